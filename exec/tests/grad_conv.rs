//! Gradients of Conv2D (grouped too), MaxPool and AvgPool against central finite
//! differences (over shapes, strides, SAME/VALID/EXPLICIT padding, NHWC/NCHW), and the
//! kernels of the gradient
//! ops Conv2DBackpropInput, Conv2DBackpropFilter, MaxPoolGrad and AvgPoolGrad against
//! float64 references written here as direct loops, in f32, f16, bf16 and f64.
//!
//! Kernel tolerance for an output summing K terms (as in the forward tests):
//!   |got - ref| <= rtol(dtype) * |ref| + 2 * K * u * sum |terms| + tiny
//! with u the compute type's unit roundoff (2^-53 for f64, 2^-24 otherwise: f16 and
//! bf16 compute in f32) and rtol the one rounding to the storage dtype.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{
    AvgPool, AvgPoolGrad, Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, MaxPool,
    MaxPoolGrad, Padding,
};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::*;
use proptest::prelude::*;

const FORMATS: [DataFormat; 2] = [DataFormat::Nhwc, DataFormat::Nchw];

/// TensorFlow's rule for spatial axis `axis` (0 height, 1 width), restated: (output
/// length, padding before).
fn tf_out(padding: Padding, axis: usize, len: usize, k: usize, s: usize) -> (usize, usize) {
    match padding {
        Padding::Valid => ((len - k) / s + 1, 0),
        Padding::Same => {
            let out = len.div_ceil(s);
            let total = ((out - 1) * s + k).saturating_sub(len);
            (out, total / 2)
        }
        Padding::Explicit(pads) => {
            let [before, after] = pads[axis];
            ((len + before + after - k) / s + 1, before)
        }
    }
}

/// The smallest length at least `len` that a `k` window fits on axis `axis`.
fn fit(padding: Padding, axis: usize, len: usize, k: usize) -> usize {
    match padding {
        Padding::Valid => len.max(k),
        Padding::Same => len,
        Padding::Explicit(pads) => len.max(k.saturating_sub(pads[axis][0] + pads[axis][1])),
    }
}

/// The input rows and columns a `k` window with its taps `dilations` apart spans.
fn spans(k: [usize; 2], dilations: [usize; 2]) -> [usize; 2] {
    [0, 1].map(|a| (k[a] - 1) * dilations[a] + 1)
}

/// Whether a `[kh, kw]` window fits an `h` x `w` image.
fn fits(padding: Padding, h: usize, w: usize, [kh, kw]: [usize; 2]) -> bool {
    fit(padding, 0, h, kh) == h && fit(padding, 1, w, kw) == w
}

/// A logical NHWC batch: dims and values indexed [n][h][w][c].
#[derive(Clone, Debug)]
struct Img {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    v: Vec<f64>,
}

impl Img {
    fn zeros(n: usize, h: usize, w: usize, c: usize) -> Img {
        Img {
            n,
            h,
            w,
            c,
            v: vec![0.0; n * h * w * c],
        }
    }
    fn idx(&self, n: usize, y: usize, x: usize, c: usize) -> usize {
        ((n * self.h + y) * self.w + x) * self.c + c
    }
    fn shape(&self, f: DataFormat) -> Vec<usize> {
        match f {
            DataFormat::Nhwc => vec![self.n, self.h, self.w, self.c],
            DataFormat::Nchw => vec![self.n, self.c, self.h, self.w],
        }
    }
    /// The values in layout `f`.
    fn layout(&self, f: DataFormat) -> Vec<f64> {
        match f {
            DataFormat::Nhwc => self.v.clone(),
            DataFormat::Nchw => {
                let mut out = Vec::with_capacity(self.v.len());
                for n in 0..self.n {
                    for c in 0..self.c {
                        for y in 0..self.h {
                            for x in 0..self.w {
                                out.push(self.v[self.idx(n, y, x, c)]);
                            }
                        }
                    }
                }
                out
            }
        }
    }
    /// A tensor of layout `f` read back into NHWC order.
    fn from_tensor(f: DataFormat, t: &Tensor) -> Img {
        let s = t.shape();
        let (n, h, w, c) = match f {
            DataFormat::Nhwc => (s[0], s[1], s[2], s[3]),
            DataFormat::Nchw => (s[0], s[2], s[3], s[1]),
        };
        let data = t.to_f64_vec();
        let mut img = Img::zeros(n, h, w, c);
        for ni in 0..n {
            for ci in 0..c {
                for yi in 0..h {
                    for xi in 0..w {
                        let src = match f {
                            DataFormat::Nhwc => ((ni * h + yi) * w + xi) * c + ci,
                            DataFormat::Nchw => ((ni * c + ci) * h + yi) * w + xi,
                        };
                        let dst = img.idx(ni, yi, xi, ci);
                        img.v[dst] = data[src];
                    }
                }
            }
        }
        img
    }
    /// This batch stored as `dtype` in layout `f`, and the batch as stored.
    fn tensor(&self, dtype: DType, f: DataFormat) -> (Tensor, Img) {
        let t = Tensor::from_f64(dtype, self.shape(f), &self.layout(f)).unwrap();
        let back = Img::from_tensor(f, &t);
        (t, back)
    }
}

fn unit_roundoff(d: DType) -> f64 {
    if d == DType::F64 {
        2f64.powi(-53)
    } else {
        2f64.powi(-24)
    }
}

