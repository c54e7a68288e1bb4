//! Range-aware precision (`numerics::calibrate`): calibration keeps in f32 exactly the
//! nodes whose f32 values do not fit f16 (computed here independently from every
//! tensor's f32 values), the AMP rewrite then keeps them and its outputs stay finite,
//! and on the TensorFlow oracle graphs nothing changes where nothing overflows.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::format::{to_json, GraphDef};
use ampgraph::graph::ops::{Binary, BinaryKind, Const, Unary, UnaryKind};
use ampgraph::graph::{DType, Graph, NodeId, Port, Tensor};
use ampgraph::numerics::calibrate::{
    calibrate, load_overrides, save_overrides, CalibrateError, DEFAULT_MARGIN,
};
use ampgraph::passes::amp::report::explain;
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, PrecisionLists};
use common::Menu;

const F16_MAX: f64 = 65504.0;
/// f16's smallest normal value (2^-14): below it, a value is subnormal or zero.
const F16_MIN_NORMAL: f64 = 6.103515625e-5;

/// A directory private to one test.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("ampgraph-calibrate-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every f32 output port of `g`.
fn f32_ports(g: &Graph) -> Vec<Port> {
    g.node_ids()
        .flat_map(|id| {
            let outs = g.node(id).outputs();
            (0..outs.len())
                .filter(move |&k| outs[k].dtype == DType::F32)
                .map(move |k| Port::new(id, k))
        })
        .collect()
}

/// The nodes that must stay in f32 for f16, from the f32 values of every tensor
/// (fetched, not observed): the producers of tensors with 2 * max|x| above 65504 or
/// all (finite, some nonzero) values below f16's normal range, and the f32 nodes reading
/// them.
fn expected_kept(g: &Graph, samples: &[Feeds]) -> BTreeSet<String> {
    let ports = f32_ports(g);
    let mut max = vec![0f64; ports.len()];
    let mut finite = vec![true; ports.len()];
    let mut exec = CpuExecutor::new();
    for feeds in samples {
        let values = exec.run(g, feeds, &ports).unwrap();
        for (k, t) in values.iter().enumerate() {
            for x in t.to_f64_vec() {
                if x.is_finite() {
                    max[k] = max[k].max(x.abs());
                } else {
                    finite[k] = false;
                }
            }
        }
    }
    let flagged: BTreeSet<Port> = ports
        .iter()
        .enumerate()
        .filter(|&(k, _)| {
            max[k] * 2.0 > F16_MAX || (finite[k] && max[k] > 0.0 && max[k] < F16_MIN_NORMAL)
        })
        .map(|(_, &p)| p)
        .collect();
    let mut kept: BTreeSet<String> = flagged
        .iter()
        .map(|p| g.node(p.node).name.clone())
        .collect();
    for id in g.node_ids() {
        let has_f32 = g.node(id).outputs().iter().any(|t| t.dtype == DType::F32);
        if has_f32 && g.inputs(id).iter().any(|p| flagged.contains(p)) {
            kept.insert(g.node(id).name.clone());
        }
    }
    kept
}

fn samples(g: &Graph, n: u64) -> Vec<Feeds> {
    (0..n).map(|seed| common::feeds(g, seed)).collect()
}

/// Puts `p -> * 1e5 -> * 1e-5` in place of the tanh `p` everywhere it is read: the
/// same values in f32, beyond f16's range in between. Returns the scaling Mul.
fn plant_overflow(g: &mut Graph, p: NodeId) -> String {
    let readers: Vec<(NodeId, usize)> = g.port_consumers(Port::new(p, 0));
    let konst = |g: &mut Graph, name: &str, v: f64| -> Port {
        let t = Tensor::from_f64(DType::F32, vec![], &[v]).unwrap();
        g.add_node(name, Box::new(Const::new(t)), &[])
            .unwrap()
            .into()
    };
    let up = konst(g, "planted_1e5", 1e5);
    let down = konst(g, "planted_1e-5", 1e-5);
    let mul = Box::new(Binary::new(BinaryKind::Mul));
    let big: Port = g
        .add_node("planted_scale", mul.clone(), &[Port::new(p, 0), up])
        .unwrap()
        .into();
    let back: Port = g
        .add_node("planted_unscale", mul, &[big, down])
        .unwrap()
        .into();
    g.rewire(readers.into_iter().map(|(n, s)| (n, s, back)).collect())
        .unwrap();
    g.validate().unwrap();
    "planted_scale".into()
}

