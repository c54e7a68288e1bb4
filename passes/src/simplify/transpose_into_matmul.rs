//! A product operand that is a Transpose moving the last axis next-to-last becomes the
//! product's adjoint flag: `MatMul(a, Transpose(b, [1, 0]))` is `MatMul(a, b,
//! transpose_b)`, and `BatchMatMul(q, Transpose(k, p))` reads `k` (or `k` transposed
//! by `p` with its last two entries swapped) with `adj_y`.
//!
//! Why: exporters write the transposes explicitly (`q @ k.transpose(-1, -2)`,
//! PyTorch's `F.linear` as `x @ w.t()` where not folded into a Gemm, SDPA's
//! decomposition): each is a copy of the operand before the GEMM, which reads it
//! transposed for free, and `fuse-attention` finds attention only as
//! `BatchMatMul(q, k, adj_y)`. A `[B, S, H, D]` key transposed to `[B, H, D, S]`
//! (`[0, 2, 3, 1]`) becomes the heads swap `[0, 2, 1, 3]` with `adj_y`, the form
//! attention fusion takes away.
//!
//! A scalar Mul between the Transpose and the product (SDPA's `k^T * sqrt(scale)`)
//! moves with it: scaling commutes with transposing. Exact in real arithmetic: the
//! product reads the same values, though a GEMM reading an operand transposed may sum
//! its terms in another order (a few ulps).

use ampgraph_graph::ops::{BatchMatMul, Binary, BinaryKind, MatMul, Transpose};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::{output_nodes, read_only_by, remove_unread, summary};
use crate::simplify::scale_into_matmul::scalar;
use crate::{Pass, PassError, PassSummary};

/// The `transpose-into-matmul` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct TransposeIntoMatmul;

/// A product operand to rewrite: the Transpose it reads (through the scalar Mul, if
/// one is between), and the perm left once the last two axes are the product's.
struct Found {
    product: NodeId,
    slot: usize,
    /// The scalar Mul between the Transpose and the product, with its scale's slot.
    mul: Option<(NodeId, usize)>,
    transpose: NodeId,
    rest: Vec<usize>,
}

/// `perm` with its last two entries swapped, where that leaves the last axis last
/// (the Transpose moved the operand's last axis next-to-last).
fn rest_of(perm: &[usize]) -> Option<Vec<usize>> {
    let n = perm.len();
    if n < 2 || perm[n - 2] != n - 1 {
        return None;
    }
    let mut rest = perm.to_vec();
    rest.swap(n - 2, n - 1);
    Some(rest)
}

/// Operand `slot` of product `id`, where it is such a Transpose (through a scalar Mul
/// only the product reads).
fn find(g: &Graph, id: NodeId, slot: usize, outputs: &[bool]) -> Option<Found> {
    let mut p = g.inputs(id)[slot];
    let mut mul = None;
    if let Some(b) = g.node(p.node).op.downcast_ref::<Binary>() {
        let inputs = g.inputs(p.node);
        let scale_slot = (0..2).find(|&s| scalar(g, inputs[s]).ok().flatten().is_some())?;
        if b.kind != BinaryKind::Mul || outputs[p.node.index()] || !read_only_by(g, p, id, slot) {
            return None;
        }
        mul = Some((p.node, scale_slot));
        p = inputs[1 - scale_slot];
        // The scale broadcasts: the Mul's type is its operand's.
        if g.ty(p) != g.ty(g.inputs(id)[slot]) {
            return None;
        }
    }
    let t = g.node(p.node).op.downcast_ref::<Transpose>()?;
    Some(Found {
        product: id,
        slot,
        mul,
        transpose: p.node,
        rest: rest_of(&t.perm)?,
    })
}

/// Another node than `except` computing `op` of `inputs` (which reads `inputs[0]`).
fn twin(g: &Graph, op: &dyn Op, inputs: &[Port], except: Option<NodeId>) -> Option<NodeId> {
    let first = *inputs.first()?;
    (g.port_consumers(first).into_iter())
        .map(|(n, _)| n)
        .filter(|&n| Some(n) != except && g.inputs(n) == inputs)
        .find(|&n| *g.node(n).op == *op && g.node(n).outputs().len() == 1)
}

/// The product's op with the adjoint of operand `slot` flipped.
fn flipped(op: &dyn Op, slot: usize) -> Option<Box<dyn Op>> {
    if let Some(m) = op.downcast_ref::<BatchMatMul>() {
        let mut m = m.clone();
        if slot == 0 {
            m.adj_x = !m.adj_x;
        } else {
            m.adj_y = !m.adj_y;
        }
        return Some(Box::new(m));
    }
    let m = op.downcast_ref::<MatMul>()?;
    let mut m = m.clone();
    if slot == 0 {
        m.transpose_a = !m.transpose_a;
    } else {
        m.transpose_b = !m.transpose_b;
    }
    Some(Box::new(m))
}

impl Pass for TransposeIntoMatmul {
    fn name(&self) -> &'static str {
        "transpose-into-matmul"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let mut lines = Vec::new();
        // A chain of transposes comes off one per round (each round takes one off
        // every operand that has one), until none is left: a fixpoint.
        loop {
            let before = lines.len();
            self.round(g, &mut lines)?;
            if lines.len() == before {
                return Ok(summary("transpose-into-matmul", lines));
            }
        }
    }
}

