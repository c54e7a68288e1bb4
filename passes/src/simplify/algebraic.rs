//! Algebraic identities: nodes that pass their input through unchanged (x*1, x+0,
//! x-0, x/1, Identity, Cast to the same dtype, Reshape to the same shape, Transpose by
//! the identity permutation) are bypassed, and chains of Transposes or of Reshapes
//! become one node. A node that is a graph output keeps its name: it becomes an
//! Identity of its input instead.
//!
//! [`simplify`] with [`Identities::Transposes`] does the Transpose part alone:
//! `layout-nhwc` cancels the Transposes it inserts against the graph's own with it.

use ampgraph_graph::ops::{Binary, BinaryKind, Cast, Const, Reshape, Transpose, Unary, UnaryKind};
use ampgraph_graph::{Graph, NodeId, Port};

use super::Edits;
use crate::rewrite::{output_nodes, summary};
use crate::{Pass, PassError, PassSummary};

/// The `algebraic` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Algebraic;

/// Which identities a sweep removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Identities {
    /// Every one the module documentation lists (the `algebraic` pass).
    All,
    /// Transposes only: chains merged, identity permutations bypassed.
    Transposes,
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub bypassed: usize,
    pub transposes: usize,
    pub reshapes: usize,
    pub to_identity: usize,
}

impl Pass for Algebraic {
    fn name(&self) -> &'static str {
        "algebraic"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let counts = simplify(g, Identities::All)?;
        let lines = vec![
            format!("algebraic: bypassed {} no-op nodes", counts.bypassed),
            format!(
                "algebraic: merged {} Transpose pairs and {} Reshape pairs",
                counts.transposes, counts.reshapes
            ),
            format!(
                "algebraic: made {} no-op graph outputs Identity",
                counts.to_identity
            ),
        ];
        Ok(summary("algebraic", lines))
    }
}

/// One sweep in topological order removing the identities `which` names.
pub(crate) fn simplify(g: &mut Graph, which: Identities) -> Result<Counts, PassError> {
    let is_output = output_nodes(g);
    let mut edits = Edits::new(g);
    let mut counts = Counts::default();
    // Graph outputs that compute their input: made Identity once the rewiring is done.
    let mut to_identity: Vec<(NodeId, Port)> = Vec::new();
    for id in g.topo_order_in(edits.adjacency())? {
        // Inputs are final here: every producer was visited first.
        if let Some((op, input)) = collapse_chain(g, &edits, id, which) {
            if op.is::<Transpose>() {
                counts.transposes += 1;
            } else {
                counts.reshapes += 1;
            }
            g.set_op(id, op);
            edits.set_input(id, 0, input);
        }
        let Some(x) = passed_through(g, &edits, id, which) else {
            continue;
        };
        if !is_output[id.index()] {
            edits.forward_node(id, 1, |_| x);
            counts.bypassed += 1;
        } else if !is_identity(g, id) {
            to_identity.push((id, x));
            counts.to_identity += 1;
        }
    }
    edits.apply(g)?;
    // Each `x` is final: it was visited, and resolved, before its reader.
    for &(id, x) in &to_identity {
        g.set_node(id, Box::new(Unary::new(UnaryKind::Identity)), &[x])?;
    }
    Ok(counts)
}

fn is_identity(g: &Graph, id: NodeId) -> bool {
    g.node(id)
        .op
        .downcast_ref::<Unary>()
        .is_some_and(|u| u.kind == UnaryKind::Identity)
}

