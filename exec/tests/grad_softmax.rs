//! Gradients of Softmax and LogSoftmax (random axes) and SoftmaxCrossEntropy against
//! central finite differences, and the kernels of `SoftmaxGrad` and
//! `SoftmaxCrossEntropyGrad` against float64 references written here, in every
//! float dtype, including logits far beyond exp's range; FusedAttention's gradient
//! against finite differences.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{
    FusedAttention, LogSoftmax, Softmax, SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad, SoftmaxGrad,
};
use ampgraph_graph::{DType, Op, Tensor};
use common::*;
use proptest::prelude::*;

/// Softmax of `xs` (shape `shape`) along `axis`, in f64, from the definition.
fn softmax_ref(xs: &[f64], shape: &[usize], axis: usize) -> Vec<f64> {
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer = xs.len() / (len * inner).max(1);
    let mut y = vec![0.0; xs.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * len + k) * inner + i;
            let m = (0..len)
                .map(|k| xs[at(k)])
                .fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..len).map(|k| (xs[at(k)] - m).exp()).sum();
            for k in 0..len {
                y[at(k)] = (xs[at(k)] - m).exp() / z;
            }
        }
    }
    y
}

/// A shape of rank 1..=3 and an axis of it, written either way.
fn shape_and_axis() -> impl Strategy<Value = (Vec<usize>, i64)> {
    prop::collection::vec(1usize..=4, 1..=3).prop_flat_map(|s| {
        let r = s.len() as i64;
        (Just(s), -r..r)
    })
}