/// The first tanh read by something (a product's tanh where the graph has one).
fn tanh_to_plant_after(g: &Graph) -> Option<NodeId> {
    g.node_ids().find(|&id| {
        g.node(id)
            .op
            .downcast_ref::<Unary>()
            .is_some_and(|u| u.kind == UnaryKind::Tanh)
            && !g.consumers(id).is_empty()
    })
}

fn outputs_finite_where_f32_is(g32: &Graph, g: &Graph, samples: &[Feeds]) -> bool {
    let mut exec = CpuExecutor::new();
    samples.iter().all(|feeds| {
        let want = exec.run(g32, feeds, g32.outputs()).unwrap();
        let got = exec.run(g, feeds, g.outputs()).unwrap();
        want.iter().zip(&got).all(|(w, o)| {
            w.to_f64_vec()
                .iter()
                .zip(o.to_f64_vec())
                .all(|(a, b)| !a.is_finite() || b.is_finite())
        })
    })
}

fn dtype_of(g: &Graph, name: &str) -> DType {
    let outputs = g.node(g.require(name).unwrap()).outputs();
    outputs.first().map_or(DType::F32, |t| t.dtype)
}

#[test]
fn planted_overflows_are_kept_in_f32_and_nothing_else() {
    let (mut planted, mut naive_broken) = (0, 0);
    for seed in 0..40u64 {
        let mut g = common::random_graph(seed, 30, Menu::WellConditioned);
        let Some(p) = tanh_to_plant_after(&g) else {
            continue;
        };
        let feeds = samples(&g, 3);
        let before = calibrate(&g, &feeds).unwrap();
        let kept_before: BTreeSet<String> = before
            .keep_f32(DType::F16, DEFAULT_MARGIN)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let scale = plant_overflow(&mut g, p);
        planted += 1;
        let calibration = calibrate(&g, &feeds).unwrap();
        assert_eq!(calibration.samples(), 3);
        let kept = calibration.keep_f32(DType::F16, DEFAULT_MARGIN);
        let names: BTreeSet<String> = kept.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, expected_kept(&g, &feeds), "seed {seed}");
        // What planting added: the 1e5 constant and the product reading it, the 1e-5
        // constant (below f16's normal range) and the unscaling product reading it;
        // nothing else.
        assert!(calibration.range(&scale).unwrap().max_abs > 0.0);
        let added: BTreeSet<String> = [
            "planted_1e5",
            "planted_scale",
            "planted_1e-5",
            "planted_unscale",
        ]
        .map(String::from)
        .into();
        let want: BTreeSet<String> = kept_before.union(&added).cloned().collect();
        assert_eq!(names, want, "seed {seed}");
        let why = &kept.iter().find(|(n, _)| n == "planted_1e5").unwrap().1;
        assert_eq!(why, "observed |x| up to 1.0e5, beyond f16's range");

        // The rewrite keeps them in f32, explains why, and gives finite outputs.
        let mut config = AmpConfig::new(DType::F16).unwrap();
        calibration.apply(&mut config, DEFAULT_MARGIN);
        let amp = AutoMixedPrecision::new(config);
        let painting = amp.analyze(&g).unwrap();
        let e = explain(&g, &painting, &amp.config, &scale)
            .unwrap()
            .to_string();
        assert!(
            e.contains("kept in f32: observed |x| up to") || e.contains("kept in f32: its input"),
            "{e}"
        );
        let mut rewritten = g.clone();
        amp.rewrite(&mut rewritten).unwrap();
        for name in &names {
            assert_eq!(
                dtype_of(&rewritten, name),
                DType::F32,
                "seed {seed}: {name}"
            );
        }
        assert!(
            outputs_finite_where_f32_is(&g, &rewritten, &feeds),
            "seed {seed}: calibrated rewrite gave non-finite outputs"
        );
        // Without calibration the same rewrite overflows in some graphs.
        let mut naive = g.clone();
        AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap())
            .rewrite(&mut naive)
            .unwrap();
        naive_broken += usize::from(!outputs_finite_where_f32_is(&g, &naive, &feeds));
    }
    println!("{planted} graphs planted; uncalibrated rewrite non-finite in {naive_broken}");
    assert!(
        planted >= 20,
        "only {planted} graphs had a tanh to plant after"
    );
    assert!(
        naive_broken > 0,
        "the planted overflow never broke the uncalibrated rewrite: the test shows nothing"
    );
}

