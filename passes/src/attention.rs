//! Attention fusion: the explicit form `softmax(scale * Q K^T) V` —
//! `BatchMatMul(adj_y, alpha) -> Softmax -> BatchMatMul` on `[B, H, S, D]` heads —
//! becomes one [`FusedAttention`], and in a training graph the gradient nodes autodiff
//! built for it (the two products' and the softmax's) one [`FusedAttentionGrad`]. The
//! scores and probabilities `[B, H, Sq, Sk]` (and their gradients) are then never
//! written: the CUDA kernels keep each tile of them in registers.
//!
//! The fused ops take the heads after the sequence (`[B, S, H, D]`, the projections'
//! layout): where an operand is the usual `Transpose(perm=[0,2,1,3])` of such a
//! tensor, the fused op reads that tensor and the transpose goes away; elsewhere a
//! transpose is added. The scale is the first product's `alpha` (where
//! `scale-into-matmul` folded it) times a scalar constant that multiplies the
//! product, if any: the fused op computes the scores in f32, so a 16-bit scale that
//! is no power of two (1/sqrt(32)) fuses too, its gradient's Mul with it.
//!
//! Masks on the scaled scores (`BatchMatMul -> Add(mask) -> Softmax`, up to two Adds,
//! or a Where) fuse in two forms:
//! - a causal mask makes the fused ops causal (the kernels then skip the masked
//!   tiles): an added constant whose `[Sq, Sk]` matrices (any leading dims: HF's
//!   `[B, 1, S, S]`) are `-inf` above the diagonal and 0 elsewhere once its Casts have
//!   rounded it, or GPT-2's `Where(keep, scores, fill)` with `keep` a constant true on
//!   and below the diagonal and `fill` `-inf` in the scores' dtype;
//! - any tensor `[B or 1, 1, 1, Sk]` of the scores' dtype (a padding mask, a per-key
//!   bias) becomes the fused ops' key bias, where it takes no gradient (autodiff's
//!   gradient of it would read the softmax's gradient, and the match fails);
//! - a constant `[B or 1, 1, Sq, Sk]` whose rows are alike in each matrix (HF
//!   transformers' padding mask expanded over the queries) becomes a constant key bias
//!   of one row per matrix, and one of zeros (no padding given) goes: adding 0 changes
//!   no softmax.
//!
//! Other masks keep the explicit form (`softmax-prologue` still fuses their Add into
//! the softmax).
//!
//! A Dropout of the probabilities (attention dropout, `Softmax -> Dropout ->
//! BatchMatMul`) fuses into the ops' own, mask for mask; in the gradient, the same
//! Dropout of `dp` that autodiff wrote goes too.
//!
//! Only 16-bit attention with a head width of at most 128 (a multiple of 16) and a
//! positive scale fuses: what the CUDA kernels (Tensor Core `mma`) compute (they take
//! each row's maximum of the unscaled scores). The match is exact: a
//! probability or score tensor anybody else reads keeps the graph as it is.

use std::collections::HashSet;

use crate::rewrite::{binary_operands, cast_constant, redirect, through_casts};
use crate::simplify::scale_into_matmul::scalar;
use ampgraph_graph::ops::attention::{check_key_bias, tensor_core_head_dim};
use ampgraph_graph::ops::{
    BatchMatMul, Binary, BinaryGrad, BinaryKind, Dropout, FusedAttention, FusedAttentionGrad,
    Softmax, SoftmaxGrad, Transpose, Where,
};
use ampgraph_graph::shape::normalize_axis;
use ampgraph_graph::{DType, Graph, NodeId, Port, Tensor, TensorType};

use crate::{format_bytes, Pass, PassError, PassSummary};

/// The attention-fusion pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseAttention;

const HEADS_SWAP: [usize; 4] = [0, 2, 1, 3];

