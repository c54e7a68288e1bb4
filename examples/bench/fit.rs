//! `--max-batch-under-mib N`: for each mode and phase, the largest batch whose planned
//! step fits N MiB, fp32 against AMP. A step's plan is made on the host: the graph of
//! that batch goes through the passes of a timed run (`prepare`) and
//! [`step_footprint`] plans it as the CUDA executor would. With `--device cpu` that is
//! all (no device needed), and the plan leaves out what only a device shows: the
//! scratch of the nodes (cuDNN's workspaces, by the algorithms autotuning picks) and
//! the GEMM library's workspace. On the GPU each candidate batch also runs: a fresh
//! executor takes two steps (the first picks the algorithms and their workspaces, the
//! second runs with them planned in the arena), and the step is planned again with that
//! scratch and what the executor held before it; its device pool's high-water mark
//! over the second step confirms the plan (the first also holds the algorithm
//! search's workspace, up to `--conv-workspace-limit-mib` (1 GiB by default), and
//! is reported beside it). The host's answer bounds the device's from above (scratch
//! only adds), so the device search starts there.

use std::collections::hash_map::{Entry, HashMap};

use ampgraph::exec::memory_plan::{mib, step_footprint, StepFootprint};
use ampgraph::exec::ExecError;

use super::{
    error_line, initial_values, json_opt, phase_name, prepare, py, py_opt, step_feeds, Args,
    Config, DeviceArg, Mode, Res,
};

/// The search stops doubling here: a budget that holds this batch is an error.
const MAX_BATCH: usize = 1 << 24;

/// A probe's steps on the device: the first takes the workspaces, the second runs
/// with them planned.
const PROBE_STEPS: usize = 2;

/// A batch's step planned: on the host, or with what a device showed.
pub struct Planned {
    /// The plan, with the nodes' scratch as the device's step took it (none on the host).
    pub footprint: StepFootprint,
    /// What the executor held before the step (the GEMM library's workspace); 0 on
    /// the host.
    pub held_bytes: usize,
    /// The device pool's high-water mark over a step after the first, where the
    /// executor runs it as planned (as `torch.cuda.max_memory_allocated` after a
    /// warm-up).
    pub measured_bytes: Option<usize>,
    /// The high-water mark from the executor's start through its first step, which
    /// also holds the algorithm search's workspace (up to its limit) and the shared
    /// workspace the step's convolutions take before they are planned.
    pub first_step_bytes: Option<usize>,
}

impl Planned {
    /// The step's planned peak with what the executor held beside it.
    pub fn peak_bytes(&self) -> usize {
        self.footprint.peak_bytes() + self.held_bytes
    }

    pub fn scratch_bytes(&self) -> usize {
        let plan = &self.footprint.plan;
        (plan.buffers.iter().filter(|b| b.scratch))
            .map(|b| b.bytes)
            .sum()
    }
}

/// The planned device memory of one step of `cfg` at `batch` in `mode` (the forward
/// pass when `infer`), after the passes a timed run runs, made on the host.
pub fn planned_step(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    batch: usize,
) -> Res<Planned> {
    let step = prepare(args, &cfg.with_batch(batch), mode, infer)?;
    Ok(Planned {
        footprint: step_footprint(&step.graph, &[step.fetch], &HashMap::new())?,
        held_bytes: 0,
        measured_bytes: None,
        first_step_bytes: None,
    })
}

