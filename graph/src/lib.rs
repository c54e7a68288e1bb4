//! ampgraph-graph: the intermediate representation of ampgraph.
//!
//! A [`Graph`] is a typed dataflow graph on petgraph. Each node holds an [`Op`]; each
//! op lives in one file under [`ops`] with its attributes, shape/dtype rule and CPU
//! reference kernel. [`format`](mod@format) reads and writes the JSON interchange format and the
//! binary format.

pub mod attrs;
pub mod autodiff;
pub mod builder;
pub mod dtype;
pub mod error;
pub mod format;
pub mod fp8;
pub mod graph;
pub mod host_memory;
pub mod kernel;
pub mod models;
pub mod nn;
pub mod op;
pub mod ops;
pub mod rng;
pub mod shape;
pub mod tensor;

pub use dtype::DType;
pub use error::{GraphError, Result};
pub use graph::{Graph, Node, NodeId, Port};
pub use op::{Arity, Op};
pub use tensor::{Data, Tensor, TensorType};
