//! Scaled casts to and from the FP8 dtypes (issue 44): what an FP8 GEMM's operands
//! go through. `QuantizeFp8` multiplies by a scale in f32 and stores the product as
//! the GPU's `cvt.rn.satfinite` does, and gives the input's largest magnitude (amax)
//! beside it, the statistic current and delayed scaling compute the next scale from;
//! `DequantizeFp8` multiplies back by the scale's inverse; `Fp8MatMul` is the product
//! of two FP8 operands by their scales' inverses, as cuBLASLt's FP8 GEMM computes it.
//! The scales come from `Fp8Scale` (current scaling: this tensor's amax) or from
//! `Fp8ScaleUpdate` (delayed scaling: a history of earlier amaxes, TransformerEngine's
//! recipe), both in the graph, so no step asks the host.

use std::borrow::Cow;

use crate::attrs::{AttrReader, AttrValue};
use crate::dtype::DType;
use crate::fp8::{amax, Fp8};
use crate::op::{fixed, per_member, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::ops::fused::Expr;
use crate::ops::linalg::{gemm_into, MatView};
use crate::ops::{
    BiasAdd, Binary, BinaryKind, DataFormat, FusedAttention, FusedAttentionGrad, FusedElementwise,
    LayerNorm, LayerNormGrad, MatMul, Transpose, Unary, UnaryKind,
};
use crate::tensor::{Data, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "QuantizeFp8",
        parse: |_, a| {
            let op = read_cast(a)?;
            Ok(Box::new(op.with_activation(read_activation(a)?)))
        },
    },
    OpEntry {
        name: "FusedQuantizeFp8",
        parse: |_, a| {
            let op = read_cast(a)?;
            Ok(Box::new(FusedQuantizeFp8::new(
                op,
                FusedElementwise::parse(a)?,
            )?))
        },
    },
    OpEntry {
        name: "LayerNormQuantizeFp8",
        parse: |_, a| {
            let op = read_cast(a)?;
            let norm = LayerNorm::parse_with_to(a, "norm_to")?;
            Ok(Box::new(LayerNormQuantizeFp8::new(norm, op)?))
        },
    },
    OpEntry {
        name: "LayerNormGradQuantizeFp8",
        parse: |_, a| {
            let op = read_cast(a)?;
            Ok(Box::new(LayerNormGradQuantizeFp8::new(
                LayerNormGrad::parse(a)?,
                op,
            )?))
        },
    },
    OpEntry {
        name: "FusedAttentionQuantizeFp8",
        parse: |_, a| {
            let op = read_cast(a)?;
            let attention = FusedAttention::parse(a)?;
            Ok(Box::new(FusedAttentionQuantizeFp8::new(attention, op)?))
        },
    },
    OpEntry {
        name: "FusedAttentionGradQuantizeFp8",
        parse: |_, a| {
            let cast = FusedQuantizeFp8::new(read_cast(a)?, FusedElementwise::parse(a)?)?;
            let grad = FusedAttentionGrad::parse(a)?;
            Ok(Box::new(FusedAttentionGradQuantizeFp8::new(grad, cast)?))
        },
    },
    OpEntry {
        name: "GroupedQuantizeFp8",
        parse: |_, a| {
            let members = a.positive("members")?;
            GroupedQuantizeFp8::new(a.dtype("to")?, members).map(|op| Box::new(op) as _)
        },
    },
    OpEntry {
        name: "DequantizeFp8",
        parse: |_, a| Ok(Box::new(DequantizeFp8::new(a.dtype("to")?)?)),
    },
    OpEntry {
        name: "Fp8MatMul",
        parse: |_, a| {
            let product = MatMul::new(
                a.bool_or("transpose_a", false)?,
                a.bool_or("transpose_b", false)?,
            );
            let op = Fp8MatMul::new(product, a.dtype("to")?)?
                .with_fast_accumulation(a.bool_or("fast_accumulation", false)?);
            let op = op.with_bias(a.bool_or("bias", false)?)?;
            Ok(Box::new(op.with_residual(a.bool_or("residual", false)?)?))
        },
    },
    OpEntry {
        name: "Fp8Scale",
        parse: |_, a| {
            let op = Fp8Scale::parse(a)?;
            Ok(Box::new(op.with_activation(read_activation(a)?)))
        },
    },
    OpEntry {
        name: "Fp8ScaleOfAmax",
        parse: |_, a| {
            Ok(Box::new(Fp8ScaleOfAmax {
                scale: Fp8Scale::parse(a)?,
            }))
        },
    },
    OpEntry {
        name: "Fp8ScaleUpdate",
        parse: |_, a| {
            let amax = a.choice("amax", &AmaxChoice::NAMES, Some(AmaxChoice::Max))?;
            // Required: before it the op had one tensor and gave this step's inverse.
            let members = a.positive("members")?;
            Ok(Box::new(Fp8ScaleUpdate {
                scale: Fp8Scale::parse(a)?,
                amax,
                members,
            }))
        },
    },
];

/// The cast's own attrs (`to`, `transposed`) of the ops that quantise.
fn read_cast(a: &mut AttrReader) -> OpResult<QuantizeFp8> {
    Ok(QuantizeFp8::new(a.dtype("to")?)?.with_transposed(a.bool_or("transposed", false)?))
}

/// `quantize`, which a fused op whose kernel computes the value itself takes only
/// without an activation (`of` names the value).
fn without_activation(quantize: QuantizeFp8, of: &str) -> OpResult<QuantizeFp8> {
    match quantize.activation {
        Some(_) => Err(format!(
            "an FP8 cast of {of} applies no activation of its own"
        )),
        None => Ok(quantize),
    }
}

/// The `activation` attr of the ops that read a tensor to quantise it (with its
/// kind's own attrs beside it, as a Unary's): a layer's activation computed as they
/// read its input, so that its output is never stored in 16 bits
/// (`activation-into-fp8` folds a Unary in).
fn read_activation(a: &mut AttrReader) -> OpResult<Option<UnaryKind>> {
    a.opt_str("activation")?
        .map(|name| UnaryKind::parse(&name, a).map_err(|e| format!("attr 'activation': {e}")))
        .transpose()
}

