//! Every verb takes `.onnx` (dump, explain, rewrite, run, convert, plan); bad ONNX
//! input of every kind exits with status 2 and one line naming the file, node or
//! tensor and the problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ampgraph::onnx::{import_file, ImportOptions};

const BIN: &str = env!("CARGO_BIN_EXE_ampgraph");

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/onnx")
        .join(rel)
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("onnx_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn ampgraph(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The one error line of a failed run.
fn error_line(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(2),
        "stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn bad_models_are_one_line_errors_naming_the_problem() {
    let cases: &[(&str, &[&str])] = &[
        ("empty.onnx", &["empty.onnx", "the file is empty"]),
        (
            "truncated.onnx",
            &["truncated.onnx", "not a valid ONNX model"],
        ),
        (
            "not_protobuf.onnx",
            &["not_protobuf.onnx", "not a valid ONNX model"],
        ),
        (
            "unknown_domain.onnx",
            &["'fancy'", "domain 'com.example.custom'"],
        ),
        (
            "missing_external.onnx",
            &["tensor 'w'", "missing_weights.bin"],
        ),
        (
            "external_escape.onnx",
            &["tensor 'w'", "inside the model's folder"],
        ),
        ("size_mismatch.onnx", &["tensor 'w'", "8 bytes", "need 64"]),
        (
            "huge_dims.onnx",
            &["tensor 'w'", "more elements than can be addressed"],
        ),
        // 80 bytes asking for 4 TiB (at import: the abort of issue 46).
        (
            "constant_of_shape_huge.onnx",
            &[
                "node 'y' (ConstantOfShape)",
                "f32[1048576, 1048576]",
                "can still allocate",
            ],
        ),
        ("cycle.onnx", &["cycle", "node_a -> node_b -> node_a"]),
        (
            "dangling.onnx",
            &["'add'", "input 'nowhere' is produced by no node"],
        ),
        (
            "if_on_data.onnx",
            &[
                "'data_check'",
                "condition 'positive' is computed at run time",
            ],
        ),
        (
            "cubic_on_input.onnx",
            &[
                "'upsample'",
                "mode cubic is supported on values known at import",
                "input 0 ('x') is computed at run time",
            ],
        ),
        (
            "unknown_attribute.onnx",
            &["'act'", "attribute 'alpha' is not read at opset 13"],
        ),
        (
            "declared_shape.onnx",
            &["graph output 'y' is declared with shape [2, 4] but computes [2, 3]"],
        ),
        (
            "unsupported_ops.onnx",
            &[
                "unsupported ONNX ops (4 nodes)",
                "Hardmax x2",
                "NonZero x1",
                "TopK x1",
            ],
        ),
    ];
    let listed: Vec<String> = std::fs::read_dir(data("bad"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        listed.len(),
        cases.len(),
        "every file in bad/ has a case: {listed:?}"
    );
    let to_onnx = scratch("bad_rewritten.onnx");
    for (file, expect) in cases {
        let model = data("bad").join(file);
        // `-o X.onnx` reads the model for probing its symbolic dims too.
        for verb in [
            &["dump"][..],
            &["run", "--device", "cpu"],
            &["rewrite", "--amp"],
            &["rewrite", "--amp", "-o", path(&to_onnx)],
        ] {
            let mut args = verb.to_vec();
            args.push(path(&model));
            let line = error_line(&ampgraph(&args));
            for e in *expect {
                assert!(line.contains(e), "{file} ({verb:?}): '{e}' not in {line}");
            }
        }
    }
}

#[test]
fn symbolic_dims_need_an_input_shape() {
    let model = data("resnet_tiny/model.onnx");
    let line = error_line(&ampgraph(&["dump", path(&model)]));
    assert!(
        line.contains("input 'input'")
            && line.contains("symbolic ('batch_size')")
            && line.contains("--input input="),
        "{line}"
    );
    let line = error_line(&ampgraph(&[
        "dump",
        path(&model),
        "--input",
        "image=1x3x32x32",
    ]));
    assert!(
        line.contains("'image'") && line.contains("not an input"),
        "{line}"
    );
    let line = error_line(&ampgraph(&["dump", path(&model), "--input", "input=1x3xz"]));
    assert!(line.contains("expected NAME=DxDx"), "{line}");
    let text = stdout(&ampgraph(&[
        "dump",
        path(&model),
        "--input",
        "input=2x3x32x32",
    ]));
    assert!(
        text.contains("Placeholder") && text.contains("[2, 3, 32, 32]"),
        "{text}"
    );
}

#[test]
fn run_explain_and_plan_read_onnx() {
    let model = data("mobilenet_v3_style/model.onnx");
    let shape = "x=1x3x32x32";
    let out = stdout(&ampgraph(&[
        "run",
        path(&model),
        "--input",
        shape,
        "--device",
        "cpu",
    ]));
    assert!(out.contains("logits"), "{out}");
    let g = import_file(
        &model,
        &ImportOptions {
            input_shapes: [("x".to_string(), vec![1, 3, 32, 32])].into(),
            ..ImportOptions::default()
        },
    )
    .unwrap();
    // A convolution: allowlisted; AveragePool: infer, next to 16-bit neighbours.
    let conv = g
        .node_ids()
        .map(|id| g.node(id))
        .find(|n| n.op.name() == "Conv2D")
        .unwrap()
        .name
        .clone();
    let e = stdout(&ampgraph(&[
        "explain",
        path(&model),
        &conv,
        "--input",
        shape,
    ]));
    assert!(
        e.contains("(Conv2D): f16") && e.contains("list: allow"),
        "{e}"
    );
    let plan = stdout(&ampgraph(&["plan", path(&model), "--input", shape]));
    assert!(plan.contains("planned peak"), "{plan}");
}

#[test]
fn rewrite_and_convert_write_onnx_that_reads_back() {
    let model = data("transformer_tiny/model.onnx");
    let fp16 = scratch("transformer_fp16.onnx");
    let out = ampgraph(&[
        "rewrite",
        path(&model),
        "--amp",
        "--report",
        "-o",
        path(&fp16),
    ]);
    let report = stdout(&out);
    assert!(
        report.contains("Automatic Mixed Precision Grappler Pass Summary"),
        "{report}"
    );
    // Written whole: nothing beside it but the model.
    let g = import_file(&fp16, &ImportOptions::default()).unwrap();
    let outs: Vec<_> = g
        .outputs()
        .iter()
        .map(|&p| (g.port_name(p), g.ty(p).dtype))
        .collect();
    assert_eq!(
        outs,
        [
            ("out".to_string(), ampgraph::DType::F32),
            ("pooled".to_string(), ampgraph::DType::F32)
        ]
    );
    assert!(g.node_ids().any(|id| g
        .node(id)
        .outputs()
        .first()
        .is_some_and(|t| t.dtype == ampgraph::DType::F16)));
    // 16-bit I/O: the inputs and outputs take the rewritten graph's type.
    let half = scratch("transformer_half_io.onnx");
    stdout(&ampgraph(&[
        "rewrite",
        path(&model),
        "--amp",
        "--half-io",
        "-o",
        path(&half),
    ]));
    let g = import_file(&half, &ImportOptions::default()).unwrap();
    for &p in g.outputs() {
        assert_eq!(g.ty(p).dtype, ampgraph::DType::F16, "{}", g.port_name(p));
    }
    // convert: ONNX -> JSON -> ONNX keeps the function.
    let json = scratch("transformer.json");
    stdout(&ampgraph(&["convert", path(&model), "-o", path(&json)]));
    let back = scratch("transformer_back.onnx");
    stdout(&ampgraph(&["convert", path(&json), "-o", path(&back)]));
    let a = stdout(&ampgraph(&[
        "run",
        path(&model),
        "--device",
        "cpu",
        "--json",
    ]));
    let b = stdout(&ampgraph(&[
        "run",
        path(&back),
        "--device",
        "cpu",
        "--json",
    ]));
    assert_eq!(a, b);
    let line = error_line(&ampgraph(&[
        "convert",
        path(&model),
        "-o",
        path(&scratch("x.txt")),
    ]));
    assert!(line.contains(".json, .bin or .onnx"), "{line}");
}

/// A graph with Variables and a loss converts to ONNX (ONNX has no variables: they
/// become initializers holding their initial values, as a session with seed 0 gives
/// them; the loss becomes SoftmaxCrossEntropyLoss), and the ONNX model computes what a
/// session of the graph computes on the same inputs.
#[test]
fn a_graph_with_variables_and_a_loss_converts_to_onnx_that_runs_the_same() {
    use ampgraph::exec::feeds::seeded_tensor;
    use ampgraph::{Device, Session};
    let graph = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/graphs/mlp.json");
    let onnx = std::env::temp_dir().join(format!("ampgraph-mlp-{}.onnx", std::process::id()));
    let converted = ampgraph(&["convert", path(&graph), "-o", path(&onnx)]);
    assert!(converted.status.success(), "{converted:?}");
    // The graph in a session (Variables initialized, seed 0), fed as `run` feeds.
    let g = ampgraph::graph::format::load(path(&graph)).unwrap();
    let mut feeds = ampgraph::exec::Feeds::new();
    for name in ["x", "labels"] {
        let ty = g.node(g.require(name).unwrap()).outputs()[0].clone();
        feeds.insert(name.to_string(), seeded_tensor(name, &ty, 0));
    }
    let outputs = g.outputs().to_vec();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let want: Vec<f64> = (session.run(&outputs, &feeds).unwrap().iter())
        .flat_map(|t| t.to_f64_vec())
        .collect();
    let out = stdout(&ampgraph(&[
        "run",
        path(&onnx),
        "--device",
        "cpu",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let got: Vec<f64> = (v["outputs"].as_array().unwrap().iter())
        .flat_map(|o| o["values"].as_array().unwrap().clone())
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(want.len(), got.len());
    let worst = (want.iter().zip(&got)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-6, "largest difference {worst}");
    std::fs::remove_file(onnx).unwrap();
}

/// `rewrite -o x.onnx` of a model imported at one batch keeps its batch symbolic;
/// a symbolic dim that a constant computed at import fixes (positions from the
/// sequence length) stays at its value, with a warning naming that node.
#[test]
fn rewrite_to_onnx_keeps_symbolic_dims_or_says_which_node_fixes_one() {
    use ampgraph::onnx::proto::{DimensionValue, ModelProto};
    use prost::Message;
    let fp16 = scratch("positions_fp16.onnx");
    let out = ampgraph(&[
        "rewrite",
        path(&data("positions/model.onnx")),
        "--input",
        "ids=2x6",
        "--amp",
        "-o",
        path(&fp16),
    ]);
    stdout(&out);
    let warning = String::from_utf8_lossy(&out.stderr);
    assert!(
        warning.contains(
            "the symbolic dim 'seq' stays 6: node '/embed/Add/const' is a constant computed from seq"
        ),
        "{warning}"
    );
    let model = ModelProto::decode(std::fs::read(&fp16).unwrap().as_slice()).unwrap();
    let graph = model.graph.unwrap();
    let dims = |v: &ampgraph::onnx::proto::ValueInfoProto| -> Vec<String> {
        let shape = v.r#type.as_ref().unwrap().tensor_type.as_ref().unwrap();
        (shape.shape.as_ref().unwrap().dim.iter())
            .map(|d| match &d.value {
                Some(DimensionValue::DimValue(n)) => n.to_string(),
                Some(DimensionValue::DimParam(p)) => p.clone(),
                None => "?".into(),
            })
            .collect()
    };
    assert_eq!(dims(&graph.input[0]), ["batch", "6"]);
    assert_eq!(dims(&graph.output[0]), ["batch", "6", "4"]);
}
