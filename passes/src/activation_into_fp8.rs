//! A layer's activation computed by the FP8 casts that read it: a `Unary` whose output
//! only `Fp8Scale` and `QuantizeFp8` nodes read (current scaling: the scale and the
//! cast; delayed scaling: the cast) becomes their `activation`, and they read its input.
//! The activation's 16-bit output, which a kernel of its own wrote and each cast read
//! back, is no longer stored: in the FP8 mlp, each hidden layer's GELU (64 MiB written
//! and read back a step). The casts read the pre-activation instead, which a training
//! step keeps anyway (GELU's gradient reads it).
//!
//! Bit-exact on the CPU: the ops round the activation to its dtype before they measure
//! and quantise it, as the Unary stored it.

use ampgraph_graph::ops::{Fp8Scale, QuantizeFp8, Unary};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::{output_nodes, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `activation-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ActivationIntoFp8;

/// `op` reading its quantised tensor through `kind` too, if it is an FP8 cast without
/// an activation.
fn with_activation(op: &dyn Op, kind: ampgraph_graph::ops::UnaryKind) -> Option<Box<dyn Op>> {
    if let Some(q) = op.downcast_ref::<QuantizeFp8>() {
        return q.activation.is_none().then(|| {
            let q = q.clone().with_activation(Some(kind));
            Box::new(q) as Box<dyn Op>
        });
    }
    let s = op.downcast_ref::<Fp8Scale>()?;
    s.activation.is_none().then(|| {
        let s = s.clone().with_activation(Some(kind));
        Box::new(s) as Box<dyn Op>
    })
}

impl Pass for ActivationIntoFp8 {
    fn name(&self) -> &'static str {
        "activation-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let (mut folded, mut bytes) = (0usize, 0u64);
        let ids: Vec<NodeId> = g.node_ids().collect();
        for id in ids {
            let Some(kind) = g.node(id).op.downcast_ref::<Unary>().map(|u| u.kind) else {
                continue;
            };
            let readers = g.consumers(id);
            if is_output[id.index()] || readers.is_empty() {
                continue;
            }
            // Every reader an FP8 cast reading it as its x.
            let rewrites: Option<Vec<(NodeId, Box<dyn Op>)>> = (readers.iter())
                .map(|&(reader, slot, _)| {
                    let op = with_activation(g.node(reader).op.as_ref(), kind)?;
                    (slot == 0).then_some((reader, op))
                })
                .collect();
            let Some(rewrites) = rewrites else {
                continue;
            };
            let input = g.inputs(id)[0];
            for (reader, op) in rewrites {
                let mut inputs = g.inputs(reader);
                inputs[0] = input;
                g.set_node(reader, op, &inputs)?;
            }
            bytes += 2 * g.ty(Port::new(id, 0)).size_bytes() as u64;
            g.remove_node(id)?;
            folded += 1;
        }
        let lines = vec![format!(
            "activation-into-fp8: {folded} activations computed by the FP8 casts reading them ({} fewer written and read back)",
            format_bytes(bytes)
        )];
        Ok(summary("activation-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, run as run_cpu};
    use ampgraph_graph::ops::UnaryKind;
    use ampgraph_graph::{DType, Tensor};

    /// `q(gelu(z))` with current scaling's scale beside it, and the gelu's value also
    /// read by `extra` when asked.
    fn graph(extra: bool) -> Graph {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::BF16, [8, 16]).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let a = g.add(Unary::new(gelu), &[z]).unwrap();
        let scale = g
            .add(Fp8Scale::new(DType::F8E4M3, 0).unwrap(), &[a])
            .unwrap();
        let op = QuantizeFp8::new(DType::F8E4M3)
            .unwrap()
            .with_transposed(true);
        let q = g.add_node("q", Box::new(op), &[a, scale]).unwrap();
        let mut outputs = vec![Port::new(q, 0), Port::new(q, 1), Port::new(q, 2)];
        if extra {
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[a]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    #[test]
    fn an_activation_read_only_by_fp8_casts_folds_into_them_with_the_same_bits() {
        let before = graph(false);
        let mut g = before.clone();
        let summary = ActivationIntoFp8.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 activations"), "{summary}");
        assert!(g.node_ids().all(|id| !g.node(id).op.is::<Unary>()));
        let q = g.find("q").unwrap();
        let op = g.node(q).op.downcast_ref::<QuantizeFp8>().unwrap();
        assert!(op.activation.is_some());
        let z: Vec<f64> = (0..128).map(|i| (i as f64 * 0.37).sin() * 4.0).collect();
        let feeds = [("z", Tensor::from_f64(DType::BF16, [8, 16], &z).unwrap())]
            .into_iter()
            .collect();
        assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
        // The ops read back from a file with their activation.
        use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
        let again = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
        assert_same_bits(&run_cpu(&g, &feeds), &run_cpu(&again, &feeds));
    }

    #[test]
    fn an_activation_something_else_reads_stays() {
        let mut g = graph(true);
        let summary = ActivationIntoFp8.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 activations"), "{summary}");
        assert!(g.node_ids().any(|id| g.node(id).op.is::<Unary>()));
    }
}
