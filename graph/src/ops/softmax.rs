//! Softmax, LogSoftmax and the softmax cross-entropy loss.
//!
//! All three subtract the maximum before exponentiating (no overflow for large
//! logits), accumulate in the compute type (f32 for f16/bf16/f32, f64 for f64) and
//! round once on store. Their gradients are `SoftmaxGrad` (from the forward output,
//! no exponential of unbounded values) and `SoftmaxCrossEntropyGrad`.

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::TypeGroup;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::{widens_exactly, FusedElementwise, Pad, Reduce, ReduceKind, Slice};
use crate::shape::normalize_axis;
use crate::tensor::{ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "Softmax",
        parse: |_, a| {
            Ok(Box::new(Softmax {
                axis: read_axis(a)?,
            }))
        },
    },
    OpEntry {
        name: "LogSoftmax",
        parse: |_, a| {
            Ok(Box::new(LogSoftmax {
                axis: read_axis(a)?,
            }))
        },
    },
    OpEntry {
        name: "SoftmaxCrossEntropy",
        parse: |_, _| Ok(Box::new(SoftmaxCrossEntropy)),
    },
    OpEntry {
        name: "FusedSoftmax",
        parse: |_, a| {
            let (axis, log) = (read_axis(a)?, a.bool_or("log", false)?);
            FusedSoftmax::new(axis, log, FusedElementwise::parse(a)?).map(|op| Box::new(op) as _)
        },
    },
];

pub(crate) const GRAD_OPS: &[OpEntry] = &[
    OpEntry {
        name: "SoftmaxGrad",
        parse: |_, a| {
            Ok(Box::new(SoftmaxGrad {
                axis: read_axis(a)?,
                log: a.bool_or("log", false)?,
            }))
        },
    },
    OpEntry {
        name: "SoftmaxCrossEntropyGrad",
        parse: |_, _| Ok(Box::new(SoftmaxCrossEntropyGrad)),
    },
    OpEntry {
        name: "SoftmaxCrossEntropyWithGrad",
        parse: |_, a| {
            Ok(Box::new(SoftmaxCrossEntropyWithGrad {
                grad_dtype: a.opt_dtype("grad_dtype")?,
                column_sum: a.bool_or("column_sum", false)?,
                classes: a
                    .opt_int("classes")?
                    .map(usize::try_from)
                    .transpose()
                    .map_err(|_| "classes must not be negative".to_string())?,
            }))
        },
    },
];

/// The gradient of output 0, if it reaches the loss.
/// The gradient rule of Softmax and LogSoftmax: `SoftmaxGrad(y, dy)`.
fn softmax_gradient(
    axis: i64,
    log: bool,
    b: &mut GradBuilder,
    outputs: &[Port],
    grads: &[Option<Port>],
) -> Result<Vec<Option<Port>>, GraphError> {
    let [y] = fixed(outputs).map_err(GraphError::Format)?;
    let Some(dy) = grad0(grads) else {
        return Ok(vec![None]);
    };
    Ok(vec![Some(b.add(SoftmaxGrad { axis, log }, &[*y, dy])?)])
}

fn read_axis(a: &mut AttrReader) -> OpResult<i64> {
    Ok(a.opt_int("axis")?.unwrap_or(-1))
}

/// Softmax or log-softmax of `x` along `axis`, in the compute type.
fn softmax_along<T: Real>(x: &Tensor, axis: i64, log: bool) -> OpResult<Vec<T>> {
    let shape = x.shape();
    let axis = normalize_axis(axis, shape.len())?;
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let xs = T::read(x);
    let mut y = vec![T::zero(); xs.len()];
    if len == 0 || inner == 0 {
        return Ok(y);
    }
    let outer = xs.len() / (len * inner);
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * len + k) * inner + i;
            let max = (0..len).map(|k| xs[at(k)]).fold(T::neg_infinity(), |m, v| {
                if v > m || v.is_nan() {
                    v
                } else {
                    m
                }
            });
            // A non-finite max (an all -inf row, +inf, NaN) would make x - max NaN for
            // every element; shifting by 0 instead gives the same NaN result as TensorFlow
            // without relying on inf - inf.
            let shift = if max.is_finite() { max } else { T::zero() };
            let sum: T = (0..len).map(|k| (xs[at(k)] - shift).exp()).sum();
            if log {
                let lse = sum.ln();
                for k in 0..len {
                    y[at(k)] = xs[at(k)] - shift - lse;
                }
            } else {
                for k in 0..len {
                    y[at(k)] = (xs[at(k)] - shift).exp() / sum;
                }
            }
        }
    }
    Ok(y)
}