fn tiny(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-24),
        _ => 1e-300,
    }
}

fn check_sums(what: &str, dtype: DType, k: usize, got: &[f64], want: &[f64], abs: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &r), &s)) in got.iter().zip(want).zip(abs).enumerate() {
        let tol = rtol(dtype) * r.abs() + 2.0 * k as f64 * unit_roundoff(dtype) * s + tiny(dtype);
        assert!(
            (g - r).abs() <= tol,
            "{what} {dtype}: element {i}: got {g}, want {r} (tolerance {tol:e})"
        );
    }
}

/// Calls `visit(n, oy, ox, ky, kx, iy, ix)` for every in-bounds window element.
#[allow(clippy::too_many_arguments)]
fn windows(
    x: (usize, usize, usize),
    k: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    visit: impl FnMut(usize, usize, usize, usize, usize, usize, usize),
) -> (usize, usize) {
    dilated_windows(x, k, strides, [1, 1], padding, visit)
}

/// As [`windows`], the window's taps `dilations` apart.
#[allow(clippy::too_many_arguments)]
fn dilated_windows(
    x: (usize, usize, usize),
    k: [usize; 2],
    strides: [usize; 2],
    dilations: [usize; 2],
    padding: Padding,
    mut visit: impl FnMut(usize, usize, usize, usize, usize, usize, usize),
) -> (usize, usize) {
    let (n, h, w) = x;
    let span = spans(k, dilations);
    let (oh, pt) = tf_out(padding, 0, h, span[0], strides[0]);
    let (ow, pl) = tf_out(padding, 1, w, span[1], strides[1]);
    for ni in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ky in 0..k[0] {
                    for kx in 0..k[1] {
                        let iy = (oy * strides[0] + ky * dilations[0]) as isize - pt as isize;
                        let ix = (ox * strides[1] + kx * dilations[1]) as isize - pl as isize;
                        if iy >= 0 && ix >= 0 && iy < h as isize && ix < w as isize {
                            visit(ni, oy, ox, ky, kx, iy as usize, ix as usize);
                        }
                    }
                }
            }
        }
    }
    (oh, ow)
}

fn rand_img(rng: &mut Gen, n: usize, h: usize, w: usize, c: usize) -> Img {
    Img {
        n,
        h,
        w,
        c,
        v: rng.vec(n * h * w * c, -1.0, 1.0),
    }
}

fn padding_strategy() -> impl Strategy<Value = Padding> {
    prop_oneof![Just(Padding::Same), Just(Padding::Valid)]
}

/// SAME, VALID or explicit pads of 0 to 3 (wider than some windows).
fn conv_padding_strategy() -> impl Strategy<Value = Padding> {
    let pair = || [0usize..=3, 0usize..=3];
    prop_oneof![
        padding_strategy(),
        [pair(), pair()].prop_map(Padding::Explicit),
    ]
}

/// SAME, VALID or explicit pads of 0 to 2, cut below the window by [`below_window`].
fn pool_padding_strategy() -> impl Strategy<Value = Padding> {
    let pair = || [0usize..=2, 0usize..=2];
    prop_oneof![
        padding_strategy(),
        [pair(), pair()].prop_map(Padding::Explicit),
    ]
}

/// `padding` with explicit pads below the `k` window, as the pools take them.
fn below_window(padding: Padding, k: [usize; 2]) -> Padding {
    match padding {
        Padding::Explicit(p) => Padding::Explicit([0, 1].map(|a| p[a].map(|v| v.min(k[a] - 1)))),
        other => other,
    }
}

fn format_strategy() -> impl Strategy<Value = DataFormat> {
    prop_oneof![Just(DataFormat::Nhwc), Just(DataFormat::Nchw)]
}

