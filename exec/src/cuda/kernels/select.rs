//! Selections and comparisons, a thread per output element: Where, the comparisons
//! and logical ops (bool results), Not, Gather and Pad. Bools are one byte each on the
//! device (0 or 1, as `Data::to_le_bytes` writes them). Where, Gather and Pad never
//! round, so they move elements as unsigned words of the element's bytes and take
//! every dtype; the comparisons load into the compute type (exact for 16-bit floats).
//!
//! Gather's indices live on the device, so the host cannot check them as the CPU
//! kernel does (which errors naming the index): an index outside `-n..n` writes a
//! slice of zero bytes (0.0 for floats) rather than reading out of bounds.
//!
//! GatherGrad (an embedding's gradient) adds each slice of `dy` at its index with
//! atomic adds into a zeroed accumulator of the accumulation type (f32, f64 for f64),
//! then rounds it once into the output: repeated indices sum in f32 whatever the
//! dtype, in an order the atomics choose (the last bits may differ from run to run);
//! an index out of range adds nothing.

use ampgraph_graph::ops::{
    Compare, CompareKind, Gather, GatherGrad, Logical, LogicalKind, Not, Pad, PadMode, Where,
};
use ampgraph_graph::shape::normalize_axis;
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Data, Op, TensorType};

use super::codegen::{module, type_parts, word, PRELUDE};
use super::elementwise::{broadcast_args, OPERAND_INDEX};
use super::shape::{widest_word, word_at};
use super::{first, input, numel, one_output, KernelResult, Lowering};
use crate::cuda::device::{Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Spec in "select" {
        /// `k(const u8* pc, const E* pa, const E* pb, E* py, i64 n, int r, Dims shape,
        /// int mc, Dims sc, int ma, Dims sa, int mb, Dims sb)`: see `broadcast_args`.
        Where { bytes: usize } => where_(bytes),
        /// `k(const T* pa, const T* pb, u8* py, i64 n, int r, Dims shape, int ma,
        /// Dims sa, int mb, Dims sb)`: `a op b`, a C operator (the logical ops' on
        /// bools loaded as 0 or 1).
        Compare { dtype: DType, op: &'static str } => compare(dtype, op),
        /// `k(const u8* px, u8* py, i64 n)`
        Not {} => not(),
        /// `k(const E* px, const TI* pi, E* py, i64 n, i64 m, i64 len, i64 inner)`
        Gather { bytes: usize, index: DType } => gather(bytes, index),
        /// `k(const T* pdy, const TI* pi, A* acc, i64 n, i64 m, i64 len, i64 inner)`
        /// adds; `k_store(const A* acc, T* py, i64 n)` rounds into the output.
        GatherGrad { dtype: DType, index: DType } => gather_grad(dtype, index),
        /// `k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, Dims keep,
        /// Dims before, i64 offset, int mode, i64 fill)`
        Pad { bytes: usize } => pad(bytes),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    // Where's values and a comparison's operands are its second and first inputs.
    let dtype = |k: usize| {
        ins.get(k)
            .map(|t| t.dtype)
            .ok_or_else(|| format!("{} is missing input {k}", op.name()))
    };
    if op.is::<Where>() {
        let spec = dtype(1).map(|d| Spec::Where {
            bytes: d.size_bytes(),
        });
        return Some(spec.and_then(|s| lower_broadcast(s, ins, outs)));
    }
    if let Some(c) = op.downcast_ref::<Compare>() {
        let op = match c.kind {
            CompareKind::Equal => "==",
            CompareKind::Less => "<",
            CompareKind::LessOrEqual => "<=",
            CompareKind::Greater => ">",
            CompareKind::GreaterOrEqual => ">=",
        };
        let spec = dtype(0).map(|dtype| Spec::Compare { dtype, op });
        return Some(spec.and_then(|s| lower_broadcast(s, ins, outs)));
    }
    if let Some(l) = op.downcast_ref::<Logical>() {
        let op = match l.kind {
            LogicalKind::And => "&",
            LogicalKind::Or => "|",
            LogicalKind::Xor => "^",
        };
        let spec = Spec::Compare {
            dtype: DType::Bool,
            op,
        };
        return Some(lower_broadcast(spec, ins, outs));
    }
    if op.is::<Not>() {
        return Some(first(outs).map(|out| {
            one_output(out, |c, inputs, y| {
                let x = input(inputs, 0)?;
                let n = x.len();
                c.launch_items(&Spec::Not {}, n, 1, &[x.arg(), y.arg(), Arg::I64(n as i64)])
            })
        }));
    }
    if let Some(g) = op.downcast_ref::<Gather>() {
        return Some(lower_gather(g.axis, ins, outs));
    }
    if let Some(g) = op.downcast_ref::<GatherGrad>() {
        return Some(lower_gather_grad(g, ins, outs));
    }
    if let Some(p) = op.downcast_ref::<Pad>() {
        return Some(lower_pad(p, ins, outs));
    }
    None
}

/// A kernel reading every input broadcast to the output (Where, Compare, Logical):
/// the modes and strides are fixed by the shapes.
fn lower_broadcast(spec: Spec, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let out = first(outs)?;
    let shapes: Vec<&[usize]> = ins.iter().map(|t| t.shape.as_slice()).collect();
    let sizes = broadcast_args(&shapes, &out.shape)?;
    let (n, operands) = (numel(&out.shape), ins.len());
    Ok(one_output(out, move |c, inputs, y| {
        let mut args = (0..operands)
            .map(|k| input(inputs, k).map(DTensor::arg))
            .collect::<Result<Vec<_>, _>>()?;
        args.push(y.arg());
        args.extend(sizes.iter().cloned());
        c.launch_items(&spec, n, 1, &args)
    }))
}

/// `y[o, p, j] = x[o, idx[p], j]` over `outer x indices x inner`, the inner slices
/// moved in the widest words they are made of.
fn lower_gather(axis: i64, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let [x, idx] = ins else {
        return Err("Gather takes data and indices".into());
    };
    let axis = normalize_axis(axis, x.shape.len())?;
    let (len, inner) = (x.shape[axis], numel(&x.shape[axis + 1..]));
    let esize = x.dtype.size_bytes();
    let word = widest_word(&[inner * esize]).max(esize);
    let (index, m) = (idx.dtype, numel(&idx.shape));
    let out = first(outs)?;
    let n = numel(&out.shape);
    Ok(one_output(out, move |c, inputs, y| {
        let (x, idx) = (input(inputs, 0)?, input(inputs, 1)?);
        let word = word_at(word, esize, &[x, y]);
        let [n, inner] = [n, inner].map(|v| v * esize / word);
        let args = [x.arg(), idx.arg(), y.arg()]
            .into_iter()
            .chain([n, m, len, inner].map(|v| Arg::I64(v as i64)));
        let spec = Spec::Gather { bytes: word, index };
        c.launch_items(&spec, n, 1, &args.collect::<Vec<_>>())
    }))
}

/// `y[o, idx[p], j] += dy[o, p, j]` over `outer x indices x inner`, accumulated in
/// the accumulation type and rounded once into `y`.
fn lower_gather_grad(g: &GatherGrad, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let [dy, idx] = ins else {
        return Err("GatherGrad takes dy and indices".into());
    };
    let out = first(outs)?;
    let axis = normalize_axis(g.axis, out.shape.len())?;
    let (len, inner) = (out.shape[axis], numel(&out.shape[axis + 1..]));
    let (m, n, total) = (numel(&idx.shape), numel(&dy.shape), numel(&out.shape));
    let spec = Spec::GatherGrad {
        dtype: out.dtype,
        index: idx.dtype,
    };
    let acc = if out.dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    Ok(one_output(out, move |c, inputs, y| {
        let (dy, idx) = (input(inputs, 0)?, input(inputs, 1)?);
        if n == 0 || total == 0 {
            return c.dev.zero(y);
        }
        let sums = c.temp(acc, total)?;
        c.dev.zero(&sums)?;
        let sizes = [n, m, len, inner].map(|v| Arg::I64(v as i64));
        let mut args = vec![dy.arg(), idx.arg(), sums.arg()];
        args.extend(sizes);
        c.launch_items(&spec, n, 1, &args)?;
        let grid = total.div_ceil(256).clamp(1, 1 << 20) as u32;
        let store = [sums.arg(), y.arg(), Arg::I64(total as i64)];
        c.launch(&spec, "k_store", (grid, 256), &store)
    }))
}

/// Each output element's source found per axis (kept, edge, mirrored or the fill):
/// the index map of `Pad`'s CPU kernel. Crops only move where the kept block starts.
fn lower_pad(p: &Pad, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let x = ins.first().ok_or("Pad takes one input")?;
    let out = first(outs)?;
    if p.pads.len() != x.shape.len() || out.shape.len() != x.shape.len() {
        return Err(format!(
            "Pad: {} pairs of pads for rank {}",
            p.pads.len(),
            x.shape.len()
        ));
    }
    let grow = |v: i64| v.max(0) as usize;
    let crop = |v: i64| v.min(0).unsigned_abs() as usize;
    let before: Vec<usize> = p.pads.iter().map(|&[b, _]| grow(b)).collect();
    let keep = p
        .pads
        .iter()
        .zip(&out.shape)
        .map(|(&[b, a], &o)| o.checked_sub(grow(b) + grow(a)))
        .collect::<Option<Vec<usize>>>()
        .ok_or("Pad: the output is smaller than its pads")?;
    let st = strides(&x.shape);
    let offset: usize = p.pads.iter().zip(&st).map(|(&[b, _], s)| crop(b) * s).sum();
    let (mode, value) = match p.mode {
        PadMode::Constant(v) => (0, v),
        PadMode::Edge => (1, 0.0),
        PadMode::Reflect => (2, 0.0),
    };
    // The fill's bits as x's dtype rounds it (as the CPU kernel does), moved as a word.
    let fill = Data::from_f64(x.dtype, [value])
        .to_le_bytes()
        .iter()
        .rev()
        .fold(0u64, |acc, &b| acc << 8 | u64::from(b));
    let n = numel(&out.shape);
    let sizes = vec![
        Arg::I64(n as i64),
        Arg::I32(out.shape.len() as i32),
        Arg::Dims(Dims::new(&out.shape)?),
        Arg::Dims(Dims::new(&st)?),
        Arg::Dims(Dims::new(&keep)?),
        Arg::Dims(Dims::new(&before)?),
        Arg::I64(offset as i64),
        Arg::I32(mode),
        Arg::I64(fill as i64),
    ];
    let spec = Spec::Pad {
        bytes: x.dtype.size_bytes(),
    };
    Ok(one_output(out, move |c, inputs, y| {
        let mut args = vec![input(inputs, 0)?.arg(), y.arg()];
        args.extend(sizes.iter().cloned());
        c.launch_items(&spec, n, 1, &args)
    }))
}

/// A module of a word type `E` of `bytes` and `body`.
fn words(bytes: usize, body: &str) -> String {
    format!("{PRELUDE}typedef {} E;\n{body}", word(bytes))
}

pub(super) fn where_(bytes: usize) -> String {
    words(
        bytes,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const u8* pc, const E* pa, const E* pb, E* py, i64 n, int r, Dims shape, int mc, Dims sc, int ma, Dims sa, int mb, Dims sb) {{\n\
               GRID_LOOP(i, n) {{\n\
                 py[i] = pc[operand_index(i, mc, r, shape, sc)] ? pa[operand_index(i, ma, r, shape, sa)] : pb[operand_index(i, mb, r, shape, sb)];\n\
               }}\n}}\n"
        ),
    )
}

