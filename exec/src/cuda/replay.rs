//! Whole steps as CUDA graphs (PyTorch's `mode="reduce-overhead"`, TensorRT's
//! enqueue). A step whose plan has run [`PLAIN_RUNS_BEFORE_CAPTURE`] times op by op
//! (its algorithms chosen, its scratch planned, its buffers settled) is captured from
//! the stream into a CUDA graph once; from then on a step copies its feeds into the
//! buffers the graph reads, launches the graph (one launch for every kernel: the
//! host's cost no longer grows with the graph) and reads its fetches from the buffers
//! the graph wrote.
//!
//! A graph replays the addresses it was captured with, so everything it touches
//! keeps its place: the arena, the plan's constants, its own feed buffers, every
//! buffer handed out while it was captured ([`Device::start_tape`]), the variables
//! (an update not written in place is copied back into its variable's buffer at the
//! graph's end) and the kept casts (likewise). Whatever moves a variable or a kept
//! cast to another buffer (a plain step's commit, `set_variable`) moves the
//! executor's state epoch on, and the graphs captured before are captured again.
//!
//! A replica's step is captured with its all-reduces: they run on the communicator's
//! stream, which forks from the compute stream and joins it again through events, so
//! the capture takes both streams. NCCL requires capture to be collective (every rank
//! captures the same collectives, and launches the graph that holds them): every
//! replica runs the same plans in the same order (the same steps and fetches) and so
//! captures each after the same count of plain runs.
//!
//! Launched op by op instead, with the reason in [`CudaExecutor::step_launch`]:
//! profiled steps, executors with
//! [`ExecOptions::op_by_op`](crate::ExecOptions::op_by_op) set, and a step whose
//! capture failed [`MAX_CAPTURE_TRIES`] times (a cuDNN call that cannot be captured, a
//! buffer the pool did not hold).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use ampgraph_graph::{DType, Graph};
use cudarc::driver::{sys, CudaGraph};

use super::device::{capturing, guard, DTensor, Launches};
use super::kernels::Owner;
use super::step::{check_fed, Launched, StepPlan};
use super::{dev_err, CudaExecutor};
use crate::{ExecError, Feeds};

/// Plain steps of a plan before its capture: the first chooses algorithms and may
/// plan scratch anew (a new plan), the second shows the buffers it settles on.
pub(super) const PLAIN_RUNS_BEFORE_CAPTURE: usize = 2;

/// Failed captures of a plan after which its steps run op by op for good.
pub(super) const MAX_CAPTURE_TRIES: usize = 2;

/// How the last step's kernels reached the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepLaunch {
    /// No step has run yet.
    None,
    /// One launch of the step's CUDA graph (captured in this step or before).
    Replayed,
    /// Kernel by kernel, and why.
    OpByOp(String),
}

impl std::fmt::Display for StepLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepLaunch::None => f.write_str("no step has run"),
            StepLaunch::Replayed => f.write_str("replayed as one CUDA graph"),
            StepLaunch::OpByOp(why) => write!(f, "launched op by op ({why})"),
        }
    }
}

/// A step captured as a CUDA graph, with everything it reads and writes.
pub(super) struct StepGraph {
    /// The plan it was captured from (its constants are the graph's).
    _plan: Arc<StepPlan>,
    /// The sources fed when it was captured, by name, in the plan's order.
    fed: Vec<String>,
    /// The executor's state epoch it was captured at.
    epoch: u64,
    graph: CudaGraph,
    /// The buffers the graph reads its feeds from, in `fed`'s order.
    feeds: Vec<DTensor>,
    /// Where the graph leaves the fetched values.
    fetched: Vec<DTensor>,
    /// Variables the graph writes (into their own buffers).
    written: Vec<String>,
    /// Kept casts the graph writes (into their own buffers).
    refreshed: Vec<(String, DType)>,
    /// Buffers handed out during the capture, and the arena: kept from the pool.
    _held: Vec<DTensor>,
}

// SAFETY: a step graph is launched only by the executor that owns it (`&mut`), on the
// executor's one stream, like the cuDNN graphs of `Dnn`.
unsafe impl Send for StepGraph {}
unsafe impl Sync for StepGraph {}