/// Values 0..n in random order, spread over [-1, 1): no ties, every gap 2/n, far
/// wider than the finite-difference step.
fn distinct(rng: &mut Gen, n: usize) -> Vec<f64> {
    rng.perm(n)
        .into_iter()
        .map(|p| 2.0 * p as f64 / n as f64 - 1.0)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn conv2d_gradient_matches_finite_differences(
        n in 1usize..=2, h in 1usize..=5, w in 1usize..=5, cin in 1usize..=2,
        cout in 1usize..=2, kh in 1usize..=3, kw in 1usize..=3,
        sh in 1usize..=2, sw in 1usize..=2,
        padding in conv_padding_strategy(), format in format_strategy(), seed: u64,
    ) {
        let (h, w) = (fit(padding, 0, h, kh), fit(padding, 1, w, kw));
        let mut rng = Gen(seed);
        let x = rand_img(&mut rng, n, h, w, cin);
        let x = t64(&x.shape(format), &x.layout(format));
        let filter = t64(&[kh, kw, cin, cout], &rng.vec(kh * kw * cin * cout, -1.0, 1.0));
        assert_grad(Box::new(Conv2D::new([sh, sw], padding, format)), &[x, filter], seed);
    }

    /// Grouped and dilated (groups 1 to 3, taps 1 to 3 apart).
    #[test]
    fn grouped_dilated_conv2d_gradient_matches_finite_differences(
        n in 1usize..=2, h in 1usize..=5, w in 1usize..=5, groups in 1usize..=3,
        cg in 1usize..=2, kg in 1usize..=2, [kh, kw] in [1usize..=3, 1usize..=3],
        strides in [1usize..=2, 1usize..=2], dilations in [1usize..=3, 1usize..=3],
        padding in conv_padding_strategy(), format in format_strategy(), seed: u64,
    ) {
        let span = spans([kh, kw], dilations);
        let (h, w) = (fit(padding, 0, h, span[0]), fit(padding, 1, w, span[1]));
        let (cin, cout) = (groups * cg, groups * kg);
        let mut rng = Gen(seed);
        let x = rand_img(&mut rng, n, h, w, cin);
        let x = t64(&x.shape(format), &x.layout(format));
        let filter = t64(&[kh, kw, cg, cout], &rng.vec(kh * kw * cg * cout, -1.0, 1.0));
        let conv = Conv2D::new(strides, padding, format)
            .with_groups(groups)
            .with_dilations(dilations);
        assert_grad(Box::new(conv), &[x, filter], seed);
    }

    #[test]
    fn max_pool_gradient_matches_finite_differences(
        n in 1usize..=2, h in 1usize..=5, w in 1usize..=5, c in 1usize..=2,
        kh in 1usize..=3, kw in 1usize..=3, sh in 1usize..=3, sw in 1usize..=3,
        padding in pool_padding_strategy(), format in format_strategy(), seed: u64,
    ) {
        let padding = below_window(padding, [kh, kw]);
        let (h, w) = (fit(padding, 0, h, kh), fit(padding, 1, w, kw));
        let mut rng = Gen(seed);
        let shape = Img::zeros(n, h, w, c).shape(format);
        let x = t64(&shape, &distinct(&mut rng, numel(&shape)));
        let op = MaxPool::new([kh, kw], [sh, sw], padding, format);
        assert_grad(Box::new(op), &[x], seed);
    }

    #[test]
    fn avg_pool_gradient_matches_finite_differences(
        n in 1usize..=2, h in 1usize..=5, w in 1usize..=5, c in 1usize..=2,
        kh in 1usize..=3, kw in 1usize..=3, sh in 1usize..=3, sw in 1usize..=3,
        padding in pool_padding_strategy(), format in format_strategy(), seed: u64,
    ) {
        let padding = below_window(padding, [kh, kw]);
        let (h, w) = (fit(padding, 0, h, kh), fit(padding, 1, w, kw));
        let mut rng = Gen(seed);
        let x = rand_img(&mut rng, n, h, w, c);
        let x = t64(&x.shape(format), &x.layout(format));
        let op = AvgPool::new([kh, kw], [sh, sw], padding, format);
        assert_grad(Box::new(op), &[x], seed);
    }
}

/// Shapes for the kernel tests: (n, h, w, cin, cout, kh, kw, strides).
type Case = (usize, usize, usize, usize, usize, usize, usize, [usize; 2]);

const CASES: [Case; 8] = [
    (1, 5, 5, 1, 1, 3, 3, [1, 1]),
    (2, 6, 5, 3, 2, 3, 2, [2, 1]),
    (1, 7, 7, 2, 4, 3, 3, [2, 2]),
    (2, 4, 4, 2, 3, 1, 1, [1, 1]),
    (1, 3, 3, 2, 2, 5, 5, [1, 1]),
    (1, 9, 8, 4, 3, 2, 3, [3, 2]),
    // One output position per image: NCHW dy rows do not run on across images.
    (3, 2, 2, 2, 2, 2, 2, [2, 2]),
    (3, 1, 1, 1, 2, 1, 1, [1, 1]),
];

#[test]
fn conv_backprop_kernels_match_reference() {
    let mut rng = Gen(17);
    for case in &CASES {
        check_backprop_kernels(&mut rng, case, 1, [1, 1]);
    }
}

#[test]
fn dilated_conv_kernels_match_reference() {
    let mut rng = Gen(41);
    // (case, groups, dilations): DeepLab's atrous 3x3 at rate 2, uneven rates, a
    // grouped one, strided ones, one whose taps outrun a small image's padding.
    let cases: [(Case, usize, [usize; 2]); 5] = [
        ((1, 9, 9, 2, 3, 3, 3, [1, 1]), 1, [2, 2]),
        ((2, 8, 7, 2, 2, 3, 2, [1, 2]), 1, [3, 2]),
        ((1, 9, 8, 4, 6, 3, 3, [2, 1]), 2, [2, 3]),
        ((2, 11, 10, 3, 2, 2, 3, [2, 3]), 1, [4, 2]),
        ((1, 3, 4, 1, 2, 3, 2, [1, 1]), 1, [3, 5]),
    ];
    for (case, groups, dilations) in &cases {
        check_backprop_kernels(&mut rng, case, *groups, *dilations);
    }
}

#[test]
fn grouped_conv_backprop_kernels_match_reference() {
    let mut rng = Gen(31);
    // (case with cin and cout multiples of groups, groups): depthwise with multipliers
    // 1 and 2, a 1x1, one output position per image, groups of several channels.
    let cases: [(Case, usize); 6] = [
        ((1, 5, 5, 2, 2, 3, 3, [1, 1]), 2),
        ((2, 6, 5, 3, 6, 3, 2, [2, 1]), 3),
        ((1, 7, 7, 4, 6, 3, 3, [2, 2]), 2),
        ((2, 4, 4, 6, 9, 1, 1, [1, 1]), 3),
        ((3, 2, 2, 4, 4, 2, 2, [2, 2]), 4),
        ((1, 9, 8, 8, 4, 2, 3, [3, 2]), 4),
    ];
    for (case, groups) in &cases {
        check_backprop_kernels(&mut rng, case, *groups, [1, 1]);
    }
}

