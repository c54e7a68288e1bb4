//! Batches of a [`Dataset`], made on worker threads ahead of the step that takes them.
//!
//! An epoch's order is fixed by the seed and the epoch (`Loader::order`); batch `b`
//! holds the examples at positions `b * batch_size ..` of it, each transformed with a
//! generator seeded by (seed, epoch, index). Workers take the next batch number from a
//! shared counter, at most `prefetch` ahead of the batch the consumer takes, and the
//! epoch hands batches out in their numbers' order: the same batches for any number of
//! workers. A worker's error (or panic) is that batch's error; the epoch ends there.
//!
//! With a [`Shard`] (data-parallel training, one replica per GPU) the epoch is that of
//! one loader of the global batch, `world * batch_size`: global batch `b` is cut into
//! `world` contiguous slices of `batch_size`, and replica `rank` takes slice `rank`,
//! numbered `b`. Every replica shuffles with the same (seed, epoch), so the replicas
//! together take each global batch once, and all of them the same number of batches.
//! A short last global batch (kept unless `drop_last`) is cut into `world` equal
//! slices of `rest / world`; the `rest % world` examples past them (fewer than `world`)
//! are left out of that epoch, and the batch is dropped if no slice would hold one.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use ampgraph_graph::host_memory::{self, mib};
use ampgraph_graph::rng::SplitMix64;
use ampgraph_graph::{Data, Tensor};

use crate::{DataError, Dataset, Result, Transform};

/// `0..n` shuffled deterministically by `seed` (Fisher-Yates on SplitMix64).
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// Replica `rank` of `world` data-parallel replicas: the loader hands it its slice
/// of every global batch (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// Replica `rank` of `world`; a rank out of `0..world` (or a world of 0) is an error.
    pub fn new(rank: usize, world: usize) -> Result<Shard> {
        if rank >= world {
            return Err(DataError::BadShard { rank, world });
        }
        Ok(Shard { rank, world })
    }

    /// Every replica's batch: one loader without shards.
    const WHOLE: Shard = Shard { rank: 0, world: 1 };
}

/// How a [`Loader`] batches.
#[derive(Clone, Debug)]
pub struct LoaderOptions {
    /// Examples in a batch (with a shard, in this replica's batch: the global batch is
    /// `world` times it).
    pub batch_size: usize,
    /// A new order each epoch (seeded), else the data set's order.
    pub shuffle: bool,
    /// Leaves out the last batch when it is short (a graph's batch size is fixed).
    pub drop_last: bool,
    pub seed: u64,
    /// Threads making batches; 0 makes them on the consumer's thread, when taken.
    pub workers: usize,
    /// How many batches may be made ahead of the one taken.
    pub prefetch: usize,
    /// This replica's slice of every global batch; `None` takes whole batches.
    pub shard: Option<Shard>,
}

impl Default for LoaderOptions {
    /// Batches of 1, shuffled with seed 0, the last kept; a worker per core, two
    /// batches ahead per worker (PyTorch's `prefetch_factor`).
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        LoaderOptions {
            batch_size: 1,
            shuffle: true,
            drop_last: false,
            seed: 0,
            workers: cores,
            prefetch: 2 * cores,
            shard: None,
        }
    }
}

/// A data set's examples, transformed and collated: images f32 `[B, ..shape]`,
/// labels i64 `[B]`.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The batch's place in its epoch.
    pub number: usize,
    /// The data set's indices of its examples, in order.
    pub indices: Vec<usize>,
    pub images: Tensor,
    pub labels: Tensor,
}

/// Makes the batches of a data set, epoch by epoch.
#[derive(Clone)]
pub struct Loader {
    dataset: Arc<dyn Dataset>,
    transforms: Arc<Vec<Transform>>,
    options: LoaderOptions,
}

impl Loader {
    /// A loader of `dataset`; refuses a zero batch size or prefetch, an empty set and a
    /// shard naming no replica.
    pub fn new(dataset: Arc<dyn Dataset>, options: LoaderOptions) -> Result<Loader> {
        if options.batch_size == 0 {
            return Err(DataError::Invalid("a batch size of 0".into()));
        }
        if let Some(shard) = options.shard {
            check_shard(shard, options.batch_size)?;
        }
        if options.workers > 0 && options.prefetch == 0 {
            return Err(DataError::Invalid(
                "workers with a prefetch of 0 batches would never start".into(),
            ));
        }
        if dataset.is_empty() {
            return Err(DataError::Invalid(format!(
                "{}: no examples",
                dataset.describe()
            )));
        }
        // The batches in flight (made ahead, and the one in use) as f32, before any is
        // made: two 12000x12000 images in batches of 32 asked for 18 GB and aborted.
        let example: usize = dataset.shape().iter().product();
        let in_flight = options.prefetch.max(1).saturating_add(1);
        // A batch holds at most the whole set.
        let per_batch = options.batch_size.min(dataset.len());
        let bytes = (example.checked_mul(per_batch))
            .and_then(|b| b.checked_mul(4))
            .and_then(|b| b.checked_mul(in_flight));
        let available = host_memory::available_bytes().unwrap_or(usize::MAX);
        if bytes.is_none_or(|b| b > available) {
            return Err(DataError::Invalid(format!(
                "{}: {in_flight} batches of {per_batch} examples of shape {:?} in flight take \
                 {}, beyond the {:.1} MiB available: a smaller batch size or prefetch",
                dataset.describe(),
                dataset.shape(),
                bytes.map_or("more bytes than can be addressed".into(), |b| format!(
                    "{:.1} MiB",
                    mib(b)
                )),
                mib(available)
            )));
        }
        Ok(Loader {
            dataset,
            transforms: Arc::new(Vec::new()),
            options,
        })
    }