impl CudaExecutor {
    /// Runs the step as its CUDA graph where it may be (capturing it first where it
    /// has none yet); `None` where it is to be launched op by op.
    pub(super) fn replayed(
        &mut self,
        plan: &Arc<StepPlan>,
        graph: &Graph,
        feeds: &Feeds,
    ) -> Result<Option<Vec<DTensor>>, ExecError> {
        if let Err(why) = self.may_capture(plan) {
            self.step_launch = StepLaunch::OpByOp(why);
            return Ok(None);
        }
        let fed = || (plan.sources.iter()).filter(|name| feeds.contains_key(*name));
        let current = (self.step_graphs.get(&plan.id))
            .is_some_and(|g| g.epoch == self.state_epoch && fed().eq(&g.fed));
        if !current && !self.casts_settled(plan, graph, feeds) {
            self.step_launch = StepLaunch::OpByOp("a weight's cast is computed again".into());
            return Ok(None);
        }
        if !current {
            self.step_graphs.remove(&plan.id);
            let fed: Vec<String> = fed().cloned().collect();
            let mut captured = self.capture(plan, graph, feeds, fed.clone());
            // Buffers the pool lacked (another graph holds those it had): reserved
            // outside the capture, which then gets them.
            let missed = self.dev.tape_misses();
            if captured.is_err() && !missed.is_empty() {
                guard("CUDA", || self.dev.reserve(&missed)).map_err(dev_err)?;
                captured = self.capture(plan, graph, feeds, fed);
            }
            match captured {
                Ok(captured) => {
                    log::debug!(
                        "step captured as a CUDA graph ({} nodes)",
                        plan.schedule.order.len()
                    );
                    self.step_graphs.insert(plan.id, captured);
                }
                Err(why) => {
                    let tries = plan.capture_failures.fetch_add(1, Ordering::Relaxed) + 1;
                    log::info!("a step could not be captured as a CUDA graph (try {tries}): {why}");
                    *plan
                        .capture_error
                        .lock()
                        .map_err(|_| dev_err("poisoned".into()))? = Some(why.clone());
                    self.step_launch = StepLaunch::OpByOp(format!("its capture failed: {why}"));
                    return Ok(None);
                }
            }
        }
        let g = &self.step_graphs[&plan.id];
        for (name, buffer) in g.fed.iter().zip(&g.feeds) {
            let value = &feeds[name];
            if value.ty() != buffer.ty() {
                let node = graph.node(graph.find(name).ok_or_else(|| ExecError::Feed {
                    name: name.clone(),
                    msg: "is not in the graph".into(),
                })?);
                check_fed(node, &value.ty())?;
            }
            let copied = match self.staging.current.get(name) {
                Some(staged) => guard("CUDA", || self.dev.copy(staged, buffer)),
                None => guard("CUDA", || self.dev.write(buffer, value.data())),
            };
            copied.map_err(|msg| ExecError::Feed {
                name: name.clone(),
                msg,
            })?;
        }
        Launches::count(&self.dev.launches.step_graphs);
        guard("CUDA", || {
            g.graph
                .launch()
                .map_err(|e| format!("launching the step's CUDA graph: {e:?}"))
        })
        .map_err(dev_err)?;
        // The variables' values changed in place: their host copies are stale, and
        // casts of them the graph does not write are no longer kept.
        for name in &g.written {
            if let Some(slot) = self.variables.get_mut(name) {
                slot.host = OnceLock::new();
            }
        }
        let before = self.cast_cache.len();
        (self.cast_cache).retain(|k, _| !g.written.contains(&k.0) || g.refreshed.contains(k));
        let fetched = g.fetched.clone();
        if self.cast_cache.len() != before {
            self.state_changed();
        }
        self.step_launch = StepLaunch::Replayed;
        Ok(Some(fetched))
    }

    /// Why the step of `plan` is launched op by op now, if it is.
    fn may_capture(&self, plan: &StepPlan) -> Result<(), String> {
        if self.options.op_by_op {
            return Err("ExecOptions::op_by_op is set".into());
        }
        if self.options.profile {
            return Err("profiled steps time each op".into());
        }
        if plan.capture_failures.load(Ordering::Relaxed) >= MAX_CAPTURE_TRIES {
            let why = plan.capture_error.lock().ok().and_then(|e| e.clone());
            return Err(format!(
                "its capture failed {MAX_CAPTURE_TRIES} times: {}",
                why.unwrap_or_default()
            ));
        }
        if plan.plain_runs.load(Ordering::Relaxed) < PLAIN_RUNS_BEFORE_CAPTURE {
            return Err("the step's first runs choose algorithms and settle its buffers".into());
        }
        Ok(())
    }