/// Conv2D, Conv2DBackpropInput and Conv2DBackpropFilter of `case` with `groups` groups
/// and `dilations` against direct loops, in every padding the case's window fits, dtype
/// and layout.
fn check_backprop_kernels(rng: &mut Gen, case: &Case, groups: usize, dilations: [usize; 2]) {
    let &(n, h, w, cin, cout, kh, kw, strides) = case;
    let span = spans([kh, kw], dilations);
    // Channels per group, in and out; output channel co reads input group co / kg.
    let (cg, kg) = (cin / groups, cout / groups);
    // Explicit: symmetric, more after than before (height) and before than after
    // (width), pads wider than the window.
    let paddings = [
        Padding::Same,
        Padding::Valid,
        Padding::Explicit([[1, 1], [1, 1]]),
        Padding::Explicit([[0, 2], [3, 1]]),
        Padding::Explicit([[kh + 1, 0], [1, kw + 2]]),
    ];
    for padding in paddings {
        if !fits(padding, h, w, span) {
            continue;
        }
        let (oh, _) = tf_out(padding, 0, h, span[0], strides[0]);
        let (ow, _) = tf_out(padding, 1, w, span[1], strides[1]);
        let x0 = rand_img(rng, n, h, w, cin);
        let dy0 = rand_img(rng, n, oh, ow, cout);
        let f0 = rng.vec(kh * kw * cg * cout, -1.0, 1.0);
        for dtype in FLOATS {
            for f in FORMATS {
                let (xt, x) = x0.tensor(dtype, f);
                let (dyt, dy) = dy0.tensor(dtype, f);
                let (ft, fv) = stored(dtype, &[kh, kw, cg, cout], &f0);
                let fidx = |ky: usize, kx: usize, ci: usize, co: usize| {
                    ((ky * kw + kx) * cg + ci) * cout + co
                };
                // Reference y, dx and dfilter.
                let mut y = Img::zeros(n, oh, ow, cout);
                let mut y_abs = y.clone();
                let mut dx = Img::zeros(n, h, w, cin);
                let mut dx_abs = dx.clone();
                let mut df = vec![0.0; f0.len()];
                let mut df_abs = df.clone();
                dilated_windows(
                    (n, h, w),
                    [kh, kw],
                    strides,
                    dilations,
                    padding,
                    |ni, oy, ox, ky, kx, iy, ix| {
                        for co in 0..cout {
                            let g = dy.v[dy.idx(ni, oy, ox, co)];
                            for ci in 0..cg {
                                let xi = x.idx(ni, iy, ix, co / kg * cg + ci);
                                let t = x.v[xi] * fv[fidx(ky, kx, ci, co)];
                                let yi = y.idx(ni, oy, ox, co);
                                y.v[yi] += t;
                                y_abs.v[yi] += t.abs();
                                let t = g * fv[fidx(ky, kx, ci, co)];
                                dx.v[xi] += t;
                                dx_abs.v[xi] += t.abs();
                                let t = g * x.v[xi];
                                df[fidx(ky, kx, ci, co)] += t;
                                df_abs[fidx(ky, kx, ci, co)] += t.abs();
                            }
                        }
                    },
                );
                let what = format!(
                    "x [{n},{h},{w},{cin}] filter [{kh},{kw},{cg},{cout}] groups {groups} \
                     dilations {dilations:?} {strides:?} {padding:?} {f:?}"
                );
                let conv = Conv2D::new(strides, padding, f)
                    .with_groups(groups)
                    .with_dilations(dilations);
                assert_round_trip(&conv);
                let got = Img::from_tensor(f, &run(&conv, &[&xt, &ft]));
                let k = kh * kw * cg;
                check_sums(&format!("y {what}"), dtype, k, &got.v, &y.v, &y_abs.v);
                let op = Conv2DBackpropInput {
                    input_shape: x.shape(f),
                    conv: conv.clone(),
                };
                assert_round_trip(&op);
                let got = run(&op, &[&ft, &dyt]);
                let got = Img::from_tensor(f, &got);
                let k = kh * kw * kg;
                check_sums(&format!("dx {what}"), dtype, k, &got.v, &dx.v, &dx_abs.v);
                let op = Conv2DBackpropFilter {
                    filter_shape: vec![kh, kw, cg, cout],
                    conv,
                };
                assert_round_trip(&op);
                let got = run(&op, &[&xt, &dyt]).to_f64_vec();
                let k = n * oh * ow;
                check_sums(&format!("dfilter {what}"), dtype, k, &got, &df, &df_abs);
            }
        }
    }
}

type PoolCase = (usize, usize, usize, usize, [usize; 2], [usize; 2]);

