//! Every file format ampgraph reads, fuzzed (issue 25): valid files (a graph in JSON
//! and in binary, a training checkpoint) mutated at random — bits flipped, bytes
//! overwritten, inserted and deleted, the end cut off — and read back. A reader returns
//! a value or an error, never panics; a checkpoint restores only unchanged. Bounded:
//! a thousand or two cases per format (proptest, in the normal test run, so in CI).

mod common;

use ampgraph::graph::format::{self, GraphDef};
use ampgraph::{Device, Session};
use common::small_training_graph;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// One edit: (kind, position, byte).
type Edit = (u8, usize, u8);

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec((0u8..5, any::<usize>(), any::<u8>()), 1..6)
}

/// `bytes` with the edits applied in order (positions taken modulo the length).
fn mutated(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for &(kind, at, byte) in edits {
        if b.is_empty() {
            b.push(byte);
            continue;
        }
        let i = at % b.len();
        match kind {
            0 => b[i] ^= 1 << (byte % 8),
            1 => b[i] = byte,
            2 => b.insert(i, byte),
            3 => {
                b.remove(i);
            }
            _ => b.truncate(i),
        }
    }
    b
}

/// Reads `bytes` as a graph file; whatever loads is valid and writes back.
fn read_graph(bytes: &[u8]) {
    if let Ok(g) = format::graph_from_bytes(bytes) {
        g.validate().unwrap();
        let def = GraphDef::from_graph(&g);
        format::to_json(&def);
        format::to_bin(&def).unwrap();
    }
}

#[test]
fn mutated_json_graphs_load_or_fail_cleanly() {
    let good = format::to_json(&GraphDef::from_graph(&small_training_graph()));
    let mut runner = TestRunner::new(Config::with_cases(2000));
    runner
        .run(&edits(), |e| {
            read_graph(&mutated(good.as_bytes(), &e));
            Ok(())
        })
        .unwrap();
}

#[test]
fn mutated_binary_graphs_load_or_fail_cleanly() {
    let good = format::to_bin(&GraphDef::from_graph(&small_training_graph())).unwrap();
    let mut runner = TestRunner::new(Config::with_cases(2000));
    runner
        .run(&edits(), |e| {
            read_graph(&mutated(&good, &e));
            Ok(())
        })
        .unwrap();
}

#[test]
fn mutated_checkpoints_restore_only_unchanged() {
    let dir = std::env::temp_dir().join(format!("ampgraph-fuzz-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (good_path, bad_path) = (dir.join("good.ckpt"), dir.join("bad.ckpt"));
    Session::new(small_training_graph(), Device::Cpu)
        .unwrap()
        .save(&good_path)
        .unwrap();
    let good = std::fs::read(&good_path).unwrap();
    // The runner's test is `Fn`: the session restores through a RefCell.
    let target =
        std::cell::RefCell::new(Session::new(small_training_graph(), Device::Cpu).unwrap());
    let mut runner = TestRunner::new(Config::with_cases(1000));
    runner
        .run(&edits(), |e| {
            let bad = mutated(&good, &e);
            std::fs::write(&bad_path, &bad).unwrap();
            let restored = target.borrow_mut().restore(&bad_path);
            prop_assert_eq!(restored.is_ok(), bad == good, "{:?}", restored.err());
            Ok(())
        })
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
