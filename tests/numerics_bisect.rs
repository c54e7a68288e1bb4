//! `numerics::bisect` against planted truth: graphs of 1,000+ nodes with a few nodes
//! whose 16-bit arithmetic ruins the output (an overflow, a cancellation), and an
//! imported ONNX model whose naive fp16 conversion ends in inf/NaN
//! (tests/data/onnx/numerics/fp16_trap, by scripts/onnx/make_models.py).

mod common;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use ampgraph::cli::{self, Cli};
use ampgraph::exec::Feeds;
use ampgraph::numerics::bisect::{bisect, Bisection};
use ampgraph::onnx::{import_file, tensor, ImportOptions};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, PrecisionLists};
use ampgraph::{CpuExecutor, DType, Graph, Port, Tensor};
use clap::Parser;
use common::Rng;

const D: usize = 8;
const RTOL: f64 = 1e-2;
/// Blocks between two of the graph's outputs.
const TAP: usize = 10;
/// The most evaluations bisection may take on these graphs.
const MAX_EVALUATIONS: usize = 30;

#[derive(Clone, Copy, Debug)]
enum Plant {
    /// h * 2^15 * 2^15 * 2^-15 * 2^-15: exact in f32 and, but for the second product
    /// (beyond 65504 where |h| > 2^-14), in f16; that product is inf in f16. The culprit
    /// is that Mul.
    Overflow,
    /// (h + 1024) - 1024: in f16 the sum's spacing is 0.5..1, so h loses its digits.
    /// The culprit is the Add (the Sub kept in f32 would still read the rounded sum).
    Cancellation,
}

struct Planted {
    graph: Graph,
    feeds: Feeds,
    /// The culprits' node names, one per plant.
    culprits: Vec<String>,
}

fn constant(g: &mut Graph, rng: &mut Rng, scale: f64) -> Port {
    let values: Vec<f64> = (0..D * D)
        .map(|_| (2.0 * rng.unit() - 1.0) * scale)
        .collect();
    g.constant(Tensor::from_f64(DType::F32, vec![D, D], &values).unwrap())
        .unwrap()
}

fn scalar(g: &mut Graph, v: f64) -> Port {
    g.scalar(DType::F32, v).unwrap()
}

/// A chain of `blocks` random blocks over [8, 8] tensors (dense tanh layers, halved
/// residuals, gates), about 6 nodes each, with `plants` placed after the blocks named,
/// and an output every [`TAP`] blocks and at the end: the chain forgets a perturbation
/// in about 6 blocks, so a plant 2 blocks before a tap shows there.
fn planted_graph(seed: u64, blocks: usize, plants: &[(usize, Plant)]) -> Planted {
    let mut rng = Rng(seed);
    let mut g = Graph::new();
    let mut h = g.placeholder("x", DType::F32, [D, D]).unwrap();
    // Uniform(-s, s) with s = sqrt(3 / D): weights of variance 1/D.
    let ws = (3.0 / D as f64).sqrt();
    let mut culprits = Vec::new();
    let mut taps = Vec::new();
    for block in 0..blocks {
        // Every block adds a bias of up to 0.5 before its tanh, so that values stay
        // near 1 rather than fading into f16's subnormals along the chain.
        let w = constant(&mut g, &mut rng, ws);
        let b = constant(&mut g, &mut rng, 0.5);
        let p = g.matmul(h, w).unwrap();
        let p = g.plus(p, b).unwrap();
        let t = g.tanh(p).unwrap();
        h = match rng.below(3) {
            0 => t,
            1 => {
                let s = g.plus(h, t).unwrap();
                let half = scalar(&mut g, 0.5);
                g.mul(s, half).unwrap()
            }
            _ => {
                let w2 = constant(&mut g, &mut rng, ws);
                let gate = g.matmul(h, w2).unwrap();
                let gate = g.sigmoid(gate).unwrap();
                g.mul(t, gate).unwrap()
            }
        };
        for &(_, plant) in plants.iter().filter(|(at, _)| *at == block) {
            // Every block ends in values within [-1, 1].
            h = match plant {
                Plant::Overflow => {
                    let up = scalar(&mut g, 32768.0);
                    let v = g.mul(h, up).unwrap();
                    let w = g.mul(v, up).unwrap();
                    culprits.push(g.node(w.node).name.clone());
                    let down = scalar(&mut g, 1.0 / 32768.0);
                    let v = g.mul(w, down).unwrap();
                    g.mul(v, down).unwrap()
                }
                Plant::Cancellation => {
                    let c = scalar(&mut g, 1024.0);
                    let u = g.plus(h, c).unwrap();
                    culprits.push(g.node(u.node).name.clone());
                    g.sub(u, c).unwrap()
                }
            };
        }
        // A head every TAP blocks (a multi-output model's), through an Identity sink.
        if (block + 1) % TAP == 0 {
            taps.push(g.identity(h).unwrap());
        }
    }
    taps.push(h);
    g.set_outputs(taps).unwrap();
    let x: Vec<f64> = (0..D * D).map(|_| 2.0 * rng.unit() - 1.0).collect();
    let feeds = Feeds::from([(
        "x".to_string(),
        Tensor::from_f64(DType::F32, vec![D, D], &x).unwrap(),
    )]);
    Planted {
        graph: g,
        feeds,
        culprits,
    }
}

