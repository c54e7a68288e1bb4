//! Happy paths of the `ampgraph` command line (docs/design.md §3), run on the built binary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use ampgraph::graph::format;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ampgraph");

/// x [2,3] @ w [3,4] -> Relu.
const MLP: &str = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
  {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2, 3]}},
  {"name": "w", "op": "Variable", "attrs": {"dtype": "f32", "shape": [3, 4]}},
  {"name": "mm", "op": "MatMul", "inputs": ["x", "w"], "attrs": {"transpose_a": false, "transpose_b": false}},
  {"name": "act", "op": "Relu", "inputs": ["mm"], "attrs": {"_tool": "kept"}}
], "outputs": ["act"]}"#;

/// A directory private to one test.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("ampgraph-cli-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    fn write(&self, name: &str, contents: &str) -> String {
        let p = self.0.join(name);
        std::fs::write(&p, contents).expect("write scratch file");
        p.to_str().expect("utf-8 path").to_string()
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().expect("utf-8 path").to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ampgraph_with_stdin(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ampgraph");
    if let Some(bytes) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(bytes)
            .expect("write stdin");
    }
    child.wait_with_output().expect("wait for ampgraph")
}

/// Runs the binary, asserts success and returns standard output.
fn ok(args: &[&str]) -> String {
    ok_stdin(args, None)
}

