//! Sharded loading for data-parallel training: the replicas' slices of global batch b,
//! concatenated in rank order, are batch b of one unsharded loader of the global batch
//! (indices, transformed images and labels), every replica takes the same number of
//! batches, a resumed shard continues its sequence, and a shard naming no replica is
//! an error.

use std::sync::Arc;

use ampgraph_data::{DataError, Loader, LoaderOptions, Mnist, Shard, Transform};

/// Values of one synthetic digit (1 x 28 x 28).
const EXAMPLE_SIZE: usize = 784;

#[path = "common/batches.rs"]
mod batches;

use batches::{collect, seen, Seen};

fn augment() -> Vec<Transform> {
    vec![
        Transform::RandomCrop { padding: 2 },
        Transform::RandomFlip,
        Transform::normalize(&[0.1307], &[0.3081]),
    ]
}

fn options(batch_size: usize, seed: u64, drop_last: bool, workers: usize) -> LoaderOptions {
    LoaderOptions {
        batch_size,
        shuffle: true,
        drop_last,
        seed,
        workers,
        prefetch: 3,
        shard: None,
    }
}

/// Examples `from..from + count` of a batch.
fn slice_of(batch: &Seen, from: usize, count: usize) -> Seen {
    let (number, indices, images, labels) = batch;
    let examples = from..from + count;
    let values = from * EXAMPLE_SIZE..(from + count) * EXAMPLE_SIZE;
    (
        *number,
        indices[examples.clone()].to_vec(),
        images[values].to_vec(),
        labels[examples].to_vec(),
    )
}

/// What replica `rank` of `world` should take, derived from the batches of one
/// unsharded loader of the global batch (`world * batch` examples, the last kept
/// short): each global batch cut into `world` equal contiguous slices, the short one
/// into slices of `len / world` (its last `len % world` examples left out), none when
/// that is 0 or `drop_last`.
fn expected_shard(
    unsharded: &[Seen],
    rank: usize,
    world: usize,
    batch: usize,
    drop_last: bool,
) -> Vec<Seen> {
    let mut want = Vec::new();
    for global in unsharded {
        let len = global.1.len();
        let slice = match len == world * batch {
            true => batch,
            false if drop_last => 0,
            false => len / world,
        };
        if slice > 0 {
            want.push(slice_of(global, rank * slice, slice));
        }
    }
    want
}

#[test]
fn the_shards_of_a_global_batch_are_the_unsharded_loaders_batch() {
    // (world, per-replica batch, examples, seed); the comments give the examples past
    // the full global batches.
    let cases = [
        (2, 8, 64, 1),   // none
        (4, 5, 203, 7),  // 3: fewer than the replicas, no short batch
        (3, 4, 100, 11), // 4: slices of 1, one example left out
        (2, 7, 100, 5),  // 2: slices of 1, none left out
        (8, 2, 100, 3),  // 4: fewer than the replicas
        (5, 3, 47, 0),   // 2: fewer than the replicas
        (1, 16, 203, 7), // 11: one replica is the unsharded loader
        (4, 6, 130, 9),  // 10: slices of 2, two left out
        (16, 1, 10, 2),  // 10: no batch at all
    ];
    for (world, batch, examples, seed) in cases {
        let data = Arc::new(Mnist::synthetic(examples, 3));
        // The truth: one loader of the global batch, its last batch kept.
        let unsharded = Loader::new(data.clone(), options(world * batch, seed, false, 2))
            .unwrap()
            .with_transforms(augment());
        for drop_last in [false, true] {
            for epoch in [0, 3] {
                let truth = collect(&unsharded, epoch);
                let mut batches_per_replica = Vec::new();
                let mut taken = Vec::new();
                for rank in 0..world {
                    let case = format!(
                        "world {world}, batch {batch}, {examples} examples, seed {seed}, \
                         drop_last {drop_last}, epoch {epoch}, rank {rank}"
                    );
                    // Workers vary by rank: the batches must not depend on them.
                    let shard = Loader::new(data.clone(), options(batch, seed, drop_last, rank))
                        .unwrap()
                        .with_transforms(augment())
                        .shard(rank, world)
                        .unwrap();
                    assert_eq!(shard.global_batch_size(), world * batch);
                    let got = collect(&shard, epoch);
                    let want = expected_shard(&truth, rank, world, batch, drop_last);
                    assert_eq!(got.len(), want.len(), "{case}: batches");
                    for (b, (got, want)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(got.0, b, "{case}: batch {b}'s number");
                        assert!(got == want, "{case}: batch {b} differs from the unsharded");
                    }
                    assert_eq!(shard.batches_per_epoch(), got.len(), "{case}");
                    batches_per_replica.push(got.len());
                    taken.extend(got.into_iter().flat_map(|(_, indices, _, _)| indices));
                }
                let case = format!(
                    "world {world}, batch {batch}, {examples} examples, drop_last {drop_last}"
                );
                assert!(
                    batches_per_replica
                        .iter()
                        .all(|&n| n == batches_per_replica[0]),
                    "{case}: every replica takes as many batches: {batches_per_replica:?}"
                );
                // Every example at most once, and only the tail described left out.
                let count = taken.len();
                taken.sort_unstable();
                taken.dedup();
                assert_eq!(taken.len(), count, "{case}: an example twice");
                let rest = examples % (world * batch);
                let left_out = match drop_last {
                    true => rest,
                    false => rest % world,
                };
                assert_eq!(count, examples - left_out, "{case}: examples taken");
            }
        }
    }
}

