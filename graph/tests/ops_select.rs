//! Where: hand-computed values in every dtype, three-way broadcasting against a naive
//! reference, every error, type groups, the file forms. (Its gradient is checked
//! against finite differences in exec/tests/grad_select_gather_pad.rs.)

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{SumTo, Where};
use ampgraph_graph::{DType, Graph, Op, Tensor};
use common::*;

fn bools(shape: &[usize], v: &[bool]) -> Tensor {
    let vals: Vec<f64> = v.iter().map(|&b| f64::from(u8::from(b))).collect();
    Tensor::from_f64(DType::Bool, shape.to_vec(), &vals).unwrap()
}

#[test]
fn where_hand_computed_every_dtype() {
    let cond = bools(&[2, 3], &[true, false, true, false, false, true]);
    for dtype in DType::ALL {
        let (a, av) = input(dtype, &[2, 3], &[1., 0., 1., 1., 0., 0.]);
        let b = Tensor::scalar(dtype, if dtype == DType::Bool { 0.0 } else { 9.0 });
        let y = run(&Where, &[&cond, &a, &b]);
        let fill = b.to_f64_vec()[0];
        let want: Vec<f64> = [0, 1, 2, 3, 4, 5]
            .iter()
            .map(|&i| if [0, 2, 5].contains(&i) { av[i] } else { fill })
            .collect();
        assert_eq!(y.dtype(), dtype);
        assert_eq!(y.shape(), &[2, 3]);
        assert_eq!(y.to_f64_vec(), want, "{dtype}");
    }
}

#[test]
fn where_broadcasts_all_three() {
    let mut rng = Rng(5);
    // cond [3], a [2, 1], b [1, 1, 3] -> [1, 2, 3]; and a scalar cond.
    for (cs, as_, bs, out) in [
        (vec![3], vec![2, 1], vec![1, 1, 3], vec![1, 2, 3]),
        (vec![], vec![2, 3], vec![3], vec![2, 3]),
        (vec![2, 1], vec![1], vec![], vec![2, 1]),
        (vec![4, 1, 2], vec![3, 1], vec![1, 2], vec![4, 3, 2]),
    ] {
        let n = |s: &[usize]| s.iter().product::<usize>();
        let cv: Vec<bool> = (0..n(&cs)).map(|_| rng.uniform() < 0.5).collect();
        let cond = bools(&cs, &cv);
        for dtype in [DType::F32, DType::BF16, DType::I64] {
            let (a, av) = input(dtype, &as_, &rng.vals(n(&as_), -50.0, 50.0));
            let (b, bv) = input(dtype, &bs, &rng.vals(n(&bs), -50.0, 50.0));
            let y = run(&Where, &[&cond, &a, &b]);
            assert_eq!(y.shape(), out.as_slice());
            // Naive: each output index reads each operand at its broadcast position.
            let at = |shape: &[usize], idx: &[usize]| {
                let off = idx.len() - shape.len();
                let own: Vec<usize> = shape
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| if d == 1 { 0 } else { idx[off + i] })
                    .collect();
                ravel(&own, shape)
            };
            let want: Vec<f64> = (0..n(&out))
                .map(|flat| {
                    let idx = unravel(flat, &out);
                    if cv[at(&cs, &idx)] {
                        av[at(&as_, &idx)]
                    } else {
                        bv[at(&bs, &idx)]
                    }
                })
                .collect();
            assert_eq!(y.to_f64_vec(), want, "{cs:?} {as_:?} {bs:?} {dtype}");
        }
    }
    // Empty broadcast dimension.
    let cond = bools(&[0, 1], &[]);
    let (a, _) = input(DType::F32, &[1, 3], &[1., 2., 3.]);
    assert_eq!(run(&Where, &[&cond, &a, &a]).shape(), &[0, 3]);
}

#[test]
fn where_errors() {
    let b = |s: &[usize]| tt(DType::Bool, s);
    let e = infer_err(&Where, &[f32t(&[2]), f32t(&[2]), f32t(&[2])]);
    assert!(e.contains("cond must be bool, got f32"), "{e}");
    let e = infer_err(&Where, &[b(&[2]), f32t(&[2]), tt(DType::F16, &[2])]);
    assert!(e.contains("a is f32 but b is f16"), "{e}");
    let e = infer_err(&Where, &[b(&[2]), f32t(&[3]), f32t(&[3])]);
    assert!(
        e.contains("cond [2], a [3] and b [3] do not broadcast"),
        "{e}"
    );
    let e = infer_err(&Where, &[b(&[3]), f32t(&[3]), f32t(&[2, 2])]);
    assert!(
        e.contains("b [2, 2]") && e.contains("do not broadcast"),
        "{e}"
    );
    let e = infer_err(&Where, &[b(&[2]), f32t(&[2])]);
    assert!(e.contains("expected 3 inputs, got 2"), "{e}");
    let huge = usize::MAX / 2;
    let e = infer_err(&Where, &[b(&[huge, 1]), f32t(&[1, 4]), f32t(&[1])]);
    assert!(e.contains("too many elements"), "{e}");
    // eval checks too.
    let x = Tensor::scalar(DType::F32, 1.0);
    let e = Where.eval(&[&x, &x, &x]).unwrap_err();
    assert!(e.contains("cond must be bool"), "{e}");
    let e = parse("Where", &[("axis", AttrValue::Int(0))]).unwrap_err();
    assert!(e.contains("unknown attr 'axis'"), "{e}");
}

#[test]
fn where_type_groups_keep_cond_bool() {
    assert_eq!(Where.typed_inputs(3), vec![1, 2]);
    assert_eq!(
        Where.type_groups(3, 1),
        vec![
            TypeGroup::new(vec![1, 2], vec![0]),
            TypeGroup::new(vec![0], vec![]).fixed()
        ]
    );
}

#[test]
fn where_file_forms() {
    let op = parse("Where", &[]).unwrap();
    assert_eq!(op.downcast_ref::<Where>(), Some(&Where));
    assert_round_trip(op.as_ref());
    assert_json_round_trip(
        Box::new(Where),
        &[tt(DType::Bool, &[2, 1]), f32t(&[3]), f32t(&[2, 3])],
    );
}

#[test]
fn where_gradient_graph() {
    // a [3] and b [2, 3] broadcast: da is summed back to [3]; cond gets no gradient.
    let mut g = Graph::new();
    let c = g.placeholder("c", DType::Bool, [2, 3]).unwrap();
    let a = g.placeholder("a", DType::F32, [3]).unwrap();
    let b = g.placeholder("b", DType::F32, [2, 3]).unwrap();
    let y = g.where_(c, a, b).unwrap();
    let loss = g.sum(y, None, false).unwrap();
    let grads = gradients(&mut g, loss, &[a, b]).unwrap();
    assert_eq!(g.ty(grads[0]), &f32t(&[3]));
    assert_eq!(g.ty(grads[1]), &f32t(&[2, 3]));
    assert!(g.node(grads[0].node).op.is::<SumTo>());
    g.validate().unwrap();
    // Integer operands have none: the inputs get zeros.
    let mut g = Graph::new();
    let c = g.placeholder("c", DType::Bool, [2]).unwrap();
    let a = g.placeholder("a", DType::I32, [2]).unwrap();
    let x = g.placeholder("x", DType::F32, [2]).unwrap();
    let picked = g.where_(c, a, a).unwrap();
    let picked = g.cast(picked, DType::F32).unwrap();
    let y = g.mul(picked, x).unwrap();
    let loss = g.sum(y, None, false).unwrap();
    gradients(&mut g, loss, &[a, x]).unwrap();
}