pub(super) fn compare(d: DType, op: &str) -> String {
    module(
        d,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const T* pa, const T* pb, u8* py, i64 n, int r, Dims shape, int ma, Dims sa, int mb, Dims sb) {{\n\
               GRID_LOOP(i, n) {{\n\
                 py[i] = (u8)(ld(pa, operand_index(i, ma, r, shape, sa)) {op} ld(pb, operand_index(i, mb, r, shape, sb)));\n\
               }}\n}}\n"
        ),
    )
}

pub(super) fn not() -> String {
    format!(
        "{PRELUDE}extern \"C\" __global__ void k(const u8* px, u8* py, i64 n) {{\n\
           GRID_LOOP(i, n) {{ py[i] = (u8)(px[i] == 0); }}\n}}\n"
    )
}

/// Gather's index map, shared by Gather and its gradient: element `i` of the gathered
/// tensor (`outer x m indices x inner`) is element `at` of the data (`outer x len x
/// inner`), `inside` where its index (a negative one counting from the end) is in
/// range.
const GATHERED_AT: &str = "i64 q = i / inner, j = i - q * inner, p = q % m, o = q / m;\n\
                           i64 k = (i64)pi[p];\n\
                           if (k < 0) k += len;\n\
                           bool inside = k >= 0 && k < len;\n\
                           i64 at = (o * len + k) * inner + j;\n";

