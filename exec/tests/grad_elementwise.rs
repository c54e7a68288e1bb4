//! Gradients of the elementwise ops (every Unary kind, every Binary kind with
//! broadcasting, BiasAdd, Dropout) against central finite differences, and the kernels of the
//! gradient ops `UnaryGrad` and `BinaryGrad` against float64 references restated
//! here from the definitions (erf by its Taylor series), in every float dtype.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::GradBuilder;
use ampgraph_graph::ops::{
    BiasAdd, Binary, BinaryGrad, BinaryKind, DataFormat, Dropout, Unary, UnaryGrad, UnaryKind,
};
use ampgraph_graph::{DType, Graph, Op, Port, Tensor};
use common::*;
use proptest::prelude::*;

const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
const SELU_SCALE: f64 = 1.050_700_987_355_480_5;

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
        LeakyRelu { alpha: -0.5 },
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

/// A point of the kind's domain at least 0.01 from every kink and domain edge.
fn sample(kind: UnaryKind, rng: &mut Gen) -> f64 {
    use UnaryKind::*;
    match kind {
        Log | Sqrt | Rsqrt => rng.uniform(0.3, 3.0),
        Log1p => rng.uniform(-0.7, 3.0),
        Reciprocal => {
            let m = rng.uniform(0.3, 3.0);
            if rng.below(2) == 0 {
                m
            } else {
                -m
            }
        }
        Relu6 => rng.away(-2.0, 8.0, &[0.0, 6.0], 0.01),
        HardSigmoid | HardSwish => rng.away(-5.0, 5.0, &[-3.0, 3.0], 0.01),
        _ => rng.away(-3.0, 3.0, &[0.0], 0.01),
    }
}

