//! Reshape, Transpose and Concat: exact for every dtype, against naive index mapping.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{Concat, Reshape, Transpose};
use ampgraph_graph::{DType, Op, Tensor};
use common::Rng;
use common::*;
use proptest::prelude::*;

/// Distinct values exactly representable in every dtype (bool: alternating).
fn iota(dtype: DType, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let vals: Vec<f64> = (0..n)
        .map(|i| {
            if dtype == DType::Bool {
                (i % 2) as f64
            } else {
                i as f64 - 7.0
            }
        })
        .collect();
    Tensor::from_f64(dtype, shape.to_vec(), &vals).unwrap()
}

fn random_tensor(dtype: DType, shape: &[usize], rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    let vals = rng.vals(n, -100.0, 100.0);
    Tensor::from_f64(dtype, shape.to_vec(), &vals).unwrap()
}

/// Naive transpose: out[i0..ik] = x[j] where j[perm[a]] = i[a].
fn naive_transpose(vals: &[f64], shape: &[usize], perm: &[usize]) -> (Vec<usize>, Vec<f64>) {
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let mut out = vec![0.0; vals.len()];
    for (flat, o) in out.iter_mut().enumerate() {
        let oi = unravel(flat, &out_shape);
        let mut ii = vec![0; shape.len()];
        for (a, &p) in perm.iter().enumerate() {
            ii[p] = oi[a];
        }
        *o = vals[ravel(&ii, shape)];
    }
    (out_shape, out)
}

