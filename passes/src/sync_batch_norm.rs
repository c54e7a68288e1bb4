//! Synchronised batch normalisation (`sync-batch-norm`), PyTorch's
//! `nn.SyncBatchNorm.convert_sync_batchnorm`: in data-parallel training each replica
//! normalises its shard of the batch with the statistics of the GLOBAL batch (every
//! replica's shard), not of its own shard.
//!
//! Run it on the forward training graph, before the backward pass is built (`minimize`
//! calls `autodiff::gradients`): the BatchNorm it leaves carries `sync_replicas`, whose
//! gradient all-reduces the replica's sums, the exact gradient of the global batch's
//! loss. A graph whose BatchNorm already has its `BatchNormGrad` is refused: that
//! kernel knows only the local batch.
//!
//! Every training-mode [`BatchNorm`] (inference ones are left alone) over `x` with
//! channel axis `c` (1 for NCHW images, the last axis for NHWC images and `[N, C]`)
//! becomes, with the statistics in their dtype U (f32, or f64 for an f64 `x`):
//!
//! ```text
//! w      = Cast<U>(x)                           the statistics' input
//! m, s   = Sum(w) / n, Sum(w * w) / n           over every axis but c, each [C]
//! M, S   = AllReduce{replicas}(m, s)            one call per BatchNorm, 2C values
//! v      = max(S - M^2, 0)                      the biased global variance
//! y      = BatchNorm{training: false,           the same op normalising by M and v
//!            sync_replicas}(x, scale, offset,   (its activation kept)
//!            M, v)
//! ```
//!
//! The normalisation is the BatchNorm op in its inference form: its fused kernels each
//! way, its layout (`layout-nhwc`), its activation (`fuse-batchnorm-activation`) and
//! AMP's treatment (16-bit `x`, f32 statistics). With `sync_replicas` its gradient is
//! `BatchNormGrad`'s inference form (`dx = a * dy`, the replica's `dscale` and
//! `doffset`), one AllReduce of those sums and the global batch's terms added to `dx`
//! (`- a * mean(dy) - a * xhat * mean(dy * xhat)`, the means over every replica's
//! shard): the training form's gradient over the global batch. The statistics' path
//! gets no gradient (it would give the same terms through two broadcasts of `[C]`
//! back to `x`, holding `x`'s f32 copy and its square through the step).
//!
//! The statistics read `x` through the Cast even when `x` is already U (a Cast of f32
//! to f32, which `algebraic` removes): AMP, run after this pass on the f32 graph,
//! narrows `x` to 16 bits but leaves an explicit Cast's destination alone, so the
//! reductions, the all-reduce and the variance stay in f32 (`cast-into-reduce` then
//! folds the widening into the local sum); without it `Sum` and `Square` (infer ops)
//! would follow the 16-bit `x`, `x * x` could overflow and `S - M^2` would keep about
//! three digits.
//!
//! The BatchNorm's other outputs, read by the moving-average updates, become `M` (the
//! batch mean) and `v * N / (N - 1)` (the batch variance with Bessel's correction, as
//! BatchNorm gives it, `N = replicas x` the local count per channel; `v` itself when
//! `N = 1`), what PyTorch's SyncBatchNorm puts in its running statistics. The new
//! BatchNorm takes the old one's node (its name, its readers); readers of the
//! statistics are rewired, and a graph output that was a statistic becomes the new
//! node's (under the new node's name). With `replicas == 1` the converted graph
//! computes what the BatchNorm did, within f32 rounding.
//!
//! Assumptions and costs:
//!
//! - Every replica holds the same number of examples (the global mean is the mean of
//!   the replicas' means); PyTorch also handles unequal shards, by their counts.
//! - The variance is `E[x^2] - E[x]^2`, one reduction pass each and a single all-reduce,
//!   clamped at 0; it loses precision where a channel's mean is large against its
//!   standard deviation (relative error about 1e-7 `(mean / std)^2` in f32).
//! - Cost per BatchNorm beyond the fused kernels: the statistics (Sums, not Means: on
//!   NHWC images and `[N, C]` they are column sums, which `sum-into-elementwise` gives
//!   the one kernel computing `w * w`, so `x` is read once and that kernel writes
//!   nothing but the two sums), an all-reduce of
//!   `2C` floats each way, and one elementwise pass adding the global terms to `dx`.
//!
//! A BatchNorm whose `x` is not of rank 2 or 4 (no channel axis is known) is an error
//! ([`PassError::Graph`] of a [`GraphError::Node`] naming it), as is `replicas == 0`.