#[test]
fn margin_and_bf16_thresholds() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4]).unwrap();
    let y = g.scalar(DType::F32, 2.0).unwrap();
    let z = g.mul(x, y).unwrap();
    g.set_outputs(vec![z]).unwrap();
    let feed = |v: [f64; 4]| -> Feeds {
        [(
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![4], &v).unwrap(),
        )]
        .into()
    };
    // |x| = 20000 fits f16 twice over; z = 40000 does not: kept at margin 2 (with
    // nothing reading it), not at margin 1.
    let c = calibrate(&g, &[feed([1.0, -20000.0, 0.5, 0.0])]).unwrap();
    let kept = |target, margin| -> Vec<String> {
        c.keep_f32(target, margin)
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    };
    let zname = g.node(z.node).name.clone();
    assert_eq!(kept(DType::F16, DEFAULT_MARGIN), [zname.as_str()]);
    assert!(kept(DType::F16, 1.0).is_empty());
    assert!(kept(DType::BF16, DEFAULT_MARGIN).is_empty());
    assert!(kept(DType::F32, DEFAULT_MARGIN).is_empty());
    // Values below f16's normal range (but not bf16's) are kept too; zeros are not.
    let c = calibrate(&g, &[feed([1e-9, -2e-9, 0.0, 0.0])]).unwrap();
    let why = c.keep_f32(DType::F16, DEFAULT_MARGIN);
    assert_eq!(why[0].0, "x");
    assert_eq!(
        why[0].1,
        "observed |x| at most 2.0e-9, below f16's normal range"
    );
    assert!(c.keep_f32(DType::BF16, DEFAULT_MARGIN).is_empty());
    let c = calibrate(&g, &[feed([0.0; 4])]).unwrap();
    assert!(c.keep_f32(DType::F16, DEFAULT_MARGIN).is_empty());
    // Non-finite values in f32 are reported, not kept for.
    let c = calibrate(&g, &[feed([f64::INFINITY, 1.0, 0.0, 0.0])]).unwrap();
    assert_eq!(c.nonfinite(), ["x", zname.as_str()]);
    assert!(c.keep_f32(DType::F16, DEFAULT_MARGIN).is_empty());
    // Several samples: the largest magnitude over all of them.
    let c = calibrate(&g, &[feed([3e4, 0.0, 0.0, 0.0]), feed([1.0; 4])]).unwrap();
    assert_eq!(c.range("x").unwrap().max_abs, 3e4);
    assert!(matches!(calibrate(&g, &[]), Err(CalibrateError::NoSamples)));
}

#[test]
fn variables_come_from_the_executor_and_are_restored() {
    use ampgraph::graph::ops::AssignVariable;
    use ampgraph::numerics::calibrate::calibrate_on;
    let mut g = Graph::new();
    let v = g.variable("v", DType::F32, [2]).unwrap();
    let k = g.scalar(DType::F32, 3e4).unwrap();
    let scaled = g.mul(v, k).unwrap();
    // No output: the assignment is a sink, and calibration still runs it.
    g.add(AssignVariable, &[v, scaled]).unwrap();
    let mut exec = CpuExecutor::new();
    let start = Tensor::from_f64(DType::F32, vec![2], &[1.0, 2.0]).unwrap();
    exec.set_variable("v", start.clone()).unwrap();
    let c = calibrate_on(&mut exec, &g, &[Feeds::new(), Feeds::new()]).unwrap();
    // The second step saw the first's assignment (v = 6e4), as a training run would.
    assert_eq!(c.range("v").unwrap().max_abs, 6e4);
    assert_eq!(c.range(&g.node(scaled.node).name).unwrap().max_abs, 1.8e9);
    assert!(common::identical(exec.variable("v").unwrap(), &start));
    // Without the executor's value, the Variable must be fed: an error naming it.
    let err = calibrate(&g, &[Feeds::new()]).unwrap_err().to_string();
    assert!(
        err.starts_with("calibration sample 0") && err.contains("'v'"),
        "{err}"
    );
}

