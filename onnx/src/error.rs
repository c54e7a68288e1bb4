//! Errors of ONNX import and export: each names the file, node or tensor it is about
//! in one line.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum OnnxError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not an ONNX model (truncated, corrupt, another format).
    #[error("{path}: not a valid ONNX model: {msg}")]
    Decode { path: String, msg: String },
    /// Something about the model as a whole: opsets, inputs, outputs, cycles.
    #[error("{0}")]
    Model(String),
    /// One node's op, attributes or inputs.
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    /// An initializer or constant's data.
    #[error("tensor '{name}': {msg}")]
    Tensor { name: String, msg: String },
    /// Every op of the model that ampgraph does not read, with how many nodes use it.
    #[error("unsupported ONNX ops ({count} nodes): {list}", count = .0.iter().map(|(_, n)| n).sum::<usize>(), list = .0.iter().map(|(op, n)| format!("{op} x{n}")).collect::<Vec<_>>().join(", "))]
    Unsupported(Vec<(String, usize)>),
    /// An op of ours that has no ONNX form.
    #[error("node '{node}' ({op}): cannot be exported to ONNX: {msg}")]
    Export {
        node: String,
        op: String,
        msg: String,
    },
    #[error(transparent)]
    Graph(#[from] ampgraph_graph::GraphError),
}

impl OnnxError {
    pub fn node(node: &str, op: &str, msg: impl Into<String>) -> Self {
        OnnxError::Node {
            node: node.into(),
            op: op.into(),
            msg: msg.into(),
        }
    }

    pub fn tensor(name: &str, msg: impl Into<String>) -> Self {
        OnnxError::Tensor {
            name: name.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T, E = OnnxError> = std::result::Result<T, E>;
