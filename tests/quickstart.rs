//! The README's library section is examples/quickstart.rs, which runs: every line of
//! the README's Rust block is a line of the example, in the same order, and the
//! example trains to a held-out accuracy far above chance.

mod common;

use std::process::Command;

use common::example_binary;

const README: &str = include_str!("../README.md");
const QUICKSTART: &str = include_str!("../examples/quickstart.rs");

/// The Rust block of the README's "## The library" section.
fn readme_block() -> Vec<&'static str> {
    let section = README
        .split("## The library")
        .nth(1)
        .expect("a library section");
    let block = section.split("```rust\n").nth(1).expect("a Rust block");
    let block = block.split("```").next().expect("its end");
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn the_readme_shows_the_quickstart_code() {
    let mut example = QUICKSTART.lines().map(str::trim);
    for line in readme_block() {
        assert!(
            example.any(|l| l == line),
            "README line not in examples/quickstart.rs (in this order): {line}"
        );
    }
}

#[test]
fn the_quickstart_runs_and_learns() {
    let quickstart = example_binary("quickstart");
    // The CPU: CI has no GPU, and auto picks it there anyway.
    let out = Command::new(&quickstart)
        .output()
        .expect("the quickstart runs");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let accuracy: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("held-out accuracy "))
        .and_then(|rest| rest.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy line in {text}"));
    assert!(accuracy >= 90.0, "{text}");
}
