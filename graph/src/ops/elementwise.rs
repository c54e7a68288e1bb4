//! Elementwise ops: unary activations and math, broadcasting binary ops, BiasAdd,
//! and their gradients (`UnaryGrad`, `BinaryGrad`).

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, par_fill, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::{DataFormat, Reduce, ReduceKind};
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

pub(crate) const GRAD_OPS: &[OpEntry] = &[
    OpEntry {
        name: "UnaryGrad",
        parse: |_, a| Ok(Box::new(UnaryGrad::parse(a)?)),
    },
    OpEntry {
        name: "BinaryGrad",
        parse: |_, a| Ok(Box::new(BinaryGrad::parse(a)?)),
    },
];

/// The ports of a fixed-size list (an op's inputs or outputs).
fn inputs_of<const N: usize>(inputs: &[Port]) -> Result<[Port; N], GraphError> {
    fixed(inputs).copied().map_err(GraphError::Format)
}

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

    /// The derivative `d apply(x) / dx`, in the kernel's compute type. At kinks it
    /// takes TensorFlow's side: Relu, Relu6 (also at 6), Abs and Sign have slope 0 at
    /// 0; LeakyRelu has `alpha` at 0; Elu and Selu take the right branch at 0 (TF
    /// tests `y < 0`).
    pub fn derivative<T: Real>(self, x: T) -> T {
        use UnaryKind::*;
        let zero = T::zero();
        let one = T::one();
        let half = T::lit(0.5);
        match self {
            Relu => {
                if x > zero {
                    one
                } else {
                    zero
                }
            }
            Relu6 => {
                if x > zero && x < T::lit(6.0) {
                    one
                } else {
                    zero
                }
            }
            Elu => {
                if x < zero {
                    x.exp()
                } else {
                    one
                }
            }
            Selu => {
                let d = if x < zero {
                    T::lit(SELU_ALPHA) * x.exp()
                } else {
                    one
                };
                T::lit(SELU_SCALE) * d
            }
            // Phi(x) + x phi(x), phi the standard normal density.
            Gelu { approximate: false } => {
                let cdf = half * (one + (x * T::FRAC_1_SQRT_2()).erf());
                let pdf = (-half * x * x).exp() * T::lit(1.0 / (2.0 * std::f64::consts::PI).sqrt());
                // x * pdf is 0 where pdf underflows, even for infinite x.
                if pdf == zero {
                    cdf
                } else {
                    cdf + x * pdf
                }
            }
            // With u = c (x + k x^3), t = tanh(u):
            // 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2).
            Gelu { approximate: true } => {
                let c = T::lit((2.0 / std::f64::consts::PI).sqrt());
                let k = T::lit(0.044715);
                let t = (c * (x + k * x * x * x)).tanh();
                let sech2 = one - t * t;
                let tail = if sech2 == zero {
                    zero // saturated: avoids 0 * inf for huge |x|
                } else {
                    half * x * sech2 * c * (one + T::lit(3.0) * k * x * x)
                };
                half * (one + t) + tail
            }
            LeakyRelu { alpha } => {
                if x > zero {
                    one
                } else {
                    T::lit(alpha)
                }
            }
            Tanh => {
                let t = x.tanh();
                one - t * t
            }
            Sigmoid => {
                let s = Sigmoid.apply(x);
                s * (one - s)
            }
            Exp => x.exp(),
            Log => one / x,
            Log1p => one / (one + x),
            Sqrt => half / x.sqrt(),
            Rsqrt => {
                let r = one / x.sqrt();
                -half * r * r * r
            }
            Square => T::lit(2.0) * x,
            Neg => -one,
            Abs => Sign.apply(x),
            Erf => T::lit(std::f64::consts::FRAC_2_SQRT_PI) * (-x * x).exp(),
            // The logistic function, in a form that never overflows.
            Softplus => {
                if x >= zero {
                    one / (one + (-x).exp())
                } else {
                    let e = x.exp();
                    e / (one + e)
                }
            }
            Reciprocal => {
                let r = one / x;
                -(r * r)
            }
            Sign => zero,
            Identity => one,
        }
    }

    /// The loss gradient of `x` given the loss gradient `dy` of `apply(x)`: what
    /// `UnaryGrad` computes per element. A zero slope stays zero even where `dy` is
    /// infinite or NaN (no `0 * inf`).
    pub fn input_grad<T: Real>(self, x: T, dy: T) -> T {
        let d = self.derivative(x);
        if d == T::zero() {
            d
        } else {
            d * dy
        }
    }

    /// The kind's own attributes (Gelu's `approximate`, LeakyRelu's `alpha`).
    fn attrs(self) -> Vec<(&'static str, AttrValue)> {
        match self {
            UnaryKind::Gelu { approximate } => vec![("approximate", approximate.into())],
            UnaryKind::LeakyRelu { alpha } => vec![("alpha", alpha.into())],
            _ => vec![],
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
        let xs = T::read(x);
        let y = par_fill(xs.len(), |i| self.apply(xs[i]));
        Ok(vec![(x.shape().to_vec(), y)])
    }
}

