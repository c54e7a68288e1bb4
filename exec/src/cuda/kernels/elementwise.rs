//! Elementwise ops, a thread per element (16-byte vectors where aligned): the unary
//! ops and their gradients, the broadcasting binary ops and theirs, BiasAdd and Cast.

use ampgraph_graph::ops::{
    BiasAdd, Binary, BinaryGrad, BinaryKind, Cast, DataFormat, Unary, UnaryGrad, UnaryKind,
};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{elementwise, module, module_multi, own, store, At, Load, Store};
use super::{
    first, float_input, input, kernel, merged_jointly, numel, one_output, Ctx, KernelResult,
    Lowering,
};
use crate::cuda::device::{Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family, one per (op kind, dtypes).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Spec in "elementwise" {
        /// `k(const T* px, T* py, i64 n)`
        Unary { dtype: DType, kind: UnaryKind } => unary(dtype, kind),
        /// `k(const T* px, const T* pdy, T* pdx, i64 n)`
        UnaryGrad { dtype: DType, kind: UnaryKind } => unary_grad(dtype, kind),
        /// `k(const T* pa, const T* pb, T* py, i64 n, int r, Dims shape, int ma, Dims sa,
        /// int mb, Dims sb)`: see [`Operands`].
        Binary { dtype: DType, kind: BinaryKind } => binary(dtype, kind),
        /// As `Binary` with the output gradient `const T* pg` after `pb`.
        BinaryGrad { dtype: DType, kind: BinaryKind, wrt: usize } => binary_grad(dtype, kind, wrt),
        /// `k(const T* px, const T* pb, T* py, i64 n, i64 inner, i64 c)`
        BiasAdd { dtype: DType } => bias_add(dtype),
        /// `k(const TI* px, TO* py, i64 n)`
        Cast { from: DType, to: DType } => cast(from, to),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(u) = op.downcast_ref::<Unary>() {
        return Some(lower_unary(u.kind, ins, outs));
    }
    if let Some(u) = op.downcast_ref::<UnaryGrad>() {
        return Some(lower_unary_grad(u.kind, ins, outs));
    }
    if let Some(b) = op.downcast_ref::<Binary>() {
        return Some(lower_binary(ins, outs, |dtype| Spec::Binary {
            dtype,
            kind: b.kind,
        }));
    }
    if let Some(g) = op.downcast_ref::<BinaryGrad>() {
        return Some(lower_binary(ins, outs, |dtype| Spec::BinaryGrad {
            dtype,
            kind: g.kind,
            wrt: g.wrt,
        }));
    }
    if let Some(b) = op.downcast_ref::<BiasAdd>() {
        return Some(lower_bias_add(b.data_format, ins, outs));
    }
    if let Some(cast) = op.downcast_ref::<Cast>() {
        return Some(lower_cast(cast.to, ins, outs));
    }
    None
}

fn lower_unary(kind: UnaryKind, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    if kind == UnaryKind::Identity {
        return Ok(kernel(|_, inputs| Ok(vec![input(inputs, 0)?.clone()])));
    }
    let spec = Spec::Unary {
        dtype: float_input(ins)?,
        kind,
    };
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, y| {
        let x = input(inputs, 0)?;
        let n = x.len();
        c.launch_elementwise(&spec, n, &[x.arg(), y.arg(), Arg::I64(n as i64)])?;
        Ok(())
    }))
}

fn lower_unary_grad(kind: UnaryKind, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let spec = Spec::UnaryGrad {
        dtype: float_input(ins)?,
        kind,
    };
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, dx| {
        let (x, dy) = (input(inputs, 0)?, input(inputs, 1)?);
        let n = x.len();
        c.launch_elementwise(&spec, n, &[x.arg(), dy.arg(), dx.arg(), Arg::I64(n as i64)])?;
        Ok(())
    }))
}

/// Strides of `shape` read as `out` (NumPy broadcasting; 0 where it repeats).
pub(super) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let rank = out.len();
    let offset = rank - shape.len().min(rank);
    let st = strides(shape);
    (0..rank)
        .map(|i| {
            if i < offset || shape[i - offset] == 1 {
                0
            } else {
                st[i - offset]
            }
        })
        .collect()
}

