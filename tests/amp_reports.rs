//! Lists, overrides, the summary, `explain` and the before/after dumps of the AMP pass.

use ampgraph::graph::format;
use ampgraph::passes::amp::report::explain;
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, ListClass, PrecisionLists};
use ampgraph::passes::PassError;
use ampgraph::{DType, Graph, Port, Tensor};

/// x, w -> MatMul -> Relu -> Add(., exp(y)) -> Tanh -> MatMul -> out
///                 y -> Exp -^
fn sample() -> Graph {
    let json = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
        {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [4, 4]}},
        {"name": "y", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [4, 4]}},
        {"name": "w", "op": "Variable", "attrs": {"dtype": "f32", "shape": [4, 4]}},
        {"name": "c", "op": "Const", "attrs": {"dtype": "f32", "shape": [4, 4]}},
        {"name": "mm", "op": "MatMul", "inputs": ["x", "w"]},
        {"name": "relu", "op": "Relu", "inputs": ["mm"]},
        {"name": "exp", "op": "Exp", "inputs": ["y"]},
        {"name": "add", "op": "Add", "inputs": ["relu", "exp"]},
        {"name": "tanh", "op": "Tanh", "inputs": ["add"]},
        {"name": "mm2", "op": "MatMul", "inputs": ["tanh", "c"]},
        {"name": "sq", "op": "Square", "inputs": ["mm2"]},
        {"name": "out", "op": "Identity", "inputs": ["sq"]}
    ], "outputs": ["out"]}"#;
    format::graph_from_bytes(json.as_bytes()).unwrap()
}

fn tf() -> AmpConfig {
    AmpConfig::with_profile(DType::F16, "tensorflow").unwrap()
}

fn dtype(g: &Graph, name: &str) -> DType {
    g.node(g.require(name).unwrap()).outputs()[0].dtype
}

#[test]
fn decisions_follow_the_lists() {
    let mut g = sample();
    let report = AutoMixedPrecision::new(tf()).rewrite(&mut g).unwrap();
    // Allow ops convert; Exp (deny) blocks Add and Tanh downstream; Relu between
    // MatMul and the blocked Add stays with MatMul; Square is in no list.
    for (name, want) in [
        ("mm", DType::F16),
        ("relu", DType::F16),
        ("exp", DType::F32),
        ("add", DType::F32),
        ("tanh", DType::F32),
        ("mm2", DType::F16),
        ("sq", DType::F32),
        ("out", DType::F32),
        ("w", DType::F32),
    ] {
        assert_eq!(dtype(&g, name), want, "{name}");
    }
    // The Variable is cast per use; the Const feeding only f16 is stored in f16.
    assert_eq!(dtype(&g, "c"), DType::F16);
    assert_eq!(report.stats.variable_casts, 1);
    assert_eq!(report.stats.consts_folded, 1);
    // Casts to f16: x for mm, tanh for mm2. Back to f32: relu for add, mm2 for sq.
    assert_eq!(report.stats.casts_to_half, 2);
    assert_eq!(report.stats.casts_to_f32, 2);
    assert_eq!(report.stats.nodes_converted, 3);
    let summary = report.summary().to_string();
    for line in [
        "Automatic Mixed Precision Grappler Pass Summary:",
        "Total nodes converted: 3",
        "Total FP16 Cast ops used (excluding Const and Variable casts): 2",
        "Allowlisted nodes converted: 2",
        "Denylisted nodes blocking conversion: 1",
        "Nodes blocked from conversion by denylisted nodes: 2",
    ] {
        assert!(summary.contains(line), "missing '{line}' in\n{summary}");
    }
    let detailed = report.detailed();
    assert!(detailed.contains("MatMul"), "{detailed}");
    // Per denylisted op: Exp's one node, and the Add and Tanh it blocked.
    assert_eq!(report.per_deny_op.len(), 1, "{:?}", report.per_deny_op);
    let exp = &report.per_deny_op["Exp"];
    assert_eq!((exp.nodes, exp.blocked), (1, 2));
    assert!(
        detailed.contains("Kept in f32 by denylisted ops:"),
        "{detailed}"
    );
    let row = detailed
        .lines()
        .find(|l| l.starts_with("Exp ") && l.split_whitespace().count() == 3);
    assert_eq!(
        row.map(|l| l.split_whitespace().collect::<Vec<_>>()),
        Some(vec!["Exp", "1", "2"]),
        "{detailed}"
    );
}

