//! Channel padding for Tensor Core convolutions (`pad-conv-channels`), the sibling of
//! `pad-gemm`: a 16-bit convolution whose input or output channel count is not a
//! multiple of 8 (an RGB input's 3 above all) runs on tensors padded with zero
//! channels, and its result is sliced back.
//!
//! The three convolution ops are padded each on its own, so a training graph (the pass
//! runs after autodiff built the gradients) is padded consistently, with `cin` and
//! `cout` the filter's HWIO channel counts rounded up to `cin'` and `cout'`:
//!
//! - `Conv2D(x, w)`: `x` gets `cin' - cin` zero channels (except that `x` keeps an
//!   input channel count below 8, as for the filter gradient), `w` zero input channels
//!   and zero output channels. The padded terms are products with zeros; the extra
//!   output channels are sliced off.
//! - `Conv2DBackpropInput(w, dy)`: `w` as above, `dy` zero channels up to `cout'`;
//!   `dx` has `cin'` channels of which the padded ones are sliced off. The padded terms
//!   multiply zero `dy` channels by zero filter columns.
//! - `Conv2DBackpropFilter(x, dy)`: `x` and `dy` padded as above (except that `x`
//!   keeps an input channel count below 8: cuDNN computes that gradient faster
//!   unpadded); the gradient of the padded filter is sliced back to
//!   `[kh, kw, cin, cout]`. Each of its elements sums `x * dy` over the same positions
//!   as before: the padding only adds rows and columns.
//!
//! Grouped convolutions (`groups` > 1) are left alone: zero channels added at the end
//! would move every group's channel boundaries. So are convolutions of one-pixel
//! images (a squeeze-excitation's): too little work for the padding to pay.
//!
//! Every padded tensor (a filter read by a convolution and its input gradient, a `dy`
//! read by both gradients) is padded once. A node whose output keeps its shape reads
//! the padded tensors in place; otherwise the op moves to a new node `<name>/padded`
//! and the node becomes the Slice of it (keeping its name and type), as in `pad-gemm`.

use std::collections::BTreeMap;

use ampgraph_graph::ops::{Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, Slice};
use ampgraph_graph::{Graph, NodeId, Op, Port, TensorType};
use foldhash::HashMap;

use super::pad_gemm::{pad_axis, round_up, GEMM_MULTIPLE};
use crate::rewrite::{node_error, summary};
use crate::{Pass, PassError, PassSummary};

/// The `pad-conv-channels` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct PadConvChannels;

/// One input of a convolution op padded along one axis to a length.
struct InputPad {
    slot: usize,
    axis: usize,
    len: usize,
}

impl Pass for PadConvChannels {
    fn name(&self) -> &'static str {
        "pad-conv-channels"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let candidates: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| {
                g.node(id)
                    .outputs()
                    .first()
                    .is_some_and(|t| t.dtype.is_half())
            })
            .collect();
        let mut padded: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut padder = Padder::default();
        for id in candidates {
            let Some((pads, op)) = padded_form(g, id) else {
                continue;
            };
            let name = op.name();
            padder.apply(g, id, &pads, op)?;
            *padded.entry(name).or_default() += 1;
        }
        let total: usize = padded.values().sum();
        let by_op: Vec<String> = padded.iter().map(|(op, n)| format!("{op} {n}")).collect();
        let line = format!(
            "pad-conv-channels: padded {total} 16-bit convolutions to channel multiples of {GEMM_MULTIPLE}{}{}",
            if by_op.is_empty() { "" } else { ": " },
            by_op.join(", ")
        );
        Ok(summary("pad-conv-channels", vec![line]))
    }
}

/// The channel axis of an image in `format`.
fn channel_axis(format: DataFormat) -> usize {
    match format {
        DataFormat::Nhwc => 3,
        DataFormat::Nchw => 1,
    }
}

/// A convolution op the pass pads.
enum ConvOp {
    Forward(Conv2D),
    Input(Conv2DBackpropInput),
    Filter(Conv2DBackpropFilter),
}

