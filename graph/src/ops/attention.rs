//! Fused scaled dot-product attention: `softmax(scale * Q K^T) V` per batch and head
//! as one op, and its gradient as another, so that the scores `[batch, heads, q, k]`
//! never exist as tensors (FlashAttention's idea; the `fuse-attention` pass builds
//! them from the explicit BatchMatMul-Softmax-BatchMatMul form). A causal attention
//! masks the scores of keys after the query (key `j > i` for query `i`, counted from
//! the start of both sequences, as an additive `-inf` mask above the diagonal does).
//! With `key_bias`, a last input `[B or 1, 1, 1, Sk]` is added to the scaled scores of
//! each key: a padding mask (0 for a key, `-inf` for padding) or any per-key bias. It
//! takes no gradient.
//!
//! Layout: `q [B, Sq, H, D]`, `k` and `v [B, Sk, H, D]`, `o [B, Sq, H, D]`: heads after
//! the sequence, as the projections produce them, so no transposes split or merge the
//! heads. Output 1 is the log-sum-exp of each row of scaled scores, `lse [B, H, Sq]`
//! in the compute type (f32 for f16/bf16/f32, f64 for f64), which the gradient reuses
//! instead of recomputing the row statistics.
//!
//! With `dropout`, the probabilities go through a [`Dropout`] (the explicit form's
//! `Dropout(softmax(..))`, mask for mask: element `((b H + h) Sq + i) Sk + j` of the
//! `[B, H, Sq, Sk]` probabilities) before their product with v; a last input is the
//! step count the masks are drawn for. The log-sum-exp is of the undropped scores.
//!
//! `packed` (a self-attention): q, k and v are one input `qkv [B, S, 3, H, D]`, the
//! packed projection's output as it is (`[B * S, 3 H D]` viewed), and the gradient's
//! one output is `dqkv` of that shape: no copies split q, k and v out of it or join
//! their gradients back (the `pack-qkv` pass makes them).

use crate::attrs::AttrValue;
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{require_float, same_dtype, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::ops::{grad0, Dropout};
use crate::tensor::{ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "FusedAttention",
        parse: |_, a| Ok(Box::new(FusedAttention::parse(a)?)),
    },
    OpEntry {
        name: "FusedAttentionGrad",
        parse: |_, a| Ok(Box::new(FusedAttentionGrad::parse(a)?)),
    },
];

/// The probabilities' dropout of `dropout_rate` and `dropout_seed`, where given.
fn parse_dropout(a: &mut crate::attrs::AttrReader) -> OpResult<Option<Dropout>> {
    match (a.opt_float("dropout_rate")?, a.opt_int("dropout_seed")?) {
        (None, None) => Ok(None),
        (Some(rate), Some(seed)) => Ok(Some(Dropout::new(rate, seed as u64)?)),
        _ => Err("dropout_rate and dropout_seed come together".into()),
    }
}

/// `o = softmax(scale * q k^T) v` per batch and head; also the rows' log-sum-exp.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttention {
    pub scale: f64,
    /// Query `i` attends to keys `0..=i` only.
    pub causal: bool,
    /// A fourth input `[B or 1, 1, 1, Sk]` is added to each key's scaled scores.
    pub key_bias: bool,
    /// One input `qkv [B, S, 3, H, D]` in place of q, k and v.
    pub packed: bool,
    /// The probabilities' dropout; a last input is then the step count.
    pub dropout: Option<Dropout>,
}

/// The gradients `dq, dk, dv` of [`FusedAttention`] from its inputs, its outputs
/// `o` and `lse`, and the loss gradient `do` of `o`.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttentionGrad {
    pub scale: f64,
    pub causal: bool,
    /// A seventh input, the forward's key bias.
    pub key_bias: bool,
    /// Inputs `qkv, o, lse, do[, key bias]` and one output `dqkv [B, S, 3, H, D]`.
    pub packed: bool,
    /// The forward's dropout; a last input is then the step count.
    pub dropout: Option<Dropout>,
}

