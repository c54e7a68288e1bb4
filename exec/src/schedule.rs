//! What both executors do around the kernels of a step: which nodes run, when each
//! value can be freed, the type check of what a kernel produced, and which Variable
//! an AssignVariable writes.

use std::collections::HashMap;

use ampgraph_graph::ops::{AllReduce, AssignVariable, Variable};
use ampgraph_graph::{Graph, Node, NodeId, Port, TensorType};

use crate::ExecError;

/// The nodes a step runs, in topological order, and the reads left of each value.
#[derive(Clone)]
pub(crate) struct Schedule {
    pub order: Vec<NodeId>,
    reads: HashMap<NodeId, usize>,
}

impl Schedule {
    /// The nodes `fetches` depend on; fetched values count as one more read.
    pub fn new(graph: &Graph, fetches: &[Port]) -> Result<Schedule, ExecError> {
        let mut needed = vec![false; graph.node_ids().map(|i| i.index() + 1).max().unwrap_or(0)];
        let mut stack: Vec<NodeId> = fetches.iter().map(|p| p.node).collect();
        while let Some(id) = stack.pop() {
            if !std::mem::replace(&mut needed[id.index()], true) {
                stack.extend(graph.inputs(id).into_iter().map(|p| p.node));
            }
        }
        let order: Vec<NodeId> = graph
            .topo_order()?
            .into_iter()
            .filter(|id| needed[id.index()])
            .collect();
        let order = collectives_early(graph, order);
        let mut reads: HashMap<NodeId, usize> = HashMap::new();
        for p in order
            .iter()
            .flat_map(|&id| graph.inputs(id))
            .chain(fetches.iter().copied())
        {
            *reads.entry(p.node).or_default() += 1;
        }
        Ok(Schedule { order, reads })
    }

    /// Counts the reads of `id`'s inputs; returns the producers nothing reads any more.
    pub fn consume_inputs(&mut self, graph: &Graph, id: NodeId) -> Vec<NodeId> {
        let mut done = Vec::new();
        for p in graph.inputs(id) {
            if let Some(left) = self.reads.get_mut(&p.node) {
                *left -= 1;
                if *left == 0 {
                    done.push(p.node);
                }
            }
        }
        done
    }
}

/// `order` with each collective (AllReduce) moved up to just after its last input's
/// producer: a bucket of gradients is averaged as soon as it exists, while the rest
/// of the backward pass runs (on a second stream, where the executor has one).
fn collectives_early(graph: &Graph, order: Vec<NodeId>) -> Vec<NodeId> {
    if !order.iter().any(|&id| graph.node(id).op.is::<AllReduce>()) {
        return order;
    }
    let position: HashMap<NodeId, usize> =
        order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    // Every other node keeps its place (key 2i); a collective goes right after its
    // inputs (2p + 1), collectives ready together in their old order.
    let mut keyed: Vec<((usize, usize), NodeId)> = order
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            if !graph.node(id).op.is::<AllReduce>() {
                return ((2 * i, 0), id);
            }
            let ready = graph
                .inputs(id)
                .iter()
                .filter_map(|p| position.get(&p.node))
                .max()
                .map_or(0, |&p| 2 * p + 1);
            ((ready, i), id)
        })
        .collect();
    keyed.sort_by_key(|&(key, _)| key);
    keyed.into_iter().map(|(_, id)| id).collect()
}

/// Checks that a kernel produced the types the graph promised.
pub(crate) fn check_outputs(
    node: &Node,
    produced: impl IntoIterator<Item = TensorType>,
) -> Result<(), ExecError> {
    for (i, (got, want)) in produced.into_iter().zip(node.outputs()).enumerate() {
        if &got != want {
            return Err(ExecError::node(
                &node.name,
                node.op.name(),
                format!("kernel produced {got} for output {i}, expected {want}"),
            ));
        }
    }
    Ok(())
}

/// The Variable an AssignVariable node writes (None for other nodes).
pub(crate) fn assigned_variable(graph: &Graph, id: NodeId) -> Result<Option<String>, ExecError> {
    let node = graph.node(id);
    if !node.op.is::<AssignVariable>() {
        return Ok(None);
    }
    let target = graph.node(graph.inputs(id)[0].node);
    if !target.op.is::<Variable>() {
        return Err(ExecError::node(
            &node.name,
            node.op.name(),
            format!(
                "input 0 must be a Variable, got '{}' ({})",
                target.name,
                target.op.name()
            ),
        ));
    }
    Ok(Some(target.name.clone()))
}