/// Transpose(Transpose(y)) as one Transpose of `y` (perms composed), and
/// Reshape(Reshape(y)) as one Reshape of `y`: the new op and its input.
fn collapse_chain(
    g: &Graph,
    edits: &Edits,
    id: NodeId,
    which: Identities,
) -> Option<(Box<dyn ampgraph_graph::Op>, Port)> {
    let op = &g.node(id).op;
    let reshape = op.is::<Reshape>() && which == Identities::All;
    if !op.is::<Transpose>() && !reshape {
        return None;
    }
    let x = edits.input(id, 0);
    let inner = &g.node(x.node).op;
    // Both are one-input ops: the inner one's input 0 exists.
    match (
        op.downcast_ref::<Transpose>(),
        inner.downcast_ref::<Transpose>(),
    ) {
        // Output axis i is the inner output's axis outer[i], which is y's inner[outer[i]].
        (Some(outer), Some(inner)) => {
            let perm: Vec<usize> = outer.perm.iter().map(|&p| inner.perm[p]).collect();
            Some((Box::new(Transpose::new(perm)), edits.input(x.node, 0)))
        }
        (None, None) if inner.is::<Reshape>() => Some((op.clone(), edits.input(x.node, 0))),
        _ => None,
    }
}

/// The input a node passes through unchanged (same dtype, shape and values), if any.
fn passed_through(g: &Graph, edits: &Edits, id: NodeId, which: Identities) -> Option<Port> {
    let node = g.node(id);
    let [out] = node.outputs() else {
        return None;
    };
    let op = &node.op;
    let identity_transpose = op
        .downcast_ref::<Transpose>()
        .is_some_and(|t| t.perm.iter().enumerate().all(|(i, &p)| i == p));
    let all = which == Identities::All;
    let candidate = if let Some(b) = op.downcast_ref::<Binary>().filter(|_| all) {
        neutral_operand(g, b.kind, edits.input(id, 0), edits.input(id, 1))?
    } else if identity_transpose
        || all
            && (is_identity(g, id)
                || op.downcast_ref::<Cast>().is_some()
                || op.downcast_ref::<Reshape>().is_some())
    {
        edits.input(id, 0)
    } else {
        return None;
    };
    // A Cast or Reshape is a no-op exactly when the type does not change; a Binary
    // whose constant broadcasts `x` to a larger shape is not one.
    (g.ty(candidate) == out).then_some(candidate)
}

/// For `a op b`, the operand the result equals when the other is a Const of the
/// neutral element (1 for Mul/Div, 0 for Add/Sub; only on the right for Sub/Div).
fn neutral_operand(g: &Graph, kind: BinaryKind, a: Port, b: Port) -> Option<Port> {
    let (neutral, commutes) = match kind {
        BinaryKind::Mul => (1.0, true),
        BinaryKind::Div => (1.0, false),
        BinaryKind::Add => (0.0, true),
        BinaryKind::Sub => (0.0, false),
        _ => return None,
    };
    if is_const_of(g, b, neutral) {
        Some(a)
    } else if commutes && is_const_of(g, a, neutral) {
        Some(b)
    } else {
        None
    }
}