fn random_perm(rank: usize, rng: &mut Rng) -> Vec<usize> {
    let mut p: Vec<usize> = (0..rank).collect();
    for i in (1..rank).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

const ALL: [DType; 9] = DType::ALL;

// ---- Reshape ----

#[test]
fn reshape_hand_computed_every_dtype() {
    for dtype in ALL {
        let x = iota(dtype, &[2, 3]);
        for (spec, want) in [
            (vec![3, 2], vec![3, 2]),
            (vec![-1], vec![6]),
            (vec![3, -1], vec![3, 2]),
            (vec![1, -1, 1], vec![1, 6, 1]),
            (vec![6, 1], vec![6, 1]),
        ] {
            let op = Reshape::new(spec.clone());
            assert_eq!(op.infer(&[&x.ty()]).unwrap(), vec![tt(dtype, &want)]);
            let y = op.eval(&[&x]).unwrap();
            assert_eq!(y[0].shape(), want.as_slice(), "{spec:?}");
            assert_eq!(
                y[0].data(),
                x.data(),
                "{dtype}: reshape keeps the values exactly"
            );
        }
    }
    // Scalars and empty tensors.
    let s = Tensor::scalar(DType::F32, 3.0);
    assert_eq!(
        Reshape::new(vec![1, 1]).eval(&[&s]).unwrap()[0].shape(),
        &[1, 1]
    );
    assert_eq!(Reshape::new(vec![-1]).eval(&[&s]).unwrap()[0].shape(), &[1]);
    let one = Tensor::from_f64(DType::F32, vec![1, 1], &[3.0]).unwrap();
    assert_eq!(
        Reshape::new(vec![]).eval(&[&one]).unwrap()[0].shape(),
        &[] as &[usize]
    );
    let e = Tensor::from_f64(DType::F32, vec![0, 3], &[]).unwrap();
    assert_eq!(
        Reshape::new(vec![3, 0]).eval(&[&e]).unwrap()[0].shape(),
        &[3, 0]
    );
}

#[test]
fn reshape_errors() {
    let x = tt(DType::F32, &[2, 3]);
    let e = infer_err(&Reshape::new(vec![4, 5]), std::slice::from_ref(&x));
    assert!(
        e.contains("[2, 3]") && e.contains("[4, 5]") && e.contains("6"),
        "{e}"
    );
    let e = infer_err(&Reshape::new(vec![4, -1]), std::slice::from_ref(&x));
    assert!(e.contains("[2, 3]") && e.contains("[4, -1]"), "{e}");
    let e = infer_err(&Reshape::new(vec![-1, -1]), std::slice::from_ref(&x));
    assert!(e.contains("more than one -1"), "{e}");
    let e = infer_err(&Reshape::new(vec![-2, -3]), std::slice::from_ref(&x));
    assert!(e.contains("negative dimension -2"), "{e}");
    let e = infer_err(&Reshape::new(vec![0, -1]), &[tt(DType::F32, &[0, 3])]);
    assert!(e.contains("ambiguous"), "{e}");
    let e = infer_err(&Reshape::new(vec![i64::MAX, 4]), &[x]);
    assert!(e.contains("cannot reshape"), "{e}");
    // The same errors from the file form, and from eval.
    let e = parse("Reshape", &[("shape", AttrValue::Ints(vec![-1, 2, -1]))]).unwrap_err();
    assert!(e.contains("more than one -1"), "{e}");
    assert!(parse("Reshape", &[])
        .unwrap_err()
        .contains("missing attr 'shape'"));
    let t = iota(DType::I64, &[2, 3]);
    assert!(Reshape::new(vec![5])
        .eval(&[&t])
        .unwrap_err()
        .contains("[5]"));
}

// ---- Transpose ----

#[test]
fn transpose_hand_computed_every_dtype() {
    for dtype in ALL {
        let x = iota(dtype, &[2, 3]);
        let y = Transpose::new(vec![1, 0]).eval(&[&x]).unwrap();
        let xs = x.to_f64_vec();
        let want: Vec<f64> = [0, 3, 1, 4, 2, 5].iter().map(|&i| xs[i]).collect();
        assert_eq!(y[0].shape(), &[3, 2]);
        assert_eq!(y[0].dtype(), dtype);
        assert_eq!(y[0].to_f64_vec(), want, "{dtype}");
        // Rank 3, perm [2, 0, 1]: out[k, i, j] = x[i, j, k].
        let x = iota(dtype, &[2, 3, 4]);
        let y = Transpose::new(vec![2, 0, 1]).eval(&[&x]).unwrap();
        assert_eq!(y[0].shape(), &[4, 2, 3]);
        let xs = x.to_f64_vec();
        let ys = y[0].to_f64_vec();
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    assert_eq!(ys[(k * 2 + i) * 3 + j], xs[(i * 3 + j) * 4 + k]);
                }
            }
        }
    }
    let s = Tensor::scalar(DType::F16, 2.0);
    assert_eq!(Transpose::new(vec![]).eval(&[&s]).unwrap()[0], s);
}

#[test]
fn transpose_float_dtypes_vs_reference() {
    let mut rng = Rng(17);
    for dtype in FLOATS {
        let x = random_tensor(dtype, &[2, 3, 4, 5], &mut rng);
        for perm in [
            vec![0, 1, 2, 3],
            vec![3, 2, 1, 0],
            vec![0, 3, 1, 2],
            vec![1, 0, 3, 2],
        ] {
            let (shape, want) = naive_transpose(&x.to_f64_vec(), x.shape(), &perm);
            let y = Transpose::new(perm.clone()).eval(&[&x]).unwrap();
            // No rounding: values move exactly (tolerance 0 in every dtype).
            assert_eq!(y[0].shape(), shape.as_slice());
            assert_eq!(y[0].to_f64_vec(), want, "{dtype} {perm:?}");
        }
    }
}

#[test]
fn transpose_errors() {
    let x3 = tt(DType::F32, &[2, 3, 4]);
    for bad in [vec![0, 0, 1], vec![0, 1], vec![0, 1, 3], vec![0, 1, 2, 3]] {
        let e = infer_err(&Transpose::new(bad.clone()), std::slice::from_ref(&x3));
        assert!(
            e.contains(&format!("{bad:?}")) && e.contains("not a permutation of 0..3"),
            "{e}"
        );
    }
    let e = parse("Transpose", &[("perm", AttrValue::Ints(vec![-1, 0]))]).unwrap_err();
    assert!(e.contains("negative"), "{e}");
    let t = iota(DType::Bool, &[2, 2]);
    assert!(Transpose::new(vec![1, 1]).eval(&[&t]).is_err());
}