fn activation_attrs(activation: Option<UnaryKind>) -> Vec<(&'static str, AttrValue)> {
    let Some(kind) = activation else {
        return Vec::new();
    };
    let mut attrs = vec![("activation", kind.name().into())];
    attrs.extend(kind.attrs());
    attrs
}

/// `x`, or its activation rounded to x's dtype (as the Unary node stored it).
fn activated(x: &Tensor, activation: Option<UnaryKind>) -> OpResult<Cow<'_, Tensor>> {
    match activation {
        None => Ok(Cow::Borrowed(x)),
        Some(kind) => {
            let y = Unary::new(kind).eval(&[x])?.into_iter().next();
            Ok(Cow::Owned(y.ok_or("the activation gave no value")?))
        }
    }
}

/// `(x, scale) -> (y, amax)`: `y = fp8(f32(x) * scale)` rounded to nearest even and
/// saturated (in `to`, E4M3 or E5M2), `amax = max |x|` as an f32 scalar (NaN where
/// some x is NaN: the recipe then treats the step as a loss scale treats an
/// overflow). `x` is f32, f16 or bf16; `scale` an f32 scalar.
///
/// With `transposed` (a matrix `x`), a third output holds `y` transposed: Hopper's FP8
/// products read both operands K-major, so a weight gradient `X^T dY` needs both
/// operands transposed, and the quantising pass writes that copy while it holds the
/// tile (TransformerEngine's cast-transpose) instead of a product reading `y` back.
///
/// With `activation`, `x` is the activation's input and the op quantises (and
/// measures) the activation's values, each rounded to x's dtype first.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizeFp8 {
    pub to: DType,
    pub transposed: bool,
    pub activation: Option<UnaryKind>,
}

impl QuantizeFp8 {
    pub fn new(to: DType) -> OpResult<Self> {
        if !to.is_fp8() {
            return Err(format!("QuantizeFp8 stores f8e4m3 or f8e5m2, not {to}"));
        }
        Ok(QuantizeFp8 {
            to,
            transposed: false,
            activation: None,
        })
    }

    pub fn with_transposed(self, transposed: bool) -> Self {
        QuantizeFp8 { transposed, ..self }
    }

    pub fn with_activation(self, activation: Option<UnaryKind>) -> Self {
        QuantizeFp8 { activation, ..self }
    }

    /// The sides of a matrix `x` whose cast and transposed copy the tiled kernels write
    /// from the same tiles: transposed, sides multiples of 8 (what the CUDA executor's
    /// cast-transpose kernels take, and the passes folding work into them check).
    pub fn tiled_sides(&self, shape: &[usize]) -> Option<(usize, usize)> {
        (self.transposed_sides(shape).ok().flatten())
            .filter(|(rows, cols)| rows % 8 == 0 && cols % 8 == 0)
    }

    /// The sides `(rows, cols)` of the matrix `x` of `shape` whose transposed copy the
    /// op writes; `None` without one.
    pub fn transposed_sides(&self, shape: &[usize]) -> OpResult<Option<(usize, usize)>> {
        match (self.transposed, shape) {
            (false, _) => Ok(None),
            (true, &[rows, cols]) => Ok(Some((rows, cols))),
            (true, _) => Err(format!(
                "a transposed copy is of a matrix, not of shape {shape:?}"
            )),
        }
    }
}

/// `(inputs..., scale) -> (y, amax[, y^T], column sums...)`: [`QuantizeFp8`] of the
/// value an elementwise program computes (its one stored output), the program's
/// column sums after the cast's outputs (the `elementwise-into-fp8` pass builds it
/// from a fused program read only by a delayed-scaling cast: a GELU gradient and its
/// bias gradient, TransformerEngine's `dgelu_cast_transpose_dbias`). The CUDA kernel
/// computes the value as it loads each tile, so it is never stored in 16 bits and
/// read back. The CPU kernel runs the program, then the cast: bit-exact against the
/// ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedQuantizeFp8 {
    pub quantize: QuantizeFp8,
    prologue: FusedElementwise,
}

impl FusedQuantizeFp8 {
    /// The cast (without an activation) of `prologue`'s value: a program with one
    /// stored output and no amaxes.
    pub fn new(quantize: QuantizeFp8, prologue: FusedElementwise) -> OpResult<Self> {
        if prologue.outputs().len() != 1 || !prologue.amaxes().is_empty() {
            return Err(format!(
                "an FP8 cast's prologue stores one value and measures none, this one {} values and {} amaxes",
                prologue.outputs().len(),
                prologue.amaxes().len()
            ));
        }
        let quantize = without_activation(quantize, "a prologue's value")?;
        Ok(FusedQuantizeFp8 { quantize, prologue })
    }

    pub fn prologue(&self) -> &FusedElementwise {
        &self.prologue
    }

    /// The cast's own outputs (its column sums follow).
    pub fn cast_outputs(&self) -> usize {
        2 + usize::from(self.quantize.transposed)
    }
}

impl Op for FusedQuantizeFp8 {
    fn name(&self) -> &'static str {
        "FusedQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(self.prologue.num_inputs() + 1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.quantize.attrs();
        attrs.extend(self.prologue.attrs());
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let Some((scale, program_inputs)) = inputs.split_last() else {
            return Err("the program's inputs and the scale".into());
        };
        let mut values = self.prologue.infer(program_inputs)?;
        let sums = values.split_off(1);
        let mut outs = self.quantize.infer(&[&values[0], scale])?;
        outs.extend(sums);
        Ok(outs)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let Some((scale, program_inputs)) = inputs.split_last() else {
            return Err("the program's inputs and the scale".into());
        };
        let mut values = self.prologue.eval(program_inputs)?;
        let sums = values.split_off(1);
        let mut outs = self.quantize.eval(&[&values[0], scale])?;
        outs.extend(sums);
        Ok(outs)
    }
    /// Every input and output keeps its type, as the program's do.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        self.prologue.type_groups(num_inputs, num_outputs)
    }
}

