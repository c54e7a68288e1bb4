//! An attention whose output, viewed as the out-projection's `[B S, H D]` input, a
//! delayed-scaling FP8 cast reads casts it as it stores it
//! ([`FusedAttentionQuantizeFp8`]): its forward kernel writes the FP8 copies beside
//! `o`, so `o` is no longer read back to be cast. `o` stays an output (the attention's
//! gradient reads it). In the FP8 transformer each block's attention output feeds its
//! FP8 out-projection: [8192, 768] a block, the cast-transpose's 7.7 us.
//!
//! Only where the CUDA kernel takes it: a transposed cast (no activation) by a
//! variable's scale (delayed scaling's: a current scale is computed from the output
//! itself), sequences a multiple of 64 long, not causal (as `attention-grad-into-fp8`).
//! Bit-exact on the CPU: the op runs the attention, then the cast.

use ampgraph_graph::ops::Variable;
use ampgraph_graph::ops::{FusedAttention, FusedAttentionQuantizeFp8, QuantizeFp8, Reshape};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::attention_grad_into_fp8::SEQ_MULTIPLE;
use crate::rewrite::{fp8_casts, read_only_by, redirect, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `attention-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionIntoFp8;

/// The attention computing `cast`'s `rows` (a Reshape of its output) with the cast
/// folded in, where the CUDA kernel takes it: the attention's node and the op.
fn fused(
    g: &Graph,
    cast: NodeId,
    rows: Port,
    scale: Port,
) -> Option<(NodeId, FusedAttentionQuantizeFp8)> {
    let q = g.node(cast).op.downcast_ref::<QuantizeFp8>()?;
    g.node(rows.node).op.downcast_ref::<Reshape>()?;
    let [o] = g.inputs(rows.node)[..] else {
        return None;
    };
    let attention = g.node(o.node).op.downcast_ref::<FusedAttention>()?;
    let takes = matches!(g.ty(o).shape[..], [b, s, h, d] if g.ty(rows).shape == [b * s, h * d] && s % SEQ_MULTIPLE == 0)
        && o.index == 0
        && q.transposed
        && !attention.causal;
    let delayed = g.node(scale.node).op.is::<Variable>();
    if !(takes && delayed && read_only_by(g, rows, cast, 0)) {
        return None;
    }
    let op = FusedAttentionQuantizeFp8::new(attention.clone(), q.clone()).ok()?;
    Some((o.node, op))
}

impl Pass for AttentionIntoFp8 {
    fn name(&self) -> &'static str {
        "attention-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        for (cast, rows, scale) in fp8_casts(g) {
            let Some((attention, op)) = fused(g, cast, rows, scale) else {
                continue;
            };
            // The attention's node gives the cast's outputs after its own two.
            let mut inputs = g.inputs(attention).to_vec();
            inputs.push(scale);
            bytes += g.ty(rows).size_bytes() as u64;
            g.set_node(attention, Box::new(op), &inputs)?;
            for k in 0..g.node(cast).outputs().len() {
                redirect(g, Port::new(cast, k), Port::new(attention, 2 + k))?;
            }
            g.remove_node(cast)?;
            g.remove_node(rows.node)?;
            folded += 1;
        }
        let lines = vec![format!(
            "attention-into-fp8: {folded} attention outputs cast to FP8 as they are stored ({} fewer read back)",
            format_bytes(bytes)
        )];
        Ok(summary("attention-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::{Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    /// The packed attention over `qkv [1, s, 3, 2, 16]` (bf16, causal as `causal`
    /// says), its output viewed as `[s, 32]` and cast to E4M3 (transposed as
    /// `transposed` says) by a variable scale (a constant where `constant`); a Neg
    /// reads `o` too (as the gradient would).
    fn graph(s: usize, transposed: bool, causal: bool, constant: bool) -> Graph {
        let mut g = Graph::new();
        let qkv = g.placeholder("qkv", DType::BF16, [1, s, 3, 2, 16]).unwrap();
        let attention = FusedAttention {
            scale: 0.25,
            causal,
            key_bias: false,
            packed: true,
            dropout: None,
        };
        let o = g.add(attention, &[qkv]).unwrap();
        let rows = g.add(Reshape::new([s as i64, 32]), &[o]).unwrap();
        let scale = if constant {
            g.scalar(DType::F32, 40.0).unwrap()
        } else {
            g.variable("scale", DType::F32, []).unwrap()
        };
        let q = QuantizeFp8::new(DType::F8E4M3)
            .unwrap()
            .with_transposed(transposed);
        let n = 2 + usize::from(transposed);
        let c = g.add_node("cast", Box::new(q), &[rows, scale]).unwrap();
        let mut outputs: Vec<Port> = (0..n).map(|k| Port::new(c, k)).collect();
        outputs.push(g.add(Unary::new(UnaryKind::Neg), &[o]).unwrap());
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds(s: usize) -> std::collections::HashMap<&'static str, Tensor> {
        let qkv: Vec<f64> = (0..s * 96).map(|i| (i as f64 * 0.37).sin() * 2.0).collect();
        let qkv = Tensor::from_f64(DType::BF16, [1, s, 3, 2, 16], &qkv).unwrap();
        [("qkv", qkv), ("scale", Tensor::scalar(DType::F32, 40.0))]
            .into_iter()
            .collect()
    }

    #[test]
    fn an_attention_output_cast_by_a_delayed_scale_is_cast_by_the_attention_with_the_same_bits() {
        for s in [64, 128] {
            let before = graph(s, true, false, false);
            let mut g = before.clone();
            let summary = AttentionIntoFp8.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(summary.lines[0].contains(": 1 attention"), "{summary}");
            let kib = 2 * s * 32 / 1024;
            assert!(
                summary.lines[0].contains(&format!("({kib}.0 KiB fewer")),
                "{summary}"
            );
            for (op, n) in [
                ("FusedAttention", 0),
                ("Reshape", 0),
                ("QuantizeFp8", 0),
                ("FusedAttentionQuantizeFp8", 1),
            ] {
                assert_eq!(count(&g, op), n, "{op}");
            }
            let (want, got) = (run_cpu(&before, &feeds(s)), run_cpu(&g, &feeds(s)));
            assert_same_bits(&want, &got);
            // Idempotent, and it reads back from a file.
            let mut again = g.clone();
            AttentionIntoFp8.run(&mut again).unwrap();
            assert_eq!(again.len(), g.len());
            use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
            let read = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
            assert_same_bits(&got, &run_cpu(&read, &feeds(s)));
        }
    }

    #[test]
    fn an_output_the_kernel_does_not_cast_stays() {
        // No transposed copy; causal; a sequence of 40; a constant (not delayed) scale.
        let cases = [
            (64, false, false, false),
            (64, true, true, false),
            (40, true, false, false),
            (64, true, false, true),
        ];
        for (s, transposed, causal, constant) in cases {
            let mut g = graph(s, transposed, causal, constant);
            let summary = AttentionIntoFp8.run(&mut g).unwrap();
            assert!(
                summary.lines[0].contains(": 0 attention"),
                "s {s} transposed {transposed} causal {causal} constant {constant}: {summary}"
            );
            assert_eq!(count(&g, "FusedAttention"), 1);
        }
    }
}
