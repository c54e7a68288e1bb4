//! Sum, Mean and Max against a naive float64 reference, in f32, f16, bf16 and f64.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{Reduce, ReduceKind};
use ampgraph_graph::{DType, Op, Tensor};
use common::Rng;
use common::*;
use proptest::prelude::*;

// ---- reference ----

/// Naive reduction: returns the output shape, the values, and per output element the
/// sum of |x| and the count reduced (for tolerances).
fn naive_reduce(
    kind: ReduceKind,
    vals: &[f64],
    shape: &[usize],
    axes: &[usize],
    keep_dims: bool,
) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
    let kept: Vec<usize> = (0..shape.len())
        .map(|i| if axes.contains(&i) { 1 } else { shape[i] })
        .collect();
    let out_shape: Vec<usize> = if keep_dims {
        kept.clone()
    } else {
        (0..shape.len())
            .filter(|i| !axes.contains(i))
            .map(|i| shape[i])
            .collect()
    };
    let n_out: usize = kept.iter().product();
    let mut sum = vec![0.0; n_out];
    let mut abs = vec![0.0; n_out];
    let mut max = vec![f64::NEG_INFINITY; n_out];
    let mut count = vec![0usize; n_out];
    for (flat, &v) in vals.iter().enumerate() {
        let mut idx = unravel(flat, shape);
        for &a in axes {
            idx[a] = 0;
        }
        let o = ravel(&idx, &kept);
        sum[o] += v;
        abs[o] += v.abs();
        max[o] = if v.is_nan() || max[o].is_nan() {
            f64::NAN
        } else {
            max[o].max(v)
        };
        count[o] += 1;
    }
    let reduced: usize = axes.iter().map(|&a| shape[a]).product();
    let out = match kind {
        ReduceKind::Sum => sum,
        ReduceKind::Mean => sum.iter().map(|s| s / reduced as f64).collect(),
        ReduceKind::Max => max,
    };
    let scale = match kind {
        ReduceKind::Sum => abs,
        ReduceKind::Mean => abs.iter().map(|s| s / reduced.max(1) as f64).collect(),
        ReduceKind::Max => vec![0.0; n_out],
    };
    (out_shape, out, scale)
}

/// Runs the op on `vals` of `dtype` and checks it against the reference.
fn check(
    kind: ReduceKind,
    dtype: DType,
    shape: &[usize],
    vals: &[f64],
    axes: Option<Vec<i64>>,
    keep_dims: bool,
) {
    let (x, xr) = input(dtype, shape, vals);
    let op = Reduce::new(kind, axes.clone(), keep_dims);
    let rank = shape.len() as i64;
    let norm_axes: Vec<usize> = match &axes {
        None => (0..shape.len()).collect(),
        Some(a) => a
            .iter()
            .map(|&a| ((a + rank) % rank.max(1)) as usize)
            .collect(),
    };
    let (out_shape, want, scale) = naive_reduce(kind, &xr, shape, &norm_axes, keep_dims);
    let inferred = op.infer(&[&x.ty()]).unwrap();
    assert_eq!(inferred, vec![tt(dtype, &out_shape)]);
    let got = op.eval(&[&x]).unwrap();
    assert_eq!(got.len(), 1);
    // f32 accumulation: error grows with the reduction length.
    let n = shape.iter().product::<usize>() / out_shape.iter().product::<usize>().max(1);
    let len_factor = (n as f64 / 64.0).max(1.0);
    let what = format!("{kind:?} {dtype} {shape:?} axes {axes:?} keep {keep_dims}");
    let g = got[0].to_f64_vec();
    assert_eq!(got[0].dtype(), dtype, "{what}");
    assert_eq!(got[0].shape(), out_shape.as_slice(), "{what}");
    for (i, ((&g, &w), &s)) in g.iter().zip(&want).zip(&scale).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
        } else if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
        } else {
            let bound = rtol(dtype) * s.max(w.abs()).max(1e-3) * len_factor;
            assert!(
                (g - w).abs() <= bound,
                "{what}[{i}]: got {g}, want {w}, |diff| {} > {bound}",
                (g - w).abs()
            );
        }
    }
}

const KINDS: [ReduceKind; 3] = [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max];

// ---- hand-computed cases ----