/// `(x, gamma, beta, scale) -> (y, amax[, y^T])`: [`QuantizeFp8`] of a [`LayerNorm`]'s
/// output, each value rounded to the norm's output dtype first, as the LayerNorm
/// stored it (the `norm-into-fp8` pass folds a LayerNorm read only by a delayed-scaling
/// cast: a pre-LN transformer's inputs to its FP8 qkv and feed-forward products). The
/// CUDA kernel normalises a band of rows in registers and writes both FP8 copies from
/// shared memory, so the 16-bit normalised rows are never stored and read back. The
/// CPU kernel runs the norm, then the cast: bit-exact against the ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormQuantizeFp8 {
    pub norm: LayerNorm,
    pub quantize: QuantizeFp8,
}

impl LayerNormQuantizeFp8 {
    /// The cast (without an activation) of `norm`'s output.
    pub fn new(norm: LayerNorm, quantize: QuantizeFp8) -> OpResult<Self> {
        let quantize = without_activation(quantize, "a layer norm")?;
        Ok(LayerNormQuantizeFp8 { norm, quantize })
    }
}

impl Op for LayerNormQuantizeFp8 {
    fn name(&self) -> &'static str {
        "LayerNormQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(4)
    }
    /// The cast's attrs, then the norm's (its output dtype as `norm_to`).
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.quantize.attrs();
        attrs.extend(self.norm.attrs_with_to("norm_to"));
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, gamma, beta, scale] = fixed(inputs)?;
        let normalized = self.norm.infer(&[x, gamma, beta])?.remove(0);
        self.quantize.infer(&[&normalized, scale])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, gamma, beta, scale] = fixed(inputs)?;
        let normalized = self.norm.eval(&[x, gamma, beta])?.remove(0);
        self.quantize.eval(&[&normalized, scale])
    }
    /// The stored types are the cast's; the norm's inputs keep theirs (it computes in
    /// gamma's, reading a narrower x); the scale and amax stay f32.
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        let stored = if self.quantize.transposed {
            vec![0, 2]
        } else {
            vec![0]
        };
        vec![
            TypeGroup::new(vec![], stored).fixed(),
            TypeGroup::new(vec![0, 1, 2], vec![]).fixed(),
            TypeGroup::new(vec![3], vec![1]).fixed(),
        ]
    }
}

/// `(x, gamma, dy[, residual], scale) -> (dx, dgamma, dbeta[, sums], y, amax[, y^T])`:
/// a [`LayerNormGrad`] whose output 0 (dx, the residual added) a delayed-scaling
/// [`QuantizeFp8`] also casts (`norm-grad-into-fp8` folds it: in a pre-LN transformer each
/// block's first norm gives the residual gradient the FP8 gradient products of the
/// block before read). The CUDA kernel casts each row as it stores dx, so dx is not
/// read back to be cast; dx stays an output (the residual branch and the next norm
/// read it). The CPU kernel runs the gradient, then the cast: bit-exact against the
/// ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormGradQuantizeFp8 {
    pub grad: LayerNormGrad,
    pub quantize: QuantizeFp8,
}

impl LayerNormGradQuantizeFp8 {
    /// The cast (without an activation) of `grad`'s dx.
    pub fn new(grad: LayerNormGrad, quantize: QuantizeFp8) -> OpResult<Self> {
        let quantize = without_activation(quantize, "a layer norm's gradient")?;
        Ok(LayerNormGradQuantizeFp8 { grad, quantize })
    }
}

impl Op for LayerNormGradQuantizeFp8 {
    fn name(&self) -> &'static str {
        "LayerNormGradQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(if self.grad.epilogue.residual { 5 } else { 4 })
    }
    /// The cast's attrs, then the gradient's.
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.quantize.attrs();
        attrs.extend(self.grad.attrs());
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (grad, scale) = op_and_scale(inputs)?;
        let mut out = self.grad.infer(grad)?;
        let cast = self.quantize.infer(&[&out[0], scale])?;
        out.extend(cast);
        Ok(out)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let (grad, scale) = op_and_scale(inputs)?;
        let mut out = self.grad.eval(grad)?;
        let cast = self.quantize.eval(&[&out[0], scale])?;
        out.extend(cast);
        Ok(out)
    }
    /// Every type is fixed: the gradient's as AMP left them, the cast's stored FP8
    /// types, the scale and amax f32.
    fn type_groups(&self, num_inputs: usize, _: usize) -> Vec<TypeGroup> {
        let grad_outputs = 3 + self.grad.epilogue.sums();
        let cast = grad_outputs;
        let mut stored = vec![cast];
        stored.extend(self.quantize.transposed.then_some(cast + 2));
        let mut groups: Vec<TypeGroup> = self
            .grad
            .type_groups(num_inputs.saturating_sub(1), grad_outputs)
            .into_iter()
            .map(TypeGroup::fixed)
            .collect();
        groups.push(TypeGroup::new(vec![], stored).fixed());
        groups.push(TypeGroup::new(vec![num_inputs.saturating_sub(1)], vec![cast + 1]).fixed());
        groups
    }
}

/// `(the attention's inputs..., scale) -> (o, lse, y, amax[, y^T])`: a
/// [`FusedAttention`] whose output `o [B, S, H, D]`, as the `[B S, H D]` matrix of the
/// output projection's input, a delayed-scaling [`QuantizeFp8`] also casts
/// (`attention-into-fp8` folds it: the FP8 out-projection reads the cast, the
/// attention's gradient `o`). The CUDA forward kernel casts each tile as it stores
/// `o`, so `o` is not read back to be cast. The CPU kernel runs the attention, then
/// the cast: bit-exact against the ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttentionQuantizeFp8 {
    pub attention: FusedAttention,
    pub quantize: QuantizeFp8,
}

