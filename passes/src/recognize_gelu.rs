//! GELU as exporters decompose it, one Gelu again: `x * 0.5 * (1 + erf(x / sqrt(2)))`
//! (torch's exact GELU, BERT's) and `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 *
//! x^3)))` (GPT-2's `gelu_new`, with `Pow`), in whatever order of operations and
//! constants the writer chose.
//!
//! A candidate is a Mul whose inputs trace back, through Unary and Binary nodes whose
//! other operands are scalar constants, to one tensor `x`, with exactly one Erf or Tanh
//! on the way. It is taken where it computes the Gelu of `x` in f64 at points across
//! GELU's range (negative tails to 10), within 1e-6 of `|x|`: a recognition by value,
//! not by the shape of the expression. The Mul becomes the Gelu (its name and readers
//! kept); what only it read goes.
//!
//! Why: one kernel instead of eight, and AMP's lists see a GELU (allowed in f16) where
//! they saw a `Pow` (denied), which kept GPT-2's every MLP activation in f32.

use std::collections::HashMap;

use ampgraph_graph::ops::{Binary, BinaryKind, Unary, UnaryKind};
use ampgraph_graph::{DType, Graph, NodeId, Op, Port, Tensor};

use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::simplify::scale_into_matmul::scalar;
use crate::{Pass, PassError, PassSummary};

/// The `recognize-gelu` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecognizeGelu;

/// The most nodes a decomposed GELU takes (the tanh form with `x * x * x`: 10).
const MOST_NODES: usize = 14;

/// The nodes between `x` and `root` (root last, each after its inputs), where every
/// input on the way is `x`, a scalar constant or another such node; `None` otherwise.
fn cone(g: &Graph, root: NodeId, x: Port) -> Result<Option<Vec<NodeId>>, PassError> {
    let mut order: Vec<NodeId> = Vec::new();
    // Depth-first, each node after its inputs.
    let mut stack = vec![(root, false)];
    while let Some((id, expanded)) = stack.pop() {
        if order.contains(&id) {
            continue;
        }
        if expanded {
            order.push(id);
            continue;
        }
        let op = &g.node(id).op;
        if !(op.is::<Unary>() || op.is::<Binary>()) || order.len() + stack.len() > MOST_NODES {
            return Ok(None);
        }
        stack.push((id, true));
        for p in g.inputs(id) {
            if p == x || scalar(g, p)?.is_some() {
                continue;
            }
            if p.index != 0 {
                return Ok(None);
            }
            stack.push((p.node, false));
        }
    }
    Ok(Some(order))
}

/// The values of `cone` at `x = samples`, in f64.
fn evaluate(g: &Graph, cone: &[NodeId], x: Port, samples: &Tensor) -> Option<Tensor> {
    let mut values: HashMap<Port, Tensor> = HashMap::new();
    values.insert(x, samples.clone());
    for &id in cone {
        let mut inputs = Vec::new();
        for p in g.inputs(id) {
            let value = match values.get(&p) {
                Some(v) => v.clone(),
                None => Tensor::scalar(DType::F64, scalar(g, p).ok()??),
            };
            inputs.push(value);
        }
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = g.node(id).op.eval(&refs).ok()?.into_iter().next()?;
        values.insert(Port::new(id, 0), out);
    }
    values.remove(&Port::new(*cone.last()?, 0))
}

/// A Gelu `root` computes: of which tensor, whether the tanh form, and the nodes of
/// its decomposition (root last).
type Recognized = (Port, bool, Vec<NodeId>);

/// The points a candidate is evaluated at (GELU's range, negative tails to 10), and
/// each form's GELU there: made once per run of the pass.
struct Reference {
    samples: Tensor,
    /// (whether the tanh form, its values at the samples)
    forms: Vec<(bool, Vec<f64>)>,
}

impl Reference {
    fn new() -> Result<Reference, PassError> {
        let err = |m: String| PassError::Rewrite(m);
        let points: Vec<f64> = (0..=40).map(|i| -10.0 + 0.5 * i as f64).collect();
        let samples = Tensor::from_f64(DType::F64, [points.len()], &points).map_err(err)?;
        let forms = [false, true]
            .into_iter()
            .map(|approximate| {
                let gelu = Unary::new(UnaryKind::Gelu { approximate });
                let values = gelu.eval(&[&samples]).map_err(err)?.remove(0);
                Ok((approximate, values.to_f64_vec()))
            })
            .collect::<Result<_, PassError>>()?;
        Ok(Reference { samples, forms })
    }

