//! Convenience methods on [`Graph`] for writing models by hand (docs/design.md §6):
//!
//! ```
//! use ampgraph_graph::{DType, Graph};
//! # fn main() -> ampgraph_graph::Result<()> {
//! let mut g = Graph::new();
//! let x = g.placeholder("x", DType::F32, [64, 784])?;
//! let w = g.variable("w", DType::F32, [784, 10])?;
//! let logits = g.matmul(x, w)?;
//! let y = g.relu(logits)?;
//! assert_eq!(g.ty(y).shape, [64, 10]);
//! # Ok(()) }
//! ```
//!
//! Each method adds one node through [`Graph::add`] (named after its op, lowercased,
//! made unique by [`Graph::fresh_name`]) and returns its output 0; the op's own type
//! rule checks the inputs, so a mismatch comes back as an error naming the node and
//! nothing is added. Ops with more outputs (BatchNorm) expose them as
//! `Port::new(y.node, k)`. Since [`Graph::add`] is the generic node adder, the
//! elementwise sum is [`Graph::plus`].

use crate::dtype::DType;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, Port};
use crate::ops::{
    AvgPool, BatchMatMul, BatchNorm, BiasAdd, Binary, BinaryKind, Cast, Concat, Const, Conv2D,
    DataFormat, LayerNorm, LogSoftmax, MatMul, MaxPool, Padding, Placeholder, Reduce, ReduceKind,
    Reshape, Softmax, SoftmaxCrossEntropy, Transpose, Unary, UnaryKind, Variable,
};
use crate::ops::{Compare, CompareKind, Gather, Logical, LogicalKind, Not, Pad, Where};
use crate::ops::{CoordinateTransform, Resize, ResizeMode};
use crate::tensor::{checked_numel, ShapeDisplay, Tensor, TensorType};

/// The type of a source node, refusing shapes whose element count overflows.
fn source_type(name: &str, op: &str, dtype: DType, shape: Vec<usize>) -> Result<TensorType> {
    if checked_numel(&shape).is_none() {
        return Err(GraphError::node(
            name,
            op,
            format!(
                "shape {} has more elements than can be addressed",
                ShapeDisplay(&shape)
            ),
        ));
    }
    Ok(TensorType::new(dtype, shape))
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $method:ident => $kind:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $method(&mut self, x: Port) -> Result<Port> {
                self.add(Unary::new(UnaryKind::$kind), &[x])
            }
        )*
    };
}

