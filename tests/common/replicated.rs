//! The small models and batches of the data-parallel tests (CPU and GPU).
#![allow(dead_code)] // each test binary uses a different part of this module

use ampgraph::exec::Feeds;
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::{DType, Graph, Tensor};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd, TrainStep};
use ampgraph::passes::sync_batch_norm::SyncBatchNorm;
use ampgraph::passes::Pass;
use ampgraph::Session;

pub const FEATURES: usize = 6;
pub const CLASSES: usize = 4;

/// x[batch, 6] -> dense 32 tanh -> dense 16 relu -> dense 4 -> mean cross-entropy.
pub fn model(batch: usize, amp: bool) -> (Graph, TrainStep) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [batch, FEATURES]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch]).unwrap();
    let h = nn::dense(&mut g, x, 32, Some(Activation::Tanh)).unwrap();
    let h = nn::dense(&mut g, h, 16, Some(Activation::Relu)).unwrap();
    let logits = nn::dense(&mut g, h, CLASSES, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let opt = Sgd::momentum(0.1, 0.9);
    let step = match amp {
        true => enable_mixed_precision_graph_rewrite(opt).minimize(&mut g, loss),
        false => opt.minimize(&mut g, loss),
    }
    .unwrap();
    (g, step)
}

/// Examples `first..first + n` of a fixed synthetic set, for step `step`.
pub fn batch(step: usize, first: usize, n: usize) -> Feeds {
    let x: Vec<f64> = (first..first + n)
        .flat_map(|e| (0..FEATURES).map(move |f| (e, f)))
        .map(|(e, f)| ((((e * 31 + f * 7 + step * 13) % 23) as f64) - 11.0) / 7.0)
        .collect();
    let labels: Vec<f64> = (first..first + n)
        .map(|e| ((e * 5 + step) % CLASSES) as f64)
        .collect();
    Feeds::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, [n, FEATURES], &x).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, [n], &labels).unwrap(),
        ),
    ])
}

pub fn variables(session: &Session) -> Vec<(String, Tensor)> {
    let mut names: Vec<String> = session.executor().variable_names();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let v = session.variable(&n).unwrap().clone();
            (n, v)
        })
        .collect()
}

/// x[batch, 6, 6, 3] -> conv 3x3 8 -> batch norm (training) -> relu -> dense 4 ->
/// cross-entropy, the batch norm synchronized over `sync` replicas where given.
pub fn convnet(batch: usize, sync: Option<usize>) -> (Graph, TrainStep) {
    use ampgraph::graph::ops::Padding;
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [batch, 6, 6, 3]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch]).unwrap();
    let c = nn::conv2d_layer(&mut g, x, 8, [3, 3], [1, 1], Padding::Same, None).unwrap();
    let bn = nn::batch_norm_layer(&mut g, c.output, true).unwrap();
    let h = g.relu(bn.output).unwrap();
    let flat = g.reshape(h, [batch as i64, 6 * 6 * 8]).unwrap();
    let logits = nn::dense(&mut g, flat, CLASSES, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    if let Some(n) = sync {
        SyncBatchNorm::new(n).run(&mut g).unwrap();
    }
    let step = Sgd::momentum(0.05, 0.9).minimize(&mut g, loss).unwrap();
    (g, step)
}

pub fn images(step: usize, first: usize, n: usize) -> Feeds {
    let x: Vec<f64> = (first * 108..(first + n) * 108)
        .map(|i| ((((i * 37 + step * 11) % 29) as f64) - 14.0) / 9.0 + (i / 108) as f64 * 0.3)
        .collect();
    let labels: Vec<f64> = (first..first + n)
        .map(|e| ((e * 3 + step) % CLASSES) as f64)
        .collect();
    Feeds::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, [n, 6, 6, 3], &x).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, [n], &labels).unwrap(),
        ),
    ])
}