// ---- Concat ----

#[test]
fn concat_hand_computed_every_dtype() {
    for dtype in ALL {
        let a = iota(dtype, &[2, 2]);
        let b = Tensor::from_f64(
            dtype,
            vec![2, 3],
            &[1., 0., 1., 0., 1., 0.].map(|v| if dtype == DType::Bool { v } else { v + 20.0 }),
        )
        .unwrap();
        let av = a.to_f64_vec();
        let bv = b.to_f64_vec();
        for axis in [1, -1] {
            let y = Concat::new(axis).eval(&[&a, &b]).unwrap();
            assert_eq!(y[0].shape(), &[2, 5]);
            let want: Vec<f64> = [&av[0..2], &bv[0..3], &av[2..4], &bv[3..6]].concat();
            assert_eq!(y[0].to_f64_vec(), want, "{dtype} axis {axis}");
            assert_eq!(y[0].dtype(), dtype);
        }
        let y = Concat::new(0).eval(&[&a, &a, &a]).unwrap();
        assert_eq!(y[0].shape(), &[6, 2]);
        assert_eq!(
            y[0].to_f64_vec(),
            [av.clone(), av.clone(), av.clone()].concat()
        );
        // One input is the identity.
        assert_eq!(Concat::new(0).eval(&[&b]).unwrap()[0], b);
    }
    // Empty parts.
    let a = iota(DType::F32, &[2, 0]);
    let b = iota(DType::F32, &[2, 2]);
    let y = Concat::new(1).eval(&[&a, &b, &a]).unwrap();
    assert_eq!(y[0], b);
}

#[test]
fn concat_float_dtypes_vs_reference() {
    let mut rng = Rng(23);
    for dtype in FLOATS {
        let parts: Vec<Tensor> = [1usize, 3, 2]
            .iter()
            .map(|&k| random_tensor(dtype, &[2, k, 3], &mut rng))
            .collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        let y = Concat::new(1).eval(&refs).unwrap();
        assert_eq!(y[0].shape(), &[2, 6, 3]);
        // Naive: out[i, j, k] from the part that holds row j.
        let ys = y[0].to_f64_vec();
        for i in 0..2 {
            let mut j0 = 0;
            for p in &parts {
                let k = p.shape()[1];
                let pv = p.to_f64_vec();
                for j in 0..k {
                    for l in 0..3 {
                        assert_eq!(ys[(i * 6 + j0 + j) * 3 + l], pv[(i * k + j) * 3 + l]);
                    }
                }
                j0 += k;
            }
        }
    }
}

#[test]
fn concat_errors() {
    let op = Concat::new(1);
    let e = infer_err(&op, &[tt(DType::F32, &[2, 3]), tt(DType::F16, &[2, 3])]);
    assert!(e.contains("input 1 is f16") && e.contains("f32"), "{e}");
    let e = infer_err(&op, &[tt(DType::F32, &[2, 3]), tt(DType::F32, &[2, 3, 1])]);
    assert!(e.contains("rank 3") && e.contains("rank 2"), "{e}");
    let e = infer_err(&op, &[tt(DType::F32, &[2, 3]), tt(DType::F32, &[4, 3])]);
    assert!(
        e.contains("[4, 3]") && e.contains("[2, 3]") && e.contains("dimension 0"),
        "{e}"
    );
    let e = infer_err(&Concat::new(2), &[tt(DType::F32, &[2, 3])]);
    assert!(e.contains("axis 2") && e.contains("out of range"), "{e}");
    let e = infer_err(&op, &[]);
    assert!(e.contains("at least one"), "{e}");
    let e = infer_err(&Concat::new(0), &[tt(DType::F32, &[])]);
    assert!(e.contains("out of range"), "{e}");
    assert_eq!(
        Concat::new(0)
            .infer(&[&tt(DType::I32, &[2]), &tt(DType::I32, &[3])])
            .unwrap(),
        vec![tt(DType::I32, &[5])]
    );
    let a = iota(DType::F32, &[2, 2]);
    let b = iota(DType::F32, &[3, 3]);
    assert!(Concat::new(0).eval(&[&a, &b]).is_err());
    assert!(parse("Concat", &[])
        .unwrap_err()
        .contains("missing attr 'axis'"));
}