impl FusedAttention {
    /// The op of its attrs (`scale`, `causal`, `key_bias`, `packed`, the dropout's).
    pub(crate) fn parse(a: &mut crate::attrs::AttrReader) -> OpResult<FusedAttention> {
        Ok(FusedAttention {
            scale: a.float_or("scale", 1.0)?,
            causal: a.bool_or("causal", false)?,
            key_bias: a.bool_or("key_bias", false)?,
            packed: a.bool_or("packed", false)?,
            dropout: parse_dropout(a)?,
        })
    }
}

impl FusedAttentionGrad {
    /// The op of its attrs (`scale`, `causal`, `key_bias`, `packed`, the dropout's).
    pub(crate) fn parse(a: &mut crate::attrs::AttrReader) -> OpResult<FusedAttentionGrad> {
        Ok(FusedAttentionGrad {
            scale: a.float_or("scale", 1.0)?,
            causal: a.bool_or("causal", false)?,
            key_bias: a.bool_or("key_bias", false)?,
            packed: a.bool_or("packed", false)?,
            dropout: parse_dropout(a)?,
        })
    }
}

/// How many inputs q, k and v take: one packed, else three.
pub fn qkv_inputs(packed: bool) -> usize {
    if packed {
        1
    } else {
        3
    }
}

/// q's type (k's and v's too) of a packed `qkv [B, S, 3, H, D]`.
pub fn unpacked_type(qkv: &TensorType) -> OpResult<TensorType> {
    match qkv.shape[..] {
        [b, s, 3, h, d] => Ok(TensorType::new(qkv.dtype, [b, s, h, d])),
        _ => Err(format!(
            "a packed qkv must be [batch, seq, 3, heads, head_dim], got {}",
            ShapeDisplay(&qkv.shape)
        )),
    }
}