fn labels(dtype: DType, n: usize, c: usize, rng: &mut Gen) -> (Tensor, Vec<usize>) {
    let l: Vec<usize> = (0..n).map(|_| rng.below(c)).collect();
    let v: Vec<f64> = l.iter().map(|&k| k as f64).collect();
    (Tensor::from_f64(dtype, vec![n], &v).unwrap(), l)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// FusedAttention's rule (FusedAttentionGrad's CPU kernel) against central
    /// differences of its output `o`, causal or not, with or without a key bias
    /// (finite values, or -inf on the keys after the first); `lse` is a saved
    /// statistic with no gradient.
    #[test]
    fn fused_attention_gradient_matches_finite_differences(
        (b, h, sq, sk, d) in (1usize..=2, 1usize..=2, 1usize..=4, 1usize..=5, 1usize..=3),
        scale in 0.1f64..2.0,
        causal in any::<bool>(),
        key_bias in prop::option::of((any::<bool>(), any::<bool>())),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let q = t64(&[b, sq, h, d], &rng.vec(b * sq * h * d, -2.0, 2.0));
        let k = t64(&[b, sk, h, d], &rng.vec(b * sk * h * d, -2.0, 2.0));
        let v = t64(&[b, sk, h, d], &rng.vec(b * sk * h * d, -1.0, 1.0));
        let mut inputs = vec![q, k, v];
        if let Some((per_batch, padded)) = key_bias {
            let rows = if per_batch { b } else { 1 };
            let mut values = rng.vec(rows * sk, -1.0, 1.0);
            if padded {
                values.iter_mut().enumerate().filter(|(j, _)| j % sk > 0).step_by(2).for_each(|(_, x)| *x = f64::NEG_INFINITY);
            }
            inputs.push(t64(&[rows, 1, 1, sk], &values));
        }
        let op = FusedAttention { scale, causal, key_bias: key_bias.is_some(), packed: false, dropout: None };
        let err = check_output0(Box::new(op), &inputs, &[0, 1, 2], seed);
        prop_assert!(err < GRAD_TOL, "relative error {err:e}");
    }

    #[test]
    fn softmax_gradients_match_finite_differences(
        (shape, axis) in shape_and_axis(),
        seed in any::<u64>(),
    ) {
        let x = t64(&shape, &Gen(seed).vec(numel(&shape), -3.0, 3.0));
        assert_grad(Box::new(Softmax { axis }), std::slice::from_ref(&x), seed);
        assert_grad(Box::new(LogSoftmax { axis }), &[x], seed);
    }

    #[test]
    fn cross_entropy_gradient_matches_finite_differences(
        n in 1usize..=4,
        c in 1usize..=5,
        wide in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let x = t64(&[n, c], &rng.vec(n * c, -3.0, 3.0));
        let (l, _) = labels(if wide { DType::I64 } else { DType::I32 }, n, c, &mut rng);
        assert_grad(Box::new(SoftmaxCrossEntropy), &[x, l], seed);
    }

    #[test]
    fn softmax_grad_kernel_matches_reference(
        (shape, axis) in shape_and_axis(),
        log in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let xs = rng.vec(numel(&shape), -4.0, 4.0);
        let dys = rng.vec(numel(&shape), -2.0, 2.0);
        let ax = (axis + shape.len() as i64) as usize % shape.len();
        let p = softmax_ref(&xs, &shape, ax);
        let ys: Vec<f64> = if log { p.iter().map(|v| v.ln()).collect() } else { p };
        let op = SoftmaxGrad { axis, log };
        let len = shape[ax];
        let inner: usize = shape[ax + 1..].iter().product();
        for dtype in FLOATS {
            let (y, yv) = stored(dtype, &shape, &ys);
            let (dy, gv) = stored(dtype, &shape, &dys);
            let mut want = vec![0.0; yv.len()];
            // The size of the terms each result is a difference of: rounding errors are
            // relative to it, not to the (possibly cancelled) result.
            let mut terms = vec![0.0; yv.len()];
            for o in 0..yv.len() / (len * inner) {
                for i in 0..inner {
                    let at = |k: usize| (o * len + k) * inner + i;
                    let sum: f64 = (0..len).map(|k| gv[at(k)]).sum();
                    let dot: f64 = (0..len).map(|k| gv[at(k)] * yv[at(k)]).sum();
                    let abs_sum: f64 = (0..len).map(|k| gv[at(k)].abs()).sum();
                    for k in 0..len {
                        let (g, y) = (gv[at(k)], yv[at(k)]);
                        (want[at(k)], terms[at(k)]) = if log {
                            (g - y.exp() * sum, g.abs() + y.exp() * abs_sum)
                        } else {
                            (y * (g - dot), y.abs() * (g.abs() + abs_sum))
                        };
                    }
                }
            }
            let got = run(&op, &[&y, &dy]).to_f64_vec();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let tol = rtol(dtype) * (w.abs() + terms[i] + 1e-2);
                assert!((g - w).abs() <= tol, "{op:?} on {shape:?} {dtype}: element {i}: got {g}, want {w} (tolerance {tol:e})");
            }
        }
    }

    #[test]
    fn cross_entropy_grad_kernel_matches_reference(
        n in 1usize..=5,
        c in 1usize..=6,
        scale in prop::sample::select(vec![1.0, 30.0, 1e4]),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let xs = rng.vec(n * c, -scale, scale);
        let dloss = rng.uniform(-2.0, 2.0);
        for dtype in FLOATS {
            let (logits, xv) = stored(dtype, &[n, c], &xs);
            let (d, dv) = stored(dtype, &[], &[dloss]);
            let (l, classes) = labels(DType::I64, n, c, &mut rng);
            let p = softmax_ref(&xv, &[n, c], 1);
            let want: Vec<f64> = (0..n * c)
                .map(|i| {
                    let onehot = if classes[i / c] == i % c { 1.0 } else { 0.0 };
                    (p[i] - onehot) * dv[0] / n as f64
                })
                .collect();
            let got = run(&SoftmaxCrossEntropyGrad, &[&logits, &l, &d]);
            check_close(&format!("SoftmaxCrossEntropyGrad [{n}, {c}] x{scale}"), dtype, 1e-2, &got.to_f64_vec(), &want);
        }
    }
}

#[test]
fn huge_logits_give_finite_gradients() {
    for dtype in FLOATS {
        let big = if dtype == DType::F16 { 6e4 } else { 1e30 };
        let (x, _) = stored(dtype, &[2, 3], &[big, -big, 0.0, big, big, -big]);
        let (d, _) = stored(dtype, &[], &[1.0]);
        let l = Tensor::from_f64(DType::I32, vec![2], &[1.0, 0.0]).unwrap();
        let got = run(&SoftmaxCrossEntropyGrad, &[&x, &l, &d]).to_f64_vec();
        assert_eq!(got, [0.5, -0.5, 0.0, -0.25, 0.25, 0.0], "{dtype}");
        let y = run(&Softmax { axis: -1 }, &[&x]);
        let g = run(
            &SoftmaxGrad {
                axis: -1,
                log: false,
            },
            &[&y, &x],
        )
        .to_f64_vec();
        assert!(g.iter().all(|v| v.is_finite()), "{dtype}: {g:?}");
    }
}

