//! Dead-node elimination: nodes that neither a graph output nor a state write
//! (AssignVariable) depends on never run (an executor's schedule starts from what is
//! fetched) and are removed.

use ampgraph_graph::{Graph, TensorType};

use super::live_nodes;
use crate::rewrite::summary;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `dce` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let adj = g.adjacency();
        let live = live_nodes(g, &adj);
        // Readers before what they read: each node is unread when it goes.
        let mut order = g.topo_order_in(&adj)?;
        order.reverse();
        let (mut removed, mut bytes) = (0usize, 0usize);
        for id in order.into_iter().filter(|id| !live[id.index()]) {
            bytes += g
                .node(id)
                .outputs()
                .iter()
                .map(TensorType::size_bytes)
                .sum::<usize>();
            g.remove_node(id)?;
            removed += 1;
        }
        let line = format!(
            "dce: removed {removed} dead nodes ({} of tensors no longer computed)",
            format_bytes(bytes as u64)
        );
        Ok(summary("dce", vec![line]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{AssignVariable, Binary, BinaryKind, Placeholder, Unary, UnaryKind};
    use ampgraph_graph::ops::{Const, Variable};
    use ampgraph_graph::{DType, Op, Port, Tensor, TensorType};

    fn add(g: &mut Graph, name: &str, op: impl Op, inputs: &[Port]) -> Port {
        g.add_node(name, Box::new(op), inputs).unwrap().into()
    }

    #[test]
    fn removes_what_no_output_or_write_needs() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2]);
        let x = add(&mut g, "x", Placeholder(ty.clone()), &[]);
        let unused = add(&mut g, "unused", Placeholder(ty.clone()), &[]);
        let y = add(&mut g, "y", Unary::new(UnaryKind::Relu), &[x]);
        // A dead branch of two nodes reading a live one.
        let d1 = add(&mut g, "d1", Unary::new(UnaryKind::Exp), &[y]);
        add(&mut g, "d2", Binary::new(BinaryKind::Add), &[d1, unused]);
        // A write no output reads: it changes `v`, so it and what it reads stay.
        let v = add(&mut g, "v", Variable::new(ty.clone()), &[]);
        let one = Const::new(Tensor::from_f64(DType::F32, [2], &[1.0, 1.0]).unwrap());
        let c = add(&mut g, "c", one, &[]);
        let next = add(&mut g, "next", Binary::new(BinaryKind::Add), &[v, c]);
        add(&mut g, "assign", AssignVariable, &[v, next]);
        g.set_outputs(vec![y]).unwrap();

        let s = Dce.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(s.lines[0].starts_with("dce: removed 3 dead nodes"), "{s}");
        for gone in ["unused", "d1", "d2"] {
            assert!(g.find(gone).is_none(), "{gone} is still there");
        }
        for kept in ["x", "y", "v", "c", "next", "assign"] {
            assert!(g.find(kept).is_some(), "{kept} was removed");
        }
        assert!(Dce.run(&mut g).unwrap().lines[0].starts_with("dce: removed 0 "));
    }
}