fn erf(x: f64) -> f64 {
    // Taylor series, accurate to ~1e-14 absolute for |x| <= 3.
    let mut term = x;
    let mut sum = x;
    for n in 1..120 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// The derivative of each unary function, from its definition.
fn derivative(kind: UnaryKind, x: f64) -> f64 {
    use UnaryKind::*;
    let step = |c: bool| if c { 1.0 } else { 0.0 };
    match kind {
        Relu => step(x > 0.0),
        Relu6 => step(x > 0.0 && x < 6.0),
        Elu => {
            if x < 0.0 {
                x.exp()
            } else {
                1.0
            }
        }
        Selu => SELU_SCALE * if x < 0.0 { SELU_ALPHA * x.exp() } else { 1.0 },
        Gelu { approximate: false } => {
            0.5 * (1.0 + erf(x / 2f64.sqrt()))
                + x * (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt()
        }
        Gelu { approximate: true } => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let u = c * (x + 0.044715 * x.powi(3));
            let du = c * (1.0 + 3.0 * 0.044715 * x * x);
            0.5 * (1.0 + u.tanh()) + 0.5 * x * du / u.cosh().powi(2)
        }
        LeakyRelu { alpha } => {
            if x > 0.0 {
                1.0
            } else {
                alpha
            }
        }
        Tanh => 1.0 / x.cosh().powi(2),
        Sigmoid => (-x).exp() / (1.0 + (-x).exp()).powi(2),
        HardSigmoid => step(x > -3.0 && x < 3.0) / 6.0,
        // PyTorch's: x / 3 + 1/2 on [-3, 3].
        HardSwish => {
            if x < -3.0 {
                0.0
            } else if x <= 3.0 {
                x / 3.0 + 0.5
            } else {
                1.0
            }
        }
        Exp => x.exp(),
        Log => 1.0 / x,
        Log1p => 1.0 / (1.0 + x),
        Sqrt => 0.5 * x.powf(-0.5),
        Rsqrt => -0.5 * x.powf(-1.5),
        Square => 2.0 * x,
        Neg => -1.0,
        Abs => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        Erf => 2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp(),
        Sin => x.cos(),
        Cos => -x.sin(),
        Softplus => 1.0 / (1.0 + (-x).exp()),
        Reciprocal => -1.0 / (x * x),
        Sign => 0.0,
        Identity => 1.0,
    }
}

/// d(a op b)/d(operand wrt) times g, TensorFlow's conventions at ties and edges.
fn binary_grad(kind: BinaryKind, wrt: usize, a: f64, b: f64, g: f64) -> f64 {
    let first = wrt == 0;
    let to = |to_a: bool| if to_a == first { g } else { 0.0 };
    match kind {
        BinaryKind::Add => g,
        BinaryKind::Sub => to(true) - to(false),
        BinaryKind::Mul => g * if first { b } else { a },
        BinaryKind::Div => {
            if first {
                g / b
            } else {
                -g * a / (b * b)
            }
        }
        BinaryKind::Maximum => to(a >= b),
        BinaryKind::Minimum => to(a <= b),
        BinaryKind::Pow => {
            if first {
                if b == 0.0 {
                    0.0
                } else {
                    g * b * a.powf(b - 1.0)
                }
            } else if a > 0.0 {
                g * a.powf(b) * a.ln()
            } else {
                0.0
            }
        }
        BinaryKind::SquaredDifference => 2.0 * (a - b) * g * if first { 1.0 } else { -1.0 },
    }
}

/// Operand values away from each kind's kinks and domain edges.
fn binary_inputs(kind: BinaryKind, na: usize, nb: usize, rng: &mut Gen) -> (Vec<f64>, Vec<f64>) {
    match kind {
        BinaryKind::Div => {
            let b = (0..nb)
                .map(|_| rng.uniform(0.5, 2.0) * if rng.below(2) == 0 { 1.0 } else { -1.0 })
                .collect();
            (rng.vec(na, -2.0, 2.0), b)
        }
        BinaryKind::Pow => (rng.vec(na, 0.5, 2.0), rng.vec(nb, -2.0, 2.0)),
        // On interleaved grids: |a - b| >= 0.05 for every pair.
        BinaryKind::Maximum | BinaryKind::Minimum => (
            (0..na)
                .map(|_| (rng.below(40) as f64 - 20.0) * 0.1)
                .collect(),
            (0..nb)
                .map(|_| (rng.below(40) as f64 - 20.0) * 0.1 + 0.05)
                .collect(),
        ),
        _ => (rng.vec(na, -2.0, 2.0), rng.vec(nb, -2.0, 2.0)),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn unary_gradients_match_finite_differences(shape in shape(3, 3), seed in any::<u64>()) {
        let mut rng = Gen(seed);
        for kind in all_unary() {
            let xs: Vec<f64> = (0..numel(&shape)).map(|_| sample(kind, &mut rng)).collect();
            assert_grad(Box::new(Unary::new(kind)), &[t64(&shape, &xs)], seed);
        }
    }

    #[test]
    fn binary_gradients_match_finite_differences(
        (sa, sb) in broadcast_pair(3, 3),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        for kind in BinaryKind::ALL {
            let (a, b) = binary_inputs(kind, numel(&sa), numel(&sb), &mut rng);
            assert_grad(Box::new(Binary::new(kind)), &[t64(&sa, &a), t64(&sb, &b)], seed);
        }
    }

    #[test]
    fn bias_add_gradient_matches_finite_differences(
        shape in prop::collection::vec(1usize..=3, 2..=4),
        nchw in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let data_format = if nchw { DataFormat::Nchw } else { DataFormat::Nhwc };
        let c = if nchw { shape[1] } else { shape[shape.len() - 1] };
        let mut rng = Gen(seed);
        let x = t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0));
        let bias = t64(&[c], &rng.vec(c, -2.0, 2.0));
        assert_grad(Box::new(BiasAdd { data_format }), &[x, bias], seed);
    }

    #[test]
    fn binary_grad_kernel_matches_reference(
        (sa, sb) in broadcast_pair(3, 3),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let out = broadcast(&sa, &sb);
        for kind in BinaryKind::ALL {
            let (a, b) = binary_inputs(kind, numel(&sa), numel(&sb), &mut rng);
            let g = rng.vec(numel(&out), -2.0, 2.0);
            for wrt in 0..2 {
                check_binary_grad(kind, wrt, (&sa, &a), (&sb, &b), (&out, &g));
            }
        }
    }
}

/// The index into an operand of `shape` read at output multi-index `idx`.
fn operand_index(idx: &[usize], shape: &[usize]) -> usize {
    let off = idx.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (i, &d)| {
        acc * d + if d == 1 { 0 } else { idx[off + i] }
    })
}

fn check_binary_grad(
    kind: BinaryKind,
    wrt: usize,
    (sa, a): (&[usize], &[f64]),
    (sb, b): (&[usize], &[f64]),
    (out, g): (&[usize], &[f64]),
) {
    for dtype in FLOATS {
        let (ta, a) = stored(dtype, sa, a);
        let (tb, b) = stored(dtype, sb, b);
        let (tg, g) = stored(dtype, out, g);
        let want: Vec<f64> = (0..numel(out))
            .map(|i| {
                let idx = unravel(i, out);
                binary_grad(
                    kind,
                    wrt,
                    a[operand_index(&idx, sa)],
                    b[operand_index(&idx, sb)],
                    g[i],
                )
            })
            .collect();
        let got = run(&BinaryGrad::new(kind, wrt), &[&ta, &tb, &tg]);
        assert_eq!(got.shape(), out);
        check_close(
            &format!("BinaryGrad {kind:?} wrt {wrt} {sa:?} {sb:?}"),
            dtype,
            1e-3,
            &got.to_f64_vec(),
            &want,
        );
    }
}