fn ok_stdin(args: &[&str], stdin: Option<&[u8]>) -> String {
    let out = ampgraph_with_stdin(args, stdin);
    assert!(
        out.status.success(),
        "ampgraph {} failed ({:?}): {}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The `outputs` list of `run --json`, as (name, shape, values).
fn run_outputs(stdout: &str) -> Vec<(String, Vec<u64>, Vec<f64>)> {
    let v: Value = serde_json::from_str(stdout).expect("run --json prints JSON");
    v["outputs"]
        .as_array()
        .expect("outputs list")
        .iter()
        .map(|o| {
            (
                o["name"].as_str().expect("name").to_string(),
                o["shape"]
                    .as_array()
                    .expect("shape")
                    .iter()
                    .map(|d| d.as_u64().expect("dim"))
                    .collect(),
                o["values"]
                    .as_array()
                    .expect("values")
                    .iter()
                    .map(|x| x.as_f64().expect("finite"))
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn dump_in_every_format() {
    let s = Scratch::new("dump");
    let g = s.write("mlp.json", MLP);

    let text = ok(&["dump", &g]);
    assert!(text.starts_with("graph: 4 nodes"), "{text}");
    assert!(text.contains("mm = MatMul(x, w)"), "{text}");
    assert!(text.contains("f32[2, 4]"), "{text}");
    assert!(text.contains("outputs: act"), "{text}");
    assert_eq!(ok(&["dump", &g, "--format", "text"]), text);

    let json = ok(&["dump", &g, "--format", "json"]);
    let def = format::parse_json(json.as_bytes()).expect("dump --format json parses");
    assert_eq!(def.nodes.len(), 4);
    assert_eq!(def.outputs, vec!["act".to_string()]);
    // Every node carries the inferred dtype; tool annotations survive.
    assert!(def.nodes.iter().all(|n| n.dtype.is_some()));
    assert!(json.contains(r#""_tool":"kept""#), "{json}");

    let dot = ok(&["dump", &g, "--format", "dot"]);
    assert!(dot.trim_start().starts_with("digraph"), "{dot}");
    assert!(
        dot.contains(r#""x" -> "mm""#) && dot.contains(r#""mm" -> "act""#),
        "{dot}"
    );
    assert!(dot.trim_end().ends_with('}'));

    // -o writes the file and nothing to stdout, for every format.
    for (fmt, name) in [
        ("text", "out.txt"),
        ("json", "out.json"),
        ("dot", "out.dot"),
        ("bin", "out.bin"),
    ] {
        let path = s.path(name);
        let stdout = ok(&["dump", &g, "--format", fmt, "-o", &path]);
        assert!(stdout.is_empty(), "dump -o {fmt} printed {stdout:?}");
        let bytes = read(&path);
        match fmt {
            "text" => assert_eq!(bytes, text.as_bytes()),
            "json" => assert_eq!(bytes, json.as_bytes()),
            "dot" => assert_eq!(bytes, dot.as_bytes()),
            _ => {
                assert!(
                    format::is_bin(&bytes),
                    "dump --format bin starts with the magic"
                );
                assert_eq!(format::from_bin(&bytes).expect("decodes"), def);
                // The .bin loads like the JSON and dumps to the same JSON text.
                assert_eq!(ok(&["dump", &path, "--format", "json"]), json);
            }
        }
    }
    // Binary to stdout is the same bytes.
    let out = ampgraph_with_stdin(&["dump", &g, "--format", "bin"], None);
    assert!(out.status.success());
    assert_eq!(out.stdout, read(&s.path("out.bin")));
}

#[test]
fn convert_json_bin_json_is_identical() {
    let s = Scratch::new("convert");
    let g = s.write("mlp.json", MLP);
    let (a_json, a_bin, b_json) = (s.path("a.json"), s.path("a.bin"), s.path("b.json"));
    ok(&["convert", &g, "-o", &a_json]);
    ok(&["convert", &a_json, "-o", &a_bin]);
    ok(&["convert", &a_bin, "-o", &b_json]);
    assert!(format::is_bin(&read(&a_bin)));
    assert_eq!(
        read(&a_json),
        read(&b_json),
        "JSON -> bin -> JSON changed the text"
    );
    // Straight from the hand-written file too.
    let (c_bin, c_json) = (s.path("c.bin"), s.path("c.json"));
    ok(&["convert", &g, "-o", &c_bin]);
    ok(&["convert", &c_bin, "-o", &c_json]);
    assert_eq!(read(&c_json), read(&a_json));
    assert_eq!(read(&c_bin), read(&a_bin));

    // A rewritten graph (casts, f16 dtypes) round-trips as well.
    let (r_json, r_bin, r2_json) = (s.path("r.json"), s.path("r.bin"), s.path("r2.json"));
    ok(&["rewrite", &g, "--amp", "-o", &r_json]);
    ok(&["convert", &r_json, "-o", &r_bin]);
    ok(&["convert", &r_bin, "-o", &r2_json]);
    assert_eq!(read(&r_json), read(&r2_json));
}

#[test]
fn run_json_gives_hand_computed_values() {
    let s = Scratch::new("run-values");
    let g = s.write("mlp.json", MLP);
    // Nested-list feeds for x, {"shape", "values"} feeds for w.
    let feeds = s.write(
        "feeds.json",
        r#"{"x": [[1, -2, 3], [-4, 5, -6]],
            "w": {"shape": [3, 4], "values": [1, 0, 0, 1,  0, 1, 0, -1,  0, 0, 1, 2]}}"#,
    );
    let out = run_outputs(&ok(&[
        "run", &g, "--device", "cpu", "--feeds", &feeds, "--json",
    ]));
    // x @ w = [[1, -2, 3, 9], [-4, 5, -6, -21]]; Relu keeps the positives.
    assert_eq!(
        out,
        vec![(
            "act".to_string(),
            vec![2, 4],
            vec![1.0, 0.0, 3.0, 9.0, 0.0, 5.0, 0.0, 0.0]
        )]
    );

    // Two outputs, one of them an output port of a node that is not the last.
    let g2 = s.write(
        "two.json",
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
          {"name": "a", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [3]}},
          {"name": "b", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [3]}},
          {"name": "s", "op": "Sub", "inputs": ["a", "b"]},
          {"name": "sq", "op": "Mul", "inputs": ["s", "s"]},
          {"name": "total", "op": "Sum", "inputs": ["sq"], "attrs": {"axes": [0], "keep_dims": false}}
        ], "outputs": ["total", "s"]}"#,
    );
    let feeds2 = s.write("feeds2.json", r#"{"a": [1.5, 2, -3], "b": [0.5, 4, 1]}"#);
    let out = run_outputs(&ok(&[
        "run", &g2, "--device", "cpu", "--feeds", &feeds2, "--json",
    ]));
    assert_eq!(
        out,
        vec![
            ("total".to_string(), vec![], vec![1.0 + 4.0 + 16.0]),
            ("s".to_string(), vec![3], vec![1.0, -2.0, -4.0]),
        ]
    );
    // The text form names each output and its type.
    let text = ok(&["run", &g2, "--device", "cpu", "--feeds", &feeds2]);
    assert!(
        text.contains("total: f32[]") || text.contains("total: f32"),
        "{text}"
    );
    assert!(text.contains("21.000000"), "{text}");
}

#[test]
fn run_seed_is_deterministic_and_keyed_by_name() {
    let s = Scratch::new("run-seed");
    let one = s.write(
        "one.json",
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
          {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [4, 5]}},
          {"name": "out", "op": "Identity", "inputs": ["x"]}
        ], "outputs": ["out"]}"#,
    );
    // A different graph: other nodes before it, x consumed differently.
    let two = s.write(
        "two.json",
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
          {"name": "a", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [7]}},
          {"name": "b", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [3, 3]}},
          {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [4, 5]}},
          {"name": "neg", "op": "Neg", "inputs": ["a"]},
          {"name": "x_out", "op": "Identity", "inputs": ["x"]}
        ], "outputs": ["neg", "x_out"]}"#,
    );
    let run = |g: &str, seed: &str| {
        run_outputs(&ok(&[
            "run", g, "--device", "cpu", "--seed", seed, "--json",
        ]))
    };
    let a = run(&one, "42");
    assert_eq!(a, run(&one, "42"), "same seed, same output");
    let c = run(&one, "43");
    assert_ne!(a[0].2, c[0].2, "another seed gives other values");
    assert_eq!(a[0].2.len(), 20);
    assert!(
        a[0].2.iter().all(|v| (-1.0..1.0).contains(v)),
        "{:?}",
        a[0].2
    );
    let b = run(&two, "42");
    assert_eq!(
        b[1].2, a[0].2,
        "the same placeholder name gets the same values in another graph"
    );
    // The default seed is fixed too.
    assert_eq!(
        ok(&["run", &one, "--device", "cpu", "--json"]),
        ok(&["run", &one, "--device", "cpu", "--json"])
    );
}

