//! Reverse-mode automatic differentiation on the graph.
//!
//! [`gradients`] adds the backward subgraph of `loss` with respect to some tensors.
//! Each op's gradient rule lives with the op ([`Op::gradient`]); rules build their
//! nodes through a [`GradBuilder`], which names them under `gradients/` and offers the
//! helpers most rules need (scalars, summing a broadcast gradient back to a shape).

use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId, Port};
use crate::op::Op;
use crate::ops::{Binary, BinaryKind, BroadcastTo, Concat, Const, SumTo};
use crate::tensor::{Tensor, TensorType};
use crate::DType;

/// What a gradient rule builds with: the graph plus naming and helpers.
pub struct GradBuilder<'a> {
    pub graph: &'a mut Graph,
    /// Name stem of the nodes being added: `gradients/<node>`.
    stem: String,
}

impl<'a> GradBuilder<'a> {
    pub fn new(graph: &'a mut Graph, stem: impl Into<String>) -> Self {
        GradBuilder {
            graph,
            stem: stem.into(),
        }
    }

    /// Adds a node named `<stem>/<op>` and returns its output 0.
    pub fn add(&mut self, op: impl Op, inputs: &[Port]) -> Result<Port> {
        Ok(self.add_node(Box::new(op), inputs)?.into())
    }

    /// Adds a node named `<stem>/<op>` and returns its id (for multi-output ops).
    pub fn add_node(&mut self, op: Box<dyn Op>, inputs: &[Port]) -> Result<NodeId> {
        let name = self
            .graph
            .fresh_name(format!("{}/{}", self.stem, op.name()));
        self.graph.add_node(name, op, inputs)
    }

    pub fn ty(&self, p: Port) -> &TensorType {
        self.graph.ty(p)
    }

    /// A scalar constant of `dtype`.
    pub fn scalar(&mut self, dtype: DType, value: f64) -> Result<Port> {
        self.add(Const::new(Tensor::scalar(dtype, value)), &[])
    }

    /// The scalar `zero` broadcast to `shape` with `len` along `axis`: the zeros a
    /// Slice's gradient places its piece among (which [`gradients`] recognises when
    /// it joins such pieces).
    pub fn zeros_along(
        &mut self,
        zero: Port,
        shape: &[usize],
        axis: usize,
        len: usize,
    ) -> Result<Port> {
        let mut shape = shape.to_vec();
        shape[axis] = len;
        self.add(BroadcastTo::new(shape), &[zero])
    }

    pub fn binary(&mut self, kind: BinaryKind, a: Port, b: Port) -> Result<Port> {
        self.add(Binary::new(kind), &[a, b])
    }

    /// Sums a gradient computed at a broadcast shape back to `shape` (the shape of the
    /// operand that was broadcast); the identity when the shapes already agree.
    pub fn sum_to(&mut self, grad: Port, shape: &[usize]) -> Result<Port> {
        if self.ty(grad).shape == shape {
            Ok(grad)
        } else {
            self.add(
                SumTo {
                    shape: shape.to_vec(),
                },
                &[grad],
            )
        }
    }
}

/// The name of the constant 1 that [`gradients`] starts from (a second one gets
/// [`Graph::fresh_name`]'s suffix): what is computed from it is a gradient, which is
/// how the FP8 pass tells a backward product's gradient operand (stored in E5M2)
/// from its forward one.
pub const SEED_NAME: &str = "gradients/seed";

/// Whether `name` is a gradient seed's (see [`SEED_NAME`]).
pub fn is_seed_name(name: &str) -> bool {
    name.strip_prefix(SEED_NAME)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
}

/// Adds nodes computing d`loss`/d`x` for each `x` in `wrt`; `loss` must be a float
/// scalar. An `x` no gradient reaches ([`gradients_if_any`]) gets zeros.
pub fn gradients(g: &mut Graph, loss: Port, wrt: &[Port]) -> Result<Vec<Port>> {
    let grads = gradients_if_any(g, loss, wrt)?;
    wrt.iter()
        .zip(grads)
        .map(|(&x, grad)| match grad {
            Some(grad) => Ok(grad),
            None => {
                let ty = g.ty(x).clone();
                GradBuilder::new(g, "gradients").add(Const { ty, values: None }, &[])
            }
        })
        .collect()
}

