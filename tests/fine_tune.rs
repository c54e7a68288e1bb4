//! Fine-tuning a model nobody here wrote: an imported ONNX model's weights made
//! trainable (`pretrained::trainable_constants`) compute what the constants computed,
//! and train, in f32 and with AMP.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ampgraph::graph::ops::{Const, Variable};
use ampgraph::onnx::{import_file, ImportOptions};
use ampgraph::optim::{Optimizer, Sgd};
use ampgraph::pretrained::{set_values, trainable_constants};
use ampgraph::{enable_mixed_precision_graph_rewrite, DType, Device, Graph, Port, Session, Tensor};

/// The checked-in ResNet-like export (tests/data/onnx/resnet_tiny: convolutions,
/// batch norms, a residual, a Linear head) at batch 4, and a batch of images.
fn resnet_tiny() -> (Graph, Port, HashMap<String, Tensor>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx/resnet_tiny");
    let opts = ImportOptions {
        input_shapes: BTreeMap::from([("input".to_string(), vec![4, 3, 32, 32])]),
        ..ImportOptions::default()
    };
    let g = import_file(&dir.join("model.onnx"), &opts).unwrap();
    let logits = g.outputs()[0];
    let values: Vec<f64> = (0..4 * 3 * 32 * 32)
        .map(|i| ((i * 37 % 101) as f64 / 50.0) - 1.0)
        .collect();
    let x = Tensor::from_f64(DType::F32, vec![4, 3, 32, 32], &values).unwrap();
    (g, logits, HashMap::from([("input".to_string(), x)]))
}

#[test]
fn imported_weights_made_trainable_compute_the_same_and_train() {
    let (g, logits, mut feeds) = resnet_tiny();
    let mut constant = Session::new(g.clone(), Device::Cpu).unwrap();
    let want = constant.run(&[logits], &feeds).unwrap();

    let (mut g, logits, _) = resnet_tiny();
    let values = trainable_constants(&mut g).unwrap();
    let count = |g: &Graph, is: fn(&dyn ampgraph::graph::Op) -> bool| {
        g.node_ids()
            .filter(|&id| is(g.node(id).op.as_ref()))
            .count()
    };
    let variables = count(&g, |op| op.is::<Variable>());
    assert_eq!(variables, values.len());
    // Convolutions, batch-norm scales and offsets, the head: the statistics stay.
    assert!(variables >= 8, "{variables} variables");
    assert!(
        count(&g, |op| op.is::<Const>()) >= 4,
        "the statistics stay constants"
    );
    let mut trainable = Session::new(g.clone(), Device::Cpu).unwrap();
    set_values(&mut trainable, values.clone()).unwrap();
    let got = trainable.run(&[logits], &feeds).unwrap();
    assert_eq!(got[0].to_f64_vec(), want[0].to_f64_vec());

    // Fine-tuning: the loss of a fixed batch falls, in f32 and with AMP (f16).
    let labels = g.placeholder("labels", DType::I64, [4]).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let y = Tensor::from_f64(DType::I64, vec![4], &[1.0, 3.0, 5.0, 7.0]).unwrap();
    feeds.insert("labels".to_string(), y);
    for amp in [false, true] {
        let mut g = g.clone();
        let sgd = Sgd::momentum(0.05, 0.9);
        let step = if amp {
            enable_mixed_precision_graph_rewrite(sgd).minimize(&mut g, loss)
        } else {
            sgd.minimize(&mut g, loss)
        }
        .unwrap();
        let mut session = Session::new(g, Device::Cpu).unwrap();
        set_values(&mut session, values.clone()).unwrap();
        let mut losses = Vec::new();
        for _ in 0..15 {
            let out = session.run(&[loss, step.step], &feeds).unwrap();
            losses.push(out[0].to_f64_vec()[0]);
        }
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(
            last.is_finite() && last < 0.5 * first,
            "amp {amp}: {first} -> {last}"
        );
    }
}

/// `ampgraph convert model.onnx -o model.json --trainable model.ckpt` writes the graph
/// with the weights as Variables and their values as a checkpoint: a session of the
/// graph restoring it computes the ONNX model's outputs. ONNX output is refused.
#[test]
fn convert_trainable_writes_the_graph_and_its_weights() {
    let dir = std::env::temp_dir().join(format!("ampgraph-trainable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx/resnet_tiny/model.onnx");
    let (graph, checkpoint) = (dir.join("model.json"), dir.join("model.ckpt"));
    let convert = |output: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ampgraph"))
            .args(["--input", "input=4x3x32x32", "convert"])
            .arg(&model)
            .arg("-o")
            .arg(output)
            .arg("--trainable")
            .arg(&checkpoint)
            .output()
            .unwrap()
    };
    let out = convert(&graph);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g = ampgraph::graph::format::graph_from_bytes(&std::fs::read(&graph).unwrap()).unwrap();
    assert!(g.node_ids().any(|id| g.node(id).op.is::<Variable>()));
    let logits = g.outputs()[0];
    let mut session = Session::new(g, Device::Cpu).unwrap();
    session.restore(&checkpoint).unwrap();
    let (constant, want_logits, feeds) = resnet_tiny();
    let want = Session::new(constant, Device::Cpu)
        .unwrap()
        .run(&[want_logits], &feeds)
        .unwrap();
    let got = session.run(&[logits], &feeds).unwrap();
    assert_eq!(got[0].to_f64_vec(), want[0].to_f64_vec());
    let out = convert(&dir.join("model.onnx"));
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--trainable writes Variables"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
