//! Deciding each tensor's precision, as TensorFlow's Grappler `auto_mixed_precision`
//! does (docs/amp-algorithm.md has the phases and the evidence for each).
//!
//! The unit of decision is a *vertex*: one type parameter of one node (an op's
//! [`TypeGroup`]). Most ops have one; BatchNorm's statistics and a Cast's source type
//! are vertices of their own. Every phase is a linear-time walk over flat arrays.

use std::collections::VecDeque;

use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{Cast, Const, Variable};
use ampgraph_graph::{DType, Graph, NodeId};

use super::lists::{ListClass, PrecisionLists};
use crate::PassError;

/// No vertex.
pub(crate) const NONE: u32 = u32::MAX;

/// Why a vertex was painted f16 (or not): recorded as the phases run, for `explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Untouched: stays in its type.
    None,
    /// Phase 1: the op is allowlisted.
    Allowlisted,
    /// Phase 2: reached from a denylisted op through infer/clear ops (parent = where from).
    Denied,
    /// Phase 3: lies between two allowlisted ops.
    BetweenAllow,
    /// Phase 4: an infer op fed by f16 (parent = that producer).
    FollowsAllow,
    /// Phase 5: a clear op next to f16 (parent = that neighbour).
    ClearNextToAllow,
    /// Phase 7: a Cast to f32 whose every consumer is f16 now casts to f16.
    CastToHalf,
}

/// The vertices of a graph and their decisions.
pub struct Painting {
    /// Nodes in topological order; vertices are numbered along it.
    pub order: Vec<NodeId>,
    /// First vertex of each node, indexed by `NodeId::index()` (NONE for vacant ids).
    first: Vec<u32>,
    pub node: Vec<NodeId>,
    pub group: Vec<TypeGroup>,
    pub class: Vec<Option<ListClass>>,
    /// The vertex's dtype is f32 (only f32 tensors take part in mixed precision).
    pub is_f32: Vec<bool>,
    /// The node may be rewritten: it is not a graph output.
    pub process: Vec<bool>,
    /// The node is a Cast.
    cast: Vec<bool>,
    fanin: Csr,
    fanout: Csr,
    pub allow: Vec<bool>,
    pub deny: Vec<bool>,
    pub step: Vec<Step>,
    /// The vertex that caused `step` (NONE for roots).
    pub parent: Vec<u32>,
}

/// Compressed adjacency lists.
struct Csr {
    start: Vec<u32>,
    targets: Vec<u32>,
}

impl Csr {
    fn new(n: usize, mut edges: Vec<(u32, u32)>) -> Csr {
        edges.sort_unstable();
        edges.dedup();
        let mut start = vec![0u32; n + 1];
        for &(a, _) in &edges {
            start[a as usize + 1] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        Csr {
            start,
            targets: edges.into_iter().map(|(_, b)| b).collect(),
        }
    }

    fn of(&self, v: u32) -> &[u32] {
        &self.targets[self.start[v as usize] as usize..self.start[v as usize + 1] as usize]
    }
}

impl Painting {
    pub fn len(&self) -> usize {
        self.node.len()
    }

    pub fn is_empty(&self) -> bool {
        self.node.is_empty()
    }

    /// The vertices of a node.
    pub fn vertices(&self, id: NodeId) -> std::ops::Range<u32> {
        let first = self.first[id.index()];
        let mut end = first;
        while (end as usize) < self.node.len() && self.node[end as usize] == id {
            end += 1;
        }
        first..end
    }

    /// The node's primary vertex: the type of what it produces.
    pub fn primary(&self, id: NodeId) -> u32 {
        self.first[id.index()]
    }

    /// The vertex that types input `slot` of `id`.
    pub fn input_vertex(&self, id: NodeId, slot: usize) -> Option<u32> {
        self.vertices(id)
            .find(|&v| self.group[v as usize].inputs.contains(&slot))
    }

    /// The vertex that types output `port` of `id`.
    pub fn output_vertex(&self, id: NodeId, port: usize) -> Option<u32> {
        self.vertices(id)
            .find(|&v| self.group[v as usize].outputs.contains(&port))
    }

    pub fn fanin(&self, v: u32) -> &[u32] {
        self.fanin.of(v)
    }

    pub fn fanout(&self, v: u32) -> &[u32] {
        self.fanout.of(v)
    }

    fn eligible(&self, v: u32) -> bool {
        let i = v as usize;
        self.process[i] && self.is_f32[i] && self.group[i].can_be_half
    }

    fn class_is(&self, v: u32, c: ListClass) -> bool {
        self.class[v as usize] == Some(c)
    }

