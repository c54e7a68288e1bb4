//! Properties of elementwise fusion on random graphs (tests/common's generator), with
//! and without the AMP rewrite first: the fused graph validates, keeps its outputs'
//! types, computes bitwise the same values on the CPU, survives JSON and binary files,
//! and a second run changes nothing. The same holds for `fuse` followed by
//! `sum-into-elementwise` on those graphs with bias-gradient-like column sums added.

mod common;

use ampgraph::exec::{CpuExecutor, Executor};
use ampgraph::graph::format::{self, GraphDef};
use ampgraph::graph::ops::fused::column_sum_dtype;
use ampgraph::graph::ops::{FusedElementwise, Reduce, ReduceKind, Unary, UnaryKind};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::passes::fuse::{Fuse, FuseReport};
use ampgraph::passes::sum_into_elementwise::SumIntoElementwise;
use ampgraph::passes::Pass;
use ampgraph::{DType, Graph, Port};
use common::{feeds, identical, json, random_graph, Menu, Rng};
use proptest::prelude::*;

/// The random graph, after AMP when `amp` is set: TensorFlow's f16 lists for even
/// seeds, ampgraph's bf16 lists for odd ones (bf16 rounds differently).
fn prepared(seed: u64, size: usize, amp: bool) -> Graph {
    let mut g = random_graph(seed, size, Menu::Everything);
    if amp {
        let config = if seed % 2 == 0 {
            AmpConfig::with_profile(DType::F16, "tensorflow").unwrap()
        } else {
            AmpConfig::new(DType::BF16).unwrap()
        };
        AutoMixedPrecision::new(config).rewrite(&mut g).unwrap();
    }
    g
}

/// The rewritten graph computes bitwise the original's outputs on the CPU.
fn same_bits_on_the_cpu(original: &Graph, g: &Graph, seed: u64) -> Result<(), TestCaseError> {
    let f = feeds(original, seed);
    let want = CpuExecutor::new()
        .run(original, &f, original.outputs())
        .unwrap();
    let got = CpuExecutor::new().run(g, &f, g.outputs()).unwrap();
    for (k, (w, o)) in want.iter().zip(&got).enumerate() {
        prop_assert!(identical(w, o), "output {}: {:?} vs {:?}", k, w, o);
    }
    Ok(())
}

fn check_fusion(unfused: &Graph, seed: u64) -> Result<FuseReport, TestCaseError> {
    let mut g = unfused.clone();
    let report = Fuse.rewrite(&mut g).unwrap();
    g.validate().unwrap();
    prop_assert_eq!(report.nodes_after, g.len());
    prop_assert_eq!(
        report.nodes_before - report.fused_nodes + report.groups + report.named_outputs,
        report.nodes_after
    );
    let fused = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<FusedElementwise>())
        .count();
    prop_assert_eq!(fused, report.groups);
    // Outputs keep dtype and shape.
    let before: Vec<_> = unfused
        .outputs()
        .iter()
        .map(|&p| unfused.ty(p).clone())
        .collect();
    let after: Vec<_> = g.outputs().iter().map(|&p| g.ty(p).clone()).collect();
    prop_assert_eq!(before, after);
    // The CPU computes the same bits: every intermediate rounds as before.
    same_bits_on_the_cpu(unfused, &g, seed)?;
    // JSON -> graph -> binary -> graph -> JSON is unchanged.
    let text = json(&g);
    let from_json = format::graph_from_bytes(text.as_bytes()).unwrap();
    let bin = format::to_bin(&GraphDef::from_graph(&from_json)).unwrap();
    let from_bin = format::graph_from_bytes(&bin).unwrap();
    prop_assert_eq!(&text, &json(&from_bin));
    // Idempotent.
    let mut again = g.clone();
    let second = Fuse.rewrite(&mut again).unwrap();
    prop_assert_eq!(second.groups, 0);
    prop_assert_eq!(text, json(&again));
    Ok(report)
}

