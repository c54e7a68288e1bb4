//! The rendezvous of one process per GPU on localhost (issue 45's CPU tests): every
//! rank gets rank 0's id; a rank whose graph differs is refused before the first step;
//! a rank that never comes, or an unreachable rank 0, ends every rank with an error
//! naming it in bounded time. Ranks run as threads here, and as processes (this test
//! binary started again with a launcher's environment) in the last test.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ampgraph::parallel::{GroupError, ProcessGroup};

/// A port nothing listens at now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn group(rank: usize, world: usize, port: u16) -> ProcessGroup {
    ProcessGroup {
        rank,
        world,
        local_rank: rank,
        master: format!("127.0.0.1:{port}"),
    }
}

/// Each of `ranks` (of a world of `world`) in its own thread with its fingerprint;
/// their results by rank.
fn rendezvous(
    world: usize,
    ranks: &[(usize, u64)],
    timeout: Duration,
) -> Vec<(usize, Result<Vec<u8>, GroupError>)> {
    let port = free_port();
    let threads: Vec<_> = ranks
        .iter()
        .map(|&(rank, fingerprint)| {
            std::thread::spawn(move || {
                let id = b"nccl unique id".to_vec();
                (
                    rank,
                    group(rank, world, port)
                        .rendezvous(&id, fingerprint, timeout)
                        .map(|r| r.id),
                )
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn every_rank_gets_rank_zeros_id() {
    let ranks = [(2, 7), (0, 7), (3, 7), (1, 7)];
    for (rank, got) in rendezvous(4, &ranks, Duration::from_secs(10)) {
        assert_eq!(got.unwrap(), b"nccl unique id", "rank {rank}");
    }
}

#[test]
fn a_rank_whose_graph_differs_is_refused_by_name() {
    let ranks = [(0, 7), (1, 7), (2, 8)];
    for (rank, got) in rendezvous(3, &ranks, Duration::from_secs(10)) {
        let e = got.unwrap_err().to_string();
        assert!(
            e.contains("rank 2's graph differs from rank 0's"),
            "rank {rank}: {e}"
        );
        assert!(e.starts_with(&format!("rank {rank}:")), "{e}");
    }
}

#[test]
fn a_rank_that_never_comes_ends_the_others_in_bounded_time() {
    let start = Instant::now();
    let results = rendezvous(3, &[(0, 7), (1, 7)], Duration::from_millis(500));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    for (rank, got) in results {
        let e = got.unwrap_err().to_string();
        assert!(e.contains("rank 2 never came"), "rank {rank}: {e}");
    }
}

#[test]
fn an_unreachable_rank_zero_is_a_clear_error_in_bounded_time() {
    let start = Instant::now();
    let port = free_port();
    let e = group(1, 2, port)
        .rendezvous(&[], 7, Duration::from_millis(300))
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(e, GroupError::Unreachable { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.starts_with("rank 1: rank 0 at 127.0.0.1:") && e.contains("could not be reached"),
        "{e}"
    );
}

#[test]
fn the_group_comes_from_torchruns_or_slurms_environment() {
    let vars = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = (pairs.iter())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name: &str| map.get(name).cloned()
    };
    let master = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
    let torchrun = [
        &[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")][..],
        &master,
    ]
    .concat();
    let g = ProcessGroup::from_vars(vars(&torchrun)).unwrap();
    assert_eq!((g.rank, g.world, g.local_rank), (3, 8, 1));
    assert_eq!(g.master, "10.0.0.1:29500");
    let slurm = [
        &[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
        ][..],
        &master,
    ]
    .concat();
    let g = ProcessGroup::from_vars(vars(&slurm)).unwrap();
    assert_eq!((g.rank, g.world, g.local_rank), (5, 16, 5));
    let err = |pairs: &[(&str, &str)]| {
        ProcessGroup::from_vars(vars(pairs))
            .unwrap_err()
            .to_string()
    };
    let e = err(&master);
    assert!(e.contains("neither RANK nor SLURM_PROCID is set"), "{e}");
    let e = err(&[("RANK", "8"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "0")]);
    assert!(e.contains("rank 8 of a world of 8"), "{e}");
    let e = err(&[("RANK", "x"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "0")]);
    assert!(e.contains("RANK is 'x', not a number"), "{e}");
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
    assert!(e.contains("MASTER_ADDR is not set"), "{e}");
}

/// The environment variable that makes this binary a rank of the process test.
const AS_RANK: &str = "AMPGRAPH_TEST_AS_RANK";

/// Ranks as processes: this binary started three times with a launcher's environment
/// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), each running
/// only `act_as_a_rank`, which prints the id it got.
#[test]
fn ranks_as_processes_rendezvous_from_their_environment() {
    if std::env::var_os(AS_RANK).is_some() {
        return;
    }
    let port = free_port().to_string();
    let children: Vec<_> = (0..3)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "act_as_a_rank",
                    "--exact",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(AS_RANK, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = (children.into_iter())
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, out) in outputs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("got id: shared by rank 0"),
            "rank {rank}: {stdout}"
        );
    }
}

/// One rank of `ranks_as_processes_rendezvous_from_their_environment` (does nothing
/// unless that test started this process).
#[test]
fn act_as_a_rank() {
    if std::env::var_os(AS_RANK).is_none() {
        return;
    }
    let g = ProcessGroup::from_env().unwrap();
    let id = g
        .rendezvous(b"shared by rank 0", 42, Duration::from_secs(10))
        .unwrap()
        .id;
    println!("got id: {}", String::from_utf8_lossy(&id));
}