/// Tolerance floor of the unary derivatives: 1 - tanh^2 and the Gelu tails cancel
/// in f32 near saturation, so errors below ~0.05 count as absolute.
const UNARY_FLOOR: f64 = 0.05;

#[test]
fn unary_grad_kernel_matches_reference_in_every_dtype() {
    let mut rng = Gen(7);
    for kind in all_unary() {
        let n = 64;
        let xs: Vec<f64> = (0..n).map(|_| sample(kind, &mut rng)).collect();
        let dys = rng.vec(n, -2.0, 2.0);
        for dtype in FLOATS {
            let (x, xv) = stored(dtype, &[8, 8], &xs);
            let (dy, gv) = stored(dtype, &[8, 8], &dys);
            let want: Vec<f64> = xv
                .iter()
                .zip(&gv)
                .map(|(&x, &g)| derivative(kind, x) * g)
                .collect();
            let got = run(&UnaryGrad::new(kind), &[&x, &dy]);
            check_close(
                &format!("UnaryGrad {kind:?}"),
                dtype,
                UNARY_FLOOR,
                &got.to_f64_vec(),
                &want,
            );
        }
    }
}

#[test]
fn unary_grad_kinks_follow_tensorflow() {
    use UnaryKind::*;
    let at = |kind: UnaryKind, x: f64| {
        let x = t64(&[1], &[x]);
        run(&UnaryGrad::new(kind), &[&x, &t64(&[1], &[1.0])]).to_f64_vec()[0]
    };
    assert_eq!(at(Relu, 0.0), 0.0);
    assert_eq!(at(Relu6, 0.0), 0.0);
    assert_eq!(at(Relu6, 6.0), 0.0);
    assert_eq!(at(Abs, 0.0), 0.0);
    assert_eq!(at(Sign, 0.0), 0.0);
    assert_eq!(at(LeakyRelu { alpha: 0.2 }, 0.0), 0.2);
    assert_eq!(at(Elu, 0.0), 1.0);
    assert_eq!(at(Selu, 0.0), SELU_SCALE);
    // A zero derivative masks the incoming gradient entirely, even inf or NaN.
    for dy in [f64::INFINITY, f64::NAN] {
        let x = t64(&[2], &[-1.0, 7.0]);
        let got = run(&UnaryGrad::new(Relu6), &[&x, &t64(&[2], &[dy, dy])]);
        assert_eq!(got.to_f64_vec(), [0.0, 0.0]);
    }
}

#[test]
fn unary_grad_survives_extreme_inputs() {
    let xs = [
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        6.0,
        1e30,
        -1e30,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
    ];
    for kind in all_unary() {
        for dtype in FLOATS {
            let (x, xv) = stored(dtype, &[xs.len()], &xs);
            let (dy, _) = stored(dtype, &[xs.len()], &[1.0; 10]);
            let got = run(&UnaryGrad::new(kind), &[&x, &dy]).to_f64_vec();
            // Saturating functions have finite derivatives at +-inf.
            for (&x, &d) in xv.iter().zip(&got) {
                if matches!(
                    kind,
                    UnaryKind::Gelu { .. }
                        | UnaryKind::Tanh
                        | UnaryKind::Sigmoid
                        | UnaryKind::Erf
                        | UnaryKind::Softplus
                ) && !x.is_nan()
                {
                    assert!(d.is_finite(), "{kind:?} {dtype}: derivative at {x} is {d}");
                }
            }
        }
    }
}

#[test]
fn binary_grad_ties_and_edges() {
    let t = |v: &[f64]| t64(&[v.len()], v);
    let g = t(&[1.0, 1.0]);
    // Ties go to the first operand, as TensorFlow's x >= y / x <= y masks.
    for kind in [BinaryKind::Maximum, BinaryKind::Minimum] {
        let (a, b) = (t(&[2.0, 2.0]), t(&[2.0, 1.0]));
        let da = run(&BinaryGrad::new(kind, 0), &[&a, &b, &g]).to_f64_vec();
        let db = run(&BinaryGrad::new(kind, 1), &[&a, &b, &g]).to_f64_vec();
        assert_eq!(da[0], 1.0, "{kind:?}: a tie goes to a");
        assert_eq!(db[0], 0.0, "{kind:?}: a tie goes to a");
        assert_eq!(
            da[1] + db[1],
            1.0,
            "{kind:?}: the gradient goes to one operand"
        );
    }
    // Pow: d/db is 0 where a <= 0; d/da is 0 where b == 0 (even at a == 0).
    let (a, b) = (t(&[-2.0, 0.0]), t(&[2.0, 0.0]));
    let da = run(&BinaryGrad::new(BinaryKind::Pow, 0), &[&a, &b, &g]).to_f64_vec();
    let db = run(&BinaryGrad::new(BinaryKind::Pow, 1), &[&a, &b, &g]).to_f64_vec();
    assert_eq!(da, [-4.0, 0.0]);
    assert_eq!(db, [0.0, 0.0]);
}

