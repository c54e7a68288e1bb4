//! AllReduce: the mean (or the max) of each input over the replicas of a
//! data-parallel step.
//!
//! Every replica runs the same graph on its own shard of the batch; an AllReduce with
//! inputs `x_1..x_k` (one bucket of gradients) outputs each `x_i` averaged over the
//! replicas, the same values on every replica. The op itself only knows how many
//! replicas there are: executors given the replicas' collective (the CPU one, or NCCL
//! on CUDA devices) compute it; with one replica it is the identity.
//!
//! The mean is linear and the same on every replica, so its adjoint is itself: the
//! gradient of a replica's input is the mean of the output gradients (a synchronized
//! batch norm's statistics are differentiated through it). The max (of FP8 scaling's
//! amaxes) takes no gradient.

use crate::attrs::AttrValue;
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::op::{Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::tensor::{Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "AllReduce",
    parse: |_, a| {
        let replicas = a.opt_int("replicas")?.unwrap_or(1);
        let replicas = usize::try_from(replicas)
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("replicas must be at least 1, got {replicas}"))?;
        let reduction = a.choice("reduction", &Reduction::NAMES, Some(Reduction::Mean))?;
        Ok(Box::new(AllReduce {
            replicas,
            reduction,
        }))
    },
}];

/// How an [`AllReduce`] combines the replicas' values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    #[default]
    Mean,
    /// The largest, NaN where any replica's is NaN.
    Max,
}

impl Reduction {
    pub const NAMES: [(&'static str, Reduction); 2] =
        [("mean", Reduction::Mean), ("max", Reduction::Max)];
}

/// The mean (or max) of each input over `replicas` replicas (output `k` from input
/// `k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReduce {
    pub replicas: usize,
    pub reduction: Reduction,
}

impl AllReduce {
    /// The mean over `replicas` replicas.
    pub fn mean(replicas: usize) -> Self {
        AllReduce {
            replicas,
            reduction: Reduction::Mean,
        }
    }
}

impl Op for AllReduce {
    fn name(&self) -> &'static str {
        "AllReduce"
    }
    fn arity(&self) -> Arity {
        Arity::AtLeast(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![("replicas", (self.replicas as i64).into())];
        if self.reduction == Reduction::Max {
            attrs.push(("reduction", "max".into()));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        if let Some((i, t)) = inputs.iter().enumerate().find(|(_, t)| !t.dtype.is_float()) {
            return Err(format!("input {i} must be a float tensor, got {t}"));
        }
        Ok(inputs.iter().map(|&t| t.clone()).collect())
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        if self.replicas == 1 {
            return Ok(inputs.iter().map(|&t| t.clone()).collect());
        }
        Err(format!(
            "a reduction over {} replicas needs their collective: run the graph on replicas (ampgraph::parallel::Replicas)",
            self.replicas
        ))
    }
    /// Each input keeps its own type, never narrowed: the mean is taken in the type
    /// the data-parallel pass chose (f32 gradients under mixed precision).
    fn type_groups(&self, num_inputs: usize, _num_outputs: usize) -> Vec<TypeGroup> {
        (0..num_inputs)
            .map(|k| TypeGroup::new(vec![k], vec![k]).fixed())
            .collect()
    }
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let present: Vec<Port> = grads.iter().flatten().copied().collect();
        if present.is_empty() || self.reduction == Reduction::Max {
            return Ok(vec![None; inputs.len()]);
        }
        let node = b.add_node(Box::new(*self), &present)?;
        let mut reduced = (0..present.len()).map(|k| Port::new(node, k));
        Ok(grads
            .iter()
            .map(|g| g.and_then(|_| reduced.next()))
            .collect())
    }
}
