//! Deciding each tensor's precision, as TensorFlow's Grappler `auto_mixed_precision`
//! does (docs/amp-algorithm.md has the phases and the evidence for each).
//!
//! The unit of decision is a *vertex*: one type parameter of one node (an op's
//! [`TypeGroup`]). Most ops have one; BatchNorm's statistics and a Cast's source type
//! are vertices of their own. Every phase is a linear-time walk over flat arrays.

use std::collections::VecDeque;

use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{Cast, Const, Variable};
use ampgraph_graph::{DType, Graph, NodeId};
use foldhash::HashMap;

use super::lists::{ListClass, PrecisionLists};
use super::AmpConfig;
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
    /// ampgraph's phase after TensorFlow's ([`AmpConfig::constant_regions`]):
    /// computed from constants alone, and every reader is f16.
    FromConstants,
}

/// The vertices of a graph and their decisions.
pub struct Painting {
    /// Nodes in topological order; vertices are numbered along it.
    pub order: Vec<NodeId>,
    /// First vertex of each node, indexed by `NodeId::index()` (NONE for vacant ids).
    first: Vec<u32>,
    pub node: Vec<NodeId>,
    /// The vertex's op, as an index into `op_names`.
    pub(crate) op: Vec<u32>,
    /// The op names met, each once (or more when equal names have different addresses).
    pub(crate) op_names: Vec<&'static str>,
    pub class: Vec<Option<ListClass>>,
    /// The vertex's dtype is f32 (only f32 tensors take part in mixed precision).
    pub is_f32: Vec<bool>,
    /// The node may be rewritten: it is not a graph output.
    pub process: Vec<bool>,
    /// The node is a Cast.
    cast: Vec<bool>,
    /// The vertex may become 16-bit: processable, f32, and its type allows it.
    eligible: Vec<bool>,
    /// The graph's edges as painted; the rewrite reads them too.
    pub(crate) adjacency: Adjacency,
    /// The vertex typing each input slot of a node (NONE where no type group holds
    /// the slot).
    slot_vertex: NodeRows,
    /// The vertex typing each output port of a node.
    port_vertex: NodeRows,
    fanin: Csr,
    fanout: Csr,
    pub allow: Vec<bool>,
    pub deny: Vec<bool>,
    pub step: Vec<Step>,
    /// The vertex that caused `step` (NONE for roots).
    pub parent: Vec<u32>,
}

/// Compressed lists: row `r` is `targets[start[r]..start[r + 1]]`.
#[derive(Default)]
struct Csr {
    start: Vec<u32>,
    targets: Vec<u32>,
}

impl Csr {
    /// `n` rows from (row, target) pairs sorted by row.
    fn from_sorted(n: usize, pairs: &[(u32, u32)]) -> Csr {
        let mut start = vec![0u32; n + 1];
        for &(a, _) in pairs {
            start[a as usize + 1] += 1;
        }
        prefix_sums(&mut start);
        Csr {
            start,
            targets: pairs.iter().map(|&(_, b)| b).collect(),
        }
    }

    /// The reverse lists, each sorted when these rows are (a counting sort).
    fn transpose(&self) -> Csr {
        let n = self.start.len() - 1;
        let mut start = vec![0u32; n + 1];
        for &b in &self.targets {
            start[b as usize + 1] += 1;
        }
        prefix_sums(&mut start);
        let mut next = start.clone();
        let mut targets = vec![NONE; self.targets.len()];
        for a in 0..n as u32 {
            for &b in self.of(a) {
                targets[next[b as usize] as usize] = a;
                next[b as usize] += 1;
            }
        }
        Csr { start, targets }
    }

    fn span(&self, row: u32) -> std::ops::Range<usize> {
        self.start[row as usize] as usize..self.start[row as usize + 1] as usize
    }

    fn of(&self, row: u32) -> &[u32] {
        &self.targets[self.span(row)]
    }
}

