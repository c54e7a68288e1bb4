//! Data-parallel training on GPUs through NCCL: one GPU replica is the plain session
//! bit for bit; two GPUs match the CPU simulation of two replicas and hold the same
//! weights; a synchronized batch norm matches the CPU's; FP8's delayed scaling state
//! stays the same on both; a failing replica stops the other with an error naming it,
//! never a hang. Each test prints "skipping: <reason>"
//! and passes without the GPUs or NCCL it needs.

use std::time::{Duration, Instant};

use ampgraph::exec::cuda::{self, nccl};
use ampgraph::exec::Feeds;
use ampgraph::graph::{Graph, Tensor};
use ampgraph::parallel::{ParallelError, ReplicaOptions, Replicas};
use ampgraph::{Device, Session};

#[path = "common/replicated.rs"]
mod replicated;

use replicated::{batch, convnet, images, model, variables};

/// Whether `n` GPUs and NCCL are here (prints why not).
fn gpus_or_skip(n: usize) -> bool {
    let why = match (cuda::available(), nccl::available()) {
        (Ok(count), Ok(())) if count >= n => return true,
        (Ok(count), Ok(())) => format!("{n} GPUs needed, {count} here"),
        (Err(why), _) | (_, Err(why)) => why,
    };
    println!("skipping: {why}");
    false
}

fn replicas(devices: &[Device], graph: Graph) -> Replicas {
    Replicas::new(graph, devices, ReplicaOptions::default()).unwrap()
}

fn gpus(n: usize) -> Vec<Device> {
    (0..n).map(Device::Cuda).collect()
}

/// max |a - b| / max(|b|, 1e-2) over every variable of two sessions.
fn max_rel_err(a: &Session, b: &Session) -> f64 {
    let (a, b) = (variables(a), variables(b));
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in ta.to_f64_vec().iter().zip(tb.to_f64_vec()) {
            worst = worst.max((x - y).abs() / y.abs().max(1e-2));
        }
    }
    worst
}

fn values(s: &Session) -> Vec<Vec<f64>> {
    variables(s).iter().map(|(_, t)| t.to_f64_vec()).collect()
}

#[test]
fn one_gpu_replica_is_the_plain_session_bit_for_bit_and_replays_with_its_all_reduces() {
    if !gpus_or_skip(1) {
        return;
    }
    let (g, step) = model(64, true);
    let mut plain = Session::new(g.clone(), Device::Cuda(0)).unwrap();
    let mut one = replicas(&gpus(1), g);
    for s in 0..5 {
        let feeds = batch(s, 0, 64);
        let a = plain.run(&[step.loss, step.step], &feeds).unwrap();
        let b = one.run(&[step.loss, step.step], &[feeds]).unwrap();
        assert_eq!(a[0].to_f64_vec(), b[0][0].to_f64_vec(), "step {s}");
    }
    let replica = one.session(0).unwrap();
    assert_eq!(values(&plain), values(replica));
    // From the third step the replica's step (its NCCL all-reduces included) is one
    // CUDA graph, as the plain session's.
    let launch = replica.executor().stats().unwrap().last_step().launch;
    assert!(launch.starts_with("replayed"), "{launch}");
}

#[test]
fn two_gpus_match_the_cpu_simulation_and_hold_the_same_weights() {
    if !gpus_or_skip(2) {
        return;
    }
    for amp in [false, true] {
        let (g, step) = model(32, amp);
        let mut on_gpus = replicas(&gpus(2), g.clone());
        let mut on_cpus = replicas(&[Device::Cpu, Device::Cpu], g);
        for s in 0..4 {
            let feeds: Vec<Feeds> = (0..2).map(|r| batch(s, r * 32, 32)).collect();
            on_gpus.run(&[step.step], &feeds).unwrap();
            on_cpus.run(&[step.step], &feeds).unwrap();
        }
        let (r0, r1) = (on_gpus.session(0).unwrap(), on_gpus.session(1).unwrap());
        assert_eq!(
            values(r0),
            values(r1),
            "amp {amp}: the replicas hold the same weights"
        );
        let err = max_rel_err(r0, on_cpus.session(0).unwrap());
        let bound = if amp { 2e-2 } else { 1e-4 };
        println!("amp {amp}: GPU replicas against the CPU's, max rel err {err:.2e}");
        assert!(err < bound, "amp {amp}: {err}");
    }
}

#[test]
fn a_synchronized_batch_norm_on_two_gpus_matches_the_cpu() {
    if !gpus_or_skip(2) {
        return;
    }
    let (g, step) = convnet(4, Some(2));
    let mut on_gpus = replicas(&gpus(2), g.clone());
    let mut on_cpus = replicas(&[Device::Cpu, Device::Cpu], g);
    for s in 0..3 {
        let feeds: Vec<Feeds> = (0..2).map(|r| images(s, r * 4, 4)).collect();
        on_gpus.run(&[step.step], &feeds).unwrap();
        on_cpus.run(&[step.step], &feeds).unwrap();
    }
    let err = max_rel_err(on_gpus.session(1).unwrap(), on_cpus.session(1).unwrap());
    println!("synchronized batch norm: GPU replicas against the CPU's, max rel err {err:.2e}");
    assert!(err < 1e-3, "{err}");
}