use ampgraph_graph::ops::{
    AllReduce, BatchNorm, BatchNormGrad, Binary, BinaryKind, Cast, Const, Reduce, ReduceKind,
    Unary, UnaryKind,
};
use ampgraph_graph::{DType, Graph, GraphError, NodeId, Op, Port, Tensor};

use crate::rewrite::summary;
use crate::{Pass, PassError, PassSummary};

/// The `sync-batch-norm` pass: training BatchNorms normalise with the statistics of
/// the batch of all `replicas` replicas (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncBatchNorm {
    /// How many replicas (one per device) share a step; at least 1.
    pub replicas: usize,
}

impl SyncBatchNorm {
    pub fn new(replicas: usize) -> Self {
        SyncBatchNorm { replicas }
    }
}

/// The error of the BatchNorm `id`.
fn node_error(g: &Graph, id: NodeId, msg: impl Into<String>) -> PassError {
    PassError::Graph(GraphError::node(&g.node(id).name, "BatchNorm", msg))
}

/// The channel axis of the BatchNorm `id`'s `x`: an error where its rank (neither 2
/// nor 4) gives none.
fn channel_axis(g: &Graph, id: NodeId, bn: &BatchNorm) -> Result<usize, PassError> {
    let x = g
        .inputs(id)
        .first()
        .copied()
        .ok_or_else(|| node_error(g, id, "has no input x"))?;
    let xt = g.ty(x);
    match xt.rank() {
        2 | 4 => Ok(bn.channel_axis(xt.rank())),
        _ => Err(node_error(
            g,
            id,
            format!(
                "x {xt} has no known channel axis (rank 2 [N, C] or rank 4 NCHW/NHWC expected): cannot synchronise its statistics"
            ),
        )),
    }
}

/// Adds nodes named `<prefix>/<leaf>` (made unique).
struct Builder<'g> {
    g: &'g mut Graph,
    prefix: String,
}

impl Builder<'_> {
    fn add(&mut self, leaf: &str, op: impl Op, inputs: &[Port]) -> Result<Port, PassError> {
        let name = self.g.fresh_name(format!("{}/{leaf}", self.prefix));
        Ok(self.g.add_node(name, Box::new(op), inputs)?.into())
    }

    fn unary(&mut self, leaf: &str, kind: UnaryKind, x: Port) -> Result<Port, PassError> {
        self.add(leaf, Unary::new(kind), &[x])
    }

    fn binary(
        &mut self,
        leaf: &str,
        kind: BinaryKind,
        a: Port,
        b: Port,
    ) -> Result<Port, PassError> {
        self.add(leaf, Binary::new(kind), &[a, b])
    }

    fn scalar(&mut self, leaf: &str, dtype: DType, value: f64) -> Result<Port, PassError> {
        self.add(leaf, Const::new(Tensor::scalar(dtype, value)), &[])
    }
}

