//! Gradients of MatMul (all four transpose combinations) and BatchMatMul (adjoint
//! flags, broadcast batch dimensions, rank-2 operands) against central finite
//! differences, the shape of the backward graph (MatMul/BatchMatMul products only, no
//! materialised transpose), and gradients built in f16/bf16/f32 against an f64
//! reference of the same products.

mod common;

use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::ops::{BatchMatMul, MatMul, Placeholder, Reduce, ReduceKind};
use ampgraph_graph::{DType, Graph, Op, Port, Tensor};
use common::*;
use proptest::prelude::*;

/// `op(a)` as a plain row-major `rows x cols` matrix, given a's stored `[r, c]` values.
fn maybe_t(v: &[f64], r: usize, c: usize, t: bool) -> Vec<f64> {
    if !t {
        return v.to_vec();
    }
    let mut out = vec![0.0; v.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = v[i * c + j];
        }
    }
    out
}

/// `[m, k] x [k, n]`, row-major, with the sum of |terms| of each element.
fn matmul_ref(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                out[i * n + j] += a[i * k + l] * b[l * n + j];
                abs[i * n + j] += (a[i * k + l] * b[l * n + j]).abs();
            }
        }
    }
    (out, abs)
}

fn random(rng: &mut Gen, shape: &[usize]) -> Tensor {
    t64(shape, &rng.vec(numel(shape), -1.0, 1.0))
}

fn mat_shape(rows: usize, cols: usize, transposed: bool) -> Vec<usize> {
    if transposed {
        vec![cols, rows]
    } else {
        vec![rows, cols]
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matmul_gradient_matches_finite_differences(
        m in 1usize..=4, k in 1usize..=4, n in 1usize..=4,
        ta: bool, tb: bool, seed: u64,
    ) {
        let mut rng = Gen(seed);
        let a = random(&mut rng, &mat_shape(m, k, ta));
        let b = random(&mut rng, &mat_shape(k, n, tb));
        assert_grad(Box::new(MatMul::new(ta, tb)), &[a, b], seed);
    }

    #[test]
    fn batch_matmul_gradient_matches_finite_differences(
        (batch_a, batch_b) in broadcast_pair(2, 3),
        m in 1usize..=3, k in 1usize..=3, n in 1usize..=3,
        adj_x: bool, adj_y: bool, seed: u64,
    ) {
        let mut rng = Gen(seed);
        let mut sa = batch_a.clone();
        sa.extend(mat_shape(m, k, adj_x));
        let mut sb = batch_b.clone();
        sb.extend(mat_shape(k, n, adj_y));
        let (a, b) = (random(&mut rng, &sa), random(&mut rng, &sb));
        assert_grad(Box::new(BatchMatMul::new(adj_x, adj_y)), &[a, b], seed);
    }
}

#[test]
fn matmul_transpose_combinations_are_exercised_at_fixed_shapes() {
    // Non-square shapes: a wrong transpose flag changes a shape and fails to build.
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut rng = Gen(7);
        let a = random(&mut rng, &mat_shape(3, 5, ta));
        let b = random(&mut rng, &mat_shape(5, 2, tb));
        assert_grad(Box::new(MatMul::new(ta, tb)), &[a, b], 11);
    }
}

#[test]
fn batch_matmul_rank2_and_broadcast_operands() {
    let mut rng = Gen(3);
    let cases: [(&[usize], &[usize]); 5] = [
        (&[2, 3], &[3, 4]),          // both rank 2
        (&[2, 3, 4], &[4, 2]),       // b rank 2, broadcast over a's batch
        (&[3, 4], &[2, 2, 4, 3]),    // a rank 2 against a rank-4 b
        (&[2, 1, 3, 4], &[3, 4, 2]), // broadcast both ways
        (&[1, 2, 3], &[4, 3, 2]),    // a's batch of 1 broadcast
    ];
    for (sa, sb) in cases {
        let (a, b) = (random(&mut rng, sa), random(&mut rng, sb));
        assert_grad(Box::new(BatchMatMul::new(false, false)), &[a, b], 5);
    }
    // With adjoints.
    let (a, b) = (random(&mut rng, &[2, 4, 3]), random(&mut rng, &[5, 4]));
    assert_grad(Box::new(BatchMatMul::new(true, true)), &[a, b], 6);
}