#[test]
fn dash_reads_json_from_stdin() {
    let s = Scratch::new("stdin");
    let g = s.write("mlp.json", MLP);
    assert_eq!(
        ok_stdin(&["dump", "-"], Some(MLP.as_bytes())),
        ok(&["dump", &g])
    );
    assert_eq!(
        ok_stdin(&["dump", "-", "--format", "json"], Some(MLP.as_bytes())),
        ok(&["dump", &g, "--format", "json"])
    );
    assert_eq!(
        ok_stdin(
            &["run", "-", "--device", "cpu", "--seed", "3", "--json"],
            Some(MLP.as_bytes())
        ),
        ok(&["run", &g, "--device", "cpu", "--seed", "3", "--json"])
    );
    assert_eq!(
        ok_stdin(&["rewrite", "-", "--amp"], Some(MLP.as_bytes())),
        ok(&["rewrite", &g, "--amp"])
    );
}

#[test]
fn rewrite_amp_writes_a_loadable_graph_with_casts() {
    let s = Scratch::new("rewrite");
    let g = s.write("mlp.json", MLP);
    let out = s.path("out.json");
    let stdout = ok(&["rewrite", &g, "--amp", "-o", &out]);
    assert!(
        stdout.is_empty(),
        "rewrite -o without --report prints nothing: {stdout:?}"
    );
    let rewritten = format::load(&out).expect("the rewritten graph loads");
    rewritten.validate().expect("and validates");
    let casts: Vec<_> = rewritten
        .node_ids()
        .filter(|&id| rewritten.node(id).op_name() == "Cast")
        .collect();
    assert!(!casts.is_empty(), "MatMul goes to f16 through Cast nodes");
    // Every original node keeps its name; MatMul is allowlisted and becomes f16.
    for name in ["x", "w", "mm", "act"] {
        assert!(rewritten.find(name).is_some(), "{name} kept");
    }
    let mm = rewritten.node(rewritten.find("mm").expect("mm"));
    assert_eq!(mm.outputs()[0].dtype, ampgraph::DType::F16);
    // Graph outputs keep their declared type.
    let act = rewritten.node(rewritten.find("act").expect("act"));
    assert_eq!(act.outputs()[0].dtype, ampgraph::DType::F32);
    // Every node carries a top-level dtype in the file.
    let def = format::parse_json(&read(&out)).expect("parses");
    assert!(def.nodes.iter().all(|n| n.dtype.is_some()));
    // The same graph goes to stdout without -o, and .bin output by extension.
    assert_eq!(
        ok(&["rewrite", &g, "--amp"]).as_bytes(),
        read(&out).as_slice()
    );
    let out_bin = s.path("out.bin");
    ok(&["rewrite", &g, "--amp", "-o", &out_bin]);
    assert_eq!(format::from_bin(&read(&out_bin)).expect("bin"), def);
    // The rewritten graph runs.
    let values = run_outputs(&ok(&["run", &out, "--device", "cpu", "--json"]));
    assert_eq!(values[0].1, vec![2, 4]);
    // --report with -o prints the summary.
    let report = ok(&["rewrite", &g, "--amp", "-o", &out, "--report"]);
    assert!(!report.is_empty());
}

