//! Lists, overrides, the summary, `explain` and the before/after dumps of the AMP pass.

use ampgraph::graph::format;
use ampgraph::passes::amp::report::explain;
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, ListClass, PrecisionLists};
use ampgraph::passes::PassError;
use ampgraph::{DType, Graph};

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