/// The graph with up to three column sums (`Sum` over axis 0 stored in f32, f64 for
/// f64) of random float matrices, each read by a Neg that becomes a graph output.
fn with_column_sums(mut g: Graph, seed: u64) -> Graph {
    let mut rng = Rng(seed ^ 0x5eed);
    let matrices: Vec<Port> = g
        .node_ids()
        .flat_map(|id| (0..g.node(id).outputs().len()).map(move |k| Port::new(id, k)))
        .filter(|&p| g.ty(p).rank() == 2 && g.ty(p).dtype.is_float())
        .collect();
    let mut outputs = g.outputs().to_vec();
    for _ in 0..3.min(matrices.len()) {
        let x = matrices[rng.below(matrices.len())];
        let to = column_sum_dtype(g.ty(x).dtype);
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false).with_output(to);
        let s = g.add(sum, &[x]).unwrap();
        outputs.push(g.add(Unary::new(UnaryKind::Neg), &[s]).unwrap());
    }
    g.set_outputs(outputs).unwrap();
    g
}

/// `fuse` then `sum-into-elementwise`: valid, bitwise the same on the CPU, the same
/// after JSON, and a second run of both changes nothing. Returns the sums folded.
fn check_column_sums(unfused: &Graph, seed: u64) -> Result<usize, TestCaseError> {
    let mut g = unfused.clone();
    Fuse.rewrite(&mut g).unwrap();
    let sums = |g: &Graph| {
        g.node_ids()
            .filter(|&id| g.node(id).op.is::<Reduce>())
            .count()
    };
    let before = sums(&g);
    SumIntoElementwise.run(&mut g).unwrap();
    g.validate().unwrap();
    let folded = before - sums(&g);
    same_bits_on_the_cpu(unfused, &g, seed)?;
    let text = json(&g);
    prop_assert_eq!(
        &text,
        &json(&format::graph_from_bytes(text.as_bytes()).unwrap())
    );
    let mut again = g.clone();
    Fuse.rewrite(&mut again).unwrap();
    SumIntoElementwise.run(&mut again).unwrap();
    prop_assert_eq!(text, json(&again));
    Ok(folded)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn column_sums_into_fused_kernels_are_exact_and_idempotent(
        seed in any::<u64>(),
        size in 1usize..40,
        amp in any::<bool>(),
    ) {
        check_column_sums(&with_column_sums(prepared(seed, size, amp), seed), seed)?;
    }

    #[test]
    fn fusion_is_valid_exact_and_idempotent(seed in any::<u64>(), size in 1usize..40) {
        check_fusion(&prepared(seed, size, false), seed)?;
    }

    #[test]
    fn fusion_after_amp_is_valid_exact_and_idempotent(seed in any::<u64>(), size in 1usize..40) {
        check_fusion(&prepared(seed, size, true), seed)?;
    }
}

/// Fusion is not vacuous: it fires on most random graphs, with and without AMP.
#[test]
fn fusion_fires_on_most_random_graphs() {
    for amp in [false, true] {
        let fired = (0..64u64)
            .filter(|&seed| {
                let mut g = prepared(seed, 24, amp);
                Fuse.rewrite(&mut g).unwrap().groups > 0
            })
            .count();
        assert!(
            fired >= 40,
            "fusion fired on {fired} of 64 graphs (amp: {amp})"
        );
    }
}

/// The column-sum fold is not vacuous: it fires on most graphs.
#[test]
fn column_sums_fold_on_most_random_graphs() {
    let fired = (0..64u64)
        .filter(|&seed| {
            let g = with_column_sums(prepared(seed, 24, seed % 4 == 0), seed);
            check_column_sums(&g, seed).unwrap() > 0
        })
        .count();
    assert!(fired >= 40, "the fold fired on {fired} of 64 graphs");
}

/// DOT dumps draw a fused node inside a cluster labelled with its members.
#[test]
fn dot_shows_fused_nodes_as_clusters() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 3]).unwrap();
    let r = g.relu(x).unwrap();
    let y = g.tanh(r).unwrap();
    g.set_outputs(vec![y]).unwrap();
    Fuse.rewrite(&mut g).unwrap();
    let dot = format::to_dot(&g, &format::default_color);
    assert!(dot.contains("subgraph cluster_0 {"), "{dot}");
    assert!(dot.contains("label=\"fused: relu, tanh\""), "{dot}");
    assert!(dot.contains("\"fused/relu\" [label="), "{dot}");
}
