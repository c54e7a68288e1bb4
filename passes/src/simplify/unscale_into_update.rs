//! Loss-scale unscaling folded into the finiteness check and the optimizer updates.
//!
//! Dynamic loss scaling unscales each gradient as `Mul(Cast<f32>(g), 1/scale)`,
//! checks `AllFinite` over the products and feeds them to the optimizer. After fp16
//! AMP the gradient `g` is f16, so each product is an f32 copy of a gradient: written
//! once, read twice. This pass hands `g` itself to `AllFinite { scaled }` and to
//! `OptimizerUpdate { grad_scale }` with the scale as a last input; both multiply in
//! the product's dtype as the Mul did, so the check and the update see the same values,
//! bit for bit. Each gradient is then read in 16 bits, twice, and never written again.
//!
//! It folds an `AllFinite` only when every input is such a product by the same scalar,
//! each product read by nothing but the check and updates of variables of its dtype
//! (f32 or f64): the step either reads no product or still needs them all. Other f32
//! scalars among the inputs (delayed FP8 scaling's amaxes) are then checked times the
//! scale too, which keeps their finiteness: a dynamic loss scale is never below 1, so
//! its inverse makes no finite scalar infinite.

use ampgraph_graph::ops::{AllFinite, Binary, BinaryKind, Cast, OptimizerUpdate};
use ampgraph_graph::{DType, Graph, NodeId, Port, TensorType};