#[test]
fn explain_names_the_deny_node_and_path() {
    let g = sample();
    let amp = AutoMixedPrecision::new(tf());
    let p = amp.analyze(&g).unwrap();
    let e = explain(&g, &p, &amp.config, "tanh").unwrap();
    assert_eq!(e.dtype, DType::F32);
    assert_eq!(e.class, Some(ListClass::Infer));
    let text = e.to_string();
    assert!(
        text.contains("blocked by denylisted node 'exp' (Exp) along exp -> add -> tanh"),
        "{text}"
    );
    let e = explain(&g, &p, &amp.config, "relu").unwrap();
    assert_eq!(e.dtype, DType::F16);
    assert!(
        e.to_string().contains("clear op next to 'mm' (MatMul)"),
        "{e}"
    );
    let e = explain(&g, &p, &amp.config, "sq").unwrap();
    assert!(e.to_string().contains("Square is in no list"), "{e}");
    let e = explain(&g, &p, &amp.config, "out").unwrap();
    assert!(e.to_string().contains("graph output"), "{e}");
    let e = explain(&g, &p, &amp.config, "mm").unwrap();
    assert!(e.to_string().contains("allowlisted"), "{e}");
    assert!(matches!(
        explain(&g, &p, &amp.config, "nope"),
        Err(PassError::Graph(_))
    ));
}

#[test]
fn environment_overrides_move_ops_between_lists() {
    let mut config = tf();
    let vars = |k: &str| match k {
        "AMPGRAPH_AMP_DENYLIST_REMOVE" => Some("Exp".to_string()),
        "AMPGRAPH_AMP_INFERLIST_ADD" => Some("Exp, Square".to_string()),
        _ => None,
    };
    config.apply_vars(vars).unwrap();
    assert_eq!(config.lists.class("Exp"), Some(ListClass::Infer));
    assert_eq!(config.lists.class("Square"), Some(ListClass::Infer));
    let mut g = sample();
    AutoMixedPrecision::new(config).rewrite(&mut g).unwrap();
    // Exp no longer blocks: Add follows its f16 input, Square follows mm2.
    assert_eq!(dtype(&g, "add"), DType::F16);
    assert_eq!(dtype(&g, "sq"), DType::F16);

    let mut config = tf();
    let err = config
        .apply_vars(|k| (k == "AMPGRAPH_AMP_ALLOWLIST_ADD").then(|| "Conv3D".to_string()))
        .unwrap_err();
    assert!(
        err.to_string().contains("AMPGRAPH_AMP_ALLOWLIST_ADD")
            && err.to_string().contains("Conv3D"),
        "{err}"
    );
}

#[test]
fn list_files_are_checked() {
    let err = PrecisionLists::from_toml("[lists]\nallow = [\"MatMul\", \"FooBar\"]\n", "my.toml")
        .unwrap_err();
    assert!(
        err.to_string().contains("my.toml: unknown op 'FooBar'"),
        "{err}"
    );
    let err = PrecisionLists::from_toml(
        "[lists]\nallow = [\"MatMul\"]\ndeny = [\"MatMul\"]\n",
        "x.toml",
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("both the allow and the deny list"),
        "{err}"
    );
    let err = PrecisionLists::from_toml("[lists]\nallowed = []\n", "x.toml").unwrap_err();
    assert!(err.to_string().contains("allowed"), "{err}");
    assert!(PrecisionLists::profile("nope").is_err());
    let tensorflow_allow = [
        "BatchMatMul",
        "Conv2D",
        "Conv2DBackpropFilter",
        "Conv2DBackpropInput",
        "MatMul",
    ];
    for profile in ["default_fp16", "default_bf16", "tensorflow"] {
        let lists = PrecisionLists::profile(profile).unwrap();
        let mut want = tensorflow_allow.to_vec();
        // Ours also allow the fused product (TensorFlow forms its own after AMP).
        if profile != "tensorflow" {
            want.insert(4, "FusedMatMul");
        }
        assert_eq!(lists.ops(ListClass::Allow), want, "{profile}");
    }
    assert!(AmpConfig::new(DType::F32).is_err());
}

#[test]
fn bf16_target_uses_bf16_casts() {
    let mut g = sample();
    let report = AutoMixedPrecision::new(AmpConfig::new(DType::BF16).unwrap())
        .rewrite(&mut g)
        .unwrap();
    assert_eq!(dtype(&g, "mm"), DType::BF16);
    // In the bf16 lists Exp is infer: everything between the MatMuls converts.
    assert_eq!(dtype(&g, "tanh"), DType::BF16);
    assert!(report
        .summary()
        .to_string()
        .contains("Total BF16 Cast ops used"));
    g.validate().unwrap();
}