#[test]
fn explain_prints_the_precision() {
    let s = Scratch::new("explain");
    let g = s.write("mlp.json", MLP);
    let mm = ok(&["explain", &g, "mm"]);
    assert!(mm.contains("'mm'") && mm.contains("MatMul"), "{mm}");
    assert!(mm.contains("f16"), "MatMul is converted: {mm}");
    let act = ok(&["explain", &g, "act"]);
    assert!(act.contains("'act'") && act.contains("f32"), "{act}");
    let bf16 = ok(&["explain", &g, "mm", "--dtype", "bf16"]);
    assert!(bf16.contains("bf16"), "{bf16}");
}

#[test]
fn rewrite_keeps_tool_annotations() {
    let s = Scratch::new("annotations");
    let g = s.write("mlp.json", MLP);
    let out = s.path("out.json");
    ok(&["rewrite", &g, "--amp", "-o", &out]);
    let text = String::from_utf8(read(&out)).expect("utf-8");
    assert!(text.contains(r#""_tool":"kept""#), "{text}");
    assert!(Path::new(&out).exists());
}

/// Relu(x) twice (a common subexpression) and a branch no output reads.
const REDUNDANT: &str = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
  {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2, 3]}},
  {"name": "a", "op": "Relu", "inputs": ["x"]},
  {"name": "b", "op": "Relu", "inputs": ["x"]},
  {"name": "sum", "op": "Add", "inputs": ["a", "b"]},
  {"name": "dead", "op": "Exp", "inputs": ["b"]}
], "outputs": ["sum"]}"#;

#[test]
fn rewrite_runs_simplification_passes_by_name() {
    let mlp = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/graphs/mlp.json");
    let rewritten =
        format::graph_from_bytes(ok(&["rewrite", mlp, "--passes", "cse,dce"]).as_bytes())
            .expect("the rewritten MLP loads");
    rewritten.validate().expect("and validates");
    // Nothing in the MLP is redundant or dead: every node stays.
    let original = format::load(mlp).expect("mlp.json loads");
    assert_eq!(rewritten.len(), original.len());

    let s = Scratch::new("simplify");
    let g = s.write("redundant.json", REDUNDANT);
    let out = s.path("out.json");
    let report = ok(&["rewrite", &g, "--passes", "cse,dce", "-o", &out, "--report"]);
    assert!(report.contains("cse: merged 1 nodes"), "{report}");
    assert!(report.contains("dce: removed 1 dead nodes"), "{report}");
    let simplified = format::load(&out).expect("the result loads");
    let mut names: Vec<_> = simplified
        .node_ids()
        .map(|id| simplified.node(id).name.clone())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "sum", "x"]);
}

#[test]
fn rewrite_rejects_an_unknown_pass_naming_it() {
    let mlp = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/graphs/mlp.json");
    let out = ampgraph_with_stdin(&["rewrite", mlp, "--passes", "cse,no-such-pass"], None);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(lines[0].contains("'no-such-pass'"), "{stderr}");
    assert!(
        lines[0].contains("cse") && lines[0].contains("fold-batchnorm"),
        "{stderr}"
    );
}

