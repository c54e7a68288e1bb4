//! A self-attention's q, k and v projections become one product. HF BERT, DistilBERT,
//! CLIP and Whisper (and torch's exports of them) project the hidden states with three
//! Linear layers, `x Wq + bq`, `x Wk + bk`, `x Wv + bv`: three GEMMs of a third of the
//! width each, and three head layouts for the attention to read. Where the weights
//! are constants (inference), this pass multiplies `x` once by `[Wq | Wk | Wv]` (and
//! adds `[bq | bk | bv]`) and slices the columns back: the form GPT-2's `c_attn` and
//! ViT's `in_proj` have, which `pack-qkv` then gives the attention whole.
//!
//! Taken: a FusedAttention whose q, k and v are each, through Reshapes read by nothing
//! else, `MatMul(x, W)` or `BiasAdd(MatMul(x, W), b)` with the same `x` (or Reshapes
//! of one tensor to one shape, as exporters flatten each Linear's input), constant
//! `W` and `b` (through Casts: AMP's), the same product flags and all with a bias or
//! none. The slices keep the names of the nodes they replace.

use ampgraph_graph::ops::{BiasAdd, Concat, DataFormat, FusedAttention, MatMul, Reshape, Slice};
use ampgraph_graph::{Graph, NodeId, Op, Port, Tensor};

use crate::rewrite::{cast_constant, output_nodes, remove_unread, sole_reader, summary};
use crate::{Pass, PassError, PassSummary};

/// The `merge-projections` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeProjections;

/// One of q, k and v as a projection.
struct Projection {
    /// The node whose output the attention's chain of Reshapes reads (the BiasAdd,
    /// or the MatMul where there is none).
    top: NodeId,
    matmul: NodeId,
    product: MatMul,
    /// The product's left operand, and what it is a Reshape of (itself otherwise).
    x: Port,
    source: Port,
    weight: Tensor,
    bias: Option<Tensor>,
    /// The nodes making the weight and the bias (Consts and Casts).
    constants: Vec<NodeId>,
}

/// `port`'s producer and the Reshapes above it, while each is read only by the next.
fn below_views(g: &Graph, mut port: Port) -> Port {
    while g.node(port.node).op.is::<Reshape>() {
        let input = g.inputs(port.node)[0];
        if sole_reader(g, input).map(|(r, _)| r) != Some(port.node) {
            break;
        }
        port = input;
    }
    port
}

/// What `x` is a Reshape of, or `x` itself.
fn reshaped(g: &Graph, x: Port) -> Port {
    match g.node(x.node).op.is::<Reshape>() {
        true => g.inputs(x.node)[0],
        false => x,
    }
}

/// The projection the attention's operand in `slot` is, if it is one this pass takes.
/// Every node from the product up is read by the next alone, so the three operands'
/// projections are distinct nodes.
fn projection(g: &Graph, attention: NodeId, slot: usize) -> Option<Projection> {
    let port = g.inputs(attention)[slot];
    if sole_reader(g, port) != Some((attention, slot)) {
        return None;
    }
    let top = below_views(g, port);
    let node = g.node(top.node);
    let (matmul, bias) = match node.op.downcast_ref::<BiasAdd>() {
        Some(b) => {
            let [y, bias] = g.inputs(top.node)[..] else {
                return None;
            };
            let along_columns = b.data_format == DataFormat::Nhwc || g.ty(y).rank() == 2;
            if !along_columns || sole_reader(g, y) != Some((top.node, 0)) {
                return None;
            }
            (y.node, Some(bias))
        }
        None => (top.node, None),
    };
    let product = g.node(matmul).op.downcast_ref::<MatMul>()?.clone();
    let [x, w] = g.inputs(matmul)[..] else {
        return None;
    };
    if product.transpose_a || g.ty(x).rank() != 2 {
        return None;
    }
    let (weight, mut constants) = cast_constant(g, w)?;
    let bias = match bias {
        Some(b) => {
            let (value, nodes) = cast_constant(g, b)?;
            constants.extend(nodes);
            Some(value)
        }
        None => None,
    };
    Some(Projection {
        top: top.node,
        matmul,
        product,
        x,
        source: reshaped(g, x),
        weight,
        bias,
        constants,
    })
}

/// q, k and v of `attention` as projections of one input, if they are.
fn projections(g: &Graph, attention: NodeId) -> Option<[Projection; 3]> {
    let op = g.node(attention).op.downcast_ref::<FusedAttention>()?;
    if op.packed {
        return None;
    }
    let [q, k, v] = [0, 1, 2].map(|slot| projection(g, attention, slot));
    let all = [q?, k?, v?];
    let first = &all[0];
    let alike = all.iter().all(|p| {
        p.source == first.source
            && g.ty(p.x) == g.ty(first.x)
            && p.product == first.product
            && p.bias.is_some() == first.bias.is_some()
            && p.weight.dtype() == first.weight.dtype()
    });
    alike.then_some(all)
}

/// `parts` joined along `axis`.
fn joined(parts: &[&Tensor], axis: i64) -> Result<Tensor, PassError> {
    let mut out = (Concat::new(axis).eval(parts)).map_err(|e| PassError::Rewrite(e.to_string()))?;
    out.pop()
        .ok_or_else(|| PassError::Rewrite("a Concat of constants gave nothing".into()))
}

