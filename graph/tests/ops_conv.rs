//! Conv2D (grouped too), MaxPool and AvgPool against an independent float64 reference
//! (direct loops written here, TensorFlow's SAME/VALID/EXPLICIT rule restated here), in
//! f32, f16, bf16 and f64, NHWC and NCHW.
//!
//! Tolerance for an output that sums K terms (a convolution: K = kh*kw*cin; an
//! average: K = window elements), per dtype:
//!   |got - ref| <= rtol(dtype) * |ref| + 2 * K * u(dtype) * sum |terms| + tiny
//! with rtol = 1e-12 (f64), 1e-5 (f32), 2e-3 (f16), 1.6e-2 (bf16), u the compute
//! type's unit roundoff (2^-53 for f64, 2^-24 for the others, which compute in f32).
//! MaxPool selects one stored input, so it must match exactly.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{
    parse_op, AvgPool, Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, MaxPool,
    Padding,
};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::*;

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

/// A logical NHWC image batch, stored in either layout.
#[derive(Clone)]
struct Images {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    /// Values indexed [n][h][w][c].
    v: Vec<f64>,
}

impl Images {
    fn at(&self, n: usize, y: usize, x: usize, c: usize) -> f64 {
        self.v[((n * self.h + y) * self.w + x) * self.c + c]
    }

    fn shape(&self, f: DataFormat) -> Vec<usize> {
        match f {
            DataFormat::Nhwc => vec![self.n, self.h, self.w, self.c],
            DataFormat::Nchw => vec![self.n, self.c, self.h, self.w],
        }
    }

    fn layout(&self, f: DataFormat) -> Vec<f64> {
        match f {
            DataFormat::Nhwc => self.v.clone(),
            DataFormat::Nchw => {
                let mut out = Vec::with_capacity(self.v.len());
                for n in 0..self.n {
                    for c in 0..self.c {
                        for y in 0..self.h {
                            for x in 0..self.w {
                                out.push(self.at(n, y, x, c));
                            }
                        }
                    }
                }
                out
            }
        }
    }

    /// Reads a tensor of layout `f` back into NHWC order.
    fn from_layout(f: DataFormat, shape: &[usize], data: &[f64]) -> Images {
        let (n, h, w, c) = match f {
            DataFormat::Nhwc => (shape[0], shape[1], shape[2], shape[3]),
            DataFormat::Nchw => (shape[0], shape[2], shape[3], shape[1]),
        };
        let mut v = vec![0.0; n * h * w * c];
        for ni in 0..n {
            for yi in 0..h {
                for xi in 0..w {
                    for ci in 0..c {
                        let src = match f {
                            DataFormat::Nhwc => ((ni * h + yi) * w + xi) * c + ci,
                            DataFormat::Nchw => ((ni * c + ci) * h + yi) * w + xi,
                        };
                        v[((ni * h + yi) * w + xi) * c + ci] = data[src];
                    }
                }
            }
        }
        Images { n, h, w, c, v }
    }

    /// This batch as a tensor of `dtype` in layout `f`, and the batch as stored.
    fn tensor(&self, dtype: DType, f: DataFormat) -> (Tensor, Images) {
        let t = Tensor::from_f64(dtype, self.shape(f), &self.layout(f)).unwrap();
        let rounded = Images::from_layout(f, t.shape(), &t.to_f64_vec());
        (t, rounded)
    }
}

/// Direct convolution with `groups` channel groups (output channel `co` reads the
/// input channels of group `co / (cout / groups)` through filter `[kh, kw, cin /
/// groups, cout]`): (values, sum of |terms|) as NHWC images.
fn ref_conv(
    x: &Images,
    filt: &[f64],
    [kh, kw, cout]: [usize; 3],
    groups: usize,
    strides: [usize; 2],
    padding: Padding,
) -> (Images, Images) {
    let (oh, pt) = tf_out(padding, 0, x.h, kh, strides[0]);
    let (ow, pl) = tf_out(padding, 1, x.w, kw, strides[1]);
    let (cin, kg) = (x.c / groups, cout / groups);
    let mut val = vec![0.0; x.n * oh * ow * cout];
    let mut abs = val.clone();
    for n in 0..x.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..cout {
                    let o = ((n * oh + oy) * ow + ox) * cout + co;
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * strides[0] + ky) as isize - pt as isize;
                            let ix = (ox * strides[1] + kx) as isize - pl as isize;
                            if iy < 0 || ix < 0 || iy >= x.h as isize || ix >= x.w as isize {
                                continue;
                            }
                            for ci in 0..cin {
                                let t = x.at(n, iy as usize, ix as usize, co / kg * cin + ci)
                                    * filt[((ky * kw + kx) * cin + ci) * cout + co];
                                val[o] += t;
                                abs[o] += t.abs();
                            }
                        }
                    }
                }
            }
        }
    }
    let img = |v| Images {
        n: x.n,
        h: oh,
        w: ow,
        c: cout,
        v,
    };
    (img(val), img(abs))
}

/// Direct pooling over in-bounds elements: (values, sum of |terms|, element counts).
fn ref_pool(
    x: &Images,
    max: bool,
    ksize: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
) -> (Images, Images, Images) {
    let (oh, pt) = tf_out(padding, 0, x.h, ksize[0], strides[0]);
    let (ow, pl) = tf_out(padding, 1, x.w, ksize[1], strides[1]);
    let len = x.n * oh * ow * x.c;
    let (mut val, mut abs, mut cnt) = (vec![0.0; len], vec![0.0; len], vec![0.0; len]);
    for n in 0..x.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for c in 0..x.c {
                    let o = ((n * oh + oy) * ow + ox) * x.c + c;
                    let mut best = f64::NEG_INFINITY;
                    let (mut sum, mut sabs, mut count) = (0.0, 0.0, 0.0);
                    for ky in 0..ksize[0] {
                        for kx in 0..ksize[1] {
                            let iy = (oy * strides[0] + ky) as isize - pt as isize;
                            let ix = (ox * strides[1] + kx) as isize - pl as isize;
                            if iy < 0 || ix < 0 || iy >= x.h as isize || ix >= x.w as isize {
                                continue;
                            }
                            let v = x.at(n, iy as usize, ix as usize, c);
                            best = best.max(v);
                            sum += v;
                            sabs += v.abs();
                            count += 1.0;
                        }
                    }
                    val[o] = if max { best } else { sum / count };
                    abs[o] = sabs / count;
                    cnt[o] = count;
                }
            }
        }
    }
    let img = |v| Images {
        n: x.n,
        h: oh,
        w: ow,
        c: x.c,
        v,
    };
    (img(val), img(abs), img(cnt))
}

fn one_to_nine() -> Images {
    Images {
        n: 1,
        h: 3,
        w: 3,
        c: 1,
        v: (1..=9).map(f64::from).collect(),
    }
}

