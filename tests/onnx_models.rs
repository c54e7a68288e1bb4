//! ONNX models nobody here wrote the graph of (tests/data/onnx, made by
//! scripts/onnx/make_models.py): imported and run on the CPU, every output matches
//! onnxruntime's on the same inputs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ampgraph::onnx::{import_file, tensor, ImportOptions};
use ampgraph::{Device, Session, Tensor};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx")
}

/// The `*_K.pb` tensors of a test-data folder, in K order.
fn tensors(dir: &Path, stem: &str) -> Vec<(String, Tensor)> {
    (0..)
        .map(|k| dir.join(format!("{stem}_{k}.pb")))
        .take_while(|p| p.exists())
        .map(|p| tensor::load(&p).unwrap())
        .collect()
}

/// Largest |a - b| over the largest |b|.
fn rel_error(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

fn check_model(name: &str) {
    let dir = data_dir().join(name);
    let data = dir.join("test_data_set_0");
    let inputs = tensors(&data, "input");
    let expected = tensors(&data, "output");
    let opts = ImportOptions {
        input_shapes: inputs
            .iter()
            .map(|(n, t)| (n.clone(), t.shape().to_vec()))
            .collect::<BTreeMap<_, _>>(),
    };
    let g = import_file(&dir.join("model.onnx"), &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    let fetches = g.outputs().to_vec();
    assert_eq!(fetches.len(), expected.len(), "{name}: outputs");
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let feeds = inputs.into_iter().collect();
    let got = session
        .run(&fetches, &feeds)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    for (k, (out, (oname, want))) in got.iter().zip(&expected).enumerate() {
        assert_eq!(out.shape(), want.shape(), "{name} output {k} ({oname})");
        let err = rel_error(out, want);
        assert!(
            err < 1e-4,
            "{name} output {k} ({oname}): relative error {err:e}"
        );
    }
}

#[test]
fn resnet_tiny_matches_onnxruntime() {
    check_model("resnet_tiny");
}

#[test]
fn external_data_matches_onnxruntime() {
    check_model("external_data");
}

#[test]
fn mobilenet_tiny_matches_onnxruntime() {
    check_model("mobilenet_tiny");
}

#[test]
fn mobilenet_v3_style_matches_onnxruntime() {
    check_model("mobilenet_v3_style");
}

#[test]
fn transformer_tiny_matches_onnxruntime() {
    check_model("transformer_tiny");
}

#[test]
fn opset_misc_matches_onnxruntime() {
    check_model("opset_misc");
}