/// Whether `p` is a Const whose every element equals `v` (either zero for 0).
fn is_const_of(g: &Graph, p: Port, v: f64) -> bool {
    match g.node(p.node).op.downcast_ref::<Const>() {
        Some(Const { values: None, .. }) => v == 0.0,
        Some(Const {
            values: Some(data), ..
        }) => data.to_f64().iter().all(|&x| x == v),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::Placeholder;
    use ampgraph_graph::{DType, Op, Tensor, TensorType};

    fn add(g: &mut Graph, name: &str, op: impl Op, inputs: &[Port]) -> Port {
        g.add_node(name, Box::new(op), inputs).unwrap().into()
    }

    fn konst(g: &mut Graph, name: &str, shape: &[usize], v: f64) -> Port {
        let n: usize = shape.iter().product();
        let t = Tensor::from_f64(DType::F32, shape, &vec![v; n]).unwrap();
        add(g, name, Const::new(t), &[])
    }

    fn op_of(g: &Graph, name: &str) -> String {
        g.node(g.find(name).unwrap()).op_name().to_string()
    }

    #[test]
    fn bypasses_neutral_arithmetic_and_no_op_nodes() {
        let mut g = Graph::new();
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, [2, 3])),
            &[],
        );
        let one = konst(&mut g, "one", &[], 1.0);
        let zero_row = konst(&mut g, "zero_row", &[3], 0.0);
        let ones_big = konst(&mut g, "ones_big", &[4, 2, 3], 1.0);
        let m = add(&mut g, "m", Binary::new(BinaryKind::Mul), &[one, x]);
        let a = add(&mut g, "a", Binary::new(BinaryKind::Add), &[m, zero_row]);
        let s = add(&mut g, "s", Binary::new(BinaryKind::Sub), &[zero_row, a]); // 0 - x: kept
        let c = add(&mut g, "c", Cast { to: DType::F32 }, &[s]);
        let i = add(&mut g, "i", Unary::new(UnaryKind::Identity), &[c]);
        let r = add(&mut g, "r", Reshape::new([2, -1]), &[i]);
        let b = add(&mut g, "b", Binary::new(BinaryKind::Mul), &[r, ones_big]); // broadcasts: kept
        let d = add(&mut g, "d", Binary::new(BinaryKind::Div), &[r, one]); // an output
        g.set_outputs(vec![b, d]).unwrap();

        let summary = Algebraic.run(&mut g).unwrap();
        g.validate().unwrap();
        assert_eq!(summary.lines[0], "algebraic: bypassed 5 no-op nodes");
        for gone in ["m", "a", "c", "i", "r"] {
            assert!(g.find(gone).is_none(), "{gone} is still there");
        }
        let s = g.find("s").unwrap();
        assert_eq!(g.node(g.inputs(s)[1].node).name, "x");
        let b = g.find("b").unwrap();
        assert_eq!(g.node(g.inputs(b)[0].node).name, "s");
        // The output `d` keeps its name and computes its input.
        assert_eq!(op_of(&g, "d"), "Identity");
        assert_eq!(g.node(g.inputs(g.find("d").unwrap())[0].node).name, "s");
        let again = Algebraic.run(&mut g).unwrap();
        assert_eq!(again.lines[0], "algebraic: bypassed 0 no-op nodes");
        assert_eq!(
            again.lines[2],
            "algebraic: made 0 no-op graph outputs Identity"
        );
    }

    #[test]
    fn composes_transposes_and_reshapes_but_keeps_rounding_casts() {
        let mut g = Graph::new();
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, [2, 3, 4])),
            &[],
        );
        let t1 = add(&mut g, "t1", Transpose::new([1, 2, 0]), &[x]); // [3, 4, 2]
        let t2 = add(&mut g, "t2", Transpose::new([0, 2, 1]), &[t1]); // [3, 2, 4]
        let back = add(&mut g, "back", Transpose::new([2, 0, 1]), &[x]); // [4, 2, 3]
        let undo = add(&mut g, "undo", Transpose::new([1, 2, 0]), &[back]); // x again
        let r1 = add(&mut g, "r1", Reshape::new([-1]), &[x]);
        let r2 = add(&mut g, "r2", Reshape::new([6, 4]), &[r1]);
        let h = add(&mut g, "h", Cast { to: DType::F16 }, &[x]);
        let f = add(&mut g, "f", Cast { to: DType::F32 }, &[h]);
        let sum = add(&mut g, "sum", Binary::new(BinaryKind::Add), &[undo, f]);
        g.set_outputs(vec![t2, r2, sum]).unwrap();

        Algebraic.run(&mut g).unwrap();
        g.validate().unwrap();
        let t2 = g.find("t2").unwrap();
        let perm = &g.node(t2).op.downcast_ref::<Transpose>().unwrap().perm;
        // t2[i, j, k] = t1[i, k, j] = x[j, i, k]... as a perm of x: [1, 0, 2].
        assert_eq!(perm, &[1, 0, 2]);
        assert_eq!(g.node(g.inputs(t2)[0].node).name, "x");
        let r2 = g.find("r2").unwrap();
        assert_eq!(g.node(g.inputs(r2)[0].node).name, "x");
        // Transpose by the inverse permutation cancels; f16 round trips stay.
        let sum = g.find("sum").unwrap();
        let names: Vec<_> = g
            .inputs(sum)
            .iter()
            .map(|p| g.node(p.node).name.clone())
            .collect();
        assert_eq!(names, ["x", "f"]);
        assert_eq!(op_of(&g, "f"), "Cast");
        assert_eq!(op_of(&g, "h"), "Cast");
    }
}
