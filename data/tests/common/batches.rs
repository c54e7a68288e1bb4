//! Batches as plain values, for comparing loaders' epochs.

use ampgraph_data::{Batch, Loader};

/// A batch as its number, indices, image values and labels.
pub type Seen = (usize, Vec<usize>, Vec<f64>, Vec<f64>);

pub fn seen(batch: ampgraph_data::Result<Batch>) -> Seen {
    let b = batch.unwrap();
    (
        b.number,
        b.indices,
        b.images.to_f64_vec(),
        b.labels.to_f64_vec(),
    )
}

/// Every batch of `epoch`.
pub fn collect(loader: &Loader, epoch: u64) -> Vec<Seen> {
    loader.epoch(epoch).map(seen).collect()
}
