//! MatMul and BatchMatMul against an independent float64 reference (naive triple
//! loops written here), in f32, f16, bf16 and f64.
//!
//! Tolerance for an output element of a K-term dot product, per dtype:
//!   |got - ref| <= rtol(dtype) * |ref| + 2 * K * u(dtype) * sum_k |a_ik * b_kj| + tiny
//! with rtol = 1e-12 (f64), 1e-5 (f32), 2e-3 (f16), 1.6e-2 (bf16) covering the final
//! rounding to the storage dtype, u the unit roundoff of the compute type (2^-53 for
//! f64, 2^-24 for f32/f16/bf16, which compute in f32), and tiny the storage dtype's
//! smallest subnormal step.

mod common;

use std::collections::BTreeMap;

use ampgraph_graph::attrs::{AttrReader, AttrValue};
use ampgraph_graph::ops::{parse_op, BatchMatMul, MatMul};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::Rng;
use common::*;
use proptest::prelude::*;

/// Reference (value, sum of |terms|) of a[.., m, k] x b[.., k, n] for one matrix each,
/// `a_at(i, p)` and `b_at(p, j)` reading the (possibly transposed) operands.
fn naive_matmul(
    m: usize,
    k: usize,
    n: usize,
    a_at: impl Fn(usize, usize) -> f64,
    b_at: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut val = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let t = a_at(i, p) * b_at(p, j);
                val[i * n + j] += t;
                abs[i * n + j] += t.abs();
            }
        }
    }
    (val, abs)
}

/// Checks one MatMul of the given logical sizes against the reference.
fn check_matmul(dtype: DType, m: usize, k: usize, n: usize, ta: bool, tb: bool, rng: &mut Rng) {
    let a_shape = if ta { [k, m] } else { [m, k] };
    let b_shape = if tb { [n, k] } else { [k, n] };
    let (a, av) = input(dtype, &a_shape, &rng.vec(m * k));
    let (b, bv) = input(dtype, &b_shape, &rng.vec(k * n));
    let y = run(&MatMul::new(ta, tb), &[&a, &b]);
    assert_eq!(y.shape(), &[m, n]);
    assert_eq!(y.dtype(), dtype);
    let (want, abs) = naive_matmul(
        m,
        k,
        n,
        |i, p| if ta { av[p * m + i] } else { av[i * k + p] },
        |p, j| if tb { bv[j * k + p] } else { bv[p * n + j] },
    );
    check_sums(
        &format!("MatMul {m}x{k}x{n} ta={ta} tb={tb}"),
        dtype,
        k,
        &y.to_f64_vec(),
        &want,
        &abs,
    );
}

