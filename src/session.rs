//! Sessions: a graph prepared for a device (rewrite passes run, variables
//! initialised) that runs steps, and saves and restores its variables.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use ampgraph_exec::feeds::initial_value;
use ampgraph_exec::{CpuExecutor, ExecError, Executor, Feeds};
use ampgraph_graph::format::write_atomic;
use ampgraph_graph::ops::Variable;
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{Data, Graph, GraphError, Port, Tensor};
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph_passes::{PassError, PassManager, PassRecord};

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
    /// CUDA when it can be used, else the CPU (saying why at info level).
    pub fn auto() -> Device {
        log::info!("using the CPU: this build of ampgraph has no CUDA executor yet");
        Device::Cpu
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
}

pub struct Session {
    graph: Graph,
    executor: CpuExecutor,
    /// What each rewrite pass did, in order.
    pub passes: Vec<PassRecord>,
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
        if let Device::Cuda(i) = device {
            return Err(SessionError::Device(format!(
                "CUDA device {i} was asked for, but this build of ampgraph has no CUDA executor yet"
            )));
        }
        let mut passes = PassManager::new();
        if let Some(dtype) = graph.mixed_precision {
            let config = match options.amp {
                Some(c) => c,
                None => AmpConfig::new(dtype)?.from_env()?,
            };
            passes.push(Box::new(AutoMixedPrecision::new(config)));
        }
        let records = passes.run(&mut graph)?;
        let mut executor = CpuExecutor::new();
        for id in graph.node_ids() {
            let node = graph.node(id);
            if let Some(var) = node.op.downcast_ref::<Variable>() {
                executor.variables.insert(
                    node.name.clone(),
                    initial_value(&node.name, var, options.seed),
                );
            }
        }
        Ok(Session {
            graph,
            executor,
            passes: records,
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

    /// Computes `fetches`; variable updates in the graph take effect when it returns.
    pub fn run(&mut self, fetches: &[Port], feeds: &Feeds) -> Result<Vec<Tensor>, SessionError> {
        Ok(self.executor.run(&self.graph, feeds, fetches)?)
    }

    /// The current value of a variable.
    pub fn variable(&self, name: &str) -> Option<&Tensor> {
        self.executor.variables.get(name)
    }

    /// Replaces a variable's value (same type).
    pub fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), SessionError> {
        let current = self
            .executor
            .variables
            .get_mut(name)
            .ok_or_else(|| GraphError::UnknownNode(name.to_string()))?;
        if current.ty() != value.ty() {
            return Err(ExecError::Feed {
                name: name.into(),
                msg: format!("expects {}, got {}", current.ty(), value.ty()),
            }
            .into());
        }
        *current = value;
        Ok(())
    }

    /// Writes every variable (weights, optimizer slots, loss-scale state) to `path`
    /// atomically: a crash leaves the old checkpoint or the new one, never half.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), SessionError> {
        let path = path.as_ref();
        let sorted: BTreeMap<&String, &Tensor> = self.executor.variables.iter().collect();
        let entries: Vec<CheckpointEntry> = sorted
            .into_iter()
            .map(|(name, t)| CheckpointEntry {
                name: name.clone(),
                shape: t.shape().to_vec(),
                data: t.data().clone(),
            })
            .collect();
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
            match self.executor.variables.get(&e.name) {
                Some(cur) if cur.ty() != t.ty() => {
                    return Err(checkpoint_err(
                        path,
                        format!(
                            "variable '{}' is {} in the checkpoint but {} in the graph",
                            e.name,
                            t.ty(),
                            cur.ty()
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
        if let Some(missing) = self
            .executor
            .variables
            .keys()
            .find(|k| !loaded.contains_key(*k))
        {
            let t = &self.executor.variables[missing];
            return Err(checkpoint_err(
                path,
                format!(
                    "has no value for variable '{missing}' {}{}",
                    t.dtype(),
                    ShapeDisplay(t.shape())
                ),
            ));
        }
        self.executor.variables.extend(loaded);
        Ok(())
    }
}

fn checkpoint_err(path: &Path, msg: String) -> SessionError {
    SessionError::Checkpoint {
        path: path.display().to_string(),
        msg,
    }
}