#[test]
fn a_failing_gpu_replica_stops_the_other_naming_it() {
    if !gpus_or_skip(2) {
        return;
    }
    let (g, step) = model(32, true);
    let mut two = replicas(&gpus(2), g);
    // One good step first: the communicators are connected.
    let feeds: Vec<Feeds> = (0..2).map(|r| batch(0, r * 32, 32)).collect();
    two.run(&[step.step], &feeds).unwrap();
    let mut bad = feeds.clone();
    bad[1].insert(
        "x".into(),
        Tensor::zeros(&ampgraph::graph::TensorType::new(
            ampgraph::DType::F32,
            [31, 6],
        )),
    );
    let start = Instant::now();
    let e = two.run(&[step.loss, step.step], &bad).unwrap_err();
    let took = start.elapsed();
    println!("failed in {took:?}: {e}");
    assert!(took < Duration::from_secs(60), "no hang: {took:?}");
    assert!(matches!(e, ParallelError::Replica { rank: 1, .. }), "{e}");
    assert!(
        e.to_string().starts_with("replica 1 failed: feed 'x'"),
        "{e}"
    );
}

#[test]
fn a_gpu_replica_that_never_comes_times_the_other_out() {
    if !gpus_or_skip(2) {
        return;
    }
    let (g, step) = model(32, true);
    let options = ReplicaOptions {
        timeout: Duration::from_secs(3),
        ..ReplicaOptions::default()
    };
    let mut two = Replicas::new(g, &gpus(2), options).unwrap();
    let feeds: Vec<Feeds> = (0..2).map(|r| batch(0, r * 32, 32)).collect();
    // The same fetches as below, until the step replays the CUDA graph that captured
    // its all-reduces (NCCL's abort then waits for that graph to be destroyed). The
    // first steps choose algorithms and may plan again where scratch grew; they wait
    // at each collective, a replayed step only at its end.
    let launch = |two: &Replicas| {
        (two.session(0).unwrap().executor().stats().unwrap())
            .last_step()
            .launch
    };
    for _ in 0..8 {
        two.run(&[step.loss, step.step], &feeds).unwrap();
        if launch(&two).starts_with("replayed") {
            break;
        }
    }
    assert!(launch(&two).starts_with("replayed"), "{}", launch(&two));
    let start = Instant::now();
    let e = two
        .on_each(|rank, session| {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(8));
            }
            session.run(&[step.loss, step.step], &feeds[rank])
        })
        .unwrap_err();
    let took = start.elapsed();
    println!("timed out in {took:?}: {e}");
    assert!(took < Duration::from_secs(60), "no hang: {took:?}");
    assert!(matches!(e, ParallelError::Replica { rank: 0, .. }), "{e}");
    assert!(
        e.to_string().contains(
            "replica 0 waited 3.0 s at the end of its step for the other replicas (timeout)"
        ),
        "{e}"
    );
}

/// FP8 with delayed scaling on two GPUs (issue 44): the amaxes' max through NCCL keeps
/// both replicas' scaling state, as their weights, the same bits (each replica's
/// batch differs, so its own amaxes differ); the middle layer's three products run in
/// FP8 (the first and last layers' shapes are not cuBLASLt's FP8 shapes).
#[test]
fn fp8_delayed_scaling_state_is_the_same_on_two_gpus() {
    use ampgraph::passes::amp::{AmpConfig, Fp8Config, Fp8Recipe};
    use ampgraph::DType;
    if !gpus_or_skip(2) {
        return;
    }
    let (g, step) = model(32, true);
    let mut fp8 = Fp8Config::everywhere(Fp8Recipe::delayed());
    fp8.keep
        .extend(["dense/matmul".to_string(), "dense_2/matmul".to_string()]);
    let options = ReplicaOptions {
        session: ampgraph::SessionOptions {
            amp: Some(AmpConfig::new(DType::F16).unwrap().with_fp8(fp8)),
            ..Default::default()
        },
        ..ReplicaOptions::default()
    };
    let mut on_gpus = Replicas::new(g, &gpus(2), options).unwrap();
    let graph = on_gpus.session(0).unwrap().graph().clone();
    let products = graph
        .node_ids()
        .filter(|&id| graph.node(id).op_name() == "Fp8MatMul")
        .count();
    assert_eq!(products, 3);
    for s in 0..3 {
        let feeds: Vec<Feeds> = (0..2).map(|r| batch(s, r * 32, 32)).collect();
        on_gpus.run(&[step.step], &feeds).unwrap();
    }
    let (r0, r1) = (on_gpus.session(0).unwrap(), on_gpus.session(1).unwrap());
    let names: Vec<String> = variables(r0).into_iter().map(|(n, _)| n).collect();
    assert!(
        names.iter().any(|n| n.starts_with("ampgraph/fp8/")),
        "{names:?}"
    );
    assert_eq!(
        values(r0),
        values(r1),
        "the replicas hold the same weights and FP8 state"
    );
}
