//! Properties of the simplification passes on random graphs (tests/common's generator,
//! `Menu::Simplifiable`): each pass alone and the whole pipeline leave a valid graph
//! with the same outputs (names, dtypes, shapes, values on the CPU) and are idempotent.

mod common;

use ampgraph::exec::cuda::pipeline_names;
use ampgraph::exec::{CpuExecutor, Executor};
use ampgraph::graph::ops::{MatMul, Placeholder};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::passes::registry::{self, SIMPLIFY_PIPELINE};
use ampgraph::passes::simplify::PadGemm;
use ampgraph::passes::{Pass, PassManager};
use ampgraph::{DType, Graph, TensorType};
use common::{check_close_with_floor, feeds, json, largest_value, random_graph, ulp, Menu};
use proptest::prelude::*;

/// Passes that can fire on the generator's f32 graphs (pad-gemm needs 16-bit products,
/// cast-into-reduce casts that widen).
const F32_PASSES: &[&str] = &[
    "const-fold",
    "algebraic",
    "cse",
    "dce",
    "fold-batchnorm",
    "scale-into-matmul",
];

/// `g` rewritten by the named passes, validated after each.
fn rewrite(g: &Graph, passes: &[&str]) -> Graph {
    let passes = passes
        .iter()
        .map(|name| registry::by_name(name).expect("a registered pass"));
    rewrite_with(g, passes)
}

/// `g` rewritten by `passes`, validated after each.
fn rewrite_with(g: &Graph, passes: impl IntoIterator<Item = Box<dyn Pass>>) -> Graph {
    let mut manager = PassManager::new();
    manager.validate = true;
    for pass in passes {
        manager.push(pass);
    }
    let mut out = g.clone();
    manager.run(&mut out).expect("the passes succeed");
    out
}

/// The properties for one list of passes.
fn check(original: &Graph, passes: &[&str], seed: u64) -> Result<(), TestCaseError> {
    check_within(original, passes, seed, 0.0)
}

/// [`check`] with the outputs held to at least `floor` of their scale.
fn check_within(
    original: &Graph,
    passes: &[&str],
    seed: u64,
    floor: f64,
) -> Result<(), TestCaseError> {
    let g = rewrite(original, passes);
    g.validate().unwrap();
    let names = |g: &Graph| -> Vec<(String, TensorType)> {
        g.outputs()
            .iter()
            .map(|&p| (g.port_name(p), g.ty(p).clone()))
            .collect()
    };
    prop_assert_eq!(names(original), names(&g), "passes {:?}", passes);
    let f = feeds(original, seed);
    let want = CpuExecutor::new()
        .run(original, &f, original.outputs())
        .unwrap();
    let got = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
    // The other passes compute the very same operations: 1e-5 of each output's scale.
    // Three compute the same values in another order, exact in real arithmetic only:
    // - fold-batchnorm: the training BatchNorm whose BiasAdd it removes normalises
    //   `x - mean(x)` where it normalised `(x + b) - mean(x + b)`, rounded at |x| + |b|
    //   and scaled by up to 1/sqrt(epsilon) (about 3 for the generator's 0.1), and
    //   folded filters round in their own dtype;
    // - scale-into-matmul: a product that read `v * c` sums `v * w` and scales the sum;
    // - transpose-into-matmul: gemm picks its kernel, and so its order of summation,
    //   by the operands' strides.
    // Their roundoff is made on the largest values the outputs depend on, and a later
    // sum that cancels (seed 11712864324322900111, size 11) or a tanh of one (seed
    // 17754716156322235475, size 15: 1.6e-4 at scale 1, after products of 1.8e4)
    // carries it to outputs far smaller: held to 1e-4 of the output's scale or 8 units
    // of f32 roundoff per op on the path, of the largest value (as amp_props holds AMP).
    let reassociates = [
        "fold-batchnorm",
        "scale-into-matmul",
        "transpose-into-matmul",
    ];
    let (tol, carried): (f64, f64) = if passes.iter().any(|p| reassociates.contains(p)) {
        let unit_roundoff = f64::from(f32::EPSILON) / 2.0;
        let depth = common::depth(original) as f64;
        (
            1e-4,
            8.0 * depth * unit_roundoff * largest_value(original, &f),
        )
    } else {
        (1e-5, 0.0)
    };
    check_close_with_floor(&want, &got, tol.max(floor), carried)
        .map_err(|e| TestCaseError::fail(format!("passes {passes:?}: {e}")))?;
    let again = rewrite(&g, passes);
    prop_assert_eq!(json(&g), json(&again), "passes {:?} not idempotent", passes);
    Ok(())
}

