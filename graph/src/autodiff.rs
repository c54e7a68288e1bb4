//! Reverse-mode automatic differentiation on the graph.
//!
//! [`gradients`] adds the backward subgraph of `loss` with respect to some tensors.
//! Each op's gradient rule lives with the op ([`Op::gradient`]); rules build their
//! nodes through a [`GradBuilder`], which names them under `gradients/` and offers the
//! helpers most rules need (scalars, summing a broadcast gradient back to a shape).

use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId, Port};
use crate::op::Op;
use crate::ops::{Binary, BinaryKind, Const, SumTo};
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

/// Adds nodes computing d`loss`/d`x` for each `x` in `wrt`; `loss` must be a float
/// scalar. An `x` the loss does not depend on gets zeros.
pub fn gradients(g: &mut Graph, loss: Port, wrt: &[Port]) -> Result<Vec<Port>> {
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
    let seed = GradBuilder::new(g, "gradients").scalar(loss_ty.dtype, 1.0)?;
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
        .map(|&x| match accumulate(g, grads.remove(&x))? {
            Some(grad) => Ok(grad),
            None => {
                let ty = g.ty(x).clone();
                GradBuilder::new(g, "gradients").add(Const { ty, values: None }, &[])
            }
        })
        .collect()
}

/// The sum of the gradient contributions to one tensor.
fn accumulate(g: &mut Graph, parts: Option<Vec<Port>>) -> Result<Option<Port>> {
    let Some(parts) = parts else { return Ok(None) };
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

/// The error for an op without a gradient rule.
pub fn not_differentiable(op: &str) -> GraphError {
    GraphError::Format(format!("{op} has no gradient"))
}
