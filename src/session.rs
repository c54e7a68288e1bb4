//! Sessions: a graph prepared for a device (rewrite passes run, variables
//! initialised) that runs steps, and saves and restores its variables.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use thiserror::Error;

use ampgraph_exec::cuda;
use ampgraph_exec::feeds::initial_value;
use ampgraph_exec::{
    check_tensor_size, CpuExecutor, CudaExecutor, ExecError, ExecOptions, Executor, Feeds,
    KernelCache, Overlapped, Staged, DEFAULT_MAX_TENSOR_BYTES,
};
use ampgraph_graph::ops::{OptimizerUpdate, Variable};
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{Graph, GraphError, Port, Tensor};
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph_passes::data_parallel::DataParallel;
use ampgraph_passes::{registry, Pass, PassError, PassManager, PassRecord};

use crate::checkpoint;
use crate::numerics::check::{CheckError, Checker, NumericsReport, Snapshot};

#[derive(Debug, Error)]
pub enum SessionError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("device: {0}")]
    Device(String),
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },
    #[error(transparent)]
    CheckNumerics(#[from] CheckError),
    #[error(transparent)]
    Data(#[from] ampgraph_data::DataError),
}

/// Where a session runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// CUDA device 0 when the driver, the CUDA libraries and a device are present,
    /// else the CPU (saying why at info level).
    pub fn auto() -> Device {
        match cuda::available() {
            Ok(_) => Device::Cuda(0),
            Err(why) => {
                log::info!("using the CPU: {why}");
                Device::Cpu
            }
        }
    }

    /// As [`Device::auto`], but the CPU also where `graph` has a node no CUDA kernel
    /// takes (the lowering a CUDA step's plan makes says which, naming the node).
    pub fn auto_for(graph: &Graph) -> Device {
        match Device::auto() {
            Device::Cuda(i) => match CudaExecutor::check_supported(graph) {
                Ok(()) => Device::Cuda(i),
                Err(why) => {
                    log::info!("using the CPU: {why}");
                    Device::Cpu
                }
            },
            cpu => cpu,
        }
    }

    pub fn cuda(ordinal: usize) -> Device {
        Device::Cuda(ordinal)
    }

    /// A new executor on this device with `options`, keeping compiled kernels where
    /// `kernel_cache` says (a clear error where CUDA cannot be used).
    pub fn executor(
        self,
        options: ExecOptions,
        kernel_cache: &KernelCache,
    ) -> Result<Box<dyn Executor + Send>, SessionError> {
        let mut executor: Box<dyn Executor + Send> = match self {
            Device::Cpu => Box::new(CpuExecutor::new()),
            Device::Cuda(i) => Box::new(CudaExecutor::with_kernel_cache(i, options, kernel_cache)?),
        };
        executor.set_options(options);
        Ok(executor)
    }
}

/// Session settings.
#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// Seed of the variables' initial values.
    pub seed: u64,
    /// AMP settings for a graph marked for mixed precision; `None` reads the
    /// defaults for the marked type and the `AMPGRAPH_AMP_*` environment.
    pub amp: Option<AmpConfig>,
    /// Passes to run after AMP, by registry name: on a copy of the graph per set of
    /// fetches, whose values they keep, so that fusing never hides a tensor someone
    /// fetches. `None` takes the executor's [`Executor::passes`]: the fusion pipeline
    /// [`cuda::pipeline`] on CUDA, none on the CPU (whose kernels gain nothing from
    /// them).
    pub passes: Option<Vec<String>>,
    /// The executor's switches: TF32 for f32 products and f16 products accumulated in
    /// f16 (both off: PyTorch's `allow_tf32` and
    /// `allow_fp16_reduced_precision_reduction`), convolution algorithms, per-op
    /// profiling, CUDA-graph replay. The CPU ignores them.
    pub executor: ExecOptions,
    /// Where the CUDA executor keeps the kernels it compiles: by default where
    /// `AMPGRAPH_KERNEL_CACHE` says (else the XDG cache directory); a directory or
    /// [`KernelCache::Off`] here overrides the environment.
    pub kernel_cache: KernelCache,
    /// Check-numerics mode ([`crate::numerics::check`]), also on where
    /// `AMPGRAPH_CHECK_NUMERICS=1` when the session is made: a step that fetches NaN or
    /// infinity, or backs its loss scale off, is re-run on the CPU to name the first
    /// node whose output is not finite while its inputs are
    /// ([`Session::last_numerics_report`], logged as a warning). Off, it costs a step
    /// one test of a flag; on, a copy of the variables before every step.
    pub check_numerics: bool,
    /// Data parallelism ([`crate::parallel::Replicas`] sets it): the gradient means
    /// over the replicas, added right after AMP, where the gradients' types are known.
    pub data_parallel: Option<DataParallel>,
}

