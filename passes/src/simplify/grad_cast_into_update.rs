//! Optimizer updates that read their gradient through a Cast read the Cast's input.
//!
//! BF16 AMP without loss scaling hands each f32 variable's update `Cast<f32>(g)` of
//! its 16-bit gradient: a kernel that reads `g` and writes it twice as wide, for the
//! update to read back. The update's kernel widens its gradient as it loads it (an
//! `OptimizerUpdate` takes a gradient of any float dtype), and widening bf16 or f16
//! to f32 is exact, so reading `g` gives the same bits (`grad-cast-into-update`). With
//! loss scaling, `unscale-into-update` reads through the Cast under the unscaling.
//!
//! The fusions that fold a bias gradient's Sum into the kernel computing the summed
//! tensor (a layer norm's gradient, a GELU's, an attention's) sum in f32 and leave a
//! Cast to the Sum's bf16: a launch of its own for a few thousand values. The update
//! then reads the f32 sums and rounds them as it loads them, as the Cast did
//! (`grad-round-into-update`, after those fusions). A Cast left unread goes.

use ampgraph_graph::ops::{Cast, OptimizerUpdate};
use ampgraph_graph::{DType, Graph, NodeId, Port};

use crate::rewrite::{lossless_cast, output_nodes, remove_unread, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `grad-cast-into-update` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GradCastIntoUpdate;

/// The `grad-round-into-update` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GradRoundIntoUpdate;

/// The narrower input a widening Cast at `p` reads, where the cast loses nothing.
fn widened(g: &Graph, p: Port) -> Option<Port> {
    lossless_cast(g, p).filter(|&x| g.ty(x).dtype != g.ty(p).dtype)
}

/// The wider float input a narrowing float Cast at `p` reads, and the Cast's dtype.
fn narrowed(g: &Graph, p: Port) -> Option<(Port, DType)> {
    let to = g.node(p.node).op.downcast_ref::<Cast>()?.to;
    let &[x] = &g.inputs(p.node)[..] else {
        return None;
    };
    let from = g.ty(x).dtype;
    (to.is_float() && from.is_float() && to.size_bytes() < from.size_bytes()).then_some((x, to))
}

/// Each update whose gradient `through` takes (the Cast's input and the update as it
/// then reads it) reads it so; the Casts left unread go. Returns the updates changed,
/// the Casts removed and their outputs' bytes.
fn fold(
    g: &mut Graph,
    through: impl Fn(&Graph, Port, &OptimizerUpdate) -> Option<(Port, OptimizerUpdate)>,
) -> Result<(usize, usize, usize), PassError> {
    let updates: Vec<NodeId> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<OptimizerUpdate>())
        .collect();
    let (mut folded, mut casts) = (0usize, Vec::new());
    for update in updates {
        let mut inputs = g.inputs(update).to_vec();
        let Some(op) = g.node(update).op.downcast_ref::<OptimizerUpdate>() else {
            continue;
        };
        let Some((read, op)) = inputs.get(2).and_then(|&p| through(g, p, op)) else {
            continue;
        };
        casts.push(inputs[2].node);
        inputs[2] = read;
        g.set_node(update, Box::new(op), &inputs)?;
        folded += 1;
    }
    let (removed, bytes) = remove_unread(g, casts, &output_nodes(g))?;
    Ok((folded, removed, bytes))
}

impl Pass for GradCastIntoUpdate {
    fn name(&self) -> &'static str {
        "grad-cast-into-update"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (folded, removed, bytes) = fold(g, |g, p, op| {
            widened(g, p).map(|narrow| (narrow, op.clone()))
        })?;
        // Each was written once and read back once.
        let lines = vec![format!(
            "grad-cast-into-update: {folded} optimizer updates read their 16-bit gradients; \
             removed {removed} widening casts ({} of tensors no longer written and read back)",
            format_bytes(2 * bytes as u64)
        )];
        Ok(summary("grad-cast-into-update", lines))
    }
}

