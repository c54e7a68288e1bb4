//! A packed attention gradient whose `dqkv`, viewed as the qkv product's `[B S, 3 H D]`
//! output gradient, only a delayed-scaling FP8 cast of it reads (`elementwise-into-fp8`
//! left a [`FusedQuantizeFp8`] loading it as it is, with its column sums, the bias
//! gradient) is cast by the attention's gradient kernels
//! ([`FusedAttentionGradQuantizeFp8`]): they write dq, dk and dv's FP8 copies, the
//! transposed copy and the column sums as they store each tile, so the 16-bit dqkv is
//! no longer written and read back. In the FP8 transformer each block but the first
//! (whose qkv products stay 16-bit) has one: [8192, 2304] bf16, 36 MiB a layer.
//!
//! Only where the CUDA kernels take it: a transposed cast, sequences a multiple of 64
//! long (each block's rows lie in one sequence and its column sums in whole bands of
//! 64 rows), and not causal: the causal dk/dv kernel casting its tiles took more
//! registers than three blocks a multiprocessor allow, and GPT-2's [16, 1024, 12, 64]
//! heads ran 353 us a layer against 258, the cast it saves 44 (H200). Under current
//! scaling the cast's scale reads dqkv's amax first, so the gradient is read twice and
//! stays. Bit-exact on the CPU: the op runs the gradient, then the cast.

