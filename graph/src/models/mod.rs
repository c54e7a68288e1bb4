//! Whole models as graphs, for examples, benchmarks and tests: each builds its forward
//! graph from an input Placeholder, naming its Variables so that a training and an
//! inference graph built alike share them.

pub mod bert;
pub mod convnet;
pub mod gpt2;
pub mod resnet;
pub mod vit;

use crate::ops::{
    AssignVariable, BatchNorm, DataFormat, Init, MatMul, NormActivation, Slice, Variable,
};
use crate::{DType, Data, Graph, GraphError, Port, Result, Tensor, TensorType};

/// An f32 Variable named `name` starting at `init`.
pub fn f32_variable(g: &mut Graph, name: String, shape: Vec<usize>, init: Init) -> Result<Port> {
    let ty = TensorType::new(DType::F32, shape);
    Ok(
        g.add_node(name, Box::new(Variable::with_init(ty, init)), &[])?
            .into(),
    )
}

/// `nn.BatchNorm2d`'s epsilon.
const BN_EPSILON: f64 = 1e-5;
/// `nn.BatchNorm2d`'s momentum: the batch statistics' weight in the running averages.
const BN_MOMENTUM: f64 = 0.1;

/// How a model names its batch norms' Variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormNames {
    /// `<name>/scale`, `/offset`, `/moving_mean`, `/moving_variance` (Keras's, the
    /// convnet's).
    Keras,
    /// `<name>.weight`, `.bias`, `.running_mean`, `.running_var` (torch's state dict).
    Torch,
}

impl NormNames {
    /// The names of the scale, offset, running mean and running variance.
    fn of(self, name: &str) -> [String; 4] {
        let (sep, leaves) = match self {
            NormNames::Keras => ('/', ["scale", "offset", "moving_mean", "moving_variance"]),
            NormNames::Torch => ('.', ["weight", "bias", "running_mean", "running_var"]),
        };
        leaves.map(|leaf| format!("{name}{sep}{leaf}"))
    }

    /// Whether `variable` is a running average (a buffer in PyTorch, no parameter).
    pub fn is_running_average(variable: &str) -> bool {
        [
            "/moving_mean",
            "/moving_variance",
            ".running_mean",
            ".running_var",
        ]
        .iter()
        .any(|suffix| variable.ends_with(suffix))
    }
}

/// PyTorch's `nn.BatchNorm2d` on NCHW images (epsilon 1e-5, scale ones, offset zeros,
/// running mean zeros and variance ones), for a model's every batch norm, its
/// Variables named as [`NormNames`] says.
///
/// In training they normalise with the batch's statistics and the step updates the
/// running averages as PyTorch does, with momentum 0.1 and the unbiased batch
/// variance: assignments of the running averages' Variables in the same step
/// ([`running_updates`](Self::running_updates)).
/// Those Variables are no input of a training BatchNorm (it reads empty statistics
/// instead, which BatchNorm allows in training), so the optimizer, which trains every
/// Variable the loss depends on, leaves them alone. In inference the batch norms read
/// them.
pub struct BatchNorms {
    training: bool,
    names: NormNames,
    /// A training BatchNorm's mean and variance inputs, unread.
    unread: Option<Port>,
    keep: Port,
    take: Port,
    /// In training, the assignments of the running averages (none in inference).
    pub running_updates: Vec<Port>,
}

impl BatchNorms {
    pub fn new(g: &mut Graph, training: bool, names: NormNames) -> Result<BatchNorms> {
        let unread = if training {
            let empty = Tensor::new(vec![0], Data::F32(Vec::new())).map_err(GraphError::Format)?;
            Some(g.constant(empty)?)
        } else {
            None
        };
        Ok(BatchNorms {
            training,
            names,
            unread,
            keep: g.scalar(DType::F32, 1.0 - BN_MOMENTUM)?,
            take: g.scalar(DType::F32, BN_MOMENTUM)?,
            running_updates: Vec::new(),
        })
    }

    /// The batch norm `name` of the NCHW `y`, then `activation`.
    pub fn apply(
        &mut self,
        g: &mut Graph,
        y: Port,
        name: &str,
        activation: NormActivation,
    ) -> Result<Port> {
        let channels = g.ty(y).shape[1];
        let [scale, offset, mean, variance] = self.names.of(name);
        let stat = |g: &mut Graph, name, init| f32_variable(g, name, vec![channels], init);
        let scale = stat(g, scale, Init::Constant(1.0))?;
        let offset = stat(g, offset, Init::Zeros)?;
        let moving_mean = stat(g, mean, Init::Zeros)?;
        let moving_variance = stat(g, variance, Init::Constant(1.0))?;
        let op = BatchNorm {
            epsilon: BN_EPSILON,
            training: self.training,
            data_format: DataFormat::Nchw,
            activation,
            ..BatchNorm::default()
        };
        let (mean, variance) = self
            .unread
            .map_or((moving_mean, moving_variance), |e| (e, e));
        let out = g.add(op, &[y, scale, offset, mean, variance])?;
        if self.training {
            // running = (1 - momentum) * running + momentum * batch statistic
            let batch_stats = [Port::new(out.node, 1), Port::new(out.node, 2)];
            for (running, batch) in [moving_mean, moving_variance].into_iter().zip(batch_stats) {
                let kept = g.mul(running, self.keep)?;
                let taken = g.mul(batch, self.take)?;
                let next = g.plus(kept, taken)?;
                self.running_updates
                    .push(g.add(AssignVariable, &[running, next])?);
            }
        }
        Ok(out)
    }
}

/// The shape of a transformer's batch: sequences, positions, heads, the residual
/// stream's width.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub width: usize,
}

