//! Data-parallel training: one replica of a training step per device, each on its own
//! shard of the global batch, the gradients averaged over the replicas before the
//! updates (PyTorch's DistributedDataParallel).
//!
//! [`Replicas::new`] runs one process, one thread per replica. Rust has no interpreter lock
//! to escape, so threads give each GPU its own host core as processes would, without
//! a launcher, a rendezvous or a port: the graph is built once and copied, every
//! replica initialises its variables from the same seed (so all start equal, as DDP's
//! broadcast from rank 0 makes them), and a failing replica stops the others through
//! shared memory at once ([`Abort`]): each waiting replica aborts its NCCL
//! communicator and the group's error names the replica that failed.
//!
//! The [`DataParallel`] pass adds the gradient means (bucketed AllReduce nodes); on
//! CUDA devices NCCL computes them on a second stream while the backward pass goes on,
//! on the CPU a shared-memory group does (the CPU simulation the tests compare with
//! one replica at the global batch).
//!
//! [`Replicas::in_process_group`] runs this process's replica of a group of processes
//! that a launcher started (torchrun, Slurm's `srun`: [`ProcessGroup::from_env`]):
//! they meet at rank 0 over TCP, which compares their collectives and gives them its
//! NCCL id; CPU replicas then average through rank 0 over the same connections, with
//! the bits of threads. The same training API serves both.

pub mod process_group;

pub use process_group::{GroupError, ProcessGroup, Rendezvous};

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ampgraph_data::Loader;
use ampgraph_exec::collective::{
    Abort, Collective, NcclId, SharedGroup, TcpGroup, Transport, DEFAULT_TIMEOUT,
};
use ampgraph_exec::cuda::nccl;
use ampgraph_exec::Feeds;
use ampgraph_graph::ops::{AllReduce, Reduction};
use ampgraph_graph::{DType, Graph, Port, Tensor};
use ampgraph_passes::data_parallel::DataParallel;

use crate::optim::TrainStep;
use crate::session::{Device, Session, SessionError, SessionOptions};
use crate::train::{read_position, write_position, Position};

/// What stops a data-parallel group.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// A replica's step failed; the others were stopped.
    #[error("replica {rank} failed: {source}")]
    Replica {
        rank: usize,
        #[source]
        source: Box<SessionError>,
    },
    /// The replicas could not be set up (devices, NCCL, graphs that disagree).
    #[error("data parallel: {0}")]
    Setup(String),
    #[error(transparent)]
    Data(#[from] ampgraph_data::DataError),
    #[error(transparent)]
    Group(#[from] GroupError),
}

/// How a group of replicas runs.
#[derive(Clone, Debug)]
pub struct ReplicaOptions {
    /// Each replica's session (the same for all).
    pub session: SessionOptions,
    /// How long a replica waits for the others at a collective.
    pub timeout: Duration,
    /// The gradient buckets' size in bytes (the first bucket is at most 1 MiB).
    pub bucket_bytes: usize,
}

impl Default for ReplicaOptions {
    fn default() -> Self {
        ReplicaOptions {
            session: SessionOptions::default(),
            timeout: DEFAULT_TIMEOUT,
            bucket_bytes: ampgraph_passes::data_parallel::BUCKET_BYTES,
        }
    }
}

/// One replica's part of a data-parallel epoch.
#[derive(Clone, Debug, Default)]
struct ReplicaEpoch {
    steps: usize,
    examples: usize,
    loss_sum: f64,
    seconds: f64,
}

/// A data-parallel epoch over all replicas.
#[derive(Clone, Debug)]
pub struct ParallelEpochReport {
    /// Where the next epoch starts.
    pub next: Position,
    /// Steps each replica ran.
    pub steps: usize,
    /// Examples over all replicas.
    pub examples: usize,
    /// The mean over steps and replicas of the replicas' losses.
    pub loss: f64,
    /// The slowest replica's wall-clock seconds.
    pub seconds: f64,
}

impl ParallelEpochReport {
    pub fn examples_per_second(&self) -> f64 {
        self.examples as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// A training graph replicated over devices: every replica, or this process's one.
pub struct Replicas {
    sessions: Vec<Session>,
    /// Each session's rank: 0..world in one process, this process's rank in a group.
    ranks: Vec<usize>,
    world: usize,
    abort: Abort,
    /// In a group of processes: rank 0's connections to this one, for what the
    /// replicas report together.
    host: Option<Collective>,
}

/// The AllReduce nodes of a graph in order, with their inputs' types: what replicas
/// must agree on before their first step, or their collectives would not match.
fn collective_signature(g: &Graph) -> Result<Vec<String>, SessionError> {
    Ok(g.topo_order()?
        .into_iter()
        .filter(|&id| g.node(id).op.is::<AllReduce>())
        .map(|id| {
            let types: Vec<String> = g.inputs(id).iter().map(|&p| g.ty(p).to_string()).collect();
            format!("{}({})", g.node(id).name, types.join(", "))
        })
        .collect())
}

/// NCCL's settings, where the environment does not give them (once per process,
/// before the first communicator; NCCL reads them then).
fn nccl_environment() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // NVLink multicast (NVLS) stays off: gradient buckets do not need it, and on
        // shared hosts a program using it can take the GPUs down.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        // Connections made when the communicators are (every rank is there then),
        // not in the first collective of each kind, where a host waiting on its
        // device could keep its peer from connecting.
        if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
            std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
        }
    });
}