/// The environment variable that turns check-numerics on for every session (`1`).
pub const CHECK_NUMERICS_ENV: &str = "AMPGRAPH_CHECK_NUMERICS";

/// The AMP settings a session with `options` uses on `graph`: `None` where the graph
/// is not marked for mixed precision.
fn amp_config(graph: &Graph, options: &SessionOptions) -> Result<Option<AmpConfig>, PassError> {
    let Some(dtype) = graph.mixed_precision else {
        return Ok(None);
    };
    Ok(Some(match &options.amp {
        Some(c) => c.clone(),
        None => AmpConfig::new(dtype)?.from_env()?,
    }))
}

/// A pass manager running the registry passes `names` in order; an unknown name is an
/// error that lists the known ones.
pub fn registry_passes<S: AsRef<str>>(names: &[S]) -> Result<PassManager, PassError> {
    let mut manager = PassManager::new();
    for name in names {
        let name = name.as_ref();
        manager.push(registry::by_name(name).ok_or_else(|| {
            PassError::Rewrite(format!(
                "unknown pass '{name}' (known: {})",
                registry::names().collect::<Vec<_>>().join(", ")
            ))
        })?);
    }
    Ok(manager)
}

/// The rewrite passes of a session, in one place for sessions, `ampgraph run` and the
/// bench: AMP where the graph is marked for mixed precision, then the passes after it
/// ([`SessionOptions::passes`], else the executor's defaults).
pub struct Pipeline {
    /// The AMP pass, for a marked graph, and the data-parallel pass where asked (else
    /// no pass).
    pub amp: PassManager,
    /// The passes after AMP, by name.
    pub names: Vec<String>,
    /// Those passes (a session runs them per set of fetches).
    pub after_amp: PassManager,
}

impl Pipeline {
    /// The pipeline a session with `options` runs on `graph`, where the executor's
    /// passes after AMP are `backend` ([`Executor::passes`]).
    pub fn new(
        graph: &Graph,
        options: &SessionOptions,
        backend: Vec<Box<dyn Pass>>,
    ) -> Result<Pipeline, SessionError> {
        let mut amp = PassManager::new();
        if let Some(config) = amp_config(graph, options)? {
            amp.push(Box::new(AutoMixedPrecision::new(config)));
        }
        if let Some(data_parallel) = options.data_parallel {
            amp.push(Box::new(data_parallel));
        }
        let after_amp = match &options.passes {
            Some(names) => registry_passes(names)?,
            None => {
                let mut manager = PassManager::new();
                backend.into_iter().for_each(|pass| manager.push(pass));
                manager
            }
        };
        let names = after_amp.names().iter().map(|s| s.to_string()).collect();
        Ok(Pipeline {
            amp,
            names,
            after_amp,
        })
    }

    /// Runs AMP and then the passes after it on `graph`, whose outputs they keep (a
    /// session runs the second part per set of fetches instead), returning what each
    /// pass did.
    pub fn run(&self, graph: &mut Graph) -> Result<Vec<PassRecord>, SessionError> {
        let mut records = self.amp.run(graph)?;
        records.extend(self.after_amp.run(graph)?);
        Ok(records)
    }

