//! Ops that move elements without computing on them: Reshape, Transpose, Concat,
//! Slice, BroadcastTo. They work for every dtype and never round.

use half::{bf16, f16};

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::{grad0, types_of};
use crate::shape::{broadcast_indices, broadcast_shapes, normalize_axis};
use crate::tensor::{checked_numel, strides, Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "Reshape",
        parse: |_, a| Ok(Box::new(Reshape::parse(a)?)),
    },
    OpEntry {
        name: "Transpose",
        parse: |_, a| Ok(Box::new(Transpose::parse(a)?)),
    },
    OpEntry {
        name: "Concat",
        parse: |_, a| {
            let axis = a.opt_int("axis")?.ok_or("missing attr 'axis'")?;
            Ok(Box::new(Concat { axis }))
        },
    },
];

pub(crate) const MORE_OPS: &[OpEntry] = &[
    OpEntry {
        name: "Slice",
        parse: |_, a| Ok(Box::new(Slice::parse(a)?)),
    },
    OpEntry {
        name: "BroadcastTo",
        parse: |_, a| {
            Ok(Box::new(BroadcastTo {
                shape: a.shape("shape")?,
            }))
        },
    },
];

/// The gradient of output 0, if it reaches the loss.
/// The input's type, when it has a gradient (floats only).
pub(crate) fn float_type(b: &GradBuilder, p: Port) -> Option<TensorType> {
    let ty = b.ty(p);
    ty.dtype.is_float().then(|| ty.clone())
}

/// One element type of [`Data`]: lets a kernel be written once over every dtype.
pub(crate) trait Elem: Copy {
    fn slice(d: &Data) -> Option<&[Self]>;
    fn wrap(v: Vec<Self>) -> Data;
}

macro_rules! elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn slice(d: &Data) -> Option<&[Self]> {
                match d {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> Data {
                Data::$variant(v)
            }
        }
    };
}

elem!(f32, F32);
elem!(f16, F16);
elem!(bf16, BF16);
elem!(f64, F64);
elem!(i32, I32);
elem!(i64, I64);
elem!(bool, Bool);
elem!(crate::fp8::F8E4M3, F8E4M3);
elem!(crate::fp8::F8E5M2, F8E5M2);

/// Runs `f::<T>` for the element type of `dtype` (paths absolute: other op files use it).
macro_rules! dispatch {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F16 => $f::<::half::f16>($($arg),*),
            $crate::DType::BF16 => $f::<::half::bf16>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
            $crate::DType::I32 => $f::<i32>($($arg),*),
            $crate::DType::I64 => $f::<i64>($($arg),*),
            $crate::DType::Bool => $f::<bool>($($arg),*),
            $crate::DType::F8E4M3 => $f::<$crate::fp8::F8E4M3>($($arg),*),
            $crate::DType::F8E5M2 => $f::<$crate::fp8::F8E5M2>($($arg),*),
        }
    };
}
pub(crate) use dispatch;

pub(crate) fn typed<T: Elem>(t: &Tensor) -> OpResult<&[T]> {
    T::slice(t.data()).ok_or_else(|| format!("unexpected {} tensor", t.dtype()))
}

/// Gives `x` a new shape with the same elements in the same (row-major) order.
/// `shape` may hold one `-1`, inferred from the element count.
#[derive(Clone, Debug, PartialEq)]
pub struct Reshape {
    pub shape: Vec<i64>,
}

