//! Errors of the graph crate: every one names what it is about.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum GraphError {
    /// A problem with one node: its op, attrs, inputs or types.
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    /// A problem with the file as a whole (syntax, header, version, outputs).
    #[error("{0}")]
    Format(String),
    #[error("no node named '{0}'")]
    UnknownNode(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A problem in the file `path` (its syntax or one of its nodes).
    #[error("{path}: {source}")]
    InFile {
        path: String,
        #[source]
        source: Box<GraphError>,
    },
}

impl GraphError {
    pub fn node(node: impl Into<String>, op: impl Into<String>, msg: impl Into<String>) -> Self {
        GraphError::Node {
            node: node.into(),
            op: op.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T, E = GraphError> = std::result::Result<T, E>;
