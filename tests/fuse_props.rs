//! Properties of elementwise fusion on random graphs (tests/common's generator), with
//! and without the AMP rewrite first: the fused graph validates, keeps its outputs'
//! types, computes bitwise the same values on the CPU, survives JSON and binary files,
//! and a second run changes nothing. The same holds for `fuse` followed by
//! `sum-into-elementwise` on those graphs with bias-gradient-like column sums added,
//! for `norm-grad-epilogue` on random layer-norm gradients added to a residual, and
//! for `softmax-prologue` on those graphs with softmaxes of their outputs.

mod common;

use ampgraph::exec::{CpuExecutor, Executor};
use ampgraph::graph::format::{self, GraphDef};
use ampgraph::graph::ops::fused::column_sum_dtype;
use ampgraph::graph::ops::{
    Binary, BinaryKind, FusedElementwise, FusedSoftmax, LayerNormGrad, LogSoftmax, Reduce,
    ReduceKind, Softmax, Unary, UnaryKind,
};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::passes::fuse::{Fuse, FuseReport};
use ampgraph::passes::norm_grad_epilogue::NormGradEpilogueFusion;
use ampgraph::passes::softmax_prologue::SoftmaxPrologue;
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

/// `rewrite` applied to `original`: valid, bitwise the same on the CPU, the same after
/// JSON, and a second application changes nothing. Returns the rewritten graph.
fn check_rewrite(
    original: &Graph,
    seed: u64,
    rewrite: impl Fn(&mut Graph),
) -> Result<Graph, TestCaseError> {
    let mut g = original.clone();
    rewrite(&mut g);
    g.validate().unwrap();
    same_bits_on_the_cpu(original, &g, seed)?;
    let text = json(&g);
    prop_assert_eq!(
        &text,
        &json(&format::graph_from_bytes(text.as_bytes()).unwrap())
    );
    let mut again = g.clone();
    rewrite(&mut again);
    prop_assert_eq!(text, json(&again));
    Ok(g)
}