    /// Which form `got` (values at the samples) is, within 1e-6 of each sample's size.
    fn form_of(&self, got: &Tensor) -> Option<bool> {
        if got.shape() != self.samples.shape() {
            return None;
        }
        let (got, points) = (got.to_f64_vec(), self.samples.to_f64_vec());
        let close = |want: &[f64]| {
            (got.iter().zip(want).zip(&points))
                .all(|((a, b), s)| (a - b).abs() <= 1e-6 * s.abs().max(1.0))
        };
        (self.forms.iter())
            .find(|(_, want)| close(want))
            .map(|&(approximate, _)| approximate)
    }
}

/// The Gelu `root` computes, if it computes one.
fn recognized(
    g: &Graph,
    root: NodeId,
    reference: &Reference,
) -> Result<Option<Recognized>, PassError> {
    if g.node(root).op.downcast_ref::<Binary>().map(|b| b.kind) != Some(BinaryKind::Mul) {
        return Ok(None);
    }
    // Candidates for x: the non-constant inputs met going up, nearest first.
    let mut candidates: Vec<Port> = Vec::new();
    let mut frontier = vec![root];
    for _ in 0..MOST_NODES {
        let Some(id) = frontier.pop() else { break };
        for p in g.inputs(id) {
            if scalar(g, p)?.is_some() || candidates.contains(&p) {
                continue;
            }
            candidates.push(p);
            let op = &g.node(p.node).op;
            if op.is::<Unary>() || op.is::<Binary>() {
                frontier.insert(0, p.node);
            }
        }
    }
    let root_ty = g.ty(Port::new(root, 0));
    for x in candidates {
        if g.ty(x) != root_ty || !g.ty(x).dtype.is_float() {
            continue;
        }
        let Some(cone) = cone(g, root, x)? else {
            continue;
        };
        let anchors = (cone.iter())
            .filter_map(|&id| g.node(id).op.downcast_ref::<Unary>())
            .filter(|u| matches!(u.kind, UnaryKind::Erf | UnaryKind::Tanh))
            .count();
        if anchors != 1 {
            continue;
        }
        let form =
            evaluate(g, &cone, x, &reference.samples).and_then(|got| reference.form_of(&got));
        if let Some(approximate) = form {
            return Ok(Some((x, approximate, cone)));
        }
    }
    Ok(None)
}

impl Pass for RecognizeGelu {
    fn name(&self) -> &'static str {
        "recognize-gelu"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let reference = Reference::new()?;
        let ids: Vec<NodeId> = g.node_ids().collect();
        let mut found = Vec::new();
        for id in ids {
            if let Some(r) = recognized(g, id, &reference)? {
                found.push((id, r));
            }
        }
        let mut dropped = Vec::new();
        let mut lines = Vec::new();
        for (root, (x, approximate, cone)) in found {
            // The decomposition's nodes and its constants (through their Casts).
            for &id in &cone {
                for p in g.inputs(id).into_iter().filter(|&p| p != x) {
                    dropped.push(p.node);
                    dropped.extend(g.inputs(p.node).iter().map(|q| q.node));
                }
            }
            dropped.extend(cone.into_iter().filter(|&id| id != root));
            let gelu = Unary::new(UnaryKind::Gelu { approximate });
            g.set_node(root, Box::new(gelu), &[x])?;
            let form = if approximate { "tanh" } else { "erf" };
            lines.push(format!("'{}': Gelu ({form})", g.node(root).name));
        }
        let is_output = output_nodes(g);
        let (removed, _) = remove_unread(g, dropped, &is_output)?;
        if !lines.is_empty() {
            lines.push(format!("{removed} nodes of the decompositions removed"));
        }
        Ok(summary(self.name(), lines))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{count, run};
    use BinaryKind::{Add, Div, Mul, Pow};

