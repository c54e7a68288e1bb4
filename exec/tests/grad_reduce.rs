//! Gradients of Sum, Mean, Max (random axes and keep_dims) and SumTo against central
//! finite differences, and the `ReduceGrad` kernel against a float64 reference
//! written here with plain loops, in every float dtype.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{Reduce, ReduceGrad, ReduceKind, SumTo};
use ampgraph_graph::{DType, Op};
use common::*;
use proptest::prelude::*;

/// A shape with a random reduction over it: axes `None` (all), or a random subset in
/// random order, each axis written either way (`i` or `i - rank`).
fn reduction(max_rank: usize) -> impl Strategy<Value = (Vec<usize>, Option<Vec<i64>>, bool)> {
    shape(max_rank, 3).prop_flat_map(|shape| {
        let r = shape.len();
        let axes = (
            any::<bool>(),
            prop::collection::vec((any::<bool>(), any::<bool>()), r),
            any::<u64>(),
        )
            .prop_map(move |(all, picks, order)| {
                (!all).then(|| {
                    Gen(order)
                        .perm(r)
                        .into_iter()
                        .filter(|&i| picks[i].0)
                        .map(|i| {
                            if picks[i].1 {
                                i as i64 - r as i64
                            } else {
                                i as i64
                            }
                        })
                        .collect()
                })
            });
        (Just(shape), axes, any::<bool>())
    })
}

/// Distinct values at least 0.09 apart, so Max has one maximum per slot and
/// finite differences never cross a tie.
fn distinct(n: usize, rng: &mut Gen) -> Vec<f64> {
    rng.perm(n)
        .into_iter()
        .map(|p| (p as f64 - n as f64 / 2.0) * 0.1 + rng.uniform(0.0, 0.01))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn reduce_gradients_match_finite_differences(
        (shape, axes, keep_dims) in reduction(3),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        for kind in ReduceKind::ALL {
            let xs = distinct(numel(&shape), &mut rng);
            let op = Reduce::new(kind, axes.clone(), keep_dims);
            assert_grad(Box::new(op), &[t64(&shape, &xs)], seed);
        }
    }

    #[test]
    fn sum_to_gradient_matches_finite_differences(
        (target, other) in broadcast_pair(3, 3),
        seed in any::<u64>(),
    ) {
        let x_shape = broadcast(&target, &other);
        let mut rng = Gen(seed);
        let x = t64(&x_shape, &rng.vec(numel(&x_shape), -2.0, 2.0));
        assert_grad(Box::new(SumTo { shape: target }), &[x], seed);
    }

    #[test]
    fn reduce_grad_kernel_matches_reference(
        (shape, axes, keep_dims) in reduction(4),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        // Coarse values: Max sees ties, split evenly.
        let xs: Vec<f64> = (0..numel(&shape)).map(|_| rng.below(4) as f64 * 0.5 - 1.0).collect();
        for kind in ReduceKind::ALL {
            let op = ReduceGrad::new(kind, axes.clone(), keep_dims);
            check_reduce_grad(&op, &shape, &xs, &mut rng);
        }
    }
}

/// Reference: the output slot of each input element, and the output shape.
fn slots(shape: &[usize], axes: &Option<Vec<i64>>, keep_dims: bool) -> (Vec<usize>, Vec<usize>) {
    let r = shape.len() as i64;
    let reduced: Vec<bool> = (0..shape.len())
        .map(|i| match axes {
            None => true,
            Some(a) => a.iter().any(|&ax| (ax + r) % r.max(1) == i as i64),
        })
        .collect();
    let kept: Vec<usize> = shape
        .iter()
        .zip(&reduced)
        .map(|(&d, &red)| if red { 1 } else { d })
        .collect();
    let out: Vec<usize> = if keep_dims {
        kept.clone()
    } else {
        shape
            .iter()
            .zip(&reduced)
            .filter(|(_, &red)| !red)
            .map(|(&d, _)| d)
            .collect()
    };
    let slot = (0..numel(shape))
        .map(|i| {
            let idx = unravel(i, shape);
            idx.iter()
                .zip(&kept)
                .fold(0, |acc, (&j, &k)| acc * k + if k == 1 { 0 } else { j })
        })
        .collect();
    (slot, out)
}

fn check_reduce_grad(op: &ReduceGrad, shape: &[usize], xs: &[f64], rng: &mut Gen) {
    let (slot, out) = slots(shape, &op.axes, op.keep_dims);
    let n_out = numel(&out);
    let dys = rng.vec(n_out, -2.0, 2.0);
    for dtype in FLOATS {
        let (x, xv) = stored(dtype, shape, xs);
        let (dy, gv) = stored(dtype, &out, &dys);
        let mut count = vec![0.0; n_out];
        let mut max = vec![f64::NEG_INFINITY; n_out];
        for (&v, &j) in xv.iter().zip(&slot) {
            count[j] += 1.0;
            max[j] = max[j].max(v);
        }
        let mut ties = vec![0.0; n_out];
        for (&v, &j) in xv.iter().zip(&slot) {
            if v == max[j] {
                ties[j] += 1.0;
            }
        }
        let want: Vec<f64> = xv
            .iter()
            .zip(&slot)
            .map(|(&v, &j)| match op.kind {
                ReduceKind::Sum => gv[j],
                ReduceKind::Mean => gv[j] / count[j],
                ReduceKind::Max if v == max[j] => gv[j] / ties[j],
                ReduceKind::Max => 0.0,
            })
            .collect();
        let got = run(op, &[&x, &dy]);
        assert_eq!(got.shape(), shape);
        check_close(
            &format!("{op:?} on {shape:?}"),
            dtype,
            1e-3,
            &got.to_f64_vec(),
            &want,
        );
    }
}

