//! The graph: named nodes holding ops, edges carrying tensors from an output port
//! of one node to an input slot of another, and the graph's outputs.

use std::collections::BTreeMap;

use foldhash::HashMap;

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;

use crate::error::{GraphError, Result};
use crate::op::Op;
use crate::tensor::TensorType;

pub type NodeId = NodeIndex;

/// One output of a node: `node:index` in files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Port {
    pub node: NodeId,
    pub index: usize,
}

impl Port {
    pub fn new(node: NodeId, index: usize) -> Self {
        Port { node, index }
    }
}

impl From<NodeId> for Port {
    fn from(node: NodeId) -> Self {
        Port { node, index: 0 }
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: Box<dyn Op>,
    /// Types of the outputs, as inferred from the inputs.
    outputs: Vec<TensorType>,
    /// Attributes whose keys start with `_`: kept for tools, ignored by ampgraph.
    pub annotations: BTreeMap<String, crate::attrs::AttrValue>,
}

impl Node {
    pub fn outputs(&self) -> &[TensorType] {
        &self.outputs
    }

    pub fn op_name(&self) -> &'static str {
        self.op.name()
    }
}

/// An edge: which output of the producer feeds which input slot of the consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Edge {
    from_port: u32,
    to_slot: u32,
}

impl Edge {
    /// Kept in 32 bits: edges are a large part of a graph's memory.
    fn new(from_port: usize, to_slot: usize) -> Edge {
        let narrow = |k: usize| u32::try_from(k).expect("port and slot numbers fit in 32 bits");
        Edge {
            from_port: narrow(from_port),
            to_slot: narrow(to_slot),
        }
    }

    fn port(self) -> usize {
        self.from_port as usize
    }

    fn slot(self) -> usize {
        self.to_slot as usize
    }
}

/// Every node's inputs and readers at one moment, in flat arrays indexed by
/// `NodeId::index()`: for walks over the whole graph, where asking [`Graph::inputs`]
/// node by node would allocate and sort. It goes stale when the graph's edges change.
#[derive(Clone, Debug, Default)]
pub struct Adjacency {
    inputs: InputTable,
    consumer_start: Vec<u32>,
    consumers: Vec<Consumer>,
}

/// The inputs of every node, in slot order.
#[derive(Clone, Debug, Default)]
struct InputTable {
    start: Vec<u32>,
    ports: Vec<Port>,
}

/// One reader of a node's output.
#[derive(Clone, Copy, Debug)]
struct Consumer {
    node: NodeId,
    slot: u32,
    port: u32,
}

impl InputTable {
    /// One pass over the edges: each lands at its slot.
    fn new(g: &Graph) -> InputTable {
        let mut start = vec![0u32; g.node_bound() + 1];
        for e in g.dag.edge_references() {
            start[e.target().index() + 1] += 1;
        }
        prefix_sums(&mut start);
        let mut ports = vec![Port::new(NodeId::end(), 0); g.dag.edge_count()];
        for e in g.dag.edge_references() {
            let t = e.target().index();
            let w = e.weight();
            // The methods that add edges keep a node's input slots 0..n.
            assert!(w.slot() < (start[t + 1] - start[t]) as usize);
            ports[start[t] as usize + w.slot()] = Port::new(e.source(), w.port());
        }
        InputTable { start, ports }
    }

    #[inline]
    fn of(&self, id: NodeId) -> &[Port] {
        let i = id.index();
        &self.ports[self.start[i] as usize..self.start[i + 1] as usize]
    }
}

impl Adjacency {
    fn new(g: &Graph) -> Adjacency {
        let inputs = InputTable::new(g);
        let bound = inputs.start.len() - 1;
        let mut consumer_start = vec![0u32; bound + 1];
        for p in &inputs.ports {
            consumer_start[p.node.index() + 1] += 1;
        }
        prefix_sums(&mut consumer_start);
        // Filled node by node, slot by slot: each node's readers come sorted.
        let mut next = consumer_start.clone();
        let unset = Consumer {
            node: NodeId::end(),
            slot: 0,
            port: 0,
        };
        let mut consumers = vec![unset; inputs.ports.len()];
        for node in (0..bound).map(NodeId::new) {
            for (slot, p) in inputs.of(node).iter().enumerate() {
                let k = &mut next[p.node.index()];
                consumers[*k as usize] = Consumer {
                    node,
                    slot: slot as u32,
                    port: p.index as u32,
                };
                *k += 1;
            }
        }
        Adjacency {
            inputs,
            consumer_start,
            consumers,
        }
    }

