//! Scalar multiplications folded into batched products as their `alpha` (BLAS's
//! scale, free in the GEMM): attention's `softmax(Q K^T * s)` stops writing and
//! re-reading its scores for the scale, and the scale's gradient (`dS * s`, read only
//! by the two products of the backward pass) goes into those products.
//!
//! Two shapes fold, in this order:
//! - into the readers: `v * c` (a Mul, or the BinaryGrad of a Mul that is `dy * c`)
//!   that only BatchMatMuls read becomes their alpha, and they read `v`;
//! - into the producer: `BatchMatMul(..) * c` where the Mul alone reads the product.
//!
//! `c` is a scalar Const, or a Cast of one (AMP casts constants into the product's
//! type). Nodes that are graph outputs keep their values and names: they never fold
//! away. In f32 and f64 the result is exact in real arithmetic and rounds within a few
//! ulps of the terms (a product scales its sum where it summed scaled operands); a
//! 16-bit product folds only a power of two (attention's 1/sqrt(64) = 1/8), whose
//! scaling commutes with rounding.

use std::collections::HashSet;

use ampgraph_graph::ops::{BatchMatMul, Binary, BinaryGrad, BinaryKind, Cast};
use ampgraph_graph::{DType, Graph, NodeId, Op, Port};

use crate::rewrite::{const_value, node_error, output_nodes, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `scale-into-matmul` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScaleIntoMatmul;

/// The value of a one-element constant (through a Cast), if `p` is one.
pub(crate) fn scalar(g: &Graph, p: Port) -> Result<Option<f64>, PassError> {
    let mut node = p.node;
    let mut cast_to = None;
    if let Some(cast) = g.node(node).op.downcast_ref::<Cast>() {
        cast_to = Some(cast.to);
        node = g.inputs(node)[0].node;
    }
    let Some(mut value) = const_value(g, node)? else {
        return Ok(None);
    };
    if value.len() != 1 {
        return Ok(None);
    }
    if let Some(to) = cast_to {
        value = Cast { to }
            .eval(&[&value])
            .map_err(|m| node_error(g, p.node, &m))?
            .remove(0);
    }
    Ok(value.to_f64_vec().first().copied())
}

/// `(v, c, the scale's port)` where node `id` computes `v * c` for a scalar constant
/// `c`, with `v` of the node's own type.
fn scaling(g: &Graph, id: NodeId) -> Result<Option<(Port, f64, Port)>, PassError> {
    let node = g.node(id);
    let inputs = g.inputs(id);
    let (v, c, k) = if node.op.downcast_ref::<Binary>().map(|b| b.kind) == Some(BinaryKind::Mul) {
        match (scalar(g, inputs[0])?, scalar(g, inputs[1])?) {
            (_, Some(c)) => (inputs[0], c, inputs[1]),
            (Some(c), None) => (inputs[1], c, inputs[0]),
            (None, None) => return Ok(None),
        }
    } else if let Some(grad) = node.op.downcast_ref::<BinaryGrad>() {
        // d(a * b)/da = dy * b and d/db = dy * a: the other operand is the scale.
        if grad.kind != BinaryKind::Mul {
            return Ok(None);
        }
        match scalar(g, inputs[1 - grad.wrt])? {
            Some(c) => (inputs[2], c, inputs[1 - grad.wrt]),
            None => return Ok(None),
        }
    } else {
        return Ok(None);
    };
    let exact = match g.ty(v).dtype {
        DType::F32 | DType::F64 => true,
        _ => is_power_of_two(c),
    };
    Ok((exact && node.outputs() == [g.ty(v).clone()]).then_some((v, c, k)))
}

/// Whether `c` is ±2^k (scaling by it is exact, short of overflow and subnormals).
fn is_power_of_two(c: f64) -> bool {
    c.is_normal() && c.to_bits() & ((1u64 << 52) - 1) == 0
}

/// Removes a scaling node that now has no readers, then its scale if that is left
/// unread too; returns the bytes of memory traffic saved (its output, written and read).
fn remove_folded(
    g: &mut Graph,
    id: NodeId,
    scale: Port,
    is_output: &[bool],
    removed: &mut HashSet<NodeId>,
) -> Result<usize, PassError> {
    let bytes = 2 * g.node(id).outputs()[0].size_bytes();
    g.remove_node(id)?;
    removed.insert(id);
    remove_unread(g, scale, is_output, removed)?;
    Ok(bytes)
}

/// Removes the scale (a Const, or a Cast and its Const) once nothing reads it.
fn remove_unread(
    g: &mut Graph,
    scale: Port,
    is_output: &[bool],
    removed: &mut HashSet<NodeId>,
) -> Result<(), PassError> {
    let mut node = Some(scale.node);
    while let Some(id) = node {
        if is_output[id.index()] || !g.consumers(id).is_empty() {
            break;
        }
        node = g.inputs(id).first().map(|p| p.node);
        g.remove_node(id)?;
        removed.insert(id);
    }
    Ok(())
}

fn batch_matmul(g: &Graph, id: NodeId) -> Option<&BatchMatMul> {
    g.node(id).op.downcast_ref::<BatchMatMul>()
}

fn scale(g: &mut Graph, id: NodeId, c: f64) -> Result<(), PassError> {
    let op = batch_matmul(g, id)
        .ok_or_else(|| node_error(g, id, "not a BatchMatMul"))?
        .clone();
    let alpha = op.alpha * c;
    g.set_op(id, Box::new(op.with_alpha(alpha)));
    Ok(())
}

impl Pass for ScaleIntoMatmul {
    fn name(&self) -> &'static str {
        "scale-into-matmul"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let order = g.topo_order()?;
        let mut removed: HashSet<NodeId> = HashSet::new();
        let (mut into_readers, mut into_producer, mut bytes) = (0usize, 0usize, 0usize);
        // Readers first: in a chain of scalings the one next to the products folds
        // first, and the one before it then has only products for readers.
        for &id in order.iter().rev() {
            if removed.contains(&id) || is_output[id.index()] {
                continue;
            }
            let Some((v, c, k)) = scaling(g, id)? else {
                continue;
            };
            let readers = g.consumers(id);
            if readers.is_empty()
                || readers
                    .iter()
                    .any(|&(r, _, _)| batch_matmul(g, r).is_none())
            {
                continue;
            }
            for &(reader, slot, _) in &readers {
                scale(g, reader, c)?;
                g.set_input(reader, slot, v)?;
            }
            bytes += remove_folded(g, id, k, &is_output, &mut removed)?;
            into_readers += 1;
        }
        for &id in &order {
            if removed.contains(&id) || is_output[id.index()] {
                continue;
            }
            let Some((v, c, k)) = scaling(g, id)? else {
                continue;
            };
            let sole_reader = g.consumers(v.node).iter().all(|&(r, _, _)| r == id);
            if v.index != 0
                || batch_matmul(g, v.node).is_none()
                || !sole_reader
                || is_output[v.node.index()]
            {
                continue;
            }
            scale(g, v.node, c)?;
            let readers = g.consumers(id);
            g.rewire(readers.iter().map(|&(r, slot, _)| (r, slot, v)).collect())?;
            bytes += remove_folded(g, id, k, &is_output, &mut removed)?;
            into_producer += 1;
        }
        let lines = vec![
            format!(
                "scale-into-matmul: {into_readers} scalings went into the BatchMatMuls that read them, {into_producer} into the BatchMatMul they scale"
            ),
            format!(
                "scale-into-matmul: {} kernels fewer per run, {} of memory traffic saved",
                into_readers + into_producer,
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("scale-into-matmul", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run;
    use ampgraph_graph::ops::{Const, Placeholder, Softmax};
    use ampgraph_graph::{DType, Tensor, TensorType};

    fn input(g: &mut Graph, name: &str, shape: &[usize]) -> Port {
        g.add_node(
            name,
            Box::new(Placeholder(TensorType::new(DType::F32, shape.to_vec()))),
            &[],
        )
        .unwrap()
        .into()
    }

    fn ramp(shape: &[usize], k: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| (i as f64 * k).sin()).collect();
        Tensor::from_f64(DType::F32, shape.to_vec(), &v).unwrap()
    }

    /// Attention scores `softmax(q k^T * 0.125)` and the backward products of a
    /// BinaryGrad `dy * 0.125` standing for the scale's gradient.
    fn attention() -> Graph {
        let mut g = Graph::new();
        let q = input(&mut g, "q", &[2, 4, 8]);
        let k = input(&mut g, "k", &[2, 4, 8]);
        let dy = input(&mut g, "dy", &[2, 4, 4]);
        let s = g.add(BatchMatMul::new(false, true), &[q, k]).unwrap();
        let c = g
            .add(Const::new(Tensor::scalar(DType::F32, 0.125)), &[])
            .unwrap();
        let scaled = g.add(Binary::new(BinaryKind::Mul), &[s, c]).unwrap();
        let p = g.add(Softmax { axis: -1 }, &[scaled]).unwrap();
        let ds = g
            .add(BinaryGrad::new(BinaryKind::Mul, 0), &[s, c, dy])
            .unwrap();
        let dq = g.add(BatchMatMul::new(false, false), &[ds, k]).unwrap();
        let dk = g.add(BatchMatMul::new(true, false), &[ds, q]).unwrap();
        g.set_outputs(vec![p, dq, dk]).unwrap();
        g
    }

    #[test]
    fn the_attention_scale_and_its_gradient_fold_into_the_products() {
        let before = attention();
        let mut after = before.clone();
        let summary = ScaleIntoMatmul.run(&mut after).unwrap();
        after.validate().unwrap();
        assert!(
            summary.lines[0]
                .contains("1 scalings went into the BatchMatMuls that read them, 1 into"),
            "{:?}",
            summary.lines
        );
        let alphas: Vec<f64> = after
            .node_ids()
            .filter_map(|id| batch_matmul(&after, id).map(|b| b.alpha))
            .collect();
        assert_eq!(alphas, vec![0.125; 3]);
        assert!(!after
            .node_ids()
            .any(|id| scaling(&after, id).unwrap().is_some()));
        let feeds = [
            ("q", ramp(&[2, 4, 8], 0.3)),
            ("k", ramp(&[2, 4, 8], 0.7)),
            ("dy", ramp(&[2, 4, 4], 1.1)),
        ]
        .into_iter()
        .collect();
        for (want, got) in run(&before, &feeds).iter().zip(run(&after, &feeds)) {
            for (a, b) in want.to_f64_vec().iter().zip(got.to_f64_vec()) {
                assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
            }
        }
        let mut again = after.clone();
        ScaleIntoMatmul.run(&mut again).unwrap();
        assert_eq!(again.len(), after.len());
    }

    #[test]
    fn sixteen_bit_products_take_powers_of_two_only() {
        assert!(is_power_of_two(0.125) && is_power_of_two(-4.0));
        assert!(!is_power_of_two(0.3) && !is_power_of_two(0.0) && !is_power_of_two(f64::NAN));
        for (c, folds) in [(0.125, true), (1.0 / 96f64.sqrt(), false)] {
            let mut g = Graph::new();
            let ty = TensorType::new(DType::F16, vec![2, 3, 3]);
            let a: Port = g
                .add_node("a", Box::new(Placeholder(ty)), &[])
                .unwrap()
                .into();
            let s = g.add(BatchMatMul::new(false, false), &[a, a]).unwrap();
            let k = g
                .add(Const::new(Tensor::scalar(DType::F16, c)), &[])
                .unwrap();
            let scaled = g.add(Binary::new(BinaryKind::Mul), &[s, k]).unwrap();
            let out = g.add(Softmax { axis: -1 }, &[scaled]).unwrap();
            g.set_outputs(vec![out]).unwrap();
            ScaleIntoMatmul.run(&mut g).unwrap();
            let alpha = batch_matmul(&g, s.node).unwrap().alpha;
            assert_eq!(alpha != 1.0, folds, "scale {c}");
        }
    }

    #[test]
    fn a_scaled_product_read_elsewhere_or_a_graph_output_stays() {
        let mut g = Graph::new();
        let a = input(&mut g, "a", &[2, 3, 3]);
        let s = g.add(BatchMatMul::new(false, false), &[a, a]).unwrap();
        let c = g
            .add(Const::new(Tensor::scalar(DType::F32, 2.0)), &[])
            .unwrap();
        let scaled = g.add(Binary::new(BinaryKind::Mul), &[c, s]).unwrap();
        // The product is an output too, and the scaled value is one.
        g.set_outputs(vec![s, scaled]).unwrap();
        let len = g.len();
        ScaleIntoMatmul.run(&mut g).unwrap();
        assert_eq!(g.len(), len);
        assert_eq!(batch_matmul(&g, s.node).unwrap().alpha, 1.0);
    }
}