#[test]
fn max_splits_ties_evenly_and_routes_nothing_for_nan() {
    let x = t64(&[2, 3], &[1.0, 3.0, 3.0, f64::NAN, 0.0, 0.0]);
    let dy = t64(&[2], &[6.0, 6.0]);
    let got = run(
        &ReduceGrad::new(ReduceKind::Max, Some(vec![1]), false),
        &[&x, &dy],
    );
    assert_eq!(got.to_f64_vec(), [0.0, 3.0, 3.0, 0.0, 0.0, 0.0]);
    // Mean over an empty axis: no elements, no gradient, no panic.
    let x = t64(&[0, 3], &[]);
    let dy = t64(&[3], &[1.0; 3]);
    let got = run(
        &ReduceGrad::new(ReduceKind::Mean, Some(vec![0]), false),
        &[&x, &dy],
    );
    assert_eq!(got.shape(), [0, 3]);
}

#[test]
fn gradients_stay_in_half_precision() {
    for dtype in [DType::F16, DType::BF16] {
        let (x, _) = stored(dtype, &[2, 3], &[0.5, -1.0, 2.0, 1.5, 0.0, -0.5]);
        for kind in ReduceKind::ALL {
            for (axes, keep) in [
                (None, false),
                (Some(vec![-1]), true),
                (Some(vec![0]), false),
            ] {
                let grads = graph_gradients(
                    Box::new(Reduce::new(kind, axes, keep)),
                    std::slice::from_ref(&x),
                );
                assert_eq!(grads[0].ty(), x.ty(), "{kind:?}");
            }
        }
        let grads = graph_gradients(Box::new(SumTo { shape: vec![3] }), std::slice::from_ref(&x));
        assert_eq!(grads[0].ty(), x.ty());
        // The loss weights of the [3] output, broadcast back over the rows.
        assert_eq!(grads[0].to_f64_vec(), [0.25, 0.375, 0.5, 0.25, 0.375, 0.5]);
    }
}

#[test]
fn reduce_grad_attrs_round_trip_and_errors() {
    for kind in ReduceKind::ALL {
        for axes in [None, Some(vec![]), Some(vec![0, -1])] {
            for keep in [false, true] {
                assert_round_trip(&ReduceGrad::new(kind, axes.clone(), keep));
            }
        }
    }
    let s = |v: &str| AttrValue::Str(v.into());
    assert!(parse("ReduceGrad", &[])
        .unwrap_err()
        .contains("missing attr 'kind'"));
    assert!(parse("ReduceGrad", &[("kind", s("Min"))])
        .unwrap_err()
        .contains("unknown reduction"));
    assert!(parse(
        "ReduceGrad",
        &[("kind", s("Sum")), ("axis", AttrValue::Int(0))]
    )
    .unwrap_err()
    .contains("unknown attr 'axis'"));
    let op = parse(
        "ReduceGrad",
        &[("kind", s("Mean")), ("axes", AttrValue::Ints(vec![1]))],
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<ReduceGrad>(),
        Some(&ReduceGrad::new(ReduceKind::Mean, Some(vec![1]), false))
    );

    let f = |s: &[usize]| tt(DType::F32, s);
    let sum1 = ReduceGrad::new(ReduceKind::Sum, Some(vec![1]), false);
    assert!(infer_err(&sum1, &[f(&[2, 3]), f(&[3])]).contains("dy has shape [3]"));
    assert!(infer_err(&sum1, &[f(&[2, 3]), f(&[2, 1])]).contains("dy has shape"));
    assert!(infer_err(&sum1, &[f(&[2, 3]), tt(DType::F16, &[2])]).contains("input 1 is f16"));
    assert!(infer_err(&sum1, &[tt(DType::I64, &[2, 3]), tt(DType::I64, &[2])]).contains("float"));
    assert!(infer_err(&sum1, &[f(&[2]), f(&[2])]).contains("out of range"));
    assert!(infer_err(&sum1, &[f(&[2])]).contains("2 inputs"));
    let dup = ReduceGrad::new(ReduceKind::Max, Some(vec![0, -2]), false);
    assert!(infer_err(&dup, &[f(&[2, 3]), f(&[3])]).contains("same axis twice"));
    let x = t64(&[2, 3], &[0.0; 6]);
    assert!(sum1.eval(&[&x, &t64(&[3], &[0.0; 3])]).is_err());
    assert!(sum1.eval(&[&x]).is_err());
}
