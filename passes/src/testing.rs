//! Helpers of the passes' unit tests.

use std::collections::HashMap;

use ampgraph_graph::{Graph, NodeId, Tensor};

/// How many nodes of the graph run the op named `op`.
pub fn count(g: &Graph, op: &str) -> usize {
    g.node_ids()
        .filter(|&id| g.node(id).op_name() == op)
        .count()
}

/// Runs the graph with the CPU kernels, placeholders fed by name.
pub fn run(g: &Graph, feeds: &HashMap<&str, Tensor>) -> Vec<Tensor> {
    let mut vals: HashMap<NodeId, Vec<Tensor>> = HashMap::new();
    for id in g.topo_order().unwrap() {
        let node = g.node(id);
        let out = match feeds.get(node.name.as_str()) {
            Some(t) => vec![t.clone()],
            None => {
                let inputs = g.inputs(id);
                let ins: Vec<&Tensor> = inputs.iter().map(|p| &vals[&p.node][p.index]).collect();
                node.op.eval(&ins).unwrap()
            }
        };
        vals.insert(id, out);
    }
    g.outputs()
        .iter()
        .map(|p| vals[&p.node][p.index].clone())
        .collect()
}

/// A grouping pass's checks: `grouped` (what `pass` made of a graph whose outputs were
/// `want`) computes the same bits, through the JSON format and back too, and the pass
/// changes nothing more on it.
pub fn assert_grouped_keeps_bits(
    pass: &dyn crate::Pass,
    grouped: &mut Graph,
    feeds: &HashMap<&str, Tensor>,
    want: &[Tensor],
) {
    assert_same_bits(want, &run(grouped, feeds));
    let def = ampgraph_graph::format::GraphDef::from_graph(grouped);
    let back = ampgraph_graph::format::parse_json(ampgraph_graph::format::to_json(&def).as_bytes())
        .and_then(|d| d.to_graph())
        .unwrap();
    assert_same_bits(want, &run(&back, feeds));
    let before = grouped.len();
    pass.run(grouped).unwrap();
    assert_eq!(grouped.len(), before, "{}: not idempotent", pass.name());
}

/// Asserts that two runs' outputs have the same types and the same bits.
pub fn assert_same_bits(want: &[Tensor], got: &[Tensor]) {
    assert_eq!(want.len(), got.len());
    let bits = |t: &Tensor| -> Vec<u64> { t.to_f64_vec().iter().map(|v| v.to_bits()).collect() };
    for (k, (w, o)) in want.iter().zip(got).enumerate() {
        assert_eq!(w.ty(), o.ty(), "output {k}");
        assert_eq!(bits(w), bits(o), "output {k}");
    }
}

/// An f32 tensor of `shape` holding `sin(i * step)` at row-major index `i`: distinct,
/// signed values a test compares before and after a rewrite.
pub fn sine(shape: &[usize], step: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| (i as f64 * step).sin()).collect();
    Tensor::from_f64(ampgraph_graph::DType::F32, shape.to_vec(), &v).unwrap()
}