/// One explicit attention and, in a training graph, its gradient nodes.
struct Core {
    scores: NodeId,
    /// The nodes between the product and the softmax: the scale's Mul, the masks'
    /// Adds, and the nodes that make the causal mask.
    between: Vec<NodeId>,
    masks: Masks,
    softmax: NodeId,
    /// The probabilities' dropout: its node, op and step count.
    dropout: Option<(NodeId, Dropout, Port)>,
    product: NodeId,
    /// The operands, heads first `[B, H, S, D]`.
    q: Port,
    k: Port,
    v: Port,
    scale: f64,
    backward: Option<Backward>,
}

/// A Mul of the scores' product by a scalar constant, or a Div by one (`by` is then
/// its reciprocal).
#[derive(Clone, Copy)]
struct Scaling {
    mul: NodeId,
    by: f64,
    constant: Port,
}

struct Backward {
    /// The loss gradient of the product, `[B, H, Sq, D]`.
    d_y: Port,
    d_p: NodeId,
    /// The dropout of `dp` (the forward's, on the gradient).
    d_p_dropout: Option<NodeId>,
    softmax_grad: NodeId,
    /// The scaling's gradient (`dS * c`), where the scale is a Mul.
    scale_grad: Option<NodeId>,
    d_q: Option<NodeId>,
    d_k: Option<NodeId>,
    d_v: Option<NodeId>,
}

fn batch_matmul(g: &Graph, id: NodeId) -> Option<&BatchMatMul> {
    g.node(id).op.downcast_ref::<BatchMatMul>()
}

/// A product of the given adjoints (and scale).
fn is_product(g: &Graph, id: NodeId, adj: (bool, bool), alpha: f64) -> bool {
    batch_matmul(g, id).is_some_and(|m| (m.adj_x, m.adj_y) == adj && m.alpha == alpha)
}

/// Whether `axis` is the last of a rank-4 tensor.
fn is_last_axis(axis: i64) -> bool {
    normalize_axis(axis, 4) == Ok(3)
}

/// The readers of `port`, or `None` when it is a graph output.
fn readers(g: &Graph, port: Port) -> Option<Vec<(NodeId, usize)>> {
    (!g.outputs().contains(&port)).then(|| g.port_consumers(port))
}

fn is_heads_swap(g: &Graph, id: NodeId) -> bool {
    g.node(id)
        .op
        .downcast_ref::<Transpose>()
        .is_some_and(|t| t.perm == HEADS_SWAP)
}

/// Whether every `[Sq, Sk]` matrix of `value` (its last two axes; any leading ones,
/// as HF's `[B, 1, S, S]` mask) is `masked(i, j)` at each query `i` and key `j`.
fn each_matrix(
    value: &Tensor,
    (sq, sk): (usize, usize),
    masked: impl Fn(usize, usize) -> f64,
) -> bool {
    let shape = value.shape();
    if shape.len() < 2 || shape[shape.len() - 2..] != [sq, sk] {
        return false;
    }
    let values = value.to_f64_vec();
    values
        .chunks(sq * sk)
        .all(|m| (0..sq).all(|i| (0..sk).all(|j| m[i * sk + j] == masked(i, j))))
}

/// Whether `port` is a constant whose `[Sq, Sk]` matrices are `-inf` above the
/// diagonal and 0 elsewhere (after its Casts); with the nodes that make it.
fn causal_mask(g: &Graph, port: Port, (sq, sk): (usize, usize)) -> Option<Vec<NodeId>> {
    let (value, nodes) = cast_constant(g, port)?;
    let masked = |i: usize, j: usize| if j > i { f64::NEG_INFINITY } else { 0.0 };
    each_matrix(&value, (sq, sk), masked).then_some(nodes)
}

