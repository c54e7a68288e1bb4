//! The CUDA executor: tensors on one GPU, GEMMs through cuBLASLt, every other op
//! (except convolutions, pooling and batch norm, which wait for cuDNN) as NVRTC
//! kernels generated per (op, dtype) and compiled once per process.
//!
//! CUDA is loaded at run time (`cudarc`'s dynamic loading): the crate builds and runs
//! on machines without it, and [`available`] says why CUDA cannot be used there. No
//! cudarc panic reaches a caller: the libraries are checked for before first use and
//! CUDA calls that could panic run under a guard.
//!
//! Variables live on the device across runs; `AssignVariable` writes replace them when
//! the step ends. Host copies of variables ([`CudaExecutor::variable`]) are downloaded
//! on demand and cached until the next write. A step's intermediate tensors live in
//! one arena, each at the offset the step's memory plan ([`crate::memory_plan`])
//! gave it; the plan is made on a graph's first run and kept by the graph's
//! fingerprint (the last one also by the graph's revision, which needs no hashing).
//! Fed values, the values assignments write and kernels' scratch come from a
//! size-keyed buffer pool. An optimizer update writes over the variable it
//! replaces where nothing later in the step reads the old value (so a step that
//! fails after such an update leaves that variable updated). Casts of variables the
//! graph never writes (an inference graph's f16 weights) are kept until the variable
//! changes, and so are the casts an optimizer update writes with its variable
//! (`cast_to`): the next step's Cast kernel does not run. Only fetched values are
//! copied back.

mod device;
mod dnn;
mod gemm;
pub mod kernel_cache;
mod kernels;
pub mod nccl;
mod pipeline;
mod staging;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{DType, Graph, NodeId, Port, Tensor, TensorType};

use crate::collective::{Collective, Transport};
use crate::memory_plan;
use crate::schedule::{assigned_variable, check_outputs, Schedule};
use crate::{
    check_tensor_size, ExecError, ExecOptions, Executor, Feeds, Overlapped, RunResult, Staged,
    TimedRunResult, DEFAULT_MAX_TENSOR_BYTES,
};

pub use device::LaunchCounts;
use device::{guard, DTensor, Device};
use dnn::Dnn;
pub use dnn::{Choice as ConvAlgorithm, DnnOptions};
use gemm::Gemm;
pub use gemm::GemmOptions;
use kernels::{Lowered, Owner, Source};
pub use pipeline::{pipeline, PIPELINE};

/// The number of CUDA devices, or why CUDA cannot be used on this machine (no driver
/// library, no device, no NVRTC or cuBLASLt library).
pub fn available() -> Result<usize, String> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    let n = guard("CUDA driver", || {
        cudarc::driver::result::init()
            .map_err(|e| format!("the CUDA driver failed to start: {e:?}"))?;
        cudarc::driver::result::device::get_count()
            .map_err(|e| format!("the CUDA driver could not count devices: {e:?}"))
    })?;
    if n <= 0 {
        return Err("the CUDA driver found no device".into());
    }
    libraries_present()?;
    Ok(n as usize)
}

/// Checks the other libraries the executor loads (NVRTC, cuBLASLt).
fn libraries_present() -> Result<(), String> {
    // SAFETY: only try to open the libraries.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("the NVRTC library (libnvrtc.so) was not found".into());
    }
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err("the cuBLASLt library (libcublasLt.so) was not found".into());
    }
    Ok(())
}

/// Settings of a CUDA executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    pub gemm: GemmOptions,
    pub dnn: DnnOptions,
    /// Time every op with CUDA events and add its time to [`CudaExecutor::profile`]
    /// (slows the step a little; for finding where a step's time goes).
    pub profile: bool,
}

/// Time spent per kind of op (op name, output dtype and shape) while profiling.
#[derive(Clone, Debug, Default)]
pub struct OpProfile {
    /// Per kind: calls, device seconds, host seconds (lowered kernel's launch call).
    entries: HashMap<String, OpTimes>,
    /// Profiled steps, their device time (first launch to last) and the host time
    /// spent putting them on the stream: where the host takes longer than the ops, the
    /// GPU waits between them.
    steps: u64,
    step_secs: f64,
    host_secs: f64,
}

#[derive(Clone, Copy, Debug, Default)]
struct OpTimes {
    calls: u64,
    device_secs: f64,
    host_secs: f64,
}

impl OpProfile {
    fn add(&mut self, key: String, device_secs: f64, host_secs: f64) {
        let e = self.entries.entry(key).or_default();
        e.calls += 1;
        e.device_secs += device_secs;
        e.host_secs += host_secs;
    }

