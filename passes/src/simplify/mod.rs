//! Graph simplification: constant folding, common-subexpression elimination,
//! dead-node elimination, algebraic identities, widening casts folded into
//! reductions and casts into layer normalisation, scalar scalings folded into
//! batched products, loss-scale unscaling, the gradients' widening and narrowing casts and the master
//! weights' casts folded into the optimizer updates, batch-norm folding, GEMM and convolution-channel padding, and pointwise convolutions
//! as products.
//!
//! Each pass is one small type in its own file. They share the helpers below: which
//! ops hold or write state (never folded, merged or removed as dead), and `Edits`,
//! the rewiring a topological sweep decides and applies in one batch.

pub(crate) mod algebraic;
mod cast_into_norm;
mod cast_into_reduce;
mod cast_into_update;
mod const_fold;
mod conv_as_matmul;
mod cse;
mod dce;
mod fold_batchnorm;
mod grad_cast_into_update;
mod pad_conv_channels;
mod pad_gemm;
pub(crate) mod scale_into_matmul;
mod transpose_into_matmul;
pub(crate) mod unscale_into_update;

pub use algebraic::Algebraic;
pub use cast_into_norm::CastIntoNorm;
pub use cast_into_reduce::CastIntoReduce;
pub use cast_into_update::CastIntoUpdate;
pub use const_fold::ConstFold;
pub use conv_as_matmul::ConvAsMatmul;
pub use cse::Cse;
pub use dce::Dce;
pub use fold_batchnorm::FoldBatchNorm;
pub use grad_cast_into_update::{GradCastIntoUpdate, GradRoundIntoUpdate};
pub use pad_conv_channels::PadConvChannels;
pub use pad_gemm::PadGemm;
pub use scale_into_matmul::ScaleIntoMatmul;
pub use transpose_into_matmul::TransposeIntoMatmul;
pub use unscale_into_update::UnscaleIntoUpdate;

use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::ops::{
    widens_exactly, AssignVariable, Cast, GroupedOptimizerUpdate, IncrementIf, LossScaleUpdate,
    OptimizerUpdate, Placeholder, Variable,
};
use ampgraph_graph::{DType, Graph, NodeId, Op, Port};
use foldhash::{HashMap, HashSet};

use crate::PassError;

/// Ops whose value is not a function of their op and inputs alone (fed or held
/// values) or that compute state written back at the end of a step: never folded or
/// merged.
pub(crate) fn is_stateful(op: &dyn Op) -> bool {
    op.is::<Placeholder>()
        || op.is::<Variable>()
        || op.is::<AssignVariable>()
        || op.is::<OptimizerUpdate>()
        || op.is::<GroupedOptimizerUpdate>()
        || op.is::<LossScaleUpdate>()
        || op.is::<IncrementIf>()
}

/// Ops that change state when they run: the roots, besides the graph outputs, of
/// what must be kept.
pub(crate) fn has_side_effects(op: &dyn Op) -> bool {
    op.is::<AssignVariable>()
}

/// Which nodes run, by node index: what a graph output or a state write depends on.
/// The rest is dead code, which `dce` removes and other passes leave alone.
pub(crate) fn live_nodes(g: &Graph, adj: &Adjacency) -> Vec<bool> {
    let mut live = vec![false; g.node_bound()];
    let mut stack: Vec<_> = g.outputs().iter().map(|p| p.node).collect();
    stack.extend(
        g.node_ids()
            .filter(|&id| has_side_effects(g.node(id).op.as_ref())),
    );
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id.index()], true) {
            stack.extend(adj.inputs(id).iter().map(|p| p.node));
        }
    }
    live
}

/// The narrow tensor a widening Cast at `p` reads, if `p` is a Cast into `wide` that
/// loses nothing (a kernel reading the narrow tensor sees the same values).
pub(crate) fn widened(g: &Graph, p: Port, wide: DType) -> Option<Port> {
    let cast = g.node(p.node).op.downcast_ref::<Cast>()?;
    let [narrow] = g.inputs(p.node)[..] else {
        return None;
    };
    let from = g.ty(narrow).dtype;
    (cast.to == wide && from != wide && widens_exactly(from, wide)).then_some(narrow)
}

