//! Gather and GatherGrad: hand-computed values in every dtype, negative axes and
//! indices, indices of any rank against a naive reference, the scatter-add of repeated
//! indices, every error, type groups, the file forms. (The gradients are checked
//! against finite differences in exec/tests/grad_select_gather_pad.rs.)

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{Gather, GatherGrad};
use ampgraph_graph::{DType, Graph, Op, Tensor};
use common::*;

/// Distinct values every dtype holds (bool: alternating).
fn iota(dtype: DType, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let vals: Vec<f64> = (0..n)
        .map(|i| {
            if dtype == DType::Bool {
                (i % 2) as f64
            } else {
                i as f64 - 3.0
            }
        })
        .collect();
    Tensor::from_f64(dtype, shape.to_vec(), &vals).unwrap()
}

fn idx(dtype: DType, shape: &[usize], v: &[i64]) -> Tensor {
    let vals: Vec<f64> = v.iter().map(|&i| i as f64).collect();
    Tensor::from_f64(dtype, shape.to_vec(), &vals).unwrap()
}

/// out[p, i, s] = data[p, indices[i] (from the end when negative), s].
fn naive_gather(data: &Tensor, indices: &[i64], ishape: &[usize], axis: usize) -> Vec<f64> {
    let ds = data.shape();
    let dv = data.to_f64_vec();
    let mut out_shape = ds[..axis].to_vec();
    out_shape.extend_from_slice(ishape);
    out_shape.extend_from_slice(&ds[axis + 1..]);
    let n: usize = out_shape.iter().product();
    (0..n)
        .map(|flat| {
            let o = unravel(flat, &out_shape);
            let k = indices[ravel(&o[axis..axis + ishape.len()], ishape)];
            let k = if k < 0 { k + ds[axis] as i64 } else { k } as usize;
            let mut src = o[..axis].to_vec();
            src.push(k);
            src.extend_from_slice(&o[axis + ishape.len()..]);
            dv[ravel(&src, ds)]
        })
        .collect()
}

#[test]
fn gather_hand_computed_every_dtype() {
    for dtype in DType::ALL {
        // data [3, 2]: rows r0 r1 r2.
        let x = iota(dtype, &[3, 2]);
        let xv = x.to_f64_vec();
        for index_dtype in [DType::I32, DType::I64] {
            let i = idx(index_dtype, &[2], &[2, 0]);
            let y = run(&Gather::new(0), &[&x, &i]);
            assert_eq!(y.shape(), &[2, 2]);
            assert_eq!(y.dtype(), dtype);
            assert_eq!(y.to_f64_vec(), [xv[4], xv[5], xv[0], xv[1]], "{dtype}");
            // Negative index and negative axis: columns [1, -2] = [1, 0].
            let i = idx(index_dtype, &[2], &[1, -2]);
            for axis in [1, -1] {
                let y = run(&Gather::new(axis), &[&x, &i]);
                assert_eq!(y.shape(), &[3, 2]);
                let want = [xv[1], xv[0], xv[3], xv[2], xv[5], xv[4]];
                assert_eq!(y.to_f64_vec(), want, "{dtype} axis {axis}");
            }
        }
        // A scalar index drops the axis; a [2, 2] index adds two.
        let y = run(&Gather::new(0), &[&x, &idx(DType::I64, &[], &[-1])]);
        assert_eq!(y.shape(), &[2]);
        assert_eq!(y.to_f64_vec(), [xv[4], xv[5]]);
        let y = run(
            &Gather::new(0),
            &[&x, &idx(DType::I32, &[2, 2], &[0, 1, 1, 1])],
        );
        assert_eq!(y.shape(), &[2, 2, 2]);
        assert_eq!(
            y.to_f64_vec(),
            [xv[0], xv[1], xv[2], xv[3], xv[2], xv[3], xv[2], xv[3]]
        );
    }
}