#[test]
fn pool_grad_kernels_match_reference() {
    let mut rng = Gen(23);
    // (n, h, w, c, ksize, strides)
    let cases: [PoolCase; 5] = [
        (1, 4, 4, 1, [2, 2], [2, 2]),
        (2, 5, 6, 3, [3, 3], [1, 1]),
        (1, 7, 5, 2, [3, 2], [2, 3]),
        (2, 3, 3, 2, [4, 4], [1, 1]),
        (1, 6, 6, 2, [1, 1], [2, 2]),
    ];
    for (n, h, w, c, k, strides) in cases {
        // Explicit pads below the window: uneven, and the widest.
        let widest = [[k[0] - 1; 2], [k[1] - 1; 2]];
        let uneven = below_window(Padding::Explicit([[0, 2], [1, 0]]), k);
        for padding in [
            Padding::Same,
            Padding::Valid,
            uneven,
            Padding::Explicit(widest),
        ] {
            if !fits(padding, h, w, k) {
                continue;
            }
            let (oh, _) = tf_out(padding, 0, h, k[0], strides[0]);
            let (ow, _) = tf_out(padding, 1, w, k[1], strides[1]);
            // Values on a coarse grid: ties in many windows, so first-max routing shows.
            let mut x0 = rand_img(&mut rng, n, h, w, c);
            x0.v.iter_mut().for_each(|v| *v = (*v * 3.0).round() / 4.0);
            let dy0 = rand_img(&mut rng, n, oh, ow, c);
            for dtype in FLOATS {
                for f in FORMATS {
                    let (xt, x) = x0.tensor(dtype, f);
                    let (dyt, dy) = dy0.tensor(dtype, f);
                    let what = format!("x [{n},{h},{w},{c}] k {k:?} {strides:?} {padding:?} {f:?}");
                    // MaxPool: each window's dy goes to its first maximum in row-major order.
                    let mut best: Vec<Option<(f64, usize)>> = vec![None; n * oh * ow * c];
                    windows(
                        (n, h, w),
                        k,
                        strides,
                        padding,
                        |ni, oy, ox, _, _, iy, ix| {
                            for ci in 0..c {
                                let o = ((ni * oh + oy) * ow + ox) * c + ci;
                                let i = x.idx(ni, iy, ix, ci);
                                if best[o].is_none_or(|(b, _)| x.v[i] > b) {
                                    best[o] = Some((x.v[i], i));
                                }
                            }
                        },
                    );
                    let mut dx = Img::zeros(n, h, w, c);
                    let mut dx_abs = dx.clone();
                    for (o, b) in best.iter().enumerate() {
                        let (_, i) = b.expect("every window has an element");
                        dx.v[i] += dy.v[o];
                        dx_abs.v[i] += dy.v[o].abs();
                    }
                    let forward = MaxPool::new(k, strides, padding, f);
                    let yt = run(&forward, &[&xt]);
                    let op = MaxPoolGrad::new(k, strides, padding, f);
                    assert_round_trip(&op);
                    let got = Img::from_tensor(f, &run(&op, &[&xt, &yt, &dyt]));
                    let terms = k[0].div_ceil(strides[0]) * k[1].div_ceil(strides[1]);
                    check_sums(
                        &format!("MaxPoolGrad {what}"),
                        dtype,
                        terms,
                        &got.v,
                        &dx.v,
                        &dx_abs.v,
                    );

                    // AvgPool: dy / (in-bounds count) to every in-bounds element.
                    let mut count = vec![0.0; n * oh * ow];
                    windows((n, h, w), k, strides, padding, |ni, oy, ox, _, _, _, _| {
                        count[(ni * oh + oy) * ow + ox] += 1.0;
                    });
                    let mut dx = Img::zeros(n, h, w, c);
                    let mut dx_abs = dx.clone();
                    windows(
                        (n, h, w),
                        k,
                        strides,
                        padding,
                        |ni, oy, ox, _, _, iy, ix| {
                            for ci in 0..c {
                                let o = ((ni * oh + oy) * ow + ox) * c + ci;
                                let t = dy.v[o] / count[(ni * oh + oy) * ow + ox];
                                let i = dx.idx(ni, iy, ix, ci);
                                dx.v[i] += t;
                                dx_abs.v[i] += t.abs();
                            }
                        },
                    );
                    let op = AvgPoolGrad {
                        input_shape: x.shape(f),
                        ksize: k,
                        strides,
                        padding,
                        data_format: f,
                    };
                    assert_round_trip(&op);
                    let got = Img::from_tensor(f, &run(&op, &[&dyt]));
                    check_sums(
                        &format!("AvgPoolGrad {what}"),
                        dtype,
                        terms + 1,
                        &got.v,
                        &dx.v,
                        &dx_abs.v,
                    );
                }
            }
        }
    }
}