fn run(g: &Graph, feeds: &Feeds) -> Vec<Tensor> {
    let fetches = g.outputs().to_vec();
    CpuExecutor::new()
        .run_observed(g, feeds, &fetches, &mut |_| ControlFlow::Continue(()))
        .unwrap()
        .unwrap()
}

/// Worst over outputs of max |got - want| / max |want|; a non-finite value is infinite.
fn rel_error(got: &[Tensor], want: &[Tensor]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
            let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(&b).fold(0f64, |m, (x, y)| {
                let d = (x - y).abs();
                if d.is_nan() {
                    f64::INFINITY
                } else {
                    m.max(d)
                }
            });
            diff / scale
        })
        .fold(0f64, f64::max)
}

/// The error of `g`'s AMP rewrite with `keep` kept in f32, against `g` in f32.
fn amp_error(g: &Graph, feeds: &Feeds, keep: &[(String, String)]) -> f64 {
    let mut config = AmpConfig::new(DType::F16).unwrap();
    for (node, why) in keep {
        config.lists.keep_f32(node, why.clone());
    }
    let mut rewritten = g.clone();
    AutoMixedPrecision::new(config)
        .rewrite(&mut rewritten)
        .unwrap();
    rel_error(&run(&rewritten, feeds), &run(g, feeds))
}

/// Bisects `p` and checks the answer against the planted culprits.
fn check_finds_the_culprits(what: &str, p: &Planted) -> Bisection {
    assert!(p.graph.len() >= 1000, "{what}: {} nodes", p.graph.len());
    // The planted truth: each culprit alone puts the rewrite out of tolerance.
    for culprit in &p.culprits {
        let others: Vec<(String, String)> = p
            .culprits
            .iter()
            .filter(|c| *c != culprit)
            .map(|c| (c.clone(), "planted".to_string()))
            .collect();
        let error = amp_error(&p.graph, &p.feeds, &others);
        assert!(error > RTOL, "{what}: {culprit} alone leaves {error:e}");
    }
    let config = AmpConfig::new(DType::F16).unwrap();
    let found = bisect(&p.graph, &p.feeds, &config, RTOL).unwrap();
    println!(
        "{what}: {} nodes, planted {:?}, found {:?}, error {:.2e} -> {:.2e}, {} evaluations",
        p.graph.len(),
        p.culprits,
        found.keep_f32,
        found.error_before,
        found.error_after,
        found.evaluations
    );
    let names: Vec<&str> = found.keep_f32.iter().map(|(n, _)| n.as_str()).collect();
    for culprit in &p.culprits {
        assert!(
            names.contains(&culprit.as_str()),
            "{what}: {culprit} not in {names:?}"
        );
    }
    assert!(names.len() <= 2 * p.culprits.len(), "{what}: {names:?}");
    assert!(
        found.evaluations <= MAX_EVALUATIONS,
        "{what}: {} evaluations",
        found.evaluations
    );
    assert!(
        found.error_before > RTOL && found.error_after <= RTOL,
        "{what}: {found:?}"
    );
    // Checked independently: the rewrite keeping the set is within tolerance.
    let after = amp_error(&p.graph, &p.feeds, &found.keep_f32);
    assert!(after <= RTOL, "{what}: {after:e} with the set kept in f32");
    for (node, why) in &found.keep_f32 {
        assert!(
            why.starts_with("bisection: its 16-bit output"),
            "{node}: {why}"
        );
    }
    found
}

#[test]
fn a_planted_overflow_is_found_in_a_1000_node_graph() {
    let p = planted_graph(1, 200, &[(117, Plant::Overflow)]);
    let found = check_finds_the_culprits("overflow", &p);
    assert!(
        found.keep_f32[0].1.contains("non-finite"),
        "{:?}",
        found.keep_f32
    );
    assert!(found.error_before.is_infinite(), "{found:?}");
}

#[test]
fn a_planted_cancellation_is_found_in_a_1000_node_graph() {
    let p = planted_graph(2, 200, &[(87, Plant::Cancellation)]);
    check_finds_the_culprits("cancellation", &p);
}

#[test]
fn three_planted_culprits_are_found_together() {
    for seed in [3, 4, 7] {
        let p = planted_graph(
            seed,
            220,
            &[
                (37, Plant::Cancellation),
                (117, Plant::Overflow),
                (197, Plant::Cancellation),
            ],
        );
        check_finds_the_culprits(&format!("three, seed {seed}"), &p);
    }
}