    /// [`Pipeline::run`] for a step of `fetches`, which become `graph`'s outputs (so
    /// the passes keep them); also returns the fetched ports after the passes.
    pub fn run_for(
        &self,
        graph: &mut Graph,
        fetches: &[Port],
    ) -> Result<(Vec<PassRecord>, Vec<Port>), SessionError> {
        graph.set_outputs(fetches.to_vec())?;
        let records = self.run(graph)?;
        Ok((records, graph.outputs().to_vec()))
    }
}

/// A graph ready to run on a device: made once (the AMP pass where the graph is marked
/// for it, the device's passes), then run step after step; it holds the variables
/// (initialised from their `Init`, or restored from a checkpoint).
///
/// ```
/// use ampgraph::graph::nn;
/// use ampgraph::exec::Feeds;
/// use ampgraph::{DType, Device, Graph, Session, Tensor};
///
/// let mut g = Graph::new();
/// let x = g.placeholder("x", DType::F32, [2, 3])?;
/// let y = nn::dense(&mut g, x, 4, None)?;
/// let mut session = Session::new(g, Device::Cpu)?;
/// let feeds = Feeds::from([("x".into(), Tensor::from_f64(DType::F32, [2, 3], &[0.5; 6])?)]);
/// let out = session.run(&[y], &feeds)?;
/// assert_eq!(out[0].shape(), [2, 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Session {
    graph: Graph,
    device: Device,
    /// Variables live in the executor: host tensors on the CPU, device tensors on CUDA
    /// (copied to the host when read).
    executor: Box<dyn Executor + Send>,
    /// What each rewrite pass did, in order.
    pub passes: Vec<PassRecord>,
    /// The passes of [`SessionOptions::passes`], run per set of fetches (none: `None`).
    per_fetch_passes: Option<PassManager>,
    /// The graph each set of fetches runs, with the ports to fetch from it.
    optimized: HashMap<Vec<Port>, (Graph, Vec<Port>)>,
    /// Steps run so far.
    steps: u64,
    /// Check-numerics' state, where the mode is on.
    numerics: Option<Box<Checker>>,
}

/// How [`Session::restore_with`] checks a checkpoint's values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreOptions {
    /// Accept NaN and infinite values in float variables (refused by default: a
    /// diverged run's weights should not resume silently).
    pub allow_non_finite: bool,
    /// A training graph refuses a checkpoint variable it lacks, except one whose
    /// name begins with one of these (default: [`checkpoint::LIBRARY_PREFIX`], the
    /// library's own, such as a trainer's position or FP8 scaling state). A graph
    /// without updates (an inference graph) skips every variable it lacks. A
    /// variable of FP8 scaling state the checkpoint lacks
    /// ([`ampgraph_passes::amp::fp8::STATE_PREFIX`]: a checkpoint of another
    /// precision) starts again from its initial value, with the rest of its tensor's
    /// state.
    pub skip_unknown: Vec<String>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            allow_non_finite: false,
            skip_unknown: vec![checkpoint::LIBRARY_PREFIX.to_string()],
        }
    }
}

impl Session {
    /// A session of `graph` on `device` with the default [`SessionOptions`]: the
    /// passes run now, and each variable gets its initial value.
    pub fn new(graph: Graph, device: Device) -> Result<Session, SessionError> {
        Self::with_options(graph, device, SessionOptions::default())
    }

