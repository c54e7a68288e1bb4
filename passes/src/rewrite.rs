//! Helpers every rewrite pass uses on a graph: which nodes are outputs or depend on
//! others, a Const's value, removing nodes nothing reads, errors naming a node, and
//! the summary a pass reports.

use ampgraph_graph::ops::{
    widens_exactly, Binary, BinaryKind, Cast, Const, QuantizeFp8, Reshape, Variable,
};
use ampgraph_graph::{Graph, NodeId, Op, Port, Tensor};

use crate::PassError;

/// The value of a Const node, `None` for any other node.
pub(crate) fn const_value(g: &Graph, id: NodeId) -> Result<Option<Tensor>, PassError> {
    let node = g.node(id);
    let Some(c) = node.op.downcast_ref::<Const>() else {
        return Ok(None);
    };
    let mut values = c.eval(&[]).map_err(|m| node_error(g, id, &m))?;
    Ok(values.pop())
}

/// The value of a constant made by a Const and Casts (whose rounding counts: -1e9 is
/// `-inf` in 16 bits), with those nodes.
pub(crate) fn cast_constant(g: &Graph, port: Port) -> Option<(Tensor, Vec<NodeId>)> {
    let nodes = through_casts(g, port);
    let (&source, casts) = nodes.split_last()?;
    let mut value = const_value(g, source).ok()??;
    for &cast in casts.iter().rev() {
        value = g.node(cast).op.eval(&[&value]).ok()?.pop()?;
    }
    Some((value, nodes))
}

/// The node of `port` and, while it is a Cast, the node it reads: the last one makes
/// the value the Casts convert.
pub(crate) fn through_casts(g: &Graph, mut port: Port) -> Vec<NodeId> {
    let mut nodes = vec![port.node];
    while g.node(port.node).op.is::<Cast>() {
        port = g.inputs(port.node)[0];
        nodes.push(port.node);
    }
    nodes
}

/// A shape as Reshape takes it.
pub(crate) fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

/// The two operands of the node of `p` where it is a Binary of `kind`.
pub(crate) fn binary_operands(g: &Graph, p: Port, kind: BinaryKind) -> Option<[Port; 2]> {
    let binary = g.node(p.node).op.downcast_ref::<Binary>()?;
    let [a, b] = g.inputs(p.node)[..] else {
        return None;
    };
    (binary.kind == kind).then_some([a, b])
}

/// An error about one node, naming it and its op.
pub(crate) fn node_error(g: &Graph, id: NodeId, msg: &str) -> PassError {
    let node = g.node(id);
    PassError::Rewrite(format!("node '{}' ({}): {msg}", node.name, node.op_name()))
}

/// Which nodes the graph outputs name, indexed by `NodeId::index()`.
pub(crate) fn output_nodes(g: &Graph) -> Vec<bool> {
    let mut is_output = vec![false; g.node_bound()];
    for p in g.outputs() {
        is_output[p.node.index()] = true;
    }
    is_output
}

/// Every reader of `from` (and the graph outputs naming it) reads `to` instead.
pub(crate) fn redirect(g: &mut Graph, from: Port, to: Port) -> Result<(), PassError> {
    let changes = g
        .port_consumers(from)
        .into_iter()
        .map(|(n, slot)| (n, slot, to))
        .collect();
    g.rewire(changes)?;
    if g.outputs().contains(&from) {
        let outputs = g
            .outputs()
            .iter()
            .map(|&p| if p == from { to } else { p })
            .collect();
        g.set_outputs(outputs)?;
    }
    Ok(())
}

/// The input of the Cast at `p` where the cast loses nothing: to its own dtype, or
/// widening exactly (16-bit floats to f32, any float to f64).
pub(crate) fn lossless_cast(g: &Graph, p: Port) -> Option<Port> {
    g.node(p.node).op.downcast_ref::<Cast>()?;
    let &[x] = &g.inputs(p.node)[..] else {
        return None;
    };
    widens_exactly(g.ty(x).dtype, g.ty(p).dtype).then_some(x)
}

