//! Softmax, LogSoftmax and the softmax cross-entropy loss.
//!
//! All three subtract the maximum before exponentiating (no overflow for large
//! logits), accumulate in the compute type (f32 for f16/bf16/f32, f64 for f64) and
//! round once on store.

use crate::attrs::{AttrReader, AttrValue};
use crate::dtype::DType;
use crate::kernel::{eval_float, require_float, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
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
];

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

impl Default for Softmax {
    fn default() -> Self {
        Softmax { axis: -1 }
    }
}

impl FloatKernel for Softmax {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        Ok(vec![(
            x.shape().to_vec(),
            softmax_along(x, self.axis, false)?,
        )])
    }
}

impl Op for Softmax {
    fn name(&self) -> &'static str {
        "Softmax"
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
}

/// `x - max - log(sum(exp(x - max)))` along `axis` (default -1).
#[derive(Clone, Debug, PartialEq)]
pub struct LogSoftmax {
    pub axis: i64,
}

impl Default for LogSoftmax {
    fn default() -> Self {
        LogSoftmax { axis: -1 }
    }
}

impl FloatKernel for LogSoftmax {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        Ok(vec![(
            x.shape().to_vec(),
            softmax_along(x, self.axis, true)?,
        )])
    }
}

impl Op for LogSoftmax {
    fn name(&self) -> &'static str {
        "LogSoftmax"
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
}
