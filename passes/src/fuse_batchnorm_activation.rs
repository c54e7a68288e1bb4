//! Batch norms take the ReLU after them, as TensorFlow's `_FusedBatchNormEx` with
//! `activation_mode = "Relu"`: `Relu(BatchNorm(x):0)`, the ReLU the normalised values'
//! only reader, becomes one BatchNorm with `activation = Relu`, so the normalised
//! values are not written and read back. The gradient follows, as
//! `_FusedBatchNormGradEx`: `BatchNormGrad(x, scale, mean, var, UnaryGrad{Relu}(y,
//! dy))`, the UnaryGrad read by nothing else and `y` the ReLU of that BatchNorm,
//! becomes `BatchNormGrad{Relu}(x, scale, mean, var, dy, offset)`, which masks `dy`
//! where it reads it by the sign of the pre-activation it recomputes from `x` (so `y`
//! is not read). In a convnet's training step each Conv + BatchNorm + ReLU layer loses
//! two elementwise passes over its activations, and its gradient two reads of `y`.
//!
//! A residual connection's `Relu(Add(BatchNorm(x):0, s))` (ResNet's block output; an
//! Add read by anything else keeps no ReLU) becomes `BatchNorm{Relu}(x, .., s)` with
//! `s` as TensorFlow's side input, on channels-last images (NHWC or `[N, C]`, the
//! layouts the CUDA kernels take it in): the normalised values and their sum are not
//! written and read back. Its gradient stays as autodiff made it: the ReLU's gradient
//! reads the block's output, which the fused BatchNorm writes.
//!
//! The forward is bit-exact on the CPU (the fused BatchNorm computes the ReLU as the
//! Unary op does; rounding commutes with it; a side input is added to the normalised
//! values rounded as the BatchNorm stored them); the gradient's recomputed mask differs
//! from `y > 0` only where the pre-activation is within rounding of 0.

use ampgraph_graph::ops::{
    BatchNorm, BatchNormGrad, BinaryKind, DataFormat, NormActivation, Unary, UnaryGrad, UnaryKind,
};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{
    binary_operands, output_nodes, read_only_by, redirect, remove_unread, summary,
};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `fuse-batchnorm-activation` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseBatchNormActivation;

/// The BatchNorm (without an activation) whose output 0 only the Relu `relu` reads.
fn relu_of_batch_norm(g: &Graph, relu: NodeId) -> Option<(Port, BatchNorm)> {
    let unary = g.node(relu).op.downcast_ref::<Unary>()?;
    let [y] = g.inputs(relu)[..] else {
        return None;
    };
    let bn = g.node(y.node).op.downcast_ref::<BatchNorm>()?;
    let fusable = unary.kind == UnaryKind::Relu
        && y.index == 0
        && bn.activation == NormActivation::Identity
        && read_only_by(g, y, relu, 0);
    fusable.then(|| (y, bn.clone()))
}

/// A residual Add `add` of a BatchNorm's normalised values (read by nothing else) and
/// another tensor of their type, the BatchNorm without an activation or side input on
/// channels-last values: the BatchNorm's output and the other operand.
fn residual_of_batch_norm(g: &Graph, add: NodeId) -> Option<(Port, Port, BatchNorm)> {
    let operands = binary_operands(g, Port::new(add, 0), BinaryKind::Add)?;
    let [a, b] = operands;
    (g.ty(a) == g.ty(b) && g.ty(a) == g.ty(Port::new(add, 0))).then_some(())?;
    [(a, b), (b, a)].into_iter().find_map(|(y, side)| {
        let bn = g.node(y.node).op.downcast_ref::<BatchNorm>()?;
        let channels_last = bn.data_format == DataFormat::Nhwc || g.ty(y).rank() == 2;
        let fusable = y.index == 0
            && y != side
            && channels_last
            && bn.activation == NormActivation::Identity
            && g.inputs(y.node).len() == 5
            && read_only_by(g, y, add, if y == a { 0 } else { 1 });
        fusable.then(|| (y, side, bn.clone()))
    })
}