/// [`gradients`], with `None` for an `x` no gradient reaches: the loss does not
/// depend on it, or only through inputs without one (batch norm's moving statistics
/// in training, which the optimizers then leave alone).
pub fn gradients_if_any(g: &mut Graph, loss: Port, wrt: &[Port]) -> Result<Vec<Option<Port>>> {
    let loss_ty = g.ty(loss).clone();
    if !loss_ty.shape.is_empty() || !loss_ty.dtype.is_float() {
        let n = g.node(loss.node);
        return Err(GraphError::node(
            &n.name,
            n.op.name(),
            format!("the loss must be a float scalar, got {loss_ty}"),
        ));
    }
    let order = g.topo_order()?;
    let capacity = order.iter().map(|i| i.index() + 1).max().unwrap_or(0);
    // Nodes on a path from some `wrt` to the loss: the only ones worth differentiating.
    let mut reaches_loss = vec![false; capacity];
    reaches_loss[loss.node.index()] = true;
    for &id in order.iter().rev() {
        if reaches_loss[id.index()] {
            for p in g.inputs(id) {
                reaches_loss[p.node.index()] = true;
            }
        }
    }
    let mut from_wrt = vec![false; capacity];
    for p in wrt {
        from_wrt[p.node.index()] = true;
    }
    for &id in &order {
        if g.inputs(id).iter().any(|p| from_wrt[p.node.index()]) {
            from_wrt[id.index()] = true;
        }
    }
    // Gradient contributions per port, summed when a tensor has several readers.
    let mut grads: std::collections::HashMap<Port, Vec<Port>> = std::collections::HashMap::new();
    let seed_name = g.fresh_name(SEED_NAME);
    let seed: Port = g
        .add_node(
            seed_name,
            Box::new(Const::new(Tensor::scalar(loss_ty.dtype, 1.0))),
            &[],
        )?
        .into();
    grads.insert(loss, vec![seed]);
    for &id in order.iter().rev() {
        // Sources (the `wrt` tensors themselves among them) have nothing to propagate to.
        if !(reaches_loss[id.index()] && from_wrt[id.index()])
            || g.node(id).op.arity() == crate::op::Arity::Exactly(0)
        {
            continue;
        }
        let n_out = g.node(id).outputs().len();
        let mut out_grads = Vec::with_capacity(n_out);
        for k in 0..n_out {
            out_grads.push(accumulate(g, grads.remove(&Port::new(id, k)))?);
        }
        if out_grads.iter().all(Option::is_none) {
            continue;
        }
        let inputs = g.inputs(id);
        let outputs: Vec<Port> = (0..n_out).map(|k| Port::new(id, k)).collect();
        let node = g.node(id);
        let (name, op) = (node.name.clone(), node.op.clone());
        let mut builder = GradBuilder::new(g, format!("gradients/{name}"));
        let in_grads = op
            .gradient(&mut builder, &inputs, &outputs, &out_grads)
            .map_err(|e| match e {
                GraphError::Format(msg) => GraphError::node(&name, op.name(), msg),
                other => other,
            })?;
        for (input, grad) in inputs.iter().zip(in_grads) {
            if let Some(grad) = grad {
                if from_wrt[input.node.index()] {
                    grads.entry(*input).or_default().push(grad);
                }
            }
        }
    }
    wrt.iter()
        .map(|&x| accumulate(g, grads.remove(&x)))
        .collect()
}

