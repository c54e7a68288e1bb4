//! A layer norm's gradient whose dx a delayed-scaling FP8 cast reads casts it as it
//! stores it ([`LayerNormGradQuantizeFp8`]): dx is no longer read back to be cast. It
//! stays an output for its other readers (in a pre-LN transformer the residual branch
//! and the norm before). In GPT-2 each block's first norm gives the residual gradient
//! the FP8 gradient products of the block before read: 12 casts a step.
//!
//! Runs after `norm-grad-epilogue`, which gives the gradient the Add of the residual
//! gradient (the cast reads that sum). Only where the CUDA kernel takes it (as
//! `norm-into-fp8`'s: rows of at most 1024 values of a matrix with sides multiples of
//! 8) and where the scale is a variable (delayed scaling's: a current scale is
//! computed from dx itself). Bit-exact on the CPU: the op runs the gradient, then the
//! cast.

use ampgraph_graph::ops::{LayerNormGrad, LayerNormGradQuantizeFp8, QuantizeFp8, Variable};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::norm_into_fp8::kernel_takes;
use crate::rewrite::{fp8_casts, redirect, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `norm-grad-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct NormGradIntoFp8;

/// The cast `cast` (a QuantizeFp8 of `x` by `scale`) of the dx of the LayerNormGrad
/// computing `x`, where the CUDA kernel takes it and the scale is a variable.
fn fused(g: &Graph, cast: NodeId, x: Port, scale: Port) -> Option<LayerNormGradQuantizeFp8> {
    let q = g.node(cast).op.downcast_ref::<QuantizeFp8>()?;
    let grad = g.node(x.node).op.downcast_ref::<LayerNormGrad>()?;
    let delayed = g.node(scale.node).op.is::<Variable>();
    if !(x.index == 0 && delayed && kernel_takes(g, x, grad.axis)) {
        return None;
    }
    LayerNormGradQuantizeFp8::new(grad.clone(), q.clone()).ok()
}

impl Pass for NormGradIntoFp8 {
    fn name(&self) -> &'static str {
        "norm-grad-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        for (cast, x, scale) in fp8_casts(g) {
            let Some(op) = fused(g, cast, x, scale) else {
                continue;
            };
            // The gradient's node gives the cast's outputs after its own.
            let first = g.node(x.node).outputs().len();
            let mut inputs = g.inputs(x.node).to_vec();
            inputs.push(scale);
            bytes += g.ty(x).size_bytes() as u64;
            g.set_node(x.node, Box::new(op), &inputs)?;
            for k in 0..g.node(cast).outputs().len() {
                redirect(g, Port::new(cast, k), Port::new(x.node, first + k))?;
            }
            g.remove_node(cast)?;
            folded += 1;
        }
        let lines = vec![format!(
            "norm-grad-into-fp8: {folded} layer norm gradients cast to FP8 as they are stored ({} fewer read back)",
            format_bytes(bytes)
        )];
        Ok(summary("norm-grad-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_grouped_keeps_bits, count, run as run_cpu, sine};
    use ampgraph_graph::ops::{NormGradEpilogue, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};
    use std::collections::HashMap;

    /// `q(dx)` of a bf16 LayerNormGrad adding a residual and summing dx's columns (as
    /// `norm-grad-epilogue` leaves a pre-LN block's first norm), E5M2 and transposed
    /// as a gradient product reads it (a matrix's), its scale a variable (delayed scaling) or, with
    /// `constant_scale`, a constant; a Neg reads dx too (the residual branch); `shape`
    /// x's.
    fn graph(shape: &[usize], constant_scale: bool) -> (Graph, HashMap<&'static str, Tensor>) {
        let mut g = Graph::new();
        let mut feeds = HashMap::new();
        let len = *shape.last().unwrap();
        let bf16 = |t: Tensor| t.cast(DType::BF16);
        for (name, step) in [("x", 0.37), ("dy", 0.23), ("residual", 0.11)] {
            g.placeholder(name, DType::BF16, shape.to_vec()).unwrap();
            feeds.insert(name, bf16(sine(shape, step)));
        }
        let port = |g: &Graph, name: &str| Port::new(g.find(name).unwrap(), 0);
        let ramp: Vec<f64> = (0..len).map(|j| 0.5 + 0.01 * j as f64).collect();
        let gamma = g
            .constant(Tensor::from_f64(DType::BF16, [len], &ramp).unwrap())
            .unwrap();
        let grad = LayerNormGrad {
            epilogue: NormGradEpilogue {
                residual: true,
                sum_dx: true,
                sum_residual: false,
            },
            ..LayerNormGrad::new(-1, 1e-5)
        };
        let inputs = [port(&g, "x"), gamma, port(&g, "dy"), port(&g, "residual")];
        let dx = g.add(grad, &inputs).unwrap();
        // A scale that saturates the largest gradients.
        let scale = if constant_scale {
            g.scalar(DType::F32, 3000.0).unwrap()
        } else {
            feeds.insert("scale", Tensor::scalar(DType::F32, 3000.0));
            g.variable("scale", DType::F32, []).unwrap()
        };
        let q = QuantizeFp8::new(DType::F8E5M2)
            .unwrap()
            .with_transposed(shape.len() == 2);
        let q = g.add_node("q", Box::new(q), &[dx, scale]).unwrap();
        let neg = g.add(Unary::new(UnaryKind::Neg), &[dx]).unwrap();
        let cast_outputs = if shape.len() == 2 { 3 } else { 2 };
        let mut outputs: Vec<Port> = (0..cast_outputs).map(|k| Port::new(q, k)).collect();
        outputs.extend((1..4).map(|k| Port::new(dx.node, k)));
        outputs.push(neg);
        g.set_outputs(outputs).unwrap();
        (g, feeds)
    }

    #[test]
    fn a_gradient_cast_by_a_delayed_scale_casts_as_it_stores_with_the_same_bits() {
        let (before, feeds) = graph(&[16, 24], false);
        let want = run_cpu(&before, &feeds);
        let mut g = before.clone();
        let summary = NormGradIntoFp8.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(
            summary.lines[0].contains(": 1 layer norm gradients"),
            "{summary}"
        );
        assert!(summary.lines[0].contains("(768 B fewer"), "{summary}");
        assert_eq!(count(&g, "QuantizeFp8"), 0);
        assert_eq!(count(&g, "LayerNormGrad"), 0);
        assert_eq!(count(&g, "LayerNormGradQuantizeFp8"), 1);
        // The same bits, through the file format too; idempotent.
        assert_grouped_keeps_bits(&NormGradIntoFp8, &mut g, &feeds, &want);
    }

    #[test]
    fn a_current_scale_or_a_shape_the_kernel_does_not_take_leaves_the_cast() {
        // A constant scale (not delayed scaling's variable); sides not multiples of 8;
        // rows longer than a warp holds; not a matrix.
        let cases: [(&[usize], bool); 4] = [
            (&[16, 24], true),
            (&[12, 24], false),
            (&[8, crate::norm_into_fp8::MAX_ROW + 8], false),
            (&[2, 8, 24], false),
        ];
        for (shape, constant_scale) in cases {
            let (mut g, _) = graph(shape, constant_scale);
            let summary = NormGradIntoFp8.run(&mut g).unwrap();
            assert!(
                summary.lines[0].contains(": 0 layer norm"),
                "{shape:?}: {summary}"
            );
            assert_eq!(count(&g, "QuantizeFp8"), 1, "{shape:?}");
        }
    }
}
