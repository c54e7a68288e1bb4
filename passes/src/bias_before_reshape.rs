//! A bias added after a Reshape that keeps the last axis is added before it:
//! `BiasAdd(Reshape(x), b)` becomes `Reshape(BiasAdd(x, b))`, and so does an `Add` of
//! the Reshape and a 1-D `b` of the last axis's length, in either order (what
//! `torch.onnx.export` writes for `nn.MultiheadAttention`'s `in_proj_bias` and for
//! Linear layers on 3-D inputs: `Add(bias, MatMul)`).
//!
//! Why: a Linear layer on a 3-D input (`[batch, seq, k] x [k, n]`) is imported as
//! one `[rows, k] x [k, n]` product between Reshapes, so its bias lands after the
//! Reshape back. Moved next to the product, the bias joins the GEMM's epilogue (one
//! kernel fewer over the whole activation: ViT's packed qkv bias), and AMP's infer
//! rule sees it follow an f16 product: without the move, the last layer's bias (with
//! no allowlisted op after it) stayed in f32 between f16 neighbours, two casts more.

use ampgraph_graph::ops::{BiasAdd, Binary, BinaryKind, DataFormat, Reshape};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{output_nodes, read_only_by, summary};
use crate::{Pass, PassError, PassSummary};

/// The `bias-before-reshape` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct BiasBeforeReshape;

/// A bias move: the node adding the bias, the Reshape it reads, and the bias.
struct Move {
    add: NodeId,
    reshape: NodeId,
    bias: Port,
}

/// The Reshape a BiasAdd along the last axis (or an Add of a 1-D tensor as long as the
/// last axis) reads, where the Reshape keeps that axis, nothing else reads it and it is
/// no graph output.
fn movable(g: &Graph, id: NodeId, outputs: &[bool]) -> Option<Move> {
    let op = &g.node(id).op;
    let inputs = g.inputs(id);
    let rank = g.node(id).outputs()[0].shape.len();
    let (reshape, bias) = if let Some(b) = op.downcast_ref::<BiasAdd>() {
        if b.data_format == DataFormat::Nchw && rank > 2 {
            return None;
        }
        (inputs[0], inputs[1])
    } else {
        let add = op.downcast_ref::<Binary>()?;
        let [a, b] = inputs[..] else {
            return None;
        };
        let is_reshape = |p: Port| g.node(p.node).op.is::<Reshape>();
        let (reshape, bias) = if is_reshape(a) { (a, b) } else { (b, a) };
        let (y, b) = (g.ty(Port::new(id, 0)), g.ty(bias));
        let along_last = b.rank() == 1 && y.shape.last() == b.shape.first();
        if add.kind != BinaryKind::Add || !along_last || b.dtype != y.dtype || g.ty(reshape) != y {
            return None;
        }
        (reshape, bias)
    };
    if reshape.index != 0
        || !g.node(reshape.node).op.is::<Reshape>()
        || outputs[reshape.node.index()]
    {
        return None;
    }
    let x = g.inputs(reshape.node)[0];
    let keeps_last =
        g.ty(x).shape.last() == g.ty(reshape).shape.last() && !g.ty(x).shape.is_empty();
    let slot = if inputs[0] == reshape { 0 } else { 1 };
    (keeps_last && read_only_by(g, reshape, id, slot)).then_some(Move {
        add: id,
        reshape: reshape.node,
        bias,
    })
}

