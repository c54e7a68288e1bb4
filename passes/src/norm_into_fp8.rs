//! A layer norm whose output only a delayed-scaling FP8 cast reads is computed by that
//! cast ([`LayerNormQuantizeFp8`]): one kernel normalises the rows and writes their
//! FP8 copies, so the 16-bit normalised rows are no longer written and read back. In
//! a pre-LN transformer with FP8 products each block's two norms feed its qkv and
//! feed-forward products and nothing else (their gradients read the norm's input, the
//! weight gradients the FP8 copies): GPT-2 124M's 23 such norms, 1.1 GiB a step.
//!
//! Only where the CUDA kernel takes it: a norm over the last axis of a matrix whose
//! rows hold at most [`MAX_ROW`] values (a warp holds a row in registers) and whose
//! sides are multiples of 8 (the cast's 8-byte stores). Under current scaling an
//! `Fp8Scale` reads the norm's output too, so it stays. Bit-exact on the CPU: the op
//! runs the norm, then the cast.

use ampgraph_graph::ops::{LayerNorm, LayerNormQuantizeFp8, QuantizeFp8};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{cast_alone_reads, fold_into_cast, fp8_casts, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The longest row the fused kernel normalises (a warp's registers hold it).
pub const MAX_ROW: usize = 1024;

/// The `norm-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct NormIntoFp8;

/// Whether the fused kernels take the rows of the matrix `x` normalised along `axis`
/// (this pass's and `norm-grad-into-fp8`'s).
pub(crate) fn kernel_takes(g: &Graph, x: Port, axis: i64) -> bool {
    let [rows, len] = g.ty(x).shape[..] else {
        return false;
    };
    matches!(axis, -1 | 1) && len <= MAX_ROW && rows % 8 == 0 && len % 8 == 0
}

/// The cast `cast` (a QuantizeFp8 of `x`) of the LayerNorm computing `x`, or computing
/// what `x` views as rows (an exported norm over `[B, S, D]`), where the CUDA kernel
/// takes it and the cast alone reads `x`; with the view, if any.
fn fused(
    g: &Graph,
    cast: NodeId,
    x: Port,
) -> Option<(LayerNormQuantizeFp8, (NodeId, Option<NodeId>))> {
    let q = g.node(cast).op.downcast_ref::<QuantizeFp8>()?;
    let (y, view) = cast_alone_reads(g, cast, x)?;
    let norm = g.node(y.node).op.downcast_ref::<LayerNorm>()?;
    // Over the last axis, whose rows the view keeps whole.
    let last = norm.axis == -1 || norm.axis + 1 == g.ty(y).rank() as i64;
    let rows_kept = g.ty(y).shape.last() == g.ty(x).shape.last();
    let over_rows = view.is_none() || (last && rows_kept);
    let axis = if view.is_some() { -1 } else { norm.axis };
    if !(over_rows && kernel_takes(g, x, axis)) {
        return None;
    }
    let norm = LayerNorm {
        axis,
        ..norm.clone()
    };
    Some((
        LayerNormQuantizeFp8::new(norm, q.clone()).ok()?,
        (y.node, view),
    ))
}

impl Pass for NormIntoFp8 {
    fn name(&self) -> &'static str {
        "norm-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        for (id, x, scale) in fp8_casts(g) {
            let Some((op, norm)) = fused(g, id, x) else {
                continue;
            };
            bytes += 2 * g.ty(x).size_bytes() as u64;
            fold_into_cast(g, (id, x, scale), norm, Box::new(op))?;
            folded += 1;
        }
        let lines = vec![format!(
            "norm-into-fp8: {folded} layer norms computed by the FP8 cast reading them ({} fewer written and read back)",
            format_bytes(bytes)
        )];
        Ok(summary("norm-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::{Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    /// `q(layer_norm(x))` (E4M3, transposed as `transposed` says, a given scale), the
    /// norm reading bf16 x with f32 parameters and storing bf16 as AMP leaves it; with
    /// `leak`, a Neg reads the normalised rows too; `shape` x's, the normalised value
    /// viewed as rows of its last axis where it is not a matrix (an exported model's).
    fn graph(leak: bool, shape: &[usize], transposed: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::BF16, shape.to_vec()).unwrap();
        let len = *shape.last().unwrap();
        let ramp = |k: f64| -> Vec<f64> { (0..len).map(|j| k + 0.01 * j as f64).collect() };
        let gamma = g
            .constant(Tensor::from_f64(DType::F32, [len], &ramp(0.5)).unwrap())
            .unwrap();
        let beta = g
            .constant(Tensor::from_f64(DType::F32, [len], &ramp(-0.2)).unwrap())
            .unwrap();
        let norm = LayerNorm {
            to: Some(DType::BF16),
            ..LayerNorm::default()
        };
        let mut y = g.add(norm, &[x, gamma, beta]).unwrap();
        if shape.len() > 2 {
            y = g.reshape(y, [-1, len as i64]).unwrap();
        }
        let scale = g.scalar(DType::F32, 40.0).unwrap();
        let q = QuantizeFp8::new(DType::F8E4M3)
            .unwrap()
            .with_transposed(transposed);
        let q = g.add_node("q", Box::new(q), &[y, scale]).unwrap();
        let mut outputs = vec![Port::new(q, 0), Port::new(q, 1)];
        outputs.extend(transposed.then(|| Port::new(q, 2)));
        if leak {
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[y]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds(shape: &[usize]) -> std::collections::HashMap<&'static str, Tensor> {
        let n: usize = shape.iter().product();
        // Rows of different means and spreads, some values far out (saturating at
        // the scale of 40).
        let x: Vec<f64> = (0..n)
            .map(|i| (i as f64 * 0.37).sin() * (1.0 + (i % 7) as f64) + (i / 24) as f64)
            .collect();
        [(
            "x",
            Tensor::from_f64(DType::BF16, shape.to_vec(), &x).unwrap(),
        )]
        .into_iter()
        .collect()
    }

    #[test]
    fn a_norm_read_only_by_its_cast_is_computed_by_it_with_the_same_bits() {
        for (transposed, shape) in [
            (true, &[16, 24][..]),
            (false, &[16, 24]),
            (true, &[2, 8, 24]),
        ] {
            let before = graph(false, shape, transposed);
            let mut g = before.clone();
            let summary = NormIntoFp8.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(summary.lines[0].contains(": 1 layer norms"), "{summary}");
            assert!(summary.lines[0].contains("(1.5 KiB fewer"), "{summary}");
            assert_eq!(count(&g, "LayerNorm"), 0);
            assert_eq!(count(&g, "LayerNormQuantizeFp8"), 1);
            let (want, got) = (run_cpu(&before, &feeds(shape)), run_cpu(&g, &feeds(shape)));
            assert_same_bits(&want, &got);
            // Idempotent, and it reads back from a file.
            let mut again = g.clone();
            NormIntoFp8.run(&mut again).unwrap();
            assert_eq!(again.len(), g.len());
            use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
            let read = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
            assert_same_bits(&got, &run_cpu(&read, &feeds(shape)));
        }
    }

    #[test]
    fn a_norm_something_else_reads_or_the_kernel_does_not_take_stays() {
        // Another reader; sides not multiples of 8; rows longer than a warp holds;
        // not a matrix.
        let cases: [(bool, &[usize]); 5] = [
            (true, &[16, 24]),
            (false, &[16, 20]),
            (false, &[12, 24]),
            (false, &[8, MAX_ROW + 8]),
            (true, &[2, 8, 24]),
        ];
        for (leak, shape) in cases {
            let mut g = graph(leak, shape, true);
            let summary = NormIntoFp8.run(&mut g).unwrap();
            assert!(
                summary.lines[0].contains(": 0 layer norms"),
                "{shape:?}: {summary}"
            );
            assert_eq!(count(&g, "LayerNorm"), 1);
        }
    }
}
