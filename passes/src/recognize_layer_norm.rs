//! Layer normalisation as exporters decompose it (ONNX before opset 17 has no
//! LayerNormalization: torch writes `nn.LayerNorm` and HF models their norms out), one
//! LayerNorm again:
//!
//! ```text
//! d = x - Mean(x)                       (over the last axis, dims kept)
//! v = Mean(d ^ 2)   or  Mean(d * d)
//! y = d / Sqrt(v + eps)   or  d * Reciprocal(Sqrt(v + eps))
//! [y * gamma] [+ beta]                  (gamma, beta constant vectors along the axis)
//! ```
//!
//! The last node of the match becomes the LayerNorm (its name and readers kept); what
//! only the decomposition read goes.
//!
//! Why: one kernel instead of eight or more, and AMP's lists see a layer norm where
//! they saw a `Pow` (denied) and two means: the decomposition stayed f32 between f16
//! products, with casts around every norm.

use ampgraph_graph::ops::{
    BiasAdd, BinaryKind, DataFormat, LayerNorm, Reduce, ReduceKind, Unary, UnaryKind,
};
use ampgraph_graph::{Graph, NodeId, Port, Tensor};

use crate::rewrite::{binary_operands, const_value, output_nodes, remove_unread, summary};
use crate::simplify::scale_into_matmul::scalar;
use crate::{Pass, PassError, PassSummary};

/// The `recognize-layer-norm` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecognizeLayerNorm;

/// One decomposed layer norm: its input, epsilon, affine constants and nodes (the
/// last one computes the result).
struct Found {
    x: Port,
    epsilon: f64,
    gamma: Option<Port>,
    beta: Option<Port>,
    nodes: Vec<NodeId>,
}

fn unary(g: &Graph, p: Port, kind: UnaryKind) -> Option<Port> {
    let u = g.node(p.node).op.downcast_ref::<Unary>()?;
    (u.kind == kind && p.index == 0).then(|| g.inputs(p.node)[0])
}

/// The operand of a Mean over the last axis with the dims kept.
fn mean_of_last(g: &Graph, p: Port) -> Option<Port> {
    let r = g.node(p.node).op.downcast_ref::<Reduce>()?;
    let x = g.inputs(p.node)[0];
    let rank = g.ty(x).rank() as i64;
    let last = matches!(r.axes.as_deref(), Some([a]) if *a == -1 || *a == rank - 1);
    let plain = r.kind == ReduceKind::Mean && r.keep_dims && r.to.is_none();
    (plain && last && rank > 0).then_some(x)
}

fn scalar_of(g: &Graph, p: Port) -> Option<f64> {
    scalar(g, p).ok().flatten()
}

/// A constant vector along the last axis of `x` (gamma's or beta's shape), of x's
/// dtype.
fn is_vector_for(g: &Graph, c: Port, x: Port) -> bool {
    let (ct, xt) = (g.ty(c), g.ty(x));
    let is_const = const_value(g, c.node).ok().flatten().is_some();
    is_const && ct.dtype == xt.dtype && ct.shape.len() == 1 && ct.shape.last() == xt.shape.last()
}