impl Op for Unary {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn is_view(&self) -> bool {
        self.kind == UnaryKind::Identity
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.kind.attrs()
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
    /// `dx = UnaryGrad(x, dy)`; Identity passes `dy` through; integer inputs (only
    /// Identity takes them) get none. Relu and Relu6 pass their output instead of `x`
    /// (as TensorFlow's ReluGrad may): `y` is in (0, 6) exactly where `x` is, so the
    /// mask is the same, and the pre-activation need not outlive the forward pass
    /// (a GEMM can then apply the activation in its epilogue in training too).
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None]);
        };
        if !b.ty(x).dtype.is_float() {
            return Ok(vec![None]);
        }
        let mask_source = match self.kind {
            UnaryKind::Identity => return Ok(vec![Some(dy)]),
            UnaryKind::Relu | UnaryKind::Relu6 => inputs_of::<1>(outputs)?[0],
            _ => x,
        };
        Ok(vec![Some(
            b.add(UnaryGrad { kind: self.kind }, &[mask_source, dy])?,
        )])
    }
}

/// The gradient of a [`Unary`] op: inputs `(x, dy)` of one shape and dtype, output
/// `dx = kind'(x) * dy` (exactly 0 where the derivative is 0, whatever `dy` holds, as
/// TensorFlow's masks give). For Relu and Relu6, autodiff passes the activation's
/// output as `x`: its derivative mask is the same. Attrs: `kind` (the unary op's name) and that kind's own
/// attrs (`approximate` for Gelu, `alpha` for LeakyRelu).
#[derive(Clone, Debug, PartialEq)]
pub struct UnaryGrad {
    pub kind: UnaryKind,
}

impl UnaryGrad {
    pub fn new(kind: UnaryKind) -> Self {
        UnaryGrad { kind }
    }

    fn parse(a: &mut AttrReader) -> OpResult<UnaryGrad> {
        let kind = a.opt_str("kind")?.ok_or("missing attr 'kind'")?;
        Ok(UnaryGrad {
            kind: Unary::parse(&kind, a)
                .map_err(|e| format!("attr 'kind': {e}"))?
                .kind,
        })
    }
}

/// Requires `dy` to have the shape `want` (the shape of what it is the gradient of).
fn check_dy(dy: &[usize], want: &[usize], of: &str) -> OpResult<()> {
    if dy == want {
        Ok(())
    } else {
        Err(format!(
            "dy has shape {} but {of} has shape {}",
            ShapeDisplay(dy),
            ShapeDisplay(want)
        ))
    }
}

impl FloatKernel for UnaryGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, dy] = fixed(inputs)?;
        check_dy(dy.shape(), x.shape(), "x")?;
        let (xs, gs) = (T::read(x), T::read(dy));
        let dx = par_fill(xs.len(), |i| self.kind.input_grad(xs[i], gs[i]));
        Ok(vec![(x.shape().to_vec(), dx)])
    }
}