impl FusedAttentionQuantizeFp8 {
    /// The cast (without an activation) of `attention`'s output.
    pub fn new(attention: FusedAttention, quantize: QuantizeFp8) -> OpResult<Self> {
        let quantize = without_activation(quantize, "an attention's output")?;
        Ok(FusedAttentionQuantizeFp8 {
            attention,
            quantize,
        })
    }
}

/// The `[B S, H D]` matrix of an attention output `o [B, S, H, D]`'s shape.
fn attention_rows(shape: &[usize]) -> OpResult<Vec<usize>> {
    match shape {
        &[b, s, h, d] => Ok(vec![b * s, h * d]),
        _ => Err(format!("an attention output of shape {shape:?}")),
    }
}

impl Op for FusedAttentionQuantizeFp8 {
    fn name(&self) -> &'static str {
        "FusedAttentionQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        match self.attention.arity() {
            Arity::Exactly(n) => Arity::Exactly(n + 1),
            other => other,
        }
    }
    /// The cast's attrs, then the attention's.
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.quantize.attrs();
        attrs.extend(self.attention.attrs());
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (attention, scale) = op_and_scale(inputs)?;
        let mut out = self.attention.infer(attention)?;
        let rows = TensorType::new(out[0].dtype, attention_rows(&out[0].shape)?);
        out.extend(self.quantize.infer(&[&rows, scale])?);
        Ok(out)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let (attention, scale) = op_and_scale(inputs)?;
        let mut out = self.attention.eval(attention)?;
        let rows = out[0].clone().reshaped(attention_rows(out[0].shape())?)?;
        out.extend(self.quantize.eval(&[&rows, scale])?);
        Ok(out)
    }
    /// Every type is fixed: the attention's as AMP left them, the cast's stored FP8
    /// types, the scale and amax f32.
    fn type_groups(&self, num_inputs: usize, _: usize) -> Vec<TypeGroup> {
        let inputs = num_inputs.saturating_sub(1);
        let mut groups: Vec<TypeGroup> = (self.attention.type_groups(inputs, 2).into_iter())
            .map(TypeGroup::fixed)
            .collect();
        let mut stored = vec![2];
        stored.extend(self.quantize.transposed.then_some(4));
        groups.push(TypeGroup::new(vec![], stored).fixed());
        groups.push(TypeGroup::new(vec![inputs], vec![3]).fixed());
        groups
    }
}

/// `(the gradient's inputs..., scale) -> (y, amax[, y^T], column sums...)`: a packed
/// [`FusedAttentionGrad`] whose `dqkv [B, S, 3, H, D]`, as the `[B S, 3 H D]` matrix
/// of the qkv product's output gradient, only a delayed-scaling cast reads: a
/// [`FusedQuantizeFp8`] of the matrix as it is (its transposed copy and column sums
/// are the product's weight and bias gradients' operands; `attention-grad-into-fp8`
/// folds it). The CUDA kernels cast each tile of dq, dk and dv as they store it, so
/// dqkv is never stored in 16 bits and read back. The CPU kernel runs the gradient,
/// then the cast: bit-exact against the ops it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedAttentionGradQuantizeFp8 {
    pub grad: FusedAttentionGrad,
    pub cast: FusedQuantizeFp8,
}

impl FusedAttentionGradQuantizeFp8 {
    /// `cast` (of its program's one input as it is) of packed `grad`'s dqkv.
    pub fn new(grad: FusedAttentionGrad, cast: FusedQuantizeFp8) -> OpResult<Self> {
        let p = cast.prologue();
        let identity = p.num_inputs() == 1
            && matches!(p.instrs(), [only] if matches!(only.expr, Expr::Input(0)))
            && p.outputs() == [0];
        if !(grad.packed && identity) {
            return Err(
                "an attention gradient is cast as it is stored only packed, by a cast of dqkv as it is"
                    .into(),
            );
        }
        Ok(FusedAttentionGradQuantizeFp8 { grad, cast })
    }
}

/// The `[B S, 3 H D]` matrix of a packed `dqkv [B, S, 3, H, D]`'s shape.
fn qkv_rows(shape: &[usize]) -> OpResult<Vec<usize>> {
    match shape {
        &[b, s, three, h, d] => Ok(vec![b * s, three * h * d]),
        _ => Err(format!("dqkv of shape {shape:?} is not packed")),
    }
}

impl Op for FusedAttentionGradQuantizeFp8 {
    fn name(&self) -> &'static str {
        "FusedAttentionGradQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        match self.grad.arity() {
            Arity::Exactly(n) => Arity::Exactly(n + 1),
            other => other,
        }
    }
    /// The cast's attrs, then the gradient's.
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.cast.attrs();
        attrs.extend(self.grad.attrs());
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (grad, scale) = op_and_scale(inputs)?;
        let dqkv = self.grad.infer(grad)?.remove(0);
        let rows = TensorType::new(dqkv.dtype, qkv_rows(&dqkv.shape)?);
        self.cast.infer(&[&rows, scale])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let (grad, scale) = op_and_scale(inputs)?;
        let dqkv = self.grad.eval(grad)?.remove(0);
        let rows = qkv_rows(dqkv.shape())?;
        self.cast.eval(&[&dqkv.reshaped(rows)?, scale])
    }
    /// Every type is fixed: the gradient's inputs as AMP left them, the cast's stored
    /// FP8 types and column sums, the scale and amax f32.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        let grad_inputs = num_inputs.saturating_sub(1);
        let mut groups: Vec<TypeGroup> = (self.grad.type_groups(grad_inputs, 0).into_iter())
            .map(TypeGroup::fixed)
            .collect();
        let cast = self.cast.cast_outputs();
        let mut stored = vec![0];
        stored.extend(self.cast.quantize.transposed.then_some(2));
        stored.extend(cast..num_outputs);
        groups.push(TypeGroup::new(vec![], stored).fixed());
        groups.push(TypeGroup::new(vec![grad_inputs], vec![1]).fixed());
        groups
    }
}