#[test]
fn gradients_stay_in_half_precision() {
    for dtype in [DType::F16, DType::BF16] {
        let (x, _) = stored(dtype, &[2, 3], &[0.5, -1.0, 2.0, 1.5, 0.0, -0.5]);
        for op in [
            Box::new(Softmax { axis: 0 }) as Box<dyn Op>,
            Box::new(LogSoftmax { axis: -1 }),
        ] {
            let grads = graph_gradients(op, std::slice::from_ref(&x));
            assert_eq!(grads[0].ty(), x.ty());
        }
        let l = Tensor::from_f64(DType::I32, vec![2], &[2.0, 0.0]).unwrap();
        let grads = graph_gradients(Box::new(SoftmaxCrossEntropy), &[x.clone(), l]);
        assert_eq!(grads.len(), 1, "labels get no gradient");
        assert_eq!(grads[0].ty(), x.ty());
        let rows: Vec<f64> = grads[0]
            .to_f64_vec()
            .chunks(3)
            .map(|r| r.iter().sum())
            .collect();
        assert!(
            rows.iter().all(|s| s.abs() < 1e-2),
            "each row of dlogits sums to 0: {rows:?}"
        );
    }
}

#[test]
fn attrs_round_trip_and_errors() {
    for axis in [-1, 0, 2] {
        for log in [false, true] {
            assert_round_trip(&SoftmaxGrad { axis, log });
        }
    }
    assert_round_trip(&SoftmaxCrossEntropyGrad);
    let op = parse("SoftmaxGrad", &[]).unwrap();
    assert_eq!(
        op.downcast_ref::<SoftmaxGrad>(),
        Some(&SoftmaxGrad {
            axis: -1,
            log: false
        })
    );
    assert!(parse("SoftmaxGrad", &[("log", AttrValue::Int(1))])
        .unwrap_err()
        .contains("log"));
    assert!(
        parse("SoftmaxCrossEntropyGrad", &[("axis", AttrValue::Int(1))])
            .unwrap_err()
            .contains("unknown attr 'axis'")
    );

    let f = |s: &[usize]| tt(DType::F32, s);
    let sg = SoftmaxGrad {
        axis: -1,
        log: true,
    };
    assert!(infer_err(&sg, &[f(&[2, 3]), f(&[3])]).contains("dy has shape"));
    assert!(infer_err(&sg, &[f(&[2]), tt(DType::F16, &[2])]).contains("input 1 is f16"));
    assert!(infer_err(&sg, &[tt(DType::I32, &[2]), tt(DType::I32, &[2])]).contains("float"));
    assert!(infer_err(
        &SoftmaxGrad {
            axis: 2,
            log: false
        },
        &[f(&[2, 3]), f(&[2, 3])]
    )
    .contains("out of range"));
    assert!(infer_err(&sg, &[f(&[]), f(&[])]).contains("out of range"));

    let ce = SoftmaxCrossEntropyGrad;
    let i = |s: &[usize]| tt(DType::I32, s);
    assert!(infer_err(&ce, &[f(&[2, 3]), i(&[2]), f(&[1])]).contains("scalar"));
    assert!(infer_err(&ce, &[f(&[2, 3]), i(&[2]), tt(DType::F64, &[])]).contains("dloss is f64"));
    assert!(infer_err(&ce, &[f(&[2, 3]), f(&[2]), f(&[])]).contains("integer class indices"));
    assert!(infer_err(&ce, &[f(&[2, 3]), i(&[3]), f(&[])]).contains("labels have shape"));
    assert!(infer_err(&ce, &[f(&[6]), i(&[6]), f(&[])]).contains("rank 2"));
    assert!(infer_err(&ce, &[f(&[2, 3]), i(&[2])]).contains("3 inputs"));
    assert_eq!(ce.typed_inputs(3), [0, 2]);

    let x = t64(&[2, 3], &[0.0; 6]);
    let d = t64(&[], &[1.0]);
    let bad = Tensor::from_f64(DType::I64, vec![2], &[0.0, 3.0]).unwrap();
    let e = ce.eval(&[&x, &bad, &d]).unwrap_err();
    assert!(e.contains("labels[1] = 3 is out of range [0, 3)"), "{e}");
    let neg = Tensor::from_f64(DType::I32, vec![2], &[-1.0, 0.0]).unwrap();
    assert!(ce.eval(&[&x, &neg, &d]).is_err());
    assert!(ce.eval(&[&x, &neg]).is_err());
    assert!(sg.eval(&[&x, &t64(&[3], &[0.0; 3])]).is_err());
    // An empty batch: no rows, no division by zero surfacing.
    let empty = t64(&[0, 3], &[]);
    let no_labels = Tensor::from_f64(DType::I32, vec![0], &[]).unwrap();
    assert_eq!(run(&ce, &[&empty, &no_labels, &d]).shape(), [0, 3]);
}