    /// The `top` most expensive kinds as a table: calls, device ms, host ms (launching
    /// them), share of the device time.
    pub fn table(&self, top: usize) -> String {
        let total = self
            .entries
            .values()
            .fold(OpTimes::default(), |a, e| OpTimes {
                calls: a.calls + e.calls,
                device_secs: a.device_secs + e.device_secs,
                host_secs: a.host_secs + e.host_secs,
            });
        let mut rows: Vec<(&String, &OpTimes)> = self.entries.iter().collect();
        rows.sort_by(|a, b| b.1.device_secs.total_cmp(&a.1.device_secs));
        let row = |key: &str, e: &OpTimes| {
            format!(
                "| {key} | {} | {:.3} | {:.3} | {:.1}% |\n",
                e.calls,
                e.device_secs * 1e3,
                e.host_secs * 1e3,
                100.0 * e.device_secs / total.device_secs.max(f64::MIN_POSITIVE)
            )
        };
        let mut out = format!(
            "steps: {}, on the device {:.3} ms, enqueued by the host in {:.3} ms\n\
             | op (output) | calls | device ms | host ms | share |\n|---|---|---|---|---|\n",
            self.steps,
            self.step_secs * 1e3,
            self.host_secs * 1e3,
        );
        out.push_str(&row("all", &total));
        for (key, e) in rows.into_iter().take(top) {
            out.push_str(&row(key, e));
        }
        out
    }
}

/// A variable's value on the device and its host copy, at least one of them present.
/// The host copy, once set, is current; the device copy is dropped only while it is
/// (see [`StepMemory::cast_only`]).
struct VarSlot {
    device: Option<DTensor>,
    host: OnceLock<Tensor>,
}

impl VarSlot {
    fn ty(&self) -> TensorType {
        match (&self.device, self.host.get()) {
            (Some(d), _) => d.ty(),
            (None, Some(h)) => h.ty(),
            (None, None) => unreachable!("a variable slot holds a value on the device or the host"),
        }
    }
}

/// A convolution's workspace may raise its step's planned peak by this fraction of
/// the arena: a quarter keeps the f32 training step's Winograd algorithms (twice as
/// fast as the next, for hundreds of MiB the backward pass has free) and passes over
/// the inference step's (whose arena is two activations).
const WORKSPACE_MAY_GROW: usize = 4;

/// A step's memory plan as the executor uses it, with the step's schedule (both made
/// once per graph and fetches: the host work before a step's first launch is time the
/// GPU waits).
struct StepMemory {
    /// Whether a whole step has run with this plan: its convolution algorithms are
    /// chosen and its memory allocated.
    steady: std::sync::atomic::AtomicBool,
    /// The nodes the step runs, in order, with their values' reads: first the
    /// variables only casts read (`cast_only`) with those casts, before the arena is
    /// taken, so a first step drops such a variable's copy before its tensors arrive.
    schedule: Schedule,
    /// How many nodes of the order run before the arena: the `cast_only` variables
    /// and their casts.
    before_arena: usize,
    /// Each of those nodes lowered, in the same order.
    lowered: Vec<Lowered>,
    /// The Variable each AssignVariable among them writes, by position.
    assigns: HashMap<NodeId, String>,
    /// Each planned tensor's byte offset in the arena.
    offsets: HashMap<Port, usize>,
    /// The scratch of each node whose kernels took some in an earlier step: where it
    /// lies in the arena, offset and bytes.
    scratch: HashMap<NodeId, (usize, usize)>,
    arena_bytes: usize,
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
    /// Those updates' cast outputs, with the variable's name.
    cast_outputs: HashMap<Port, String>,
}

impl StepMemory {
    /// The plan of a run of `fetches` from `graph`, every node lowered, with
    /// `scratch_bytes` of scratch for the nodes that take some and the workspace room
    /// of an earlier plan of the step (`None`: this plan's); refuses a node no kernel
    /// takes.
    fn new(
        graph: &Graph,
        fetches: &[Port],
        scratch_bytes: HashMap<NodeId, usize>,
        workspace_room: Option<HashMap<NodeId, usize>>,
    ) -> Result<StepMemory, ExecError> {
        let mut schedule = Schedule::new(graph, fetches)?;
        let casts = memory_plan::constant_casts(graph);
        let cast_only_vars = memory_plan::read_only_through_casts(graph, fetches, &casts);
        // Neither those variables nor their casts are in the arena: running them first
        // moves no arena tensor's place in the order the plan counts steps by.
        let reads_cast_only = |id: &NodeId| {
            (graph.inputs(*id).first()).is_some_and(|x| cast_only_vars.contains(&x.node))
        };
        let their_casts: HashSet<NodeId> = (casts.iter())
            .map(|(cast, _)| cast.node)
            .filter(reads_cast_only)
            .collect();
        let (mut order, rest): (Vec<NodeId>, Vec<NodeId>) = (schedule.order.iter())
            .partition(|id| cast_only_vars.contains(id) || their_casts.contains(id));
        let before_arena = order.len();
        order.extend(rest);
        schedule.order = order;
        let lowered = schedule
            .order
            .iter()
            .map(|&id| lower(graph, id))
            .collect::<Result<Vec<_>, _>>()?;
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
        for (cast, var, out) in memory_plan::update_casts(graph) {
            update_casts.insert(cast, var.clone());
            cast_outputs.insert(out, var);
        }
        // Kept values live beyond the step, outside the arena.
        let outside = constant_casts
            .keys()
            .chain(update_casts.keys())
            .chain(cast_outputs.keys())
            .copied()
            .collect();
        let plan = memory_plan::plan_outside(graph, fetches, &outside, &scratch_bytes)?;
        // The room is the first plan's (without scratch), the same from step to step:
        // it keys the algorithms chosen.
        let workspace_room = workspace_room.unwrap_or_else(|| {
            (plan.headroom().into_iter())
                .map(|(id, free)| (id, free + plan.arena_bytes / WORKSPACE_MAY_GROW))
                .collect()
        });
        log::debug!(
            "memory plan: {} tensors in an arena of {} bytes ({} apart)",
            plan.buffers.len(),
            plan.arena_bytes,
            plan.total_bytes
        );
        let in_place = memory_plan::in_place_updates(graph, fetches)?
            .into_iter()
            .map(|(port, var)| (port, graph.node(var).name.clone()))
            .collect();
        Ok(StepMemory {
            steady: Default::default(),
            schedule,
            before_arena,
            lowered,
            assigns,
            offsets: plan.offsets(),
            scratch: plan.scratch(),
            arena_bytes: plan.arena_bytes,
            workspace_room,
            largest_at_peak: plan.largest_at_peak(graph, 3),
            in_place,
            constant_casts,
            cast_only,
            update_casts,
            cast_outputs,
        })
    }
}