#[test]
fn gradients_stay_in_half_precision() {
    let mut rng = Gen(11);
    for dtype in [DType::F16, DType::BF16] {
        for kind in all_unary() {
            let xs: Vec<f64> = (0..6).map(|_| sample(kind, &mut rng)).collect();
            let (x, xv) = stored(dtype, &[2, 3], &xs);
            let grads = graph_gradients(Box::new(Unary::new(kind)), &[x]);
            assert_eq!(grads[0].dtype(), dtype, "{kind:?}");
            let w = |i: usize| 0.25 + 0.5 * ((i % 5) as f64) / 4.0;
            let want: Vec<f64> = xv
                .iter()
                .enumerate()
                .map(|(i, &x)| derivative(kind, x) * w(i))
                .collect();
            // Three roundings (the weight, the product, the derivative) in the half type.
            let got = grads[0].to_f64_vec();
            for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
                let tol = 3.0 * rtol(dtype) * (r.abs() + UNARY_FLOOR);
                assert!(
                    (g - r).abs() <= tol,
                    "{kind:?} {dtype} [{i}]: got {g}, want {r}"
                );
            }
        }
        for kind in BinaryKind::ALL {
            let (a, b) = binary_inputs(kind, 6, 3, &mut rng);
            let (ta, _) = stored(dtype, &[2, 3], &a);
            let (tb, _) = stored(dtype, &[3], &b);
            let grads = graph_gradients(Box::new(Binary::new(kind)), &[ta, tb]);
            assert_eq!(
                grads[0].ty(),
                ampgraph_graph::TensorType::new(dtype, vec![2, 3])
            );
            assert_eq!(
                grads[1].ty(),
                ampgraph_graph::TensorType::new(dtype, vec![3])
            );
        }
        let (x, _) = stored(dtype, &[2, 3], &[1.0; 6]);
        let (bias, _) = stored(dtype, &[3], &[1.0; 3]);
        let grads = graph_gradients(
            Box::new(BiasAdd {
                data_format: DataFormat::Nhwc,
            }),
            &[x, bias],
        );
        assert_eq!(grads[1].dtype(), dtype);
        assert_eq!(grads[1].shape(), [3]);
    }
}

#[test]
fn gradient_op_attrs_round_trip_and_reject_bad_values() {
    for kind in all_unary() {
        assert_round_trip(&UnaryGrad::new(kind));
    }
    for kind in BinaryKind::ALL {
        for wrt in 0..2 {
            assert_round_trip(&BinaryGrad::new(kind, wrt));
        }
    }
    let s = |v: &str| AttrValue::Str(v.into());
    let err = |name: &str, attrs: &[(&str, AttrValue)]| parse(name, attrs).unwrap_err();
    assert!(err("UnaryGrad", &[]).contains("missing attr 'kind'"));
    assert!(err("UnaryGrad", &[("kind", s("Foo"))]).contains("unknown unary op 'Foo'"));
    assert!(err("UnaryGrad", &[("kind", AttrValue::Int(1))]).contains("kind"));
    assert!(err(
        "UnaryGrad",
        &[("kind", s("Relu")), ("alpha", AttrValue::Float(0.1))]
    )
    .contains("unknown attr 'alpha'"));
    let leaky = parse(
        "UnaryGrad",
        &[("kind", s("LeakyRelu")), ("alpha", AttrValue::Float(0.3))],
    )
    .unwrap();
    assert_eq!(
        leaky.downcast_ref::<UnaryGrad>(),
        Some(&UnaryGrad::new(UnaryKind::LeakyRelu { alpha: 0.3 }))
    );
    assert!(err("BinaryGrad", &[("kind", s("Mul"))]).contains("missing attr 'wrt'"));
    assert!(err("BinaryGrad", &[("wrt", AttrValue::Int(0))]).contains("missing attr 'kind'"));
    assert!(err(
        "BinaryGrad",
        &[("kind", s("Mul")), ("wrt", AttrValue::Int(2))]
    )
    .contains("0 or 1"));
    assert!(err(
        "BinaryGrad",
        &[("kind", s("Mul")), ("wrt", AttrValue::Int(-1))]
    )
    .contains("0 or 1"));
    assert!(err(
        "BinaryGrad",
        &[("kind", s("Relu")), ("wrt", AttrValue::Int(0))]
    )
    .contains("unknown binary op"));
}

