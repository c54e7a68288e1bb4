//! Data parallelism: the gradients of a training step averaged over the replicas.
//!
//! Every replica runs the same step on its own shard of the global batch; before the
//! updates, each gradient becomes its mean over the replicas ([`AllReduce`]), so every
//! replica applies the same update to the same weights (PyTorch's
//! DistributedDataParallel). The pass groups the gradients into buckets in the order
//! the backward pass produces them (the last layers' first), a first bucket of at most
//! 1 MiB and then 25 MiB each, as DDP's defaults: executors issue each bucket's
//! all-reduce as soon as its last gradient exists, while the rest of the backward
//! still runs.
//!
//! It runs after AMP (a session runs it right after the AMP pass), where each
//! gradient's type is known. Under mixed precision the mean is taken over the 16-bit
//! gradients (still scaled by the loss scale, where there is one): the input of the
//! widening `Cast<f32>` that the loss-scale unscaling multiplies or that hands the
//! update its gradient, as PyTorch DDP's `fp16_compress_hook` (and
//! `bf16_compress_hook`) reduce. Half the bytes of f32 cross the links, and the cast
//! and the unscaling still fold into the optimizer updates (`unscale-into-update`,
//! `grad-cast-into-update`), so a replica costs its one-GPU step plus the all-reduce.
//! NCCL's average scales each replica's contribution by 1/N before summing floats
//! (its `ncclAvg` is a pre-multiplied sum), so the mean cannot overflow where no
//! replica's gradient did, and a replica's infinity or NaN makes every replica's mean
//! non-finite: the all-finite check after the mean reads the same values on every
//! replica, one global skip decision and one loss-scale update, and the replicas never
//! diverge. In f32 training the f32 gradients are averaged.
//!
//! FP8 with delayed scaling (`amp::fp8`) keeps amax histories: the replicas' max of
//! every amax (one AllReduce of all of them) is what the `Fp8ScaleUpdate`s and the
//! all-finite checks read, so every replica keeps the same state, as
//! TransformerEngine reduces its amaxes.

use std::collections::HashMap;

use ampgraph_graph::ops::{AllFinite, AllReduce, Fp8ScaleUpdate, OptimizerUpdate, Reduction};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::lossless_cast;
use crate::simplify::unscale_into_update::unscaling;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// PyTorch DDP's `bucket_cap_mb`.
pub const BUCKET_BYTES: usize = 25 << 20;
/// PyTorch DDP's first bucket: small, so that its all-reduce starts early.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// The `data-parallel` pass: gradient means over `replicas` replicas, in buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataParallel {
    pub replicas: usize,
    pub bucket_bytes: usize,
    pub first_bucket_bytes: usize,
}

impl DataParallel {
    pub fn new(replicas: usize) -> Self {
        DataParallel {
            replicas,
            bucket_bytes: BUCKET_BYTES,
            first_bucket_bytes: FIRST_BUCKET_BYTES,
        }
    }
}

/// The tensor whose mean is taken for the gradient port `grad` of an update: the
/// gradient the loss-scale unscaling multiplies (read through its widening cast) where
/// the all-finite check reads the product, the 16-bit gradient an exact widening Cast
/// hands the update (BF16 AMP, no loss scale), or the gradient itself.
fn reduced_port(g: &Graph, grad: Port) -> Port {
    let checked = g
        .port_consumers(grad)
        .into_iter()
        .any(|(reader, _)| g.node(reader).op.is::<AllFinite>());
    match checked.then(|| unscaling(g, grad)).flatten() {
        Some(u) => u.grad,
        None => lossless_cast(g, grad).unwrap_or(grad),
    }
}

/// The ports to reduce, in the order the graph's schedule produces them.
fn gradients_in_order(g: &Graph) -> Result<Vec<Port>, PassError> {
    let position: HashMap<NodeId, usize> = g
        .topo_order()?
        .into_iter()
        .enumerate()
        .map(|(i, id)| (id, i))
        .collect();
    let mut ports: Vec<Port> = Vec::new();
    for id in g.node_ids() {
        if g.node(id).op.is::<OptimizerUpdate>() {
            if let Some(&grad) = g.inputs(id).get(2) {
                let p = reduced_port(g, grad);
                if !ports.contains(&p) {
                    ports.push(p);
                }
            }
        }
    }
    ports.sort_by_key(|p| (position[&p.node], p.index));
    Ok(ports)
}

/// `ports` cut into buckets of at most `first` bytes, then `rest` bytes (a tensor
/// larger than a bucket is a bucket of its own).
fn buckets(g: &Graph, ports: &[Port], first: usize, rest: usize) -> Vec<Vec<Port>> {
    let mut buckets: Vec<Vec<Port>> = Vec::new();
    let mut bytes = 0usize;
    for &p in ports {
        let size = g.ty(p).size_bytes();
        let cap = if buckets.len() == 1 { first } else { rest };
        match buckets.last_mut() {
            Some(bucket) if bytes + size <= cap => {
                bucket.push(p);
                bytes += size;
            }
            _ => {
                buckets.push(vec![p]);
                bytes = size;
            }
        }
    }
    buckets
}