    /// Runs the rewrite pipeline (AMP when the graph is marked for it), logs each
    /// pass's summary, and initialises every Variable from the seed.
    pub fn with_options(
        mut graph: Graph,
        device: Device,
        options: SessionOptions,
    ) -> Result<Session, SessionError> {
        let mut executor = device.executor(options.executor, &options.kernel_cache)?;
        let pipeline = Pipeline::new(&graph, &options, executor.passes())?;
        let check_numerics = options.check_numerics
            || std::env::var(CHECK_NUMERICS_ENV).is_ok_and(|v| v.trim() == "1");
        let numerics = match check_numerics {
            // `explain` reads the decisions off the graph before the rewrite.
            true => Some(Box::new(Checker::new(
                amp_config(&graph, &options)?.map(|config| (graph.clone(), config)),
            ))),
            false => None,
        };
        let records = pipeline.amp.run(&mut graph)?;
        executor.check_supported(&graph)?;
        for id in graph.node_ids() {
            let node = graph.node(id);
            if let Some(var) = node.op.downcast_ref::<Variable>() {
                check_tensor_size(&node.name, "Variable", &var.ty, DEFAULT_MAX_TENSOR_BYTES)?;
                executor.set_variable(&node.name, initial_value(&node.name, var, options.seed))?;
            }
        }
        let per_fetch_passes = (!pipeline.names.is_empty()).then_some(pipeline.after_amp);
        Ok(Session {
            graph,
            device,
            executor,
            passes: records,
            per_fetch_passes,
            optimized: HashMap::new(),
            steps: 0,
            numerics,
        })
    }

    /// A session for inference: only what `outputs` need is kept (no gradients,
    /// updates or optimizer slots); restore a training checkpoint into it.
    pub fn inference(
        mut graph: Graph,
        outputs: &[Port],
        device: Device,
    ) -> Result<Session, SessionError> {
        graph.prune(outputs)?;
        Self::new(graph, device)
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The graph a run of `fetches` executes: after [`SessionOptions::passes`] once
    /// such a run happened, else the session's graph.
    pub fn graph_for(&self, fetches: &[Port]) -> &Graph {
        self.optimized.get(fetches).map_or(&self.graph, |(g, _)| g)
    }

    /// Where this session runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The executor: its device's name, switches ([`Executor::set_options`]), memory
    /// and launch counters where it has them.
    pub fn executor(&self) -> &dyn Executor {
        self.executor.as_ref()
    }

    /// The executor, to change its switches (setting variables through it skips
    /// [`Session::set_variable`]'s type check).
    pub fn executor_mut(&mut self) -> &mut dyn Executor {
        self.executor.as_mut()
    }

    /// Computes `fetches`; variable updates in the graph take effect when it returns.
    pub fn run(&mut self, fetches: &[Port], feeds: &Feeds) -> Result<Vec<Tensor>, SessionError> {
        let snapshot = self.snapshot(feeds)?;
        let outputs = self.step(fetches, |e, graph, ports| e.run(graph, feeds, ports))?;
        self.check_numerics(snapshot, fetches, &outputs)?;
        Ok(outputs)
    }

    /// [`Session::run`], also returning the step's milliseconds on the device where the
    /// executor times them there ([`Executor::run_timed`]: CUDA events; `None` on the CPU).
    pub fn run_timed(
        &mut self,
        fetches: &[Port],
        feeds: &Feeds,
    ) -> Result<(Vec<Tensor>, Option<f64>), SessionError> {
        let snapshot = self.snapshot(feeds)?;
        let timed = self.step(fetches, |e, graph, ports| e.run_timed(graph, feeds, ports))?;
        self.check_numerics(snapshot, fetches, &timed.0)?;
        Ok(timed)
    }

    /// A step on `current` while `next` goes to the device
    /// ([`Executor::run_overlapped`]: page-locked buffers, a copy stream and events on
    /// CUDA), to be given to the next call.
    pub fn run_overlapped(
        &mut self,
        fetches: &[Port],
        current: Staged,
        next: Option<Feeds>,
    ) -> Result<Overlapped, SessionError> {
        let snapshot = self.snapshot(current.feeds())?;
        let overlapped = self.step(fetches, |e, graph, ports| {
            e.run_overlapped(graph, current, ports, next)
        })?;
        self.check_numerics(snapshot, fetches, &overlapped.outputs)?;
        Ok(overlapped)
    }

    /// Steps this session has run; the next one is step `step_count()` (as
    /// [`NumericsReport::step`] counts them).
    pub fn step_count(&self) -> u64 {
        self.steps
    }

    /// Whether check-numerics is on ([`SessionOptions::check_numerics`]).
    pub fn checks_numerics(&self) -> bool {
        self.numerics.is_some()
    }

    /// The report of the last step check-numerics looked into: the first node whose
    /// output was not finite while its inputs were.
    pub fn last_numerics_report(&self) -> Option<&NumericsReport> {
        self.numerics.as_ref()?.last.as_ref()
    }

    /// Under check-numerics, the variables and feeds of the step about to run.
    fn snapshot(&self, feeds: &Feeds) -> Result<Option<Snapshot>, SessionError> {
        if self.numerics.is_none() {
            return Ok(None);
        }
        Ok(Some(Snapshot::take(
            self.executor.as_ref(),
            feeds,
            self.steps,
        )?))
    }

    /// Under check-numerics, looks into the step just run from `snapshot` where it
    /// went non-finite.
    fn check_numerics(
        &mut self,
        snapshot: Option<Snapshot>,
        fetches: &[Port],
        outputs: &[Tensor],
    ) -> Result<(), SessionError> {
        let (Some(snapshot), Some(checker)) = (snapshot, self.numerics.as_mut()) else {
            return Ok(());
        };
        // The graph and ports the executor ran, as `step` picked them.
        let (graph, ports) = match self.optimized.get(fetches) {
            Some((graph, ports)) => (graph, ports.as_slice()),
            None => (&self.graph, fetches),
        };
        checker.check(snapshot, self.executor.as_ref(), graph, ports, outputs)?;
        Ok(())
    }

    /// Runs `run` on the graph a run of `fetches` executes (made on first use) and the
    /// ports to fetch from it.
    fn step<T>(
        &mut self,
        fetches: &[Port],
        run: impl FnOnce(&mut dyn Executor, &Graph, &[Port]) -> Result<T, ExecError>,
    ) -> Result<T, SessionError> {
        self.steps += 1;
        let Some(passes) = &self.per_fetch_passes else {
            return Ok(run(self.executor.as_mut(), &self.graph, fetches)?);
        };
        if !self.optimized.contains_key(fetches) {
            let mut graph = self.graph.clone();
            graph.set_outputs(fetches.to_vec())?;
            passes.run(&mut graph)?;
            let ports = graph.outputs().to_vec();
            self.optimized.insert(fetches.to_vec(), (graph, ports));
        }
        let (graph, ports) = &self.optimized[fetches];
        Ok(run(self.executor.as_mut(), graph, ports)?)
    }

    /// The current value of a variable (on CUDA, copied from the device on first read
    /// after each step that wrote it).
    pub fn variable(&self, name: &str) -> Option<&Tensor> {
        self.executor.variable(name)
    }

    /// Replaces a variable's value (same type).
    pub fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), SessionError> {
        let current = self
            .executor
            .variable_type(name)
            .ok_or_else(|| GraphError::UnknownNode(name.to_string()))?;
        if current != value.ty() {
            return Err(ExecError::Feed {
                name: name.into(),
                msg: format!("expects {}, got {}", current, value.ty()),
            }
            .into());
        }
        Ok(self.executor.set_variable(name, value)?)
    }