#[test]
fn rewrite_lists_every_registered_pass_once_with_its_summary() {
    use ampgraph::passes::registry;
    let listing = ok(&["rewrite", "--list-passes"]);
    let lines: Vec<&str> = listing.lines().collect();
    assert_eq!(lines.len(), registry::PASSES.len(), "{listing}");
    for entry in registry::PASSES {
        let rows: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.split_whitespace().next() == Some(entry.name))
            .collect();
        assert_eq!(rows.len(), 1, "`{}` in:\n{listing}", entry.name);
        let summary = rows[0][entry.name.len()..].trim();
        assert!(!summary.is_empty(), "`{}` has no summary", entry.name);
        assert_eq!(summary, entry.summary);
    }
    // The flag stands alone: with a graph it is a usage error.
    let mlp = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/graphs/mlp.json");
    let out = ampgraph_with_stdin(&["rewrite", mlp, "--list-passes"], None);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn rewrite_amp_then_fuse_runs_the_same() {
    let s = Scratch::new("fuse");
    let g = s.write("mlp.json", MLP);
    let (amp, fused) = (s.path("amp.json"), s.path("fused.json"));
    ok(&["rewrite", &g, "--amp", "-o", &amp]);
    let report = ok(&[
        "rewrite", &g, "--amp", "--passes", "fuse", "-o", &fused, "--report",
    ]);
    assert!(
        report.contains("Elementwise Fusion Pass Summary:"),
        "{report}"
    );
    assert!(report.contains("Groups fused: 1"), "{report}");
    let rewritten = format::load(&fused).expect("the fused graph loads");
    rewritten.validate().expect("and validates");
    assert!(rewritten
        .node_ids()
        .any(|id| rewritten.node(id).op_name() == "FusedElementwise"));
    let run = |path: &str| run_outputs(&ok(&["run", path, "--device", "cpu", "--json"]));
    let (want, got) = (run(&amp), run(&fused));
    assert_eq!(want.len(), got.len());
    for (w, o) in want.iter().zip(&got) {
        assert_eq!((&w.1, &w.2), (&o.1, &o.2));
    }
}

#[test]
fn plan_prints_the_peak_and_its_parts() {
    let s = Scratch::new("plan");
    let g = s.write("mlp.json", MLP);
    // x [2,3] and w [3,4] (one 256-byte aligned buffer each) beside the arena, where
    // mm and act [2,4] are alive together while act runs.
    let unfused = ok(&["plan", &g, "--passes", "none"]);
    for line in [
        "planned peak: 1024 bytes (0.0 MiB)",
        "arena: 512 bytes",
        "lower bound (most bytes alive at once): 512 bytes",
        "every tensor apart: 512 bytes",
        "variables (1 nodes): 256 bytes",
        "fed: 256 bytes",
        "constants: 0 bytes",
        "kept casts: 0 bytes",
        "written beside the old values: 0 bytes",
        "peak step: 3 (while 'act' (Relu) runs)",
        "alive at the peak, largest first:",
        "mm (MatMul) f32[2, 4]  steps 2..3",
        "act (Relu) f32[2, 4]  steps 3..4",
    ] {
        assert!(unfused.contains(line), "{line:?} missing from:\n{unfused}");
    }
    // A fetch of the product alone plans only it.
    let product = ok(&["plan", &g, "--passes", "none", "--fetch", "mm"]);
    assert!(product.contains("arena: 256 bytes"), "{product}");
    assert!(!product.contains("act (Relu)"), "{product}");
    // The CUDA pipeline by default: the fusions never plan more.
    let fused = ok(&["plan", &g, "--top", "1"]);
    let peak = |report: &str| -> u64 {
        let line = report.lines().next().expect("a first line");
        let bytes = line.strip_prefix("planned peak: ").expect("the peak first");
        bytes.split(' ').next().unwrap().parse().expect("bytes")
    };
    assert!(peak(&fused) <= peak(&unfused), "{fused}");
    assert_eq!(fused.lines().filter(|l| l.contains(" MiB  ")).count(), 1);
}

