//! GPT-2 (Hugging Face's `GPT2LMHeadModel`, llm.c's model) as a graph: token and
//! learned position embeddings, pre-norm blocks (LayerNorm, causal self-attention with
//! one packed q/k/v projection, LayerNorm, a 4x MLP with the tanh GELU), a final
//! LayerNorm and logits through the token embedding (tied). [`Gpt2Config::GPT2_124M`]
//! has the 124M model's 124,439,808 parameters.
//!
//! The Variables are named as Hugging Face names the parameters
//! (`transformer.h.0.attn.c_attn.weight`), in its layout (its `Conv1D` weights are
//! `[in, out]`, a MatMul's right operand here): a checkpoint's tensors load by name.
//! Attention is written out (`BatchMatMul(q, k, adj_y) * 1/sqrt(d) + causal mask ->
//! Softmax -> BatchMatMul`): `fuse-attention` makes it one causal FusedAttention.

use super::{Heads, Transformer, WeightLayout};
use crate::ops::{Init, MatMul, Slice};
use crate::{DType, Graph, GraphError, Port, Result, Tensor};

/// A GPT-2's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab: usize,
    /// The most positions (the position embedding's rows).
    pub positions: usize,
    pub layers: usize,
    pub heads: usize,
    /// The residual stream's width (a multiple of `heads`).
    pub width: usize,
    /// The dropout after the embeddings and on each attention's and MLP's output
    /// (Hugging Face's `embd_pdrop` and `resid_pdrop`: 0.1 in its config, 0 in
    /// llm.c's).
    pub dropout: f64,
    /// The dropout on attention's probabilities (`attn_pdrop`: 0.1 in Hugging Face's
    /// config, 0 in llm.c's), which `fuse-attention` fuses with the attention.
    pub attention_dropout: f64,
}

impl Gpt2Config {
    /// The 124M GPT-2 (Hugging Face's `gpt2`, llm.c's `gpt2_124M`).
    pub const GPT2_124M: Gpt2Config = Gpt2Config {
        vocab: 50257,
        positions: 1024,
        layers: 12,
        heads: 12,
        width: 768,
        dropout: 0.0,
        attention_dropout: 0.0,
    };
}

/// LayerNorm's epsilon in GPT-2.
const LN_EPSILON: f64 = 1e-5;

/// Causal self-attention `name` of `x [rows, width]` with the `causal` mask.
fn attention(t: &mut Transformer, x: Port, name: &str, causal: Port) -> Result<Port> {
    let (c, heads) = (t.heads.width, t.heads);
    let qkv = t.linear(x, &format!("{name}.c_attn"), 3 * c)?;
    let [q, k, v] = [0, c, 2 * c].map(|from| heads.split(t.g, qkv, from));
    let y = heads.attention(t.g, [q?, k?, v?], Some(causal), t.attention_dropout)?;
    let y = t.linear(y, &format!("{name}.c_proj"), c)?;
    t.dropout(y)
}

/// Block `i` on the residual stream `x`.
fn block(t: &mut Transformer, x: Port, i: usize, causal: Port) -> Result<Port> {
    let c = t.heads.width;
    let name = format!("transformer.h.{i}");
    let h = t.layer_norm(x, &format!("{name}.ln_1"))?;
    let h = attention(t, h, &format!("{name}.attn"), causal)?;
    let x = t.g.plus(x, h)?;
    let h = t.layer_norm(x, &format!("{name}.ln_2"))?;
    let h = t.linear(h, &format!("{name}.mlp.c_fc"), 4 * c)?;
    let h = t.g.gelu(h, true)?;
    let h = t.linear(h, &format!("{name}.mlp.c_proj"), c)?;
    let h = t.dropout(h)?;
    t.g.plus(x, h)
}

/// `[seq, seq]` of `-inf` above the diagonal and 0 elsewhere: position `i` attends to
/// `0..=i`.
fn causal_mask(g: &mut Graph, seq: usize) -> Result<Port> {
    let values: Vec<f64> = (0..seq * seq)
        .map(|at| {
            if at % seq > at / seq {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_f64(DType::F32, [seq, seq], &values).map_err(GraphError::Format)?;
    g.constant(mask)
}

/// GPT-2 of `config` on `tokens [batch, seq]` (i64 ids): the logits `[batch * seq,
/// vocab]`, row `b * seq + t` predicting the token after position `t` of sequence `b`.
pub fn build(g: &mut Graph, tokens: Port, config: &Gpt2Config) -> Result<Port> {
    let shape = (config.positions, config.heads, config.width);
    let heads = Heads::of_tokens(g, tokens, ("GPT-2", config), shape, config.layers > 0)?;
    let (batch, seq) = (heads.batch, heads.seq);
    let mut b = Transformer {
        g,
        heads,
        ln_epsilon: LN_EPSILON,
        layout: WeightLayout::InOut,
        dropout: config.dropout,
        attention_dropout: config.attention_dropout,
    };
    let c = config.width;
    let wte = b.variable(
        "transformer.wte.weight",
        vec![config.vocab, c],
        Init::GlorotUniform,
    )?;
    let wpe = b.variable(
        "transformer.wpe.weight",
        vec![config.positions, c],
        Init::GlorotUniform,
    )?;
    let tok = b.g.gather(wte, tokens, 0)?;
    let pos =
        b.g.add(Slice::new([0, 0], [seq as i64, c as i64]), &[wpe])?;
    let x = b.g.plus(tok, pos)?;
    let x = b.dropout(x)?;
    let mut x = b.g.reshape(x, [(batch * seq) as i64, c as i64])?;
    let causal = causal_mask(b.g, seq)?;
    for i in 0..config.layers {
        x = block(&mut b, x, i, causal)?;
    }
    let x = b.layer_norm(x, "transformer.ln_f")?;
    // lm_head shares the token embedding: logits = x @ wte^T.
    b.g.add(MatMul::new(false, true), &[x, wte])
}