/// A fused op-and-cast's inputs: the op's (all but the last) and the cast's scale.
fn op_and_scale<'a, T>(inputs: &'a [&'a T]) -> OpResult<(&'a [&'a T], &'a T)> {
    match inputs.split_last() {
        Some((scale, op)) if !op.is_empty() => Ok((op, scale)),
        _ => Err("missing inputs".into()),
    }
}

/// `(y, scale_inv) -> f32(y) * scale_inv`, rounded to `to` (f32, f16 or bf16).
#[derive(Clone, Debug, PartialEq)]
pub struct DequantizeFp8 {
    pub to: DType,
}

impl DequantizeFp8 {
    pub fn new(to: DType) -> OpResult<Self> {
        check_wide("DequantizeFp8 gives", to)?;
        Ok(DequantizeFp8 { to })
    }
}

/// Checks that `dtype` is one an FP8 tensor is quantised from or dequantised to:
/// f32, f16 or bf16 (`what` says whose, as "x must be").
fn check_wide(what: &str, dtype: DType) -> OpResult<()> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        Ok(())
    } else {
        Err(format!("{what} f32, f16 or bf16, not {dtype}"))
    }
}

/// Checks a scale operand: an f32 scalar.
fn check_scale(what: &str, t: &TensorType) -> OpResult<()> {
    if t.dtype != DType::F32 || !t.shape.is_empty() {
        return Err(format!("{what} must be an f32 scalar, not {t}"));
    }
    Ok(())
}

fn scalar_of(t: &Tensor) -> f32 {
    t.to_f32_vec().first().copied().unwrap_or(f32::NAN)
}

impl Op for QuantizeFp8 {
    fn name(&self) -> &'static str {
        "QuantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![
            ("to", self.to.into()),
            ("transposed", self.transposed.into()),
        ];
        attrs.extend(activation_attrs(self.activation));
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, scale] = fixed(inputs)?;
        check_wide("x must be", x.dtype)?;
        check_scale("scale", scale)?;
        let mut outs = vec![x.with_dtype(self.to), TensorType::new(DType::F32, [])];
        if let Some((rows, cols)) = self.transposed_sides(&x.shape)? {
            outs.push(TensorType::new(self.to, vec![cols, rows]));
        }
        Ok(outs)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, scale] = fixed(inputs)?;
        let x = activated(x, self.activation)?;
        let (xs, s) = (x.to_f32_vec(), scalar_of(scale));
        let amax = amax(&xs);
        let scaled: Vec<f32> = xs.iter().map(|&v| v * s).collect();
        let y = Tensor::new(x.shape().to_vec(), Data::from_f32(self.to, scaled))?;
        let copy = match self.transposed_sides(x.shape())? {
            Some(_) => Transpose::new([1, 0]).eval(&[&y])?.pop(),
            None => None,
        };
        Ok([y, Tensor::scalar(DType::F32, f64::from(amax))]
            .into_iter()
            .chain(copy)
            .collect())
    }
    /// The stored types are its own; `x` may be converted by mixed precision; the
    /// scale and amax stay f32.
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        let stored = if self.transposed { vec![0, 2] } else { vec![0] };
        vec![
            TypeGroup::new(vec![], stored).fixed(),
            TypeGroup::new(vec![0], vec![]),
            TypeGroup::new(vec![1], vec![1]).fixed(),
        ]
    }
}

/// Several transposed [`QuantizeFp8`]s of matrices of one dtype as one node
/// (TransformerEngine's `multi_cast_transpose`), so that an executor casts a step's
/// weights in one launch: inputs `(x, scale)` per member in turn, outputs `(y, amax,
/// y^T)` per member in turn. Members may differ in shape. The `group-fp8-casts` pass
/// makes them of delayed-scaling casts of variables: GPT-2 cast its 35 FP8 weights
/// by a launch each, most too small to fill the GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedQuantizeFp8 {
    /// Each member's cast (transposed, without an activation).
    pub quantize: QuantizeFp8,
    pub members: usize,
}

impl GroupedQuantizeFp8 {
    /// The inputs of one member: x and its scale.
    pub const MEMBER_INPUTS: usize = 2;
    /// The outputs of one member: y, its amax and y transposed.
    pub const MEMBER_OUTPUTS: usize = 3;

    pub fn new(to: DType, members: usize) -> OpResult<Self> {
        Ok(GroupedQuantizeFp8 {
            quantize: QuantizeFp8::new(to)?.with_transposed(true),
            members,
        })
    }
}

impl Op for GroupedQuantizeFp8 {
    fn name(&self) -> &'static str {
        "GroupedQuantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(Self::MEMBER_INPUTS * self.members)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("to", self.quantize.to.into()),
            ("members", (self.members as i64).into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let mut values = inputs.iter().step_by(Self::MEMBER_INPUTS);
        if let (Some(first), Some(other)) =
            (values.next(), values.find(|x| x.dtype != inputs[0].dtype))
        {
            return Err(format!(
                "the members' values must share one dtype, not {} and {}",
                first.dtype, other.dtype
            ));
        }
        per_member(inputs, Self::MEMBER_INPUTS, |member| {
            self.quantize.infer(member)
        })
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        per_member(inputs, Self::MEMBER_INPUTS, |member| {
            self.quantize.eval(member)
        })
    }
    /// As [`QuantizeFp8`]'s, the members' values one type.
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        let (i, o) = (Self::MEMBER_INPUTS, Self::MEMBER_OUTPUTS);
        let members = 0..self.members;
        vec![
            TypeGroup::new(
                vec![],
                members.clone().flat_map(|m| [o * m, o * m + 2]).collect(),
            )
            .fixed(),
            TypeGroup::new(members.clone().map(|m| i * m).collect(), vec![]),
            TypeGroup::new(
                members.clone().map(|m| i * m + 1).collect(),
                members.map(|m| o * m + 1).collect(),
            )
            .fixed(),
        ]
    }
}

