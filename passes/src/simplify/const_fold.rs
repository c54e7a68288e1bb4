//! Constant folding: a node whose inputs are all Consts is computed once, at rewrite
//! time, with its CPU kernel, and becomes a Const of that value under its own name.

use ampgraph_graph::ops::Const;
use ampgraph_graph::{Graph, NodeId, Tensor};
use foldhash::HashMap;
use std::collections::hash_map::Entry;

use super::is_stateful;
use crate::rewrite::{const_value, node_error, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// Results larger than this many elements are not folded: a Const that size would
/// bloat the graph file and the rewrite's memory for little gain.
pub const MAX_FOLDED_ELEMENTS: usize = 1 << 20;

/// The `const-fold` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConstFold;

impl Pass for ConstFold {
    fn name(&self) -> &'static str {
        "const-fold"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let adj = g.adjacency();
        // The values of the Consts read so far, original and folded.
        let mut values: HashMap<NodeId, Tensor> = HashMap::default();
        let (mut folded, mut bytes) = (0usize, 0usize);
        for id in g.topo_order_in(&adj)? {
            let inputs = adj.inputs(id);
            if inputs.is_empty() || !foldable(g, id) {
                continue;
            }
            let mut args = Vec::with_capacity(inputs.len());
            for p in inputs {
                let value = match values.entry(p.node) {
                    Entry::Occupied(known) => known.get().clone(),
                    Entry::Vacant(slot) => match const_value(g, p.node)? {
                        Some(v) => slot.insert(v).clone(),
                        None => break,
                    },
                };
                args.push(value);
            }
            if args.len() < inputs.len() {
                continue;
            }
            let refs: Vec<&Tensor> = args.iter().collect();
            let node = g.node(id);
            let value = node
                .op
                .eval(&refs)
                .map_err(|m| node_error(g, id, &m))?
                .pop()
                .ok_or_else(|| node_error(g, id, "the kernel produced no output"))?;
            bytes += value.len() * value.dtype().size_bytes();
            folded += 1;
            g.set_node(id, Box::new(Const::new(value.clone())), &[])?;
            values.insert(id, value);
        }
        let line = format!(
            "const-fold: folded {folded} nodes ({} of constants)",
            format_bytes(bytes as u64)
        );
        Ok(summary("const-fold", vec![line]))
    }
}

/// Whether a node may be replaced by its value: deterministic, one output, no state,
/// and a result of bounded size.
fn foldable(g: &Graph, id: NodeId) -> bool {
    let node = g.node(id);
    let [out] = node.outputs() else {
        return false;
    };
    !node.op.is::<Const>()
        && !is_stateful(node.op.as_ref())
        && out.checked_len().is_some_and(|n| n <= MAX_FOLDED_ELEMENTS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{Binary, BinaryKind, Placeholder, Unary, UnaryKind};
    use ampgraph_graph::{DType, Port, TensorType};

    fn constant(g: &mut Graph, name: &str, shape: &[usize], values: &[f64]) -> Port {
        let t = Tensor::from_f64(DType::F32, shape, values).unwrap();
        g.add_node(name, Box::new(Const::new(t)), &[])
            .unwrap()
            .into()
    }

    fn value_of(g: &Graph, name: &str) -> Vec<f64> {
        let id = g.find(name).unwrap();
        const_value(g, id).unwrap().expect("a Const").to_f64_vec()
    }

    #[test]
    fn folds_a_chain_of_constant_ops_and_keeps_names() {
        let mut g = Graph::new();
        let a = constant(&mut g, "a", &[2], &[1.0, -2.0]);
        let b = constant(&mut g, "b", &[], &[3.0]);
        let sum = g
            .add_node("sum", Box::new(Binary::new(BinaryKind::Add)), &[a, b])
            .unwrap();
        let act = g
            .add_node("act", Box::new(Unary::new(UnaryKind::Relu)), &[sum.into()])
            .unwrap();
        let x = g
            .add_node(
                "x",
                Box::new(Placeholder(TensorType::new(DType::F32, [2]))),
                &[],
            )
            .unwrap();
        let out = g
            .add_node(
                "out",
                Box::new(Binary::new(BinaryKind::Mul)),
                &[act.into(), x.into()],
            )
            .unwrap();
        g.set_outputs(vec![out.into(), act.into()]).unwrap();

        let s = ConstFold.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(s.lines[0].contains("folded 2 nodes (16 B"), "{s}");
        assert_eq!(value_of(&g, "sum"), [4.0, 1.0]);
        assert_eq!(value_of(&g, "act"), [4.0, 1.0]);
        // The node reading a Placeholder stays; the outputs still name `act`.
        assert_eq!(g.node(out).op_name(), "Mul");
        assert_eq!(g.port_name(g.outputs()[1]), "act");
        // Idempotent.
        let again = ConstFold.run(&mut g).unwrap();
        assert!(again.lines[0].contains("folded 0 nodes"), "{again}");
    }

    #[test]
    fn skips_results_over_the_size_bound() {
        let mut g = Graph::new();
        let n = MAX_FOLDED_ELEMENTS + 1;
        let big = g
            .add_node(
                "big",
                Box::new(Const {
                    ty: TensorType::new(DType::F32, [n]),
                    values: None,
                }),
                &[],
            )
            .unwrap();
        let neg = g
            .add_node("neg", Box::new(Unary::new(UnaryKind::Neg)), &[big.into()])
            .unwrap();
        g.set_outputs(vec![neg.into()]).unwrap();
        ConstFold.run(&mut g).unwrap();
        assert_eq!(g.node(neg).op_name(), "Neg");
    }
}
