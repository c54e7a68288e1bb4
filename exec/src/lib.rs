//! ampgraph-exec: executors that run a [`Graph`](ampgraph_graph::Graph).
//!
//! [`CpuExecutor`] is the reference backend and the embedded default: every op's CPU
//! kernel, in the op's own file in `ampgraph-graph`, run in topological order with
//! tensors freed after their last use. [`cuda::CudaExecutor`] runs the same graphs on
//! a GPU (CUDA loaded at run time; [`cuda::available`] says whether it can be used).

mod cpu;
pub mod cuda;
pub mod data;
pub mod feeds;
pub mod gradcheck;
pub mod memory_plan;
pub mod rng;
mod schedule;

use std::collections::HashMap;

use ampgraph_graph::{GraphError, Port, Tensor};
use thiserror::Error;

pub use cpu::{check_tensor_size, CpuExecutor, DEFAULT_MAX_TENSOR_BYTES};
pub use cuda::CudaExecutor;

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

/// Values given to a run, by node name: Placeholders (and Variables, to override).
pub type Feeds = HashMap<String, Tensor>;

/// Something that computes the tensors at `fetches`.
pub trait Executor {
    fn run(
        &mut self,
        graph: &ampgraph_graph::Graph,
        feeds: &Feeds,
        fetches: &[Port],
    ) -> Result<Vec<Tensor>, ExecError>;
}