#[test]
fn gather_vs_naive_reference() {
    let mut rng = Rng(11);
    let x = iota(DType::F64, &[2, 3, 4]);
    for axis in 0..3usize {
        for ishape in [vec![], vec![5], vec![2, 3]] {
            let n = x.shape()[axis] as i64;
            let count: usize = ishape.iter().product();
            let iv: Vec<i64> = (0..count)
                .map(|_| (rng.next_u64() % (2 * n as u64)) as i64 - n)
                .collect();
            let want = naive_gather(&x, &iv, &ishape, axis);
            for ax in [axis as i64, axis as i64 - 3] {
                let y = run(&Gather::new(ax), &[&x, &idx(DType::I64, &ishape, &iv)]);
                assert_eq!(y.to_f64_vec(), want, "axis {ax} indices {ishape:?} {iv:?}");
            }
        }
    }
    // Empty indices, and an empty axis gathered by nothing.
    let y = run(&Gather::new(1), &[&x, &idx(DType::I32, &[0], &[])]);
    assert_eq!(y.shape(), &[2, 0, 4]);
    let e = iota(DType::F32, &[0, 3]);
    let y = run(&Gather::new(0), &[&e, &idx(DType::I32, &[0], &[])]);
    assert_eq!(y.shape(), &[0, 3]);
}

#[test]
fn gather_errors() {
    let x = iota(DType::F32, &[3, 2]);
    for bad in [3, 7, -4] {
        let e = Gather::new(0)
            .eval(&[&x, &idx(DType::I64, &[2], &[0, bad])])
            .unwrap_err();
        assert!(
            e.contains(&format!("index {bad} is out of range for axis 0 of size 3")),
            "{e}"
        );
    }
    let e = Gather::new(-1)
        .eval(&[&x, &idx(DType::I32, &[1], &[i32::MIN.into()])])
        .unwrap_err();
    assert!(e.contains("out of range for axis 1 of size 2"), "{e}");
    let e = Gather::new(0)
        .eval(&[&iota(DType::F32, &[0, 2]), &idx(DType::I32, &[1], &[0])])
        .unwrap_err();
    assert!(
        e.contains("index 0 is out of range for axis 0 of size 0"),
        "{e}"
    );
    let e = infer_err(&Gather::new(0), &[f32t(&[3, 2]), f32t(&[2])]);
    assert!(e.contains("indices must be i32 or i64, got f32"), "{e}");
    let e = infer_err(&Gather::new(2), &[f32t(&[3, 2]), tt(DType::I32, &[2])]);
    assert!(e.contains("axis 2 is out of range for rank 2"), "{e}");
    let e = infer_err(&Gather::new(-3), &[f32t(&[3, 2]), tt(DType::I32, &[2])]);
    assert!(e.contains("axis -3 is out of range"), "{e}");
    let e = infer_err(&Gather::new(0), &[f32t(&[]), tt(DType::I32, &[2])]);
    assert!(e.contains("out of range for rank 0"), "{e}");
    let huge = usize::MAX / 2;
    let e = infer_err(&Gather::new(0), &[f32t(&[3, 4]), tt(DType::I32, &[huge])]);
    assert!(e.contains("too many elements"), "{e}");
    let e = infer_err(&Gather::new(0), &[f32t(&[3])]);
    assert!(e.contains("expected 2 inputs, got 1"), "{e}");
    let e = parse("Gather", &[("axis", AttrValue::Float(1.0))]).unwrap_err();
    assert!(e.contains("attr 'axis' must be an integer"), "{e}");
}

