//! Gradients of Reshape, Transpose (random permutations), Concat (random axes and
//! parts), Slice (random blocks) and BroadcastTo against central finite differences, and the kernels of the
//! new data-movement ops `Slice` and `BroadcastTo` against references written here
//! with index arithmetic, in every dtype (they copy, so results must be exact).

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{BroadcastTo, Concat, Reshape, Slice, Transpose};
use ampgraph_graph::{DType, Op, Tensor};
use common::*;
use proptest::prelude::*;

/// Values every dtype holds exactly: small integers (0/1 for bool, -8..=8 for FP8).
fn exact_values(dtype: DType, n: usize, rng: &mut Gen) -> Vec<f64> {
    (0..n)
        .map(|_| match dtype {
            DType::Bool => rng.below(2) as f64,
            // E5M2's two mantissa bits hold the integers up to 8 exactly.
            DType::F8E4M3 | DType::F8E5M2 => rng.below(17) as f64 - 8.0,
            _ => rng.below(200) as f64 - 100.0,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn reshape_gradient_matches_finite_differences(
        shape in shape(3, 3),
        variant in 0usize..3,
        seed in any::<u64>(),
    ) {
        let target: Vec<i64> = match variant {
            0 => shape.iter().rev().map(|&d| d as i64).collect(),
            1 => vec![-1],
            _ => {
                let mut t: Vec<i64> = vec![1];
                t.extend(shape.iter().map(|&d| d as i64));
                t.push(-1);
                t
            }
        };
        let x = t64(&shape, &Gen(seed).vec(numel(&shape), -2.0, 2.0));
        assert_grad(Box::new(Reshape::new(target)), &[x], seed);
    }

    #[test]
    fn transpose_gradient_matches_finite_differences(shape in shape(4, 3), seed in any::<u64>()) {
        let mut rng = Gen(seed);
        let perm = rng.perm(shape.len());
        let x = t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0));
        assert_grad(Box::new(Transpose::new(perm)), &[x], seed);
    }

    #[test]
    fn concat_gradient_matches_finite_differences(
        base in prop::collection::vec(1usize..=3, 1..=3),
        sizes in prop::collection::vec(0usize..=3, 1..=3),
        axis_pick in any::<u64>(),
        negative in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let rank = base.len();
        let axis = (axis_pick % rank as u64) as usize;
        let mut rng = Gen(seed);
        let inputs: Vec<Tensor> = sizes
            .iter()
            .map(|&s| {
                let mut shape = base.clone();
                shape[axis] = s;
                t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0))
            })
            .collect();
        let axis = if negative { axis as i64 - rank as i64 } else { axis as i64 };
        assert_grad(Box::new(Concat::new(axis)), &inputs, seed);
    }

    #[test]
    fn slice_gradient_matches_finite_differences(shape in shape(3, 4), seed in any::<u64>()) {
        let mut rng = Gen(seed);
        let mut begin = Vec::new();
        let mut size = Vec::new();
        for &d in &shape {
            let b = rng.below(d);
            begin.push(b);
            size.push(if rng.below(3) == 0 { -1 } else { 1 + rng.below(d - b) as i64 });
        }
        let x = t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0));
        assert_grad(Box::new(Slice::new(begin, size)), &[x], seed);
    }

    #[test]
    fn broadcast_to_gradient_matches_finite_differences(
        (sa, sb) in broadcast_pair(3, 3),
        seed in any::<u64>(),
    ) {
        let target = broadcast(&sa, &sb);
        let x = t64(&sa, &Gen(seed).vec(numel(&sa), -2.0, 2.0));
        assert_grad(Box::new(BroadcastTo::new(target)), &[x], seed);
    }

    #[test]
    fn slice_matches_reference_in_every_dtype(
        shape in shape(3, 4),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let mut begin = Vec::new();
        let mut size = Vec::new();
        let mut out = Vec::new();
        for &d in &shape {
            let b = rng.below(d + 1);
            let s = rng.below(d - b + 1);
            let to_end = rng.below(3) == 0;
            begin.push(b);
            size.push(if to_end { -1 } else { s as i64 });
            out.push(if to_end { d - b } else { s });
        }
        let op = Slice::new(begin.clone(), size);
        for dtype in DType::ALL {
            let xs = exact_values(dtype, numel(&shape), &mut rng);
            let x = Tensor::from_f64(dtype, shape.clone(), &xs).unwrap();
            let want: Vec<f64> = (0..numel(&out))
                .map(|i| {
                    let idx: Vec<usize> = unravel(i, &out).iter().zip(&begin).map(|(i, b)| i + b).collect();
                    xs[ravel(&idx, &shape)]
                })
                .collect();
            let got = run(&op, &[&x]);
            assert_eq!(got.shape(), out.as_slice());
            assert_eq!(got.dtype(), dtype);
            assert_eq!(got.to_f64_vec(), want, "{op:?} {dtype} on {shape:?}");
        }
    }

    #[test]
    fn broadcast_to_matches_reference_in_every_dtype(
        (sa, sb) in broadcast_pair(3, 3),
        seed in any::<u64>(),
    ) {
        let mut rng = Gen(seed);
        let target = broadcast(&sa, &sb);
        let op = BroadcastTo::new(target.clone());
        let off = target.len() - sa.len();
        for dtype in DType::ALL {
            let xs = exact_values(dtype, numel(&sa), &mut rng);
            let x = Tensor::from_f64(dtype, sa.clone(), &xs).unwrap();
            let want: Vec<f64> = (0..numel(&target))
                .map(|i| {
                    let idx = unravel(i, &target);
                    let src: Vec<usize> = sa
                        .iter()
                        .enumerate()
                        .map(|(k, &d)| if d == 1 { 0 } else { idx[off + k] })
                        .collect();
                    xs[ravel(&src, &sa)]
                })
                .collect();
            let got = run(&op, &[&x]);
            assert_eq!(got.ty(), ampgraph_graph::TensorType::new(dtype, target.clone()));
            assert_eq!(got.to_f64_vec(), want, "{op:?} {dtype} from {sa:?}");
        }
    }
}

