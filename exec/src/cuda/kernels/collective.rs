//! AllReduce: a bucket of tensors averaged over the data-parallel replicas through the
//! executor's NCCL communicator, on its own stream (no kernel of ours: NCCL's).
//!
//! The launch enqueues the bucket's all-reduces after the compute stream's work so far
//! and leaves the event of their end in [`Ctx::joins`]: the executor makes the first
//! reader of the outputs wait for it, so the rest of the backward pass runs meanwhile.
//! With one replica and no communicator the outputs are copies of the inputs.

use ampgraph_graph::ops::AllReduce;
use ampgraph_graph::{Op, TensorType};

use super::{kernel, Ctx, Lowering};
use crate::collective::check_replicas;

pub(super) fn lower(op: &dyn Op, _ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    let reduce = *op.downcast_ref::<AllReduce>()?;
    let outs = outs.to_vec();
    Some(Ok(kernel(move |c: &Ctx, inputs| {
        let outputs = c.alloc_all(&outs)?;
        match c.collective {
            Some(nccl) => {
                check_replicas(reduce.replicas, nccl.rank, nccl.world)?;
                let done = nccl.all_reduce(c.dev, inputs, &outputs, reduce.reduction)?;
                c.joins.borrow_mut().push(done);
            }
            None if reduce.replicas == 1 => {
                for (x, y) in inputs.iter().zip(&outputs) {
                    c.dev.copy(x, y)?;
                }
            }
            None => {
                return Err(format!(
                    "a reduction over {} replicas needs their NCCL communicator: run the graph on replicas (ampgraph::parallel::Replicas)",
                    reduce.replicas
                ))
            }
        }
        Ok(outputs)
    })))
}