    /// The inputs of a node, in slot order (as [`Graph::inputs`]).
    #[inline]
    pub fn inputs(&self, id: NodeId) -> &[Port] {
        self.inputs.of(id)
    }

    /// Every (consumer, input slot) reading any output of `id`, sorted (as
    /// [`Graph::consumers`]).
    pub fn consumers(&self, id: NodeId) -> impl Iterator<Item = (NodeId, usize, Port)> + '_ {
        let i = id.index();
        self.consumers[self.consumer_start[i] as usize..self.consumer_start[i + 1] as usize]
            .iter()
            .map(move |c| (c.node, c.slot as usize, Port::new(id, c.port as usize)))
    }

    /// Every (consumer, input slot) reading `port`, sorted (as [`Graph::port_consumers`]).
    pub fn port_consumers(&self, port: Port) -> impl Iterator<Item = (NodeId, usize)> + '_ {
        self.consumers(port.node)
            .filter(move |c| c.2 == port)
            .map(|(n, s, _)| (n, s))
    }
}

fn prefix_sums(counts: &mut [u32]) {
    for i in 1..counts.len() {
        counts[i] += counts[i - 1];
    }
}

/// Which graph and which of its edits a [`Graph`] is at: a fresh graph (new or
/// cloned) gets a number no other graph in the process has, and every `&mut` method
/// counts an edit. Equal revisions mean the same graph, unchanged, so an executor
/// can keep what it derived from it (its schedule, its memory plan) without hashing
/// the graph again at every step.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Revision {
    graph: u64,
    edits: u64,
}

impl Revision {
    fn fresh() -> Revision {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Revision {
            graph: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            edits: 0,
        }
    }
}

impl Default for Revision {
    fn default() -> Self {
        Revision::fresh()
    }
}

/// A clone is another graph: its edits must not meet the original's revisions.
impl Clone for Revision {
    fn clone(&self) -> Self {
        Revision::fresh()
    }
}

/// A dataflow graph: nodes (an op, a name, the types of its outputs) reading other
/// nodes' outputs ([`Port`]s), and the ports that are its outputs. Built with the
/// builder methods (`placeholder`, `matmul`, `relu`, ... and [`crate::nn`] layers) or
/// loaded from a file ([`crate::format::load`]); every edit checks types at once.
///
/// ```
/// use ampgraph_graph::{DType, Graph};
///
/// let mut g = Graph::new();
/// let x = g.placeholder("x", DType::F32, [2, 3])?;
/// let w = g.placeholder("w", DType::F32, [3, 4])?;
/// let y = g.matmul(x, w)?;
/// let y = g.relu(y)?;
/// g.set_outputs(vec![y])?;
/// assert_eq!(g.ty(y).shape, [2, 4]);
/// # Ok::<(), ampgraph_graph::GraphError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Graph {
    revision: Revision,
    dag: StableDiGraph<Node, Edge>,
    names: HashMap<String, NodeId>,
    outputs: Vec<Port>,
    /// Set by `enable_mixed_precision_graph_rewrite`: a session runs the AMP pass
    /// with this 16-bit type. Files carry it as `_mixed_precision`.
    pub mixed_precision: Option<crate::DType>,
}

impl Graph {
    pub fn new() -> Self {
        Graph::default()
    }

    pub fn len(&self) -> usize {
        self.dag.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.dag.node_count() == 0
    }