fn prefix_sums(counts: &mut [u32]) {
    for i in 1..counts.len() {
        counts[i] += counts[i - 1];
    }
}

/// A list of vertices per node, indexed by `NodeId::index()`, set in any node order.
#[derive(Default)]
struct NodeRows {
    span: Vec<(u32, u32)>,
    items: Vec<u32>,
}

impl NodeRows {
    fn new(bound: usize) -> NodeRows {
        NodeRows {
            span: vec![(0, 0); bound],
            items: Vec::with_capacity(bound),
        }
    }

    /// A new row of `len` NONEs for `id`, to fill in.
    fn add(&mut self, id: NodeId, len: usize) -> &mut [u32] {
        let start = self.items.len();
        self.items.resize(start + len, NONE);
        self.span[id.index()] = (start as u32, self.items.len() as u32);
        &mut self.items[start..]
    }

    fn of(&self, id: NodeId) -> &[u32] {
        let (start, end) = self.span[id.index()];
        &self.items[start as usize..end as usize]
    }

    /// Entry `k` of the row of `id`, if a vertex is there.
    fn vertex(&self, id: NodeId, k: usize) -> Option<u32> {
        self.of(id).get(k).copied().filter(|&v| v != NONE)
    }
}

/// Fills `row` (one entry per slot) with the first of `groups` (vertices `first..`)
/// whose `slots_of` holds each slot.
fn fill_vertices(
    row: &mut [u32],
    groups: &[TypeGroup],
    first: u32,
    slots_of: impl Fn(&TypeGroup) -> &[usize],
) {
    for (v, group) in (first..).zip(groups) {
        for &slot in slots_of(group) {
            if let Some(entry) = row.get_mut(slot).filter(|e| **e == NONE) {
                *entry = v;
            }
        }
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
        self.slot_vertex.vertex(id, slot)
    }

    /// The vertex that types output `port` of `id`.
    pub fn output_vertex(&self, id: NodeId, port: usize) -> Option<u32> {
        self.port_vertex.vertex(id, port)
    }

    /// The output ports whose type is vertex `v`.
    pub fn output_ports(&self, v: u32) -> impl Iterator<Item = usize> + '_ {
        let row = self.port_vertex.of(self.node[v as usize]);
        (0..row.len()).filter(move |&port| row[port] == v)
    }

    /// Whether vertex `v` types some input slot.
    fn types_inputs(&self, v: u32) -> bool {
        self.slot_vertex.of(self.node[v as usize]).contains(&v)
    }

    /// Whether the node was a Cast when painted.
    pub(crate) fn is_cast(&self, id: NodeId) -> bool {
        self.cast[self.primary(id) as usize]
    }

    pub fn fanin(&self, v: u32) -> &[u32] {
        self.fanin.of(v)
    }

    pub fn fanout(&self, v: u32) -> &[u32] {
        self.fanout.of(v)
    }

    fn eligible(&self, v: u32) -> bool {
        self.eligible[v as usize]
    }

    fn class_is(&self, v: u32, c: ListClass) -> bool {
        self.class[v as usize] == Some(c)
    }

    /// Builds the vertex graph of `g` and runs every phase.
    pub fn paint(g: &Graph, config: &AmpConfig) -> Result<Painting, PassError> {
        let mut p = Painting::build(g, &config.lists)?;
        if p.allowlist() {
            p.propagate_deny();
            p.between_allow();
            p.infer_follows_allow();
            p.clear_next_to_allow();
            p.casts_to_half();
            if config.constant_regions {
                p.on_constants_read_in_half(g);
            }
        }
        Ok(p)
    }

    fn build(g: &Graph, lists: &PrecisionLists) -> Result<Painting, PassError> {
        let adjacency = g.adjacency();
        let order = g.topo_order_in(&adjacency)?;
        let mut p = Painting {
            first: vec![NONE; g.node_bound()],
            node: Vec::with_capacity(order.len()),
            op: Vec::with_capacity(order.len()),
            op_names: Vec::new(),
            class: Vec::with_capacity(order.len()),
            is_f32: Vec::with_capacity(order.len()),
            process: Vec::with_capacity(order.len()),
            cast: Vec::with_capacity(order.len()),
            eligible: Vec::with_capacity(order.len()),
            adjacency,
            slot_vertex: NodeRows::new(g.node_bound()),
            port_vertex: NodeRows::new(g.node_bound()),
            fanin: Csr::default(),
            fanout: Csr::default(),
            allow: vec![],
            deny: vec![],
            step: vec![],
            parent: vec![],
            order,
        };
        p.add_vertices(g, lists);
        p.fanin = p.vertex_fanin();
        p.fanout = p.fanin.transpose();
        let n = p.len();
        p.allow = vec![false; n];
        p.deny = vec![false; n];
        p.step = vec![Step::None; n];
        p.parent = vec![NONE; n];
        Ok(p)
    }

    /// One vertex per type group of each node, nodes in topological order.
    fn add_vertices(&mut self, g: &Graph, lists: &PrecisionLists) {
        let mut preserved = vec![false; self.first.len()];
        for port in g.outputs() {
            preserved[port.node.index()] = true;
        }
        // Each op name is numbered and looked up in the lists once, not once per node;
        // the names are static, so their address and length identify them.
        let mut ops: HashMap<(usize, usize), (u32, Option<ListClass>)> = HashMap::default();
        let mut group_index: HashMap<(u32, usize, usize), usize> = HashMap::default();
        let mut group_sets: Vec<Vec<TypeGroup>> = Vec::new();
        for &id in &self.order {
            let node = g.node(id);
            let inputs = self.adjacency.inputs(id);
            let first = self.node.len() as u32;
            self.first[id.index()] = first;
            let op = node.op.name();
            let (kind, class) = *ops
                .entry((op.as_ptr() as usize, op.len()))
                .or_insert_with(|| {
                    self.op_names.push(op);
                    (self.op_names.len() as u32 - 1, lists.class(op))
                });
            // A node kept in f32 by name is painted as a denylisted one.
            let class = match lists.kept_f32(&node.name) {
                Some(_) => Some(ListClass::Deny),
                None => class,
            };
            let is_cast = node.op.is::<Cast>();
            let process = !preserved[id.index()];
            // Type groups depend only on the op and its input and output counts
            // (Op::type_groups): computed once per such triple, not once per node.
            let key = (kind, inputs.len(), node.outputs().len());
            let set = *group_index.entry(key).or_insert_with(|| {
                group_sets.push(node.op.type_groups(key.1, key.2));
                group_sets.len() - 1
            });
            let groups = &group_sets[set];
            for group in groups {
                let dtype = match (group.outputs.first(), group.inputs.first()) {
                    (Some(&o), _) => node.outputs()[o].dtype,
                    (None, Some(&i)) => g.ty(inputs[i]).dtype,
                    (None, None) => DType::Bool,
                };
                let is_f32 = dtype == DType::F32;
                self.node.push(id);
                self.op.push(kind);
                self.class.push(class);
                self.is_f32.push(is_f32);
                self.process.push(process);
                self.cast.push(is_cast);
                self.eligible.push(process && is_f32 && group.can_be_half);
            }
            let slots = self.slot_vertex.add(id, inputs.len());
            fill_vertices(slots, groups, first, |t| &t.inputs);
            let ports = self.port_vertex.add(id, node.outputs().len());
            fill_vertices(ports, groups, first, |t| &t.outputs);
        }
    }

    /// The vertex edges (producer's output vertex to consumer's input vertex),
    /// collapsed, as the sorted fanin of each vertex.
    fn vertex_fanin(&self) -> Csr {
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(self.len());
        let mut of_node: Vec<(u32, u32)> = Vec::new();
        for &id in &self.order {
            of_node.clear();
            for (slot, port) in self.adjacency.inputs(id).iter().enumerate() {
                if let (Some(src), Some(dst)) = (
                    self.output_vertex(port.node, port.index),
                    self.input_vertex(id, slot),
                ) {
                    of_node.push((dst, src));
                }
            }
            // Vertices are numbered node by node along `order`: sorting each node's
            // pairs sorts them all.
            of_node.sort_unstable();
            of_node.dedup();
            pairs.extend_from_slice(&of_node);
        }
        Csr::from_sorted(self.len(), &pairs)
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
            for k in self.fanin.span(v) {
                self.join_clear(self.fanin.targets[k], v, &mut queue);
            }
            for k in self.fanout.span(v) {
                self.join_clear(self.fanout.targets[k], v, &mut queue);
            }
        }
    }

    /// Phase 5 at `o`, a neighbour of the f16 vertex `v`.
    fn join_clear(&mut self, o: u32, v: u32, queue: &mut VecDeque<u32>) {
        let i = o as usize;
        if !self.allow[i] && !self.deny[i] && self.class_is(o, ListClass::Clear) && self.eligible(o)
        {
            self.mark_allow(o, Step::ClearNextToAllow, v);
            queue.push_back(o);
        }
    }

    /// Phase 7: an existing Cast to f32 whose consumers are all f16 casts to f16 instead.
    /// (Unlike TensorFlow, a Cast that is a graph output keeps its type.)
    fn casts_to_half(&mut self) {
        for v in 0..self.len() as u32 {
            let i = v as usize;
            // A Cast's destination vertex has outputs and no inputs.
            let destination = self.cast[i] && !self.types_inputs(v);
            if !destination || !self.is_f32[i] || !self.process[i] || self.allow[i] {
                continue;
            }
            let outs = self.fanout.of(v);
            if !outs.is_empty() && outs.iter().all(|&o| self.allow[o as usize]) {
                self.mark_allow(v, Step::CastToHalf, NONE);
            }
        }
    }

    /// ampgraph's phase after TensorFlow's: an infer or clear op computed from Consts
    /// alone (through such ops), every reader of which is f16, becomes f16; readers
    /// first, so a chain joins from its end. Exporters compute a transformer's input
    /// so (token and position embeddings looked up and added, often normalised): in
    /// f32 it is cast at each f16 reader; in f16 its tables are stored in 16 bits
    /// and no cast is left.
    fn on_constants_read_in_half(&mut self, g: &Graph) {
        let n = self.len();
        let mut from_constants = vec![false; n];
        for v in 0..n as u32 {
            let i = v as usize;
            from_constants[i] = if g.node(self.node[i]).op.is::<Const>() {
                self.is_f32[i]
            } else {
                let fanin = self.fanin.of(v);
                self.eligible(v)
                    && !self.allow[i]
                    && !self.deny[i]
                    && matches!(self.class[i], Some(ListClass::Infer | ListClass::Clear))
                    && !fanin.is_empty()
                    && fanin.iter().all(|&f| from_constants[f as usize])
            };
        }
        // Vertices are numbered in topological order: readers come later.
        for v in (0..n as u32).rev() {
            let i = v as usize;
            // Consts (no fanin) are stored in 16 bits by the rewrite where read so.
            if !from_constants[i] || self.allow[i] || self.fanin.of(v).is_empty() {
                continue;
            }
            let readers = self.fanout.of(v);
            if !readers.is_empty() && readers.iter().all(|&r| self.allow[r as usize]) {
                self.mark_allow(v, Step::FromConstants, NONE);
            }
        }
    }
}

/// Source nodes whose casts TensorFlow does not count (their casts are one-off).
pub(crate) fn is_const_or_variable(g: &Graph, id: NodeId) -> bool {
    let op = &g.node(id).op;
    op.is::<Const>() || op.is::<Variable>()
}