/// Makes the one product of `parts` and puts the slices of its columns in place of
/// each part's top node.
fn merge(g: &mut Graph, parts: &[Projection; 3]) -> Result<Vec<NodeId>, PassError> {
    let first = &parts[0];
    // A weight `[K, N]`, or `[N, K]` read transposed: the columns join along N.
    let n_axis = usize::from(!first.product.transpose_b);
    let weights: Vec<&Tensor> = parts.iter().map(|p| &p.weight).collect();
    let weight = g.constant(joined(&weights, n_axis as i64)?)?;
    let name = g.fresh_name(format!("{}/qkv", g.node(first.matmul).name));
    let mut merged =
        Port::from(g.add_node(name, Box::new(first.product.clone()), &[first.x, weight])?);
    if parts.iter().all(|p| p.bias.is_some()) {
        let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
        let bias = g.constant(joined(&biases, 0)?)?;
        let op = BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        let name = g.fresh_name(format!("{}/qkv_bias", g.node(first.top).name));
        merged = g.add_node(name, Box::new(op), &[merged, bias])?.into();
    }
    let rows = g.ty(merged).shape[0] as i64;
    let mut stale = Vec::new();
    let mut column = 0;
    for p in parts {
        let width = p.weight.shape()[n_axis];
        let slice = Slice::new([0, column], [rows, width as i64]);
        g.set_node(p.top, Box::new(slice), &[merged])?;
        column += width;
        stale.extend([p.matmul, p.x.node]);
        stale.extend(&p.constants);
    }
    Ok(stale)
}

impl Pass for MergeProjections {
    fn name(&self) -> &'static str {
        "merge-projections"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let attentions: Vec<NodeId> = (g.node_ids())
            .filter(|&id| g.node(id).op.is::<FusedAttention>())
            .collect();
        let (mut merged, mut stale) = (0, Vec::new());
        for attention in attentions {
            let Some(parts) = projections(g, attention) else {
                continue;
            };
            stale.extend(merge(g, &parts)?);
            merged += 1;
        }
        let (removed, _) = remove_unread(g, stale, &is_output)?;
        let line = format!(
            "merge-projections: {merged} attentions' q, k and v projections as one product ({removed} nodes fewer)"
        );
        Ok(summary("merge-projections", vec![line]))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ampgraph_graph::ops::Cast;
    use ampgraph_graph::DType;

    use super::*;
    use crate::testing::{assert_same_bits, count, run, sine};

    const B: usize = 2;
    const S: usize = 4;
    const H: usize = 2;
    const D: usize = 16;

    /// Self-attention as HF BERT exports it: each of q, k and v its own Linear of the
    /// flattened hidden states (a Reshape each), f32 constants cast to f16 (AMP's
    /// casts), the product `[B S, H D]` viewed as heads; `read_weight` makes v's
    /// weight a Placeholder (a trained weight).
    fn bert_attention(read_weight: bool) -> Graph {
        let mut g = Graph::new();
        let hidden = g.placeholder("hidden", DType::F16, [B, S, H * D]).unwrap();
        let mut heads = Vec::new();
        for (k, name) in ["q", "k", "v"].into_iter().enumerate() {
            let rows = g
                .add(Reshape::new([-1, (H * D) as i64]), &[hidden])
                .unwrap();
            let weight = if read_weight && name == "v" {
                g.placeholder("wv", DType::F16, [H * D, H * D]).unwrap()
            } else {
                let w = g.constant(sine(&[H * D, H * D], 0.3 + k as f64)).unwrap();
                g.add(Cast { to: DType::F16 }, &[w]).unwrap()
            };
            let bias = g.constant(sine(&[H * D], 0.7 + k as f64)).unwrap();
            let bias = g.add(Cast { to: DType::F16 }, &[bias]).unwrap();
            let y = g.add(MatMul::new(false, false), &[rows, weight]).unwrap();
            let op = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            let y = g.add_node(name, Box::new(op), &[y, bias]).unwrap();
            let y = g.add(
                Reshape::new([B as i64, S as i64, H as i64, D as i64]),
                &[y.into()],
            );
            heads.push(y.unwrap());
        }
        let op = FusedAttention {
            scale: 0.25,
            causal: false,
            key_bias: false,
            packed: false,
            dropout: None,
        };
        let att = g.add_node("attention", Box::new(op), &heads).unwrap();
        g.set_outputs(vec![Port::new(att, 0)]).unwrap();
        g
    }

    fn feeds() -> HashMap<&'static str, Tensor> {
        let cast = |t: Tensor| t.cast(DType::F16);
        HashMap::from([
            ("hidden", cast(sine(&[B, S, H * D], 0.11))),
            ("wv", cast(sine(&[H * D, H * D], 2.3))),
        ])
    }

    /// The three Linears become one product whose column slices keep their names,
    /// computing the same bits on the CPU; a second run changes nothing.
    #[test]
    fn three_projections_of_one_input_become_one_product() {
        let before = bert_attention(false);
        let mut g = before.clone();
        let summary = MergeProjections.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 attentions'"), "{summary}");
        assert_eq!((count(&g, "MatMul"), count(&g, "BiasAdd")), (1, 1));
        for name in ["q", "k", "v"] {
            let id = g.find(name).unwrap();
            assert!(
                g.node(id).op.is::<Slice>(),
                "{name} is a slice of the product"
            );
        }
        // The three weights' Consts and Casts, and two of the input's Reshapes, went.
        assert_eq!(count(&g, "Cast"), 0);
        assert_eq!(count(&g, "Reshape"), 1 + 3);
        assert_same_bits(&run(&before, &feeds()), &run(&g, &feeds()));
        let text = ampgraph_graph::format::to_text(&g);
        MergeProjections.run(&mut g).unwrap();
        assert_eq!(ampgraph_graph::format::to_text(&g), text);
    }

    /// A weight that is not a constant (a training graph's) keeps the three products.
    #[test]
    fn a_weight_read_from_a_tensor_keeps_the_projections_apart() {
        let mut g = bert_attention(true);
        let summary = MergeProjections.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 attentions'"), "{summary}");
        assert_eq!(count(&g, "MatMul"), 3);
    }
}
