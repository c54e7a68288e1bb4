//! torch_anchor.py's `ConvNet` as a graph on NCHW images, PyTorch's layout:
//! `LAYERS.len()` x (Conv2D 3x3, no bias + BatchNorm + Relu), the mean over H and W,
//! then Linear (MatMul + BiasAdd) to the classes.
//!
//! Convolutions pad explicitly one zero on every side, PyTorch's `padding=1`: the same
//! windows as PyTorch's at every stride (TensorFlow's SAME would pad (0, 1) at stride 2
//! on an even size). Symmetric, the padding goes to cuDNN with no copy of the input.
//!
//! Batch norms are PyTorch's `nn.BatchNorm2d` (epsilon 1e-5, scale ones, offset zeros,
//! running mean zeros and variance ones). In training they normalise with the batch's
//! statistics and the step updates the running averages as PyTorch does, with
//! momentum 0.1 and the unbiased batch variance: assignments of the Variables
//! `bn_<i>/moving_mean` and `bn_<i>/moving_variance` in the same step. Those Variables
//! are no input of a training BatchNorm (it reads empty statistics instead, which
//! BatchNorm allows in training), so the optimizer, which trains every Variable the
//! loss depends on, leaves them alone. In inference the batch norms read them.

use super::f32_variable;
use crate::nn;
use crate::ops::{AssignVariable, BatchNorm, DataFormat, Init, NormActivation, Padding};
use crate::{DType, Data, Graph, GraphError, Port, Result, Tensor};

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

/// `nn.BatchNorm2d`'s epsilon.
const BN_EPSILON: f64 = 1e-5;
/// `nn.BatchNorm2d`'s momentum: the batch statistics' weight in the running averages.
const BN_MOMENTUM: f64 = 0.1;

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
    // A training BatchNorm's mean and variance inputs, unread.
    let unread = if training {
        Some(g.constant(Tensor::new(vec![0], Data::F32(Vec::new())).map_err(GraphError::Format)?)?)
    } else {
        None
    };
    let keep = g.scalar(DType::F32, 1.0 - BN_MOMENTUM)?;
    let take = g.scalar(DType::F32, BN_MOMENTUM)?;
    let mut h = x;
    let mut running_updates = Vec::new();
    for (i, &(times, stride)) in LAYERS.iter().enumerate() {
        let (cin, cout) = (g.ty(h).shape[1], times * width);
        let kernel = f32_variable(
            g,
            format!("conv_{i}/kernel"),
            vec![3, 3, cin, cout],
            Init::GlorotUniform,
        )?;
        let y = g.conv2d(h, kernel, [stride, stride], PADDING, DataFormat::Nchw)?;
        let stat = |g: &mut Graph, leaf: &str, init| {
            f32_variable(g, format!("bn_{i}/{leaf}"), vec![cout], init)
        };
        let scale = stat(g, "scale", Init::Constant(1.0))?;
        let offset = stat(g, "offset", Init::Zeros)?;
        let moving_mean = stat(g, "moving_mean", Init::Zeros)?;
        let moving_variance = stat(g, "moving_variance", Init::Constant(1.0))?;
        let op = BatchNorm {
            epsilon: BN_EPSILON,
            training,
            data_format: DataFormat::Nchw,
            activation: NormActivation::Identity,
        };
        let (mean, variance) = unread.map_or((moving_mean, moving_variance), |e| (e, e));
        let y = g.add(op, &[y, scale, offset, mean, variance])?;
        if training {
            // running = (1 - momentum) * running + momentum * batch statistic
            let batch_stats = [Port::new(y.node, 1), Port::new(y.node, 2)];
            for (running, batch) in [moving_mean, moving_variance].into_iter().zip(batch_stats) {
                let kept = g.mul(running, keep)?;
                let taken = g.mul(batch, take)?;
                let next = g.plus(kept, taken)?;
                running_updates.push(g.add(AssignVariable, &[running, next])?);
            }
        }
        h = g.relu(y)?;
    }
    let pooled = g.mean(h, Some(&[2, 3]), false)?;
    Ok(ConvNet {
        logits: nn::dense(g, pooled, classes, None)?,
        running_updates,
    })
}
