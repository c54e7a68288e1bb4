//! Softmaxes take the elementwise program that computes their operand. A Softmax
//! (or LogSoftmax) outside fused attention usually reads a value that elementwise ops
//! just computed from a product: the scores scaled, a mask added (causal or padding
//! masks, which `fuse-attention` does not take), a cast. The `fuse` pass makes that
//! chain one kernel, which writes the value for the softmax kernel to read back. This
//! pass gives the chain to the softmax instead ([`FusedSoftmax`]): its kernel
//! computes the value as it loads each row, so the value is never stored.
//!
//! The operand must be the one output of a fused program without column sums, or of
//! a lone elementwise node, read by nothing but the softmax and not a graph output.
//! The fused op runs the program and then the softmax's own kernel on the CPU, so the
//! result is bit-exact.

use ampgraph_graph::ops::{FusedSoftmax, LogSoftmax, Softmax};
use ampgraph_graph::{Graph, NodeId};

use crate::fuse::record_members;
use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::sum_into_elementwise::producer_program;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `softmax-prologue` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoftmaxPrologue;

/// `(axis, log)` of a Softmax or LogSoftmax node.
fn softmax_of(g: &Graph, id: NodeId) -> Option<(i64, bool)> {
    let op = &g.node(id).op;
    op.downcast_ref::<Softmax>()
        .map(|s| (s.axis, false))
        .or_else(|| op.downcast_ref::<LogSoftmax>().map(|s| (s.axis, true)))
}