    /// Builds the vertex graph of `g` and runs every phase.
    pub fn paint(g: &Graph, lists: &PrecisionLists) -> Result<Painting, PassError> {
        let mut p = Painting::build(g, lists)?;
        if p.allowlist() {
            p.propagate_deny();
            p.between_allow();
            p.infer_follows_allow();
            p.clear_next_to_allow();
            p.casts_to_half();
        }
        Ok(p)
    }

    fn build(g: &Graph, lists: &PrecisionLists) -> Result<Painting, PassError> {
        let order = g.topo_order()?;
        let capacity = g.node_ids().map(|i| i.index() + 1).max().unwrap_or(0);
        let mut preserved = vec![false; capacity];
        for p in g.outputs() {
            preserved[p.node.index()] = true;
        }
        let mut p = Painting {
            first: vec![NONE; capacity],
            node: Vec::with_capacity(order.len()),
            group: Vec::with_capacity(order.len()),
            class: Vec::with_capacity(order.len()),
            is_f32: Vec::with_capacity(order.len()),
            process: Vec::with_capacity(order.len()),
            cast: Vec::with_capacity(order.len()),
            fanin: Csr::new(0, vec![]),
            fanout: Csr::new(0, vec![]),
            allow: vec![],
            deny: vec![],
            step: vec![],
            parent: vec![],
            order,
        };
        let mut inputs_of = Vec::with_capacity(p.order.len());
        for &id in &p.order {
            let node = g.node(id);
            let inputs = g.inputs(id);
            p.first[id.index()] = p.node.len() as u32;
            let class = lists.class(node.op.name());
            for group in node.op.type_groups(inputs.len(), node.outputs().len()) {
                let dtype = match (group.outputs.first(), group.inputs.first()) {
                    (Some(&o), _) => node.outputs()[o].dtype,
                    (None, Some(&i)) => g.ty(inputs[i]).dtype,
                    (None, None) => DType::Bool,
                };
                p.node.push(id);
                p.class.push(class);
                p.is_f32.push(dtype == DType::F32);
                p.process.push(!preserved[id.index()]);
                p.cast.push(node.op.is::<Cast>());
                p.group.push(group);
            }
            inputs_of.push(inputs);
        }
        let mut edges = Vec::new();
        for (&id, inputs) in p.order.iter().zip(&inputs_of) {
            for (slot, port) in inputs.iter().enumerate() {
                if let (Some(src), Some(dst)) = (
                    p.output_vertex(port.node, port.index),
                    p.input_vertex(id, slot),
                ) {
                    edges.push((src, dst));
                }
            }
        }
        let n = p.node.len();
        p.fanin = Csr::new(n, edges.iter().map(|&(a, b)| (b, a)).collect());
        p.fanout = Csr::new(n, edges);
        p.allow = vec![false; n];
        p.deny = vec![false; n];
        p.step = vec![Step::None; n];
        p.parent = vec![NONE; n];
        Ok(p)
    }

    fn mark_allow(&mut self, v: u32, step: Step, parent: u32) {
        self.allow[v as usize] = true;
        self.step[v as usize] = step;
        self.parent[v as usize] = parent;
    }

    /// Phase 1: allowlisted ops go to f16. False when there are none (nothing to do).
    fn allowlist(&mut self) -> bool {
        let mut any = false;
        for v in 0..self.len() as u32 {
            if self.process[v as usize] && self.class_is(v, ListClass::Allow) {
                self.mark_allow(v, Step::Allowlisted, NONE);
                any = true;
            }
        }
        any
    }

    /// Phase 2: deny spreads forward from denylisted ops through infer ops, and
    /// through clear ops that lead (through clear ops) to a deny or infer op.
    fn propagate_deny(&mut self) {
        let n = self.len();
        // Vertices upstream of a deny or infer op through clear ops only.
        let mut upstream = vec![false; n];
        let mut queue: VecDeque<u32> = VecDeque::new();
        for v in 0..n as u32 {
            if self.class_is(v, ListClass::Deny) || self.class_is(v, ListClass::Infer) {
                upstream[v as usize] = true;
                queue.push_back(v);
            }
        }
        while let Some(v) = queue.pop_front() {
            for &i in self.fanin.of(v) {
                if !upstream[i as usize] && self.class_is(i, ListClass::Clear) {
                    upstream[i as usize] = true;
                    queue.push_back(i);
                }
            }
        }
        for v in 0..n as u32 {
            if self.class_is(v, ListClass::Deny) {
                self.deny[v as usize] = true;
                self.step[v as usize] = Step::Denied;
                queue.push_back(v);
            }
        }
        while let Some(v) = queue.pop_front() {
            for k in self.fanout.start[v as usize]..self.fanout.start[v as usize + 1] {
                let o = self.fanout.targets[k as usize];
                if !self.deny[o as usize] && upstream[o as usize] {
                    self.deny[o as usize] = true;
                    self.step[o as usize] = Step::Denied;
                    self.parent[o as usize] = v;
                    queue.push_back(o);
                }
            }
        }
    }

