//! A layer's activation computed by the FP8 cast that reads it: a `Unary` whose output
//! only a `QuantizeFp8` reads (delayed scaling's cast) becomes its `activation`, and the
//! cast reads the Unary's input. The activation's 16-bit output, which a kernel of its
//! own wrote and the cast read back, is no longer stored: in the FP8 mlp, each hidden
//! layer's GELU (64 MiB written and read back a step). The cast reads the
//! pre-activation instead, which a training step keeps anyway (GELU's gradient reads
//! it). Under current scaling an `Fp8Scale` reads the activation too and would compute
//! it a second time: the exact GELU's erf twice cost what the stores saved (the mlp's
//! FP8 step 3.750 ms apart, 3.779 folded), so such activations stay (both ops take an
//! `activation`).
//!
//! Bit-exact on the CPU: the ops round the activation to its dtype before they measure
//! and quantise it, as the Unary stored it.

use ampgraph_graph::ops::{QuantizeFp8, Unary};
use ampgraph_graph::Graph;

use crate::rewrite::{cast_alone_reads, fold_into_cast, fp8_casts, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `activation-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ActivationIntoFp8;

impl Pass for ActivationIntoFp8 {
    fn name(&self) -> &'static str {
        "activation-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        for (cast, x, scale) in fp8_casts(g) {
            // The Unary computing what the cast alone reads, or a view of it alone reads
            // (an exported activation over `[B, S, D]` reshaped to the product's rows:
            // the activation of the pre-activation viewed so).
            let Some((y, view)) = cast_alone_reads(g, cast, x) else {
                continue;
            };
            let Some(kind) = g.node(y.node).op.downcast_ref::<Unary>().map(|u| u.kind) else {
                continue;
            };
            let op = g.node(cast).op.downcast_ref::<QuantizeFp8>();
            let Some(op) = op.filter(|q| q.activation.is_none()) else {
                continue;
            };
            let op = op.clone().with_activation(Some(kind));
            bytes += 2 * g.ty(y).size_bytes() as u64;
            fold_into_cast(g, (cast, x, scale), (y.node, view), Box::new(op))?;
            folded += 1;
        }
        let lines = vec![format!(
            "activation-into-fp8: {folded} activations computed by the FP8 cast reading them ({} fewer written and read back)",
            format_bytes(bytes)
        )];
        Ok(summary("activation-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, run as run_cpu};
    use ampgraph_graph::ops::{Fp8Scale, UnaryKind};
    use ampgraph_graph::{DType, Op, Port, Tensor};

    /// `q(gelu(z))` with delayed scaling's given scale, and the gelu's value also read
    /// by `extra` where given (a Neg, or current scaling's `Fp8Scale`); z `[8, 16]`, or
    /// `[2, 4, 16]` with the gelu's value `viewed` as `[8, 16]` (an exported model's).
    fn graph(extra: Option<Box<dyn Op>>, viewed: bool) -> Graph {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::BF16, z_shape(viewed)).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let mut a = g.add(Unary::new(gelu), &[z]).unwrap();
        if viewed {
            a = g.reshape(a, [8, 16]).unwrap();
        }
        let scale = g.scalar(DType::F32, 3.0).unwrap();
        let op = QuantizeFp8::new(DType::F8E4M3)
            .unwrap()
            .with_transposed(true);
        let q = g.add_node("q", Box::new(op), &[a, scale]).unwrap();
        let mut outputs = vec![Port::new(q, 0), Port::new(q, 1), Port::new(q, 2)];
        if let Some(op) = extra {
            outputs.push(Port::new(g.add_node("extra", op, &[a]).unwrap(), 0));
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn z_shape(viewed: bool) -> Vec<usize> {
        if viewed {
            vec![2, 4, 16]
        } else {
            vec![8, 16]
        }
    }

    #[test]
    fn an_activation_read_only_by_an_fp8_cast_folds_into_it_with_the_same_bits() {
        for viewed in [false, true] {
            let before = graph(None, viewed);
            let mut g = before.clone();
            let summary = ActivationIntoFp8.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(summary.lines[0].contains(": 1 activations"), "{summary}");
            assert!(g.node_ids().all(|id| !g.node(id).op.is::<Unary>()));
            let q = g.find("q").unwrap();
            let op = g.node(q).op.downcast_ref::<QuantizeFp8>().unwrap();
            assert!(op.activation.is_some());
            let z: Vec<f64> = (0..128).map(|i| (i as f64 * 0.37).sin() * 4.0).collect();
            let z = Tensor::from_f64(DType::BF16, z_shape(viewed), &z).unwrap();
            let feeds = [("z", z)].into_iter().collect();
            assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
            // The op reads back from a file with its activation.
            use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
            let again = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
            assert_same_bits(&run_cpu(&g, &feeds), &run_cpu(&again, &feeds));
        }
    }

    #[test]
    fn an_activation_something_else_reads_stays() {
        let neg: Box<dyn Op> = Box::new(Unary::new(UnaryKind::Neg));
        let scale: Box<dyn Op> = Box::new(Fp8Scale::new(DType::F8E4M3, 0).unwrap());
        for extra in [neg, scale] {
            let mut g = graph(Some(extra), false);
            let summary = ActivationIntoFp8.run(&mut g).unwrap();
            assert!(summary.lines[0].contains(": 0 activations"), "{summary}");
            assert!(g.node_ids().any(|id| g.node(id).op.is::<Unary>()));
        }
    }
}