impl SyncBatchNorm {
    /// Replaces the training BatchNorm `id` by the synchronised computation.
    /// Returns its channel count.
    fn convert(&self, g: &mut Graph, id: NodeId, bn: &BatchNorm) -> Result<usize, PassError> {
        let axis = channel_axis(g, id, bn)?;
        let [x, scale, offset, _, _] = g.inputs(id)[..] else {
            return Err(node_error(g, id, "a BatchNorm takes 5 inputs"));
        };
        let xt = g.ty(x).clone();
        let rank = xt.rank();
        let channels = xt.shape[axis];
        let stats = g.ty(scale).dtype;
        let local_count = xt.shape.iter().product::<usize>() / channels.max(1);
        let reduced: Vec<i64> = (0..rank).filter(|&a| a != axis).map(|a| a as i64).collect();
        // The statistics' readers, decided before anything changes.
        let [mean_readers, variance_readers] = [1, 2].map(|k| g.port_consumers(Port::new(id, k)));
        let outputs = g.outputs().to_vec();
        let is_output = |k: usize| outputs.contains(&Port::new(id, k));
        let name = g.node(id).name.clone();
        let mut b = Builder {
            g,
            prefix: format!("{name}/sync"),
        };

        // The statistics read x through a Cast to U even where x is U already: mixed
        // precision, run later, narrows x but leaves an explicit Cast's destination
        // wide, so the reductions and the all-reduce stay in U.
        let wide = b.add("cast", Cast { to: stats }, &[x])?;
        // Sums scaled after (not Means): on NHWC images and [N, C] they are column
        // sums, which `sum-into-elementwise` gives the kernel computing the square.
        let sum_op = || Reduce::new(ReduceKind::Sum, Some(reduced.clone()), false);
        let per_value = b.scalar("per_value", stats, 1.0 / local_count.max(1) as f64)?;
        let sum = b.add("local_sum", sum_op(), &[wide])?;
        let local_mean = b.binary("local_mean", BinaryKind::Mul, sum, per_value)?;
        let square = b.unary("square", UnaryKind::Square, wide)?;
        let sum_square = b.add("local_sum_square", sum_op(), &[square])?;
        let local_mean_square =
            b.binary("local_mean_square", BinaryKind::Mul, sum_square, per_value)?;
        let all_reduce = b.add(
            "all_reduce",
            AllReduce::mean(self.replicas),
            &[local_mean, local_mean_square],
        )?;
        let mean = Port::new(all_reduce.node, 0);
        let mean_square = Port::new(all_reduce.node, 1);
        let squared_mean = b.unary("squared_mean", UnaryKind::Square, mean)?;
        let difference = b.binary("difference", BinaryKind::Sub, mean_square, squared_mean)?;
        let zero = b.scalar("zero", stats, 0.0)?;
        let variance = b.binary("variance", BinaryKind::Maximum, difference, zero)?;
        // y: the batch norm in its inference form, normalising by the global
        // statistics (its fused kernels, each way); its gradient adds their terms.
        let apply = BatchNorm {
            training: false,
            sync_replicas: self.replicas,
            ..bn.clone()
        };
        let apply_inputs = [x, scale, offset, mean, variance];

        // The statistics' readers (the moving averages) read their replacements.
        let global_count = self.replicas * local_count;
        let unbiased = if variance_readers.is_empty() && !is_output(2) {
            None
        } else if global_count > 1 {
            let bessel = global_count as f64 / (global_count - 1) as f64;
            let bessel = b.scalar("bessel", stats, bessel)?;
            Some(b.binary("unbiased_variance", BinaryKind::Mul, variance, bessel)?)
        } else {
            Some(variance)
        };
        let g = b.g;
        let mut changes: Vec<(NodeId, usize, Port)> = mean_readers
            .into_iter()
            .map(|(reader, slot)| (reader, slot, mean))
            .collect();
        if let Some(unbiased) = unbiased {
            changes.extend(
                variance_readers
                    .into_iter()
                    .map(|(reader, slot)| (reader, slot, unbiased)),
            );
        }
        g.rewire(changes)?;
        let repointed: Vec<Port> = outputs
            .iter()
            .map(|&p| match (p.node == id, p.index, unbiased) {
                (true, 1, _) => mean,
                (true, 2, Some(v)) => v,
                _ => p,
            })
            .collect();
        if repointed != outputs {
            g.set_outputs(repointed)?;
        }
        g.set_node(id, Box::new(apply), &apply_inputs)?;
        Ok(channels)
    }
}

impl Pass for SyncBatchNorm {
    fn name(&self) -> &'static str {
        "sync-batch-norm"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        if self.replicas == 0 {
            return Err(PassError::Rewrite(
                "sync-batch-norm: replicas must be at least 1".into(),
            ));
        }
        let mut training = Vec::new();
        let mut inference = 0usize;
        for id in g.topo_order()? {
            let Some(bn) = g.node(id).op.downcast_ref::<BatchNorm>() else {
                continue;
            };
            if !bn.training {
                inference += 1;
                continue;
            }
            if g.consumers(id)
                .iter()
                .any(|&(reader, _, _)| g.node(reader).op.is::<BatchNormGrad>())
            {
                return Err(node_error(
                    g,
                    id,
                    "its BatchNormGrad is already built: run sync-batch-norm on the forward graph, before autodiff",
                ));
            }
            // Checked for every BatchNorm before any changes: an error leaves the graph
            // as it was.
            channel_axis(g, id, bn)?;
            training.push((id, bn.clone()));
        }
        let (mut channels, converted) = (0usize, training.len());
        for (id, bn) in training {
            channels += self.convert(g, id, &bn)?;
        }
        let lines = vec![
            format!(
                "sync-batch-norm: {converted} training BatchNorms converted to statistics over {} replicas (one AllReduce of 2C values each, {} values a step); {inference} inference BatchNorms left alone",
                self.replicas,
                2 * channels
            ),
        ];
        Ok(summary("sync-batch-norm", lines))
    }
}
