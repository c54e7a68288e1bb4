//! Activation recomputation (llm.c's, torch's checkpointing of cheap layers): a GELU
//! or LayerNorm whose output the backward pass reads too is computed again for it,
//! right before its first backward reader, so that the forward's output dies after its
//! forward readers instead of living through the whole step. Memory for time: one more
//! elementwise or norm kernel each; the user's choice (not in any default pipeline:
//! `--passes ...,recompute-activations,...` before `fuse`).
//!
//! Backward readers are the nodes autodiff built (`gradients/...`, also inside a fused
//! node's name). The copy computes the same op on the same inputs: the same bits.
//!
//! `recompute-input-views` (in the CUDA pipeline) does the same for the layout and
//! precision copies of values the step holds anyway: AMP's NHWC f16 copy of a
//! network's f32 NCHW input images, which the first convolution's filter gradient
//! reads at the very end of the backward pass, costs a quarter of the input's size
//! through the whole step (ResNet-50 at batch 256: 73.5 MiB of the peak, the
//! difference between AMP's and fp32's activations halving exactly); its copy is one
//! transpose of the input.

use std::collections::HashMap;

use ampgraph_graph::ops::{is_source, Cast, LayerNorm, Transpose, Unary, UnaryKind};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::{is_variable_cast, summary};
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
        Ok(recompute_summary("recompute-activations", lines, bytes))
    }
}

/// A recompute pass's summary: its `lines` and the bytes no longer kept.
fn recompute_summary(pass: &str, lines: Vec<String>, bytes: usize) -> PassSummary {
    let mut s = summary(pass, lines);
    s.lines.push(format!(
        "{pass}: {} no longer kept for the backward pass",
        format_bytes(bytes as u64)
    ));
    s
}

/// The `recompute-input-views` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecomputeInputViews;

/// Whether `p` lives through the whole step anyway: a Variable, Placeholder or Const,
/// or a Cast of a Variable (the CUDA executor keeps those from step to step).
fn step_long(g: &Graph, p: Port) -> bool {
    is_source(g.node(p.node).op.as_ref()) || is_variable_cast(g, p.node)
}

/// The chain of Transposes and Casts from `id` down to values that live through the
/// step (`id` first), or `None` where another op is on the way.
fn view_chain(g: &Graph, id: NodeId) -> Option<Vec<NodeId>> {
    let mut chain = vec![id];
    let mut at = id;
    loop {
        let op = &g.node(at).op;
        if !(op.is::<Transpose>() || op.is::<Cast>()) || is_backward(g, at) {
            return None;
        }
        let &[x] = g.inputs(at).as_slice() else {
            return None;
        };
        if step_long(g, x) {
            return Some(chain);
        }
        at = x.node;
        chain.push(at);
    }
}

impl Pass for RecomputeInputViews {
    fn name(&self) -> &'static str {
        "recompute-input-views"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let candidates: Vec<(NodeId, Vec<NodeId>)> = (g.node_ids())
            .filter(|&id| g.node(id).op.is::<Transpose>() && !step_long(g, Port::new(id, 0)))
            .filter_map(|id| view_chain(g, id).map(|chain| (id, chain)))
            .collect();
        let (mut lines, mut bytes) = (Vec::new(), 0usize);
        for (id, chain) in candidates {
            let (backward, forward): (Vec<_>, Vec<_>) = (g.port_consumers(Port::new(id, 0)))
                .into_iter()
                .partition(|&(n, _)| is_backward(g, n));
            if backward.is_empty() || forward.is_empty() {
                continue;
            }
            // The chain again from its step-long end, each copy reading the last.
            let mut copies: HashMap<NodeId, NodeId> = HashMap::new();
            for &n in chain.iter().rev() {
                let inputs: Vec<Port> = (g.inputs(n).iter())
                    .map(|p| copies.get(&p.node).map_or(*p, |&c| Port::new(c, p.index)))
                    .collect();
                let name = g.fresh_name(format!("{}/recomputed", g.node(n).name));
                let op = g.node(n).op.clone();
                copies.insert(n, g.add_node(name, op, &inputs)?);
            }
            let copy = copies[&id];
            let changes = (backward.iter())
                .map(|&(n, slot)| (n, slot, Port::new(copy, 0)))
                .collect();
            g.rewire(changes)?;
            bytes += g.node(id).outputs()[0].size_bytes();
            lines.push(format!(
                "{}: computed again (with {} op(s) under it) for {} backward reader(s)",
                g.node(id).name,
                chain.len() - 1,
                backward.len()
            ));
        }
        Ok(recompute_summary("recompute-input-views", lines, bytes))
    }
}
