//! Row permutations moved past row-wise ops, for `compose-views` to cancel.
//!
//! A row view `Reshape(Transpose(x, p), [M, K])`, `p` keeping the last axis (rows of
//! `x` reordered, each row whole), read by an op that computes each row of its result
//! from the same row of that operand alone (a product's left operand, a BiasAdd, an
//! Add or Mul of a row vector, an elementwise op) is the op on `x`'s rows in their own order,
//! reordered after: `op(Reshape(x, [M, K]))` viewed as `x`'s leading axes, transposed
//! by `p` and reshaped to `[M, N]`. `torch.onnx.export`'s `nn.MultiheadAttention`
//! (`batch_first`, as torchvision's ViT) transposes its input to sequence-first before
//! the packed in-projection and its output back after the out-projection: moved past
//! them, these Transposes meet the ones the attention's operands take and compose
//! away. An FP8 product's operand is read by its cast (row-wise) and by the scale its
//! amax sets, which the order of the rows does not change: the scale reads `x`'s rows
//! as they are, and the view moves past the cast and the product as past a 16-bit one.

use ampgraph_graph::ops::{
    BiasAdd, Binary, Cast, Fp8MatMul, Fp8Scale, MatMul, QuantizeFp8, Reshape, Slice, Transpose,
    Unary,
};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{dims, output_nodes, remove_unread};
use crate::PassError;

/// A row view read by one row-wise op: `x`'s leading axes (those `p` reorders), `p`
/// on them, and the Reshape and Transpose nodes.
struct RowView {
    x: Port,
    lead: Vec<usize>,
    perm: Vec<usize>,
    nodes: [NodeId; 2],
}

/// The row view at `v`, a Reshape to `[M, K]` of a Transpose that keeps in place the
/// trailing axes making up `K` (each read by the next alone), if it is one.
fn row_view(g: &Graph, v: Port, outputs: &[Port]) -> Option<RowView> {
    let reshape = v.node;
    g.node(reshape).op.downcast_ref::<Reshape>()?;
    let t = *g.inputs(reshape).first()?;
    let perm = g.node(t.node).op.downcast_ref::<Transpose>()?.perm.clone();
    let x = *g.inputs(t.node).first()?;
    let shape = &g.ty(x).shape;
    let [m, k] = g.ty(v).shape[..] else {
        return None;
    };
    // The first axis of the row: the trailing axes after it multiply to K.
    let row = (0..shape.len())
        .rev()
        .find(|&j| shape[j..].iter().product::<usize>() >= k)?;
    let rows = shape[row..].iter().product::<usize>() == k
        && shape[..row].iter().product::<usize>() == m
        && (row..shape.len()).all(|i| perm[i] == i);
    let sole = |p: Port| g.port_consumers(p).len() == 1 && !outputs.contains(&p);
    (rows && row > 0 && sole(t) && order_reader(g, v, outputs).is_some()).then(|| RowView {
        x,
        lead: shape[..row].to_vec(),
        perm: perm[..row].to_vec(),
        nodes: [reshape, t.node],
    })
}

/// Whether node `id` reads its input whole, in no order: an FP8 scale (the amax of
/// the values).
fn order_blind(g: &Graph, id: NodeId) -> bool {
    g.node(id).op.is::<Fp8Scale>()
}

/// The one reader of `p` that reads its rows' order (any others are order-blind), if
/// `p` is no graph output.
fn order_reader(g: &Graph, p: Port, outputs: &[Port]) -> Option<(NodeId, usize)> {
    let mut ordered = (g.port_consumers(p).into_iter()).filter(|&(r, _)| !order_blind(g, r));
    match (ordered.next(), ordered.next()) {
        (Some(one), None) if !outputs.contains(&p) => Some(one),
        _ => None,
    }
}

/// Whether `op` computes each row of its `[M, N]` result from the same row of input
/// `slot` (and inputs the same for every row).
fn row_wise(g: &Graph, id: NodeId, slot: usize) -> bool {
    let op = &g.node(id).op;
    if g.ty(Port::new(id, 0)).shape.len() != 2 {
        return false;
    }
    // An FP8 cast's scale is one for every row, and its second output the amax of
    // them all, whatever their order.
    if let Some(q) = op.downcast_ref::<QuantizeFp8>() {
        return slot == 0 && !q.transposed;
    }
    if g.node(id).outputs().len() != 1 {
        return false;
    }
    if let Some(m) = op.downcast_ref::<MatMul>() {
        return slot == 0 && !m.transpose_a;
    }
    // A bias is a row vector; a residual is not.
    if let Some(m) = op.downcast_ref::<Fp8MatMul>() {
        return slot == 0 && !m.product.transpose_a && !m.residual;
    }
    if op.is::<Binary>() {
        let other = g.inputs(id)[1 - slot];
        let shape = &g.ty(other).shape;
        let per_row = shape.len() <= 1 || (shape.len() == 2 && shape[0] == 1);
        return g.inputs(id).len() == 2 && per_row;
    }
    // A BiasAdd of a matrix adds its bias along the last axis in either format.
    (op.is::<BiasAdd>() && slot == 0) || op.is::<Unary>() || op.is::<Cast>()
}