/// q, k and v of a packed `qkv [B, S, 3, H, D]`.
fn unpack(qkv: &Tensor) -> OpResult<[Tensor; 3]> {
    let q = unpacked_type(&qkv.ty())?;
    let [b, s, h, d] = q.shape[..] else {
        unreachable!("unpacked_type is of rank 4")
    };
    let part = |j: usize| -> OpResult<Tensor> {
        let slice = crate::ops::Slice::new([0, 0, j, 0, 0], [b, s, 1, h, d].map(|n| n as i64));
        let [t] = <[Tensor; 1]>::try_from(slice.eval(&[qkv])?).map_err(|_| "slice")?;
        t.reshaped(q.shape.clone())
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

/// The gradients of q, k and v joined as `dqkv [B, S, 3, H, D]`.
fn pack(parts: Vec<Tensor>) -> OpResult<Tensor> {
    let viewed = parts
        .into_iter()
        .map(|t| {
            let [b, s, h, d] = t.shape()[..] else {
                return Err("q's gradient is not of rank 4".to_string());
            };
            t.reshaped(vec![b, s, 1, h, d])
        })
        .collect::<OpResult<Vec<Tensor>>>()?;
    let refs: Vec<&Tensor> = viewed.iter().collect();
    let [t] =
        <[Tensor; 1]>::try_from(crate::ops::Concat::new(2).eval(&refs)?).map_err(|_| "concat")?;
    Ok(t)
}

/// `eval` of `inputs` with a packed qkv (input 0) unpacked into q, k and v.
fn eval_unpacked<R>(
    inputs: &[&Tensor],
    eval: impl FnOnce(&[&Tensor]) -> OpResult<R>,
) -> OpResult<R> {
    let (qkv, rest) = inputs.split_first().ok_or("missing the packed qkv")?;
    let parts = unpack(qkv)?;
    let all: Vec<&Tensor> = parts.iter().chain(rest.iter().copied()).collect();
    eval(&all)
}

/// `inputs` with a packed qkv (input 0) in place of q, k and v.
fn unpacked_types(inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
    let (qkv, rest) = inputs.split_first().ok_or("missing the packed qkv")?;
    let q = unpacked_type(qkv)?;
    Ok([q.clone(), q.clone(), q]
        .into_iter()
        .chain(rest.iter().map(|t| (*t).clone()))
        .collect())
}

/// The head widths the fused CUDA kernels take: multiples of the Tensor Core step
/// (16) up to 128, where a block's tiles fit in 48 KiB of shared memory (heads
/// wider than 64 in narrower tiles).
pub fn tensor_core_head_dim(d: usize) -> bool {
    d > 0 && d % 16 == 0 && d <= 128
}

/// The dtype of the row statistics: the compute type.
pub fn lse_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The sizes of one attention: batch, heads, query and key lengths, head width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub batch: usize,
    pub heads: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub head_dim: usize,
}

impl AttentionDims {
    /// Checks `q [B, Sq, H, D]`, `k` and `v [B, Sk, H, D]` of one float dtype.
    pub fn of(q: &TensorType, k: &TensorType, v: &TensorType) -> OpResult<AttentionDims> {
        same_dtype(&[q, k, v])?;
        require_float("q, k and v", q.dtype)?;
        let [b, sq, h, d] = q.shape[..] else {
            return Err(format!(
                "q must be [batch, seq, heads, head_dim], got {}",
                ShapeDisplay(&q.shape)
            ));
        };
        if k.shape.len() != 4 || k.shape != v.shape {
            return Err(format!(
                "k and v must be [batch, seq, heads, head_dim] alike, got {} and {}",
                ShapeDisplay(&k.shape),
                ShapeDisplay(&v.shape)
            ));
        }
        if k.shape[0] != b || k.shape[2] != h || k.shape[3] != d {
            return Err(format!(
                "k {} does not match q {} in batch, heads or head_dim",
                ShapeDisplay(&k.shape),
                ShapeDisplay(&q.shape)
            ));
        }
        Ok(AttentionDims {
            batch: b,
            heads: h,
            q_len: sq,
            k_len: k.shape[1],
            head_dim: d,
        })
    }

    fn lse_type(&self, dtype: DType) -> TensorType {
        TensorType::new(lse_dtype(dtype), [self.batch, self.heads, self.q_len])
    }

    /// Offset of row `s` of head `h` in batch `b` of a `[B, S, H, D]` tensor.
    fn row(&self, len: usize, b: usize, s: usize, h: usize) -> usize {
        ((b * len + s) * self.heads + h) * self.head_dim
    }
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// The attrs both ops write: `causal`, `key_bias` and `packed` only where set, so
/// files from before them read the same.
fn attention_attrs(
    scale: f64,
    (causal, key_bias, packed): (bool, bool, bool),
    dropout: Option<Dropout>,
) -> Vec<(&'static str, AttrValue)> {
    let mut attrs = vec![("scale", scale.into())];
    for (name, set) in [
        ("causal", causal),
        ("key_bias", key_bias),
        ("packed", packed),
    ] {
        if set {
            attrs.push((name, true.into()));
        }
    }
    if let Some(d) = dropout {
        attrs.push(("dropout_rate", d.rate.into()));
        attrs.push(("dropout_seed", (d.seed as i64).into()));
    }
    attrs
}

/// `inputs` without the dropout's step count (the last input where `dropout`), and
/// the count.
fn split_count<T>(dropout: Option<Dropout>, inputs: &[T]) -> OpResult<(&[T], Option<&T>)> {
    match dropout {
        None => Ok((inputs, None)),
        Some(_) => {
            let (count, rest) = inputs.split_last().ok_or("missing the step count")?;
            Ok((rest, Some(count)))
        }
    }
}

/// Checks the dropout's step count: a float scalar.
fn check_count(count: Option<&&TensorType>) -> OpResult<()> {
    match count {
        Some(t) if !t.shape.is_empty() || !t.dtype.is_float() => {
            Err(format!("the step count must be a float scalar, not {t}"))
        }
        _ => Ok(()),
    }
}

/// The mask and scale of the probabilities' dropout at `count`: element `i` of the
/// `[B, H, Sq, Sk]` probabilities is kept and scaled by `scale`, or zeroed.
struct DropMask<T> {
    dropout: Dropout,
    count: u64,
    scale: T,
}

impl<T: Real> DropMask<T> {
    fn of(dropout: Option<Dropout>, count: Option<&&Tensor>) -> Option<DropMask<T>> {
        let (dropout, count) = (dropout?, count?);
        let count = Dropout::count_of(T::read(count).first().copied().unwrap_or(T::zero()));
        Some(DropMask {
            dropout,
            count,
            scale: T::lit(dropout.scale()),
        })
    }

    /// What probability `j` of query row `qi` of (`b`, `h`) is multiplied by.
    fn factor(&self, dims: &AttentionDims, (b, h, qi, j): (usize, usize, usize, usize)) -> T {
        let i = ((b * dims.heads + h) * dims.q_len + qi) * dims.k_len + j;
        if self.dropout.keeps(self.count, i as u64) {
            self.scale
        } else {
            T::zero()
        }
    }
}

/// Checks a key bias of an attention over `batch` and `k_len` keys in `dtype`:
/// `[batch or 1, 1, 1, k_len]` of that dtype.
pub fn check_key_bias(
    bias: &TensorType,
    (batch, k_len): (usize, usize),
    dtype: DType,
) -> OpResult<()> {
    let batch_ok = matches!(bias.shape.first(), Some(&n) if n == 1 || n == batch);
    if bias.rank() != 4 || !batch_ok || bias.shape[1..] != [1, 1, k_len] {
        return Err(format!(
            "key bias must be [{batch} or 1, 1, 1, {k_len}], got {}",
            ShapeDisplay(&bias.shape)
        ));
    }
    if bias.dtype != dtype {
        return Err(format!("key bias is {} but q is {dtype}", bias.dtype));
    }
    Ok(())
}

/// How scores are made: the scale, the causal mask, and the key bias's values (one
/// row of `Sk`, or one per batch).
struct ScoreRule<'a, T> {
    scale: T,
    causal: bool,
    key_bias: Option<&'a [T]>,
}

impl<T: Real> ScoreRule<'_, T> {
    /// The scaled scores of query row `qi` of (`b`, `h`) against every key, into `s`:
    /// plus the key bias, `-inf` for the keys a causal attention masks.
    fn scores(
        &self,
        dims: &AttentionDims,
        (q, k): (&[T], &[T]),
        (b, h, qi): (usize, usize, usize),
        s: &mut [T],
    ) {
        let d = dims.head_dim;
        let qr = dims.row(dims.q_len, b, qi, h);
        let bias = self.key_bias.map(|all| {
            let row = if all.len() == dims.k_len { 0 } else { b };
            &all[row * dims.k_len..(row + 1) * dims.k_len]
        });
        for (j, sj) in s.iter_mut().enumerate() {
            let kr = dims.row(dims.k_len, b, j, h);
            *sj = if self.causal && j > qi {
                T::neg_infinity()
            } else {
                let score = self.scale * dot(&q[qr..qr + d], &k[kr..kr + d]);
                bias.map_or(score, |bias| score + bias[j])
            };
        }
    }
}

