//! Data-parallel training on the CPU: one replica is the plain graph bit for bit; N
//! replicas (threads averaging through shared memory) match one replica at the
//! global batch; buckets follow the backward pass; one overflow skips the step on
//! every replica; failures name their replica; checkpoints go from rank 0 to all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ampgraph::data::{Loader, LoaderOptions, Mnist};
use ampgraph::exec::{CpuExecutor, Feeds};
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::AllReduce;
use ampgraph::graph::{DType, Graph, Port, Tensor};
use ampgraph::optim::{Optimizer, Sgd, TrainStep, LOSS_SCALE_VARIABLE};
use ampgraph::parallel::{ParallelError, ReplicaOptions, Replicas};
use ampgraph::passes::data_parallel::DataParallel;
use ampgraph::passes::Pass;
use ampgraph::{Device, Position, Session};

mod common;
#[path = "common/replicated.rs"]
mod replicated;

use replicated::{batch, convnet, images, model, variables, CLASSES, FEATURES};

fn cpu_replicas(world: usize, graph: Graph) -> Replicas {
    Replicas::new(graph, &vec![Device::Cpu; world], ReplicaOptions::default()).unwrap()
}

#[test]
fn one_replica_is_the_plain_graph_bit_for_bit() {
    for amp in [false, true] {
        let (g, step) = model(8, amp);
        let mut plain = Session::new(g.clone(), Device::Cpu).unwrap();
        let mut replicas = cpu_replicas(1, g);
        for s in 0..4 {
            let feeds = batch(s, 0, 8);
            let a = plain.run(&[step.loss], &feeds).unwrap();
            plain.run(&[step.step], &feeds).unwrap();
            let b = replicas
                .run(&[step.loss], std::slice::from_ref(&feeds))
                .unwrap();
            replicas.run(&[step.step], &[feeds]).unwrap();
            assert_eq!(
                a[0].to_f64_vec(),
                b[0][0].to_f64_vec(),
                "amp {amp} step {s}"
            );
        }
        let (a, b) = (variables(&plain), variables(replicas.session(0).unwrap()));
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert_eq!(ta.to_f64_vec(), tb.to_f64_vec(), "amp {amp}: variable {na}");
        }
    }
}

