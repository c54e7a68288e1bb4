//! A self-attention reads its packed projection. Models that project q, k and v with
//! one matrix (GPT-2's `c_attn`, ViT's `in_proj`) slice its `[B * S, 3 H D]` output
//! into three `[B * S, H D]` copies for the attention, and autodiff joins the three
//! gradients back with a Concat: GPT-2 124M's step spent 1.5 ms of 39 on those copies.
//! This pass gives `FusedAttention` the projection itself, viewed as
//! `qkv [B, S, 3, H, D]` (`packed`: the kernels read q, k and v at their places in each
//! row), and its gradient writes `dqkv` in that layout, which the Concat's readers read
//! as it is (through a Reshape, no copy).
//!
//! Taken: a FusedAttention whose q, k and v are `Reshape(Slice(y))` of one `y [B * S,
//! 3 H D]` (or `[B, S, 3 H D]`, as `torch.onnx.export` splits GPT-2's `c_attn`) at
//! columns 0, H D and 2 H D of its last axis, read by nothing but it and its
//! gradients, each gradient's three outputs reshaped back and joined by one Concat
//! along that axis and read by nothing else. Other attentions are left as they are.

use ampgraph_graph::ops::{Concat, FusedAttention, FusedAttentionGrad, Reshape, Slice};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{redirect, summary};
use crate::{Pass, PassError, PassSummary};

/// The `pack-qkv` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct PackQkv;

/// What one attention's packing rewrites.
struct Packing {
    attention: NodeId,
    /// The attention's op, to be packed.
    op: FusedAttention,
    /// The packed projection, `3 H D` its last axis.
    source: Port,
    /// `[B, S, 3, H, D]`.
    view: [usize; 5],
    /// The forward's q, k and v: Reshapes of Slices.
    parts: [NodeId; 3],
    /// Each gradient node with its op, the Concat joining its outputs and the
    /// Reshapes between.
    grads: Vec<(NodeId, FusedAttentionGrad, NodeId, [NodeId; 3])>,
}

/// The one node reading `port` once, where it is no graph output.
fn sole_reader(g: &Graph, port: Port) -> Option<NodeId> {
    crate::rewrite::sole_reader(g, port).map(|(reader, _)| reader)
}

/// The packing of `attention`, if it reads one packed projection as the module says.
fn packing(g: &Graph, attention: NodeId) -> Option<Packing> {
    let op = g.node(attention).op.downcast_ref::<FusedAttention>()?;
    if op.packed {
        return None;
    }
    let inputs = g.inputs(attention);
    let q = g.ty(inputs[0]);
    let [b, s, h, d] = q.shape[..] else {
        return None;
    };
    let (rows, width) = (b * s, h * d);
    let mut source = None;
    let mut parts = [attention; 3];
    for (j, part) in parts.iter_mut().enumerate() {
        let reshape = inputs[j];
        *part = reshape.node;
        let slice = g.inputs(reshape.node).first().copied()?;
        let is_reshape = g.node(reshape.node).op.is::<Reshape>();
        let cut = g.node(slice.node).op.downcast_ref::<Slice>()?;
        let y = g.inputs(slice.node)[0];
        // y is `[rows, 3 H D]`, or any shape of those rows with that last axis (`[B,
        // S, 3 H D]`, as exporters split it); the cut takes the j-th third of it.
        let shape = &g.ty(y).shape;
        let (last, leading) = shape.split_last()?;
        let mut begin = vec![0; shape.len()];
        begin[shape.len() - 1] = j * width;
        let mut size: Vec<i64> = leading.iter().map(|&n| n as i64).collect();
        size.push(width as i64);
        let place = cut.begin == begin && cut.size == size;
        let whole =
            *last == 3 * width && leading.iter().product::<usize>() == rows && g.ty(reshape) == q;
        if !(is_reshape && place && whole && source.is_none_or(|p| p == y)) {
            return None;
        }
        // The slice feeds this reshape alone.
        if sole_reader(g, slice)? != reshape.node {
            return None;
        }
        source = Some(y);
    }
    // q, k and v are read by the attention and its gradients only, as their first
    // three inputs in order.
    let mut grads = Vec::new();
    for (reader, slot, port) in g.consumers(parts[0]) {
        let expected = (port.index, slot) == (0, 0);
        if reader == attention && expected {
            continue;
        }
        let grad = g.node(reader).op.downcast_ref::<FusedAttentionGrad>()?;
        let reads = &g.inputs(reader)[..3];
        if grad.packed || !expected || reads != &inputs[..3] {
            return None;
        }
        let (concat, reshapes) = joined_gradients(g, reader, &g.ty(source?).shape, width)?;
        grads.push((reader, grad.clone(), concat, reshapes));
    }
    for (j, &part) in parts.iter().enumerate().skip(1) {
        let readers = g.consumers(part);
        let expected = readers.iter().all(|&(reader, slot, _)| {
            slot == j && (reader == attention || grads.iter().any(|(id, ..)| *id == reader))
        });
        if !expected || readers.len() != 1 + grads.len() {
            return None;
        }
    }
    Some(Packing {
        attention,
        op: op.clone(),
        source: source?,
        view: [b, s, 3, h, d],
        parts,
        grads,
    })
}

