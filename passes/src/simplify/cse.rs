//! Common-subexpression elimination: nodes with equal ops (name and attributes,
//! Const values included) reading the same tensors compute the same values; the
//! first in topological order is kept and the others' readers move to it.

use std::borrow::Cow;
use std::hash::{BuildHasher, Hash, Hasher};

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::Const;
use ampgraph_graph::{Data, Graph, NodeId, Op, Port, TensorType};
use foldhash::HashMap;

use super::{is_stateful, Edits};
use crate::rewrite::{output_nodes, summary};
use crate::{Pass, PassError, PassSummary};

/// The `cse` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let mut edits = Edits::new(g);
        // Kept nodes by the hash of (op, inputs); equal hashes are compared in full.
        let mut kept: HashMap<u64, Vec<NodeId>> = HashMap::default();
        for id in g.topo_order_in(edits.adjacency())? {
            let op = g.node(id).op.as_ref();
            if is_stateful(op) {
                continue;
            }
            let inputs = edits.inputs(id);
            let key = fingerprint(op, &inputs);
            let twin = kept.get(&key).and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&k| same_op(g.node(k).op.as_ref(), op) && edits.inputs(k) == inputs)
            });
            match twin {
                // A graph output keeps its name: it stays, a duplicate.
                Some(twin) if !is_output[id.index()] => {
                    edits.forward_node(id, g.node(id).outputs().len(), |k| Port::new(twin, k));
                }
                Some(_) => {}
                None => kept.entry(key).or_default().push(id),
            }
        }
        let merged = edits.forwarded();
        edits.apply(g)?;
        let line = format!("cse: merged {merged} nodes");
        Ok(summary("cse", vec![line]))
    }
}

/// A Const's type and values, the values as their bytes in place: its attributes
/// would copy every element into an f64 for each hash and comparison (a 4 GiB constant
/// folded at import took 21 GB).
type ConstParts<'a> = (&'a TensorType, Option<Cow<'a, [u8]>>);

fn const_parts(op: &dyn Op) -> Option<ConstParts<'_>> {
    op.downcast_ref::<Const>()
        .map(|c| (&c.ty, c.values.as_deref().map(Data::le_bytes)))
}

/// A hash of the op's name and attributes and of the input tensors.
fn fingerprint(op: &dyn Op, inputs: &[Port]) -> u64 {
    let mut h = foldhash::fast::FixedState::default().build_hasher();
    op.name().hash(&mut h);
    if let Some(parts) = const_parts(op) {
        parts.hash(&mut h);
    } else {
        for (key, value) in op.attrs() {
            key.hash(&mut h);
            hash_attr(&value, &mut h);
        }
    }
    inputs.hash(&mut h);
    h.finish()
}

fn hash_attr(v: &AttrValue, h: &mut impl Hasher) {
    std::mem::discriminant(v).hash(h);
    match v {
        AttrValue::Bool(b) => b.hash(h),
        AttrValue::Int(i) => i.hash(h),
        AttrValue::Float(f) => f.to_bits().hash(h),
        AttrValue::Str(s) => s.hash(h),
        AttrValue::Ints(v) => v.hash(h),
        AttrValue::Floats(v) => v.iter().for_each(|f| f.to_bits().hash(h)),
    }
}