#[test]
fn hand_computed_2x3() {
    let x = Tensor::from_f64(DType::F64, vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
    let run = |kind, axes: Option<Vec<i64>>, keep| {
        let out = Reduce::new(kind, axes, keep).eval(&[&x]).unwrap();
        (out[0].shape().to_vec(), out[0].to_f64_vec())
    };
    assert_eq!(run(ReduceKind::Sum, None, false), (vec![], vec![21.]));
    assert_eq!(run(ReduceKind::Sum, None, true), (vec![1, 1], vec![21.]));
    assert_eq!(
        run(ReduceKind::Sum, Some(vec![0]), false),
        (vec![3], vec![5., 7., 9.])
    );
    assert_eq!(
        run(ReduceKind::Sum, Some(vec![-1]), true),
        (vec![2, 1], vec![6., 15.])
    );
    assert_eq!(
        run(ReduceKind::Mean, Some(vec![1]), false),
        (vec![2], vec![2., 5.])
    );
    assert_eq!(
        run(ReduceKind::Mean, Some(vec![0]), false),
        (vec![3], vec![2.5, 3.5, 4.5])
    );
    assert_eq!(
        run(ReduceKind::Max, Some(vec![0]), false),
        (vec![3], vec![4., 5., 6.])
    );
    assert_eq!(
        run(ReduceKind::Max, Some(vec![1, 0]), false),
        (vec![], vec![6.])
    );
    // An empty axis list reduces nothing.
    assert_eq!(
        run(ReduceKind::Sum, Some(vec![]), false),
        (vec![2, 3], vec![1., 2., 3., 4., 5., 6.])
    );
}

#[test]
fn max_propagates_nan_and_empty_reductions() {
    let x = Tensor::from_f64(DType::F32, vec![2, 2], &[1., f64::NAN, 3., 4.]).unwrap();
    let out = Reduce::new(ReduceKind::Max, Some(vec![1]), false)
        .eval(&[&x])
        .unwrap();
    let v = out[0].to_f64_vec();
    assert!(v[0].is_nan());
    assert_eq!(v[1], 4.0);
    let empty = Tensor::from_f64(DType::F32, vec![2, 0], &[]).unwrap();
    let s = Reduce::new(ReduceKind::Sum, Some(vec![1]), false)
        .eval(&[&empty])
        .unwrap();
    assert_eq!(s[0].to_f64_vec(), vec![0.0, 0.0]);
    let m = Reduce::new(ReduceKind::Mean, Some(vec![1]), false)
        .eval(&[&empty])
        .unwrap();
    assert!(m[0].to_f64_vec().iter().all(|v| v.is_nan()));
    let mx = Reduce::new(ReduceKind::Max, Some(vec![1]), false)
        .eval(&[&empty])
        .unwrap();
    assert_eq!(mx[0].to_f64_vec(), vec![f64::NEG_INFINITY; 2]);
}

#[test]
fn half_sums_accumulate_in_f32() {
    // 4096 ones: an f16 accumulator would stall at 2048; f32 accumulation is exact.
    let x = Tensor::from_f64(DType::F16, vec![4096], &[1.0; 4096]).unwrap();
    let s = Reduce::new(ReduceKind::Sum, None, false)
        .eval(&[&x])
        .unwrap();
    assert_eq!(s[0].to_f64_vec(), vec![4096.0]);
    // bf16: 256 + 1 + 1 + ... stays 256 in bf16; the f32 sum is 512, rounded once.
    let x = Tensor::from_f64(
        DType::BF16,
        vec![257],
        &[[256.0].as_slice(), &[1.0; 256]].concat(),
    )
    .unwrap();
    let s = Reduce::new(ReduceKind::Sum, None, false)
        .eval(&[&x])
        .unwrap();
    assert_eq!(s[0].to_f64_vec(), vec![512.0]);
    let m = Reduce::new(ReduceKind::Mean, None, false)
        .eval(&[&Tensor::from_f64(DType::F16, vec![4096], &[1.0; 4096]).unwrap()])
        .unwrap();
    assert_eq!(m[0].to_f64_vec(), vec![1.0]);
}

/// f32 sums are kept in f64 and rounded once: 2^25 values of 0.1 (f32) sum to their
/// f64 sum rounded to f32; an f32 running sum stalls at 2^21 (ulp 0.25 swallows 0.1)
/// and gave 2,097,152 for 3,355,443.2. The mean is 0.1's f32 value exactly.
#[test]
fn long_f32_sums_do_not_stall() {
    let n = 1usize << 25;
    let tenth = 0.1f32;
    let x = Tensor::new(vec![n], ampgraph_graph::Data::F32(vec![tenth; n])).unwrap();
    let sum = Reduce::new(ReduceKind::Sum, None, false)
        .eval(&[&x])
        .unwrap();
    let want = (f64::from(tenth) * n as f64) as f32;
    assert_eq!(sum[0].to_f64_vec(), vec![f64::from(want)]);
    let mean = Reduce::new(ReduceKind::Mean, None, false)
        .eval(&[&x])
        .unwrap();
    assert_eq!(mean[0].to_f64_vec(), vec![f64::from(tenth)]);
    // SumTo (a broadcast's gradient) likewise, into two columns.
    let x = Tensor::new(vec![n / 2, 2], ampgraph_graph::Data::F32(vec![tenth; n])).unwrap();
    let cols = ampgraph_graph::ops::SumTo { shape: vec![1, 2] }
        .eval(&[&x])
        .unwrap();
    let half = (f64::from(tenth) * (n / 2) as f64) as f32;
    assert_eq!(cols[0].to_f64_vec(), vec![f64::from(half); 2]);
}

// ---- every dtype against the reference ----

#[test]
fn all_kinds_all_dtypes_vs_reference() {
    let mut rng = Rng(7);
    let shape = [3, 4, 5];
    let axes_cases: Vec<Option<Vec<i64>>> = vec![
        None,
        Some(vec![0]),
        Some(vec![1]),
        Some(vec![-1]),
        Some(vec![0, 2]),
        Some(vec![2, -3]),
        Some(vec![0, 1, 2]),
        Some(vec![]),
    ];
    for dtype in FLOATS {
        let vals = rng.vals(60, -3.0, 3.0);
        for kind in KINDS {
            for axes in &axes_cases {
                for keep in [false, true] {
                    check(kind, dtype, &shape, &vals, axes.clone(), keep);
                }
            }
        }
    }
}

#[test]
fn long_reduction_tolerance_scales_with_length() {
    let mut rng = Rng(11);
    for dtype in FLOATS {
        let vals = rng.vals(2 * 1000, 0.0, 1.0);
        for kind in KINDS {
            check(kind, dtype, &[2, 1000], &vals, Some(vec![1]), false);
        }
    }
}

// ---- errors ----

#[test]
fn axis_errors() {
    let x = tt(DType::F32, &[2, 3]);
    let e = infer_err(
        &Reduce::new(ReduceKind::Sum, Some(vec![0, 0]), false),
        std::slice::from_ref(&x),
    );
    assert!(e.contains("same axis twice"), "{e}");
    let e = infer_err(
        &Reduce::new(ReduceKind::Mean, Some(vec![1, -1]), false),
        std::slice::from_ref(&x),
    );
    assert!(e.contains("same axis twice"), "{e}");
    let e = infer_err(
        &Reduce::new(ReduceKind::Max, Some(vec![2]), false),
        std::slice::from_ref(&x),
    );
    assert!(e.contains("axis 2") && e.contains("out of range"), "{e}");
    let e = infer_err(&Reduce::new(ReduceKind::Sum, Some(vec![-3]), true), &[x]);
    assert!(e.contains("axis -3") && e.contains("rank 2"), "{e}");
    let e = infer_err(
        &Reduce::new(ReduceKind::Sum, None, false),
        &[tt(DType::I32, &[2])],
    );
    assert!(e.contains("float") && e.contains("i32"), "{e}");
    // eval checks too, and returns the error rather than panicking.
    let t = Tensor::from_f64(DType::F32, vec![2], &[1., 2.]).unwrap();
    assert!(Reduce::new(ReduceKind::Sum, Some(vec![5]), false)
        .eval(&[&t])
        .is_err());
}

#[test]
fn registry_and_attrs() {
    for (name, kind) in [
        ("Sum", ReduceKind::Sum),
        ("Mean", ReduceKind::Mean),
        ("Max", ReduceKind::Max),
    ] {
        let op = parse(name, &[]).unwrap();
        let r = op.downcast_ref::<Reduce>().unwrap();
        assert_eq!(r, &Reduce::new(kind, None, false));
        assert_eq!(op.name(), name);
        let op = parse(
            name,
            &[
                ("axes", AttrValue::Ints(vec![0, -1])),
                ("keep_dims", AttrValue::Bool(true)),
            ],
        )
        .unwrap();
        assert_eq!(
            op.downcast_ref::<Reduce>().unwrap(),
            &Reduce::new(kind, Some(vec![0, -1]), true)
        );
        assert_round_trip(op.as_ref());
        assert_round_trip(&Reduce::new(kind, None, false));
    }
    assert!(parse("Sum", &[("axis", AttrValue::Int(0))])
        .unwrap_err()
        .contains("unknown attr"));
}

// ---- property tests ----

fn reduce_case(
) -> impl Strategy<Value = (Vec<usize>, Vec<bool>, bool, bool, bool, usize, usize, u64)> {
    (
        prop::collection::vec(0usize..5, 0..=4),
        prop::collection::vec(any::<bool>(), 4),
        any::<bool>(), // axes absent
        any::<bool>(), // negative axes
        any::<bool>(), // keep_dims
        0usize..3,     // kind
        0usize..4,     // dtype
        any::<u64>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn reductions_match_naive(
        (shape, mask, absent, negative, keep, kind, dtype, seed) in reduce_case()
    ) {
        let rank = shape.len();
        let axes = if absent {
            None
        } else {
            Some(
                (0..rank)
                    .filter(|&i| mask[i])
                    .map(|i| if negative { i as i64 - rank as i64 } else { i as i64 })
                    .collect::<Vec<_>>(),
            )
        };
        let n: usize = shape.iter().product();
        let vals = Rng(seed).vals(n, -2.0, 2.0);
        check(KINDS[kind], FLOATS[dtype], &shape, &vals, axes, keep);
    }
}