fn infer_softmax(axis: i64, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
    let [x] = fixed(inputs)?;
    require_float("the input", x.dtype)?;
    normalize_axis(axis, x.rank())?;
    Ok(vec![(*x).clone()])
}

/// `exp(x - max) / sum(exp(x - max))` along `axis` (default -1).
#[derive(Clone, Debug, PartialEq)]
pub struct Softmax {
    pub axis: i64,
}

/// `x - max - log(sum(exp(x - max)))` along `axis` (default -1).
#[derive(Clone, Debug, PartialEq)]
pub struct LogSoftmax {
    pub axis: i64,
}

/// Default, kernel and `Op` of Softmax (`log: false`) and LogSoftmax (`log: true`),
/// which differ only in their name and `log`.
macro_rules! softmax_op {
    ($ty:ident, $log:literal) => {
        impl Default for $ty {
            fn default() -> Self {
                $ty { axis: -1 }
            }
        }

        impl FloatKernel for $ty {
            fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
                let [x] = fixed(inputs)?;
                Ok(vec![(
                    x.shape().to_vec(),
                    softmax_along(x, self.axis, $log)?,
                )])
            }
        }

        impl Op for $ty {
            fn name(&self) -> &'static str {
                stringify!($ty)
            }
            fn arity(&self) -> Arity {
                Arity::Exactly(1)
            }
            fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
                vec![("axis", self.axis.into())]
            }
            fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
                infer_softmax(self.axis, inputs)
            }
            fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
                let [x] = fixed(inputs)?;
                infer_softmax(self.axis, &[&x.ty()])?;
                eval_float(self, x.dtype(), inputs)
            }
            fn gradient(
                &self,
                b: &mut GradBuilder,
                _inputs: &[Port],
                outputs: &[Port],
                grads: &[Option<Port>],
            ) -> Result<Vec<Option<Port>>, GraphError> {
                softmax_gradient(self.axis, $log, b, outputs, grads)
            }
        }
    };
}

softmax_op!(Softmax, false);
softmax_op!(LogSoftmax, true);

/// Softmax (`log: false`) or LogSoftmax (`log: true`) along `axis` of the value an
/// elementwise program computes (the `softmax-prologue` pass builds it from a Softmax
/// and the fused program or lone elementwise node computing its operand for it alone:
/// a mask added, a scale, a cast): the inputs are the program's, the output the
/// softmax of its one output. A kernel computes the program's value as it loads the row, so the
/// value is never stored and read back. The CPU kernel runs the program (rounding its
/// value to its dtype, as the node it replaces stored it) and then the softmax's own
/// kernel: bit-exact against the ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedSoftmax {
    pub axis: i64,
    pub log: bool,
    prologue: FusedElementwise,
}

impl FusedSoftmax {
    /// The softmax of `prologue`'s value: a program with one output and no column sums
    /// or amaxes.
    pub fn new(axis: i64, log: bool, prologue: FusedElementwise) -> OpResult<FusedSoftmax> {
        let reductions = prologue.column_sums().len() + prologue.amaxes().len();
        if prologue.outputs().len() != 1 || reductions > 0 {
            return Err(format!(
                "a softmax prologue outputs one value and no column sums or amaxes, this one {} values and {reductions} reductions",
                prologue.outputs().len(),
            ));
        }
        Ok(FusedSoftmax {
            axis,
            log,
            prologue,
        })
    }

    /// The program computing the softmax's operand.
    pub fn prologue(&self) -> &FusedElementwise {
        &self.prologue
    }

