//! The `sync-batch-norm` pass (`ampgraph::passes::SyncBatchNorm`): training BatchNorms
//! become statistics over all replicas (an AllReduce of the per-channel mean and mean
//! of squares), built before autodiff so the backward is autodiff's of the composed ops.
//!
//! - With one replica the converted graph computes what BatchNorm computed: forward,
//!   gradients (autodiff after the pass against BatchNormGrad before it) and the
//!   moving-average updates, NCHW and NHWC, with and without the fused ReLU; and a
//!   float64 hand computation of batch-norm on tiny tensors (f32 and f64 graphs,
//!   images and `[N, C]`).
//! - Two replicas simulated on the CPU in lockstep, without threads (each AllReduce
//!   averages its inputs over the replicas' values): every replica's half of the
//!   batch is normalised, differentiated and averaged into the moving statistics as
//!   the full batch is by one BatchNorm, which its own half alone is not.
//! - Mixed precision after the pass (the order of a training step: the pass, autodiff,
//!   AMP) narrows the convolutions but leaves the statistics and every all-reduce f32.
//! - The CUDA pipeline's passes after it keep the step's values (on the CPU), the
//!   statistics summed by one kernel that stores nothing else.
//! - Structure and errors: one AllReduce of 2 x [C] per training BatchNorm, inference
//!   ones untouched, idempotent, 16-bit `x` widened for the statistics; a BatchNorm with
//!   no channel axis, a graph with its BatchNormGrad built, and 0 replicas refused.

mod common;

use std::collections::HashMap;

use ampgraph::exec::feeds::seeded_tensor;
use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::autodiff::gradients;
use ampgraph::graph::ops::{
    AllReduce, AssignVariable, BatchNorm, BatchNormGrad, Cast, DataFormat, NormActivation, Padding,
    Reduce, ReduceKind,
};
use ampgraph::graph::{DType, Graph, GraphError, NodeId, Port, Tensor, TensorType};
use ampgraph::passes::{Pass, PassError, SyncBatchNorm};
use common::count;

const CIN: usize = 3;
const C: usize = 4;
const HW: usize = 5;
const EPSILON: f64 = 1e-3;
const MOMENTUM: f64 = 0.1;

/// conv -> BatchNorm (training) -> relu -> mean loss, with the moving averages updated.
struct Model {
    g: Graph,
    loss: Port,
    /// What the gradients are taken of: x, the conv kernel, scale, offset.
    wrt: Vec<Port>,
    /// The BatchNorm's node (after the pass: the node computing y, same name).
    bn: NodeId,
}

/// The image shape of `batch` images with `channels` channels.
fn image(format: DataFormat, batch: usize, channels: usize) -> Vec<usize> {
    match format {
        DataFormat::Nchw => vec![batch, channels, HW, HW],
        DataFormat::Nhwc => vec![batch, HW, HW, channels],
    }
}

/// Graph outputs: loss, y, batch mean, batch variance, the two moving-average updates.
/// The loss weighs each activation by a fed `r`, so that every gradient is non-trivial.
fn model(format: DataFormat, batch: usize, activation: NormActivation) -> Model {
    let mut g = Graph::new();
    let x = g
        .placeholder("x", DType::F32, image(format, batch, CIN))
        .unwrap();
    let kernel = g.variable("kernel", DType::F32, [3, 3, CIN, C]).unwrap();
    let conv = g.conv2d(x, kernel, [1, 1], Padding::Same, format).unwrap();
    let scale = g.variable("bn/scale", DType::F32, [C]).unwrap();
    let offset = g.variable("bn/offset", DType::F32, [C]).unwrap();
    let moving_mean = g.variable("bn/moving_mean", DType::F32, [C]).unwrap();
    let moving_variance = g.variable("bn/moving_variance", DType::F32, [C]).unwrap();
    // As models/convnet.rs: a training BatchNorm reads empty statistics.
    let empty = g
        .constant(Tensor::from_f64(DType::F32, [0], &[]).unwrap())
        .unwrap();
    let op = BatchNorm {
        epsilon: EPSILON,
        training: true,
        data_format: format,
        activation,
        ..BatchNorm::default()
    };
    let bn = g
        .add_node("bn", Box::new(op), &[conv, scale, offset, empty, empty])
        .unwrap();
    let y = Port::new(bn, 0);
    let keep = g.scalar(DType::F32, 1.0 - MOMENTUM).unwrap();
    let take = g.scalar(DType::F32, MOMENTUM).unwrap();
    let mut updates = Vec::new();
    for (running, k) in [(moving_mean, 1), (moving_variance, 2)] {
        let kept = g.mul(running, keep).unwrap();
        let taken = g.mul(Port::new(bn, k), take).unwrap();
        let next = g.plus(kept, taken).unwrap();
        updates.push(g.add(AssignVariable, &[running, next]).unwrap());
    }
    let h = g.relu(y).unwrap();
    let r = g
        .placeholder("r", DType::F32, image(format, batch, C))
        .unwrap();
    let weighted = g.mul(h, r).unwrap();
    let loss = g.mean(weighted, None, false).unwrap();
    let outputs = vec![loss, y, Port::new(bn, 1), Port::new(bn, 2)];
    g.set_outputs(outputs.into_iter().chain(updates).collect())
        .unwrap();
    Model {
        g,
        loss,
        wrt: vec![x, kernel, scale, offset],
        bn,
    }
}

