//! The README's library section as a whole program: build a model, train it with
//! automatic mixed precision, save a checkpoint, restore it into an AMP inference
//! session, and run a graph loaded from a file. tests/quickstart.rs runs it and checks
//! that the README shows this code.
//!
//! ```sh
//! cargo run --release --example quickstart
//! ```

use ampgraph::exec::Feeds;
use ampgraph::graph::format;
use ampgraph::graph::nn::{self, Activation};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd};
use ampgraph::{DType, Device, Graph, Session, Tensor};

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(run)
}

/// A batch of 128 images of 784 pseudo-random values in [0, 0.5) with one bright pixel
/// among the first 10, whose index is the label: a task a small MLP learns in a few
/// dozen steps.
fn batch(step: u64) -> Result<Feeds, Box<dyn std::error::Error>> {
    let mut state = step.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let labels: Vec<f64> = (0..128).map(|_| (next() * 10.0).floor()).collect();
    let mut x: Vec<f64> = (0..128 * 784).map(|_| 0.5 * next()).collect();
    for (image, &label) in x.chunks_mut(784).zip(&labels) {
        image[label as usize] = 1.0;
    }
    Ok(Feeds::from([
        ("x".into(), Tensor::from_f64(DType::F32, [128, 784], &x)?),
        (
            "labels".into(),
            Tensor::from_f64(DType::I64, [128], &labels)?,
        ),
    ]))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The model: 784 -> 512 (GELU) -> 10, and its loss.
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [128, 784])?;
    let labels = g.placeholder("labels", DType::I64, [128])?;
    let h = nn::dense(&mut g, x, 512, Some(Activation::Gelu))?;
    let logits = nn::dense(&mut g, h, 10, None)?;
    g.set_outputs(vec![logits])?;
    let mut model = g.clone(); // for inference: the same variable names
    let loss = g.softmax_cross_entropy(logits, labels)?;

    // Training with AMP: f16 compute, f32 weights, the loss scale in the graph.
    let opt = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9));
    let train = opt.minimize(&mut g, loss)?; // gradients, scaled loss, updates
    let mut session = Session::new(g, Device::auto())?; // runs the AMP pass
    for step in 0..60 {
        let out = session.run(&[train.loss, train.step], &batch(step)?)?;
        if step % 20 == 0 {
            println!("step {step}: loss {:.4}", out[0].to_f64_vec()[0]);
        }
    }
    let checkpoint = std::env::temp_dir().join("ampgraph-quickstart.ckpt");
    session.save(&checkpoint)?; // atomic; restore() checks every variable

    // AMP inference from the checkpoint: f16 compute, no gradients or optimizer slots.
    model.mixed_precision = Some(DType::F16);
    let mut inference = Session::inference(model, &[logits], Device::auto())?;
    inference.restore(&checkpoint)?;
    let test = batch(1000)?;
    let scores = inference.run(&[logits], &test)?[0].to_f64_vec();
    let correct = scores
        .chunks(10)
        .zip(test["labels"].to_f64_vec())
        .filter(|(row, label)| {
            let best = (0..10).max_by(|&a, &b| row[a].total_cmp(&row[b]));
            best == Some(*label as usize)
        })
        .count();
    println!(
        "held-out accuracy {:.1}% (chance 10%)",
        100.0 * correct as f64 / 128.0
    );

    // A graph file: load it, feed its placeholders, fetch its outputs.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/graphs/mlp.json");
    let file_graph = format::load(path)?;
    let outputs = file_graph.outputs().to_vec();
    let mut feeds = batch(7)?;
    for (name, rows) in [("x", 784), ("labels", 1)] {
        let t = &feeds[name];
        let kept: Vec<f64> = t.to_f64_vec()[..64 * rows].to_vec(); // the file's batch is 64
        let shape = if rows == 1 { vec![64] } else { vec![64, rows] };
        feeds.insert(name.into(), Tensor::from_f64(t.dtype(), shape, &kept)?);
    }
    let mut file_session = Session::new(file_graph, Device::auto())?;
    let values = file_session.run(&outputs, &feeds)?;
    println!("{path}: loss {:.4}", values[1].to_f64_vec()[0]);
    std::fs::remove_file(&checkpoint)?;
    Ok(())
}
