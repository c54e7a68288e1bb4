//! How examples get in: data sets, per-example transforms, and a loader that decodes
//! and collates batches on worker threads ahead of the training step.
//!
//! - A [`Dataset`] is a length and one example by index. Built in: MNIST-format idx
//!   files ([`Mnist`], any image size the file declares), in-memory tensors
//!   ([`TensorDataset`]) and an image folder ([`ImageFolder`], one sub-folder per
//!   class, PNG or JPEG).
//! - A [`Transform`] changes one example: normalise, random crop, random flip. Random
//!   ones draw from a generator seeded by the loader's seed, the epoch and the
//!   example's index, so an epoch's values do not depend on which thread made them.
//! - A [`Loader`] shuffles (seeded, one order per epoch), batches, and makes the
//!   batches on `workers` threads, at most `prefetch` ahead of the one taken; they come
//!   out in order, the same for any number of workers. With a [`Shard`] it is one
//!   replica's part of each global batch, for data-parallel training.
//!
//! Reading never trusts a file: every problem is a [`DataError`] naming the file (and
//! the example), and a worker's error ends the epoch with it, never a hang.
//!
//! ```no_run
//! use std::sync::Arc;
//! use ampgraph_data::{Loader, LoaderOptions, Mnist, Transform};
//! # fn main() -> Result<(), ampgraph_data::DataError> {
//! let data = Arc::new(Mnist::load("examples/data/mnist")?);
//! let options = LoaderOptions { batch_size: 128, ..LoaderOptions::default() };
//! let loader = Loader::new(data, options)?
//!     .with_transforms(vec![Transform::normalize(&[0.1307], &[0.3081])]);
//! for batch in loader.epoch(0) {
//!     let batch = batch?; // images f32 [128, 1, 28, 28], labels i64 [128]
//! #   let _ = batch;
//! }
//! # Ok(()) }
//! ```

mod error;
pub mod folder;
pub mod idx;
pub mod loader;
pub mod memory;
pub mod mnist;
pub mod transform;

pub use error::DataError;
pub use folder::ImageFolder;
pub use loader::{Batch, Epoch, Loader, LoaderOptions, Shard};
pub use memory::TensorDataset;
pub use mnist::{Mnist, Split, NUM_CLASSES};
pub use transform::Transform;

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// One example: its values, row-major in the data set's [`Dataset::shape`] (an image
/// is `[channels, height, width]`, scaled to `[0, 1]`), and its class.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub values: Vec<f32>,
    pub label: i64,
}

/// A data set: a length and one example by index. Shared by the loader's threads.
pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every example's shape (`[channels, height, width]` for images).
    fn shape(&self) -> &[usize];

    /// How many classes the labels count (labels are in `0..classes`).
    fn classes(&self) -> usize;

    /// Example `index`; an error names the file or the index.
    fn get(&self, index: usize) -> Result<Example>;

    /// What the data set is, for errors: a file or folder.
    fn describe(&self) -> String;
}
