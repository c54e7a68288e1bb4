//! The CUDA executor: tensors on one GPU, GEMMs through cuBLASLt, convolutions, pooling
//! and batch normalisation through cuDNN, every other op as NVRTC kernels generated
//! per (op, dtype) and compiled once per process.
//!
//! CUDA is loaded at run time (`cudarc`'s dynamic loading): the crate builds and runs
//! on machines without it, and [`available`] says why CUDA cannot be used there. No
//! cudarc panic reaches a caller: the libraries are checked for before first use and
//! CUDA calls that could panic run under a guard.
//!
//! A step is planned once per graph and fetches (`step.rs`: kernels lowered, the arena's
//! offsets, constants uploaded), bound to its feeds, launched (op by op, or replayed as
//! one CUDA graph once its buffers have settled: `replay.rs`) and committed.
//!
//! Variables live on the device across runs; `AssignVariable` writes replace them when
//! the step ends. Host copies of variables ([`CudaExecutor::variable`]) are downloaded
//! on demand and cached until the next write. A step's intermediate tensors live in
//! one arena, each at the offset the step's memory plan ([`crate::memory_plan`])
//! gave it. Fed values, the values assignments write and kernels' scratch come from a
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
mod replay;
mod staging;
mod step;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use ampgraph_graph::{DType, Graph, NodeId, Port, Tensor, TensorType};

use crate::collective::{Collective, Transport};
use crate::{
    DeviceStats, ExecError, ExecOptions, Executor, Feeds, Overlapped, RunResult, Staged,
    TimedRunResult, DEFAULT_MAX_TENSOR_BYTES,
};

pub use device::LaunchCounts;
use device::{guard, DTensor, Device};
use dnn::Dnn;
pub use dnn::{Choice as ConvAlgorithm, DnnOptions};
use gemm::Gemm;
pub use gemm::GemmOptions;
use kernels::Owner;
pub use pipeline::{pipeline, pipeline_names};
use replay::StepGraph;
pub use replay::StepLaunch;
use step::StepPlan;

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
        for (key, e) in rows.iter().take(top) {
            out.push_str(&row(key, e));
        }
        // The same times by kind of op alone (the key's first word), every kind.
        let mut kinds: HashMap<&str, OpTimes> = HashMap::new();
        for (key, e) in &rows {
            let k = kinds
                .entry(key.split(' ').next().unwrap_or(key))
                .or_default();
            k.calls += e.calls;
            k.device_secs += e.device_secs;
            k.host_secs += e.host_secs;
        }
        let mut kinds: Vec<(&str, OpTimes)> = kinds.into_iter().collect();
        kinds.sort_by(|a, b| b.1.device_secs.total_cmp(&a.1.device_secs));
        out.push_str("\n| op | calls | device ms | host ms | share |\n|---|---|---|---|---|\n");
        for (kind, e) in &kinds {
            out.push_str(&row(kind, e));
        }
        out
    }
}

/// A variable's value on the device and its host copy, at least one of them present.
/// The host copy, once set, is current; the device copy is dropped only while it is
/// (a variable only kept casts read: [`StepLayout::cast_only`](crate::memory_plan::StepLayout)).
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

