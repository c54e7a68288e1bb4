//! How the replicas of a data-parallel step compute an [`AllReduce`] together.
//!
//! Each replica's executor joins a [`Collective`]: its rank among `world` replicas, the
//! transport (a [`SharedGroup`] of host threads for CPU executors, a [`TcpGroup`] for
//! CPU executors in processes of their own, an NCCL unique id for CUDA ones) and the
//! group's [`Abort`]. A replica whose step fails raises the
//! abort; every other replica waiting on a collective sees it (or its own timeout),
//! gives up its communicator and fails naming the rank that failed, so no replica
//! hangs on a peer that will never come. Between processes a [`TcpGroup`]'s watcher
//! raises the abort as soon as a rank's connection closes, also while every rank waits
//! in NCCL rather than on the sockets.
//!
//! [`AllReduce`]: ampgraph_graph::ops::AllReduce

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ampgraph_graph::ops::Reduction;
use ampgraph_graph::{DType, Data, Tensor};

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

impl NcclId {
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.iter().map(|&c| c as u8).collect()
    }

    /// The id [`to_bytes`](Self::to_bytes) gave, as another process received it.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, String> {
        let mut id = [0 as std::ffi::c_char; 128];
        if bytes.len() != id.len() {
            return Err(format!(
                "an NCCL unique id has {} bytes, not {}",
                id.len(),
                bytes.len()
            ));
        }
        for (c, &b) in id.iter_mut().zip(bytes) {
            *c = b as std::ffi::c_char;
        }
        Ok(NcclId(id))
    }
}

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
    /// CPU executors in processes of their own, through rank 0 over TCP.
    Tcp(Arc<TcpGroup>),
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

impl Collective {
    /// The mean (or max) over the replicas of each of `inputs`, through host memory
    /// or TCP, in host code (a CPU executor's AllReduce; what replicas report
    /// together). A CUDA executor's reductions are NCCL's, on its device.
    pub fn host_all_reduce(
        &self,
        inputs: &[&Tensor],
        reduction: Reduction,
    ) -> Result<Vec<Tensor>, String> {
        match &self.transport {
            Transport::Shared(group) => group.all_reduce(self, inputs, reduction),
            Transport::Tcp(group) => group.all_reduce(self, inputs, reduction),
            Transport::Nccl(_) => Err("NCCL's reductions are a CUDA executor's".into()),
        }
    }
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

