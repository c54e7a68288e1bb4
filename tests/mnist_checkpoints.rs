//! The mnist example's checkpoints as a user meets them: a run resumed from an epoch's
//! checkpoint ends with the same bytes as an uninterrupted run, an epoch whose loss is
//! not finite writes no checkpoint, and errors are one `error: ...` line. The example
//! runs on the CPU with its built-in synthetic data (cargo builds the examples before
//! the tests run, beside the test binaries).

mod common;

use std::process::{Command, Output};

use common::{example_binary, ScratchDir};

/// A small CPU run of the example with `extra` arguments.
fn run(extra: &[&str]) -> Output {
    let small = [
        "--train", "256", "--eval", "64", "--batch", "64", "--device", "cpu",
    ];
    Command::new(example_binary("mnist"))
        .args(small)
        .args(extra)
        .output()
        .expect("the mnist example runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_resumed_run_ends_with_the_checkpoint_of_an_uninterrupted_one() {
    let dir = ScratchDir::new("mnist-resume");
    let (whole, halves) = (dir.join("whole.ckpt"), dir.join("halves.ckpt"));
    let (whole_arg, halves_arg) = (whole.to_str().unwrap(), halves.to_str().unwrap());
    let uninterrupted = run(&["--epochs", "3", "--checkpoint", whole_arg]);
    assert!(uninterrupted.status.success(), "{uninterrupted:?}");
    let first = run(&["--epochs", "1", "--checkpoint", halves_arg]);
    assert!(first.status.success(), "{first:?}");
    let resumed = run(&["--epochs", "3", "--checkpoint", halves_arg, "--resume"]);
    assert!(resumed.status.success(), "{resumed:?}");
    let text = stdout(&resumed);
    assert!(text.contains("after epoch 1"), "{text}");
    assert!(
        !text.contains("epoch 1:"),
        "epoch 1 is not trained again: {text}"
    );
    // Epochs 2 and 3 print the losses of the uninterrupted run's epochs 2 and 3
    // (the rest of the line is timing).
    let epoch_lines = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.starts_with("epoch 2:") || l.starts_with("epoch 3:"))
            .map(|l| l.split(',').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(epoch_lines(&text), epoch_lines(&stdout(&uninterrupted)));
    // Every variable (weights, momenta, loss scale, the position) the same bits.
    assert_eq!(
        std::fs::read(&whole).unwrap(),
        std::fs::read(&halves).unwrap()
    );
}

#[test]
fn an_epoch_whose_loss_is_not_finite_saves_nothing() {
    let dir = ScratchDir::new("mnist-nan");
    let path = dir.join("m.ckpt");
    let arg = path.to_str().unwrap();
    // A good epoch first, then a learning rate that makes the loss NaN.
    assert!(run(&["--epochs", "1", "--fp32", "--checkpoint", arg])
        .status
        .success());
    let good = std::fs::read(&path).unwrap();
    let out = run(&[
        "--epochs",
        "2",
        "--fp32",
        "--lr",
        "1e30",
        "--checkpoint",
        arg,
        "--resume",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("epoch 2's loss is") && stderr.contains("not saving"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        good,
        "the last good checkpoint stays"
    );
}

#[test]
fn errors_are_one_line() {
    let out = run(&["--resume"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("No --data"))
        .collect();
    assert_eq!(lines, ["error: --resume needs --checkpoint PATH"]);
    let out = run(&["--epochs", "1", "--checkpoint", "/nonexistent-dir/m.ckpt"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("m.ckpt"),
        "{stderr}"
    );
}