#[test]
fn a_shard_in_the_options_is_the_same_as_loader_shard() {
    let data = Arc::new(Mnist::synthetic(90, 3));
    for rank in 0..3 {
        let by_method = Loader::new(data.clone(), options(4, 5, false, 1))
            .unwrap()
            .shard(rank, 3)
            .unwrap();
        let by_options = Loader::new(
            data.clone(),
            LoaderOptions {
                shard: Some(Shard::new(rank, 3).unwrap()),
                ..options(4, 5, false, 1)
            },
        )
        .unwrap();
        assert_eq!(by_options.options().shard, Some(Shard { rank, world: 3 }));
        assert_eq!(
            collect(&by_method, 1),
            collect(&by_options, 1),
            "rank {rank}"
        );
    }
    // Sharding again replaces the shard, it does not shard the shard.
    let resharded = Loader::new(data.clone(), options(4, 5, false, 0))
        .unwrap()
        .shard(2, 3)
        .unwrap()
        .shard(1, 2)
        .unwrap();
    let direct = Loader::new(data, options(4, 5, false, 0))
        .unwrap()
        .shard(1, 2)
        .unwrap();
    assert_eq!(collect(&resharded, 0), collect(&direct, 0));
}

#[test]
fn a_resumed_shard_continues_its_exact_sequence() {
    let data = Arc::new(Mnist::synthetic(150, 3));
    for rank in 0..4 {
        let shard = Loader::new(data.clone(), options(6, 2, false, 2))
            .unwrap()
            .with_transforms(augment())
            .shard(rank, 4)
            .unwrap();
        let whole = collect(&shard, 4);
        // 150 = 6 batches of 24 and 6 more: a short batch of slices of 1.
        assert_eq!(whole.len(), 7);
        assert_eq!(whole[6].1.len(), 1);
        for first in [0, 3, 6, 7] {
            let resumed: Vec<Seen> = shard.epoch_from(4, first).map(seen).collect();
            assert_eq!(resumed, whole[first..], "rank {rank}, from batch {first}");
        }
    }
}

#[test]
fn a_shard_naming_no_replica_is_an_error() {
    let data = Arc::new(Mnist::synthetic(20, 3));
    let loader = || Loader::new(data.clone(), options(4, 0, false, 0)).unwrap();
    for (rank, world) in [(2, 2), (5, 2), (0, 0), (1, 0)] {
        // The error of a result, whatever it holds.
        let bad = |error: Option<DataError>| match error {
            Some(DataError::BadShard { rank: r, world: w }) => (r, w) == (rank, world),
            _ => false,
        };
        assert!(
            bad(Shard::new(rank, world).err()),
            "Shard::new({rank}, {world})"
        );
        assert!(
            bad(loader().shard(rank, world).err()),
            "shard({rank}, {world})"
        );
        let in_options = LoaderOptions {
            shard: Some(Shard { rank, world }),
            ..options(4, 0, false, 0)
        };
        let by_new = Loader::new(data.clone(), in_options);
        assert!(
            bad(by_new.err()),
            "Loader::new with shard {rank} of {world}"
        );
    }
    let err = loader().shard(2, 2).err().unwrap().to_string();
    assert_eq!(
        err,
        "shard rank 2 of a world of 2 replicas: the ranks are 0..2 (and the world at least 1)"
    );
    // A global batch past usize is refused, not wrapped.
    let huge = Loader::new(data.clone(), options(usize::MAX / 2 + 1, 0, false, 0))
        .unwrap()
        .shard(0, 2);
    assert!(matches!(huge, Err(DataError::Invalid(_))));
}