impl Op for FusedAttention {
    fn name(&self) -> &'static str {
        "FusedAttention"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(
            qkv_inputs(self.packed)
                + usize::from(self.key_bias)
                + usize::from(self.dropout.is_some()),
        )
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        attention_attrs(
            self.scale,
            (self.causal, self.key_bias, self.packed),
            self.dropout,
        )
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        if self.packed {
            let unpacked = unpacked_types(inputs)?;
            return self.unpacked().infer(&unpacked.iter().collect::<Vec<_>>());
        }
        let (inputs, count) = split_count(self.dropout, inputs)?;
        check_count(count)?;
        let (q, dims) = forward_dims(self.key_bias, inputs)?;
        Ok(vec![q.clone(), dims.lse_type(q.dtype)])
    }
    fn type_groups(&self, num_inputs: usize, _num_outputs: usize) -> Vec<TypeGroup> {
        let typed = num_inputs - usize::from(self.dropout.is_some()).min(num_inputs);
        let mut groups = vec![
            TypeGroup::new((0..typed).collect(), vec![0]),
            TypeGroup::new(vec![], vec![1]).fixed(),
        ];
        if typed < num_inputs {
            groups.push(TypeGroup::new(vec![typed], vec![]).fixed());
        }
        groups
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        if self.packed {
            return eval_unpacked(inputs, |all| self.unpacked().eval(all));
        }
        let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        let types: Vec<&TensorType> = types.iter().collect();
        let (types, _) = split_count(self.dropout, &types)?;
        let (_, dims) = forward_dims(self.key_bias, types)?;
        match inputs[0].dtype() {
            DType::F64 => attention::<f64>(self, &dims, inputs),
            _ => attention::<f32>(self, &dims, inputs),
        }
    }
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (Some(d_o), [o, lse]) = (grad0(grads), outputs) else {
            return Ok(vec![None; inputs.len()]);
        };
        let (qkv, rest) = inputs.split_at(qkv_inputs(self.packed).min(inputs.len()));
        let op = FusedAttentionGrad {
            scale: self.scale,
            causal: self.causal,
            key_bias: self.key_bias,
            packed: self.packed,
            dropout: self.dropout,
        };
        let mut grad_inputs = qkv.to_vec();
        grad_inputs.extend([*o, *lse, d_o]);
        grad_inputs.extend(rest);
        let id = b.add_node(Box::new(op), &grad_inputs)?;
        // The key bias (a mask) and the step count take no gradient.
        let mut grads: Vec<Option<Port>> = (0..qkv.len()).map(|i| Some(Port::new(id, i))).collect();
        grads.extend(rest.iter().map(|_| None));
        Ok(grads)
    }
}