impl Reshape {
    pub fn new(shape: impl Into<Vec<i64>>) -> Self {
        Reshape {
            shape: shape.into(),
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<Reshape> {
        let r = Reshape {
            shape: a.ints("shape")?,
        };
        r.check_attr()?;
        Ok(r)
    }

    fn check_attr(&self) -> OpResult<()> {
        if let Some(&d) = self.shape.iter().find(|&&d| d < -1) {
            return Err(format!(
                "attr 'shape' {:?} has a negative dimension {d} (only -1 is allowed)",
                self.shape
            ));
        }
        if self.shape.iter().filter(|&&d| d == -1).count() > 1 {
            return Err(format!(
                "attr 'shape' {:?} has more than one -1",
                self.shape
            ));
        }
        Ok(())
    }

    /// The output shape for an input shape.
    pub fn output_shape(&self, input: &[usize]) -> OpResult<Vec<usize>> {
        self.check_attr()?;
        let numel = checked_numel(input).ok_or("the input has too many elements")?;
        let mismatch = || {
            format!(
                "cannot reshape {} ({numel} elements) into {:?}",
                ShapeDisplay(input),
                self.shape
            )
        };
        let known = self
            .shape
            .iter()
            .filter(|&&d| d >= 0)
            .try_fold(1usize, |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            })
            .ok_or_else(mismatch)?;
        let missing = if self.shape.contains(&-1) {
            if known == 0 {
                return Err(format!(
                    "{}: the -1 dimension is ambiguous when another dimension is 0",
                    mismatch()
                ));
            }
            if numel % known != 0 {
                return Err(mismatch());
            }
            numel / known
        } else {
            if known != numel {
                return Err(mismatch());
            }
            0
        };
        Ok(self
            .shape
            .iter()
            .map(|&d| if d == -1 { missing } else { d as usize })
            .collect())
    }
}

impl Op for Reshape {
    fn name(&self) -> &'static str {
        "Reshape"
    }
    fn is_view(&self) -> bool {
        true
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("shape", self.shape.clone().into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        Ok(vec![TensorType::new(x.dtype, self.output_shape(&x.shape)?)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        let shape = self.output_shape(x.shape())?;
        Ok(vec![(*x).clone().reshaped(shape)?])
    }
    /// `dx = Reshape(dy, shape of x)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, *x)) else {
            return Ok(vec![None]);
        };
        let shape: Vec<i64> = ty.shape.iter().map(|&d| d as i64).collect();
        Ok(vec![Some(b.add(Reshape::new(shape), &[dy])?)])
    }
}

/// Permutes the axes of `x`: output axis `i` is input axis `perm[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Transpose {
    pub perm: Vec<usize>,
}

impl Transpose {
    pub fn new(perm: impl Into<Vec<usize>>) -> Self {
        Transpose { perm: perm.into() }
    }

    fn parse(a: &mut AttrReader) -> OpResult<Transpose> {
        let perm = a
            .ints("perm")?
            .into_iter()
            .map(|p| {
                usize::try_from(p).map_err(|_| format!("attr 'perm' has a negative entry {p}"))
            })
            .collect::<OpResult<Vec<_>>>()?;
        Ok(Transpose { perm })
    }

    /// The output shape for an input shape; `perm` must be a permutation of 0..rank.
    pub fn output_shape(&self, input: &[usize]) -> OpResult<Vec<usize>> {
        let rank = input.len();
        let mut seen = vec![false; rank];
        let valid = self.perm.len() == rank
            && self.perm.iter().all(|&p| match seen.get_mut(p) {
                Some(s) if !*s => {
                    *s = true;
                    true
                }
                _ => false,
            });
        if !valid {
            return Err(format!(
                "perm {:?} is not a permutation of 0..{rank} for input shape {}",
                self.perm,
                ShapeDisplay(input)
            ));
        }
        Ok(self.perm.iter().map(|&p| input[p]).collect())
    }
}

fn transpose_typed<T: Elem>(x: &Tensor, perm: &[usize], out_shape: &[usize]) -> OpResult<Data> {
    let xs = typed::<T>(x)?;
    let in_strides = strides(x.shape());
    // Stride in the input of each output axis.
    let stride: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let out = strided_gather(
        xs,
        0,
        &stride,
        out_shape,
        xs.len(),
        "transpose index out of range",
    )?;
    Ok(T::wrap(out))
}