/// How a binary operand is indexed (see `OPERAND_INDEX`): 0 at full size, 1 a single
/// value, 2 strided.
fn operand_mode(shape: &[usize], out: &[usize]) -> i32 {
    match numel(shape) {
        n if n == numel(out) => 0,
        1 => 1,
        _ => 2,
    }
}

/// The size arguments of a kernel over `out` that reads each of `operands` broadcast
/// to it: `i64 n, int r, Dims shape`, then `int m, Dims s` per operand (see
/// `OPERAND_INDEX`; `shape` is only filled where some operand is strided, with the
/// axes merged where every strided operand allows: an NHWC image times its
/// `[N, 1, 1, C]` scale indexes `[N, H W, C]`, a division fewer per element).
pub(super) fn broadcast_args(operands: &[&[usize]], out: &[usize]) -> Result<Vec<Arg>, String> {
    let modes: Vec<i32> = operands.iter().map(|s| operand_mode(s, out)).collect();
    let strides: Vec<Vec<usize>> = (operands.iter().zip(&modes))
        .filter(|(_, &m)| m == 2)
        .map(|(s, _)| broadcast_strides(s, out))
        .collect();
    let (shape, steps) = match strides.is_empty() {
        true => (Vec::new(), Vec::new()),
        false => merged_jointly(out, &strides.iter().map(Vec::as_slice).collect::<Vec<_>>()),
    };
    let mut args = vec![
        Arg::I64(numel(out) as i64),
        Arg::I32(shape.len() as i32),
        Arg::Dims(Dims::new(&shape)?),
    ];
    let mut steps = steps.into_iter();
    for m in modes {
        let s = match m {
            2 => steps.next().ok_or("a strided operand without strides")?,
            _ => Vec::new(),
        };
        args.extend([Arg::I32(m), Arg::Dims(Dims::new(&s)?)]);
    }
    Ok(args)
}

/// A binary op or gradient: the operands' broadcast modes are fixed by the shapes, so
/// every argument but the pointers is made here.
fn lower_binary(
    ins: &[TensorType],
    outs: &[TensorType],
    spec: impl Fn(DType) -> Spec,
) -> KernelResult {
    let spec = spec(float_input(ins)?);
    let out = first(outs)?;
    let [a, b, ..] = ins else {
        return Err("a binary op takes two inputs".into());
    };
    let n = numel(&out.shape);
    let sizes = broadcast_args(&[&a.shape, &b.shape], &out.shape)?;
    let operands = if matches!(spec, Spec::BinaryGrad { .. }) {
        3
    } else {
        2
    };
    Ok(one_output(out, move |c, inputs, y| {
        let mut args = (0..operands)
            .map(|k| input(inputs, k).map(DTensor::arg))
            .collect::<Result<Vec<_>, _>>()?;
        args.push(y.arg());
        args.extend(sizes.iter().cloned());
        c.launch_elementwise(&spec, n, &args)?;
        Ok(())
    }))
}

fn lower_bias_add(format: DataFormat, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let x = &ins[0];
    let axis = match format {
        DataFormat::Nhwc => x.shape.len().checked_sub(1).ok_or("BiasAdd of a scalar")?,
        DataFormat::Nchw => 1,
    };
    let inner = numel(&x.shape[axis + 1..]);
    let ch = x.shape[axis];
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, y| {
        let (x, bias) = (input(inputs, 0)?, input(inputs, 1)?);
        let n = x.len();
        c.launch_elementwise(
            &Spec::BiasAdd { dtype },
            n,
            &[
                x.arg(),
                bias.arg(),
                y.arg(),
                Arg::I64(n as i64),
                Arg::I64(inner as i64),
                Arg::I64(ch as i64),
            ],
        )?;
        Ok(())
    }))
}

fn lower_cast(to: DType, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    if ins.first().ok_or("Cast takes one input")?.dtype == to {
        return Ok(kernel(|_, inputs| Ok(vec![input(inputs, 0)?.clone()])));
    }
    let ty = first(outs)?;
    Ok(kernel(move |c, inputs| {
        let y = c.alloc(&ty)?;
        cast_into(c, input(inputs, 0)?, &y)?;
        Ok(vec![y])
    }))
}