/// Node `id` of `graph` lowered, or an error naming it.
fn lower(graph: &Graph, id: NodeId) -> Result<Lowered, ExecError> {
    let node = graph.node(id);
    let inputs: Vec<TensorType> = graph
        .inputs(id)
        .iter()
        .map(|&p| graph.ty(p).clone())
        .collect();
    kernels::lower(node.op.as_ref(), &inputs, node.outputs())
        .map_err(|msg| ExecError::node(&node.name, node.op.name(), msg))
}

/// A plan with the graph revision and fetches it was last used for.
type LastPlan = ((u64, u64), Vec<Port>, Arc<StepMemory>);

/// Runs graphs on one CUDA device.
pub struct CudaExecutor {
    dev: Device,
    gemm: Gemm,
    dnn: Dnn,
    pub options: CudaOptions,
    variables: HashMap<String, VarSlot>,
    /// Uploaded Consts (and Group's `true`) by node name, with the value they hold.
    consts: HashMap<String, (Tensor, DTensor)>,
    /// The largest tensor one op may produce, in bytes.
    pub max_tensor_bytes: u64,
    /// Per-op times, filled while `options.profile` is on.
    pub profile: OpProfile,
    /// Memory plans by [`memory_plan::fingerprint`] of the graph and fetches.
    plans: HashMap<u64, Arc<StepMemory>>,
    /// The last plan used, by the graph's [`Graph::revision`] and the fetches: a
    /// training loop's steps skip hashing the graph (tens of microseconds of host
    /// time before the step's first launch, while the GPU waits).
    last_plan: Option<LastPlan>,
    /// The arena every step's planned tensors live in (as large as the largest plan).
    arena: Option<DTensor>,
    /// Casts of variables by (variable, dtype), kept until the variable is written:
    /// an inference step casts its weights once, not every step.
    cast_cache: HashMap<(String, DType), DTensor>,
    /// Feeds copied to the device while the step before them runs.
    staging: staging::Staging,
    /// The events timing a step, reused.
    step_events: Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    /// The communicator of the data-parallel group this replica joined.
    nccl: Option<nccl::Nccl>,
}

/// Uploads a fed or held value (`kind` "feed" or "variable"), an error naming it.
fn upload_value(
    dev: &Device,
    t: &Tensor,
    kind: &'static str,
    name: &str,
) -> Result<DTensor, ExecError> {
    guard("CUDA", || dev.upload(t, &Owner(kind, name))).map_err(|msg| ExecError::Feed {
        name: name.into(),
        msg,
    })
}

fn dev_err(msg: String) -> ExecError {
    ExecError::Device(msg)
}

impl CudaExecutor {
    /// An executor on device `ordinal`, or a clear error where CUDA cannot be used.
    pub fn new(ordinal: usize) -> Result<CudaExecutor, ExecError> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<CudaExecutor, ExecError> {
        Self::with_kernel_cache(ordinal, options, &kernel_cache::KernelCache::FromEnv)
    }