#[test]
fn log_path_dumps_before_and_after() {
    let dir = std::env::temp_dir().join(format!("ampgraph_dump_test_{}", std::process::id()));
    let mut config = tf();
    config
        .apply_vars(|k| (k == "AMPGRAPH_AMP_LOG_PATH").then(|| dir.display().to_string()))
        .unwrap();
    let mut g = sample();
    AutoMixedPrecision::new(config).rewrite(&mut g).unwrap();
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for suffix in ["_before.json", "_after.json", "_before.dot", "_after.dot"] {
        assert!(
            files.iter().any(|f| f.ends_with(suffix)),
            "no *{suffix} in {files:?}"
        );
    }
    // SVG too, where Graphviz is installed.
    if std::process::Command::new("dot").arg("-V").output().is_ok() {
        assert!(
            files.iter().any(|f| f.ends_with("_after.svg")),
            "no SVG in {files:?}"
        );
    }
    let after = files.iter().find(|f| f.ends_with("_after.dot")).unwrap();
    let dot = std::fs::read_to_string(dir.join(after)).unwrap();
    // f16 green, blocked red, casts yellow.
    for color in ["#9be39b", "#f4a7a7", "#ffe08a"] {
        assert!(dot.contains(color), "{color} missing from\n{dot}");
    }
    let after_json = files.iter().find(|f| f.ends_with("_after.json")).unwrap();
    let reloaded = format::load(dir.join(after_json).to_str().unwrap()).unwrap();
    assert_eq!(dtype(&reloaded, "mm"), DType::F16);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nodes_kept_in_f32_by_name_are_denied_and_explained() {
    let mut config = tf();
    config
        .lists
        .keep_f32("mm2", "observed |x| up to 1.2e5, beyond f16's range");
    let g = sample();
    let amp = AutoMixedPrecision::new(config.clone());
    let p = amp.analyze(&g).unwrap();
    let e = explain(&g, &p, &amp.config, "mm2").unwrap();
    assert!(
        e.to_string()
            .contains("kept in f32: observed |x| up to 1.2e5, beyond f16's range"),
        "{e}"
    );
    let mut rewritten = sample();
    amp.rewrite(&mut rewritten).unwrap();
    // mm2 is f32 now, mm still converts; the others as in decisions_follow_the_lists.
    assert_eq!(dtype(&rewritten, "mm2"), DType::F32);
    assert_eq!(dtype(&rewritten, "mm"), DType::F16);
    // A list file carries them too.
    let text = r#"
        [lists]
        allow = ["MatMul"]
        [keep_f32]
        "mm" = "bisection: 3e-2 of the error"
    "#;
    let lists = PrecisionLists::from_toml(text, "test").unwrap();
    assert_eq!(lists.kept_f32("mm"), Some("bisection: 3e-2 of the error"));
    let mut g = sample();
    AutoMixedPrecision::new(AmpConfig { lists, ..tf() })
        .rewrite(&mut g)
        .unwrap();
    assert_eq!(dtype(&g, "mm"), DType::F32);
}

/// An infer op whose input goes f16 only in a later phase (a Reshape after a MatMul,
/// clear next to it) stays f32, as in TensorFlow; `explain` says so rather than "no
/// input runs in f16" above an input list showing an f16 input.
#[test]
fn explain_an_infer_op_whose_input_went_half_in_a_later_phase() {
    let json = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
        {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2, 4, 8]}},
        {"name": "w", "op": "Const", "attrs": {"dtype": "f32", "shape": [8, 8]}},
        {"name": "b", "op": "Const", "attrs": {"dtype": "f32", "shape": [8]}},
        {"name": "flat", "op": "Reshape", "inputs": ["x"], "attrs": {"shape": [8, 8]}},
        {"name": "mm", "op": "MatMul", "inputs": ["flat", "w"]},
        {"name": "back", "op": "Reshape", "inputs": ["mm"], "attrs": {"shape": [2, 4, 8]}},
        {"name": "add", "op": "Add", "inputs": ["back", "b"]},
        {"name": "out", "op": "Identity", "inputs": ["add"]}
    ], "outputs": ["out"]}"#;
    let g = format::graph_from_bytes(json.as_bytes()).unwrap();
    let amp = AutoMixedPrecision::new(tf());
    let p = amp.analyze(&g).unwrap();
    let e = explain(&g, &p, &amp.config, "add").unwrap();
    assert_eq!(e.dtype, DType::F32);
    let text = e.to_string();
    assert!(
        text.contains(
            "its input 'back' (Reshape) went f16 afterwards, as a clear op next to 'mm' (MatMul)"
        ),
        "{text}"
    );
    assert!(text.contains("inputs: back (f16), b (f32)"), "{text}");
    assert!(!text.contains("no input runs in"), "{text}");
}

/// Exporters' transformer input: token and position rows looked up in tables, added
/// and normalised, read by the first product and by the first residual Add.
struct Embeddings {
    g: Graph,
    tables: [Port; 2],
    /// The two lookups, their sum and its LayerNorm.
    computed: [Port; 4],
}