/// The paddings of the convolution op `id` and the op on the padded tensors, when its
/// channels need padding.
fn padded_form(g: &Graph, id: NodeId) -> Option<(Vec<InputPad>, Box<dyn Op>)> {
    let op = &g.node(id).op;
    let conv = if let Some(c) = op.downcast_ref::<Conv2D>() {
        ConvOp::Forward(c.clone())
    } else if let Some(c) = op.downcast_ref::<Conv2DBackpropInput>() {
        ConvOp::Input(c.clone())
    } else {
        ConvOp::Filter(op.downcast_ref::<Conv2DBackpropFilter>()?.clone())
    };
    let input_shape = |slot: usize| Some(g.ty(*g.inputs(id).get(slot)?).shape.clone());
    let (filter, format, groups) = match &conv {
        ConvOp::Forward(c) => (input_shape(1)?, c.data_format, c.groups),
        ConvOp::Input(c) => (input_shape(0)?, c.conv.data_format, c.conv.groups),
        ConvOp::Filter(c) => (c.filter_shape.clone(), c.conv.data_format, c.conv.groups),
    };
    // One pixel per image (a squeeze-excitation's two 1x1 convolutions on the pooled
    // `[N, 1, 1, C]`, a classifier head written as a convolution): a few thousand
    // products each, where the padding's Concats and Slices would cost more launches
    // than Tensor Cores could save.
    let image = match &conv {
        ConvOp::Input(c) => c.input_shape.clone(),
        _ => input_shape(0)?,
    };
    let pixels: usize = match format {
        DataFormat::Nhwc => image.get(1..3)?.iter().product(),
        DataFormat::Nchw => image.get(2..4)?.iter().product(),
    };
    if groups != 1 || pixels == 1 {
        return None;
    }
    let [kh, kw, cin, cout] = filter[..] else {
        return None;
    };
    let padded_cout = round_up(cout);
    // A convolution and its filter gradient keep fewer than 8 input channels (an RGB
    // input's 3): cuDNN's filter gradient on them took 90 us for the bench convnet's
    // first layer on the H100 against 305 us padded to 8, ResNet-50's first
    // convolution (its kernels for RGB images) 0.59 ms a step against 1.22 plus 0.58 for
    // padding its input; and the unpadded input is the smaller tensor kept for the
    // backward pass.
    let padded_cin = match conv {
        ConvOp::Filter(_) | ConvOp::Forward(_) if cin < GEMM_MULTIPLE => cin,
        _ => round_up(cin),
    };
    if (padded_cin, padded_cout) == (cin, cout) {
        return None;
    }
    let channels = channel_axis(format);
    let pad = |slot, axis, len| InputPad { slot, axis, len };
    // The filter (HWIO) is padded along I and O, images and their gradients along
    // their channel axis.
    Some(match conv {
        ConvOp::Forward(c) => {
            let pads = vec![
                pad(0, channels, padded_cin),
                pad(1, 2, padded_cin),
                pad(1, 3, padded_cout),
            ];
            (pads, Box::new(c))
        }
        ConvOp::Input(mut c) => {
            *c.input_shape.get_mut(channels)? = padded_cin;
            let pads = vec![
                pad(0, 2, padded_cin),
                pad(0, 3, padded_cout),
                pad(1, channels, padded_cout),
            ];
            (pads, Box::new(c))
        }
        ConvOp::Filter(mut c) => {
            c.filter_shape = vec![kh, kw, padded_cin, padded_cout];
            let pads = vec![pad(0, channels, padded_cin), pad(1, channels, padded_cout)];
            (pads, Box::new(c))
        }
    })
}

/// Pads tensors, each (tensor, axis, length) once.
#[derive(Default)]
struct Padder {
    padded: HashMap<(Port, usize, usize), Port>,
}

impl Padder {
    fn pad(&mut self, g: &mut Graph, x: Port, axis: usize, len: usize) -> Result<Port, PassError> {
        if let Some(&p) = self.padded.get(&(x, axis, len)) {
            return Ok(p);
        }
        let stem = format!("{}/pad_channels", g.node(x.node).name);
        let p = pad_axis(g, x, axis, len, &stem)?;
        self.padded.insert((x, axis, len), p);
        Ok(p)
    }

