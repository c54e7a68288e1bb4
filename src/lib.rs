//! ampgraph: automatic mixed precision for dataflow graphs.
//!
//! A model is a [`Graph`] of ops (built with its methods and [`graph::nn`], or loaded
//! from a file or an ONNX model with [`onnx`]). [`enable_mixed_precision_graph_rewrite`]
//! wraps an optimizer so that training runs in f16 or bf16 where TensorFlow's AMP
//! would, with FP32 master weights and a dynamic loss scale in the graph. A [`Session`]
//! runs the graph on a [`Device`] (the CPU, or CUDA through the
//! [`exec::CudaExecutor`], whose steps are planned once and replayed as CUDA graphs):
//! it runs the AMP pass and the device's passes, holds the variables, runs steps and
//! saves checkpoints. [`Trainer`] drives epochs from a [`data`] loader; [`parallel`]
//! runs replicas on several GPUs; [`numerics`] finds where a step overflows.
//!
//! The workspace is layered as the architecture: [`graph`] (what a model is),
//! [`passes`] (how it is rewritten), [`exec`] (how it runs), [`data`] (how examples
//! get in); [`onnx`] reads and writes ONNX models. This crate re-exports them and hosts
//! the `ampgraph` command line ([`cli`]).
//!
//! A training step with mixed precision, on the CPU (`Device::auto()` takes the GPU
//! where there is one):
//!
//! ```
//! use ampgraph::exec::Feeds;
//! use ampgraph::graph::nn::{self, Activation};
//! use ampgraph::optim::{Optimizer, Sgd};
//! use ampgraph::{enable_mixed_precision_graph_rewrite, DType, Device, Graph, Session, Tensor};
//!
//! // x[8, 4] -> dense 16 relu -> dense 3 -> softmax cross-entropy.
//! let mut g = Graph::new();
//! let x = g.placeholder("x", DType::F32, [8, 4])?;
//! let labels = g.placeholder("labels", DType::I32, [8])?;
//! let h = nn::dense(&mut g, x, 16, Some(Activation::Relu))?;
//! let logits = nn::dense(&mut g, h, 3, None)?;
//! let loss = g.softmax_cross_entropy(logits, labels)?;
//! // Gradients, the loss scale and SGD's update in the graph; AMP f16 when it runs.
//! let step = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9)).minimize(&mut g, loss)?;
//!
//! let mut session = Session::new(g, Device::Cpu)?;
//! let feeds = Feeds::from([
//!     ("x".into(), Tensor::from_f64(DType::F32, [8, 4], &[0.25; 32])?),
//!     ("labels".into(), Tensor::from_f64(DType::I32, [8], &[0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0])?),
//! ]);
//! let first = session.run(&[step.loss, step.step], &feeds)?[0].to_f64_vec()[0];
//! for _ in 0..20 {
//!     session.run(&[step.loss, step.step], &feeds)?;
//! }
//! let last = session.run(&[step.loss], &feeds)?[0].to_f64_vec()[0];
//! assert!(last < first, "the loss falls: {first} -> {last}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
pub mod checkpoint;
pub mod cli;
pub mod numerics;
pub mod optim;
pub mod parallel;
pub mod pretrained;
pub mod session;
pub mod train;

pub use optim::enable_mixed_precision_graph_rewrite;
pub use session::{Device, RestoreOptions, Session, SessionOptions};
pub use train::{Position, TrainOptions, Trainer};
