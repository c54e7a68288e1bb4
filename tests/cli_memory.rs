//! `ampgraph run` of a graph with a large output: the output prints streaming from the
//! tensor, so the process peaks near the output's size (issue 25: a 4 GB output once
//! took ~20 GB to print). Alone in its test binary, so that the process's high-water
//! mark (Linux's VmHWM) is this run's.

use clap::Parser;

use ampgraph::cli::{run, Cli};

/// The process's peak resident memory so far, in bytes (Linux).
fn peak_resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[test]
fn a_large_output_prints_within_a_fraction_more_than_its_size() {
    let Some(before) = peak_resident_bytes() else {
        println!("skipping: this system does not report the peak resident memory");
        return;
    };
    let n = 64 << 20; // f32 values: 256 MiB
    let graph = format!(
        r#"{{"format": "ampgraph.graph", "version": 1, "nodes": [
          {{"name": "x", "op": "Placeholder", "attrs": {{"dtype": "f32", "shape": [1]}}}},
          {{"name": "y", "op": "BroadcastTo", "inputs": ["x"], "attrs": {{"shape": [{n}]}}}}
        ], "outputs": ["y"]}}"#
    );
    let path = std::env::temp_dir().join(format!("ampgraph-large-{}.json", std::process::id()));
    std::fs::write(&path, graph).unwrap();
    let cli = Cli::parse_from(["ampgraph", "run", path.to_str().unwrap(), "--device", "cpu"]);
    let mut printed = Vec::new();
    run(cli, &mut printed).unwrap();
    std::fs::remove_file(&path).unwrap();
    let text = String::from_utf8(printed).unwrap();
    assert!(text.contains(&format!("({n} values; finite:")), "{text}");
    let grown = peak_resident_bytes().unwrap().saturating_sub(before);
    let output = n * 4;
    assert!(
        (grown as f64) < 1.5 * output as f64,
        "the run grew the peak by {grown} bytes for a {output}-byte output"
    );
}
