//! Pad in its three modes: hand-computed values in every dtype (the reflect and edge
//! cases are NumPy's `np.pad`), negative pads that crop, every error, the gradient's
//! form, the file forms. (The constant-mode gradient is checked against finite
//! differences in exec/tests/grad_select_gather_pad.rs.)

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::ops::{Pad, PadMode, Slice};
use ampgraph_graph::{DType, Graph, Op, Tensor};
use common::*;

fn ints(shape: &[usize], v: &[i64]) -> Tensor {
    let vals: Vec<f64> = v.iter().map(|&i| i as f64).collect();
    Tensor::from_f64(DType::I64, shape.to_vec(), &vals).unwrap()
}

fn values(t: &Tensor) -> Vec<i64> {
    t.to_f64_vec().iter().map(|&v| v as i64).collect()
}

#[test]
fn constant_hand_computed_every_dtype() {
    for dtype in DType::ALL {
        // [[a b c], [d e f]] with one row of 9 before and two columns after.
        let src = [1., 0., 1., 1., 1., 0.];
        let (x, xv) = input(dtype, &[2, 3], &src);
        // 6 is exact in every float type, E5M2's two mantissa bits included.
        let value = if dtype == DType::Bool { 1.0 } else { 6.0 };
        let y = run(&Pad::constant([[1, 0], [0, 2]], value), &[&x]);
        assert_eq!(y.dtype(), dtype);
        assert_eq!(y.shape(), &[3, 5]);
        let v = value;
        #[rustfmt::skip]
        let want = [
            v, v, v, v, v,
            xv[0], xv[1], xv[2], v, v,
            xv[3], xv[4], xv[5], v, v,
        ];
        assert_eq!(y.to_f64_vec(), want, "{dtype}");
    }
    // The value rounds to the dtype as a Const would.
    let (x, _) = input(DType::I32, &[1], &[5.0]);
    let y = run(&Pad::constant([[1, 0]], -2.7), &[&x]);
    assert_eq!(y.to_f64_vec(), [-2.0, 5.0]);
    let (x, _) = input(DType::F16, &[1], &[5.0]);
    let y = run(&Pad::constant([[0, 1]], 1e6), &[&x]);
    assert_eq!(y.to_f64_vec(), [5.0, f64::INFINITY]);
    // A scalar has no axes to pad; an empty axis pads to the fill alone.
    let s = Tensor::scalar(DType::F64, 4.0);
    assert_eq!(run(&Pad::constant([], 1.0), &[&s]), s);
    let (e, _) = input(DType::F32, &[0, 2], &[]);
    let y = run(&Pad::constant([[1, 1], [0, 0]], 3.0), &[&e]);
    assert_eq!(y.to_f64_vec(), [3.0; 4]);
}

#[test]
fn negative_pads_crop() {
    let x = ints(&[2, 4], &[1, 2, 3, 4, 5, 6, 7, 8]);
    // Crop the last row, one column before, grow one after.
    let y = run(&Pad::constant([[0, -1], [-1, 1]], 0.0), &[&x]);
    assert_eq!(y.shape(), &[1, 4]);
    assert_eq!(values(&y), [2, 3, 4, 0]);
    // Crop everything of an axis, then pad it: only fill.
    let y = run(&Pad::constant([[0, 0], [-4, 2]], 7.0), &[&x]);
    assert_eq!(values(&y), [7, 7, 7, 7]);
    // Reflect and edge copy from what the crop keeps (ONNX crops first).
    let x = ints(&[4], &[1, 2, 3, 4]);
    let y = run(&Pad::new([[-1, 2]], PadMode::Reflect), &[&x]);
    assert_eq!(values(&y), [2, 3, 4, 3, 2]);
    let y = run(&Pad::new([[2, -3]], PadMode::Edge), &[&x]);
    assert_eq!(values(&y), [1, 1, 1]);
}

