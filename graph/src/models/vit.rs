//! torchvision's Vision Transformer (`vit_b_16`) as a graph: 16x16 patches embedded by
//! a strided convolution, a class token, learned position embeddings, pre-norm encoder
//! layers (LayerNorm, multi-head self-attention with one packed in-projection,
//! LayerNorm, a 4x MLP with the exact GELU), a final LayerNorm and a Linear head on the
//! class token. [`VitConfig::VIT_B_16`] has `vit_b_16`'s 86,567,656 parameters.
//!
//! The Variables are named as torchvision names the parameters
//! (`encoder.layers.encoder_layer_0.self_attention.in_proj_weight`), Linear weights in
//! its `[out, in]` layout (the product reads them transposed); the patch embedding's
//! kernel is HWIO (`[16, 16, 3, width]`, torch's OIHW transposed).

use super::{Heads, Transformer, WeightLayout};
use crate::ops::{BroadcastTo, DataFormat, Init, Padding, Slice};
use crate::{Graph, GraphError, Port, Result};

/// A ViT's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VitConfig {
    pub image: usize,
    pub patch: usize,
    pub layers: usize,
    pub heads: usize,
    /// The residual stream's width (a multiple of `heads`).
    pub width: usize,
    /// The MLP's hidden width.
    pub mlp: usize,
    pub classes: usize,
}

impl VitConfig {
    /// torchvision's `vit_b_16`.
    pub const VIT_B_16: VitConfig = VitConfig {
        image: 224,
        patch: 16,
        layers: 12,
        heads: 12,
        width: 768,
        mlp: 3072,
        classes: 1000,
    };
}

/// LayerNorm's epsilon in torchvision's ViT.
const LN_EPSILON: f64 = 1e-6;

/// Encoder layer `name` on the residual stream `x`.
fn layer(t: &mut Transformer, x: Port, name: &str, mlp: usize) -> Result<Port> {
    let (c, heads) = (t.heads.width, t.heads);
    let h = t.layer_norm(x, &format!("{name}.ln_1"))?;
    let attn = format!("{name}.self_attention");
    let packed = (
        format!("{attn}.in_proj_weight"),
        format!("{attn}.in_proj_bias"),
    );
    let qkv = t.linear_named(h, (&packed.0, &packed.1), 3 * c)?;
    let [q, k, v] = [0, c, 2 * c].map(|from| heads.split(t.g, qkv, from));
    let y = heads.attention(t.g, [q?, k?, v?], None, t.attention_dropout)?;
    let y = t.linear(y, &format!("{attn}.out_proj"), c)?;
    let x = t.g.plus(x, y)?;
    let h = t.layer_norm(x, &format!("{name}.ln_2"))?;
    // torchvision's MLPBlock: Linear (0), GELU, Dropout, Linear (3), Dropout.
    let h = t.linear(h, &format!("{name}.mlp.0"), mlp)?;
    let h = t.g.gelu(h, false)?;
    let h = t.linear(h, &format!("{name}.mlp.3"), c)?;
    t.g.plus(x, h)
}

/// The ViT of `config` on `x [batch, 3, image, image]` (NCHW): the logits `[batch,
/// classes]`.
pub fn build(g: &mut Graph, x: Port, config: &VitConfig) -> Result<Port> {
    let ty = g.ty(x).clone();
    let side = config.image;
    let fits = config.patch > 0
        && side % config.patch == 0
        && config.heads > 0
        && config.width % config.heads == 0;
    let [batch, 3, h, w] = ty.shape[..] else {
        return Err(GraphError::Format(format!(
            "a ViT takes NCHW RGB images, got {ty}"
        )));
    };
    if !fits || [h, w] != [side, side] {
        return Err(GraphError::Format(format!(
            "a ViT of {config:?} takes {side}x{side} images in whole patches, got {ty}"
        )));
    }
    let (c, p) = (config.width, config.patch);
    let patches = (side / p) * (side / p);
    let seq = patches + 1;
    let mut b = Transformer {
        g,
        heads: Heads {
            batch,
            seq,
            heads: config.heads,
            width: c,
        },
        ln_epsilon: LN_EPSILON,
        layout: WeightLayout::OutIn,
        // torchvision's vit_b_16 trains without dropout.
        dropout: 0.0,
        attention_dropout: 0.0,
    };
    let kernel = b.variable("conv_proj.weight", vec![p, p, 3, c], Init::HeNormal)?;
    let bias = b.variable("conv_proj.bias", vec![c], Init::Zeros)?;
    let y =
        b.g.conv2d(x, kernel, [p, p], Padding::Valid, DataFormat::Nchw)?;
    let y = b.g.bias_add_format(y, bias, DataFormat::Nchw)?;
    let y = b.g.reshape(y, [batch as i64, c as i64, patches as i64])?;
    let tokens = b.g.transpose(y, [0, 2, 1])?;
    let class_token = b.variable("class_token", vec![1, 1, c], Init::Zeros)?;
    let class_tokens = b.g.add(BroadcastTo::new([batch, 1, c]), &[class_token])?;
    let x = b.g.concat(&[class_tokens, tokens], 1)?;
    let positions = b.variable(
        "encoder.pos_embedding",
        vec![1, seq, c],
        Init::GlorotUniform,
    )?;
    let x = b.g.plus(x, positions)?;
    let mut x = b.g.reshape(x, [(batch * seq) as i64, c as i64])?;
    for i in 0..config.layers {
        x = layer(
            &mut b,
            x,
            &format!("encoder.layers.encoder_layer_{i}"),
            config.mlp,
        )?;
    }
    let x = b.layer_norm(x, "encoder.ln")?;
    // The head reads the class token of each image.
    let x = b.g.reshape(x, [batch as i64, seq as i64, c as i64])?;
    let first =
        b.g.add(Slice::new([0, 0, 0], [batch as i64, 1, c as i64]), &[x])?;
    let first = b.g.reshape(first, [batch as i64, c as i64])?;
    b.linear(first, "heads.head", config.classes)
}
