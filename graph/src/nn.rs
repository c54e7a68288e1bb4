//! Layers in the manner of Keras: each creates its Variables and ops under a fresh
//! scope (`dense`, `dense_1`, ...), so a model reads as docs/design.md §6 shows:
//!
//! ```
//! use ampgraph_graph::nn::{self, Activation};
//! use ampgraph_graph::{DType, Graph};
//! # fn main() -> ampgraph_graph::Result<()> {
//! let mut g = Graph::new();
//! let x = g.placeholder("x", DType::F32, [128, 784])?;
//! let h = nn::dense(&mut g, x, 512, Some(Activation::Gelu))?;
//! let logits = nn::dense(&mut g, h, 10, None)?;
//! assert_eq!(g.ty(logits).shape, [128, 10]);
//! assert!(g.find("dense_1/kernel").is_some());
//! # Ok(()) }
//! ```
//!
//! Variables carry Keras' initialisers as their `init` attr (kernels Glorot-uniform,
//! biases, offsets and moving means zeros, scales and moving variances ones); the
//! session fills them. A layer that fails (a wrong input shape) leaves the graph as it
//! was.

use std::collections::HashSet;

use crate::dtype::DType;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId, Port};
use crate::op::Op;
use crate::ops::{
    step_count, BatchNorm, BiasAdd, Conv2D, DataFormat, Dropout, Init, MatMul, Padding, Unary,
    UnaryKind, Variable,
};
use crate::tensor::{checked_numel, ShapeDisplay, TensorType};

/// The activations a layer can end with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Relu,
    /// Exact (erf) GELU, Keras' default.
    Gelu,
    Tanh,
    Sigmoid,
}

impl Activation {
    /// The elementwise op this activation adds.
    pub fn kind(self) -> UnaryKind {
        match self {
            Activation::Relu => UnaryKind::Relu,
            Activation::Gelu => UnaryKind::Gelu { approximate: false },
            Activation::Tanh => UnaryKind::Tanh,
            Activation::Sigmoid => UnaryKind::Sigmoid,
        }
    }
}

/// What [`dense_layer`] created: `output = act(x @ kernel + bias)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dense {
    /// Variable `<scope>/kernel`, `[in, units]`.
    pub kernel: Port,
    /// Variable `<scope>/bias`, `[units]`.
    pub bias: Port,
    pub output: Port,
}

/// What [`conv2d_layer`] created: `output = act(conv2d(x, kernel) + bias)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dLayer {
    /// Variable `<scope>/kernel`, HWIO `[h, w, in, filters]`.
    pub kernel: Port,
    /// Variable `<scope>/bias`, `[filters]`.
    pub bias: Port,
    pub output: Port,
}

/// What [`batch_norm_layer`] created. The statistics Variables are `[C]` in f32 (f64
/// when `x` is f64), as BatchNorm wants them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormLayer {
    pub scale: Port,
    pub offset: Port,
    pub moving_mean: Port,
    pub moving_variance: Port,
    /// The normalised `x`.
    pub output: Port,
    /// The batch statistics (the moving averages in inference), for updating the
    /// moving averages in training.
    pub batch_mean: Port,
    pub batch_variance: Port,
}

/// A fully connected layer on `x [N, in]`: returns `act(x @ kernel + bias)`, `[N, units]`.
pub fn dense(g: &mut Graph, x: Port, units: usize, activation: Option<Activation>) -> Result<Port> {
    dense_layer(g, x, units, activation).map(|d| d.output)
}

/// [`dense`], returning the Variables it created too.
pub fn dense_layer(
    g: &mut Graph,
    x: Port,
    units: usize,
    activation: Option<Activation>,
) -> Result<Dense> {
    let mut s = Scope::new(g, "dense", "Dense");
    let r = build_dense(&mut s, x, units, activation);
    s.finish(r)
}