/// `Where(keep, scores, fill)` as GPT-2's export writes its causal mask: `keep` a
/// constant true on and below the diagonal of each `[Sq, Sk]` matrix, `fill` a scalar
/// that is `-inf` in the scores' dtype (PyTorch's `finfo.min` cast to 16 bits). The
/// scores, and the nodes that make the mask.
fn causal_where(g: &Graph, x: Port, (sq, sk): (usize, usize)) -> Option<(Port, Vec<NodeId>)> {
    if !g.node(x.node).op.is::<Where>() {
        return None;
    }
    let [keep, scores, fill] = g.inputs(x.node)[..] else {
        return None;
    };
    let (keep, mut nodes) = cast_constant(g, keep)?;
    let lower = |i: usize, j: usize| if j > i { 0.0 } else { 1.0 };
    let (fill, fill_nodes) = cast_constant(g, fill)?;
    let fill_is_minus_inf = fill.len() == 1 && fill.to_f64_vec()[0] == f64::NEG_INFINITY;
    let chained =
        g.node(scores.node).op.is::<BatchMatMul>() || g.node(scores.node).op.is::<Binary>();
    let alone = readers(g, scores)? == [(x.node, 1)];
    let fits = g.ty(scores) == g.ty(x) && fill.dtype() == g.ty(x).dtype;
    if !(each_matrix(&keep, (sq, sk), lower) && fill_is_minus_inf && chained && alone && fits) {
        return None;
    }
    nodes.extend(fill_nodes);
    Some((scores, nodes))
}

/// Whether `port` can be a key bias of scores of type `scores` `[B, H, Sq, Sk]`: what
/// the fused op takes (`check_key_bias`).
fn is_key_bias(g: &Graph, port: Port, scores: &TensorType) -> bool {
    let (Some(&batch), Some(&k_len)) = (scores.shape.first(), scores.shape.get(3)) else {
        return false;
    };
    check_key_bias(g.ty(port), (batch, k_len), scores.dtype).is_ok()
}

/// The masks added to the scores.
#[derive(Clone, Debug, Default)]
struct Masks {
    causal: bool,
    key_bias: Option<KeyBias>,
}

/// The key bias the fused op reads.
#[derive(Clone, Debug)]
enum KeyBias {
    /// A tensor of the graph, `[B or 1, 1, 1, Sk]`.
    Port(Port),
    /// A constant mask's rows, all alike within each matrix: one row each, made a
    /// constant `[B or 1, 1, 1, Sk]` when the attention is rewritten.
    Rows(Tensor),
}

/// One mask an Add puts on the scores.
enum Mask {
    /// The causal mask, with the nodes that make it.
    Causal(Vec<NodeId>),
    KeyBias(KeyBias),
    /// A constant of zeros (adding it changes no softmax), with the nodes that make it.
    Zeros(Vec<NodeId>),
}

/// A constant mask `[B or 1, 1, Sq, Sk]` of the scores' dtype whose rows are alike
/// within each matrix (a padding mask HF's transformers expands over the queries, all
/// zeros where no padding was given): a key bias of one row per matrix, or nothing
/// where every value is 0 (`x + 0` is `x`, or `+0` for `-0`: the same softmax).
fn query_independent(g: &Graph, port: Port, scores: &TensorType) -> Option<Mask> {
    let (value, nodes) = cast_constant(g, port)?;
    let [b, 1, sq, sk] = value.shape()[..] else {
        return None;
    };
    let batch = scores.shape[0];
    if (b != 1 && b != batch) || [sq, sk] != scores.shape[2..] || value.dtype() != scores.dtype {
        return None;
    }
    let values = value.to_f64_vec();
    let alike = values
        .chunks(sq * sk)
        .all(|m| m.chunks(sk).all(|row| row == &m[..sk]));
    if !alike {
        return None;
    }
    let first_rows: Vec<f64> = values
        .chunks(sq * sk)
        .flat_map(|m| m[..sk].to_vec())
        .collect();
    if first_rows.iter().all(|&v| v == 0.0) {
        return Some(Mask::Zeros(nodes));
    }
    let rows = Tensor::from_f64(scores.dtype, vec![b, 1, 1, sk], &first_rows).ok()?;
    Some(Mask::KeyBias(KeyBias::Rows(rows)))
}

