//! BERT with its masked-language-model head (Hugging Face's `BertForMaskedLM`) as a
//! graph: word, position and token-type embeddings and their LayerNorm, post-norm
//! encoder layers (self-attention with query, key and value projections, the output
//! projection, Add and LayerNorm; a 4x MLP with the exact GELU, Add and LayerNorm), and
//! the head (a dense layer, GELU, LayerNorm, and the decoder through the word
//! embedding, tied, plus its bias). [`BertConfig::BERT_BASE`] has
//! `bert-base-uncased`'s 109,514,298 parameters.
//!
//! Every sequence is one segment (token type 0) with no padding: the attention takes
//! no mask. The Variables are named as Hugging Face names the parameters
//! (`bert.encoder.layer.0.attention.self.query.weight`), Linear weights in torch's
//! `[out, in]` layout.

use super::{Heads, Transformer, WeightLayout};
use crate::ops::{Init, MatMul, Slice};
use crate::{Graph, Port, Result};

/// A BERT's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BertConfig {
    pub vocab: usize,
    /// The most positions (the position embedding's rows).
    pub positions: usize,
    pub token_types: usize,
    pub layers: usize,
    pub heads: usize,
    /// The hidden width (a multiple of `heads`).
    pub width: usize,
    /// The MLP's hidden width.
    pub intermediate: usize,
    /// The dropout after the embeddings and on each attention's and MLP's output
    /// (Hugging Face's `hidden_dropout_prob`, 0.1 in `bert-base-uncased`'s config).
    pub dropout: f64,
    /// The dropout on attention's probabilities (`attention_probs_dropout_prob`: 0.1
    /// in `bert-base-uncased`'s config), which `fuse-attention` fuses with the
    /// attention.
    pub attention_dropout: f64,
}

impl BertConfig {
    /// `bert-base-uncased`.
    pub const BERT_BASE: BertConfig = BertConfig {
        vocab: 30522,
        positions: 512,
        token_types: 2,
        layers: 12,
        heads: 12,
        width: 768,
        intermediate: 3072,
        dropout: 0.0,
        attention_dropout: 0.0,
    };
}

/// LayerNorm's epsilon in BERT.
const LN_EPSILON: f64 = 1e-12;

/// Encoder layer `name` on `x [rows, width]`.
fn layer(t: &mut Transformer, x: Port, name: &str, intermediate: usize) -> Result<Port> {
    let (c, heads) = (t.heads.width, t.heads);
    let mut qkv = Vec::with_capacity(3);
    for part in ["query", "key", "value"] {
        let p = t.linear(x, &format!("{name}.attention.self.{part}"), c)?;
        qkv.push(heads.of(t.g, p)?);
    }
    let y = heads.attention(t.g, [qkv[0], qkv[1], qkv[2]], None, t.attention_dropout)?;
    let y = t.linear(y, &format!("{name}.attention.output.dense"), c)?;
    let y = t.dropout(y)?;
    let x = t.g.plus(x, y)?;
    let x = t.layer_norm(x, &format!("{name}.attention.output.LayerNorm"))?;
    let h = t.linear(x, &format!("{name}.intermediate.dense"), intermediate)?;
    let h = t.g.gelu(h, false)?;
    let h = t.linear(h, &format!("{name}.output.dense"), c)?;
    let h = t.dropout(h)?;
    let x = t.g.plus(x, h)?;
    t.layer_norm(x, &format!("{name}.output.LayerNorm"))
}

/// BERT of `config` on `tokens [batch, seq]` (i64 ids): the masked-LM logits `[batch *
/// seq, vocab]`, row `b * seq + t` for position `t` of sequence `b`.
pub fn build(g: &mut Graph, tokens: Port, config: &BertConfig) -> Result<Port> {
    let shape = (config.positions, config.heads, config.width);
    let heads = Heads::of_tokens(g, tokens, ("BERT", config), shape, config.token_types > 0)?;
    let (batch, seq, c) = (heads.batch, heads.seq, config.width);
    let mut b = Transformer {
        g,
        heads,
        ln_epsilon: LN_EPSILON,
        layout: WeightLayout::OutIn,
        dropout: config.dropout,
        attention_dropout: config.attention_dropout,
    };
    let e = "bert.embeddings";
    let words = b.variable(
        &format!("{e}.word_embeddings.weight"),
        vec![config.vocab, c],
        Init::GlorotUniform,
    )?;
    let positions = b.variable(
        &format!("{e}.position_embeddings.weight"),
        vec![config.positions, c],
        Init::GlorotUniform,
    )?;
    let types = b.variable(
        &format!("{e}.token_type_embeddings.weight"),
        vec![config.token_types, c],
        Init::GlorotUniform,
    )?;
    let x = b.g.gather(words, tokens, 0)?;
    let position =
        b.g.add(Slice::new([0, 0], [seq as i64, c as i64]), &[positions])?;
    let segment = b.g.add(Slice::new([0, 0], [1, c as i64]), &[types])?;
    let x = b.g.plus(x, position)?;
    let x = b.g.plus(x, segment)?;
    let x = b.g.reshape(x, [(batch * seq) as i64, c as i64])?;
    let x = b.layer_norm(x, &format!("{e}.LayerNorm"))?;
    let mut x = b.dropout(x)?;
    for i in 0..config.layers {
        x = layer(
            &mut b,
            x,
            &format!("bert.encoder.layer.{i}"),
            config.intermediate,
        )?;
    }
    let head = "cls.predictions";
    let h = b.linear(x, &format!("{head}.transform.dense"), c)?;
    let h = b.g.gelu(h, false)?;
    let h = b.layer_norm(h, &format!("{head}.transform.LayerNorm"))?;
    // The decoder shares the word embedding: logits = h @ words^T + bias.
    let logits = b.g.add(MatMul::new(false, true), &[h, words])?;
    let bias = b.variable(&format!("{head}.bias"), vec![config.vocab], Init::Zeros)?;
    b.g.bias_add(logits, bias)
}