/// `y = x` converted to `y`'s dtype, element by element.
pub(super) fn cast_into(c: &Ctx, x: &DTensor, y: &DTensor) -> Result<(), String> {
    let n = x.len();
    c.launch_elementwise(
        &Spec::Cast {
            from: x.dtype,
            to: y.dtype,
        },
        n,
        &[x.arg(), y.arg(), Arg::I64(n as i64)],
    )
}

pub(super) fn unary(d: DType, kind: UnaryKind) -> String {
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, T* py, i64 n) {{\n{}}}\n",
            elementwise(
                &[own(d, "x", "px")],
                &kind.cuda_expr(),
                &[store(d, "py", "y")]
            )
        ),
    )
}

pub(super) fn unary_grad(d: DType, kind: UnaryKind) -> String {
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, const T* pdy, T* pdx, i64 n) {{\n{}}}\n",
            elementwise(
                &[own(d, "x", "px"), own(d, "g", "pdy")],
                &kind.cuda_derivative(),
                &[store(d, "pdx", "(d == (C)0 ? d : d * g)")]
            )
        ),
    )
}

/// Index of an operand: mode 0 identity, 1 scalar, 2 strided over the output shape.
pub(super) const OPERAND_INDEX: &str = r#"
__device__ __forceinline__ i64 operand_index(i64 i, int mode, int r, const Dims& shape, const Dims& st) {
  return mode == 0 ? i : (mode == 1 ? 0 : strided(i, r, shape, st));
}
"#;

/// The operands of the binary kernels: a and b broadcast (mode 0: full size), the
/// gradient g not.
fn binary_loads(d: DType) -> [Load<'static>; 3] {
    let broadcast = |name, ptr, cond, index| Load {
        at: At::OwnIf(cond, index),
        ..own(d, name, ptr)
    };
    [
        broadcast("a", "pa", "ma == 0", "operand_index(i, ma, r, shape, sa)"),
        broadcast("b", "pb", "mb == 0", "operand_index(i, mb, r, shape, sb)"),
        own(d, "g", "pg"),
    ]
}

pub(super) fn binary(d: DType, kind: BinaryKind) -> String {
    module(
        d,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const T* pa, const T* pb, T* py, i64 n, int r, Dims shape, int ma, Dims sa, int mb, Dims sb) {{\n{}}}\n",
            elementwise(&binary_loads(d)[..2], "", &[store(d, "py", kind.cuda_expr())])
        ),
    )
}

pub(super) fn binary_grad(d: DType, kind: BinaryKind, wrt: usize) -> String {
    module(
        d,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const T* pa, const T* pb, const T* pg, T* py, i64 n, int r, Dims shape, int ma, Dims sa, int mb, Dims sb) {{\n{}}}\n",
            elementwise(
                &binary_loads(d),
                "",
                &[store(d, "py", kind.cuda_grad_expr(wrt))]
            )
        ),
    )
}

pub(super) fn bias_add(d: DType) -> String {
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, const T* pb, T* py, i64 n, i64 inner, i64 c) {{\n{}}}\n",
            elementwise(
                &[
                    own(d, "x", "px"),
                    Load {
                        at: At::Gather("(i / inner) % c"),
                        ..own(d, "b", "pb")
                    }
                ],
                "",
                &[store(d, "py", "x + b")]
            )
        ),
    )
}

pub(super) fn cast(from: DType, to: DType) -> String {
    let value = if to == DType::Bool {
        "(CO)(x != 0)"
    } else if from.is_int() || to.is_int() {
        // Through f64, as the CPU does: float-to-int conversions saturate (NaN to 0).
        "(CO)(double)x"
    } else {
        "(CO)x"
    };
    let x = Load {
        ty: "CI",
        loader: "ldI",
        ..own(from, "x", "px")
    };
    let y = Store {
        storer: "stO",
        ..store(to, "py", value)
    };
    let body = elementwise(&[x], "", &[y]);
    module_multi(
        &[("I", from), ("O", to)],
        &format!("extern \"C\" __global__ void k(const TI* px, TO* py, i64 n) {{\n{body}}}\n"),
    )
}
