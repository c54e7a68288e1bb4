//! GEMM epilogues: `MatMul -> BiasAdd [-> Relu | tanh-GELU]` becomes one
//! [`FusedMatMul`], whose bias and activation the CUDA executor folds into the
//! cuBLASLt call (PyTorch's `addmm` and `F.linear` do the same with the bias); an
//! `Fp8MatMul` stored in 16 bits takes its BiasAdd likewise ([`Fp8MatMul::bias`]), and
//! its residual Add (below).
//!
//! A product fuses only with the BiasAdd that is its sole reader, and an activation
//! only where it is the BiasAdd's sole reader: an intermediate someone else reads (the
//! pre-activation a GELU's gradient needs in a training graph, a graph output) has to
//! exist, so it stays unfused. (A Relu's gradient reads the Relu's output, so Relus
//! fuse in training too. cuBLASLt's `GELU_AUX_BIAS` and `DGELU[_BGRAD]` epilogues,
//! which would keep the pre-activation or apply the gradient, measured slower on the
//! H100 than the plain epilogue plus a generated kernel: docs/passes.md.) Then a
//! fused product without an activation (or an FP8 product stored in 16 bits, with or
//! without its bias) whose sole reader is an `Add` of a tensor of
//! its own type (a residual connection), directly or through a Reshape of its rows
//! (`[B*S, D]` back to `[B, S, D]`, as exporters write a Linear), adds that
//! tensor itself (`FusedMatMul::residual`, cuBLASLt's `C` with beta 1), and a 16-bit
//! fused product whose sole reader is a Cast to f32 (AMP's cast back before the loss
//! or a graph output) stores its result in f32 itself (`FusedMatMul::to`). The fused
//! node takes the name of the last node it replaces.

use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::ops::{
    BiasAdd, Binary, BinaryKind, Cast, DataFormat, Epilogue, Fp8MatMul, FusedMatMul, MatMul,
    Reshape, Unary,
};
use ampgraph_graph::{DType, Graph, NodeId, Op, Port};

use crate::rewrite::{dims, node_error};
use crate::{Pass, PassError, PassSummary};

/// The GEMM-epilogue pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GemmEpilogue;

/// One product with what folds into it.
struct Candidate {
    matmul: NodeId,
    bias_add: NodeId,
    /// The activation node and its epilogue, when one fuses too.
    activation: Option<(NodeId, Epilogue)>,
}

/// The node that alone reads `port`, when exactly one node reads it through one slot
/// and it is not a graph output.
fn sole_reader(g: &Graph, adj: &Adjacency, port: Port) -> Option<NodeId> {
    if g.outputs().contains(&port) || adj.consumers(port.node).any(|(_, _, p)| p != port) {
        return None;
    }
    let mut readers = adj.port_consumers(port);
    match (readers.next(), readers.next()) {
        (Some((reader, _)), None) => Some(reader),
        _ => None,
    }
}