    /// The softmax applied to the prologue's value, as a node of its own.
    pub fn softmax(&self) -> Box<dyn Op> {
        if self.log {
            Box::new(LogSoftmax { axis: self.axis })
        } else {
            Box::new(Softmax { axis: self.axis })
        }
    }
}

impl Op for FusedSoftmax {
    fn name(&self) -> &'static str {
        "FusedSoftmax"
    }
    fn arity(&self) -> Arity {
        self.prologue.arity()
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![("axis", self.axis.into()), ("log", self.log.into())];
        attrs.extend(self.prologue.attrs());
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let x = self.prologue.infer(inputs)?;
        infer_softmax(self.axis, &x.iter().collect::<Vec<_>>())
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let x = self.prologue.eval(inputs)?;
        self.softmax().eval(&x.iter().collect::<Vec<_>>())
    }
    /// Each input and the output keep their types, as the program's do.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        self.prologue.type_groups(num_inputs, num_outputs)
    }
}

/// The gradient of Softmax (`log: false`) or LogSoftmax (`log: true`) along `axis`,
/// from the forward output `y` and its loss gradient `dy` (same shape and dtype):
/// `dx = y * (dy - sum(dy * y))` for Softmax and `dx = dy - exp(y) * sum(dy)` for
/// LogSoftmax, sums along `axis`. Only bounded values are exponentiated (`y <= 0`).
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxGrad {
    pub axis: i64,
    pub log: bool,
}

impl SoftmaxGrad {
    fn check(&self, y: &TensorType, dy: &TensorType) -> OpResult<()> {
        same_dtype(&[y, dy])?;
        require_float("the inputs", y.dtype)?;
        normalize_axis(self.axis, y.rank())?;
        if y.shape != dy.shape {
            return Err(format!(
                "dy has shape {} but y has shape {}",
                ShapeDisplay(&dy.shape),
                ShapeDisplay(&y.shape)
            ));
        }
        Ok(())
    }
}

impl FloatKernel for SoftmaxGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [y, dy] = fixed(inputs)?;
        self.check(&y.ty(), &dy.ty())?;
        let shape = y.shape();
        let axis = normalize_axis(self.axis, shape.len())?;
        let len = shape[axis];
        let inner: usize = shape[axis + 1..].iter().product();
        let (ys, gs) = (T::read(y), T::read(dy));
        let mut dx = vec![T::zero(); ys.len()];
        if len == 0 || inner == 0 {
            return Ok(vec![(shape.to_vec(), dx)]);
        }
        let outer = ys.len() / (len * inner);
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * len + k) * inner + i;
                if self.log {
                    let sum: T = (0..len).map(|k| gs[at(k)]).sum();
                    for k in 0..len {
                        dx[at(k)] = gs[at(k)] - ys[at(k)].exp() * sum;
                    }
                } else {
                    let dot: T = (0..len).map(|k| gs[at(k)] * ys[at(k)]).sum();
                    for k in 0..len {
                        dx[at(k)] = ys[at(k)] * (gs[at(k)] - dot);
                    }
                }
            }
        }
        Ok(vec![(shape.to_vec(), dx)])
    }
}

impl Op for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "SoftmaxGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("axis", self.axis.into()), ("log", self.log.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [y, dy] = fixed(inputs)?;
        self.check(y, dy)?;
        Ok(vec![(*y).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [y, dy] = fixed(inputs)?;
        self.check(&y.ty(), &dy.ty())?;
        eval_float(self, y.dtype(), inputs)
    }
}

/// Sparse softmax cross-entropy: `logits [N, C]` (float) and class indices
/// `labels [N]` (i32 or i64); the output is the mean over the batch of
/// `logsumexp(logits[n]) - logits[n, labels[n]]`, a scalar in logits' dtype.
/// A label outside `[0, C)` is an error at evaluation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoftmaxCrossEntropy;

