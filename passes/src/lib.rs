//! ampgraph-passes: graph rewrites.
//!
//! A rewrite is a [`Pass`]; a [`PassManager`] runs an ordered pipeline of them, times
//! each, validates the graph between them (in tests and debug builds) and collects
//! each pass's summary. The heart is [`amp::AutoMixedPrecision`]; [`simplify`] holds
//! the graph simplifications, and [`registry`] names every pass that needs no settings.

pub mod activation_into_fp8;
pub mod amax_into_elementwise;
pub mod amp;
pub mod attention;
pub mod attention_grad_into_fp8;
pub mod attention_into_fp8;
pub mod bias_before_reshape;
pub mod compose_views;
pub mod cross_entropy;
pub mod data_parallel;
pub mod elementwise_into_fp8;
pub mod epilogue;
pub mod fuse;
pub mod fuse_batchnorm_activation;
pub mod group_fp8_casts;
pub mod group_updates;
pub mod layout_nhwc;
pub mod merge_projections;
pub mod norm_grad_epilogue;
pub mod norm_grad_into_fp8;
pub mod norm_into_fp8;
pub mod pack_qkv;
pub mod recognize_gelu;
pub mod recognize_layer_norm;
pub mod recompute;
pub mod registry;
mod rewrite;
pub mod simplify;
pub mod softmax_prologue;
pub mod sum_into_elementwise;
pub mod sync_batch_norm;
#[cfg(test)]
mod testing;

pub use sync_batch_norm::SyncBatchNorm;

use std::time::{Duration, Instant};

use ampgraph_graph::{Graph, GraphError};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PassError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("precision lists: {0}")]
    Lists(String),
    #[error("rewrite: {0}")]
    Rewrite(String),
    #[error("pass '{pass}' left an invalid graph: {source}")]
    Invalid {
        pass: &'static str,
        #[source]
        source: GraphError,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A byte count as pass summaries print it: `512 B`, `1.2 KiB`, `1086.5 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    match bytes {
        b if b < 1024 => format!("{b} B"),
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

/// What a pass reports after it ran: a title and the lines of its summary.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassSummary {
    pub title: String,
    pub lines: Vec<String>,
}

impl std::fmt::Display for PassSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.title)?;
        for line in &self.lines {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

/// One graph rewrite (shareable across threads, as the sessions holding them are).
pub trait Pass: Send + Sync {
    /// The pass's name, as `ampgraph rewrite --passes` selects it.
    fn name(&self) -> &'static str;

    /// Rewrites `graph` in place and says what it did.
    fn run(&self, graph: &mut Graph) -> Result<PassSummary, PassError>;
}

/// A pass's summary and how long it took.
#[derive(Clone, Debug)]
pub struct PassRecord {
    pub pass: &'static str,
    pub elapsed: Duration,
    pub summary: PassSummary,
}

/// Runs passes in order.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    /// Validate the graph after every pass (on in debug builds and tests).
    pub validate: bool,
}

impl Default for PassManager {
    fn default() -> Self {
        PassManager {
            passes: Vec::new(),
            validate: cfg!(debug_assertions),
        }
    }
}

impl PassManager {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with(mut self, pass: impl Pass + 'static) -> Self {
        self.passes.push(Box::new(pass));
        self
    }

    pub fn push(&mut self, pass: Box<dyn Pass>) {
        self.passes.push(pass);
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Runs every pass; each summary also goes to the log at info level.
    pub fn run(&self, graph: &mut Graph) -> Result<Vec<PassRecord>, PassError> {
        let mut records = Vec::with_capacity(self.passes.len());
        for pass in &self.passes {
            let start = Instant::now();
            let summary = pass.run(graph)?;
            let elapsed = start.elapsed();
            if self.validate {
                graph.validate().map_err(|source| PassError::Invalid {
                    pass: pass.name(),
                    source,
                })?;
            }
            log::info!("{summary}");
            records.push(PassRecord {
                pass: pass.name(),
                elapsed,
                summary,
            });
        }
        Ok(records)
    }
}
