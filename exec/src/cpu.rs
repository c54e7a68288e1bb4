//! The CPU reference executor.

use std::collections::HashMap;
use std::ops::ControlFlow;

use ampgraph_graph::ops::{AllReduce, Placeholder, Variable};
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{Graph, NodeId, Port, Tensor, TensorType};

use crate::collective::{check_replicas, Collective, Transport};
use crate::schedule::{assigned_variable, check_outputs, Schedule};
use crate::{host_memory, memory_plan};
use crate::{ExecError, ExecOptions, Executor, Feeds, RunResult};

/// One node of a step as [`CpuExecutor::run_observed`] shows it.
pub struct Evaluated<'a> {
    pub id: NodeId,
    pub inputs: &'a [&'a Tensor],
    pub outputs: &'a [Tensor],
}

/// Runs graphs on the host with each op's reference kernel.
#[derive(Debug)]
pub struct CpuExecutor {
    /// Current values of Variables, by node name.
    pub variables: HashMap<String, Tensor>,
    /// The largest tensor one op may produce, in bytes.
    pub max_tensor_bytes: u64,
    /// Kept for [`Executor::options`]; the CPU kernels' arithmetic does not change.
    options: ExecOptions,
    /// The host memory a step may take, in bytes; `None`: what the host has available
    /// when the step is first run ([`host_memory::available_bytes`]).
    pub memory_limit: Option<usize>,
    /// The graph revision and fetches last admitted (checked against the memory once).
    admitted: Option<((u64, u64), Vec<Port>)>,
    /// The data-parallel group this replica computes AllReduce with, once joined.
    collective: Option<Collective>,
}

/// 16 GiB: larger than any tensor this machine class can hold next to its inputs.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 16 << 30;

/// Refuses a tensor type whose storage exceeds `limit` bytes, before anything allocates it.
pub fn check_tensor_size(
    name: &str,
    op: &str,
    ty: &TensorType,
    limit: u64,
) -> Result<(), ExecError> {
    let bytes = ty
        .checked_len()
        .and_then(|n| (n as u64).checked_mul(ty.dtype.size_bytes() as u64));
    match bytes {
        Some(b) if b <= limit => Ok(()),
        _ => Err(ExecError::node(
            name,
            op,
            format!(
                "output {ty} is too large to allocate (limit {} GiB)",
                limit >> 30
            ),
        )),
    }
}

impl Default for CpuExecutor {
    fn default() -> Self {
        CpuExecutor {
            variables: HashMap::new(),
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            options: ExecOptions::default(),
            memory_limit: None,
            admitted: None,
            collective: None,
        }
    }
}

