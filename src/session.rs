//! Sessions: a graph prepared for a device (rewrite passes run, variables
//! initialised) that runs steps, and saves and restores its variables.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use ampgraph_exec::cuda::{self, CudaOptions};
use ampgraph_exec::feeds::initial_value;
use ampgraph_exec::{CpuExecutor, CudaExecutor, ExecError, Executor, Feeds};
use ampgraph_graph::format::write_atomic;
use ampgraph_graph::ops::Variable;
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{Data, Graph, GraphError, Port, Tensor, TensorType};
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph_passes::{registry, PassError, PassManager, PassRecord};

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

    /// As [`Device::auto`], but the CPU also where `graph` has an op without a CUDA
    /// kernel yet (convolutions, pooling, batch norm).
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
    /// fetches. `None` takes the device's default: [`registry::CUDA_PIPELINE`] on
    /// CUDA, none on the CPU (whose kernels gain nothing from them).
    pub passes: Option<Vec<String>>,
}

/// The executor a session runs on. Variables live in the executor: host tensors on
/// the CPU, device tensors on CUDA (copied to the host when read).
enum Backend {
    Cpu(CpuExecutor),
    Cuda(Box<CudaExecutor>),
}

impl Backend {
    fn run(
        &mut self,
        graph: &Graph,
        feeds: &Feeds,
        fetches: &[Port],
    ) -> Result<Vec<Tensor>, ExecError> {
        match self {
            Backend::Cpu(e) => e.run(graph, feeds, fetches),
            Backend::Cuda(e) => e.run(graph, feeds, fetches),
        }
    }

    fn variable(&self, name: &str) -> Option<&Tensor> {
        match self {
            Backend::Cpu(e) => e.variables.get(name),
            Backend::Cuda(e) => e.variable(name),
        }
    }

    fn try_variable(&self, name: &str) -> Result<Option<Tensor>, ExecError> {
        match self {
            Backend::Cpu(e) => Ok(e.variables.get(name).cloned()),
            Backend::Cuda(e) => e.try_variable(name),
        }
    }

    fn variable_type(&self, name: &str) -> Option<TensorType> {
        match self {
            Backend::Cpu(e) => e.variables.get(name).map(|t| t.ty()),
            Backend::Cuda(e) => e.variable_type(name),
        }
    }

    fn variable_names(&self) -> Vec<String> {
        match self {
            Backend::Cpu(e) => e.variables.keys().cloned().collect(),
            Backend::Cuda(e) => e.variable_names(),
        }
    }

    /// Sets a variable without checking its type (callers do).
    fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), ExecError> {
        match self {
            Backend::Cpu(e) => {
                e.variables.insert(name.to_string(), value);
                Ok(())
            }
            Backend::Cuda(e) => e.set_variable(name, value),
        }
    }
}

pub struct Session {
    graph: Graph,
    executor: Backend,
    /// What each rewrite pass did, in order.
    pub passes: Vec<PassRecord>,
    /// The passes of [`SessionOptions::passes`], run per set of fetches (none: `None`).
    per_fetch_passes: Option<PassManager>,
    /// The graph each set of fetches runs, with the ports to fetch from it.
    optimized: HashMap<Vec<Port>, (Graph, Vec<Port>)>,
}

const CHECKPOINT_MAGIC: &[u8; 8] = b"AMPGCKPT";
const CHECKPOINT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct CheckpointEntry {
    name: String,
    shape: Vec<usize>,
    data: Data,
}

