//! How the replicas of a data-parallel step compute an [`AllReduce`] together.
//!
//! Each replica's executor joins a [`Collective`]: its rank among `world` replicas, the
//! transport (a [`SharedGroup`] of host threads for CPU executors, an NCCL unique id
//! for CUDA ones) and the group's [`Abort`]. A replica whose step fails raises the
//! abort; every other replica waiting on a collective sees it (or its own timeout),
//! gives up its communicator and fails naming the rank that failed, so no replica
//! hangs on a peer that will never come.
//!
//! [`AllReduce`]: ampgraph_graph::ops::AllReduce

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ampgraph_graph::{Data, Tensor};

/// How long a replica waits for its peers at a collective before it gives up.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The first failure among a group of replicas, seen by all of them.
#[derive(Clone, Debug, Default)]
pub struct Abort(Arc<Mutex<Option<String>>>);

impl Abort {
    fn lock(&self) -> MutexGuard<'_, Option<String>> {
        // A replica that panicked while holding the lock left the reason readable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records why the group stops (the first reason raised is kept).
    pub fn raise(&self, why: impl Into<String>) {
        let mut reason = self.lock();
        if reason.is_none() {
            *reason = Some(why.into());
        }
    }

    /// Why the group stopped, once some replica raised it.
    pub fn reason(&self) -> Option<String> {
        self.lock().clone()
    }

    /// The error of replica `rank` that stops waiting at `what` after `waited`: the
    /// group's reason, or its own timeout (which then stops the group too).
    pub fn stopped(&self, rank: usize, what: &str, waited: Duration) -> String {
        if let Some(why) = self.reason() {
            return format!("replica {rank} stopped at {what}: {why}");
        }
        let why = format!(
            "replica {rank} waited {:.1} s at {what} for the other replicas (timeout)",
            waited.as_secs_f64()
        );
        self.raise(why.clone());
        why
    }
}

/// Refuses an AllReduce over `replicas` on replica `rank` of a group of `world`.
pub fn check_replicas(replicas: usize, rank: usize, world: usize) -> Result<(), String> {
    if replicas == world {
        return Ok(());
    }
    Err(format!(
        "averages over {replicas} replicas, but this executor is replica {rank} of {world}"
    ))
}

