//! Cross-entropy and its gradient in one op. A training step computes
//! `SoftmaxCrossEntropy(logits, labels)` and, after autodiff,
//! `SoftmaxCrossEntropyGrad(logits, labels, dloss)`: two kernels that each read the
//! logits, and after AMP a Cast kernel that narrows the gradient for the 16-bit
//! products reading it. This pass gives the loss node the op
//! [`SoftmaxCrossEntropyWithGrad`]: one kernel reads each row of logits once and
//! writes its loss and its gradient, already narrowed. It also reads the 16-bit
//! logits under AMP's widening Cast (exact), so the product making them stores half
//! the bytes. The output bias' gradient, a Sum of the gradient over the batch, becomes
//! a third output, added up by the same kernel.
//!
//! The gradient's input `dloss` must not depend on the loss. Autodiff of AMP's scaled
//! loss `loss * scale` gives `BinaryGrad<Mul, wrt=0>(loss, scale, dy)`, which reads
//! the loss only for its type: the pass first makes it `Mul(dy, scale)`, the same
//! product.

use ampgraph_graph::ops::{
    Binary, BinaryGrad, BinaryKind, Reduce, SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad,
    SoftmaxCrossEntropyWithGrad, MAX_SUMMED_CLASSES,
};
use ampgraph_graph::{DType, Graph, NodeId, Port};

use crate::rewrite::reachable_from;
use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::simplify::{one_cast_dtype, widened};
use crate::sum_into_elementwise::is_column_sum;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `fuse-cross-entropy` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseCrossEntropy;

/// `dloss` as a tensor that does not depend on the loss node `loss`, if it can be:
/// a gradient of the product `loss * other` (shapes equal) becomes `Mul(dy, other)`.
fn independent_of(g: &mut Graph, dloss: Port, loss: NodeId) -> Result<Option<Port>, PassError> {
    let node = g.node(dloss.node);
    if let Some(bg) = node.op.downcast_ref::<BinaryGrad>() {
        let inputs = g.inputs(dloss.node);
        let ty = g.ty(dloss);
        let same = inputs.iter().all(|&p| g.ty(p) == ty);
        if bg.kind == BinaryKind::Mul && same && inputs[bg.wrt] == Port::new(loss, 0) {
            let (other, dy) = (inputs[1 - bg.wrt], inputs[2]);
            g.set_node(
                dloss.node,
                Box::new(Binary::new(BinaryKind::Mul)),
                &[dy, other],
            )?;
        }
    }
    // Any other path from the loss still ties them.
    let tied = reachable_from(g, [loss])[dloss.node.index()];
    Ok((!tied).then_some(dloss))
}

/// How the readers of the gradient `grad` (`[N, C]`, compute type) fold: the column
/// Sum among them (at most one, no graph output), and the one dtype the rest all
/// cast it to, where they all are such Casts (none a graph output) that the kernel
/// rounds to as the Cast did (once).
fn fold_readers(
    g: &Graph,
    grad: NodeId,
    compute: DType,
    is_output: &[bool],
) -> (Option<NodeId>, Option<DType>) {
    let readers: Vec<NodeId> = g.consumers(grad).iter().map(|r| r.0).collect();
    let ty = g.node(grad).outputs()[0].clone();
    let sum = readers.iter().copied().find(|&r| {
        let summed = g.node(r).op.downcast_ref::<Reduce>();
        !is_output[r.index()]
            && ty.shape.get(1).is_some_and(|&c| c <= MAX_SUMMED_CLASSES)
            && summed.is_some_and(|s| is_column_sum(s, ty.rank(), ty.dtype))
    });
    let rest = readers.iter().copied().filter(|&r| Some(r) != sum);
    // f64 rounded to 16 bits in a kernel would round twice, through f32.
    let once = |to: DType| compute != DType::F64 || to.size_bytes() >= 4;
    (sum, one_cast_dtype(g, rest, is_output, once))
}