/// Explicit pads equal to what SAME or VALID pad give the convolution's and the pools'
/// gradients bit for bit.
#[test]
fn explicit_padding_gradients_equal_same_and_valid() {
    let mut rng = Gen(29);
    // (h, w, k, stride, SAME's (before, after) for height and width)
    let cases = [
        (8, 6, 3, 2, [[0, 1], [0, 1]]), // stride 2 over an even input: 0 before, 1 after
        (7, 6, 3, 2, [[1, 1], [0, 1]]),
        (6, 8, 4, 1, [[1, 2], [1, 2]]),
    ];
    for (h, w, k, stride, pads) in cases {
        for f in FORMATS {
            let x = rand_img(&mut rng, 2, h, w, 3);
            let (xt, _) = x.tensor(DType::F32, f);
            let (ft, _) = stored(DType::F32, &[k, k, 3, 4], &rng.vec(k * k * 12, -1.0, 1.0));
            let grads = |padding| {
                let conv = Conv2D::new([stride, stride], padding, f);
                graph_gradients(Box::new(conv), &[xt.clone(), ft.clone()])
            };
            let what = format!("{h}x{w} k{k} s{stride} {f:?}");
            let explicit = grads(Padding::Explicit(pads));
            assert_eq!(explicit, grads(Padding::Same), "{what}");
            let zero = grads(Padding::Explicit([[0, 0], [0, 0]]));
            assert_eq!(zero, grads(Padding::Valid), "{what}");
            // The pools' gradients (MaxPoolGrad, AvgPoolGrad) likewise.
            let (ks, ss) = ([k, k], [stride, stride]);
            let pool_grads = |padding| {
                let max = MaxPool::new(ks, ss, padding, f);
                let avg = AvgPool::new(ks, ss, padding, f);
                let x = std::slice::from_ref(&xt);
                [
                    graph_gradients(Box::new(max), x),
                    graph_gradients(Box::new(avg), x),
                ]
            };
            assert_eq!(
                pool_grads(Padding::Explicit(pads)),
                pool_grads(Padding::Same),
                "{what}"
            );
            let zero = Padding::Explicit([[0, 0], [0, 0]]);
            assert_eq!(pool_grads(zero), pool_grads(Padding::Valid), "{what}");
        }
    }
}

#[test]
fn max_pool_grad_routes_ties_to_the_first_maximum() {
    // One 2x2 window of equal values: all of dy goes to the top-left element.
    for f in FORMATS {
        let x = Tensor::from_f64(DType::F32, [1, 2, 2, 1], &[5.0; 4]).unwrap();
        let y = Tensor::from_f64(DType::F32, [1, 1, 1, 1], &[5.0]).unwrap();
        let dy = Tensor::from_f64(DType::F32, [1, 1, 1, 1], &[3.0]).unwrap();
        let shape = match f {
            DataFormat::Nhwc => [1, 2, 2, 1],
            DataFormat::Nchw => [1, 1, 2, 2],
        };
        let x = x.reshaped(shape.to_vec()).unwrap();
        let op = MaxPoolGrad::new([2, 2], [2, 2], Padding::Valid, f);
        assert_eq!(run(&op, &[&x, &y, &dy]).to_f64_vec(), [3.0, 0.0, 0.0, 0.0]);
    }
}

#[test]
fn gradients_keep_the_forward_dtype() {
    for dtype in FLOATS {
        let mut rng = Gen(5);
        let (x, _) = stored(dtype, &[1, 4, 4, 2], &rng.vec(32, -1.0, 1.0));
        let (filt, _) = stored(dtype, &[3, 3, 2, 3], &rng.vec(54, -1.0, 1.0));
        let conv = Conv2D::new([2, 2], Padding::Same, DataFormat::Nhwc);
        let grads = graph_gradients(Box::new(conv), &[x.clone(), filt]);
        assert_eq!(grads[0].ty(), tt(dtype, &[1, 4, 4, 2]));
        assert_eq!(grads[1].ty(), tt(dtype, &[3, 3, 2, 3]));
        for op in [
            Box::new(MaxPool::new(
                [2, 2],
                [2, 2],
                Padding::Valid,
                DataFormat::Nhwc,
            )) as Box<dyn Op>,
            Box::new(AvgPool::new(
                [3, 3],
                [1, 1],
                Padding::Same,
                DataFormat::Nhwc,
            )),
        ] {
            let grads = graph_gradients(op, std::slice::from_ref(&x));
            assert_eq!(grads[0].ty(), tt(dtype, &[1, 4, 4, 2]));
        }
    }
}