fn output_nhwc(y: &Tensor, f: DataFormat) -> Images {
    Images::from_layout(f, y.shape(), &y.to_f64_vec())
}

#[test]
fn conv_3x3_by_hand() {
    let x = one_to_nine();
    for dtype in FLOATS {
        for f in FORMATS {
            let (xt, _) = x.tensor(dtype, f);
            // 2x2 filter of ones, VALID: sums of 2x2 blocks.
            let ones2 = Tensor::from_f64(dtype, [2, 2, 1, 1], &[1.0; 4]).unwrap();
            let y = run(&Conv2D::new([1, 1], Padding::Valid, f), &[&xt, &ones2]);
            let want_shape = match f {
                DataFormat::Nhwc => [1, 2, 2, 1],
                DataFormat::Nchw => [1, 1, 2, 2],
            };
            assert_eq!(y.shape(), &want_shape[..]);
            assert_eq!(y.to_f64_vec(), [12.0, 16.0, 24.0, 28.0], "{dtype} {f:?}");
            // 3x3 filter of ones, SAME: sums of the in-bounds neighbourhoods.
            let ones3 = Tensor::from_f64(dtype, [3, 3, 1, 1], &[1.0; 9]).unwrap();
            let y = run(&Conv2D::new([1, 1], Padding::Same, f), &[&xt, &ones3]);
            assert_eq!(
                y.to_f64_vec(),
                [12.0, 21.0, 16.0, 27.0, 45.0, 33.0, 24.0, 39.0, 28.0],
                "{dtype} {f:?}"
            );
            // The same with stride 2: the corners.
            let y = run(&Conv2D::new([2, 2], Padding::Same, f), &[&xt, &ones3]);
            assert_eq!(y.to_f64_vec(), [12.0, 16.0, 24.0, 28.0], "{dtype} {f:?}");
            // A filter that is not symmetric: it picks the top-left neighbour
            // (cross-correlation, not flipped).
            let mut pick = [0.0; 9];
            pick[0] = 1.0;
            let pick = Tensor::from_f64(dtype, [3, 3, 1, 1], &pick).unwrap();
            let y = run(&Conv2D::new([1, 1], Padding::Same, f), &[&xt, &pick]);
            assert_eq!(
                y.to_f64_vec(),
                [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 4.0, 5.0],
                "{dtype} {f:?}"
            );
        }
    }
}

#[test]
fn conv_two_channels_by_hand() {
    // x: 1x1 image with channels [2, 3]; filter 1x1, 2 in, 2 out [[1, 10], [100, 1000]].
    let x = Tensor::from_f64(DType::F32, [1, 1, 1, 2], &[2.0, 3.0]).unwrap();
    let f = Tensor::from_f64(DType::F32, [1, 1, 2, 2], &[1.0, 10.0, 100.0, 1000.0]).unwrap();
    let y = run(
        &Conv2D::new([1, 1], Padding::Valid, DataFormat::Nhwc),
        &[&x, &f],
    );
    assert_eq!(y.to_f64_vec(), [302.0, 3020.0]);
    let y = run(
        &Conv2D::new([1, 1], Padding::Valid, DataFormat::Nchw),
        &[&x.clone().reshaped(vec![1, 2, 1, 1]).unwrap(), &f],
    );
    assert_eq!(y.shape(), &[1, 2, 1, 1]);
    assert_eq!(y.to_f64_vec(), [302.0, 3020.0]);
}

struct ConvCase {
    n: usize,
    h: usize,
    w: usize,
    cin: usize,
    cout: usize,
    kh: usize,
    kw: usize,
    strides: [usize; 2],
    groups: usize,
}

fn check_conv(case: &ConvCase, dtype: DType, f: DataFormat, padding: Padding, rng: &mut Rng) {
    let ConvCase {
        n,
        h,
        w,
        cin,
        cout,
        kh,
        kw,
        strides,
        groups,
    } = *case;
    let cg = cin / groups;
    let x = Images {
        n,
        h,
        w,
        c: cin,
        v: rng.vec(n * h * w * cin),
    };
    let (xt, x) = x.tensor(dtype, f);
    let ft = Tensor::from_f64(dtype, [kh, kw, cg, cout], &rng.vec(kh * kw * cg * cout)).unwrap();
    let fv = ft.to_f64_vec();
    let conv = Conv2D::new(strides, padding, f).with_groups(groups);
    let y = run(&conv, &[&xt, &ft]);
    let (want, abs) = ref_conv(&x, &fv, [kh, kw, cout], groups, strides, padding);
    assert_eq!(y.shape(), &want.shape(f)[..]);
    let got = output_nhwc(&y, f);
    check_sums(
        &format!("Conv2D x [{n},{h},{w},{cin}] filter [{kh},{kw},{cg},{cout}] groups {groups} {strides:?} {padding:?} {f:?}"),
        dtype,
        kh * kw * cg,
        &got.v,
        &want.v,
        &abs.v,
    );
}

#[test]
fn conv_matches_reference() {
    let mut rng = Rng(7);
    let c = |n, h, w, cin, cout, kh, kw, strides| ConvCase {
        n,
        h,
        w,
        cin,
        cout,
        kh,
        kw,
        strides,
        groups: 1,
    };
    let cases = [
        c(2, 5, 6, 3, 4, 3, 3, [1, 1]),
        c(1, 7, 5, 2, 3, 2, 2, [2, 2]), // even window: asymmetric SAME padding
        c(3, 8, 8, 4, 5, 3, 2, [2, 1]),
        c(2, 4, 4, 3, 2, 1, 1, [1, 1]), // 1x1: NHWC skips im2col
        c(1, 6, 6, 2, 2, 1, 1, [2, 2]), // 1x1 with stride
        c(1, 3, 3, 2, 3, 5, 5, [1, 1]), // window larger than the image (SAME only)
        c(2, 9, 7, 1, 1, 3, 3, [3, 2]),
        c(4, 12, 12, 8, 16, 3, 3, [1, 1]), // big enough for parallel products
    ];
    for dtype in FLOATS {
        for f in FORMATS {
            for case in &cases {
                for padding in paddings(case) {
                    check_conv(case, dtype, f, padding, &mut rng);
                }
            }
        }
    }
}

/// The paddings a case's window fits: SAME, VALID, and explicit ones: symmetric,
/// more after than before (height) and before than after (width), pads wider than the
/// window (some windows read zeros only).
fn paddings(case: &ConvCase) -> Vec<Padding> {
    let (kh, kw) = (case.kh, case.kw);
    [
        Padding::Same,
        Padding::Valid,
        Padding::Explicit([[1, 1], [1, 1]]),
        Padding::Explicit([[0, 2], [3, 1]]),
        Padding::Explicit([[kh + 1, 0], [1, kw + 2]]),
    ]
    .into_iter()
    .filter(|&p| {
        let fits = |axis: usize, len: usize, k: usize| match p {
            Padding::Same => true,
            Padding::Valid => len >= k,
            Padding::Explicit(pads) => len + pads[axis][0] + pads[axis][1] >= k,
        };
        fits(0, case.h, kh) && fits(1, case.w, kw)
    })
    .collect()
}