/// The BatchNorm `grad` is the gradient of, where `y` is its ReLU: the output of the
/// BatchNorm with the ReLU fused, or of a Relu of the BatchNorm's output. Its inputs
/// `x` and `scale` and the statistics it normalised with must be `grad`'s.
fn forward_of_relu(g: &Graph, y: Port, grad: &BatchNormGrad, inputs: &[Port]) -> Option<NodeId> {
    let bn_output = match g.node(y.node).op.downcast_ref::<Unary>() {
        Some(u) if u.kind == UnaryKind::Relu => *g.inputs(y.node).first()?,
        _ => y,
    };
    let bn = g.node(bn_output.node).op.downcast_ref::<BatchNorm>()?;
    let fwd = g.inputs(bn_output.node);
    // A side input's sum is not recomputable from `x`.
    if fwd.len() != 5 {
        return None;
    }
    let statistics = if bn.training {
        [Port::new(bn_output.node, 1), Port::new(bn_output.node, 2)]
    } else {
        [*fwd.get(3)?, *fwd.get(4)?]
    };
    let same = bn_output.index == 0
        && (bn.epsilon, bn.training, bn.data_format)
            == (grad.epsilon, grad.training, grad.data_format)
        && fwd[..2] == inputs[..2]
        && statistics == inputs[2..4];
    same.then_some(bn_output.node)
}

/// The BatchNormGrad (without an activation) whose `dy` is `UnaryGrad{Relu}(y, dy')`
/// read by nothing else, `y` the ReLU of its own forward: its inputs with `dy'` for
/// `dy` and the forward's `offset` last.
fn relu_grad_operand(g: &Graph, grad: NodeId) -> Option<(Vec<Port>, BatchNormGrad, Port)> {
    let op = g.node(grad).op.downcast_ref::<BatchNormGrad>()?;
    let mut inputs = g.inputs(grad);
    let masked = *inputs.get(4)?;
    let unary = g.node(masked.node).op.downcast_ref::<UnaryGrad>()?;
    let [y, dy] = g.inputs(masked.node)[..] else {
        return None;
    };
    let fusable = op.activation == NormActivation::Identity
        && unary.kind == UnaryKind::Relu
        && read_only_by(g, masked, grad, 4);
    if !fusable {
        return None;
    }
    let bn = forward_of_relu(g, y, op, &inputs)?;
    inputs[4] = dy;
    inputs.push(g.inputs(bn)[2]);
    Some((inputs, op.clone(), masked))
}

impl Pass for FuseBatchNormActivation {
    fn name(&self) -> &'static str {
        "fuse-batchnorm-activation"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let (mut forward, mut backward, mut residual, mut bytes) = (0, 0, 0, 0usize);
        let mut stale = Vec::new();
        let ids: Vec<NodeId> = g.node_ids().collect();
        // Each fused side input must not depend on its BatchNorm: true when it comes
        // first in a topological order, else checked, and the order found again.
        let mut order = position_in_order(g)?;
        for &add in &ids {
            if is_output[add.index()] {
                continue;
            }
            let Some((y, side, bn)) = residual_of_batch_norm(g, add) else {
                continue;
            };
            let after = order[side.node.index()] > order[y.node.index()];
            if after && g.needed_by(&[side])[y.node.index()] {
                continue;
            }
            let readers = g.consumers(add);
            let relu = match &readers[..] {
                [(r, _, _)] if !is_output[r.index()] => g
                    .node(*r)
                    .op
                    .downcast_ref::<Unary>()
                    .is_some_and(|u| u.kind == UnaryKind::Relu)
                    .then_some(*r),
                _ => None,
            };
            let op = BatchNorm {
                activation: match relu {
                    Some(_) => NormActivation::Relu,
                    None => NormActivation::Identity,
                },
                ..bn
            };
            let mut inputs = g.inputs(y.node);
            inputs.push(side);
            g.set_node(y.node, Box::new(op), &inputs)?;
            redirect(g, Port::new(relu.unwrap_or(add), 0), y)?;
            bytes += (2 + 2 * usize::from(relu.is_some())) * g.ty(y).size_bytes();
            residual += 1;
            stale.push(add);
            stale.extend(relu);
            if after {
                order = position_in_order(g)?;
            }
        }
        for &relu in &ids {
            if is_output[relu.index()] {
                continue;
            }
            let Some((y, bn)) = relu_of_batch_norm(g, relu) else {
                continue;
            };
            let op = BatchNorm {
                activation: NormActivation::Relu,
                ..bn
            };
            let inputs = g.inputs(y.node);
            g.set_node(y.node, Box::new(op), &inputs)?;
            redirect(g, Port::new(relu, 0), y)?;
            bytes += 2 * g.ty(y).size_bytes();
            forward += 1;
            stale.push(relu);
        }
        for &grad in &ids {
            let Some((inputs, op, masked)) = relu_grad_operand(g, grad) else {
                continue;
            };
            let op = BatchNormGrad {
                activation: NormActivation::Relu,
                ..op
            };
            g.set_node(grad, Box::new(op), &inputs)?;
            bytes += 2 * g.ty(masked).size_bytes();
            backward += 1;
            stale.push(masked.node);
        }
        let (removed, _) = remove_unread(g, stale, &is_output)?;
        let lines = vec![
            format!(
                "fuse-batchnorm-activation: {forward} BatchNorms apply the ReLU after them, {backward} BatchNormGrads its gradient, {residual} BatchNorms add a residual ({removed} kernels fewer)"
            ),
            format!(
                "fuse-batchnorm-activation: {} of tensors no longer written and read back",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("fuse-batchnorm-activation", lines))
    }
}