impl TransposeIntoMatmul {
    /// One rewrite of every product operand found now; its lines appended to `lines`.
    fn round(&self, g: &mut Graph, lines: &mut Vec<String>) -> Result<(), PassError> {
        let outputs = output_nodes(g);
        let found: Vec<Found> = (g.node_ids())
            .filter(|&id| g.node(id).op.is::<BatchMatMul>() || g.node(id).op.is::<MatMul>())
            .flat_map(|id| [(id, 0), (id, 1)])
            .filter_map(|(id, slot)| find(g, id, slot, &outputs))
            .collect();
        let mut stale: Vec<NodeId> = found.iter().map(|f| f.transpose).collect();
        for f in &found {
            let x = g.inputs(f.transpose)[0];
            let identity = f.rest.iter().enumerate().all(|(i, &a)| i == a);
            let rest = Transpose::new(f.rest.clone());
            let mut operand = if identity {
                x
            } else if let Some(same) = twin(g, &rest, &[x], None) {
                Port::new(same, 0)
            } else {
                let name = g.fresh_name(format!("{}/adj", g.node(f.transpose).name));
                g.add_node(name, Box::new(rest), &[x])?.into()
            };
            if let Some((mul, scale_slot)) = f.mul {
                let mut inputs = g.inputs(mul).to_vec();
                inputs[1 - scale_slot] = operand;
                let op = g.node(mul).op.clone();
                g.set_node(mul, op, &inputs)?;
                operand = Port::new(mul, 0);
            }
            let Some(op) = flipped(g.node(f.product).op.as_ref(), f.slot) else {
                continue;
            };
            let mut inputs = g.inputs(f.product).to_vec();
            inputs[f.slot] = operand;
            g.set_node(f.product, op, &inputs)?;
            // A product now computing what another does gives way to it (the
            // transposes of one tensor made two products of the same operands).
            let product = Port::new(f.product, 0);
            let op = g.node(f.product).op.clone();
            if let Some(same) = twin(g, op.as_ref(), &inputs, Some(f.product)) {
                if !outputs[f.product.index()] {
                    let readers = g.port_consumers(product);
                    let to = Port::new(same, 0);
                    g.rewire(readers.into_iter().map(|(n, s)| (n, s, to)).collect())?;
                    stale.push(f.product);
                }
            }
            lines.push(format!(
                "{}: reads operand {} through its adjoint, not the Transpose '{}'",
                g.node(f.product).name,
                f.slot,
                g.node(f.transpose).name
            ));
        }
        // The Transposes (a copy of the operand each) and products nothing reads any
        // more go.
        remove_unread(g, stale, &outputs)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{count, run};
    use ampgraph_graph::ops::Const;
    use ampgraph_graph::{DType, Tensor};

    fn values(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n)
            .map(|i| ((i * 7 + seed) % 13) as f64 / 4.0 - 1.5)
            .collect();
        Tensor::from_f64(DType::F32, shape.to_vec(), &v).unwrap()
    }

