//! What can go wrong reading data: every error names the file (and the example where
//! one is at fault), in one line.

use std::io;

use thiserror::Error;

use crate::mnist::NUM_CLASSES;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a valid gzip stream: {source}")]
    Gzip {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: truncated: {what}")]
    Truncated { path: String, what: String },
    #[error("{path}: bad magic number {found:#010x}, expected {expected:#010x} (idx {kind})")]
    BadMagic {
        path: String,
        found: u32,
        expected: u32,
        kind: &'static str,
    },
    #[error("{path}: bad dimensions: {what}")]
    BadDims { path: String, what: String },
    #[error("{path}: count mismatch: {what}")]
    CountMismatch { path: String, what: String },
    #[error("{path}: label {label} at index {index} is not a class in 0..{NUM_CLASSES}")]
    BadLabel {
        path: String,
        index: usize,
        label: u8,
    },
    /// Nothing of the data set in `dir`: `what` it is, and what was looked for.
    #[error("{dir}: no {what} found (looked for {looked})")]
    NotFound {
        dir: String,
        what: &'static str,
        looked: String,
    },
    /// Half of a pair of files: one found, its partner not.
    #[error("{dir}: {found} is there but {missing} is not")]
    Incomplete {
        dir: String,
        found: String,
        missing: String,
    },
    #[error("example {index} is out of range for a data set of {len}")]
    Index { index: usize, len: usize },
    #[error("{path}: cannot decode the image: {msg}")]
    Decode { path: String, msg: String },
    #[error(
        "{path}: {found:?} (channels, height, width), but the data set's images are {expected:?}"
    )]
    ImageShape {
        path: String,
        found: [usize; 3],
        expected: [usize; 3],
    },
    #[error("{dir}: the class folder holds no images (PNG or JPEG)")]
    EmptyClass { dir: String },
    #[error("{what}: example {index}: {source}")]
    Example {
        what: String,
        index: usize,
        #[source]
        source: Box<DataError>,
    },
    /// A replica's shard that names no replica: the ranks of `world` replicas are
    /// `0..world`, and a world holds at least one.
    #[error("shard rank {rank} of a world of {world} replicas: the ranks are 0..{world} (and the world at least 1)")]
    BadShard { rank: usize, world: usize },
    #[error("a loader worker failed making batch {batch}: {msg}")]
    Worker { batch: usize, msg: String },
    #[error("{0}")]
    Invalid(String),
}
