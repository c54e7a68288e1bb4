//! One process per GPU, as launchers start them (torchrun, Slurm's `srun`, mpirun):
//! the process's place in the group from its environment, and the rendezvous that
//! gives every rank rank 0's NCCL unique id over TCP (as llm.c and torchrun's
//! TCPStore do) after checking that every rank built the same graph.
//!
//! Rank 0 listens at `MASTER_ADDR:MASTER_PORT` (the port after it under torchrun, whose
//! agent serves PyTorch's store there); every other rank connects (retrying
//! until the deadline: rank 0 may start later) and sends its rank, the world size and
//! its graph's fingerprint. Once all have come, rank 0 answers each with the id, or,
//! where a rank's world or fingerprint differs from its own or a rank never came
//! within the timeout, every rank that came with the reason, and fails itself: no rank
//! waits for ever, every error names the rank at fault.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use ampgraph_exec::collective::Links;
use thiserror::Error;

/// What ends a rendezvous, one line naming the rank and the problem.
#[derive(Debug, Error)]
pub enum GroupError {
    #[error("environment: {0}")]
    Environment(String),
    #[error("rank {rank}: rank 0 at {master} could not be reached within {waited:?}: {reason}")]
    Unreachable {
        rank: usize,
        master: String,
        waited: Duration,
        reason: String,
    },
    #[error("rank 0: {} never came to {master} within {waited:?}", list(missing))]
    Missing {
        missing: Vec<usize>,
        master: String,
        waited: Duration,
    },
    #[error("rank 0: {0}")]
    Refusing(String),
    #[error("rank {rank}: rank 0 refused: {reason}")]
    Refused { rank: usize, reason: String },
    #[error("rank {rank}: {context}: {source}")]
    Io {
        rank: usize,
        context: String,
        source: std::io::Error,
    },
}

fn list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match ranks {
        [_] => format!("rank {}", names[0]),
        _ => format!("ranks {}", names.join(", ")),
    }
}

/// A process's place in a group of processes, one per GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessGroup {
    pub rank: usize,
    pub world: usize,
    /// The GPU of this process on its host.
    pub local_rank: usize,
    /// Rank 0's `host:port`.
    pub master: String,
}

/// The rendezvous's first bytes, so a stray connection is told apart.
const MAGIC: &[u8; 4] = b"AMPG";
/// The most bytes of an id or a refusal rank 0 sends.
const MOST_REPLY: u32 = 1 << 16;

impl ProcessGroup {
    /// The group from this process's environment: torchrun's `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; with
    /// `MASTER_ADDR` and `MASTER_PORT` (both launchers' scripts set them).
    pub fn from_env() -> Result<ProcessGroup, GroupError> {
        ProcessGroup::from_vars(|name| std::env::var(name).ok())
    }

    /// The group a launcher started this process in, from its environment; `None`
    /// where neither torchrun's `RANK` nor Slurm's `SLURM_PROCID` with `MASTER_ADDR`
    /// is set: a process on its own.
    pub fn launched() -> Result<Option<ProcessGroup>, GroupError> {
        ProcessGroup::launched_from(|name| std::env::var(name).ok())
    }

