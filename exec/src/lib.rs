//! ampgraph-exec: executors that run a graph ([`ampgraph_graph::Graph`]).
//!
//! [`CpuExecutor`] is the reference backend and the embedded default: every op's CPU
//! kernel, in the op's own file in `ampgraph-graph`, run in topological order with
//! tensors freed after their last use. [`cuda::CudaExecutor`] runs the same graphs on
//! a GPU (CUDA loaded at run time; [`cuda::available`] says whether it can be used).

pub mod collective;
mod cpu;
pub mod cuda;
pub mod feeds;
pub mod gradcheck;
pub use ampgraph_graph::host_memory;
pub mod memory_plan;
mod schedule;

use std::collections::HashMap;

use ampgraph_graph::{Graph, GraphError, NodeId, Port, Tensor, TensorType};
use thiserror::Error;

pub use collective::Collective;
pub use cpu::{check_tensor_size, CpuExecutor, Evaluated, DEFAULT_MAX_TENSOR_BYTES};
pub use cuda::kernel_cache::KernelCache;
pub use cuda::{CudaExecutor, LaunchCounts};

#[derive(Debug, Error)]
pub enum ExecError {
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("feed '{name}': {msg}")]
    Feed { name: String, msg: String },
    /// The device could not be used (no CUDA, a driver failure).
    #[error("device: {0}")]
    Device(String),
    /// A run that cannot fit the memory there is, refused before it computes.
    #[error("out of memory: {0}")]
    Memory(String),
    /// A collective of a data-parallel step failed, timed out or was aborted by
    /// another replica's failure.
    #[error("{0}")]
    Collective(String),
}

impl ExecError {
    pub fn node(node: &str, op: &str, msg: impl Into<String>) -> Self {
        ExecError::Node {
            node: node.to_string(),
            op: op.to_string(),
            msg: msg.into(),
        }
    }
}

/// What a run returns: the fetched tensors, in the order of the fetches.
pub type RunResult = Result<Vec<Tensor>, ExecError>;

/// A run's tensors and, where the backend times it on the device, its milliseconds.
pub type TimedRunResult = Result<(Vec<Tensor>, Option<f64>), ExecError>;

/// Values given to a run, by node name: Placeholders (and Variables, to override).
pub type Feeds = HashMap<String, Tensor>;

/// A run's feeds, whose copies to the device may be under way already: made by
/// [`Staged::host`] for a first step, and by [`Executor::run_overlapped`] for the
/// step after the one it runs.
#[derive(Debug)]
pub struct Staged {
    feeds: Feeds,
    /// The executor's number for the copies it started; 0: none started.
    ticket: u64,
}

impl Staged {
    /// Feeds the step will upload itself.
    pub fn host(feeds: Feeds) -> Staged {
        Staged { feeds, ticket: 0 }
    }

    pub(crate) fn on_device(feeds: Feeds, ticket: u64) -> Staged {
        Staged { feeds, ticket }
    }

    pub(crate) fn ticket(&self) -> u64 {
        self.ticket
    }

    /// The host values (the step checks their types, and a backend without staging
    /// runs on them).
    pub fn feeds(&self) -> &Feeds {
        &self.feeds
    }
}

/// What [`Executor::run_overlapped`] returns.
#[derive(Debug)]
pub struct Overlapped {
    /// The fetched tensors, in the order of the fetches.
    pub outputs: Vec<Tensor>,
    /// The step's milliseconds on the device, where the backend times it.
    pub device_ms: Option<f64>,
    /// The next step's feeds, on their way to the device.
    pub next: Option<Staged>,
}

/// An executor's switches: one type for every backend, handed to the kernels as it
/// is (PyTorch's names). A backend ignores what it has no use for: the CPU the
/// matrix-product and convolution switches (its f32 products are plain f32 and its
/// 16-bit products accumulate in f32, whatever these say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// Matrix products: TF32, f16 accumulation, autotuning.
    pub gemm: cuda::GemmOptions,
    /// Convolutions: deterministic algorithms, the workspace limit.
    pub conv: cuda::DnnOptions,
    /// Time every op (CUDA events) for [`DeviceStats::profile_table`]; slows steps a
    /// little, and launches them op by op.
    pub profile: bool,
    /// Launch every step op by op rather than replaying its captured CUDA graph (for
    /// comparing the two, or debugging a kernel).
    pub op_by_op: bool,
}

/// Something that holds variables and computes the tensors at `fetches`: the one
/// interface sessions, the command line and the bench drive every backend through.
pub trait Executor {
    /// What runs the graphs: the GPU's name, "CPU (16 threads)".
    fn device_name(&self) -> String;