/// `n` elements of `xs` read in row-major order over `out_shape`, starting at `start`
/// and stepping `stride[ax]` along each output axis (an odometer over the output index).
fn strided_gather<T: Elem>(
    xs: &[T],
    start: usize,
    stride: &[usize],
    out_shape: &[usize],
    n: usize,
    out_of_range: &'static str,
) -> OpResult<Vec<T>> {
    let rank = out_shape.len();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; rank];
    let mut pos = start;
    for _ in 0..n {
        out.push(*xs.get(pos).ok_or(out_of_range)?);
        for ax in (0..rank).rev() {
            idx[ax] += 1;
            pos += stride[ax];
            if idx[ax] < out_shape[ax] {
                break;
            }
            pos -= stride[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    Ok(out)
}

impl Op for Transpose {
    fn name(&self) -> &'static str {
        "Transpose"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("perm", self.perm.as_slice().into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        Ok(vec![TensorType::new(x.dtype, self.output_shape(&x.shape)?)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        let shape = self.output_shape(x.shape())?;
        let data = dispatch!(x.dtype(), transpose_typed(x, &self.perm, &shape))?;
        Ok(vec![Tensor::new(shape, data)?])
    }
    /// `dx = Transpose(dy, inverse of perm)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, *x)) else {
            return Ok(vec![None]);
        };
        self.output_shape(&ty.shape).map_err(GraphError::Format)?;
        let mut inverse = vec![0; self.perm.len()];
        for (i, &p) in self.perm.iter().enumerate() {
            inverse[p] = i;
        }
        Ok(vec![Some(b.add(Transpose::new(inverse), &[dy])?)])
    }
}

/// Joins one or more tensors along `axis`; they share dtype and rank, and every
/// other dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct Concat {
    pub axis: i64,
}

impl Concat {
    pub fn new(axis: i64) -> Self {
        Concat { axis }
    }

    fn output_type(&self, inputs: &[&TensorType]) -> OpResult<(TensorType, usize)> {
        let first = inputs.first().ok_or("Concat needs at least one input")?;
        let axis = normalize_axis(self.axis, first.rank())?;
        let mut shape = first.shape.clone();
        for (i, t) in inputs.iter().enumerate().skip(1) {
            if t.dtype != first.dtype {
                return Err(format!(
                    "input {i} is {} but input 0 is {}",
                    t.dtype, first.dtype
                ));
            }
            if t.rank() != first.rank() {
                return Err(format!(
                    "input {i} has shape {} of rank {} but input 0 has shape {} of rank {}",
                    ShapeDisplay(&t.shape),
                    t.rank(),
                    ShapeDisplay(&first.shape),
                    first.rank()
                ));
            }
            for (ax, (&a, &b)) in t.shape.iter().zip(&first.shape).enumerate() {
                if ax != axis && a != b {
                    return Err(format!(
                        "input {i} has shape {} but input 0 has shape {}: \
                         dimension {ax} differs ({a} vs {b}) and only axis {axis} may",
                        ShapeDisplay(&t.shape),
                        ShapeDisplay(&first.shape)
                    ));
                }
            }
            shape[axis] = shape[axis]
                .checked_add(t.shape[axis])
                .ok_or("the concatenated axis overflows")?;
        }
        if checked_numel(&shape).is_none() {
            return Err(format!(
                "the result {} has too many elements",
                ShapeDisplay(&shape)
            ));
        }
        Ok((TensorType::new(first.dtype, shape), axis))
    }
}

fn concat_typed<T: Elem>(inputs: &[&Tensor], axis: usize, total: usize) -> OpResult<Data> {
    let parts = inputs
        .iter()
        .map(|t| {
            let inner: usize = t.shape()[axis..].iter().product();
            Ok((typed::<T>(t)?, inner))
        })
        .collect::<OpResult<Vec<_>>>()?;
    let outer: usize = inputs
        .first()
        .map(|t| t.shape()[..axis].iter().product())
        .unwrap_or(0);
    let mut out = Vec::with_capacity(total);
    for o in 0..outer {
        for &(xs, inner) in &parts {
            let chunk = xs
                .get(o * inner..(o + 1) * inner)
                .ok_or("concat index out of range")?;
            out.extend_from_slice(chunk);
        }
    }
    Ok(T::wrap(out))
}

impl Op for Concat {
    fn name(&self) -> &'static str {
        "Concat"
    }
    fn arity(&self) -> Arity {
        Arity::AtLeast(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("axis", self.axis.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.output_type(inputs)?.0])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        let (out, axis) = self.output_type(&types.iter().collect::<Vec<_>>())?;
        let total = out.checked_len().unwrap_or(0);
        let data = dispatch!(out.dtype, concat_typed(inputs, axis, total))?;
        Ok(vec![Tensor::new(out.shape, data)?])
    }
    /// Input `i`'s gradient is the slice of `dy` it was copied to.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None; inputs.len()]);
        };
        let types: Vec<TensorType> = inputs.iter().map(|&p| b.ty(p).clone()).collect();
        let (_, axis) = self
            .output_type(&types.iter().collect::<Vec<_>>())
            .map_err(GraphError::Format)?;
        let mut offset = 0usize;
        let mut out = Vec::with_capacity(inputs.len());
        for ty in &types {
            let mut begin = vec![0; ty.rank()];
            begin[axis] = offset;
            offset += ty.shape[axis];
            out.push(if ty.dtype.is_float() {
                let size = ty.shape.iter().map(|&d| d as i64).collect();
                Some(b.add(Slice { begin, size }, &[dy])?)
            } else {
                None
            });
        }
        Ok(out)
    }
}