#[test]
fn oracle_decisions_are_unchanged_where_nothing_overflows() {
    let tf = || AmpConfig::with_profile(DType::F16, "tensorflow").unwrap();
    let (mut graphs, mut with_kept, mut kept_nodes, mut changed) = (0, 0, 0, 0);
    for (file, case) in common::oracle_cases() {
        let g = common::oracle_graph(&case);
        let feeds = samples(&g, 2);
        let calibration = calibrate(&g, &feeds).unwrap();
        let kept = calibration.keep_f32(DType::F16, DEFAULT_MARGIN);
        let names: BTreeSet<String> = kept.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names, expected_kept(&g, &feeds), "{file}");
        let mut plain = g.clone();
        AutoMixedPrecision::new(tf()).rewrite(&mut plain).unwrap();
        let mut config = tf();
        calibration.apply(&mut config, DEFAULT_MARGIN);
        let mut calibrated = g.clone();
        AutoMixedPrecision::new(config)
            .rewrite(&mut calibrated)
            .unwrap();
        graphs += 1;
        // Calibration only ever keeps more in f32.
        for id in g.node_ids() {
            let name = &g.node(id).name;
            let half = |r: &Graph| dtype_of(r, name).is_half();
            assert!(
                !half(&calibrated) || half(&plain),
                "{file}: {name} became 16-bit"
            );
            changed += usize::from(half(&calibrated) != half(&plain));
        }
        if kept.is_empty() {
            assert_eq!(
                common::json(&plain),
                common::json(&calibrated),
                "{file}: calibration found nothing yet changed the rewrite"
            );
        } else {
            with_kept += 1;
            kept_nodes += kept.len();
            for name in &names {
                let id = calibrated.require(name).unwrap();
                let outs = calibrated.node(id).outputs();
                assert!(
                    outs.iter().all(|t| !t.dtype.is_half()),
                    "{file}: {name} was kept in f32 but is {}",
                    outs[0].dtype
                );
            }
        }
    }
    println!(
        "{graphs} oracle graphs calibrated; {with_kept} had nodes kept in f32 ({kept_nodes} \
         nodes; {changed} decisions moved to f32 with them)"
    );
    assert!(graphs >= 100, "the oracle set looks incomplete: {graphs}");
}

#[test]
fn overrides_round_trip() {
    let dir = Scratch::new("roundtrip");
    let path = std::path::PathBuf::from(dir.path("keep.toml"));
    let kept = vec![
        (
            "block/mul:0".to_string(),
            "observed |x| up to 1.2e5, beyond f16's range".to_string(),
        ),
        (
            "odd \"name\" \\ é".to_string(),
            "its input 'a' has observed |x|\nup to 7.0e4".to_string(),
        ),
    ];
    save_overrides(&path, &kept).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("[keep_f32]") && !text.contains("[lists]"),
        "{text}"
    );
    // A file of [keep_f32] alone is a list file.
    let alone = PrecisionLists::from_toml(&text, "saved").unwrap();
    let want: BTreeMap<String, String> = kept.iter().cloned().collect();
    assert_eq!(alone.nodes_kept_f32(), &want);
    // Applied onto a profile it adds the nodes and keeps the op lists.
    let mut lists = PrecisionLists::profile("tensorflow").unwrap();
    let classes = lists.clone();
    assert_eq!(load_overrides(&mut lists, &path).unwrap(), 2);
    assert_eq!(lists.nodes_kept_f32(), &want);
    assert_eq!(
        lists.ops(ampgraph::passes::amp::ListClass::Allow),
        classes.ops(ampgraph::passes::amp::ListClass::Allow)
    );
    // Nothing kept: an empty table, read back as nothing.
    save_overrides(&path, &[]).unwrap();
    let mut lists = PrecisionLists::profile("tensorflow").unwrap();
    assert_eq!(load_overrides(&mut lists, &path).unwrap(), 0);
    assert!(lists.nodes_kept_f32().is_empty());
    // A file with op lists is refused (those replace a profile: --lists).
    std::fs::write(
        &path,
        "[lists]\nallow = [\"MatMul\"]\n[keep_f32]\n\"a\" = \"b\"\n",
    )
    .unwrap();
    let err = load_overrides(&mut lists, &path).unwrap_err().to_string();
    assert!(err.contains("only a [keep_f32] table"), "{err}");
}

/// x[4,8] @ w[8,8] -> * 1e5 -> * 1e-5 -> Relu: the scaled product overflows f16.
fn scaled_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 8]).unwrap();
    let w = g.placeholder("w", DType::F32, [8, 8]).unwrap();
    let product = ampgraph::graph::ops::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    let mm: Port = g
        .add_node("matmul", Box::new(product), &[x, w])
        .unwrap()
        .into();
    let konst = |g: &mut Graph, name: &str, v: f64| -> Port {
        let t = Tensor::from_f64(DType::F32, vec![], &[v]).unwrap();
        g.add_node(name, Box::new(Const::new(t)), &[])
            .unwrap()
            .into()
    };
    let up = konst(&mut g, "up", 1e5);
    let down = konst(&mut g, "down", 1e-5);
    let mul = Box::new(Binary::new(BinaryKind::Mul));
    let big: Port = g.add_node("big", mul.clone(), &[mm, up]).unwrap().into();
    let back: Port = g.add_node("back", mul, &[big, down]).unwrap().into();
    let out: Port = g
        .add_node("out", Box::new(Unary::new(UnaryKind::Relu)), &[back])
        .unwrap()
        .into();
    g.set_outputs(vec![out]).unwrap();
    g
}