/// Output word `i` is word `j` of the inner slice `o, p`; a negative index counts
/// from the end, one out of range gives zeros (`E()`).
pub(super) fn gather(bytes: usize, index: DType) -> String {
    words(
        bytes,
        &format!(
            "typedef {} TI;\n\
             extern \"C\" __global__ void k(const E* px, const TI* pi, E* py, i64 n, i64 m, i64 len, i64 inner) {{\n\
               GRID_LOOP(i, n) {{\n{GATHERED_AT}\
                 py[i] = inside ? px[at] : E();\n\
               }}\n}}\n",
            type_parts(index).0
        ),
    )
}

/// `k` adds each element of `dy` where Gather read it (into the accumulator `acc`),
/// `k_store` rounds the sums into the output.
pub(super) fn gather_grad(dtype: DType, index: DType) -> String {
    module(
        dtype,
        &format!(
            "typedef {} TI;\n\
             extern \"C\" __global__ void k(const T* pdy, const TI* pi, A* acc, i64 n, i64 m, i64 len, i64 inner) {{\n\
               GRID_LOOP(i, n) {{\n{GATHERED_AT}\
                 if (inside) atomicAdd(&acc[at], (A)ld(pdy, i));\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_store(const A* acc, T* py, i64 n) {{\n\
               GRID_LOOP(i, n) {{ st(py, i, (C)acc[i]); }}\n}}\n",
            type_parts(index).0
        ),
    )
}