#[test]
fn matmul_2x2_by_hand() {
    for dtype in FLOATS {
        let a = Tensor::from_f64(dtype, [2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_f64(dtype, [2, 2], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        let y = run(&MatMul::default(), &[&a, &b]);
        assert_eq!(y.to_f64_vec(), [19.0, 22.0, 43.0, 50.0], "{dtype}");
        // a^T b = [[1,3],[2,4]] x [[5,6],[7,8]]
        let y = run(&MatMul::new(true, false), &[&a, &b]);
        assert_eq!(y.to_f64_vec(), [26.0, 30.0, 38.0, 44.0], "{dtype}");
        // a b^T = [[1,2],[3,4]] x [[5,7],[6,8]]
        let y = run(&MatMul::new(false, true), &[&a, &b]);
        assert_eq!(y.to_f64_vec(), [17.0, 23.0, 39.0, 53.0], "{dtype}");
        // a^T b^T = [[1,3],[2,4]] x [[5,7],[6,8]]
        let y = run(&MatMul::new(true, true), &[&a, &b]);
        assert_eq!(y.to_f64_vec(), [23.0, 31.0, 34.0, 46.0], "{dtype}");
    }
}

#[test]
fn matmul_matches_reference_all_dtypes_and_transposes() {
    let mut rng = Rng(1);
    // Includes shapes above the parallel threshold (2^18 multiply-adds) and odd sizes.
    let sizes = [
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (64, 100, 10),
        (70, 80, 64),
        (1, 300, 1),
    ];
    for dtype in FLOATS {
        for &(m, k, n) in &sizes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                check_matmul(dtype, m, k, n, ta, tb, &mut rng);
            }
        }
    }
}

#[test]
fn matmul_empty_dimensions() {
    for dtype in FLOATS {
        // k = 0: a sum of no terms is zero.
        let a = Tensor::from_f64(dtype, [3, 0], &[]).unwrap();
        let b = Tensor::from_f64(dtype, [0, 2], &[]).unwrap();
        let y = run(&MatMul::default(), &[&a, &b]);
        assert_eq!(y.shape(), &[3, 2]);
        assert!(y.to_f64_vec().iter().all(|&v| v == 0.0));
        // m = 0: an empty result.
        let a = Tensor::from_f64(dtype, [0, 4], &[]).unwrap();
        let b = Tensor::from_f64(dtype, [4, 2], &[0.0; 8]).unwrap();
        let y = run(&MatMul::default(), &[&a, &b]);
        assert_eq!(y.shape(), &[0, 2]);
    }
}

#[test]
fn matmul_shape_errors() {
    let e = infer_err(&MatMul::default(), &[f32t(&[64, 784]), f32t(&[512, 10])]);
    assert_eq!(e, "inner dimensions differ: a is [64, 784], b is [512, 10]");
    let e = infer_err(
        &MatMul::new(false, true),
        &[f32t(&[64, 784]), f32t(&[784, 10])],
    );
    assert!(e.contains("inner dimensions differ"), "{e}");
    assert!(e.contains("[64, 784]") && e.contains("[784, 10]"), "{e}");
    assert!(e.contains("transpose_b"), "{e}");
    // Transposing makes it agree.
    let ok = MatMul::new(false, true)
        .infer(&[&f32t(&[64, 784]), &f32t(&[10, 784])])
        .unwrap();
    assert_eq!(ok[0].shape, [64, 10]);

    let e = infer_err(&MatMul::default(), &[f32t(&[2, 3, 4]), f32t(&[4, 5])]);
    assert!(e.contains("rank 2") && e.contains("[2, 3, 4]"), "{e}");
    let e = infer_err(
        &MatMul::default(),
        &[f32t(&[2, 3]), TensorType::new(DType::F16, vec![3, 4])],
    );
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
    let e = infer_err(
        &MatMul::default(),
        &[
            TensorType::new(DType::I32, vec![2, 3]),
            TensorType::new(DType::I32, vec![3, 4]),
        ],
    );
    assert!(e.contains("float"), "{e}");
    // eval rejects a dtype mismatch too, rather than panicking.
    let a = Tensor::from_f64(DType::F32, [1, 1], &[1.0]).unwrap();
    let b = Tensor::from_f64(DType::F64, [1, 1], &[1.0]).unwrap();
    assert!(MatMul::default().eval(&[&a, &b]).is_err());
    let b = Tensor::from_f64(DType::F32, [2, 1], &[1.0, 2.0]).unwrap();
    let e = MatMul::default().eval(&[&a, &b]).unwrap_err();
    assert!(e.contains("inner dimensions differ"), "{e}");
}

#[test]
fn batch_matmul_matches_reference() {
    let mut rng = Rng(2);
    // (a batch dims, b batch dims, m, k, n)
    type BatchCase<'a> = (&'a [usize], &'a [usize], usize, usize, usize);
    let cases: &[BatchCase] = &[
        (&[], &[], 3, 4, 5),
        (&[2], &[2], 3, 4, 5),
        (&[2, 3], &[3], 4, 5, 6),
        (&[1, 4], &[2, 1], 3, 2, 3),
        (&[3], &[], 2, 6, 2),
        (&[], &[2, 2], 5, 3, 1),
        (&[16], &[16], 8, 8, 8), // many small products: parallel over the batch
        (&[2], &[1], 70, 64, 64), // large products: each parallel
        (&[0, 3], &[3], 2, 2, 2), // empty batch
    ];
    for dtype in FLOATS {
        for &(ba, bb, m, k, n) in cases {
            for (adj_x, adj_y) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut a_shape = ba.to_vec();
                a_shape.extend(if adj_x { [k, m] } else { [m, k] });
                let mut b_shape = bb.to_vec();
                b_shape.extend(if adj_y { [n, k] } else { [k, n] });
                let na: usize = a_shape.iter().product();
                let nb: usize = b_shape.iter().product();
                let (a, av) = input(dtype, &a_shape, &rng.vec(na));
                let (b, bv) = input(dtype, &b_shape, &rng.vec(nb));
                let y = run(&BatchMatMul::new(adj_x, adj_y), &[&a, &b]);

                // Reference batch broadcasting, written out here.
                let rank = ba.len().max(bb.len());
                let pad = |s: &[usize]| {
                    let mut v = vec![1; rank - s.len()];
                    v.extend_from_slice(s);
                    v
                };
                let (pa, pb) = (pad(ba), pad(bb));
                let batch: Vec<usize> = pa
                    .iter()
                    .zip(&pb)
                    .map(|(&x, &y)| if x == 1 { y } else { x })
                    .collect();
                let mut want_shape = batch.clone();
                want_shape.extend([m, n]);
                assert_eq!(y.shape(), &want_shape[..]);
                let nbatch: usize = batch.iter().product();
                let got = y.to_f64_vec();
                for bi in 0..nbatch {
                    // Unravel bi over `batch`, then ravel into each operand's batch.
                    let (mut rem, mut ia, mut ib) = (bi, 0, 0);
                    let (mut sa, mut sb) = (1, 1);
                    for ax in (0..rank).rev() {
                        let idx = rem % batch[ax];
                        rem /= batch[ax];
                        if pa[ax] != 1 {
                            ia += idx * sa;
                        }
                        if pb[ax] != 1 {
                            ib += idx * sb;
                        }
                        sa *= pa[ax];
                        sb *= pb[ax];
                    }
                    let a0 = ia * m * k;
                    let b0 = ib * k * n;
                    let (want, abs) = naive_matmul(
                        m,
                        k,
                        n,
                        |i, p| {
                            if adj_x {
                                av[a0 + p * m + i]
                            } else {
                                av[a0 + i * k + p]
                            }
                        },
                        |p, j| {
                            if adj_y {
                                bv[b0 + j * k + p]
                            } else {
                                bv[b0 + p * n + j]
                            }
                        },
                    );
                    check_sums(
                        &format!("BatchMatMul {a_shape:?} x {b_shape:?} batch {bi}"),
                        dtype,
                        k,
                        &got[bi * m * n..(bi + 1) * m * n],
                        &want,
                        &abs,
                    );
                }
            }
        }
    }
}