    /// As [`with_options`](Self::with_options), keeping compiled kernels where `cache`
    /// says rather than where the environment does.
    pub fn with_kernel_cache(
        ordinal: usize,
        options: CudaOptions,
        cache: &kernel_cache::KernelCache,
    ) -> Result<CudaExecutor, ExecError> {
        let count = available().map_err(|e| dev_err(format!("CUDA is not available: {e}")))?;
        if ordinal >= count {
            return Err(dev_err(format!(
                "CUDA device {ordinal} was asked for, but there {} only {count}",
                if count == 1 { "is" } else { "are" }
            )));
        }
        let disk = kernel_cache::DiskCache::new(cache);
        let (dev, gemm) = guard("CUDA", || {
            let dev = Device::new(ordinal, disk.clone())?;
            let gemm = Gemm::new(&dev)?;
            Ok((dev, gemm))
        })
        .map_err(dev_err)?;
        let dnn = Dnn::new(&dev, disk.dir());
        log::info!("CUDA executor on device {ordinal}: {}", dev.name);
        Ok(CudaExecutor {
            dev,
            gemm,
            dnn,
            options,
            variables: HashMap::new(),
            consts: HashMap::new(),
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            profile: OpProfile::default(),
            plans: HashMap::new(),
            last_plan: None,
            arena: None,
            cast_cache: HashMap::new(),
            staging: staging::Staging::default(),
            step_events: None,
            nccl: None,
        })
    }

