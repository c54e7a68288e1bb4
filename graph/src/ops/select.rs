//! Where (ONNX Where, TensorFlow SelectV2): `a` where `cond` holds, `b` elsewhere,
//! all three broadcast together by NumPy rules. Works for every dtype and never
//! rounds.

use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::shape_ops::{dispatch, float_type, typed, Elem};
use crate::ops::{grad0, types_of};
use crate::shape::{broadcast_indices, broadcast_shapes};
use crate::tensor::{checked_numel, Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "Where",
    parse: |_, _| Ok(Box::new(Where)),
}];

/// `y = cond ? a : b` elementwise, with inputs `(cond, a, b)`: `cond` is bool, `a`
/// and `b` share any dtype, which `y` has; the three shapes broadcast together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Where;

impl Where {
    fn output_type(inputs: &[&TensorType]) -> OpResult<TensorType> {
        let [cond, a, b] = fixed(inputs)?;
        if cond.dtype != DType::Bool {
            return Err(format!("cond must be bool, got {}", cond.dtype));
        }
        if a.dtype != b.dtype {
            return Err(format!("a is {} but b is {}", a.dtype, b.dtype));
        }
        let shape = broadcast_shapes(&cond.shape, &a.shape)
            .and_then(|s| broadcast_shapes(&s, &b.shape))
            .map_err(|_| {
                format!(
                    "cond {}, a {} and b {} do not broadcast together",
                    ShapeDisplay(&cond.shape),
                    ShapeDisplay(&a.shape),
                    ShapeDisplay(&b.shape)
                )
            })?;
        if checked_numel(&shape).is_none() {
            return Err(format!(
                "the result {} has too many elements",
                ShapeDisplay(&shape)
            ));
        }
        Ok(TensorType::new(a.dtype, shape))
    }
}

fn where_typed<T: Elem>(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> OpResult<Data> {
    let (c, av, bv) = (typed::<bool>(cond)?, typed::<T>(a)?, typed::<T>(b)?);
    // `output_type` checked that every shape broadcasts to `shape`, so the indices lie
    // inside their tensors.
    let out = broadcast_indices(cond.shape(), shape)
        .zip(broadcast_indices(a.shape(), shape))
        .zip(broadcast_indices(b.shape(), shape))
        .map(|((i, j), k)| if c[i] { av[j] } else { bv[k] })
        .collect();
    Ok(T::wrap(out))
}

impl Op for Where {
    fn name(&self) -> &'static str {
        "Where"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![Self::output_type(inputs)?])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let out = Self::output_type(&types_of(inputs).iter().collect::<Vec<_>>())?;
        let [cond, a, b] = fixed(inputs)?;
        let data = dispatch!(out.dtype, where_typed(cond, a, b, &out.shape))?;
        Ok(vec![Tensor::new(out.shape, data)?])
    }
    /// `a` and `b` are the compute type; `cond` keeps bool (a fixed group).
    fn typed_inputs(&self, num_inputs: usize) -> Vec<usize> {
        (1..num_inputs).collect()
    }
    /// `da = SumTo(Where(cond, dy, 0))` to a's shape, `db = SumTo(Where(cond, 0, dy))`
    /// to b's; `cond` gets none.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[cond, on_true, on_false] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, on_true)) else {
            return Ok(vec![None; 3]);
        };
        let false_shape = b.ty(on_false).shape.clone();
        let zero = b.scalar(ty.dtype, 0.0)?;
        let d_true = b.add(Where, &[cond, dy, zero])?;
        let d_false = b.add(Where, &[cond, zero, dy])?;
        Ok(vec![
            None,
            Some(b.sum_to(d_true, &ty.shape)?),
            Some(b.sum_to(d_false, &false_shape)?),
        ])
    }
}
