//! Gather (ONNX Gather, TensorFlow GatherV2 with `batch_dims` 0) and its gradient
//! GatherGrad, the scatter-add of `dy` back into the gathered axis.
//!
//! With `data` of shape `P + [n] + S` (`axis` between them) and integer `indices` of
//! any shape `I`, the output has shape `P + I + S`: each index picks one `P`-batched
//! slice `S` along the axis. Negative indices count from the end (ONNX); an index
//! outside `-n..n` is an error naming it and the bound.

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::shape_ops::{dispatch, float_type, typed, Elem};
use crate::shape::normalize_axis;
use crate::tensor::{checked_numel, Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "Gather",
        parse: |_, a| {
            Ok(Box::new(Gather {
                axis: a.opt_int("axis")?.unwrap_or(0),
            }))
        },
    },
    OpEntry {
        name: "GatherGrad",
        parse: |_, a| Ok(Box::new(GatherGrad::parse(a)?)),
    },
];

/// Requires integer indices, naming the dtype otherwise.
fn check_indices(indices: &TensorType) -> OpResult<()> {
    if indices.dtype.is_int() {
        Ok(())
    } else {
        Err(format!("indices must be i32 or i64, got {}", indices.dtype))
    }
}

/// The axis of `data` that `axis` names, and the shape gathering `indices` along it
/// gives (`data[:axis] + indices + data[axis+1:]`).
fn gathered(data: &[usize], axis: i64, indices: &[usize]) -> OpResult<(usize, Vec<usize>)> {
    let ax = normalize_axis(axis, data.len())?;
    let mut shape = data[..ax].to_vec();
    shape.extend_from_slice(indices);
    shape.extend_from_slice(&data[ax + 1..]);
    if checked_numel(&shape).is_none() {
        return Err(format!(
            "the result {} has too many elements",
            ShapeDisplay(&shape)
        ));
    }
    Ok((ax, shape))
}

/// `(outer, n, inner)`: the element counts before `axis`, along it and after it.
fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// The indices as positions in `0..n`: negative ones count from the end.
fn resolve_indices(indices: &Tensor, axis: usize, n: usize) -> OpResult<Vec<usize>> {
    let values = indices
        .to_i64_vec()
        .ok_or_else(|| format!("indices must be i32 or i64, got {}", indices.dtype()))?;
    values
        .into_iter()
        .map(|i| {
            let from_end = i < 0;
            usize::try_from(i.unsigned_abs())
                .ok()
                .and_then(|m| if from_end { n.checked_sub(m) } else { Some(m) })
                .filter(|&k| k < n)
                .ok_or_else(|| {
                    format!("index {i} is out of range for axis {axis} of size {n} (-{n}..{n})")
                })
        })
        .collect()
}

/// Gathers slices of `data` along `axis` at `indices`; attr `axis` (negative counts
/// from the end; 0 when absent, as in ONNX).
#[derive(Clone, Debug, PartialEq)]
pub struct Gather {
    pub axis: i64,
}

impl Gather {
    pub fn new(axis: i64) -> Self {
        Gather { axis }
    }

    fn output_type(
        &self,
        data: &TensorType,
        indices: &TensorType,
    ) -> OpResult<(usize, TensorType)> {
        check_indices(indices)?;
        let (axis, shape) = gathered(&data.shape, self.axis, &indices.shape)?;
        Ok((axis, TensorType::new(data.dtype, shape)))
    }
}

fn gather_typed<T: Elem>(
    data: &Tensor,
    idx: &[usize],
    axis: usize,
    total: usize,
) -> OpResult<Data> {
    let xs = typed::<T>(data)?;
    let (outer, n, inner) = split_at_axis(data.shape(), axis);
    let mut out = Vec::with_capacity(total);
    // An empty result needs no pass over `outer * idx` empty slices (there may be many).
    if total > 0 {
        for o in 0..outer {
            for &k in idx {
                let start = (o * n + k) * inner;
                let slice = xs
                    .get(start..start + inner)
                    .ok_or("gather index out of range")?;
                out.extend_from_slice(slice);
            }
        }
    }
    Ok(T::wrap(out))
}