#[test]
fn backprop_ops_reject_bad_types() {
    let f32t = |s: &[usize]| tt(DType::F32, s);
    let nhwc = DataFormat::Nhwc;
    let bi = Conv2DBackpropInput {
        input_shape: vec![1, 5, 5, 2],
        conv: Conv2D::new([1, 1], Padding::Valid, nhwc),
    };
    // Good: filter [3,3,2,4], dy [1,3,3,4].
    let ok = bi
        .infer(&[&f32t(&[3, 3, 2, 4]), &f32t(&[1, 3, 3, 4])])
        .unwrap();
    assert_eq!(ok, vec![f32t(&[1, 5, 5, 2])]);
    let e = infer_err(&bi, &[f32t(&[3, 3, 2, 4]), f32t(&[1, 3, 3, 3])]);
    assert!(
        e.contains("dy has shape [1, 3, 3, 3]") && e.contains("[1, 3, 3, 4]"),
        "{e}"
    );
    let e = infer_err(&bi, &[f32t(&[3, 3, 3, 4]), f32t(&[1, 3, 3, 4])]);
    assert!(e.contains("channels"), "{e}");
    let e = infer_err(&bi, &[f32t(&[3, 3, 2, 4]), tt(DType::F16, &[1, 3, 3, 4])]);
    assert!(e.contains("f16"), "{e}");
    let e = infer_err(
        &bi,
        &[tt(DType::I32, &[3, 3, 2, 4]), tt(DType::I32, &[1, 3, 3, 4])],
    );
    assert!(e.contains("float"), "{e}");
    let e = infer_err(&bi, &[f32t(&[3, 3, 2]), f32t(&[1, 3, 3, 4])]);
    assert!(e.contains("filter must have rank 4"), "{e}");
    let rank3 = Conv2DBackpropInput {
        input_shape: vec![5, 5, 2],
        ..bi.clone()
    };
    let e = infer_err(&rank3, &[f32t(&[3, 3, 2, 4]), f32t(&[1, 3, 3, 4])]);
    assert!(e.contains("input_shape must have rank 4"), "{e}");
    let small = Conv2DBackpropInput {
        input_shape: vec![1, 2, 5, 2],
        ..bi.clone()
    };
    let e = infer_err(&small, &[f32t(&[3, 3, 2, 4]), f32t(&[1, 3, 3, 4])]);
    assert!(e.contains("height") && e.contains("VALID"), "{e}");
    // Absurd sizes are errors, not overflows.
    for input_shape in [
        vec![1 << 40, 1 << 40, 1, 2],
        vec![1, 1 << 50, 1, 2],
        vec![usize::MAX, 2, 2, 2],
    ] {
        let big = Conv2DBackpropInput {
            input_shape,
            conv: Conv2D::new([1, 1], Padding::Same, nhwc),
        };
        infer_err(&big, &[f32t(&[3, 3, 2, 4]), f32t(&[1, 3, 3, 4])]);
    }

    let bf = Conv2DBackpropFilter {
        filter_shape: vec![3, 3, 2, 4],
        conv: Conv2D::new([2, 2], Padding::Same, DataFormat::Nchw),
    };
    let ok = bf
        .infer(&[&f32t(&[1, 2, 5, 5]), &f32t(&[1, 4, 3, 3])])
        .unwrap();
    assert_eq!(ok, vec![f32t(&[3, 3, 2, 4])]);
    let e = infer_err(&bf, &[f32t(&[1, 2, 5, 5]), f32t(&[1, 3, 3, 4])]);
    assert!(e.contains("dy has shape"), "{e}");
    let e = infer_err(&bf, &[f32t(&[1, 5, 5, 2]), f32t(&[1, 4, 3, 3])]);
    assert!(e.contains("channels"), "{e}");
    let bad = Conv2DBackpropFilter {
        filter_shape: vec![0, 3, 2, 4],
        ..bf.clone()
    };
    let e = infer_err(&bad, &[f32t(&[1, 2, 5, 5]), f32t(&[1, 4, 3, 3])]);
    assert!(e.contains("empty window"), "{e}");

    // A kernel handed tensors infer would refuse errs instead of panicking.
    let ft = Tensor::from_f64(DType::F32, [3, 3, 2, 4], &[0.0; 72]).unwrap();
    let dy = Tensor::from_f64(DType::F32, [1, 2, 2, 4], &[0.0; 16]).unwrap();
    assert!(bi.eval(&[&ft, &dy]).is_err());
    let x = Tensor::from_f64(DType::F32, [1, 2, 5, 5], &[0.0; 50]).unwrap();
    assert!(bf.eval(&[&x, &dy]).is_err());
    assert!(bf.eval(&[&x]).is_err());
}