#[test]
fn n_replicas_match_one_replica_at_the_global_batch() {
    for world in [2, 4] {
        let per = 4;
        let global = per * world;
        let (g1, step1) = model(global, false);
        let mut one = Session::new(g1, Device::Cpu).unwrap();
        let (gn, stepn) = model(per, false);
        let mut replicas = cpu_replicas(world, gn);
        for s in 0..5 {
            let feeds: Vec<Feeds> = (0..world).map(|r| batch(s, r * per, per)).collect();
            let losses = replicas.run(&[stepn.loss, stepn.step], &feeds).unwrap();
            let want = one
                .run(&[step1.loss, step1.step], &batch(s, 0, global))
                .unwrap()[0]
                .to_f64_vec()[0];
            let mean = losses.iter().map(|o| o[0].to_f64_vec()[0]).sum::<f64>() / world as f64;
            assert!(
                (mean - want).abs() <= 1e-5 * want.abs().max(1.0),
                "world {world} step {s}: {mean} vs {want}"
            );
        }
        for (name, want) in variables(&one) {
            for rank in 0..world {
                let got = replicas
                    .session(rank)
                    .unwrap()
                    .variable(&name)
                    .unwrap()
                    .to_f64_vec();
                for (i, (a, b)) in got.iter().zip(want.to_f64_vec()).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-5 * b.abs().max(1e-2),
                        "world {world} rank {rank} {name}[{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Under BF16 AMP the means are of bf16 gradients (rounded once more than f32 means):
/// two replicas still train as one replica at the global batch, within bf16's
/// precision, and hold the same weights.
#[test]
fn bf16_replicas_train_as_one_replica_at_the_global_batch() {
    let bf16 = |batch: usize| {
        let (mut g, step) = model(batch, false);
        g.mixed_precision = Some(DType::BF16);
        (g, step)
    };
    let (world, per) = (2, 4);
    let (g1, step1) = bf16(per * world);
    let mut one = Session::new(g1, Device::Cpu).unwrap();
    let (gn, stepn) = bf16(per);
    let mut replicas = cpu_replicas(world, gn);
    for s in 0..5 {
        let feeds: Vec<Feeds> = (0..world).map(|r| batch(s, r * per, per)).collect();
        replicas.run(&[stepn.step], &feeds).unwrap();
        one.run(&[step1.step], &batch(s, 0, per * world)).unwrap();
    }
    let mut worst = 0f64;
    for (name, want) in variables(&one) {
        let got: Vec<Vec<f64>> = (0..world)
            .map(|r| {
                replicas
                    .session(r)
                    .unwrap()
                    .variable(&name)
                    .unwrap()
                    .to_f64_vec()
            })
            .collect();
        assert_eq!(got[0], got[1], "{name}: the replicas hold the same weights");
        for (a, b) in got[0].iter().zip(want.to_f64_vec()) {
            worst = worst.max((a - b).abs() / b.abs().max(1e-1));
        }
    }
    println!("bf16: two replicas against one, max rel err {worst:.2e}");
    assert!(worst < 2e-2, "{worst}");
}

#[test]
fn buckets_follow_the_backward_pass_and_run_as_soon_as_their_gradients_exist() {
    // Small buckets: the last layer's gradients (produced first) fill the first.
    let (mut g, _) = model(8, false);
    let pass = DataParallel {
        bucket_bytes: 600,
        first_bucket_bytes: 100,
        ..DataParallel::new(1)
    };
    pass.run(&mut g).unwrap();
    let buckets: Vec<Vec<String>> = g
        .topo_order()
        .unwrap()
        .into_iter()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .map(|id| {
            g.inputs(id)
                .iter()
                .map(|&p| g.node(p.node).name.clone())
                .collect()
        })
        .collect();
    let sizes: Vec<Vec<usize>> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .map(|id| g.inputs(id).iter().map(|&p| g.ty(p).size_bytes()).collect())
        .collect();
    // Gradients in backward order: dense_2's bias (16 B) and kernel (256 B), dense_1's
    // (64, 2048), dense's (128, 768). First bucket <= 100 B, then <= 600 B, a larger
    // tensor alone.
    let flat: Vec<usize> = sizes.iter().flatten().copied().collect();
    assert_eq!(
        flat.iter().sum::<usize>(),
        4 * (32 * 6 + 32 + 16 * 32 + 16 + 4 * 16 + 4)
    );
    assert!(sizes[0].iter().sum::<usize>() <= 100, "{sizes:?}");
    for b in &sizes[1..] {
        assert!(b.len() == 1 || b.iter().sum::<usize>() <= 600, "{sizes:?}");
    }
    assert!(buckets.len() >= 4, "{buckets:?}");
    // Execution order: every AllReduce right after its last input's producer, with
    // backward work still after the first one.
    let feeds = batch(0, 0, 8);
    let mut order = Vec::new();
    let outputs = g.outputs().to_vec();
    CpuExecutor::new()
        .run_observed(&g, &feeds_with_variables(&g, feeds), &outputs, &mut |e| {
            order.push(e.id);
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    let position = |id| order.iter().position(|&o| o == id).unwrap();
    let reduces: Vec<_> = order
        .iter()
        .copied()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .collect();
    for &r in &reduces {
        let last_input = g.inputs(r).iter().map(|p| position(p.node)).max().unwrap();
        assert_eq!(
            position(r),
            last_input + 1,
            "{} runs right after its inputs",
            g.node(r).name
        );
    }
    let first = position(reduces[0]);
    let backward_after = order[first..]
        .iter()
        .any(|&id| g.node(id).op.name().contains("Grad") || g.node(id).op.name() == "MatMul");
    assert!(
        backward_after,
        "the first bucket is averaged while the backward pass goes on"
    );
}

/// `feeds` plus every Variable's initial value (a bare executor has none).
fn feeds_with_variables(g: &Graph, mut feeds: Feeds) -> Feeds {
    let session = Session::new(g.clone(), Device::Cpu).unwrap();
    for (name, value) in variables(&session) {
        feeds.insert(name, value);
    }
    feeds
}

#[test]
fn one_replicas_overflow_skips_the_step_on_every_replica() {
    let world = 2;
    let (g, step) = model(4, true);
    let mut replicas = cpu_replicas(world, g);
    let before: Vec<_> = (0..world)
        .map(|r| variables(replicas.session(r).unwrap()))
        .collect();
    let mut feeds: Vec<Feeds> = (0..world).map(|r| batch(0, r * 4, 4)).collect();
    // Replica 1's input overflows f16 in the forward pass: its gradients are not finite.
    let x = feeds[1]["x"]
        .to_f64_vec()
        .iter()
        .map(|v| v * 1e30)
        .collect::<Vec<_>>();
    feeds[1].insert(
        "x".into(),
        Tensor::from_f64(DType::F32, [4, FEATURES], &x).unwrap(),
    );
    replicas.run(&[step.step], &feeds).unwrap();
    for (rank, before) in before.iter().enumerate() {
        let s = replicas.session(rank).unwrap();
        let scale = s.variable(LOSS_SCALE_VARIABLE).unwrap().to_f64_vec()[0];
        assert_eq!(scale, 16384.0, "replica {rank} halves its scale");
        for (name, value) in before {
            if name.starts_with("loss_scale") {
                continue;
            }
            assert_eq!(
                s.variable(name).unwrap().to_f64_vec(),
                value.to_f64_vec(),
                "replica {rank} skipped {name}"
            );
        }
    }
    // A finite step then updates every replica alike.
    let feeds: Vec<Feeds> = (0..world).map(|r| batch(1, r * 4, 4)).collect();
    replicas.run(&[step.step], &feeds).unwrap();
    let (a, b) = (
        variables(replicas.session(0).unwrap()),
        variables(replicas.session(1).unwrap()),
    );
    assert_eq!(
        a.iter().map(|(_, t)| t.to_f64_vec()).collect::<Vec<_>>(),
        b.iter().map(|(_, t)| t.to_f64_vec()).collect::<Vec<_>>()
    );
    assert_ne!(a, before[0].clone(), "the finite step updates the weights");
}

#[test]
fn a_failing_replica_stops_every_replica_with_an_error_naming_it() {
    let world = 3;
    let (g, step) = model(4, false);
    let mut replicas = cpu_replicas(world, g);
    let mut feeds: Vec<Feeds> = (0..world).map(|r| batch(0, r * 4, 4)).collect();
    feeds[2] = batch(0, 0, 5); // the wrong batch size
    let start = Instant::now();
    let e = replicas.run(&[step.loss, step.step], &feeds).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "no replica hangs"
    );
    let msg = e.to_string();
    assert!(matches!(e, ParallelError::Replica { rank: 2, .. }), "{msg}");
    assert!(msg.starts_with("replica 2 failed: feed 'x'"), "{msg}");
    // The group is spent: a next step says so rather than hanging.
    let e = replicas.run(
        &[step.loss],
        &(0..world).map(|r| batch(0, r * 4, 4)).collect::<Vec<_>>(),
    );
    assert!(e.unwrap_err().to_string().contains("replica 2 failed"));
}

#[test]
fn replicas_whose_graphs_disagree_are_refused_before_the_first_step() {
    let (a, _) = model(4, false);
    let mut b = Graph::new();
    let x = b.placeholder("x", DType::F32, [4, FEATURES]).unwrap();
    let labels = b.placeholder("labels", DType::I64, [4]).unwrap();
    let logits = nn::dense(&mut b, x, CLASSES, None).unwrap();
    let loss = b.softmax_cross_entropy(logits, labels).unwrap();
    Sgd::new(0.1).minimize(&mut b, loss).unwrap();
    let e = Replicas::with_graphs(
        vec![a, b],
        &[Device::Cpu, Device::Cpu],
        ReplicaOptions::default(),
    )
    .err()
    .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("replica 1's graph averages") && msg.contains("replica 0's averages"),
        "{msg}"
    );
}

#[test]
fn a_checkpoint_written_once_restores_into_every_replica() {
    let dir = std::env::temp_dir().join(format!("ampgraph-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dp.ckpt");
    let (g, step) = model(4, true);
    let mut trained = cpu_replicas(2, g.clone());
    for s in 0..3 {
        let feeds: Vec<Feeds> = (0..2).map(|r| batch(s, r * 4, 4)).collect();
        trained.run(&[step.step], &feeds).unwrap();
    }
    trained.save(&path).unwrap();
    let mut fresh = cpu_replicas(2, g.clone());
    fresh.restore(&path).unwrap();
    let want = variables(trained.session(0).unwrap());
    for rank in 0..2 {
        assert_eq!(
            variables(fresh.session(rank).unwrap()),
            want,
            "replica {rank}"
        );
    }
    // The same file restores into a plain (one-device) session too.
    let mut plain = Session::new(g, Device::Cpu).unwrap();
    plain.restore(&path).unwrap();
    assert_eq!(variables(&plain), want);
    std::fs::remove_dir_all(&dir).ok();
}

/// images[batch, 1, 28, 28] -> dense 16 relu -> dense 10 -> cross-entropy, momentum SGD.
fn mnist_mlp(batch: usize) -> (Graph, TrainStep, Port, Port) {
    let mut g = Graph::new();
    let x = g
        .placeholder("images", DType::F32, [batch, 1, 28, 28])
        .unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch]).unwrap();
    let flat = g.reshape(x, [batch as i64, 784]).unwrap();
    let h = nn::dense(&mut g, flat, 16, Some(Activation::Relu)).unwrap();
    let logits = nn::dense(&mut g, h, 10, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = Sgd::momentum(0.05, 0.9).minimize(&mut g, loss).unwrap();
    (g, step, x, labels)
}

fn loader_options(batch_size: usize) -> LoaderOptions {
    LoaderOptions {
        batch_size,
        drop_last: true,
        seed: 3,
        ..Default::default()
    }
}

#[test]
fn a_resumed_data_parallel_run_ends_with_the_uninterrupted_runs_bits() {
    let loader = Loader::new(Arc::new(Mnist::synthetic(64, 5)), loader_options(8)).unwrap();
    let (g, step, images, labels) = mnist_mlp(8);
    let mut straight = cpu_replicas(2, g.clone());
    let mut at = Position::START;
    for _ in 0..2 {
        at = straight
            .epoch(&loader, &step, images, labels, at)
            .unwrap()
            .next;
    }
    let dir = std::env::temp_dir().join(format!("ampgraph-dp-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("epoch1.ckpt");
    let mut first = cpu_replicas(2, g.clone());
    first
        .epoch(&loader, &step, images, labels, Position::START)
        .unwrap();
    first.save(&path).unwrap();
    drop(first);
    let mut resumed = cpu_replicas(2, g);
    let at = resumed.resume(&path).unwrap();
    assert_eq!(at, Position { epoch: 2, batch: 0 });
    resumed.epoch(&loader, &step, images, labels, at).unwrap();
    let want = variables(straight.session(0).unwrap());
    for rank in 0..2 {
        assert_eq!(
            variables(resumed.session(rank).unwrap()),
            want,
            "replica {rank}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_epoch_of_shards_trains_as_one_replica_on_the_global_batches() {
    let data = Arc::new(Mnist::synthetic(96, 7));
    let (per, world) = (8, 2);
    let (g, step, images, labels) = mnist_mlp(per);
    let mut replicas = cpu_replicas(world, g);
    let report = replicas
        .epoch(
            &Loader::new(data.clone(), loader_options(per)).unwrap(),
            &step,
            images,
            labels,
            Position::START,
        )
        .unwrap();
    assert_eq!(report.steps, 96 / (per * world));
    assert_eq!(report.next, Position { epoch: 2, batch: 0 });
    assert_eq!(report.examples, 96);
    let (g1, step1, images1, labels1) = mnist_mlp(per * world);
    let mut one = Session::new(g1, Device::Cpu).unwrap();
    let loader = Loader::new(data, loader_options(per * world)).unwrap();
    for b in loader.epoch_from(Position::START.epoch as u64, 0) {
        let b = b.unwrap();
        let feeds = Feeds::from([
            (one.graph().node(images1.node).name.clone(), b.images),
            (one.graph().node(labels1.node).name.clone(), b.labels),
        ]);
        one.run(&[step1.loss, step1.step], &feeds).unwrap();
    }
    for (name, want) in variables(&one) {
        let got = replicas.variable(&name).unwrap().to_f64_vec();
        for (a, b) in got.iter().zip(want.to_f64_vec()) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1e-2),
                "{name}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn synchronized_batch_norm_replicas_train_as_one_at_the_global_batch() {
    let (world, per) = (2, 4);
    let (g1, step1) = convnet(per * world, None);
    let mut one = Session::new(g1, Device::Cpu).unwrap();
    let mut max_error = |sync: Option<usize>| {
        let (g, step) = convnet(per, sync);
        let mut replicas = cpu_replicas(world, g);
        let mut fresh = Session::new(convnet(per * world, None).0, Device::Cpu).unwrap();
        std::mem::swap(&mut one, &mut fresh);
        for s in 0..3 {
            let feeds: Vec<Feeds> = (0..world).map(|r| images(s, r * per, per)).collect();
            replicas.run(&[step.step], &feeds).unwrap();
            one.run(&[step1.step], &images(s, 0, per * world)).unwrap();
        }
        let mut worst: f64 = 0.0;
        let mut compared = 0;
        for (name, want) in variables(&one) {
            // The moving statistics are not updated by this step (no one fetches them).
            let Some(got) = replicas.variable(&name) else {
                continue;
            };
            compared += 1;
            for (a, b) in got.to_f64_vec().iter().zip(want.to_f64_vec()) {
                worst = worst.max((a - b).abs() / b.abs().max(1e-2));
            }
        }
        assert!(compared >= 6, "{compared} variables compared");
        worst
    };
    let synced = max_error(Some(world));
    assert!(synced < 1e-4, "synchronized: {synced}");
    // Each replica's own statistics train another model: the comparison can tell.
    let local = max_error(None);
    assert!(local > 1e-3, "local statistics: {local}");
}

#[test]
fn a_replica_that_never_comes_times_the_others_out() {
    let (g, step) = model(4, false);
    let options = ReplicaOptions {
        timeout: Duration::from_millis(500),
        ..ReplicaOptions::default()
    };
    let mut replicas = Replicas::new(g, &[Device::Cpu, Device::Cpu], options).unwrap();
    let feeds: Vec<Feeds> = (0..2).map(|r| batch(0, r * 4, 4)).collect();
    let start = Instant::now();
    let e = replicas
        .on_each(|rank, session| {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(2));
            }
            session.run(&[step.step], &feeds[rank])
        })
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    let msg = e.to_string();
    assert!(matches!(e, ParallelError::Replica { rank: 0, .. }), "{msg}");
    assert!(
        msg.contains("replica 0 waited 0.5 s at an all-reduce for the other replicas (timeout)"),
        "{msg}"
    );
}

/// The CUDA pipeline on `model(8, loss_scaled)` under `amp`, with and without the means
/// over two replicas: each graph and the summary of `summarised` (a pass's name).
fn cuda_rewritten(
    loss_scaled: bool,
    amp: Option<ampgraph::passes::amp::AmpConfig>,
    summarised: &str,
) -> [(Graph, String); 2] {
    use ampgraph::session::Pipeline;
    use ampgraph::SessionOptions;
    [None, Some(DataParallel::new(2))].map(|data_parallel| {
        let (mut g, step) = model(8, loss_scaled);
        if let Some(config) = &amp {
            g.mixed_precision = Some(config.target);
        }
        let options = SessionOptions {
            data_parallel,
            amp: amp.clone(),
            ..SessionOptions::default()
        };
        let recipe = ampgraph::exec::cuda::pipeline(&Default::default());
        let (records, _) = Pipeline::new(&g, &options, recipe)
            .unwrap()
            .run_for(&mut g, &[step.step])
            .unwrap();
        let summary = records
            .iter()
            .find(|r| r.pass == summarised)
            .unwrap()
            .summary
            .to_string();
        (g, summary)
    })
}

/// The dtypes of the tensors the AllReduce nodes average.
fn reduced_dtypes(g: &Graph) -> Vec<DType> {
    g.node_ids()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .flat_map(|id| g.inputs(id))
        .map(|p| g.ty(p).dtype)
        .collect()
}

#[test]
fn under_amp_the_means_are_of_the_16_bit_gradients_and_the_unscaling_still_folds() {
    let [(plain, plain_unscale), (g, unscale)] = cuda_rewritten(true, None, "unscale-into-update");
    let reduced = reduced_dtypes(&g);
    assert_eq!(
        reduced.len(),
        6,
        "every variable's gradient is averaged once"
    );
    // The kernels' gradients in f16; the biases' column sums are f32 (Sum is denied).
    assert_eq!(
        reduced.iter().filter(|&&d| d == DType::F16).count(),
        3,
        "{reduced:?}"
    );
    assert_eq!(
        unscale, plain_unscale,
        "the unscaling and its casts fold as without replicas"
    );
    assert_eq!(
        common::count(&g, "Cast"),
        common::count(&plain, "Cast"),
        "no cast added"
    );
}

#[test]
fn under_bf16_amp_the_means_are_of_the_bf16_gradients_and_their_casts_still_fold() {
    // BF16 AMP has no loss scale: each kernel's update reads Cast<f32> of its bf16
    // gradient, and the mean is of the bf16 tensor (half the bytes), as without
    // replicas the cast folds into the update.
    let amp = ampgraph::passes::amp::AmpConfig::new(DType::BF16).unwrap();
    let [(plain, plain_folded), (g, folded)] =
        cuda_rewritten(false, Some(amp), "grad-cast-into-update");
    let reduced = reduced_dtypes(&g);
    // All but the last bias's (the column sum of the f32 cross-entropy gradient).
    assert_eq!(
        reduced,
        [
            DType::F32,
            DType::BF16,
            DType::BF16,
            DType::BF16,
            DType::BF16,
            DType::BF16
        ]
    );
    assert!(folded.contains("5 optimizer updates"), "{folded}");
    assert_eq!(folded, plain_folded, "the casts fold as without replicas");
    // One GPU's updates round the f32 bias sums the fusions leave as they read them
    // (`grad-round-into-update`); the replicas average the rounded bf16 sums, so those
    // casts stay. No other cast is added.
    let rounded = rounding_updates(&plain);
    assert_eq!(rounded, 2, "the hidden layers' biases");
    assert_eq!(rounding_updates(&g), 0);
    assert_eq!(
        common::count(&g, "Cast"),
        common::count(&plain, "Cast") + rounded,
        "no cast added"
    );
}

/// The updates (grouped ones' members) that read their gradient rounded.
fn rounding_updates(g: &Graph) -> usize {
    use ampgraph::graph::ops::update_members;
    (g.node_ids())
        .filter_map(|id| update_members(g.node(id).op.as_ref()))
        .filter(|(update, _)| update.grad_rounded_to.is_some())
        .map(|(_, members)| members)
        .sum()
}