#[test]
fn gradients_stay_in_half_precision() {
    for dtype in [DType::F16, DType::BF16] {
        let (x, _) = stored(dtype, &[2, 3], &[0.5, -1.0, 2.0, 1.5, 0.0, -0.5]);
        let (y, _) = stored(dtype, &[2, 1], &[1.0, 2.0]);
        let cases: Vec<(Box<dyn Op>, Vec<Tensor>)> = vec![
            (Box::new(Reshape::new([3, -1])), vec![x.clone()]),
            (Box::new(Transpose::new([1, 0])), vec![x.clone()]),
            (Box::new(Concat::new(-1)), vec![x.clone(), y.clone()]),
            (Box::new(BroadcastTo::new([4, 2, 3])), vec![x.clone()]),
        ];
        for (op, inputs) in cases {
            let what = format!("{op:?}");
            let grads = graph_gradients(op, &inputs);
            for (g, x) in grads.iter().zip(&inputs) {
                assert_eq!(g.ty(), x.ty(), "{what}");
            }
        }
        // Concat's parts: y's gradient is the last column of the loss weights
        // (0.25 + 0.125 * (i % 5) at flat index i = 3, 7).
        let grads = graph_gradients(Box::new(Concat::new(1)), &[x.clone(), y.clone()]);
        assert_eq!(grads[1].to_f64_vec(), [0.625, 0.5]);
    }
}

