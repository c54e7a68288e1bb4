//! Elementwise fusion: each maximal group of connected elementwise nodes (Unary,
//! UnaryGrad, Binary, BinaryGrad, BiasAdd, float Casts) over tensors of one element
//! count becomes one `FusedElementwise` node, so the group's intermediate tensors are
//! never written to memory and read back.
//!
//! Groups grow in one walk over the nodes in topological order: a node joins the group
//! of one of its producers when every other input cannot depend on that group (else
//! the group would have a path that leaves it and comes back, a cycle once fused). To
//! know that without searching, each node records the highest group id its value
//! depends on: an input whose record is below a group's id cannot depend on that group.
//! The test is conservative (it may refuse a safe join) and linear in the graph.
//!
//! A member's tensor read outside its group, or a graph output, becomes an output of
//! the fused node; the others are internal. The fused node is named `fused/<first
//! member>` and lists its members in the `_fused_members` annotation. Fused nodes are
//! not fused again: a second run changes nothing.

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::ops::fused::{Expr, Instr, MEMBERS_ANNOTATION};
use ampgraph_graph::ops::{is_source, ElementOp, FusedElementwise, FusedSoftmax, Unary, UnaryKind};
use ampgraph_graph::{Graph, NodeId, Port};
use foldhash::HashMap;

use crate::simplify::live_nodes;
use crate::{Pass, PassError, PassSummary};

/// The fusion pass (`--passes fuse`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fuse;

/// What a fusion run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FuseReport {
    /// Groups replaced by one fused node.
    pub groups: usize,
    /// Nodes those groups held.
    pub fused_nodes: usize,
    /// Graph outputs inside a group, kept under their names by an Identity.
    pub named_outputs: usize,
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// Nodes that run a kernel (all but sources and aliases: see `kernels`).
    pub kernels_before: usize,
    pub kernels_after: usize,
    /// Bytes of the tensors now internal to a fused node, each written once and read
    /// once fewer: twice their size.
    pub bytes_saved: u64,
}

impl FuseReport {
    pub fn summary(&self) -> PassSummary {
        PassSummary {
            title: "Elementwise Fusion Pass Summary:".into(),
            lines: vec![
                format!("Groups fused: {}", self.groups),
                format!("Nodes fused: {}", self.fused_nodes),
                format!("Graph outputs kept by name: {}", self.named_outputs),
                format!(
                    "Nodes: {} before, {} after",
                    self.nodes_before, self.nodes_after
                ),
                format!(
                    "Kernels: {} before, {} after",
                    self.kernels_before, self.kernels_after
                ),
                format!(
                    "Memory traffic saved per run: {} (intermediate tensors no longer written and read)",
                    crate::format_bytes(self.bytes_saved)
                ),
            ],
        }
    }
}

/// No group.
const NONE: usize = usize::MAX;

/// Whether a node can join a group: an elementwise op over float tensors with one
/// non-empty output.
pub(crate) fn fusible(g: &Graph, id: NodeId, inputs: &[Port]) -> bool {
    let node = g.node(id);
    let [out] = node.outputs() else {
        return false;
    };
    ElementOp::of(node.op.as_ref()).is_some()
        && out.dtype.is_float()
        && out.checked_len().is_some_and(|n| n > 0)
        && inputs.iter().all(|&p| g.ty(p).dtype.is_float())
}