impl Pass for SoftmaxPrologue {
    fn name(&self) -> &'static str {
        "softmax-prologue"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let adj = g.adjacency();
        let (mut fused, mut bytes) = (0usize, 0u64);
        let mut stale = Vec::new();
        let softmaxes: Vec<NodeId> = g.node_ids().collect();
        for id in softmaxes {
            let Some((axis, log)) = softmax_of(g, id) else {
                continue;
            };
            let [x] = adj.inputs(id)[..] else {
                continue;
            };
            let alone = g.port_consumers(x) == [(id, 0)] && !is_output[x.node.index()];
            if !alone {
                continue;
            }
            let Some((program, inputs)) = producer_program(g, &adj, x.node) else {
                continue;
            };
            // A program with other outputs or column sums still has to run.
            let Ok(op) = FusedSoftmax::new(axis, log, program) else {
                continue;
            };
            bytes += 2 * g.ty(x).size_bytes() as u64;
            g.set_node(id, Box::new(op), &inputs)?;
            record_members(g, id, x.node, &[id]);
            stale.push(x.node);
            fused += 1;
        }
        let (removed, _) = remove_unread(g, stale, &is_output)?;
        let lines = vec![
            format!(
                "softmax-prologue: {fused} softmaxes compute their operand's elementwise program themselves ({removed} kernels fewer per run)"
            ),
            format!(
                "softmax-prologue: {} of tensors no longer written and read back",
                format_bytes(bytes)
            ),
        ];
        Ok(summary("softmax-prologue", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuse::Fuse;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::format::to_text;
    use ampgraph_graph::ops::fused::MEMBERS_ANNOTATION;
    use ampgraph_graph::ops::{BatchMatMul, Binary, BinaryKind, Cast, Unary, UnaryKind};
    use ampgraph_graph::{DType, Port, Tensor};
    use std::collections::HashMap;

    const B: usize = 2;
    const S: usize = 6;
    const D: usize = 8;

    /// Masked attention as a model without fused attention writes it:
    /// `softmax(q k^T * 0.25 + mask) v` on `[B, S, D]` heads, the mask `[S, S]`
    /// (causal: -inf above the diagonal) broadcast over the batch, and the softmax
    /// (LogSoftmax with `log`) computed in f32 between casts when `wide`.
    fn masked_attention(dtype: DType, log: bool, wide: bool) -> Graph {
        let mut g = Graph::new();
        let q = g.placeholder("q", dtype, [B, S, D]).unwrap();
        let k = g.placeholder("k", dtype, [B, S, D]).unwrap();
        let v = g.placeholder("v", dtype, [B, S, D]).unwrap();
        let mask: Vec<f64> = (0..S * S)
            .map(|i| {
                if i % S > i / S {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = g
            .constant(Tensor::from_f64(dtype, vec![S, S], &mask).unwrap())
            .unwrap();
        let quarter = g
            .constant(Tensor::from_f64(dtype, vec![], &[0.25]).unwrap())
            .unwrap();
        let scores = g.add(BatchMatMul::new(false, true), &[q, k]).unwrap();
        let scaled = g
            .add(Binary::new(BinaryKind::Mul), &[scores, quarter])
            .unwrap();
        let mut masked = g
            .add(Binary::new(BinaryKind::Add), &[scaled, mask])
            .unwrap();
        if wide {
            masked = g.add(Cast { to: DType::F32 }, &[masked]).unwrap();
        }
        let mut p = if log {
            g.add(LogSoftmax::default(), &[masked]).unwrap()
        } else {
            g.add(Softmax::default(), &[masked]).unwrap()
        };
        if wide {
            p = g.add(Cast { to: dtype }, &[p]).unwrap();
        }
        let y = g.add(BatchMatMul::new(false, false), &[p, v]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        g
    }

    fn feeds(dtype: DType) -> HashMap<&'static str, Tensor> {
        let ramp = |k: f64| -> Tensor {
            let v: Vec<f64> = (0..B * S * D).map(|i| (i as f64 * k).sin() * 2.0).collect();
            Tensor::from_f64(dtype, vec![B, S, D], &v).unwrap()
        };
        HashMap::from([("q", ramp(0.37)), ("k", ramp(0.91)), ("v", ramp(0.13))])
    }

    #[test]
    fn a_masked_softmax_computes_its_scaled_masked_scores_itself() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            for (log, wide) in [(false, false), (true, false), (false, true)] {
                let before = masked_attention(dtype, log, wide);
                let mut g = before.clone();
                Fuse.run(&mut g).unwrap();
                let summary = SoftmaxPrologue.run(&mut g).unwrap();
                g.validate().unwrap();
                let what = format!("{dtype} log {log} wide {wide}");
                assert_eq!(count(&g, "FusedSoftmax"), 1, "{what}");
                assert_eq!(count(&g, "Softmax") + count(&g, "LogSoftmax"), 0, "{what}");
                // The widening cast joins the prologue; the cast back stays a node.
                assert_eq!(count(&g, "FusedElementwise"), 0, "{what}");
                assert_eq!(count(&g, "Cast"), usize::from(wide), "{what}");
                let id = g
                    .node_ids()
                    .find(|&id| g.node(id).op_name() == "FusedSoftmax")
                    .unwrap();
                let fs = g.node(id).op.downcast_ref::<FusedSoftmax>().unwrap();
                assert_eq!(fs.log, log);
                // The scores, the scale and the mask.
                assert_eq!(g.inputs(id).len(), 3, "{what}");
                let members = &g.node(id).annotations[MEMBERS_ANNOTATION];
                assert!(format!("{members:?}").contains(&g.node(id).name), "{what}");
                let scores = B * S * S * if wide { 4 } else { dtype.size_bytes() };
                let text = summary.lines.join("\n");
                assert!(text.contains("1 softmaxes"), "{text}");
                assert!(text.contains(&format_bytes(2 * scores as u64)), "{text}");
                let f = feeds(dtype);
                assert_same_bits(&run_cpu(&before, &f), &run_cpu(&g, &f));
                // Idempotent.
                let text = to_text(&g);
                SoftmaxPrologue.run(&mut g).unwrap();
                assert_eq!(to_text(&g), text, "{what}");
            }
        }
    }

    #[test]
    fn a_lone_elementwise_node_becomes_the_prologue() {
        let mut g = masked_attention(DType::F32, false, false);
        let before = g.clone();
        SoftmaxPrologue.run(&mut g).unwrap();
        g.validate().unwrap();
        let id = g
            .node_ids()
            .find(|&id| g.node(id).op_name() == "FusedSoftmax")
            .unwrap();
        // The Add alone: the Mul before it is its input.
        let fs = g.node(id).op.downcast_ref::<FusedSoftmax>().unwrap();
        assert_eq!(fs.prologue().instrs().len(), 3);
        assert_eq!(count(&g, "Add"), 0);
        assert_eq!(count(&g, "Mul"), 1);
        let f = feeds(DType::F32);
        assert_same_bits(&run_cpu(&before, &f), &run_cpu(&g, &f));
    }

    /// The masked scores of [`masked_attention`] (f32, fused), also read by `reader`
    /// (given the scores), or a graph output with `output`.
    fn shared_scores(reader: Option<fn(&mut Graph, Port) -> Port>, output: bool) -> Graph {
        let mut g = masked_attention(DType::F32, false, false);
        let add = g
            .node_ids()
            .find(|&id| g.node(id).op_name() == "Add")
            .unwrap();
        let scores = Port::new(add, 0);
        let mut outputs = g.outputs().to_vec();
        if let Some(reader) = reader {
            outputs.push(reader(&mut g, scores));
        }
        if output {
            outputs.push(scores);
        }
        g.set_outputs(outputs).unwrap();
        Fuse.run(&mut g).unwrap();
        g
    }

    #[test]
    fn an_operand_that_others_read_stays_stored() {
        let exp: fn(&mut Graph, Port) -> Port =
            |g, p| g.add(Unary::new(UnaryKind::Exp), &[p]).unwrap();
        let matmul: fn(&mut Graph, Port) -> Port =
            |g, p| g.add(BatchMatMul::new(false, false), &[p, p]).unwrap();
        for g in [
            // Exp joins the program, which then outputs two values.
            shared_scores(Some(exp), false),
            // A product reads the program's one output too.
            shared_scores(Some(matmul), false),
            shared_scores(None, true),
        ] {
            let mut after = g.clone();
            let summary = SoftmaxPrologue.run(&mut after).unwrap();
            assert!(summary.lines[0].contains(" 0 softmaxes"), "{summary:?}");
            assert_eq!(to_text(&g), to_text(&after));
        }
    }
}