/// The sum of the gradient contributions to one tensor. Contributions that are each one
/// tensor among zeros along the same axis at disjoint places (the gradients of Slices
/// that split a tensor: GPT-2's and ViT's packed q, k, v) become one Concat of the
/// pieces, rather than a zero-padded copy of each added up.
fn accumulate(g: &mut Graph, parts: Option<Vec<Port>>) -> Result<Option<Port>> {
    let Some(parts) = parts else { return Ok(None) };
    let parts = concat_placed(g, parts)?;
    let mut b = GradBuilder::new(g, "gradients/accumulate");
    let mut iter = parts.into_iter();
    let Some(mut sum) = iter.next() else {
        return Ok(None);
    };
    for p in iter {
        sum = b.binary(BinaryKind::Add, sum, p)?;
    }
    Ok(Some(sum))
}

/// One tensor placed among zeros along one axis (a Slice's gradient along the axis it
/// cut, a pad of zero rows or columns): the axis, the tensor's first index along it,
/// and the tensor.
pub struct Placed {
    pub axis: usize,
    pub start: usize,
    /// The piece's length along the axis.
    pub len: usize,
    pub piece: Port,
}

/// `p` as a [`Placed`] tensor: a Concat of broadcast zero scalars and one other tensor.
pub fn placed(g: &Graph, p: Port) -> Option<Placed> {
    let concat = g.node(p.node).op.downcast_ref::<Concat>()?;
    let axis = usize::try_from(concat.axis).ok()?;
    let (mut offset, mut found) = (0, None);
    for x in g.inputs(p.node) {
        let len = *g.ty(x).shape.get(axis)?;
        if !is_zeros(g, x) {
            if found.is_some() {
                return None;
            }
            found = Some(Placed {
                axis,
                start: offset,
                len,
                piece: x,
            });
        }
        offset += len;
    }
    found
}

/// Whether `p` is a broadcast zero scalar ([`GradBuilder::zeros_along`]).
fn is_zeros(g: &Graph, p: Port) -> bool {
    if !g.node(p.node).op.is::<BroadcastTo>() {
        return false;
    }
    let source = g.inputs(p.node)[0];
    match g.node(source.node).op.downcast_ref::<Const>() {
        Some(c) => c
            .values
            .as_ref()
            .is_none_or(|v| v.iter_f64().all(|v| v == 0.0)),
        None => false,
    }
}

/// `parts` with the placed ones ([`Placed`]) along one axis at disjoint places joined
/// into one Concat (zeros where no piece lies); the rest as they were.
fn concat_placed(g: &mut Graph, parts: Vec<Port>) -> Result<Vec<Port>> {
    let (pieces, rest): (Vec<_>, Vec<_>) = parts
        .iter()
        .map(|&p| (p, placed(g, p)))
        .partition(|(_, q)| q.is_some());
    let mut found: Vec<Placed> = pieces.into_iter().filter_map(|(_, q)| q).collect();
    if found.len() < 2 || found.iter().any(|p| p.axis != found[0].axis) {
        return Ok(parts);
    }
    found.sort_by_key(|p| p.start);
    if found.windows(2).any(|w| w[0].start + w[0].len > w[1].start) {
        return Ok(parts);
    }
    let (axis, full) = (found[0].axis, g.ty(parts[0]).clone());
    let rest: Vec<Port> = rest.into_iter().map(|(p, _)| p).collect();
    let mut b = GradBuilder::new(g, "gradients/accumulate");
    let zero = b.scalar(full.dtype, 0.0)?;
    let (mut pieces, mut at) = (Vec::new(), 0);
    for p in &found {
        if p.start > at {
            pieces.push(b.zeros_along(zero, &full.shape, axis, p.start - at)?);
        }
        pieces.push(p.piece);
        at = p.start + p.len;
    }
    if full.shape[axis] > at {
        pieces.push(b.zeros_along(zero, &full.shape, axis, full.shape[axis] - at)?);
    }
    let concat = b.add(Concat::new(axis as i64), &pieces)?;
    Ok(std::iter::once(concat).chain(rest).collect())
}

/// The error for an op without a gradient rule.
pub fn not_differentiable(op: &str) -> GraphError {
    GraphError::Format(format!("{op} has no gradient"))
}