impl Pass for DataParallel {
    fn name(&self) -> &'static str {
        "data-parallel"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        if self.replicas == 0 {
            return Err(PassError::Rewrite(
                "data-parallel: replicas must be at least 1".into(),
            ));
        }
        let title = format!("Data parallel over {} replicas", self.replicas);
        let amaxes = self.reduce_amaxes(g)?;
        // Gradients averaged already (a second run) are left alone; the graph's other
        // AllReduce nodes (a synchronized batch norm's) are not gradients.
        let ports: Vec<Port> = gradients_in_order(g)?
            .into_iter()
            .filter(|p| !g.node(p.node).op.is::<AllReduce>())
            .collect();
        if ports.is_empty() {
            return Ok(PassSummary {
                title,
                lines: vec!["no gradient to average: unchanged".into()],
            });
        }
        let amax_line =
            (amaxes > 0).then(|| format!("{amaxes} FP8 amaxes: their max over the replicas"));
        let buckets = buckets(g, &ports, self.first_bucket_bytes, self.bucket_bytes);
        // The nodes the gradients are computed from: a reader of a gradient among them
        // is part of the backward pass (a synchronised batch norm's gradient reads its
        // `dscale` and `doffset`), which needs the replica's own gradient (and reading
        // the mean would make a cycle); the updates, the finite check and the clipping
        // norm read the mean.
        let backward = g.needed_by(&ports);
        let mut lines = Vec::new();
        let mut total = 0usize;
        for (i, bucket) in buckets.iter().enumerate() {
            let name = g.fresh_name(format!("data_parallel/all_reduce_{i}"));
            let op = AllReduce::mean(self.replicas);
            let node = g.add_node(name, Box::new(op), bucket)?;
            let mut changes = Vec::new();
            for (k, &p) in bucket.iter().enumerate() {
                changes.extend(
                    g.port_consumers(p)
                        .into_iter()
                        .filter(|&(reader, _)| {
                            reader != node
                                && !backward.get(reader.index()).copied().unwrap_or(false)
                        })
                        .map(|(reader, slot)| (reader, slot, Port::new(node, k))),
                );
            }
            g.rewire(changes)?;
            let bytes: usize = bucket.iter().map(|&p| g.ty(p).size_bytes()).sum();
            total += bytes;
            let mut dtypes: Vec<String> = Vec::new();
            for &p in bucket {
                let d = g.ty(p).dtype.to_string();
                if !dtypes.contains(&d) {
                    dtypes.push(d);
                }
            }
            lines.push(format!(
                "bucket {i}: {} gradients, {} ({})",
                bucket.len(),
                format_bytes(bytes as u64),
                dtypes.join(", ")
            ));
        }
        lines.insert(
            0,
            format!(
                "{} gradients ({}) averaged in {} buckets",
                ports.len(),
                format_bytes(total as u64),
                buckets.len()
            ),
        );
        lines.extend(amax_line);
        Ok(PassSummary { title, lines })
    }
}

impl DataParallel {
    /// Makes every replica read the replicas' max of each delayed-scaling amax: one
    /// AllReduce of all the amaxes, which the updates (at the step's end) and the
    /// all-finite checks then read, so every replica keeps the same state and makes
    /// the same skip decision. The products read the scales' inverses from the state,
    /// so none waits for it. Returns how many amaxes.
    fn reduce_amaxes(&self, g: &mut Graph) -> Result<usize, PassError> {
        let mut amaxes: Vec<Port> = Vec::new();
        for id in g.node_ids() {
            if g.node(id).op.is::<Fp8ScaleUpdate>() {
                let inputs = g.inputs(id);
                let step = Fp8ScaleUpdate::MEMBER_INPUTS;
                amaxes.extend(inputs.iter().skip(1).step_by(step).copied());
            }
        }
        amaxes.retain(|p| !g.node(p.node).op.is::<AllReduce>());
        if amaxes.is_empty() {
            return Ok(0);
        }
        let op = AllReduce {
            replicas: self.replicas,
            reduction: Reduction::Max,
        };
        let name = g.fresh_name("data_parallel/amax_max");
        let reduced = g.add_node(name, Box::new(op), &amaxes)?;
        let mut changes = Vec::new();
        for (k, &amax) in amaxes.iter().enumerate() {
            changes.extend(
                g.port_consumers(amax)
                    .into_iter()
                    .filter(|&(reader, _)| reader != reduced)
                    .map(|(reader, slot)| (reader, slot, Port::new(reduced, k))),
            );
        }
        g.rewire(changes)?;
        Ok(amaxes.len())
    }
}