    /// The passes a session runs after AMP on this backend unless told otherwise: the
    /// backend's own recipe (none on the CPU, whose kernels gain nothing from them).
    fn passes(&self) -> Vec<Box<dyn ampgraph_passes::Pass>> {
        Vec::new()
    }

    /// Refuses a graph with an op this backend has no kernel for, naming the first
    /// such node.
    fn check_supported(&self, _graph: &Graph) -> Result<(), ExecError> {
        Ok(())
    }

    /// The switches the executor runs with.
    fn options(&self) -> ExecOptions;

    /// Changes the switches; the next run uses them.
    fn set_options(&mut self, options: ExecOptions);

    fn run(&mut self, graph: &Graph, feeds: &Feeds, fetches: &[Port]) -> RunResult;

    /// [`run`](Self::run), also returning the step's milliseconds on the device where the
    /// backend times it there (CUDA events around the step's kernels); `None` elsewhere.
    fn run_timed(&mut self, graph: &Graph, feeds: &Feeds, fetches: &[Port]) -> TimedRunResult {
        Ok((self.run(graph, feeds, fetches)?, None))
    }

    /// Runs a step on `current` and, while it computes, starts copying `next` (every
    /// one a Placeholder) to the device, to be given to the next call: PyTorch's
    /// `pin_memory=True` and `non_blocking=True`, so that the GPU never waits for a
    /// batch's upload. Timed as [`run_timed`](Self::run_timed). A backend without
    /// a device runs `current` and hands `next` back as it is.
    fn run_overlapped(
        &mut self,
        graph: &Graph,
        current: Staged,
        fetches: &[Port],
        next: Option<Feeds>,
    ) -> Result<Overlapped, ExecError> {
        let (outputs, device_ms) = self.run_timed(graph, current.feeds(), fetches)?;
        Ok(Overlapped {
            outputs,
            device_ms,
            next: next.map(Staged::host),
        })
    }

    /// A variable's current value (on a device, copied to the host on first read after
    /// each write; a failed copy reads as `None`, [`try_variable`](Self::try_variable)
    /// returns its error).
    fn variable(&self, name: &str) -> Option<&Tensor>;

    /// A variable's current value, or the error of copying it to the host.
    fn try_variable(&self, name: &str) -> Result<Option<Tensor>, ExecError>;

    /// A variable's type, without copying its value.
    fn variable_type(&self, name: &str) -> Option<TensorType>;

    /// The names of the variables the executor holds, in no particular order.
    fn variable_names(&self) -> Vec<String>;

    /// Sets (or creates) a variable; its type is not checked against any graph.
    fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), ExecError>;

    /// Joins a data-parallel group: the graph's AllReduce nodes then average over its
    /// replicas. Backends without a collective refuse.
    fn join_collective(&mut self, collective: Collective) -> Result<(), ExecError> {
        let _ = collective;
        Err(ExecError::Collective(format!(
            "{} cannot run data-parallel replicas",
            self.device_name()
        )))
    }

    /// The device's statistics (memory, launches, the profile, the last step), where
    /// the backend keeps them (CUDA; not the CPU).
    fn stats(&self) -> Option<&dyn DeviceStats> {
        None
    }
}

/// What a device backend tells of its memory and its steps.
pub trait DeviceStats {
    /// The most bytes of device memory held at once since the executor was made or
    /// [`reset_peak_bytes`](Self::reset_peak_bytes) (variables, kept values, the
    /// step's arena).
    fn peak_bytes(&self) -> usize;

    /// Device bytes held now.
    fn live_bytes(&self) -> usize;

    /// Starts [`peak_bytes`](Self::peak_bytes) again from what is live now (as
    /// PyTorch's `torch.cuda.reset_peak_memory_stats`).
    fn reset_peak_bytes(&self);

    /// Each node's scratch bytes (kernels' temporaries, cuDNN's workspaces) in the
    /// plan of the graph last run: with [`memory_plan::step_footprint`] the step's
    /// planned memory as the device runs it.
    fn planned_scratch(&self) -> HashMap<NodeId, usize>;

    /// Work put on the device so far: the difference of two snapshots counts a
    /// step's launches.
    fn launches(&self) -> LaunchCounts;

    /// The `top` most expensive kinds of op over the runs made with
    /// [`ExecOptions::profile`] on, as a Markdown table.
    fn profile_table(&self, top: usize) -> String;

    /// How the last step reached the device.
    fn last_step(&self) -> StepReport;
}

/// How an executor's last step reached the device.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Host seconds from the step's call until its last launch was on the stream
    /// (feeds bound, kernels or its graph launched), before the fetches' download.
    pub host_enqueue_secs: f64,
    /// How its kernels were launched ("replayed as one CUDA graph", or op by op and
    /// why).
    pub launch: String,
}