    /// Makes node `id` compute `op` on its inputs padded as `pads` say, sliced back
    /// to its own output type where that differs.
    fn apply(
        &mut self,
        g: &mut Graph,
        id: NodeId,
        pads: &[InputPad],
        op: Box<dyn Op>,
    ) -> Result<(), PassError> {
        let mut inputs = g.inputs(id);
        for pad in pads {
            inputs[pad.slot] = self.pad(g, inputs[pad.slot], pad.axis, pad.len)?;
        }
        let types: Vec<&TensorType> = inputs.iter().map(|&p| g.ty(p)).collect();
        let padded_ty = op.infer(&types).map_err(|m| node_error(g, id, &m))?;
        let want = g.node(id).outputs()[0].clone();
        if padded_ty.first() == Some(&want) {
            g.set_node(id, op, &inputs)?;
            return Ok(());
        }
        let name = g.fresh_name(format!("{}/padded", g.node(id).name));
        let conv = g.add_node(name, op, &inputs)?;
        let size: Vec<i64> = want.shape.iter().map(|&d| d as i64).collect();
        let slice = Slice::new(vec![0; size.len()], size);
        g.set_node(id, Box::new(slice), &[conv.into()])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ampgraph_graph::autodiff::gradients;
    use ampgraph_graph::ops::Padding;
    use ampgraph_graph::{DType, Tensor};

    use super::*;
    use crate::testing::{assert_same_bits, count, run};

    /// Quarters in [-2, 2]: their products and sums of a few hundred are exact in the
    /// f32 accumulators, so padding cannot move a result even by rounding.
    fn tensor(dtype: DType, shape: &[usize], seed: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f64> = (0..n)
            .map(|i| ((i as f64 * 0.37 + seed).sin() * 8.0).round() / 4.0)
            .collect();
        Tensor::from_f64(dtype, shape, &v).unwrap()
    }

    fn feeds(g: &Graph) -> HashMap<&str, Tensor> {
        g.node_ids()
            .map(|id| g.node(id))
            .filter(|n| n.op.is::<ampgraph_graph::ops::Placeholder>())
            .map(|n| {
                let ty = &n.outputs()[0];
                (
                    n.name.as_str(),
                    tensor(ty.dtype, &ty.shape, n.name.len() as f64),
                )
            })
            .collect()
    }

    /// The pass on a copy: valid, bitwise the same outputs, idempotent.
    fn pad(g: &Graph) -> (Graph, PassSummary) {
        let mut out = g.clone();
        let summary = PadConvChannels.run(&mut out).unwrap();
        out.validate().unwrap();
        let f = feeds(g);
        assert_same_bits(&run(g, &f), &run(&out, &f));
        let again = PadConvChannels.run(&mut out.clone()).unwrap();
        assert!(again.lines[0].starts_with("pad-conv-channels: padded 0 "));
        (out, summary)
    }

    /// The HWIO filter shape and the padding each convolution op of `g` runs with.
    fn filters(g: &Graph) -> Vec<(Vec<usize>, Padding)> {
        g.node_ids()
            .filter_map(|id| {
                let node = g.node(id);
                let inputs = g.inputs(id);
                if let Some(c) = node.op.downcast_ref::<Conv2D>() {
                    Some((g.ty(inputs[1]).shape.clone(), c.padding))
                } else if let Some(c) = node.op.downcast_ref::<Conv2DBackpropInput>() {
                    Some((g.ty(inputs[0]).shape.clone(), c.conv.padding))
                } else {
                    let dw = node.op.downcast_ref::<Conv2DBackpropFilter>()?;
                    Some((dw.filter_shape.clone(), dw.conv.padding))
                }
            })
            .collect()
    }

    #[test]
    fn pads_an_rgb_f16_convolution_and_slices_its_output() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F16, [2, 3, 7, 5]).unwrap();
        let w = g.placeholder("w", DType::F16, [3, 3, 3, 5]).unwrap();
        let y = g
            .conv2d(x, w, [2, 1], Padding::Same, DataFormat::Nchw)
            .unwrap();
        g.set_outputs(vec![y]).unwrap();