/// Explicit pads equal to what SAME or VALID pad give the same windows, so the same
/// values bit for bit.
#[test]
fn explicit_padding_equals_same_and_valid() {
    let mut rng = Rng(3);
    // (h, w, k, stride, SAME's (before, after) for height and width)
    let cases = [
        (8, 6, 3, 2, [[0, 1], [0, 1]]), // stride 2 over an even input: 0 before, 1 after
        (7, 6, 3, 2, [[1, 1], [0, 1]]),
        (7, 7, 3, 1, [[1, 1], [1, 1]]),
        (6, 8, 4, 1, [[1, 2], [1, 2]]),
        (9, 5, 2, 2, [[0, 1], [0, 1]]),
    ];
    for (h, w, k, stride, pads) in cases {
        for f in FORMATS {
            let x = Images {
                n: 2,
                h,
                w,
                c: 3,
                v: rng.vec(2 * h * w * 3),
            };
            let (xt, _) = x.tensor(DType::F32, f);
            let ft = Tensor::from_f64(DType::F32, [k, k, 3, 4], &rng.vec(k * k * 12)).unwrap();
            let strides = [stride, stride];
            let conv = |p| run(&Conv2D::new(strides, p, f), &[&xt, &ft]);
            let explicit = Padding::Explicit(pads);
            assert_eq!(
                conv(explicit),
                conv(Padding::Same),
                "{h}x{w} k{k} s{stride} {f:?}"
            );
            let zero = Padding::Explicit([[0, 0], [0, 0]]);
            assert_eq!(
                conv(zero),
                conv(Padding::Valid),
                "{h}x{w} k{k} s{stride} {f:?}"
            );
        }
    }
}

#[test]
fn conv_batch_larger_than_im2col_budget() {
    // 3 images of 64x64 pixels with 3x3x256 patches: more than one im2col group.
    let case = ConvCase {
        n: 3,
        h: 64,
        w: 64,
        cin: 256,
        cout: 2,
        kh: 3,
        kw: 3,
        strides: [1, 1],
        groups: 1,
    };
    let mut rng = Rng(11);
    for f in FORMATS {
        check_conv(&case, DType::F32, f, Padding::Same, &mut rng);
    }
}

#[test]
fn grouped_conv_matches_reference() {
    let mut rng = Rng(19);
    let c = |n, h, w, cin, cout, k: [usize; 2], strides, groups| ConvCase {
        n,
        h,
        w,
        cin,
        cout,
        kh: k[0],
        kw: k[1],
        strides,
        groups,
    };
    let cases = [
        c(2, 5, 6, 4, 6, [3, 3], [1, 1], 2),
        // Depthwise (groups = channels), as MobileNet's, with multipliers 1 and 2.
        c(2, 7, 5, 3, 3, [3, 3], [2, 2], 3),
        c(1, 6, 6, 4, 8, [3, 3], [1, 1], 4),
        c(1, 7, 5, 2, 2, [2, 2], [2, 2], 2), // even window: asymmetric SAME padding
        c(2, 4, 4, 6, 9, [1, 1], [1, 1], 3), // 1x1: NHWC reads the pixels in place
        c(3, 8, 8, 8, 16, [3, 2], [2, 1], 4),
        c(1, 3, 3, 4, 2, [5, 5], [1, 1], 2), // window larger than the image
        c(4, 12, 12, 16, 32, [3, 3], [1, 1], 8), // big enough for parallel products
        c(2, 9, 7, 12, 12, [3, 3], [3, 2], 12),
    ];
    for dtype in FLOATS {
        for f in FORMATS {
            for case in &cases {
                for padding in paddings(case) {
                    check_conv(case, dtype, f, padding, &mut rng);
                }
            }
        }
    }
}

#[test]
fn grouped_conv_larger_than_im2col_budget() {
    // 64x64 images with 3x3x256 patches per group: NHWC takes several im2col blocks,
    // NCHW images too large for one buffer.
    let case = ConvCase {
        n: 2,
        h: 64,
        w: 64,
        cin: 512,
        cout: 4,
        kh: 3,
        kw: 3,
        strides: [1, 1],
        groups: 2,
    };
    let mut rng = Rng(23);
    for f in FORMATS {
        check_conv(&case, DType::F32, f, Padding::Same, &mut rng);
    }
}

#[test]
fn grouped_conv_shape_errors() {
    let grouped = |groups| Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc).with_groups(groups);
    let e = infer_err(&grouped(4), &[f32t(&[1, 5, 5, 6]), f32t(&[3, 3, 1, 8])]);
    assert!(
        e.contains("6 channels") && e.contains("not divisible by groups 4"),
        "{e}"
    );
    let e = infer_err(&grouped(3), &[f32t(&[1, 5, 5, 6]), f32t(&[3, 3, 2, 5])]);
    assert!(
        e.contains("5 output channels") && e.contains("not divisible by groups 3"),
        "{e}"
    );
    // 6 channels in 2 groups take a filter of 3 input channels.
    let e = infer_err(&grouped(2), &[f32t(&[1, 5, 5, 6]), f32t(&[3, 3, 2, 4])]);
    assert!(
        e.contains("3 per group of 2") && e.contains("expects 2 input channels per group"),
        "{e}"
    );
    // An ungrouped filter over all channels is the mistake above too.
    let e = infer_err(&grouped(3), &[f32t(&[1, 5, 5, 6]), f32t(&[3, 3, 6, 6])]);
    assert!(e.contains("2 per group of 3"), "{e}");
    let e = infer_err(&grouped(0), &[f32t(&[1, 5, 5, 6]), f32t(&[3, 3, 6, 6])]);
    assert!(e.contains("groups must be positive"), "{e}");
    let ok = grouped(3)
        .infer(&[&f32t(&[2, 5, 5, 6]), &f32t(&[3, 3, 2, 9])])
        .unwrap();
    assert_eq!(ok[0].shape, [2, 5, 5, 9]);
    // The gradient ops check the same.
    let df = Conv2DBackpropFilter {
        filter_shape: vec![3, 3, 2, 4],
        conv: Conv2D::new([1, 1], Padding::Same, DataFormat::Nchw).with_groups(3),
    };
    let e = infer_err(&df, &[f32t(&[1, 6, 5, 5]), f32t(&[1, 4, 5, 5])]);
    assert!(e.contains("4 output channels"), "{e}");
    let dx = Conv2DBackpropInput {
        input_shape: vec![1, 5, 5, 9],
        conv: Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc).with_groups(2),
    };
    let e = infer_err(&dx, &[f32t(&[3, 3, 3, 4]), f32t(&[1, 5, 5, 4])]);
    assert!(e.contains("9 channels, not divisible by groups 2"), "{e}");
    // eval reports them rather than panicking.
    let x = Tensor::from_f64(DType::F32, [1, 2, 2, 6], &[0.0; 24]).unwrap();
    let fl = Tensor::from_f64(DType::F32, [1, 1, 6, 6], &[0.0; 36]).unwrap();
    assert!(grouped(3)
        .eval(&[&x, &fl])
        .unwrap_err()
        .contains("per group"));
}

