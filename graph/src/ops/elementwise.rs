//! Elementwise ops: unary activations and math, broadcasting binary ops, BiasAdd.

use crate::attrs::{AttrReader, AttrValue};
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::DataFormat;
use crate::shape::{broadcast_index_map, broadcast_shapes};
use crate::tensor::{ShapeDisplay, Tensor, TensorType};

macro_rules! entries {
    ($parse:expr; $($name:literal),* $(,)?) => {
        &[$(OpEntry { name: $name, parse: $parse }),*]
    };
}

pub(crate) const UNARY_OPS: &[OpEntry] = entries!(|n, a| Ok(Box::new(Unary::parse(n, a)?));
    "Relu", "Relu6", "Elu", "Selu", "Gelu", "LeakyRelu", "Tanh", "Sigmoid", "Exp", "Log", "Log1p",
    "Sqrt", "Rsqrt", "Square", "Neg", "Abs", "Erf", "Softplus", "Reciprocal", "Sign", "Identity");

pub(crate) const BINARY_OPS: &[OpEntry] = entries!(|n, _| Ok(Box::new(Binary::parse(n)?));
    "Add", "Sub", "Mul", "Div", "Maximum", "Minimum", "Pow", "SquaredDifference");

pub(crate) const OTHER_OPS: &[OpEntry] = &[OpEntry {
    name: "BiasAdd",
    parse: |_, a| {
        Ok(Box::new(BiasAdd {
            data_format: DataFormat::read(a)?,
        }))
    },
}];

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryKind {
    Relu,
    Relu6,
    Elu,
    Selu,
    Gelu { approximate: bool },
    LeakyRelu { alpha: f64 },
    Tanh,
    Sigmoid,
    Exp,
    Log,
    Log1p,
    Sqrt,
    Rsqrt,
    Square,
    Neg,
    Abs,
    Erf,
    Softplus,
    Reciprocal,
    Sign,
    Identity,
}

const SELU_ALPHA: f64 = 1.673_263_242_354_377_284_817_042_991_671_7;
const SELU_SCALE: f64 = 1.050_700_987_355_480_493_419_334_985_294_6;

impl UnaryKind {
    pub fn name(self) -> &'static str {
        use UnaryKind::*;
        match self {
            Relu => "Relu",
            Relu6 => "Relu6",
            Elu => "Elu",
            Selu => "Selu",
            Gelu { .. } => "Gelu",
            LeakyRelu { .. } => "LeakyRelu",
            Tanh => "Tanh",
            Sigmoid => "Sigmoid",
            Exp => "Exp",
            Log => "Log",
            Log1p => "Log1p",
            Sqrt => "Sqrt",
            Rsqrt => "Rsqrt",
            Square => "Square",
            Neg => "Neg",
            Abs => "Abs",
            Erf => "Erf",
            Softplus => "Softplus",
            Reciprocal => "Reciprocal",
            Sign => "Sign",
            Identity => "Identity",
        }
    }

    /// The function itself, in the kernel's compute type.
    pub fn apply<T: Real>(self, x: T) -> T {
        use UnaryKind::*;
        let zero = T::zero();
        let one = T::one();
        match self {
            Relu => x.max(zero),
            Relu6 => x.max(zero).min(T::lit(6.0)),
            Elu => {
                if x > zero {
                    x
                } else {
                    x.exp_m1()
                }
            }
            Selu => {
                let y = if x > zero {
                    x
                } else {
                    T::lit(SELU_ALPHA) * x.exp_m1()
                };
                T::lit(SELU_SCALE) * y
            }
            Gelu { approximate: false } => T::lit(0.5) * x * (one + (x * T::FRAC_1_SQRT_2()).erf()),
            Gelu { approximate: true } => {
                let inner = T::lit((2.0 / std::f64::consts::PI).sqrt())
                    * (x + T::lit(0.044715) * x * x * x);
                T::lit(0.5) * x * (one + inner.tanh())
            }
            LeakyRelu { alpha } => {
                if x > zero {
                    x
                } else {
                    T::lit(alpha) * x
                }
            }
            Tanh => x.tanh(),
            Sigmoid => one / (one + (-x).exp()),
            Exp => x.exp(),
            Log => x.ln(),
            Log1p => x.ln_1p(),
            Sqrt => x.sqrt(),
            Rsqrt => one / x.sqrt(),
            Square => x * x,
            Neg => -x,
            Abs => x.abs(),
            Erf => x.erf(),
            // max(x, 0) + log1p(exp(-|x|)): no overflow for large x.
            Softplus => x.max(zero) + (-x.abs()).exp().ln_1p(),
            Reciprocal => one / x,
            Sign => {
                if x > zero {
                    one
                } else if x < zero {
                    -one
                } else {
                    x // keeps NaN and signed zero
                }
            }
            Identity => x,
        }
    }
}

/// A one-input elementwise op.
#[derive(Clone, Debug, PartialEq)]
pub struct Unary {
    pub kind: UnaryKind,
}

impl Unary {
    pub fn new(kind: UnaryKind) -> Self {
        Unary { kind }
    }

    fn parse(name: &str, a: &mut AttrReader) -> OpResult<Unary> {
        use UnaryKind::*;
        let kind = match name {
            "Gelu" => Gelu {
                approximate: a.bool_or("approximate", false)?,
            },
            "LeakyRelu" => LeakyRelu {
                alpha: a.float_or("alpha", 0.2)?,
            },
            other => [
                Relu, Relu6, Elu, Selu, Tanh, Sigmoid, Exp, Log, Log1p, Sqrt, Rsqrt, Square, Neg,
                Abs, Erf, Softplus, Reciprocal, Sign, Identity,
            ]
            .into_iter()
            .find(|k| k.name() == other)
            .ok_or_else(|| format!("unknown unary op '{other}'"))?,
        };
        Ok(Unary { kind })
    }
}