/// Adds the gradients of the loss to the graph's outputs (after its own).
fn with_gradients(m: &mut Model) {
    let grads = gradients(&mut m.g, m.loss, &m.wrt).unwrap();
    let outputs: Vec<Port> = m.g.outputs().iter().copied().chain(grads).collect();
    m.g.set_outputs(outputs).unwrap();
}

/// Names of the graph outputs [`model`] and [`with_gradients`] make, for messages.
const OUTPUTS: [&str; 10] = [
    "loss",
    "y",
    "batch_mean",
    "batch_variance",
    "moving_mean update",
    "moving_variance update",
    "dx",
    "dkernel",
    "dscale",
    "doffset",
];

fn uniform(name: &str, shape: Vec<usize>, seed: u64, scale: f64, shift: f64) -> Tensor {
    let t = seeded_tensor(name, &TensorType::new(DType::F32, shape.clone()), seed);
    let values: Vec<f64> = t.to_f64_vec().iter().map(|v| v * scale + shift).collect();
    Tensor::from_f64(DType::F32, shape, &values).unwrap()
}

/// The variables' values (shared by every replica).
fn variables(seed: u64) -> Feeds {
    [
        (
            "kernel",
            uniform("kernel", vec![3, 3, CIN, C], seed, 0.5, 0.0),
        ),
        ("bn/scale", uniform("bn/scale", vec![C], seed, 0.5, 1.0)),
        ("bn/offset", uniform("bn/offset", vec![C], seed, 0.5, 0.0)),
        ("bn/moving_mean", uniform("mm", vec![C], seed, 0.1, 0.0)),
        ("bn/moving_variance", uniform("mv", vec![C], seed, 0.1, 1.0)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The placeholders of a batch of `batch` (x away from zero mean, so the mean matters).
fn batch_feeds(format: DataFormat, batch: usize, seed: u64) -> Feeds {
    [
        ("x", uniform("x", image(format, batch, CIN), seed, 2.0, 0.5)),
        ("r", uniform("r", image(format, batch, C), seed, 1.0, 0.0)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Runs the graph's outputs on a fresh CPU executor holding `vars`; also returns the
/// variables it wrote.
fn run(g: &Graph, vars: &Feeds, feeds: &Feeds) -> (Vec<Tensor>, HashMap<String, Tensor>) {
    let mut exec = CpuExecutor::new();
    for (name, value) in vars {
        exec.set_variable(name, value.clone()).unwrap();
    }
    let out = exec.run(g, feeds, g.outputs()).unwrap();
    (out, exec.variables)
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tolerance: f64) {
    let err = common::relative_error(got, want);
    assert!(
        err <= tolerance,
        "{what}: relative error {err:e} > {tolerance:e}\n got {got:?}\nwant {want:?}"
    );
}

/// The training BatchNorms left, and the inference-form ones whose statistics get
/// gradients (what the pass makes of a training one).
fn synchronised(g: &Graph) -> (usize, usize) {
    let bns: Vec<&BatchNorm> = (g.node_ids())
        .filter_map(|id| g.node(id).op.downcast_ref::<BatchNorm>())
        .collect();
    let training = bns.iter().filter(|b| b.training).count();
    let synchronised = (bns.iter())
        .filter(|b| !b.training && b.sync_replicas > 0)
        .count();
    (training, synchronised)
}

const FORMATS: [DataFormat; 2] = [DataFormat::Nchw, DataFormat::Nhwc];
const ACTIVATIONS: [NormActivation; 2] = [NormActivation::Identity, NormActivation::Relu];

#[test]
fn one_replica_matches_batch_norm_forward_gradients_and_moving_averages() {
    for format in FORMATS {
        for activation in ACTIVATIONS {
            let case = format!("{format:?} {activation:?}");
            let mut before = model(format, 4, activation);
            let mut after = model(format, 4, activation);
            let summary = SyncBatchNorm::new(1).run(&mut after.g).unwrap();
            assert!(
                summary.lines[0].contains("1 training BatchNorms converted"),
                "{case}: {summary}"
            );
            after.g.validate().unwrap();
            assert_eq!(synchronised(&after.g), (0, 1), "{case}");
            assert_eq!(count(&after.g, "AllReduce"), 1, "{case}");
            // The node computing y kept the BatchNorm's name.
            assert_eq!(after.g.find("bn"), Some(after.bn), "{case}");
            with_gradients(&mut before);
            with_gradients(&mut after);
            assert_eq!(count(&before.g, "BatchNormGrad"), 1, "{case}");
            // Its gradient: the inference form's, with the statistics' gradients.
            let grads: Vec<&BatchNormGrad> = (after.g.node_ids())
                .filter_map(|id| after.g.node(id).op.downcast_ref::<BatchNormGrad>())
                .collect();
            assert_eq!(grads.len(), 1, "{case}");
            assert!(!grads[0].training, "{case}");
            let written = assert_same_step(&case, &before.g, &after.g, format, 7);
            let vars = variables(7);
            for name in ["bn/moving_mean", "bn/moving_variance"] {
                assert_ne!(written[name], vars[name], "{case}: {name} not updated");
            }
        }
    }
}

/// Runs `want` and `got` on the same variables and batch (of `seed`): the same
/// [`OUTPUTS`] and moving averages, within f32 rounding. Returns the variables `got`
/// wrote.
fn assert_same_step(
    case: &str,
    want: &Graph,
    got: &Graph,
    format: DataFormat,
    seed: u64,
) -> HashMap<String, Tensor> {
    let vars = variables(seed);
    let feeds = batch_feeds(format, 4, seed);
    let (want, want_vars) = run(want, &vars, &feeds);
    let (got, got_vars) = run(got, &vars, &feeds);
    assert_eq!(want.len(), OUTPUTS.len());
    for ((name, w), o) in OUTPUTS.iter().zip(&want).zip(&got) {
        assert_eq!(w.ty(), o.ty(), "{case}: {name}");
        assert_close(
            &format!("{case}: {name}"),
            &o.to_f64_vec(),
            &w.to_f64_vec(),
            1e-5,
        );
    }
    for name in ["bn/moving_mean", "bn/moving_variance"] {
        assert_close(
            &format!("{case}: {name} written"),
            &got_vars[name].to_f64_vec(),
            &want_vars[name].to_f64_vec(),
            1e-5,
        );
    }
    got_vars
}

/// The converted graph with its gradients after the CUDA pipeline's passes (layouts,
/// fusion, the statistics' column sums taken by the kernel squaring `x`), run on the
/// CPU: the same outputs and moving averages as before those passes; and the
/// statistics' kernel stores nothing but its two column sums (not x's square).
#[test]
fn the_cuda_pipelines_passes_keep_what_the_synchronised_step_computes() {
    use ampgraph::graph::ops::FusedElementwise;
    for format in FORMATS {
        let case = format!("{format:?}");
        let mut m = model(format, 4, NormActivation::Relu);
        SyncBatchNorm::new(1).run(&mut m.g).unwrap();
        with_gradients(&mut m);
        let mut piped = m.g.clone();
        let mut passes = ampgraph::passes::PassManager::new();
        for pass in ampgraph::exec::cuda::pipeline(&Default::default()) {
            passes.push(pass);
        }
        passes.run(&mut piped).unwrap();
        piped.validate().unwrap();
        let sums_alone: Vec<&FusedElementwise> = (piped.node_ids())
            .filter_map(|id| piped.node(id).op.downcast_ref::<FusedElementwise>())
            .filter(|f| f.outputs().is_empty())
            .collect();
        // NCHW f32 convolutions keep their layout (`layout-nhwc` moves 16-bit ones):
        // the statistics are then Sums over three axes, not column sums.
        if format == DataFormat::Nhwc {
            assert_eq!(sums_alone.len(), 1, "{case}");
            assert_eq!(sums_alone[0].column_sums().len(), 2, "{case}");
        }
        assert_same_step(&case, &m.g, &piped, format, 5);
    }
}

/// Batch norm in training by hand, in f64: (y, mean, unbiased variance), `x` read
/// along `channel` of `shape`.
fn batch_norm_f64(
    x: &[f64],
    shape: &[usize],
    channel: usize,
    scale: &[f64],
    offset: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = shape[channel];
    let inner: usize = shape[channel + 1..].iter().product();
    let ch = |i: usize| (i / inner) % c;
    let n = (x.len() / c) as f64;
    let mut mean = vec![0.0; c];
    for (i, v) in x.iter().enumerate() {
        mean[ch(i)] += v / n;
    }
    let mut var = vec![0.0; c];
    for (i, v) in x.iter().enumerate() {
        var[ch(i)] += (v - mean[ch(i)]).powi(2) / n;
    }
    let y = x
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let k = ch(i);
            (v - mean[k]) / (var[k] + EPSILON).sqrt() * scale[k] + offset[k]
        })
        .collect();
    let unbiased = var.iter().map(|v| v * n / (n - 1.0)).collect();
    (y, mean, unbiased)
}

#[test]
fn one_replica_matches_a_float64_batch_norm_by_hand() {
    // (shape, format, channel axis)
    let cases = [
        (vec![2, 3, 2, 2], DataFormat::Nchw, 1),
        (vec![2, 2, 2, 3], DataFormat::Nhwc, 3),
        (vec![5, 3], DataFormat::Nhwc, 1),
    ];
    for (shape, format, channel) in cases {
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let case = format!("{shape:?} {format:?} {dtype}");
            let c = shape[channel];
            let n: usize = shape.iter().product();
            // Values with per-channel means far from 0 and unequal spreads.
            let x: Vec<f64> = (0..n)
                .map(|i| ((i * 7919) % 23) as f64 / 7.0 - 1.0 + (i % 3) as f64)
                .collect();
            let scale: Vec<f64> = (0..c).map(|k| 0.5 + k as f64 * 0.25).collect();
            let offset: Vec<f64> = (0..c).map(|k| k as f64 * 0.3 - 0.2).collect();
            let mut g = Graph::new();
            let xp = g.placeholder("x", dtype, shape.clone()).unwrap();
            let sp = g.placeholder("scale", dtype, [c]).unwrap();
            let op = g.placeholder("offset", dtype, [c]).unwrap();
            let empty = g
                .constant(Tensor::from_f64(dtype, [0], &[]).unwrap())
                .unwrap();
            let bn = BatchNorm {
                epsilon: EPSILON,
                training: true,
                data_format: format,
                activation: NormActivation::Identity,
                ..BatchNorm::default()
            };
            let bn = g.add(bn, &[xp, sp, op, empty, empty]).unwrap();
            g.set_outputs(vec![bn, Port::new(bn.node, 1), Port::new(bn.node, 2)])
                .unwrap();
            let original = g.clone();
            SyncBatchNorm::new(1).run(&mut g).unwrap();
            g.validate().unwrap();
            assert_eq!(synchronised(&g), (0, 1), "{case}");
            let feeds: Feeds = [
                ("x", &x, &shape),
                ("scale", &scale, &vec![c]),
                ("offset", &offset, &vec![c]),
            ]
            .into_iter()
            .map(|(name, v, s)| {
                (
                    name.to_string(),
                    Tensor::from_f64(dtype, s.clone(), v).unwrap(),
                )
            })
            .collect();
            let (y, mean, unbiased) = batch_norm_f64(&x, &shape, channel, &scale, &offset);
            let (got, _) = run(&g, &Feeds::new(), &feeds);
            let (original, _) = run(&original, &Feeds::new(), &feeds);
            for (k, want) in [y, mean, unbiased].iter().enumerate() {
                assert_eq!(got[k].dtype(), dtype, "{case}: output {k}");
                assert_close(
                    &format!("{case}: output {k}"),
                    &got[k].to_f64_vec(),
                    want,
                    tolerance,
                );
                // BatchNorm itself, for the record, is as close.
                assert_close(
                    &format!("{case}: BatchNorm output {k}"),
                    &original[k].to_f64_vec(),
                    want,
                    tolerance,
                );
            }
        }
    }
}

/// Runs `g` for each replica's feeds in lockstep, as replicas would: an AllReduce
/// outputs the mean of its inputs over the replicas (computed in f64, stored in their
/// dtype). `shared` feeds every replica (the variables).
fn run_replicas(g: &Graph, shared: &Feeds, shards: &[Feeds]) -> Vec<Vec<Tensor>> {
    let replicas = shards.len();
    let mut values: Vec<HashMap<NodeId, Vec<Tensor>>> = vec![HashMap::new(); replicas];
    for id in g.topo_order().unwrap() {
        let node = g.node(id);
        let inputs = g.inputs(id);
        if let Some(all_reduce) = node.op.downcast_ref::<AllReduce>() {
            assert_eq!(all_reduce.replicas, replicas, "{}", node.name);
            let means: Vec<Tensor> = inputs
                .iter()
                .map(|p| {
                    let ty = g.ty(*p);
                    let mut sum = vec![0.0; ty.checked_len().unwrap()];
                    for v in &values {
                        for (s, x) in sum.iter_mut().zip(v[&p.node][p.index].to_f64_vec()) {
                            *s += x;
                        }
                    }
                    let mean: Vec<f64> = sum.iter().map(|s| s / replicas as f64).collect();
                    Tensor::from_f64(ty.dtype, ty.shape.clone(), &mean).unwrap()
                })
                .collect();
            for v in &mut values {
                v.insert(id, means.clone());
            }
            continue;
        }
        for (v, feeds) in values.iter_mut().zip(shards) {
            let outputs = match feeds.get(&node.name).or_else(|| shared.get(&node.name)) {
                Some(t) => vec![t.clone()],
                None => {
                    let args: Vec<&Tensor> = inputs.iter().map(|p| &v[&p.node][p.index]).collect();
                    node.op
                        .eval(&args)
                        .unwrap_or_else(|e| panic!("{}: {e}", node.name))
                }
            };
            v.insert(id, outputs);
        }
    }
    values
        .iter()
        .map(|v| {
            g.outputs()
                .iter()
                .map(|p| v[&p.node][p.index].clone())
                .collect()
        })
        .collect()
}

/// Part `k` of `parts` equal parts of `t` along axis 0.
fn shard(t: &Tensor, k: usize, parts: usize) -> Tensor {
    let mut shape = t.shape().to_vec();
    shape[0] /= parts;
    let len: usize = shape.iter().product();
    let values = t.to_f64_vec()[k * len..(k + 1) * len].to_vec();
    Tensor::from_f64(t.dtype(), shape, &values).unwrap()
}

#[test]
fn two_simulated_replicas_normalise_differentiate_and_average_as_the_whole_batch() {
    const R: usize = 2;
    const BATCH: usize = 4;
    for format in FORMATS {
        for activation in ACTIVATIONS {
            let case = format!("{format:?} {activation:?}");
            // The whole batch through one BatchNorm (and BatchNormGrad).
            let mut whole = model(format, BATCH, activation);
            with_gradients(&mut whole);
            let vars = variables(11);
            let feeds = batch_feeds(format, BATCH, 11);
            let (want, _) = run(&whole.g, &vars, &feeds);
            // Each replica's half through the synchronised graph.
            let mut synced = model(format, BATCH / R, activation);
            SyncBatchNorm::new(R).run(&mut synced.g).unwrap();
            synced.g.validate().unwrap();
            with_gradients(&mut synced);
            // The backward all-reduces the statistics' gradients too.
            assert_eq!(count(&synced.g, "AllReduce"), 2, "{case}");
            let shards: Vec<Feeds> = (0..R)
                .map(|k| {
                    feeds
                        .iter()
                        .map(|(n, t)| (n.clone(), shard(t, k, R)))
                        .collect()
                })
                .collect();
            let got = run_replicas(&synced.g, &vars, &shards);
            let out = |r: usize, name: &str| {
                let k = OUTPUTS.iter().position(|o| *o == name).unwrap();
                got[r][k].to_f64_vec()
            };
            let whole_out = |name: &str| {
                let k = OUTPUTS.iter().position(|o| *o == name).unwrap();
                want[k].clone()
            };
            for r in 0..R {
                // Each replica's y is its part of the whole batch's y.
                let y = shard(&whole_out("y"), r, R).to_f64_vec();
                assert_close(&format!("{case}: y of replica {r}"), &out(r, "y"), &y, 1e-5);
                // The statistics and moving averages are the whole batch's (the
                // variance unbiased over the global count), on every replica.
                for name in [
                    "batch_mean",
                    "batch_variance",
                    "moving_mean update",
                    "moving_variance update",
                ] {
                    assert_close(
                        &format!("{case}: {name} of replica {r}"),
                        &out(r, name),
                        &whole_out(name).to_f64_vec(),
                        1e-5,
                    );
                }
                // Replica r's input gradient is that of the sum of the replicas' losses,
                // R times the whole batch's mean loss, on its part.
                let dx: Vec<f64> = shard(&whole_out("dx"), r, R)
                    .to_f64_vec()
                    .iter()
                    .map(|v| v * R as f64)
                    .collect();
                assert_close(
                    &format!("{case}: dx of replica {r}"),
                    &out(r, "dx"),
                    &dx,
                    1e-5,
                );
            }
            // The replicas' losses and weight gradients average to the whole batch's
            // (what the data-parallel gradient all-reduce computes).
            for name in ["loss", "dkernel", "dscale", "doffset"] {
                let n = out(0, name).len();
                let mean: Vec<f64> = (0..n)
                    .map(|i| (0..R).map(|r| out(r, name)[i]).sum::<f64>() / R as f64)
                    .collect();
                assert_close(
                    &format!("{case}: mean {name}"),
                    &mean,
                    &whole_out(name).to_f64_vec(),
                    1e-5,
                );
            }
            // What synchronising changes: one half's own statistics are not the batch's.
            let mut local = model(format, BATCH / R, activation);
            with_gradients(&mut local);
            let (half, _) = run(&local.g, &vars, &shards[0]);
            for name in ["batch_mean", "batch_variance", "dscale"] {
                let k = OUTPUTS.iter().position(|o| *o == name).unwrap();
                let err = common::tensor_relative_error(&half[k], &want[k]);
                assert!(
                    err > 1e-2,
                    "{case}: {name} of a half is the batch's ({err:e})"
                );
            }
        }
    }
}

#[test]
fn converts_each_training_batch_norm_once_and_leaves_inference_ones() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, C, 3, 3]).unwrap();
    let stat = |g: &mut Graph, name: &str| g.variable(name, DType::F32, [C]).unwrap();
    let (scale, offset) = (stat(&mut g, "scale"), stat(&mut g, "offset"));
    let (mean, variance) = (stat(&mut g, "mean"), stat(&mut g, "variance"));
    let bn = |training, format| BatchNorm {
        epsilon: EPSILON,
        training,
        data_format: format,
        activation: NormActivation::Identity,
        ..BatchNorm::default()
    };
    let inputs = |x| [x, scale, offset, mean, variance];
    let a = g.add(bn(true, DataFormat::Nchw), &inputs(x)).unwrap();
    let b = g.add(bn(false, DataFormat::Nchw), &inputs(a)).unwrap();
    let t = g.transpose(b, [0, 2, 3, 1]).unwrap();
    let c = g.add(bn(true, DataFormat::Nhwc), &inputs(t)).unwrap();
    let update = g
        .add(AssignVariable, &[variance, Port::new(c.node, 2)])
        .unwrap();
    g.set_outputs(vec![c, update]).unwrap();
    let summary = SyncBatchNorm::new(4).run(&mut g).unwrap();
    g.validate().unwrap();
    assert!(
        summary.lines[0].contains("2 training BatchNorms converted")
            && summary.lines[0].contains("4 replicas")
            && summary.lines[0].contains("1 inference BatchNorms left alone")
            && summary.lines[0].contains(&format!("{} values", 4 * C)),
        "{summary}"
    );
    // One AllReduce of the two [C] statistics per training BatchNorm.
    let all_reduces: Vec<NodeId> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .collect();
    assert_eq!(all_reduces.len(), 2);
    for &id in &all_reduces {
        assert_eq!(
            g.node(id).op.downcast_ref::<AllReduce>().unwrap().replicas,
            4
        );
        let inputs = g.inputs(id);
        assert_eq!(inputs.len(), 2);
        for p in inputs {
            assert_eq!(*g.ty(p), TensorType::new(DType::F32, vec![C]));
            // A local sum (a column sum once NHWC) times 1 / count.
            let sum = g.inputs(p.node)[0];
            let reduce = g.node(sum.node).op.downcast_ref::<Reduce>();
            assert!(reduce.is_some_and(|r| r.kind == ReduceKind::Sum), "{p:?}");
        }
    }
    let bns: Vec<&BatchNorm> = g
        .node_ids()
        .filter_map(|id| g.node(id).op.downcast_ref::<BatchNorm>())
        .collect();
    assert_eq!(bns.len(), 3);
    assert_eq!(synchronised(&g), (0, 2));
    // The update reads the unbiased global variance: S - M^2 (clamped) times
    // N / (N - 1), N = 4 replicas x 2*3*3 values per channel.
    let update_value = g.inputs(update.node)[1];
    let bessel = g.inputs(update_value.node)[1];
    let n = 4.0 * 18.0;
    assert_eq!(
        g.node(bessel.node).op.eval(&[]).unwrap()[0].to_f64_vec(),
        vec![(n / (n - 1.0)) as f32 as f64]
    );
    // Idempotent: nothing left to convert.
    let len = g.len();
    let again = SyncBatchNorm::new(4).run(&mut g).unwrap();
    assert!(again.lines[0].contains("0 training BatchNorms"), "{again}");
    assert_eq!(g.len(), len);
}

