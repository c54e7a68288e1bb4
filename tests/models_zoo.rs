//! The zoo of models people train (`graph::models`): the parameter counts of their
//! reference configurations equal torchvision's and Hugging Face's, and small
//! configurations train on the CPU (the loss of a fixed batch falls).

use std::collections::HashMap;

use ampgraph::graph::models::resnet::{self, ResNetConfig};
use ampgraph::graph::ops::{Group, Variable};
use ampgraph::optim::{Optimizer, Sgd};
use ampgraph::{DType, Device, Graph, Port, Session, Tensor};

/// The trainable parameters of `g`: its Variables but the batch norms' running
/// averages (PyTorch's buffers).
fn parameters(g: &Graph) -> usize {
    g.node_ids()
        .filter(|&id| g.node(id).op.is::<Variable>())
        .filter(|&id| {
            let name = &g.node(id).name;
            !name.ends_with("/moving_mean") && !name.ends_with("/moving_variance")
        })
        .map(|id| g.node(id).outputs()[0].shape.iter().product::<usize>())
        .sum()
}

#[test]
fn resnet50_has_torchvisions_parameter_count() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [1, 3, 224, 224]).unwrap();
    let net = resnet::build(&mut g, x, &ResNetConfig::RESNET50, false).unwrap();
    // torchvision.models.resnet50(): sum(p.numel() for p in m.parameters()).
    assert_eq!(parameters(&g), 25_557_032);
    assert_eq!(g.ty(net.logits).shape, [1, 1000]);
    let convolutions = (g.node_ids())
        .filter(|&id| g.node(id).op_name() == "Conv2D")
        .count();
    assert_eq!(
        convolutions, 53,
        "the stem, 16 bottlenecks of 3, 4 projections"
    );
}

/// Seeded values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// A small ResNet (one bottleneck a stage, width 4) trains on one batch of 8 images of
/// 3 classes on the CPU: SGD with momentum takes its loss below half the first step's
/// in 30 steps, and the batch norms' running averages move.
#[test]
fn a_small_resnet_trains_on_the_cpu() {
    let config = ResNetConfig {
        blocks: [1, 1, 1, 1],
        width: 4,
        classes: 3,
    };
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [8, 3, 32, 32]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [8]).unwrap();
    let net = resnet::build(&mut g, x, &config, true).unwrap();
    let loss = g.softmax_cross_entropy(net.logits, labels).unwrap();
    let mut step = Sgd::momentum(0.05, 0.9).minimize(&mut g, loss).unwrap();
    step.step = g
        .add(Group, &[&[step.step], &net.running_updates[..]].concat())
        .unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let feeds = HashMap::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![8, 3, 32, 32], &values(8 * 3 * 32 * 32, 1)).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, vec![8], &[0., 1., 2., 0., 1., 2., 0., 1.]).unwrap(),
        ),
    ]);
    let mut run = |fetch: &[Port]| session.run(fetch, &feeds).unwrap();
    let first = run(&[loss, step.step])[0].to_f64_vec()[0];
    let mut last = first;
    for _ in 0..30 {
        last = run(&[loss, step.step])[0].to_f64_vec()[0];
    }
    assert!(
        last.is_finite() && last < 0.5 * first,
        "loss {first} -> {last}"
    );
    let mean = session
        .variable("stem/bn/moving_mean")
        .unwrap()
        .to_f64_vec();
    assert!(mean.iter().any(|&m| m != 0.0), "running mean {mean:?}");
}