impl FloatKernel for UnaryKind {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        let y = T::read(x).iter().map(|&v| self.apply(v)).collect();
        Ok(vec![(x.shape().to_vec(), y)])
    }
}

impl Op for Unary {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        match self.kind {
            UnaryKind::Gelu { approximate } => vec![("approximate", approximate.into())],
            UnaryKind::LeakyRelu { alpha } => vec![("alpha", alpha.into())],
            _ => vec![],
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        if self.kind != UnaryKind::Identity {
            require_float("the input", x.dtype)?;
        }
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        if self.kind == UnaryKind::Identity {
            return Ok(vec![(*x).clone()]);
        }
        eval_float(&self.kind, x.dtype(), inputs)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Pow,
    SquaredDifference,
}

impl BinaryKind {
    pub const ALL: [BinaryKind; 8] = [
        BinaryKind::Add,
        BinaryKind::Sub,
        BinaryKind::Mul,
        BinaryKind::Div,
        BinaryKind::Maximum,
        BinaryKind::Minimum,
        BinaryKind::Pow,
        BinaryKind::SquaredDifference,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryKind::Add => "Add",
            BinaryKind::Sub => "Sub",
            BinaryKind::Mul => "Mul",
            BinaryKind::Div => "Div",
            BinaryKind::Maximum => "Maximum",
            BinaryKind::Minimum => "Minimum",
            BinaryKind::Pow => "Pow",
            BinaryKind::SquaredDifference => "SquaredDifference",
        }
    }

    pub fn apply<T: Real>(self, a: T, b: T) -> T {
        match self {
            BinaryKind::Add => a + b,
            BinaryKind::Sub => a - b,
            BinaryKind::Mul => a * b,
            BinaryKind::Div => a / b,
            // NaN wins, as in TensorFlow and CUDA's fmaxf on NaN-propagating paths.
            BinaryKind::Maximum => {
                if a.is_nan() || b.is_nan() {
                    T::nan()
                } else {
                    a.max(b)
                }
            }
            BinaryKind::Minimum => {
                if a.is_nan() || b.is_nan() {
                    T::nan()
                } else {
                    a.min(b)
                }
            }
            BinaryKind::Pow => a.powf(b),
            BinaryKind::SquaredDifference => (a - b) * (a - b),
        }
    }
}

/// A two-input elementwise op with NumPy broadcasting.
#[derive(Clone, Debug, PartialEq)]
pub struct Binary {
    pub kind: BinaryKind,
}

impl Binary {
    pub fn new(kind: BinaryKind) -> Self {
        Binary { kind }
    }

    fn parse(name: &str) -> OpResult<Binary> {
        BinaryKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .map(Binary::new)
            .ok_or_else(|| format!("unknown binary op '{name}'"))
    }
}

/// Applies `f` over two broadcast operands into `out_shape`.
pub(crate) fn broadcast_zip<T: Copy, U>(
    a: &[T],
    a_shape: &[usize],
    b: &[T],
    b_shape: &[usize],
    out_shape: &[usize],
    f: impl Fn(T, T) -> U,
) -> Vec<U> {
    if a_shape == b_shape {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    let ia = broadcast_index_map(a_shape, out_shape);
    let ib = broadcast_index_map(b_shape, out_shape);
    ia.iter().zip(&ib).map(|(&i, &j)| f(a[i], b[j])).collect()
}

impl FloatKernel for BinaryKind {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b] = fixed(inputs)?;
        let out = broadcast_shapes(a.shape(), b.shape())?;
        let y = broadcast_zip(
            &T::read(a),
            a.shape(),
            &T::read(b),
            b.shape(),
            &out,
            |x, y| self.apply(x, y),
        );
        Ok(vec![(out, y)])
    }
}

impl Op for Binary {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        Ok(vec![TensorType::new(
            dtype,
            broadcast_shapes(&a.shape, &b.shape)?,
        )])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(&self.kind, inputs[0].dtype(), inputs)
    }
}

/// Adds a 1-D bias along the channel axis (last for NHWC, 1 for NCHW).
#[derive(Clone, Debug, PartialEq)]
pub struct BiasAdd {
    pub data_format: DataFormat,
}

impl BiasAdd {
    fn channel_axis(&self, rank: usize) -> usize {
        match self.data_format {
            DataFormat::Nhwc => rank - 1,
            DataFormat::Nchw => 1,
        }
    }
}

impl FloatKernel for BiasAdd {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, bias] = fixed(inputs)?;
        let shape = x.shape();
        let axis = self.channel_axis(shape.len());
        let inner: usize = shape[axis + 1..].iter().product();
        let c = shape[axis];
        let bias = T::read(bias);
        let y = T::read(x)
            .iter()
            .enumerate()
            .map(|(i, &v)| v + bias[(i / inner) % c])
            .collect();
        Ok(vec![(shape.to_vec(), y)])
    }
}

impl Op for BiasAdd {
    fn name(&self) -> &'static str {
        "BiasAdd"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("data_format", self.data_format.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, bias] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        if x.rank() < 2 {
            return Err(format!(
                "x must have rank 2 or more, got {}",
                ShapeDisplay(&x.shape)
            ));
        }
        let c = x.shape[self.channel_axis(x.rank())];
        if bias.shape != [c] {
            return Err(format!(
                "bias has shape {} but x {} has {c} channels",
                ShapeDisplay(&bias.shape),
                ShapeDisplay(&x.shape)
            ));
        }
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(self, inputs[0].dtype(), inputs)
    }
}