fn ampgraph(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ampgraph"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_rewrite_calibrate_saves_and_reuses_overrides() {
    let dir = Scratch::new("cli");
    let graph = dir.path("g.json");
    std::fs::write(&graph, to_json(&GraphDef::from_graph(&scaled_graph()))).unwrap();
    let (out1, out2, keep) = (
        dir.path("out1.json"),
        dir.path("out2.json"),
        dir.path("keep.toml"),
    );
    let (ok, stdout, stderr) = ampgraph(&[
        "rewrite",
        &graph,
        "--amp",
        "--calibrate",
        "seed:2",
        "--save-overrides",
        &keep,
        "--report",
        "-o",
        &out1,
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(
            "Calibration: 2 sample(s) in f32; nodes kept in f32 by their observed range: 4"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("  big: observed |x| up to"), "{stdout}");
    assert!(
        stdout.contains("  back: its input 'big' has observed |x| up to"),
        "{stdout}"
    );
    let rewritten = ampgraph::graph::format::load(&out1).unwrap();
    assert_eq!(dtype_of(&rewritten, "big"), DType::F32);
    assert_eq!(
        dtype_of(&rewritten, "matmul"),
        DType::F16,
        "the product itself converts"
    );
    // The saved file reproduces the decisions, and explain gives the reason.
    let (ok, _, stderr) = ampgraph(&[
        "rewrite",
        &graph,
        "--amp",
        "--overrides",
        &keep,
        "-o",
        &out2,
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::read_to_string(&out1).unwrap(),
        std::fs::read_to_string(&out2).unwrap()
    );
    let (ok, stdout, stderr) = ampgraph(&["explain", &graph, "big", "--overrides", &keep]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("kept in f32: observed |x| up to"),
        "{stdout}"
    );
    // Without --amp, or with a bad sample count: usage errors.
    let (ok, _, stderr) = ampgraph(&[
        "rewrite",
        &graph,
        "--passes",
        "cse",
        "--calibrate",
        "seed:2",
    ]);
    assert!(!ok && stderr.contains("add --amp"), "{stderr}");
    let (ok, _, stderr) = ampgraph(&["rewrite", &graph, "--amp", "--calibrate", "seed:0"]);
    assert!(!ok && stderr.contains("seed:N"), "{stderr}");
    // One sample from --feeds JSON (w seeded): small inputs keep the product in
    // range, so only the constants (1e5 beyond f16's range, 1e-5 below its normal
    // range) and their readers stay in f32.
    let feeds = serde_json::json!({ "x": vec![vec![1e-3; 8]; 4] }).to_string();
    let (ok, stdout, stderr) = ampgraph(&[
        "rewrite",
        &graph,
        "--amp",
        "--calibrate",
        &feeds,
        "--report",
        "-o",
        &out2,
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("Calibration: 1 sample(s)"), "{stdout}");
    assert!(
        stdout.contains("  up: observed |x| up to 1.0e5"),
        "{stdout}"
    );
    assert!(stdout.contains("  big: its input 'up' has"), "{stdout}");
    assert!(
        stdout.contains("  back: its input 'down' has observed |x| at most 1.0e-5"),
        "{stdout}"
    );
}

/// `x (4x16) -> MatMul(w1) -> Relu -> MatMul(w2) -> Relu -> MatMul(w3) -> y` with
/// weights of 1e-4, 1e-6 and 1e4: the first hidden values are f16-normal (~1e-4), the
/// second (~1e-10) round to zero in f16, as an untrained network's activations do
/// layer after layer, and the outputs (~1e-6) are those zeros' products.
fn tiny_logits_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 16]).unwrap();
    let weight = |g: &mut Graph, name: &str, seed: u64, scale: f64| -> Port {
        let ty = ampgraph::graph::TensorType::new(DType::F32, vec![16, 16]);
        let t = ampgraph::exec::feeds::seeded_tensor(name, &ty, seed);
        let scaled: Vec<f64> = t.to_f64_vec().iter().map(|v| v * scale).collect();
        let t = Tensor::from_f64(DType::F32, vec![16, 16], &scaled).unwrap();
        g.add_node(name, Box::new(Const::new(t)), &[])
            .unwrap()
            .into()
    };
    let w1 = weight(&mut g, "w1", 1, 1e-4);
    let w2 = weight(&mut g, "w2", 2, 1e-6);
    let w3 = weight(&mut g, "w3", 3, 1e4);
    let h = g.matmul(x, w1).unwrap();
    let h = g.relu(h).unwrap();
    let h = g.matmul(h, w2).unwrap();
    let h = g.relu(h).unwrap();
    let y = g.matmul(h, w3).unwrap();
    g.set_outputs(vec![y]).unwrap();
    g
}

/// Outputs below f16's normal range come out of AMP as zeros (and are reported as
/// underflowing); calibration keeps them in f32, where they match f32's.
#[test]
fn outputs_below_the_normal_range_underflow_unless_calibration_keeps_them_wide() {
    let g32 = tiny_logits_graph();
    let feeds = samples(&g32, 2);
    let f16 = || AmpConfig::new(DType::F16).unwrap();
    let wide32 = ampgraph::numerics::calibrate::outputs_on(&g32, &feeds).unwrap();
    let mut plain = g32.clone();
    AutoMixedPrecision::new(f16()).rewrite(&mut plain).unwrap();
    let found = ampgraph::numerics::calibrate::underflows(&wide32, &plain, &feeds).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].lost * 2 > found[0].nonzero, "{:?}", found[0]);
    assert!(found[0].max_abs < F16_MIN_NORMAL, "{:?}", found[0]);

    let mut config = f16();
    let kept = calibrate(&g32, &feeds)
        .unwrap()
        .apply(&mut config, DEFAULT_MARGIN);
    let output = g32.node(g32.outputs()[0].node).name.clone();
    assert!(kept.iter().any(|(n, _)| *n == output), "{kept:?}");
    let mut wide = g32.clone();
    AutoMixedPrecision::new(config).rewrite(&mut wide).unwrap();
    let found = ampgraph::numerics::calibrate::underflows(&wide32, &wide, &feeds).unwrap();
    assert!(found.is_empty(), "{found:?}");
    let mut exec = CpuExecutor::new();
    for f in &feeds {
        let want = exec.run(&g32, f, g32.outputs()).unwrap();
        let got = exec.run(&wide, f, wide.outputs()).unwrap();
        let (w, o) = (want[0].to_f64_vec(), got[0].to_f64_vec());
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = w
            .iter()
            .zip(&o)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-2 * scale, "error {err:e} of {scale:e}");
    }
}

