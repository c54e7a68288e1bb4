//! Layer-norm gradients take the Add that follows them. In a pre-LN transformer's
//! backward pass each `LayerNormGrad`'s dx is added to the gradient arriving along the
//! residual branch, and that sum's column sums are the bias gradient of the product
//! that fed the residual. This pass gives the LayerNormGrad the Add (and the Add's
//! column sums, taken there by `sum-into-elementwise`) as its epilogue
//! ([`NormGradEpilogue`]): one kernel computes dx, adds the residual gradient and
//! sums the columns with dgamma and dbeta, so dx is no longer written and read back
//! and the Add's kernel goes.
//!
//! The Add must read dx (output 0, read by nothing else, no graph output) and another
//! tensor of its type that does not depend on the LayerNormGrad. It is a lone `Add`
//! or a fused program that is only that Add. A column sum of dx before the Add has no
//! place in the epilogue: such an Add stays. The fused op rounds dx to its dtype
//! before adding, as the Add read it, so the result is bit-exact on the CPU.

use ampgraph_graph::ops::fused::{ElementOp, Expr};
use ampgraph_graph::ops::{Binary, BinaryKind, FusedElementwise, LayerNormGrad, NormGradEpilogue};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::reachable_from;
use crate::rewrite::{output_nodes, read_only_by, remove_unread, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `norm-grad-epilogue` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct NormGradEpilogueFusion;

/// What an Add node's column-sum output sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Summed {
    /// Its input `k`.
    Input(usize),
    /// Its result.
    Result,
}

/// The two operands of `id` when it is an Add of two tensors of its own type, and what
/// its column-sum outputs (ports 1, 2, ...) sum.
fn as_add(g: &Graph, id: NodeId) -> Option<([Port; 2], Vec<Summed>)> {
    let node = g.node(id);
    let [a, b] = g.inputs(id)[..] else {
        return None;
    };
    let ty = node.outputs().first()?;
    if g.ty(a) != ty || g.ty(b) != ty {
        return None;
    }
    if node
        .op
        .downcast_ref::<Binary>()
        .is_some_and(|op| op.kind == BinaryKind::Add)
    {
        return Some(([a, b], Vec::new()));
    }
    let f = node.op.downcast_ref::<FusedElementwise>()?;
    let add = ElementOp::Binary(BinaryKind::Add);
    let only_an_add = matches!(
        f.instrs(),
        [x, y, sum] if x.expr == Expr::Input(0)
            && y.expr == Expr::Input(1)
            && sum.expr == Expr::Apply(add, vec![0, 1])
    );
    if !only_an_add || f.outputs() != [2] {
        return None;
    }
    let summed = f.column_sums().iter().map(|&v| match v {
        2 => Some(Summed::Result),
        k @ (0 | 1) => Some(Summed::Input(k)),
        _ => None,
    });
    Some(([a, b], summed.collect::<Option<Vec<_>>>()?))
}

/// The LayerNormGrad (without an epilogue) whose dx is operand `side` of the Add
/// `add`, read by nothing else and not a graph output.
fn norm_grad_operand(g: &Graph, add: NodeId, dx: Port, side: usize) -> Option<&LayerNormGrad> {
    let ln = g.node(dx.node).op.downcast_ref::<LayerNormGrad>()?;
    let ok = dx.index == 0
        && ln.epilogue == NormGradEpilogue::default()
        && read_only_by(g, dx, add, side);
    ok.then_some(ln)
}

