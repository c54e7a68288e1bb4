//! Widening casts folded into reductions: `Sum(Cast<f32>(x: f16))` becomes
//! `Sum<to=f32>(x)`, which reads the 16-bit tensor and accumulates in f32 as the
//! cast-then-sum did. After AMP this is every bias gradient of an fp16 training
//! graph (TensorFlow's fp16 lists keep Sum and Mean in f32): without the fold, each
//! one writes an f32 copy of an activation-sized gradient, twice its bytes, that stays
//! alive until the sum runs.
//!
//! Only casts that lose nothing ([`widens_exactly`]) fold, so the reduction sees the
//! same values. A cast that something else also reads stays for its other readers; one
//! left unread is removed.

use ampgraph_graph::ops::{widens_exactly, Cast, Reduce};
use ampgraph_graph::{Graph, NodeId};

use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `cast-into-reduce` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct CastIntoReduce;

impl Pass for CastIntoReduce {
    fn name(&self) -> &'static str {
        "cast-into-reduce"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let mut casts: Vec<NodeId> = Vec::new();
        let mut folded = 0usize;
        let ids: Vec<NodeId> = g.node_ids().collect();
        for id in ids {
            let Some(reduce) = g.node(id).op.downcast_ref::<Reduce>() else {
                continue;
            };
            let [x] = g.inputs(id)[..] else {
                continue;
            };
            let Some(cast) = g.node(x.node).op.downcast_ref::<Cast>() else {
                continue;
            };
            let [narrow] = g.inputs(x.node)[..] else {
                continue;
            };
            let from = g.ty(narrow).dtype;
            if from == cast.to || !widens_exactly(from, cast.to) {
                continue;
            }
            let op = reduce.clone().with_output(reduce.output_dtype(cast.to));
            g.set_node(id, Box::new(op), &[narrow])?;
            casts.push(x.node);
            folded += 1;
        }
        let is_output = output_nodes(g);
        let (removed, bytes) = remove_unread(g, casts, &is_output)?;
        let lines = vec![
            format!("cast-into-reduce: {folded} reductions read the narrow tensor a widening Cast fed them"),
            format!(
                "cast-into-reduce: removed {removed} Cast kernels ({} of tensors no longer written, and read back)",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("cast-into-reduce", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run as run_cpu;
    use ampgraph_graph::ops::{Placeholder, ReduceKind, Unary, UnaryKind};
    use ampgraph_graph::{DType, Port, Tensor, TensorType};

    /// `x: from[64, 8] -> Cast<to> -> Sum over axis 0`, with the cast also read by a
    /// Relu output when `shared`.
    fn graph(from: DType, to: DType, shared: bool) -> Graph {
        let mut g = Graph::new();
        let x = g
            .add_node(
                "x",
                Box::new(Placeholder(TensorType::new(from, vec![64, 8]))),
                &[],
            )
            .unwrap();
        let wide = g.add(Cast { to }, &[x.into()]).unwrap();
        let sum = g
            .add(Reduce::new(ReduceKind::Sum, Some(vec![0]), false), &[wide])
            .unwrap();
        let mut outputs = vec![sum];
        if shared {
            outputs.push(g.add(Unary::new(UnaryKind::Relu), &[wide]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn run(g: &Graph, from: DType) -> Vec<Tensor> {
        let values: Vec<f64> = (0..512)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect();
        let x = Tensor::from_f64(from, vec![64, 8], &values).unwrap();
        run_cpu(g, &[("x", x)].into_iter().collect())
    }

    fn sum_input(g: &Graph) -> (Port, Reduce) {
        let id = g.outputs()[0].node;
        let reduce = g.node(id).op.downcast_ref::<Reduce>().unwrap().clone();
        (g.inputs(id)[0], reduce)
    }

    #[test]
    fn a_widening_cast_folds_and_the_sum_is_bit_exact() {
        for from in [DType::F16, DType::BF16] {
            let before = graph(from, DType::F32, false);
            let mut after = before.clone();
            let s = CastIntoReduce.run(&mut after).unwrap();
            after.validate().unwrap();
            let (input, reduce) = sum_input(&after);
            assert_eq!(after.node(input.node).name, "x");
            assert_eq!(reduce.to, Some(DType::F32));
            assert_eq!(after.len(), 2, "the cast is gone");
            assert!(s.lines[1].contains("removed 1 Cast"), "{:?}", s.lines);
            let (want, got) = (run(&before, from), run(&after, from));
            assert_eq!(want[0].ty(), got[0].ty());
            assert_eq!(want[0].to_f64_vec(), got[0].to_f64_vec());
            // Idempotent.
            let mut again = after.clone();
            CastIntoReduce.run(&mut again).unwrap();
            assert_eq!(again.len(), after.len());
        }
    }

    #[test]
    fn a_cast_read_elsewhere_stays_and_narrowing_casts_never_fold() {
        let mut g = graph(DType::F16, DType::F32, true);
        CastIntoReduce.run(&mut g).unwrap();
        assert_eq!(sum_input(&g).1.to, Some(DType::F32));
        assert_eq!(g.len(), 4, "the Relu still reads the cast");
        for (from, to) in [(DType::F32, DType::F16), (DType::F16, DType::BF16)] {
            let mut g = graph(from, to, false);
            CastIntoReduce.run(&mut g).unwrap();
            assert_eq!(sum_input(&g).1.to, None, "{from} -> {to}");
            assert_eq!(g.len(), 3);
        }
    }
}