/// The input `x` of a softmax split into the scaled scores and the masks that Adds
/// put on them (a causal mask, a key bias; nothing else reading the scores below
/// each Add), with those Adds and the causal mask's nodes.
fn unmask(g: &Graph, mut x: Port) -> Option<(Port, Masks, Vec<NodeId>)> {
    let (mut masks, mut nodes) = (Masks::default(), Vec::new());
    loop {
        let ty = g.ty(x);
        let (sq, sk) = (*ty.shape.get(2)?, *ty.shape.get(3)?);
        if !masks.causal {
            if let Some((scores, made_by)) = causal_where(g, x, (sq, sk)) {
                masks.causal = true;
                nodes.extend(made_by);
                nodes.push(x.node);
                x = scores;
                continue;
            }
        }
        let Some([a, b]) = binary_operands(g, x, BinaryKind::Add) else {
            break;
        };
        let (scores, found) = [(a, b), (b, a)].into_iter().find_map(|(scores, mask)| {
            // Where both sides have the scores' type (one query, one key), the scores
            // are the side the product's chain makes.
            let chained =
                g.node(scores.node).op.is::<BatchMatMul>() || g.node(scores.node).op.is::<Binary>();
            if !chained || g.ty(scores) != ty || readers(g, scores)?.len() != 1 {
                return None;
            }
            if !masks.causal {
                if let Some(made_by) = causal_mask(g, mask, (sq, sk)) {
                    return Some((scores, Mask::Causal(made_by)));
                }
            }
            if masks.key_bias.is_none() && is_key_bias(g, mask, ty) {
                return Some((scores, Mask::KeyBias(KeyBias::Port(mask))));
            }
            query_independent(g, mask, ty)
                .filter(|m| matches!(m, Mask::Zeros(_)) || masks.key_bias.is_none())
                .map(|m| (scores, m))
        })?;
        match found {
            Mask::Causal(made_by) => {
                masks.causal = true;
                nodes.extend(made_by);
            }
            Mask::KeyBias(bias) => masks.key_bias = Some(bias),
            Mask::Zeros(made_by) => nodes.extend(made_by),
        }
        nodes.push(x.node);
        x = scores;
    }
    Some((x, masks, nodes))
}

/// The product whose scores `s` are, and the Mul by a scalar constant (or the Div by
/// one: BERT's and GPT-2's `/ sqrt(d)`) that made `s` from it, if one did.
fn unscale(g: &Graph, s: Port) -> Option<(Port, Option<Scaling>)> {
    let scalar = |p| scalar(g, p).ok().flatten();
    if let Some([a, b]) = binary_operands(g, s, BinaryKind::Div) {
        let by = 1.0 / scalar(b).filter(|&c| c != 0.0)?;
        let mul = s.node;
        let same = g.ty(a) == g.ty(s);
        return same.then_some((
            a,
            Some(Scaling {
                mul,
                by,
                constant: b,
            }),
        ));
    }
    if binary_operands(g, s, BinaryKind::Mul).is_none() {
        return Some((s, None));
    }
    let (product, by, constant) = scalar_mul(g, s)?;
    let mul = s.node;
    Some((product, Some(Scaling { mul, by, constant })))
}

/// `(x, c, the constant's port)` where `p` is a Mul of `x` by a scalar constant `c`,
/// `x` of `p`'s type.
fn scalar_mul(g: &Graph, p: Port) -> Option<(Port, f64, Port)> {
    let [a, b] = binary_operands(g, p, BinaryKind::Mul)?;
    let scalar = |x| scalar(g, x).ok().flatten();
    let (x, by, constant) = match (scalar(a), scalar(b)) {
        (None, Some(by)) => (a, by, b),
        (Some(by), None) => (b, by, a),
        _ => return None,
    };
    (g.ty(x) == g.ty(p)).then_some((x, by, constant))
}