impl Pass for NormGradEpilogueFusion {
    fn name(&self) -> &'static str {
        "norm-grad-epilogue"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let (mut fused, mut sums, mut bytes) = (0usize, 0usize, 0usize);
        let mut stale = Vec::new();
        let adds: Vec<NodeId> = g.node_ids().filter(|&id| !is_output[id.index()]).collect();
        for add in adds {
            let Some((operands, summed)) = as_add(g, add) else {
                continue;
            };
            let found = (0..2).find_map(|side| {
                let dx = operands[side];
                let ln = norm_grad_operand(g, add, dx, side)?;
                let residual = operands[1 - side];
                let sums_dx_alone = summed.contains(&Summed::Input(side));
                let tied = || reachable_from(g, [dx.node])[residual.node.index()];
                (!sums_dx_alone && !tied()).then(|| (ln.clone(), dx, residual, side))
            });
            let Some((ln, dx, residual, side)) = found else {
                continue;
            };
            let epilogue = NormGradEpilogue {
                residual: true,
                sum_dx: summed.contains(&Summed::Result),
                sum_residual: summed.contains(&Summed::Input(1 - side)),
            };
            // The fused node's port of each of the Add's outputs.
            let port_of = |summed: Summed| match summed {
                Summed::Result => 3,
                _ => 3 + usize::from(epilogue.sum_dx),
            };
            let mut rewired = Vec::new();
            for (reader, slot, port) in g.consumers(add) {
                let to = match port.index {
                    0 => 0,
                    k => port_of(summed[k - 1]),
                };
                rewired.push((reader, slot, Port::new(dx.node, to)));
            }
            let mut inputs = g.inputs(dx.node);
            inputs.push(residual);
            let op = LayerNormGrad { epilogue, ..ln };
            g.set_node(dx.node, Box::new(op), &inputs)?;
            g.rewire(rewired)?;
            bytes += 2 * g.ty(dx).size_bytes();
            sums += epilogue.sums();
            fused += 1;
            stale.push(add);
        }
        let (removed, _) = remove_unread(g, stale, &is_output)?;
        let lines = vec![
            format!("norm-grad-epilogue: {fused} LayerNormGrads add the residual gradient to dx themselves ({removed} Add kernels fewer)"),
            format!("norm-grad-epilogue: {sums} column sums of the Adds summed by the LayerNormGrads"),
            format!(
                "norm-grad-epilogue: {} of tensors no longer written and read back",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("norm-grad-epilogue", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuse::Fuse;
    use crate::sum_into_elementwise::SumIntoElementwise;
    use crate::testing::{assert_same_bits, run as run_cpu};
    use ampgraph_graph::ops::fused::column_sum_dtype;
    use ampgraph_graph::ops::{BiasAdd, DataFormat, Reduce, ReduceKind, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};
    use std::collections::HashMap;

    const ROWS: usize = 6;
    const LEN: usize = 10;

    /// `dx = LayerNormGrad(x, gamma, dy)` then `Add(r, dx)` (operands in that order
    /// when `dx_first` is false), the Add's column sum and r's, each read by a Neg
    /// output, and the Add read by a Max over its rows (not elementwise: the Add stays
    /// a kernel of its own after fusion).
    fn graph(dtype: DType, dx_first: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", dtype, [ROWS, LEN]).unwrap();
        let gamma = g.placeholder("gamma", dtype, [LEN]).unwrap();
        let dy = g.placeholder("dy", dtype, [ROWS, LEN]).unwrap();
        let r = g.placeholder("r", dtype, [ROWS, LEN]).unwrap();
        let grad = g
            .add(LayerNormGrad::new(-1, 1e-5), &[x, gamma, dy])
            .unwrap();
        let dx = Port::new(grad.node, 0);
        let operands = if dx_first { [dx, r] } else { [r, dx] };
        let add = g.add(Binary::new(BinaryKind::Add), &operands).unwrap();
        let mut outputs = vec![
            Port::new(grad.node, 1),
            Port::new(grad.node, 2),
            g.add(Reduce::new(ReduceKind::Max, Some(vec![1]), false), &[add])
                .unwrap(),
        ];
        for summed in [add, r] {
            let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false)
                .with_output(column_sum_dtype(dtype));
            let s = g.add(sum, &[summed]).unwrap();
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[s]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds(dtype: DType) -> HashMap<&'static str, Tensor> {
        let values = |n: usize, k: f64| -> Tensor {
            let v: Vec<f64> = (0..n).map(|i| (i as f64 * k).sin() * 2.0 + 0.1).collect();
            let shape = if n == LEN { vec![LEN] } else { vec![ROWS, LEN] };
            Tensor::from_f64(dtype, shape, &v).unwrap()
        };
        HashMap::from([
            ("x", values(ROWS * LEN, 0.37)),
            ("gamma", values(LEN, 0.71)),
            ("dy", values(ROWS * LEN, 1.13)),
            ("r", values(ROWS * LEN, 0.53)),
        ])
    }

    /// The CUDA pipeline's order: fusion, the column sums into the fused Add, then this.
    fn rewrite(g: &mut Graph) -> PassSummary {
        Fuse.run(g).unwrap();
        SumIntoElementwise.run(g).unwrap();
        NormGradEpilogueFusion.run(g).unwrap()
    }

    fn fused_norm_grad(g: &Graph) -> Option<&LayerNormGrad> {
        g.node_ids()
            .find_map(|id| g.node(id).op.downcast_ref::<LayerNormGrad>())
    }

    #[test]
    fn the_add_and_its_column_sums_fold_into_the_norm_gradient_bit_exactly() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            for dx_first in [false, true] {
                let before = graph(dtype, dx_first);
                let mut g = before.clone();
                let summary = rewrite(&mut g);
                g.validate().unwrap();
                assert!(summary.lines[0].contains(": 1 LayerNormGrads"), "{summary}");
                assert!(
                    summary.lines[0].contains("(1 Add kernels fewer)"),
                    "{summary}"
                );
                assert!(summary.lines[1].contains(": 2 column sums"), "{summary}");
                let epilogue = fused_norm_grad(&g).unwrap().epilogue;
                assert_eq!(
                    epilogue,
                    NormGradEpilogue {
                        residual: true,
                        sum_dx: true,
                        sum_residual: true
                    }
                );
                // Only the Max and the Negs are left beside it.
                assert_eq!(
                    g.len(),
                    4 + 1 + 3,
                    "{}",
                    ampgraph_graph::format::to_text(&g)
                );
                let want = run_cpu(&before, &feeds(dtype));
                assert_same_bits(&want, &run_cpu(&g, &feeds(dtype)));
                // Idempotent.
                let text = ampgraph_graph::format::to_text(&g);
                let again = rewrite(&mut g);
                assert!(again.lines[0].contains(": 0 LayerNormGrads"), "{again}");
                assert_eq!(text, ampgraph_graph::format::to_text(&g));
            }
        }
    }

    #[test]
    fn a_lone_add_folds_without_sums() {
        let mut g = graph(DType::F16, true);
        let before = g.clone();
        let summary = NormGradEpilogueFusion.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 LayerNormGrads"), "{summary}");
        assert_eq!(
            fused_norm_grad(&g).unwrap().epilogue,
            NormGradEpilogue {
                residual: true,
                ..Default::default()
            }
        );
        assert_same_bits(
            &run_cpu(&before, &feeds(DType::F16)),
            &run_cpu(&g, &feeds(DType::F16)),
        );
    }

    #[test]
    fn adds_that_cannot_fold_stay() {
        // Fusion and the column sums first, then this pass changes nothing.
        let unchanged = |mut g: Graph| {
            Fuse.run(&mut g).unwrap();
            SumIntoElementwise.run(&mut g).unwrap();
            let text = ampgraph_graph::format::to_text(&g);
            let summary = NormGradEpilogueFusion.run(&mut g).unwrap();
            assert!(summary.lines[0].contains(": 0 LayerNormGrads"), "{summary}");
            assert_eq!(text, ampgraph_graph::format::to_text(&g));
        };
        let with_reader_of_dx = |reader: Box<dyn ampgraph_graph::Op>| {
            let mut g = graph(DType::F32, false);
            let grad = norm_grad_node(&g);
            let name = g.fresh_name("reader");
            let read = g.add_node(name, reader, &[Port::new(grad, 0)]).unwrap();
            let neg = g
                .add(Unary::new(UnaryKind::Neg), &[Port::new(read, 0)])
                .unwrap();
            let mut outputs = g.outputs().to_vec();
            outputs.push(neg);
            g.set_outputs(outputs).unwrap();
            g
        };
        // dx read by another node too.
        unchanged(with_reader_of_dx(Box::new(Unary::new(UnaryKind::Exp))));
        // dx's own column sum (taken by the fused Add): no place for it.
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false).with_output(DType::F32);
        unchanged(with_reader_of_dx(Box::new(sum)));

        // The residual depends on the LayerNormGrad (its dgamma as a bias): a cycle.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [ROWS, LEN]).unwrap();
        let gamma = g.placeholder("gamma", DType::F32, [LEN]).unwrap();
        let dy = g.placeholder("dy", DType::F32, [ROWS, LEN]).unwrap();
        let grad = g
            .add(LayerNormGrad::new(-1, 1e-5), &[x, gamma, dy])
            .unwrap();
        let bias = BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        let r = g.add(bias, &[x, Port::new(grad.node, 1)]).unwrap();
        let add = g
            .add(Binary::new(BinaryKind::Add), &[Port::new(grad.node, 0), r])
            .unwrap();
        g.set_outputs(vec![add]).unwrap();
        unchanged(g);
    }

    fn norm_grad_node(g: &Graph) -> NodeId {
        g.node_ids()
            .find(|&id| g.node(id).op.is::<LayerNormGrad>())
            .unwrap()
    }
}