/// Each node's position in a topological order.
fn position_in_order(g: &Graph) -> Result<Vec<usize>, PassError> {
    let mut position = vec![0; g.node_bound()];
    for (k, id) in g.topo_order()?.into_iter().enumerate() {
        position[id.index()] = k;
    }
    Ok(position)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::count;
    use crate::testing::{assert_same_bits, run as run_cpu};
    use ampgraph_graph::autodiff::gradients;
    use ampgraph_graph::ops::DataFormat;
    use ampgraph_graph::{DType, Tensor};
    use std::collections::HashMap;

    /// Placeholders x and w (4 channels in `format`), the statistics' scale and offset,
    /// and a training BatchNorm of x: `[x, w, scale, offset, y]`.
    fn batch_norm_of(g: &mut Graph, dtype: DType, format: DataFormat) -> [Port; 5] {
        let image = match format {
            DataFormat::Nhwc => [2, 3, 3, 4],
            DataFormat::Nchw => [2, 4, 3, 3],
        };
        let x = g.placeholder("x", dtype, image).unwrap();
        let w = g.placeholder("w", dtype, image).unwrap();
        let stats = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let scale = g.placeholder("scale", stats, [4]).unwrap();
        let offset = g.placeholder("offset", stats, [4]).unwrap();
        let bn = BatchNorm {
            epsilon: 1e-3,
            training: true,
            data_format: format,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        let y = g.add(bn, &[x, scale, offset, scale, offset]).unwrap();
        [x, w, scale, offset, y]
    }

    /// `loss = sum(relu(BatchNorm(x)) * w)` and its gradients with respect to x and the
    /// batch norm's scale and offset, for a channels-last x.
    fn training_graph(dtype: DType) -> (Graph, Vec<Port>) {
        let mut g = Graph::new();
        let [x, w, scale, offset, y] = batch_norm_of(&mut g, dtype, DataFormat::Nhwc);
        let r = g.relu(y).unwrap();
        let weighted = g.mul(r, w).unwrap();
        let loss = g.sum(weighted, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, scale, offset]).unwrap();
        let mut fetches = vec![loss];
        fetches.extend(grads);
        g.set_outputs(fetches.clone()).unwrap();
        (g, fetches)
    }

    /// `loss = sum(relu(BatchNorm(x) + s) * w)` (with `relu`; else without it, the sum
    /// also read by a Mul) and its gradients with respect to x, scale, offset and s,
    /// for an x of 4 channels in `format` (`s` = `w * 0.5`, so that it is computed).
    fn residual_graph(dtype: DType, relu: bool, format: DataFormat) -> Graph {
        let mut g = Graph::new();
        let [x, w, scale, offset, y] = batch_norm_of(&mut g, dtype, format);
        let half = g.scalar(dtype, 0.5).unwrap();
        let side = g.mul(w, half).unwrap();
        let sum = g.plus(side, y).unwrap();
        let out = if relu {
            g.relu(sum).unwrap()
        } else {
            let squared = g.mul(sum, sum).unwrap();
            g.plus(squared, sum).unwrap()
        };
        let weighted = g.mul(out, w).unwrap();
        let loss = g.sum(weighted, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, scale, offset, side]).unwrap();
        let mut fetches = vec![loss];
        fetches.extend(grads);
        g.set_outputs(fetches).unwrap();
        g
    }

    #[test]
    fn a_residual_and_its_relu_fuse_into_the_batch_norm_bit_for_bit() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            for relu in [true, false] {
                let mut g = residual_graph(dtype, relu, DataFormat::Nhwc);
                let before = run_cpu(&g, &feeds(dtype));
                let adds = count(&g, "Add");
                let s = FuseBatchNormActivation.run(&mut g).unwrap();
                assert!(
                    s.lines[0].contains("1 BatchNorms add a residual"),
                    "{}",
                    s.lines[0]
                );
                let bn = g
                    .node_ids()
                    .find(|&id| g.node(id).op.is::<BatchNorm>())
                    .unwrap();
                assert_eq!(g.inputs(bn).len(), 6, "{dtype}");
                assert_eq!(count(&g, "Add"), adds - 1, "{dtype} relu {relu}");
                assert_eq!(count(&g, "Relu"), 0, "{dtype}");
                assert_same_bits(&before, &run_cpu(&g, &feeds(dtype)));
                // Nothing more to fuse: the pass is idempotent.
                let again = FuseBatchNormActivation.run(&mut g).unwrap();
                assert!(
                    again.lines[0].contains("0 BatchNorms add a residual"),
                    "{}",
                    again.lines[0]
                );
            }
        }
    }

    /// NCHW images stay unfused (CUDA adds side inputs channels-last only); a side
    /// input computed from the batch norm's own statistics would close a cycle.
    #[test]
    fn residuals_the_batch_norm_cannot_take_stay_adds() {
        let mut g = residual_graph(DType::F32, true, DataFormat::Nchw);
        let s = FuseBatchNormActivation.run(&mut g).unwrap();
        assert!(
            s.lines[0].contains("0 BatchNorms add a residual"),
            "{}",
            s.lines[0]
        );

        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 3]).unwrap();
        let scale = g.placeholder("scale", DType::F32, [3]).unwrap();
        let bn = BatchNorm {
            epsilon: 1e-3,
            training: true,
            ..BatchNorm::default()
        };
        let y = g.add(bn, &[x, scale, scale, scale, scale]).unwrap();
        let mean = Port::new(y.node, 1);
        let side = g.plus(x, mean).unwrap();
        let sum = g.plus(y, side).unwrap();
        let out = g.relu(sum).unwrap();
        g.set_outputs(vec![out]).unwrap();
        let s = FuseBatchNormActivation.run(&mut g).unwrap();
        assert!(
            s.lines[0].contains("0 BatchNorms add a residual"),
            "{}",
            s.lines[0]
        );
        g.topo_order().unwrap();
    }

    fn feeds(dtype: DType) -> HashMap<&'static str, Tensor> {
        let values = |k: f64| -> Vec<f64> { (0..72).map(|i| (i as f64 * k).sin() * 2.0).collect() };
        let stats = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let image = |k| Tensor::from_f64(dtype, [2, 3, 3, 4], &values(k)).unwrap();
        HashMap::from([
            ("x", image(0.7)),
            ("w", image(1.3)),
            (
                "scale",
                Tensor::from_f64(stats, [4], &[1.0, 0.5, 2.0, 1.5]).unwrap(),
            ),
            (
                "offset",
                Tensor::from_f64(stats, [4], &[0.1, -0.2, 0.3, 0.0]).unwrap(),
            ),
        ])
    }

    #[test]
    fn a_training_step_fuses_both_ways_bit_for_bit() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let (mut g, _) = training_graph(dtype);
            let before = run_cpu(&g, &feeds(dtype));
            let s = FuseBatchNormActivation.run(&mut g).unwrap();
            assert!(
                s.lines[0].contains("1 BatchNorms apply the ReLU after them, 1 BatchNormGrads"),
                "{}",
                s.lines[0]
            );
            assert_eq!(
                (count(&g, "Relu"), count(&g, "UnaryGrad")),
                (0, 0),
                "{dtype}"
            );
            assert_same_bits(&before, &run_cpu(&g, &feeds(dtype)));
        }
    }

    /// A ReLU gradient whose mask is another ReLU's output is not this batch norm's:
    /// its gradient stays unfused.
    #[test]
    fn a_mask_of_another_relu_stays_outside_the_gradient() {
        let (mut g, _) = training_graph(DType::F32);
        let mask = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<UnaryGrad>())
            .unwrap();
        let w = g.find("w").unwrap();
        let other = g.relu(Port::new(w, 0)).unwrap();
        g.rewire(vec![(mask, 0, other)]).unwrap();
        let before = run_cpu(&g, &feeds(DType::F32));
        let s = FuseBatchNormActivation.run(&mut g).unwrap();
        assert!(s.lines[0].contains(", 0 BatchNormGrads"), "{}", s.lines[0]);
        assert_eq!(count(&g, "UnaryGrad"), 1);
        assert_same_bits(&before, &run_cpu(&g, &feeds(DType::F32)));
    }

    /// The gradient finds its forward through the Relu: it fuses even where the
    /// forward cannot.
    #[test]
    fn a_normalised_value_read_elsewhere_keeps_its_relu() {
        let (mut g, mut fetches) = training_graph(DType::F32);
        // The BatchNorm's output itself is fetched too.
        let bn = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<BatchNorm>())
            .unwrap();
        fetches.push(Port::new(bn, 0));
        g.set_outputs(fetches).unwrap();
        let before = run_cpu(&g, &feeds(DType::F32));
        let s = FuseBatchNormActivation.run(&mut g).unwrap();
        assert!(
            s.lines[0].contains("0 BatchNorms apply the ReLU after them, 1 BatchNormGrads"),
            "{}",
            s.lines[0]
        );
        assert_same_bits(&before, &run_cpu(&g, &feeds(DType::F32)));
    }
}