fn build_dense(s: &mut Scope, x: Port, units: usize, act: Option<Activation>) -> Result<Dense> {
    let ty = s.input_type(x)?;
    let [_, inputs] = ty.shape[..] else {
        return Err(s.error(format!(
            "input must have rank 2 [N, features], got shape {}",
            ShapeDisplay(&ty.shape)
        )));
    };
    if units == 0 {
        return Err(s.error("units must be positive"));
    }
    let kernel = s.variable("kernel", ty.dtype, vec![inputs, units], Init::GlorotUniform)?;
    let bias = s.variable("bias", ty.dtype, vec![units], Init::Zeros)?;
    let y = s.node("matmul", MatMul::new(false, false), &[x, kernel])?;
    let y = s.node("bias_add", nhwc_bias_add(), &[y, bias])?;
    let output = s.activation(y, act)?;
    Ok(Dense {
        kernel,
        bias,
        output,
    })
}

/// A 2-D convolution layer on NHWC `x` with an HWIO kernel `[h, w, in, filters]` and a
/// bias `[filters]`: returns `act(conv2d(x, kernel) + bias)`.
pub fn conv2d_layer(
    g: &mut Graph,
    x: Port,
    filters: usize,
    kernel: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    activation: Option<Activation>,
) -> Result<Conv2dLayer> {
    let mut s = Scope::new(g, "conv2d", "Conv2DLayer");
    let r = build_conv2d(&mut s, x, filters, kernel, strides, padding, activation);
    s.finish(r)
}

fn build_conv2d(
    s: &mut Scope,
    x: Port,
    filters: usize,
    [kh, kw]: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    act: Option<Activation>,
) -> Result<Conv2dLayer> {
    let ty = s.input_type(x)?;
    let [_, _, _, channels] = ty.shape[..] else {
        return Err(s.error(format!(
            "input must have rank 4 NHWC, got shape {}",
            ShapeDisplay(&ty.shape)
        )));
    };
    if filters == 0 || kh == 0 || kw == 0 {
        return Err(s.error(format!(
            "filters and kernel size must be positive, got {filters} filters of {kh}x{kw}"
        )));
    }
    let kernel = s.variable(
        "kernel",
        ty.dtype,
        vec![kh, kw, channels, filters],
        Init::GlorotUniform,
    )?;
    let bias = s.variable("bias", ty.dtype, vec![filters], Init::Zeros)?;
    let conv = Conv2D::new(strides, padding, DataFormat::Nhwc);
    let y = s.node("conv2d", conv, &[x, kernel])?;
    let y = s.node("bias_add", nhwc_bias_add(), &[y, bias])?;
    let output = s.activation(y, act)?;
    Ok(Conv2dLayer {
        kernel,
        bias,
        output,
    })
}

/// Batch normalisation of `x` (NHWC rank 4, or `[N, C]`) over its last axis, with
/// Variables `<scope>/scale`, `offset`, `moving_mean`, `moving_variance`, each `[C]`.
pub fn batch_norm_layer(g: &mut Graph, x: Port, training: bool) -> Result<BatchNormLayer> {
    let mut s = Scope::new(g, "batch_norm", "BatchNormLayer");
    let r = build_batch_norm(&mut s, x, training);
    s.finish(r)
}

fn build_batch_norm(s: &mut Scope, x: Port, training: bool) -> Result<BatchNormLayer> {
    let ty = s.input_type(x)?;
    let channels = match ty.shape[..] {
        [_, c] | [_, _, _, c] => c,
        _ => {
            return Err(s.error(format!(
                "input must have rank 4 NHWC or rank 2 [N, C], got shape {}",
                ShapeDisplay(&ty.shape)
            )))
        }
    };
    let stats = if ty.dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let scale = s.variable("scale", stats, vec![channels], Init::Constant(1.0))?;
    let offset = s.variable("offset", stats, vec![channels], Init::Zeros)?;
    let moving_mean = s.variable("moving_mean", stats, vec![channels], Init::Zeros)?;
    let moving_variance = s.variable(
        "moving_variance",
        stats,
        vec![channels],
        Init::Constant(1.0),
    )?;
    let op = BatchNorm {
        training,
        ..BatchNorm::default()
    };
    let inputs = [x, scale, offset, moving_mean, moving_variance];
    let output = s.node("batch_norm", op, &inputs)?;
    Ok(BatchNormLayer {
        scale,
        offset,
        moving_mean,
        moving_variance,
        output,
        batch_mean: Port::new(output.node, 1),
        batch_variance: Port::new(output.node, 2),
    })
}