#[test]
fn attrs_round_trip_and_errors() {
    assert_round_trip(&Slice::new([0, 1], [-1, 2]));
    assert_round_trip(&Slice::new([], []));
    assert_round_trip(&BroadcastTo::new([2, 1, 3]));
    assert_round_trip(&BroadcastTo::new([]));
    let ints = |v: &[i64]| AttrValue::Ints(v.to_vec());
    let err = |name: &str, attrs: &[(&str, AttrValue)]| parse(name, attrs).unwrap_err();
    assert!(err("Slice", &[("size", ints(&[1]))]).contains("missing attr 'begin'"));
    assert!(err("Slice", &[("begin", ints(&[0]))]).contains("missing attr 'size'"));
    assert!(err("Slice", &[("begin", ints(&[-1])), ("size", ints(&[1]))]).contains("negative"));
    assert!(err("Slice", &[("begin", ints(&[0])), ("size", ints(&[-2]))]).contains("only -1"));
    assert!(err("BroadcastTo", &[]).contains("missing attr 'shape'"));
    assert!(err("BroadcastTo", &[("shape", ints(&[-3]))]).contains("negative"));

    let f = |s: &[usize]| tt(DType::F32, s);
    assert!(infer_err(&Slice::new([0], [1]), &[f(&[2, 3])]).contains("one entry per axis"));
    assert!(infer_err(&Slice::new([2, 0], [1, 1]), &[f(&[2, 3])]).contains("axis 0"));
    assert!(infer_err(&Slice::new([0, 1], [1, 3]), &[f(&[2, 3])]).contains("axis 1"));
    assert!(infer_err(&Slice::new([3, 0], [-1, 1]), &[f(&[2, 3])]).contains("axis 0"));
    assert!(infer_err(&Slice::new([usize::MAX], [2]), &[f(&[2])]).contains("axis 0"));
    assert!(infer_err(&BroadcastTo::new([2, 4]), &[f(&[3])]).contains("does not broadcast"));
    assert!(infer_err(&BroadcastTo::new([3]), &[f(&[2, 3])]).contains("does not broadcast"));
    assert!(infer_err(&BroadcastTo::new([usize::MAX, 2]), &[f(&[2])]).contains("too many"));
    // Kernels check too: no panic on inputs infer would refuse.
    let x = t64(&[2, 3], &[0.0; 6]);
    assert!(Slice::new([1, 1], [1, 5]).eval(&[&x]).is_err());
    assert!(BroadcastTo::new([3, 3]).eval(&[&x]).is_err());
    assert!(BroadcastTo::new([2, 3]).eval(&[]).is_err());
    // Integer tensors have no gradient, and rules with the wrong arity are errors.
    let mut g = ampgraph_graph::Graph::new();
    let p: ampgraph_graph::Port = g
        .add_node(
            "x",
            Box::new(ampgraph_graph::ops::Placeholder(tt(DType::I32, &[2, 3]))),
            &[],
        )
        .unwrap()
        .into();
    let q: ampgraph_graph::Port = g
        .add_node(
            "q",
            Box::new(ampgraph_graph::ops::Placeholder(f(&[2, 3]))),
            &[],
        )
        .unwrap()
        .into();
    let mut b = ampgraph_graph::autodiff::GradBuilder::new(&mut g, "t");
    let ops: Vec<Box<dyn Op>> = vec![
        Box::new(Reshape::new([-1])),
        Box::new(Transpose::new([1, 0])),
        Box::new(Concat::new(0)),
        Box::new(BroadcastTo::new([2, 2, 3])),
    ];
    for op in ops {
        assert_eq!(
            op.gradient(&mut b, &[p], &[], &[Some(p)]).unwrap(),
            vec![None],
            "{op:?}"
        );
        if op.name() != "Concat" {
            assert!(
                op.gradient(&mut b, &[p, p], &[], &[Some(p)]).is_err(),
                "{op:?}"
            );
        }
    }
    assert!(Transpose::new([0, 0])
        .gradient(&mut b, &[q], &[], &[Some(q)])
        .is_err());
    assert!(Concat::new(5)
        .gradient(&mut b, &[q], &[], &[Some(q)])
        .is_err());
}
