//! Bad input of every kind makes the CLI exit with status 2 and print one line
//! `error: ...` naming the node and the problem, never a panic (docs/design.md §3).
//!
//! The corpus lives in `tests/bad_inputs/` (see its README.md); [`CASES`] below is the
//! manifest: each file, what it checks, and a substring the error line must contain.
//! Cases too large to store (deep JSON nesting) or that need a binary encoder (a
//! well-formed `.bin` of a bad graph) are generated at run time.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use ampgraph::graph::format;

const BIN: &str = env!("CARGO_BIN_EXE_ampgraph");

/// One corpus file.
struct Case {
    file: &'static str,
    /// Substrings the error line must contain (the node's name and the problem).
    expect: &'static [&'static str],
    /// Whether `rewrite --amp` must fail too (false only where only running is impossible).
    rewrite_fails: bool,
}

const fn case(file: &'static str, expect: &'static [&'static str]) -> Case {
    Case {
        file,
        expect,
        rewrite_fails: true,
    }
}

/// The manifest: every file in tests/bad_inputs/ must be listed here.
const CASES: &[Case] = &[
    // ---- file level
    case("not_json.json", &["not valid JSON"]),
    case("empty.json", &["empty"]),
    case("top_level_array.json", &["must be a JSON object"]),
    case(
        "wrong_format_name.json",
        &["'format' must be", "onnx.graph"],
    ),
    case("wrong_version.json", &["unsupported version 7"]),
    case(
        "unknown_top_level_key.json",
        &["unknown top-level key 'metadata'"],
    ),
    // ---- node structure
    case("missing_node_name.json", &["node #1", "no 'name'"]),
    case("duplicate_names.json", &["'x'", "already exists"]),
    case("unknown_op.json", &["'act'", "unknown op 'Frobnicate'"]),
    case("unknown_node_key.json", &["'act'", "unknown key 'device'"]),
    case("unknown_attr_key.json", &["'act'", "unknown attr 'slope'"]),
    case(
        "missing_required_attr.json",
        &["'x'", "missing attr 'shape'"],
    ),
    case(
        "wrong_attr_type.json",
        &["'mm'", "transpose_a", "must be a boolean"],
    ),
    // ---- wiring
    case("missing_input.json", &["'act'", "no node named 'ghost'"]),
    case(
        "output_index_out_of_range.json",
        &["'act'", "output 3", "'x'"],
    ),
    case(
        "graph_output_index_out_of_range.json",
        &["'act'", "output 3 does not exist"],
    ),
    case(
        "missing_graph_output.json",
        &["graph output 'nowhere'", "no node named"],
    ),
    case("cycle.json", &["cycle"]),
    case("self_loop.json", &["'loop'", "cycle"]),
    case("arity_too_few.json", &["'sum2'", "takes 2 inputs, got 1"]),
    case("arity_too_many.json", &["'act'", "takes 1 input, got 2"]),
    // ---- shapes and types
    case("matmul_inner_dims.json", &["'mm'", "inner dimensions"]),
    case(
        "add_broadcast_mismatch.json",
        &["'plus'", "do not broadcast"],
    ),
    case("add_dtype_mismatch.json", &["'plus'", "f64", "f32"]),
    case("reshape_element_count.json", &["'rs'", "cannot reshape"]),
    case("conv2d_channels.json", &["'conv'", "channels"]),
    case("batchnorm_param_length.json", &["'bn'", "mean", "channels"]),
    case("bad_dtype_string.json", &["'x'", "unknown dtype 'float17'"]),
    case("negative_dims.json", &["'x'", "negative dimension -3"]),
    case(
        "placeholder_shape_overflow.json",
        &["'huge'", "more elements than can be addressed"],
    ),
    case("bad_perm.json", &["'tr'", "not a permutation"]),
    case("bad_perm_length.json", &["'tr'", "not a permutation"]),
    case(
        "softmax_axis_out_of_range.json",
        &["'sm'", "axis 5 is out of range"],
    ),
    case("sum_duplicate_axes.json", &["'total'", "same axis twice"]),
    case("sce_float_labels.json", &["'loss'", "labels", "f32"]),
    case("dtype_field_disagrees.json", &["'act'", "dtype f16", "f32"]),
    // A graph that is fine to rewrite but cannot be run: 4 TB of f32.
    Case {
        file: "placeholder_too_large.json",
        expect: &["'huge'", "too large to allocate"],
        rewrite_fails: false,
    },
    // ---- binary files
    case("truncated.bin", &["corrupt binary graph"]),
    case("truncated_header.bin", &["truncated binary graph header"]),
    case("garbage_body.bin", &["corrupt binary graph"]),
    case("huge_length_prefix.bin", &["corrupt binary graph"]),
    case("trailing_bytes.bin", &["trailing bytes"]),
    case("wrong_bin_version.bin", &["unsupported binary version 9"]),
];

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_inputs")
}