/// NCCL's unique id of a communicator, made once by the group and given to every rank.
#[derive(Clone, Copy)]
pub struct NcclId(pub [std::ffi::c_char; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

/// How the replicas exchange their tensors.
#[derive(Clone, Debug)]
pub enum Transport {
    /// Host threads of one process (CPU executors).
    Shared(Arc<SharedGroup>),
    /// NCCL, one communicator per GPU (CUDA executors).
    Nccl(NcclId),
}

/// One replica's place in a data-parallel group.
#[derive(Clone, Debug)]
pub struct Collective {
    pub rank: usize,
    pub world: usize,
    pub transport: Transport,
    pub abort: Abort,
    /// How long a collective waits for the other replicas.
    pub timeout: Duration,
}

/// `world` host replicas averaging tensors through shared memory: each deposits its
/// tensors, the last to arrive computes the means (summing in rank order, in f64, so
/// every run gives the same bits) and wakes the others.
#[derive(Debug)]
pub struct SharedGroup {
    round: Mutex<Round>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    /// Completed rounds.
    generation: u64,
    deposits: Vec<Option<Vec<Tensor>>>,
    /// The last completed round's means (or why they could not be taken).
    means: Option<Arc<Result<Vec<Tensor>, String>>>,
}

impl SharedGroup {
    /// A group of `world` replicas and one [`Collective`] per rank.
    pub fn collectives(world: usize, abort: &Abort, timeout: Duration) -> Vec<Collective> {
        let group = Arc::new(SharedGroup {
            round: Mutex::new(Round {
                deposits: vec![None; world],
                ..Round::default()
            }),
            done: Condvar::new(),
        });
        (0..world)
            .map(|rank| Collective {
                rank,
                world,
                transport: Transport::Shared(group.clone()),
                abort: abort.clone(),
                timeout,
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.round.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mean over the replicas of each of `inputs` (the same on every rank).
    pub fn all_reduce_mean(
        &self,
        me: &Collective,
        inputs: &[&Tensor],
    ) -> Result<Vec<Tensor>, String> {
        let start = Instant::now();
        let mut round = self.lock();
        let generation = round.generation;
        round.deposits[me.rank] = Some(inputs.iter().map(|&t| t.clone()).collect());
        if round.deposits.iter().all(Option::is_some) {
            let deposits: Vec<Vec<Tensor>> =
                round.deposits.iter_mut().flat_map(Option::take).collect();
            round.means = Some(Arc::new(means(&deposits)));
            round.generation += 1;
            self.done.notify_all();
        }
        while round.generation == generation {
            if me.abort.reason().is_some() || start.elapsed() >= me.timeout {
                round.deposits[me.rank] = None;
                return Err(me.abort.stopped(me.rank, "an all-reduce", start.elapsed()));
            }
            let wait = Duration::from_millis(20).min(me.timeout.saturating_sub(start.elapsed()));
            round = self
                .done
                .wait_timeout(round, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let means = round
            .means
            .clone()
            .expect("a completed round has its means");
        drop(round);
        (*means).clone()
    }
}

/// The mean of each input over the ranks' deposits, in its dtype.
fn means(deposits: &[Vec<Tensor>]) -> Result<Vec<Tensor>, String> {
    let first = &deposits[0];
    for (rank, d) in deposits.iter().enumerate() {
        if d.len() != first.len() {
            return Err(format!(
                "replica {rank} reduces {} tensors where replica 0 reduces {}",
                d.len(),
                first.len()
            ));
        }
        for (k, (t, t0)) in d.iter().zip(first).enumerate() {
            if t.ty() != t0.ty() {
                return Err(format!(
                    "replica {rank}'s tensor {k} is {} where replica 0's is {}",
                    t.ty(),
                    t0.ty()
                ));
            }
        }
    }
    let n = deposits.len() as f64;
    (0..first.len())
        .map(|k| {
            let mut sum = first[k].to_f64_vec();
            for d in &deposits[1..] {
                for (s, v) in sum.iter_mut().zip(d[k].data().iter_f64()) {
                    *s += v;
                }
            }
            let data = Data::from_f64(first[k].dtype(), sum.into_iter().map(|s| s / n));
            Tensor::new(first[k].shape().to_vec(), data)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::DType;

    fn run(
        world: usize,
        f: impl Fn(&Collective) -> Result<Vec<Tensor>, String> + Sync,
    ) -> Vec<Result<Vec<Tensor>, String>> {
        let abort = Abort::default();
        let members = SharedGroup::collectives(world, &abort, Duration::from_secs(5));
        std::thread::scope(|s| {
            let handles: Vec<_> = members.iter().map(|m| s.spawn(|| f(m))).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect()
        })
    }

    fn reduce(m: &Collective, t: &Tensor) -> Result<Vec<Tensor>, String> {
        let Transport::Shared(group) = &m.transport else {
            unreachable!()
        };
        group.all_reduce_mean(m, &[t])
    }

    #[test]
    fn every_replica_gets_the_mean_round_after_round() {
        let results = run(3, |m| {
            let mut last = Vec::new();
            for round in 0..50 {
                let v = (m.rank * 100 + round) as f64;
                let t = Tensor::from_f64(DType::F32, [2], &[v, -v]).map_err(|e| e.to_string())?;
                last = reduce(m, &t)?;
                let mean = (100 + round) as f64; // (0 + 100 + 200) / 3 + round
                assert_eq!(last[0].to_f64_vec(), vec![mean, -mean], "round {round}");
            }
            Ok(last)
        });
        assert!(results.iter().all(Result::is_ok));
    }

    #[test]
    fn a_replica_that_fails_releases_the_others_with_its_reason() {
        let results = run(3, |m| {
            if m.rank == 1 {
                m.abort.raise("replica 1 failed: out of memory");
                return Err("failed".into());
            }
            let t = Tensor::scalar(DType::F32, 1.0);
            reduce(m, &t)
        });
        for rank in [0, 2] {
            let e = results[rank].as_ref().unwrap_err();
            assert!(e.contains("replica 1 failed: out of memory"), "{e}");
        }
    }

    #[test]
    fn a_replica_that_never_comes_times_out() {
        let abort = Abort::default();
        let members = SharedGroup::collectives(2, &abort, Duration::from_millis(100));
        let t = Tensor::scalar(DType::F32, 1.0);
        let Transport::Shared(group) = &members[0].transport else {
            unreachable!()
        };
        let e = group.all_reduce_mean(&members[0], &[&t]).unwrap_err();
        assert!(
            e.contains("replica 0 waited") && e.contains("timeout"),
            "{e}"
        );
        assert!(abort.reason().is_some(), "the timeout stops the group");
    }

    #[test]
    fn replicas_that_disagree_on_shapes_get_an_error_naming_them() {
        let results = run(2, |m| {
            let t = Tensor::zeros(&ampgraph_graph::TensorType::new(DType::F32, [m.rank + 1]));
            reduce(m, &t)
        });
        for r in results {
            let e = r.unwrap_err();
            assert!(
                e.contains("replica 1's tensor 0 is f32[2] where replica 0's is f32[1]"),
                "{e}"
            );
        }
    }
}