impl Session {
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
        let mut passes = PassManager::new();
        if let Some(dtype) = graph.mixed_precision {
            let config = match options.amp {
                Some(c) => c,
                None => AmpConfig::new(dtype)?.from_env()?,
            };
            passes.push(Box::new(AutoMixedPrecision::new(config)));
        }
        let records = passes.run(&mut graph)?;
        let names: Vec<String> = match (options.passes, device) {
            (Some(names), _) => names,
            (None, Device::Cuda(_)) => registry::CUDA_PIPELINE
                .iter()
                .map(|s| s.to_string())
                .collect(),
            (None, Device::Cpu) => Vec::new(),
        };
        let per_fetch_passes = match names.is_empty() {
            true => None,
            false => {
                let mut manager = PassManager::new();
                for name in &names {
                    manager.push(registry::by_name(name).ok_or_else(|| {
                        PassError::Rewrite(format!(
                            "unknown pass '{name}' (known: {})",
                            registry::names().collect::<Vec<_>>().join(", ")
                        ))
                    })?);
                }
                Some(manager)
            }
        };
        let mut executor = match device {
            Device::Cpu => Backend::Cpu(CpuExecutor::new()),
            Device::Cuda(i) => {
                let e = CudaExecutor::new(i).map_err(|e| SessionError::Device(e.to_string()))?;
                CudaExecutor::check_supported(&graph)?;
                Backend::Cuda(Box::new(e))
            }
        };
        for id in graph.node_ids() {
            let node = graph.node(id);
            if let Some(var) = node.op.downcast_ref::<Variable>() {
                executor.set_variable(&node.name, initial_value(&node.name, var, options.seed))?;
            }
        }
        Ok(Session {
            graph,
            executor,
            passes: records,
            per_fetch_passes,
            optimized: HashMap::new(),
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
        match &self.executor {
            Backend::Cpu(_) => Device::Cpu,
            Backend::Cuda(e) => Device::Cuda(e.ordinal()),
        }
    }

    /// The CUDA executor's settings (GEMM precision), when the session runs on CUDA.
    pub fn cuda_options_mut(&mut self) -> Option<&mut CudaOptions> {
        match &mut self.executor {
            Backend::Cuda(e) => Some(&mut e.options),
            Backend::Cpu(_) => None,
        }
    }

    /// Computes `fetches`; variable updates in the graph take effect when it returns.
    pub fn run(&mut self, fetches: &[Port], feeds: &Feeds) -> Result<Vec<Tensor>, SessionError> {
        let Some(passes) = &self.per_fetch_passes else {
            return Ok(self.executor.run(&self.graph, feeds, fetches)?);
        };
        if !self.optimized.contains_key(fetches) {
            let mut graph = self.graph.clone();
            graph.set_outputs(fetches.to_vec())?;
            passes.run(&mut graph)?;
            let ports = graph.outputs().to_vec();
            self.optimized.insert(fetches.to_vec(), (graph, ports));
        }
        let (graph, ports) = &self.optimized[fetches];
        Ok(self.executor.run(graph, feeds, ports)?)
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

    /// Writes every variable (weights, optimizer slots, loss-scale state) to `path`
    /// atomically: a crash leaves the old checkpoint or the new one, never half.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), SessionError> {
        let path = path.as_ref();
        let mut names = self.executor.variable_names();
        names.sort();
        let mut entries: Vec<CheckpointEntry> = Vec::with_capacity(names.len());
        for name in names {
            if let Some(t) = self.executor.try_variable(&name)? {
                entries.push(CheckpointEntry {
                    name,
                    shape: t.shape().to_vec(),
                    data: t.data().clone(),
                });
            }
        }
        let mut bytes = CHECKPOINT_MAGIC.to_vec();
        bytes.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
        let body = bincode::serde::encode_to_vec(&entries, bincode::config::standard())
            .map_err(|e| checkpoint_err(path, e.to_string()))?;
        bytes.extend_from_slice(&body);
        Ok(write_atomic(path, &bytes)?)
    }

    /// Loads a checkpoint written by [`Session::save`]. Every variable of this session
    /// must be in it with the same type; a training session also refuses
    /// checkpoint variables it does not have (an inference session ignores them).
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<(), SessionError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| checkpoint_err(path, e.to_string()))?;
        let rest = bytes
            .strip_prefix(CHECKPOINT_MAGIC.as_slice())
            .ok_or_else(|| checkpoint_err(path, "not an ampgraph checkpoint (bad magic)".into()))?;
        let (version, body) = rest
            .split_at_checked(4)
            .ok_or_else(|| checkpoint_err(path, "truncated header".into()))?;
        let version = u32::from_le_bytes(
            version
                .try_into()
                .map_err(|_| checkpoint_err(path, "truncated header".into()))?,
        );
        if version != CHECKPOINT_VERSION {
            return Err(checkpoint_err(
                path,
                format!("version {version}, this ampgraph reads {CHECKPOINT_VERSION}"),
            ));
        }
        let config = bincode::config::standard().with_limit::<{ 1 << 34 }>();
        let (entries, used): (Vec<CheckpointEntry>, usize) =
            bincode::serde::decode_from_slice(body, config)
                .map_err(|e| checkpoint_err(path, format!("corrupt: {e}")))?;
        if used != body.len() {
            return Err(checkpoint_err(path, "corrupt: trailing bytes".into()));
        }
        let training = self
            .graph
            .node_ids()
            .any(|id| self.graph.node(id).op.name() == "AssignVariable");
        let mut loaded = BTreeMap::new();
        for e in entries {
            let t = Tensor::new(e.shape, e.data)
                .map_err(|m| checkpoint_err(path, format!("variable '{}': {m}", e.name)))?;
            match self.executor.variable_type(&e.name) {
                Some(cur) if cur != t.ty() => {
                    return Err(checkpoint_err(
                        path,
                        format!(
                            "variable '{}' is {} in the checkpoint but {} in the graph",
                            e.name,
                            t.ty(),
                            cur
                        ),
                    ))
                }
                Some(_) => {
                    loaded.insert(e.name, t);
                }
                None if training => {
                    return Err(checkpoint_err(
                        path,
                        format!("variable '{}' is not in the graph", e.name),
                    ));
                }
                None => {}
            }
        }
        let mut names = self.executor.variable_names();
        names.sort();
        if let Some(missing) = names.iter().find(|k| !loaded.contains_key(*k)) {
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
        for (name, t) in loaded {
            self.executor.set_variable(&name, t)?;
        }
        Ok(())
    }
}

fn checkpoint_err(path: &Path, msg: String) -> SessionError {
    SessionError::Checkpoint {
        path: path.display().to_string(),
        msg,
    }
}