    /// Gives each of this session's variables the value `other` holds under its name
    /// (the same model's weights from a training session into an evaluation one);
    /// returns how many were copied. Variables `other` lacks keep their values.
    pub fn copy_variables_from(&mut self, other: &Session) -> Result<usize, SessionError> {
        let mut copied = 0;
        for name in self.executor.variable_names() {
            if let Some(value) = other.executor.try_variable(&name)? {
                self.set_variable(&name, value)?;
                copied += 1;
            }
        }
        Ok(copied)
    }

    /// Writes every variable (weights, optimizer slots, loss-scale state) to `path`
    /// atomically: a crash leaves the old checkpoint or the new one, never half (the
    /// file is flushed to disk before it replaces the old one). Where `path` exists its
    /// previous contents are kept as `PATH.prev`, so one bad save never destroys the
    /// last good state. Each variable carries a CRC-32 of its name, type and bytes,
    /// and the file a CRC-32 of the whole, which [`Session::restore`] checks (the
    /// format: [`crate::checkpoint`]).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), SessionError> {
        let mut names = self.executor.variable_names();
        names.sort();
        let mut variables = Vec::with_capacity(names.len());
        for name in names {
            if let Some(t) = self.executor.try_variable(&name)? {
                variables.push((name, t));
            }
        }
        checkpoint::write(path.as_ref(), &variables)
    }

    /// Loads a checkpoint written by [`Session::save`]. Every variable of this session
    /// must be in it with the same type; a training session also refuses
    /// checkpoint variables it does not have (an inference session ignores them, and
    /// every session a [`Trainer`](crate::train::Trainer)'s position and the slots of
    /// variables it holds but does not train).
    /// Checksums are verified (a mismatch names the variable, or the file), and a
    /// float variable holding NaN or infinity is refused; see
    /// [`Session::restore_with`] to accept those. Nothing is restored on an error.
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<(), SessionError> {
        self.restore_with(path, RestoreOptions::default())
    }

    /// [`Session::restore`] with `options` (e.g. accepting non-finite values).
    pub fn restore_with(
        &mut self,
        path: impl AsRef<Path>,
        options: RestoreOptions,
    ) -> Result<(), SessionError> {
        let path = path.as_ref();
        let variables = checkpoint::read(path, options.allow_non_finite)?;
        let training = self
            .graph
            .node_ids()
            .any(|id| self.graph.node(id).op.name() == "AssignVariable");
        // The variables an optimizer updates: a checkpoint's slot (`<var>/<slot>`) of a
        // variable this graph holds but does not train has nothing to restore into
        // (batch norms' moving statistics had momentum slots before they stopped
        // being trained), so it is passed over.
        let trained: std::collections::HashSet<&str> = (self.graph.node_ids())
            .filter(|&id| self.graph.node(id).op.is::<OptimizerUpdate>())
            .filter_map(|id| self.graph.inputs(id).get(1).copied())
            .map(|var| self.graph.node(var.node).name.as_str())
            .collect();
        let untrained_slot = |name: &str| {
            name.rsplit_once('/').is_some_and(|(var, _)| {
                self.executor.variable_type(var).is_some() && !trained.contains(var)
            })
        };
        let mut loaded = BTreeMap::new();
        for (name, t) in variables {
            match self.executor.variable_type(&name) {
                Some(cur) if cur != t.ty() => {
                    return Err(checkpoint_err(
                        path,
                        format!(
                            "variable '{}' is {} in the checkpoint but {} in the graph",
                            name,
                            t.ty(),
                            cur
                        ),
                    ))
                }
                Some(_) => {
                    loaded.insert(name, t);
                }
                None if training
                    && !options.skip_unknown.iter().any(|p| name.starts_with(p))
                    && !untrained_slot(&name) =>
                {
                    return Err(checkpoint_err(
                        path,
                        format!("variable '{}' is not in the graph", name),
                    ));
                }
                None => {}
            }
        }
        let mut names = self.executor.variable_names();
        names.sort();
        // FP8 scaling state of another precision's checkpoint starts afresh (its amaxes
        // were of other weights); any other variable missing is an error.
        let (restarted, missing): (Vec<&String>, Vec<&String>) = names
            .iter()
            .filter(|k| !loaded.contains_key(*k))
            .partition(|k| k.starts_with(ampgraph_passes::amp::fp8::STATE_PREFIX));
        if let Some(&missing) = missing.first() {
            let t = self
                .executor
                .variable_type(missing)
                .ok_or_else(|| GraphError::UnknownNode(missing.clone()))?;
            return Err(checkpoint_err(
                path,
                format!(
                    "has no value for variable '{missing}' {}{}",
                    t.dtype,
                    ShapeDisplay(&t.shape)
                ),
            ));
        }
        // A tensor's state restarts whole: a scale kept beside a fresh inverse (a
        // checkpoint from before the inverse was state) would dequantise wrongly.
        let stem = |name: &str| {
            name.rsplit_once('/')
                .map_or(name.to_string(), |(s, _)| s.to_string())
        };
        let restarted_tensors: std::collections::HashSet<String> =
            restarted.iter().map(|name| stem(name)).collect();
        let restarted: Vec<&String> = names
            .iter()
            .filter(|k| k.starts_with(ampgraph_passes::amp::fp8::STATE_PREFIX))
            .filter(|k| restarted_tensors.contains(&stem(k)))
            .collect();
        for name in restarted {
            let id = self.graph.require(name)?;
            if let Some(var) = self.graph.node(id).op.downcast_ref::<Variable>() {
                loaded.insert(name.clone(), initial_value(name, var, 0));
            }
        }
        for (name, t) in loaded {
            self.executor.set_variable(&name, t)?;
        }
        Ok(())
    }
}