impl FloatKernel for SoftmaxCrossEntropy {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [logits, labels] = fixed(inputs)?;
        let [n, c] = logits.shape() else {
            return Err(format!(
                "logits must have rank 2 [N, C], got {}",
                ShapeDisplay(logits.shape())
            ));
        };
        let (n, c) = (*n, *c);
        let labels = labels
            .to_i64_vec()
            .ok_or_else(|| format!("labels must be i32 or i64, got {}", labels.dtype()))?;
        if labels.len() != n {
            return Err(format!("{} labels for {n} rows of logits", labels.len()));
        }
        let xs = T::read(logits);
        let mut total = T::zero();
        for (row, &label) in labels.iter().enumerate() {
            let xs = xs
                .get(row * c..(row + 1) * c)
                .ok_or("logits have fewer values than their shape")?;
            let class = usize::try_from(label)
                .ok()
                .filter(|&k| k < c)
                .ok_or_else(|| {
                    format!("labels[{row}] = {label} is out of range [0, {c}) for {c} classes")
                })?;
            let max = xs.iter().fold(
                T::neg_infinity(),
                |m, &v| if v > m || v.is_nan() { v } else { m },
            );
            let shift = if max.is_finite() { max } else { T::zero() };
            let lse = xs.iter().map(|&v| (v - shift).exp()).sum::<T>().ln() + shift;
            total = total + (lse - xs[class]);
        }
        Ok(vec![(vec![], vec![total / T::lit(n as f64)])])
    }
}

impl Op for SoftmaxCrossEntropy {
    fn name(&self) -> &'static str {
        "SoftmaxCrossEntropy"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [logits, labels] = fixed(inputs)?;
        require_float("logits", logits.dtype)?;
        if logits.rank() != 2 {
            return Err(format!(
                "logits must have rank 2 [N, C], got {}",
                ShapeDisplay(&logits.shape)
            ));
        }
        if labels.dtype.is_float() {
            return Err(format!(
                "labels are {} but must be integer class indices (i32 or i64); \
                 float (one-hot or soft) labels are not accepted",
                labels.dtype
            ));
        }
        if !matches!(labels.dtype, DType::I32 | DType::I64) {
            return Err(format!(
                "labels must be i32 or i64 class indices, got {}",
                labels.dtype
            ));
        }
        if labels.shape != [logits.shape[0]] {
            return Err(format!(
                "labels have shape {} but logits {} need [{}]",
                ShapeDisplay(&labels.shape),
                ShapeDisplay(&logits.shape),
                logits.shape[0]
            ));
        }
        Ok(vec![TensorType::new(logits.dtype, [])])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [logits, labels] = fixed(inputs)?;
        self.infer(&[&logits.ty(), &labels.ty()])?;
        eval_float(self, logits.dtype(), inputs)
    }
    /// Only the logits follow the compute type; the labels keep their integer dtype.
    fn typed_inputs(&self, _num_inputs: usize) -> Vec<usize> {
        vec![0]
    }
    /// `dlogits = SoftmaxCrossEntropyGrad(logits, labels, dloss)`; labels get none.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [logits, labels] = fixed(inputs).map_err(GraphError::Format)?;
        let Some(dloss) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        let dlogits = b.add(SoftmaxCrossEntropyGrad, &[*logits, *labels, dloss])?;
        Ok(vec![Some(dlogits), None])
    }
}

/// The gradient of [`SoftmaxCrossEntropy`] with respect to the logits: inputs
/// `(logits [N, C], labels [N], dloss [])`, output `[N, C]` in logits' dtype:
/// `(softmax(logits) - onehot(labels)) * dloss / N`, the softmax computed with the
/// maximum subtracted. A label outside `[0, C)` is an error at evaluation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoftmaxCrossEntropyGrad;

