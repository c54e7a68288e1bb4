//! The maths of every elementwise op, one row per op: its name, its value and
//! derivative on the CPU (generic over [`Real`]) and the same two as CUDA C. The
//! tables generate [`UnaryKind`] and [`BinaryKind`], their names, the registry rows
//! that parse them, the CPU kernels and gradient rules, and the CUDA expressions the
//! executor's code generator inlines.
//!
//! To add a unary op: add one row to the `unary_kinds!` table below, then put its
//! name in the precision lists of each `allowlists/*.toml` (allow, infer or deny).
//!
//! The CUDA columns are C++ over the kernel's compute type `C` (`float` or
//! `double`) and the `m_*` functions of the kernel prelude: a unary value is an
//! expression of `C x` (wrapped as `C y = ...;`), its derivative statements that set
//! `C d`; a binary value is an expression of `C a` and `C b`, its gradients
//! expressions of `a`, `b` and the output gradient `C g`. Constants are written with
//! [`cuda_lit`].

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, PI};
use std::hash::{Hash, Hasher};

use super::{Binary, Unary};
use crate::attrs::{AttrReader, AttrValue};
use crate::kernel::Real;
use crate::op::{OpEntry, OpResult};

/// A C literal for an f64 constant (full precision; non-finite values spelled out as
/// the prelude's `F_NAN` and `F_INF`).
pub fn cuda_lit(v: f64) -> String {
    if v.is_nan() {
        "F_NAN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "F_INF" } else { "(-F_INF)" }.into()
    } else {
        format!("{v:e}")
    }
}

/// SELU's constants, as the CUDA kernels have always baked them in. The scale is the
/// f64 nearest the true 1.0507009873554804934...; the alpha, 1.6732632423543774, is
/// one ulp above the f64 nearest the true 1.6732632423543772848... (kept, so that
/// the CUDA source stays byte-identical; the CPU uses the same value).
const SELU_ALPHA: f64 = 1.673_263_242_354_377_4;
const SELU_SCALE: f64 = 1.050_700_987_355_480_5;

/// An attribute a unary kind carries (at most one per kind): read from the op's
/// attributes with a default, written back, and compared and hashed by its bits.
trait KindAttr: Copy + Into<AttrValue> {
    fn read(a: &mut AttrReader, key: &str, default: Self) -> OpResult<Self>;
    fn bits(self) -> u64;
}

impl KindAttr for bool {
    fn read(a: &mut AttrReader, key: &str, default: bool) -> OpResult<bool> {
        a.bool_or(key, default)
    }
    fn bits(self) -> u64 {
        self.into()
    }
}

