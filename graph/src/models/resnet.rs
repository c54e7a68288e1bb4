//! torchvision's ResNet (v1.5: a bottleneck's stride on its 3x3 convolution, as NVIDIA
//! trains it) on NCHW images: a 7x7 stride-2 stem, a 3x3 stride-2 max pool, four
//! stages of bottlenecks (1x1, 3x3, 1x1 with 4x the width, the input added back through
//! a 1x1 strided projection where the shape changes), the mean over H and W, and a
//! Linear to the classes. [`ResNetConfig::RESNET50`] is `torchvision.models.resnet50`:
//! 25,557,032 trainable parameters.
//!
//! Convolutions have no bias and pad as PyTorch's `padding=k // 2` (symmetric: cuDNN
//! takes it with no copy); batch norms are [`BatchNorms`]. The Variables are named as
//! torchvision's state dict names them (`layer1.0.conv2.weight`, `layer1.0.bn2.
//! running_var`, `layer2.0.downsample.0.weight`, `fc.weight`): kernels HWIO (torch's
//! OIHW transposed, as `pretrained` loads them), the head's weight `[classes, in]`.
//! Kernels start He-normal, the head Glorot-uniform.

use super::{f32_variable, BatchNorms, NormNames};
use crate::ops::{DataFormat, Init, MatMul, NormActivation, Padding};
use crate::{Graph, GraphError, Port, Result};

/// A ResNet's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// Bottlenecks per stage.
    pub blocks: [usize; 4],
    /// The first stage's bottleneck width (64); each stage doubles it, and a
    /// bottleneck's output is 4x its width.
    pub width: usize,
    pub classes: usize,
}

impl ResNetConfig {
    /// torchvision's `resnet50`.
    pub const RESNET50: ResNetConfig = ResNetConfig {
        blocks: [3, 4, 6, 3],
        width: 64,
        classes: 1000,
    };
}

/// A bottleneck's output channels over its width.
const EXPANSION: usize = 4;

/// What [`build`] made.
pub struct ResNet {
    pub logits: Port,
    /// In training, the assignments of the batch norms' running averages.
    pub running_updates: Vec<Port>,
}

/// The convolutions and batch norms of one model under construction.
struct Layers<'a> {
    g: &'a mut Graph,
    norms: BatchNorms,
}

impl Layers<'_> {
    /// A `k x k` convolution `conv.weight` of NCHW `x` to `cout` channels at `stride`,
    /// padded `k / 2` on every side, then its batch norm `bn` and a Relu where `relu`
    /// (`fuse-batchnorm-activation` folds it into the norm).
    fn conv_bn(
        &mut self,
        x: Port,
        (conv, bn): (&str, &str),
        (cout, k, stride): (usize, usize, usize),
        relu: bool,
    ) -> Result<Port> {
        let cin = self.g.ty(x).shape[1];
        let kernel = f32_variable(
            self.g,
            format!("{conv}.weight"),
            vec![k, k, cin, cout],
            Init::HeNormal,
        )?;
        let pad = Padding::Explicit([[k / 2; 2]; 2]);
        let y = self
            .g
            .conv2d(x, kernel, [stride, stride], pad, DataFormat::Nchw)?;
        let identity = NormActivation::Identity;
        let y = self.norms.apply(self.g, y, bn, identity)?;
        if relu {
            self.g.relu(y)
        } else {
            Ok(y)
        }
    }

    /// One bottleneck `name` of `width` at `stride`.
    fn bottleneck(&mut self, x: Port, name: &str, width: usize, stride: usize) -> Result<Port> {
        let out = width * EXPANSION;
        let pair = |i: usize| (format!("{name}.conv{i}"), format!("{name}.bn{i}"));
        let (c, b) = pair(1);
        let h = self.conv_bn(x, (&c, &b), (width, 1, 1), true)?;
        let (c, b) = pair(2);
        let h = self.conv_bn(h, (&c, &b), (width, 3, stride), true)?;
        let (c, b) = pair(3);
        let h = self.conv_bn(h, (&c, &b), (out, 1, 1), false)?;
        let shortcut = if stride != 1 || self.g.ty(x).shape[1] != out {
            let (c, b) = (
                format!("{name}.downsample.0"),
                format!("{name}.downsample.1"),
            );
            self.conv_bn(x, (&c, &b), (out, 1, stride), false)?
        } else {
            x
        };
        let sum = self.g.plus(h, shortcut)?;
        self.g.relu(sum)
    }
}

/// The ResNet of `config` on `x [batch, 3, h, w]`, its batch norms in training mode or
/// not.
pub fn build(g: &mut Graph, x: Port, config: &ResNetConfig, training: bool) -> Result<ResNet> {
    if g.ty(x).rank() != 4 || config.width == 0 || config.classes == 0 {
        return Err(GraphError::Format(format!(
            "a ResNet takes NCHW images and a positive width and class count, got {} and \
             {config:?}",
            g.ty(x)
        )));
    }
    let mut layers = Layers {
        norms: BatchNorms::new(g, training, NormNames::Torch)?,
        g,
    };
    let stem = layers.conv_bn(x, ("conv1", "bn1"), (config.width, 7, 2), true)?;
    let pad = Padding::Explicit([[1, 1], [1, 1]]);
    let mut h = layers
        .g
        .max_pool(stem, [3, 3], [2, 2], pad, DataFormat::Nchw)?;
    for (stage, &blocks) in config.blocks.iter().enumerate() {
        let width = config.width << stage;
        for block in 0..blocks {
            let stride = if stage > 0 && block == 0 { 2 } else { 1 };
            h = layers.bottleneck(h, &format!("layer{}.{block}", stage + 1), width, stride)?;
        }
    }
    let g = layers.g;
    let pooled = g.mean(h, Some(&[2, 3]), false)?;
    let features = g.ty(pooled).shape[1];
    let w = f32_variable(
        g,
        "fc.weight".into(),
        vec![config.classes, features],
        Init::GlorotUniform,
    )?;
    let b = f32_variable(g, "fc.bias".into(), vec![config.classes], Init::Zeros)?;
    let logits = g.add(MatMul::new(false, true), &[pooled, w])?;
    Ok(ResNet {
        logits: g.bias_add(logits, b)?,
        running_updates: layers.norms.running_updates,
    })
}
