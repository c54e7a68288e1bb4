//! Activation recomputation (llm.c's, torch's checkpointing of cheap layers): a GELU
//! or LayerNorm whose output the backward pass reads too is computed again for it,
//! right before its first backward reader, so that the forward's output dies after its
//! forward readers instead of living through the whole step. Memory for time: one more
//! elementwise or norm kernel each; the user's choice (not in any default pipeline:
//! `--passes ...,recompute-activations,...` before `fuse`).
//!
//! Backward readers are the nodes autodiff built (`gradients/...`, also inside a fused
//! node's name). The copy computes the same op on the same inputs: the same bits.

use ampgraph_graph::ops::{LayerNorm, Unary, UnaryKind};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::summary;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `recompute-activations` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecomputeActivations;

/// Whether `op` is cheap to compute again from inputs that stay alive anyway.
fn recomputable(op: &dyn Op) -> bool {
    let gelu = op
        .downcast_ref::<Unary>()
        .is_some_and(|u| matches!(u.kind, UnaryKind::Gelu { .. }));
    gelu || op.is::<LayerNorm>()
}

/// Whether node `id` was built by autodiff for the backward pass.
fn is_backward(g: &Graph, id: NodeId) -> bool {
    let name = &g.node(id).name;
    name.starts_with("gradients/") || name.contains("/gradients/")
}

impl Pass for RecomputeActivations {
    fn name(&self) -> &'static str {
        "recompute-activations"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let candidates: Vec<NodeId> = (g.node_ids())
            .filter(|&id| recomputable(g.node(id).op.as_ref()) && !is_backward(g, id))
            .collect();
        let (mut lines, mut bytes) = (Vec::new(), 0usize);
        for id in candidates {
            let outputs = g.node(id).outputs().len();
            let readers: Vec<(NodeId, usize, Port)> = (0..outputs)
                .flat_map(|k| {
                    let port = Port::new(id, k);
                    g.port_consumers(port)
                        .into_iter()
                        .map(move |(n, slot)| (n, slot, port))
                })
                .collect();
            let (backward, forward): (Vec<_>, Vec<_>) = readers
                .into_iter()
                .partition(|&(n, _, _)| is_backward(g, n));
            if backward.is_empty() || forward.is_empty() {
                continue;
            }
            let name = g.fresh_name(format!("{}/recomputed", g.node(id).name));
            let op = g.node(id).op.clone();
            let inputs = g.inputs(id).to_vec();
            let copy = g.add_node(name, op, &inputs)?;
            let changes = (backward.iter())
                .map(|&(n, slot, p)| (n, slot, Port::new(copy, p.index)))
                .collect();
            g.rewire(changes)?;
            bytes += g.node(id).outputs()[0].size_bytes();
            lines.push(format!(
                "{}: computed again for {} backward reader(s)",
                g.node(id).name,
                backward.len()
            ));
        }
        let mut s = summary("recompute-activations", lines);
        s.lines.push(format!(
            "recompute-activations: {} no longer kept for the backward pass",
            format_bytes(bytes as u64)
        ));
        Ok(s)
    }
}