impl Op for DequantizeFp8 {
    fn name(&self) -> &'static str {
        "DequantizeFp8"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("to", self.to.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [y, scale_inv] = fixed(inputs)?;
        if !y.dtype.is_fp8() {
            return Err(format!("y must be f8e4m3 or f8e5m2, not {}", y.dtype));
        }
        check_scale("scale_inv", scale_inv)?;
        Ok(vec![y.with_dtype(self.to)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [y, scale_inv] = fixed(inputs)?;
        let s = scalar_of(scale_inv);
        let values: Vec<f32> = y.to_f32_vec().into_iter().map(|v| v * s).collect();
        Ok(vec![Tensor::new(
            y.shape().to_vec(),
            Data::from_f32(self.to, values),
        )?])
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        vec![
            TypeGroup::new(vec![], vec![0]),
            TypeGroup::new(vec![0], vec![]).fixed(),
            TypeGroup::new(vec![1], vec![]).fixed(),
        ]
    }
}

/// `(a, b, a_scale_inv, b_scale_inv) -> op(a) op(b) * (a_scale_inv * b_scale_inv)`,
/// stored in `to` (f32, f16 or bf16): cuBLASLt's FP8 GEMM, which accumulates in f32 and
/// applies the operands' scale inverses in its epilogue. `a` and `b` are FP8, not both
/// E5M2 (Hopper has no such product: gradients are E5M2, so one side of a backward
/// product is E4M3); the scales are f32 scalars.
///
/// `fast_accumulation` lets the GPU sum in Hopper's fast mode, which skips the
/// periodic promotion of partial sums to f32 (cuBLASLt's `FAST_ACCUM`: 1.1-1.2x
/// faster, fewer bits kept); torchao and TransformerEngine use it for forward
/// products, the AMP pass for every product by default (`FastAccumulation`). The CPU
/// reference sums in f32 either way.
///
/// With `bias`, a fifth input `[n]` of the output's dtype (16-bit: cuBLASLt's FP8
/// epilogue adds a 16-bit bias to a 16-bit result) is added to every row:
/// `gemm-epilogue` folds a Linear's BiasAdd in, as into 16-bit products. With
/// `residual`, a last input of the output's type is added after it (a residual
/// connection's `Add`: cuBLASLt's `C` with beta 1, 16-bit results too), as
/// [`FusedMatMul::residual`](crate::ops::FusedMatMul::residual).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8MatMul {
    pub product: MatMul,
    pub to: DType,
    pub fast_accumulation: bool,
    pub bias: bool,
    pub residual: bool,
}

impl Fp8MatMul {
    pub fn new(product: MatMul, to: DType) -> OpResult<Self> {
        check_wide("Fp8MatMul gives", to)?;
        Ok(Fp8MatMul {
            product,
            to,
            fast_accumulation: false,
            bias: false,
            residual: false,
        })
    }

    /// Whether the product can add a bias or a residual: cuBLASLt's FP8 epilogue adds
    /// them to a 16-bit result only.
    pub fn can_take_bias(&self) -> bool {
        matches!(self.to, DType::F16 | DType::BF16)
    }

    /// The product adding a bias input ([`Self::can_take_bias`]).
    pub fn with_bias(self, bias: bool) -> OpResult<Self> {
        self.check_addend(bias, "a bias")?;
        Ok(Fp8MatMul { bias, ..self })
    }

    /// The product adding a residual input ([`Self::can_take_bias`]).
    pub fn with_residual(self, residual: bool) -> OpResult<Self> {
        self.check_addend(residual, "a residual")?;
        Ok(Fp8MatMul { residual, ..self })
    }

    fn check_addend(&self, added: bool, what: &str) -> OpResult<()> {
        if added && !self.can_take_bias() {
            return Err(format!(
                "an FP8 product adds {what} to an f16 or bf16 result, not {}",
                self.to
            ));
        }
        Ok(())
    }

    pub fn with_fast_accumulation(self, fast_accumulation: bool) -> Self {
        Fp8MatMul {
            fast_accumulation,
            ..self
        }
    }
}

impl Op for Fp8MatMul {
    fn name(&self) -> &'static str {
        "Fp8MatMul"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(self.input_count())
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![
            ("transpose_a", self.product.transpose_a.into()),
            ("transpose_b", self.product.transpose_b.into()),
            ("to", self.to.into()),
            ("fast_accumulation", self.fast_accumulation.into()),
            ("bias", self.bias.into()),
        ];
        if self.residual {
            attrs.push(("residual", true.into()));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (inputs, bias, residual) = self.split_addends(inputs)?;
        let [a, b, a_scale_inv, b_scale_inv] = fixed(inputs)?;
        for (what, t) in [("a", a), ("b", b)] {
            if !t.dtype.is_fp8() {
                return Err(format!("{what} must be f8e4m3 or f8e5m2, not {}", t.dtype));
            }
        }
        if a.dtype == DType::F8E5M2 && b.dtype == DType::F8E5M2 {
            return Err("a and b are both f8e5m2: FP8 products take E4M3 on one side".into());
        }
        check_scale("a_scale_inv", a_scale_inv)?;
        check_scale("b_scale_inv", b_scale_inv)?;
        let (m, _, n) = self.product.dims(&a.shape, &b.shape)?;
        let row = TensorType::new(self.to, vec![n]);
        if let Some(bias) = bias.filter(|&t| *t != row) {
            return Err(format!("the bias must be {row}, not {bias}"));
        }
        let out = TensorType::new(self.to, vec![m, n]);
        if let Some(r) = residual.filter(|&t| *t != out) {
            return Err(format!(
                "the residual must be {out} (the output's type), not {r}"
            ));
        }
        Ok(vec![out])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let (inputs, bias, residual) = self.split_addends(inputs)?;
        let [a, b, a_scale_inv, b_scale_inv] = fixed(inputs)?;
        let (m, k, n) = self.product.dims(a.shape(), b.shape())?;
        let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
        let mut out = vec![0f32; m * n];
        gemm_into(
            m,
            n,
            k,
            &mut out,
            MatView::dense(&av, a.shape()[1], self.product.transpose_a),
            MatView::dense(&bv, b.shape()[1], self.product.transpose_b),
            true,
        )?;
        let scale = scalar_of(a_scale_inv) * scalar_of(b_scale_inv);
        out.iter_mut().for_each(|v| *v *= scale);
        let product = Tensor::new(vec![m, n], Data::from_f32(self.to, out))?;
        // As the product, a BiasAdd and an Add apart compute it (`FusedMatMul`
        // likewise): the GPU's epilogue rounds once, within the output's rounding of
        // this.
        let mut out = match bias {
            Some(bias) => BiasAdd {
                data_format: DataFormat::Nhwc,
            }
            .eval(&[&product, bias])?,
            None => vec![product],
        };
        if let Some(r) = residual {
            out = Binary::new(BinaryKind::Add).eval(&[&out[0], r])?;
        }
        Ok(out)
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        let result = (4..self.input_count()).collect();
        vec![
            TypeGroup::new(result, vec![0]),
            TypeGroup::new(vec![0], vec![]).fixed(),
            TypeGroup::new(vec![1], vec![]).fixed(),
            TypeGroup::new(vec![2, 3], vec![]).fixed(),
        ]
    }
}

impl Fp8MatMul {
    /// The four product inputs, then the bias and the residual where it adds them.
    fn input_count(&self) -> usize {
        4 + usize::from(self.bias) + usize::from(self.residual)
    }

