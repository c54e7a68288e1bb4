//! A step on the GPU, in four phases.
//!
//! - **Plan**, once per graph revision and fetches ([`StepPlan`], TensorRT's engine
//!   build): the schedule, every node lowered to its kernel, the arena's offsets, the
//!   graph's constants uploaded (owned by the plan: a step never looks at their
//!   values), the casts kept between steps and the updates written in place.
//! - **Bind**: the feeds' device values (uploaded, or staged ahead by
//!   [`Staging`](super::staging::Staging)).
//! - **Launch**: the kernels put on the stream one by one, or the step's CUDA graph
//!   replayed ([`super::replay`]), which costs one launch.
//! - **Commit**: the variables' new values become current; kept casts follow them.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ampgraph_graph::ops::Const;
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{DType, Graph, Node, NodeId, Port, Tensor, TensorType};
use cudarc::driver::CudaEvent;

use super::device::{guard, DTensor, Device};
use super::kernels::{self, Lowered, Owner, Source};
use super::{dev_err, upload_value, CudaExecutor, VarSlot};
use crate::memory_plan;
use crate::schedule::{assigned_variable, check_outputs, Schedule};
use crate::{check_tensor_size, ExecError, Feeds, Staged};

/// A convolution's workspace may raise its step's planned peak by this fraction of
/// the arena: a quarter keeps the f32 training step's Winograd algorithms (twice as
/// fast as the next, for hundreds of MiB the backward pass has free) and passes over
/// the inference step's (whose arena is two activations).
const WORKSPACE_MAY_GROW: usize = 4;

/// Plans an executor keeps (the most recently used): each holds its graph's
/// constants on the device.
const PLANS_KEPT: usize = 8;

/// Everything a step of `fetches` from one graph needs that depends only on the graph
/// and its shapes, decided once and kept for every later step. Its order, kept casts
/// and arena are the step's [`StepLayout`](memory_plan::StepLayout), as
/// [`step_footprint`](memory_plan::step_footprint)'s are.
pub(super) struct StepPlan {
    /// Unique in the process: captured step graphs are kept by it.
    pub id: u64,
    /// Plain (op by op) steps run with this plan; from the first its convolution
    /// algorithms are chosen and its memory allocated.
    pub plain_runs: AtomicUsize,
    /// Failed captures of this step: after [`super::replay::MAX_CAPTURE_TRIES`] it is
    /// launched op by op for good.
    pub capture_failures: AtomicUsize,
    /// The last capture's failure.
    pub capture_error: Mutex<Option<String>>,
    /// The nodes the step runs, in order, with their values' reads: first the
    /// variables only casts read (`cast_only`) with those casts, before the arena is
    /// taken, so a first step drops such a variable's copy before its tensors arrive.
    pub schedule: Schedule,
    /// The ports the step fetches.
    fetches: Vec<Port>,
    /// How many nodes of the order run before the arena: the `cast_only` variables
    /// and their casts.
    before_arena: usize,
    /// Each of those nodes lowered, in the same order (shared with the plans made
    /// again from this one: the same graph lowers the same).
    lowered: Arc<Vec<Lowered>>,
    /// The fed sources (Placeholders and Variables) among them, by name.
    pub sources: Vec<String>,
    /// The graph's constants (and groups' `true`), on the device.
    constants: HashMap<NodeId, DTensor>,
    /// The Variable each AssignVariable among them writes, by position.
    assigns: HashMap<NodeId, String>,
    /// Each planned tensor's byte offset in the arena.
    offsets: HashMap<Port, usize>,
    /// The scratch of each node whose kernels took some in an earlier step: where it
    /// lies in the arena, offset and bytes.
    pub scratch: HashMap<NodeId, (usize, usize)>,
    pub arena_bytes: usize,
    /// Outputs an earlier step's kernels zeroed before folding values into them
    /// (amaxes), and the bytes at the arena's start where the plan put them: the step
    /// zeroes those bytes with one memset before its first kernel, and those outputs'
    /// kernels then skip their own (a memset and the gap after it, about 3.5 us each:
    /// 39 a step in the transformer's FP8 step).
    zeroed: HashSet<Port>,
    zeroed_bytes: usize,
    /// What a convolution's workspace may take at each node: the arena's bytes not
    /// alive while it runs ([`MemoryPlan::headroom`](memory_plan::MemoryPlan::headroom))
    /// and `1 / WORKSPACE_MAY_GROW` of the arena more, in the step's first plan (no
    /// scratch yet), carried to the plans after it.
    workspace_room: HashMap<NodeId, usize>,
    /// The largest tensors alive at the plan's peak, for an out-of-memory error.
    largest_at_peak: String,
    /// Optimizer outputs written over the variable they replace, by the variable's
    /// name ([`memory_plan::in_place_updates`]).
    in_place: HashMap<Port, String>,
    /// Casts of variables the graph never writes, by the variable's name
    /// ([`memory_plan::constant_casts`]): computed once, then kept in `cast_cache`.
    constant_casts: HashMap<Port, String>,
    /// Variables nothing but those casts reads, with their casts' `cast_cache` keys:
    /// while every cast is kept the step skips the variable, and after the step its
    /// device copy is dropped if the host copy is current (an inference session then
    /// holds its weights once, in f16, as PyTorch's `model.half()` would).
    cast_only: HashMap<NodeId, Vec<(String, DType)>>,
    /// Casts of variables an optimizer update writes together with their cast
    /// ([`memory_plan::update_casts`]), by the variable's name: served from
    /// `cast_cache`, which the update's cast output refills when the step commits.
    update_casts: HashMap<Port, String>,
    /// Those updates' cast outputs, with the variable's name and whether the output
    /// is written over the kept cast it replaces ([`memory_plan::StepLayout`]'s
    /// `casts_in_place`).
    cast_outputs: HashMap<Port, (String, bool)>,
}

