//! Every file format ampgraph reads, fuzzed (issue 25): valid files (a graph in JSON
//! and in binary, a training checkpoint) mutated at random — bits flipped, bytes
//! overwritten, inserted and deleted, the end cut off — and read back. A reader returns
//! a value or an error, never panics; a checkpoint restores only unchanged. Bounded:
//! a thousand or two cases per format (proptest, in the normal test run, so in CI);
//! ONNX models (four of the checked-in set), MNIST idx files and PNG/JPEG images too.

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

/// Mutated ONNX models (a small ResNet, every exporter pattern of the checked-in set
/// through its folder) import or fail with an error: never a panic or an abort, whatever
/// sizes, counts or names the bytes now say.
#[test]
fn mutated_onnx_models_import_or_fail_cleanly() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx");
    let models: Vec<Vec<u8>> = [
        "resnet_tiny",
        "exporter_constants",
        "control_flow",
        "einsum_cases",
    ]
    .iter()
    .map(|m| std::fs::read(root.join(m).join("model.onnx")).unwrap())
    .collect();
    let options = ampgraph::onnx::ImportOptions {
        input_shapes: [("input".to_string(), vec![1, 3, 32, 32])].into(),
        ..Default::default()
    };
    let plain = ampgraph::onnx::ImportOptions::default();
    let mut runner = TestRunner::new(Config::with_cases(1500));
    runner
        .run(&(0usize..4, edits()), |(m, e)| {
            let bad = mutated(&models[m], &e);
            let opts = if m == 0 { &options } else { &plain };
            if let Ok(g) = ampgraph::onnx::import_bytes(&bad, "fuzz.onnx", None, opts) {
                g.validate().unwrap();
            }
            Ok(())
        })
        .unwrap();
}

/// Mutated MNIST idx files read or fail with an error naming the file, never panic.
#[test]
fn mutated_idx_files_read_or_fail_cleanly() {
    use ampgraph::data::idx::{load_idx_images, load_idx_labels};
    let dir = std::env::temp_dir().join(format!("ampgraph-fuzz-idx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A small plain idx pair: 3 images of 4x5 and their labels.
    let mut images = vec![0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 5];
    images.extend((0..60).map(|v| v as u8));
    let labels = [0u8, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3];
    let mut runner = TestRunner::new(Config::with_cases(1000));
    runner
        .run(&(any::<bool>(), edits()), |(pick_images, e)| {
            let path = dir.join("case.idx");
            let good: &[u8] = if pick_images { &images } else { &labels };
            std::fs::write(&path, mutated(good, &e)).unwrap();
            let shown = path.display().to_string();
            let err = match pick_images {
                true => load_idx_images(&path).err(),
                false => load_idx_labels(&path).err(),
            };
            if let Some(err) = err {
                prop_assert!(err.to_string().contains(&shown), "{err}");
            }
            Ok(())
        })
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Mutated PNG and JPEG images in an image folder open and read or fail with an error
/// naming the file, never panic (a header may declare any size: the decoder keeps to
/// the memory budget).
#[test]
fn mutated_images_read_or_fail_cleanly() {
    use ampgraph::data::{Dataset, ImageFolder};
    let dir = std::env::temp_dir().join(format!("ampgraph-fuzz-img-{}", std::process::id()));
    let class = dir.join("a");
    std::fs::create_dir_all(&class).unwrap();
    let pixels: Vec<u8> = (0..8 * 8 * 3).map(|v| (v * 7) as u8).collect();
    let mut goods = Vec::new();
    for (name, format) in [
        ("x.png", image::ImageFormat::Png),
        ("x.jpg", image::ImageFormat::Jpeg),
    ] {
        let img = image::RgbImage::from_raw(8, 8, pixels.clone()).unwrap();
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, format).unwrap();
        goods.push((name, bytes.into_inner()));
    }
    let mut runner = TestRunner::new(Config::with_cases(600));
    runner
        .run(&(0usize..2, edits()), |(k, e)| {
            let (name, good) = &goods[k];
            for f in std::fs::read_dir(&class).unwrap() {
                std::fs::remove_file(f.unwrap().path()).unwrap();
            }
            let path = class.join(name);
            std::fs::write(&path, mutated(good, &e)).unwrap();
            let read = ImageFolder::open(&dir).and_then(|set| set.get(0).map(|_| ()));
            if let Err(err) = read {
                prop_assert!(err.to_string().contains(name), "{err}");
            }
            Ok(())
        })
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
