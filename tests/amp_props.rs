//! Properties of the AMP rewrite on random graphs (tests/common's generator).

mod common;

use std::collections::HashSet;

use ampgraph::exec::{CpuExecutor, Executor};
use ampgraph::graph::ops::{Cast, Variable};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, ListClass};
use ampgraph::{DType, Graph};
use common::{feeds, json, random_graph, Menu};
use proptest::prelude::*;

/// The three profiles with their targets.
fn configs() -> Vec<AmpConfig> {
    vec![
        AmpConfig::with_profile(DType::F16, "tensorflow").unwrap(),
        AmpConfig::with_profile(DType::F16, "default_fp16").unwrap(),
        AmpConfig::with_profile(DType::BF16, "default_bf16").unwrap(),
    ]
}

fn check_structure(original: &Graph, config: &AmpConfig) -> Result<(), TestCaseError> {
    let amp = AutoMixedPrecision::new(config.clone());
    let mut g = original.clone();
    amp.rewrite(&mut g).unwrap();
    // The result validates, and the outputs keep their dtype and shape.
    g.validate().unwrap();
    let before: Vec<_> = original
        .outputs()
        .iter()
        .map(|&p| original.ty(p).clone())
        .collect();
    let after: Vec<_> = g.outputs().iter().map(|&p| g.ty(p).clone()).collect();
    prop_assert_eq!(before, after);
    for id in g.node_ids() {
        let n = g.node(id);
        let out = n.outputs()[0].dtype;
        match config.lists.class(n.op.name()) {
            // No deny op runs in 16 bits.
            Some(ListClass::Deny) => {
                prop_assert!(!out.is_half(), "deny op {} runs in {}", n.name, out)
            }
            // Every allow op (none is a graph output here) runs in 16 bits.
            Some(ListClass::Allow) => {
                prop_assert_eq!(out, config.target, "allow op {} runs in {}", n.name, out)
            }
            _ => {}
        }
        if n.op.is::<Cast>() {
            // No cast reads a float-to-float cast, unless the original graph had that edge.
            let src = g.inputs(id)[0].node;
            let src_name = &g.node(src).name;
            let original_edge = original.find(&n.name).is_some_and(|o| {
                original
                    .inputs(o)
                    .iter()
                    .any(|p| &original.node(p.node).name == src_name)
            });
            let float_cast = g.node(src).op.is::<Cast>() && g.ty(g.inputs(src)[0]).dtype.is_float();
            prop_assert!(
                !float_cast || original_edge,
                "cast {} reads cast {}",
                n.name,
                src_name
            );
        }
        // The rewrite casts no tensor twice to one dtype (the generator may itself
        // have cast a tensor more than once; those casts stay).
        let mut seen = HashSet::new();
        for (consumer, _, port) in g.consumers(id) {
            let inserted = original.find(&g.node(consumer).name).is_none();
            if let (Some(c), true) = (g.node(consumer).op.downcast_ref::<Cast>(), inserted) {
                prop_assert!(
                    seen.insert((port, c.to)),
                    "{} is cast twice to {}",
                    n.name,
                    c.to
                );
                let twin = g.port_consumers(port).into_iter().any(|(d, _)| {
                    d != consumer
                        && g.node(d)
                            .op
                            .downcast_ref::<Cast>()
                            .is_some_and(|o| o.to == c.to)
                });
                prop_assert!(
                    !twin,
                    "{} is cast to {} beside an existing cast",
                    n.name,
                    c.to
                );
            }
        }
        // Variables stay f32 (master weights).
        if n.op.is::<Variable>() {
            prop_assert_eq!(out, DType::F32);
        }
    }
    // Idempotent: a second rewrite changes nothing.
    let mut again = g.clone();
    amp.rewrite(&mut again).unwrap();
    prop_assert_eq!(json(&g), json(&again));
    Ok(())
}

/// The rewritten graph computes the f32 graph's outputs within the 16-bit rounding
/// error: each op on a path adds at most a few units of roundoff relative to the scale
/// of the values it works on (inputs are in [-1, 1] and the ops are well-conditioned).
fn check_numerics(original: &Graph, config: &AmpConfig, seed: u64) -> Result<(), TestCaseError> {
    let mut g = original.clone();
    AutoMixedPrecision::new(config.clone())
        .rewrite(&mut g)
        .unwrap();
    let f = feeds(original, seed);
    let want = CpuExecutor::new()
        .run(original, &f, original.outputs())
        .unwrap();
    let got = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
    let unit_roundoff = if config.target == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    };
    let depth = common::depth(original) as f64;
    // Rounding errors scale with the values they are made on, intermediate ones
    // included (common::largest_value).
    let scale = common::largest_value(original, &f);
    // Well-conditioned means representable in 16 bits: values near f16's largest
    // (65504) round to infinity, which is no rounding error to bound.
    prop_assume!(scale < 1e4, "the f32 values leave the f16 range");
    // 8 inputs per dot product, rounding at each of `depth` ops.
    let bound = 8.0 * depth * unit_roundoff * scale;
    for (w, o) in want.iter().zip(&got) {
        let w = w.to_f64_vec();
        let o = o.to_f64_vec();
        for (a, b) in w.iter().zip(&o) {
            prop_assert!(
                (a - b).abs() <= bound,
                "|{a} - {b}| > {bound} (depth {depth})"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn rewrite_is_valid_safe_and_idempotent(seed in any::<u64>(), size in 1usize..40) {
        let g = random_graph(seed, size, Menu::Everything);
        for config in configs() {
            check_structure(&g, &config)?;
        }
    }

    #[test]
    fn rewrite_stays_within_half_precision_error(seed in any::<u64>(), size in 1usize..25) {
        let g = random_graph(seed, size, Menu::WellConditioned);
        for config in configs() {
            check_numerics(&g, &config, seed)?;
        }
    }
}