/// The groups of fusible nodes, each in topological order (singletons included).
/// Dead code joins none: which of it a group would take depends on its live
/// neighbours, so a second run (after other passes fused those) would group it anew.
fn find_groups(g: &Graph, adj: &Adjacency, order: &[NodeId]) -> (Vec<usize>, Vec<Vec<NodeId>>) {
    let bound = g.node_bound();
    let live = live_nodes(g, adj);
    let mut group = vec![NONE; bound];
    // The highest group id each node's value depends on, its own included (-1: none).
    let mut reach = vec![-1i64; bound];
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    let mut group_len: Vec<usize> = Vec::new();
    let mut candidates = Vec::new();
    for &id in order {
        let inputs = adj.inputs(id);
        let upstream = inputs
            .iter()
            .map(|p| reach[p.node.index()])
            .max()
            .unwrap_or(-1);
        if !live[id.index()] || !fusible(g, id, inputs) {
            reach[id.index()] = upstream;
            let op = &g.node(id).op;
            if op.is::<FusedElementwise>() || op.is::<FusedSoftmax>() {
                // A fused node (a lone node that took a column sum, or a softmax that
                // took its operand's program, included) blocks joins across it as its
                // group did: an empty group of its own, so a later run groups its
                // neighbours as the first did.
                groups.push(Vec::new());
                group_len.push(0);
                reach[id.index()] = upstream.max(groups.len() as i64 - 1);
            }
            continue;
        }
        let len = g.node(id).outputs()[0].checked_len().unwrap_or(0);
        candidates.clear();
        candidates.extend(
            inputs
                .iter()
                .map(|p| group[p.node.index()])
                .filter(|&k| k != NONE && group_len[k] == len),
        );
        // The newest group first: older inputs are likelier not to depend on it.
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        candidates.dedup();
        let joinable = candidates.iter().copied().find(|&k| {
            inputs
                .iter()
                .all(|p| group[p.node.index()] == k || reach[p.node.index()] < k as i64)
        });
        let k = joinable.unwrap_or_else(|| {
            groups.push(Vec::new());
            group_len.push(len);
            groups.len() - 1
        });
        // An input alone in an older group, read by this node only and depending on
        // nothing of group `k`, moves into it (first: its inputs are outside): a
        // running average's `Mul(average, momentum)` joins the `Add` of the batch's
        // share instead of running as a kernel of its own.
        for p in inputs {
            let kp = group[p.node.index()];
            let lone = kp != k && kp != NONE && groups[kp].len() == 1 && group_len[kp] == len;
            let only_reader = || adj.consumers(p.node).all(|(c, _, _)| c == id);
            let independent =
                || (adj.inputs(p.node).iter()).all(|q| reach[q.node.index()] < k as i64);
            if lone && only_reader() && independent() {
                groups[kp].clear();
                groups[k].insert(0, p.node);
                group[p.node.index()] = k;
                reach[p.node.index()] = k as i64;
            }
        }
        groups[k].push(id);
        group[id.index()] = k;
        reach[id.index()] = upstream.max(k as i64);
    }
    (group, groups)
}

/// A group turned into a program: the fused node's op, inputs, and which member each
/// of its outputs stands for.
pub(crate) struct Fused {
    pub(crate) op: FusedElementwise,
    pub(crate) inputs: Vec<Port>,
    exports: Vec<NodeId>,
    internal_bytes: u64,
}

/// The program of a group: its members in topological order, which nodes belong to
/// it, and which members' tensors are read outside it.
pub(crate) fn program(
    g: &Graph,
    adj: &Adjacency,
    members: &[NodeId],
    in_group: impl Fn(NodeId) -> bool,
    exported: impl Fn(NodeId) -> bool,
) -> Result<Fused, String> {
    // The instruction computing each member, and reading each input.
    let mut value_of: HashMap<NodeId, usize> = HashMap::default();
    let mut input_value: HashMap<Port, usize> = HashMap::default();
    let mut instrs: Vec<Instr> = Vec::new();
    let mut inputs: Vec<Port> = Vec::new();
    let mut outputs = Vec::new();
    let mut exports = Vec::new();
    let mut internal_bytes = 0u64;
    for &m in members {
        let node = g.node(m);
        let op = ElementOp::of(node.op.as_ref()).ok_or("internal: a member is not elementwise")?;
        let mut args = Vec::new();
        for &p in adj.inputs(m) {
            let v = if in_group(p.node) {
                *value_of
                    .get(&p.node)
                    .ok_or("internal: a member reads a later member")?
            } else {
                *input_value.entry(p).or_insert_with(|| {
                    instrs.push(Instr {
                        expr: Expr::Input(inputs.len()),
                        ty: g.ty(p).clone(),
                    });
                    inputs.push(p);
                    instrs.len() - 1
                })
            };
            args.push(v);
        }
        let ty = node.outputs()[0].clone();
        instrs.push(Instr {
            expr: Expr::Apply(op, args),
            ty: ty.clone(),
        });
        value_of.insert(m, instrs.len() - 1);
        if exported(m) {
            outputs.push(instrs.len() - 1);
            exports.push(m);
        } else {
            internal_bytes += 2 * ty.size_bytes() as u64;
        }
    }
    Ok(Fused {
        op: FusedElementwise::new(instrs, outputs)?,
        inputs,
        exports,
        internal_bytes,
    })
}

