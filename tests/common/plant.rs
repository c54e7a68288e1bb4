//! Planted overflows for the check-numerics tests (tests/numerics_check.rs on the CPU,
//! tests/cuda_numerics.rs on the GPU): a `Mul` by f16's largest value after a node
//! whose f16 values reach beyond 1, so that the product, and nothing before it,
//! overflows f16.

use std::ops::ControlFlow;
use std::sync::Arc;

use ampgraph::data::{Loader, LoaderOptions, Mnist};
use ampgraph::exec::{CpuExecutor, Feeds};
use ampgraph::graph::nn;
use ampgraph::graph::ops::{Binary, BinaryKind, Const, Unary, UnaryKind};
use ampgraph::graph::{DType, Graph, NodeId, Port, Tensor};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, LossScale, Optimizer, Sgd, TrainStep};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};

use crate::common::{self, Rng};

/// The planted node's name.
pub const PLANTED: &str = "planted";

/// The plant's factor: f16's largest finite value (its constant stays finite in f16,
/// and times any |x| >= 1.0003 the product rounds to infinity).
pub const FACTOR: f64 = 65504.0;

/// Inserts `planted = output 0 of at * FACTOR` and feeds every consumer of that output
/// from it instead.
pub fn plant(g: &mut Graph, at: NodeId) -> NodeId {
    let x = Port::new(at, 0);
    let consumers: Vec<(NodeId, usize)> = g.port_consumers(x);
    let factor = g
        .add_node(
            format!("{PLANTED}/factor"),
            Box::new(Const::new(Tensor::scalar(DType::F32, FACTOR))),
            &[],
        )
        .unwrap();
    let planted = g
        .add_node(
            PLANTED,
            Box::new(Binary::new(BinaryKind::Mul)),
            &[x, factor.into()],
        )
        .unwrap();
    g.rewire(
        consumers
            .into_iter()
            .map(|(c, slot)| (c, slot, planted.into()))
            .collect(),
    )
    .unwrap();
    planted
}

/// The AMP settings of every test here (the session's and the ground truth's).
pub fn amp() -> AmpConfig {
    AmpConfig::new(DType::F16).unwrap()
}

/// Where the plant in `planted` (before AMP) overflows once rewritten: it runs in
/// f16, its input is finite and reaches 1.01 in magnitude, its output holds infinity
/// (a CPU run of the rewritten graph on `feeds`).
pub fn plant_overflows(planted: &Graph, feeds: &Feeds) -> bool {
    let mut rewritten = planted.clone();
    AutoMixedPrecision::new(amp())
        .rewrite(&mut rewritten)
        .unwrap();
    let id = rewritten.require(PLANTED).unwrap();
    if rewritten.ty(Port::new(id, 0)).dtype != DType::F16 {
        return false;
    }
    let mut overflows = false;
    let outputs = rewritten.outputs().to_vec();
    CpuExecutor::new()
        .run_observed(&rewritten, feeds, &outputs, &mut |seen| {
            if seen.id != id {
                return ControlFlow::Continue(());
            }
            let x = seen.inputs[0].to_f64_vec();
            let reach = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            overflows = x.iter().all(|v| v.is_finite())
                && reach >= 1.01
                && seen.outputs[0].to_f64_vec().iter().any(|v| v.is_infinite());
            ControlFlow::Break(())
        })
        .unwrap();
    overflows
}

/// A random well-conditioned graph of `size` steps (marked for f16 AMP), its feeds,
/// and the same graph with a plant that overflows after a random node on a path to an
/// output; `None` where no node's values reach far enough.
pub fn planted_random_graph(seed: u64, size: usize) -> Option<(Graph, Graph, Feeds)> {
    let mut g = common::random_graph(seed, size, common::Menu::WellConditioned);
    g.mixed_precision = Some(DType::F16);
    let feeds = common::feeds(&g, seed);
    let needed = g.needed_by(g.outputs());
    let outputs: Vec<NodeId> = g.outputs().iter().map(|p| p.node).collect();
    let mut candidates: Vec<NodeId> = g
        .node_ids()
        .filter(|&id| needed[id.index()] && !outputs.contains(&id))
        .filter(|&id| !g.inputs(id).is_empty() && g.ty(Port::new(id, 0)).dtype == DType::F32)
        .collect();
    let mut rng = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
    while !candidates.is_empty() {
        let at = candidates.swap_remove(rng.below(candidates.len()));
        let mut planted = g.clone();
        plant(&mut planted, at);
        if plant_overflows(&planted, &feeds) {
            return Some((g, planted, feeds));
        }
    }
    None
}

/// Whether any fetched value is NaN or infinite.
pub fn any_non_finite(outputs: &[Tensor]) -> bool {
    outputs
        .iter()
        .any(|t| t.dtype().is_float() && t.to_f64_vec().iter().any(|v| !v.is_finite()))
}

pub const BATCH: usize = 32;

/// An AMP MLP on `[32, 1, 28, 28]` images, 784 -> 32 -> relu -> 10 -> cross-entropy,
/// with the plant (where `planted`) between the first layer and its relu: its
/// pre-activations reach past 1 on the synthetic digits, so the plant overflows, the
/// loss is NaN and the loss scale backs off every step. Returns the graph (before AMP),
/// its step and its Placeholders.
pub fn training_net(planted: bool, initial_scale: f64) -> (Graph, TrainStep, Port, Port) {
    let mut g = Graph::new();
    let images = g
        .placeholder("images", DType::F32, [BATCH, 1, 28, 28])
        .unwrap();
    let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let x = g.reshape(images, [BATCH as i64, 784]).unwrap();
    let mut h = nn::dense(&mut g, x, 32, None).unwrap();
    if planted {
        h = plant(&mut g, h.node).into();
    }
    let h = g.add(Unary::new(UnaryKind::Relu), &[h]).unwrap();
    let logits = nn::dense(&mut g, h, 10, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let scale = LossScale::Dynamic {
        initial: initial_scale,
        growth_interval: 2000,
        growth_factor: 2.0,
        backoff_factor: 0.5,
    };
    let step = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.05, 0.9))
        .with_loss_scale(scale)
        .minimize(&mut g, loss)
        .unwrap();
    (g, step, images, labels)
}

/// 8 batches of 32 synthetic digits.
pub fn loader() -> Loader {
    let options = LoaderOptions {
        batch_size: BATCH,
        drop_last: true,
        seed: 3,
        ..LoaderOptions::default()
    };
    Loader::new(Arc::new(Mnist::synthetic(256, 7)), options).unwrap()
}