/// The explicit attention whose softmax is `softmax`, when it is one the kernels take.
fn find_core(g: &Graph, softmax: NodeId) -> Option<Core> {
    let sm = g.node(softmax).op.downcast_ref::<Softmax>()?;
    let input = g.inputs(softmax)[0];
    if readers(g, input)? != [(softmax, 0)] {
        return None;
    }
    let (scaled, masks, mut between) = unmask(g, input)?;
    let (s, scaling) = unscale(g, scaled)?;
    if let Some(scaling) = scaling {
        between.push(scaling.mul);
        between.extend(through_casts(g, scaling.constant));
    }
    let [q, k] = g.inputs(s.node)[..] else {
        return None;
    };
    // SDPA's decomposition scales both operands by sqrt(scale) before the product.
    let (q, q_by) = unscale_operand(g, q, s.node, 0, &mut between);
    let (k, k_by) = unscale_operand(g, k, s.node, 1, &mut between);
    let alpha = batch_matmul(g, s.node)?.alpha;
    let scale = alpha * scaling.map_or(1.0, |x| x.by) * q_by * k_by;
    let (qt, kt) = (g.ty(q), g.ty(k));
    let shapes_fit = qt.rank() == 4
        && kt.rank() == 4
        && qt.shape[..2] == kt.shape[..2]
        && qt.shape[3] == kt.shape[3];
    let positive_scale = scale > 0.0 && scale.is_finite();
    if !is_last_axis(sm.axis)
        || !positive_scale
        || !is_product(g, s.node, (false, true), alpha)
        || !shapes_fit
        || !matches!(qt.dtype, DType::F16 | DType::BF16)
        || !tensor_core_head_dim(qt.shape[3])
    {
        return None;
    }
    let p = Port::new(softmax, 0);
    let mut at_p = readers(g, p)?;
    let dropout = match at_p
        .iter()
        .position(|&(r, slot)| slot == 0 && g.node(r).op.is::<Dropout>())
    {
        Some(i) => {
            let d = at_p.remove(i).0;
            let op = *g.node(d).op.downcast_ref::<Dropout>()?;
            Some((d, op, g.inputs(d)[1]))
        }
        None => None,
    };
    // The products read the probabilities or their dropout's output; the softmax's
    // gradient reads the probabilities.
    let mut candidates: Vec<(NodeId, usize, bool)> =
        at_p.into_iter().map(|(r, slot)| (r, slot, false)).collect();
    if let Some((d, _, _)) = dropout {
        let dropped = readers(g, Port::new(d, 0))?;
        candidates.extend(dropped.into_iter().map(|(r, slot)| (r, slot, true)));
    }
    let (mut product, mut d_v, mut softmax_grad) = (None, None, None);
    for (reader, slot, dropped) in candidates {
        let free = |found: &Option<NodeId>| slot == 0 && found.is_none();
        let of_products = dropped == dropout.is_some();
        if of_products && free(&product) && is_product(g, reader, (false, false), 1.0) {
            product = Some(reader);
        } else if of_products && free(&d_v) && is_product(g, reader, (true, false), 1.0) {
            d_v = Some(reader);
        } else if !dropped
            && free(&softmax_grad)
            && g.node(reader)
                .op
                .downcast_ref::<SoftmaxGrad>()
                .is_some_and(|sg| !sg.log && is_last_axis(sg.axis))
        {
            softmax_grad = Some(reader);
        } else {
            return None;
        }
    }
    let product = product?;
    let v = g.inputs(product)[1];
    if g.ty(v) != kt {
        return None;
    }
    let operands_scaled = q_by != 1.0 || k_by != 1.0;
    let backward = match softmax_grad {
        // The gradients of scaled operands are not matched: the form stays.
        Some(_) if operands_scaled => return None,
        Some(sg) => Some(find_backward(
            g,
            (q, k, v),
            (s, alpha, scaling),
            (sg, d_v),
            dropout.map(|(_, op, count)| (op, count)),
        )?),
        None if d_v.is_none() => None,
        None => return None,
    };
    // A scaled product is read by its Mul and that Mul's gradient alone.
    if let Some(scaling) = scaling {
        let scale_grad = backward.as_ref().and_then(|b| b.scale_grad);
        let others = readers(g, s)?
            .into_iter()
            .any(|(r, _)| r != scaling.mul && Some(r) != scale_grad);
        if others {
            return None;
        }
    }
    Some(Core {
        scores: s.node,
        between,
        masks,
        softmax,
        dropout,
        product,
        q,
        k,
        v,
        scale,
        backward,
    })
}