/// Records on `node` the names of the nodes it now stands for, in the
/// `_fused_members` annotation: those `absorbed` stood for (its own annotation, or its
/// name), then the names of `added`.
pub(crate) fn record_members(g: &mut Graph, node: NodeId, absorbed: NodeId, added: &[NodeId]) {
    let absorbed = g.node(absorbed);
    let mut members = match absorbed.annotations.get(MEMBERS_ANNOTATION) {
        Some(AttrValue::Str(s)) => s.clone(),
        _ => absorbed.name.clone(),
    };
    for &a in added {
        members.push(',');
        members.push_str(&g.node(a).name);
    }
    g.node_mut(node)
        .annotations
        .insert(MEMBERS_ANNOTATION.into(), AttrValue::Str(members));
}

/// Nodes that launch work: not sources, and not the views executors run as aliases.
fn kernels(g: &Graph) -> usize {
    g.node_ids()
        .filter(|&id| {
            let op = &g.node(id).op;
            !(op.is_view() || is_source(op.as_ref()))
        })
        .count()
}

impl Fuse {
    /// Fuses every group of two or more elementwise nodes. Rounds repeat until one
    /// fuses nothing: the join test is conservative, and with the first round's groups
    /// gone a later round may find a join it refused. So a second run changes nothing.
    pub fn rewrite(&self, g: &mut Graph) -> Result<FuseReport, PassError> {
        let mut report = FuseReport {
            nodes_before: g.len(),
            kernels_before: kernels(g),
            ..FuseReport::default()
        };
        while fuse_round(g, &mut report)? {}
        report.nodes_after = g.len();
        report.kernels_after = kernels(g);
        Ok(report)
    }
}

