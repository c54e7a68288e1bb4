//! The MNIST example trained data-parallel as a user runs it (`--replicas 2` on the
//! CPU, real MNIST): the loss falls, evaluation runs on replica 0's weights, and a run
//! resumes from the checkpoint written once, after its last epoch.

mod common;

use std::process::Command;

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
            assert!(l.contains("eval accuracy"), "{l}");
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