    /// The reduction over the replicas of each of `inputs` (the same on every rank).
    pub fn all_reduce(
        &self,
        me: &Collective,
        inputs: &[&Tensor],
        reduction: Reduction,
    ) -> Result<Vec<Tensor>, String> {
        let start = Instant::now();
        let mut round = self.lock();
        let generation = round.generation;
        round.deposits[me.rank] = Some(inputs.iter().map(|&t| t.clone()).collect());
        if round.deposits.iter().all(Option::is_some) {
            let deposits: Vec<Vec<Tensor>> =
                round.deposits.iter_mut().flat_map(Option::take).collect();
            round.means = Some(Arc::new(reduce(&deposits, reduction)));
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

/// Replicas in processes of their own (CPU executors started by torchrun or srun),
/// averaging through rank 0 over the connections their rendezvous made: every other
/// rank sends its tensors to rank 0, which takes the means as a [`SharedGroup`] does
/// (in rank order, in f64: the bits of threads) and sends them back to each. A rank
/// whose process ends closes its connection: the others' all-reduce fails naming it,
/// and, between collectives, the group's watcher stops them at once: rank 0's sees the
/// connection close, raises its abort and sends the reason to every other rank, whose
/// watchers raise theirs (a CUDA rank waiting in NCCL then aborts its communicator).
#[derive(Debug)]
pub struct TcpGroup {
    links: Mutex<Links>,
}

/// One process's connections in a [`TcpGroup`].
#[derive(Debug)]
pub enum Links {
    /// Rank 0: one connection to each other rank, in rank order (rank 1 first).
    Hub(Vec<TcpStream>),
    /// Any other rank: its connection to rank 0.
    Spoke(TcpStream),
}

/// The most tensors, and the most dimensions of one, a message holds: more is a
/// stream out of step, not an all-reduce.
const MOST_TENSORS: u32 = 1 << 20;
const MOST_RANK: u8 = 16;

impl TcpGroup {
    /// The [`Collective`] of replica `rank` of `world`, reducing over `links`.
    pub fn collective(
        rank: usize,
        world: usize,
        links: Links,
        abort: &Abort,
        timeout: Duration,
    ) -> Collective {
        let group = Arc::new(TcpGroup {
            links: Mutex::new(links),
        });
        watch(&group, abort.clone());
        Collective {
            rank,
            world,
            transport: Transport::Tcp(group),
            abort: abort.clone(),
            timeout,
        }
    }

    fn links(&self) -> MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reduction over the replicas of each of `inputs` (the same on every rank).
    pub fn all_reduce(
        &self,
        me: &Collective,
        inputs: &[&Tensor],
        reduction: Reduction,
    ) -> Result<Vec<Tensor>, String> {
        if let Some(why) = me.abort.reason() {
            return Err(format!(
                "replica {} stopped at an all-reduce: {why}",
                me.rank
            ));
        }
        let start = Instant::now();
        let left = || me.timeout.saturating_sub(start.elapsed()).max(MIN_WAIT);
        let mut links = self.links();
        let result = match &mut *links {
            Links::Hub(peers) => {
                let mut deposits = vec![inputs.iter().map(|&t| t.clone()).collect()];
                let mut failure = None;
                for (k, stream) in peers.iter_mut().enumerate() {
                    let rank = k + 1;
                    match read_message(stream, left()) {
                        Ok(Ok(tensors)) => deposits.push(tensors),
                        Ok(Err(why)) => failure = Some(why),
                        Err(e) => failure = Some(gone(rank, &e, start.elapsed())),
                    }
                    if failure.is_some() {
                        break;
                    }
                }
                let result = failure.map_or_else(|| reduce(&deposits, reduction), Err);
                // Every rank hears the result; one already gone is not waited for.
                for stream in peers.iter_mut() {
                    let _ = write_message(stream, result.as_deref().map_err(String::as_str));
                }
                result
            }
            Links::Spoke(stream) => {
                let sent: Vec<Tensor> = inputs.iter().map(|&t| t.clone()).collect();
                write_message(stream, Ok(&sent))
                    .and_then(|()| read_message(stream, left()))
                    .unwrap_or_else(|e| Err(gone(0, &e, start.elapsed())))
            }
        };
        result.map_err(|why| {
            me.abort.raise(why.clone());
            format!("replica {} stopped at an all-reduce: {why}", me.rank)
        })
    }
}

/// The least time given to one read.
const MIN_WAIT: Duration = Duration::from_millis(50);

/// How long the watcher's `poll` waits before it looks again whether its group is
/// still there.
const WATCH_TICK: Duration = Duration::from_millis(100);

/// Starts the watcher of `group`'s connections (a thread that ends with the group).
/// Rank 0's watches for a connection closing (its process ended), without reading:
/// the other ranks' messages arrive at any time, for an all-reduce it has not reached
/// yet. Once its abort is raised, by the watcher or by anything else in its process,
/// it sends the reason to every other rank still connected. Any other rank's watches
/// its connection to rank 0: outside an all-reduce (its links free) nothing arrives
/// there but that reason, or the end of the connection.
#[cfg(target_os = "linux")]
fn watch(group: &Arc<TcpGroup>, abort: Abort) {
    use std::os::fd::AsRawFd;
    let peers: Vec<(usize, i32)> = match &*group.links() {
        Links::Hub(streams) => (streams.iter().enumerate())
            .map(|(k, s)| (k + 1, s.as_raw_fd()))
            .collect(),
        Links::Spoke(stream) => vec![(0, stream.as_raw_fd())],
    };
    let group = Arc::downgrade(group);
    let watcher = move || {
        let hub = peers.first().is_some_and(|p| p.0 != 0);
        let mut open = peers;
        let mut told = false;
        let events = if hub {
            libc::POLLRDHUP
        } else {
            libc::POLLIN | libc::POLLRDHUP
        };
        while let Some(group) = group.upgrade() {
            if hub && !told {
                if let (Some(why), Ok(mut links)) = (abort.reason(), group.links.try_lock()) {
                    if let Links::Hub(streams) = &mut *links {
                        for &(rank, _) in &open {
                            let _ = write_message(&mut streams[rank - 1], Err(&why));
                        }
                    }
                    told = true;
                }
            }
            if open.is_empty() {
                return;
            }
            let fds = poll(&open, events, WATCH_TICK);
            if hub {
                for (k, &revents) in fds.iter().enumerate().rev() {
                    if revents & CLOSED != 0 {
                        let rank = open.remove(k).0;
                        abort.raise(format!(
                            "replica {rank}'s process is gone (its connection closed)"
                        ));
                    }
                }
                continue;
            }
            if fds[0] == 0 {
                continue;
            }
            // Rank 0's reason, or the end of its connection: read where no all-reduce
            // is reading (one that is meets the same and fails with it), once it is
            // there with the links held (an all-reduce may have just read its reply).
            let Ok(mut links) = group.links.try_lock() else {
                std::thread::sleep(POLL);
                continue;
            };
            if poll(&open, events, Duration::ZERO)[0] == 0 {
                continue;
            }
            if let Links::Spoke(stream) = &mut *links {
                abort.raise(match read_message(stream, MIN_WAIT) {
                    Ok(Err(why)) => why,
                    Ok(Ok(_)) => "replica 0 sent tensors outside an all-reduce".to_string(),
                    Err(e) => gone(0, &e, Duration::ZERO),
                });
            }
            return;
        }
    };
    // Without a thread the group still works: a closed connection is then found by
    // the next all-reduce, and a rank in NCCL waits for its timeout.
    let _ = std::thread::Builder::new()
        .name("ampgraph-group-watch".into())
        .spawn(watcher);
}

/// Whether a connection closed (any of these in `poll`'s `revents`).
#[cfg(target_os = "linux")]
const CLOSED: i16 = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;

/// `poll(2)` of the sockets `fds` (rank, descriptor) for `events`, waiting at most
/// `wait`: each one's `revents` (0 where nothing happened or the call failed).
#[cfg(target_os = "linux")]
fn poll(fds: &[(usize, i32)], events: i16, wait: Duration) -> Vec<i16> {
    let mut polled: Vec<libc::pollfd> = (fds.iter())
        .map(|&(_, fd)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    // SAFETY: the descriptors are sockets of a group the caller holds (open for the
    // call); `poll` writes only their `revents`.
    let ready = unsafe {
        libc::poll(
            polled.as_mut_ptr(),
            polled.len() as libc::nfds_t,
            wait.as_millis() as i32,
        )
    };
    (polled.iter())
        .map(|p| if ready > 0 { p.revents } else { 0 })
        .collect()
}

/// Elsewhere a closed connection is found by the next all-reduce (and a rank in NCCL
/// waits for its timeout).
#[cfg(not(target_os = "linux"))]
fn watch(_group: &Arc<TcpGroup>, _abort: Abort) {}

/// Between looks at a connection whose data an all-reduce is reading.
const POLL: Duration = Duration::from_millis(20);

/// Why the connection to replica `rank` failed.
fn gone(rank: usize, e: &std::io::Error, waited: Duration) -> String {
    use std::io::ErrorKind::{
        ConnectionAborted, ConnectionReset, TimedOut, UnexpectedEof, WouldBlock,
    };
    match e.kind() {
        TimedOut | WouldBlock => format!(
            "replica {rank} did not come within {:.1} s (timeout)",
            waited.as_secs_f64()
        ),
        UnexpectedEof | ConnectionReset | ConnectionAborted => {
            format!("replica {rank}'s process is gone (its connection closed)")
        }
        _ => format!("replica {rank}'s process is gone ({e})"),
    }
}

/// A message: tensors, or why the sender stops.
fn write_message(stream: &mut TcpStream, body: Result<&[Tensor], &str>) -> std::io::Result<()> {
    let mut out = Vec::new();
    match body {
        Ok(tensors) => {
            out.push(0u8);
            out.extend((tensors.len() as u32).to_le_bytes());
            for t in tensors {
                let dtype = t.dtype().as_str().as_bytes();
                out.push(dtype.len() as u8);
                out.extend(dtype);
                out.push(t.shape().len() as u8);
                for &d in t.shape() {
                    out.extend((d as u64).to_le_bytes());
                }
                out.extend(t.data().to_le_bytes());
            }
        }
        Err(why) => {
            out.push(1u8);
            out.extend((why.len() as u32).to_le_bytes());
            out.extend(why.as_bytes());
        }
    }
    stream.write_all(&out)
}

/// Reads a message [`write_message`] wrote, waiting at most `timeout` for each part.
fn read_message(
    stream: &mut TcpStream,
    timeout: Duration,
) -> std::io::Result<Result<Vec<Tensor>, String>> {
    use std::io::{Error, ErrorKind};
    let invalid = |what: String| Error::new(ErrorKind::InvalidData, what);
    stream.set_read_timeout(Some(timeout))?;
    let mut byte = [0u8; 1];
    let mut word = [0u8; 4];
    stream.read_exact(&mut byte)?;
    stream.read_exact(&mut word)?;
    let count = u32::from_le_bytes(word);
    if byte[0] != 0 {
        let mut why = vec![0u8; count.min(1 << 16) as usize];
        stream.read_exact(&mut why)?;
        return Ok(Err(String::from_utf8_lossy(&why).into_owned()));
    }
    if count > MOST_TENSORS {
        return Err(invalid(format!("a message of {count} tensors")));
    }
    let mut tensors = Vec::with_capacity(count as usize);
    for _ in 0..count {
        stream.read_exact(&mut byte)?;
        let mut name = vec![0u8; byte[0] as usize];
        stream.read_exact(&mut name)?;
        let dtype: DType = (String::from_utf8_lossy(&name).parse()).map_err(invalid)?;
        stream.read_exact(&mut byte)?;
        if byte[0] > MOST_RANK {
            return Err(invalid(format!("a tensor of {} dimensions", byte[0])));
        }
        let mut shape = Vec::with_capacity(byte[0] as usize);
        let mut dim = [0u8; 8];
        for _ in 0..byte[0] {
            stream.read_exact(&mut dim)?;
            shape.push(u64::from_le_bytes(dim) as usize);
        }
        let bytes = (shape.iter())
            .try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| invalid(format!("a tensor of shape {shape:?}")))?;
        let mut data = vec![0u8; bytes];
        stream.read_exact(&mut data)?;
        let data = Data::from_le_bytes(dtype, &data).map_err(invalid)?;
        tensors.push(Tensor::new(shape, data).map_err(|e| invalid(e.to_string()))?);
    }
    Ok(Ok(tensors))
}

/// The mean (or max) of each input over the ranks' deposits, in its dtype: folded in
/// rank order in f64, so every run gives the same bits.
fn reduce(deposits: &[Vec<Tensor>], reduction: Reduction) -> Result<Vec<Tensor>, String> {
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
    let fold = |acc: f64, v: f64| match reduction {
        Reduction::Mean => acc + v,
        Reduction::Max if acc.is_nan() || v.is_nan() => f64::NAN,
        Reduction::Max => acc.max(v),
    };
    (0..first.len())
        .map(|k| {
            let mut folded = first[k].to_f64_vec();
            for d in &deposits[1..] {
                for (s, v) in folded.iter_mut().zip(d[k].data().iter_f64()) {
                    *s = fold(*s, v);
                }
            }
            let values = folded.into_iter().map(|s| match reduction {
                Reduction::Mean => s / n,
                Reduction::Max => s,
            });
            Tensor::new(
                first[k].shape().to_vec(),
                Data::from_f64(first[k].dtype(), values),
            )
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

    /// The max of each element over the replicas, NaN where any replica's is.
    #[test]
    fn every_replica_gets_the_max() {
        let results = run(3, |m| {
            let r = m.rank as f64;
            let t = Tensor::from_f64(
                DType::F32,
                [3],
                &[r, -r, if m.rank == 1 { f64::NAN } else { r }],
            )
            .unwrap();
            m.host_all_reduce(&[&t], Reduction::Max)
        });
        for r in results {
            let v = r.unwrap()[0].to_f64_vec();
            assert_eq!(v[..2], [2.0, 0.0]);
            assert!(v[2].is_nan());
        }
    }

    #[test]
    fn every_replica_gets_the_mean_round_after_round() {
        let results = run(3, |m| {
            let mut last = Vec::new();
            for round in 0..50 {
                let v = (m.rank * 100 + round) as f64;
                let t = Tensor::from_f64(DType::F32, [2], &[v, -v]).map_err(|e| e.to_string())?;
                last = m.host_all_reduce(&[&t], Reduction::Mean)?;
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
            m.host_all_reduce(&[&t], Reduction::Mean)
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
        let e = group
            .all_reduce(&members[0], &[&t], Reduction::Mean)
            .unwrap_err();
        assert!(
            e.contains("replica 0 waited") && e.contains("timeout"),
            "{e}"
        );
        assert!(abort.reason().is_some(), "the timeout stops the group");
    }

    /// `world` replicas linked as processes are, over sockets on localhost.
    fn tcp_members(world: usize, timeout: Duration) -> Vec<Collective> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let mut spokes = Vec::new();
        let mut hub = Vec::new();
        for _ in 1..world {
            spokes.push(TcpStream::connect(address).unwrap());
            hub.push(listener.accept().unwrap().0);
        }
        let abort = Abort::default();
        let mut members = vec![TcpGroup::collective(
            0,
            world,
            Links::Hub(hub),
            &abort,
            timeout,
        )];
        for (k, stream) in spokes.into_iter().enumerate() {
            // Each process has its own abort.
            let abort = Abort::default();
            members.push(TcpGroup::collective(
                k + 1,
                world,
                Links::Spoke(stream),
                &abort,
                timeout,
            ));
        }
        members
    }

    /// Over TCP every replica gets the bits threads get, in every dtype, round after
    /// round.
    #[test]
    fn replicas_in_processes_get_the_means_threads_get() {
        let world = 3;
        let tensors = |rank: usize, round: usize| -> Vec<Tensor> {
            let v: Vec<f64> = (0..7)
                .map(|i| ((rank * 7 + i + round) as f64).sin() * 3.0)
                .collect();
            [DType::F32, DType::F16, DType::BF16, DType::F64]
                .into_iter()
                .map(|dtype| Tensor::from_f64(dtype, [7], &v).unwrap())
                .collect()
        };
        let by_threads = run(world, |m| {
            (0..5)
                .map(|round| {
                    let t = tensors(m.rank, round);
                    m.host_all_reduce(&t.iter().collect::<Vec<_>>(), Reduction::Mean)
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|rounds| rounds.concat())
        });
        let members = tcp_members(world, Duration::from_secs(5));
        let by_sockets: Vec<Vec<Tensor>> = std::thread::scope(|s| {
            let handles: Vec<_> = (members.iter())
                .map(|m| {
                    s.spawn(|| {
                        (0..5)
                            .map(|round| {
                                let t = tensors(m.rank, round);
                                m.host_all_reduce(&t.iter().collect::<Vec<_>>(), Reduction::Mean)
                                    .unwrap()
                            })
                            .collect::<Vec<_>>()
                            .concat()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (sockets, threads)) in by_sockets.iter().zip(&by_threads).enumerate() {
            let threads = threads.as_ref().unwrap();
            assert_eq!(sockets.len(), threads.len());
            for (a, b) in sockets.iter().zip(threads) {
                assert_eq!(a.ty(), b.ty(), "rank {rank}");
                assert_eq!(
                    a.data().to_le_bytes(),
                    b.data().to_le_bytes(),
                    "rank {rank}"
                );
            }
        }
    }

    /// A rank whose process ends (its connection closes) fails every other rank's
    /// all-reduce with an error naming it; one that never sends times out.
    #[test]
    fn a_replica_process_that_ends_or_never_comes_is_named() {
        let t = Tensor::scalar(DType::F32, 1.0);
        let mut members = tcp_members(3, Duration::from_secs(5));
        drop(members.pop());
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (members.iter())
                .map(|m| s.spawn(|| m.host_all_reduce(&[&t], Reduction::Mean).unwrap_err()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, e) in errors.iter().enumerate() {
            assert!(
                e.starts_with(&format!("replica {rank} stopped at an all-reduce: "))
                    && e.contains("replica 2's process is gone"),
                "{e}"
            );
        }
        assert!(members[0].abort.reason().is_some(), "the hub's group stops");

        let members = tcp_members(2, Duration::from_millis(200));
        let e = members[0]
            .host_all_reduce(&[&t], Reduction::Mean)
            .unwrap_err();
        assert!(
            e.contains("replica 1 did not come within") && e.contains("timeout"),
            "{e}"
        );
    }

    /// Every member's abort reason, once all are raised (within `within`).
    fn reasons(members: &[Collective], within: Duration) -> Vec<String> {
        let start = Instant::now();
        while members.iter().any(|m| m.abort.reason().is_none()) && start.elapsed() < within {
            std::thread::sleep(Duration::from_millis(10));
        }
        (members.iter())
            .map(|m| m.abort.reason().unwrap_or_else(|| "(not stopped)".into()))
            .collect()
    }

    /// A rank whose process ends while the others wait outside the group's sockets (in
    /// NCCL, on CUDA) stops every other rank within a fraction of a second, naming it
    /// (rank 0 sees the connection close and tells the others); their next all-reduce
    /// fails at once with the reason. Rank 0's own end stops the rest likewise.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_replica_process_that_ends_between_collectives_stops_the_others_at_once() {
        let t = Tensor::scalar(DType::F32, 1.0);
        let long = Duration::from_secs(60);
        let mut members = tcp_members(3, long);
        // A round first: the watchers leave the all-reduces' messages alone.
        let means = std::thread::scope(|s| {
            let handles: Vec<_> = (members.iter())
                .map(|m| s.spawn(|| m.host_all_reduce(&[&t], Reduction::Mean)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(
            means.iter().all(|m| m.as_ref().is_ok_and(|m| m[0] == t)),
            "{means:?}"
        );
        drop(members.pop());
        let start = Instant::now();
        for why in reasons(&members, Duration::from_secs(5)) {
            assert_eq!(why, "replica 2's process is gone (its connection closed)");
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let e = members[1]
            .host_all_reduce(&[&t], Reduction::Mean)
            .unwrap_err();
        assert_eq!(
            e,
            "replica 1 stopped at an all-reduce: replica 2's process is gone (its connection closed)"
        );

        let mut members = tcp_members(3, long);
        members.remove(0);
        for why in reasons(&members, Duration::from_secs(5)) {
            assert_eq!(why, "replica 0's process is gone (its connection closed)");
        }
    }

    #[test]
    fn replicas_that_disagree_on_shapes_get_an_error_naming_them() {
        let results = run(2, |m| {
            let t = Tensor::zeros(&ampgraph_graph::TensorType::new(DType::F32, [m.rank + 1]));
            m.host_all_reduce(&[&t], Reduction::Mean)
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