use ampgraph_graph::ops::{
    FusedAttentionGrad, FusedAttentionGradQuantizeFp8, FusedQuantizeFp8, Reshape,
};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{read_only_by, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The sequence lengths the fused kernels take: multiples of this.
pub const SEQ_MULTIPLE: usize = 64;

/// The `attention-grad-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionGradIntoFp8;

/// The op computing `cast`'s value from the attention gradient under it, with the
/// Reshape and the gradient it replaces and the cast's scale, where the CUDA kernels
/// take it.
fn fused(g: &Graph, cast: NodeId) -> Option<(FusedAttentionGradQuantizeFp8, [NodeId; 2], Port)> {
    let q = g.node(cast).op.downcast_ref::<FusedQuantizeFp8>()?;
    let [rows, scale] = g.inputs(cast)[..] else {
        return None;
    };
    g.node(rows.node).op.downcast_ref::<Reshape>()?;
    let [dqkv] = g.inputs(rows.node)[..] else {
        return None;
    };
    let grad = g.node(dqkv.node).op.downcast_ref::<FusedAttentionGrad>()?;
    let shape = &g.ty(dqkv).shape;
    let takes = matches!(shape[..], [b, s, 3, h, d] if g.ty(rows).shape == [b * s, 3 * h * d] && s % SEQ_MULTIPLE == 0)
        && q.quantize.transposed
        && !grad.causal;
    let alone = read_only_by(g, rows, cast, 0) && read_only_by(g, dqkv, rows.node, 0);
    if !(takes && alone) {
        return None;
    }
    let op = FusedAttentionGradQuantizeFp8::new(grad.clone(), q.clone()).ok()?;
    Some((op, [rows.node, dqkv.node], scale))
}

impl Pass for AttentionGradIntoFp8 {
    fn name(&self) -> &'static str {
        "attention-grad-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        let nodes: Vec<NodeId> = g.node_ids().collect();
        for cast in nodes {
            let Some((op, [rows, grad], scale)) = fused(g, cast) else {
                continue;
            };
            let mut inputs = g.inputs(grad).to_vec();
            inputs.push(scale);
            bytes += 2 * g.node(grad).outputs()[0].size_bytes() as u64;
            g.set_node(cast, Box::new(op), &inputs)?;
            g.remove_node(rows)?;
            g.remove_node(grad)?;
            folded += 1;
        }
        let lines = vec![format!(
            "attention-grad-into-fp8: {folded} attention gradients cast by their own kernels ({} fewer written and read back)",
            format_bytes(bytes)
        )];
        Ok(summary("attention-grad-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::fused::{Expr, Instr};
    use ampgraph_graph::ops::{FusedAttention, FusedElementwise, QuantizeFp8, Unary, UnaryKind};
    use ampgraph_graph::{DType, Port, Tensor};

    /// The packed attention's gradient over `qkv [1, s, 3, 2, 16]` (bf16, causal as
    /// `causal` says), viewed as `[s, 96]` and cast to E5M2 (transposed as `transposed`
    /// says, column sums where `sums`, a scale of 40), the forward's outputs from the
    /// forward op; with `leak`, a Neg reads dqkv too.
    fn graph(s: usize, transposed: bool, sums: bool, leak: bool, causal: bool) -> Graph {
        let mut g = Graph::new();
        let qkv = g.placeholder("qkv", DType::BF16, [1, s, 3, 2, 16]).unwrap();
        let d_o = g.placeholder("do", DType::BF16, [1, s, 2, 16]).unwrap();
        let forward = FusedAttention {
            scale: 0.25,
            causal,
            key_bias: false,
            packed: true,
            dropout: None,
        };
        let o = g.add_node("attention", Box::new(forward), &[qkv]).unwrap();
        let grad = FusedAttentionGrad {
            scale: 0.25,
            causal,
            key_bias: false,
            packed: true,
            dropout: None,
        };
        let (o, lse) = (Port::new(o, 0), Port::new(o, 1));
        let dqkv = g.add(grad, &[qkv, o, lse, d_o]).unwrap();
        let rows = g.add(Reshape::new([s as i64, 96]), &[dqkv]).unwrap();
        let load = Instr {
            expr: Expr::Input(0),
            ty: g.ty(rows).clone(),
        };
        let mut program = FusedElementwise::new(vec![load], vec![0]).unwrap();
        if sums {
            program = program.with_column_sums(vec![0]).unwrap();
        }
        let q = QuantizeFp8::new(DType::F8E5M2)
            .unwrap()
            .with_transposed(transposed);
        let cast = FusedQuantizeFp8::new(q, program).unwrap();
        let scale = g.scalar(DType::F32, 40.0).unwrap();
        let n = cast.cast_outputs() + usize::from(sums);
        let c = g.add_node("cast", Box::new(cast), &[rows, scale]).unwrap();
        let mut outputs: Vec<Port> = (0..n).map(|k| Port::new(c, k)).collect();
        if leak {
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[dqkv]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds(s: usize) -> std::collections::HashMap<&'static str, Tensor> {
        let wave =
            |n: usize, k: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * k).sin() * 2.0).collect() };
        let qkv = Tensor::from_f64(DType::BF16, [1, s, 3, 2, 16], &wave(s * 96, 0.37)).unwrap();
        let d_o = Tensor::from_f64(DType::BF16, [1, s, 2, 16], &wave(s * 32, 0.61)).unwrap();
        [("qkv", qkv), ("do", d_o)].into_iter().collect()
    }

    #[test]
    fn an_attention_gradient_read_only_by_its_cast_is_cast_by_it_with_the_same_bits() {
        for (transposed_sums, s) in [(true, 64), (false, 128)] {
            let before = graph(s, true, transposed_sums, false, false);
            let mut g = before.clone();
            let summary = AttentionGradIntoFp8.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(summary.lines[0].contains(": 1 attention"), "{summary}");
            let kib = 2 * 2 * s * 96 / 1024;
            assert!(
                summary.lines[0].contains(&format!("({kib}.0 KiB fewer")),
                "{summary}"
            );
            for (op, n) in [
                ("FusedAttentionGrad", 0),
                ("Reshape", 0),
                ("FusedQuantizeFp8", 0),
                ("FusedAttentionGradQuantizeFp8", 1),
            ] {
                assert_eq!(count(&g, op), n, "{op}");
            }
            let (want, got) = (run_cpu(&before, &feeds(s)), run_cpu(&g, &feeds(s)));
            assert_same_bits(&want, &got);
            // Idempotent, and it reads back from a file.
            let mut again = g.clone();
            AttentionGradIntoFp8.run(&mut again).unwrap();
            assert_eq!(again.len(), g.len());
            use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
            let read = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
            assert_same_bits(&got, &run_cpu(&read, &feeds(s)));
        }
    }

    #[test]
    fn a_gradient_something_else_reads_or_the_kernels_do_not_take_stays() {
        // Another reader of dqkv; no transposed copy; a sequence of 40; causal.
        let cases = [
            (64, true, true, false),
            (64, false, false, false),
            (40, true, false, false),
            (64, true, false, true),
        ];
        for (s, transposed, leak, causal) in cases {
            let mut g = graph(s, transposed, true, leak, causal);
            let summary = AttentionGradIntoFp8.run(&mut g).unwrap();
            assert!(
                summary.lines[0].contains(": 0 attention"),
                "s {s} transposed {transposed} leak {leak} causal {causal}: {summary}"
            );
            assert_eq!(count(&g, "FusedAttentionGrad"), 1);
        }
    }
}