pub(crate) fn checkpoint_err(path: &Path, msg: String) -> SessionError {
    SessionError::Checkpoint {
        path: path.display().to_string(),
        msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_pipeline_resolves_through_the_registry() {
        let names = cuda::pipeline_names(&ExecOptions::default());
        let manager = registry_passes(&names).unwrap();
        assert_eq!(manager.names(), names);
        let err = registry_passes(&["dce", "no-such-pass"]).err().unwrap();
        assert!(
            err.to_string().contains("unknown pass 'no-such-pass'"),
            "{err}"
        );
    }

    #[test]
    fn the_pipeline_takes_the_executors_defaults_unless_told() {
        let mut g = Graph::new();
        let x = g.placeholder("x", ampgraph_graph::DType::F32, [2]).unwrap();
        g.set_outputs(vec![x]).unwrap();
        let recipe = || cuda::pipeline(&ExecOptions::default());
        let defaults = Pipeline::new(&g, &SessionOptions::default(), recipe()).unwrap();
        assert_eq!(
            defaults.names,
            cuda::pipeline_names(&ExecOptions::default())
        );
        assert!(
            defaults.amp.names().is_empty(),
            "no AMP for an unmarked graph"
        );
        let chosen = SessionOptions {
            passes: Some(vec!["fuse".into()]),
            ..Default::default()
        };
        let chosen = Pipeline::new(&g, &chosen, recipe()).unwrap();
        assert_eq!(chosen.after_amp.names(), ["fuse"]);
        g.mixed_precision = Some(ampgraph_graph::DType::F16);
        let marked = Pipeline::new(&g, &SessionOptions::default(), Vec::new()).unwrap();
        assert_eq!(marked.amp.names().len(), 1);
        assert!(marked.names.is_empty());
    }

    #[test]
    fn executor_options_reach_the_executor() {
        let mut g = Graph::new();
        let x = g.placeholder("x", ampgraph_graph::DType::F32, [2]).unwrap();
        g.set_outputs(vec![x]).unwrap();
        let executor = ExecOptions {
            gemm: cuda::GemmOptions {
                allow_tf32: true,
                allow_fp16_reduced_precision_reduction: true,
                heuristic_only: true,
            },
            conv: cuda::DnnOptions {
                deterministic: true,
                workspace_limit_mib: Some(64),
            },
            profile: false,
            op_by_op: true,
        };
        let options = SessionOptions {
            executor,
            kernel_cache: KernelCache::Off,
            ..Default::default()
        };
        let mut s = Session::with_options(g, Device::Cpu, options).unwrap();
        assert_eq!(s.executor().options(), executor);
        assert!(s.executor().device_name().starts_with("CPU"));
        assert!(s.executor().passes().is_empty());
        assert!(
            s.executor().stats().is_none(),
            "the CPU counts no device memory"
        );
        s.executor_mut().set_options(ExecOptions::default());
        assert_eq!(s.executor().options(), ExecOptions::default());
        let feeds = Feeds::from([(
            "x".to_string(),
            Tensor::from_f64(ampgraph_graph::DType::F32, vec![2], &[1.0, 2.0]).unwrap(),
        )]);
        let (out, device_ms) = s.run_timed(&[x], &feeds).unwrap();
        assert_eq!(out[0].to_f64_vec(), [1.0, 2.0]);
        assert_eq!(device_ms, None, "the CPU has no device clock");
    }
}