impl FusedAttention {
    /// The same attention over q, k and v as three inputs.
    fn unpacked(&self) -> FusedAttention {
        FusedAttention {
            packed: false,
            ..self.clone()
        }
    }
}

impl FusedAttentionGrad {
    /// The same gradient of q, k and v as three inputs and outputs.
    fn unpacked(&self) -> FusedAttentionGrad {
        FusedAttentionGrad {
            packed: false,
            ..self.clone()
        }
    }
}

/// The sizes of a FusedAttention over `q, k, v` (and a key bias where `key_bias`),
/// with q's type.
fn forward_dims<'a>(
    key_bias: bool,
    inputs: &[&'a TensorType],
) -> OpResult<(&'a TensorType, AttentionDims)> {
    let (qkv, bias) = inputs.split_at(3.min(inputs.len()));
    let [q, k, v] = fixed(qkv)?;
    let dims = AttentionDims::of(q, k, v)?;
    match bias {
        [] if !key_bias => {}
        [bias] if key_bias => check_key_bias(bias, (dims.batch, dims.k_len), q.dtype)?,
        _ => return Err(format!("expected {} inputs", 3 + usize::from(key_bias))),
    }
    Ok((q, dims))
}

/// The reference forward: per row, the scores, their maximum-shifted exponentials,
/// the weighted sum of values and the log-sum-exp.
fn attention<T: Real>(
    op: &FusedAttention,
    dims: &AttentionDims,
    inputs: &[&Tensor],
) -> OpResult<Vec<Tensor>> {
    let (inputs, count) = split_count(op.dropout, inputs)?;
    let drop = DropMask::<T>::of(op.dropout, count);
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let (qs, ks, vs) = (T::read(q), T::read(k), T::read(v));
    let bias = inputs.get(3).map(|t| T::read(t));
    let rule = ScoreRule {
        scale: T::lit(op.scale),
        causal: op.causal,
        key_bias: bias.as_deref(),
    };
    let d = dims.head_dim;
    let mut o = vec![T::zero(); qs.len()];
    let mut lse = Vec::with_capacity(dims.batch * dims.heads * dims.q_len);
    let mut s = vec![T::zero(); dims.k_len];
    for b in 0..dims.batch {
        for h in 0..dims.heads {
            for qi in 0..dims.q_len {
                rule.scores(dims, (&qs, &ks), (b, h, qi), &mut s);
                let max = s.iter().copied().fold(T::neg_infinity(), T::max);
                let shift = if max.is_finite() { max } else { T::zero() };
                s.iter_mut().for_each(|x| *x = (*x - shift).exp());
                let sum: T = s.iter().copied().sum();
                let or = dims.row(dims.q_len, b, qi, h);
                for (j, &p) in s.iter().enumerate() {
                    let p = drop
                        .as_ref()
                        .map_or(p, |m| p * m.factor(dims, (b, h, qi, j)));
                    let vr = dims.row(dims.k_len, b, j, h);
                    for (oc, &vc) in o[or..or + d].iter_mut().zip(&vs[vr..vr + d]) {
                        *oc = *oc + p * vc;
                    }
                }
                o[or..or + d].iter_mut().for_each(|x| *x = *x / sum);
                lse.push(shift + sum.ln());
            }
        }
    }
    let lse_shape = vec![dims.batch, dims.heads, dims.q_len];
    Ok(vec![
        T::store(q.dtype(), q.shape().to_vec(), o)?,
        T::store(lse_dtype(q.dtype()), lse_shape, lse)?,
    ])
}