use crate::rewrite::{lossless_cast, output_nodes, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `unscale-into-update` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct UnscaleIntoUpdate;

/// One unscaled gradient: `product = Mul(cast?(grad), scale)`.
struct Unscaled {
    product: NodeId,
    /// The Cast between the gradient and the Mul, if any.
    cast: Option<NodeId>,
    grad: Port,
    scale: Port,
    /// The updates reading the product as their gradient.
    updates: Vec<NodeId>,
}

/// An unscaling `Mul(cast?(grad), scale)`: the gradient read through a Cast that
/// loses nothing, the scalar, and that Cast.
pub(crate) struct Unscaling {
    pub grad: Port,
    pub scale: Port,
    pub cast: Option<NodeId>,
}

/// `p` as an unscaling: a product of a tensor of its type (or a lossless cast of one)
/// by a scalar of its dtype.
pub(crate) fn unscaling(g: &Graph, p: Port) -> Option<Unscaling> {
    if g.node(p.node).op.downcast_ref::<Binary>()?.kind != BinaryKind::Mul {
        return None;
    }
    let dtype = g.ty(p).dtype;
    let &[a, b] = &g.inputs(p.node)[..] else {
        return None;
    };
    let is_scale = |s: Port| {
        let ty = g.ty(s);
        ty.shape.is_empty() && ty.dtype == dtype
    };
    // The scalar is the second operand as optim.rs builds it; either order multiplies
    // the same.
    let (x, scale) = if is_scale(b) && g.ty(a) == g.ty(p) {
        (a, b)
    } else if is_scale(a) && g.ty(b) == g.ty(p) {
        (b, a)
    } else {
        return None;
    };
    // A Cast that loses nothing (f16 -> f32, or to its own type) is read through.
    let cast = lossless_cast(g, x).map(|from| (x.node, from));
    Some(Unscaling {
        grad: cast.map_or(x, |c| c.1),
        scale,
        cast: cast.map(|c| c.0),
    })
}

/// `p` as an unscaled gradient read only by `check` and optimizer updates of its dtype.
fn unscaled(g: &Graph, p: Port, check: NodeId, is_output: &[bool]) -> Option<Unscaled> {
    if is_output[p.node.index()] {
        return None;
    }
    let Unscaling { grad, scale, cast } = unscaling(g, p)?;
    let dtype = g.ty(p).dtype;
    let mut updates = Vec::new();
    for (reader, slot, _) in g.consumers(p.node) {
        if reader == check {
            continue;
        }
        let update = g.node(reader).op.downcast_ref::<OptimizerUpdate>()?;
        let var = g.inputs(reader)[1];
        if slot != 2 || update.grad_scale || g.ty(var).dtype != dtype {
            return None;
        }
        updates.push(reader);
    }
    Some(Unscaled {
        product: p.node,
        cast,
        grad,
        scale,
        updates,
    })
}

impl Pass for UnscaleIntoUpdate {
    fn name(&self) -> &'static str {
        "unscale-into-update"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let checks: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| {
                g.node(id)
                    .op
                    .downcast_ref::<AllFinite>()
                    .is_some_and(|a| !a.scaled)
            })
            .collect();
        let (mut folded_checks, mut folded_updates) = (0usize, 0usize);
        let mut dead: Vec<NodeId> = Vec::new();
        for check in checks {
            let (mut found, mut scalars) = (Vec::new(), Vec::new());
            let foldable = g.inputs(check).iter().all(|&p| {
                // A product the check reads twice (cse makes two variables' equal
                // gradients one) is folded once: its updates gain the scale once.
                if found.iter().any(|u: &Unscaled| u.product == p.node) {
                    true
                } else if let Some(u) = unscaled(g, p, check, &is_output) {
                    found.push(u);
                    true
                } else if *g.ty(p) == TensorType::new(DType::F32, []) {
                    scalars.push(p);
                    true
                } else {
                    false
                }
            });
            if !foldable || found.is_empty() {
                continue;
            }
            let scale = found[0].scale;
            if found.iter().any(|u| u.scale != scale) {
                continue;
            }
            let mut inputs: Vec<Port> = found.iter().map(|u| u.grad).collect();
            inputs.extend(scalars);
            inputs.push(scale);
            g.set_node(check, Box::new(AllFinite { scaled: true }), &inputs)?;
            folded_checks += 1;
            for u in &found {
                for &update in &u.updates {
                    let Some(op) = g.node(update).op.downcast_ref::<OptimizerUpdate>() else {
                        continue;
                    };
                    let op = OptimizerUpdate {
                        grad_scale: true,
                        ..op.clone()
                    };
                    let mut inputs = g.inputs(update).to_vec();
                    inputs[2] = u.grad;
                    inputs.push(scale);
                    g.set_node(update, Box::new(op), &inputs)?;
                    folded_updates += 1;
                }
                dead.push(u.product);
                dead.extend(u.cast);
            }
        }
        // Products first, then the casts only they read.
        let mut seen = std::collections::HashSet::new();
        dead.retain(|id| seen.insert(*id));
        let (mut products, mut casts, mut bytes) = (0usize, 0usize, 0usize);
        for id in dead {
            if is_output[id.index()] || !g.consumers(id).is_empty() {
                continue;
            }
            let node = g.node(id);
            bytes += node.outputs()[0].size_bytes();
            if node.op.is::<Cast>() {
                casts += 1;
            } else {
                products += 1;
            }
            g.remove_node(id)?;
        }
        let lines = vec![
            format!(
                "unscale-into-update: {folded_checks} finiteness checks and {folded_updates} optimizer updates read the scaled gradients and unscale them as they go"
            ),
            format!(
                "unscale-into-update: removed {products} unscaling products and {casts} casts ({} of tensors no longer written, and read back)",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("unscale-into-update", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{count, run as run_cpu};
    use ampgraph_graph::ops::{Placeholder, Rule, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor, TensorType};

    /// A Placeholder `name` of `dtype` and `shape`.
    fn input(g: &mut Graph, name: &str, dtype: DType, shape: &[usize]) -> Port {
        let ty = TensorType::new(dtype, shape.to_vec());
        g.add_node(name, Box::new(Placeholder(ty)), &[])
            .unwrap()
            .into()
    }

    /// Two f16 gradients unscaled by `1/scale` (the second by `other_scale` when
    /// given), checked, and applied by SGD to two f32 variables; with `leak`, a Relu
    /// output also reads the first product.
    fn graph(other_scale: bool, leak: bool) -> Graph {
        let mut g = Graph::new();
        let scale = input(&mut g, "inv_scale", DType::F32, &[]);
        let other = input(&mut g, "other_scale", DType::F32, &[]);
        let mut products = Vec::new();
        for (k, shape) in [[4, 3], [3, 2]].iter().enumerate() {
            let grad = input(&mut g, &format!("grad{k}"), DType::F16, shape);
            let wide = g.add(Cast { to: DType::F32 }, &[grad]).unwrap();
            let s = if other_scale && k == 1 { other } else { scale };
            products.push(g.add(Binary::new(BinaryKind::Mul), &[wide, s]).unwrap());
        }
        let finite = g.add(AllFinite::default(), &products).unwrap();
        let mut outputs = Vec::new();
        for (k, &p) in products.iter().enumerate() {
            let shape = g.ty(p).shape.clone();
            let var = input(&mut g, &format!("w{k}"), DType::F32, &shape);
            let sgd = OptimizerUpdate::new(Rule::PLAIN_SGD, 0.5, 0.0);
            outputs.push(g.add(sgd, &[finite, var, p]).unwrap());
        }
        if leak {
            outputs.push(g.add(Unary::new(UnaryKind::Relu), &[products[0]]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    #[test]
    fn the_check_and_the_updates_read_the_16_bit_gradients() {
        let before = graph(false, false);
        let mut after = before.clone();
        let s = UnscaleIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert_eq!((count(&after, "Mul"), count(&after, "Cast")), (0, 0));
        assert!(
            s.lines[1].contains("2 unscaling products and 2 casts"),
            "{:?}",
            s.lines
        );
        let check = after
            .node_ids()
            .find(|&id| after.node(id).op_name() == "AllFinite");
        let check = check.unwrap();
        assert_eq!(after.inputs(check).len(), 3, "two gradients and the scale");
        assert!(after
            .inputs(check)
            .iter()
            .take(2)
            .all(|&p| after.ty(p).dtype == DType::F16));
        // Idempotent.
        let mut again = after.clone();
        UnscaleIntoUpdate.run(&mut again).unwrap();
        assert_eq!(again.len(), after.len());
        // The same updates, bit for bit, and the same skip when a product overflows
        // f32 (60000 * 1e35) though the f16 gradient is finite.
        for inv_scale in [1.0 / 1024.0, 1e35] {
            let t = |dtype, shape: &[usize], f: &dyn Fn(usize) -> f64| {
                let n = shape.iter().product();
                let v: Vec<f64> = (0..n).map(f).collect();
                Tensor::from_f64(dtype, shape.to_vec(), &v).unwrap()
            };
            let feeds: std::collections::HashMap<&str, Tensor> = [
                ("inv_scale", Tensor::scalar(DType::F32, inv_scale)),
                ("other_scale", Tensor::scalar(DType::F32, 1.0)),
                (
                    "grad0",
                    t(DType::F16, &[4, 3], &|i| 60000.0 - 997.0 * i as f64),
                ),
                ("grad1", t(DType::F16, &[3, 2], &|i| i as f64 / 3.0)),
                ("w0", t(DType::F32, &[4, 3], &|i| 0.1 * i as f64)),
                ("w1", t(DType::F32, &[3, 2], &|i| 1.0 - 0.3 * i as f64)),
            ]
            .into_iter()
            .collect();
            let (want, got) = (run_cpu(&before, &feeds), run_cpu(&after, &feeds));
            assert_eq!(want, got, "inv_scale {inv_scale}");
        }
    }

    /// Two variables with one gradient (cse makes equal gradients one product, which
    /// the check then reads twice): each update gains the scale once, and the step
    /// is the same, bit for bit.
    #[test]
    fn a_product_the_check_reads_twice_is_folded_once() {
        let mut before = Graph::new();
        let g = &mut before;
        let scale = input(g, "inv_scale", DType::F32, &[]);
        let grad = input(g, "grad", DType::F16, &[3]);
        let wide = g.add(Cast { to: DType::F32 }, &[grad]).unwrap();
        let product = g.add(Binary::new(BinaryKind::Mul), &[wide, scale]).unwrap();
        let finite = g.add(AllFinite::default(), &[product, product]).unwrap();
        let mut outputs = Vec::new();
        for name in ["w0", "w1"] {
            let var = input(g, name, DType::F32, &[3]);
            let sgd = OptimizerUpdate::new(Rule::PLAIN_SGD, 0.5, 0.0);
            outputs.push(g.add(sgd, &[finite, var, product]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        let mut after = before.clone();
        UnscaleIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert_eq!((count(&after, "Mul"), count(&after, "Cast")), (0, 0));
        let t = |dtype, v: &[f64]| Tensor::from_f64(dtype, vec![v.len()], v).unwrap();
        let feeds: std::collections::HashMap<&str, Tensor> = [
            ("inv_scale", Tensor::scalar(DType::F32, 1.0 / 1024.0)),
            ("grad", t(DType::F16, &[1024.0, -3.0, 0.5])),
            ("w0", t(DType::F32, &[1.0, 2.0, 3.0])),
            ("w1", t(DType::F32, &[-1.0, 0.0, 0.25])),
        ]
        .into_iter()
        .collect();
        assert_eq!(run_cpu(&before, &feeds), run_cpu(&after, &feeds));
    }

    /// [`graph`]'s check also reading a Placeholder `extra` of `shape` (an amax).
    fn graph_with_extra_check(shape: &[usize]) -> Graph {
        let mut g = graph(false, false);
        let extra = input(&mut g, "extra", DType::F32, shape);
        let check = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<AllFinite>())
            .unwrap();
        let mut inputs = g.inputs(check);
        inputs.push(extra);
        g.set_node(check, Box::new(AllFinite::default()), &inputs)
            .unwrap();
        g
    }

    /// An f32 scalar beside the products (delayed FP8 scaling's amax) is checked
    /// times the scale: the same skips for finite, infinite and NaN amaxes. A larger
    /// tensor keeps the check unfolded.
    #[test]
    fn a_scalar_beside_the_products_is_checked_with_them() {
        let before = graph_with_extra_check(&[]);
        let mut after = before.clone();
        UnscaleIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert_eq!(count(&after, "Mul"), 0);
        for amax in [3.0, f64::INFINITY, f64::NAN] {
            let feeds: std::collections::HashMap<&str, Tensor> = [
                ("inv_scale", Tensor::scalar(DType::F32, 1.0 / 1024.0)),
                ("other_scale", Tensor::scalar(DType::F32, 1.0)),
                (
                    "grad0",
                    Tensor::from_f64(DType::F16, [4, 3], &[2.0; 12]).unwrap(),
                ),
                (
                    "grad1",
                    Tensor::from_f64(DType::F16, [3, 2], &[-1.0; 6]).unwrap(),
                ),
                (
                    "w0",
                    Tensor::from_f64(DType::F32, [4, 3], &[0.5; 12]).unwrap(),
                ),
                (
                    "w1",
                    Tensor::from_f64(DType::F32, [3, 2], &[0.25; 6]).unwrap(),
                ),
                ("extra", Tensor::scalar(DType::F32, amax)),
            ]
            .into_iter()
            .collect();
            let (want, got) = (run_cpu(&before, &feeds), run_cpu(&after, &feeds));
            assert_eq!(want, got, "amax {amax}");
        }
        let mut wide = graph_with_extra_check(&[2]);
        UnscaleIntoUpdate.run(&mut wide).unwrap();
        assert_eq!(count(&wide, "Mul"), 2);
    }

    #[test]
    fn other_readers_or_scales_leave_the_products() {
        for (other_scale, leak) in [(true, false), (false, true)] {
            let mut g = graph(other_scale, leak);
            let nodes = g.len();
            UnscaleIntoUpdate.run(&mut g).unwrap();
            assert_eq!(g.len(), nodes, "other scale {other_scale}, leak {leak}");
            assert_eq!(count(&g, "Mul"), 2);
        }
    }
}
