//! torch_anchor.py's `ConvNet` as a graph on NCHW images, PyTorch's layout:
//! `LAYERS.len()` x (Conv2D 3x3, no bias + BatchNorm + Relu), the mean over H and W,
//! then Linear (MatMul + BiasAdd) to the classes.
//!
//! Convolutions pad explicitly one zero on every side, PyTorch's `padding=1`: the same
//! windows as PyTorch's at every stride (TensorFlow's SAME would pad (0, 1) at stride 2
//! on an even size). Symmetric, the padding goes to cuDNN with no copy of the input.
//!
//! Batch norms are PyTorch's `nn.BatchNorm2d` ([`BatchNorms`]).

use super::{f32_variable, BatchNorms, NormNames};
use crate::nn;
use crate::ops::{DataFormat, Init, NormActivation, Padding};
use crate::{Graph, Port, Result};

/// Each layer's output channels as a multiple of the width, and its stride:
/// torch_anchor.py's `cbr(3, c), cbr(c, c), cbr(c, 2 * c, 2), ...`.
pub const LAYERS: [(usize, usize); 8] = [
    (1, 1),
    (1, 1),
    (2, 2),
    (2, 1),
    (4, 2),
    (4, 1),
    (8, 2),
    (8, 1),
];

/// `nn.Conv2d(..., padding=1)`: one zero before and after each spatial axis.
pub const PADDING: Padding = Padding::Explicit([[1, 1], [1, 1]]);

/// What [`build`] made.
pub struct ConvNet {
    pub logits: Port,
    /// In training, the assignments of the running averages (none in inference).
    pub running_updates: Vec<Port>,
}

/// The convnet on `x [batch, 3, hw, hw]` with base width `width`; its batch norms in
/// training mode or not. Conv kernels are HWIO Variables `conv_<i>/kernel`, the batch
/// norms' `bn_<i>/scale`, `offset`, `moving_mean`, `moving_variance`, the head
/// `nn::dense`'s.
pub fn build(
    g: &mut Graph,
    x: Port,
    width: usize,
    classes: usize,
    training: bool,
) -> Result<ConvNet> {
    let mut norms = BatchNorms::new(g, training, NormNames::Keras)?;
    let mut h = x;
    for (i, &(times, stride)) in LAYERS.iter().enumerate() {
        let (cin, cout) = (g.ty(h).shape[1], times * width);
        let kernel = f32_variable(
            g,
            format!("conv_{i}/kernel"),
            vec![3, 3, cin, cout],
            Init::GlorotUniform,
        )?;
        let y = g.conv2d(h, kernel, [stride, stride], PADDING, DataFormat::Nchw)?;
        let y = norms.apply(g, y, &format!("bn_{i}"), NormActivation::Identity)?;
        h = g.relu(y)?;
    }
    let pooled = g.mean(h, Some(&[2, 3]), false)?;
    Ok(ConvNet {
        logits: nn::dense(g, pooled, classes, None)?,
        running_updates: norms.running_updates,
    })
}