fn embeddings(token_table_is_variable: bool) -> Embeddings {
    use ampgraph::exec::feeds::seeded_tensor;
    use ampgraph::graph::ops::{Binary, BinaryKind, Unary, UnaryKind};
    use ampgraph::TensorType;
    let mut g = Graph::new();
    let seeded = |g: &mut Graph, name: &str, shape: Vec<usize>| -> Port {
        let t = seeded_tensor(name, &TensorType::new(DType::F32, shape), 7);
        g.constant(t).unwrap()
    };
    let ids = g.placeholder("ids", DType::I64, [3]).unwrap();
    let table = if token_table_is_variable {
        g.variable("table", DType::F32, [10, 4]).unwrap()
    } else {
        seeded(&mut g, "table", vec![10, 4])
    };
    let positions = seeded(&mut g, "positions", vec![3, 4]);
    let gamma = seeded(&mut g, "gamma", vec![4]);
    let beta = seeded(&mut g, "beta", vec![4]);
    let w = seeded(&mut g, "w", vec![4, 4]);
    let position_ids = Tensor::from_f64(DType::I64, vec![3], &[0.0, 1.0, 2.0]).unwrap();
    let position_ids = g.constant(position_ids).unwrap();
    let token = g.gather(table, ids, 0).unwrap();
    let position = g.gather(positions, position_ids, 0).unwrap();
    let add = |g: &mut Graph, name: &str, a: Port, b: Port| -> Port {
        (g.add_node(name, Box::new(Binary::new(BinaryKind::Add)), &[a, b]))
            .unwrap()
            .into()
    };
    let sum = add(&mut g, "embed", token, position);
    let normed = g.layer_norm(sum, gamma, beta, -1, 1e-5).unwrap();
    let product = g.matmul(normed, w).unwrap();
    let residual = add(&mut g, "residual", product, sum);
    // A graph output keeps its type: the residual Add before it is an f16 reader.
    let out = g.add(Unary::new(UnaryKind::Identity), &[residual]).unwrap();
    g.set_outputs(vec![out]).unwrap();
    Embeddings {
        g,
        tables: [table, positions],
        computed: [token, position, sum, normed],
    }
}

/// With ampgraph's lists a computation on constants alone whose readers are all f16
/// runs in f16, its tables stored so: no cast where TensorFlow's painting casts the
/// sum and its LayerNorm (the converter's one cast for DistilBERT and GPT-2). Its
/// values stay within f16's rounding of the f32 graph's.
#[test]
fn a_computation_on_constants_read_only_in_f16_runs_in_f16() {
    use ampgraph::{CpuExecutor, Executor};
    let Embeddings {
        g: original,
        tables,
        computed,
    } = embeddings(false);
    let ours = AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap());
    let explained = explain(
        &original,
        &ours.analyze(&original).unwrap(),
        &ours.config,
        "embed",
    )
    .unwrap()
    .to_string();
    assert!(
        explained.contains("computed from constants alone and every reader runs in f16"),
        "{explained}"
    );
    let mut g = original.clone();
    let report = ours.rewrite(&mut g).unwrap();
    for port in computed.into_iter().chain(tables) {
        assert_eq!(g.ty(port).dtype, DType::F16, "{}", g.port_name(port));
    }
    assert_eq!(report.stats.casts_to_half, 0);
    assert_eq!(report.stats.casts_to_f32, 1, "the output's");

    let ids = Tensor::from_f64(DType::I64, vec![3], &[4.0, 9.0, 0.0]).unwrap();
    let feeds = [("ids".to_string(), ids)].into_iter().collect();
    let mut exec = CpuExecutor::new();
    let want = exec.run(&original, &feeds, original.outputs()).unwrap()[0].to_f64_vec();
    let got = exec.run(&g, &feeds, g.outputs()).unwrap()[0].to_f64_vec();
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = want
        .iter()
        .zip(&got)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        scale > 0.1 && err <= 5e-3 * scale,
        "error {err:e} of {scale:e}"
    );

    // TensorFlow's painting keeps them f32 and casts the sum and its LayerNorm.
    let mut g = original.clone();
    let report = AutoMixedPrecision::new(tf()).rewrite(&mut g).unwrap();
    for port in computed {
        assert_eq!(g.ty(port).dtype, DType::F32, "{}", g.port_name(port));
    }
    assert_eq!(report.stats.casts_to_half, 2);

    // A Variable is no constant (a trained table would be cast whole every step):
    // its lookup, and what reads it, stay f32.
    let Embeddings {
        mut g, computed, ..
    } = embeddings(true);
    ours.rewrite(&mut g).unwrap();
    for port in [computed[0], computed[2], computed[3]] {
        assert_eq!(g.ty(port).dtype, DType::F32, "{}", g.port_name(port));
    }
}