/// A scratch directory private to this test process.
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ampgraph-cli-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

fn ampgraph(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn().expect("spawn ampgraph");
    if let Some(bytes) = stdin {
        use std::io::Write;
        let mut pipe = child.stdin.take().expect("stdin pipe");
        // The binary may stop reading early; a broken pipe is not this test's concern.
        let _ = pipe.write_all(bytes);
    }
    child.wait_with_output().expect("wait for ampgraph")
}

/// Checks the contract of a failing command: status 2, one `error: ` line holding
/// every expected substring, no panic text. Returns a description of what is wrong.
/// Rust's debug form of a value in `line`, where there is one: a struct or enum
/// variant with fields (`UnexpectedEnd { additional: 5 }`), an `Option`, an escaped
/// string.
fn debug_text(line: &str) -> Option<&str> {
    let struct_like = line.find(" { ").filter(|&at| {
        let before = line[..at].rsplit(' ').next().unwrap_or("");
        before.chars().next().is_some_and(char::is_uppercase)
            && before.chars().all(char::is_alphanumeric)
    });
    let at = struct_like
        .or_else(|| line.find("Some("))
        .or_else(|| line.find("None,"))
        .or_else(|| line.find("\\\""))?;
    Some(&line[at.saturating_sub(20)..line.len().min(at + 30)])
}

fn check_failure(what: &str, out: &Output, expect: &[&str]) -> Result<(), String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut problems = Vec::new();
    if out.status.code() != Some(2) {
        problems.push(format!("exit status {:?}, expected 2", out.status.code()));
    }
    if stderr.contains("panicked")
        || stderr.contains("RUST_BACKTRACE")
        || stderr.contains("stack backtrace")
    {
        problems.push("panic text on stderr".to_string());
    }
    let lines: Vec<&str> = stderr.lines().collect();
    if lines.len() != 1 {
        problems.push(format!("{} stderr lines, expected 1", lines.len()));
    }
    match lines.first() {
        Some(line) if line.starts_with("error: ") => {
            for s in expect {
                if !line.contains(s) {
                    problems.push(format!("the error does not mention {s:?}"));
                }
            }
            if let Some(debug) = debug_text(line) {
                problems.push(format!("debug formatting in the error: {debug:?}"));
            }
        }
        _ => problems.push("stderr does not start with 'error: '".to_string()),
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {}\n    stderr: {stderr:?}",
            problems.join("; ")
        ))
    }
}

fn check_success(what: &str, out: &Output) -> Result<(), String> {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what}: expected success, got {:?}; stderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Runs `run`, `rewrite --amp` and `plan` on a file and checks all fail properly
/// (`rewrite` and `plan` succeed where only running is impossible).
fn check_file(path: &str, expect: &[&str], rewrite_fails: bool, failures: &mut Vec<String>) {
    // An error found reading the file (rewrite and plan fail too) names the file.
    let mut with_file = expect.to_vec();
    if rewrite_fails {
        with_file.push(path);
    }
    let expect = &with_file[..];
    let run = ampgraph(&["run", path, "--device", "cpu"], None);
    if let Err(e) = check_failure(&format!("run {path}"), &run, expect) {
        failures.push(e);
    }
    for args in [&["rewrite", path, "--amp"][..], &["plan", path]] {
        let out = ampgraph(args, None);
        let what = args.join(" ");
        let result = if rewrite_fails {
            check_failure(&what, &out, expect)
        } else {
            check_success(&what, &out)
        };
        if let Err(e) = result {
            failures.push(e);
        }
    }
}

#[test]
fn every_corpus_file_is_in_the_manifest() {
    let mut on_disk: Vec<String> = std::fs::read_dir(corpus_dir())
        .expect("read tests/bad_inputs")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n != "README.md")
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.file.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed, "tests/bad_inputs/ and CASES disagree");
    let readme = std::fs::read_to_string(corpus_dir().join("README.md")).expect("README.md");
    for c in CASES {
        assert!(
            readme.contains(c.file),
            "README.md does not describe {}",
            c.file
        );
    }
}

