//! Reductions: Sum, Mean, Max over a set of axes; their gradient `ReduceGrad`; and
//! `SumTo`, the adjoint of broadcasting.
//!
//! Accumulation happens in the compute type (f32 for f16/bf16/f32, f64 for f64) and
//! the result is rounded once on store.

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::{BroadcastTo, Cast};
use crate::shape::{broadcast_indices, normalize_axes};
use crate::tensor::{ShapeDisplay, Tensor, TensorType};
use crate::DType;

macro_rules! entries {
    ($($name:literal),* $(,)?) => {
        &[$(OpEntry { name: $name, parse: |n, a| Ok(Box::new(Reduce::parse(n, a)?)) }),*]
    };
}

pub(crate) const OPS: &[OpEntry] = entries!("Sum", "Mean", "Max");

pub(crate) const GRAD_OPS: &[OpEntry] = &[OpEntry {
    name: "ReduceGrad",
    parse: |_, a| Ok(Box::new(ReduceGrad::parse(a)?)),
}];

/// The gradient of output 0, if it reaches the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

impl ReduceKind {
    pub const ALL: [ReduceKind; 3] = [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max];

    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "Sum",
            ReduceKind::Mean => "Mean",
            ReduceKind::Max => "Max",
        }
    }
}

/// Reduces `x` over `axes` (all axes when `None`; negative axes count from the end;
/// an empty list reduces nothing). With `keep_dims` the reduced axes stay as size 1.
/// Empty reductions give 0 (Sum), NaN (Mean) and -inf (Max); Max propagates NaN.
///
/// `to` (attr `to`) gives the output a wider float type than the input's: the
/// reduction of a Cast to `to` with the Cast folded in, reading the narrow tensor
/// instead of a widened copy of it ([`widens_exactly`] pairs only, so the values are
/// the same).
#[derive(Clone, Debug, PartialEq)]
pub struct Reduce {
    pub kind: ReduceKind,
    pub axes: Option<Vec<i64>>,
    pub keep_dims: bool,
    pub to: Option<DType>,
}

/// Whether every `from` value is exactly a `to` value (a Cast that loses nothing).
pub fn widens_exactly(from: DType, to: DType) -> bool {
    use DType::*;
    from == to || matches!((from, to), (F16 | BF16, F32) | (F16 | BF16 | F32, F64))
}

impl Reduce {
    pub fn new(kind: ReduceKind, axes: Option<Vec<i64>>, keep_dims: bool) -> Self {
        Reduce {
            kind,
            axes,
            keep_dims,
            to: None,
        }
    }

    /// The same reduction with its output in `to`.
    pub fn with_output(mut self, to: DType) -> Self {
        self.to = Some(to);
        self
    }

    /// The output dtype for an input of `dtype`.
    pub fn output_dtype(&self, dtype: DType) -> DType {
        self.to.unwrap_or(dtype)
    }

    fn parse(name: &str, a: &mut AttrReader) -> OpResult<Reduce> {
        let kind = ReduceKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| format!("unknown reduction '{name}'"))?;
        Ok(Reduce {
            kind,
            axes: a.opt_ints("axes")?,
            keep_dims: a.bool_or("keep_dims", false)?,
            to: a.opt_dtype("to")?,
        })
    }

    /// The reduced axes of an input of `rank`, sorted and distinct.
    pub fn reduced_axes(&self, rank: usize) -> OpResult<Vec<usize>> {
        match &self.axes {
            None => Ok((0..rank).collect()),
            Some(axes) => normalize_axes(axes, rank),
        }
    }

    /// The output shape for an input shape, and the shape with reduced axes kept as 1.
    fn output_shapes(&self, shape: &[usize]) -> OpResult<(Vec<usize>, Vec<usize>)> {
        let axes = self.reduced_axes(shape.len())?;
        let kept: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let out = if self.keep_dims {
            kept.clone()
        } else {
            shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        Ok((out, kept))
    }
}