    /// Applies `transforms` to every example, in order.
    pub fn with_transforms(mut self, transforms: Vec<Transform>) -> Loader {
        self.transforms = Arc::new(transforms);
        self
    }

    /// This loader as replica `rank` of `world` (replacing any shard it had):
    /// `batch_size` stays the replica's batch.
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Loader> {
        let shard = Shard { rank, world };
        check_shard(shard, self.options.batch_size)?;
        self.options.shard = Some(shard);
        Ok(self)
    }

    /// The examples of a step over all replicas: `world * batch_size` (`batch_size`
    /// without a shard).
    pub fn global_batch_size(&self) -> usize {
        self.options.batch_size * self.shard_or_whole().world
    }

    fn shard_or_whole(&self) -> Shard {
        self.options.shard.unwrap_or(Shard::WHOLE)
    }

    pub fn options(&self) -> &LoaderOptions {
        &self.options
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// The data set's indices in `epoch`'s order.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let n = self.dataset.len();
        match self.options.shuffle {
            true => shuffled(n, mix(self.options.seed, epoch)),
            false => (0..n).collect(),
        }
    }

    /// Batches in an epoch (with a shard, the same for every replica).
    pub fn batches_per_epoch(&self) -> usize {
        let full = self.dataset.len() / self.global_batch_size();
        match !self.options.drop_last && self.short_slice() > 0 {
            true => full + 1,
            false => full,
        }
    }

    /// A replica's part of the short last global batch: the examples past the full
    /// batches shared equally (0 when there are none, or fewer than replicas).
    fn short_slice(&self) -> usize {
        let rest = self.dataset.len() % self.global_batch_size();
        rest / self.shard_or_whole().world
    }

    /// The positions in the epoch's order of this loader's part of batch `b`.
    fn positions(&self, b: usize) -> std::ops::Range<usize> {
        let global = self.global_batch_size();
        let slice = match b < self.dataset.len() / global {
            true => self.options.batch_size,
            false => self.short_slice(),
        };
        let start = b * global + self.shard_or_whole().rank * slice;
        start..start + slice
    }

    /// The batches of `epoch`, in order.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        self.epoch_from(epoch, 0)
    }

    /// The batches of `epoch` from batch `first` on (a run resumed mid-epoch takes the
    /// batches an uninterrupted one would).
    pub fn epoch_from(&self, epoch: u64, first: usize) -> Epoch {
        let order = self.order(epoch);
        let batches: Vec<Vec<usize>> = (first..self.batches_per_epoch())
            .map(|b| order[self.positions(b)].to_vec())
            .collect();
        let maker = Arc::new(Maker {
            dataset: self.dataset.clone(),
            transforms: self.transforms.clone(),
            seed: mix(self.options.seed, epoch),
            first,
            batches,
        });
        Epoch::start(maker, self.options.workers, self.options.prefetch)
    }
}

/// Refuses a shard naming no replica, and a global batch too large to count (so that
/// positions in an epoch are computed without overflow).
fn check_shard(shard: Shard, batch_size: usize) -> Result<()> {
    let Shard { rank, world } = Shard::new(shard.rank, shard.world)?;
    if batch_size.checked_mul(world).is_none() {
        return Err(DataError::Invalid(format!(
            "replica {rank}: a global batch of {world} replicas times {batch_size} examples overflows"
        )));
    }
    Ok(())
}

/// Two values mixed into one seed.
fn mix(a: u64, b: u64) -> u64 {
    let mut state = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ampgraph_graph::rng::step(&mut state)
}

/// What an epoch's threads share: how to make batch `k` of it.
struct Maker {
    dataset: Arc<dyn Dataset>,
    transforms: Arc<Vec<Transform>>,
    /// The epoch's seed.
    seed: u64,
    /// The number of `batches[0]` in the epoch.
    first: usize,
    batches: Vec<Vec<usize>>,
}