/// Whether `id` is a Cast of a Variable: AMP's 16-bit copy of a weight, which the CUDA
/// executor keeps from step to step (the variable's update writes it) instead of
/// running the Cast.
pub(crate) fn is_variable_cast(g: &Graph, id: NodeId) -> bool {
    g.node(id).op.is::<Cast>()
        && (g.inputs(id).first()).is_some_and(|x| g.node(x.node).op.is::<Variable>())
}

/// Whether `port` is read by `(reader, slot)` alone and is not a graph output: a
/// tensor a fusion may stop writing.
pub(crate) fn read_only_by(g: &Graph, port: Port, reader: NodeId, slot: usize) -> bool {
    g.port_consumers(port) == [(reader, slot)] && !g.outputs().contains(&port)
}

/// The tensor the FP8 cast `cast` alone reads as its `x`, and the view between them:
/// `(x, None)`, or `(y, Some(view))` where `x` is a Reshape that alone reads `y` (an
/// exported model's layer norm or activation over `[B, S, D]` viewed as the
/// product's rows). The node computing it may fold into the cast ([`fold_into_cast`]).
pub(crate) fn cast_alone_reads(g: &Graph, cast: NodeId, x: Port) -> Option<(Port, Option<NodeId>)> {
    if !read_only_by(g, x, cast, 0) {
        return None;
    }
    let through = (g.node(x.node).op.is::<Reshape>())
        .then(|| g.inputs(x.node)[0])
        .filter(|&y| read_only_by(g, y, x.node, 0));
    Some(match through {
        Some(y) => (y, Some(x.node)),
        None => (x, None),
    })
}

/// The cast `cast` of `x` (with `scale`) becomes `op`, which computes what `producer`
/// computed from the producer's inputs, the first viewed as `x` is; the producer and
/// the `view` between them ([`cast_alone_reads`]) go.
pub(crate) fn fold_into_cast(
    g: &mut Graph,
    (cast, x, scale): (NodeId, Port, Port),
    (producer, view): (NodeId, Option<NodeId>),
    op: Box<dyn Op>,
) -> Result<(), PassError> {
    let mut inputs = g.inputs(producer).to_vec();
    let shape = g.ty(x).shape.clone();
    if g.ty(inputs[0]).shape != shape {
        let name = g.fresh_name(format!("{}/rows", g.node(producer).name));
        inputs[0] = (g.add_node(name, Box::new(Reshape::new(dims(&shape))), &[inputs[0]])?).into();
    }
    inputs.push(scale);
    g.set_node(cast, op, &inputs)?;
    if let Some(view) = view {
        g.remove_node(view)?;
    }
    g.remove_node(producer)?;
    Ok(())
}

/// Each `QuantizeFp8` node with its `x` and `scale`: the casts the passes folding the
/// node computing `x` into an FP8 cast visit.
pub(crate) fn fp8_casts(g: &Graph) -> Vec<(NodeId, Port, Port)> {
    (g.node_ids())
        .filter(|&id| g.node(id).op.is::<QuantizeFp8>())
        .filter_map(|id| match g.inputs(id)[..] {
            [x, scale] => Some((id, x, scale)),
            _ => None,
        })
        .collect()
}

/// The one reader of `port` (node and input slot), where it is not a graph output.
pub(crate) fn sole_reader(g: &Graph, port: Port) -> Option<(NodeId, usize)> {
    match g.port_consumers(port)[..] {
        [one] if !g.outputs().contains(&port) => Some(one),
        _ => None,
    }
}

/// Removes the `nodes` (folded casts) that nothing reads any more and no graph output
/// names, also those that only others of them read; returns how many went and the
/// bytes of the tensors they no longer write.
pub(crate) fn remove_unread(
    g: &mut Graph,
    mut nodes: Vec<NodeId>,
    is_output: &[bool],
) -> Result<(usize, usize), PassError> {
    nodes.sort();
    nodes.dedup();
    let (mut removed, mut bytes) = (0usize, 0usize);
    loop {
        let before = nodes.len();
        let mut kept = Vec::with_capacity(before);
        for id in nodes {
            if is_output[id.index()] || !g.consumers(id).is_empty() {
                kept.push(id);
                continue;
            }
            bytes += g.node(id).outputs()[0].size_bytes();
            g.remove_node(id)?;
            removed += 1;
        }
        nodes = kept;
        if nodes.len() == before {
            return Ok((removed, bytes));
        }
    }
}