/// [`planned_step`] run on a fresh executor of `args`' device and planned again with
/// the scratch its step took; `None` where the device ran out of memory.
pub fn probed_step(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    batch: usize,
) -> Res<Option<Planned>> {
    let cfg = cfg.with_batch(batch);
    let step = prepare(args, &cfg, mode, infer)?;
    let data = cfg.data(args.seed)?;
    let options = args.session_options(mode)?;
    let mut exec =
        (args.device.device(args.ordinal)).executor(options.executor, &options.kernel_cache)?;
    let held_bytes = exec.stats().map_or(0, |s| s.live_bytes());
    for (name, value) in initial_values(args, &step.graph, &data)? {
        exec.set_variable(&name, value)?;
    }
    let feeds = step_feeds(args, &step.graph, &data);
    let mut peaks = Vec::new();
    for _ in 0..PROBE_STEPS {
        match exec.run(&step.graph, &feeds, &[step.fetch]) {
            Ok(_) => {}
            Err(ExecError::Memory(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let stats = exec.stats();
        peaks.push(stats.map(|s| s.peak_bytes()));
        if let Some(s) = stats {
            s.reset_peak_bytes();
        }
    }
    let scratch = exec
        .stats()
        .map(|s| s.planned_scratch())
        .unwrap_or_default();
    Ok(Some(Planned {
        footprint: step_footprint(&step.graph, &[step.fetch], &scratch)?,
        held_bytes,
        measured_bytes: peaks[PROBE_STEPS - 1],
        first_step_bytes: peaks[0],
    }))
}

/// The largest batch for which `fits` holds, searched from `start`: doubling while it
/// fits, else stepping down 1, 2, 4, ... below `start` until one does (the device's
/// answer lies a few batches below the host's: each probe there runs steps), then
/// bisecting between the last batch that fit and the first that did not. `fits` must
/// hold up to some batch and not beyond (a planned peak grows with the batch). None
/// where batch 1 does not fit.
pub fn largest_batch(start: usize, mut fits: impl FnMut(usize) -> Res<bool>) -> Res<Option<usize>> {
    let (mut lo, mut hi);
    if fits(start.max(1))? {
        (lo, hi) = (start.max(1), 2 * start.max(1));
        while fits(hi)? {
            if hi >= MAX_BATCH {
                return Err(format!("batch {hi} still fits; the search stops there").into());
            }
            (lo, hi) = (hi, hi * 2);
        }
    } else {
        let mut step = 1;
        hi = start.max(1);
        loop {
            lo = start.saturating_sub(step).max(1);
            if lo < hi && fits(lo)? {
                break;
            }
            if lo == 1 {
                return Ok(None);
            }
            (hi, step) = (lo, step * 2);
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// The largest batch that fits, its plan and the next batch's planned peak (`None`:
/// the device ran out of memory).
pub struct Fit {
    pub batch: usize,
    pub planned: Planned,
    pub next_peak_bytes: Option<usize>,
}

/// The largest batch of `cfg` in `mode` whose planned peak is at most `budget` bytes:
/// planned on the host, then on `args`' device where it is a GPU.
pub fn max_batch(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    budget: usize,
) -> Res<Option<Fit>> {
    let host = search(1, usize::MAX, budget, |batch| {
        Ok(Some(planned_step(args, cfg, mode, infer, batch)?))
    })?;
    let (DeviceArg::Cuda, Some(host)) = (args.device, &host) else {
        return Ok(host);
    };
    // Scratch only adds to a plan: no batch beyond the host's fits.
    search(host.batch, host.batch, budget, |batch| {
        let probe = probed_step(args, cfg, mode, infer, batch)?;
        println!("{}", probe_line(mode, infer, batch, probe.as_ref()));
        Ok(probe)
    })
}

/// The largest batch, from `start` up to `most`, whose plan (by `plan`, `None`: out
/// of memory) peaks within `budget`, with the next batch's peak. Each batch is
/// planned once; the answer and the batch after it are among them.
fn search(
    start: usize,
    most: usize,
    budget: usize,
    mut plan: impl FnMut(usize) -> Res<Option<Planned>>,
) -> Res<Option<Fit>> {
    let mut plans: HashMap<usize, Option<Planned>> = HashMap::new();
    let mut peak = |batch: usize| -> Res<Option<usize>> {
        let planned = match plans.entry(batch) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => new.insert(plan(batch)?),
        };
        Ok(planned.as_ref().map(Planned::peak_bytes))
    };
    // Beyond `most` nothing is planned.
    let found = largest_batch(start, |batch| {
        Ok(batch <= most && peak(batch)?.is_some_and(|p| p <= budget))
    })?;
    let Some(batch) = found else {
        return Ok(None);
    };
    let next_peak_bytes = peak(batch + 1)?;
    let planned = (plans.remove(&batch).flatten()).ok_or("the search lost its answer's plan")?;
    Ok(Some(Fit {
        batch,
        planned,
        next_peak_bytes,
    }))
}

/// One line of the device search: the batch, its plan and measured peak.
fn probe_line(mode: Mode, infer: bool, batch: usize, probe: Option<&Planned>) -> String {
    let what = match probe {
        Some(p) => format!(
            "planned {} MiB (its nodes' scratch adds up to {} MiB), measured {} MiB ({} MiB in the first step)",
            py(mib(p.peak_bytes()), 1),
            py(mib(p.scratch_bytes()), 1),
            py_opt(p.measured_bytes.map(mib), 1),
            py_opt(p.first_step_bytes.map(mib), 1)
        ),
        None => "out of device memory".to_string(),
    };
    format!(
        "# {} {} batch {batch}: {what}",
        mode.name(),
        phase_name(infer)
    )
}

/// Prints, per phase, one line per mode: its largest batch under `budget_mib`, the
/// plan's parts there, and for AMP modes the batch against fp32's; then a table.
pub fn report(
    args: &Args,
    cfg: &Config,
    modes: &[Mode],
    phases: &[bool],
    budget_mib: f64,
) -> Res<()> {
    if !(budget_mib.is_finite() && budget_mib > 0.0) {
        return Err(format!(
            "--max-batch-under-mib must be a positive number of MiB, got {budget_mib}"
        )
        .into());
    }
    let budget = (budget_mib * (1u64 << 20) as f64) as usize;
    println!(
        "# the largest batch whose planned step fits {budget_mib} MiB: the memory plan's \
         arena, every variable (weights, optimizer slots, resident inputs), the 16-bit casts \
         kept, fed inputs and the variables' next values beside it; by doubling, then bisection"
    );
    if args.device == DeviceArg::Cuda {
        println!(
            "# on the GPU: from the host's answer down, each batch run for {PROBE_STEPS} steps \
             on a fresh executor and planned again with the scratch its step took (cuDNN's \
             workspaces) and what the executor held before it (the GEMM library's workspace); \
             measured: the device pool's high-water mark over the second step (the first \
             also holds the algorithm search's workspace, up to its limit)"
        );
    }
    let mut rows = Vec::new();
    for &infer in phases {
        let mut found = Vec::new();
        for &mode in modes {
            match max_batch(args, cfg, mode, infer, budget) {
                Ok(fit) => found.push((mode, fit)),
                Err(e) => println!("{}", error_line(args, mode, infer, e.as_ref())),
            }
        }
        let fp32_batch = found
            .iter()
            .find_map(|(mode, fit)| (*mode == Mode::Fp32).then_some(fit.as_ref()?.batch));
        for (mode, fit) in found {
            let versus = fp32_batch
                .filter(|_| mode.amp().is_some())
                .zip(fit.as_ref())
                .map(|(fp32, fit)| fit.batch as f64 / fp32 as f64);
            let mut line = format!(
                "{{\"workload\": \"{}\", \"mode\": \"{}\", \"phase\": \"{}\", \"budget_mib\": {}",
                args.workload.name(),
                mode.name(),
                phase_name(infer),
                py(budget_mib, 1)
            );
            match &fit {
                None => line += ", \"max_batch\": null",
                Some(fit) => {
                    let (p, f) = (&fit.planned, &fit.planned.footprint);
                    line += &format!(
                        ", \"max_batch\": {}, \"planned_peak_mib\": {}, \"arena_mib\": {}, \"scratch_mib\": {}, \"held_mib\": {}, \"variables_mib\": {}, \"kept_casts_mib\": {}, \"next_batch_peak_mib\": {}, \"measured_peak_mib\": {}, \"first_step_peak_mib\": {}",
                        fit.batch,
                        py(mib(p.peak_bytes()), 1),
                        py(mib(f.plan.arena_bytes), 1),
                        py(mib(p.scratch_bytes()), 1),
                        py(mib(p.held_bytes), 1),
                        py(mib(f.variable_bytes), 1),
                        py(mib(f.kept_cast_bytes), 1),
                        json_opt(fit.next_peak_bytes.map(mib), 1),
                        json_opt(p.measured_bytes.map(mib), 1),
                        json_opt(p.first_step_bytes.map(mib), 1)
                    );
                }
            }
            if let Some(ratio) = versus {
                line += &format!(", \"batch_vs_fp32\": {}", py(ratio, 2));
            }
            println!("{line}}}");
            rows.push((infer, mode, fit.map(|f| f.batch), versus));
        }
    }
    println!("\n| workload | phase | mode | max batch | vs fp32 |");
    println!("|---|---|---|---|---|");
    for (infer, mode, batch, versus) in rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            args.workload.name(),
            phase_name(infer),
            mode.name(),
            batch.map_or("none".to_string(), |b| b.to_string()),
            versus.map_or(String::new(), |r| format!("{}x", py(r, 2)))
        );
    }
    Ok(())
}