    /// A graph of x [4, 64] -> MatMul -> `body(x)` -> Relu (a reader after it).
    fn graph(body: impl Fn(&mut Graph, Port) -> Port) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 64]).unwrap();
        let w = g.placeholder("w", DType::F32, [64, 64]).unwrap();
        let h = g.matmul(x, w).unwrap();
        let y = body(&mut g, h);
        let out = g.add(Unary::new(UnaryKind::Relu), &[y]).unwrap();
        g.set_outputs(vec![out, y]).unwrap();
        g
    }

    fn bin(g: &mut Graph, kind: BinaryKind, a: Port, b: Port) -> Port {
        g.add(Binary::new(kind), &[a, b]).unwrap()
    }

    fn un(g: &mut Graph, kind: UnaryKind, a: Port) -> Port {
        g.add(Unary::new(kind), &[a]).unwrap()
    }

    fn c(g: &mut Graph, v: f64) -> Port {
        g.scalar(DType::F32, v).unwrap()
    }

    /// torch's export of exact GELU: x * 0.5 * (1 + erf(x / 1.4142135)).
    fn erf_gelu(g: &mut Graph, x: Port) -> Port {
        let s = c(g, std::f64::consts::SQRT_2);
        let d = bin(g, Div, x, s);
        let e = un(g, UnaryKind::Erf, d);
        let one = c(g, 1.0);
        let a = bin(g, Add, e, one);
        let m = bin(g, Mul, x, a);
        let half = c(g, 0.5);
        bin(g, Mul, m, half)
    }

    /// GPT-2's gelu_new: 0.5 * x * (1 + tanh(0.7978845608 * (x + 0.044715 * x^3))),
    /// the cube as `Pow` or as products.
    fn tanh_gelu(g: &mut Graph, x: Port, pow: bool, k: f64) -> Port {
        let cube = if pow {
            let three = c(g, 3.0);
            bin(g, Pow, x, three)
        } else {
            let sq = bin(g, Mul, x, x);
            bin(g, Mul, sq, x)
        };
        let kc = c(g, k);
        let t = bin(g, Mul, kc, cube);
        let inner = bin(g, Add, x, t);
        let s = c(g, (2.0 / std::f64::consts::PI).sqrt());
        let scaled = bin(g, Mul, s, inner);
        let th = un(g, UnaryKind::Tanh, scaled);
        let one = c(g, 1.0);
        let a = bin(g, Add, one, th);
        let half = c(g, 0.5);
        let hx = bin(g, Mul, half, x);
        bin(g, Mul, hx, a)
    }

    fn feeds() -> HashMap<&'static str, Tensor> {
        let x: Vec<f64> = (0..256)
            .map(|i| ((i * 37) % 101) as f64 / 25.0 - 2.0)
            .collect();
        let w: Vec<f64> = (0..4096)
            .map(|i| ((i * 13) % 29) as f64 / 29.0 - 0.5)
            .collect();
        HashMap::from([
            ("x", Tensor::from_f64(DType::F32, [4, 64], &x).unwrap()),
            ("w", Tensor::from_f64(DType::F32, [64, 64], &w).unwrap()),
        ])
    }

    /// Runs the pass; the graph's outputs before and after, and how many Gelus.
    fn rewritten(mut g: Graph) -> (Vec<Tensor>, Vec<Tensor>, usize) {
        let before = run(&g, &feeds());
        RecognizeGelu.run(&mut g).unwrap();
        g.validate().unwrap();
        (before, run(&g, &feeds()), count(&g, "Gelu"))
    }

    fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
        (a.iter().zip(b))
            .flat_map(|(x, y)| x.to_f64_vec().into_iter().zip(y.to_f64_vec()))
            .fold(0.0, |m, (x, y)| m.max((x - y).abs()))
    }

    #[test]
    fn both_decomposed_forms_become_one_gelu_computing_the_same() {
        type Body = Box<dyn Fn(&mut Graph, Port) -> Port>;
        let cases: [(&str, Body); 3] = [
            ("erf", Box::new(erf_gelu)),
            (
                "tanh with Pow",
                Box::new(|g, x| tanh_gelu(g, x, true, 0.044715)),
            ),
            (
                "tanh with x*x*x",
                Box::new(|g, x| tanh_gelu(g, x, false, 0.044715)),
            ),
        ];
        for (what, body) in cases {
            let g = graph(body);
            let nodes = g.len();
            let (before, after, gelus) = rewritten(g.clone());
            assert_eq!(gelus, 1, "{what}");
            assert!(
                max_diff(&before, &after) < 1e-5,
                "{what}: {}",
                max_diff(&before, &after)
            );
            let mut g2 = g;
            RecognizeGelu.run(&mut g2).unwrap();
            assert!(
                g2.len() + 7 <= nodes,
                "{what}: {} nodes left of {nodes}",
                g2.len()
            );
            assert_eq!(
                count(&g2, "Erf") + count(&g2, "Tanh") + count(&g2, "Pow"),
                0,
                "{what}"
            );
        }
    }

    #[test]
    fn near_misses_stay_as_written() {
        // A different cubic coefficient, and the sigmoid approximation: not GELU.
        let off = graph(|g, x| tanh_gelu(g, x, true, 0.05));
        assert_eq!(rewritten(off).2, 0);
        let sigmoid = graph(|g, x| {
            let k = c(g, 1.702);
            let s = bin(g, Mul, x, k);
            let sg = un(g, UnaryKind::Sigmoid, s);
            bin(g, Mul, x, sg)
        });
        assert_eq!(rewritten(sigmoid).2, 0);
    }
}
