//! `--replicas N`: the workload's training step data-parallel over GPUs 0..N (one
//! thread per GPU, gradients averaged through NCCL), each GPU on its own batch of the
//! workload's size, as `scripts/torch_ddp.py` runs PyTorch's DDP under torchrun.
//! Started by a launcher (`torchrun --no-python --nproc-per-node N target/release/
//! examples/bench --replicas N ...`), each process times its own GPU's replica and
//! rank 0 prints the line.

use std::time::Duration;

use ampgraph::exec::collective::Collective;
use ampgraph::exec::memory_plan::mib;
use ampgraph::graph::ops::Reduction;
use ampgraph::parallel::{on_each_replica, ProcessGroup};
use ampgraph::passes::data_parallel::DataParallel;
use ampgraph::{DType, Tensor};
use ampgraph::{Device, SessionOptions};

use super::{
    initial_values, prepare_with, print_profile, py, step_feeds, timed_steps, Args, Config, Mode,
    Res,
};

/// One replica's timed steps: the median step (ms, CUDA events) and peak MiB.
struct ReplicaTimes {
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    peak_mib: Option<f64>,
}

/// Times `mode`'s training step over `world` GPUs and prints one JSON line (the
/// slowest replica's median step; examples per second over all GPUs).
pub(super) fn run(args: &Args, cfg: &Config, mode: Mode, world: usize) -> Res<()> {
    let options = SessionOptions {
        data_parallel: Some(DataParallel {
            bucket_bytes: (args.bucket_mib * (1 << 20) as f64) as usize,
            ..DataParallel::new(world)
        }),
        ..args.session_options(mode)?
    };
    let step = prepare_with(args, cfg, mode, false, &options)?;
    super::dump(args, &step.graph, "train", mode)?;
    if args.passes_only {
        for r in &step.records {
            println!("## {}\n{}", r.pass, r.summary);
        }
        return Ok(());
    }
    let timeout = Duration::from_secs(120);
    let times = match ProcessGroup::launched()? {
        Some(group) => {
            if group.world != world {
                return Err(format!(
                    "--replicas {world} under a launcher of {} processes",
                    group.world
                )
                .into());
            }
            let met = group.join(&step.graph, true, timeout)?;
            let mine = time_replica(
                args,
                cfg,
                mode,
                &step,
                &options,
                (group.rank, group.local_rank),
                &met.collective,
            )?;
            let times = gathered(&met.host, group.rank, world, &mine)?;
            if group.rank != 0 {
                return Ok(());
            }
            times
        }
        None => {
            let devices: Vec<Device> = (0..world).map(Device::Cuda).collect();
            let mut collectives = ampgraph::parallel::collectives(&devices, timeout)?;
            let abort = collectives[0].abort.clone();
            on_each_replica(&mut collectives, &abort, |rank, c| {
                time_replica(args, cfg, mode, &step, &options, (rank, rank), c)
                    .map_err(|e| e.to_string())
            })
            .map_err(|(rank, e)| match e {
                Some(e) => format!("replica {rank} failed: {e}"),
                None => format!("replica {rank} panicked"),
            })?
        }
    };
    let slowest = times.iter().map(|t| t.median_ms).fold(0.0, f64::max);
    let batch = cfg.batch();
    let per_rank: Vec<String> = times.iter().map(|t| py(t.median_ms, 3)).collect();
    let peak = times.iter().filter_map(|t| t.peak_mib).fold(0.0, f64::max);
    println!(
        "{{\"peer\": \"ampgraph\", \"workload\": \"{}\", \"mode\": \"{}\", \"world\": {world}, \"per_gpu_batch\": {batch}, \"median_ms\": {}, \"min_ms\": {}, \"max_ms\": {}, \"rank_median_ms\": [{}], \"examples_per_s\": {}, \"peak_mib\": {}}}",
        args.workload.name(),
        mode.name(),
        py(slowest, 3),
        py(times.iter().map(|t| t.min_ms).fold(f64::INFINITY, f64::min), 3),
        py(times.iter().map(|t| t.max_ms).fold(0.0, f64::max), 3),
        per_rank.join(", "),
        py((world * batch) as f64 / (slowest / 1e3), 1),
        py(peak, 0),
    );
    Ok(())
}

/// Replica `rank`'s timed steps on GPU `gpu`, joined to `collective` (then the profiled
/// steps of `--profile`, rank 0 printing their table).
fn time_replica(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    step: &super::Step,
    options: &SessionOptions,
    (rank, gpu): (usize, usize),
    collective: &Collective,
) -> Res<ReplicaTimes> {
    // Each GPU its own batch, as each DDP rank draws its own.
    let data = cfg.data(args.seed + rank as u64)?;
    let feeds = step_feeds(args, &step.graph, &data);
    let mut exec = Device::Cuda(gpu).executor(options.executor, &options.kernel_cache)?;
    exec.check_supported(&step.graph)?;
    for (name, value) in initial_values(args, &step.graph, &data)? {
        exec.set_variable(&name, value)?;
    }
    exec.join_collective(collective.clone())?;
    for _ in 0..args.warmup {
        exec.run(&step.graph, &feeds, &[step.fetch])?;
    }
    if let Some(stats) = exec.stats() {
        stats.reset_peak_bytes();
    }
    let mut times = timed_steps(args, exec.as_mut(), &step.graph, &feeds, step.fetch)?;
    times.sort_by(f64::total_cmp);
    let peak_mib = exec.stats().map(|s| mib(s.peak_bytes()));
    // Every replica runs the profiled steps (their all-reduces need each other).
    let shown = (rank == 0).then_some(("train", mode));
    print_profile(args, exec.as_mut(), &step.graph, &feeds, step.fetch, shown)?;
    Ok(ReplicaTimes {
        median_ms: times[times.len() / 2],
        min_ms: times[0],
        max_ms: times[times.len() - 1],
        peak_mib,
    })
}

/// Every process's times, in rank order: each puts its own in its row of a
/// `[world, 4]` tensor of zeros, and the mean over the processes times `world` is
/// every row.
fn gathered(
    host: &Collective,
    rank: usize,
    world: usize,
    mine: &ReplicaTimes,
) -> Res<Vec<ReplicaTimes>> {
    let mut rows = vec![0.0; world * 4];
    let peak = mine.peak_mib.unwrap_or(f64::NAN);
    rows[rank * 4..][..4].copy_from_slice(&[mine.median_ms, mine.min_ms, mine.max_ms, peak]);
    let mine = Tensor::from_f64(DType::F64, [world, 4], &rows)?;
    let all = host.host_all_reduce(&[&mine], Reduction::Mean)?[0].to_f64_vec();
    Ok(all
        .chunks(4)
        .map(|r| {
            let v = |k: usize| r[k] * world as f64;
            ReplicaTimes {
                median_ms: v(0),
                min_ms: v(1),
                max_ms: v(2),
                peak_mib: Some(v(3)).filter(|p| p.is_finite()),
            }
        })
        .collect())
}