impl Pass for BiasBeforeReshape {
    fn name(&self) -> &'static str {
        "bias-before-reshape"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let outputs = output_nodes(g);
        let found: Vec<Move> = (g.node_ids())
            .filter_map(|id| movable(g, id, &outputs))
            .collect();
        for &Move { add, reshape, bias } in &found {
            // The Reshape's node adds the bias to its input, the adding node reshapes
            // that: each keeps its name, the last one its readers.
            let bias_op = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            let reshape_op = g.node(reshape).op.clone();
            let x = g.inputs(reshape)[0];
            g.set_node(reshape, Box::new(bias_op), &[x, bias])?;
            g.set_node(add, reshape_op, &[Port::new(reshape, 0)])?;
            // The bias's annotations (the ONNX op it was) go with it.
            let annotations = std::mem::take(&mut g.node_mut(add).annotations);
            g.node_mut(reshape).annotations.extend(annotations);
        }
        let lines = found
            .iter()
            .map(|m| {
                format!(
                    "{}: the bias is added before the Reshape",
                    g.node(m.add).name
                )
            })
            .collect();
        Ok(summary("bias-before-reshape", lines))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{assert_same_bits, count, run};
    use ampgraph_graph::ops::{Const, MatMul, Unary, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    /// `x [2,3,4] -> Reshape [6,4] -> MatMul w [4,5] -> Reshape back -> BiasAdd b`.
    fn linear_on_3d(back: &[i64]) -> (Graph, Port) {
        linear_on_3d_with(back, |g, back, b| {
            let bias = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            g.add_node("y", Box::new(bias), &[back, b]).unwrap().into()
        })
    }

    /// The same product with `add` adding the bias to the Reshape.
    fn linear_on_3d_with(
        back: &[i64],
        add: impl Fn(&mut Graph, Port, Port) -> Port,
    ) -> (Graph, Port) {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 4]).unwrap();
        let konst = |g: &mut Graph, name: &str, shape: Vec<usize>| -> Port {
            let n: usize = shape.iter().product();
            let v: Vec<f64> = (0..n).map(|i| (i % 7) as f64 * 0.25 - 0.5).collect();
            let t = Tensor::from_f64(DType::F32, shape, &v).unwrap();
            g.add_node(name, Box::new(Const::new(t)), &[])
                .unwrap()
                .into()
        };
        let w = konst(&mut g, "w", vec![4, 5]);
        let b = konst(&mut g, "b", vec![*back.last().unwrap() as usize]);
        let rows = g.add(Reshape::new([6, 4]), &[x]).unwrap();
        let mm = g.add(MatMul::new(false, false), &[rows, w]).unwrap();
        let back = g.add(Reshape::new(back), &[mm]).unwrap();
        let y = add(&mut g, back, b);
        g.set_outputs(vec![y]).unwrap();
        (g, y)
    }

    fn feeds() -> HashMap<&'static str, Tensor> {
        let v: Vec<f64> = (0..24).map(|i| f64::from(i) / 10.0).collect();
        [(
            "x",
            Tensor::from_f64(DType::F32, vec![2, 3, 4], &v).unwrap(),
        )]
        .into()
    }

    /// Runs the pass on `g` (output `y`, its bias after the Reshape): the bias moved
    /// as a BiasAdd right after the product, the same values.
    fn assert_moves(mut g: Graph, y: Port) {
        let before = run(&g, &feeds());
        let summary = BiasBeforeReshape.run(&mut g).unwrap();
        assert_eq!(summary.lines, ["y: the bias is added before the Reshape"]);
        g.validate().unwrap();
        // The output keeps its node; the product's one reader is the bias now.
        assert!(g.node(y.node).op.is::<Reshape>());
        let bias = g.inputs(y.node)[0].node;
        assert!(g.node(bias).op.is::<BiasAdd>());
        assert!(g.node(g.inputs(bias)[0].node).op.is::<MatMul>());
        assert_same_bits(&before, &run(&g, &feeds()));
    }

    #[test]
    fn the_bias_moves_before_the_reshape_with_the_same_values() {
        let (g, y) = linear_on_3d(&[2, 3, 5]);
        assert_moves(g, y);
    }

    /// `Add(bias, Reshape(MatMul))` (torch.onnx.export's Linear on 3-D inputs) and
    /// `Add(Reshape, bias)` move too, as BiasAdds; an Add of a whole tensor stays.
    #[test]
    fn an_add_of_a_1d_bias_in_either_order_moves_as_a_bias_add() {
        for bias_first in [true, false] {
            let (g, y) = linear_on_3d_with(&[2, 3, 5], |g, back, b| {
                let (l, r) = if bias_first { (b, back) } else { (back, b) };
                let add = Binary::new(BinaryKind::Add);
                g.add_node("y", Box::new(add), &[l, r]).unwrap().into()
            });
            assert_moves(g, y);
        }
        let (mut g, _) = linear_on_3d_with(&[2, 3, 5], |g, back, _| {
            let full = Tensor::from_f64(DType::F32, vec![2, 3, 5], &[0.5; 30]).unwrap();
            let full = g.add(Const::new(full), &[]).unwrap();
            g.plus(back, full).unwrap()
        });
        assert!(BiasBeforeReshape.run(&mut g).unwrap().lines.is_empty());
    }

    #[test]
    fn a_reshape_someone_else_reads_or_that_changes_the_last_axis_stays() {
        let (mut g, y) = linear_on_3d(&[2, 3, 5]);
        let back = g.inputs(y.node)[0];
        let relu = g.add(Unary::new(UnaryKind::Relu), &[back]).unwrap();
        g.set_outputs(vec![y, relu]).unwrap();
        assert!(BiasBeforeReshape.run(&mut g).unwrap().lines.is_empty());
        let (mut g, _) = linear_on_3d(&[2, 15]);
        assert!(BiasBeforeReshape.run(&mut g).unwrap().lines.is_empty());
        assert_eq!(count(&g, "Reshape"), 2);
    }
}