#[test]
fn grouped_conv_attrs_round_trip() {
    let base = [
        ("strides", AttrValue::Ints(vec![2, 1])),
        ("padding", AttrValue::from("SAME")),
        ("data_format", AttrValue::from("NCHW")),
    ];
    let with = |groups: AttrValue| {
        let mut a = base.to_vec();
        a.push(("groups", groups));
        a
    };
    let op = parse_op("Conv2D", attrs(&with(AttrValue::Int(4)))).unwrap();
    let want = Conv2D::new([2, 1], Padding::Same, DataFormat::Nchw).with_groups(4);
    assert_eq!(op.downcast_ref::<Conv2D>(), Some(&want));
    assert!(op.attrs().contains(&("groups", AttrValue::Int(4))));
    assert_round_trip(&*op);
    for (name, key) in [
        ("Conv2DBackpropInput", "input_shape"),
        ("Conv2DBackpropFilter", "filter_shape"),
    ] {
        let mut a = with(AttrValue::Int(4));
        a.push((key, AttrValue::Ints(vec![1, 8, 3, 3])));
        let op = parse_op(name, attrs(&a)).unwrap();
        assert!(
            op.attrs().contains(&("groups", AttrValue::Int(4))),
            "{name}"
        );
        assert_round_trip(&*op);
    }
    // groups 1 (given or not) is an ungrouped convolution, written as before.
    let op = parse_op("Conv2D", attrs(&with(AttrValue::Int(1)))).unwrap();
    assert_eq!(
        op.downcast_ref::<Conv2D>(),
        Some(&Conv2D::new([2, 1], Padding::Same, DataFormat::Nchw))
    );
    assert!(op.attrs().iter().all(|(k, _)| *k != "groups"));
    for bad in [AttrValue::Int(0), AttrValue::Int(-2)] {
        let e = parse_op("Conv2D", attrs(&with(bad))).err().unwrap();
        assert!(
            e.contains("attr 'groups' must be a positive integer"),
            "{e}"
        );
    }
    let e = parse_op("Conv2D", attrs(&with("2".into()))).err().unwrap();
    assert!(e.contains("groups") && e.contains("integer"), "{e}");

    // Through a graph file: only the grouped node writes the attr.
    use ampgraph_graph::format::{parse_json, to_json, GraphDef};
    let mut g = ampgraph_graph::Graph::new();
    let x = g.placeholder("x", DType::F32, [1, 6, 5, 5]).unwrap();
    let w = g.placeholder("w", DType::F32, [3, 3, 2, 6]).unwrap();
    let v = g.placeholder("v", DType::F32, [1, 1, 6, 6]).unwrap();
    let grouped = Conv2D::new([1, 1], Padding::Same, DataFormat::Nchw).with_groups(3);
    let y = g.add(grouped, &[x, w]).unwrap();
    let y = g
        .conv2d(y, v, [1, 1], Padding::Valid, DataFormat::Nchw)
        .unwrap();
    g.set_outputs(vec![y]).unwrap();
    let json = to_json(&GraphDef::from_graph(&g));
    assert_eq!(json.matches("\"groups\"").count(), 1, "{json}");
    let back = parse_json(json.as_bytes()).unwrap().to_graph().unwrap();
    assert_eq!(to_json(&GraphDef::from_graph(&back)), json);
}

#[test]
fn conv_shape_errors() {
    let op = Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc);
    let e = infer_err(&op, &[f32t(&[8, 28, 28, 3]), f32t(&[3, 3, 4, 16])]);
    assert!(
        e.contains("3 channels") && e.contains("4 input channels"),
        "{e}"
    );
    assert!(
        e.contains("[8, 28, 28, 3]") && e.contains("[3, 3, 4, 16]"),
        "{e}"
    );
    // The same x read as NCHW has 28 channels.
    let nchw = Conv2D::new([1, 1], Padding::Same, DataFormat::Nchw);
    let e = infer_err(&nchw, &[f32t(&[8, 28, 28, 3]), f32t(&[3, 3, 3, 16])]);
    assert!(e.contains("28 channels") && e.contains("NCHW"), "{e}");
    let ok = nchw
        .infer(&[&f32t(&[8, 3, 28, 28]), &f32t(&[3, 3, 3, 16])])
        .unwrap();
    assert_eq!(ok[0].shape, [8, 16, 28, 28]);

    // Bad strides, built directly (parsing rejects them earlier, see below).
    let bad = Conv2D::new([0, 1], Padding::Same, DataFormat::Nhwc);
    let e = infer_err(&bad, &[f32t(&[1, 4, 4, 1]), f32t(&[2, 2, 1, 1])]);
    assert!(e.contains("strides") && e.contains("positive"), "{e}");

    let e = infer_err(&op, &[f32t(&[28, 28, 3]), f32t(&[3, 3, 3, 16])]);
    assert!(e.contains("rank 4") && e.contains("[28, 28, 3]"), "{e}");
    let e = infer_err(&op, &[f32t(&[1, 28, 28, 3]), f32t(&[3, 3, 3])]);
    assert!(e.contains("filter") && e.contains("rank 4"), "{e}");
    let valid = Conv2D::new([1, 1], Padding::Valid, DataFormat::Nhwc);
    let e = infer_err(&valid, &[f32t(&[1, 2, 8, 1]), f32t(&[3, 3, 1, 1])]);
    assert!(e.contains("height") && e.contains("VALID"), "{e}");
    let e = infer_err(
        &op,
        &[
            f32t(&[1, 4, 4, 1]),
            TensorType::new(DType::F16, vec![2, 2, 1, 1]),
        ],
    );
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
    let i32t = |s: &[usize]| TensorType::new(DType::I32, s.to_vec());
    let e = infer_err(&op, &[i32t(&[1, 4, 4, 1]), i32t(&[2, 2, 1, 1])]);
    assert!(e.contains("float"), "{e}");
    // eval reports the same problems instead of panicking.
    let x = Tensor::from_f64(DType::F32, [1, 2, 2, 3], &[0.0; 12]).unwrap();
    let fl = Tensor::from_f64(DType::F32, [1, 1, 2, 1], &[0.0; 2]).unwrap();
    assert!(op.eval(&[&x, &fl]).unwrap_err().contains("channels"));
}