impl FloatKernel for SoftmaxCrossEntropyGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [logits, labels, dloss] = fixed(inputs)?;
        self.infer(&[&logits.ty(), &labels.ty(), &dloss.ty()])?;
        let (n, c) = (logits.shape()[0], logits.shape()[1]);
        let labels = labels
            .to_i64_vec()
            .ok_or_else(|| format!("labels must be i32 or i64, got {}", labels.dtype()))?;
        let scale = T::read(dloss)
            .first()
            .copied()
            .ok_or("dloss has no value")?
            / T::lit(n as f64);
        let xs = T::read(logits);
        let mut dx = vec![T::zero(); xs.len()];
        for (row, &label) in labels.iter().enumerate() {
            let range = row * c..(row + 1) * c;
            let (Some(xs), Some(out)) = (xs.get(range.clone()), dx.get_mut(range)) else {
                return Err("logits have fewer values than their shape".into());
            };
            let class = usize::try_from(label)
                .ok()
                .filter(|&k| k < c)
                .ok_or_else(|| {
                    format!("labels[{row}] = {label} is out of range [0, {c}) for {c} classes")
                })?;
            let max = xs.iter().fold(
                T::neg_infinity(),
                |m, &v| if v > m || v.is_nan() { v } else { m },
            );
            let shift = if max.is_finite() { max } else { T::zero() };
            let exps: Vec<T> = xs.iter().map(|&v| (v - shift).exp()).collect();
            let sum: T = exps.iter().copied().sum();
            // p - 1 for the label as -(sum of the other classes) / sum: no cancellation
            // when p is close to 1.
            let others: T = exps
                .iter()
                .enumerate()
                .filter(|&(k, _)| k != class)
                .map(|(_, &e)| e)
                .sum();
            for (k, (o, &e)) in out.iter_mut().zip(&exps).enumerate() {
                let d = if k == class { -others / sum } else { e / sum };
                *o = d * scale;
            }
        }
        Ok(vec![(logits.shape().to_vec(), dx)])
    }
}

impl Op for SoftmaxCrossEntropyGrad {
    fn name(&self) -> &'static str {
        "SoftmaxCrossEntropyGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [logits, labels, dloss] = fixed(inputs)?;
        SoftmaxCrossEntropy.infer(&[logits, labels])?;
        if dloss.dtype != logits.dtype {
            return Err(format!(
                "dloss is {} but logits are {}",
                dloss.dtype, logits.dtype
            ));
        }
        if !dloss.shape.is_empty() {
            return Err(format!(
                "dloss must be a scalar, got shape {}",
                ShapeDisplay(&dloss.shape)
            ));
        }
        Ok(vec![(*logits).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [logits, _, _] = fixed(inputs)?;
        eval_float(self, logits.dtype(), inputs)
    }
    /// Only the logits and dloss follow the compute type; the labels keep theirs.
    fn typed_inputs(&self, _num_inputs: usize) -> Vec<usize> {
        vec![0, 2]
    }
}

/// [`SoftmaxCrossEntropy`] and [`SoftmaxCrossEntropyGrad`] of the same logits in one
/// op (the `fuse-cross-entropy` pass builds it), so a kernel reads the logits once for
/// both: inputs `(logits [N, C], labels [N], dloss [])`, outputs the loss (a scalar of
/// dloss' dtype, the compute type), `dlogits [N, C]` and, with `column_sum`, the sum
/// of `dlogits` over the batch `[C]` (the output bias' gradient, as a `Sum` over axis
/// 0 of the compute-type gradient gives it).
///
/// Logits narrower than the compute type are widened exactly first (a widening Cast
/// folded in); `dlogits` is rounded once to `grad_dtype` where that is set (a
/// narrowing Cast of the gradient folded in), else it has the compute type; the
/// column sum adds the values before that rounding.
///
/// With `classes`, only the logits' first `classes` columns are classes: the rest are
/// padding (a GEMM's result padded for Tensor Cores, `pad-gemm`), never read, and
/// their gradient is zero, so `dlogits` is the gradient of the sliced logits padded
/// with zero columns, as the padded product reading it wants.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SoftmaxCrossEntropyWithGrad {
    pub grad_dtype: Option<DType>,
    pub column_sum: bool,
    pub classes: Option<usize>,
}

/// The most classes whose gradient's column sum [`SoftmaxCrossEntropyWithGrad`] takes:
/// the CUDA kernel holds each thread's share of a row, and its column sums, in
/// registers (16 of each for 256 threads).
pub const MAX_SUMMED_CLASSES: usize = 4096;

impl SoftmaxCrossEntropyWithGrad {
    /// The Sum that gives output 2 from the compute-type gradient.
    pub fn column_sum_op() -> Reduce {
        Reduce::new(ReduceKind::Sum, Some(vec![0]), false)
    }

