//! Elementwise ops (unary, broadcasting binary, BiasAdd) and Cast against an
//! independent float64 reference: every formula is restated here, in f64, from the
//! definitions (erf by its Taylor series), never by calling the library's kernels.
//!
//! Tolerance per dtype, for reference value r (computed from the inputs as stored):
//!   |got - r| <= rtol(dtype) * (|r| + floor) + tiny(dtype)
//! with rtol = 1e-12 (f64), 1e-5 (f32), 2e-3 (f16), 1.6e-2 (bf16): one rounding to the
//! storage dtype plus a few ulps of f32 (or f64) compute. `floor` is the value scale
//! below which errors count as absolute: 1e-3 for unary functions (f32 libm results
//! of functions such as Gelu lose relative accuracy near their zeros and tails),
//! 1e-9 for the binary ops and BiasAdd (correctly rounded arithmetic).
//! Cast must round exactly as IEEE round-to-nearest-even, checked bit for bit
//! against a rounding function written here.

mod common;

use ampgraph_graph::ops::{BiasAdd, Binary, BinaryKind, Cast, DataFormat, Unary, UnaryKind};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::Rng;
use common::*;
use proptest::prelude::*;

fn check(what: &str, dtype: DType, floor: f64, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        let tol = rtol(dtype) * (r.abs() + floor) + tiny(dtype);
        assert!(
            (g - r).abs() <= tol || (g.is_nan() && r.is_nan()) || g == r,
            "{what} {dtype}: element {i}: got {g}, want {r} (tolerance {tol:e})"
        );
    }
}

// ---- reference functions, from their definitions ----