    fn feeds(shapes: &[(&'static str, &[usize])]) -> HashMap<&'static str, Tensor> {
        (shapes.iter().enumerate())
            .map(|(i, &(name, shape))| (name, values(shape, i)))
            .collect()
    }

    /// Rewrites `g`, checks the outputs keep their values (to f32's rounding of the
    /// sums: the CPU's GEMM walks a transposed operand in another order) and the pass
    /// is idempotent; returns the summary's lines.
    fn rewrite(g: &mut Graph, feeds: &HashMap<&str, Tensor>) -> Vec<String> {
        let before = run(g, feeds);
        let lines = TransposeIntoMatmul.run(g).unwrap().lines;
        g.validate().unwrap();
        for (want, got) in before.iter().zip(run(g, feeds)) {
            assert_eq!(want.ty(), got.ty());
            let (want, got) = (want.to_f64_vec(), got.to_f64_vec());
            let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (a, b) in want.iter().zip(&got) {
                assert!((a - b).abs() <= 1e-6 * scale, "{a} vs {b}");
            }
        }
        let again = TransposeIntoMatmul.run(g).unwrap().lines;
        assert!(
            again.iter().all(|l| !l.contains("reads operand")),
            "{again:?}"
        );
        lines
    }

    #[test]
    fn a_matrix_transpose_becomes_transpose_b() {
        let mut g = Graph::new();
        let a = g.placeholder("a", DType::F32, [3, 4]).unwrap();
        let b = g.placeholder("b", DType::F32, [5, 4]).unwrap();
        let bt = g.add(Transpose::new(vec![1, 0]), &[b]).unwrap();
        let y = g.add(MatMul::new(false, false), &[a, bt]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let lines = rewrite(&mut g, &feeds(&[("a", &[3, 4]), ("b", &[5, 4])]));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(count(&g, "Transpose"), 0);
        let mm = g.node(y.node).op.downcast_ref::<MatMul>().unwrap();
        assert!(mm.transpose_b && !mm.transpose_a);
    }

    /// A `[B, S, H, D]` key transposed to `[B, H, D, S]` and scaled by a scalar (the
    /// encoder's and SDPA's forms): the heads swap with `adj_y`, the Mul before it.
    #[test]
    fn a_scaled_key_transpose_becomes_the_heads_swap_with_adj_y() {
        let mut g = Graph::new();
        let q = g.placeholder("q", DType::F32, [2, 3, 5, 4]).unwrap();
        let k = g.placeholder("k", DType::F32, [2, 5, 3, 4]).unwrap();
        let kt = g.add(Transpose::new(vec![0, 2, 3, 1]), &[k]).unwrap();
        let c = g
            .add_node(
                "c",
                Box::new(Const::new(Tensor::scalar(DType::F32, 0.7))),
                &[],
            )
            .unwrap();
        let scaled = g
            .add(Binary::new(BinaryKind::Mul), &[kt, c.into()])
            .unwrap();
        let s = g.add(BatchMatMul::new(false, false), &[q, scaled]).unwrap();
        g.set_outputs(vec![s]).unwrap();
        let lines = rewrite(
            &mut g,
            &feeds(&[("q", &[2, 3, 5, 4]), ("k", &[2, 5, 3, 4])]),
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
        let m = g.node(s.node).op.downcast_ref::<BatchMatMul>().unwrap();
        assert!(m.adj_y && !m.adj_x);
        let mul = g.inputs(s.node)[1].node;
        let swap = g.inputs(mul)[0].node;
        let t = g.node(swap).op.downcast_ref::<Transpose>().unwrap();
        assert_eq!(t.perm, [0, 2, 1, 3]);
        assert_eq!(g.inputs(swap)[0], k);
        // The old Transpose went: nothing read it any more.
        assert_eq!(count(&g, "Transpose"), 1);
    }

    /// Two transposes in a row both come off in one run (the pass is idempotent).
    #[test]
    fn a_chain_of_transposes_comes_off_in_one_run() {
        let mut g = Graph::new();
        let a = g.placeholder("a", DType::F32, [4, 4]).unwrap();
        let b = g.placeholder("b", DType::F32, [4, 4]).unwrap();
        let t1 = g.add(Transpose::new(vec![1, 0]), &[b]).unwrap();
        let t2 = g.add(Transpose::new(vec![1, 0]), &[t1]).unwrap();
        let y = g.add(MatMul::new(true, true), &[a, t2]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let lines = rewrite(&mut g, &feeds(&[("a", &[4, 4]), ("b", &[4, 4])]));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(g.inputs(y.node)[1], b);
        let mm = g.node(y.node).op.downcast_ref::<MatMul>().unwrap();
        assert!(mm.transpose_a && mm.transpose_b);
        assert_eq!(count(&g, "Transpose"), 0);
    }

    /// A product that becomes another's twin (`a T(b)` beside `a b^T`) gives way to it,
    /// so that a later CSE finds nothing left to merge (the pass is idempotent inside
    /// any pipeline).
    #[test]
    fn a_product_that_becomes_anothers_twin_gives_way() {
        let mut g = Graph::new();
        let a = g.placeholder("a", DType::F32, [3, 4]).unwrap();
        let b = g.placeholder("b", DType::F32, [5, 4]).unwrap();
        let bt = g.add(Transpose::new(vec![1, 0]), &[b]).unwrap();
        let x = g.add(MatMul::new(false, false), &[a, bt]).unwrap();
        let y = g.add(MatMul::new(false, true), &[a, b]).unwrap();
        let sum = g.add(Binary::new(BinaryKind::Add), &[x, y]).unwrap();
        g.set_outputs(vec![sum]).unwrap();
        rewrite(&mut g, &feeds(&[("a", &[3, 4]), ("b", &[5, 4])]));
        assert_eq!(count(&g, "MatMul"), 1);
        assert_eq!(g.inputs(sum.node), [y, y]);
    }

    /// A Transpose read elsewhere too stays for that reader; one that keeps the last
    /// axis last (the heads swap) is no adjoint and stays in place.
    #[test]
    fn other_readers_and_other_perms_keep_their_transposes() {
        let mut g = Graph::new();
        let q = g.placeholder("q", DType::F32, [2, 3, 5, 4]).unwrap();
        let k = g.placeholder("k", DType::F32, [2, 3, 5, 4]).unwrap();
        let kt = g.add(Transpose::new(vec![0, 1, 3, 2]), &[k]).unwrap();
        let s = g.add(BatchMatMul::new(false, false), &[q, kt]).unwrap();
        let swapped = g.add(Transpose::new(vec![0, 2, 1, 3]), &[q]).unwrap();
        let p = g
            .add(BatchMatMul::new(false, true), &[swapped, swapped])
            .unwrap();
        g.set_outputs(vec![s, kt, p]).unwrap();
        let lines = rewrite(
            &mut g,
            &feeds(&[("q", &[2, 3, 5, 4]), ("k", &[2, 3, 5, 4])]),
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(g.inputs(s.node)[1], k);
        assert_eq!(count(&g, "Transpose"), 2);
    }
}