/// Operand `slot` of the scores' product `product`, and the scalar constant that
/// multiplies it, where a Mul only the product reads does (its nodes join `between`);
/// else the operand itself and 1.
fn unscale_operand(
    g: &Graph,
    p: Port,
    product: NodeId,
    slot: usize,
    between: &mut Vec<NodeId>,
) -> (Port, f64) {
    let only_reader = readers(g, p).is_some_and(|r| r == [(product, slot)]);
    let found = scalar_mul(g, p).filter(|_| only_reader);
    match found {
        Some((x, by, constant)) => {
            between.push(p.node);
            between.extend(through_casts(g, constant));
            (x, by)
        }
        None => (p, 1.0),
    }
}

/// The gradient of `scaling` (the product `s` times a constant) that reads the
/// softmax's gradient `sg`: a BinaryGrad of the Mul with respect to `s`.
fn scale_grad(g: &Graph, sg: NodeId, s: Port, scaling: Scaling) -> Option<NodeId> {
    let [(reader, 2)] = readers(g, Port::new(sg, 0))?[..] else {
        return None;
    };
    let grad = g.node(reader).op.downcast_ref::<BinaryGrad>()?;
    let inputs = g.inputs(reader);
    let by_constant = inputs.get(1 - grad.wrt) == Some(&scaling.constant);
    let matches = grad.kind == BinaryKind::Mul && inputs[grad.wrt] == s && by_constant;
    matches.then_some(reader)
}

/// The gradient nodes around the softmax's gradient `sg`: `dp = dy v^T` before it,
/// `dq = alpha ds k` and `dk = alpha ds^T q` after it, where `ds` is the softmax's
/// gradient times the scaling's constant if the scores' product `s` was scaled by a
/// Mul; `d_v` (`p^T dy`) must read the same `dy`. With the forward's `dropout` (its
/// op and step count), `dp` reaches the softmax's gradient through the same Dropout.
fn find_backward(
    g: &Graph,
    (q, k, v): (Port, Port, Port),
    (s, alpha, scaling): (Port, f64, Option<Scaling>),
    (sg, d_v): (NodeId, Option<NodeId>),
    dropout: Option<(Dropout, Port)>,
) -> Option<Backward> {
    let mut d_p = g.inputs(sg)[1];
    let mut d_p_reader = (sg, 1);
    let d_p_dropout = match dropout {
        Some((op, count)) => {
            let same = g.node(d_p.node).op.downcast_ref::<Dropout>() == Some(&op)
                && g.inputs(d_p.node)[1] == count
                && readers(g, d_p)? == [(sg, 1)];
            if !same {
                return None;
            }
            let node = d_p.node;
            d_p_reader = (node, 0);
            d_p = g.inputs(node)[0];
            Some(node)
        }
        None => None,
    };
    // Only a product is looked into: other nodes may have fewer inputs.
    if !is_product(g, d_p.node, (false, true), 1.0) {
        return None;
    }
    let [d_y, d_p_v] = g.inputs(d_p.node)[..] else {
        return None;
    };
    let d_p_ok = d_p.index == 0 && d_p_v == v && readers(g, d_p)? == [d_p_reader];
    if !d_p_ok || d_v.is_some_and(|dv| g.inputs(dv)[1] != d_y) {
        return None;
    }
    let scale_grad = match scaling {
        Some(scaling) => Some(scale_grad(g, sg, s, scaling)?),
        None => None,
    };
    let d_s = Port::new(scale_grad.unwrap_or(sg), 0);
    let (mut d_q, mut d_k) = (None, None);
    for (reader, slot) in readers(g, d_s)? {
        let other = *g.inputs(reader).get(1)?;
        if slot == 0 && d_q.is_none() && other == k && is_product(g, reader, (false, false), alpha)
        {
            d_q = Some(reader);
        } else if slot == 0
            && d_k.is_none()
            && other == q
            && is_product(g, reader, (true, false), alpha)
        {
            d_k = Some(reader);
        } else {
            return None;
        }
    }
    Some(Backward {
        d_y,
        d_p: d_p.node,
        d_p_dropout,
        softmax_grad: sg,
        scale_grad,
        d_q,
        d_k,
        d_v,
    })
}