/// `fuse` then `sum-into-elementwise` pass [`check_rewrite`]. Returns the sums folded.
fn check_column_sums(unfused: &Graph, seed: u64) -> Result<usize, TestCaseError> {
    let sums = |g: &Graph| {
        g.node_ids()
            .filter(|&id| g.node(id).op.is::<Reduce>())
            .count()
    };
    let mut fused = unfused.clone();
    Fuse.rewrite(&mut fused).unwrap();
    let g = check_rewrite(unfused, seed, |g| {
        Fuse.rewrite(g).unwrap();
        SumIntoElementwise.run(g).unwrap();
    })?;
    Ok(sums(&fused) - sums(&g))
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

/// The graph with a Softmax or LogSoftmax (along a random axis) of most of its float
/// outputs in their place; now and then the output stays an output as well, and so
/// keeps its kernel.
fn with_softmaxes(mut g: Graph, seed: u64) -> Graph {
    let mut rng = Rng(seed ^ 0x50f7);
    let mut outputs = Vec::new();
    for p in g.outputs().to_vec() {
        let ty = g.ty(p).clone();
        if !ty.dtype.is_float() || ty.rank() == 0 || rng.below(4) == 0 {
            outputs.push(p);
            continue;
        }
        let axis = rng.below(ty.rank()) as i64
            - if rng.below(2) == 0 {
                ty.rank() as i64
            } else {
                0
            };
        let y = if rng.below(3) == 0 {
            g.add(LogSoftmax { axis }, &[p]).unwrap()
        } else {
            g.add(Softmax { axis }, &[p]).unwrap()
        };
        outputs.push(y);
        if rng.below(6) == 0 {
            outputs.push(p);
        }
    }
    g.set_outputs(outputs).unwrap();
    g
}

/// `fuse` then `softmax-prologue` pass [`check_rewrite`]. Returns the softmaxes that
/// took a prologue.
fn check_softmax_prologue(original: &Graph, seed: u64) -> Result<usize, TestCaseError> {
    let g = check_rewrite(original, seed, |g| {
        Fuse.rewrite(g).unwrap();
        SoftmaxPrologue.run(g).unwrap();
    })?;
    Ok(g.node_ids()
        .filter(|&id| g.node(id).op.is::<FusedSoftmax>())
        .count())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn softmax_prologues_are_exact_and_idempotent(
        seed in any::<u64>(),
        size in 1usize..40,
        amp in any::<bool>(),
    ) {
        check_softmax_prologue(&with_softmaxes(prepared(seed, size, amp), seed), seed)?;
    }
}

/// The prologue fold is not vacuous: it fires on most graphs.
#[test]
fn softmax_prologues_fold_on_most_random_graphs() {
    let fired = (0..64u64)
        .filter(|&seed| {
            let g = with_softmaxes(prepared(seed, 24, seed % 4 == 0), seed);
            check_softmax_prologue(&g, seed).unwrap() > 0
        })
        .count();
    assert!(fired >= 32, "the fold fired on {fired} of 64 graphs");
}

/// A LayerNormGrad's dx added to a residual gradient, as a pre-LN block's backward
/// pass has it, with what the draw picks: the dtype, `rows x len` (normalised over
/// the last axis, or the last two of a rank-3 x), the operand order, column sums of
/// the Add, of the residual and of dx itself, and a second reader of dx or of the Add.
fn residual_norm_grad(seed: u64) -> Graph {
    let mut rng = Rng(seed);
    let dtype = rng.pick(&[DType::F32, DType::F16, DType::BF16, DType::F64]);
    let (rows, len) = (1 + rng.below(12), 1 + rng.below(20));
    let (shape, axis) = if rng.below(4) == 0 {
        (vec![rows, 2, len], 1)
    } else {
        (vec![rows, len], -1)
    };
    let gamma_shape = if axis == 1 { vec![2, len] } else { vec![len] };
    let mut g = Graph::new();
    let x = g.placeholder("x", dtype, shape.clone()).unwrap();
    let gamma = g.placeholder("gamma", dtype, gamma_shape).unwrap();
    let dy = g.placeholder("dy", dtype, shape.clone()).unwrap();
    let r = g.placeholder("r", dtype, shape.clone()).unwrap();
    let grad = g
        .add(LayerNormGrad::new(axis, 1e-5), &[x, gamma, dy])
        .unwrap()
        .node;
    let dx = Port::new(grad, 0);
    let operands = if rng.below(2) == 0 { [dx, r] } else { [r, dx] };
    let add = g.add(Binary::new(BinaryKind::Add), &operands).unwrap();
    // A product reads the Add (elementwise readers would fuse with it).
    let rank = shape.len();
    let max = Reduce::new(ReduceKind::Max, Some(vec![rank as i64 - 1]), false);
    let mut outputs = vec![
        Port::new(grad, 1),
        Port::new(grad, 2),
        g.add(max, &[add]).unwrap(),
    ];
    let leading: Vec<i64> = (0..rank as i64 - 1).collect();
    // dx's own sum and a second reader are rarer: each keeps the Add apart.
    for (summed, one_in) in [(add, 2), (r, 2), (dx, 4)] {
        if rng.below(one_in) == 0 {
            let sum = Reduce::new(ReduceKind::Sum, Some(leading.clone()), false)
                .with_output(column_sum_dtype(dtype));
            let s = g.add(sum, &[summed]).unwrap();
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[s]).unwrap());
        }
    }
    match rng.below(8) {
        0 => outputs.push(dx),
        1 => outputs.push(add),
        _ => {}
    }
    g.set_outputs(outputs).unwrap();
    g
}

/// The CUDA pipeline's order around `norm-grad-epilogue`.
fn norm_grad_epilogue(g: &mut Graph) -> usize {
    Fuse.rewrite(g).unwrap();
    SumIntoElementwise.run(g).unwrap();
    let before = g.len();
    NormGradEpilogueFusion.run(g).unwrap();
    before - g.len()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `norm-grad-epilogue` after fusion and the column sums: valid, bitwise the same
    /// on the CPU, the same after JSON, idempotent.
    #[test]
    fn norm_grad_epilogue_is_exact_and_idempotent(seed in any::<u64>()) {
        check_rewrite(&residual_norm_grad(seed), seed, |g| {
            norm_grad_epilogue(g);
        })?;
    }
}

/// The epilogue fold is not vacuous: it fires on most such graphs.
#[test]
fn norm_grad_epilogue_fires_on_most_residual_graphs() {
    let fired = (0..64u64)
        .filter(|&seed| norm_grad_epilogue(&mut residual_norm_grad(seed)) > 0)
        .count();
    assert!(fired >= 24, "the epilogue fused in {fired} of 64 graphs");
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