    /// The four product inputs, the bias and the residual, where the product has them.
    #[allow(clippy::type_complexity)]
    fn split_addends<'t, T>(
        &self,
        inputs: &'t [&'t T],
    ) -> OpResult<(&'t [&'t T], Option<&'t T>, Option<&'t T>)> {
        let (rest, residual) = match (self.residual, inputs) {
            (true, [rest @ .., r]) => (rest, Some(*r)),
            (false, _) => (inputs, None),
            (true, []) => return Err("a product with a residual takes it last".into()),
        };
        match (self.bias, rest) {
            (true, [four @ .., bias]) => Ok((four, Some(*bias), residual)),
            (false, _) => Ok((rest, None, residual)),
            (true, []) => Err("a product with a bias takes five inputs".into()),
        }
    }
}

/// `x -> (scale, scale_inv)`: current ("tensorwise") scaling, torchao's default. The
/// scale maps `x`'s amax onto the format's largest value, `2^margin` below it:
/// `scale = max / amax / 2^margin`; 1 where `x` is all zeros; NaN (both) where the
/// amax is not finite, so that the product becomes NaN and a loss-scaled step is
/// skipped, as for a gradient that overflowed. With `activation`, the scale is of the
/// activation's values, as [`QuantizeFp8`]'s.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Scale {
    /// The FP8 dtype scaled to.
    pub format: DType,
    pub margin: i32,
    pub activation: Option<UnaryKind>,
}

impl Fp8Scale {
    pub fn new(format: DType, margin: i32) -> OpResult<Self> {
        if !format.is_fp8() {
            return Err(format!(
                "an FP8 scale is for f8e4m3 or f8e5m2, not {format}"
            ));
        }
        if !(0..=16).contains(&margin) {
            return Err(format!("the margin must be 0 to 16 binades, not {margin}"));
        }
        Ok(Fp8Scale {
            format,
            margin,
            activation: None,
        })
    }

    pub fn with_activation(self, activation: Option<UnaryKind>) -> Self {
        Fp8Scale { activation, ..self }
    }

    fn parse(a: &mut AttrReader) -> OpResult<Self> {
        let margin = a.opt_int("margin")?.unwrap_or(0);
        Fp8Scale::new(
            a.dtype("format")?,
            i32::try_from(margin).map_err(|_| format!("margin {margin} is out of range"))?,
        )
    }

    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("format", self.format.into()),
            ("margin", i64::from(self.margin).into()),
        ]
    }

    /// `(scale, scale_inv)` for a tensor's amax: 1 where it is 0, NaN where it is
    /// not finite.
    fn scales(&self, amax: f32) -> Vec<Tensor> {
        let scale = match self.of_amax(amax) {
            Some(s) => s,
            None if amax == 0.0 => 1.0,
            None => f32::NAN,
        };
        vec![scalar(scale), scalar(1.0 / scale)]
    }

    /// The scale for an amax that is finite and positive, else `None`.
    pub fn of_amax(&self, amax: f32) -> Option<f32> {
        let largest = Fp8::of(self.format)?.max();
        (amax.is_finite() && amax > 0.0).then(|| largest / amax / (1u32 << self.margin) as f32)
    }
}

fn scalar(v: f32) -> Tensor {
    Tensor::scalar(DType::F32, f64::from(v))
}

impl Op for Fp8Scale {
    fn name(&self) -> &'static str {
        "Fp8Scale"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = Fp8Scale::attrs(self);
        attrs.extend(activation_attrs(self.activation));
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        check_wide("x must be", x.dtype)?;
        Ok(vec![TensorType::new(DType::F32, []); 2])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        let m = amax(&activated(x, self.activation)?.to_f32_vec());
        Ok(self.scales(m))
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        vec![
            TypeGroup::new(vec![0], vec![]),
            TypeGroup::new(vec![], vec![0, 1]).fixed(),
        ]
    }
}

/// `amax -> (scale, scale_inv)`: [`Fp8Scale`]'s scales of a tensor whose amax the
/// kernel computing it measured (a `FusedElementwise`'s amax output, given by the
/// `amax-into-elementwise` pass), so that current scaling does not read the tensor
/// a second time.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8ScaleOfAmax {
    /// The format and margin (no activation: the amax is of the stored tensor).
    pub scale: Fp8Scale,
}