#[test]
fn reflect_and_edge_match_numpy() {
    let x = ints(&[3], &[1, 2, 3]);
    let reflect = |pads: [i64; 2]| values(&run(&Pad::new([pads], PadMode::Reflect), &[&x]));
    assert_eq!(reflect([2, 2]), [3, 2, 1, 2, 3, 2, 1]);
    // Wider than the axis: the mirror repeats, as np.pad([1, 2, 3], (5, 0), 'reflect').
    assert_eq!(reflect([5, 0]), [2, 1, 2, 3, 2, 1, 2, 3]);
    let y = run(&Pad::new([[4, 4]], PadMode::Edge), &[&x]);
    assert_eq!(values(&y), [1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3]);
    // One element reflects to itself.
    let one = ints(&[1], &[7]);
    let y = run(&Pad::new([[2, 1]], PadMode::Reflect), &[&one]);
    assert_eq!(values(&y), [7, 7, 7, 7]);
    // Two axes at once, every dtype: np.pad(a, ((1, 1), (2, 0)), mode).
    for dtype in DType::ALL {
        let (a, _) = input(dtype, &[2, 3], &[1., 2., 3., 4., 5., 6.]);
        let stored = |v: &[f64]| input(dtype, &[v.len()], v).1;
        for (mode, want) in [
            (
                PadMode::Reflect,
                [
                    6., 5., 4., 5., 6., 3., 2., 1., 2., 3., 6., 5., 4., 5., 6., 3., 2., 1., 2., 3.,
                ],
            ),
            (
                PadMode::Edge,
                [
                    1., 1., 1., 2., 3., 1., 1., 1., 2., 3., 4., 4., 4., 5., 6., 4., 4., 4., 5., 6.,
                ],
            ),
        ] {
            let y = run(&Pad::new([[1, 1], [2, 0]], mode), &[&a]);
            assert_eq!(y.shape(), &[4, 5]);
            assert_eq!(y.to_f64_vec(), stored(&want), "{dtype} {mode:?}");
        }
    }
}

#[test]
fn pad_errors() {
    let x = f32t(&[3, 2]);
    let e = infer_err(&Pad::constant([[1, 1]], 0.0), std::slice::from_ref(&x));
    assert!(
        e.contains("attr 'pads' has 1 (before, after) pairs but the input [3, 2] has rank 2"),
        "{e}"
    );
    let e = infer_err(
        &Pad::constant([[-2, -2], [0, 0]], 0.0),
        std::slice::from_ref(&x),
    );
    assert!(
        e.contains("pads [-2, -2] crop more than the 3 elements of axis 0"),
        "{e}"
    );
    let e = infer_err(
        &Pad::constant([[0, 0], [i64::MIN, 0]], 0.0),
        std::slice::from_ref(&x),
    );
    assert!(e.contains("crop more than the 2 elements of axis 1"), "{e}");
    for mode in [PadMode::Reflect, PadMode::Edge] {
        let e = infer_err(&Pad::new([[0, 0], [-2, 1]], mode), std::slice::from_ref(&x));
        assert!(
            e.contains(&format!(
                "mode {} pads axis 1 but keeps none of its 2 elements",
                mode.name()
            )),
            "{e}"
        );
    }
    let e = infer_err(
        &Pad::constant([[i64::MAX, 0], [0, 0]], 0.0),
        std::slice::from_ref(&x),
    );
    assert!(e.contains("too many elements"), "{e}");
    let e = infer_err(&Pad::constant([[0, 0]], 0.0), &[f32t(&[2]), f32t(&[2])]);
    assert!(e.contains("expected 1 inputs, got 2"), "{e}");
    let t = Tensor::scalar(DType::F32, 1.0);
    assert!(Pad::constant([[1, 1]], 0.0)
        .eval(&[&t])
        .unwrap_err()
        .contains("rank 0"));
    // The file form.
    let e = parse("Pad", &[]).unwrap_err();
    assert!(e.contains("missing attr 'pads'"), "{e}");
    let e = parse("Pad", &[("pads", AttrValue::Ints(vec![1, 2, 3]))]).unwrap_err();
    assert!(
        e.contains("attr 'pads' must hold a (before, after) pair per axis, got 3 integers"),
        "{e}"
    );
    let pads = ("pads", AttrValue::Ints(vec![1, 1]));
    let e = parse("Pad", &[pads.clone(), ("mode", "wrap".into())]).unwrap_err();
    assert!(
        e.contains("attr 'mode' must be one of constant reflect edge, got 'wrap'"),
        "{e}"
    );
    let e = parse(
        "Pad",
        &[
            pads.clone(),
            ("mode", "edge".into()),
            ("value", AttrValue::Float(1.0)),
        ],
    )
    .unwrap_err();
    assert!(
        e.contains("attr 'value' is for mode constant only, not edge"),
        "{e}"
    );
    let e = parse("Pad", &[pads, ("value", AttrValue::Str("x".into()))]).unwrap_err();
    assert!(e.contains("attr 'value' must be a number"), "{e}");
}