/// Runs the binary, asserts it failed with status 2, returns its one error line.
fn error_line(args: &[&str]) -> String {
    let out = ampgraph_with_stdin(args, None);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

#[test]
fn feeds_come_inline_or_from_a_file_and_only_for_sources_in_range() {
    let s = Scratch::new("feeds");
    let g = s.write("mlp.json", MLP);
    let inline = r#"{"x": [[1, -2, 3], [-4, 5, -6]], "w": {"values": [1, 0, 0, 1, 0, 1, 0, -1, 0, 0, 1, 2]}}"#;
    let from_text = run_outputs(&ok(&[
        "run", &g, "--device", "cpu", "--feeds", inline, "--json",
    ]));
    let file = s.write("feeds.json", inline);
    let from_file = run_outputs(&ok(&[
        "run", &g, "--device", "cpu", "--feeds", &file, "--json",
    ]));
    assert_eq!(from_text, from_file);
    assert_eq!(from_text[0].2, [1.0, 0.0, 3.0, 9.0, 0.0, 5.0, 0.0, 0.0]);
    // An intermediate node takes no values.
    let e = error_line(&["run", &g, "--device", "cpu", "--feeds", r#"{"mm": [[0]]}"#]);
    assert!(e.contains("'mm'") && e.contains("is a MatMul node"), "{e}");
    // A value that overflows the dtype, an integer that is not whole, a repeated name.
    let e = error_line(&[
        "run",
        &g,
        "--device",
        "cpu",
        "--feeds",
        r#"{"x": [[1e40, 0, 0], [0, 0, 0]]}"#,
    ]);
    assert!(
        e.contains("'x'") && e.contains("1e40") && e.contains("f32"),
        "{e}"
    );
    let e = error_line(&[
        "run",
        &g,
        "--device",
        "cpu",
        "--feeds",
        r#"{"x": [[1]], "x": [[2]]}"#,
    ]);
    assert!(e.contains("duplicate key 'x'"), "{e}");
}

#[test]
fn graph_files_take_a_byte_order_mark_and_refuse_repeated_keys() {
    let s = Scratch::new("bom");
    let with_bom = s.0.join("bom.json");
    std::fs::write(
        &with_bom,
        [b"\xEF\xBB\xBF".as_slice(), MLP.as_bytes()].concat(),
    )
    .unwrap();
    let text = ok(&["dump", with_bom.to_str().unwrap()]);
    assert!(text.contains("act = Relu"), "{text}");
    let repeated = MLP.replacen(r#""version": 1,"#, r#""version": 1, "version": 1,"#, 1);
    let e = error_line(&["dump", &s.write("dup.json", &repeated)]);
    assert!(e.contains("duplicate key 'version'"), "{e}");
}

#[test]
fn non_finite_outputs_are_counted_not_summarised_as_infinite_bounds() {
    let s = Scratch::new("nan");
    let g = s.write(
        "log.json",
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
          {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [100]}},
          {"name": "y", "op": "Log", "inputs": ["x"]}
        ], "outputs": ["y"]}"#,
    );
    // log(-1) is NaN, log(0) is -inf.
    let values = |v: &str| format!(r#"{{"x": {{"values": [{}]}}}}"#, vec![v; 100].join(","));
    let text = ok(&["run", &g, "--device", "cpu", "--feeds", &values("-1")]);
    assert!(
        text.contains("(100 values, 100 NaN, none finite)"),
        "{text}"
    );
    let mut mixed: Vec<&str> = vec!["1"; 98];
    mixed.extend(["-1", "0"]);
    let feeds = format!(r#"{{"x": {{"values": [{}]}}}}"#, mixed.join(","));
    let text = ok(&["run", &g, "--device", "cpu", "--feeds", &feeds]);
    assert!(
        text.contains(
            "(100 values, 1 NaN, 1 infinite; finite: min 0.000000, max 0.000000, mean 0.000000)"
        ),
        "{text}"
    );
}

#[test]
fn an_unknown_list_profile_names_the_ones_the_help_names() {
    let s = Scratch::new("lists");
    let g = s.write("mlp.json", MLP);
    let e = error_line(&["rewrite", &g, "--amp", "--lists", "fp16"]);
    assert!(
        e.contains("--lists fp16") && e.contains("default, tensorflow"),
        "{e}"
    );
    let help = ok(&["rewrite", "--help"]);
    assert!(
        help.contains("`default`") && help.contains("`tensorflow`"),
        "{help}"
    );
}

/// `bench` times a graph's step: as many timed steps as asked, percentiles in order,
/// the batch from the first Placeholder, throughput from the median wall time; on the
/// CPU no device time or launch. An ONNX model with `--input`, AMP and its weights as
/// Variables, as text.
#[test]
fn bench_reports_percentiles_throughput_and_the_batch() {
    let out = ok(&[
        "bench",
        "examples/graphs/mlp.json",
        "--device",
        "cpu",
        "--iterations",
        "7",
        "--warmup",
        "1",
        "--json",
    ]);
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["iterations"], 7);
    assert_eq!(r["batch"], 64);
    assert!(r["device_ms"].is_null() && r["launch"].is_null(), "{r}");
    let wall = &r["wall_ms"];
    let (median, p90, p99) = (
        wall["median"].as_f64().unwrap(),
        wall["p90"].as_f64().unwrap(),
        wall["p99"].as_f64().unwrap(),
    );
    assert!(0.0 < median && median <= p90 && p90 <= p99, "{wall}");
    let throughput = r["throughput"].as_f64().unwrap();
    assert!((throughput - 64.0 / (median / 1e3)).abs() <= 1e-6 * throughput);
    let text = ok(&[
        "bench",
        "tests/data/onnx/resnet_tiny/model.onnx",
        "--input",
        "input=2x3x32x32",
        "--amp",
        "f16",
        "--weights-as-variables",
        "--device",
        "cpu",
        "--iterations",
        "2",
        "--warmup",
        "0",
    ]);
    assert!(
        text.contains("batch 2") && text.contains("wall ms per step: median"),
        "{text}"
    );
}

/// Seeded feeds larger than the host's available memory are refused before any value
/// is made (16 GB of values were generated first: 48 s for an error needing no data).
#[test]
fn seeded_feeds_beyond_the_hosts_memory_are_refused_before_they_are_made() {
    let s = Scratch::new("huge_feeds");
    // 64 placeholders of 16 GiB, each within the tensor limit, 1 TiB together.
    let nodes: Vec<String> = (0..64)
        .map(|k| {
            format!(r#"{{"name": "p{k}", "op": "Placeholder", "attrs": {{"dtype": "f32", "shape": [4294967296]}}}}"#)
        })
        .collect();
    let graph = format!(
        r#"{{"format": "ampgraph.graph", "version": 1, "nodes": [{}], "outputs": ["p0"]}}"#,
        nodes.join(", ")
    );
    let path = s.write("huge.json", &graph);
    let started = std::time::Instant::now();
    let line = error_line(&["run", &path, "--device", "cpu"]);
    assert!(
        line.contains("the seeded feeds take 1048576.0 MiB") && line.contains("available"),
        "{line}"
    );
    assert!(started.elapsed().as_secs() < 10, "{:?}", started.elapsed());
}

/// Two ReLU layers of Variables, 32 -> 32 -> 16, on a [16, 32] input: products the FP8
/// options decide.
const TWO_LAYERS: &str = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
  {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [16, 32]}},
  {"name": "w1", "op": "Variable", "attrs": {"dtype": "f32", "shape": [32, 32]}},
  {"name": "w2", "op": "Variable", "attrs": {"dtype": "f32", "shape": [32, 16]}},
  {"name": "mm1", "op": "MatMul", "inputs": ["x", "w1"]},
  {"name": "act", "op": "Relu", "inputs": ["mm1"]},
  {"name": "mm2", "op": "MatMul", "inputs": ["act", "w2"]},
  {"name": "y", "op": "Relu", "inputs": ["mm2"]}
], "outputs": ["y"]}"#;