#[test]
fn batch_matmul_by_hand() {
    // Two 2x2 products against one shared right operand (broadcast).
    let a = Tensor::from_f64(DType::F32, [2, 2, 2], &[1., 2., 3., 4., 0., 1., 1., 0.]).unwrap();
    let b = Tensor::from_f64(DType::F32, [2, 2], &[5., 6., 7., 8.]).unwrap();
    let y = run(&BatchMatMul::default(), &[&a, &b]);
    assert_eq!(y.shape(), &[2, 2, 2]);
    assert_eq!(y.to_f64_vec(), [19., 22., 43., 50., 7., 8., 5., 6.]);
}

#[test]
fn batch_matmul_shape_errors() {
    let op = BatchMatMul::default();
    let e = infer_err(&op, &[f32t(&[2, 3, 4, 5]), f32t(&[2, 5, 6])]);
    assert!(e.contains("do not broadcast"), "{e}");
    assert!(e.contains("[2, 3]") && e.contains("[2]"), "{e}");
    assert!(e.contains("[2, 3, 4, 5]") && e.contains("[2, 5, 6]"), "{e}");
    let e = infer_err(&op, &[f32t(&[2, 3, 4, 5]), f32t(&[2, 3, 6, 6])]);
    assert!(e.contains("inner dimensions differ"), "{e}");
    assert!(
        e.contains("[2, 3, 4, 5]") && e.contains("[2, 3, 6, 6]"),
        "{e}"
    );
    let e = infer_err(
        &BatchMatMul::new(false, true),
        &[f32t(&[4, 5]), f32t(&[5, 6])],
    );
    assert!(
        e.contains("inner dimensions differ") && e.contains("adj_y"),
        "{e}"
    );
    // adj_x makes [4, 5]^T x [4, 6] valid.
    let ok = BatchMatMul::new(true, false)
        .infer(&[&f32t(&[4, 5]), &f32t(&[4, 6])])
        .unwrap();
    assert_eq!(ok[0].shape, [5, 6]);
    let e = infer_err(&op, &[f32t(&[5]), f32t(&[5, 6])]);
    assert!(e.contains("rank 2 or more") && e.contains("[5]"), "{e}");
    let ok = BatchMatMul::new(false, false)
        .infer(&[&f32t(&[7, 1, 4, 5]), &f32t(&[3, 5, 6])])
        .unwrap();
    assert_eq!(ok[0].shape, [7, 3, 4, 6]);
}

