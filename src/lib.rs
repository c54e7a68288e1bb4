//! ampgraph: automatic mixed precision for dataflow graphs.
//!
//! The workspace is layered as the architecture: [`graph`] (what a model is),
//! [`passes`] (how it is rewritten), [`exec`] (how it runs), [`data`] (how examples
//! get in); [`onnx`] reads and writes ONNX models. This crate re-exports them and hosts the `ampgraph` command line.

// Inlined, so that `cargo doc -p ampgraph` documents the whole library in one place.
#[doc(inline)]
pub use ampgraph_data as data;
#[doc(inline)]
pub use ampgraph_exec as exec;
#[doc(inline)]
pub use ampgraph_graph as graph;
#[doc(inline)]
pub use ampgraph_onnx as onnx;
#[doc(inline)]
pub use ampgraph_passes as passes;

pub use ampgraph_exec::{CpuExecutor, Executor};
pub use ampgraph_graph::{DType, Graph, GraphError, Port, Tensor, TensorType};

pub mod benchmark;
pub mod cli;
pub mod numerics;
pub mod optim;
pub mod parallel;
pub mod session;
pub mod train;

pub use optim::enable_mixed_precision_graph_rewrite;
pub use session::{Device, RestoreOptions, Session, SessionOptions};
pub use train::{Position, TrainOptions, Trainer};