#[test]
fn gradient_forms() {
    let grad_op = |pad: Pad| {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [3, 2]).unwrap();
        let y = g.add(pad, &[x]).unwrap();
        let loss = g.sum(y, None, false).unwrap();
        gradients(&mut g, loss, &[x]).map(|d| {
            assert_eq!(g.ty(d[0]), &f32t(&[3, 2]));
            g.validate().unwrap();
            g.node(d[0].node).op.clone()
        })
    };
    // Growth only: a Slice of dy.
    let op = grad_op(Pad::constant([[1, 2], [0, 3]], 5.0)).unwrap();
    assert_eq!(
        op.downcast_ref::<Slice>(),
        Some(&Slice::new([1, 0], [3, 2]))
    );
    // Some crop: the opposite pad, zeros where x was cropped.
    let op = grad_op(Pad::constant([[-1, 2], [1, -1]], 5.0)).unwrap();
    assert_eq!(
        op.downcast_ref::<Pad>(),
        Some(&Pad::constant([[1, -2], [-1, 1]], 0.0))
    );
    for mode in [PadMode::Reflect, PadMode::Edge] {
        let e = grad_op(Pad::new([[1, 1], [0, 0]], mode))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("Pad in mode {} has no gradient", mode.name())),
            "{e}"
        );
    }
}

#[test]
fn file_forms() {
    let op = parse(
        "Pad",
        &[
            ("pads", AttrValue::Ints(vec![1, -2, 0, 3])),
            ("value", AttrValue::Float(-1.5)),
        ],
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<Pad>(),
        Some(&Pad::constant([[1, -2], [0, 3]], -1.5))
    );
    assert_round_trip(op.as_ref());
    assert_json_round_trip(op, &[f32t(&[4, 2])]);
    // Constant mode and 0 by default.
    let op = parse("Pad", &[("pads", AttrValue::Ints(vec![]))]).unwrap();
    assert_eq!(op.downcast_ref::<Pad>(), Some(&Pad::constant([], 0.0)));
    for mode in [PadMode::Reflect, PadMode::Edge] {
        let op = parse(
            "Pad",
            &[
                ("pads", AttrValue::Ints(vec![1, 1])),
                ("mode", mode.name().into()),
            ],
        )
        .unwrap();
        assert_eq!(op.downcast_ref::<Pad>(), Some(&Pad::new([[1, 1]], mode)));
        assert_round_trip(op.as_ref());
        assert_json_round_trip(op, &[tt(DType::I32, &[3])]);
    }
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::BF16, [2]).unwrap();
    let y = g.pad(x, &[[1, 1]], 2.0).unwrap();
    assert_eq!(g.ty(y), &tt(DType::BF16, &[4]));
}