impl Op for FusedAttentionGrad {
    fn name(&self) -> &'static str {
        "FusedAttentionGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(
            qkv_inputs(self.packed)
                + 3
                + usize::from(self.key_bias)
                + usize::from(self.dropout.is_some()),
        )
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        attention_attrs(
            self.scale,
            (self.causal, self.key_bias, self.packed),
            self.dropout,
        )
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (inputs, count) = split_count(self.dropout, inputs)?;
        check_count(count)?;
        if self.packed {
            let unpacked = unpacked_types(inputs)?;
            grad_dims(self.key_bias, &unpacked.iter().collect::<Vec<_>>())?;
            return Ok(vec![inputs[0].clone()]);
        }
        grad_dims(self.key_bias, inputs)?;
        Ok(inputs[..3].iter().map(|t| (*t).clone()).collect())
    }
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        // The lse (input 2 packed, 4 not) and the step count keep their types; the
        // rest share q's.
        let (lse, outputs) = if self.packed { (2, 1) } else { (4, 3) };
        let count = self.dropout.map(|_| num_inputs.saturating_sub(1));
        let group = (0..num_inputs)
            .filter(|&i| i != lse && Some(i) != count)
            .collect();
        let mut groups = vec![
            TypeGroup::new(group, (0..outputs.min(num_outputs)).collect()),
            TypeGroup::new(vec![lse], vec![]).fixed(),
        ];
        groups.extend(count.map(|c| TypeGroup::new(vec![c], vec![]).fixed()));
        groups
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        if self.packed {
            return eval_unpacked(inputs, |all| Ok(vec![pack(self.unpacked().eval(all)?)?]));
        }
        let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        let types: Vec<&TensorType> = types.iter().collect();
        let (types, _) = split_count(self.dropout, &types)?;
        let dims = grad_dims(self.key_bias, types)?;
        match inputs[0].dtype() {
            DType::F64 => attention_grad::<f64>(self, &dims, inputs),
            _ => attention_grad::<f32>(self, &dims, inputs),
        }
    }
}

