//! Turning a painting into a graph: casts at precision boundaries only, one per
//! (tensor, target dtype) shared by every consumer; f32 Consts feeding f16 become f16
//! Consts instead of being cast at run time.

use ampgraph_graph::ops::{Cast, Const};
use ampgraph_graph::{DType, Graph, NodeId, Port, Tensor};

use foldhash::HashMap;

use super::paint::{is_const_or_variable, Painting};
use crate::PassError;

/// What the rewrite did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RewriteStats {
    /// Nodes whose type changed to the 16-bit target.
    pub nodes_converted: usize,
    /// Casts to the 16-bit target from anything but a Const or Variable (TensorFlow's count).
    pub casts_to_half: usize,
    /// Casts to the 16-bit target of Variables (master weights cast per use).
    pub variable_casts: usize,
    /// Casts back to f32.
    pub casts_to_f32: usize,
    /// Consts stored in the 16-bit type instead of being cast.
    pub consts_folded: usize,
    /// Inserted nodes, in insertion order.
    pub inserted: Vec<NodeId>,
}

fn cast_suffix(to: DType) -> &'static str {
    match to {
        DType::F16 => "CastToFp16",
        DType::BF16 => "CastToBf16",
        _ => "CastToFp32",
    }
}

/// `{node}-{port}-CastToFp16{tail}`, TensorFlow's name for a cast it inserts; built
/// by hand because `format!` cost more than the rest of inserting a cast.
fn cast_name(node: &str, port: usize, to: DType, tail: &str) -> String {
    let suffix = cast_suffix(to);
    let mut name = String::with_capacity(node.len() + suffix.len() + tail.len() + 24);
    name.push_str(node);
    name.push('-');
    if port < 10 {
        name.push(char::from(b'0' + port as u8));
    } else {
        name.push_str(&port.to_string());
    }
    name.push('-');
    name.push_str(suffix);
    name.push_str(tail);
    name
}

/// Applies `p` to `g`, converting allow vertices to `target`.
pub(crate) fn apply(g: &mut Graph, p: &Painting, target: DType) -> Result<RewriteStats, PassError> {
    let mut stats = RewriteStats::default();
    let outputs: Vec<Port> = g.outputs().to_vec();
    // Rewiring happens in one batch at the end (see Graph::rewire).
    let mut changes: Vec<(NodeId, usize, Port)> = Vec::new();
    // The casts this rewrite inserted, by (tensor, dtype).
    let mut inserted: HashMap<(Port, DType), NodeId> = HashMap::default();
    let mut mismatched: Vec<(NodeId, usize)> = Vec::new();
    // Nodes given a new op: Casts and Consts whose output becomes the target type.
    let mut new_ops: Vec<NodeId> = Vec::new();
    // Existing Casts to f32 whose readers are all f16 now cast to f16 directly.
    for v in 0..p.len() {
        if p.step[v] == super::paint::Step::CastToHalf {
            g.set_op(p.node[v], Box::new(Cast { to: target }));
            new_ops.push(p.node[v]);
        }
    }
    for v in 0..p.len() {
        if !p.is_f32[v] {
            continue;
        }
        let id = p.node[v];
        let src_allow = p.allow[v];
        if src_allow && p.primary(id) as usize == v {
            stats.nodes_converted += 1;
        }
        for port_index in p.output_ports(v as u32) {
            let port = Port::new(id, port_index);
            // The graph's edges have not changed since painting: the painting's
            // adjacency still holds every reader.
            mismatched.clear();
            let mut readers = 0;
            for (d, slot) in p.adjacency.port_consumers(port) {
                readers += 1;
                if needs_cast(p, d, slot, src_allow) {
                    mismatched.push((d, slot));
                }
            }
            if mismatched.is_empty() {
                continue;
            }
            let to = if src_allow { DType::F32 } else { target };
            let const_values = g.node(id).op.downcast_ref::<Const>().cloned();
            if let (Some(c), true) = (&const_values, to == target) {
                let whole = mismatched.len() == readers && !outputs.contains(&port);
                let rounded = Const::new(const_tensor(c)?.cast(target));
                stats.consts_folded += 1;
                if whole {
                    // Every reader wants the 16-bit value: store it that way.
                    g.set_op(id, Box::new(rounded));
                    new_ops.push(id);
                    continue;
                }
                let name = g.fresh_name(cast_name(&g.node(id).name, port_index, to, ""));
                let new = g.add_node(name, Box::new(rounded), &[])?;
                stats.inserted.push(new);
                rewire(&mut changes, &mismatched, Port::new(new, 0));
                continue;
            }
            // Never a cast of a float cast: convert what the existing Cast reads, or read
            // it directly when it already has the wanted type.
            let source = cast_source(g, p, port);
            if source != port && final_dtype(g, p, source, target) == to {
                rewire(&mut changes, &mismatched, source);
                continue;
            }
            // One cast per (tensor, dtype): reuse a Cast the graph already has.
            if let Some(cast) = existing_cast(g, p, &inserted, source, to) {
                rewire(&mut changes, &mismatched, Port::new(cast, 0));
                continue;
            }
            let name = g.fresh_name(cast_name(
                &g.node(id).name,
                port_index,
                to,
                "-AutoMixedPrecision",
            ));
            let cast = g.add_node(name, Box::new(Cast { to }), &[source])?;
            inserted.insert((source, to), cast);
            stats.inserted.push(cast);
            rewire(&mut changes, &mismatched, Port::new(cast, 0));
            if to == DType::F32 {
                stats.casts_to_f32 += 1;
            } else if is_const_or_variable(g, id) {
                stats.variable_casts += 1;
            } else {
                stats.casts_to_half += 1;
            }
        }
    }
    g.rewire(changes)?;
    // The new types are known without re-inference: a converted vertex's outputs and
    // the retyped Casts and Consts take the target type; every other node keeps its
    // types (the inserted ones were inferred as they were added, and a rewired reader
    // reads the dtype it read before). Tests and debug builds check this.
    for v in 0..p.len() {
        if p.allow[v] && p.is_f32[v] {
            for port in p.output_ports(v as u32) {
                g.set_dtype(Port::new(p.node[v], port), target);
            }
        }
    }
    for id in new_ops {
        g.set_dtype(Port::new(id, 0), target);
    }
    if cfg!(debug_assertions) {
        g.validate()?;
    }
    Ok(stats)
}