    /// The memory plan of a run of `fetches` from `graph`, made on first use.
    fn step_memory(
        &mut self,
        graph: &Graph,
        fetches: &[Port],
    ) -> Result<Arc<StepMemory>, ExecError> {
        if let Some((revision, last_fetches, m)) = &self.last_plan {
            if *revision == graph.revision() && last_fetches == fetches {
                return Ok(m.clone());
            }
        }
        let key = memory_plan::fingerprint(graph, fetches);
        let m = match self.plans.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(StepMemory::new(graph, fetches, HashMap::new(), None)?);
                self.plans.insert(key, m.clone());
                m
            }
        };
        self.last_plan = Some((graph.revision(), fetches.to_vec(), m.clone()));
        Ok(m)
    }

    /// Plans again the step `memory` planned, with the scratch nodes took beyond it
    /// (`grown`), for the next step: its kernels' temporaries and cuDNN's workspaces
    /// then lie in the arena beside the tensors alive at their step, and the
    /// workspace shared until then goes.
    fn replan(
        &mut self,
        graph: &Graph,
        fetches: &[Port],
        memory: &StepMemory,
        grown: HashMap<NodeId, usize>,
    ) -> Result<(), ExecError> {
        let mut scratch: HashMap<NodeId, usize> = (memory.scratch.iter())
            .map(|(&id, &(_, bytes))| (id, bytes))
            .collect();
        scratch.extend(grown);
        let room = Some(memory.workspace_room.clone());
        let m = Arc::new(StepMemory::new(graph, fetches, scratch, room)?);
        self.plans
            .insert(memory_plan::fingerprint(graph, fetches), m.clone());
        self.last_plan = Some((graph.revision(), fetches.to_vec(), m));
        self.dnn.release_workspace();
        Ok(())
    }

    /// The arena, grown to at least `bytes`.
    fn arena(&mut self, bytes: usize) -> Result<Option<DTensor>, ExecError> {
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

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.dev.ctx.ordinal()
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// The GPU's memory in bytes.
    pub fn device_bytes(&self) -> usize {
        self.dev.total_bytes
    }

    /// [`Executor::run`], also returning the step's milliseconds on the device: CUDA
    /// events recorded on the stream before the step's first launch and after its last
    /// kernel, before the fetches' download (as `torch.cuda.Event`s around a PyTorch
    /// step, whose loss stays on the device).
    pub fn run_timed(
        &mut self,
        graph: &Graph,
        feeds: &Feeds,
        fetches: &[Port],
    ) -> Result<(Vec<Tensor>, f64), ExecError> {
        let (out, ms, _) = self.timed(|e, done| {
            let out = e.run_step(graph, feeds, fetches, Some(done), None)?;
            Ok((out.0, None))
        })?;
        Ok((out, ms))
    }

    /// `step` between two CUDA events; its milliseconds on the device.
    fn timed(
        &mut self,
        step: impl FnOnce(
            &mut Self,
            &cudarc::driver::CudaEvent,
        ) -> Result<(Vec<Tensor>, Option<Staged>), ExecError>,
    ) -> Result<(Vec<Tensor>, f64, Option<Staged>), ExecError> {
        // Made before the first is recorded (creating one takes host time the
        // measurement would count), and kept for the next step (a training loop
        // would otherwise create and destroy two per step between its steps).
        let (start, end) = match self.step_events.take() {
            Some(events) => events,
            None => {
                guard("CUDA", || Ok((self.dev.event()?, self.dev.event()?))).map_err(dev_err)?
            }
        };
        guard("CUDA", || self.dev.record(&start)).map_err(dev_err)?;
        let (out, next) = step(self, &end)?;
        let ms = guard("CUDA", || {
            start
                .elapsed_ms(&end)
                .map_err(|e| format!("timing events: {e:?}"))
        })
        .map_err(dev_err)?;
        self.step_events = Some((start, end));
        Ok((out, f64::from(ms), next))
    }

    /// Work put on the stream so far (kernels, cuBLASLt calls, memsets, copies); the
    /// difference of two snapshots counts a step's launches.
    pub fn launches(&self) -> LaunchCounts {
        self.dev.launches.snapshot()
    }

    /// The cuDNN convolution algorithms chosen so far (each also logged at info level).
    pub fn conv_algorithms(&self) -> Vec<ConvAlgorithm> {
        self.dnn.choices()
    }

    /// The most bytes of device tensors (variables and the arena included) allocated
    /// at once since the executor was made or [`reset_peak_bytes`](Self::reset_peak_bytes).
    pub fn peak_bytes(&self) -> usize {
        self.dev.pool.lock().map(|p| p.peak).unwrap_or(0)
    }

    /// Each node's scratch bytes in the last step's plan (kernels' temporaries,
    /// cuDNN's workspaces): planned from the scratch the nodes took in a step before.
    pub fn planned_scratch(&self) -> HashMap<NodeId, usize> {
        let plan = self.last_plan.as_ref().map(|(_, _, m)| m);
        (plan.iter().flat_map(|m| &m.scratch))
            .map(|(&id, &(_, bytes))| (id, bytes))
            .collect()
    }

    /// Bytes of the cuDNN workspace shared outside the plan: a convolution's until the
    /// plan holds its scratch (after its first step), 0 after.
    pub fn shared_conv_workspace_bytes(&self) -> usize {
        self.dnn.shared_workspace_bytes()
    }

    /// Device bytes held by live tensors now (variables, kept casts, the arena).
    pub fn live_bytes(&self) -> usize {
        self.dev.pool.lock().map(|p| p.live).unwrap_or(0)
    }

    /// Starts [`peak_bytes`](Self::peak_bytes) again from what is live now (as
    /// PyTorch's `torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_bytes(&self) {
        if let Ok(mut p) = self.dev.pool.lock() {
            p.peak = p.live;
        }
    }

    /// Refuses a graph with a node no CUDA kernel takes, naming the first such node
    /// (the lowering a step's plan makes; no device needed).
    pub fn check_supported(graph: &Graph) -> Result<(), ExecError> {
        for id in graph.node_ids() {
            lower(graph, id)?;
        }
        Ok(())
    }

    /// Names of the variables this executor holds.
    pub fn variable_names(&self) -> Vec<String> {
        self.variables.keys().cloned().collect()
    }

    /// A variable's type, without copying it to the host.
    pub fn variable_type(&self, name: &str) -> Option<TensorType> {
        self.variables.get(name).map(VarSlot::ty)
    }

    /// A variable's current value, copied to the host on first use after each write
    /// (a failed copy is logged and reads as `None`; [`try_variable`](Self::try_variable)
    /// returns the error).
    pub fn variable(&self, name: &str) -> Option<&Tensor> {
        match self.try_variable(name) {
            Ok(_) => self.variables.get(name)?.host.get(),
            Err(e) => {
                log::error!("{e}");
                None
            }
        }
    }

    /// A variable's current value, or the error of copying it.
    pub fn try_variable(&self, name: &str) -> Result<Option<Tensor>, ExecError> {
        let Some(slot) = self.variables.get(name) else {
            return Ok(None);
        };
        let device = match (slot.host.get(), &slot.device) {
            (Some(t), _) => return Ok(Some(t.clone())),
            (None, Some(d)) => d,
            (None, None) => unreachable!("a variable slot holds a value on the device or the host"),
        };
        let t = guard("CUDA", || self.dev.download(device)).map_err(|msg| ExecError::Feed {
            name: name.into(),
            msg,
        })?;
        let _ = slot.host.set(t.clone());
        Ok(Some(t))
    }

    /// Sets (or creates) a variable, copying the value to the device.
    pub fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), ExecError> {
        let dev = upload_value(&self.dev, &value, "variable", name)?;
        let host = OnceLock::new();
        let _ = host.set(value);
        self.variables.insert(
            name.to_string(),
            VarSlot {
                device: Some(dev),
                host,
            },
        );
        self.cast_cache.retain(|(var, _), _| var != name);
        Ok(())
    }

    /// Whether `var` is read only through casts and every one of them is kept.
    fn casts_kept(&self, memory: &StepMemory, var: NodeId) -> bool {
        memory
            .cast_only
            .get(&var)
            .is_some_and(|keys| keys.iter().all(|k| self.cast_cache.contains_key(k)))
    }

    /// The value of a source node: fed, held (a Variable) or constant.
    fn source_value(
        &mut self,
        node: &ampgraph_graph::Node,
        source: &Source,
        feeds: &Feeds,
    ) -> Result<DTensor, ExecError> {
        let want = &node.outputs()[0];
        let check = |t: &TensorType| -> Result<(), ExecError> {
            if t != want {
                return Err(ExecError::Feed {
                    name: node.name.clone(),
                    msg: format!("expects {want}, got {}{}", t.dtype, ShapeDisplay(&t.shape)),
                });
            }
            Ok(())
        };
        let host = match source {
            Source::Placeholder | Source::Variable => {
                if let Some(v) = feeds.get(&node.name) {
                    check(&v.ty())?;
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
                check(&slot.ty())?;
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
                let d = upload_value(&self.dev, host, "variable", &node.name)?;
                slot.device = Some(d.clone());
                return Ok(d);
            }
            Source::Value(host) => host,
        };
        if let Some((t, d)) = self.consts.get(&node.name) {
            // The graph's own value first: comparing a large constant's values would
            // cost host time every step.
            if t.is_clone_of(host) || t == host {
                return Ok(d.clone());
            }
        }
        let d = guard("CUDA", || self.dev.upload(host, &Owner("node", &node.name)))
            .map_err(|m| ExecError::node(&node.name, node.op.name(), m))?;
        self.consts
            .insert(node.name.clone(), (host.clone(), d.clone()));
        Ok(d)
    }
}