impl Pass for GradRoundIntoUpdate {
    fn name(&self) -> &'static str {
        "grad-round-into-update"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (folded, removed, _) = fold(g, |g, p, op| {
            let (wide, to) = narrowed(g, p).filter(|_| op.grad_rounded_to.is_none())?;
            let op = OptimizerUpdate {
                grad_rounded_to: Some(to),
                ..op.clone()
            };
            Some((wide, op))
        })?;
        let lines = vec![format!(
            "grad-round-into-update: {folded} optimizer updates round their gradients as they read them; \
             removed {removed} narrowing casts (a launch each)"
        )];
        Ok(summary("grad-round-into-update", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{count, run as run_cpu};
    use ampgraph_graph::ops::{Rule, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    /// AdamW on two f32 variables whose gradients are bf16 cast to f32; with `leak`,
    /// a Relu reads the first cast too; `narrowing` makes the second gradient f64
    /// (cast down to f32: not exact, so not folded).
    fn graph(leak: bool, narrowing: bool) -> Graph {
        let mut g = Graph::new();
        let input = |g: &mut Graph, name: &str, dtype, shape: &[usize]| {
            g.placeholder(name, dtype, shape).unwrap()
        };
        let finite = input(&mut g, "finite", DType::Bool, &[]);
        let step = input(&mut g, "step", DType::I64, &[]);
        let adamw = Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            decoupled: true,
        };
        let mut outputs = Vec::new();
        let mut casts = Vec::new();
        for (k, shape) in [[4, 3], [3, 2]].iter().enumerate() {
            let dtype = if narrowing && k == 1 {
                DType::F64
            } else {
                DType::BF16
            };
            let grad = input(&mut g, &format!("grad{k}"), dtype, shape);
            let wide = g.add(Cast { to: DType::F32 }, &[grad]).unwrap();
            casts.push(wide);
            let var = input(&mut g, &format!("w{k}"), DType::F32, shape);
            let m = input(&mut g, &format!("m{k}"), DType::F32, shape);
            let v = input(&mut g, &format!("v{k}"), DType::F32, shape);
            let update = OptimizerUpdate::new(adamw, 0.01, 0.1);
            let node = g.add(update, &[finite, var, wide, m, v, step]).unwrap();
            outputs.extend([node, Port::new(node.node, 1), Port::new(node.node, 2)]);
        }
        if leak {
            outputs.push(g.add(Unary::new(UnaryKind::Relu), &[casts[0]]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds() -> std::collections::HashMap<&'static str, Tensor> {
        let t = |dtype, shape: &[usize], f: &dyn Fn(usize) -> f64| {
            let n = shape.iter().product();
            let v: Vec<f64> = (0..n).map(f).collect();
            Tensor::from_f64(dtype, shape.to_vec(), &v).unwrap()
        };
        [
            ("finite", Tensor::scalar(DType::Bool, 1.0)),
            ("step", Tensor::scalar(DType::I64, 3.0)),
            ("grad0", t(DType::BF16, &[4, 3], &|i| 0.37 * i as f64 - 1.9)),
            (
                "grad1",
                t(DType::BF16, &[3, 2], &|i| 1.0 / (1.0 + i as f64)),
            ),
            ("w0", t(DType::F32, &[4, 3], &|i| 0.1 * i as f64)),
            ("w1", t(DType::F32, &[3, 2], &|i| 1.0 - 0.3 * i as f64)),
            ("m0", t(DType::F32, &[4, 3], &|i| 0.01 * i as f64)),
            ("m1", t(DType::F32, &[3, 2], &|i| -0.02 * i as f64)),
            ("v0", t(DType::F32, &[4, 3], &|i| 0.001 * i as f64)),
            ("v1", t(DType::F32, &[3, 2], &|i| 0.003 * i as f64)),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn the_updates_read_the_16_bit_gradients_with_the_same_bits() {
        let before = graph(false, false);
        let mut after = before.clone();
        let s = GradCastIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert_eq!(count(&after, "Cast"), 0);
        assert!(
            s.lines[0].contains("2 optimizer updates") && s.lines[0].contains("2 widening casts"),
            "{:?}",
            s.lines
        );
        assert_eq!(run_cpu(&before, &feeds()), run_cpu(&after, &feeds()));
        // Idempotent.
        let mut again = after.clone();
        GradCastIntoUpdate.run(&mut again).unwrap();
        assert_eq!(again.len(), after.len());
    }

    /// Momentum SGD on two f32 variables whose gradients are f32 sums rounded to
    /// bf16 by a Cast (as the fusions leave a bias gradient); with `leak`, a Relu
    /// reads the first cast too.
    fn rounded_graph(leak: bool) -> Graph {
        let mut g = Graph::new();
        let finite = g.placeholder("finite", DType::Bool, []).unwrap();
        let mut outputs = Vec::new();
        let mut casts = Vec::new();
        for k in 0..2 {
            let sum = g.placeholder(format!("sum{k}"), DType::F32, [5]).unwrap();
            let rounded = g.add(Cast { to: DType::BF16 }, &[sum]).unwrap();
            casts.push(rounded);
            let var = g.placeholder(format!("w{k}"), DType::F32, [5]).unwrap();
            let b = g.placeholder(format!("b{k}"), DType::F32, [5]).unwrap();
            let momentum = Rule::Sgd {
                momentum: 0.9,
                nesterov: false,
            };
            let sgd = OptimizerUpdate::new(momentum, 0.5, 0.0);
            let node = g.add(sgd, &[finite, var, rounded, b]).unwrap();
            outputs.extend([node, Port::new(node.node, 1)]);
        }
        if leak {
            outputs.push(g.add(Unary::new(UnaryKind::Relu), &[casts[0]]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    /// Sums whose bf16 rounding changes them (below bf16's precision), values and
    /// momentum buffers.
    fn rounded_feeds() -> std::collections::HashMap<&'static str, Tensor> {
        let t = |f: &dyn Fn(f64) -> f64| {
            let v: Vec<f64> = (0..5).map(|i| f(i as f64)).collect();
            Tensor::from_f64(DType::F32, vec![5], &v).unwrap()
        };
        [
            ("finite", Tensor::scalar(DType::Bool, 1.0)),
            ("sum0", t(&|i| 1.0 + i * 1.0e-3)),
            ("sum1", t(&|i| -3.0 + i * 7.0e-4)),
            ("w0", t(&|i| 0.25 * i)),
            ("w1", t(&|i| 1.0 - 0.5 * i)),
            ("b0", t(&|i| 0.01 * i)),
            ("b1", t(&|i| -0.02 * i)),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn the_updates_round_the_wide_sums_as_the_casts_did() {
        let before = rounded_graph(false);
        let mut after = before.clone();
        let s = GradRoundIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert_eq!(count(&after, "Cast"), 0, "{:?}", s.lines);
        assert!(s.lines[0].contains("2 optimizer updates"), "{:?}", s.lines);
        let feeds = rounded_feeds();
        let (plain, folded) = (run_cpu(&before, &feeds), run_cpu(&after, &feeds));
        assert_eq!(plain, folded);
        // The rounding matters: reading the sums unrounded gives other weights.
        let mut unrounded = after.clone();
        for id in unrounded.node_ids().collect::<Vec<_>>() {
            if let Some(u) = unrounded.node(id).op.downcast_ref::<OptimizerUpdate>() {
                let op = OptimizerUpdate {
                    grad_rounded_to: None,
                    ..u.clone()
                };
                let inputs = unrounded.inputs(id).to_vec();
                unrounded.set_node(id, Box::new(op), &inputs).unwrap();
            }
        }
        assert_ne!(run_cpu(&unrounded, &feeds)[0], plain[0]);
        // Idempotent; a cast something else reads stays.
        let mut again = after.clone();
        let s = GradRoundIntoUpdate.run(&mut again).unwrap();
        assert!(s.lines[0].contains(" 0 optimizer updates"), "{:?}", s.lines);
        assert_eq!(again.len(), after.len());
        let mut leaky = rounded_graph(true);
        GradRoundIntoUpdate.run(&mut leaky).unwrap();
        assert_eq!(count(&leaky, "Cast"), 1);
    }

    #[test]
    fn a_cast_something_else_reads_stays_and_a_narrowing_one_is_not_folded() {
        let mut g = graph(true, false);
        GradCastIntoUpdate.run(&mut g).unwrap();
        g.validate().unwrap();
        assert_eq!(count(&g, "Cast"), 1, "the Relu still reads the first cast");
        let mut g = graph(false, true);
        let s = GradCastIntoUpdate.run(&mut g).unwrap();
        assert_eq!(count(&g, "Cast"), 1, "{:?}", s.lines);
        assert!(s.lines[0].contains("1 optimizer updates"), "{:?}", s.lines);
    }
}