/// The row-wise ops a row view at `v` would move past, in order, where the views after
/// the last of them lead to Transposes it can compose with (else moving it gains
/// nothing, and costs more where the ops widen the rows).
fn path(g: &Graph, v: Port, outputs: &[Port]) -> Option<Vec<NodeId>> {
    row_view(g, v, outputs)?;
    let mut ops = Vec::new();
    let mut at = v;
    while let Some((op, _)) =
        order_reader(g, at, outputs).filter(|&(op, slot)| row_wise(g, op, slot))
    {
        ops.push(op);
        at = Port::new(op, 0);
    }
    (!ops.is_empty() && leads_to_transpose(g, at, outputs)).then_some(ops)
}

/// Whether every path of views from `at` (Reshapes, and Slices where several read a
/// tensor: q, k and v of a packed projection) ends at a Transpose.
fn leads_to_transpose(g: &Graph, at: Port, outputs: &[Port]) -> bool {
    let readers = g.port_consumers(at);
    if readers.is_empty() || outputs.contains(&at) {
        return false;
    }
    readers.iter().all(|&(r, _)| {
        let op = &g.node(r).op;
        let view = op.is::<Reshape>() || op.is::<Slice>();
        (op.is::<Transpose>() && readers.len() == 1)
            || (view
                && (readers.len() == 1 || op.is::<Slice>())
                && leads_to_transpose(g, Port::new(r, 0), outputs))
    })
}

/// Moves each row view past the row-wise ops reading it where it then meets another
/// Transpose ([`path`]); returns how many ops it moved past.
pub(super) fn move_past_row_ops(g: &mut Graph) -> Result<usize, PassError> {
    let outputs = g.outputs().to_vec();
    let starts: Vec<(NodeId, Vec<NodeId>)> = (g.node_ids())
        .filter_map(|r| Some((r, path(g, Port::new(r, 0), &outputs)?)))
        .collect();
    let mut moves = 0;
    let mut stale = Vec::new();
    for (start, ops) in starts {
        let mut view = Port::new(start, 0);
        for op in ops {
            let Some(row) = row_view(g, view, &outputs) else {
                break;
            };
            stale.extend(row.nodes);
            // The view of the matrix a move before left, which this move bypasses.
            stale.push(row.x.node);
            view = move_past(g, row, op)?;
            moves += 1;
        }
    }
    remove_unread(g, stale, &output_nodes(g))?;
    Ok(moves)
}

