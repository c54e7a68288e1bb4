//! The MNIST example trained data-parallel as a user runs it (`--replicas 2` on the
//! CPU, real MNIST): the loss falls, evaluation runs on replica 0's weights, and a run
//! resumes from the checkpoint written once, after its last epoch.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::example_binary;

#[test]
fn two_cpu_replicas_train_mnist_and_checkpoint_once() {
    let dir = std::env::temp_dir().join(format!("ampgraph-mnist-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("dp.ckpt");
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/mnist");
    let mut args = vec!["--device", "cpu", "--replicas", "2"];
    args.extend([
        "--train", "1024", "--eval", "256", "--batch", "32", "--quiet",
    ]);
    let ckpt_arg = ckpt.to_str().unwrap().to_string();
    let data_arg = if std::path::Path::new(data).exists() {
        vec!["--data", data]
    } else {
        vec![]
    };
    let out = Command::new(example_binary("mnist"))
        .args(&args)
        .args(&data_arg)
        .args(["--checkpoint", &ckpt_arg, "--epochs", "2"])
        .output()
        .expect("the mnist example runs");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("data-parallel over 2 x CPU"), "{text}");
    assert!(text.contains("Data parallel over 2 replicas"), "{text}");
    let losses: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| {
            assert!(
                l.contains("eval loss") && l.contains("eval accuracy"),
                "{l}"
            );
            l.split("loss ")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{text}");
    assert!(losses[1] < losses[0], "{losses:?}");
    // A second run resumes after the checkpoint's last epoch, in every replica.
    let out = Command::new(example_binary("mnist"))
        .args(&args)
        .args(&data_arg)
        .args(["--checkpoint", &ckpt_arg, "--resume", "--epochs", "3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("at epoch 3"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.starts_with("epoch ")).count(),
        1,
        "{text}"
    );
    let resumed: f64 = text
        .lines()
        .find(|l| l.starts_with("epoch 3"))
        .and_then(|l| l.split("loss ").nth(1))
        .and_then(|l| l.split(',').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        resumed < losses[0],
        "resumed weights train on: {resumed} vs {}",
        losses[0]
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The example's arguments for a short CPU run on real MNIST where it is checked in.
fn short_run(epochs: &str) -> Vec<String> {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/mnist");
    let mut args: Vec<String> = [
        "--device", "cpu", "--train", "1024", "--eval", "0", "--batch", "32", "--quiet",
        "--epochs", epochs,
    ]
    .map(String::from)
    .to_vec();
    if std::path::Path::new(data).exists() {
        args.extend(["--data".to_string(), data.to_string()]);
    }
    args
}

/// A port nothing listens at now (and, likely, the next one: torchrun's rendezvous
/// takes it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank `rank` of `world` as a launcher starts it: its environment and nothing else.
fn rank_process(rank: usize, world: usize, port: u16, args: &[String]) -> Command {
    let mut c = Command::new(example_binary("mnist"));
    c.args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    c
}

/// Ranks 0..world of a group on one free port, rank `r` with `args(r)`, run to their
/// end together; their outputs in rank order.
fn launch(world: usize, args: impl Fn(usize) -> Vec<String>) -> Vec<std::process::Output> {
    let port = free_port();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            rank_process(rank, world, port, &args(rank))
                .spawn()
                .unwrap()
        })
        .collect();
    (ranks.into_iter())
        .map(|r| r.wait_with_output().unwrap())
        .collect()
}

fn epoch_lines(stdout: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(stdout);
    (text.lines())
        .filter(|l| l.starts_with("epoch "))
        .map(|l| l.split(", ").next().unwrap_or(l).to_string())
        .collect()
}

/// Two processes started as torchrun starts them (one replica each, on the CPU,
/// averaging through rank 0 over TCP) train to the bits two threads do: the same
/// losses, and the same checkpoint, written once by rank 0; rank 1 prints nothing.
#[test]
fn two_processes_train_as_two_threads_do() {
    let dir = std::env::temp_dir().join(format!("ampgraph-mnist-pg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (by_threads, by_processes) = (dir.join("threads.ckpt"), dir.join("processes.ckpt"));
    let args = short_run("2");
    let threads = Command::new(example_binary("mnist"))
        .args(&args)
        .args([
            "--replicas",
            "2",
            "--checkpoint",
            by_threads.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(threads.status.success(), "{threads:?}");
    let mut args = args.clone();
    args.extend(["--checkpoint".into(), by_processes.to_str().unwrap().into()]);
    let outputs = launch(2, |_| args.clone());
    for (rank, out) in outputs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {out:?}");
    }
    let losses = epoch_lines(&threads.stdout);
    assert_eq!(losses.len(), 2, "{threads:?}");
    assert_eq!(epoch_lines(&outputs[0].stdout), losses);
    assert!(outputs[1].stdout.is_empty(), "{:?}", outputs[1]);
    let two_epochs = std::fs::read(&by_threads).unwrap();
    assert!(
        two_epochs == std::fs::read(&by_processes).unwrap(),
        "the checkpoints differ"
    );
    // Each resumes from its checkpoint for a third epoch, every process restoring it:
    // the same loss and the same checkpoint again.
    let resumed = |checkpoint: &std::path::Path| {
        let mut a = short_run("3");
        a.extend(["--resume".into(), "--checkpoint".into()]);
        a.push(checkpoint.to_str().unwrap().into());
        a
    };
    let threads = Command::new(example_binary("mnist"))
        .args(resumed(&by_threads))
        .args(["--replicas", "2"])
        .output()
        .unwrap();
    assert!(threads.status.success(), "{threads:?}");
    let outputs = launch(2, |_| resumed(&by_processes));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {out:?}");
    }
    let third = epoch_lines(&threads.stdout);
    assert_eq!(third.len(), 1, "{threads:?}");
    assert_eq!(epoch_lines(&outputs[0].stdout), third);
    assert!(
        std::fs::read(&by_threads).unwrap() == std::fs::read(&by_processes).unwrap(),
        "the resumed checkpoints differ"
    );
    // Under torchrun itself where it is installed (its agent holds MASTER_PORT).
    let torchrun = Command::new("torchrun")
        .args(["--no-python", "--nproc-per-node", "2", "--master-port"])
        .arg(free_port().to_string())
        .arg(example_binary("mnist"))
        .args(short_run("2"))
        .args(["--checkpoint", dir.join("torchrun.ckpt").to_str().unwrap()])
        .output();
    match torchrun {
        Err(e) => println!("skipped torchrun: {e}"),
        // pyenv's shim of a torchrun the active Python lacks.
        Ok(out) if out.status.code() == Some(127) => println!("skipped torchrun: {out:?}"),
        Ok(out) => {
            assert!(out.status.success(), "{out:?}");
            assert_eq!(epoch_lines(&out.stdout), losses);
            assert!(
                two_epochs == std::fs::read(dir.join("torchrun.ckpt")).unwrap(),
                "torchrun's checkpoint differs"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank that built another model is refused before any step, every rank saying
/// which; a rank whose process is killed ends the others with an error naming it.
#[test]
fn ranks_that_differ_or_die_end_the_group_naming_them() {
    let mut cnn = short_run("1");
    cnn.extend(["--model".into(), "cnn".into()]);
    let outputs = launch(2, |rank| {
        if rank == 0 {
            short_run("1")
        } else {
            cnn.clone()
        }
    });
    for (rank, out) in outputs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "rank {rank}: {out:?}");
        assert!(
            stderr.contains("rank 1's graph differs from rank 0's"),
            "rank {rank}: {stderr}"
        );
        assert!(epoch_lines(&out.stdout).is_empty(), "rank {rank}: {out:?}");
    }

    let port = free_port();
    let mut first = rank_process(0, 2, port, &short_run("1000"))
        .spawn()
        .unwrap();
    let mut second = rank_process(1, 2, port, &short_run("1000"))
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.starts_with("epoch 1:"))),
        "rank 0 trains"
    );
    second.kill().unwrap();
    second.wait().unwrap();
    let killed = Instant::now();
    let out = first.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("replica 1's process is gone"), "{stderr}");
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "{:?}",
        killed.elapsed()
    );
}