#[test]
fn sixteen_bit_x_is_widened_for_the_statistics() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F16, [4, 3, 3, C]).unwrap();
    let scale = g.placeholder("scale", DType::F32, [C]).unwrap();
    let offset = g.placeholder("offset", DType::F32, [C]).unwrap();
    let empty = g
        .constant(Tensor::from_f64(DType::F32, [0], &[]).unwrap())
        .unwrap();
    let y = g.batch_norm(x, scale, offset, empty, empty, true).unwrap();
    g.set_outputs(vec![y, Port::new(y.node, 1), Port::new(y.node, 2)])
        .unwrap();
    let original = g.clone();
    SyncBatchNorm::new(1).run(&mut g).unwrap();
    g.validate().unwrap();
    // x is cast to f32 once; the reductions, the all-reduce and the statistics are f32.
    let casts: Vec<NodeId> = g
        .node_ids()
        .filter(|&id| {
            g.node(id)
                .op
                .downcast_ref::<Cast>()
                .is_some_and(|c| c.to == DType::F32)
        })
        .collect();
    assert_eq!(casts.len(), 1);
    assert_eq!(g.inputs(casts[0]), vec![x]);
    for id in g.node_ids().filter(|&id| g.node(id).op.is::<Reduce>()) {
        assert_eq!(g.node(id).outputs()[0].dtype, DType::F32);
    }
    assert_eq!(g.ty(g.outputs()[0]).dtype, DType::F16);
    let feeds: Feeds = [
        (
            "x",
            seeded_tensor("x", &TensorType::new(DType::F16, vec![4, 3, 3, C]), 3),
        ),
        ("scale", uniform("scale", vec![C], 3, 0.5, 1.0)),
        ("offset", uniform("offset", vec![C], 3, 0.5, 0.0)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let (got, _) = run(&g, &Feeds::new(), &feeds);
    let (want, _) = run(&original, &Feeds::new(), &feeds);
    for (k, tolerance) in [(0, 1e-3), (1, 1e-5), (2, 1e-5)] {
        assert_eq!(got[k].ty(), want[k].ty());
        assert_close(
            &format!("output {k}"),
            &got[k].to_f64_vec(),
            &want[k].to_f64_vec(),
            tolerance,
        );
    }
}

#[test]
fn refuses_what_it_cannot_synchronise() {
    // A BatchNorm whose x has no channel axis (rank 3: rewired after the fact).
    let mut m = model(DataFormat::Nchw, 2, NormActivation::Identity);
    let odd = m.g.placeholder("odd", DType::F32, [2, C, 25]).unwrap();
    m.g.set_input(m.bn, 0, odd).unwrap();
    // Beside a BatchNorm that converts, which the error leaves as it is.
    let flat = m.g.placeholder("flat", DType::F32, [2, C]).unwrap();
    let inputs = m.g.inputs(m.bn);
    let good =
        m.g.batch_norm(flat, inputs[1], inputs[2], inputs[3], inputs[4], true)
            .unwrap();
    let outputs: Vec<Port> = m.g.outputs().iter().copied().chain([good]).collect();
    m.g.set_outputs(outputs).unwrap();
    let len = m.g.len();
    match SyncBatchNorm::new(2).run(&mut m.g) {
        Err(PassError::Graph(GraphError::Node { node, op, msg })) => {
            assert_eq!((node.as_str(), op.as_str()), ("bn", "BatchNorm"));
            assert!(msg.contains("channel axis"), "{msg}");
        }
        other => panic!("expected an error naming bn, got {other:?}"),
    }
    assert_eq!((m.g.len(), count(&m.g, "BatchNorm")), (len, 2));
    // The backward already built: BatchNormGrad knows only the local batch.
    let mut m = model(DataFormat::Nhwc, 2, NormActivation::Identity);
    with_gradients(&mut m);
    assert_eq!(count(&m.g, "BatchNormGrad"), 1);
    match SyncBatchNorm::new(2).run(&mut m.g) {
        Err(PassError::Graph(GraphError::Node { node, msg, .. })) => {
            assert_eq!(node, "bn");
            assert!(msg.contains("before autodiff"), "{msg}");
        }
        other => panic!("expected an error naming bn, got {other:?}"),
    }
    // No replicas.
    let mut m = model(DataFormat::Nhwc, 2, NormActivation::Identity);
    assert!(matches!(
        SyncBatchNorm::new(0).run(&mut m.g),
        Err(PassError::Rewrite(_))
    ));
}

#[test]
fn statistics_stay_f32_when_mixed_precision_runs_after_the_pass() {
    use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
    for format in FORMATS {
        // The pass on the f32 forward graph, then the backward, then fp16 AMP: the
        // order of a mixed-precision data-parallel step.
        let mut m = model(format, 2, NormActivation::Identity);
        SyncBatchNorm::new(2).run(&mut m.g).unwrap();
        with_gradients(&mut m);
        let amp = AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap());
        amp.run(&mut m.g).unwrap();
        m.g.validate().unwrap();
        let g = &m.g;
        let conv = g
            .node_ids()
            .find(|&id| g.node(id).op_name() == "Conv2D")
            .unwrap();
        assert_eq!(g.node(conv).outputs()[0].dtype, DType::F16, "{format:?}");
        let stats = ["local_mean", "square", "local_mean_square", "all_reduce"];
        for leaf in stats {
            let id = g.find(&format!("bn/sync/{leaf}")).unwrap();
            for t in g.node(id).outputs() {
                assert_eq!(t.dtype, DType::F32, "{format:?} {leaf}");
            }
        }
        // Every all-reduce (the backward's too) is of f32 values.
        for id in g.node_ids().filter(|&id| g.node(id).op.is::<AllReduce>()) {
            for p in g.inputs(id) {
                assert_eq!(g.ty(p).dtype, DType::F32, "{}", g.node(id).name);
            }
        }
    }
}