#[test]
fn gradient_ops_reject_bad_shapes_and_dtypes() {
    let relu = UnaryGrad::new(UnaryKind::Relu);
    assert!(
        infer_err(&relu, &[tt(DType::F32, &[2, 3]), tt(DType::F32, &[3])]).contains("dy has shape")
    );
    assert!(
        infer_err(&relu, &[tt(DType::F32, &[2]), tt(DType::F16, &[2])]).contains("input 1 is f16")
    );
    assert!(infer_err(&relu, &[tt(DType::I32, &[2]), tt(DType::I32, &[2])]).contains("float"));
    assert!(infer_err(&relu, &[tt(DType::F32, &[2])]).contains("2 inputs"));
    let mul = BinaryGrad::new(BinaryKind::Mul, 1);
    let f = |s: &[usize]| tt(DType::F32, s);
    assert!(infer_err(&mul, &[f(&[2, 3]), f(&[3]), f(&[3])]).contains("dy has shape"));
    assert!(infer_err(&mul, &[f(&[2, 3]), f(&[2]), f(&[2, 3])]).contains("do not broadcast"));
    assert!(infer_err(&mul, &[f(&[2]), f(&[2]), tt(DType::F64, &[2])]).contains("input 2 is f64"));
    assert!(infer_err(
        &BinaryGrad::new(BinaryKind::Mul, 2),
        &[f(&[2]), f(&[2]), f(&[2])]
    )
    .contains("0 or 1"));
    // The kernels check too: no panic on inputs infer would refuse.
    let x = t64(&[2, 3], &[1.0; 6]);
    let short = t64(&[3], &[1.0; 3]);
    assert!(relu.eval(&[&x, &short]).is_err());
    assert!(mul.eval(&[&x, &short, &short]).is_err());
    assert!(mul.eval(&[&x]).is_err());
}

#[test]
fn rules_refuse_wrong_arity_without_panicking() {
    let mut g = Graph::new();
    let x: Port = g
        .add_node(
            "x",
            Box::new(ampgraph_graph::ops::Placeholder(tt(DType::F32, &[2]))),
            &[],
        )
        .unwrap()
        .into();
    let mut b = GradBuilder::new(&mut g, "t");
    let ops: Vec<Box<dyn Op>> = vec![
        Box::new(Unary::new(UnaryKind::Tanh)),
        Box::new(Binary::new(BinaryKind::Mul)),
        Box::new(BiasAdd {
            data_format: DataFormat::Nhwc,
        }),
    ];
    for op in ops {
        assert!(op.gradient(&mut b, &[], &[], &[Some(x)]).is_err(), "{op:?}");
        assert!(
            op.gradient(&mut b, &[x, x, x], &[], &[Some(x)]).is_err(),
            "{op:?}"
        );
    }
    // No incoming gradient: nothing to do.
    let none = Unary::new(UnaryKind::Tanh)
        .gradient(&mut b, &[x], &[], &[None])
        .unwrap();
    assert_eq!(none, vec![None]);
    let none = Unary::new(UnaryKind::Tanh)
        .gradient(&mut b, &[x], &[], &[])
        .unwrap();
    assert_eq!(none, vec![None]);
    // BiasAdd of a rank-1 x (refused by infer) is an error, not a panic.
    assert!(BiasAdd {
        data_format: DataFormat::Nchw
    }
    .gradient(&mut b, &[x, x], &[], &[Some(x)])
    .is_err());
    let _ = Tensor::scalar(DType::F32, 0.0);
}

/// Dropout's gradient (the same mask on the output's gradient) against finite
/// differences in `x` (the step count has none), at rates 0.3 and 0.9.
#[test]
fn dropout_gradient_matches_finite_differences() {
    let mut rng = Gen(11);
    for (rate, count) in [(0.3, 7.0), (0.9, 0.0)] {
        let x = t64(&[5, 13], &rng.vec(65, -2.0, 2.0));
        let op = Dropout::new(rate, 99).unwrap();
        let err = check_output0(Box::new(op), &[x, t64(&[], &[count])], &[0], 3);
        assert!(err < GRAD_TOL, "rate {rate}: relative error {err:e}");
    }
}