    /// Phase 3: clear and infer ops on a path from one allowlisted op to another.
    fn between_allow(&mut self) {
        let n = self.len();
        let roots: Vec<u32> = (0..n as u32)
            .filter(|&v| self.process[v as usize] && self.class_is(v, ListClass::Allow))
            .collect();
        let mut downstream = vec![false; n];
        let mut queue: VecDeque<u32> = roots.iter().copied().collect();
        for &r in &roots {
            downstream[r as usize] = true;
        }
        while let Some(v) = queue.pop_front() {
            for k in self.fanout.start[v as usize]..self.fanout.start[v as usize + 1] {
                let o = self.fanout.targets[k as usize];
                let passable = matches!(
                    self.class[o as usize],
                    Some(ListClass::Clear | ListClass::Infer)
                );
                if !downstream[o as usize] && passable && !self.deny[o as usize] && self.eligible(o)
                {
                    downstream[o as usize] = true;
                    queue.push_back(o);
                }
            }
        }
        let mut upstream = vec![false; n];
        for &r in &roots {
            upstream[r as usize] = true;
            queue.push_back(r);
        }
        while let Some(v) = queue.pop_front() {
            for k in self.fanin.start[v as usize]..self.fanin.start[v as usize + 1] {
                let i = self.fanin.targets[k as usize];
                if !upstream[i as usize] && downstream[i as usize] {
                    upstream[i as usize] = true;
                    if !self.allow[i as usize] {
                        self.mark_allow(i, Step::BetweenAllow, v);
                    }
                    queue.push_back(i);
                }
            }
        }
    }

    /// Phase 4: an infer op becomes f16 when a producer is f16 and none is denied;
    /// in topological order, so chains of infer ops follow.
    fn infer_follows_allow(&mut self) {
        for v in 0..self.len() as u32 {
            let i = v as usize;
            if self.allow[i]
                || self.deny[i]
                || !self.class_is(v, ListClass::Infer)
                || !self.eligible(v)
            {
                continue;
            }
            let mut allowed_fanin = NONE;
            for &f in self.fanin.of(v) {
                if self.deny[f as usize] {
                    allowed_fanin = NONE;
                    break;
                }
                if self.allow[f as usize] && allowed_fanin == NONE {
                    allowed_fanin = f;
                }
            }
            if allowed_fanin != NONE {
                self.mark_allow(v, Step::FollowsAllow, allowed_fanin);
            }
        }
    }

    /// Phase 5: connected clear ops touching f16 join it (both directions).
    fn clear_next_to_allow(&mut self) {
        let mut queue: VecDeque<u32> = (0..self.len() as u32)
            .filter(|&v| self.allow[v as usize] && self.process[v as usize])
            .collect();
        while let Some(v) = queue.pop_front() {
            let neighbours: Vec<u32> = self
                .fanin
                .of(v)
                .iter()
                .chain(self.fanout.of(v))
                .copied()
                .collect();
            for o in neighbours {
                let i = o as usize;
                if !self.allow[i]
                    && !self.deny[i]
                    && self.class_is(o, ListClass::Clear)
                    && self.eligible(o)
                {
                    self.mark_allow(o, Step::ClearNextToAllow, v);
                    queue.push_back(o);
                }
            }
        }
    }

    /// Phase 7: an existing Cast to f32 whose consumers are all f16 casts to f16 instead.
    /// (Unlike TensorFlow, a Cast that is a graph output keeps its type.)
    fn casts_to_half(&mut self) {
        for v in 0..self.len() as u32 {
            let i = v as usize;
            // A Cast's destination vertex has outputs and no inputs.
            let destination = self.cast[i] && self.group[i].inputs.is_empty();
            if !destination || !self.is_f32[i] || !self.process[i] || self.allow[i] {
                continue;
            }
            let outs = self.fanout.of(v);
            if !outs.is_empty() && outs.iter().all(|&o| self.allow[o as usize]) {
                self.mark_allow(v, Step::CastToHalf, NONE);
            }
        }
    }
}

/// Source nodes whose casts TensorFlow does not count (their casts are one-off).
pub(crate) fn is_const_or_variable(g: &Graph, id: NodeId) -> bool {
    let op = &g.node(id).op;
    op.is::<Const>() || op.is::<Variable>()
}