/// erf by its Maclaurin series; accurate to ~1e-15 for |x| <= 3.
fn erf_ref(x: f64) -> f64 {
    let x2 = x * x;
    let mut term = x; // (-1)^n x^(2n+1) / n!
    let mut sum = 0.0;
    for n in 0..200 {
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-17 * sum.abs() {
            break;
        }
        term *= -x2 / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

const SELU_ALPHA: f64 = 1.6732632423543772848170429916717;
const SELU_SCALE: f64 = 1.0507009873554804934193349852946;

fn unary_ref(kind: UnaryKind, x: f64) -> f64 {
    use UnaryKind::*;
    match kind {
        Relu => {
            if x > 0.0 {
                x
            } else {
                0.0
            }
        }
        Relu6 => x.clamp(0.0, 6.0),
        Elu => {
            if x > 0.0 {
                x
            } else {
                x.exp() - 1.0
            }
        }
        Selu => {
            SELU_SCALE
                * if x > 0.0 {
                    x
                } else {
                    SELU_ALPHA * (x.exp() - 1.0)
                }
        }
        Gelu { approximate: false } => 0.5 * x * (1.0 + erf_ref(x / 2f64.sqrt())),
        Gelu { approximate: true } => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
        }
        LeakyRelu { alpha } => {
            if x > 0.0 {
                x
            } else {
                alpha * x
            }
        }
        Tanh => {
            let (e, f) = (x.exp(), (-x).exp());
            (e - f) / (e + f)
        }
        Sigmoid => 1.0 / (1.0 + (-x).exp()),
        HardSigmoid => (x + 3.0).clamp(0.0, 6.0) / 6.0,
        HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
        Exp => x.exp(),
        Log => x.ln(),
        Log1p => (1.0 + x).ln(),
        Sqrt => x.sqrt(),
        Rsqrt => 1.0 / x.sqrt(),
        Square => x * x,
        Neg => -x,
        Abs => x.abs(),
        Erf => erf_ref(x),
        Sin => x.sin(),
        Cos => x.cos(),
        Softplus => (1.0 + x.exp()).ln(),
        Reciprocal => 1.0 / x,
        Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        Identity => x,
    }
}

fn binary_ref(kind: BinaryKind, a: f64, b: f64) -> f64 {
    match kind {
        BinaryKind::Add => a + b,
        BinaryKind::Sub => a - b,
        BinaryKind::Mul => a * b,
        BinaryKind::Div => a / b,
        BinaryKind::Maximum => {
            if a >= b {
                a
            } else {
                b
            }
        }
        BinaryKind::Minimum => {
            if a <= b {
                a
            } else {
                b
            }
        }
        BinaryKind::Pow => (b * a.ln()).exp(),
        BinaryKind::SquaredDifference => (a - b) * (a - b),
    }
}

/// The input range each unary op is tested on.
fn unary_domain(kind: UnaryKind) -> (f64, f64) {
    use UnaryKind::*;
    match kind {
        Log | Sqrt | Rsqrt | Reciprocal => (0.05, 4.0),
        Log1p => (-0.9, 3.0),
        Exp => (-5.0, 5.0),
        Gelu { .. } | Erf => (-2.5, 2.5),
        Relu6 => (-2.0, 8.0),
        _ => (-3.0, 3.0),
    }
}

fn all_unary() -> Vec<UnaryKind> {
    use UnaryKind::*;
    vec![
        Relu,
        Relu6,
        Elu,
        Selu,
        Gelu { approximate: false },
        Gelu { approximate: true },
        LeakyRelu { alpha: 0.2 },
        LeakyRelu { alpha: 0.01 },
        Tanh,
        Sigmoid,
        HardSigmoid,
        HardSwish,
        Exp,
        Log,
        Log1p,
        Sqrt,
        Rsqrt,
        Square,
        Neg,
        Abs,
        Erf,
        Softplus,
        Reciprocal,
        Sign,
        Identity,
    ]
}

#[test]
fn erf_reference_is_accurate() {
    // Known values (Abramowitz & Stegun table 7.1 / high-precision tables).
    assert!((erf_ref(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
    assert!((erf_ref(1.0) - 0.842_700_792_949_714_9).abs() < 1e-15);
    assert!((erf_ref(2.0) - 0.995_322_265_018_952_7).abs() < 1e-15);
    assert!((erf_ref(-2.5) + 0.999_593_047_982_555).abs() < 1e-14);
}

#[test]
fn unary_ops_match_reference() {
    let mut rng = Rng(21);
    for kind in all_unary() {
        let (lo, hi) = unary_domain(kind);
        let mut vals = rng.vals(257, lo, hi);
        // Exact points where functions change form.
        if lo < 0.0 && hi > 0.0 {
            vals.extend([0.0, 1.0, -1.0]);
        }
        for dtype in FLOATS {
            let (x, xs) = input(dtype, &[vals.len()], &vals);
            let y = run(&Unary::new(kind), &[&x]);
            assert_eq!(y.dtype(), dtype);
            let want: Vec<f64> = xs.iter().map(|&v| unary_ref(kind, v)).collect();
            check(&format!("{kind:?}"), dtype, 1e-3, &y.to_f64_vec(), &want);
        }
    }
}

#[test]
fn unary_by_hand_and_edge_values() {
    let t = |v: &[f64]| Tensor::from_f64(DType::F32, [v.len()], v).unwrap();
    let eval = |k: UnaryKind, v: &[f64]| run(&Unary::new(k), &[&t(v)]).to_f64_vec();
    assert_eq!(eval(UnaryKind::Relu, &[-2.0, 0.0, 3.0]), [0.0, 0.0, 3.0]);
    assert_eq!(eval(UnaryKind::Relu6, &[-1.0, 3.0, 9.0]), [0.0, 3.0, 6.0]);
    assert_eq!(eval(UnaryKind::Sign, &[-0.5, 0.0, 7.0]), [-1.0, 0.0, 1.0]);
    assert_eq!(eval(UnaryKind::Square, &[-3.0]), [9.0]);
    // Softplus does not overflow for large inputs.
    assert_eq!(eval(UnaryKind::Softplus, &[100.0]), [100.0]);
    assert_eq!(eval(UnaryKind::Sigmoid, &[0.0]), [0.5]);
    assert_eq!(eval(UnaryKind::Exp, &[0.0]), [1.0]);
    assert!(eval(UnaryKind::Log, &[-1.0])[0].is_nan());
    assert_eq!(eval(UnaryKind::Log, &[0.0]), [f64::NEG_INFINITY]);
    // Exp overflows f16 at ln(65504) ~ 11.09 but not f32.
    let x16 = Tensor::from_f64(DType::F16, [1], &[12.0]).unwrap();
    let y = run(&Unary::new(UnaryKind::Exp), &[&x16]).to_f64_vec();
    assert_eq!(y, [f64::INFINITY]);
    // tanh-GELU keeps f32's relative accuracy below zero, where 0.5 x (1 + tanh u)
    // cancels (that form was 8e-5 off at -3.5, 1.5e-4 at -4.25 and 1.0 at -5.5).
    let xs = [-5.5, -4.25, -3.5, -2.0];
    let gelu = eval(UnaryKind::Gelu { approximate: true }, &xs);
    for (&x, y) in xs.iter().zip(gelu) {
        let want = unary_ref(UnaryKind::Gelu { approximate: true }, x);
        assert!(
            (y - want).abs() <= 1e-6 * want.abs(),
            "gelu_tanh({x}) = {y}, not {want}"
        );
    }
    // Identity accepts any dtype; the others want floats.
    let ints = Tensor::new([2], ampgraph_graph::Data::I32(vec![1, -2])).unwrap();
    assert_eq!(run(&Unary::new(UnaryKind::Identity), &[&ints]), ints);
    let e = Unary::new(UnaryKind::Relu)
        .infer(&[&TensorType::new(DType::I32, vec![2])])
        .unwrap_err();
    assert!(e.contains("float"), "{e}");
}

/// Naive broadcasting: for each output multi-index, the operand's element.
fn broadcast_ref(
    kind: BinaryKind,
    a: &[f64],
    a_shape: &[usize],
    b: &[f64],
    b_shape: &[usize],
) -> (Vec<usize>, Vec<f64>) {
    let rank = a_shape.len().max(b_shape.len());
    let pad = |s: &[usize]| {
        let mut v = vec![1; rank - s.len()];
        v.extend_from_slice(s);
        v
    };
    let (pa, pb) = (pad(a_shape), pad(b_shape));
    let out: Vec<usize> = (0..rank)
        .map(|i| if pa[i] == 1 { pb[i] } else { pa[i] })
        .collect();
    let n: usize = out.iter().product();
    let mut vals = Vec::with_capacity(n);
    for lin in 0..n {
        let mut idx = vec![0; rank];
        let mut rem = lin;
        for ax in (0..rank).rev() {
            idx[ax] = rem % out[ax];
            rem /= out[ax];
        }
        let flat = |shape: &[usize]| {
            let mut f = 0;
            for ax in 0..rank {
                let i = if shape[ax] == 1 { 0 } else { idx[ax] };
                f = f * shape[ax] + i;
            }
            f
        };
        vals.push(binary_ref(kind, a[flat(&pa)], b[flat(&pb)]));
    }
    (out, vals)
}

/// Operand values for `kind`: Pow wants a positive base, Div a divisor away from 0.
fn binary_operands(kind: BinaryKind, rng: &mut Rng, na: usize, nb: usize) -> (Vec<f64>, Vec<f64>) {
    match kind {
        BinaryKind::Pow => (rng.vals(na, 0.1, 3.0), rng.vals(nb, -2.0, 2.0)),
        BinaryKind::Div => {
            let b = rng
                .vals(nb, 0.2, 2.0)
                .into_iter()
                .map(|v| if rng.next_u64() % 2 == 0 { v } else { -v })
                .collect();
            (rng.vals(na, -3.0, 3.0), b)
        }
        _ => (rng.vals(na, -3.0, 3.0), rng.vals(nb, -3.0, 3.0)),
    }
}

fn check_binary(
    kind: BinaryKind,
    dtype: DType,
    a_shape: &[usize],
    b_shape: &[usize],
    rng: &mut Rng,
) {
    let (na, nb) = (a_shape.iter().product(), b_shape.iter().product());
    let (av, bv) = binary_operands(kind, rng, na, nb);
    let (a, av) = input(dtype, a_shape, &av);
    let (b, bv) = input(dtype, b_shape, &bv);
    let y = run(&Binary::new(kind), &[&a, &b]);
    let (shape, want) = broadcast_ref(kind, &av, a_shape, &bv, b_shape);
    assert_eq!(y.shape(), &shape[..], "{kind:?} {a_shape:?} {b_shape:?}");
    check(
        &format!("{kind:?} {a_shape:?} {b_shape:?}"),
        dtype,
        1e-9,
        &y.to_f64_vec(),
        &want,
    );
}

#[test]
fn binary_ops_match_reference() {
    let mut rng = Rng(31);
    let shapes: &[(&[usize], &[usize])] = &[
        (&[17], &[17]),
        (&[3, 4], &[4]),
        (&[3, 1], &[1, 5]),
        (&[2, 3, 4], &[]),
        (&[], &[6]),
        (&[2, 1, 4], &[3, 1]),
        (&[4, 0], &[4, 1]),
    ];
    for kind in BinaryKind::ALL {
        for dtype in FLOATS {
            for &(sa, sb) in shapes {
                check_binary(kind, dtype, sa, sb, &mut rng);
            }
        }
    }
}

#[test]
fn binary_by_hand_and_errors() {
    let t = |s: &[usize], v: &[f64]| Tensor::from_f64(DType::F32, s.to_vec(), v).unwrap();
    let y = run(
        &Binary::new(BinaryKind::Sub),
        &[&t(&[2, 2], &[10., 20., 30., 40.]), &t(&[2], &[1., 2.])],
    );
    assert_eq!(y.to_f64_vec(), [9., 18., 29., 38.]);
    let y = run(
        &Binary::new(BinaryKind::Mul),
        &[&t(&[2, 1], &[2., 3.]), &t(&[3], &[1., 10., 100.])],
    );
    assert_eq!(y.shape(), &[2, 3]);
    assert_eq!(y.to_f64_vec(), [2., 20., 200., 3., 30., 300.]);
    // NaN wins in Maximum/Minimum.
    let y = run(
        &Binary::new(BinaryKind::Maximum),
        &[&t(&[2], &[f64::NAN, 1.0]), &t(&[2], &[0.0, f64::NAN])],
    );
    assert!(y.to_f64_vec().iter().all(|v| v.is_nan()));

    let op = Binary::new(BinaryKind::Add);
    let f32t = |s: &[usize]| TensorType::new(DType::F32, s.to_vec());
    let e = op.infer(&[&f32t(&[2, 3]), &f32t(&[4])]).unwrap_err();
    assert!(
        e.contains("[2, 3]") && e.contains("[4]") && e.contains("broadcast"),
        "{e}"
    );
    let e = op
        .infer(&[&f32t(&[2]), &TensorType::new(DType::F16, vec![2])])
        .unwrap_err();
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
}

#[test]
fn bias_add_both_formats() {
    let mut rng = Rng(41);
    for dtype in FLOATS {
        // (x shape, format): the channel axis is last for NHWC, 1 for NCHW.
        let cases: &[(&[usize], DataFormat)] = &[
            (&[5, 7], DataFormat::Nhwc),
            (&[2, 3, 4, 6], DataFormat::Nhwc),
            (&[2, 6, 3, 4], DataFormat::Nchw),
            (&[3, 5, 7], DataFormat::Nchw),
            (&[4, 3], DataFormat::Nchw),
        ];
        for &(shape, f) in cases {
            let axis = match f {
                DataFormat::Nhwc => shape.len() - 1,
                DataFormat::Nchw => 1,
            };
            let c = shape[axis];
            let n: usize = shape.iter().product();
            let (x, xv) = input(dtype, shape, &rng.vals(n, -3.0, 3.0));
            let (b, bv) = input(dtype, &[c], &rng.vals(c, -3.0, 3.0));
            let y = run(&BiasAdd { data_format: f }, &[&x, &b]);
            let inner: usize = shape[axis + 1..].iter().product();
            let want: Vec<f64> = (0..n).map(|i| xv[i] + bv[(i / inner) % c]).collect();
            check(
                &format!("BiasAdd {shape:?} {f:?}"),
                dtype,
                1e-9,
                &y.to_f64_vec(),
                &want,
            );
        }
    }
    // By hand, NCHW: [1, 2, 1, 2] + [10, 20].
    let x = Tensor::from_f64(DType::F32, [1, 2, 1, 2], &[1., 2., 3., 4.]).unwrap();
    let b = Tensor::from_f64(DType::F32, [2], &[10., 20.]).unwrap();
    let y = run(
        &BiasAdd {
            data_format: DataFormat::Nchw,
        },
        &[&x, &b],
    );
    assert_eq!(y.to_f64_vec(), [11., 12., 23., 24.]);
    let y = run(
        &BiasAdd {
            data_format: DataFormat::Nhwc,
        },
        &[&x, &b],
    );
    assert_eq!(y.to_f64_vec(), [11., 22., 13., 24.]);
    // Mismatched bias.
    let e = BiasAdd {
        data_format: DataFormat::Nchw,
    }
    .infer(&[
        &TensorType::new(DType::F32, vec![1, 3, 4, 4]),
        &TensorType::new(DType::F32, vec![4]),
    ])
    .unwrap_err();
    assert!(e.contains("3 channels"), "{e}");
}

/// IEEE round-to-nearest-even of `x` to a binary format with `mant` fraction bits and
/// exponent range [emin, emax] (subnormals below emin, infinity above the maximum).
fn round_to_format(x: f64, mant: i32, emin: i32, emax: i32) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let biased = ((x.abs().to_bits() >> 52) & 0x7ff) as i32;
    assert!(biased > 0, "f64 subnormal inputs are not used here");
    let e = (biased - 1023).max(emin);
    let quantum = 2f64.powi(e - mant);
    let r = (x / quantum).round_ties_even() * quantum;
    let max = (2.0 - 2f64.powi(-mant)) * 2f64.powi(emax);
    if r.abs() > max {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

fn round_ref(x: f64, to: DType) -> f64 {
    match to {
        DType::F64 => x,
        DType::F32 => round_to_format(x, 23, -126, 127),
        DType::F16 => round_to_format(x, 10, -14, 15),
        DType::BF16 => round_to_format(x, 7, -126, 127),
        _ => unreachable!(),
    }
}

#[test]
fn cast_between_all_float_dtypes_rounds_to_nearest_even() {
    let mut rng = Rng(51);
    let mut vals = rng.vals(500, -4.0, 4.0);
    vals.extend(rng.vals(100, -1e5, 1e5)); // beyond f16's range: infinity
    vals.extend(rng.vals(100, -1e-6, 1e-6)); // f16 subnormals
    vals.extend([
        0.0,
        -0.0,
        1.0,
        65504.0,                    // f16 max
        65520.0,                    // rounds to f16 infinity (tie to even)
        65519.99,                   // rounds to f16 max
        1.0 + 2f64.powi(-11),       // f16 tie: to even (1.0)
        1.0 + 3.0 * 2f64.powi(-11), // f16 tie: to even (1 + 2^-9)
        1.0 + 2f64.powi(-8),        // bf16 tie: to even (1.0)
        1.0 + 3.0 * 2f64.powi(-8),  // bf16 tie: to even (1 + 2^-6)
        1.0 + 2f64.powi(-24),       // f32 tie
        2f64.powi(-25),             // half the smallest f16 subnormal: to 0
        3.0 * 2f64.powi(-25),       // to 2^-23
        1e39,                       // beyond f32: infinity
        f64::INFINITY,
        f64::NEG_INFINITY,
        1.0 / 3.0,
        std::f64::consts::PI,
    ]);
    for from in FLOATS {
        let (x, xs) = input(from, &[vals.len()], &vals);
        for to in FLOATS {
            let y = run(&Cast { to }, &[&x]);
            assert_eq!(y.dtype(), to);
            for (i, (&g, &s)) in y.to_f64_vec().iter().zip(&xs).enumerate() {
                let want = round_ref(s, to);
                assert!(
                    g.to_bits() == want.to_bits(),
                    "Cast {from} -> {to}: element {i} = {s:e}: got {g:e}, want {want:e}"
                );
            }
        }
        // NaN stays NaN.
        let nan = Tensor::from_f64(from, [1], &[f64::NAN]).unwrap();
        for to in FLOATS {
            assert!(run(&Cast { to }, &[&nan]).to_f64_vec()[0].is_nan());
        }
    }
    // The rounding helper itself, on values with known answers.
    assert_eq!(round_ref(65520.0, DType::F16), f64::INFINITY);
    assert_eq!(
        round_ref(1.0 + 3.0 * 2f64.powi(-11), DType::F16),
        1.0 + 2f64.powi(-9)
    );
    assert_eq!(round_ref(3.0 * 2f64.powi(-25), DType::F16), 2f64.powi(-23));
}

/// A broadcast-compatible pair of shapes drawn from one output shape.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(1usize..5, 0..5).prop_flat_map(|out| {
        let rank = out.len();
        let operand = {
            let out = out.clone();
            (0..=rank, prop::collection::vec(any::<bool>(), rank)).prop_map(move |(r, ones)| {
                (rank - r..rank)
                    .map(|i| if ones[i] { 1 } else { out[i] })
                    .collect::<Vec<usize>>()
            })
        };
        (operand.clone(), operand)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn prop_binary_broadcasting(
        (a_shape, b_shape) in broadcast_pair(),
        k in 0usize..8,
        d in 0usize..4,
        seed in any::<u64>(),
    ) {
        check_binary(BinaryKind::ALL[k], FLOATS[d], &a_shape, &b_shape, &mut Rng(seed));
    }
}