/// One round of fusion, counted into `report`; whether it fused any group.
fn fuse_round(g: &mut Graph, report: &mut FuseReport) -> Result<bool, PassError> {
    let adj = g.adjacency();
    let order = g.topo_order_in(&adj)?;
    let (group, groups) = find_groups(g, &adj, &order);
    let mut is_output = vec![false; g.node_bound()];
    for p in g.outputs() {
        is_output[p.node.index()] = true;
    }
    // Each fused member's output port on its fused node, by node index.
    let mut export_port: Vec<Option<Port>> = vec![None; g.node_bound()];
    let mut fused_member = vec![false; g.node_bound()];
    let mut created: Vec<(NodeId, Vec<Port>)> = Vec::new();
    for (k, members) in groups.iter().enumerate().filter(|(_, m)| m.len() >= 2) {
        let first = &g.node(members[0]).name;
        let name = g.fresh_name(format!("fused/{first}"));
        let exported = |m: NodeId| {
            is_output[m.index()] || adj.consumers(m).any(|(c, _, _)| group[c.index()] != k)
        };
        let in_group = |m: NodeId| group[m.index()] == k;
        let fused = program(g, &adj, members, in_group, exported)
            .map_err(|e| PassError::Rewrite(format!("group '{name}': {e}")))?;
        let names: Vec<&str> = members.iter().map(|&m| g.node(m).name.as_str()).collect();
        let members_attr = AttrValue::Str(names.join(","));
        let id = g.add_node(name, Box::new(fused.op), &fused.inputs)?;
        g.node_mut(id)
            .annotations
            .insert(MEMBERS_ANNOTATION.into(), members_attr);
        for (o, &m) in fused.exports.iter().enumerate() {
            export_port[m.index()] = Some(Port::new(id, o));
        }
        for &m in members {
            fused_member[m.index()] = true;
        }
        created.push((id, fused.inputs));
        report.groups += 1;
        report.fused_nodes += members.len();
        report.bytes_saved += fused.internal_bytes;
    }
    if created.is_empty() {
        return Ok(false);
    }
    let exported = |p: Port| export_port[p.node.index()].filter(|_| p.index == 0);
    // Readers of fused members: other nodes, and fused nodes reading another group.
    let mut changes = Vec::new();
    for &id in &order {
        if fused_member[id.index()] {
            continue;
        }
        for (slot, &p) in adj.inputs(id).iter().enumerate() {
            if let Some(to) = exported(p) {
                changes.push((id, slot, to));
            }
        }
    }
    for (id, inputs) in &created {
        for (slot, &p) in inputs.iter().enumerate() {
            if let Some(to) = exported(p) {
                changes.push((*id, slot, to));
            }
        }
    }
    g.rewire(changes)?;
    // A graph output that was a member keeps its name: an Identity of that name (free:
    // executors alias it) reads the fused node's export.
    let outputs: Vec<(Port, Option<(String, Port)>)> = g
        .outputs()
        .iter()
        .map(|&p| (p, exported(p).map(|to| (g.node(p.node).name.clone(), to))))
        .collect();
    g.set_outputs(
        outputs
            .iter()
            .map(|(p, e)| e.as_ref().map_or(*p, |e| e.1))
            .collect(),
    )?;
    // Readers first: a member is read only by later members by now.
    for &id in order.iter().rev() {
        if fused_member[id.index()] {
            g.remove_node(id)?;
        }
    }
    let mut kept_names = Vec::with_capacity(outputs.len());
    for (p, export) in outputs {
        kept_names.push(match export {
            Some((name, to)) => match g.find(&name) {
                Some(id) => Port::from(id),
                None => {
                    report.named_outputs += 1;
                    let identity = Unary::new(UnaryKind::Identity);
                    g.add_node(name, Box::new(identity), &[to])?.into()
                }
            },
            None => p,
        });
    }
    g.set_outputs(kept_names)?;
    Ok(true)
}