#[test]
fn conv_output_shapes_follow_tensorflow() {
    // TF: SAME -> ceil(in / stride); VALID -> ceil((in - k + 1) / stride).
    let cases = [
        (Padding::Same, 28, 3, 1, 28),
        (Padding::Same, 28, 3, 2, 14),
        (Padding::Same, 7, 3, 2, 4),
        (Padding::Valid, 28, 5, 1, 24),
        (Padding::Valid, 7, 3, 2, 3),
        (Padding::Valid, 8, 3, 3, 2),
        // Explicit: (len + before + after - k) / stride + 1, PyTorch's rule.
        (Padding::Explicit([[1, 1]; 2]), 28, 3, 2, 14),
        (Padding::Explicit([[1, 1]; 2]), 7, 3, 2, 4),
        (Padding::Explicit([[0, 0]; 2]), 28, 5, 1, 24),
        (Padding::Explicit([[3, 2]; 2]), 7, 3, 2, 5),
        (Padding::Explicit([[0, 9]; 2]), 1, 4, 3, 3),
    ];
    for (padding, len, k, s, want) in cases {
        let op = Conv2D::new([s, s], padding, DataFormat::Nhwc);
        let y = op
            .infer(&[&f32t(&[1, len, len, 1]), &f32t(&[k, k, 1, 2])])
            .unwrap();
        assert_eq!(y[0].shape, [1, want, want, 2], "{padding:?} {len} {k} {s}");
    }
}

#[test]
fn conv_parse_attrs() {
    let op = parse_op(
        "Conv2D",
        attrs(&[
            ("strides", AttrValue::Ints(vec![2, 1])),
            ("padding", "VALID".into()),
            ("data_format", "NCHW".into()),
        ]),
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<Conv2D>(),
        Some(&Conv2D::new([2, 1], Padding::Valid, DataFormat::Nchw))
    );
    // Attrs written back parse to the same op.
    let back: Vec<(&str, AttrValue)> = op.attrs();
    let again = parse_op("Conv2D", attrs(&back)).unwrap();
    assert!(*again == *op);
    // data_format defaults to NHWC, strides to [1, 1].
    let op = parse_op("Conv2D", attrs(&[("padding", "SAME".into())])).unwrap();
    assert_eq!(
        op.downcast_ref::<Conv2D>(),
        Some(&Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc))
    );

    let e = parse_op(
        "Conv2D",
        attrs(&[
            ("strides", AttrValue::Ints(vec![0, 1])),
            ("padding", "SAME".into()),
        ]),
    )
    .err()
    .unwrap();
    assert!(e.contains("strides") && e.contains("positive"), "{e}");
    let e = parse_op(
        "Conv2D",
        attrs(&[
            ("strides", AttrValue::Ints(vec![1, 2, 2, 1])),
            ("padding", "SAME".into()),
        ]),
    )
    .err()
    .unwrap();
    assert!(e.contains("strides"), "{e}");
    let e = parse_op("Conv2D", attrs(&[])).err().unwrap();
    assert!(e.contains("padding"), "{e}");
    let e = parse_op("Conv2D", attrs(&[("padding", "FULL".into())]))
        .err()
        .unwrap();
    assert!(e.contains("SAME") && e.contains("FULL"), "{e}");
    let e = parse_op(
        "Conv2D",
        attrs(&[("padding", "SAME".into()), ("data_format", "NWHC".into())]),
    )
    .err()
    .unwrap();
    assert!(e.contains("data_format"), "{e}");
}

#[test]
fn conv_explicit_padding_errors() {
    // Too little for one window, on either axis.
    let op = Conv2D::new(
        [1, 1],
        Padding::Explicit([[1, 0], [0, 0]]),
        DataFormat::Nhwc,
    );
    let e = infer_err(&op, &[f32t(&[1, 1, 4, 1]), f32t(&[3, 3, 1, 1])]);
    assert!(
        e.contains("height") && e.contains("1 before and 0 after"),
        "{e}"
    );
    let op = Conv2D::new(
        [1, 1],
        Padding::Explicit([[5, 5], [0, 1]]),
        DataFormat::Nchw,
    );
    let e = infer_err(&op, &[f32t(&[1, 1, 4, 2]), f32t(&[3, 4, 1, 1])]);
    assert!(e.contains("width") && e.contains("window 4"), "{e}");
    // Pads that overflow, or beyond any image.
    let op = Conv2D::new(
        [1, 1],
        Padding::Explicit([[usize::MAX, 1], [0, 0]]),
        DataFormat::Nhwc,
    );
    let e = infer_err(&op, &[f32t(&[1, 4, 4, 1]), f32t(&[3, 3, 1, 1])]);
    assert!(e.contains("overflows"), "{e}");
    let op = Conv2D::new(
        [1, 1],
        Padding::Explicit([[0, 0], [1 << 41, 0]]),
        DataFormat::Nhwc,
    );
    let e = infer_err(&op, &[f32t(&[1, 4, 4, 1]), f32t(&[3, 3, 1, 1])]);
    assert!(e.contains("width") && e.contains("2^40"), "{e}");
}

/// A Conv2D's attrs in `format` with `padding: EXPLICIT` and `explicit_paddings`.
fn explicit_attrs(format: &str, list: Vec<i64>) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("padding", "EXPLICIT".into()),
        ("explicit_paddings", AttrValue::Ints(list)),
        ("data_format", format.into()),
    ]
}

#[test]
fn conv_explicit_padding_attrs_round_trip() {
    let pads = Padding::Explicit([[1, 2], [3, 4]]);
    // The pairs follow data_format: (N, H, W, C) or (N, C, H, W).
    for (format, f, list) in [
        ("NHWC", DataFormat::Nhwc, vec![0, 0, 1, 2, 3, 4, 0, 0]),
        ("NCHW", DataFormat::Nchw, vec![0, 0, 0, 0, 1, 2, 3, 4]),
    ] {
        let op = parse_op("Conv2D", attrs(&explicit_attrs(format, list.clone()))).unwrap();
        assert_eq!(
            op.downcast_ref::<Conv2D>(),
            Some(&Conv2D::new([1, 1], pads, f))
        );
        let written = op.attrs();
        assert!(
            written.contains(&("explicit_paddings", AttrValue::Ints(list.clone()))),
            "{written:?}"
        );
        assert_round_trip(&*op);
        for (name, shape_key) in [
            ("Conv2DBackpropInput", "input_shape"),
            ("Conv2DBackpropFilter", "filter_shape"),
        ] {
            let mut a = explicit_attrs(format, list.clone());
            a.push((shape_key, AttrValue::Ints(vec![1, 3, 3, 1])));
            let op = parse_op(name, attrs(&a)).unwrap();
            assert!(
                op.attrs().contains(&("padding", "EXPLICIT".into())),
                "{name}"
            );
            assert_round_trip(&*op);
        }
    }
    // SAME and VALID write no explicit_paddings; TensorFlow's empty list reads as none.
    let op = Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc);
    assert!(op.attrs().iter().all(|(k, _)| *k != "explicit_paddings"));
    let op = parse_op(
        "Conv2D",
        attrs(&[
            ("padding", "VALID".into()),
            ("explicit_paddings", AttrValue::Ints(vec![])),
        ]),
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<Conv2D>(),
        Some(&Conv2D::new([1, 1], Padding::Valid, DataFormat::Nhwc))
    );
}