impl KindAttr for f64 {
    fn read(a: &mut AttrReader, key: &str, default: f64) -> OpResult<f64> {
        a.float_or(key, default)
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

/// `Some(e)` for one expression, `None` for none.
macro_rules! optional {
    () => {
        None
    };
    ($e:expr) => {
        Some($e)
    };
}

/// The unary table. Its header names what the rows may use: the compute type, the
/// input, and the constants 0, 1 and 1/2 in that type. A row is
/// `Variant { attr: type = default }? => "Name" { value, derivative, cuda,
/// cuda_derivative }`; the attribute, when there is one, is in scope in all four.
macro_rules! unary_kinds {
    (
        <$T:ident> |$x:ident| $zero:ident, $one:ident, $half:ident;
        $(
            $(#[$doc:meta])*
            $V:ident $({ $attr:ident: $aty:ty = $default:expr })? => $name:literal {
                value: $value:expr,
                derivative: $derivative:expr,
                cuda: $cuda:expr,
                cuda_derivative: $cuda_derivative:expr $(,)?
            }
        )*
    ) => {
        /// A one-input elementwise function (see the table in this module).
        #[derive(Clone, Copy, Debug)]
        pub enum UnaryKind {
            $( $(#[$doc])* $V $({ $attr: $aty })?, )*
        }

        pub(crate) const UNARY_OPS: &[OpEntry] = &[$(
            OpEntry {
                name: $name,
                parse: |n, a| Ok(Box::new(Unary::new(UnaryKind::parse(n, a)?))),
            },
        )*];

        impl UnaryKind {
            pub fn name(self) -> &'static str {
                match self {
                    $( Self::$V { .. } => $name, )*
                }
            }

            /// The kind of the op named `name`, with its attribute (if any) read from
            /// `a`.
            pub(crate) fn parse(name: &str, a: &mut AttrReader) -> OpResult<UnaryKind> {
                match name {
                    $( $name => Ok(Self::$V $({
                        $attr: KindAttr::read(a, stringify!($attr), $default)?
                    })?), )*
                    other => Err(format!("unknown unary op '{other}'")),
                }
            }

            /// The kind's own attributes (Gelu's `approximate`, LeakyRelu's `alpha`).
            pub(crate) fn attrs(self) -> Vec<(&'static str, AttrValue)> {
                match self {
                    $( Self::$V $({ $attr })? => vec![$((stringify!($attr), $attr.into()))?], )*
                }
            }

            /// The attribute's bits, for `Eq` and `Hash`.
            fn attr_bits(self) -> Option<u64> {
                match self {
                    $( Self::$V $({ $attr })? => optional!($(KindAttr::bits($attr))?), )*
                }
            }

            /// The function itself, in the kernel's compute type.
            #[allow(unused_variables)]
            pub fn apply<$T: Real>(self, $x: $T) -> $T {
                let ($zero, $one, $half) = ($T::zero(), $T::one(), $T::lit(0.5));
                match self {
                    $( Self::$V $({ $attr })? => $value, )*
                }
            }

            /// The derivative `d apply(x) / dx`, in the kernel's compute type. At kinks
            /// it takes TensorFlow's side: Relu, Relu6 (also at 6), Abs and Sign have
            /// slope 0 at 0; LeakyRelu has `alpha` at 0; Elu and Selu take the right
            /// branch at 0 (TF tests `y < 0`).
            #[allow(unused_variables)]
            pub fn derivative<$T: Real>(self, $x: $T) -> $T {
                let ($zero, $one, $half) = ($T::zero(), $T::one(), $T::lit(0.5));
                match self {
                    $( Self::$V $({ $attr })? => $derivative, )*
                }
            }

            /// The CUDA C statement `C y = ...;` computing the function of `C x`.
            pub fn cuda_expr(&self) -> String {
                let e: String = match *self {
                    $( Self::$V $({ $attr })? => $cuda.into(), )*
                };
                format!("C y = {e};")
            }

            /// The CUDA C statements computing `C d`, the derivative at `C x`.
            pub fn cuda_derivative(&self) -> String {
                match *self {
                    $( Self::$V $({ $attr })? => $cuda_derivative.into(), )*
                }
            }
        }
    };
}

unary_kinds! {
    <T> |x| zero, one, half;

    Relu => "Relu" {
        value: x.max(zero),
        derivative: if x > zero { one } else { zero },
        cuda: "m_max(x, (C)0)",
        cuda_derivative: "C d = x > (C)0 ? (C)1 : (C)0;",
    }
    Relu6 => "Relu6" {
        value: x.max(zero).min(T::lit(6.0)),
        derivative: if x > zero && x < T::lit(6.0) { one } else { zero },
        cuda: "m_min(m_max(x, (C)0), (C)6)",
        cuda_derivative: "C d = (x > (C)0 && x < (C)6) ? (C)1 : (C)0;",
    }
    Elu => "Elu" {
        value: if x > zero { x } else { x.exp_m1() },
        derivative: if x < zero { x.exp() } else { one },
        cuda: "x > (C)0 ? x : m_expm1(x)",
        cuda_derivative: "C d = x < (C)0 ? m_exp(x) : (C)1;",
    }
    Selu => "Selu" {
        value: T::lit(SELU_SCALE) * if x > zero { x } else { T::lit(SELU_ALPHA) * x.exp_m1() },
        derivative: T::lit(SELU_SCALE) * if x < zero { T::lit(SELU_ALPHA) * x.exp() } else { one },
        cuda: format!(
            "(C){} * (x > (C)0 ? x : (C){} * m_expm1(x))",
            cuda_lit(SELU_SCALE),
            cuda_lit(SELU_ALPHA)
        ),
        cuda_derivative: format!(
            "C d = (C){} * (x < (C)0 ? (C){} * m_exp(x) : (C)1);",
            cuda_lit(SELU_SCALE),
            cuda_lit(SELU_ALPHA)
        ),
    }
    /// `x Phi(x)`, Phi the standard normal CDF; `approximate`: its tanh form
    /// `0.5 x (1 + tanh(u))`, `u = c (x + k x^3)`, `c = sqrt(2 / pi)`, `k = 0.044715`,
    /// computed as the same `x / (1 + exp(-2u))`: below zero `1 + tanh(u)` cancels (in
    /// f32, 8e-5 off at x = -3.5, all of it at -5.5), the quotient does not; and on
    /// the GPU one exponential and one reciprocal cost a third of `tanhf`'s
    /// instructions, which bound the FP8 cast computing GELU as it loads.
    Gelu { approximate: bool = false } => "Gelu" {
        value: if approximate {
            let inner = T::lit((2.0 / PI).sqrt()) * (x + T::lit(0.044715) * x * x * x);
            x / (one + (-(inner + inner)).exp())
        } else {
            half * x * (one + (x * T::FRAC_1_SQRT_2()).erf())
        },
        derivative: if approximate {
            // With u = c (x + k x^3), e = exp(-2u), s = 1 / (1 + e) (= 0.5 (1 + tanh u)):
            // s + 2 x s (1 - s) c (1 + 3 k x^2), where s (1 - s) = e s^2.
            let c = T::lit((2.0 / PI).sqrt());
            let k = T::lit(0.044715);
            let u = c * (x + k * x * x * x);
            let e = (-(u + u)).exp();
            let s = one / (one + e);
            let slope = e * s * s;
            let tail = if slope == zero || s == zero {
                zero // saturated: avoids 0 * inf for huge |x|
            } else {
                (x + x) * slope * c * (one + T::lit(3.0) * k * x * x)
            };
            s + tail
        } else {
            // Phi(x) + x phi(x), phi the standard normal density.
            let cdf = half * (one + (x * T::FRAC_1_SQRT_2()).erf());
            let pdf = (-half * x * x).exp() * T::lit(1.0 / (2.0 * PI).sqrt());
            // x * pdf is 0 where pdf underflows, even for infinite x.
            if pdf == zero {
                cdf
            } else {
                cdf + x * pdf
            }
        },
        cuda: if approximate {
            "m_gelu_tanh(x)".to_string()
        } else {
            "m_gelu(x)".to_string()
        },
        cuda_derivative: if approximate {
            "C d = m_gelu_tanh_grad(x);".to_string()
        } else {
            format!(
                "C cdf = m_fma((C)0.5, m_erf_clamped(x * (C){}), (C)0.5);\n\
                 C pdf = m_normal_pdf(x);\n\
                 C d = pdf == (C)0 ? cdf : m_fma(x, pdf, cdf);",
                cuda_lit(FRAC_1_SQRT_2)
            )
        },
    }
    LeakyRelu { alpha: f64 = 0.2 } => "LeakyRelu" {
        value: if x > zero { x } else { T::lit(alpha) * x },
        derivative: if x > zero { one } else { T::lit(alpha) },
        cuda: format!("x > (C)0 ? x : (C){} * x", cuda_lit(alpha)),
        cuda_derivative: format!("C d = x > (C)0 ? (C)1 : (C){};", cuda_lit(alpha)),
    }
    Tanh => "Tanh" {
        value: x.tanh(),
        derivative: {
            let t = x.tanh();
            one - t * t
        },
        cuda: "m_tanh(x)",
        cuda_derivative: "C t = m_tanh(x); C d = (C)1 - t * t;",
    }
    Sigmoid => "Sigmoid" {
        value: one / (one + (-x).exp()),
        derivative: {
            let s = one / (one + (-x).exp());
            s * (one - s)
        },
        cuda: "(C)1 / ((C)1 + m_exp(-x))",
        cuda_derivative: "C s = (C)1 / ((C)1 + m_exp(-x)); C d = s * ((C)1 - s);",
    }
    /// PyTorch's `hardsigmoid`, ONNX's HardSigmoid at alpha 1/6, beta 1/2:
    /// `relu6(x + 3) / 6`.
    HardSigmoid => "HardSigmoid" {
        value: (x + T::lit(3.0)).max(zero).min(T::lit(6.0)) / T::lit(6.0),
        derivative: if x > T::lit(-3.0) && x < T::lit(3.0) { T::lit(1.0 / 6.0) } else { zero },
        cuda: "m_min(m_max(x + (C)3, (C)0), (C)6) / (C)6",
        cuda_derivative: "C d = (x > (C)-3 && x < (C)3) ? (C)1 / (C)6 : (C)0;",
    }
    /// PyTorch's `hardswish` (ONNX's HardSwish): `x * relu6(x + 3) / 6`; the
    /// derivative is PyTorch's, `x / 3 + 1/2` on [-3, 3].
    HardSwish => "HardSwish" {
        value: x * (x + T::lit(3.0)).max(zero).min(T::lit(6.0)) / T::lit(6.0),
        derivative: if x < T::lit(-3.0) {
            zero
        } else if x <= T::lit(3.0) {
            x / T::lit(3.0) + half
        } else {
            one
        },
        cuda: "x * m_min(m_max(x + (C)3, (C)0), (C)6) / (C)6",
        cuda_derivative: "C d = x < (C)-3 ? (C)0 : (x <= (C)3 ? x / (C)3 + (C)0.5 : (C)1);",
    }
    Exp => "Exp" {
        value: x.exp(),
        derivative: x.exp(),
        cuda: "m_exp(x)",
        cuda_derivative: "C d = m_exp(x);",
    }
    Log => "Log" {
        value: x.ln(),
        derivative: one / x,
        cuda: "m_log(x)",
        cuda_derivative: "C d = (C)1 / x;",
    }
    Log1p => "Log1p" {
        value: x.ln_1p(),
        derivative: one / (one + x),
        cuda: "m_log1p(x)",
        cuda_derivative: "C d = (C)1 / ((C)1 + x);",
    }
    Sqrt => "Sqrt" {
        value: x.sqrt(),
        derivative: half / x.sqrt(),
        cuda: "m_sqrt(x)",
        cuda_derivative: "C d = (C)0.5 / m_sqrt(x);",
    }
    Rsqrt => "Rsqrt" {
        value: one / x.sqrt(),
        derivative: {
            let r = one / x.sqrt();
            -half * r * r * r
        },
        cuda: "(C)1 / m_sqrt(x)",
        cuda_derivative: "C r = (C)1 / m_sqrt(x); C d = -(C)0.5 * r * r * r;",
    }
    Square => "Square" {
        value: x * x,
        derivative: T::lit(2.0) * x,
        cuda: "x * x",
        cuda_derivative: "C d = (C)2 * x;",
    }
    Neg => "Neg" {
        value: -x,
        derivative: -one,
        cuda: "-x",
        cuda_derivative: "C d = (C)-1;",
    }
    Abs => "Abs" {
        value: x.abs(),
        // Sign(x).
        derivative: if x > zero { one } else if x < zero { -one } else { x },
        cuda: "m_abs(x)",
        cuda_derivative: "C d = x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : x);",
    }
    Erf => "Erf" {
        value: x.erf(),
        derivative: T::lit(FRAC_2_SQRT_PI) * (-x * x).exp(),
        cuda: "m_erf(x)",
        cuda_derivative: format!("C d = (C){} * m_exp(-x * x);", cuda_lit(FRAC_2_SQRT_PI)),
    }
    /// Sinusoidal position embeddings computed from positions (Funnel's, XLNet's).
    Sin => "Sin" {
        value: x.sin(),
        derivative: x.cos(),
        cuda: "m_sin(x)",
        cuda_derivative: "C d = m_cos(x);",
    }
    Cos => "Cos" {
        value: x.cos(),
        derivative: -x.sin(),
        cuda: "m_cos(x)",
        cuda_derivative: "C d = -m_sin(x);",
    }
    /// `log(1 + exp(x))`.
    Softplus => "Softplus" {
        // max(x, 0) + log1p(exp(-|x|)): no overflow for large x.
        value: x.max(zero) + (-x.abs()).exp().ln_1p(),
        // The logistic function, in a form that never overflows.
        derivative: if x >= zero {
            one / (one + (-x).exp())
        } else {
            let e = x.exp();
            e / (one + e)
        },
        cuda: "m_max(x, (C)0) + m_log1p(m_exp(-m_abs(x)))",
        cuda_derivative: "C d; if (x >= (C)0) { d = (C)1 / ((C)1 + m_exp(-x)); } \
                          else { C e = m_exp(x); d = e / ((C)1 + e); }",
    }
    Reciprocal => "Reciprocal" {
        value: one / x,
        derivative: {
            let r = one / x;
            -(r * r)
        },
        cuda: "(C)1 / x",
        cuda_derivative: "C r = (C)1 / x; C d = -(r * r);",
    }
    Sign => "Sign" {
        // The sign keeps NaN and signed zero.
        value: if x > zero { one } else if x < zero { -one } else { x },
        derivative: zero,
        cuda: "x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : x)",
        cuda_derivative: "C d = (C)0;",
    }
    Identity => "Identity" {
        value: x,
        derivative: one,
        cuda: "x",
        cuda_derivative: "C d = (C)1;",
    }
}

impl UnaryKind {
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
}

/// Kinds are equal when they are the same function: the same variant with the same
/// attribute bits (so a NaN `alpha` equals itself, and `-0.0` differs from `0.0`).
impl PartialEq for UnaryKind {
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.attr_bits() == other.attr_bits()
    }
}

impl Eq for UnaryKind {}

impl Hash for UnaryKind {
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::mem::discriminant(self).hash(state);
        self.attr_bits().hash(state);
    }
}

/// The binary table. Its header names what the rows may use: the compute type, the
/// operands, the output gradient, and the constants 0 and 1 in that type. A row is
/// `Variant => "Name" { value, grad_a, grad_b, cuda, cuda_grad_a, cuda_grad_b }`, the
/// gradients being the loss gradients of `a` and of `b` (`dy` times the partial).
macro_rules! binary_kinds {
    (
        <$T:ident> |$a:ident, $b:ident, $dy:ident| $zero:ident, $one:ident;
        $(
            $(#[$doc:meta])*
            $V:ident => $name:literal {
                value: $value:expr,
                grad_a: $grad_a:expr,
                grad_b: $grad_b:expr,
                cuda: $cuda:literal,
                cuda_grad_a: $cuda_grad_a:literal,
                cuda_grad_b: $cuda_grad_b:literal $(,)?
            }
        )*
    ) => {
        /// A two-input elementwise function (see the table in this module).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryKind {
            $( $(#[$doc])* $V, )*
        }

        pub(crate) const BINARY_OPS: &[OpEntry] = &[$(
            OpEntry {
                name: $name,
                parse: |n, _| Ok(Box::new(Binary::new(BinaryKind::parse(n)?))),
            },
        )*];

        impl BinaryKind {
            pub const ALL: [BinaryKind; [$($name),*].len()] = [$(BinaryKind::$V),*];

            pub fn name(self) -> &'static str {
                match self {
                    $( Self::$V => $name, )*
                }
            }

            /// The kind of the op named `name`.
            pub(crate) fn parse(name: &str) -> OpResult<BinaryKind> {
                match name {
                    $( $name => Ok(Self::$V), )*
                    other => Err(format!("unknown binary op '{other}'")),
                }
            }

            /// The function itself, in the kernel's compute type.
            #[allow(unused_variables)]
            pub fn apply<$T: Real>(self, $a: $T, $b: $T) -> $T {
                match self {
                    $( Self::$V => $value, )*
                }
            }

            /// The loss gradient of operand `wrt` (0: a, 1: b) at one element: `dy`
            /// times the partial derivative, in TensorFlow's forms. Maximum and
            /// Minimum send the whole gradient to one operand, a tie going to `a`
            /// (TF's `x >= y` and `x <= y` masks; a NaN operand sends it to `b`).
            /// Pow's `d/db` is 0 where `a <= 0` (TF), and `d/da` is 0 where `b == 0`
            /// (the derivative of the constant `a^0`).
            #[allow(unused_variables)]
            pub fn grad<$T: Real>(self, wrt: usize, $a: $T, $b: $T, $dy: $T) -> $T {
                let ($zero, $one) = ($T::zero(), $T::one());
                match self {
                    $( Self::$V => if wrt == 0 { $grad_a } else { $grad_b }, )*
                }
            }

            /// The CUDA C expression of `C a` and `C b` computing the function.
            pub fn cuda_expr(&self) -> &'static str {
                match self {
                    $( Self::$V => $cuda, )*
                }
            }

            /// The CUDA C expression of `C a`, `C b` and the output gradient `C g`
            /// computing the loss gradient of operand `wrt` (0: a, 1: b).
            pub fn cuda_grad_expr(&self, wrt: usize) -> &'static str {
                match self {
                    $( Self::$V => if wrt == 0 { $cuda_grad_a } else { $cuda_grad_b }, )*
                }
            }
        }
    };
}

binary_kinds! {
    <T> |a, b, dy| zero, one;

    Add => "Add" {
        value: a + b,
        grad_a: dy,
        grad_b: dy,
        cuda: "a + b",
        cuda_grad_a: "g",
        cuda_grad_b: "g",
    }
    Sub => "Sub" {
        value: a - b,
        grad_a: dy,
        grad_b: -dy,
        cuda: "a - b",
        cuda_grad_a: "g",
        cuda_grad_b: "-g",
    }
    Mul => "Mul" {
        value: a * b,
        grad_a: dy * b,
        grad_b: dy * a,
        cuda: "a * b",
        cuda_grad_a: "g * b",
        cuda_grad_b: "g * a",
    }
    Div => "Div" {
        value: a / b,
        grad_a: dy / b,
        grad_b: dy * (-a / b) / b,
        cuda: "a / b",
        cuda_grad_a: "g / b",
        cuda_grad_b: "g * (-a / b) / b",
    }
    /// NaN wins, as in TensorFlow and CUDA's fmaxf on NaN-propagating paths.
    Maximum => "Maximum" {
        value: if a.is_nan() || b.is_nan() { T::nan() } else { a.max(b) },
        grad_a: if a >= b { dy } else { zero },
        grad_b: if a >= b { zero } else { dy },
        cuda: "(m_isnan(a) || m_isnan(b)) ? (C)F_NAN : m_max(a, b)",
        cuda_grad_a: "(a >= b) ? g : (C)0",
        cuda_grad_b: "(a >= b) ? (C)0 : g",
    }
    /// NaN wins, as for Maximum.
    Minimum => "Minimum" {
        value: if a.is_nan() || b.is_nan() { T::nan() } else { a.min(b) },
        grad_a: if a <= b { dy } else { zero },
        grad_b: if a <= b { zero } else { dy },
        cuda: "(m_isnan(a) || m_isnan(b)) ? (C)F_NAN : m_min(a, b)",
        cuda_grad_a: "(a <= b) ? g : (C)0",
        cuda_grad_b: "(a <= b) ? (C)0 : g",
    }
    Pow => "Pow" {
        value: a.powf(b),
        grad_a: if b == zero { zero } else { dy * b * a.powf(b - one) },
        grad_b: if a > zero { dy * a.powf(b) * a.ln() } else { zero },
        cuda: "m_pow(a, b)",
        cuda_grad_a: "b == (C)0 ? (C)0 : g * b * m_pow(a, b - (C)1)",
        cuda_grad_b: "a > (C)0 ? g * m_pow(a, b) * m_log(a) : (C)0",
    }
    SquaredDifference => "SquaredDifference" {
        value: (a - b) * (a - b),
        grad_a: T::lit(2.0) * (a - b) * dy,
        grad_b: -(T::lit(2.0) * (a - b) * dy),
        cuda: "(a - b) * (a - b)",
        cuda_grad_a: "(C)2 * (a - b) * g",
        cuda_grad_b: "-((C)2 * (a - b) * g)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A few CUDA expressions pinned to the exact text the code generator inlines.
    #[test]
    fn cuda_expressions_are_pinned() {
        assert_eq!(UnaryKind::Relu.cuda_expr(), "C y = m_max(x, (C)0);");
        assert_eq!(
            UnaryKind::Relu.cuda_derivative(),
            "C d = x > (C)0 ? (C)1 : (C)0;"
        );
        let gelu = UnaryKind::Gelu { approximate: false };
        assert_eq!(gelu.cuda_expr(), "C y = m_gelu(x);");
        assert_eq!(
            gelu.cuda_derivative(),
            "C cdf = m_fma((C)0.5, m_erf_clamped(x * (C)7.071067811865476e-1), (C)0.5);\n\
             C pdf = m_normal_pdf(x);\n\
             C d = pdf == (C)0 ? cdf : m_fma(x, pdf, cdf);"
        );
        let leaky = UnaryKind::LeakyRelu { alpha: 0.2 };
        assert_eq!(leaky.cuda_expr(), "C y = x > (C)0 ? x : (C)2e-1 * x;");
        assert_eq!(leaky.cuda_derivative(), "C d = x > (C)0 ? (C)1 : (C)2e-1;");
        assert_eq!(
            UnaryKind::Selu.cuda_expr(),
            "C y = (C)1.0507009873554805e0 * (x > (C)0 ? x : (C)1.6732632423543774e0 * m_expm1(x));"
        );
        assert_eq!(
            BinaryKind::Maximum.cuda_expr(),
            "(m_isnan(a) || m_isnan(b)) ? (C)F_NAN : m_max(a, b)"
        );
        assert_eq!(
            BinaryKind::Pow.cuda_grad_expr(1),
            "a > (C)0 ? g * m_pow(a, b) * m_log(a) : (C)0"
        );
        assert_eq!(cuda_lit(f64::NEG_INFINITY), "(-F_INF)");
    }

    #[test]
    fn names_parse_back() {
        for entry in UNARY_OPS {
            let kind =
                UnaryKind::parse(entry.name, &mut AttrReader::new(Default::default())).unwrap();
            assert_eq!(kind.name(), entry.name);
        }
        for kind in BinaryKind::ALL {
            assert_eq!(BinaryKind::parse(kind.name()), Ok(kind));
        }
        assert_eq!(BINARY_OPS.len(), BinaryKind::ALL.len());
    }

    /// Equality and hashing go by the attribute's bits.
    #[test]
    fn kinds_compare_by_bits() {
        let leaky = |alpha| UnaryKind::LeakyRelu { alpha };
        assert_eq!(leaky(f64::NAN), leaky(f64::NAN));
        assert_ne!(leaky(0.0), leaky(-0.0));
        assert_ne!(leaky(0.2), UnaryKind::Relu);
        assert_ne!(
            UnaryKind::Gelu { approximate: false },
            UnaryKind::Gelu { approximate: true }
        );
        let set: HashSet<UnaryKind> = [leaky(0.2), leaky(0.2), leaky(0.1), UnaryKind::Relu]
            .into_iter()
            .collect();
        assert_eq!(set.len(), 3);
    }
}