impl Op for UnaryGrad {
    fn name(&self) -> &'static str {
        "UnaryGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("kind", self.kind.name().into())];
        a.extend(self.kind.attrs());
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, dy] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        check_dy(&dy.shape, &x.shape, "x")?;
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, dy] = fixed(inputs)?;
        self.infer(&[&x.ty(), &dy.ty()])?;
        eval_float(self, x.dtype(), inputs)
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

    /// The loss gradient of operand `wrt` (0: a, 1: b) at one element: `dy` times
    /// the partial derivative, in TensorFlow's forms. Maximum and Minimum send the
    /// whole gradient to one operand, a tie going to `a` (TF's `x >= y` and `x <= y`
    /// masks; a NaN operand sends it to `b`). Pow's `d/db` is 0 where `a <= 0` (TF),
    /// and `d/da` is 0 where `b == 0` (the derivative of the constant `a^0`).
    pub fn grad<T: Real>(self, wrt: usize, a: T, b: T, dy: T) -> T {
        let zero = T::zero();
        let first = wrt == 0;
        let pick = |to_a: bool| if to_a == first { dy } else { zero };
        match self {
            BinaryKind::Add => dy,
            BinaryKind::Sub => {
                if first {
                    dy
                } else {
                    -dy
                }
            }
            BinaryKind::Mul => {
                if first {
                    dy * b
                } else {
                    dy * a
                }
            }
            BinaryKind::Div => {
                if first {
                    dy / b
                } else {
                    dy * (-a / b) / b
                }
            }
            BinaryKind::Maximum => pick(a >= b),
            BinaryKind::Minimum => pick(a <= b),
            BinaryKind::Pow => {
                if first {
                    if b == zero {
                        zero
                    } else {
                        dy * b * a.powf(b - T::one())
                    }
                } else if a > zero {
                    dy * a.powf(b) * a.ln()
                } else {
                    zero
                }
            }
            BinaryKind::SquaredDifference => {
                let g = T::lit(2.0) * (a - b) * dy;
                if first {
                    g
                } else {
                    -g
                }
            }
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
pub(crate) fn broadcast_zip<T: Copy + Sync, U: Send>(
    a: &[T],
    a_shape: &[usize],
    b: &[T],
    b_shape: &[usize],
    out_shape: &[usize],
    f: impl Fn(T, T) -> U + Sync + Send,
) -> Vec<U> {
    if a_shape == b_shape {
        return par_fill(a.len(), |i| f(a[i], b[i]));
    }
    // A scalar operand (loss scales, learning rates) needs no index maps.
    let n: usize = out_shape.iter().product();
    if b.len() == 1 && a.len() == n {
        return par_fill(n, |i| f(a[i], b[0]));
    }
    if a.len() == 1 && b.len() == n {
        return par_fill(n, |i| f(a[0], b[i]));
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
    /// Each operand's gradient is `BinaryGrad` (or `dy` itself where the partial is 1)
    /// at the broadcast shape, summed back to the operand's shape.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let operands: [Port; 2] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        let mut out = Vec::with_capacity(2);
        for (wrt, &p) in operands.iter().enumerate() {
            let ty = b.ty(p).clone();
            if !ty.dtype.is_float() {
                out.push(None);
                continue;
            }
            let g = if matches!(
                (self.kind, wrt),
                (BinaryKind::Add, _) | (BinaryKind::Sub, 0)
            ) {
                dy
            } else {
                let op = BinaryGrad {
                    kind: self.kind,
                    wrt,
                };
                b.add(op, &[operands[0], operands[1], dy])?
            };
            out.push(Some(b.sum_to(g, &ty.shape)?));
        }
        Ok(out)
    }
}

/// The gradient of a [`Binary`] op with respect to operand `wrt` (0 or 1): inputs
/// `(a, b, dy)` with `dy` at the broadcast shape of `a` and `b`; the output, at that
/// broadcast shape, is [`BinaryKind::grad`] elementwise. Summing it back to the
/// operand's shape is left to a `SumTo`. Attrs: `kind` (the binary op's name), `wrt`.
#[derive(Clone, Debug, PartialEq)]
pub struct BinaryGrad {
    pub kind: BinaryKind,
    pub wrt: usize,
}

impl BinaryGrad {
    pub fn new(kind: BinaryKind, wrt: usize) -> Self {
        BinaryGrad { kind, wrt }
    }

    fn parse(a: &mut AttrReader) -> OpResult<BinaryGrad> {
        let kind = a.opt_str("kind")?.ok_or("missing attr 'kind'")?;
        let kind = Binary::parse(&kind)
            .map_err(|e| format!("attr 'kind': {e}"))?
            .kind;
        let wrt = match a.opt_int("wrt")? {
            Some(0) => 0,
            Some(1) => 1,
            Some(w) => return Err(format!("attr 'wrt' must be 0 or 1, got {w}")),
            None => return Err("missing attr 'wrt'".into()),
        };
        Ok(BinaryGrad { kind, wrt })
    }

    fn output_shape(&self, a: &[usize], b: &[usize], dy: &[usize]) -> OpResult<Vec<usize>> {
        if self.wrt > 1 {
            return Err(format!("wrt must be 0 or 1, got {}", self.wrt));
        }
        let out = broadcast_shapes(a, b)?;
        check_dy(dy, &out, "the broadcast of a and b")?;
        Ok(out)
    }
}

impl FloatKernel for BinaryGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b, dy] = fixed(inputs)?;
        let out = self.output_shape(a.shape(), b.shape(), dy.shape())?;
        let (av, bv, gv) = (T::read(a), T::read(b), T::read(dy));
        let f = |i: usize, j: usize, g: T| self.kind.grad(self.wrt, av[i], bv[j], g);
        let dx = if a.shape() == b.shape() {
            par_fill(gv.len(), |i| f(i, i, gv[i]))
        } else {
            let ia = broadcast_index_map(a.shape(), &out);
            let ib = broadcast_index_map(b.shape(), &out);
            ia.iter()
                .zip(&ib)
                .zip(gv.iter())
                .map(|((&i, &j), &g)| f(i, j, g))
                .collect()
        };
        Ok(vec![(out, dx)])
    }
}