impl Executor for CudaExecutor {
    fn device_name(&self) -> String {
        CudaExecutor::device_name(self).to_string()
    }

    fn default_passes(&self) -> Vec<&'static str> {
        pipeline(&self.options())
    }

    fn check_supported(&self, graph: &Graph) -> Result<(), ExecError> {
        CudaExecutor::check_supported(graph)
    }

    fn options(&self) -> ExecOptions {
        ExecOptions {
            allow_tf32: self.options.gemm.allow_tf32,
            allow_fp16_reduced_precision_reduction: self
                .options
                .gemm
                .allow_fp16_reduced_precision_reduction,
            deterministic_convolutions: self.options.dnn.deterministic,
            conv_workspace_limit_mib: self.options.dnn.workspace_limit_mib,
            profile: self.options.profile,
        }
    }

    fn set_options(&mut self, options: ExecOptions) {
        self.options.gemm.allow_tf32 = options.allow_tf32;
        self.options.gemm.allow_fp16_reduced_precision_reduction =
            options.allow_fp16_reduced_precision_reduction;
        self.options.dnn.deterministic = options.deterministic_convolutions;
        self.options.dnn.workspace_limit_mib = options.conv_workspace_limit_mib;
        self.options.profile = options.profile;
    }

    fn run(&mut self, graph: &Graph, feeds: &Feeds, fetches: &[Port]) -> RunResult {
        Ok(self.run_step(graph, feeds, fetches, None, None)?.0)
    }

    fn run_overlapped(
        &mut self,
        graph: &Graph,
        current: Staged,
        fetches: &[Port],
        next: Option<Feeds>,
    ) -> Result<Overlapped, ExecError> {
        self.staging.begin(&self.dev, &current)?;
        let result =
            self.timed(|e, done| e.run_step(graph, current.feeds(), fetches, Some(done), next));
        self.staging.end(&self.dev)?;
        let (outputs, ms, next) = result?;
        Ok(Overlapped {
            outputs,
            device_ms: Some(ms),
            next,
        })
    }

    fn run_timed(&mut self, graph: &Graph, feeds: &Feeds, fetches: &[Port]) -> TimedRunResult {
        let (out, ms) = CudaExecutor::run_timed(self, graph, feeds, fetches)?;
        Ok((out, Some(ms)))
    }

    fn variable(&self, name: &str) -> Option<&Tensor> {
        CudaExecutor::variable(self, name)
    }

    fn try_variable(&self, name: &str) -> Result<Option<Tensor>, ExecError> {
        CudaExecutor::try_variable(self, name)
    }

    fn variable_type(&self, name: &str) -> Option<TensorType> {
        CudaExecutor::variable_type(self, name)
    }

    fn variable_names(&self) -> Vec<String> {
        CudaExecutor::variable_names(self)
    }

    fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), ExecError> {
        CudaExecutor::set_variable(self, name, value)
    }

    fn peak_bytes(&self) -> Option<usize> {
        Some(CudaExecutor::peak_bytes(self))
    }

    fn live_bytes(&self) -> Option<usize> {
        Some(CudaExecutor::live_bytes(self))
    }

    fn reset_peak_bytes(&self) {
        CudaExecutor::reset_peak_bytes(self)
    }

    fn join_collective(&mut self, collective: Collective) -> Result<(), ExecError> {
        let Transport::Nccl(id) = collective.transport else {
            return Err(ExecError::Collective(
                "a CUDA replica reduces through NCCL, not host memory".into(),
            ));
        };
        let comm = nccl::Nccl::new(&self.dev, &collective, id)
            .map_err(|e| ExecError::Collective(format!("replica {}: {e}", collective.rank)))?;
        self.nccl = Some(comm);
        Ok(())
    }

    fn planned_scratch(&self) -> Option<HashMap<NodeId, usize>> {
        Some(CudaExecutor::planned_scratch(self))
    }

    fn launches(&self) -> Option<LaunchCounts> {
        Some(CudaExecutor::launches(self))
    }

    fn profile_table(&self, top: usize) -> Option<String> {
        Some(self.profile.table(top))
    }
}

