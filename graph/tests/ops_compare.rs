//! Equal, Less, LessOrEqual, Greater, GreaterOrEqual and the logical ops And, Or,
//! Xor, Not: hand-computed values in every dtype they take (NaN included),
//! broadcasting, every error, type groups, no gradient, the file forms.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{Compare, CompareKind, Logical, LogicalKind, Not};
use ampgraph_graph::{DType, Graph, Op, Tensor};
use common::*;

fn bools(shape: &[usize], v: &[bool]) -> Tensor {
    let vals: Vec<f64> = v.iter().map(|&b| f64::from(u8::from(b))).collect();
    Tensor::from_f64(DType::Bool, shape.to_vec(), &vals).unwrap()
}

fn as_bools(t: &Tensor) -> Vec<bool> {
    assert_eq!(t.dtype(), DType::Bool);
    t.to_f64_vec().iter().map(|&v| v != 0.0).collect()
}

#[test]
fn comparisons_hand_computed_every_dtype() {
    let a = [1.0, 2.0, 3.0, -4.0];
    let b = [2.0, 2.0, 1.0, -4.0];
    let want = |kind: CompareKind| -> Vec<bool> {
        match kind {
            CompareKind::Equal => vec![false, true, false, true],
            CompareKind::Less => vec![true, false, false, false],
            CompareKind::LessOrEqual => vec![true, true, false, true],
            CompareKind::Greater => vec![false, false, true, false],
            CompareKind::GreaterOrEqual => vec![false, true, true, true],
        }
    };
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
    ] {
        let (x, _) = input(dtype, &[4], &a);
        let (y, _) = input(dtype, &[4], &b);
        for kind in CompareKind::ALL {
            let out = run(&Compare::new(kind), &[&x, &y]);
            assert_eq!(out.shape(), &[4]);
            assert_eq!(as_bools(&out), want(kind), "{dtype} {kind:?}");
        }
    }
    // Bools: Equal only.
    let x = bools(&[4], &[true, true, false, false]);
    let y = bools(&[4], &[true, false, true, false]);
    let out = run(&Compare::new(CompareKind::Equal), &[&x, &y]);
    assert_eq!(as_bools(&out), [true, false, false, true]);
}

#[test]
fn comparisons_of_nan_are_false() {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let (x, _) = input(dtype, &[3], &[f64::NAN, 1.0, f64::NAN]);
        let (y, _) = input(dtype, &[3], &[1.0, f64::NAN, f64::NAN]);
        for kind in CompareKind::ALL {
            let out = run(&Compare::new(kind), &[&x, &y]);
            assert_eq!(as_bools(&out), [false; 3], "{dtype} {kind:?}");
        }
    }
}

#[test]
fn comparisons_are_exact_in_16_bits() {
    // Neighbouring f16 values compare as their f32 values do: no rounding happens.
    let (x, xv) = input(DType::F16, &[2], &[1.0, 1.0 + 2f64.powi(-10)]);
    let (y, _) = input(DType::F16, &[2], &[1.0 + 2f64.powi(-10), 1.0]);
    assert!(xv[1] > xv[0]);
    let out = run(&Compare::new(CompareKind::Less), &[&x, &y]);
    assert_eq!(as_bools(&out), [true, false]);
}

#[test]
fn comparisons_broadcast() {
    // a [2, 1] against b [3]: out[i, j] = a[i] < b[j].
    let (a, av) = input(DType::I64, &[2, 1], &[1.0, 5.0]);
    let (b, bv) = input(DType::I64, &[3], &[0.0, 3.0, 7.0]);
    let out = run(&Compare::new(CompareKind::Less), &[&a, &b]);
    assert_eq!(out.shape(), &[2, 3]);
    let want: Vec<bool> = (0..6).map(|k| av[k / 3] < bv[k % 3]).collect();
    assert_eq!(as_bools(&out), want);
    // A scalar on either side; an empty broadcast.
    let s = Tensor::scalar(DType::F32, 2.0);
    let (v, _) = input(DType::F32, &[3], &[1.0, 2.0, 3.0]);
    let out = run(&Compare::new(CompareKind::GreaterOrEqual), &[&s, &v]);
    assert_eq!(as_bools(&out), [true, true, false]);
    let out = run(&Compare::new(CompareKind::Greater), &[&v, &s]);
    assert_eq!(as_bools(&out), [false, false, true]);
    let (e, _) = input(DType::F32, &[0, 1], &[]);
    assert_eq!(
        run(&Compare::new(CompareKind::Equal), &[&e, &v]).shape(),
        &[0, 3]
    );
}

#[test]
fn logical_ops_hand_computed() {
    let x = bools(&[4], &[true, true, false, false]);
    let y = bools(&[4], &[true, false, true, false]);
    for (kind, want) in [
        (LogicalKind::And, [true, false, false, false]),
        (LogicalKind::Or, [true, true, true, false]),
        (LogicalKind::Xor, [false, true, true, false]),
    ] {
        assert_eq!(
            as_bools(&run(&Logical::new(kind), &[&x, &y])),
            want,
            "{kind:?}"
        );
    }
    assert_eq!(as_bools(&run(&Not, &[&x])), [false, false, true, true]);
    // Broadcasting: [2, 1] with [2].
    let a = bools(&[2, 1], &[true, false]);
    let b = bools(&[2], &[true, false]);
    let out = run(&Logical::new(LogicalKind::Or), &[&a, &b]);
    assert_eq!(out.shape(), &[2, 2]);
    assert_eq!(as_bools(&out), [true, true, true, false]);
}