/// Equal names and attributes, floats compared bit for bit: a Const of -0.0 is not
/// one of 0.0 (1/x tells them apart).
fn same_op(a: &dyn Op, b: &dyn Op) -> bool {
    if let (Some(x), Some(y)) = (const_parts(a), const_parts(b)) {
        return x == y;
    }
    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    a.name() == b.name()
        && a.attrs()
            .into_iter()
            .zip(b.attrs())
            .all(|((ka, va), (kb, vb))| {
                ka == kb
                    && match (&va, &vb) {
                        (AttrValue::Float(x), AttrValue::Float(y)) => x.to_bits() == y.to_bits(),
                        (AttrValue::Floats(x), AttrValue::Floats(y)) => bits(x) == bits(y),
                        _ => va == vb,
                    }
            })
        && a.attrs().len() == b.attrs().len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{Binary, BinaryKind, Const, Placeholder, Unary, UnaryKind, Variable};
    use ampgraph_graph::{DType, Tensor, TensorType};

    fn add(g: &mut Graph, name: &str, op: impl Op, inputs: &[Port]) -> Port {
        g.add_node(name, Box::new(op), inputs).unwrap().into()
    }

    fn scalar(g: &mut Graph, name: &str, v: f64) -> Port {
        add(g, name, Const::new(Tensor::scalar(DType::F32, v)), &[])
    }

    #[test]
    fn merges_equal_subexpressions_and_equal_consts() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [3]);
        let x = add(&mut g, "x", Placeholder(ty.clone()), &[]);
        let c1 = scalar(&mut g, "c1", 2.0);
        let c2 = scalar(&mut g, "c2", 2.0);
        let m1 = add(&mut g, "m1", Binary::new(BinaryKind::Mul), &[x, c1]);
        let m2 = add(&mut g, "m2", Binary::new(BinaryKind::Mul), &[x, c2]);
        let t1 = add(&mut g, "t1", Unary::new(UnaryKind::Tanh), &[m1]);
        let t2 = add(&mut g, "t2", Unary::new(UnaryKind::Tanh), &[m2]);
        // Different op: stays.
        let s = add(&mut g, "s", Unary::new(UnaryKind::Sigmoid), &[m2]);
        let sum = add(&mut g, "sum", Binary::new(BinaryKind::Add), &[t1, t2]);
        let out = add(&mut g, "out", Binary::new(BinaryKind::Add), &[sum, s]);
        g.set_outputs(vec![out]).unwrap();
        let before = g.len();

        let summary = Cse.run(&mut g).unwrap();
        g.validate().unwrap();
        // c2, m2 and t2 merge into c1, m1 and t1.
        assert_eq!(g.len(), before - 3, "{summary}");
        assert_eq!(summary.lines, ["cse: merged 3 nodes"]);
        for gone in ["c2", "m2", "t2"] {
            assert!(g.find(gone).is_none(), "{gone} is still there");
        }
        let sum = g.find("sum").unwrap();
        let t1 = g.find("t1").unwrap();
        assert_eq!(g.inputs(sum), [Port::from(t1), Port::from(t1)]);
        let s = g.find("s").unwrap();
        assert_eq!(g.node(g.inputs(s)[0].node).name, "m1");
        // Idempotent.
        assert_eq!(Cse.run(&mut g).unwrap().lines, ["cse: merged 0 nodes"]);
    }

    #[test]
    fn never_merges_variables_placeholders_signed_zeros_or_outputs() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2]);
        let v1 = add(&mut g, "v1", Variable::new(ty.clone()), &[]);
        let v2 = add(&mut g, "v2", Variable::new(ty.clone()), &[]);
        let p1 = add(&mut g, "p1", Placeholder(ty.clone()), &[]);
        let p2 = add(&mut g, "p2", Placeholder(ty.clone()), &[]);
        let z = scalar(&mut g, "z", 0.0);
        let nz = scalar(&mut g, "nz", -0.0);
        let a = add(&mut g, "a", Binary::new(BinaryKind::Add), &[v1, v2]);
        let b = add(&mut g, "b", Binary::new(BinaryKind::Add), &[p1, p2]);
        let o1 = add(&mut g, "o1", Unary::new(UnaryKind::Neg), &[a]);
        let o2 = add(&mut g, "o2", Unary::new(UnaryKind::Neg), &[a]);
        let d1 = add(&mut g, "d1", Binary::new(BinaryKind::Div), &[b, z]);
        let d2 = add(&mut g, "d2", Binary::new(BinaryKind::Div), &[b, nz]);
        g.set_outputs(vec![o1, o2, d1, d2]).unwrap();
        let before = g.len();
        Cse.run(&mut g).unwrap();
        assert_eq!(g.len(), before);
    }
}