impl CudaExecutor {
    /// A step; `done`, if given, is recorded on the stream after its kernels and
    /// before the fetches' download, and `next` is staged while the kernels run.
    fn run_step(
        &mut self,
        graph: &Graph,
        feeds: &Feeds,
        fetches: &[Port],
        done: Option<&cudarc::driver::CudaEvent>,
        next: Option<Feeds>,
    ) -> Result<(Vec<Tensor>, Option<Staged>), ExecError> {
        guard("CUDA", || {
            self.dev
                .ctx
                .bind_to_thread()
                .map_err(|e| format!("CUDA context: {e:?}"))
        })
        .map_err(dev_err)?;
        // Profiling only: the step's first event and the host clock beside it.
        let step_start = self
            .options
            .profile
            .then(|| guard("CUDA", || self.dev.timing_event()))
            .transpose()
            .map_err(dev_err)?
            .map(|event| (event, std::time::Instant::now()));
        let memory = self.step_memory(graph, fetches)?;
        let steady = memory.steady.load(std::sync::atomic::Ordering::Relaxed);
        let mut schedule = memory.schedule.clone();
        let order = std::mem::take(&mut schedule.order);
        let mut arena = None;
        let mut values: HashMap<NodeId, Vec<DTensor>> = HashMap::new();
        let mut writes: Vec<(String, DTensor)> = Vec::new();
        // Casts optimizer updates wrote of their new values, by variable.
        let mut written_casts: Vec<(String, DTensor)> = Vec::new();
        let mut timed = Vec::new();
        // Nodes that took more scratch than the plan holds for them.
        let mut grown: HashMap<NodeId, usize> = HashMap::new();
        // Collectives still running on their stream: the events their readers wait
        // for, and their inputs, kept from the pool until then.
        let mut joins: HashMap<NodeId, (Vec<cudarc::driver::CudaEvent>, Vec<DTensor>)> =
            HashMap::new();
        for (position, (&id, lowered)) in order.iter().zip(&memory.lowered).enumerate() {
            if position == memory.before_arena {
                // Before any launch but the casts of variables only they read: a step
                // whose tensors do not fit fails at once.
                arena = self.arena(memory.arena_bytes).map_err(|e| {
                    ExecError::Memory(format!(
                        "the step's tensors need an arena of {:.1} MiB on the device ({e}); the largest alive at once: {}",
                        memory_plan::mib(memory.arena_bytes),
                        memory.largest_at_peak
                    ))
                })?;
            }
            let node = graph.node(id);
            let op = node.op.name();
            for ty in node.outputs() {
                check_tensor_size(&node.name, op, ty, self.max_tensor_bytes)?;
            }
            if !feeds.contains_key(&node.name) && self.casts_kept(&memory, id) {
                continue;
            }
            // A cast of an unfed variable kept from an earlier step: one no step
            // writes, or one an update wrote together with its cast.
            let port = Port::new(id, 0);
            let constant = memory.constant_casts.get(&port);
            let cast_key = constant
                .or(memory.update_casts.get(&port))
                .filter(|var| !feeds.contains_key(var.as_str()))
                .map(|var| (var.clone(), node.outputs()[0].dtype));
            let kept = cast_key
                .as_ref()
                .and_then(|k| self.cast_cache.get(k))
                .cloned();
            // Only a constant cast computed now holds for later steps.
            let keep = cast_key.filter(|_| kept.is_none() && constant.is_some());
            let outputs = match (kept, lowered) {
                (Some(t), _) => vec![t],
                (None, Lowered::Source(source)) => vec![self.source_value(node, source, feeds)?],
                (None, Lowered::Kernel(kernel)) => {
                    let inputs: Vec<DTensor> = graph
                        .inputs(id)
                        .iter()
                        .map(|p| values[&p.node][p.index].clone())
                        .collect();
                    let planned: Vec<Option<DTensor>> = node
                        .outputs()
                        .iter()
                        .enumerate()
                        .map(|(k, ty)| {
                            let port = Port::new(id, k);
                            if let Some(var) = memory.in_place.get(&port) {
                                return Ok(self.variables.get(var).and_then(|v| v.device.clone()));
                            }
                            match (&arena, memory.offsets.get(&port)) {
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
                    let planned_scratch = memory.scratch.get(&id).copied();
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
                        dnn_options: self.options.dnn,
                        name: &node.name,
                        planned: &planned,
                        allocated: Cell::new(0),
                        scratch,
                        scratch_used: Cell::new(0),
                        workspace_room: memory.workspace_room.get(&id).copied(),
                        collective: self.nccl.as_ref(),
                        joins: RefCell::new(Vec::new()),
                    };
                    // Only a profiled step brackets each op with timing events.
                    let out = guard("CUDA", || {
                        let start = self
                            .options
                            .profile
                            .then(|| self.dev.timing_event())
                            .transpose()?
                            .map(|event| (event, std::time::Instant::now()));
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
                        if let Some((start, host)) = start {
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
                    if let (Some(nccl), false) = (&self.nccl, events.is_empty() || steady) {
                        // A plan's first steps choose convolution algorithms and
                        // allocate, which may wait for the whole device: no collective
                        // is left running then, or two replicas could wait for each
                        // other through their NCCL kernels.
                        for e in &events {
                            nccl.wait(e, "an all-reduce")
                                .map_err(ExecError::Collective)?;
                        }
                    }
                    if !events.is_empty() {
                        joins.insert(id, (events, inputs));
                    }
                    let used = ctx.scratch_used.get();
                    if used > planned_scratch.map_or(0, |(_, bytes)| bytes) {
                        grown.insert(id, used);
                    }
                    out
                }
            };
            check_outputs(node, outputs.iter().map(|t| t.ty()))?;
            if let Some(key) = keep {
                self.cast_cache.insert(key, outputs[0].clone());
                let var = graph.inputs(id)[0].node;
                self.drop_cast_only_copy(&memory, graph, feeds, var);
            }
            if let Some(variable) = memory.assigns.get(&id) {
                writes.push((variable.clone(), outputs[0].clone()));
            }
            for (k, out) in outputs.iter().enumerate() {
                if let Some(var) = memory.cast_outputs.get(&Port::new(id, k)) {
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
        if let Some((step_start, host_start)) = step_start {
            self.profile.host_secs += host_start.elapsed().as_secs_f64();
            let step_end = guard("CUDA", || self.dev.timing_event()).map_err(dev_err)?;
            let elapsed = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
                a.elapsed_ms(b)
                    .map_err(|e| ExecError::Device(format!("CUDA timing event: {e:?}")))
            };
            self.profile.steps += 1;
            self.profile.step_secs += f64::from(elapsed(&step_start, &step_end)?) / 1e3;
            for (key, start, end, host_secs) in timed {
                let device_secs = f64::from(elapsed(&start, &end)?) / 1e3;
                self.profile.add(key, device_secs, host_secs);
            }
        }
        // What to download; the rest of the step's values go back now.
        let fetched: Vec<(&str, &str, DTensor)> = fetches
            .iter()
            .map(|p| {
                let node = graph.node(p.node);
                (
                    node.name.as_str(),
                    node.op.name(),
                    values[&p.node][p.index].clone(),
                )
            })
            .collect();
        drop(values);
        if let Some(e) = done {
            guard("CUDA", || self.dev.record(e)).map_err(dev_err)?;
        }
        self.commit(&memory, graph, feeds, writes, written_casts);
        memory
            .steady
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if !grown.is_empty() {
            self.replan(graph, fetches, &memory, grown)?;
        }
        let next = next
            .map(|feeds| self.staging.stage(&self.dev, graph, feeds))
            .transpose()?;
        // A replica waits for its step polling, so that a failed peer or a timeout
        // ends the wait rather than hanging in the driver.
        if let Some(nccl) = &self.nccl {
            let end = guard("CUDA", || self.dev.timing_event()).map_err(dev_err)?;
            nccl.wait(&end, "the end of its step")
                .map_err(ExecError::Collective)?;
        }
        // Last: the download waits for the stream, and the host work above ran
        // while the GPU was still busy with the step.
        let outputs = fetched
            .into_iter()
            .map(|(name, op, d)| {
                guard("CUDA", || self.dev.download(&d)).map_err(|m| ExecError::node(name, op, m))
            })
            .collect::<Result<_, _>>()?;
        Ok((outputs, next))
    }

    /// Makes the compute stream wait for work on other streams (collectives).
    fn join(&self, events: &[cudarc::driver::CudaEvent]) -> Result<(), ExecError> {
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
        memory: &StepMemory,
        graph: &Graph,
        feeds: &Feeds,
        writes: Vec<(String, DTensor)>,
        written_casts: Vec<(String, DTensor)>,
    ) {
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
        for &var in memory.cast_only.keys() {
            self.drop_cast_only_copy(memory, graph, feeds, var);
        }
    }

    /// Drops the device copy of `var` if only casts read it, every one of them is
    /// kept, it was not fed, and its host copy is current: the step and the next
    /// read the casts (the pool frees the copy after its last read in this step).
    fn drop_cast_only_copy(
        &mut self,
        memory: &StepMemory,
        graph: &Graph,
        feeds: &Feeds,
        var: NodeId,
    ) {
        let name = &graph.node(var).name;
        if feeds.contains_key(name) || !self.casts_kept(memory, var) {
            return;
        }
        if let Some(slot) = self.variables.get_mut(name) {
            if slot.host.get().is_some() {
                slot.device = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OpProfile;

    #[test]
    fn the_profile_table_ranks_kinds_of_op_by_time() {
        let mut p = OpProfile::default();
        p.add("MatMul f16[8, 8]".into(), 0.003, 0.001);
        p.add("Relu f16[8, 8]".into(), 0.001, 0.0);
        p.add("MatMul f16[8, 8]".into(), 0.003, 0.001);
        p.add("Cast f32[8]".into(), 0.002, 0.0005);
        let table = p.table(2);
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows[3], "| all | 4 | 9.000 | 2.500 | 100.0% |");
        assert_eq!(rows[4], "| MatMul f16[8, 8] | 2 | 6.000 | 2.000 | 66.7% |");
        assert_eq!(rows[5], "| Cast f32[8] | 1 | 2.000 | 0.500 | 22.2% |");
        assert_eq!(rows.len(), 6, "only the top 2 kinds:\n{table}");
    }
}