/// Each fused product (a FusedMatMul, or an Fp8MatMul) with the node that alone reads
/// its product.
fn products_and_readers<'g>(
    g: &'g Graph,
    adj: &'g Adjacency,
) -> impl Iterator<Item = (NodeId, &'g dyn Op, NodeId)> + 'g {
    g.node_ids().filter_map(move |id| {
        let op = g.node(id).op.as_ref();
        (op.is::<FusedMatMul>() || op.is::<Fp8MatMul>()).then_some(())?;
        Some((id, op, sole_reader(g, adj, Port::new(id, 0))?))
    })
}

/// What the folds taken so far do to each node: a later fold may neither remove a node
/// an earlier one reads or rewrites, nor read or rewrite one it removed (ResNet's
/// `Add(conv, downsample conv)`: each product alone reads the Add, one takes it).
#[derive(Clone, Copy, PartialEq)]
enum Claim {
    Free,
    Read,
    Rewritten,
    Removed,
}

struct Claims(Vec<Claim>);

impl Claims {
    fn new(g: &Graph) -> Self {
        Claims(vec![Claim::Free; g.node_bound()])
    }

    /// Takes a fold that removes `removed`, rewrites `rewritten` in place (its output
    /// keeps its type) and reads `read`, unless it conflicts with one taken before.
    fn take(&mut self, removed: &[NodeId], rewritten: NodeId, read: Option<Port>) -> bool {
        let at = |id: NodeId| self.0[id.index()];
        let free = removed.iter().all(|&id| at(id) == Claim::Free)
            && matches!(at(rewritten), Claim::Free | Claim::Read)
            && read.is_none_or(|p| at(p.node) != Claim::Removed);
        if free {
            for &id in removed {
                self.0[id.index()] = Claim::Removed;
            }
            self.0[rewritten.index()] = Claim::Rewritten;
            if let Some(claim) = read.map(|p| &mut self.0[p.node.index()]) {
                if *claim == Claim::Free {
                    *claim = Claim::Read;
                }
            }
        }
        free
    }
}

/// Folds into each fused product the node that alone reads it where `fold` (given the
/// product, the fused op and that reader) says how: the op to become and an extra
/// input. The fused node replaces the reader (and takes its name). Returns the folds
/// and the bytes of the products no longer written and read back.
fn fold_sole_readers(
    g: &mut Graph,
    fold: impl Fn(&Graph, Port, &dyn Op, NodeId) -> Option<(Box<dyn Op>, Option<Port>)>,
) -> Result<(usize, usize), PassError> {
    let adj = g.adjacency();
    let mut claims = Claims::new(g);
    let mut folds = Vec::new();
    for (id, fused, reader) in products_and_readers(g, &adj) {
        let product = Port::new(id, 0);
        if let Some((op, extra)) = fold(g, product, fused, reader) {
            if claims.take(&[id], reader, extra) {
                folds.push((id, reader, op, extra));
            }
        }
    }
    let mut bytes = 0;
    let count = folds.len();
    for (id, reader, op, extra) in folds {
        bytes += 2 * g.ty(Port::new(id, 0)).size_bytes();
        let mut inputs = g.inputs(id).to_vec();
        inputs.extend(extra);
        g.set_node(reader, op, &inputs)?;
        g.remove_node(id)?;
    }
    Ok((count, bytes))
}

/// A 16-bit FusedMatMul read only by a Cast to f32 stores its result in f32.
fn fold_output_casts(g: &mut Graph) -> Result<(usize, usize), PassError> {
    fold_sole_readers(g, |g, product, op, cast| {
        let fused = op.downcast_ref::<FusedMatMul>()?;
        let narrow = matches!(g.ty(product).dtype, DType::F16 | DType::BF16);
        let to_f32 = g.node(cast).op.downcast_ref::<Cast>().map(|c| c.to) == Some(DType::F32);
        (narrow && to_f32 && fused.to.is_none() && !fused.residual).then(|| {
            let wide = FusedMatMul {
                to: Some(DType::F32),
                ..fused.clone()
            };
            (Box::new(wide) as Box<dyn Op>, None)
        })
    })
}

/// A FusedMatMul without an activation, or an Fp8MatMul storing 16 bits, read only by
/// an `Add` whose other addend has the product's type (a residual connection) adds
/// that addend itself (cuBLASLt's `C`).
/// The product may reach the Add through a Reshape read by it alone (an exporter's
/// `[B*S, D]` rows back to `[B, S, D]`, a view): the addend is then viewed as the
/// product's rows, and the Add becomes the view of the fused product (keeping its name
/// for its readers). Returns the folds and the bytes no longer written and read back.
fn fold_residual_adds(g: &mut Graph) -> Result<(usize, usize), PassError> {
    let (direct, mut bytes) = fold_sole_readers(g, |g, product, op, add| {
        let other = residual_addend(g, product, add)?;
        let fused = with_residual(op).filter(|_| g.ty(other) == g.ty(product))?;
        Some((fused, Some(other)))
    })?;
    let adj = g.adjacency();
    let mut claims = Claims::new(g);
    let mut through_views = Vec::new();
    for (id, op, view) in products_and_readers(g, &adj) {
        if !g.node(view).op.is::<Reshape>() {
            continue;
        }
        let Some(fused) = with_residual(op) else {
            continue;
        };
        let viewed = Port::new(view, 0);
        let Some(add) = sole_reader(g, &adj, viewed) else {
            continue;
        };
        let Some(other) = residual_addend(g, viewed, add) else {
            continue;
        };
        if g.ty(other) == g.ty(viewed) && claims.take(&[id, view], add, Some(other)) {
            through_views.push((id, view, add, other, fused));
        }
    }
    let folds = through_views.len();
    for (id, view, add, other, op) in through_views {
        let rows = g.ty(Port::new(id, 0)).shape.clone();
        let shape = g.ty(Port::new(add, 0)).shape.clone();
        let name = g.fresh_name(format!("{}/residual", g.node(add).name));
        let addend = g.add_node(name, Box::new(Reshape::new(dims(&rows))), &[other])?;
        let mut inputs = g.inputs(id).to_vec();
        inputs.push(addend.into());
        let name = g.fresh_name(format!("{}/product", g.node(add).name));
        let fused = g.add_node(name, op, &inputs)?;
        g.set_node(add, Box::new(Reshape::new(dims(&shape))), &[fused.into()])?;
        g.remove_node(view)?;
        bytes += 2 * g.ty(Port::new(id, 0)).size_bytes();
        g.remove_node(id)?;
    }
    Ok((direct + folds, bytes))
}

/// The fused product adding a residual, where it can take one: a FusedMatMul without
/// an activation, cast or residual yet; an Fp8MatMul storing 16 bits without one.
fn with_residual(op: &dyn Op) -> Option<Box<dyn Op>> {
    if let Some(fused) = op.downcast_ref::<FusedMatMul>() {
        let plain = !fused.residual && fused.to.is_none() && fused.epilogue.activation().is_none();
        return plain.then(|| {
            Box::new(FusedMatMul {
                residual: true,
                ..fused.clone()
            }) as Box<dyn Op>
        });
    }
    let fp8 = op.downcast_ref::<Fp8MatMul>().filter(|p| !p.residual)?;
    Some(Box::new(fp8.clone().with_residual(true).ok()?))
}

/// The other addend of `add` when it is an `Add` reading `value` in one slot.
fn residual_addend(g: &Graph, value: Port, add: NodeId) -> Option<Port> {
    let is_add = g.node(add).op.downcast_ref::<Binary>().map(|b| b.kind) == Some(BinaryKind::Add);
    let inputs = g.inputs(add);
    let other = inputs.iter().copied().find(|&p| p != value)?;
    (is_add && inputs.len() == 2).then_some(other)
}

fn find(g: &Graph) -> Result<Vec<Candidate>, PassError> {
    let adj = g.adjacency();
    let mut found = Vec::new();
    for id in g.topo_order_in(&adj)? {
        let Some(bias_add) = g.node(id).op.downcast_ref::<BiasAdd>() else {
            continue;
        };
        let [x, _bias] = adj.inputs(id) else {
            continue;
        };
        // NCHW on a matrix also adds along the last axis.
        let along_columns = bias_add.data_format == DataFormat::Nhwc || g.ty(*x).rank() == 2;
        // cuBLASLt's epilogues take f32, f16 and bf16 products, and FP8 products
        // stored in 16 bits (their bias only).
        let op = &g.node(x.node).op;
        let fp8 = op
            .downcast_ref::<Fp8MatMul>()
            .is_some_and(|p| !p.bias && p.can_take_bias());
        let is_product = x.index == 0
            && (fp8 || op.is::<MatMul>())
            && matches!(g.ty(*x).dtype, DType::F32 | DType::F16 | DType::BF16);
        if !along_columns || !is_product || sole_reader(g, &adj, *x) != Some(id) {
            continue;
        }
        let activation = sole_reader(g, &adj, Port::new(id, 0))
            .filter(|_| !fp8)
            .and_then(|reader| {
                let unary = g.node(reader).op.downcast_ref::<Unary>()?;
                Some((reader, Epilogue::with_activation(unary.kind)?))
            });
        found.push(Candidate {
            matmul: x.node,
            bias_add: id,
            activation,
        });
    }
    Ok(found)
}

impl Pass for GemmEpilogue {
    fn name(&self) -> &'static str {
        "gemm-epilogue"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let candidates = find(g)?;
        let (mut activations, mut bytes_saved) = (0usize, 0usize);
        for c in &candidates {
            let bias = g.inputs(c.bias_add)[1];
            let (last, epilogue) = c.activation.unwrap_or((c.bias_add, Epilogue::Bias));
            let mut inputs = g.inputs(c.matmul);
            inputs.push(bias);
            let op = &g.node(c.matmul).op;
            let fused: Box<dyn Op> = if let Some(product) = op.downcast_ref::<MatMul>() {
                Box::new(FusedMatMul {
                    product: product.clone(),
                    epilogue,
                    to: None,
                    residual: false,
                })
            } else if let Some(fp8) = op.downcast_ref::<Fp8MatMul>() {
                let with_bias = fp8.clone().with_bias(true);
                Box::new(with_bias.map_err(|e| node_error(g, c.matmul, &e))?)
            } else {
                return Err(node_error(
                    g,
                    c.matmul,
                    "a fusion candidate is not a product",
                ));
            };
            // Each intermediate tensor no longer exists: written once and read once.
            bytes_saved += 2 * g.ty(Port::new(c.matmul, 0)).size_bytes();
            g.set_node(last, fused, &inputs)?;
            if c.activation.is_some() {
                activations += 1;
                bytes_saved += 2 * g.ty(Port::new(c.bias_add, 0)).size_bytes();
                g.remove_node(c.bias_add)?;
            }
            g.remove_node(c.matmul)?;
        }
        let fused = candidates.len();
        let (residuals, residual_bytes) = fold_residual_adds(g)?;
        let (wide, wide_bytes) = fold_output_casts(g)?;
        bytes_saved += residual_bytes + wide_bytes;
        let summary = PassSummary {
            title: "GEMM epilogue pass summary:".into(),
            lines: vec![
                format!("Products that took their bias: {fused}"),
                format!("... and their activation too: {activations}"),
                format!("... that add a residual too (an Add folded): {residuals}"),
                format!("... that store their result in f32 (a Cast folded): {wide}"),
                format!(
                    "Kernels fewer per run: {}",
                    fused + activations + residuals + wide
                ),
                format!(
                    "Memory traffic saved per run: {}",
                    crate::format_bytes(bytes_saved as u64)
                ),
            ],
        };
        Ok(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{Placeholder, UnaryKind};
    use ampgraph_graph::{Tensor, TensorType};

    fn placeholder(g: &mut Graph, name: &str, dtype: DType, shape: &[usize]) -> Port {
        let ty = TensorType::new(dtype, shape.to_vec());
        g.add_node(name, Box::new(Placeholder(ty)), &[])
            .unwrap()
            .into()
    }

    /// x[4,3] @ w[3,5] + b[5], then `act` (None: no activation), as the graph output.
    fn dense(dtype: DType, act: Option<UnaryKind>) -> Graph {
        let mut g = Graph::new();
        let x = placeholder(&mut g, "x", dtype, &[4, 3]);
        let w = placeholder(&mut g, "w", dtype, &[3, 5]);
        let b = placeholder(&mut g, "b", dtype, &[5]);
        let mm = g
            .add_node("mm", Box::new(MatMul::new(false, false)), &[x, w])
            .unwrap();
        let biased = g
            .add_node(
                "bias_add",
                Box::new(BiasAdd {
                    data_format: DataFormat::Nhwc,
                }),
                &[mm.into(), b],
            )
            .unwrap();
        let out = match act {
            Some(kind) => g
                .add_node("act", Box::new(Unary::new(kind)), &[biased.into()])
                .unwrap(),
            None => biased,
        };
        g.set_outputs(vec![out.into()]).unwrap();
        g
    }

    fn values(n: usize, seed: f64) -> Vec<f64> {
        (0..n)
            .map(|i| (i as f64 * 0.37 + seed).sin() * 2.0)
            .collect()
    }

    /// The graph's output, from its own CPU kernels in topological order.
    fn run(g: &Graph) -> Tensor {
        let mut vals: std::collections::HashMap<NodeId, Vec<Tensor>> = Default::default();
        for id in g.topo_order().unwrap() {
            let node = g.node(id);
            let out = if node.op.is::<Placeholder>() {
                let ty = &node.outputs()[0];
                let seed = node.name.len() as f64;
                vec![Tensor::from_f64(
                    ty.dtype,
                    ty.shape.clone(),
                    &values(ty.checked_len().unwrap(), seed),
                )
                .unwrap()]
            } else {
                let ins: Vec<Tensor> = g
                    .inputs(id)
                    .iter()
                    .map(|p| vals[&p.node][p.index].clone())
                    .collect();
                let refs: Vec<&Tensor> = ins.iter().collect();
                node.op.eval(&refs).unwrap()
            };
            vals.insert(id, out);
        }
        let o = g.outputs()[0];
        vals[&o.node][o.index].clone()
    }

    #[test]
    fn bias_and_activation_fold_into_the_product_with_the_same_values() {
        for (dtype, act, epilogue, nodes) in [
            (DType::F32, None, Epilogue::Bias, 4),
            (DType::F16, Some(UnaryKind::Relu), Epilogue::BiasRelu, 4),
            (
                DType::BF16,
                Some(UnaryKind::Gelu { approximate: true }),
                Epilogue::BiasGeluTanh,
                4,
            ),
        ] {
            let g = dense(dtype, act);
            let before = run(&g);
            let mut fused = g.clone();
            let summary = GemmEpilogue.run(&mut fused).unwrap();
            fused.validate().unwrap();
            assert_eq!(
                fused.len(),
                nodes,
                "{dtype} {act:?}: x, w, b and the fused node"
            );
            let out = fused.outputs()[0].node;
            let op = fused.node(out).op.downcast_ref::<FusedMatMul>().unwrap();
            assert_eq!(op.epilogue, epilogue);
            let last = if act.is_some() { "act" } else { "bias_add" };
            assert_eq!(
                fused.node(out).name,
                last,
                "the fused node keeps the last name"
            );
            assert_eq!(
                run(&fused),
                before,
                "{dtype} {act:?}: bitwise the unfused values"
            );
            assert!(summary.lines[0].ends_with(": 1"), "{summary}");
            // Idempotent: nothing left to fuse.
            let again = fused.clone();
            GemmEpilogue.run(&mut fused).unwrap();
            assert_eq!(fused.len(), again.len());
        }
    }

    #[test]
    fn a_cast_to_f32_after_a_16_bit_product_folds_in() {
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            let mut g = dense(dtype, Some(UnaryKind::Relu));
            let relu = g.outputs()[0];
            let cast = g
                .add_node("logits", Box::new(Cast { to: DType::F32 }), &[relu])
                .unwrap();
            g.set_outputs(vec![cast.into()]).unwrap();
            let before = run(&g);
            let mut fused = g.clone();
            let summary = GemmEpilogue.run(&mut fused).unwrap();
            fused.validate().unwrap();
            let out = fused.outputs()[0].node;
            let op = fused.node(out).op.downcast_ref::<FusedMatMul>();
            let narrow = dtype != DType::F32;
            assert_eq!(
                op.map(|f| f.to),
                narrow.then_some(Some(DType::F32)),
                "{dtype}"
            );
            if narrow {
                assert_eq!(fused.len(), 4, "x, w, b and the fused node");
                assert_eq!(fused.node(out).name, "logits", "the cast's name stays");
                assert!(summary.lines[3].ends_with(": 1"), "{summary}");
            }
            assert_eq!(run(&fused), before, "{dtype}: bitwise the unfused values");
            let again = fused.clone();
            GemmEpilogue.run(&mut fused).unwrap();
            assert_eq!(fused.len(), again.len(), "idempotent");
        }
    }

    /// `dense` whose output is added to `r` (a placeholder of `r_shape`), in the
    /// order `r + dense` or `dense + r`.
    fn residual(dtype: DType, act: Option<UnaryKind>, r_shape: &[usize], r_first: bool) -> Graph {
        let mut g = dense(dtype, act);
        let y = g.outputs()[0];
        let r = placeholder(&mut g, "r", dtype, r_shape);
        let ins = if r_first { [r, y] } else { [y, r] };
        let add = g
            .add_node("add", Box::new(Binary::new(BinaryKind::Add)), &ins)
            .unwrap();
        g.set_outputs(vec![add.into()]).unwrap();
        g
    }

    #[test]
    fn a_residual_add_folds_into_the_product_with_the_same_values() {
        for (dtype, r_first) in [(DType::F32, true), (DType::F16, false), (DType::BF16, true)] {
            let g = residual(dtype, None, &[4, 5], r_first);
            let before = run(&g);
            let mut fused = g.clone();
            let summary = GemmEpilogue.run(&mut fused).unwrap();
            fused.validate().unwrap();
            assert_eq!(fused.len(), 5, "{dtype}: x, w, b, r and the fused node");
            let out = fused.outputs()[0].node;
            assert_eq!(fused.node(out).name, "add", "the Add's name stays");
            let op = fused.node(out).op.downcast_ref::<FusedMatMul>().unwrap();
            assert!(op.residual && op.epilogue == Epilogue::Bias);
            assert_eq!(fused.inputs(out)[3], Port::new(fused.find("r").unwrap(), 0));
            assert!(summary.lines[2].ends_with(": 1"), "{summary}");
            assert!(summary.lines[4].ends_with(": 2"), "{summary}");
            assert_eq!(run(&fused), before, "{dtype}: bitwise the unfused values");
            let again = fused.clone();
            GemmEpilogue.run(&mut fused).unwrap();
            assert_eq!(fused.len(), again.len(), "idempotent");
        }
        // Not after an activation, nor an addend that broadcasts.
        for (act, r_shape) in [(Some(UnaryKind::Relu), [4, 5]), (None, [1, 5])] {
            let mut g = residual(DType::F32, act, &r_shape, false);
            GemmEpilogue.run(&mut g).unwrap();
            assert!(
                g.find("add").is_some_and(|id| g.node(id).op.is::<Binary>()),
                "{act:?} {r_shape:?}"
            );
        }
    }

    /// An FP8 product stored in bf16 (a transformer's second feed-forward layer under
    /// FP8 AMP) takes its bias and then its residual Add, with the same values; one
    /// stored in f32 takes neither.
    #[test]
    fn an_fp8_product_takes_its_bias_and_residual_with_the_same_values() {
        for to in [DType::BF16, DType::F32] {
            let mut g = Graph::new();
            let a = placeholder(&mut g, "a", DType::F8E4M3, &[4, 16]);
            let b = placeholder(&mut g, "b", DType::F8E4M3, &[16, 16]);
            let sa = placeholder(&mut g, "sa", DType::F32, &[]);
            let sb = placeholder(&mut g, "sb", DType::F32, &[]);
            let product = Fp8MatMul::new(MatMul::new(false, true), to).unwrap();
            let mm = g
                .add_node("mm", Box::new(product), &[a, b, sa, sb])
                .unwrap();
            let bias = placeholder(&mut g, "bias", to, &[16]);
            let biased = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            let biased = g
                .add_node("bias_add", Box::new(biased), &[mm.into(), bias])
                .unwrap();
            let r = placeholder(&mut g, "r", to, &[4, 16]);
            let add = Binary::new(BinaryKind::Add);
            let add = g
                .add_node("add", Box::new(add), &[r, biased.into()])
                .unwrap();
            g.set_outputs(vec![add.into()]).unwrap();
            let before = run(&g);
            let mut fused = g.clone();
            let summary = GemmEpilogue.run(&mut fused).unwrap();
            fused.validate().unwrap();
            assert_eq!(run(&fused), before, "{to}: bitwise the unfused values");
            let out = fused.outputs()[0].node;
            let op = fused.node(out).op.downcast_ref::<Fp8MatMul>();
            if to == DType::BF16 {
                assert_eq!(fused.len(), 7, "a, b, the scales, bias, r and the product");
                assert_eq!(fused.node(out).name, "add", "the Add's name stays");
                assert!(op.is_some_and(|p| p.bias && p.residual), "{op:?}");
                assert_eq!(fused.inputs(out)[5], r);
                assert!(summary.lines[2].ends_with(": 1"), "{summary}");
            } else {
                assert_eq!(fused.len(), g.len(), "{to}: nothing folds");
            }
            let again = fused.clone();
            GemmEpilogue.run(&mut fused).unwrap();
            assert_eq!(fused.len(), again.len(), "idempotent");
        }
    }

    /// ViT's and BERT's exports: the product's rows viewed as `[2, 2, 5]` before the
    /// residual Add.
    #[test]
    fn a_residual_add_after_a_view_of_the_rows_folds_with_the_same_values() {
        for (dtype, r_first) in [(DType::F32, false), (DType::F16, true)] {
            let mut g = dense(dtype, None);
            let y = g.outputs()[0];
            let view = g
                .add_node("view", Box::new(Reshape::new([2, 2, 5])), &[y])
                .unwrap();
            let r = placeholder(&mut g, "r", dtype, &[2, 2, 5]);
            let ins = if r_first {
                [r, view.into()]
            } else {
                [view.into(), r]
            };
            let add = g
                .add_node("add", Box::new(Binary::new(BinaryKind::Add)), &ins)
                .unwrap();
            let neg = g
                .add_node("neg", Box::new(Unary::new(UnaryKind::Neg)), &[add.into()])
                .unwrap();
            g.set_outputs(vec![neg.into(), add.into()]).unwrap();
            let before = run(&g);
            let mut fused = g.clone();
            let summary = GemmEpilogue.run(&mut fused).unwrap();
            fused.validate().unwrap();
            assert!(summary.lines[2].ends_with(": 1"), "{summary}");
            let add = fused.find("add").unwrap();
            assert!(
                fused.node(add).op.is::<Reshape>(),
                "the Add views the product"
            );
            let product = fused.inputs(add)[0].node;
            let op = fused
                .node(product)
                .op
                .downcast_ref::<FusedMatMul>()
                .unwrap();
            assert!(op.residual && op.epilogue == Epilogue::Bias);
            let addend = fused.inputs(product)[3].node;
            assert_eq!(
                fused.inputs(addend),
                [Port::new(fused.find("r").unwrap(), 0)]
            );
            assert!(fused.find("view").is_none() && fused.find("mm").is_none());
            assert_eq!(run(&fused), before, "{dtype}: bitwise the unfused values");
            let text = ampgraph_graph::format::to_text(&fused);
            GemmEpilogue.run(&mut fused).unwrap();
            assert_eq!(ampgraph_graph::format::to_text(&fused), text, "idempotent");
        }
        // A view someone else reads stays, and the Add with it.
        let mut g = dense(DType::F32, None);
        let y = g.outputs()[0];
        let view = g
            .add_node("view", Box::new(Reshape::new([2, 2, 5])), &[y])
            .unwrap();
        let r = placeholder(&mut g, "r", DType::F32, &[2, 2, 5]);
        let add = g
            .add_node(
                "add",
                Box::new(Binary::new(BinaryKind::Add)),
                &[view.into(), r],
            )
            .unwrap();
        g.set_outputs(vec![add.into(), view.into()]).unwrap();
        GemmEpilogue.run(&mut g).unwrap();
        assert!(g.node(g.find("add").unwrap()).op.is::<Binary>());
    }

    /// ResNet's `Add(conv, downsample conv)`: both products alone read the Add, one
    /// takes it and the other is its addend.
    #[test]
    fn an_add_of_two_products_folds_one_of_them() {
        for viewed in [false, true] {
            let mut g = dense(DType::F16, None);
            let mut sides = vec![g.outputs()[0]];
            let x = placeholder(&mut g, "x2", DType::F16, &[4, 3]);
            let w = placeholder(&mut g, "w2", DType::F16, &[3, 5]);
            let b = placeholder(&mut g, "b2", DType::F16, &[5]);
            let mm = g.add(MatMul::new(false, false), &[x, w]).unwrap();
            let bias_add = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            sides.push(g.add(bias_add, &[mm, b]).unwrap());
            if viewed {
                for side in &mut sides {
                    *side = g.add(Reshape::new([2, 2, 5]), &[*side]).unwrap();
                }
            }
            let add = g.add(Binary::new(BinaryKind::Add), &sides).unwrap();
            g.set_outputs(vec![add]).unwrap();
            let before = run(&g);
            let summary = GemmEpilogue.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(
                summary.lines[2].ends_with(": 1"),
                "viewed {viewed}: {summary}"
            );
            assert_eq!(run(&g), before, "viewed {viewed}");
        }
    }

    #[test]
    fn exact_gelu_and_read_intermediates_stay_unfused() {
        // The exact (erf) GELU has no cuBLASLt epilogue: only the bias fuses.
        let mut g = dense(DType::F16, Some(UnaryKind::Gelu { approximate: false }));
        GemmEpilogue.run(&mut g).unwrap();
        let fused: Vec<&str> = g
            .node_ids()
            .filter_map(|id| {
                g.node(id)
                    .op
                    .downcast_ref::<FusedMatMul>()
                    .map(|f| f.epilogue.name())
            })
            .collect();
        assert_eq!(fused, ["bias"]);
        assert!(g.find("act").is_some());

        // A product read by another node keeps its own output.
        let mut g = dense(DType::F32, None);
        let mm = g.find("mm").unwrap();
        let also = g
            .add_node("also", Box::new(Unary::new(UnaryKind::Neg)), &[mm.into()])
            .unwrap();
        let out = g.outputs()[0];
        g.set_outputs(vec![out, also.into()]).unwrap();
        let before = g.len();
        GemmEpilogue.run(&mut g).unwrap();
        assert_eq!(g.len(), before);
        assert!(g.node_ids().all(|id| !g.node(id).op.is::<FusedMatMul>()));
    }
}