#[test]
fn a_graph_within_tolerance_keeps_nothing_after_one_evaluation() {
    let p = planted_graph(5, 200, &[]);
    let found = bisect(
        &p.graph,
        &p.feeds,
        &AmpConfig::new(DType::F16).unwrap(),
        RTOL,
    )
    .unwrap();
    assert!(found.keep_f32.is_empty(), "{found:?}");
    assert_eq!(found.evaluations, 1);
    assert!(
        found.error_before <= RTOL && found.error_before > 0.0,
        "{found:?}"
    );
}

#[test]
fn a_bad_tolerance_is_refused() {
    let p = planted_graph(6, 2, &[]);
    let config = AmpConfig::new(DType::F16).unwrap();
    for rtol in [-1.0, f64::NAN, f64::INFINITY] {
        let err = bisect(&p.graph, &p.feeds, &config, rtol).unwrap_err();
        assert!(err.to_string().contains("rtol"), "{err}");
    }
}

fn trap_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx/numerics/fp16_trap")
}

/// The trap model imported, its input and onnxruntime's output.
fn load_trap() -> (Graph, Feeds, Tensor) {
    let data = trap_dir().join("test_data_set_0");
    let (name, input) = tensor::load(&data.join("input_0.pb")).unwrap();
    let (_, expected) = tensor::load(&data.join("output_0.pb")).unwrap();
    let opts = ImportOptions {
        input_shapes: BTreeMap::from([(name.clone(), input.shape().to_vec())]),
        ..ImportOptions::default()
    };
    let g = import_file(&trap_dir().join("model.onnx"), &opts).unwrap();
    (g, Feeds::from([(name, input)]), expected)
}

#[test]
fn bisection_repairs_the_onnx_model_a_naive_fp16_conversion_breaks() {
    let (g, feeds, expected) = load_trap();
    // Imported in f32, it is onnxruntime's model.
    let f32_error = rel_error(&run(&g, &feeds), std::slice::from_ref(&expected));
    assert!(f32_error < 1e-4, "f32 import: {f32_error:e}");
    let plain = amp_error(&g, &feeds, &[]);
    assert!(plain > RTOL, "the plain AMP rewrite is within: {plain:e}");
    let found = bisect(&g, &feeds, &AmpConfig::new(DType::F16).unwrap(), RTOL).unwrap();
    println!("fp16_trap: {found:?}");
    assert!(
        !found.keep_f32.is_empty() && found.keep_f32.len() <= 2,
        "{found:?}"
    );
    assert!(found.evaluations <= MAX_EVALUATIONS, "{found:?}");
    // Against onnxruntime's f32 output, the repaired rewrite is within tolerance.
    let mut config = AmpConfig::new(DType::F16).unwrap();
    for (node, why) in &found.keep_f32 {
        config.lists.keep_f32(node, why.clone());
    }
    let mut repaired = g.clone();
    AutoMixedPrecision::new(config)
        .rewrite(&mut repaired)
        .unwrap();
    let err = rel_error(&run(&repaired, &feeds), std::slice::from_ref(&expected));
    assert!(err <= RTOL, "repaired: {err:e}");
}

#[test]
fn the_cli_prints_the_set_and_saves_it_as_overrides() {
    let (g, feeds, expected) = load_trap();
    let dir = std::env::temp_dir().join(format!("ampgraph-bisect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = &feeds["features"];
    let feeds_json = serde_json::json!({
        "features": {"shape": input.shape(), "values": input.to_f64_vec()}
    });
    let feeds_path = dir.join("feeds.json");
    std::fs::write(&feeds_path, feeds_json.to_string()).unwrap();
    let list = dir.join("keep.toml");
    let model = trap_dir().join("model.onnx");
    let args = [
        "ampgraph",
        "bisect",
        model.to_str().unwrap(),
        "--feeds",
        feeds_path.to_str().unwrap(),
        "--rtol",
        "1e-2",
        "-o",
        list.to_str().unwrap(),
    ];
    let mut out = Vec::new();
    cli::run(Cli::try_parse_from(args).unwrap(), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    println!("{text}");
    assert!(text.contains("keep in f32 (1):"), "{text}");
    assert!(text.contains("evaluations: "), "{text}");
    assert!(text.contains("relative error: "), "{text}");
    // The file is a list file of a [keep_f32] table that repairs the rewrite.
    let saved = PrecisionLists::from_file(&list).unwrap();
    let kept: Vec<(String, String)> = saved
        .nodes_kept_f32()
        .iter()
        .map(|(n, w)| (n.clone(), w.clone()))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(text.contains(&kept[0].0), "{text}");
    let mut config = AmpConfig::new(DType::F16).unwrap();
    config.lists.keep_f32(&kept[0].0, kept[0].1.clone());
    let mut repaired = g.clone();
    AutoMixedPrecision::new(config)
        .rewrite(&mut repaired)
        .unwrap();
    let err = rel_error(&run(&repaired, &feeds), std::slice::from_ref(&expected));
    assert!(err <= RTOL, "repaired: {err:e}");
    let _ = std::fs::remove_dir_all(&dir);
}
