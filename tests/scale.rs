//! Graphs of a million nodes (issue 46): import from JSON and from ONNX (our export),
//! the AMP rewrite, the memory plan and a CPU run each take time linear in the graph's
//! size. The chains of the
//! issue's reproducer (10k nodes 0.13 s, 100k 8.8 s, 300k past 20 s: quadratic) and one
//! Concat of as many inputs, each at 100k and at 1M nodes: the larger may take at most
//! 30 times as long (linear is 10, quadratic 100; 12 to 17 seen, the allocator and the
//! caches working harder on the larger), and the results are checked.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ampgraph::exec::memory_plan::step_footprint;
use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::format::{graph_from_bytes, to_json, GraphDef};
use ampgraph::graph::ops::{Concat, Unary, UnaryKind};
use ampgraph::onnx::{export_file, import_file, ExportOptions, ImportOptions};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
use ampgraph::{DType, Graph, Port, Tensor};

/// `n` nodes after one input: a chain of Negs, or (`wide`) one Concat of `n` copies of
/// the input.
fn graph(n: usize, wide: bool) -> Graph {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2]).unwrap();
    let out = if wide {
        g.add(Concat::new(0), &vec![x; n]).unwrap()
    } else {
        (0..n).fold(x, |y, _| g.add(Unary::new(UnaryKind::Neg), &[y]).unwrap())
    };
    g.set_outputs(vec![out]).unwrap();
    g
}

/// The time of every stage on `graph(n, wide)`, checking what each gives.
fn stages(n: usize, wide: bool) -> Duration {
    let g = graph(n, wide);
    let json = to_json(&GraphDef::from_graph(&g));
    let onnx = std::env::temp_dir().join(format!("ampgraph-scale-{}.onnx", std::process::id()));
    export_file(&g, &onnx, &ExportOptions::default()).unwrap();
    let start = Instant::now();
    let imported = import_file(&onnx, &ImportOptions::default()).unwrap();
    let _ = std::fs::remove_file(&onnx);
    let mut g = graph_from_bytes(json.as_bytes()).unwrap();
    assert_eq!(g.len(), if wide { 2 } else { n + 1 });
    assert_eq!(imported.len(), g.len());
    AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap())
        .rewrite(&mut g)
        .unwrap();
    let out: Port = g.outputs()[0];
    let plan = step_footprint(&g, &[out], &HashMap::new()).unwrap();
    // The concatenation holds n pairs (in f16 at least).
    assert!(plan.peak_bytes() >= 4 * if wide { n } else { 1 });
    let feeds = Feeds::from([(
        "x".to_string(),
        Tensor::from_f64(DType::F32, vec![2], &[1.5, -2.0]).unwrap(),
    )]);
    let y = CpuExecutor::new().run(&g, &feeds, &[out]).unwrap();
    let want = match (wide, n % 2) {
        (true, _) => [1.5, -2.0].repeat(n),
        (false, 0) => vec![1.5, -2.0],
        (false, _) => vec![-1.5, 2.0],
    };
    assert_eq!(y[0].to_f64_vec(), want);
    start.elapsed()
}

#[test]
fn a_million_nodes_import_rewrite_plan_and_run_in_linear_time() {
    for wide in [false, true] {
        // The smaller graph's best of two: the ratio is not a first run's warm-up.
        let small = stages(100_000, wide).min(stages(100_000, wide));
        let large = stages(1_000_000, wide);
        println!("wide {wide}: 100k nodes {small:?}, 1M nodes {large:?}");
        assert!(
            large < small * 30,
            "wide {wide}: 1M nodes took {large:?}, 100k {small:?}"
        );
    }
}