impl Pass for Fuse {
    fn name(&self) -> &'static str {
        "fuse"
    }

    fn run(&self, graph: &mut Graph) -> Result<PassSummary, PassError> {
        Ok(self.rewrite(graph)?.summary())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::run;
    use ampgraph_graph::ops::{BiasAdd, Cast, DataFormat, MatMul, Transpose, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    fn unary(g: &mut Graph, kind: UnaryKind, x: Port) -> Port {
        g.add(Unary::new(kind), &[x]).unwrap()
    }

    fn ramp(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin() * 2.5).collect();
        Tensor::from_f64(DType::F32, shape.to_vec(), &v).unwrap()
    }

    fn fused_nodes(g: &Graph) -> Vec<NodeId> {
        g.node_ids()
            .filter(|&id| g.node(id).op.is::<FusedElementwise>())
            .collect()
    }

    fn members(g: &Graph, id: NodeId) -> String {
        match &g.node(id).annotations[MEMBERS_ANNOTATION] {
            AttrValue::Str(s) => s.clone(),
            other => panic!("members annotation is {other:?}"),
        }
    }

    #[test]
    fn matmul_bias_relu_cast_fuses_into_one_node_after_the_matmul() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 8]).unwrap();
        let w = g.placeholder("w", DType::F32, [8, 6]).unwrap();
        let b = g.placeholder("b", DType::F32, [6]).unwrap();
        let mm = g.add(MatMul::default(), &[x, w]).unwrap();
        let biased = g
            .add(
                BiasAdd {
                    data_format: DataFormat::Nhwc,
                },
                &[mm, b],
            )
            .unwrap();
        let act = unary(&mut g, UnaryKind::Relu, biased);
        let half = g.add(Cast { to: DType::F16 }, &[act]).unwrap();
        g.set_outputs(vec![half]).unwrap();
        let feeds: HashMap<&str, Tensor> = [
            ("x", ramp(&[4, 8])),
            ("w", ramp(&[8, 6])),
            ("b", ramp(&[6])),
        ]
        .into();
        let want = run(&g, &feeds);

        let report = Fuse.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        let fused = fused_nodes(&g);
        assert_eq!(fused.len(), 1);
        let f = fused[0];
        assert_eq!(g.node(f).name, "fused/biasadd");
        assert_eq!(members(&g, f), "biasadd,relu,cast");
        // The MatMul is untouched and feeds the fused node with the bias.
        let mm_id = g.find("matmul").unwrap();
        assert!(g.node(mm_id).op.is::<MatMul>());
        assert_eq!(g.inputs(f), vec![Port::from(mm_id), b]);
        // The output keeps its name: an Identity named "cast" reads the fused node.
        let out = g.outputs()[0].node;
        assert_eq!(g.node(out).name, "cast");
        assert_eq!(g.inputs(out), vec![Port::new(f, 0)]);
        assert_eq!(
            g.ty(g.outputs()[0]),
            &ampgraph_graph::TensorType::new(DType::F16, vec![4, 6])
        );
        assert!(g.find("relu").is_none());
        let got = run(&g, &feeds);
        assert_eq!(got, want);
        assert_eq!(
            report,
            FuseReport {
                groups: 1,
                fused_nodes: 3,
                named_outputs: 1,
                nodes_before: 7,
                nodes_after: 6,
                kernels_before: 4,
                kernels_after: 2,
                // The BiasAdd and Relu outputs, f32[4, 6], written and read once each.
                bytes_saved: 2 * 2 * 24 * 4,
            }
        );
        let summary = report.summary().to_string();
        assert!(summary.contains("Groups fused: 1"), "{summary}");
        assert!(summary.contains("Kernels: 4 before, 2 after"), "{summary}");
        assert!(
            summary.contains("Memory traffic saved per run: 384 B"),
            "{summary}"
        );
    }

    #[test]
    fn a_diamond_fuses_and_exports_what_others_read() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [3, 5]).unwrap();
        let a = unary(&mut g, UnaryKind::Relu, x);
        let b = unary(&mut g, UnaryKind::Tanh, a);
        let c = unary(&mut g, UnaryKind::Sigmoid, a);
        let d = g.plus(b, c).unwrap();
        // The Relu is also read by a MatMul: it becomes a second output.
        let w = g.placeholder("w", DType::F32, [5, 2]).unwrap();
        let mm = g.add(MatMul::default(), &[a, w]).unwrap();
        g.set_outputs(vec![d, mm]).unwrap();
        let feeds: HashMap<&str, Tensor> = [("x", ramp(&[3, 5])), ("w", ramp(&[5, 2]))].into();
        let want = run(&g, &feeds);

        let report = Fuse.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        let fused = fused_nodes(&g);
        assert_eq!(fused.len(), 1);
        let f = fused[0];
        assert_eq!(members(&g, f), "relu,tanh,sigmoid,add");
        assert_eq!(g.node(f).outputs().len(), 2);
        assert_eq!(g.inputs(g.find("matmul").unwrap())[0], Port::new(f, 0));
        let out = g.outputs()[0].node;
        assert_eq!(g.node(out).name, "add");
        assert_eq!(g.inputs(out), vec![Port::new(f, 1)]);
        assert_eq!(run(&g, &feeds), want);
        assert_eq!((report.groups, report.fused_nodes), (1, 4));
        // Tanh and Sigmoid outputs are internal; the Relu output is still stored.
        assert_eq!(report.bytes_saved, 2 * 2 * 15 * 4);
    }

    /// A running average: `Mul(average, momentum)` (its own group, made first) and
    /// `Mul(batch_mean, 1 - momentum)` behind a MatMul meet in an Add: the lone Mul
    /// moves into the Add's group rather than running alone.
    #[test]
    fn a_lone_input_joins_the_group_of_its_only_reader() {
        let mut g = Graph::new();
        let average = g.placeholder("average", DType::F32, [4, 6]).unwrap();
        let momentum = g.scalar(DType::F32, 0.9).unwrap();
        let decayed = g.mul(average, momentum).unwrap();
        let x = g.placeholder("x", DType::F32, [4, 8]).unwrap();
        let w = g.placeholder("w", DType::F32, [8, 6]).unwrap();
        let mm = g.add(MatMul::default(), &[x, w]).unwrap();
        let share = g.scalar(DType::F32, 0.1).unwrap();
        let scaled = g.mul(mm, share).unwrap();
        let updated = g.plus(scaled, decayed).unwrap();
        g.set_outputs(vec![updated]).unwrap();
        let feeds: HashMap<&str, Tensor> = [
            ("average", ramp(&[4, 6])),
            ("x", ramp(&[4, 8])),
            ("w", ramp(&[8, 6])),
        ]
        .into();
        let want = run(&g, &feeds);
        Fuse.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        let fused = fused_nodes(&g);
        assert_eq!(fused.len(), 1);
        assert_eq!(members(&g, fused[0]), "mul,mul_7,add");
        assert_eq!(run(&g, &feeds), want);
    }

    #[test]
    fn a_path_through_a_non_fusible_node_splits_the_group() {
        // relu -> neg -> transpose -> add(neg, transpose) -> tanh: one group would read
        // the transpose, which reads the group: a cycle.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 4]).unwrap();
        let a = unary(&mut g, UnaryKind::Relu, x);
        let n = unary(&mut g, UnaryKind::Neg, a);
        let t = g.add(Transpose::new([1, 0]), &[n]).unwrap();
        let s = g.plus(n, t).unwrap();
        let y = unary(&mut g, UnaryKind::Tanh, s);
        g.set_outputs(vec![y]).unwrap();
        let feeds: HashMap<&str, Tensor> = [("x", ramp(&[4, 4]))].into();
        let want = run(&g, &feeds);

        let report = Fuse.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        assert_eq!(report.groups, 2);
        let by_members: Vec<String> = fused_nodes(&g).iter().map(|&f| members(&g, f)).collect();
        assert!(
            by_members.contains(&"relu,neg".to_string()),
            "{by_members:?}"
        );
        assert!(
            by_members.contains(&"add,tanh".to_string()),
            "{by_members:?}"
        );
        let first = g.find("fused/relu").unwrap();
        let second = g.find("fused/add").unwrap();
        let transpose = g.find("transpose").unwrap();
        assert_eq!(g.inputs(transpose), vec![Port::new(first, 0)]);
        assert_eq!(
            g.inputs(second),
            vec![Port::new(first, 0), Port::from(transpose)]
        );
        assert_eq!(run(&g, &feeds), want);
    }

    #[test]
    fn a_second_run_changes_nothing() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 4]).unwrap();
        let a = unary(&mut g, UnaryKind::Relu, x);
        let n = unary(&mut g, UnaryKind::Neg, a);
        let t = g.add(Transpose::new([1, 0]), &[n]).unwrap();
        let s = g.plus(n, t).unwrap();
        let lone = unary(&mut g, UnaryKind::Exp, t);
        g.set_outputs(vec![s, lone]).unwrap();
        let first = Fuse.rewrite(&mut g).unwrap();
        assert_eq!(first.groups, 1);
        let before =
            ampgraph_graph::format::to_json(&ampgraph_graph::format::GraphDef::from_graph(&g));
        let second = Fuse.rewrite(&mut g).unwrap();
        let after =
            ampgraph_graph::format::to_json(&ampgraph_graph::format::GraphDef::from_graph(&g));
        assert_eq!(before, after);
        assert_eq!(
            (second.groups, second.nodes_before, second.nodes_after),
            (0, g.len(), g.len())
        );
    }

    #[test]
    fn tensors_of_other_element_counts_stay_outside() {
        // A scalar loss scale multiplies in; a Relu of the scalar does not join.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [8]).unwrap();
        let s = g.placeholder("s", DType::F32, []).unwrap();
        let rs = unary(&mut g, UnaryKind::Relu, s);
        let m = g.mul(x, rs).unwrap();
        let y = unary(&mut g, UnaryKind::Neg, m);
        g.set_outputs(vec![y]).unwrap();
        Fuse.rewrite(&mut g).unwrap();
        g.validate().unwrap();
        let f = fused_nodes(&g)[0];
        assert_eq!(members(&g, f), "mul,neg");
        assert!(g.find("relu").is_some());
    }
}