impl Op for Fp8ScaleOfAmax {
    fn name(&self) -> &'static str {
        "Fp8ScaleOfAmax"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.scale.attrs()
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [amax] = fixed(inputs)?;
        check_scale("amax", amax)?;
        Ok(vec![TensorType::new(DType::F32, []); 2])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [amax] = fixed(inputs)?;
        Ok(self.scale.scales(scalar_of(amax)))
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        vec![TypeGroup::new(vec![0], vec![0, 1]).fixed()]
    }
}

/// Which amax of the history delayed scaling scales by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmaxChoice {
    /// The largest in the history (TransformerEngine's default).
    Max,
    /// The latest.
    MostRecent,
}

impl AmaxChoice {
    pub const NAMES: [(&'static str, AmaxChoice); 2] = [
        ("max", AmaxChoice::Max),
        ("most_recent", AmaxChoice::MostRecent),
    ];

    pub fn name(self) -> &'static str {
        match self {
            AmaxChoice::Max => "max",
            AmaxChoice::MostRecent => "most_recent",
        }
    }
}

/// Delayed scaling's step for `members` tensors quantised to one format, Transformer
/// Engine's recipe: per member `(history, amax, scale, scale_inv) -> (history', scale',
/// scale_inv')`, the inputs and outputs member after member (the old inverse is read
/// by no one here: it is an input so that its next value may be written over it, as
/// the history's and the scale's are). This step quantised with
/// `scale`, the Variable's value, and measured `amax`; `history'` is `[amax,
/// history[..n-1]]` (unchanged where `amax` is not finite: one overflow does not poison
/// the next thousand scales); `scale'` is [`Fp8Scale`]'s scale of the history's `max`
/// or most recent amax (the old scale where that is 0), and `scale_inv'` its inverse,
/// which the next step's products read. So the products never wait for the update,
/// and one node updates every tensor of a format in a step: on CUDA one launch per 32
/// tensors, where an update per tensor cost GPT-2 146 launches of 5 us. A non-finite
/// amax is for the step's all-finite check to catch (`amp::fp8` adds the amaxes to
/// it).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8ScaleUpdate {
    pub scale: Fp8Scale,
    pub amax: AmaxChoice,
    pub members: usize,
}

impl Fp8ScaleUpdate {
    /// The inputs of one member: its history, amax, scale and scale inverse.
    pub const MEMBER_INPUTS: usize = 4;
    /// The outputs of one member: its next history, scale and scale inverse.
    pub const MEMBER_OUTPUTS: usize = 3;

    /// The outputs that are the next values of inputs, as (output, input slot): each
    /// member's history, scale and scale inverse.
    pub fn replaced_inputs(&self) -> Vec<(usize, usize)> {
        let (i, o) = (Self::MEMBER_INPUTS, Self::MEMBER_OUTPUTS);
        (0..self.members)
            .flat_map(|m| {
                [
                    (o * m, i * m),
                    (o * m + 1, i * m + 2),
                    (o * m + 2, i * m + 3),
                ]
            })
            .collect()
    }

    /// One member's step on the host: `(history', scale', scale_inv')`.
    fn step(&self, history: &Tensor, amax: &Tensor, scale: &Tensor) -> OpResult<[Tensor; 3]> {
        let (mut h, m, s) = (history.to_f32_vec(), scalar_of(amax), scalar_of(scale));
        if m.is_finite() {
            h.rotate_right(1);
            h[0] = m;
        }
        let chosen = match self.amax {
            AmaxChoice::Max => h.iter().fold(0f32, |a, &b| a.max(b)),
            AmaxChoice::MostRecent => h[0],
        };
        let next = self.scale.of_amax(chosen).unwrap_or(s);
        Ok([
            Tensor::new(history.shape().to_vec(), Data::F32(h))?,
            scalar(next),
            scalar(1.0 / next),
        ])
    }
}

impl Op for Fp8ScaleUpdate {
    fn name(&self) -> &'static str {
        "Fp8ScaleUpdate"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(Self::MEMBER_INPUTS * self.members)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.scale.attrs();
        attrs.push(("amax", self.amax.name().into()));
        attrs.push(("members", (self.members as i64).into()));
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let mut out = Vec::with_capacity(Self::MEMBER_OUTPUTS * self.members);
        for (m, member) in inputs.chunks(Self::MEMBER_INPUTS).enumerate() {
            let &[history, amax, scale, scale_inv] = member else {
                return Err(format!("member {m} has {} inputs, not 4", member.len()));
            };
            if history.dtype != DType::F32 || history.shape.len() != 1 || history.shape[0] == 0 {
                return Err(format!(
                    "member {m}: the amax history must be a non-empty f32 vector, not {history}"
                ));
            }
            check_scale("amax", amax).map_err(|e| format!("member {m}: {e}"))?;
            check_scale("scale", scale).map_err(|e| format!("member {m}: {e}"))?;
            check_scale("scale_inv", scale_inv).map_err(|e| format!("member {m}: {e}"))?;
            out.extend([
                history.clone(),
                TensorType::new(DType::F32, []),
                TensorType::new(DType::F32, []),
            ]);
        }
        Ok(out)
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let mut out = Vec::with_capacity(Self::MEMBER_OUTPUTS * self.members);
        for member in inputs.chunks(Self::MEMBER_INPUTS) {
            let &[history, amax, scale, _] = member else {
                return Err("each member takes a history, an amax, a scale and its inverse".into());
            };
            out.extend(self.step(history, amax, scale)?);
        }
        Ok(out)
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        let inputs = (0..Self::MEMBER_INPUTS * self.members).collect();
        let outputs = (0..Self::MEMBER_OUTPUTS * self.members).collect();
        vec![TypeGroup::new(inputs, outputs).fixed()]
    }
}