/// Dropout of `x` at `rate` (in [0, 1); 0 returns `x`): a [`Dropout`] node whose
/// seed comes from its name (`dropout`, `dropout_1`, ...) and whose mask changes with
/// the step count ([`step_count`]: a scalar f32 Variable, made if the graph has none,
/// that the optimizers advance each applied step). An inference graph is built
/// without it (rate 0), as batch norm's `training` flag builds its own.
pub fn dropout(g: &mut Graph, x: Port, rate: f64) -> Result<Port> {
    if rate == 0.0 {
        return Ok(x);
    }
    let name = g.fresh_name("dropout");
    // FNV-1a of the name: a fixed, distinct seed per node.
    let seed = name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    });
    let op = Dropout::new(rate, seed).map_err(|e| GraphError::Format(format!("{name}: {e}")))?;
    let count = step_count(g)?;
    Ok(g.add_node(name, Box::new(op), &[x, count])?.into())
}

fn nhwc_bias_add() -> BiasAdd {
    BiasAdd {
        data_format: DataFormat::Nhwc,
    }
}

/// The nodes of one layer, named `<scope>/<leaf>`; on failure they are removed again.
struct Scope<'g> {
    g: &'g mut Graph,
    name: String,
    layer: &'static str,
    created: Vec<NodeId>,
}

impl<'g> Scope<'g> {
    /// The first of `stem`, `stem_1`, `stem_2`, ... that no node name uses as its
    /// first path component.
    fn new(g: &'g mut Graph, stem: &str, layer: &'static str) -> Self {
        let taken: HashSet<&str> = g
            .node_ids()
            .map(|id| g.node(id).name.split('/').next().unwrap_or_default())
            .collect();
        let name = std::iter::once(stem.to_string())
            .chain((1..).map(|i| format!("{stem}_{i}")))
            .find(|n| !taken.contains(n.as_str()))
            .unwrap_or_default();
        Scope {
            g,
            name,
            layer,
            created: Vec::new(),
        }
    }

    fn error(&self, msg: impl Into<String>) -> GraphError {
        GraphError::node(&self.name, self.layer, msg)
    }

    /// The type of `x`, or an error when `x` is not a port of this graph.
    fn input_type(&self, x: Port) -> Result<TensorType> {
        let exists = self.g.node_ids().any(|id| id == x.node)
            && x.index < self.g.node(x.node).outputs().len();
        if !exists {
            return Err(self.error(format!(
                "input (node id {}, output {}) is not in this graph",
                x.node.index(),
                x.index
            )));
        }
        let ty = self.g.ty(x).clone();
        if !ty.dtype.is_float() {
            return Err(self.error(format!("input must be a float tensor, got {ty}")));
        }
        Ok(ty)
    }

    fn track(&mut self, id: NodeId) -> Port {
        self.created.push(id);
        id.into()
    }

    fn variable(
        &mut self,
        leaf: &str,
        dtype: DType,
        shape: Vec<usize>,
        init: Init,
    ) -> Result<Port> {
        if checked_numel(&shape).is_none() {
            return Err(self.error(format!(
                "variable '{leaf}' of shape {} has more elements than can be addressed",
                ShapeDisplay(&shape)
            )));
        }
        let ty = TensorType::new(dtype, shape);
        self.node(leaf, Variable::with_init(ty, init), &[])
    }

    fn node(&mut self, leaf: &str, op: impl Op, inputs: &[Port]) -> Result<Port> {
        let id = self
            .g
            .add_node(format!("{}/{leaf}", self.name), Box::new(op), inputs)?;
        Ok(self.track(id))
    }

    fn activation(&mut self, x: Port, act: Option<Activation>) -> Result<Port> {
        match act {
            None => Ok(x),
            Some(a) => {
                let kind = a.kind();
                self.node(&kind.name().to_lowercase(), Unary::new(kind), &[x])
            }
        }
    }

    /// Passes `r` through; on an error removes what the layer added (consumers first).
    fn finish<T>(self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            for &id in self.created.iter().rev() {
                // Nothing outside the layer reads its nodes yet, so removal succeeds.
                let _ = self.g.remove_node(id);
            }
        }
        r
    }
}