impl Pass for FuseCrossEntropy {
    fn name(&self) -> &'static str {
        "fuse-cross-entropy"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let (mut fused, mut widenings, mut narrowings, mut sums) = (0usize, 0usize, 0usize, 0usize);
        let mut stale = Vec::new();
        let mut rewired = Vec::new();
        let grads: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| g.node(id).op.is::<SoftmaxCrossEntropyGrad>())
            .collect();
        for grad in grads {
            let [logits, labels, dloss] = g.inputs(grad)[..] else {
                continue;
            };
            let loss = g.port_consumers(logits).into_iter().find(|&(c, slot)| {
                slot == 0 && g.node(c).op.is::<SoftmaxCrossEntropy>() && g.inputs(c)[1] == labels
            });
            let Some((loss, _)) = loss.filter(|_| !is_output[grad.index()]) else {
                continue;
            };
            let Some(dloss) = independent_of(g, dloss, loss)? else {
                continue;
            };
            let compute = g.ty(dloss).dtype;
            let read = match widened(g, logits, compute) {
                Some(narrow) => {
                    stale.push(logits.node);
                    widenings += 1;
                    narrow
                }
                None => logits,
            };
            let (sum, grad_dtype) = fold_readers(g, grad, compute, &is_output);
            // The gradient's readers: those of its Casts where they fold; the Sum's.
            let mut readers = Vec::new();
            for (reader, slot, _) in g.consumers(grad) {
                if Some(reader) == sum {
                    let to_sum = g.consumers(reader).into_iter();
                    readers.extend(to_sum.map(|(r, s, _)| (r, s, Port::new(loss, 2))));
                    stale.push(reader);
                    sums += 1;
                } else if grad_dtype.is_some() {
                    let to_cast = g.consumers(reader).into_iter();
                    readers.extend(to_cast.map(|(r, s, _)| (r, s, Port::new(loss, 1))));
                    stale.push(reader);
                    narrowings += 1;
                } else {
                    readers.push((reader, slot, Port::new(loss, 1)));
                }
            }
            let op = SoftmaxCrossEntropyWithGrad {
                grad_dtype,
                column_sum: sum.is_some(),
                classes: None,
            };
            g.set_node(loss, Box::new(op), &[read, labels, dloss])?;
            rewired.extend(readers);
            stale.push(grad);
            fused += 1;
        }
        g.rewire(rewired)?;
        let (removed, bytes) = remove_unread(g, stale, &is_output)?;
        let lines = vec![
            format!("fuse-cross-entropy: {fused} losses computed with their gradient by one kernel"),
            format!("fuse-cross-entropy: {widenings} widening Casts of the logits and {narrowings} narrowing Casts of the gradient folded in"),
            format!("fuse-cross-entropy: {sums} column sums of the gradient (bias gradients) added up by the same kernel"),
            format!(
                "fuse-cross-entropy: removed {removed} kernels ({} of tensors no longer written, and read back)",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("fuse-cross-entropy", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::{Cast, Unary, UnaryKind};
    use ampgraph_graph::Tensor;
    use std::collections::HashMap;

    /// An AMP training step's loss end: `logits: f16 -> Cast<f32> -> loss`; the
    /// gradient of `loss * scale` (`BinaryGrad<Mul>`), the loss' gradient, its column
    /// Sum (read by a Neg) and its Cast to f16 read by a Tanh. With `tied`, dloss also
    /// reads the loss.
    fn graph(tied: bool) -> Graph {
        let mut g = Graph::new();
        let logits = g.placeholder("logits", DType::F16, [6, 5]).unwrap();
        let labels = g.placeholder("labels", DType::I64, [6]).unwrap();
        let scale = g.placeholder("scale", DType::F32, []).unwrap();
        let one = g.scalar(DType::F32, 1.0).unwrap();
        let wide = g.add(Cast { to: DType::F32 }, &[logits]).unwrap();
        let loss = g.add(SoftmaxCrossEntropy, &[wide, labels]).unwrap();
        let mut dloss = g
            .add(BinaryGrad::new(BinaryKind::Mul, 0), &[loss, scale, one])
            .unwrap();
        if tied {
            dloss = g.add(Binary::new(BinaryKind::Add), &[dloss, loss]).unwrap();
        }
        let grad = g
            .add(SoftmaxCrossEntropyGrad, &[wide, labels, dloss])
            .unwrap();
        let sum = g.sum(grad, Some(&[0]), false).unwrap();
        let bias_grad = g.add(Unary::new(UnaryKind::Neg), &[sum]).unwrap();
        let half = g.add(Cast { to: DType::F16 }, &[grad]).unwrap();
        let t = g.add(Unary::new(UnaryKind::Tanh), &[half]).unwrap();
        g.set_outputs(vec![loss, bias_grad, t]).unwrap();
        g
    }

    fn feeds() -> HashMap<&'static str, Tensor> {
        let logits: Vec<f64> = (0..30).map(|i| (i as f64 * 0.77).sin() * 3.0).collect();
        HashMap::from([
            (
                "logits",
                Tensor::from_f64(DType::F16, vec![6, 5], &logits).unwrap(),
            ),
            (
                "labels",
                Tensor::from_f64(DType::I64, vec![6], &[0.0, 4.0, 2.0, 2.0, 1.0, 3.0]).unwrap(),
            ),
            ("scale", Tensor::scalar(DType::F32, 1024.0)),
        ])
    }

    /// The fused op the loss node holds, if it does.
    fn fused_op(g: &Graph) -> Option<&SoftmaxCrossEntropyWithGrad> {
        let id = g.find("softmaxcrossentropy")?;
        g.node(id).op.downcast_ref::<SoftmaxCrossEntropyWithGrad>()
    }

    #[test]
    fn the_loss_its_gradient_casts_and_bias_sum_become_one_op_bit_exactly() {
        let before = graph(false);
        let mut g = before.clone();
        let summary = FuseCrossEntropy.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 losses"), "{summary}");
        assert!(
            summary.lines[1].contains(": 1 widening Casts of the logits and 1 narrowing"),
            "{summary}"
        );
        assert!(summary.lines[2].contains(": 1 column sums"), "{summary}");
        for gone in ["SoftmaxCrossEntropyGrad", "Cast", "Sum", "BinaryGrad"] {
            assert_eq!(
                count(&g, gone),
                0,
                "{gone} left:\n{}",
                ampgraph_graph::format::to_text(&g)
            );
        }
        assert_eq!(
            fused_op(&g),
            Some(&SoftmaxCrossEntropyWithGrad {
                grad_dtype: Some(DType::F16),
                column_sum: true,
                classes: None,
            })
        );
        let fused = g.find("softmaxcrossentropy").unwrap();
        assert_eq!(g.ty(g.inputs(fused)[0]).dtype, DType::F16);
        assert_same_bits(&run_cpu(&before, &feeds()), &run_cpu(&g, &feeds()));
        // Idempotent.
        let text = ampgraph_graph::format::to_text(&g);
        let again = FuseCrossEntropy.run(&mut g).unwrap();
        assert!(again.lines[0].contains(": 0 losses"), "{again}");
        assert_eq!(text, ampgraph_graph::format::to_text(&g));
    }

    #[test]
    fn a_gradient_that_depends_on_the_loss_value_or_is_an_output_stays_apart() {
        let mut g = graph(true);
        let summary = FuseCrossEntropy.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 losses"), "{summary}");
        assert_eq!(count(&g, "SoftmaxCrossEntropyGrad"), 1);

        // The f32 gradient fetched: nothing fuses (its readers would need it anyway).
        let mut g = graph(false);
        let grad = g.find("softmaxcrossentropygrad").unwrap();
        let mut outputs = g.outputs().to_vec();
        outputs.push(Port::new(grad, 0));
        g.set_outputs(outputs).unwrap();
        let before = g.clone();
        let summary = FuseCrossEntropy.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 losses"), "{summary}");
        assert_same_bits(&run_cpu(&before, &feeds()), &run_cpu(&g, &feeds()));
    }

    #[test]
    fn a_gradient_read_in_its_own_type_keeps_it() {
        // A second reader of the f32 gradient: no narrowing, the Sum still folds.
        let mut g = graph(false);
        let grad = g.find("softmaxcrossentropygrad").unwrap();
        let neg = g
            .add(Unary::new(UnaryKind::Neg), &[Port::new(grad, 0)])
            .unwrap();
        let mut outputs = g.outputs().to_vec();
        outputs.push(neg);
        g.set_outputs(outputs).unwrap();
        let before = g.clone();
        FuseCrossEntropy.run(&mut g).unwrap();
        g.validate().unwrap();
        assert_eq!(
            fused_op(&g),
            Some(&SoftmaxCrossEntropyWithGrad {
                grad_dtype: None,
                column_sum: true,
                classes: None,
            })
        );
        assert_eq!(count(&g, "Cast"), 1);
        assert_same_bits(&run_cpu(&before, &feeds()), &run_cpu(&g, &feeds()));
    }
}
