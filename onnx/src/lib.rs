//! ONNX models in and out of ampgraph graphs.
//!
//! [`import_file`] reads a model (opset 11 and later, initializers inline or in
//! external data files) into a statically shaped [`Graph`](ampgraph_graph::Graph);
//! [`export`] writes a graph back as a model onnxruntime loads. The protobuf messages
//! are declared with `prost`'s derive (`proto.rs`), so building needs no `protoc`.

mod error;
mod export;
mod import;
pub mod proto;
mod symbolic;
pub mod tensor;

pub use error::{OnnxError, Result};
pub use export::{
    export, export_file, export_file_with_dims, export_with_dims, ExportOptions, EXPORT_OPSET,
};
pub use import::{import_bytes, import_file, import_model, ImportOptions, MIN_OPSET};
pub use symbolic::{import_file_probed, Probes, Symbol, SymbolicDims};

/// The annotation of a node made from an ONNX op that ampgraph would not write back
/// as that op by itself (a BiasAdd that was an Add), naming the op.
pub const ONNX_OP_ANNOTATION: &str = "_onnx_op";

/// Whether a path names an ONNX model (by its `.onnx` extension).
pub fn is_onnx_path(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}