#[test]
fn comparison_and_logical_errors() {
    let less = Compare::new(CompareKind::Less);
    let e = infer_err(&less, &[f32t(&[2]), tt(DType::F16, &[2])]);
    assert!(e.contains("input 1 is f16 but input 0 is f32"), "{e}");
    let e = infer_err(&less, &[tt(DType::Bool, &[2]), tt(DType::Bool, &[2])]);
    assert!(
        e.contains("Less cannot order bool inputs") && e.contains("only Equal"),
        "{e}"
    );
    let e = infer_err(&less, &[f32t(&[2]), f32t(&[3])]);
    assert!(e.contains("[2] and [3] do not broadcast"), "{e}");
    let e = infer_err(&less, &[f32t(&[2])]);
    assert!(e.contains("expected 2 inputs, got 1"), "{e}");
    let huge = usize::MAX / 2;
    let e = infer_err(&less, &[f32t(&[huge, 1]), f32t(&[1, 4])]);
    assert!(e.contains("too many elements"), "{e}");
    let and = Logical::new(LogicalKind::And);
    let e = infer_err(&and, &[f32t(&[2]), f32t(&[2])]);
    assert!(e.contains("the inputs must be bool, got f32"), "{e}");
    let e = infer_err(&Not, &[tt(DType::I32, &[2])]);
    assert!(e.contains("the inputs must be bool, got i32"), "{e}");
    // eval checks too.
    let x = Tensor::scalar(DType::F32, 1.0);
    assert!(and.eval(&[&x, &x]).unwrap_err().contains("must be bool"));
    assert!(Not.eval(&[&x]).unwrap_err().contains("must be bool"));
    let t = bools(&[1], &[true]);
    assert!(less.eval(&[&t, &t]).unwrap_err().contains("bool"));
    let e = parse("Less", &[("axis", AttrValue::Int(0))]).unwrap_err();
    assert!(e.contains("unknown attr 'axis'"), "{e}");
}

#[test]
fn comparison_inputs_may_be_half_output_in_no_group() {
    for kind in CompareKind::ALL {
        assert_eq!(
            Compare::new(kind).type_groups(2, 1),
            vec![TypeGroup::new(vec![0, 1], vec![])]
        );
    }
    // Bool-only ops: one group of bools, which the AMP pass never converts.
    assert_eq!(
        Not.type_groups(1, 1),
        vec![TypeGroup::new(vec![0], vec![0])]
    );
}

#[test]
fn no_gradient_through_a_comparison() {
    // loss = sum(where(x < y, x, y)): x and y get their gradients through Where only;
    // the comparison contributes none (and differentiating it is no error).
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [3]).unwrap();
    let y = g.placeholder("y", DType::F32, [3]).unwrap();
    let less = g.less(x, y).unwrap();
    let not = g.logical_not(less).unwrap();
    let both = g.logical_and(less, not).unwrap();
    let either = g.logical_or(both, less).unwrap();
    let picked = g.where_(either, x, y).unwrap();
    let loss = g.sum(picked, None, false).unwrap();
    let grads = gradients(&mut g, loss, &[x, y]).unwrap();
    assert_eq!(g.ty(grads[0]), &f32t(&[3]));
    g.validate().unwrap();
    // The rules themselves say "none" for every input.
    let mut b = ampgraph_graph::autodiff::GradBuilder::new(&mut g, "t");
    let seed = Some(x);
    for op in [
        Box::new(Compare::new(CompareKind::Equal)) as Box<dyn Op>,
        Box::new(Logical::new(LogicalKind::Xor)),
    ] {
        assert_eq!(
            op.gradient(&mut b, &[x, y], &[less], &[seed]).unwrap(),
            vec![None, None]
        );
    }
    assert_eq!(
        Not.gradient(&mut b, &[less], &[not], &[seed]).unwrap(),
        vec![None]
    );
}

#[test]
fn file_forms() {
    for kind in CompareKind::ALL {
        let op = parse(kind.name(), &[]).unwrap();
        assert_eq!(op.downcast_ref::<Compare>(), Some(&Compare::new(kind)));
        assert_round_trip(op.as_ref());
        assert_json_round_trip(op, &[tt(DType::I32, &[2, 1]), tt(DType::I32, &[3])]);
    }
    for kind in LogicalKind::ALL {
        let op = parse(kind.name(), &[]).unwrap();
        assert_eq!(op.downcast_ref::<Logical>(), Some(&Logical::new(kind)));
        assert_json_round_trip(op, &[tt(DType::Bool, &[2]), tt(DType::Bool, &[])]);
    }
    let names: Vec<&str> = CompareKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(
        names,
        ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"]
    );
    assert_json_round_trip(parse("Not", &[]).unwrap(), &[tt(DType::Bool, &[2])]);
    // The builder names the same ops.
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F64, [2]).unwrap();
    for (port, name) in [
        (g.equal(x, x).unwrap(), "Equal"),
        (g.less_or_equal(x, x).unwrap(), "LessOrEqual"),
        (g.greater(x, x).unwrap(), "Greater"),
        (g.greater_or_equal(x, x).unwrap(), "GreaterOrEqual"),
    ] {
        assert_eq!(g.node(port.node).op.name(), name);
        assert_eq!(g.ty(port), &tt(DType::Bool, &[2]));
    }
    let p = g.placeholder("p", DType::Bool, [2]).unwrap();
    let q = g.logical_xor(p, p).unwrap();
    assert_eq!(g.node(q.node).op.name(), "Xor");
}