impl Op for Gather {
    fn name(&self) -> &'static str {
        "Gather"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("axis", self.axis.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [data, indices] = fixed(inputs)?;
        Ok(vec![self.output_type(data, indices)?.1])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [data, indices] = fixed(inputs)?;
        let (axis, out) = self.output_type(&data.ty(), &indices.ty())?;
        let idx = resolve_indices(indices, axis, data.shape()[axis])?;
        let total = out.checked_len().unwrap_or(0);
        let values = dispatch!(out.dtype, gather_typed(data, &idx, axis, total))?;
        Ok(vec![Tensor::new(out.shape, values)?])
    }
    /// Only `data` is the compute type; the indices keep their integer dtype.
    fn typed_inputs(&self, _num_inputs: usize) -> Vec<usize> {
        vec![0]
    }
    /// `ddata = GatherGrad(dy, indices)` into data's shape; indices get none.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[data, indices] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, data)) else {
            return Ok(vec![None, None]);
        };
        let op = GatherGrad::new(self.axis, ty.shape);
        Ok(vec![Some(b.add(op, &[dy, indices])?), None])
    }
}

/// The gradient of [`Gather`]: inputs `(dy, indices)`, output zeros of `shape` (the
/// gathered data's) with each slice of `dy` added at its index along `axis`;
/// repeated indices accumulate (in the kernel's compute type, one rounding per
/// element). Attrs: `axis` and `shape`.
#[derive(Clone, Debug, PartialEq)]
pub struct GatherGrad {
    pub axis: i64,
    pub shape: Vec<usize>,
}

impl GatherGrad {
    pub fn new(axis: i64, shape: impl Into<Vec<usize>>) -> Self {
        GatherGrad {
            axis,
            shape: shape.into(),
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<GatherGrad> {
        let axis = a.opt_int("axis")?.ok_or("missing attr 'axis'")?;
        Ok(GatherGrad::new(axis, a.shape("shape")?))
    }

    /// The normalised axis, after checking `dy` is what gathering `indices` from
    /// `shape` gives.
    fn check(&self, dy: &TensorType, indices: &TensorType) -> OpResult<usize> {
        require_float("dy", dy.dtype)?;
        check_indices(indices)?;
        if checked_numel(&self.shape).is_none() {
            return Err(format!(
                "attr 'shape' {} has too many elements",
                ShapeDisplay(&self.shape)
            ));
        }
        let (axis, want) = gathered(&self.shape, self.axis, &indices.shape)?;
        if dy.shape != want {
            return Err(format!(
                "dy has shape {} but gathering indices {} from {} along axis {axis} gives {}",
                ShapeDisplay(&dy.shape),
                ShapeDisplay(&indices.shape),
                ShapeDisplay(&self.shape),
                ShapeDisplay(&want)
            ));
        }
        Ok(axis)
    }
}

impl FloatKernel for GatherGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [dy, indices] = fixed(inputs)?;
        let axis = self.check(&dy.ty(), &indices.ty())?;
        let (outer, n, inner) = split_at_axis(&self.shape, axis);
        let idx = resolve_indices(indices, axis, n)?;
        let g = T::read(dy);
        let mut dx = vec![T::zero(); outer * n * inner];
        // `check` made `dy` the gathered shape: every slice lies inside both tensors.
        if !g.is_empty() {
            for o in 0..outer {
                for (p, &k) in idx.iter().enumerate() {
                    let src = (o * idx.len() + p) * inner;
                    let dst = (o * n + k) * inner;
                    for (d, &s) in dx[dst..dst + inner].iter_mut().zip(&g[src..src + inner]) {
                        *d = *d + s;
                    }
                }
            }
        }
        Ok(vec![(self.shape.clone(), dx)])
    }
}

impl Op for GatherGrad {
    fn name(&self) -> &'static str {
        "GatherGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("axis", self.axis.into()),
            ("shape", self.shape.as_slice().into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [dy, indices] = fixed(inputs)?;
        self.check(dy, indices)?;
        Ok(vec![TensorType::new(dy.dtype, self.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(self, inputs.first().ok_or("no inputs")?.dtype(), inputs)
    }
    /// Only `dy` is the compute type; the indices keep their integer dtype.
    fn typed_inputs(&self, _num_inputs: usize) -> Vec<usize> {
        vec![0]
    }
    /// It is linear in `dy`: `d(dy) = Gather(ddx, indices)`; indices get none.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[_, indices] = fixed(inputs).map_err(GraphError::Format)?;
        let Some(ddx) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        Ok(vec![
            Some(b.add(Gather::new(self.axis), &[ddx, indices])?),
            None,
        ])
    }
}