#[test]
fn pool_grad_ops_reject_bad_types() {
    let f32t = |s: &[usize]| tt(DType::F32, s);
    let mp = MaxPoolGrad::new([2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc);
    let ok = mp
        .infer(&[
            &f32t(&[1, 4, 4, 3]),
            &f32t(&[1, 2, 2, 3]),
            &f32t(&[1, 2, 2, 3]),
        ])
        .unwrap();
    assert_eq!(ok, vec![f32t(&[1, 4, 4, 3])]);
    let g = |x: &[usize], y: &[usize], dy: TensorType| vec![f32t(x), f32t(y), dy];
    assert_infer_errs(
        &mp,
        &[
            (
                g(&[1, 4, 4, 3], &[1, 2, 2, 3], f32t(&[1, 2, 3, 3])),
                "dy has shape [1, 2, 3, 3]",
            ),
            (
                g(&[1, 4, 4, 3], &[1, 4, 4, 3], f32t(&[1, 2, 2, 3])),
                "y has shape",
            ),
            (
                g(&[1, 4, 4, 3], &[1, 2, 2, 3], tt(DType::BF16, &[1, 2, 2, 3])),
                "dy is bf16",
            ),
            (g(&[4, 4, 3], &[1, 2, 2, 3], f32t(&[1, 2, 2, 3])), "rank 4"),
        ],
    );
    let x = Tensor::from_f64(DType::F32, [1, 4, 4, 1], &[0.0; 16]).unwrap();
    let dy = Tensor::from_f64(DType::F32, [1, 1, 1, 1], &[0.0]).unwrap();
    assert!(mp.eval(&[&x, &dy, &dy]).is_err());

    let ap = AvgPoolGrad {
        input_shape: vec![1, 3, 5, 5],
        ksize: [3, 3],
        strides: [2, 2],
        padding: Padding::Same,
        data_format: DataFormat::Nchw,
    };
    assert_eq!(
        ap.infer(&[&f32t(&[1, 3, 3, 3])]).unwrap(),
        vec![f32t(&[1, 3, 5, 5])]
    );
    let e = infer_err(&ap, &[f32t(&[1, 3, 2, 3])]);
    assert!(
        e.contains("dy has shape [1, 3, 2, 3]") && e.contains("[1, 3, 3, 3]"),
        "{e}"
    );
    let e = infer_err(&ap, &[tt(DType::I64, &[1, 3, 3, 3])]);
    assert!(e.contains("float"), "{e}");
    let bad = AvgPoolGrad {
        input_shape: vec![3, 5, 5],
        ..ap.clone()
    };
    let e = infer_err(&bad, &[f32t(&[1, 3, 3, 3])]);
    assert!(e.contains("input_shape must have rank 4"), "{e}");
    let bad = AvgPoolGrad {
        input_shape: vec![1 << 40, 1 << 40, 1 << 40, 1],
        ..ap.clone()
    };
    infer_err(&bad, &[f32t(&[1, 3, 3, 3])]);
    let bad = AvgPoolGrad {
        input_shape: vec![1, 3, 2, 2],
        padding: Padding::Valid,
        ..ap.clone()
    };
    let e = infer_err(&bad, &[f32t(&[1, 3, 1, 1])]);
    assert!(e.contains("VALID"), "{e}");
    let dy = Tensor::from_f64(DType::F32, [1, 3, 2, 2], &[0.0; 12]).unwrap();
    assert!(ap.eval(&[&dy]).is_err());
}

#[test]
fn grad_op_attrs_parse_and_reject_mistakes() {
    let strides = ("strides", AttrValue::Ints(vec![2, 1]));
    let padding = ("padding", AttrValue::from("SAME"));
    let nchw = ("data_format", AttrValue::from("NCHW"));
    let shape = |k: &'static str| (k, AttrValue::Ints(vec![1, 2, 3, 4]));
    let op = parse(
        "Conv2DBackpropInput",
        &[
            shape("input_shape"),
            strides.clone(),
            padding.clone(),
            nchw.clone(),
        ],
    )
    .unwrap();
    assert_eq!(op.name(), "Conv2DBackpropInput");
    assert_round_trip(op.as_ref());
    let op = parse(
        "Conv2DBackpropFilter",
        &[shape("filter_shape"), padding.clone()],
    )
    .unwrap();
    assert_round_trip(op.as_ref());
    let explicit = [
        ("padding", AttrValue::from("EXPLICIT")),
        (
            "explicit_paddings",
            AttrValue::Ints(vec![0, 0, 0, 0, 1, 2, 0, 3]),
        ),
    ];
    for (name, key) in [
        ("Conv2DBackpropInput", "input_shape"),
        ("Conv2DBackpropFilter", "filter_shape"),
    ] {
        let mut a = vec![shape(key), nchw.clone()];
        a.extend(explicit.iter().cloned());
        let op = parse(name, &a).unwrap();
        assert!(op.attrs().contains(&explicit[1]), "{name}");
        assert_round_trip(op.as_ref());
    }
    let ksize = ("ksize", AttrValue::Ints(vec![2, 2]));
    let op = parse(
        "MaxPoolGrad",
        &[ksize.clone(), strides.clone(), padding.clone()],
    )
    .unwrap();
    assert_round_trip(op.as_ref());
    let op = parse(
        "AvgPoolGrad",
        &[
            shape("input_shape"),
            ksize.clone(),
            strides.clone(),
            padding.clone(),
            nchw,
        ],
    )
    .unwrap();
    assert_round_trip(op.as_ref());

    let err = |name: &str, attrs: &[(&str, AttrValue)]| parse(name, attrs).unwrap_err();
    let e = err("Conv2DBackpropInput", &[strides.clone(), padding.clone()]);
    assert!(e.contains("missing attr 'input_shape'"), "{e}");
    let e = err(
        "Conv2DBackpropFilter",
        &[
            ("filter_shape", AttrValue::Ints(vec![3, -3, 1, 1])),
            padding.clone(),
        ],
    );
    assert!(e.contains("negative"), "{e}");
    let e = err(
        "Conv2DBackpropInput",
        &[
            shape("input_shape"),
            ("strides", AttrValue::Ints(vec![0, 1])),
            padding.clone(),
        ],
    );
    assert!(e.contains("strides"), "{e}");
    let e = err("Conv2DBackpropInput", &[shape("input_shape")]);
    assert!(e.contains("padding"), "{e}");
    let e = err("MaxPoolGrad", &[strides.clone(), padding.clone()]);
    assert!(e.contains("ksize"), "{e}");
    let e = err(
        "AvgPoolGrad",
        &[ksize.clone(), strides.clone(), padding.clone()],
    );
    assert!(e.contains("input_shape"), "{e}");
    let e = err(
        "MaxPoolGrad",
        &[
            ksize,
            strides,
            padding.clone(),
            ("data_format", AttrValue::from("NCWH")),
        ],
    );
    assert!(e.contains("data_format"), "{e}");
    // Dilations: written when not [1, 1], read back; zero is refused.
    let dilated = ("dilations", AttrValue::Ints(vec![2, 3]));
    let op = parse(
        "Conv2DBackpropFilter",
        &[shape("filter_shape"), padding.clone(), dilated.clone()],
    )
    .unwrap();
    assert!(op.attrs().contains(&dilated));
    assert_round_trip(op.as_ref());
    let dense = ("dilations", AttrValue::Ints(vec![1, 1]));
    let op = parse("Conv2D", &[padding.clone(), dense]).unwrap();
    assert!(op.attrs().iter().all(|(k, _)| *k != "dilations"));
    let e = err(
        "Conv2D",
        &[padding, ("dilations", AttrValue::Ints(vec![0, 1]))],
    );
    assert!(
        e.contains("'dilations' must be two positive integers"),
        "{e}"
    );
}