/// Two-input methods, one per kind of `Op` (Binary by default): `Op::new(Kind::X)`.
macro_rules! binary_methods {
    ($($(#[$doc:meta])* $method:ident => $kind:ident;)*) => {
        binary_methods!(Binary(BinaryKind): $($(#[$doc])* $method => $kind;)*);
    };
    ($Op:ident($Kind:ident): $($(#[$doc:meta])* $method:ident => $kind:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $method(&mut self, a: Port, b: Port) -> Result<Port> {
                self.add($Op::new($Kind::$kind), &[a, b])
            }
        )*
    };
}

impl Graph {
    // ----- sources -------------------------------------------------------------

    /// A value fed at run time, under the given name.
    pub fn placeholder(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: impl Into<Vec<usize>>,
    ) -> Result<Port> {
        let name = name.into();
        let ty = source_type(&name, "Placeholder", dtype, shape.into())?;
        Ok(self.add_node(name, Box::new(Placeholder(ty)), &[])?.into())
    }

    /// A trainable value under the given name, with the default initialiser
    /// ([`Init::Auto`](crate::ops::Init::Auto)); the session holds and initialises it.
    pub fn variable(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: impl Into<Vec<usize>>,
    ) -> Result<Port> {
        let name = name.into();
        let ty = source_type(&name, "Variable", dtype, shape.into())?;
        Ok(self
            .add_node(name, Box::new(Variable::new(ty)), &[])?
            .into())
    }

    /// A constant holding `value`.
    pub fn constant(&mut self, value: Tensor) -> Result<Port> {
        self.add(Const::new(value), &[])
    }

    /// A rank-0 constant.
    pub fn scalar(&mut self, dtype: DType, value: f64) -> Result<Port> {
        self.constant(Tensor::scalar(dtype, value))
    }

    // ----- linear algebra and convolution -----------------------------------------

    /// `a @ b` for `a [M, K]`, `b [K, N]`.
    pub fn matmul(&mut self, a: Port, b: Port) -> Result<Port> {
        self.matmul_t(a, b, false, false)
    }

    /// `op(a) @ op(b)`, each operand transposed when asked.
    pub fn matmul_t(
        &mut self,
        a: Port,
        b: Port,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Result<Port> {
        self.add(MatMul::new(transpose_a, transpose_b), &[a, b])
    }

    /// Batched `a @ b` (rank >= 3, broadcast batch dims).
    pub fn batch_matmul(&mut self, a: Port, b: Port) -> Result<Port> {
        self.batch_matmul_adj(a, b, false, false)
    }

    /// Batched `op(a) @ op(b)`, each operand's last two axes swapped when asked.
    pub fn batch_matmul_adj(&mut self, a: Port, b: Port, adj_x: bool, adj_y: bool) -> Result<Port> {
        self.add(BatchMatMul::new(adj_x, adj_y), &[a, b])
    }

    /// 2-D convolution of `x` with an HWIO `filter`; a grouped one is
    /// `add(Conv2D::new(..).with_groups(groups), &[x, filter])`.
    pub fn conv2d(
        &mut self,
        x: Port,
        filter: Port,
        strides: [usize; 2],
        padding: Padding,
        format: DataFormat,
    ) -> Result<Port> {
        self.add(Conv2D::new(strides, padding, format), &[x, filter])
    }

    /// Maximum over `ksize` windows.
    pub fn max_pool(
        &mut self,
        x: Port,
        ksize: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        format: DataFormat,
    ) -> Result<Port> {
        self.add(MaxPool::new(ksize, strides, padding, format), &[x])
    }

    /// Mean over `ksize` windows.
    pub fn avg_pool(
        &mut self,
        x: Port,
        ksize: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        format: DataFormat,
    ) -> Result<Port> {
        self.add(AvgPool::new(ksize, strides, padding, format), &[x])
    }

    // ----- normalisation -----------------------------------------------------------

    /// Batch normalisation (NHWC or `[N, C]`, epsilon 0.001). Returns `y`; the batch
    /// mean and variance are `Port::new(y.node, 1)` and `Port::new(y.node, 2)`. For
    /// other attrs add a [`BatchNorm`] with [`Graph::add`].
    pub fn batch_norm(
        &mut self,
        x: Port,
        scale: Port,
        offset: Port,
        mean: Port,
        variance: Port,
        training: bool,
    ) -> Result<Port> {
        let op = BatchNorm {
            training,
            ..BatchNorm::default()
        };
        self.add(op, &[x, scale, offset, mean, variance])
    }

    /// Layer normalisation over the axes `axis..` of `x`.
    pub fn layer_norm(
        &mut self,
        x: Port,
        gamma: Port,
        beta: Port,
        axis: i64,
        epsilon: f64,
    ) -> Result<Port> {
        self.add(
            LayerNorm {
                axis,
                epsilon,
                to: None,
            },
            &[x, gamma, beta],
        )
    }

    // ----- elementwise ---------------------------------------------------------------

    unary_methods! {
        relu => Relu;
        relu6 => Relu6;
        elu => Elu;
        selu => Selu;
        tanh => Tanh;
        sigmoid => Sigmoid;
        exp => Exp;
        log => Log;
        log1p => Log1p;
        sqrt => Sqrt;
        rsqrt => Rsqrt;
        square => Square;
        neg => Neg;
        abs => Abs;
        erf => Erf;
        softplus => Softplus;
        reciprocal => Reciprocal;
        sign => Sign;
        identity => Identity;
    }

    /// GELU, exact (erf) or with the tanh approximation.
    pub fn gelu(&mut self, x: Port, approximate: bool) -> Result<Port> {
        self.add(Unary::new(UnaryKind::Gelu { approximate }), &[x])
    }

    /// `x` where positive, `alpha * x` elsewhere.
    pub fn leaky_relu(&mut self, x: Port, alpha: f64) -> Result<Port> {
        self.add(Unary::new(UnaryKind::LeakyRelu { alpha }), &[x])
    }

    binary_methods! {
        /// `a + b` (the op Add; `add` is [`Graph::add`], the generic node adder).
        plus => Add;
        sub => Sub;
        mul => Mul;
        div => Div;
        maximum => Maximum;
        minimum => Minimum;
        pow => Pow;
        squared_difference => SquaredDifference;
    }

    /// Adds a 1-D `bias` along the last axis of `x`.
    pub fn bias_add(&mut self, x: Port, bias: Port) -> Result<Port> {
        self.bias_add_format(x, bias, DataFormat::Nhwc)
    }

    /// Adds a 1-D `bias` along the channel axis of `format`.
    pub fn bias_add_format(&mut self, x: Port, bias: Port, format: DataFormat) -> Result<Port> {
        self.add(
            BiasAdd {
                data_format: format,
            },
            &[x, bias],
        )
    }

    // ----- selection, comparison, indexing -------------------------------------------

    /// `a` where `cond` (bool) holds, `b` elsewhere; the three broadcast together.
    pub fn where_(&mut self, cond: Port, a: Port, b: Port) -> Result<Port> {
        self.add(Where, &[cond, a, b])
    }

    binary_methods! {
        Compare(CompareKind):
        /// `a == b` elementwise (broadcasting), a bool tensor; the others likewise.
        equal => Equal;
        less => Less;
        less_or_equal => LessOrEqual;
        greater => Greater;
        greater_or_equal => GreaterOrEqual;
    }

    binary_methods! {
        Logical(LogicalKind):
        /// `a && b` on bool tensors (broadcasting); `or` and `xor` likewise.
        logical_and => And;
        logical_or => Or;
        logical_xor => Xor;
    }

    /// `!x` on a bool tensor.
    pub fn logical_not(&mut self, x: Port) -> Result<Port> {
        self.add(Not, &[x])
    }

    /// The slices of `x` along `axis` at integer `indices` (negative ones count from
    /// the end): shape `x[:axis] + indices + x[axis+1:]`.
    pub fn gather(&mut self, x: Port, indices: Port, axis: i64) -> Result<Port> {
        self.add(Gather::new(axis), &[x, indices])
    }

    /// `x` with `pads[i] = [before, after]` elements of `value` around axis `i`
    /// (negative counts crop). For the reflect and edge modes add a [`Pad`].
    pub fn pad(&mut self, x: Port, pads: &[[i64; 2]], value: f64) -> Result<Port> {
        self.add(Pad::constant(pads, value), &[x])
    }

    /// `x` resized to `shape` (ONNX Resize): each axis whose length changes is
    /// interpolated by `mode`, its outputs mapped back by `coordinates`.
    pub fn resize(
        &mut self,
        x: Port,
        shape: &[usize],
        mode: ResizeMode,
        coordinates: CoordinateTransform,
    ) -> Result<Port> {
        self.add(Resize::new(shape, mode, coordinates), &[x])
    }

    // ----- softmax and loss -----------------------------------------------------------

    pub fn softmax(&mut self, x: Port, axis: i64) -> Result<Port> {
        self.add(Softmax { axis }, &[x])
    }

    pub fn log_softmax(&mut self, x: Port, axis: i64) -> Result<Port> {
        self.add(LogSoftmax { axis }, &[x])
    }

    /// Mean cross-entropy of `logits [N, C]` against integer `labels [N]`: a scalar.
    pub fn softmax_cross_entropy(&mut self, logits: Port, labels: Port) -> Result<Port> {
        self.add(SoftmaxCrossEntropy, &[logits, labels])
    }

    // ----- reductions -------------------------------------------------------------------

    /// Sum over `axes` (all axes when `None`).
    pub fn sum(&mut self, x: Port, axes: Option<&[i64]>, keep_dims: bool) -> Result<Port> {
        self.add(
            Reduce::new(ReduceKind::Sum, axes.map(<[i64]>::to_vec), keep_dims),
            &[x],
        )
    }

    /// Mean over `axes` (all axes when `None`).
    pub fn mean(&mut self, x: Port, axes: Option<&[i64]>, keep_dims: bool) -> Result<Port> {
        self.add(
            Reduce::new(ReduceKind::Mean, axes.map(<[i64]>::to_vec), keep_dims),
            &[x],
        )
    }

    /// Maximum over `axes` (all axes when `None`).
    pub fn max(&mut self, x: Port, axes: Option<&[i64]>, keep_dims: bool) -> Result<Port> {
        self.add(
            Reduce::new(ReduceKind::Max, axes.map(<[i64]>::to_vec), keep_dims),
            &[x],
        )
    }

    // ----- shapes and types ---------------------------------------------------------------

    /// `x` with a new shape of the same size (one `-1` is inferred).
    pub fn reshape(&mut self, x: Port, shape: impl Into<Vec<i64>>) -> Result<Port> {
        self.add(Reshape::new(shape), &[x])
    }

    /// `x` with its axes permuted: output axis `i` is input axis `perm[i]`.
    pub fn transpose(&mut self, x: Port, perm: impl Into<Vec<usize>>) -> Result<Port> {
        self.add(Transpose::new(perm), &[x])
    }

    /// The inputs joined along `axis`.
    pub fn concat(&mut self, inputs: &[Port], axis: i64) -> Result<Port> {
        self.add(Concat::new(axis), inputs)
    }

    /// `x` converted to `dtype`.
    pub fn cast(&mut self, x: Port, dtype: DType) -> Result<Port> {
        self.add(Cast { to: dtype }, &[x])
    }
}
