//! `--max-batch-under-mib N`: for each mode and phase, the largest batch whose planned
//! step fits N MiB, fp32 against AMP. A step's plan is made on the host: the graph of
//! that batch goes through the passes of a timed run (`prepare`) and
//! [`step_footprint`] plans it as the CUDA executor would, so no device is needed.

use std::collections::hash_map::{Entry, HashMap};

use ampgraph::exec::memory_plan::{mib, step_footprint, StepFootprint};

use super::{error_line, phase_name, prepare, py, Args, Config, Mode, Res};

/// The search stops doubling here: a budget that holds this batch is an error.
const MAX_BATCH: usize = 1 << 24;

/// The planned device memory of one step of `cfg` at `batch` in `mode` (the forward
/// pass when `infer`), after the passes a timed run runs.
pub fn planned_step(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    batch: usize,
) -> Res<StepFootprint> {
    let step = prepare(args, &cfg.with_batch(batch), mode, infer)?;
    Ok(step_footprint(&step.graph, &[step.fetch])?)
}

/// The largest batch for which `fits` holds: doubling from 1 until it fails, then
/// bisecting between the last batch that fit and the first that did not. `fits` must
/// hold up to some batch and not beyond (a planned peak grows with the batch). None
/// where batch 1 does not fit.
pub fn largest_batch(mut fits: impl FnMut(usize) -> Res<bool>) -> Res<Option<usize>> {
    if !fits(1)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1, 2);
    while fits(hi)? {
        if hi >= MAX_BATCH {
            return Err(format!("batch {hi} still fits; the search stops there").into());
        }
        (lo, hi) = (hi, hi * 2);
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

/// The largest batch that fits, with its plan and the next batch's planned peak.
pub struct Fit {
    pub batch: usize,
    pub footprint: StepFootprint,
    pub next_peak_bytes: usize,
}

/// The largest batch of `cfg` in `mode` whose planned peak is at most `budget` bytes.
pub fn max_batch(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    budget: usize,
) -> Res<Option<Fit>> {
    // The search plans each batch once; the answer and the batch after it are among them.
    let mut plans: HashMap<usize, StepFootprint> = HashMap::new();
    let mut peak = |batch: usize| -> Res<usize> {
        let plan = match plans.entry(batch) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => new.insert(planned_step(args, cfg, mode, infer, batch)?),
        };
        Ok(plan.peak_bytes())
    };
    let Some(batch) = largest_batch(|batch| Ok(peak(batch)? <= budget))? else {
        return Ok(None);
    };
    let next_peak_bytes = peak(batch + 1)?;
    let footprint = plans
        .remove(&batch)
        .ok_or("the search lost its answer's plan")?;
    Ok(Some(Fit {
        batch,
        footprint,
        next_peak_bytes,
    }))
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
                    let f = &fit.footprint;
                    line += &format!(
                        ", \"max_batch\": {}, \"planned_peak_mib\": {}, \"arena_mib\": {}, \"variables_mib\": {}, \"kept_casts_mib\": {}, \"next_batch_peak_mib\": {}",
                        fit.batch,
                        py(mib(f.peak_bytes()), 1),
                        py(mib(f.plan.arena_bytes), 1),
                        py(mib(f.variable_bytes), 1),
                        py(mib(f.kept_cast_bytes), 1),
                        py(mib(fit.next_peak_bytes), 1)
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