    /// The step of `plan` captured (not run) with buffers of its own for the sources
    /// in `fed`.
    fn capture(
        &mut self,
        plan: &Arc<StepPlan>,
        graph: &Graph,
        feeds: &Feeds,
        fed: Vec<String>,
    ) -> Result<StepGraph, String> {
        let mut bound = HashMap::new();
        let mut feed_buffers = Vec::new();
        for name in &fed {
            let value = &feeds[name];
            let d = self
                .dev
                .alloc(value.dtype(), value.shape(), &Owner("feed", name))?;
            bound.insert(name.clone(), d.clone());
            feed_buffers.push(d);
        }
        let arena = self.arena(plan.arena_bytes).map_err(|e| e.to_string())?;
        self.dev.start_tape()?;
        let ctx = self.dev.ctx.clone();
        let outcome = capturing(&ctx, || {
            let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            if let Err(e) = self.dev.stream.begin_capture(mode) {
                return (Err(format!("begin capture: {e:?}")), Ok(None));
            }
            let launched = (self.launch(plan, graph, feeds, &bound))
                .map_err(|e| e.to_string())
                .and_then(|mut l| {
                    let refreshed = copy_back(self, &mut l)?;
                    Ok((l, refreshed))
                });
            // The capture ends whatever happened: the stream must leave capture mode.
            let captured = (self.dev.stream)
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| format!("end capture: {e:?}"));
            (launched, captured)
        });
        let mut held = self.dev.end_tape()?;
        let (launched, captured) = outcome?;
        let (launched, refreshed) = launched?;
        let graph = captured?.ok_or("an empty capture")?;
        held.extend(arena);
        held.extend(launched.writes.iter().map(|(_, d)| d.clone()));
        Ok(StepGraph {
            _plan: plan.clone(),
            fed,
            epoch: self.state_epoch,
            graph,
            feeds: feed_buffers,
            fetched: launched.fetched,
            written: launched.writes.into_iter().map(|(name, _)| name).collect(),
            refreshed,
            _held: held,
        })
    }
}

/// Under capture, after the step's kernels: copies each new variable value not
/// written in place into the variable's buffer, and each cast an update wrote into its
/// kept cast's buffer, so that the graph leaves them where the next replay reads
/// them; the casts refreshed so. A fetched value in one of those buffers (a variable's
/// old value, read through a view) is copied aside first, as a plain step's commit
/// would leave it.
fn copy_back(e: &CudaExecutor, launched: &mut Launched) -> Result<Vec<(String, DType)>, String> {
    let dev = &e.dev;
    let mut copies: Vec<(&DTensor, &DTensor)> = Vec::new();
    for (name, value) in &launched.writes {
        let target = (e.variables.get(name))
            .and_then(|slot| slot.device.as_ref())
            .ok_or_else(|| format!("variable '{name}' has no device copy to write"))?;
        if target.ptr() != value.ptr() {
            copies.push((value, target));
        }
    }
    let mut refreshed = Vec::new();
    for (var, cast) in &launched.written_casts {
        if !launched.writes.iter().any(|(name, _)| name == var) {
            continue;
        }
        let key = (var.clone(), cast.dtype);
        let target = (e.cast_cache.get(&key)).ok_or_else(|| {
            format!(
                "the {} cast of variable '{var}' is not kept yet",
                cast.dtype
            )
        })?;
        if target.ptr() != cast.ptr() {
            copies.push((cast, target));
        }
        refreshed.push(key);
    }
    let mut fetched = launched.fetched.clone();
    for f in &mut fetched {
        if copies.iter().any(|(_, target)| f.shares_buffer(target)) {
            let aside = dev.alloc(f.dtype, &f.shape, &"a fetched value of a captured step")?;
            dev.copy(f, &aside)?;
            *f = aside;
        }
    }
    for (value, target) in copies {
        dev.copy(value, target)?;
    }
    launched.fetched = fetched;
    Ok(refreshed)
}