#[test]
fn gather_grad_scatter_adds() {
    for dtype in FLOATS {
        // Rows 0, 2, 0 of a [3, 2] data: row 0 collects two slices, row 1 none.
        let (dy, g) = input(dtype, &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let i = idx(DType::I64, &[3], &[0, -1, 0]);
        let dx = run(&GatherGrad::new(0, [3, 2]), &[&dy, &i]);
        let want = [g[0] + g[4], g[1] + g[5], 0.0, 0.0, g[2], g[3]];
        assert_close("GatherGrad", &dx, dtype, &[3, 2], &want, dtype, 1.0);
        // Along the last axis with a [2, 2] index: dy [3, 2, 2].
        let (dy, g) = input(
            dtype,
            &[3, 2, 2],
            &(0..12).map(f64::from).collect::<Vec<_>>(),
        );
        let i = idx(DType::I32, &[2, 2], &[1, 1, 0, 1]);
        let dx = run(&GatherGrad::new(-1, [3, 2]), &[&dy, &i]);
        let want: Vec<f64> = (0..3)
            .flat_map(|r| {
                let s = &g[4 * r..4 * r + 4];
                [s[2], s[0] + s[1] + s[3]]
            })
            .collect();
        assert_close("GatherGrad axis -1", &dx, dtype, &[3, 2], &want, dtype, 1.0);
    }
}

#[test]
fn gather_grad_errors() {
    let op = GatherGrad::new(0, [3, 2]);
    let i = tt(DType::I32, &[4]);
    let e = infer_err(&op, &[f32t(&[3, 2]), i.clone()]);
    assert!(
        e.contains("dy has shape [3, 2]") && e.contains("gives [4, 2]"),
        "{e}"
    );
    let e = infer_err(&op, &[tt(DType::I32, &[4, 2]), i.clone()]);
    assert!(e.contains("dy must be a float tensor, got i32"), "{e}");
    let e = infer_err(&op, &[f32t(&[4, 2]), f32t(&[4])]);
    assert!(e.contains("indices must be i32 or i64, got f32"), "{e}");
    let e = infer_err(&GatherGrad::new(2, [3, 2]), &[f32t(&[4, 2]), i]);
    assert!(e.contains("axis 2 is out of range for rank 2"), "{e}");
    let (dy, _) = input(DType::F32, &[1, 2], &[1.0, 2.0]);
    let e = op.eval(&[&dy, &idx(DType::I64, &[1], &[3])]).unwrap_err();
    assert!(
        e.contains("index 3 is out of range for axis 0 of size 3"),
        "{e}"
    );
    let e = parse("GatherGrad", &[("shape", AttrValue::Ints(vec![3]))]).unwrap_err();
    assert!(e.contains("missing attr 'axis'"), "{e}");
    let e = parse("GatherGrad", &[("axis", AttrValue::Int(0))]).unwrap_err();
    assert!(e.contains("missing attr 'shape'"), "{e}");
    let e = parse(
        "GatherGrad",
        &[
            ("axis", AttrValue::Int(0)),
            ("shape", AttrValue::Ints(vec![-3])),
        ],
    )
    .unwrap_err();
    assert!(e.contains("negative dimension -3"), "{e}");
}

#[test]
fn only_data_is_the_compute_type() {
    let groups = vec![
        TypeGroup::new(vec![0], vec![0]),
        TypeGroup::new(vec![1], vec![]).fixed(),
    ];
    assert_eq!(Gather::new(0).typed_inputs(2), vec![0]);
    assert_eq!(Gather::new(0).type_groups(2, 1), groups);
    assert_eq!(GatherGrad::new(0, [1]).type_groups(2, 1), groups);
}

#[test]
fn file_forms() {
    let op = parse("Gather", &[("axis", AttrValue::Int(-2))]).unwrap();
    assert_eq!(op.downcast_ref::<Gather>(), Some(&Gather::new(-2)));
    assert_round_trip(op.as_ref());
    // ONNX's default axis.
    let op = parse("Gather", &[]).unwrap();
    assert_eq!(op.downcast_ref::<Gather>(), Some(&Gather::new(0)));
    assert_json_round_trip(op, &[tt(DType::F16, &[5, 3]), tt(DType::I64, &[2, 2])]);
    let op = GatherGrad::new(-1, [2, 3]);
    assert_round_trip(&op);
    assert_json_round_trip(Box::new(op), &[f32t(&[2, 4]), tt(DType::I32, &[4])]);
}

#[test]
fn gradient_graph() {
    let mut g = Graph::new();
    let table = g.placeholder("table", DType::F32, [10, 4]).unwrap();
    let ids = g.placeholder("ids", DType::I64, [2, 3]).unwrap();
    let rows = g.gather(table, ids, 0).unwrap();
    assert_eq!(g.ty(rows), &f32t(&[2, 3, 4]));
    let loss = g.sum(rows, None, false).unwrap();
    let grads = gradients(&mut g, loss, &[table, ids]).unwrap();
    let op = &g.node(grads[0].node).op;
    assert_eq!(
        op.downcast_ref::<GatherGrad>(),
        Some(&GatherGrad::new(0, [10, 4]))
    );
    assert_eq!(g.ty(grads[0]), &f32t(&[10, 4]));
    g.validate().unwrap();
}