impl FloatKernel for Reduce {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        let shape = x.shape();
        let (out_shape, kept) = self.output_shapes(shape)?;
        let out_len: usize = kept.iter().product();
        let in_len = x.len();
        let count = in_len.checked_div(out_len).unwrap_or(0);
        let xs = T::read(x);
        // The output slot of each input element, in order.
        let slots = broadcast_indices(&kept, shape);
        let acc = match self.kind {
            // Sums in f64, rounded once: an f32 running sum stalls once it is 2^24
            // times its terms (the mean of 2^28 values near 5 came out 1.0).
            ReduceKind::Sum | ReduceKind::Mean => {
                let sums = slot_sums(&xs, slots, out_len)?;
                let n = if self.kind == ReduceKind::Mean {
                    count as f64
                } else {
                    1.0
                };
                sums.into_iter().map(|s| T::lit(s / n)).collect()
            }
            ReduceKind::Max => {
                let mut max = vec![T::neg_infinity(); out_len];
                for (&v, j) in xs.iter().zip(slots) {
                    let m = max.get_mut(j).ok_or("reduction index out of range")?;
                    *m = if v.is_nan() || m.is_nan() {
                        T::nan()
                    } else {
                        m.max(v)
                    };
                }
                max
            }
        };
        Ok(vec![(out_shape, acc)])
    }
}

/// The sums of `xs` in `len` slots (`slots` gives each element's, in order), in f64.
fn slot_sums<T: Real>(
    xs: &[T],
    slots: impl Iterator<Item = usize>,
    len: usize,
) -> OpResult<Vec<f64>> {
    let mut sums = vec![0f64; len];
    for (&v, j) in xs.iter().zip(slots) {
        *sums.get_mut(j).ok_or("reduction index out of range")? += v.wide();
    }
    Ok(sums)
}

impl Op for Reduce {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = Vec::new();
        if let Some(axes) = &self.axes {
            a.push(("axes", axes.clone().into()));
        }
        a.push(("keep_dims", self.keep_dims.into()));
        if let Some(to) = self.to {
            a.push(("to", to.into()));
        }
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        require_float("the input", x.dtype)?;
        let to = self.output_dtype(x.dtype);
        if !widens_exactly(x.dtype, to) {
            return Err(format!(
                "output type {to} does not hold every {} value of the input exactly",
                x.dtype
            ));
        }
        let (out, _) = self.output_shapes(&x.shape)?;
        Ok(vec![TensorType::new(to, out)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        self.infer(&[&x.ty()])?;
        // In the output's compute type: what a Cast to it, then the reduction, computes.
        eval_float(self, self.output_dtype(x.dtype()), inputs)
    }
    /// `dx = ReduceGrad(x, dy)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = fixed(inputs).map_err(GraphError::Format)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None]);
        };
        let op = ReduceGrad::new(self.kind, self.axes.clone(), self.keep_dims);
        // With a wider output, dy is rounded back to x's type, as the folded Cast's
        // gradient would.
        let narrow = b.ty(*x).dtype;
        let dy = if b.ty(dy).dtype == narrow {
            dy
        } else {
            b.add(Cast { to: narrow }, &[dy])?
        };
        Ok(vec![Some(b.add(op, &[*x, dy])?)])
    }
}

/// The gradient of a [`Reduce`] with the same `kind`, `axes` and `keep_dims`:
/// inputs `(x, dy)`, `dy` of the reduction's output shape; the output, of x's type,
/// broadcasts `dy` back over the reduced axes. Sum copies it, Mean divides it by the
/// number of reduced elements, Max routes it to the elements equal to their maximum,
/// split evenly among ties (TensorFlow's rule; a NaN maximum routes nothing).
#[derive(Clone, Debug, PartialEq)]
pub struct ReduceGrad {
    pub kind: ReduceKind,
    pub axes: Option<Vec<i64>>,
    pub keep_dims: bool,
}

