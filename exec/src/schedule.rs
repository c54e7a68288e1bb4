//! What both executors do around the kernels of a step: which nodes run, when each
//! value can be freed, the type check of what a kernel produced, and which Variable
//! an AssignVariable writes.

use std::collections::{HashMap, HashSet};

use ampgraph_graph::ops::{
    is_source, AllReduce, AssignVariable, Cast, Reshape, Transpose, Variable,
};
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
        let order = collectives_early(graph, views_late(graph, order));
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

/// `order` with each Transpose, Reshape or Cast of values the step holds anyway
/// (Variables, Placeholders, Consts, and such views of them) moved down to just before
/// its first reader. Cheap wherever it runs, such a view can hold memory for nothing
/// where the topological order puts it: a reader's inputs come in slot order, so the
/// copy of the input images that `recompute-input-views` makes for the first
/// convolution's filter gradient (its input 0) would otherwise be computed before the
/// whole backward pass its gradient (input 1) needs.
fn views_late(graph: &Graph, order: Vec<NodeId>) -> Vec<NodeId> {
    let source = |id: NodeId| is_source(graph.node(id).op.as_ref());
    let mut floating: HashSet<NodeId> = HashSet::new();
    for &id in &order {
        let op = &graph.node(id).op;
        let view = op.is::<Transpose>() || op.is::<Reshape>() || op.is::<Cast>();
        if view && (graph.inputs(id).iter()).all(|p| source(p.node) || floating.contains(&p.node)) {
            floating.insert(id);
        }
    }
    if floating.is_empty() {
        return order;
    }
    let mut placed: HashSet<NodeId> = HashSet::new();
    let mut out = Vec::with_capacity(order.len());
    // Floating `id` after its floating inputs, once.
    fn place(
        graph: &Graph,
        id: NodeId,
        floating: &HashSet<NodeId>,
        placed: &mut HashSet<NodeId>,
        out: &mut Vec<NodeId>,
    ) {
        if !floating.contains(&id) || !placed.insert(id) {
            return;
        }
        for p in graph.inputs(id) {
            place(graph, p.node, floating, placed, out);
        }
        out.push(id);
    }
    for &id in &order {
        if floating.contains(&id) {
            continue;
        }
        for p in graph.inputs(id) {
            place(graph, p.node, &floating, &mut placed, &mut out);
        }
        out.push(id);
    }
    // Those no other node reads (fetched ones) last, in their order.
    for &id in &order {
        place(graph, id, &floating, &mut placed, &mut out);
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{Binary, BinaryKind, Unary, UnaryKind};
    use ampgraph_graph::DType;

    /// A Transpose of an input, read first by the last node, runs just before it (the
    /// topological order computes it first, beside the input); views under it too.
    #[test]
    fn views_of_held_values_run_just_before_their_first_reader() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3]).unwrap();
        let wide = g
            .add_node("wide", Box::new(Cast { to: DType::F64 }), &[x])
            .unwrap();
        let t = (g.add_node("t", Box::new(Transpose::new(vec![1, 0])), &[wide.into()])).unwrap();
        let mut y = g
            .add_node("n0", Box::new(Unary::new(UnaryKind::Neg)), &[x])
            .unwrap();
        for k in 1..4 {
            let n = g.add_node(
                format!("n{k}"),
                Box::new(Unary::new(UnaryKind::Neg)),
                &[y.into()],
            );
            y = n.unwrap();
        }
        let y64 = g
            .add_node("y64", Box::new(Cast { to: DType::F64 }), &[y.into()])
            .unwrap();
        let yt = (g.add_node("yt", Box::new(Transpose::new(vec![1, 0])), &[y64.into()])).unwrap();
        let sum = g.add_node(
            "sum",
            Box::new(Binary::new(BinaryKind::Add)),
            &[t.into(), yt.into()],
        );
        let sum = sum.unwrap();
        let names = |order: &[NodeId]| -> Vec<String> {
            order.iter().map(|&id| g.node(id).name.clone()).collect()
        };
        let topo = g.topo_order().unwrap();
        assert_eq!(names(&topo)[..3], ["x", "wide", "t"]);
        let order = Schedule::new(&g, &[Port::new(sum, 0)]).unwrap().order;
        assert_eq!(
            names(&order),
            ["x", "n0", "n1", "n2", "n3", "y64", "yt", "wide", "t", "sum"]
        );
    }
}