#[test]
fn each_pass_fires_on_a_fair_share_of_generated_graphs() {
    let cases = 100;
    for pass in F32_PASSES {
        let fired = (0..cases)
            .filter(|&seed| {
                let g = random_graph(seed, 20, Menu::Simplifiable);
                json(&rewrite(&g, &[pass])) != json(&g)
            })
            .count();
        assert!(
            fired >= cases as usize / 4,
            "{pass} fired on {fired} of {cases} graphs"
        );
    }
}

/// A 16-bit `m x k` by `k x n` product of Placeholders, operands transposed as asked.
fn half_product(dtype: DType, (m, k, n): (usize, usize, usize), ta: bool, tb: bool) -> Graph {
    let mut g = Graph::new();
    let shape = |rows, cols, t: bool| if t { [cols, rows] } else { [rows, cols] };
    let a = g
        .add_node(
            "a",
            Box::new(Placeholder(TensorType::new(dtype, shape(m, k, ta)))),
            &[],
        )
        .unwrap();
    let b = g
        .add_node(
            "b",
            Box::new(Placeholder(TensorType::new(dtype, shape(k, n, tb)))),
            &[],
        )
        .unwrap();
    let mm = g
        .add_node("mm", Box::new(MatMul::new(ta, tb)), &[a.into(), b.into()])
        .unwrap();
    g.set_outputs(vec![mm.into()]).unwrap();
    g
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn each_pass_and_the_pipeline_keep_outputs_and_are_idempotent(
        seed in any::<u64>(),
        size in 1usize..30,
    ) {
        let g = random_graph(seed, size, Menu::Simplifiable);
        for pass in registry::names() {
            check(&g, &[pass], seed)?;
        }
        check(&g, SIMPLIFY_PIPELINE, seed)?;
        // The pipeline, then batch-norm folding and the dead nodes it leaves.
        let everything = [SIMPLIFY_PIPELINE, &["fold-batchnorm", "dce"]].concat();
        check(&g, &everything, seed)?;
    }

    /// After AMP, the whole pipeline (simplifications, GEMM epilogues, fusion, padding)
    /// computes what AMP alone computes, so the f16 error bound that amp_props proves
    /// for AMP holds for the optimized graph too.
    #[test]
    fn the_whole_pipeline_after_amp_keeps_amps_outputs(
        seed in any::<u64>(),
        size in 1usize..30,
        bf16 in any::<bool>(),
    ) {
        let mut g = random_graph(seed, size, Menu::Simplifiable);
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        AutoMixedPrecision::new(AmpConfig::new(dtype).unwrap())
            .rewrite(&mut g)
            .unwrap();
        let everything = [SIMPLIFY_PIPELINE, &pipeline_names(&Default::default()), &["pad-gemm"]].concat();
        // After AMP values round to 16 bits between ops, and passes that reorder an
        // f32 accumulation (transpose-into-matmul reads an operand the other way) can
        // move a rounding by a unit of its last place, carried on to the outputs (seed
        // 7349869297159779640, size 15: 0.93115 against 0.93066 at scale 1.84 in f16):
        // held to two units at the outputs' scale.
        let unit = if bf16 { f64::from(half::bf16::EPSILON) } else { f64::from(half::f16::EPSILON) };
        check_within(&g, &everything, seed, 2.0 * unit)?;
    }

    #[test]
    fn pad_gemm_keeps_16_bit_products_to_the_ulp(
        seed in any::<u64>(),
        dims in (1usize..20, 1usize..20, 1usize..20),
        bf16 in any::<bool>(),
        ta in any::<bool>(),
        tb in any::<bool>(),
    ) {
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        let g = half_product(dtype, dims, ta, tb);
        // Every size pads here (the registry's pass pads only products that pay).
        let pad = |g: &Graph| rewrite_with(g, [Box::new(PadGemm::every_size()) as Box<dyn Pass>]);
        let padded = pad(&g);
        // The stored row lengths: k of `a` untransposed or `b` transposed, m of `a`
        // transposed, n always.
        let (m, k, n) = dims;
        let misaligned = (ta && m % 8 != 0) || ((!ta || tb) && k % 8 != 0) || n % 8 != 0;
        prop_assert_eq!(padded.len() != g.len(), misaligned);
        let f = feeds(&g, seed);
        let want = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
        let got = CpuExecutor::new().run(&padded, &f, padded.outputs()).unwrap();
        prop_assert_eq!(want[0].ty(), got[0].ty());
        // The padding adds exact zeros; only the f32 accumulation order of the CPU
        // kernel depends on K, which can move the 16-bit result by one ulp.
        for (a, b) in want[0].to_f64_vec().iter().zip(got[0].to_f64_vec()) {
            prop_assert!((a - b).abs() <= ulp(a.abs().max(b.abs()), dtype), "{} vs {}", a, b);
        }
        prop_assert_eq!(json(&padded), json(&pad(&padded)));
    }
}