/// `--fp8-scaling static` (inference): `--calibrate` measures each cast's amax and
/// `--save-fp8-amaxes` keeps them; `--fp8-amaxes` rewrites with them instead of
/// calibrating (the same graph: scales as constants, no amax pass); static scaling
/// without either, or the files under other scaling, are one-line usage errors.
#[test]
fn static_fp8_scales_are_calibrated_saved_and_reused() {
    let s = Scratch::new("fp8-static");
    let g = s.write("two.json", TWO_LAYERS);
    let (calibrated, reused, amaxes) = (s.path("c.json"), s.path("r.json"), s.path("a.json"));
    let static_fp8 = [
        "--amp",
        "--dtype",
        "fp8",
        "--fp8-everywhere",
        "--fp8-scaling",
        "static",
    ];
    let report = ok(&[
        &["rewrite", &g],
        &static_fp8[..],
        &[
            "--calibrate",
            "seed:2",
            "--save-fp8-amaxes",
            &amaxes,
            "--report",
            "-o",
            &calibrated,
        ],
    ]
    .concat());
    assert!(
        report.contains("FP8 static scales: the amaxes of 4 tensors"),
        "{report}"
    );
    let saved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&read(&amaxes)).unwrap();
    assert_eq!(saved.len(), 4, "{saved:?}");
    assert!(saved
        .keys()
        .all(|k| k.starts_with("ampgraph/fp8/") && k.ends_with("/e4m3")));
    ok(&[
        &["rewrite", &g],
        &static_fp8[..],
        &["--fp8-amaxes", &amaxes, "-o", &reused],
    ]
    .concat());
    let text = String::from_utf8(read(&reused)).unwrap();
    assert_eq!(text, String::from_utf8(read(&calibrated)).unwrap());
    assert_eq!(text.matches("\"Fp8MatMul\"").count(), 2);
    assert_eq!(text.matches("\"Fp8Scale\"").count(), 0);
    let err = error_line(&[&["rewrite", &g], &static_fp8[..], &["-o", &reused]].concat());
    assert!(err.contains("add --calibrate (or --fp8-amaxes)"), "{err}");
    let current = [
        "--amp",
        "--dtype",
        "fp8",
        "--fp8-amaxes",
        &amaxes,
        "-o",
        &reused,
    ];
    let err = error_line(&[&["rewrite", &g][..], &current].concat());
    assert!(err.contains("are for --fp8-scaling static"), "{err}");
}