/// The normalised `d / sqrt(v + eps)` at `y`: (d, eps), and the nodes from the
/// square of `d` to `y`.
fn normalised(g: &Graph, y: Port) -> Option<(Port, f64, Vec<NodeId>)> {
    let mut nodes = vec![y.node];
    let (d, root) = if let Some([d, root]) = binary_operands(g, y, BinaryKind::Div) {
        nodes.push(root.node);
        (d, unary(g, root, UnaryKind::Sqrt)?)
    } else {
        let [a, b] = binary_operands(g, y, BinaryKind::Mul)?;
        let inverse = |p: Port| {
            let root = unary(g, p, UnaryKind::Reciprocal)?;
            Some((p.node, root.node, unary(g, root, UnaryKind::Sqrt)?))
        };
        let (d, (reciprocal, sqrt, root)) = match (inverse(a), inverse(b)) {
            (None, Some(found)) => (a, found),
            (Some(found), None) => (b, found),
            _ => return None,
        };
        nodes.extend([reciprocal, sqrt]);
        (d, root)
    };
    let [v, e] = binary_operands(g, root, BinaryKind::Add)?;
    let (v, eps) = match (scalar_of(g, v), scalar_of(g, e)) {
        (None, Some(eps)) => (v, eps),
        (Some(eps), None) => (e, eps),
        _ => return None,
    };
    // An f32 constant's epsilon as the decimal its writer meant (1e-5, not
    // 9.99999974e-6: the shortest decimal that reads back as the same f32).
    let epsilon = (eps as f32).to_string().parse().unwrap_or(eps);
    let square = mean_of_last(g, v)?;
    let squared_d = match binary_operands(g, square, BinaryKind::Pow) {
        Some([base, two]) => (scalar_of(g, two) == Some(2.0)).then_some(base)?,
        None => {
            let [a, b] = binary_operands(g, square, BinaryKind::Mul)?;
            (a == b).then_some(a)?
        }
    };
    nodes.extend([root.node, v.node, square.node]);
    (squared_d == d && epsilon > 0.0).then_some((d, epsilon, nodes))
}

/// The decomposed layer norm whose last node is `root`, if it is one.
fn recognized(g: &Graph, root: NodeId) -> Option<Found> {
    let mut nodes = Vec::new();
    let mut at = Port::new(root, 0);
    // `+ beta` (the importer's BiasAdd along the last axis, or an Add).
    let mut beta = None;
    if let Some(b) = g.node(root).op.downcast_ref::<BiasAdd>() {
        let [y, bias] = g.inputs(root)[..] else {
            return None;
        };
        let along_last = b.data_format == DataFormat::Nhwc || g.ty(y).rank() <= 2;
        if !along_last {
            return None;
        }
        beta = Some(bias);
        nodes.push(root);
        at = y;
    } else if let Some([y, bias]) = binary_operands(g, at, BinaryKind::Add) {
        if is_vector_for(g, bias, y) {
            beta = Some(bias);
            nodes.push(root);
            at = y;
        }
    }
    // `* gamma`.
    let mut gamma = None;
    if let Some([a, b]) = binary_operands(g, at, BinaryKind::Mul) {
        let (y, c) = if is_vector_for(g, b, a) {
            (a, b)
        } else {
            (b, a)
        };
        if is_vector_for(g, c, y) && normalised(g, y).is_some() {
            gamma = Some(c);
            nodes.push(at.node);
            at = y;
        }
    }
    let (d, epsilon, inner) = normalised(g, at)?;
    let [x, mean] = binary_operands(g, d, BinaryKind::Sub)?;
    if mean_of_last(g, mean)? != x || beta.is_some_and(|b| !is_vector_for(g, b, x)) {
        return None;
    }
    nodes.extend(inner);
    nodes.extend([d.node, mean.node]);
    // Root last.
    nodes.reverse();
    Some(Found {
        x,
        epsilon,
        gamma,
        beta,
        nodes,
    })
}

/// A constant of `value` in the shape and dtype of x's last axis.
fn filled(g: &mut Graph, x: Port, value: f64, name: &str) -> Result<Port, PassError> {
    let ty = g.ty(x).clone();
    let n = ty.shape.last().copied().unwrap_or(1);
    let t = Tensor::from_f64(ty.dtype, [n], &vec![value; n]).map_err(PassError::Rewrite)?;
    let name = g.fresh_name(name.to_string());
    Ok(
        g.add_node(name, Box::new(ampgraph_graph::ops::Const::new(t)), &[])?
            .into(),
    )
}