/// What the rewrites did, for the summary.
#[derive(Default)]
struct Tally {
    forward: usize,
    backward: usize,
    added_kernels: usize,
}

/// `p` (`[B, H, S, D]`) with the heads after the sequence: the tensor a heads swap
/// read, or a new swap.
fn heads_last(g: &mut Graph, p: Port, tally: &mut Tally) -> Result<Port, PassError> {
    if p.index == 0 && is_heads_swap(g, p.node) {
        return Ok(g.inputs(p.node)[0]);
    }
    tally.added_kernels += 1;
    swap_heads(g, p)
}

fn swap_heads(g: &mut Graph, p: Port) -> Result<Port, PassError> {
    let name = g.fresh_name(format!("{}/swap_heads", g.node(p.node).name));
    Ok(
        g.add_node(name, Box::new(Transpose::new(HEADS_SWAP)), &[p])?
            .into(),
    )
}

/// Replaces `old` (`[B, H, S, D]`) by `new` (`[B, S, H, D]`): readers that swap the
/// heads back read `new` itself, the others a swap of it. Returns the swaps bypassed.
fn replace_heads_first(
    g: &mut Graph,
    old: Port,
    new: Port,
    tally: &mut Tally,
) -> Result<Vec<NodeId>, PassError> {
    let mut bypassed = Vec::new();
    let mut others = false;
    for (reader, _) in g.port_consumers(old) {
        if !is_heads_swap(g, reader) {
            others = true;
        } else if !bypassed.contains(&reader) {
            bypassed.push(reader);
        }
    }
    for &swap in &bypassed {
        redirect(g, Port::new(swap, 0), new)?;
    }
    if others || g.outputs().contains(&old) {
        tally.added_kernels += 1;
        let swapped = swap_heads(g, new)?;
        redirect(g, old, swapped)?;
    }
    Ok(bypassed)
}

/// The heads swaps among the producers of `ports`.
fn swaps(g: &Graph, ports: &[Port]) -> Vec<NodeId> {
    ports
        .iter()
        .map(|p| p.node)
        .filter(|&id| is_heads_swap(g, id))
        .collect()
}