impl Maker {
    /// Batch `k` of this run (number `first + k` of the epoch), a panic as an error.
    fn make(&self, k: usize) -> Result<Batch> {
        let number = self.first + k;
        catch_unwind(AssertUnwindSafe(|| self.collate(number, &self.batches[k]))).unwrap_or_else(
            |panic| {
                let msg = (panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Err(DataError::Worker { batch: number, msg })
            },
        )
    }

    fn collate(&self, number: usize, indices: &[usize]) -> Result<Batch> {
        let shape = self.dataset.shape().to_vec();
        let size: usize = shape.iter().product();
        let mut values = Vec::with_capacity(indices.len() * size);
        let mut labels = Vec::with_capacity(indices.len());
        let classes = self.dataset.classes() as i64;
        for &index in indices {
            let in_example = |source: DataError| DataError::Example {
                what: self.dataset.describe(),
                index,
                source: Box::new(source),
            };
            let mut example = self.dataset.get(index).map_err(in_example)?;
            let mut rng = SplitMix64::new(mix(self.seed, index as u64));
            for t in self.transforms.iter() {
                t.apply(&mut example.values, &shape, &mut rng)
                    .map_err(in_example)?;
            }
            if example.values.len() != size {
                return Err(in_example(DataError::Invalid(format!(
                    "{} values, the data set's shape {shape:?} holds {size}",
                    example.values.len()
                ))));
            }
            if !(0..classes).contains(&example.label) {
                return Err(in_example(DataError::Invalid(format!(
                    "label {} is not a class in 0..{classes}",
                    example.label
                ))));
            }
            values.extend_from_slice(&example.values);
            labels.push(example.label);
        }
        let b = indices.len();
        let images = Tensor::new([&[b][..], &shape].concat(), Data::F32(values))
            .map_err(DataError::Invalid)?;
        let labels = Tensor::new([b], Data::I64(labels)).map_err(DataError::Invalid)?;
        Ok(Batch {
            number,
            indices: indices.to_vec(),
            images,
            labels,
        })
    }
}

/// The workers' window: the next batch to take and how many the consumer took.
#[derive(Default)]
struct Window {
    next: usize,
    taken: usize,
    stop: bool,
}

/// One epoch's batches in order, made by its worker threads (or, with none, when
/// taken). Dropping it stops and joins the workers.
pub struct Epoch {
    maker: Arc<Maker>,
    /// The next batch to hand out (of `maker.batches`).
    next: usize,
    workers: Vec<JoinHandle<()>>,
    window: Arc<(Mutex<Window>, Condvar)>,
    made: Option<Receiver<(usize, Result<Batch>)>>,
    /// Batches made before their turn.
    early: BTreeMap<usize, Result<Batch>>,
    /// An error ended the epoch.
    failed: bool,
}

impl Epoch {
    fn start(maker: Arc<Maker>, workers: usize, prefetch: usize) -> Epoch {
        let window = Arc::new((Mutex::new(Window::default()), Condvar::new()));
        let mut epoch = Epoch {
            maker,
            next: 0,
            workers: Vec::new(),
            window,
            made: None,
            early: BTreeMap::new(),
            failed: false,
        };
        if workers == 0 {
            return epoch;
        }
        let (send, receive) = channel();
        for _ in 0..workers.min(epoch.maker.batches.len()) {
            let (maker, window, send) = (epoch.maker.clone(), epoch.window.clone(), send.clone());
            epoch.workers.push(std::thread::spawn(move || loop {
                let k = {
                    let (lock, turn) = &*window;
                    let Ok(mut w) = lock.lock() else { return };
                    while !w.stop && w.next < maker.batches.len() && w.next >= w.taken + prefetch {
                        w = match turn.wait(w) {
                            Ok(w) => w,
                            Err(_) => return,
                        };
                    }
                    if w.stop || w.next >= maker.batches.len() {
                        return;
                    }
                    w.next += 1;
                    w.next - 1
                };
                if send.send((k, maker.make(k))).is_err() {
                    return;
                }
            }));
        }
        epoch.made = Some(receive);
        epoch
    }

    /// Batch `k`, from the workers (waiting for it) or made here.
    fn take(&mut self, k: usize) -> Result<Batch> {
        let Some(made) = &self.made else {
            return self.maker.make(k);
        };
        loop {
            if let Some(batch) = self.early.remove(&k) {
                return batch;
            }
            match made.recv() {
                Ok((j, batch)) => {
                    self.early.insert(j, batch);
                }
                Err(_) => {
                    return Err(DataError::Worker {
                        batch: self.maker.first + k,
                        msg: "the workers ended before making it".into(),
                    })
                }
            }
        }
    }

    fn stop(&mut self) {
        let (lock, turn) = &*self.window;
        if let Ok(mut w) = lock.lock() {
            w.stop = true;
        }
        turn.notify_all();
        // Workers blocked on a send see the receiver gone.
        self.made = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl Iterator for Epoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.failed || self.next >= self.maker.batches.len() {
            return None;
        }
        let batch = self.take(self.next);
        self.next += 1;
        let (lock, turn) = &*self.window;
        if let Ok(mut w) = lock.lock() {
            w.taken = self.next;
        }
        turn.notify_all();
        if batch.is_err() {
            self.failed = true;
            self.stop();
        }
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.maker.batches.len() - self.next;
        (left, Some(left))
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_is_a_permutation_fixed_by_its_seed() {
        let mut v = shuffled(1000, 3);
        assert_eq!(v, shuffled(1000, 3));
        assert_ne!(v, shuffled(1000, 4));
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
    }
}