impl Pass for RecognizeLayerNorm {
    fn name(&self) -> &'static str {
        "recognize-layer-norm"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let outputs = output_nodes(g);
        let found: Vec<Found> = g.node_ids().filter_map(|id| recognized(g, id)).collect();
        let mut lines = Vec::new();
        let mut stale = Vec::new();
        for f in &found {
            let Some(&root) = f.nodes.last() else {
                continue;
            };
            // A match inside a larger one (the norm without its affine part) is left
            // to the larger: each node rewrites once.
            let inside_another = (found.iter())
                .any(|other| other.nodes.last() != Some(&root) && other.nodes.contains(&root));
            if inside_another {
                continue;
            }
            let name = g.node(root).name.clone();
            let gamma = match f.gamma {
                Some(c) => c,
                None => filled(g, f.x, 1.0, &format!("{name}/gamma"))?,
            };
            let beta = match f.beta {
                Some(c) => c,
                None => filled(g, f.x, 0.0, &format!("{name}/beta"))?,
            };
            let op = LayerNorm {
                axis: -1,
                epsilon: f.epsilon,
                to: None,
            };
            g.set_node(root, Box::new(op), &[f.x, gamma, beta])?;
            stale.extend(f.nodes[..f.nodes.len() - 1].iter().copied());
            lines.push(format!("{name}: a layer norm (epsilon {})", f.epsilon));
        }
        // The decompositions' nodes (and their scalar constants) go where nothing
        // else reads them.
        let constants: Vec<NodeId> = (stale.iter())
            .flat_map(|&id| g.inputs(id))
            .filter(|&p| scalar_of(g, p).is_some())
            .map(|p| p.node)
            .collect();
        stale.extend(constants);
        remove_unread(g, stale, &outputs)?;
        Ok(summary("recognize-layer-norm", lines))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{count, run};
    use ampgraph_graph::ops::{Binary, Const};
    use ampgraph_graph::DType;

    /// `(x - Mean(x)) / Sqrt(Mean((x - Mean(x))^2) + 1e-5)` over `axis` of x [2, 3, 4],
    /// its `d` also a graph output where `d_read` (another reader to keep).
    fn decomposed(axis: i64, d_read: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 4]).unwrap();
        let konst = |g: &mut Graph, v: f64| -> Port {
            let name = g.fresh_name("c".to_string());
            let t = Tensor::scalar(DType::F32, v);
            g.add_node(name, Box::new(Const::new(t)), &[])
                .unwrap()
                .into()
        };
        let mean = |g: &mut Graph, p| {
            g.add(Reduce::new(ReduceKind::Mean, Some(vec![axis]), true), &[p])
                .unwrap()
        };
        let bin = |g: &mut Graph, kind, a, b| g.add(Binary::new(kind), &[a, b]).unwrap();
        let m = mean(&mut g, x);
        let d = bin(&mut g, BinaryKind::Sub, x, m);
        let two = konst(&mut g, 2.0);
        let sq = bin(&mut g, BinaryKind::Pow, d, two);
        let v = mean(&mut g, sq);
        let eps = konst(&mut g, 1e-5);
        let ve = bin(&mut g, BinaryKind::Add, v, eps);
        let root = g.add(Unary::new(UnaryKind::Sqrt), &[ve]).unwrap();
        let y = bin(&mut g, BinaryKind::Div, d, root);
        let outputs = if d_read { vec![y, d] } else { vec![y] };
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds() -> HashMap<&'static str, Tensor> {
        let v: Vec<f64> = (0..24).map(|i| ((i * 5) % 11) as f64 - 4.0).collect();
        [("x", Tensor::from_f64(DType::F32, [2, 3, 4], &v).unwrap())].into()
    }

    #[test]
    fn a_norm_over_the_last_axis_becomes_a_layer_norm_keeping_other_readers() {
        for (axis, d_read) in [(-1, false), (2, true)] {
            let mut g = decomposed(axis, d_read);
            let before = run(&g, &feeds());
            RecognizeLayerNorm.run(&mut g).unwrap();
            g.validate().unwrap();
            assert_eq!(count(&g, "LayerNorm"), 1, "axis {axis}");
            // The Sub stays where the graph reads it.
            assert_eq!(count(&g, "Sub"), usize::from(d_read));
            for (want, got) in before.iter().zip(run(&g, &feeds())) {
                let (want, got) = (want.to_f64_vec(), got.to_f64_vec());
                for (a, b) in want.iter().zip(&got) {
                    assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn a_norm_over_another_axis_is_left_alone() {
        let mut g = decomposed(1, false);
        let summary = RecognizeLayerNorm.run(&mut g).unwrap();
        assert_eq!(count(&g, "LayerNorm"), 0, "{:?}", summary.lines);
        assert_eq!(count(&g, "Pow"), 1);
    }
}