/// Runs `f` on every item at once, item `rank` on a thread of its own (a replica and
/// what it runs on). The first to fail raises `abort` with its error, which stops the
/// others at their next collective, and is the error, with its rank; a thread that
/// panicked is its rank with no error.
pub fn on_each_replica<T, R, E>(
    items: &mut [T],
    abort: &Abort,
    f: impl Fn(usize, &mut T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, (usize, Option<E>)>
where
    T: Send,
    R: Send,
    E: Send + std::fmt::Display,
{
    let first_failure: Mutex<Option<(usize, E)>> = Mutex::new(None);
    let results: Vec<Option<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .iter_mut()
            .enumerate()
            .map(|(rank, item)| {
                let (f, first_failure) = (&f, &first_failure);
                s.spawn(move || match f(rank, item) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        // Recorded and raised under one lock: a replica stopped by
                        // this abort finds the slot taken.
                        let mut first = first_failure.lock().unwrap_or_else(|p| p.into_inner());
                        if first.is_none() {
                            abort.raise(format!("replica {rank} failed: {e}"));
                            *first = Some((rank, e));
                        }
                        None
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    });
    if let Some((rank, e)) = first_failure
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
    {
        return Err((rank, Some(e)));
    }
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.ok_or((rank, None)))
        .collect()
}

/// One [`Collective`] per device, sharing one [`Abort`]: NCCL communicators' unique
/// id for CUDA devices (NVLink multicast left off), a shared-memory group for CPUs.
pub fn collectives(
    devices: &[Device],
    timeout: Duration,
) -> Result<Vec<Collective>, ParallelError> {
    let world = devices.len();
    let on_cuda = devices.iter().all(|d| matches!(d, Device::Cuda(_)));
    if world == 0 || (!on_cuda && devices.iter().any(|d| matches!(d, Device::Cuda(_)))) {
        return Err(ParallelError::Setup(
            "the replicas' devices must be all CUDA or all CPU, at least one".into(),
        ));
    }
    let abort = Abort::default();
    if !on_cuda {
        return Ok(SharedGroup::collectives(world, &abort, timeout));
    }
    nccl_environment();
    let id = nccl::unique_id().map_err(ParallelError::Setup)?;
    Ok((0..world)
        .map(|rank| Collective {
            rank,
            world,
            transport: Transport::Nccl(id),
            abort: abort.clone(),
            timeout,
        })
        .collect())
}

impl Replicas {
    /// `graph` (a training step, as `minimize` builds it) on each of `devices`: the
    /// gradients averaged over them (the [`DataParallel`] pass), one session per
    /// device. Devices are all CUDA or all CPU.
    pub fn new(
        graph: Graph,
        devices: &[Device],
        options: ReplicaOptions,
    ) -> Result<Replicas, ParallelError> {
        Self::with_graphs(vec![graph; devices.len()], devices, options)
    }

    /// As [`new`](Self::new), with each replica's own graph: they must average the
    /// same tensors in the same buckets, checked before the first step.
    pub fn with_graphs(
        graphs: Vec<Graph>,
        devices: &[Device],
        options: ReplicaOptions,
    ) -> Result<Replicas, ParallelError> {
        let world = devices.len();
        if world == 0 || graphs.len() != world {
            return Err(ParallelError::Setup(format!(
                "{} graphs for {world} devices (one graph per device, at least one)",
                graphs.len()
            )));
        }
        // First: it refuses mixed devices before any session is made.
        let collectives = collectives(devices, options.timeout)?;
        let session_options = SessionOptions {
            data_parallel: Some(DataParallel {
                bucket_bytes: options.bucket_bytes,
                ..DataParallel::new(world)
            }),
            ..options.session.clone()
        };
        let mut sessions = Vec::with_capacity(world);
        for (rank, (graph, &device)) in graphs.into_iter().zip(devices).enumerate() {
            let session = Session::with_options(graph, device, session_options.clone()).map_err(
                |source| ParallelError::Replica {
                    rank,
                    source: Box::new(source),
                },
            )?;
            sessions.push(session);
        }
        let signatures = sessions
            .iter()
            .map(|s| collective_signature(s.graph()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ParallelError::Setup(e.to_string()))?;
        for (rank, sig) in signatures.iter().enumerate().skip(1) {
            if *sig != signatures[0] {
                return Err(ParallelError::Setup(format!(
                    "replica {rank}'s graph averages [{}] where replica 0's averages [{}]: the replicas must run the same step",
                    sig.join("; "),
                    signatures[0].join("; ")
                )));
            }
        }
        let abort = collectives[0].abort.clone();
        let mut replicas = Replicas {
            sessions,
            ranks: (0..world).collect(),
            world,
            abort,
            host: None,
        };
        // Every rank joins at once: NCCL's communicators are made together.
        replicas.on_each(|rank, session| {
            Ok(session
                .executor_mut()
                .join_collective(collectives[rank].clone())?)
        })?;
        Ok(replicas)
    }

    /// `graph` on this process's replica of a group of processes (one per GPU, as
    /// torchrun or srun start them: [`ProcessGroup::from_env`]), on `device`
    /// (`Device::Cuda(group.local_rank)` on GPUs). The processes meet at rank 0 within
    /// `options.timeout`; a rank whose collectives differ from rank 0's is refused
    /// before any step. CUDA replicas then average through NCCL, CPU ones through rank
    /// 0 over TCP (the bits of [`new`](Self::new)'s threads).
    pub fn in_process_group(
        graph: Graph,
        group: &ProcessGroup,
        device: Device,
        options: ReplicaOptions,
    ) -> Result<Replicas, ParallelError> {
        let replica = |source| ParallelError::Replica {
            rank: group.rank,
            source: Box::new(source),
        };
        let session_options = SessionOptions {
            data_parallel: Some(DataParallel {
                bucket_bytes: options.bucket_bytes,
                ..DataParallel::new(group.world)
            }),
            ..options.session.clone()
        };
        let mut session = Session::with_options(graph, device, session_options).map_err(replica)?;
        let on_cuda = matches!(device, Device::Cuda(_));
        let met = group.join(session.graph(), on_cuda, options.timeout)?;
        session
            .executor_mut()
            .join_collective(met.collective)
            .map_err(|e| replica(e.into()))?;
        Ok(Replicas {
            sessions: vec![session],
            ranks: vec![group.rank],
            world: group.world,
            abort: met.host.abort.clone(),
            host: Some(met.host),
        })
    }

    /// How many replicas there are (in every process).
    pub fn world(&self) -> usize {
        self.world
    }

    /// Replica `rank`'s session, where this process holds it.
    pub fn session(&self, rank: usize) -> Option<&Session> {
        let index = self.ranks.iter().position(|&r| r == rank)?;
        self.sessions.get(index)
    }

    /// Whether this process holds replica 0, which writes checkpoints and reports
    /// progress.
    pub fn leads(&self) -> bool {
        self.ranks.contains(&0)
    }

    /// Runs `f` on every replica at once, each on its own thread. The first replica
    /// to fail stops the others (their collectives give up) and is the error.
    pub fn on_each<R: Send>(
        &mut self,
        f: impl Fn(usize, &mut Session) -> Result<R, SessionError> + Sync,
    ) -> Result<Vec<R>, ParallelError> {
        self.on_each_held(|_, rank, session| f(rank, session))
    }

    /// [`on_each`](Self::on_each), `f` given each session's place among this process's
    /// and its rank.
    fn on_each_held<R: Send>(
        &mut self,
        f: impl Fn(usize, usize, &mut Session) -> Result<R, SessionError> + Sync,
    ) -> Result<Vec<R>, ParallelError> {
        if let Some(why) = self.abort.reason() {
            return Err(ParallelError::Setup(format!(
                "the replicas stopped earlier ({why}); make them anew"
            )));
        }
        let ranks = &self.ranks;
        let f = |index: usize, session: &mut Session| f(index, ranks[index], session);
        on_each_replica(&mut self.sessions, &self.abort, f).map_err(|(index, e)| {
            let rank = ranks[index];
            match e {
                Some(source) => ParallelError::Replica {
                    rank,
                    source: Box::new(source),
                },
                None => ParallelError::Setup(format!("replica {rank} panicked")),
            }
        })
    }

    /// One step on every replica of this process, its `k`-th fed `feeds[k]`; each
    /// one's fetches.
    pub fn run(
        &mut self,
        fetches: &[Port],
        feeds: &[Feeds],
    ) -> Result<Vec<Vec<Tensor>>, ParallelError> {
        if feeds.len() != self.sessions.len() {
            return Err(ParallelError::Setup(format!(
                "{} feeds for {} replicas",
                feeds.len(),
                self.sessions.len()
            )));
        }
        self.on_each_held(|index, _, session| session.run(fetches, &feeds[index]))
    }

    /// The rest of epoch `at.epoch` of `loader` from global batch `at.batch`, each
    /// replica on its shard ([`Loader::shard`]): together they take the loader's global
    /// batches (its batch size is the per-replica one). The position after it is kept
    /// in every replica's position variables (as a [`Trainer`](crate::Trainer) keeps
    /// its own), so [`save`](Self::save) writes it and [`resume`](Self::resume) reads it.
    pub fn epoch(
        &mut self,
        loader: &Loader,
        step: &TrainStep,
        images: Port,
        labels: Port,
        at: Position,
    ) -> Result<ParallelEpochReport, ParallelError> {
        let world = self.world();
        let shards = (self.ranks.iter())
            .map(|&rank| loader.clone().shard(rank, world))
            .collect::<Result<Vec<_>, _>>()?;
        let fetches = [step.loss, step.step];
        let next = Position {
            epoch: at.epoch + 1,
            batch: 0,
        };
        let parts = self.on_each_held(|index, _, session| {
            let name = |p: Port| session.graph().node(p.node).name.clone();
            let (images, labels) = (name(images), name(labels));
            let start = Instant::now();
            let mut part = ReplicaEpoch::default();
            for batch in shards[index].epoch_from(at.epoch as u64, at.batch) {
                let batch = batch?;
                part.examples += batch.images.shape().first().copied().unwrap_or(0);
                let feeds = Feeds::from([
                    (images.clone(), batch.images),
                    (labels.clone(), batch.labels),
                ]);
                let out = session.run(&fetches, &feeds)?;
                part.loss_sum += out[0].to_f64_vec().first().copied().unwrap_or(f64::NAN);
                part.steps += 1;
            }
            part.seconds = start.elapsed().as_secs_f64();
            write_position(session, next)?;
            Ok(part)
        })?;
        let steps = parts[0].steps;
        // Means over the replicas, summed in rank order in f64 (as the gradients'), so
        // threads and processes report the same bits.
        let totals = |p: &ReplicaEpoch| [p.loss_sum, p.examples as f64];
        let means = match &self.host {
            Some(host) => {
                let local = Tensor::from_f64(DType::F64, [2], &totals(&parts[0]))
                    .map_err(|e| ParallelError::Setup(e.to_string()))?;
                let mean = host.host_all_reduce(&[&local], Reduction::Mean);
                mean.map_err(ParallelError::Setup)?[0].to_f64_vec()
            }
            None => (0..2)
                .map(|k| parts.iter().map(|p| totals(p)[k]).sum::<f64>() / world as f64)
                .collect(),
        };
        Ok(ParallelEpochReport {
            next,
            steps,
            examples: (means[1] * world as f64).round() as usize,
            loss: means[0] / steps.max(1) as f64,
            seconds: parts.iter().map(|p| p.seconds).fold(0.0, f64::max),
        })
    }

    /// Writes replica 0's variables (every replica holds the same) as
    /// [`Session::save`] does; in a group of processes, rank 0's process alone.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), ParallelError> {
        let Some(first) = self.session(0) else {
            return Ok(());
        };
        first.save(path).map_err(|source| ParallelError::Replica {
            rank: 0,
            source: Box::new(source),
        })
    }

    /// Restores a checkpoint into every replica.
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<(), ParallelError> {
        let path = path.as_ref();
        self.on_each(|_, session| session.restore(path))?;
        Ok(())
    }

    /// Restores a checkpoint that [`epoch`](Self::epoch) and [`save`](Self::save) wrote
    /// (or a [`Trainer`](crate::Trainer)'s) into every replica, and returns the
    /// position it holds: the next [`epoch`](Self::epoch) continues exactly there.
    pub fn resume(&mut self, path: impl AsRef<Path>) -> Result<Position, ParallelError> {
        let path = path.as_ref();
        // The position variables exist before the restore, which then fills them.
        self.on_each(|_, session| {
            write_position(session, Position::START)?;
            session.restore(path)
        })?;
        read_position(&self.sessions[0], path).map_err(|e| ParallelError::Setup(e.to_string()))
    }

    /// A variable's value (this process's first replica's; every replica holds the
    /// same).
    pub fn variable(&self, name: &str) -> Option<&Tensor> {
        self.sessions[0].variable(name)
    }
}

/// What a process of a group of processes has once the group met ([`ProcessGroup::join`]).
pub struct Met {
    /// What its executor joins: NCCL's (CUDA) or rank 0's TCP group (CPU).
    pub collective: Collective,
    /// The TCP group between the processes, for what host code averages (reports);
    /// its abort is the process's.
    pub host: Collective,
}

impl ProcessGroup {
    /// Meets the group's other processes at rank 0 for a step whose collectives are
    /// `graph`'s: every rank's (and whether it runs on CUDA) must be rank 0's, checked
    /// before any step. Rank 0 gives CUDA ranks its NCCL unique id.
    pub fn join(
        &self,
        graph: &Graph,
        on_cuda: bool,
        timeout: Duration,
    ) -> Result<Met, ParallelError> {
        let signature =
            collective_signature(graph).map_err(|e| ParallelError::Setup(e.to_string()))?;
        let fingerprint = {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            (on_cuda, signature).hash(&mut h);
            h.finish()
        };
        if on_cuda {
            nccl_environment();
        }
        // Rank 0's id is the one every rank gets; the others send none.
        let id = match (on_cuda, self.rank) {
            (true, 0) => nccl::unique_id().map_err(ParallelError::Setup)?.to_bytes(),
            _ => Vec::new(),
        };
        let met = self.rendezvous(&id, fingerprint, timeout)?;
        let abort = Abort::default();
        let host = TcpGroup::collective(self.rank, self.world, met.links, &abort, timeout);
        let collective = match on_cuda {
            true => Collective {
                transport: Transport::Nccl(
                    NcclId::from_bytes(&met.id).map_err(ParallelError::Setup)?,
                ),
                ..host.clone()
            },
            false => host.clone(),
        };
        Ok(Met { collective, host })
    }
}