#[test]
fn conv_explicit_padding_attr_errors() {
    let err = |a: Vec<(&str, AttrValue)>| parse_op("Conv2D", attrs(&a)).err().unwrap();
    let one_line = |e: &str| assert!(!e.contains('\n') && e.contains("explicit_paddings"), "{e}");
    // Wrong length, missing.
    let e = err(explicit_attrs("NHWC", vec![0, 0, 1, 1, 1, 1]));
    one_line(&e);
    assert!(
        e.contains("8 integers") && e.contains("[0, 0, 1, 1, 1, 1]"),
        "{e}"
    );
    let e = err(vec![("padding", "EXPLICIT".into())]);
    one_line(&e);
    assert!(e.contains("8 integers"), "{e}");
    // Negative.
    let e = err(explicit_attrs("NHWC", vec![0, 0, 1, -1, 1, 1, 0, 0]));
    one_line(&e);
    assert!(e.contains("negative"), "{e}");
    // The batch or channel pair nonzero, in either layout's order.
    for list in [vec![1, 0, 1, 1, 1, 1, 0, 0], vec![0, 0, 1, 1, 1, 1, 0, 2]] {
        let e = err(explicit_attrs("NHWC", list));
        one_line(&e);
        assert!(e.contains("batch or channel") && e.contains("NHWC"), "{e}");
    }
    let e = err(explicit_attrs("NCHW", vec![0, 0, 1, 1, 1, 1, 0, 0]));
    one_line(&e);
    assert!(e.contains("batch or channel") && e.contains("NCHW"), "{e}");
    // A list of the wrong kind, or a list without EXPLICIT.
    let e = err(vec![
        ("padding", "EXPLICIT".into()),
        ("explicit_paddings", AttrValue::Floats(vec![0.5; 8])),
    ]);
    one_line(&e);
    let e = err(vec![
        ("padding", "SAME".into()),
        ("explicit_paddings", AttrValue::Ints(vec![0; 8])),
    ]);
    one_line(&e);
    assert!(e.contains("unless padding is EXPLICIT"), "{e}");
    // The backprop ops read it as Conv2D does.
    let mut a = explicit_attrs("NHWC", vec![0, 0, 1]);
    a.push(("input_shape", AttrValue::Ints(vec![1, 3, 3, 1])));
    let e = parse_op("Conv2DBackpropInput", attrs(&a)).err().unwrap();
    assert!(e.contains("8 integers"), "{e}");
}

/// A pooling op's attrs with `padding: EXPLICIT` and `explicit_paddings` in `format`.
fn pool_explicit_attrs(format: &str, list: Vec<i64>) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("ksize", AttrValue::Ints(vec![3, 3])),
        ("strides", AttrValue::Ints(vec![2, 2])),
        ("padding", "EXPLICIT".into()),
        ("explicit_paddings", AttrValue::Ints(list)),
        ("data_format", format.into()),
    ]
}

#[test]
fn pools_parse_and_write_explicit_padding() {
    let pads = Padding::Explicit([[1, 2], [0, 1]]);
    for (format, f, list) in [
        ("NHWC", DataFormat::Nhwc, vec![0, 0, 1, 2, 0, 1, 0, 0]),
        ("NCHW", DataFormat::Nchw, vec![0, 0, 0, 0, 1, 2, 0, 1]),
    ] {
        let op = parse_op("MaxPool", attrs(&pool_explicit_attrs(format, list.clone()))).unwrap();
        assert_eq!(
            op.downcast_ref::<MaxPool>(),
            Some(&MaxPool::new([3, 3], [2, 2], pads, f))
        );
        let op = parse_op("AvgPool", attrs(&pool_explicit_attrs(format, list.clone()))).unwrap();
        assert_eq!(
            op.downcast_ref::<AvgPool>(),
            Some(&AvgPool::new([3, 3], [2, 2], pads, f))
        );
        assert!(
            op.attrs()
                .contains(&("explicit_paddings", AttrValue::Ints(list.clone()))),
            "{:?}",
            op.attrs()
        );
        for name in ["MaxPool", "AvgPool", "MaxPoolGrad"] {
            let op = parse_op(name, attrs(&pool_explicit_attrs(format, list.clone()))).unwrap();
            assert_round_trip(&*op);
        }
        let mut a = pool_explicit_attrs(format, list.clone());
        a.push(("input_shape", AttrValue::Ints(vec![1, 4, 4, 4])));
        assert_round_trip(&*parse_op("AvgPoolGrad", attrs(&a)).unwrap());
    }
    // SAME and VALID pools write what they wrote before: no explicit_paddings.
    let op = MaxPool::new([2, 2], [2, 2], Padding::Same, DataFormat::Nhwc);
    assert!(op.attrs().iter().all(|(k, _)| *k != "explicit_paddings"));
    // Mistakes in the list are the convolutions' errors.
    let e = parse_op(
        "AvgPool",
        attrs(&pool_explicit_attrs("NHWC", vec![0, 0, 1, 1])),
    )
    .err()
    .unwrap();
    assert!(e.contains("8 integers"), "{e}");
    let e = parse_op(
        "MaxPool",
        attrs(&pool_explicit_attrs("NCHW", vec![0, 0, 1, 1, 1, 1, 0, 0])),
    )
    .err()
    .unwrap();
    assert!(e.contains("batch or channel"), "{e}");
    let mut a = pool_explicit_attrs("NHWC", vec![0, 0, 1, 1, 1, 1, 0, 0]);
    a[2] = ("padding", "SAME".into());
    let e = parse_op("MaxPool", attrs(&a)).err().unwrap();
    assert!(e.contains("unless padding is EXPLICIT"), "{e}");
}