    #[inline]
    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.edited();
        &mut self.dag[id]
    }

    /// Counts an edit (every `&mut` method calls it first, or through the one it
    /// delegates to).
    fn edited(&mut self) {
        self.revision.edits += 1;
    }

    /// This graph and its edit count: equal between two calls only if the graph was
    /// not changed in between (see `Revision`).
    pub fn revision(&self) -> (u64, u64) {
        (self.revision.graph, self.revision.edits)
    }

    /// One more than the largest node index: the length of tables indexed by
    /// `NodeId::index()`.
    pub fn node_bound(&self) -> usize {
        self.dag.node_bound()
    }

    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.node_indices()
    }

    pub fn find(&self, name: &str) -> Option<NodeId> {
        self.names.get(name).copied()
    }

    /// The node of that name, or an error naming it.
    pub fn require(&self, name: &str) -> Result<NodeId> {
        self.find(name)
            .ok_or_else(|| GraphError::UnknownNode(name.to_string()))
    }

    /// The type of the tensor at a port.
    #[inline]
    pub fn ty(&self, port: Port) -> &TensorType {
        &self.dag[port.node].outputs[port.index]
    }

    /// The inputs of a node, in slot order.
    pub fn inputs(&self, id: NodeId) -> Vec<Port> {
        let mut edges: Vec<(usize, Port)> = self
            .dag
            .edges_directed(id, Direction::Incoming)
            .map(|e| (e.weight().slot(), Port::new(e.source(), e.weight().port())))
            .collect();
        edges.sort_unstable_by_key(|&(slot, _)| slot);
        edges.into_iter().map(|(_, p)| p).collect()
    }

    /// Every (consumer, input slot) reading any output of `id`.
    pub fn consumers(&self, id: NodeId) -> Vec<(NodeId, usize, Port)> {
        let mut out: Vec<(NodeId, usize, Port)> = self
            .dag
            .edges_directed(id, Direction::Outgoing)
            .map(|e| {
                (
                    e.target(),
                    e.weight().slot(),
                    Port::new(id, e.weight().port()),
                )
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Every (consumer, input slot) reading `port`.
    pub fn port_consumers(&self, port: Port) -> Vec<(NodeId, usize)> {
        self.consumers(port.node)
            .into_iter()
            .filter(|c| c.2 == port)
            .map(|(n, s, _)| (n, s))
            .collect()
    }

    pub fn outputs(&self) -> &[Port] {
        &self.outputs
    }

    pub fn set_outputs(&mut self, outputs: Vec<Port>) -> Result<()> {
        self.edited();
        for p in &outputs {
            self.check_port(*p)?;
        }
        self.outputs = outputs;
        Ok(())
    }

    fn check_port(&self, p: Port) -> Result<()> {
        let node = self
            .dag
            .node_weight(p.node)
            .ok_or_else(|| GraphError::Format(format!("no node with id {}", p.node.index())))?;
        if p.index >= node.outputs.len() {
            return Err(GraphError::node(
                &node.name,
                node.op.name(),
                format!(
                    "has {} outputs, output {} does not exist",
                    node.outputs.len(),
                    p.index
                ),
            ));
        }
        Ok(())
    }

    /// `name` or `name:k`, as files spell a port.
    pub fn port_name(&self, p: Port) -> String {
        let name = &self.dag[p.node].name;
        if p.index == 0 {
            name.clone()
        } else {
            format!("{name}:{}", p.index)
        }
    }

    /// The port spelled `name` or `name:k` (as [`Graph::port_name`] writes it), or an
    /// error when no such node or output exists.
    pub fn port_by_name(&self, s: &str) -> Result<Port> {
        let (id, index) = self.parse_port_name(s).map_err(GraphError::Format)?;
        let port = Port::new(id, index);
        self.check_port(port)?;
        Ok(port)
    }

    /// A name not yet used, from a stem: `matmul`, `matmul_1`, ... (An owned stem is
    /// returned as it is when free.)
    pub fn fresh_name(&self, stem: impl AsRef<str> + Into<String>) -> String {
        if !self.names.contains_key(stem.as_ref()) {
            return stem.into();
        }
        let stem = stem.as_ref();
        // Start at the node count so that naming many nodes stays linear.
        (self.len()..)
            .map(|i| format!("{stem}_{i}"))
            .find(|n| !self.names.contains_key(n))
            .expect("an unused name exists")
    }

    /// The output types of a node `name` computing `op` from `inputs`, after checking
    /// its arity and that every input exists.
    fn output_types(&self, name: &str, op: &dyn Op, inputs: &[Port]) -> Result<Vec<TensorType>> {
        let err = |msg: String| GraphError::node(name, op.name(), msg);
        if !op.arity().accepts(inputs.len()) {
            return Err(err(format!("takes {}, got {}", op.arity(), inputs.len())));
        }
        for p in inputs {
            self.check_port(*p)?;
        }
        let types: Vec<&TensorType> = inputs.iter().map(|p| self.ty(*p)).collect();
        op.infer(&types).map_err(err)
    }

    /// Adds a node, checking its name, arity and input types as it goes.
    pub fn add_node(
        &mut self,
        name: impl Into<String>,
        op: Box<dyn Op>,
        inputs: &[Port],
    ) -> Result<NodeId> {
        self.edited();
        let name = name.into();
        if name.is_empty() {
            return Err(GraphError::Format("a node has an empty name".into()));
        }
        let outputs = self.output_types(&name, op.as_ref(), inputs)?;
        // One lookup of the name both checks it and files the node under it.
        let slot = match self.names.entry(name) {
            std::collections::hash_map::Entry::Occupied(e) => {
                return Err(GraphError::node(
                    e.key(),
                    op.name(),
                    "a node of this name already exists",
                ))
            }
            std::collections::hash_map::Entry::Vacant(v) => v,
        };
        let id = self.dag.add_node(Node {
            name: slot.key().clone(),
            op,
            outputs,
            annotations: BTreeMap::new(),
        });
        slot.insert(id);
        for (slot, p) in inputs.iter().enumerate() {
            self.dag.add_edge(p.node, id, Edge::new(p.index, slot));
        }
        Ok(id)
    }

    /// Adds a node named after its op and returns its output 0.
    pub fn add(&mut self, op: impl Op, inputs: &[Port]) -> Result<Port> {
        let name = self.fresh_name(op.name().to_lowercase());
        Ok(self.add_node(name, Box::new(op), inputs)?.into())
    }

    /// Adds nodes whose inputs may come in any order (as in files): `inputs` name
    /// ports as `node` or `node:k`. Types are inferred once all are present.
    pub fn from_parts(
        parts: Vec<(String, Box<dyn Op>, Vec<String>)>,
        outputs: &[String],
    ) -> Result<Graph> {
        let mut g = Graph::new();
        for (name, op, _) in &parts {
            if g.names.contains_key(name) {
                return Err(GraphError::node(
                    name,
                    op.name(),
                    "a node of this name already exists",
                ));
            }
            if name.is_empty() {
                return Err(GraphError::Format("a node has an empty name".into()));
            }
            let id = g.dag.add_node(Node {
                name: name.clone(),
                op: op.clone(),
                outputs: Vec::new(),
                annotations: BTreeMap::new(),
            });
            g.names.insert(name.clone(), id);
        }
        for (name, op, inputs) in &parts {
            let id = g.names[name];
            if !op.arity().accepts(inputs.len()) {
                return Err(GraphError::node(
                    name,
                    op.name(),
                    format!("takes {}, got {}", op.arity(), inputs.len()),
                ));
            }
            for (slot, input) in inputs.iter().enumerate() {
                let (src, port) = g
                    .parse_port_name(input)
                    .map_err(|m| GraphError::node(name, op.name(), format!("input {slot}: {m}")))?;
                g.dag.add_edge(src, id, Edge::new(port, slot));
            }
        }
        g.infer_types()?;
        let outs = outputs
            .iter()
            .map(|o| {
                g.parse_port_name(o)
                    .map(|(n, i)| Port::new(n, i))
                    .map_err(|m| GraphError::Format(format!("graph output '{o}': {m}")))
            })
            .collect::<Result<Vec<_>>>()?;
        g.set_outputs(outs)?;
        Ok(g)
    }

    fn parse_port_name(&self, s: &str) -> std::result::Result<(NodeId, usize), String> {
        let (name, index) = match s.rsplit_once(':') {
            Some((n, k))
                if !n.is_empty() && k.chars().all(|c| c.is_ascii_digit()) && !k.is_empty() =>
            {
                (
                    n,
                    k.parse::<usize>()
                        .map_err(|_| format!("bad output index in '{s}'"))?,
                )
            }
            _ => (s, 0),
        };
        let id = self
            .find(name)
            .ok_or_else(|| format!("no node named '{name}'"))?;
        Ok((id, index))
    }

    /// Every node's inputs and readers as they are now, in flat arrays.
    pub fn adjacency(&self) -> Adjacency {
        Adjacency::new(self)
    }

    /// Nodes in an order where every node comes after its inputs, otherwise in
    /// insertion (file) order; a cycle is an error naming a node on it.
    pub fn topo_order(&self) -> Result<Vec<NodeId>> {
        self.topo_order_by(&InputTable::new(self))
    }

    /// [`topo_order`](Self::topo_order), reading the edges from `adj` (which must be current).
    pub fn topo_order_in(&self, adj: &Adjacency) -> Result<Vec<NodeId>> {
        self.topo_order_by(&adj.inputs)
    }

    fn topo_order_by(&self, inputs: &InputTable) -> Result<Vec<NodeId>> {
        const NEW: u8 = 0;
        const OPEN: u8 = 1;
        const DONE: u8 = 2;
        let mut state = vec![NEW; self.node_bound()];
        let mut order = Vec::with_capacity(self.len());
        let cycle = |id: NodeId| {
            let n = &self.dag[id];
            GraphError::node(&n.name, n.op.name(), "is part of a cycle")
        };
        // Iterative post-order DFS over inputs; each stack entry is (node, inputs pushed).
        let mut stack: Vec<(NodeId, bool)> = Vec::new();
        for root in self.dag.node_indices() {
            if state[root.index()] != NEW {
                continue;
            }
            stack.push((root, false));
            while let Some((id, expanded)) = stack.pop() {
                if expanded {
                    state[id.index()] = DONE;
                    order.push(id);
                    continue;
                }
                match state[id.index()] {
                    DONE => continue,
                    OPEN => return Err(cycle(id)),
                    _ => {}
                }
                state[id.index()] = OPEN;
                stack.push((id, true));
                // Visit input 0 first: push in reverse slot order.
                for p in inputs.of(id).iter().rev() {
                    match state[p.node.index()] {
                        DONE => {}
                        OPEN => return Err(cycle(p.node)),
                        _ => stack.push((p.node, false)),
                    }
                }
            }
        }
        Ok(order)
    }

    /// Infers every node's output types from scratch, in topological order.
    pub fn infer_types(&mut self) -> Result<()> {
        self.edited();
        let inputs = InputTable::new(self);
        for id in self.topo_order_by(&inputs)? {
            let outputs = self.infer_node(id, inputs.of(id))?;
            self.dag[id].outputs = outputs;
        }
        Ok(())
    }

    /// Re-infers the types of `touched` nodes (a new op or new inputs) and of every
    /// node downstream whose input types changed as a result; the rest keep theirs,
    /// since a node's types follow from its op and its inputs' types alone.
    pub fn infer_types_from(&mut self, touched: &[NodeId]) -> Result<()> {
        self.edited();
        let inputs = InputTable::new(self);
        let bound = self.node_bound();
        let mut dirty = vec![false; bound];
        for t in touched {
            dirty[t.index()] = true;
        }
        let mut changed = vec![false; bound];
        for id in self.topo_order_by(&inputs)? {
            let ins = inputs.of(id);
            if !dirty[id.index()] && !ins.iter().any(|p| changed[p.node.index()]) {
                continue;
            }
            let outputs = self.infer_node(id, ins)?;
            if outputs != self.dag[id].outputs {
                changed[id.index()] = true;
                self.dag[id].outputs = outputs;
            }
        }
        Ok(())
    }

    /// The output types of `id` from its op and the types of `inputs`, its inputs.
    fn infer_node(&self, id: NodeId, inputs: &[Port]) -> Result<Vec<TensorType>> {
        let node = &self.dag[id];
        let err = |msg: String| GraphError::node(&node.name, node.op.name(), msg);
        if !node.op.arity().accepts(inputs.len()) {
            return Err(err(format!(
                "takes {}, got {}",
                node.op.arity(),
                inputs.len()
            )));
        }
        let mut types = Vec::with_capacity(inputs.len());
        for (slot, p) in inputs.iter().enumerate() {
            let src = &self.dag[p.node];
            let ty = src.outputs.get(p.index).ok_or_else(|| {
                err(format!(
                    "input {slot} reads output {} of '{}', which has {} outputs",
                    p.index,
                    src.name,
                    src.outputs.len()
                ))
            })?;
            types.push(ty);
        }
        node.op.infer(&types).map_err(err)
    }

    /// Checks the whole graph: acyclic, every node's types agree with its op's rule,
    /// outputs exist. Passes call this between rewrites in tests and debug builds.
    pub fn validate(&self) -> Result<()> {
        let inputs = InputTable::new(self);
        for id in self.topo_order_by(&inputs)? {
            let inferred = self.infer_node(id, inputs.of(id))?;
            let node = &self.dag[id];
            if inferred != node.outputs {
                return Err(GraphError::node(
                    &node.name,
                    node.op.name(),
                    "recorded output types disagree with its inputs",
                ));
            }
        }
        for p in &self.outputs {
            self.check_port(*p)?;
        }
        Ok(())
    }

    /// Points input `slot` of `consumer` at `to`. Types are re-inferred by the caller;
    /// many edges are rewired in one [`Graph::rewire`].
    pub fn set_input(&mut self, consumer: NodeId, slot: usize, to: Port) -> Result<()> {
        self.rewire(vec![(consumer, slot, to)])
    }

    /// Points each (consumer, slot) of `changes` at its new port, in one linear pass:
    /// petgraph unlinks a removed edge by walking its producer's edge list, so edge
    /// by edge this would be quadratic in a producer's fan-out.
    pub fn rewire(&mut self, mut changes: Vec<(NodeId, usize, Port)>) -> Result<()> {
        self.edited();
        changes.sort_unstable_by_key(|&(n, slot, _)| (n, slot));
        for &(consumer, slot, to) in &changes {
            self.check_port(to)?;
            let has_slot = self
                .dag
                .edges_directed(consumer, Direction::Incoming)
                .any(|e| e.weight().slot() == slot);
            if !has_slot {
                let n = &self.dag[consumer];
                return Err(GraphError::node(
                    &n.name,
                    n.op.name(),
                    format!("has no input {slot}"),
                ));
            }
        }
        // Most consumers keep all their inputs: look those up in `changes` not at all.
        let mut rewired = vec![false; self.node_bound()];
        for &(consumer, _, _) in &changes {
            rewired[consumer.index()] = true;
        }
        let mut edges: Vec<(NodeId, NodeId, Edge)> = Vec::with_capacity(self.dag.edge_count());
        for e in self.dag.edge_references() {
            let (w, consumer) = (*e.weight(), e.target());
            let change = if rewired[consumer.index()] {
                let key = (consumer, w.slot());
                changes.binary_search_by_key(&key, |&(n, s, _)| (n, s)).ok()
            } else {
                None
            };
            edges.push(match change {
                Some(i) => {
                    let to = changes[i].2;
                    (to.node, consumer, Edge::new(to.index, w.slot()))
                }
                None => (e.source(), consumer, w),
            });
        }
        self.dag.clear_edges();
        for (a, b, w) in edges {
            self.dag.add_edge(a, b, w);
        }
        Ok(())
    }

    /// Records a new dtype for the tensor at `port`, for a rewrite that knows what
    /// re-inference would give (the AMP pass: a converted op's outputs take the 16-bit
    /// type, shapes unchanged) and skips it on large graphs. [`validate`](Self::validate)
    /// checks the result in tests and debug builds.
    pub fn set_dtype(&mut self, port: Port, dtype: crate::DType) {
        self.edited();
        self.dag[port.node].outputs[port.index].dtype = dtype;
    }

    /// Replaces the op of a node (same inputs); types are re-inferred by the caller.
    pub fn set_op(&mut self, id: NodeId, op: Box<dyn Op>) {
        self.edited();
        self.dag[id].op = op;
    }

    /// Gives a node a new op and new inputs, keeping its name and its readers: a
    /// rewrite that replaces what a node computes in place (a folded constant, a
    /// cheaper equivalent). Its own types are inferred here; readers' are re-inferred
    /// by the caller where they changed. No reader or graph output may read an output
    /// port the new op lacks.
    pub fn set_node(&mut self, id: NodeId, op: Box<dyn Op>, inputs: &[Port]) -> Result<()> {
        self.edited();
        let node = &self.dag[id];
        let err = |msg: String| GraphError::node(&node.name, op.name(), msg);
        let outputs = self.output_types(&node.name, op.as_ref(), inputs)?;
        let read_ports = self
            .dag
            .edges_directed(id, Direction::Outgoing)
            .map(|e| e.weight().port())
            .chain(
                self.outputs
                    .iter()
                    .filter(|p| p.node == id)
                    .map(|p| p.index),
            );
        if let Some(port) = read_ports.into_iter().find(|&k| k >= outputs.len()) {
            return Err(err(format!(
                "output {port} is read but the new op has {} outputs",
                outputs.len()
            )));
        }
        let old: Vec<_> = self
            .dag
            .edges_directed(id, Direction::Incoming)
            .map(|e| e.id())
            .collect();
        for e in old {
            self.dag.remove_edge(e);
        }
        for (slot, p) in inputs.iter().enumerate() {
            self.dag.add_edge(p.node, id, Edge::new(p.index, slot));
        }
        let node = &mut self.dag[id];
        node.op = op;
        node.outputs = outputs;
        Ok(())
    }

    /// Removes a node that nothing reads.
    pub fn remove_node(&mut self, id: NodeId) -> Result<()> {
        self.edited();
        let node = &self.dag[id];
        if self
            .dag
            .edges_directed(id, Direction::Outgoing)
            .next()
            .is_some()
            || self.outputs.iter().any(|p| p.node == id)
        {
            return Err(GraphError::node(
                &node.name,
                node.op.name(),
                "cannot be removed while it is read",
            ));
        }
        let name = node.name.clone();
        self.names.remove(&name);
        self.dag.remove_node(id);
        Ok(())
    }

    /// Which nodes `ports` depend on (their own included), by node index: with the
    /// graph's outputs, the nodes that are not dead code.
    pub fn needed_by(&self, ports: &[Port]) -> Vec<bool> {
        let mut needed = vec![false; self.node_bound()];
        let mut stack: Vec<NodeId> = ports.iter().map(|p| p.node).collect();
        while let Some(id) = stack.pop() {
            if !std::mem::replace(&mut needed[id.index()], true) {
                stack.extend(self.inputs(id).into_iter().map(|p| p.node));
            }
        }
        needed
    }

    /// Keeps only what `keep` depends on, which become the outputs: an inference
    /// graph from a training graph drops gradients, updates and optimizer slots.
    pub fn prune(&mut self, keep: &[Port]) -> Result<()> {
        self.edited();
        for p in keep {
            self.check_port(*p)?;
        }
        let needed = self.needed_by(keep);
        let dead: Vec<NodeId> = self
            .dag
            .node_indices()
            .filter(|id| !needed[id.index()])
            .collect();
        for id in dead {
            let name = self.dag[id].name.clone();
            self.names.remove(&name);
            self.dag.remove_node(id);
        }
        self.outputs = keep.to_vec();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{BatchNorm, Const, Placeholder, Unary, UnaryKind};
    use crate::DType;

    #[test]
    fn ports_spelled_by_name_round_trip_and_unknown_ones_are_errors() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2]);
        let x = g.add_node("x", Box::new(Placeholder(ty)), &[]).unwrap();
        let y = g.add(Unary::new(UnaryKind::Exp), &[x.into()]).unwrap();
        for p in [Port::from(x), y] {
            assert_eq!(g.port_by_name(&g.port_name(p)).unwrap(), p);
        }
        let missing = g.port_by_name("ghost").unwrap_err().to_string();
        assert_eq!(missing, "no node named 'ghost'");
        let past = g.port_by_name("x:1").unwrap_err().to_string();
        assert!(past.contains("output 1 does not exist"), "{past}");
    }

    #[test]
    fn the_revision_changes_with_every_edit_and_differs_between_graphs() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2]);
        let x = g.add_node("x", Box::new(Placeholder(ty)), &[]).unwrap();
        let r0 = g.revision();
        let _ = (g.topo_order().unwrap(), g.len(), g.ty(Port::new(x, 0)));
        assert_eq!(g.revision(), r0, "reads leave it");
        let y = g
            .add(Unary::new(UnaryKind::Exp), &[Port::new(x, 0)])
            .unwrap();
        let r1 = g.revision();
        assert_ne!(r1, r0);
        g.node_mut(y.node)
            .annotations
            .insert("k".into(), "v".into());
        assert_ne!(g.revision(), r1, "a mutable borrow of a node counts");
        let r2 = g.revision();
        g.set_outputs(vec![y]).unwrap();
        assert_ne!(g.revision(), r2);
        // A clone is another graph: the same edits on both never give equal revisions.
        let mut h = g.clone();
        assert_ne!(h.revision().0, g.revision().0);
        g.set_op(y.node, Box::new(Unary::new(UnaryKind::Log)));
        h.set_op(y.node, Box::new(Unary::new(UnaryKind::Tanh)));
        assert_ne!(g.revision(), h.revision());
        assert_ne!(Graph::new().revision(), Graph::new().revision());
    }

    #[test]
    fn set_node_replaces_op_and_inputs_keeping_name_and_readers() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2]);
        let x = g
            .add_node("x", Box::new(Placeholder(ty.clone())), &[])
            .unwrap();
        let y = g
            .add_node("y", Box::new(Unary::new(UnaryKind::Relu)), &[x.into()])
            .unwrap();
        let z = g
            .add_node("z", Box::new(Unary::new(UnaryKind::Neg)), &[y.into()])
            .unwrap();
        g.set_outputs(vec![y.into()]).unwrap();
        let c = Const::new(crate::Tensor::from_f64(DType::F32, [2], &[1.0, 2.0]).unwrap());
        g.set_node(y, Box::new(c), &[]).unwrap();
        g.validate().unwrap();
        assert_eq!(g.find("y"), Some(y));
        assert_eq!(g.node(y).op_name(), "Const");
        assert!(g.inputs(y).is_empty());
        assert!(g.consumers(x).is_empty());
        assert_eq!(g.inputs(z), [Port::from(y)]);
    }

    #[test]
    fn set_node_refuses_to_drop_a_read_output() {
        let mut g = Graph::new();
        let x = g
            .add_node(
                "x",
                Box::new(Placeholder(TensorType::new(DType::F32, [2, 3]))),
                &[],
            )
            .unwrap();
        let s = g
            .add_node(
                "s",
                Box::new(Placeholder(TensorType::new(DType::F32, [3]))),
                &[],
            )
            .unwrap();
        let stats = [x, s, s, s, s].map(Port::from);
        let bn = g
            .add_node("bn", Box::new(BatchNorm::default()), &stats)
            .unwrap();
        g.set_outputs(vec![Port::new(bn, 1)]).unwrap();
        let identity = Box::new(Unary::new(UnaryKind::Identity));
        let err = g.set_node(bn, identity, &[x.into()]).unwrap_err();
        assert!(err.to_string().contains("output 1 is read"), "{err}");
        assert_eq!(g.node(bn).op_name(), "BatchNorm");
    }
}