#[test]
fn corpus_files_fail_with_one_error_line() {
    let mut failures = Vec::new();
    for c in CASES {
        let path = corpus_dir().join(c.file);
        check_file(
            path.to_str().expect("utf-8 path"),
            c.expect,
            c.rewrite_fails,
            &mut failures,
        );
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

#[test]
fn deeply_nested_json_is_refused() {
    let dir = scratch();
    let mut failures = Vec::new();
    // 100 000 open brackets: a recursive parser without a depth limit overflows its stack.
    let brackets = "[".repeat(100_000);
    let path = dir.join("deep_brackets.json");
    std::fs::write(&path, &brackets).expect("write");
    check_file(
        path.to_str().expect("utf-8"),
        &["not valid JSON"],
        true,
        &mut failures,
    );
    // Deep nesting inside an attribute of an otherwise valid graph.
    let inner = format!("{}1{}", "[".repeat(50_000), "]".repeat(50_000));
    let graph = format!(
        r#"{{"format": "ampgraph.graph", "version": 1, "nodes": [{{"name": "x", "op": "Placeholder", "attrs": {{"dtype": "f32", "shape": {inner}}}}}], "outputs": ["x"]}}"#
    );
    let path = dir.join("deep_attr.json");
    std::fs::write(&path, &graph).expect("write");
    check_file(
        path.to_str().expect("utf-8"),
        &["not valid JSON"],
        true,
        &mut failures,
    );
    // And the same through standard input.
    let out = ampgraph(&["run", "-", "--device", "cpu"], Some(brackets.as_bytes()));
    if let Err(e) = check_failure("run - (deep JSON on stdin)", &out, &["not valid JSON"]) {
        failures.push(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Binary files whose encoding is fine but whose graph is not: the `.bin` path checks
/// the graph exactly as the JSON path does.
#[test]
fn well_formed_bin_of_a_bad_graph_is_refused() {
    let dir = std::env::temp_dir().join(format!("ampgraph-cli-errors-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    let mut failures = Vec::new();
    for (file, expect) in [
        ("cycle.json", &["cycle"][..]),
        ("unknown_op.json", &["'act'", "unknown op 'Frobnicate'"][..]),
        ("matmul_inner_dims.json", &["'mm'", "inner dimensions"][..]),
        ("dtype_field_disagrees.json", &["'act'", "dtype f16"][..]),
        (
            "missing_input.json",
            &["'act'", "no node named 'ghost'"][..],
        ),
    ] {
        let json = std::fs::read(corpus_dir().join(file)).expect("read corpus file");
        let def = format::parse_json(&json).expect("structurally valid JSON");
        let bin = format::to_bin(&def).expect("encode");
        let path = dir.join(file.replace(".json", ".bin"));
        std::fs::write(&path, bin).expect("write");
        check_file(path.to_str().expect("utf-8"), expect, true, &mut failures);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn bad_input_on_stdin_fails_properly() {
    let mut failures = Vec::new();
    for c in CASES
        .iter()
        .filter(|c| c.file.ends_with(".json") && c.rewrite_fails)
    {
        let bytes = std::fs::read(corpus_dir().join(c.file)).expect("read");
        let out = ampgraph(&["rewrite", "-", "--amp"], Some(&bytes));
        if let Err(e) = check_failure(&format!("rewrite - < {}", c.file), &out, c.expect) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unreadable_files_and_absent_nodes_fail_properly() {
    let dir = std::env::temp_dir().join(format!("ampgraph-cli-errors-misc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    let graph = dir.join("good.json");
    std::fs::write(
        &graph,
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
            {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2, 2]}},
            {"name": "act", "op": "Relu", "inputs": ["x"]}], "outputs": ["act"]}"#,
    )
    .expect("write");
    let graph = graph.to_str().expect("utf-8").to_string();
    let no_outputs = dir.join("no_outputs.json");
    std::fs::write(
        &no_outputs,
        r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
            {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2]}}],
            "outputs": []}"#,
    )
    .expect("write");
    let no_outputs = no_outputs.to_str().expect("utf-8");
    let missing = dir.join("no_such_file.json");
    let missing = missing.to_str().expect("utf-8");
    let dir_str = dir.to_str().expect("utf-8");
    let mut failures = Vec::new();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["run", missing], vec!["no_such_file.json"]),
        (vec!["rewrite", missing, "--amp"], vec!["no_such_file.json"]),
        (vec!["dump", missing], vec!["no_such_file.json"]),
        (vec!["run", dir_str], vec![dir_str]),
        (vec!["explain", &graph, "nobody"], vec!["nobody"]),
        (vec!["plan", missing], vec!["no_such_file.json"]),
        (
            vec!["plan", &graph, "--fetch", "act,nobody"],
            vec!["--fetch nobody", "no node named 'nobody'"],
        ),
        (vec!["plan", &graph, "--fetch", "act:1"], vec!["output 1"]),
        (vec!["plan", no_outputs], vec!["no outputs", "--fetch"]),
        (
            vec!["plan", &graph, "--passes", "bogus"],
            vec!["unknown pass 'bogus'"],
        ),
    ];
    for (args, expect) in &cases {
        let out = ampgraph(args, None);
        if let Err(e) = check_failure(&args.join(" "), &out, expect) {
            failures.push(e);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