/// `op` reads `row.x`'s rows in their own order, and the row view moves after it:
/// returns the view's new end, which `op`'s readers read.
fn move_past(g: &mut Graph, row: RowView, op: NodeId) -> Result<Port, PassError> {
    let y = Port::new(op, 0);
    let slot = (g.inputs(op).iter())
        .position(|&p| p == Port::new(row.nodes[0], 0))
        .ok_or_else(|| PassError::Rewrite("a row view's reader lost it".into()))?;
    let [m, n] = g.ty(y).shape[..] else {
        return Err(PassError::Rewrite(
            "a row-wise op's result is a matrix".into(),
        ));
    };
    let k = g.ty(row.x).shape.iter().product::<usize>() / m.max(1);
    let name = g.node(op).name.clone();
    // x's rows as a matrix: the matrix itself where x views one (the result of the op
    // moved past before), so that a product and its bias stay neighbours for the GEMM
    // epilogue.
    let viewed = (g.node(row.x.node).op.is::<Reshape>())
        .then(|| g.inputs(row.x.node)[0])
        .filter(|&p| g.ty(p).shape == [m, k]);
    let rows = match viewed {
        Some(matrix) => matrix,
        None => g
            .add_node(
                g.fresh_name(format!("{name}/rows")),
                Box::new(Reshape::new(dims(&[m, k]))),
                &[row.x],
            )?
            .into(),
    };
    g.set_input(op, slot, rows)?;
    for (blind, blind_slot) in g.port_consumers(Port::new(row.nodes[0], 0)) {
        g.set_input(blind, blind_slot, rows)?;
    }
    let readers = g.port_consumers(y);
    let unrows = g.add_node(
        g.fresh_name(format!("{name}/unrows")),
        Box::new(Reshape::new(dims(&[row.lead.clone(), vec![n]].concat()))),
        &[y],
    )?;
    let perm = [row.perm.clone(), vec![row.lead.len()]].concat();
    let moved = g.add_node(
        g.fresh_name(format!("{name}/reordered")),
        Box::new(Transpose::new(perm)),
        &[unrows.into()],
    )?;
    let back = g.add_node(
        g.fresh_name(format!("{name}/view")),
        Box::new(Reshape::new(dims(&[m, n]))),
        &[moved.into()],
    )?;
    g.rewire(
        readers
            .into_iter()
            .map(|(r, s)| (r, s, back.into()))
            .collect(),
    )?;
    Ok(back.into())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ampgraph_graph::DType;

    use super::*;
    use crate::testing::{assert_same_bits, count, run, sine};

    /// `nn.MultiheadAttention`'s out-projection as exported: the attention's result
    /// transposed to sequence-first, rows, a product, a bias and (here) a Tanh, and
    /// transposed back: the first Transpose moves past the three ops, next to the
    /// second. Without the second it stays.
    #[test]
    fn a_transposed_projection_computes_in_the_inputs_row_order() {
        for back in [true, false] {
            let mut g = Graph::new();
            let x = g.placeholder("x", DType::F32, [2, 3, 2, 2]).unwrap();
            let w = g.placeholder("w", DType::F32, [4, 6]).unwrap();
            let b = g.placeholder("b", DType::F32, [6]).unwrap();
            let t = g.transpose(x, [1, 0, 2, 3]).unwrap();
            let rows = g.reshape(t, [6, 4]).unwrap();
            let product = g.matmul(rows, w).unwrap();
            let biased = g.plus(product, b).unwrap();
            let y = g.tanh(biased).unwrap();
            let mut z = g.reshape(y, [3, 2, 6]).unwrap();
            if back {
                z = g.transpose(z, [1, 0, 2]).unwrap();
            }
            g.set_outputs(vec![z]).unwrap();
            let feeds = HashMap::from([
                ("x", sine(&[2, 3, 2, 2], 0.3)),
                ("w", sine(&[4, 6], 0.7)),
                ("b", sine(&[6], 1.1)),
            ]);
            let mut after = g.clone();
            let moves = move_past_row_ops(&mut after).unwrap();
            after.validate().unwrap();
            assert_same_bits(&run(&g, &feeds), &run(&after, &feeds));
            if !back {
                assert_eq!(moves, 0);
                continue;
            }
            assert_eq!(moves, 3);
            // The product reads x's own rows, the bias and the Tanh the product's
            // result (as the GEMM epilogue wants them); the moved Transpose reads the Tanh.
            let a = after.inputs(product.node)[0];
            assert_eq!(after.inputs(a.node)[0], x);
            assert_eq!(after.inputs(biased.node)[0], product);
            assert_eq!(count(&after, "Transpose"), 2);
            let moved = (after.node_ids())
                .find(|&id| after.node(id).name.ends_with("/reordered"))
                .unwrap();
            assert_eq!(after.inputs(after.inputs(moved)[0].node)[0], y);
        }
    }

    /// The same projection in FP8 under current scaling: the rows' view is read by
    /// their cast and by the scale their amax sets (which reads x's rows in their own
    /// order, the same amax), and moves past the cast and the product to meet the
    /// Transpose back.
    #[test]
    fn an_fp8_projection_computes_in_the_inputs_row_order() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 2, 2]).unwrap();
        let w = g.placeholder("w", DType::F32, [6, 4]).unwrap();
        let t = g.transpose(x, [1, 0, 2, 3]).unwrap();
        let rows = g.reshape(t, [6, 4]).unwrap();
        let cast = |g: &mut Graph, name: &str, v: Port| {
            let scale = (g.add_node(
                format!("{name}/scale"),
                Box::new(Fp8Scale::new(DType::F8E4M3, 0).unwrap()),
                &[v],
            ))
            .unwrap();
            let q = (g.add_node(
                format!("{name}/quantize"),
                Box::new(QuantizeFp8::new(DType::F8E4M3).unwrap()),
                &[v, Port::new(scale, 0)],
            ))
            .unwrap();
            (Port::new(q, 0), Port::new(scale, 1))
        };
        let (a, a_inv) = cast(&mut g, "a", rows);
        let (b, b_inv) = cast(&mut g, "b", w);
        let op = Fp8MatMul::new(MatMul::new(false, true), DType::F32).unwrap();
        let product: Port = (g.add_node("product", Box::new(op), &[a, b, a_inv, b_inv]))
            .unwrap()
            .into();
        let z = g.reshape(product, [3, 2, 6]).unwrap();
        let z = g.transpose(z, [1, 0, 2]).unwrap();
        g.set_outputs(vec![z]).unwrap();
        let feeds = HashMap::from([("x", sine(&[2, 3, 2, 2], 0.3)), ("w", sine(&[6, 4], 0.7))]);
        let mut after = g.clone();
        assert_eq!(move_past_row_ops(&mut after).unwrap(), 2);
        after.validate().unwrap();
        assert_same_bits(&run(&g, &feeds), &run(&after, &feeds));
        // The cast and the scale read x's own rows; one Transpose left before the last.
        let rows_after = after.inputs(a.node)[0];
        assert_eq!(after.inputs(rows_after.node)[0], x);
        let scale = after.inputs(a.node)[1].node;
        assert_eq!(after.inputs(scale)[0], rows_after);
        assert_eq!(count(&after, "Transpose"), 2);
    }
}