#[test]
fn registry_round_trips() {
    let op = parse("Reshape", &[("shape", AttrValue::Ints(vec![2, -1]))]).unwrap();
    assert_eq!(
        op.downcast_ref::<Reshape>(),
        Some(&Reshape::new(vec![2, -1]))
    );
    assert_round_trip(op.as_ref());
    let op = parse("Transpose", &[("perm", AttrValue::Ints(vec![1, 0]))]).unwrap();
    assert_eq!(
        op.downcast_ref::<Transpose>(),
        Some(&Transpose::new(vec![1, 0]))
    );
    assert_round_trip(op.as_ref());
    let op = parse("Concat", &[("axis", AttrValue::Int(-1))]).unwrap();
    assert_eq!(op.downcast_ref::<Concat>(), Some(&Concat::new(-1)));
    assert_round_trip(op.as_ref());
}

// ---- property tests ----

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn reshape_round_trip(
        shape in prop::collection::vec(0usize..5, 0..=4),
        dtype in 0usize..7,
        seed in any::<u64>(),
        hole in 0usize..4,
    ) {
        let dtype = ALL[dtype];
        let mut rng = Rng(seed);
        let x = random_tensor(dtype, &shape, &mut rng);
        let n: usize = shape.iter().product();
        // Flatten with -1 (when n > 0), then back to the original shape with one dim as -1.
        let flat = if n > 0 { vec![-1] } else { vec![0] };
        let y = Reshape::new(flat).eval(&[&x]).unwrap();
        prop_assert_eq!(y[0].shape(), &[n]);
        let mut back: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        if !back.is_empty() && n > 0 {
            let h = hole % back.len();
            back[h] = -1;
        }
        let z = Reshape::new(back).eval(&[&y[0]]).unwrap();
        prop_assert_eq!(&z[0], &x);
        // A permuted shape has the same element count and keeps the values in order.
        let perm = random_perm(shape.len(), &mut rng);
        let other: Vec<i64> = perm.iter().map(|&p| shape[p] as i64).collect();
        let w = Reshape::new(other).eval(&[&x]).unwrap();
        prop_assert_eq!(w[0].data(), x.data());
    }

    #[test]
    fn transpose_matches_naive_and_inverts(
        shape in prop::collection::vec(0usize..5, 0..=5),
        dtype in 0usize..7,
        seed in any::<u64>(),
    ) {
        let dtype = ALL[dtype];
        let mut rng = Rng(seed);
        let x = random_tensor(dtype, &shape, &mut rng);
        let perm = random_perm(shape.len(), &mut rng);
        let op = Transpose::new(perm.clone());
        let y = op.eval(&[&x]).unwrap();
        let (want_shape, want) = naive_transpose(&x.to_f64_vec(), &shape, &perm);
        prop_assert_eq!(y[0].shape(), want_shape.as_slice());
        prop_assert_eq!(y[0].dtype(), dtype);
        prop_assert_eq!(y[0].to_f64_vec(), want);
        prop_assert_eq!(op.infer(&[&x.ty()]).unwrap(), vec![y[0].ty()]);
        // The inverse permutation undoes it exactly.
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let z = Transpose::new(inv).eval(&[&y[0]]).unwrap();
        prop_assert_eq!(&z[0], &x);
    }
}
