//! How the AMP pass scales: rewrites in-memory graphs of 10k, 100k and 1M nodes and
//! prints the time of the analysis and of the whole rewrite (one core).
//!
//! `cargo run --release --example amp_scaling [-- SIZES...]`

use std::time::Instant;

use ampgraph::graph::ops::{
    BiasAdd, Binary, BinaryKind, DataFormat, MatMul, Placeholder, Reduce, ReduceKind, Unary,
    UnaryKind,
};
use ampgraph::graph::{Graph, NodeId, Op, Port};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::{DType, TensorType};

/// A deterministic mix of allow, infer, clear and deny ops over [8, 8] tensors, each
/// reading recent tensors, with an output every 1000 nodes.
fn build(n: usize) -> Result<Graph, Box<dyn std::error::Error>> {
    let mut g = Graph::new();
    let square = TensorType::new(DType::F32, vec![8, 8]);
    let bias = g.add_node(
        "bias",
        Box::new(Placeholder(TensorType::new(DType::F32, vec![8]))),
        &[],
    )?;
    let mut recent: Vec<Port> = Vec::new();
    let mut outputs = Vec::new();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for i in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let pick = |k: u64| recent[recent.len() - 1 - (k as usize % recent.len().min(8))];
        let (op, inputs): (Box<dyn Op>, Vec<Port>) = match (recent.len() < 2, state % 16) {
            (true, _) | (_, 0) => (Box::new(Placeholder(square.clone())), vec![]),
            (_, 1..=3) => (
                Box::new(MatMul {
                    transpose_a: false,
                    transpose_b: false,
                }),
                vec![pick(state >> 8), pick(state >> 16)],
            ),
            (_, 4..=6) => (
                Box::new(Binary::new(BinaryKind::Add)),
                vec![pick(state >> 8), pick(state >> 16)],
            ),
            (_, 7) => (
                Box::new(BiasAdd {
                    data_format: DataFormat::Nhwc,
                }),
                vec![pick(state >> 8), bias.into()],
            ),
            (_, 8..=10) => (
                Box::new(Unary::new(UnaryKind::Relu)),
                vec![pick(state >> 8)],
            ),
            (_, 11) => (Box::new(Unary::new(UnaryKind::Exp)), vec![pick(state >> 8)]),
            (_, 12) => (
                Box::new(Unary::new(UnaryKind::Tanh)),
                vec![pick(state >> 8)],
            ),
            (_, 13) => (
                Box::new(Reduce::new(ReduceKind::Max, Some(vec![1]), false)),
                vec![pick(state >> 8)],
            ),
            _ => (
                Box::new(Unary::new(UnaryKind::Identity)),
                vec![pick(state >> 8)],
            ),
        };
        let id: NodeId = g.add_node(format!("n{i}"), op, &inputs)?;
        if g.node(id).outputs()[0].shape == [8, 8] {
            recent.push(id.into());
        }
        if i % 1000 == 999 {
            outputs.push(id.into());
        }
    }
    g.set_outputs(outputs)?;
    Ok(g)
}

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(run)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .map_err(|_| format!("the size '{a}' is not a whole number"))
        })
        .collect::<Result<_, _>>()?;
    let sizes = if sizes.is_empty() {
        vec![10_000, 100_000, 1_000_000]
    } else {
        sizes
    };
    let amp = AutoMixedPrecision::new(AmpConfig::with_profile(DType::F16, "tensorflow")?);
    println!(
        "| nodes | build (s) | analyze (s) | rewrite incl. analyze (s) | converted | fp16 casts |"
    );
    println!("|---|---|---|---|---|---|");
    for n in sizes {
        let t = Instant::now();
        let mut g = build(n)?;
        let built = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let painting = amp.analyze(&g)?;
        let analyzed = t.elapsed().as_secs_f64();
        drop(painting);
        let t = Instant::now();
        let report = amp.rewrite(&mut g)?;
        let rewritten = t.elapsed().as_secs_f64();
        println!(
            "| {n} | {built:.3} | {analyzed:.3} | {rewritten:.3} | {} | {} |",
            report.stats.nodes_converted, report.stats.casts_to_half
        );
    }
    Ok(())
}