/// Whether input `slot` of `reader` wants the other precision than its producer's
/// (`src_allow`). A Cast reader converts whatever it reads: it needs no cast in front.
fn needs_cast(p: &Painting, reader: NodeId, slot: usize, src_allow: bool) -> bool {
    p.input_vertex(reader, slot)
        .is_some_and(|dv| p.allow[dv as usize] != src_allow)
        && !p.is_cast(reader)
}

/// A Cast of `source` to `to`: the first the graph had, else the one this rewrite
/// inserted. (It inserts one only where the graph had none.)
fn existing_cast(
    g: &Graph,
    p: &Painting,
    inserted: &HashMap<(Port, DType), NodeId>,
    source: Port,
    to: DType,
) -> Option<NodeId> {
    p.adjacency
        .port_consumers(source)
        .map(|(d, _)| d)
        .find(|&d| {
            p.is_cast(d)
                && g.node(d)
                    .op
                    .downcast_ref::<Cast>()
                    .is_some_and(|c| c.to == to)
        })
        .or_else(|| inserted.get(&(source, to)).copied())
}

fn const_tensor(c: &Const) -> Result<Tensor, PassError> {
    use ampgraph_graph::Op;
    let mut values = c.eval(&[]).map_err(PassError::Rewrite)?;
    values
        .pop()
        .ok_or_else(|| PassError::Rewrite("a Const produced no value".into()))
}

/// The dtype `port` will have once the rewrite is done (its types are set last).
fn final_dtype(g: &Graph, p: &Painting, port: Port, target: DType) -> DType {
    let converted = p
        .output_vertex(port.node, port.index)
        .is_some_and(|v| p.allow[v as usize] && p.is_f32[v as usize]);
    if converted {
        target
    } else {
        g.ty(port).dtype
    }
}

/// The tensor a chain of float-to-float Casts ending at `port` starts from. (A cast
/// from an integer type changes values, so the chain stops there.)
fn cast_source(g: &Graph, p: &Painting, mut port: Port) -> Port {
    while p.is_cast(port.node) {
        let input = p.adjacency.inputs(port.node)[0];
        if !g.ty(input).dtype.is_float() {
            break;
        }
        port = input;
    }
    port
}

fn rewire(changes: &mut Vec<(NodeId, usize, Port)>, readers: &[(NodeId, usize)], to: Port) {
    changes.extend(readers.iter().map(|&(d, slot)| (d, slot, to)));
}
