//! Current FP8 scaling's amax measured by the kernel that computes the tensor: an
//! `Fp8Scale(x)` whose `x` a `FusedElementwise` node or a lone elementwise node
//! produces becomes `Fp8ScaleOfAmax` of that node's new amax output
//! ([`FusedElementwise::with_amaxes`](ampgraph_graph::ops::FusedElementwise::with_amaxes)).
//! The kernel folds `max |x|` as it stores `x`, so the scale no longer reads `x`
//! back from memory in a pass of its own (current
//! scaling's one extra read per tensor: in the FP8 mlp, each hidden layer's GELU
//! output and GELU gradient, 64 MiB each). The cast still reads `x`: it needs the
//! scale first.
//!
//! Bit-exact: the amax is of the value as stored, rounded to its dtype, as `Fp8Scale`
//! measures the tensor. An `Fp8Scale` with an `activation` (it applies a Unary
//! `activation-into-fp8` folded) stays, and so does the scale of a weight's 16-bit
//! cast, which executors keep between steps rather than run.

use ampgraph_graph::ops::{Fp8Scale, Fp8ScaleOfAmax};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{is_variable_cast, summary};
use crate::sum_into_elementwise::producer_program;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `amax-into-elementwise` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct AmaxIntoElementwise;

impl Pass for AmaxIntoElementwise {
    fn name(&self) -> &'static str {
        "amax-into-elementwise"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let scales: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| {
                (g.node(id).op.downcast_ref::<Fp8Scale>()).is_some_and(|s| s.activation.is_none())
            })
            .collect();
        let (mut folded, mut bytes) = (0usize, 0u64);
        for id in scales {
            let Some(scale) = g.node(id).op.downcast_ref::<Fp8Scale>().cloned() else {
                continue;
            };
            let [x] = g.inputs(id)[..] else {
                continue;
            };
            // A Variable's 16-bit cast stays a Cast: executors keep it between steps,
            // written by the variable's update (`cast-into-update`).
            if is_variable_cast(g, x.node) {
                continue;
            }
            // Each fold changes the producer: a fresh adjacency reads its inputs.
            let adj = g.adjacency();
            let Some((op, inputs)) = producer_program(g, &adj, x.node) else {
                continue;
            };
            // The program value `x` is.
            let Some(&v) = op.outputs().get(x.index) else {
                continue;
            };
            let first_amax = op.outputs().len() + op.column_sums().len();
            // A value measured already (its other format's scale) is read again.
            let k = match op.amaxes().iter().position(|&a| a == v) {
                Some(k) => k,
                None => {
                    let mut amaxes = op.amaxes().to_vec();
                    amaxes.push(v);
                    let k = amaxes.len() - 1;
                    let op = op.with_amaxes(amaxes).map_err(|e| {
                        PassError::Rewrite(format!("'{}': {e}", g.node(x.node).name))
                    })?;
                    g.set_node(x.node, Box::new(op), &inputs)?;
                    k
                }
            };
            let amax = Port::new(x.node, first_amax + k);
            g.set_node(id, Box::new(Fp8ScaleOfAmax { scale }), &[amax])?;
            bytes += g.ty(x).size_bytes() as u64;
            folded += 1;
        }
        let lines = vec![format!(
            "amax-into-elementwise: {folded} FP8 scales take the amax of the kernel computing their tensor ({} no longer read back)",
            format_bytes(bytes)
        )];
        Ok(summary("amax-into-elementwise", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::{Cast, FusedElementwise, QuantizeFp8, Unary, UnaryKind, Variable};
    use ampgraph_graph::{DType, Op, Tensor, TensorType};

    /// `q(a)` under current scaling, in E4M3 and (when `both`) in E5M2 too, of `a` a
    /// lone GELU or (when `fused`) the program `fuse` makes of a GELU and a Neg.
    fn graph(fused: bool, both: bool) -> Graph {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::BF16, [8, 16]).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let mut a = g.add(Unary::new(gelu), &[z]).unwrap();
        if fused {
            a = g.add(Unary::new(UnaryKind::Neg), &[a]).unwrap();
        }
        let mut outputs = Vec::new();
        let formats: &[DType] = if both {
            &[DType::F8E4M3, DType::F8E5M2]
        } else {
            &[DType::F8E4M3]
        };
        for &format in formats {
            let scale: Box<dyn Op> = Box::new(Fp8Scale::new(format, 0).unwrap());
            let s = g.add_node(format!("scale_{format}"), scale, &[a]).unwrap();
            let q = g
                .add(QuantizeFp8::new(format).unwrap(), &[a, s.into()])
                .unwrap();
            outputs.extend([q, Port::new(s, 1)]);
        }
        g.set_outputs(outputs).unwrap();
        if fused {
            crate::fuse::Fuse.run(&mut g).unwrap();
            assert_eq!(count(&g, "FusedElementwise"), 1);
        }
        g
    }

    fn feeds(scale: f64) -> std::collections::HashMap<&'static str, Tensor> {
        let z: Vec<f64> = (0..128).map(|i| (i as f64 * 0.37).sin() * scale).collect();
        [("z", Tensor::from_f64(DType::BF16, [8, 16], &z).unwrap())]
            .into_iter()
            .collect()
    }

    #[test]
    fn scales_read_the_amax_their_producer_measured_with_the_same_bits() {
        for (fused, both) in [(false, false), (false, true), (true, false)] {
            let before = graph(fused, both);
            let mut g = before.clone();
            let summary = AmaxIntoElementwise.run(&mut g).unwrap();
            g.validate().unwrap();
            let n = if both { 2 } else { 1 };
            assert!(
                summary.lines[0].contains(&format!(": {n} FP8 scales")),
                "{summary}"
            );
            assert_eq!(count(&g, "Fp8Scale"), 0);
            assert_eq!(count(&g, "Fp8ScaleOfAmax"), n);
            // Both formats read one amax.
            let program = g
                .node_ids()
                .find(|&id| g.node(id).op.is::<FusedElementwise>());
            let program = g
                .node(program.unwrap())
                .op
                .downcast_ref::<FusedElementwise>();
            assert_eq!(program.unwrap().amaxes().len(), 1);
            // Ordinary values, zeros (amax 0: scale 1), values near bf16's largest,
            // and a NaN, which makes the scales NaN.
            for s in [4.0, 0.0, 1e38] {
                assert_same_bits(&run_cpu(&before, &feeds(s)), &run_cpu(&g, &feeds(s)));
            }
            let mut nan = feeds(1.0);
            let mut z = nan["z"].to_f64_vec();
            z[5] = f64::NAN;
            nan.insert("z", Tensor::from_f64(DType::BF16, [8, 16], &z).unwrap());
            let (want, got) = (run_cpu(&before, &nan), run_cpu(&g, &nan));
            assert!(got[1].to_f64_vec()[0].is_nan());
            assert_same_bits(&want, &got);
            // Idempotent, and the program reads back from a file with its amax.
            let mut again = g.clone();
            AmaxIntoElementwise.run(&mut again).unwrap();
            assert_eq!(again.len(), g.len());
            use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
            let read = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
            assert_same_bits(&run_cpu(&g, &feeds(4.0)), &run_cpu(&read, &feeds(4.0)));
        }
    }

    #[test]
    fn scales_of_other_tensors_of_weight_copies_or_with_an_activation_stay() {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::BF16, [8, 16]).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let with_activation = Fp8Scale::new(DType::F8E4M3, 0)
            .unwrap()
            .with_activation(Some(gelu));
        let a = g.add(with_activation, &[z]).unwrap();
        let b = g
            .add(Fp8Scale::new(DType::F8E4M3, 0).unwrap(), &[z])
            .unwrap();
        // A weight's bf16 copy: a Cast of a Variable.
        let w = Variable::new(TensorType::new(DType::F32, vec![16, 8]));
        let w = g.add_node("w", Box::new(w), &[]).unwrap();
        let copy = g.add(Cast { to: DType::BF16 }, &[w.into()]).unwrap();
        let c = g
            .add(Fp8Scale::new(DType::F8E4M3, 0).unwrap(), &[copy])
            .unwrap();
        g.set_outputs(vec![a, b, c]).unwrap();
        let summary = AmaxIntoElementwise.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 FP8 scales"), "{summary}");
        assert_eq!((count(&g, "Fp8Scale"), count(&g, "Cast")), (3, 1));
    }
}