        let (after, summary) = pad(&g);
        assert_eq!(
            summary.lines,
            ["pad-conv-channels: padded 1 16-bit convolutions to channel multiples of 8: Conv2D 1"]
        );
        // The 5 output channels are padded; the image keeps its 3.
        assert_eq!(filters(&after), [(vec![3, 3, 3, 8], Padding::Same)]);
        let padded = after.find("conv2d/padded").unwrap();
        assert_eq!(after.inputs(padded)[0], x);
        // The node keeps its name and type as the Slice of the padded convolution.
        assert_eq!(after.node(after.outputs()[0].node).op_name(), "Slice");
        assert_eq!(after.ty(after.outputs()[0]), g.ty(y));
    }

    #[test]
    fn pads_a_training_graphs_convolution_and_both_gradients_sharing_the_padding() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::BF16, [2, 5, 6, 3]).unwrap();
        let w1 = g.placeholder("w1", DType::BF16, [3, 3, 3, 12]).unwrap();
        let w2 = g.placeholder("w2", DType::BF16, [1, 1, 12, 16]).unwrap();
        let pads = Padding::Explicit([[2, 0], [1, 3]]);
        let h = g.conv2d(x, w1, [1, 1], pads, DataFormat::Nhwc).unwrap();
        let h = g.relu(h).unwrap();
        let y = g
            .conv2d(h, w2, [1, 1], Padding::Same, DataFormat::Nhwc)
            .unwrap();
        let loss = g.sum(y, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, w1, w2]).unwrap();
        g.set_outputs([vec![loss], grads].concat()).unwrap();

        let (after, summary) = pad(&g);
        assert_eq!(
            summary.lines[0],
            "pad-conv-channels: padded 6 16-bit convolutions to channel multiples of 8: \
             Conv2D 2, Conv2DBackpropFilter 2, Conv2DBackpropInput 2"
        );
        // Every op runs on channel multiples of 8 but the filter gradient of the
        // first convolution, which keeps x's 3 channels.
        let shapes: Vec<Vec<usize>> = filters(&after).into_iter().map(|(f, _)| f).collect();
        assert!(shapes.contains(&vec![3, 3, 3, 16]), "{shapes:?}");
        for f in shapes.iter().filter(|f| **f != [3, 3, 3, 16]) {
            assert_eq!((f[2] % 8, f[3] % 8), (0, 0), "{f:?}");
        }
        // The first convolution and its gradients keep its explicit pads.
        let explicit = |g: &Graph| filters(g).iter().filter(|(_, p)| *p == pads).count();
        assert_eq!((explicit(&g), explicit(&after)), (3, 3));
        // x, w1 (in and out channels), h and w2 (in channels), once each, shared by
        // the convolutions and their gradients; the first convolution's dy (12
        // channels) once for both of its gradients.
        assert_eq!(count(&after, "Concat"), 6);
        // Every op but the second convolution (16 output channels already) changes
        // its output's shape and is sliced back.
        assert_eq!(count(&after, "Slice"), 5);
    }

    /// A depthwise f16 convolution (3 channels, 3 groups) and its gradients: padding
    /// channels would regroup them, so none is padded.
    #[test]
    fn leaves_grouped_convolutions_alone() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F16, [2, 5, 6, 3]).unwrap();
        let w = g.placeholder("w", DType::F16, [3, 3, 1, 6]).unwrap();
        let conv = Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc).with_groups(3);
        let y = g.add(conv, &[x, w]).unwrap();
        let loss = g.sum(y, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, w]).unwrap();
        g.set_outputs([vec![loss], grads].concat()).unwrap();
        let before = g.len();
        let (after, summary) = pad(&g);
        assert!(summary.lines[0].starts_with("pad-conv-channels: padded 0 "));
        assert_eq!(after.len(), before);
        assert_eq!(filters(&after).len(), 3, "Conv2D and both gradients");
    }

    /// A squeeze-excitation's reduction, 24 channels to 6 and back on `[N, 1, 1, C]`,
    /// and its gradients: nothing padded.
    #[test]
    fn leaves_convolutions_of_one_pixel_alone() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F16, [4, 1, 1, 24]).unwrap();
        let w1 = g.placeholder("w1", DType::F16, [1, 1, 24, 6]).unwrap();
        let w2 = g.placeholder("w2", DType::F16, [1, 1, 6, 24]).unwrap();
        let h = g
            .conv2d(x, w1, [1, 1], Padding::Valid, DataFormat::Nhwc)
            .unwrap();
        let y = g
            .conv2d(h, w2, [1, 1], Padding::Valid, DataFormat::Nhwc)
            .unwrap();
        let loss = g.sum(y, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, w1, w2]).unwrap();
        g.set_outputs([vec![loss], grads].concat()).unwrap();
        let before = g.len();
        let (after, summary) = pad(&g);
        assert!(summary.lines[0].starts_with("pad-conv-channels: padded 0 "));
        assert_eq!(after.len(), before);
    }

    #[test]
    fn leaves_f32_and_aligned_convolutions_alone() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [1, 4, 4, 3]).unwrap();
        let w = g.placeholder("w", DType::F32, [3, 3, 3, 5]).unwrap();
        let a = g
            .conv2d(x, w, [1, 1], Padding::Same, DataFormat::Nhwc)
            .unwrap();
        let xh = g.placeholder("xh", DType::F16, [1, 8, 4, 4]).unwrap();
        let wh = g.placeholder("wh", DType::F16, [3, 3, 8, 16]).unwrap();
        let b = g
            .conv2d(xh, wh, [1, 1], Padding::Same, DataFormat::Nchw)
            .unwrap();
        g.set_outputs(vec![a, b]).unwrap();
        let before = g.len();
        let (after, _) = pad(&g);
        assert_eq!(after.len(), before);
    }
}