/// `rewrite --calibrate` warns of an output that underflows where no tensor is out
/// of f16's range: `(x @ w + 1) - 1` with products below 4.9e-4 (half of f16's
/// epsilon) cancels to 0 in f16.
#[test]
fn cli_rewrite_calibrate_warns_of_an_output_that_underflows() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 8]).unwrap();
    let small = Tensor::from_f64(DType::F32, vec![8, 8], &[1e-4; 64]).unwrap();
    let w: Port = g
        .add_node("w", Box::new(Const::new(small)), &[])
        .unwrap()
        .into();
    let one = Tensor::from_f64(DType::F32, vec![], &[1.0]).unwrap();
    let one: Port = g
        .add_node("one", Box::new(Const::new(one)), &[])
        .unwrap()
        .into();
    let mm = g.matmul(x, w).unwrap();
    let shifted: Port = (g.add_node(
        "shifted",
        Box::new(Binary::new(BinaryKind::Add)),
        &[mm, one],
    ))
    .unwrap()
    .into();
    let back: Port = (g.add_node(
        "back",
        Box::new(Binary::new(BinaryKind::Sub)),
        &[shifted, one],
    ))
    .unwrap()
    .into();
    g.set_outputs(vec![back]).unwrap();
    let dir = Scratch::new("underflow");
    let graph = dir.path("g.json");
    std::fs::write(&graph, to_json(&GraphDef::from_graph(&g))).unwrap();
    let out = dir.path("out.json");
    let (ok, stdout, stderr) = ampgraph(&[
        "rewrite",
        &graph,
        "--amp",
        "--calibrate",
        "seed:1",
        "--report",
        "-o",
        &out,
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("output 'back' underflows: ")
            && stderr.contains("are 0 after mixed precision"),
        "{stderr}"
    );
    assert!(
        stdout.contains("Warning: output 'back' underflows"),
        "{stdout}"
    );
}