/// A 4x4 image of 1..=16 (row-major), pooled by hand.
#[test]
fn explicit_padding_pools_by_hand() {
    let x = Images {
        n: 1,
        h: 4,
        w: 4,
        c: 1,
        v: (1..=16).map(f64::from).collect(),
    };
    // (pads, output height and width, max, mean over in-bounds elements)
    type HandCase = (Padding, [usize; 2], Vec<f64>, Vec<f64>);
    let cases: [HandCase; 2] = [
        // PyTorch's padding=1 with a 3x3 window at stride 2: windows rows {0, 1} and
        // {1, 2, 3}, the same columns. avg_pool2d(count_include_pad=False) divides
        // by 4, 6, 6 and 9 elements.
        (
            Padding::Explicit([[1, 1], [1, 1]]),
            [2, 2],
            vec![6.0, 8.0, 14.0, 16.0],
            vec![3.5, 5.0, 9.5, 11.0],
        ),
        // Rows (0 before, 2 after): {0, 1, 2}, {2, 3}; columns (2 before, 1 after):
        // {0}, {0, 1, 2}, {2, 3}.
        (
            Padding::Explicit([[0, 2], [2, 1]]),
            [2, 3],
            vec![9.0, 11.0, 12.0, 13.0, 15.0, 16.0],
            vec![5.0, 6.0, 7.5, 11.0, 12.0, 13.5],
        ),
    ];
    for (pads, [oh, ow], max, mean) in cases {
        for dtype in FLOATS {
            for f in FORMATS {
                let (xt, _) = x.tensor(dtype, f);
                let what = format!("{pads:?} {dtype} {f:?}");
                let y = run(&MaxPool::new([3, 3], [2, 2], pads, f), &[&xt]);
                assert_eq!(
                    y.shape(),
                    &Images {
                        h: oh,
                        w: ow,
                        ..x.clone()
                    }
                    .shape(f)[..]
                );
                assert_eq!(y.to_f64_vec(), max, "MaxPool {what}");
                // Negated: padding zeros would win every window if they took part.
                let neg = Images {
                    v: x.v.iter().map(|v| -v).collect(),
                    ..x.clone()
                };
                let (nt, _) = neg.tensor(dtype, f);
                let y = run(&MaxPool::new([3, 3], [2, 2], pads, f), &[&nt]);
                assert!(y.to_f64_vec().iter().all(|&v| v <= -1.0), "{what}: {y:?}");
                let y = run(&AvgPool::new([3, 3], [2, 2], pads, f), &[&xt]);
                assert_eq!(y.to_f64_vec(), mean, "AvgPool {what}");
            }
        }
    }
}

/// Explicit pads equal to SAME's pool bit for bit as SAME does; zero pads as VALID.
#[test]
fn explicit_pool_padding_equals_same_and_valid() {
    let mut rng = Rng(13);
    // (h, w, k, stride, SAME's (before, after) for height and width)
    let cases = [
        (8, 6, 3, 2, [[0, 1], [0, 1]]),
        (7, 6, 3, 2, [[1, 1], [0, 1]]),
        (6, 8, 4, 1, [[1, 2], [1, 2]]),
        (9, 5, 2, 2, [[0, 1], [0, 1]]),
    ];
    for (h, w, k, stride, pads) in cases {
        for f in FORMATS {
            let x = Images {
                n: 2,
                h,
                w,
                c: 3,
                v: rng.vec(2 * h * w * 3),
            };
            let (xt, _) = x.tensor(DType::F32, f);
            let what = format!("{h}x{w} k{k} s{stride} {f:?}");
            let (ks, ss) = ([k, k], [stride, stride]);
            let max = |p| run(&MaxPool::new(ks, ss, p, f), &[&xt]);
            let avg = |p| run(&AvgPool::new(ks, ss, p, f), &[&xt]);
            let zero = Padding::Explicit([[0, 0], [0, 0]]);
            assert_eq!(max(Padding::Explicit(pads)), max(Padding::Same), "{what}");
            assert_eq!(avg(Padding::Explicit(pads)), avg(Padding::Same), "{what}");
            assert_eq!(max(zero), max(Padding::Valid), "{what}");
            assert_eq!(avg(zero), avg(Padding::Valid), "{what}");
        }
    }
}

#[test]
fn pools_refuse_pads_as_wide_as_the_window() {
    let explicit = |p| Padding::Explicit(p);
    // Before or after, on either axis: PyTorch refuses these too.
    for (pads, axis) in [
        ([[2, 0], [0, 0]], "height"),
        ([[0, 2], [1, 1]], "height"),
        ([[1, 1], [3, 0]], "width"),
    ] {
        let p = MaxPool::new([2, 3], [1, 1], explicit(pads), DataFormat::Nhwc);
        let e = infer_err(&p, &[f32t(&[1, 5, 5, 1])]);
        assert!(
            e.contains(axis) && e.contains("smaller than the pooling window"),
            "{pads:?}: {e}"
        );
    }
    // The gradients check the same, and so do kernels handed such an op.
    let pads = explicit([[0, 0], [0, 3]]);
    let e = infer_err(
        &AvgPool::new([3, 3], [1, 1], pads, DataFormat::Nchw),
        &[f32t(&[1, 1, 4, 4])],
    );
    assert!(e.contains("window 3"), "{e}");
    let grad = ampgraph_graph::ops::MaxPoolGrad::new([3, 3], [1, 1], pads, DataFormat::Nchw);
    let e = infer_err(
        &grad,
        &[
            f32t(&[1, 1, 4, 4]),
            f32t(&[1, 1, 2, 5]),
            f32t(&[1, 1, 2, 5]),
        ],
    );
    assert!(e.contains("window 3"), "{e}");
    let x = Tensor::from_f64(DType::F32, [1, 4, 4, 1], &[0.0; 16]).unwrap();
    let wide = MaxPool::new([2, 2], [1, 1], explicit([[2, 2], [0, 0]]), DataFormat::Nhwc);
    assert!(wide.eval(&[&x]).unwrap_err().contains("window 2"));
    // An empty image with pads would pool padding only.
    let p = AvgPool::new([3, 3], [1, 1], explicit([[2, 2], [1, 1]]), DataFormat::Nhwc);
    let e = infer_err(&p, &[f32t(&[1, 0, 4, 1])]);
    assert!(e.contains("height") && e.contains("empty"), "{e}");
    // Pads one below the window are fine: every window holds an element.
    let p = MaxPool::new([3, 3], [1, 1], explicit([[2, 2], [2, 2]]), DataFormat::Nhwc);
    assert_eq!(
        p.infer(&[&f32t(&[1, 1, 1, 1])]).unwrap()[0].shape,
        [1, 3, 3, 1]
    );
}

#[test]
fn avgpool_same_divides_by_in_bounds_count() {
    let x = one_to_nine();
    for dtype in FLOATS {
        for f in FORMATS {
            let (xt, _) = x.tensor(dtype, f);
            let y = run(&AvgPool::new([3, 3], [1, 1], Padding::Same, f), &[&xt]);
            // Corners average 4 elements, edges 6, the centre 9.
            assert_eq!(
                y.to_f64_vec(),
                [3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0],
                "{dtype} {f:?}"
            );
            // 2x2 windows, stride 2: padding goes after (bottom/right).
            let y = run(&AvgPool::new([2, 2], [2, 2], Padding::Same, f), &[&xt]);
            assert_eq!(y.to_f64_vec(), [3.0, 4.5, 7.5, 9.0], "{dtype} {f:?}");
            let y = run(&MaxPool::new([2, 2], [2, 2], Padding::Same, f), &[&xt]);
            assert_eq!(y.to_f64_vec(), [5.0, 6.0, 8.0, 9.0], "{dtype} {f:?}");
            let y = run(&AvgPool::new([2, 2], [1, 1], Padding::Valid, f), &[&xt]);
            assert_eq!(y.to_f64_vec(), [3.0, 4.0, 6.0, 7.0], "{dtype} {f:?}");
        }
    }
}