/// The Concat joining `grad`'s three outputs, each reshaped to the packed projection's
/// `shape` with `width` for its last axis, along that axis, and those Reshapes, if
/// nothing else reads them.
fn joined_gradients(
    g: &Graph,
    grad: NodeId,
    shape: &[usize],
    width: usize,
) -> Option<(NodeId, [NodeId; 3])> {
    let mut part = shape.to_vec();
    *part.last_mut()? = width;
    let mut reshapes = [grad; 3];
    let mut concat = None;
    for (j, reshape) in reshapes.iter_mut().enumerate() {
        *reshape = sole_reader(g, Port::new(grad, j))?;
        let out = Port::new(*reshape, 0);
        let join = sole_reader(g, out)?;
        let is_reshape = g.node(*reshape).op.is::<Reshape>();
        if !is_reshape || g.ty(out).shape != part || concat.is_some_and(|c| c != join) {
            return None;
        }
        concat = Some(join);
    }
    let concat = concat?;
    let axis = g.node(concat).op.downcast_ref::<Concat>()?.axis;
    let joins = g.inputs(concat) == reshapes.map(|r| Port::new(r, 0));
    let last = axis == -1 || axis == part.len() as i64 - 1;
    (joins && last).then_some((concat, reshapes))
}

/// Rewrites one attention and its gradients to read and write the packed projection.
fn pack(g: &mut Graph, p: Packing) -> Result<(), PassError> {
    let name = g.fresh_name(format!("{}/qkv", g.node(p.attention).name));
    let dims = p.view.map(|n| n as i64);
    let view = Port::from(g.add_node(name, Box::new(Reshape::new(dims)), &[p.source])?);
    let mut inputs = vec![view];
    inputs.extend_from_slice(&g.inputs(p.attention)[3..]);
    let packed = FusedAttention {
        packed: true,
        ..p.op
    };
    g.set_node(p.attention, Box::new(packed), &inputs)?;
    let joined = g
        .ty(p.source)
        .shape
        .iter()
        .map(|&n| n as i64)
        .collect::<Vec<_>>();
    for (grad, op, concat, reshapes) in p.grads {
        let mut inputs = vec![view];
        inputs.extend_from_slice(&g.inputs(grad)[3..]);
        let name = g.fresh_name(format!("{}/packed", g.node(grad).name));
        let packed = FusedAttentionGrad { packed: true, ..op };
        let packed = g.add_node(name, Box::new(packed), &inputs)?;
        // The Concat's readers read dqkv as the projection's gradient, in its shape.
        let name = g.fresh_name(format!("{}/joined", g.node(packed).name));
        let reshape = Box::new(Reshape::new(joined.clone()));
        let joined_grad = Port::from(g.add_node(name, reshape, &[Port::new(packed, 0)])?);
        redirect(g, Port::new(concat, 0), joined_grad)?;
        for id in [concat].into_iter().chain(reshapes).chain([grad]) {
            g.remove_node(id)?;
        }
    }
    let slices: Vec<NodeId> = p.parts.iter().map(|&r| g.inputs(r)[0].node).collect();
    for id in p.parts.into_iter().chain(slices) {
        g.remove_node(id)?;
    }
    Ok(())
}

impl Pass for PackQkv {
    fn name(&self) -> &'static str {
        "pack-qkv"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let attentions: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| g.node(id).op.is::<FusedAttention>())
            .collect();
        let (mut packed, mut grads) = (0usize, 0usize);
        for id in attentions {
            if let Some(p) = packing(g, id) {
                grads += p.grads.len();
                pack(g, p)?;
                packed += 1;
            }
        }
        Ok(summary(
            self.name(),
            vec![format!(
                "pack-qkv: {packed} self-attentions read their packed q/k/v projection and {grads} gradients write it packed (3 slices and a Concat fewer each)"
            )],
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{assert_same_bits, count, run, sine};
    use ampgraph_graph::autodiff::gradients;
    use ampgraph_graph::{DType, Tensor};

    /// An exporter's split of a packed projection `y [B, S, 3 H D]` (3-D, as
    /// `torch.onnx.export` writes GPT-2's `c_attn`) into q, k, v `[B, S, H, D]` for a
    /// causal FusedAttention, and the gradient of `sum(o * w)` with respect to `y`.
    #[test]
    fn a_three_dimensional_projection_is_read_packed_with_the_same_bits() {
        let (b, s, h, d) = (2usize, 4usize, 2usize, 4usize);
        let e = h * d;
        let mut g = Graph::new();
        let y = g.placeholder("y", DType::F32, [b, s, 3 * e]).unwrap();
        let w = g.placeholder("w", DType::F32, [b, s, h, d]).unwrap();
        let parts: Vec<Port> = (0..3)
            .map(|j| {
                let cut = Slice::new([0, 0, j * e], [b as i64, s as i64, e as i64]);
                let part = g.add(cut, &[y]).unwrap();
                g.reshape(part, [b as i64, s as i64, h as i64, d as i64])
                    .unwrap()
            })
            .collect();
        let attention = FusedAttention {
            scale: 0.5,
            causal: true,
            key_bias: false,
            packed: false,
            dropout: None,
        };
        let o = g.add(attention, &parts).unwrap();
        let weighted = g.mul(o, w).unwrap();
        let loss = g.sum(weighted, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[y]).unwrap();
        g.set_outputs([vec![o], grads].concat()).unwrap();
        let feeds: HashMap<&str, Tensor> = [
            ("y", sine(&[b, s, 3 * e], 0.37)),
            ("w", sine(&[b, s, h, d], 0.11)),
        ]
        .into();
        let before = run(&g, &feeds);
        // The pipeline's dce first: autodiff leaves each slice's zero-padded gradient.
        crate::simplify::Dce.run(&mut g).unwrap();
        let summary = PackQkv.run(&mut g).unwrap();
        assert!(
            summary.lines[0]
                .contains("1 self-attentions read their packed q/k/v projection and 1 gradients"),
            "{}",
            summary.lines[0]
        );
        g.validate().unwrap();
        assert_eq!((count(&g, "Slice"), count(&g, "Concat")), (0, 0));
        assert_same_bits(&before, &run(&g, &feeds));
    }
}