impl Heads {
    /// The heads of a language model `model` (its `config` for messages) on `tokens`,
    /// i64 ids `[batch, seq]` of at most `positions`, its `width` split into `heads`;
    /// `fits`: the model's own checks of its config passed.
    pub fn of_tokens(
        g: &Graph,
        tokens: Port,
        (model, config): (&str, &dyn std::fmt::Debug),
        (positions, heads, width): (usize, usize, usize),
        fits: bool,
    ) -> Result<Heads> {
        let ty = g.ty(tokens);
        let [batch, seq] = ty.shape[..] else {
            return Err(GraphError::Format(format!(
                "{model} takes token ids [batch, seq], got {ty}"
            )));
        };
        let fits = fits && heads > 0 && width % heads == 0;
        if !fits || seq == 0 || seq > positions || ty.dtype != DType::I64 {
            return Err(GraphError::Format(format!(
                "{model} takes i64 token ids of at most {positions} positions and a width \
                 divisible by its heads, got {ty} and {config:?}"
            )));
        }
        Ok(Heads {
            batch,
            seq,
            heads,
            width,
        })
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Columns `from..from + width` of a packed projection `x [rows, 3 * width]` as
    /// heads `[batch, heads, seq, width / heads]`.
    pub fn split(&self, g: &mut Graph, x: Port, from: usize) -> Result<Port> {
        let size = [self.rows() as i64, self.width as i64];
        let part = g.add(Slice::new([0, from], size), &[x])?;
        self.of(g, part)
    }

    /// A projection `x [rows, width]` as heads `[batch, heads, seq, width / heads]`.
    pub fn of(&self, g: &mut Graph, x: Port) -> Result<Port> {
        let dims = [self.batch, self.seq, self.heads, self.width / self.heads];
        let x = g.reshape(x, dims.map(|d| d as i64))?;
        g.transpose(x, [0, 2, 1, 3])
    }

    /// `softmax(q k^T / sqrt(d) + mask) v` of heads `[batch, heads, seq, d]`, merged
    /// back to `[rows, width]`, the probabilities through a dropout of `dropout`
    /// (none at 0). Written out as `fuse-attention` finds it.
    pub fn attention(
        &self,
        g: &mut Graph,
        [q, k, v]: [Port; 3],
        mask: Option<Port>,
        dropout: f64,
    ) -> Result<Port> {
        let scores = g.batch_matmul_adj(q, k, false, true)?;
        let head_width = (self.width / self.heads) as f64;
        let scale = g.scalar(DType::F32, 1.0 / head_width.sqrt())?;
        let mut scores = g.mul(scores, scale)?;
        if let Some(mask) = mask {
            scores = g.plus(scores, mask)?;
        }
        let p = g.softmax(scores, -1)?;
        let p = crate::nn::dropout(g, p, dropout)?;
        let y = g.batch_matmul(p, v)?;
        let y = g.transpose(y, [0, 2, 1, 3])?;
        g.reshape(y, [self.rows() as i64, self.width as i64])
    }
}

/// How a checkpoint lays out a linear layer's weight.
#[derive(Clone, Copy, Debug)]
pub(crate) enum WeightLayout {
    /// `[in, out]`: Hugging Face's `Conv1D` (GPT-2), the product's right operand.
    InOut,
    /// `[out, in]`: torch's `nn.Linear`, read transposed by the product.
    OutIn,
}

/// A transformer under construction: its graph, the shape of its batch, its layer
/// norms' epsilon and its linear layers' weight layout.
pub(crate) struct Transformer<'a> {
    pub g: &'a mut Graph,
    pub heads: Heads,
    pub ln_epsilon: f64,
    pub layout: WeightLayout,
    /// The rate of the dropouts on the embeddings and each sublayer's output.
    pub dropout: f64,
    /// The rate of the dropout on attention's probabilities.
    pub attention_dropout: f64,
}

impl Transformer<'_> {
    /// `x` through a dropout at the model's rate (nothing at 0).
    pub fn dropout(&mut self, x: Port) -> Result<Port> {
        crate::nn::dropout(self.g, x, self.dropout)
    }

    pub fn variable(&mut self, name: &str, shape: Vec<usize>, init: Init) -> Result<Port> {
        f32_variable(self.g, name.to_string(), shape, init)
    }

    /// `nn.LayerNorm` `name` (`name.weight`, `name.bias`) over the last axis of
    /// `x [rows, width]`.
    pub fn layer_norm(&mut self, x: Port, name: &str) -> Result<Port> {
        let c = self.heads.width;
        let gamma = self.variable(&format!("{name}.weight"), vec![c], Init::Constant(1.0))?;
        let beta = self.variable(&format!("{name}.bias"), vec![c], Init::Zeros)?;
        self.g.layer_norm(x, gamma, beta, 1, self.ln_epsilon)
    }

    /// The linear layer `name` (`name.weight`, `name.bias`) of `x [rows, in]`.
    pub fn linear(&mut self, x: Port, name: &str, out: usize) -> Result<Port> {
        let names = (format!("{name}.weight"), format!("{name}.bias"));
        self.linear_named(x, (&names.0, &names.1), out)
    }

    /// The linear layer of `x [rows, in]` with its weight and bias named as given.
    pub fn linear_named(
        &mut self,
        x: Port,
        (weight, bias): (&str, &str),
        out: usize,
    ) -> Result<Port> {
        let inputs = self.g.ty(x).shape[1];
        let (shape, transposed) = match self.layout {
            WeightLayout::InOut => (vec![inputs, out], false),
            WeightLayout::OutIn => (vec![out, inputs], true),
        };
        let w = self.variable(weight, shape, Init::GlorotUniform)?;
        let b = self.variable(bias, vec![out], Init::Zeros)?;
        let y = self.g.add(MatMul::new(false, transposed), &[x, w])?;
        self.g.bias_add(y, b)
    }
}