impl StepPlan {
    /// The plan of a run of `fetches` from `graph`, every node lowered, with
    /// `scratch_bytes` of scratch for the nodes that take some, the outputs of
    /// `zeroed` zeroed at the step's start, and the workspace room and constants of an
    /// earlier plan of the step (`None`: this plan's, the constants uploaded to `dev`
    /// now); refuses a node no kernel takes.
    fn new(
        dev: &Device,
        graph: &Graph,
        fetches: &[Port],
        (scratch_bytes, zeroed): (HashMap<NodeId, usize>, HashSet<Port>),
        earlier: Option<&StepPlan>,
    ) -> Result<StepPlan, ExecError> {
        let memory_plan::StepLayout {
            schedule,
            before_arena,
            constant_casts: casts,
            cast_only: cast_only_vars,
            update_casts: updates,
            in_place,
            casts_in_place,
            plan,
        } = memory_plan::StepLayout::new(graph, fetches, &scratch_bytes, &zeroed)?;
        let lowered = match earlier {
            Some(p) if p.schedule.order == schedule.order => p.lowered.clone(),
            _ => Arc::new(
                (schedule.order.iter())
                    .map(|&id| lower(graph, id))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let mut sources = Vec::new();
        let mut constants = HashMap::new();
        for (&id, lowered) in schedule.order.iter().zip(lowered.iter()) {
            let node = graph.node(id);
            match lowered {
                Lowered::Source(Source::Placeholder | Source::Variable) => {
                    sources.push(node.name.clone())
                }
                Lowered::Source(Source::Constant) => {
                    let kept = earlier.and_then(|p| p.constants.get(&id));
                    let value = match kept {
                        Some(d) => d.clone(),
                        None => upload_constant(dev, node)?,
                    };
                    constants.insert(id, value);
                }
                Lowered::Kernel(_) => {}
            }
        }
        let mut assigns = HashMap::new();
        for &id in &schedule.order {
            if let Some(var) = assigned_variable(graph, id)? {
                assigns.insert(id, var);
            }
        }
        let mut cast_only: HashMap<NodeId, Vec<(String, DType)>> = HashMap::new();
        for var in cast_only_vars {
            let name = &graph.node(var).name;
            let keys = casts
                .iter()
                .filter(|(_, v)| v == name)
                .map(|(cast, _)| (name.clone(), graph.ty(*cast).dtype));
            cast_only.insert(var, keys.collect());
        }
        let constant_casts: HashMap<Port, String> = casts.into_iter().collect();
        let mut update_casts = HashMap::new();
        let mut cast_outputs = HashMap::new();
        for (cast, var, out) in updates {
            update_casts.insert(cast, var.clone());
            cast_outputs.insert(out, (var, casts_in_place.contains(&out)));
        }
        // The room is the first plan's (without scratch), the same from step to step:
        // it keys the algorithms chosen.
        let workspace_room = match earlier {
            Some(p) => p.workspace_room.clone(),
            None => (plan.headroom().into_iter())
                .map(|(id, free)| (id, free + plan.arena_bytes / WORKSPACE_MAY_GROW))
                .collect(),
        };
        log::debug!(
            "memory plan: {} tensors in an arena of {} bytes ({} apart)",
            plan.buffers.len(),
            plan.arena_bytes,
            plan.total_bytes
        );
        let in_place = (in_place.into_iter())
            .map(|(port, var)| (port, graph.node(var).name.clone()))
            .collect();
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Ok(StepPlan {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            plain_runs: AtomicUsize::new(0),
            capture_failures: AtomicUsize::new(0),
            capture_error: Mutex::new(None),
            schedule,
            fetches: fetches.to_vec(),
            before_arena,
            lowered,
            sources,
            constants,
            assigns,
            offsets: plan.offsets(),
            scratch: plan.scratch(),
            arena_bytes: plan.arena_bytes,
            zeroed,
            zeroed_bytes: plan.zeroed_bytes,
            workspace_room,
            largest_at_peak: plan.largest_at_peak(graph, 3),
            in_place,
            constant_casts,
            cast_only,
            update_casts,
            cast_outputs,
        })
    }

    /// Whether a whole step has run with this plan: its convolution algorithms are
    /// chosen and its memory allocated.
    fn steady(&self) -> bool {
        self.plain_runs.load(Ordering::Relaxed) > 0
    }
}

/// Node `id` of `graph` lowered, or an error naming it.
pub(super) fn lower(graph: &Graph, id: NodeId) -> Result<Lowered, ExecError> {
    let node = graph.node(id);
    let inputs: Vec<TensorType> = graph
        .inputs(id)
        .iter()
        .map(|&p| graph.ty(p).clone())
        .collect();
    kernels::lower(node.op.as_ref(), &inputs, node.outputs())
        .map_err(|msg| ExecError::node(&node.name, node.op.name(), msg))
}

/// A Const's values (zeros where it holds none) or a group's `true`, on the device.
fn upload_constant(dev: &Device, node: &Node) -> Result<DTensor, ExecError> {
    let ty = &node.outputs()[0];
    guard("CUDA", || {
        let who = Owner("node", &node.name);
        match node.op.downcast_ref::<Const>().map(|k| &k.values) {
            Some(Some(values)) => dev.upload_data(values, &ty.shape, &who),
            Some(None) => {
                let d = dev.alloc(ty.dtype, &ty.shape, &who)?;
                dev.zero(&d)?;
                Ok(d)
            }
            None => dev.upload(&Tensor::scalar(DType::Bool, 1.0), &who),
        }
    })
    .map_err(|m| ExecError::node(&node.name, node.op.name(), m))
}

/// What the launches of a step leave for its commit.
pub(super) struct Launched {
    /// The fetched values (every other value went back when its last reader ran).
    pub fetched: Vec<DTensor>,
    /// Variables' new values, by name.
    pub writes: Vec<(String, DTensor)>,
    /// Casts optimizer updates wrote of their new values, by variable.
    pub written_casts: Vec<(String, DTensor)>,
    /// Profiled ops: kind, events around it, host seconds launching it.
    timed: Vec<(String, CudaEvent, CudaEvent, f64)>,
    /// Nodes that took more scratch than the plan holds for them.
    grown: HashMap<NodeId, usize>,
    /// Outputs their kernels zeroed that the plan does not zero at the step's start.
    zeroed: HashSet<Port>,
}

/// The graph revision and fetches a plan serves.
pub(super) type PlanKey = ((u64, u64), Vec<Port>);

impl CudaExecutor {
    /// A step; `done`, if given, is recorded on the stream after its kernels and
    /// before the fetches' download, and `next` is staged while the kernels run.
    pub(super) fn run_step(
        &mut self,
        graph: &Graph,
        feeds: &Feeds,
        fetches: &[Port],
        done: Option<&CudaEvent>,
        next: Option<Feeds>,
    ) -> Result<(Vec<Tensor>, Option<Staged>), ExecError> {
        let host_start = std::time::Instant::now();
        guard("CUDA", || self.dev.bind()).map_err(dev_err)?;
        super::device::clear_runtime_error();
        let plan = self.step_plan(graph, fetches)?;
        let fetched = match self.replayed(&plan, graph, feeds)? {
            Some(fetched) => fetched,
            None => self.plain_step(&plan, graph, feeds)?,
        };
        if let Some(e) = done {
            guard("CUDA", || self.dev.record(e)).map_err(dev_err)?;
        }
        self.host_enqueue_secs = host_start.elapsed().as_secs_f64();
        let next = next
            .map(|feeds| self.staging.stage(&self.dev, graph, feeds))
            .transpose()?;
        // A replica waits for its step polling, so that a failed peer or a timeout
        // ends the wait rather than hanging in the driver.
        if self.nccl.is_some() {
            let end = guard("CUDA", || self.dev.timing_event()).map_err(dev_err)?;
            self.wait_collective(&end, "the end of its step")?;
        }
        // Last: the download waits for the stream, and the host work above ran
        // while the GPU was still busy with the step.
        let outputs = (fetches.iter().zip(fetched))
            .map(|(p, d)| {
                let node = graph.node(p.node);
                guard("CUDA", || self.dev.download(&d))
                    .map_err(|m| ExecError::node(&node.name, node.op.name(), m))
            })
            .collect::<Result<_, _>>()?;
        Ok((outputs, next))
    }

    /// The plan of a run of `fetches` from `graph`, made on first use.
    fn step_plan(&mut self, graph: &Graph, fetches: &[Port]) -> Result<Arc<StepPlan>, ExecError> {
        let key = (graph.revision(), fetches.to_vec());
        if let Some(at) = self.plans.iter().position(|(k, _)| *k == key) {
            let kept = self.plans.remove(at);
            let plan = kept.1.clone();
            self.plans.insert(0, kept);
            return Ok(plan);
        }
        let plan = Arc::new(StepPlan::new(
            &self.dev,
            graph,
            fetches,
            Default::default(),
            None,
        )?);
        self.keep_plan(key, plan.clone());
        Ok(plan)
    }

    /// Keeps `plan` as the most recent, forgetting the oldest beyond [`PLANS_KEPT`]
    /// (and the step graphs captured from them).
    fn keep_plan(&mut self, key: PlanKey, plan: Arc<StepPlan>) {
        self.plans.retain(|(k, _)| *k != key);
        self.plans.insert(0, (key, plan));
        self.plans.truncate(PLANS_KEPT);
        let live: HashSet<u64> = self.plans.iter().map(|(_, p)| p.id).collect();
        self.step_graphs.retain(|id, _| live.contains(id));
    }

    /// Plans again the step `plan` planned, with the scratch nodes took beyond it
    /// (`grown`) and the outputs they zeroed (`zeroed`), for the next step: its
    /// kernels' temporaries and cuDNN's workspaces then lie in the arena beside the
    /// tensors alive at their step, the workspace shared until then goes, and those
    /// outputs are zeroed at the step's start.
    fn replan(
        &mut self,
        graph: &Graph,
        plan: &StepPlan,
        grown: HashMap<NodeId, usize>,
        zeroed: HashSet<Port>,
    ) -> Result<(), ExecError> {
        let key = (graph.revision(), plan.fetches.clone());
        let mut scratch: HashMap<NodeId, usize> = (plan.scratch.iter())
            .map(|(&id, &(_, bytes))| (id, bytes))
            .collect();
        scratch.extend(grown);
        let zeroed = plan.zeroed.union(&zeroed).copied().collect();
        let replanned = StepPlan::new(
            &self.dev,
            graph,
            &plan.fetches,
            (scratch, zeroed),
            Some(plan),
        )?;
        self.keep_plan(key, Arc::new(replanned));
        self.dnn.release_workspace();
        Ok(())
    }

    /// The arena, grown to at least `bytes`.
    pub(super) fn arena(&mut self, bytes: usize) -> Result<Option<DTensor>, ExecError> {
        if bytes == 0 {
            return Ok(None);
        }
        if let Some(a) = self.arena.as_ref().filter(|a| a.bytes() >= bytes) {
            return Ok(Some(a.clone()));
        }
        // The old arena goes back to the pool first, where the new one may reuse it.
        self.arena = None;
        let arena = guard("CUDA", || {
            self.dev.alloc(
                DType::F32,
                &[bytes.div_ceil(4)],
                &format!("the step's tensors (an arena of {bytes} bytes)"),
            )
        })
        .map_err(dev_err)?;
        self.arena = Some(arena.clone());
        Ok(Some(arena))
    }

    /// A step launched op by op, committed; its fetched values.
    fn plain_step(
        &mut self,
        plan: &Arc<StepPlan>,
        graph: &Graph,
        feeds: &Feeds,
    ) -> Result<Vec<DTensor>, ExecError> {
        // Profiling only: the step's first event and the host clock beside it.
        let step_start = self
            .options
            .profile
            .then(|| guard("CUDA", || self.dev.timing_event()))
            .transpose()
            .map_err(dev_err)?
            .map(|event| (event, std::time::Instant::now()));
        let launched = self.launch(plan, graph, feeds, &HashMap::new())?;
        if let Some((step_start, host_start)) = step_start {
            self.profile.host_secs += host_start.elapsed().as_secs_f64();
            let step_end = guard("CUDA", || self.dev.timing_event()).map_err(dev_err)?;
            let elapsed = |a: &CudaEvent, b: &CudaEvent| {
                a.elapsed_ms(b)
                    .map_err(|e| ExecError::Device(format!("CUDA timing event: {e:?}")))
            };
            self.profile.steps += 1;
            self.profile.step_secs += f64::from(elapsed(&step_start, &step_end)?) / 1e3;
            for (key, start, end, host_secs) in &launched.timed {
                let device_secs = f64::from(elapsed(start, end)?) / 1e3;
                self.profile.add(key.clone(), device_secs, *host_secs);
            }
        }
        self.commit(plan, graph, feeds, launched.writes, launched.written_casts);
        plan.plain_runs.fetch_add(1, Ordering::Relaxed);
        if !launched.grown.is_empty() || !launched.zeroed.is_empty() {
            self.replan(graph, plan, launched.grown, launched.zeroed)?;
        }
        Ok(launched.fetched)
    }

    /// Puts the step's kernels on the stream, in order. `bound` holds device values
    /// for feeds bound beforehand (a captured step's own buffers). Under capture
    /// ([`capturing_here`](super::device::capturing_here)) nothing may change the
    /// executor's state: a step that would (a weight cast made for the first time)
    /// fails instead.
    pub(super) fn launch(
        &mut self,
        plan: &StepPlan,
        graph: &Graph,
        feeds: &Feeds,
        bound: &HashMap<String, DTensor>,
    ) -> Result<Launched, ExecError> {
        let capturing = super::device::capturing_here();
        let steady = plan.steady();
        let mut schedule = plan.schedule.clone();
        let order = std::mem::take(&mut schedule.order);
        let mut arena = None;
        let mut values: HashMap<NodeId, Vec<DTensor>> = HashMap::new();
        let mut writes: Vec<(String, DTensor)> = Vec::new();
        let mut written_casts: Vec<(String, DTensor)> = Vec::new();
        let mut timed = Vec::new();
        let mut grown: HashMap<NodeId, usize> = HashMap::new();
        let mut zeroed: HashSet<Port> = HashSet::new();
        // Collectives still running on their stream: the events their readers wait
        // for, and their inputs, kept from the pool until then.
        let mut joins: HashMap<NodeId, (Vec<CudaEvent>, Vec<DTensor>)> = HashMap::new();
        for (position, (&id, lowered)) in order.iter().zip(plan.lowered.iter()).enumerate() {
            if position == plan.before_arena {
                // Before any launch but the casts of variables only they read: a step
                // whose tensors do not fit fails at once.
                arena = self.arena(plan.arena_bytes).map_err(|e| {
                    ExecError::Memory(format!(
                        "the step's tensors need an arena of {:.1} MiB on the device ({e}); the largest alive at once: {}",
                        memory_plan::mib(plan.arena_bytes),
                        plan.largest_at_peak
                    ))
                })?;
                if let Some(a) = arena.as_ref().filter(|_| plan.zeroed_bytes > 0) {
                    let words = TensorType::new(DType::F32, [plan.zeroed_bytes / 4]);
                    guard("CUDA", || self.dev.zero(&a.slot(0, &words)?)).map_err(dev_err)?;
                }
            }
            let node = graph.node(id);
            let op = node.op.name();
            for ty in node.outputs() {
                check_tensor_size(&node.name, op, ty, self.max_tensor_bytes)?;
            }
            if !feeds.contains_key(&node.name) && self.casts_kept(plan, id) {
                continue;
            }
            // A cast of an unfed variable kept from an earlier step: one no step
            // writes, or one an update wrote together with its cast.
            let port = Port::new(id, 0);
            let constant = plan.constant_casts.get(&port);
            let cast_key = constant
                .or(plan.update_casts.get(&port))
                .filter(|var| !feeds.contains_key(var.as_str()))
                .map(|var| (var.clone(), node.outputs()[0].dtype));
            let kept = cast_key
                .as_ref()
                .and_then(|k| self.cast_cache.get(k))
                .cloned();
            // Only a constant cast computed now holds for later steps.
            let keep = cast_key.filter(|_| kept.is_none() && constant.is_some());
            if capturing && keep.is_some() {
                return Err(ExecError::node(
                    &node.name,
                    op,
                    "a weight's cast is made for the first time",
                ));
            }
            let outputs = match (kept, lowered) {
                (Some(t), _) => vec![t],
                (None, Lowered::Source(Source::Constant)) => vec![plan.constants[&id].clone()],
                (None, Lowered::Source(source)) => match bound.get(&node.name) {
                    Some(d) => vec![d.clone()],
                    None => vec![self.source_value(node, source, feeds)?],
                },
                (None, Lowered::Kernel(kernel)) => {
                    let inputs: Vec<DTensor> = graph
                        .inputs(id)
                        .iter()
                        .map(|p| values[&p.node][p.index].clone())
                        .collect();
                    let prezeroed: Vec<bool> = (0..node.outputs().len())
                        .map(|k| {
                            let at = plan.offsets.get(&Port::new(id, k));
                            at.is_some_and(|&at| at < plan.zeroed_bytes)
                        })
                        .collect();
                    let planned: Vec<Option<DTensor>> = node
                        .outputs()
                        .iter()
                        .enumerate()
                        .map(|(k, ty)| {
                            let port = Port::new(id, k);
                            if let Some(var) = plan.in_place.get(&port) {
                                return Ok(self.variables.get(var).and_then(|v| v.device.clone()));
                            }
                            if let Some((var, true)) = plan.cast_outputs.get(&port) {
                                return Ok(self.cast_cache.get(&(var.clone(), ty.dtype)).cloned());
                            }
                            match (&arena, plan.offsets.get(&port)) {
                                (Some(a), Some(&at)) => a.slot(at, ty).map(Some),
                                _ => Ok(None),
                            }
                        })
                        .collect::<Result<_, String>>()
                        .map_err(|m| ExecError::node(&node.name, op, m))?;
                    for p in graph.inputs(id) {
                        if let Some((events, _)) = joins.remove(&p.node) {
                            self.join(&events)?;
                        }
                    }
                    let planned_scratch = plan.scratch.get(&id).copied();
                    let scratch = match (&arena, planned_scratch) {
                        (Some(a), Some((at, bytes))) => {
                            let words = TensorType::new(DType::F32, [bytes / 4]);
                            Some(
                                a.slot(at, &words)
                                    .map_err(|m| ExecError::node(&node.name, op, m))?,
                            )
                        }
                        _ => None,
                    };
                    let ctx = kernels::Ctx {
                        dev: &self.dev,
                        gemm: &self.gemm,
                        gemm_options: self.options.gemm,
                        dnn: &self.dnn,
                        dnn_options: self.options.conv,
                        name: &node.name,
                        planned: &planned,
                        prezeroed: &prezeroed,
                        zeroed_here: RefCell::new(Vec::new()),
                        allocated: Cell::new(0),
                        scratch,
                        scratch_used: Cell::new(0),
                        workspace_room: plan.workspace_room.get(&id).copied(),
                        collective: self.nccl.as_ref(),
                        joins: RefCell::new(Vec::new()),
                    };
                    // Only a profiled step brackets each op with timing events, and
                    // keeps them only for ops that put work on the stream: an update
                    // written in place or a view would show the events' gap alone
                    // (0.3 ms of a GPT-2 step's table).
                    let out = guard("CUDA", || {
                        let start = self
                            .options
                            .profile
                            .then(|| self.dev.timing_event())
                            .transpose()?
                            .map(|event| (event, std::time::Instant::now()));
                        let launches = || self.dev.launches.snapshot().total();
                        let launched_before = start.as_ref().map(|_| launches());
                        let mut out = kernel.launch(&ctx, &inputs)?;
                        let start = start.map(|(event, host)| (event, host.elapsed()));
                        // An op that returns an input (a Cast to the same type) where
                        // the plan gave the output a slot of its own: the input's slot
                        // is reused after its last planned reader, so the value moves.
                        for (o, slot) in out.iter_mut().zip(&planned) {
                            if let (Some(slot), Some(a)) = (slot, &arena) {
                                if o.ptr() != slot.ptr() && o.shares_buffer(a) {
                                    self.dev.copy(o, slot)?;
                                    *o = slot.clone();
                                }
                            }
                        }
                        let launched = launched_before.is_some_and(|n| launches() != n);
                        if let Some((start, host)) = start.filter(|_| launched) {
                            let key = match node.outputs().first() {
                                Some(ty) => format!("{op} {ty}"),
                                None => op.to_string(),
                            };
                            timed.push((key, start, self.dev.timing_event()?, host.as_secs_f64()));
                        }
                        Ok(out)
                    })
                    .map_err(|m| ExecError::node(&node.name, op, m))?;
                    let events = ctx.joins.take();
                    let used = ctx.scratch_used.get();
                    zeroed.extend(
                        (ctx.zeroed_here.take().into_iter())
                            .map(|k| Port::new(id, k))
                            .filter(|p| !plan.zeroed.contains(p)),
                    );
                    drop(ctx);
                    if !steady {
                        // A plan's first steps choose convolution algorithms and
                        // allocate, which may wait for the whole device: no collective
                        // is left running then, or two replicas could wait for each
                        // other through their NCCL kernels.
                        for e in &events {
                            self.wait_collective(e, "an all-reduce")?;
                        }
                    }
                    if !events.is_empty() {
                        joins.insert(id, (events, inputs));
                    }
                    if used > planned_scratch.map_or(0, |(_, bytes)| bytes) {
                        grown.insert(id, used);
                    }
                    out
                }
            };
            check_outputs(node, outputs.iter().map(|t| t.ty()))?;
            if let Some(key) = keep {
                self.cast_cache.insert(key, outputs[0].clone());
                self.state_changed();
                let var = graph.inputs(id)[0].node;
                self.drop_cast_only_copy(plan, graph, feeds, var);
            }
            if let Some(variable) = plan.assigns.get(&id) {
                writes.push((variable.clone(), outputs[0].clone()));
            }
            for (k, out) in outputs.iter().enumerate() {
                if let Some((var, _)) = plan.cast_outputs.get(&Port::new(id, k)) {
                    written_casts.push((var.clone(), out.clone()));
                }
            }
            values.insert(id, outputs);
            for done in schedule.consume_inputs(graph, id) {
                values.remove(&done);
            }
        }
        for (events, _) in joins.into_values() {
            self.join(&events)?;
        }
        let fetched = (plan.fetches.iter())
            .map(|p| values[&p.node][p.index].clone())
            .collect();
        Ok(Launched {
            fetched,
            writes,
            written_casts,
            timed,
            grown,
            zeroed,
        })
    }

    /// Waits for `event` of the replica's collectives (`what` it ends); where the wait
    /// gives up (a failed peer, the timeout), aborts the communicator and destroys the
    /// step graphs, which hold its captured collectives.
    fn wait_collective(&mut self, event: &CudaEvent, what: &str) -> Result<(), ExecError> {
        let Some(nccl) = &self.nccl else {
            return Ok(());
        };
        let Err(why) = nccl.wait(event, what) else {
            return Ok(());
        };
        // Each waits for the other: NCCL's abort returns once the graphs holding the
        // communicator's collectives are destroyed, and destroying a graph still
        // running waits for its end, which its NCCL kernels reach once the abort has
        // raised their flag. So the abort runs on a thread of its own meanwhile.
        let graphs = &mut self.step_graphs;
        std::thread::scope(|s| {
            let aborting = s.spawn(|| nccl.abort_comm());
            graphs.clear();
            let _ = aborting.join();
        });
        Err(ExecError::Collective(why))
    }

    /// Makes the compute stream wait for work on other streams (collectives).
    fn join(&self, events: &[CudaEvent]) -> Result<(), ExecError> {
        for e in events {
            self.dev
                .stream
                .wait(e)
                .map_err(|e| dev_err(format!("CUDA stream wait: {e:?}")))?;
        }
        Ok(())
    }

    /// Makes a step's variable writes current: the variables take their new values,
    /// the casts the updates wrote are kept, and a variable read only through kept
    /// casts drops its device copy (when its host copy is current).
    fn commit(
        &mut self,
        plan: &StepPlan,
        graph: &Graph,
        feeds: &Feeds,
        writes: Vec<(String, DTensor)>,
        written_casts: Vec<(String, DTensor)>,
    ) {
        if !writes.is_empty() {
            self.state_changed();
        }
        let written: HashSet<String> = writes.iter().map(|(name, _)| name.clone()).collect();
        for (name, value) in writes {
            self.cast_cache.retain(|(var, _), _| *var != name);
            self.variables.insert(
                name,
                VarSlot {
                    device: Some(value),
                    host: OnceLock::new(),
                },
            );
        }
        // An update's cast holds once its variable is written (not when the step
        // fetched the update without assigning it).
        for (var, cast) in written_casts {
            if written.contains(&var) {
                self.cast_cache.insert((var, cast.dtype), cast);
            }
        }
        for &var in plan.cast_only.keys() {
            self.drop_cast_only_copy(plan, graph, feeds, var);
        }
    }

    /// Drops the device copy of `var` if only casts read it, every one of them is
    /// kept, it was not fed, and its host copy is current: the step and the next
    /// read the casts (the pool frees the copy after its last read in this step).
    fn drop_cast_only_copy(&mut self, plan: &StepPlan, graph: &Graph, feeds: &Feeds, var: NodeId) {
        let name = &graph.node(var).name;
        if feeds.contains_key(name) || !self.casts_kept(plan, var) {
            return;
        }
        if let Some(slot) = self.variables.get_mut(name) {
            if slot.host.get().is_some() && slot.device.is_some() {
                slot.device = None;
                self.state_changed();
            }
        }
    }

    /// Whether every cast of a weight the step reads is kept already: a cast the
    /// step would make and keep, or an update's cast with no kept buffer to write
    /// into, is state a captured step cannot change.
    pub(super) fn casts_settled(&self, plan: &StepPlan, graph: &Graph, feeds: &Feeds) -> bool {
        (plan.constant_casts.iter().chain(&plan.update_casts)).all(|(port, var)| {
            feeds.contains_key(var)
                || (self.cast_cache).contains_key(&(var.clone(), graph.ty(*port).dtype))
        })
    }

    /// Whether `var` is read only through casts and every one of them is kept.
    fn casts_kept(&self, plan: &StepPlan, var: NodeId) -> bool {
        plan.cast_only
            .get(&var)
            .is_some_and(|keys| keys.iter().all(|k| self.cast_cache.contains_key(k)))
    }

    /// The value of a fed or held source node (a Placeholder or a Variable).
    fn source_value(
        &mut self,
        node: &Node,
        source: &Source,
        feeds: &Feeds,
    ) -> Result<DTensor, ExecError> {
        let want = &node.outputs()[0];
        if let Some(v) = feeds.get(&node.name) {
            check_fed(node, &v.ty())?;
            if let Some(d) = self.staging.current.get(&node.name) {
                return Ok(d.clone());
            }
            return upload_value(&self.dev, v, "feed", &node.name);
        }
        if let Source::Placeholder = source {
            return Err(ExecError::Feed {
                name: node.name.clone(),
                msg: format!("Placeholder {want} was not fed"),
            });
        }
        let Some(slot) = self.variables.get_mut(&node.name) else {
            return Err(ExecError::Feed {
                name: node.name.clone(),
                msg: format!("Variable {want} has no value (initialise or feed it)"),
            });
        };
        check_fed(node, &slot.ty())?;
        if let Some(d) = &slot.device {
            return Ok(d.clone());
        }
        // Dropped while only kept casts read it: upload the host copy.
        let Some(host) = slot.host.get() else {
            return Err(ExecError::Device(format!(
                "variable '{}' has neither a device nor a host copy",
                node.name
            )));
        };
        if super::device::capturing_here() {
            return Err(ExecError::node(
                &node.name,
                "Variable",
                "its device copy was dropped",
            ));
        }
        let d = upload_value(&self.dev, host, "variable", &node.name)?;
        slot.device = Some(d.clone());
        self.state_changed();
        Ok(d)
    }

    /// Something a captured step graph may have read (a variable's or a kept cast's
    /// buffer) changed: the graphs captured before are not replayed.
    pub(super) fn state_changed(&mut self) {
        self.state_epoch += 1;
    }
}

/// Refuses a value of another type than node `node` (a source) produces.
pub(super) fn check_fed(node: &Node, got: &TensorType) -> Result<(), ExecError> {
    let want = &node.outputs()[0];
    if got != want {
        return Err(ExecError::Feed {
            name: node.name.clone(),
            msg: format!(
                "expects {want}, got {}{}",
                got.dtype,
                ShapeDisplay(&got.shape)
            ),
        });
    }
    Ok(())
}