/// Which nodes depend on any of `starts` (themselves included).
pub(crate) fn reachable_from(g: &Graph, starts: impl IntoIterator<Item = NodeId>) -> Vec<bool> {
    let mut seen = vec![false; g.node_bound()];
    let mut stack: Vec<NodeId> = starts.into_iter().collect();
    while let Some(id) = stack.pop() {
        if std::mem::replace(&mut seen[id.index()], true) {
            continue;
        }
        stack.extend(g.consumers(id).into_iter().map(|(c, _, _)| c));
    }
    seen
}

/// Whether anything a member computes flows into another member's inputs (a group
/// of them would then be its own ancestor).
fn members_depend_on_each_other(g: &Graph, members: &[NodeId]) -> bool {
    let readers: Vec<NodeId> = members
        .iter()
        .flat_map(|&m| g.consumers(m))
        .map(|(reader, _, _)| reader)
        .collect();
    let downstream = reachable_from(g, readers);
    members.iter().any(|m| downstream[m.index()])
}

/// The nodes to which `key` gives a key, in node order, in buckets of equal keys (the
/// first seen first): what a grouping pass may put in one node.
pub(crate) fn bucketed<K: PartialEq>(
    g: &Graph,
    key: impl Fn(NodeId) -> Option<K>,
) -> Vec<(K, Vec<NodeId>)> {
    let mut buckets: Vec<(K, Vec<NodeId>)> = Vec::new();
    for id in g.node_ids() {
        let Some(k) = key(id) else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == k) {
            Some((_, ids)) => ids.push(id),
            None => buckets.push((k, vec![id])),
        }
    }
    buckets
}

/// Each bucket of two or more nodes none of which feeds another becomes one node
/// ([`replace_by_group`]) of the op `group` makes of its key and members, with the
/// outputs each member has; returns how many groups and how many nodes went into them.
pub(crate) fn group_buckets<K>(
    g: &mut Graph,
    buckets: Vec<(K, Vec<NodeId>)>,
    group: impl Fn(&Graph, K, &[NodeId]) -> Result<(Box<dyn Op>, usize), PassError>,
) -> Result<(usize, usize), PassError> {
    let (mut groups, mut grouped) = (0usize, 0usize);
    for (key, members) in buckets {
        if members.len() < 2 || members_depend_on_each_other(g, &members) {
            continue;
        }
        let (op, per_member) = group(g, key, &members)?;
        replace_by_group(g, &members, op, per_member)?;
        groups += 1;
        grouped += members.len();
    }
    Ok((groups, grouped))
}

/// Replaces `members` (nodes of `per_member` outputs each) by one node of `op`, which
/// reads their inputs in turn and gives their outputs in turn. It takes the first
/// member's place and name, whose readers keep their ports.
fn replace_by_group(
    g: &mut Graph,
    members: &[NodeId],
    op: Box<dyn Op>,
    per_member: usize,
) -> Result<(), PassError> {
    let inputs: Vec<Port> = members
        .iter()
        .flat_map(|&id| g.inputs(id).to_vec())
        .collect();
    let node = members[0];
    g.set_node(node, op, &inputs)?;
    let moved = |m: usize, port: Port| Port::new(node, m * per_member + port.index);
    let mut changes = Vec::new();
    let mut outputs = g.outputs().to_vec();
    for (m, &id) in members.iter().enumerate().skip(1) {
        for (reader, slot, port) in g.consumers(id) {
            changes.push((reader, slot, moved(m, port)));
        }
        for out in outputs.iter_mut().filter(|p| p.node == id) {
            *out = moved(m, *out);
        }
    }
    g.rewire(changes)?;
    g.set_outputs(outputs)?;
    for &id in &members[1..] {
        g.remove_node(id)?;
    }
    Ok(())
}

/// The summary every simplification pass reports: a title and one line per count.
/// [`PassManager`](crate::PassManager) logs it at info level, as it does AMP's.
pub(crate) fn summary(pass: &str, lines: Vec<String>) -> crate::PassSummary {
    crate::PassSummary {
        title: format!("{pass} pass summary:"),
        lines,
    }
}