/// The sizes of a FusedAttentionGrad over `q, k, v, o, lse, do` (and a key bias
/// where `key_bias`), once `o` and `do` are checked against `q` and `lse` against the
/// sizes.
fn grad_dims(key_bias: bool, inputs: &[&TensorType]) -> OpResult<AttentionDims> {
    let (first, rest) = inputs.split_at(6.min(inputs.len()));
    let [q, k, v, o, lse, d_o] = fixed(first)?;
    let mut forward = vec![*q, *k, *v];
    forward.extend(rest);
    let (_, dims) = forward_dims(key_bias, &forward)?;
    for (what, t) in [("o", o), ("do", d_o)] {
        if *t != *q {
            return Err(format!("{what} is {t} but q is {q}"));
        }
    }
    let want = dims.lse_type(q.dtype);
    if **lse != want {
        return Err(format!("lse is {lse} but must be {want}"));
    }
    Ok(dims)
}

/// The reference backward, as the fused kernels compute it: the probabilities from
/// the saved log-sum-exp, `dp = do v^T`, `ds = p (dp - rowsum(do * o))`, then
/// `dq = scale ds k`, `dk = scale ds^T q`, `dv = p^T do`. With dropout (mask and
/// scale `m`): `dv = (p m)^T do` and `ds = p (dp m - rowsum(do * o))`, since
/// `o = (p m) v`.
fn attention_grad<T: Real>(
    op: &FusedAttentionGrad,
    dims: &AttentionDims,
    inputs: &[&Tensor],
) -> OpResult<Vec<Tensor>> {
    let (inputs, count) = split_count(op.dropout, inputs)?;
    let drop = DropMask::<T>::of(op.dropout, count);
    let [q, k, v, o, lse, d_o] = fixed(&inputs[..6])?;
    let (qs, ks, vs) = (T::read(q), T::read(k), T::read(v));
    let (os, lses, dos) = (T::read(o), T::read(lse), T::read(d_o));
    let bias = inputs.get(6).map(|t| T::read(t));
    let rule = ScoreRule {
        scale: T::lit(op.scale),
        causal: op.causal,
        key_bias: bias.as_deref(),
    };
    let d = dims.head_dim;
    let mut dq = vec![T::zero(); qs.len()];
    let mut dk = vec![T::zero(); ks.len()];
    let mut dv = vec![T::zero(); vs.len()];
    let (mut p, mut ds) = (vec![T::zero(); dims.k_len], vec![T::zero(); dims.k_len]);
    let scale = rule.scale;
    for b in 0..dims.batch {
        for h in 0..dims.heads {
            for qi in 0..dims.q_len {
                rule.scores(dims, (&qs, &ks), (b, h, qi), &mut p);
                let row_lse = lses[(b * dims.heads + h) * dims.q_len + qi];
                p.iter_mut().for_each(|x| *x = (*x - row_lse).exp());
                let qr = dims.row(dims.q_len, b, qi, h);
                let delta = dot(&dos[qr..qr + d], &os[qr..qr + d]);
                let factor = |j| drop.as_ref().map(|m| m.factor(dims, (b, h, qi, j)));
                for (j, (dsj, &pj)) in ds.iter_mut().zip(&p).enumerate() {
                    let vr = dims.row(dims.k_len, b, j, h);
                    let dp = dot(&dos[qr..qr + d], &vs[vr..vr + d]);
                    *dsj = pj * (factor(j).map_or(dp, |f| dp * f) - delta);
                }
                for (j, (&pj, &dsj)) in p.iter().zip(&ds).enumerate() {
                    let pj = factor(j).map_or(pj, |f| pj * f);
                    let kr = dims.row(dims.k_len, b, j, h);
                    for c in 0..d {
                        dq[qr + c] = dq[qr + c] + scale * dsj * ks[kr + c];
                        dk[kr + c] = dk[kr + c] + scale * dsj * qs[qr + c];
                        dv[kr + c] = dv[kr + c] + pj * dos[qr + c];
                    }
                }
            }
        }
    }
    Ok(vec![
        T::store(q.dtype(), q.shape().to_vec(), dq)?,
        T::store(k.dtype(), k.shape().to_vec(), dk)?,
        T::store(v.dtype(), v.shape().to_vec(), dv)?,
    ])
}