/// The one float dtype every node of `readers` casts to, where each is a Cast that
/// is no graph output and whose dtype `fits` accepts (None for no readers): a kernel
/// storing its result in that dtype replaces them all.
pub(crate) fn one_cast_dtype(
    g: &Graph,
    readers: impl IntoIterator<Item = NodeId>,
    is_output: &[bool],
    fits: impl Fn(DType) -> bool,
) -> Option<DType> {
    let cast_to = |c: NodeId| {
        let to = g.node(c).op.downcast_ref::<Cast>()?.to;
        (!is_output[c.index()] && to.is_float() && fits(to)).then_some(to)
    };
    let mut readers = readers.into_iter();
    let first = readers.next().and_then(cast_to);
    first.filter(|_| readers.all(|c| cast_to(c) == first))
}

/// Rewiring decided during one sweep over the graph in topological order and applied
/// in one batch at the end ([`Graph::rewire`] rebuilds every edge, so edge by edge
/// it would be quadratic). While sweeping, [`input`](Edits::input) gives a node's
/// inputs as the edits so far leave them.
pub(crate) struct Edits {
    adj: Adjacency,
    /// Tensors whose readers move to another tensor; targets are never forwarded.
    forward: HashMap<Port, Port>,
    /// Input slots given a new tensor.
    inputs: HashMap<(NodeId, usize), Port>,
    /// Nodes whose every output is forwarded: removed once nothing reads them.
    forwarded: Vec<NodeId>,
}

impl Edits {
    pub fn new(g: &Graph) -> Edits {
        Edits {
            adj: g.adjacency(),
            forward: HashMap::default(),
            inputs: HashMap::default(),
            forwarded: Vec::new(),
        }
    }

    /// The graph's adjacency before any edit.
    pub fn adjacency(&self) -> &Adjacency {
        &self.adj
    }

    /// Input `slot` of `id` as the edits leave it.
    pub fn input(&self, id: NodeId, slot: usize) -> Port {
        let original = self.adj.inputs(id)[slot];
        self.inputs
            .get(&(id, slot))
            .copied()
            .unwrap_or_else(|| self.resolve(original))
    }

    /// Every input of `id` as the edits leave it.
    pub fn inputs(&self, id: NodeId) -> Vec<Port> {
        (0..self.adj.inputs(id).len())
            .map(|slot| self.input(id, slot))
            .collect()
    }

    fn resolve(&self, p: Port) -> Port {
        self.forward.get(&p).copied().unwrap_or(p)
    }

    /// Every reader of `node`'s outputs reads `to(port)` instead; `node` goes away.
    /// `node` must not be a graph output.
    pub fn forward_node(&mut self, node: NodeId, num_outputs: usize, to: impl Fn(usize) -> Port) {
        for k in 0..num_outputs {
            let target = self.resolve(to(k));
            self.forward.insert(Port::new(node, k), target);
        }
        self.forwarded.push(node);
    }

    /// Points input `slot` of `id` at `to`.
    pub fn set_input(&mut self, id: NodeId, slot: usize, to: Port) {
        self.inputs.insert((id, slot), self.resolve(to));
    }

    pub fn forwarded(&self) -> usize {
        self.forwarded.len()
    }

    /// Rewires the graph, removes the forwarded nodes and re-infers the types of the
    /// rewired nodes.
    pub fn apply(self, g: &mut Graph) -> Result<(), PassError> {
        let mut changes = Vec::new();
        for id in g.node_ids() {
            for (slot, &old) in self.adj.inputs(id).iter().enumerate() {
                let new = self.input(id, slot);
                if new != old {
                    changes.push((id, slot, new));
                }
            }
        }
        let mut touched: Vec<NodeId> = changes.iter().map(|c| c.0).collect();
        g.rewire(changes)?;
        let removed: HashSet<NodeId> = self.forwarded.iter().copied().collect();
        for &id in &self.forwarded {
            g.remove_node(id)?;
        }
        touched.retain(|id| !removed.contains(id));
        g.infer_types_from(&touched)?;
        Ok(())
    }
}