impl ReduceGrad {
    pub fn new(kind: ReduceKind, axes: Option<Vec<i64>>, keep_dims: bool) -> Self {
        ReduceGrad {
            kind,
            axes,
            keep_dims,
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<ReduceGrad> {
        let name = a.opt_str("kind")?.ok_or("missing attr 'kind'")?;
        let forward = Reduce::parse(&name, a).map_err(|e| format!("attr 'kind': {e}"))?;
        Ok(ReduceGrad::new(
            forward.kind,
            forward.axes,
            forward.keep_dims,
        ))
    }

    fn forward(&self) -> Reduce {
        Reduce::new(self.kind, self.axes.clone(), self.keep_dims)
    }

    /// Checks dy against the reduction of `x`; returns x's shape with reduced axes as 1.
    fn kept_shape(&self, x: &[usize], dy: &[usize]) -> OpResult<Vec<usize>> {
        let (out, kept) = self.forward().output_shapes(x)?;
        if dy != out.as_slice() {
            return Err(format!(
                "dy has shape {} but the {} of x {} has shape {}",
                ShapeDisplay(dy),
                self.kind.name(),
                ShapeDisplay(x),
                ShapeDisplay(&out)
            ));
        }
        Ok(kept)
    }
}

impl FloatKernel for ReduceGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, dy] = fixed(inputs)?;
        let kept = self.kept_shape(x.shape(), dy.shape())?;
        // The output element each input element is reduced into, walked (a table
        // would take 8 bytes an input element).
        let slots = || broadcast_indices(&kept, x.shape());
        let gs = T::read(dy);
        let xs = T::read(x);
        let at = |j: usize| gs.get(j).copied().ok_or("reduction index out of range");
        let dx = match self.kind {
            ReduceKind::Sum => slots().map(at).collect::<Result<_, _>>()?,
            ReduceKind::Mean => {
                let count = T::lit(xs.len().checked_div(gs.len()).unwrap_or(0) as f64);
                slots()
                    .map(|j| Ok(at(j)? / count))
                    .collect::<Result<_, &str>>()?
            }
            ReduceKind::Max => {
                let mut max = vec![T::neg_infinity(); gs.len()];
                for (&v, j) in xs.iter().zip(slots()) {
                    let m = max.get_mut(j).ok_or("reduction index out of range")?;
                    *m = if v.is_nan() || m.is_nan() {
                        T::nan()
                    } else {
                        m.max(v)
                    };
                }
                let mut ties = vec![T::zero(); gs.len()];
                for (&v, j) in xs.iter().zip(slots()) {
                    if v == max[j] {
                        ties[j] = ties[j] + T::one();
                    }
                }
                xs.iter()
                    .zip(slots())
                    .map(|(&v, j)| {
                        Ok(if v == max[j] {
                            at(j)? / ties[j]
                        } else {
                            T::zero()
                        })
                    })
                    .collect::<Result<_, &str>>()?
            }
        };
        Ok(vec![(x.shape().to_vec(), dx)])
    }
}

impl Op for ReduceGrad {
    fn name(&self) -> &'static str {
        "ReduceGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("kind", self.kind.name().into())];
        a.extend(self.forward().attrs());
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, dy] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        self.kept_shape(&x.shape, &dy.shape)?;
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, dy] = fixed(inputs)?;
        self.infer(&[&x.ty(), &dy.ty()])?;
        eval_float(self, x.dtype(), inputs)
    }
}

/// Sums `x` down to `shape`, which must broadcast to x's shape: the adjoint of
/// broadcasting, used by the gradients of broadcasting ops.
#[derive(Clone, Debug, PartialEq)]
pub struct SumTo {
    pub shape: Vec<usize>,
}

pub(crate) const SUM_TO_OPS: &[OpEntry] = &[OpEntry {
    name: "SumTo",
    parse: |_, a| {
        Ok(Box::new(SumTo {
            shape: a.shape("shape")?,
        }))
    },
}];

impl FloatKernel for SumTo {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        check_sum_to(&self.shape, x.shape())?;
        // Sums in f64, rounded once (as Reduce's).
        let slots = broadcast_indices(&self.shape, x.shape());
        let sums = slot_sums(&T::read(x), slots, self.shape.iter().product())?;
        let out = sums.into_iter().map(T::lit).collect();
        Ok(vec![(self.shape.clone(), out)])
    }
}

fn check_sum_to(target: &[usize], x: &[usize]) -> OpResult<()> {
    match crate::shape::broadcast_shapes(target, x) {
        Ok(s) if s == x => Ok(()),
        _ => Err(format!(
            "shape {} does not broadcast to the input's {}",
            crate::tensor::ShapeDisplay(target),
            crate::tensor::ShapeDisplay(x)
        )),
    }
}

impl Op for SumTo {
    fn name(&self) -> &'static str {
        "SumTo"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("shape", self.shape.as_slice().into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        require_float("the input", x.dtype)?;
        check_sum_to(&self.shape, &x.shape)?;
        Ok(vec![TensorType::new(x.dtype, self.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(self, inputs[0].dtype(), inputs)
    }
    /// `dx = BroadcastTo(dy, shape of x)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = fixed(inputs).map_err(GraphError::Format)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None]);
        };
        let shape = b.ty(*x).shape.clone();
        Ok(vec![Some(b.add(BroadcastTo { shape }, &[dy])?)])
    }
}