    /// [`launched`](Self::launched) with the variables `var` gives.
    pub fn launched_from(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<ProcessGroup>, GroupError> {
        let torchrun = var("RANK").is_some();
        let slurm = var("SLURM_PROCID").is_some() && var("MASTER_ADDR").is_some();
        if !(torchrun || slurm) {
            return Ok(None);
        }
        ProcessGroup::from_vars(var).map(Some)
    }

    /// [`from_env`](Self::from_env) with the variables `var` gives.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<ProcessGroup, GroupError> {
        let number = |names: [&str; 2]| -> Result<usize, GroupError> {
            let (name, value) = (names.iter())
                .find_map(|&n| var(n).map(|v| (n, v)))
                .ok_or_else(|| {
                    GroupError::Environment(format!(
                        "neither {} nor {} is set (start the processes with torchrun or srun)",
                        names[0], names[1]
                    ))
                })?;
            value
                .trim()
                .parse()
                .map_err(|_| GroupError::Environment(format!("{name} is '{value}', not a number")))
        };
        let rank = number(["RANK", "SLURM_PROCID"])?;
        let world = number(["WORLD_SIZE", "SLURM_NTASKS"])?;
        let local_rank = number(["LOCAL_RANK", "SLURM_LOCALID"])?;
        if world == 0 || rank >= world {
            return Err(GroupError::Environment(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        let required = |name: &str| {
            var(name).ok_or_else(|| GroupError::Environment(format!("{name} is not set")))
        };
        let (addr, port) = (required("MASTER_ADDR")?, required("MASTER_PORT")?);
        let mut port: u16 = port
            .trim()
            .parse()
            .map_err(|_| GroupError::Environment(format!("MASTER_PORT is '{port}', not a port")))?;
        // torchrun's agent serves its own store at MASTER_PORT for PyTorch's workers:
        // the rendezvous takes the port after it.
        if var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            port = port.checked_add(1).ok_or_else(|| {
                GroupError::Environment(
                    "MASTER_PORT is 65535: under torchrun the rendezvous takes the next port"
                        .into(),
                )
            })?;
        }
        Ok(ProcessGroup {
            rank,
            world,
            local_rank,
            master: format!("{addr}:{port}"),
        })
    }

    /// Gives every rank rank 0's `id` (the others' is ignored) once every rank has come
    /// with the same world and graph `fingerprint`, within `timeout`; the connections
    /// stay open, for a [`TcpGroup`](ampgraph_exec::collective::TcpGroup) between the
    /// processes.
    pub fn rendezvous(
        &self,
        id: &[u8],
        fingerprint: u64,
        timeout: Duration,
    ) -> Result<Rendezvous, GroupError> {
        if self.rank == 0 {
            let peers = self.serve(id, fingerprint, timeout)?;
            Ok(Rendezvous {
                id: id.to_vec(),
                links: Links::Hub(peers),
            })
        } else {
            let (id, stream) = self.fetch(fingerprint, timeout)?;
            Ok(Rendezvous {
                id,
                links: Links::Spoke(stream),
            })
        }
    }

    fn io(&self, context: impl Into<String>) -> impl FnOnce(std::io::Error) -> GroupError {
        let (rank, context) = (self.rank, context.into());
        move |source| GroupError::Io {
            rank,
            context,
            source,
        }
    }

    /// Rank 0: every other rank's hello, then the id to each (or the reason to all);
    /// the connections in rank order.
    fn serve(
        &self,
        id: &[u8],
        fingerprint: u64,
        timeout: Duration,
    ) -> Result<Vec<TcpStream>, GroupError> {
        let start = Instant::now();
        let listener = TcpListener::bind(&self.master)
            .map_err(self.io(format!("listening at {}", self.master)))?;
        listener
            .set_nonblocking(true)
            .map_err(self.io("listening"))?;
        let mut peers: Vec<(usize, TcpStream)> = Vec::new();
        let mut problems = Vec::new();
        while peers.len() + 1 < self.world && start.elapsed() < timeout {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let left = timeout.saturating_sub(start.elapsed()).max(MIN_WAIT);
                    match read_hello(&mut stream, left) {
                        Ok((rank, world, theirs)) => {
                            if rank == 0 || rank >= self.world || peers.iter().any(|p| p.0 == rank)
                            {
                                problems.push(format!(
                                    "a second rank {rank}, or one out of 1..{}",
                                    self.world
                                ));
                            } else if world != self.world {
                                problems.push(format!(
                                    "rank {rank} was started for a world of {world}, rank 0 for {}",
                                    self.world
                                ));
                            } else if theirs != fingerprint {
                                problems.push(format!(
                                    "rank {rank}'s graph differs from rank 0's (fingerprint {theirs:016x}, rank 0's {fingerprint:016x})"
                                ));
                            }
                            peers.push((rank, stream));
                        }
                        // Not a rank of ours (a port scanner, a stale process): ignored.
                        Err(_) => continue,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(self.io("accepting a rank")(e)),
            }
        }
        let error = if let Some(problem) = problems.first() {
            Some(GroupError::Refusing(problem.clone()))
        } else if peers.len() + 1 < self.world {
            let missing = (1..self.world)
                .filter(|r| peers.iter().all(|p| p.0 != *r))
                .collect();
            Some(GroupError::Missing {
                missing,
                master: self.master.clone(),
                waited: timeout,
            })
        } else {
            None
        };
        let reply = match &error {
            None => (0u8, id.to_vec()),
            Some(e) => (1u8, e.to_string().into_bytes()),
        };
        for (rank, stream) in &mut peers {
            write_reply(stream, &reply).map_err(|source| GroupError::Io {
                rank: 0,
                context: format!("answering rank {rank}"),
                source,
            })?;
        }
        if let Some(e) = error {
            return Err(e);
        }
        peers.sort_by_key(|p| p.0);
        Ok(peers.into_iter().map(|(_, stream)| stream).collect())
    }

    /// Any other rank: connect (retrying until the deadline), say hello, read the id.
    fn fetch(
        &self,
        fingerprint: u64,
        timeout: Duration,
    ) -> Result<(Vec<u8>, TcpStream), GroupError> {
        let start = Instant::now();
        let unreachable = |reason: String| GroupError::Unreachable {
            rank: self.rank,
            master: self.master.clone(),
            waited: timeout,
            reason,
        };
        let address = (self.master.to_socket_addrs())
            .map_err(|e| unreachable(e.to_string()))?
            .next()
            .ok_or_else(|| unreachable("the address resolves to nothing".into()))?;
        let mut stream = loop {
            let left = timeout.saturating_sub(start.elapsed());
            match TcpStream::connect_timeout(&address, left.max(MIN_WAIT)) {
                Ok(s) => break s,
                Err(e) if start.elapsed() + POLL >= timeout => {
                    return Err(unreachable(e.to_string()))
                }
                Err(_) => std::thread::sleep(POLL),
            }
        };
        let mut hello = MAGIC.to_vec();
        for v in [self.rank as u64, self.world as u64, fingerprint] {
            hello.extend(v.to_le_bytes());
        }
        stream
            .write_all(&hello)
            .map_err(self.io("saying hello to rank 0"))?;
        // Rank 0 answers once every rank has come: it waits at most the same timeout.
        let wait = timeout.saturating_sub(start.elapsed()) + timeout;
        stream
            .set_read_timeout(Some(wait.max(MIN_WAIT)))
            .map_err(self.io("waiting for rank 0"))?;
        let mut head = [0u8; 5];
        stream
            .read_exact(&mut head)
            .map_err(self.io("waiting for rank 0's answer"))?;
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
        if len > MOST_REPLY {
            return Err(unreachable(format!(
                "an answer of {len} bytes is no rendezvous"
            )));
        }
        let mut body = vec![0u8; len as usize];
        stream
            .read_exact(&mut body)
            .map_err(self.io("reading rank 0's answer"))?;
        match head[0] {
            0 => Ok((body, stream)),
            _ => Err(GroupError::Refused {
                rank: self.rank,
                reason: String::from_utf8_lossy(&body).into_owned(),
            }),
        }
    }
}

/// What a rendezvous gives a rank: rank 0's id, and the connections it was made over.
#[derive(Debug)]
pub struct Rendezvous {
    pub id: Vec<u8>,
    pub links: Links,
}

/// Between polls of a listener or connection attempts.
const POLL: Duration = Duration::from_millis(20);
/// The least time given to one read or connection attempt.
const MIN_WAIT: Duration = Duration::from_millis(50);

/// A rank's hello: (rank, world, fingerprint).
fn read_hello(stream: &mut TcpStream, timeout: Duration) -> std::io::Result<(usize, usize, u64)> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(timeout))?;
    let mut hello = [0u8; 4 + 24];
    stream.read_exact(&mut hello)?;
    if &hello[..4] != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a rank",
        ));
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&hello[4 + 8 * i..][..8]);
        u64::from_le_bytes(b)
    };
    Ok((word(0) as usize, word(1) as usize, word(2)))
}

fn write_reply(stream: &mut TcpStream, (status, body): &(u8, Vec<u8>)) -> std::io::Result<()> {
    let mut reply = vec![*status];
    reply.extend((body.len() as u32).to_le_bytes());
    reply.extend(body);
    stream.write_all(&reply)
}