/// The backward graph of one product: the op names of every node the rule added.
fn backward_ops(op: Box<dyn Op>, sa: &[usize], sb: &[usize]) -> Vec<&'static str> {
    let mut g = Graph::new();
    let a: Port = g
        .add_node("a", Box::new(Placeholder(tt(DType::F32, sa))), &[])
        .unwrap()
        .into();
    let b: Port = g
        .add_node("b", Box::new(Placeholder(tt(DType::F32, sb))), &[])
        .unwrap()
        .into();
    let y = g.add_node("y", op, &[a, b]).unwrap();
    let loss = g
        .add(Reduce::new(ReduceKind::Sum, None, false), &[y.into()])
        .unwrap();
    let before = g.len();
    gradients(&mut g, loss, &[a, b]).unwrap();
    g.validate().unwrap();
    let mut ops: Vec<&'static str> = g
        .node_ids()
        .filter(|&id| g.node(id).name.starts_with("gradients/y/"))
        .map(|id| g.node(id).op.name())
        .collect();
    ops.sort_unstable();
    assert!(g.len() > before);
    ops
}

#[test]
fn backward_products_absorb_transposes() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let ops = backward_ops(
            Box::new(MatMul::new(ta, tb)),
            &mat_shape(3, 5, ta),
            &mat_shape(5, 2, tb),
        );
        assert_eq!(
            ops,
            ["MatMul", "MatMul"],
            "transpose_a={ta} transpose_b={tb}"
        );
    }
    for (adj_x, adj_y) in [(false, false), (true, true)] {
        let mut sa = vec![4];
        sa.extend(mat_shape(3, 5, adj_x));
        let ops = backward_ops(
            Box::new(BatchMatMul::new(adj_x, adj_y)),
            &sa,
            &mat_shape(5, 2, adj_y),
        );
        // b was broadcast over the batch: its gradient is summed back (SumTo).
        assert_eq!(ops, ["BatchMatMul", "BatchMatMul", "SumTo"]);
    }
}

/// Gradients built and run in each float dtype (f16 stays f16) agree with an f64
/// reference: da = dy op(b)^T, db = op(a)^T dy with the fixed weights of
/// `graph_gradients` as dy.
#[test]
fn matmul_gradients_in_every_float_dtype() {
    let (m, k, n) = (3, 4, 2);
    for dtype in FLOATS {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let mut rng = Gen(42);
            let (sa, sb) = (mat_shape(m, k, ta), mat_shape(k, n, tb));
            let (a, av) = stored(dtype, &sa, &rng.vec(m * k, -1.0, 1.0));
            let (b, bv) = stored(dtype, &sb, &rng.vec(k * n, -1.0, 1.0));
            let grads = graph_gradients(Box::new(MatMul::new(ta, tb)), &[a, b]);
            assert_eq!(grads[0].dtype(), dtype);
            assert_eq!(grads[1].dtype(), dtype);
            let dy: Vec<f64> = (0..m * n)
                .map(|i| 0.25 + 0.5 * ((i % 5) as f64) / 4.0)
                .collect();
            // Plain (untransposed) operands as row-major matrices.
            let a_mk = maybe_t(&av, sa[0], sa[1], ta);
            let b_kn = maybe_t(&bv, sb[0], sb[1], tb);
            // da_mk = dy [m, n] x b^T [n, k]; db_kn = a^T [k, m] x dy [m, n].
            let (da_mk, da_abs) = matmul_ref(&dy, &maybe_t(&b_kn, k, n, true), m, n, k);
            let (db_kn, db_abs) = matmul_ref(&maybe_t(&a_mk, m, k, true), &dy, k, m, n);
            // Back into the operands' stored layouts.
            let da = maybe_t(&da_mk, m, k, ta);
            let da_abs = maybe_t(&da_abs, m, k, ta);
            let db = maybe_t(&db_kn, k, n, tb);
            let db_abs = maybe_t(&db_abs, k, n, tb);
            for (what, got, want, abs) in [
                ("da", &grads[0], &da, &da_abs),
                ("db", &grads[1], &db, &db_abs),
            ] {
                let floor = abs.iter().cloned().fold(0.0, f64::max);
                check_close(
                    &format!("{what} ta={ta} tb={tb}"),
                    dtype,
                    floor,
                    &got.to_f64_vec(),
                    want,
                );
            }
        }
    }
}

#[test]
fn batch_matmul_gradients_keep_the_operand_dtype_and_shape() {
    for dtype in FLOATS {
        let mut rng = Gen(9);
        let (a, _) = stored(dtype, &[2, 3, 4], &rng.vec(24, -1.0, 1.0));
        let (b, _) = stored(dtype, &[4, 5], &rng.vec(20, -1.0, 1.0));
        let grads = graph_gradients(Box::new(BatchMatMul::new(false, false)), &[a, b]);
        assert_eq!(grads[0].ty(), tt(dtype, &[2, 3, 4]));
        assert_eq!(grads[1].ty(), tt(dtype, &[4, 5]));
    }
}