#[test]
fn maxpool_ignores_padding() {
    // All values negative: a zero pad would win if padding took part.
    let mut x = one_to_nine();
    x.v.iter_mut().for_each(|v| *v = -*v);
    for dtype in FLOATS {
        for f in FORMATS {
            let (xt, _) = x.tensor(dtype, f);
            let y = run(&MaxPool::new([3, 3], [1, 1], Padding::Same, f), &[&xt]);
            assert_eq!(
                y.to_f64_vec(),
                [-1.0, -1.0, -2.0, -1.0, -1.0, -2.0, -4.0, -4.0, -5.0],
                "{dtype} {f:?}"
            );
        }
    }
}

#[test]
fn pools_match_reference() {
    let mut rng = Rng(5);
    // (n, h, w, c, ksize, strides)
    type PoolCase = (usize, usize, usize, usize, [usize; 2], [usize; 2]);
    let cases: &[PoolCase] = &[
        (2, 6, 6, 3, [2, 2], [2, 2]),
        (1, 7, 5, 2, [3, 3], [2, 2]),
        (3, 5, 8, 4, [3, 2], [1, 3]),
        (1, 4, 4, 1, [5, 5], [1, 1]), // window larger than the image (SAME only)
        (2, 9, 9, 5, [1, 1], [2, 2]),
    ];
    for dtype in FLOATS {
        for f in FORMATS {
            for &(n, h, w, c, ksize, strides) in cases {
                // Explicit pads below the window: symmetric, uneven, the widest taken.
                let widest = [ksize[0] - 1, ksize[1] - 1];
                let paddings = [
                    Padding::Same,
                    Padding::Valid,
                    Padding::Explicit([[widest[0] / 2; 2], [widest[1] / 2; 2]]),
                    Padding::Explicit([[0, widest[0]], [widest[1], 0]]),
                    Padding::Explicit([[widest[0]; 2], [widest[1]; 2]]),
                ];
                for padding in paddings {
                    let fits = |axis: usize, len: usize| match padding {
                        Padding::Same => true,
                        Padding::Valid => len >= ksize[axis],
                        Padding::Explicit(p) => len + p[axis][0] + p[axis][1] >= ksize[axis],
                    };
                    if !fits(0, h) || !fits(1, w) {
                        continue;
                    }
                    let x = Images {
                        n,
                        h,
                        w,
                        c,
                        v: rng.vec(n * h * w * c),
                    };
                    let (xt, x) = x.tensor(dtype, f);
                    let what =
                        format!("x [{n},{h},{w},{c}] {ksize:?} {strides:?} {padding:?} {f:?}");

                    let y = run(&MaxPool::new(ksize, strides, padding, f), &[&xt]);
                    let (want, _, _) = ref_pool(&x, true, ksize, strides, padding);
                    assert_eq!(y.shape(), &want.shape(f)[..], "MaxPool {what}");
                    assert_eq!(output_nhwc(&y, f).v, want.v, "MaxPool {what} {dtype}");

                    let y = run(&AvgPool::new(ksize, strides, padding, f), &[&xt]);
                    let (want, abs, _) = ref_pool(&x, false, ksize, strides, padding);
                    assert_eq!(y.shape(), &want.shape(f)[..], "AvgPool {what}");
                    check_sums(
                        &format!("AvgPool {what}"),
                        dtype,
                        ksize[0] * ksize[1],
                        &output_nhwc(&y, f).v,
                        &want.v,
                        &abs.v,
                    );
                }
            }
        }
    }
}

#[test]
fn pool_errors_and_attrs() {
    let p = MaxPool::new([2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc);
    let e = infer_err(&p, &[f32t(&[4, 4, 3])]);
    assert!(e.contains("rank 4"), "{e}");
    let e = infer_err(&p, &[f32t(&[1, 1, 4, 3])]);
    assert!(e.contains("height") && e.contains("VALID"), "{e}");
    let e = infer_err(&p, &[TensorType::new(DType::I64, vec![1, 4, 4, 1])]);
    assert!(e.contains("float"), "{e}");
    let bad = AvgPool::new([2, 0], [1, 1], Padding::Same, DataFormat::Nhwc);
    let e = infer_err(&bad, &[f32t(&[1, 4, 4, 1])]);
    assert!(e.contains("ksize"), "{e}");
    let bad = AvgPool::new([2, 2], [1, 0], Padding::Same, DataFormat::Nhwc);
    let e = infer_err(&bad, &[f32t(&[1, 4, 4, 1])]);
    assert!(e.contains("strides"), "{e}");
    let ok = AvgPool::new([3, 3], [2, 2], Padding::Same, DataFormat::Nchw)
        .infer(&[&f32t(&[2, 16, 7, 9])])
        .unwrap();
    assert_eq!(ok[0].shape, [2, 16, 4, 5]);

    for name in ["MaxPool", "AvgPool"] {
        let op = parse_op(
            name,
            attrs(&[
                ("ksize", AttrValue::Ints(vec![3, 2])),
                ("strides", AttrValue::Ints(vec![2, 1])),
                ("padding", "SAME".into()),
            ]),
        )
        .unwrap();
        assert_eq!(op.name(), name);
        let again = parse_op(name, attrs(&op.attrs())).unwrap();
        assert!(*again == *op);
        let e = parse_op(name, attrs(&[("padding", "SAME".into())]))
            .err()
            .unwrap();
        assert!(e.contains("ksize"), "{e}");
        let e = parse_op(
            name,
            attrs(&[
                ("ksize", AttrValue::Ints(vec![2, 2])),
                ("strides", AttrValue::Ints(vec![2, -1])),
                ("padding", "SAME".into()),
            ]),
        )
        .err()
        .unwrap();
        assert!(e.contains("strides"), "{e}");
    }
    let op = parse_op(
        "MaxPool",
        attrs(&[
            ("ksize", AttrValue::Ints(vec![2, 2])),
            ("strides", AttrValue::Ints(vec![2, 2])),
            ("padding", "VALID".into()),
        ]),
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<MaxPool>(),
        Some(&MaxPool::new(
            [2, 2],
            [2, 2],
            Padding::Valid,
            DataFormat::Nhwc
        ))
    );
}