/// `--dtype fp8`: FP8 products where the options say (`--fp8-everywhere`, a node kept
/// by `--fp8-keep`), `explain` saying why; the FP8 options without `--dtype fp8`, or
/// delayed scaling's without `--fp8-scaling delayed`, are usage errors.
#[test]
fn fp8_options_choose_the_products_and_explain_says_why() {
    let s = Scratch::new("fp8");
    let two = TWO_LAYERS;
    let g = s.write("two.json", two);
    let out = s.path("out.json");
    let products_of = |graph: &str, args: &[&str]| {
        ok(&[
            &["rewrite", graph, "--amp", "--dtype", "fp8", "-o", &out],
            args,
        ]
        .concat());
        String::from_utf8(read(&out))
            .unwrap()
            .matches("\"Fp8MatMul\"")
            .count()
    };
    let products = |args: &[&str]| products_of(&g, args);
    assert_eq!(products(&[]), 0, "the cost model keeps products this small");
    assert_eq!(products(&["--fp8-everywhere"]), 2);
    assert_eq!(products(&["--fp8-everywhere", "--fp8-keep", "mm2"]), 1);
    // A classifier's head of 10 columns: cuBLASLt's FP8 products take no such n, so
    // "everywhere" leaves it 16-bit (a graph the GPU runs), and explain says why.
    let head = s.write("head.json", &two.replace("[32, 16]", "[32, 10]"));
    assert_eq!(products_of(&head, &["--fp8-everywhere"]), 1);
    let why = ok(&[
        "explain",
        &head,
        "mm2",
        "--dtype",
        "fp8",
        "--fp8-everywhere",
    ]);
    assert!(
        why.contains("FP8 products need k and n multiples of 16 (k = 32, n = 10)"),
        "{why}"
    );
    // Every product sums fast unless told otherwise.
    let fast = |args: &[&str]| {
        products(&[&["--fp8-everywhere"], args].concat());
        String::from_utf8(read(&out))
            .unwrap()
            .matches("\"fast_accumulation\":true")
            .count()
    };
    assert_eq!(fast(&[]), 2);
    assert_eq!(fast(&["--fp8-fast-accumulation", "forward"]), 2);
    assert_eq!(fast(&["--fp8-fast-accumulation", "never"]), 0);
    let why = ok(&[
        "explain",
        &g,
        "mm2",
        "--dtype",
        "fp8",
        "--fp8-everywhere",
        "--fp8-keep",
        "mm2",
    ]);
    assert!(
        why.contains("kept bf16 rather than FP8: its layer 'mm2' is listed"),
        "{why}"
    );
    let err = error_line(&["rewrite", &g, "--amp", "--fp8-everywhere", "-o", &out]);
    assert!(err.contains("need --dtype fp8"), "{err}");
    let err = error_line(&[
        "rewrite",
        &g,
        "--amp",
        "--dtype",
        "fp8",
        "--fp8-amax",
        "most-recent",
        "-o",
        &out,
    ]);
    assert!(err.contains("need --fp8-scaling delayed"), "{err}");
    // `--fp8-scaling` overrides AMPGRAPH_AMP_FP8_SCALING (delayed scaling needs a
    // training step, which this graph lacks).
    let with_env = |extra: &[&str]| {
        let args = [
            "rewrite",
            &g,
            "--amp",
            "--dtype",
            "fp8",
            "--fp8-everywhere",
            "-o",
            &out,
        ];
        Command::new(BIN)
            .args(args.iter().chain(extra))
            .env("AMPGRAPH_AMP_FP8_SCALING", "delayed")
            .output()
            .unwrap()
    };
    let delayed = with_env(&[]);
    let stderr = String::from_utf8_lossy(&delayed.stderr);
    assert!(
        !delayed.status.success() && stderr.contains("use current scaling"),
        "{stderr}"
    );
    assert!(with_env(&["--fp8-scaling", "current"]).status.success());
}