#[test]
fn parse_and_attrs_round_trip() {
    let mut map = BTreeMap::new();
    map.insert("transpose_b".to_string(), AttrValue::Bool(true));
    let op = parse_op("MatMul", AttrReader::new(map)).unwrap();
    assert_eq!(op.downcast_ref::<MatMul>(), Some(&MatMul::new(false, true)));
    let back: BTreeMap<String, AttrValue> = op
        .attrs()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let again = parse_op("MatMul", AttrReader::new(back)).unwrap();
    assert!(*again == *op);

    let mut map = BTreeMap::new();
    map.insert("adj_x".to_string(), AttrValue::Bool(true));
    let op = parse_op("BatchMatMul", AttrReader::new(map)).unwrap();
    assert_eq!(
        op.downcast_ref::<BatchMatMul>(),
        Some(&BatchMatMul::new(true, false))
    );

    let mut map = BTreeMap::new();
    map.insert("transpose_c".to_string(), AttrValue::Bool(true));
    let e = parse_op("MatMul", AttrReader::new(map)).err().unwrap();
    assert!(e.contains("transpose_c"), "{e}");
    let mut map = BTreeMap::new();
    map.insert("transpose_a".to_string(), AttrValue::Int(1));
    let e = parse_op("MatMul", AttrReader::new(map)).err().unwrap();
    assert!(e.contains("transpose_a") && e.contains("boolean"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn prop_transposed_matmul(
        m in 1usize..12, k in 1usize..12, n in 1usize..12,
        ta in any::<bool>(), tb in any::<bool>(),
        d in 0usize..4, seed in any::<u64>(),
    ) {
        check_matmul(FLOATS[d], m, k, n, ta, tb, &mut Rng(seed));
    }
}

/// `cargo test --release -p ampgraph-graph --test ops_linalg -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_matmul_f32_2048() {
    let n = 2048;
    let mut rng = Rng(3);
    let a = Tensor::from_f64(DType::F32, [n, n], &rng.vec(n * n)).unwrap();
    let b = Tensor::from_f64(DType::F32, [n, n], &rng.vec(n * n)).unwrap();
    let op = MatMul::default();
    op.eval(&[&a, &b]).unwrap(); // warm-up
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = std::time::Instant::now();
        op.eval(&[&a, &b]).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gflops = 2.0 * (n as f64).powi(3) / best / 1e9;
    println!("ampgraph MatMul f32 {n}^3: best {best:.3} s, {gflops:.1} GFLOP/s");
}