/// Rewrites one core; returns the nodes that may have become unread.
fn rewrite(g: &mut Graph, c: &Core, tally: &mut Tally) -> Result<Vec<NodeId>, PassError> {
    let mut stale = vec![c.scores, c.softmax, c.product];
    stale.extend(c.dropout.map(|(d, _, _)| d));
    stale.extend(&c.between);
    stale.extend(swaps(g, &[c.q, c.k, c.v]));
    let q = heads_last(g, c.q, tally)?;
    let k = heads_last(g, c.k, tally)?;
    let v = heads_last(g, c.v, tally)?;
    let name = g.fresh_name(format!("{}/FusedAttention", g.node(c.product).name));
    let key_bias = match &c.masks.key_bias {
        Some(KeyBias::Port(p)) => Some(*p),
        Some(KeyBias::Rows(rows)) => Some(g.constant(rows.clone())?),
        None => None,
    };
    let (scale, causal) = (c.scale, c.masks.causal);
    let (dropout, count) = match c.dropout {
        Some((_, op, count)) => (Some(op), Some(count)),
        None => (None, None),
    };
    let op = FusedAttention {
        scale,
        causal,
        key_bias: key_bias.is_some(),
        packed: false,
        dropout,
    };
    let mut inputs = vec![q, k, v];
    inputs.extend(key_bias);
    inputs.extend(count);
    let att = g.add_node(name, Box::new(op), &inputs)?;
    let (o, lse) = (Port::new(att, 0), Port::new(att, 1));
    stale.extend(replace_heads_first(g, Port::new(c.product, 0), o, tally)?);
    tally.forward += 1;
    tally.added_kernels += 1;
    let Some(b) = &c.backward else {
        return Ok(stale);
    };
    stale.extend([b.d_p, b.softmax_grad]);
    stale.extend(b.d_p_dropout);
    stale.extend(b.scale_grad);
    stale.extend(swaps(g, &[b.d_y]));
    let d_o = heads_last(g, b.d_y, tally)?;
    let name = g.fresh_name(format!(
        "{}/FusedAttentionGrad",
        g.node(b.softmax_grad).name
    ));
    let op = FusedAttentionGrad {
        scale,
        causal,
        key_bias: key_bias.is_some(),
        packed: false,
        dropout,
    };
    let mut inputs = vec![q, k, v, o, lse, d_o];
    inputs.extend(key_bias);
    inputs.extend(count);
    let grad = g.add_node(name, Box::new(op), &inputs)?;
    for (i, node) in [b.d_q, b.d_k, b.d_v].into_iter().enumerate() {
        if let Some(node) = node {
            stale.push(node);
            stale.extend(replace_heads_first(
                g,
                Port::new(node, 0),
                Port::new(grad, i),
                tally,
            )?);
        }
    }
    tally.backward += 1;
    tally.added_kernels += 1;
    Ok(stale)
}

/// Removes the nodes of `stale` nothing reads any more (readers first); returns the
/// kernels and the bytes of their outputs (each written once and read at least once).
fn remove_unread(g: &mut Graph, stale: Vec<NodeId>) -> Result<(usize, usize), PassError> {
    let mut left: Vec<NodeId> = {
        let mut seen = HashSet::new();
        stale.into_iter().filter(|id| seen.insert(*id)).collect()
    };
    let (mut kernels, mut bytes) = (0, 0);
    loop {
        let before = left.len();
        let mut kept = Vec::with_capacity(left.len());
        for id in left {
            let read = !g.consumers(id).is_empty() || g.outputs().iter().any(|p| p.node == id);
            if read {
                kept.push(id);
                continue;
            }
            let node = g.node(id);
            if !node.op.is_view() {
                kernels += 1;
                bytes += 2 * node.outputs().iter().map(|t| t.size_bytes()).sum::<usize>();
            }
            g.remove_node(id)?;
        }
        left = kept;
        if left.len() == before {
            return Ok((kernels, bytes));
        }
    }
}

impl Pass for FuseAttention {
    fn name(&self) -> &'static str {
        "fuse-attention"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let cores: Vec<Core> = g
            .node_ids()
            .filter_map(|id| find_core(g, id))
            .collect::<Vec<_>>();
        let mut tally = Tally::default();
        let mut stale = Vec::new();
        for c in &cores {
            stale.extend(rewrite(g, c, &mut tally)?);
        }
        let (removed, bytes) = remove_unread(g, stale)?;
        Ok(PassSummary {
            title: "Attention fusion pass summary:".into(),
            lines: vec![
                format!("Attentions fused: {}", tally.forward),
                format!("... with their gradient: {}", tally.backward),
                format!(
                    "Kernels per run: {removed} removed, {} added",
                    tally.added_kernels
                ),
                format!(
                    "Memory traffic saved per run: {}",
                    format_bytes(bytes as u64)
                ),
            ],
        })
    }
}