impl Op for BinaryGrad {
    fn name(&self) -> &'static str {
        "BinaryGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("kind", self.kind.name().into()),
            ("wrt", (self.wrt as i64).into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b, dy] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        Ok(vec![TensorType::new(
            dtype,
            self.output_shape(&a.shape, &b.shape, &dy.shape)?,
        )])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [a, b, dy] = fixed(inputs)?;
        self.infer(&[&a.ty(), &b.ty(), &dy.ty()])?;
        eval_float(self, a.dtype(), inputs)
    }
}

/// Adds a 1-D bias along the channel axis (last for NHWC, 1 for NCHW).
#[derive(Clone, Debug, PartialEq)]
pub struct BiasAdd {
    pub data_format: DataFormat,
}

impl BiasAdd {
    /// The channel axis of an input of rank `rank` (2 or more).
    pub fn channel_axis(&self, rank: usize) -> usize {
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
        let (bias, xs) = (T::read(bias), T::read(x));
        let y = par_fill(xs.len(), |i| xs[i] + bias[(i / inner) % c]);
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
    /// `dx = dy`; `dbias` sums `dy` over every axis but the channel axis.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x, _bias] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        let rank = b.ty(x).rank();
        if rank < 2 {
            return Err(GraphError::Format(format!(
                "x must have rank 2 or more, got {rank}"
            )));
        }
        let channel = self.channel_axis(rank);
        let axes: Vec<i64> = (0..rank)
            .filter(|&a| a != channel)
            .map(|a| a as i64)
            .collect();
        let dbias = b.add(Reduce::new(ReduceKind::Sum, Some(axes), false), &[dy])?;
        Ok(vec![Some(dy), Some(dbias)])
    }
}