    /// With `classes`, the Slice of `logits` (`[N, W]`) that holds the classes and
    /// the padding's width.
    fn class_slice(&self, logits: &TensorType) -> OpResult<Option<(Slice, i64)>> {
        let Some(classes) = self.classes else {
            return Ok(None);
        };
        match logits.shape[..] {
            [rows, width] if (1..=width).contains(&classes) => Ok(Some((
                Slice::new([0, 0], [rows as i64, classes as i64]),
                (width - classes) as i64,
            ))),
            _ => Err(format!(
                "{classes} classes must be 1 to the width of the [rows, columns] logits, which are {}",
                ShapeDisplay(&logits.shape)
            )),
        }
    }
}

impl Op for SoftmaxCrossEntropyWithGrad {
    fn name(&self) -> &'static str {
        "SoftmaxCrossEntropyWithGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs: Vec<(&'static str, AttrValue)> = Vec::new();
        if let Some(d) = self.grad_dtype {
            attrs.push(("grad_dtype", AttrValue::Str(d.to_string())));
        }
        if self.column_sum {
            attrs.push(("column_sum", true.into()));
        }
        if let Some(c) = self.classes {
            attrs.push(("classes", AttrValue::Int(c as i64)));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [padded, labels, dloss] = fixed(inputs)?;
        let logits = &match self.class_slice(padded)? {
            Some((slice, _)) => slice.infer(&[padded])?.remove(0),
            None => (*padded).clone(),
        };
        let compute = dloss.dtype;
        require_float("dloss", compute)?;
        require_float("logits", logits.dtype)?;
        if !widens_exactly(logits.dtype, compute) {
            return Err(format!(
                "logits are {} but dloss is {compute}: logits must be dloss' dtype or one it widens from exactly",
                logits.dtype
            ));
        }
        let wide = TensorType::new(compute, logits.shape.clone());
        SoftmaxCrossEntropyGrad.infer(&[&wide, labels, dloss])?;
        let grad_dtype = self.grad_dtype.unwrap_or(compute);
        require_float("grad_dtype", grad_dtype)?;
        // The gradient has the padded logits' shape.
        let grad = |dtype: DType| TensorType::new(dtype, padded.shape.clone());
        let mut out = vec![TensorType::new(compute, []), grad(grad_dtype)];
        if self.column_sum {
            out.extend(Self::column_sum_op().infer(&[&grad(compute)])?);
        }
        Ok(out)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [logits, labels, dloss] = fixed(inputs)?;
        let types = [logits.ty(), labels.ty(), dloss.ty()];
        let out = self.infer(&types.iter().collect::<Vec<_>>())?;
        let class_slice = self.class_slice(&types[0])?;
        let sliced;
        let logits = match &class_slice {
            Some((slice, _)) => {
                sliced = slice.eval(&[logits])?.remove(0);
                &sliced
            }
            None => logits,
        };
        let wide = logits.cast(dloss.dtype());
        let mut outputs = eval_float(&SoftmaxCrossEntropy, dloss.dtype(), &[&wide, labels])?;
        let grad = eval_float(
            &SoftmaxCrossEntropyGrad,
            dloss.dtype(),
            &[&wide, labels, dloss],
        )?
        .remove(0);
        let grad = match class_slice {
            Some((_, pad)) => Pad::constant([[0, 0], [0, pad]], 0.0)
                .eval(&[&grad])?
                .remove(0),
            None => grad,
        };
        let sums = if self.column_sum {
            Self::column_sum_op().eval(&[&grad])?
        } else {
            Vec::new()
        };
        outputs.push(grad.cast(out[1].dtype));
        outputs.extend(sums);
        Ok(outputs)
    }
    /// A rewrite after mixed precision: every type stays as the pass chose it.
    fn type_groups(&self, _num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        let mut groups = vec![
            TypeGroup::new(vec![2], vec![0]).fixed(),
            TypeGroup::new(vec![0], vec![]).fixed(),
            TypeGroup::new(vec![1], vec![]).fixed(),
        ];
        groups.extend((1..num_outputs).map(|k| TypeGroup::new(vec![], vec![k]).fixed()));
        groups
    }
}