/// Runs graphs on one CUDA device.
pub struct CudaExecutor {
    dev: Device,
    gemm: Gemm,
    dnn: Dnn,
    pub options: ExecOptions,
    variables: HashMap<String, VarSlot>,
    /// The largest tensor one op may produce, in bytes.
    pub max_tensor_bytes: u64,
    /// Per-op times, filled while `options.profile` is on.
    pub profile: OpProfile,
    /// Step plans by graph revision and fetches, the most recently used first.
    plans: Vec<(step::PlanKey, Arc<StepPlan>)>,
    /// Steps captured as CUDA graphs, by their plan's id. Declared before `nccl`, so
    /// dropped first: destroying a communicator waits until no graph holds its
    /// collectives.
    step_graphs: HashMap<u64, StepGraph>,
    /// Moves on whenever a variable or a kept cast changes buffer: graphs captured
    /// before read the old ones.
    state_epoch: u64,
    /// How the last step was launched.
    step_launch: StepLaunch,
    /// Host seconds the last step took from its call to its last launch (before the
    /// fetches' download): what the host adds to a step whose GPU is waiting.
    host_enqueue_secs: f64,
    /// The arena every step's planned tensors live in (as large as the largest plan).
    arena: Option<DTensor>,
    /// Casts of variables by (variable, dtype), kept until the variable is written:
    /// an inference step casts its weights once, not every step.
    cast_cache: HashMap<(String, DType), DTensor>,
    /// Feeds copied to the device while the step before them runs.
    staging: staging::Staging,
    /// The events timing a step, reused.
    step_events: Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    /// The communicator of the data-parallel group this replica joined (after
    /// `step_graphs`: see there).
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
        Self::with_options(ordinal, ExecOptions::default())
    }

    pub fn with_options(ordinal: usize, options: ExecOptions) -> Result<CudaExecutor, ExecError> {
        Self::with_kernel_cache(ordinal, options, &kernel_cache::KernelCache::FromEnv)
    }

    /// As [`with_options`](Self::with_options), keeping compiled kernels where `cache`
    /// says rather than where the environment does.
    pub fn with_kernel_cache(
        ordinal: usize,
        options: ExecOptions,
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
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            profile: OpProfile::default(),
            plans: Vec::new(),
            step_graphs: HashMap::new(),
            state_epoch: 0,
            step_launch: StepLaunch::None,
            host_enqueue_secs: 0.0,
            arena: None,
            cast_cache: HashMap::new(),
            staging: staging::Staging::default(),
            step_events: None,
            nccl: None,
        })
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

    /// The cuDNN convolution algorithms chosen so far (each also logged at info level).
    pub fn conv_algorithms(&self) -> Vec<ConvAlgorithm> {
        self.dnn.choices()
    }

    /// Bytes of the cuDNN workspace shared outside the plan: a convolution's until the
    /// plan holds its scratch (after its first step), 0 after.
    pub fn shared_conv_workspace_bytes(&self) -> usize {
        self.dnn.shared_workspace_bytes()
    }

    /// Refuses a graph with a node no CUDA kernel takes, naming the first such node
    /// (the lowering a step's plan makes; no device needed).
    pub fn check_supported(graph: &Graph) -> Result<(), ExecError> {
        for id in graph.node_ids() {
            step::lower(graph, id)?;
        }
        Ok(())
    }

    /// How the last step's kernels reached the GPU: replayed as its CUDA graph, or op
    /// by op and why.
    pub fn step_launch(&self) -> &StepLaunch {
        &self.step_launch
    }

    /// Host seconds the last step took from its call until its last launch was on the
    /// stream (its feeds bound, its kernels or graph launched), before the fetches'
    /// download.
    pub fn host_enqueue_secs(&self) -> f64 {
        self.host_enqueue_secs
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
        self.state_changed();
        Ok(())
    }
}

impl Executor for CudaExecutor {
    fn device_name(&self) -> String {
        CudaExecutor::device_name(self).to_string()
    }

    fn passes(&self) -> Vec<Box<dyn ampgraph_passes::Pass>> {
        pipeline(&self.options())
    }

    fn check_supported(&self, graph: &Graph) -> Result<(), ExecError> {
        CudaExecutor::check_supported(graph)
    }

    fn options(&self) -> ExecOptions {
        self.options
    }

    fn set_options(&mut self, options: ExecOptions) {
        self.options = options;
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

    fn stats(&self) -> Option<&dyn DeviceStats> {
        Some(self)
    }
}

impl DeviceStats for CudaExecutor {
    fn peak_bytes(&self) -> usize {
        self.dev.pool.lock().map(|p| p.peak).unwrap_or(0)
    }

    fn live_bytes(&self) -> usize {
        self.dev.pool.lock().map(|p| p.live).unwrap_or(0)
    }

    fn reset_peak_bytes(&self) {
        if let Ok(mut p) = self.dev.pool.lock() {
            p.peak = p.live;
        }
    }

    fn planned_scratch(&self) -> HashMap<NodeId, usize> {
        let plan = self.plans.first().map(|(_, plan)| plan);
        (plan.iter().flat_map(|m| &m.scratch))
            .map(|(&id, &(_, bytes))| (id, bytes))
            .collect()
    }

    fn launches(&self) -> LaunchCounts {
        self.dev.launches.snapshot()
    }

    fn profile_table(&self, top: usize) -> String {
        self.profile.table(top)
    }

    fn last_step(&self) -> crate::StepReport {
        crate::StepReport {
            host_enqueue_secs: self.host_enqueue_secs,
            launch: self.step_launch.to_string(),
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
        assert_eq!(rows[6], "", "only the top 2 kinds:\n{table}");
        assert_eq!(rows[9], "| MatMul | 2 | 6.000 | 2.000 | 66.7% |");
        assert_eq!(rows[10], "| Cast | 1 | 2.000 | 0.500 | 22.2% |");
        assert_eq!(rows[11], "| Relu | 1 | 1.000 | 0.000 | 11.1% |");
        assert_eq!(rows.len(), 12, "every kind of op:\n{table}");
    }
}