/// Extracts the block of `x` that starts at `begin` and has extent `size` (TensorFlow's
/// Slice with both as attrs): `size[i] == -1` takes everything from `begin[i]` on.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub begin: Vec<usize>,
    pub size: Vec<i64>,
}

impl Slice {
    pub fn new(begin: impl Into<Vec<usize>>, size: impl Into<Vec<i64>>) -> Self {
        Slice {
            begin: begin.into(),
            size: size.into(),
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<Slice> {
        let begin = a.shape("begin")?;
        let size = a.ints("size")?;
        if let Some(&d) = size.iter().find(|&&d| d < -1) {
            return Err(format!(
                "attr 'size' {size:?} has a negative extent {d} (only -1 is allowed)"
            ));
        }
        Ok(Slice { begin, size })
    }

    /// The output shape for an input shape: the block must lie inside the input.
    pub fn output_shape(&self, input: &[usize]) -> OpResult<Vec<usize>> {
        if self.begin.len() != input.len() || self.size.len() != input.len() {
            return Err(format!(
                "begin {:?} and size {:?} must both have one entry per axis of the input {}",
                self.begin,
                self.size,
                ShapeDisplay(input)
            ));
        }
        let mut out = Vec::with_capacity(input.len());
        for (ax, ((&b, &s), &d)) in self.begin.iter().zip(&self.size).zip(input).enumerate() {
            let size = if s == -1 {
                d.checked_sub(b)
            } else {
                usize::try_from(s)
                    .ok()
                    .filter(|&s| b.checked_add(s).is_some_and(|end| end <= d))
            };
            out.push(size.ok_or_else(|| {
                format!(
                    "the slice begin {:?} size {:?} leaves the input {} on axis {ax}",
                    self.begin,
                    self.size,
                    ShapeDisplay(input)
                )
            })?);
        }
        Ok(out)
    }
}

fn slice_typed<T: Elem>(x: &Tensor, begin: &[usize], out_shape: &[usize]) -> OpResult<Data> {
    let xs = typed::<T>(x)?;
    let in_strides = strides(x.shape());
    let n: usize = out_shape.iter().product();
    let start: usize = begin.iter().zip(&in_strides).map(|(b, s)| b * s).sum();
    let out = strided_gather(
        xs,
        start,
        &in_strides,
        out_shape,
        n,
        "slice index out of range",
    )?;
    Ok(T::wrap(out))
}

impl Op for Slice {
    fn name(&self) -> &'static str {
        "Slice"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("begin", self.begin.as_slice().into()),
            ("size", self.size.clone().into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        Ok(vec![TensorType::new(x.dtype, self.output_shape(&x.shape)?)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        let shape = self.output_shape(x.shape())?;
        let data = dispatch!(x.dtype(), slice_typed(x, &self.begin, &shape))?;
        Ok(vec![Tensor::new(shape, data)?])
    }
    /// `dx` is `dy` back in its place among zeros: along each axis the slice cut, a
    /// Concat of broadcast zeros before it, `dy`, and zeros after it (ops every
    /// executor has, none needing a kernel of its own).
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (Some(dy), [x]) = (grad0(grads), inputs) else {
            return Ok(vec![None; inputs.len()]);
        };
        let x_ty = b.ty(*x).clone();
        if !x_ty.dtype.is_float() {
            return Ok(vec![None]);
        }
        let cut = self.output_shape(&x_ty.shape).map_err(GraphError::Format)?;
        let zero = b.scalar(x_ty.dtype, 0.0)?;
        let mut dx = dy;
        let mut shape = cut.clone();
        for axis in 0..shape.len() {
            let before = self.begin[axis];
            let after = x_ty.shape[axis] - before - cut[axis];
            if before == 0 && after == 0 {
                continue;
            }
            let mut parts = Vec::with_capacity(3);
            if before > 0 {
                parts.push(b.zeros_along(zero, &shape, axis, before)?);
            }
            parts.push(dx);
            if after > 0 {
                parts.push(b.zeros_along(zero, &shape, axis, after)?);
            }
            dx = b.add(Concat::new(axis as i64), &parts)?;
            shape[axis] = x_ty.shape[axis];
        }
        Ok(vec![Some(dx)])
    }
}

/// Broadcasts `x` to `shape` by NumPy rules (x's shape must broadcast to exactly
/// `shape`): the adjoint of `SumTo`.
#[derive(Clone, Debug, PartialEq)]
pub struct BroadcastTo {
    pub shape: Vec<usize>,
}

impl BroadcastTo {
    pub fn new(shape: impl Into<Vec<usize>>) -> Self {
        BroadcastTo {
            shape: shape.into(),
        }
    }

    fn check(&self, x: &[usize]) -> OpResult<()> {
        match broadcast_shapes(x, &self.shape) {
            Ok(s) if s == self.shape => {}
            _ => {
                return Err(format!(
                    "the input {} does not broadcast to {}",
                    ShapeDisplay(x),
                    ShapeDisplay(&self.shape)
                ))
            }
        }
        if checked_numel(&self.shape).is_none() {
            return Err(format!(
                "the result {} has too many elements",
                ShapeDisplay(&self.shape)
            ));
        }
        Ok(())
    }
}

fn broadcast_typed<T: Elem>(x: &Tensor, shape: &[usize]) -> OpResult<Data> {
    let xs = typed::<T>(x)?;
    broadcast_indices(x.shape(), shape)
        .map(|i| xs.get(i).copied().ok_or("broadcast index out of range"))
        .collect::<Result<Vec<T>, _>>()
        .map(T::wrap)
        .map_err(String::from)
}

impl Op for BroadcastTo {
    fn name(&self) -> &'static str {
        "BroadcastTo"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("shape", self.shape.as_slice().into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        self.check(&x.shape)?;
        Ok(vec![TensorType::new(x.dtype, self.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        self.check(x.shape())?;
        let data = dispatch!(x.dtype(), broadcast_typed(x, &self.shape))?;
        Ok(vec![Tensor::new(self.shape.clone(), data)?])
    }
    /// `dx = SumTo(dy, shape of x)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, *x)) else {
            return Ok(vec![None]);
        };
        Ok(vec![Some(b.sum_to(dy, &ty.shape)?)])
    }
}