/// An AllReduce of a replica in `c`'s group.
fn all_reduce(
    c: &Collective,
    reduce: &AllReduce,
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>, String> {
    check_replicas(reduce.replicas, c.rank, c.world)?;
    match &c.transport {
        Transport::Nccl(_) => Err("NCCL needs a CUDA executor".into()),
        _ => c.host_all_reduce(inputs, reduce.reduction),
    }
}

impl CpuExecutor {
    /// Runs a step as [`Executor::run`] does, showing `observe` every node as it is
    /// computed, in execution order, with its inputs and outputs: what numerics tools
    /// (the first non-finite value, the largest magnitudes, 16-bit against f32 errors)
    /// read. When `observe` breaks, the step stops there, writing no variable, and the
    /// result is `None`.
    pub fn run_observed(
        &mut self,
        graph: &Graph,
        feeds: &Feeds,
        fetches: &[Port],
        observe: &mut dyn FnMut(&Evaluated) -> ControlFlow<()>,
    ) -> Result<Option<Vec<Tensor>>, ExecError> {
        self.admit(graph, fetches)?;
        let mut schedule = Schedule::new(graph, fetches)?;
        let order = std::mem::take(&mut schedule.order);
        let mut values: HashMap<NodeId, Vec<Tensor>> = HashMap::new();
        // Variable writes, applied when the step ends so that every read sees the old value.
        let mut writes: Vec<(String, Tensor)> = Vec::new();
        for &id in &order {
            let node = graph.node(id);
            let op = node.op.name();
            for ty in node.outputs() {
                check_tensor_size(&node.name, op, ty, self.max_tensor_bytes)?;
            }
            let inputs = graph.inputs(id);
            let args: Vec<&Tensor> = inputs.iter().map(|p| &values[&p.node][p.index]).collect();
            let outputs = match self.source_value(graph, id, feeds)? {
                Some(v) => vec![v],
                None => match (node.op.downcast_ref::<AllReduce>(), &self.collective) {
                    (Some(reduce), Some(c)) => all_reduce(c, reduce, &args)
                        .map_err(|m| ExecError::node(&node.name, op, m))?,
                    _ => node
                        .op
                        .eval(&args)
                        .map_err(|m| ExecError::node(&node.name, op, m))?,
                },
            };
            check_outputs(node, outputs.iter().map(|t| t.ty()))?;
            let seen = Evaluated {
                id,
                inputs: &args,
                outputs: &outputs,
            };
            if observe(&seen).is_break() {
                return Ok(None);
            }
            if let Some(variable) = assigned_variable(graph, id)? {
                writes.push((variable, outputs[0].clone()));
            }
            values.insert(id, outputs);
            for done in schedule.consume_inputs(graph, id) {
                values.remove(&done);
            }
        }
        let fetched = fetches
            .iter()
            .map(|p| values[&p.node][p.index].clone())
            .collect();
        self.variables.extend(writes);
        Ok(Some(fetched))
    }

    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses, before it computes anything, a step whose tensors cannot all be in
    /// host memory when they must ([`memory_plan::admit`]): a graph that does not fit
    /// fails in milliseconds rather than aborting the process mid-run. Checked once per
    /// graph revision and fetches.
    fn admit(&mut self, graph: &Graph, fetches: &[Port]) -> Result<(), ExecError> {
        let key = (graph.revision(), fetches.to_vec());
        if self.admitted.as_ref() == Some(&key) {
            return Ok(());
        }
        let limit = self.memory_limit.or_else(host_memory::available_bytes);
        if let Some(available) = limit {
            memory_plan::admit(graph, fetches, available, "the host")?;
        }
        self.admitted = Some(key);
        Ok(())
    }

    fn source_value(
        &self,
        graph: &Graph,
        id: NodeId,
        feeds: &Feeds,
    ) -> Result<Option<Tensor>, ExecError> {
        let node = graph.node(id);
        let is_placeholder = node.op.is::<Placeholder>();
        let is_variable = node.op.is::<Variable>();
        if !is_placeholder && !is_variable {
            return Ok(None);
        }
        let want = &node.outputs()[0];
        let value = match feeds
            .get(&node.name)
            .or_else(|| self.variables.get(&node.name))
        {
            Some(v) => v,
            None if is_placeholder => {
                return Err(ExecError::Feed {
                    name: node.name.clone(),
                    msg: format!("Placeholder {want} was not fed"),
                })
            }
            None => {
                return Err(ExecError::Feed {
                    name: node.name.clone(),
                    msg: format!("Variable {want} has no value (initialise or feed it)"),
                })
            }
        };
        if value.dtype() != want.dtype || value.shape() != want.shape.as_slice() {
            return Err(ExecError::Feed {
                name: node.name.clone(),
                msg: format!(
                    "expects {want}, got {}{}",
                    value.dtype(),
                    ShapeDisplay(value.shape())
                ),
            });
        }
        Ok(Some(value.clone()))
    }
}

impl Executor for CpuExecutor {
    fn join_collective(&mut self, collective: Collective) -> Result<(), ExecError> {
        if let Transport::Nccl(_) = collective.transport {
            return Err(ExecError::Collective(
                "a CPU replica reduces through host memory, not NCCL".into(),
            ));
        }
        self.collective = Some(collective);
        Ok(())
    }

    fn device_name(&self) -> String {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        format!("CPU ({threads} threads)")
    }

    fn options(&self) -> ExecOptions {
        self.options
    }

    fn set_options(&mut self, options: ExecOptions) {
        self.options = options;
    }

    fn variable(&self, name: &str) -> Option<&Tensor> {
        self.variables.get(name)
    }

    fn try_variable(&self, name: &str) -> Result<Option<Tensor>, ExecError> {
        Ok(self.variables.get(name).cloned())
    }

    fn variable_type(&self, name: &str) -> Option<TensorType> {
        self.variables.get(name).map(Tensor::ty)
    }

    fn variable_names(&self) -> Vec<String> {
        self.variables.keys().cloned().collect()
    }

    fn set_variable(&mut self, name: &str, value: Tensor) -> Result<(), ExecError> {
        self.variables.insert(name.to_string(), value);
        Ok(())
    }

    fn run(&mut self, graph: &Graph, feeds: &Feeds, fetches: &[Port]) -> RunResult {
        let fetched =
            self.run_observed(graph, feeds, fetches, &mut |_| ControlFlow::Continue(()))?;
        // Nothing stops an observer that always continues.
        Ok(fetched.unwrap_or_default())
    }
}