/// Per axis (unrolled over the rank limit, as `strided`): the position `j` in the
/// kept block, outside it the fill (mode 0), the edge (1) or the mirror image (2,
/// period `2 (m - 1)`, as NumPy's reflect).
pub(super) fn pad(bytes: usize) -> String {
    words(
        bytes,
        "extern \"C\" __global__ void k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, Dims keep, Dims before, i64 offset, int mode, i64 fill) {\n\
           GRID_LOOP(i, n) {\n\
             i64 rest = i, off = offset;\n\
             bool inside = true;\n\
         #pragma unroll\n\
             for (int d = 7; d >= 0; --d) {\n\
               if (d < r) {\n\
                 i64 len = shape.n[d], m = keep.n[d];\n\
                 i64 j = rest % len - before.n[d];\n\
                 rest /= len;\n\
                 if (j < 0 || j >= m) {\n\
                   if (mode == 0) inside = false;\n\
                   else if (mode == 1 || m == 1) j = j < 0 ? 0 : m - 1;\n\
                   else { i64 period = 2 * (m - 1); j %= period; if (j < 0) j += period; if (j >= m) j = period - j; }\n\
                 }\n\
                 off += j * st.n[d];\n\
               }\n\
             }\n\
             py[i] = inside ? px[off] : (E)fill;\n\
           }\n}\n",
    )
}
