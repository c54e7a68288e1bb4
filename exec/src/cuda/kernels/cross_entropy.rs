//! Sparse softmax cross-entropy: the mean loss over rows of logits (a block per row,
//! then one block for the mean), its gradient, and both at once with the gradient's
//! column sums (the fused form `fuse-cross-entropy` makes).

use ampgraph_graph::ops::{
    SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad, SoftmaxCrossEntropyWithGrad, MAX_SUMMED_CLASSES,
};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{column_sums_fin, module_multi, vector_len};
use super::{
    acc_dtype, block_rows, first, float_input, input, kernel, launch_column_sums_fin, one_output,
    Ctx, KernelResult, Lowering,
};
use crate::cuda::device::{row_grid, Arg, DTensor};

/// Row chunks (blocks) of a cross-entropy kernel that sums its gradient's columns:
/// about a wave of blocks (fewer left the GPU waiting on each row's reductions).
const SCE_SUM_CHUNKS: usize = 1024;

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "cross_entropy" {
        /// `k_rows(const T* px, const L* pl, A* rows, i64 n, i64 c)`, then
        /// `k_mean(const A* rows, T* py, i64 n)`.
        Loss { dtype: DType, labels: DType } => sce(dtype, labels),
        /// `k(const T* px, const L* pl, const T* pdl, T* pdx, i64 n, i64 c)`
        Grad { dtype: DType, labels: DType } => sce_grad(dtype, labels),
        /// `k_rows(const TX* px, const L* pl, const T* pdl, TG* pg, A* rows, A* part, i64
        /// n, i64 c, i64 w)`, `k_mean`, and with `summed` (the row width) `k_cols_fin`.
        WithGrad { x: DType, dl: DType, grad: DType, labels: DType, summed: Option<usize> } => sce_with_grad(x, dl, grad, labels, summed),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if op.is::<SoftmaxCrossEntropy>() {
        return Some(lower_loss(false, ins, outs));
    }
    if let Some(f) = op.downcast_ref::<SoftmaxCrossEntropyWithGrad>() {
        return Some(lower_with_grad(f, ins, outs));
    }
    if op.is::<SoftmaxCrossEntropyGrad>() {
        return Some(lower_loss(true, ins, outs));
    }
    None
}

/// (rows, classes) of the logits and the labels' dtype.
fn logits(ins: &[TensorType]) -> Result<(usize, usize, DType), String> {
    let [x, labels, ..] = ins else {
        return Err("cross-entropy takes logits and labels".into());
    };
    let [n, classes] = x.shape[..] else {
        return Err("cross-entropy takes [rows, classes] logits".into());
    };
    Ok((n, classes, labels.dtype))
}

/// The mean loss, or (`grad`) its gradient: a block per row of logits.
fn lower_loss(grad: bool, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let (n, classes, labels) = logits(ins)?;
    let out = first(outs)?;
    if grad {
        let spec = Spec::Grad { dtype, labels };
        return Ok(one_output(out, move |c, inputs, dx| {
            let (x, labels, dl) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
            let tensors = [x.arg(), labels.arg(), dl.arg(), dx.arg()];
            block_rows(c, &spec, "k", &tensors, (n, classes))
        }));
    }
    let spec = Spec::Loss { dtype, labels };
    Ok(one_output(out, move |c, inputs, y| {
        let (x, labels) = (input(inputs, 0)?, input(inputs, 1)?);
        let rows = c.temp(acc_dtype(dtype), n)?;
        let tensors = [x.arg(), labels.arg(), rows.arg()];
        block_rows(c, &spec, "k_rows", &tensors, (n, classes))?;
        sce_mean(c, &spec, &rows, y, n)
    }))
}

fn lower_with_grad(
    op: &SoftmaxCrossEntropyWithGrad,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let x = float_input(ins)?;
    let (n, width, labels) = logits(ins)?;
    let classes = op.classes.unwrap_or(width);
    let dl = ins.get(2).ok_or("missing input 2")?.dtype;
    let grad = outs.get(1).ok_or("the node lacks an output")?.dtype;
    if op.column_sum && outs.len() < 3 {
        return Err("the node lacks an output".into());
    }
    if op.column_sum && width > MAX_SUMMED_CLASSES {
        return Err(format!(
            "the gradient's column sums take at most {MAX_SUMMED_CLASSES} columns, not {width}"
        ));
    }
    let summed = op.column_sum.then_some(width);
    // With column sums, a block per chunk of rows: its sums are one partial each.
    let (blocks, threads, part_len) = match summed {
        Some(_) => {
            let blocks = n.min(SCE_SUM_CHUNKS);
            (blocks, SCE_SUM_THREADS as u32, blocks * width)
        }
        None => (n, sce_threads(width, sce_vector(x, grad)), 1),
    };
    let spec = Spec::WithGrad {
        x,
        dl,
        grad,
        labels,
        summed,
    };
    let outs = outs.to_vec();
    Ok(kernel(move |c, inputs| {
        let (x, labels, dl) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
        let rows = c.temp(acc_dtype(dl.dtype), n)?;
        let out = c.alloc_all(&outs)?;
        let part = c.temp(acc_dtype(dl.dtype), part_len)?;
        if n > 0 {
            let tensors = [x, labels, dl, &out[1], &rows, &part].map(DTensor::arg);
            let mut args = tensors.to_vec();
            args.extend([n, classes, width].map(|v| Arg::I64(v as i64)));
            c.launch(&spec, "k_rows", (row_grid(blocks), threads), &args)?;
        }
        sce_mean(c, &spec, &rows, &out[0], n)?;
        if summed.is_some() {
            launch_column_sums_fin(c, &spec, &part, width, blocks.max(1), &[(&out[2], 1.0)])?;
        }
        Ok(out)
    }))
}

/// `k_mean` of a cross-entropy module: the mean of the `n` rows' losses into `y`.
fn sce_mean(c: &Ctx, spec: &Spec, rows: &DTensor, y: &DTensor, n: usize) -> Result<(), String> {
    c.launch(
        spec,
        "k_mean",
        (1, 1024),
        &[rows.arg(), y.arg(), Arg::I64(n as i64)],
    )
}

/// The shift (the row's maximum, where finite) and the sum of `exp(x - shift)` of
/// the `c` logits at `x` (a row), block-wide; `sce_row{t}` reads logits of type `T{t}`.
fn sce_row(t: &str) -> String {
    format!(
        "__device__ void sce_row{t}(const T{t}* x, i64 c, A* sh, A* shift_out, A* sum_out) {{\n\
           A m = (A)(-F_INF);\n\
           for (i64 j = threadIdx.x; j < c; j += blockDim.x) {{ A v = (A)ld{t}(x, j); if (v > m || m_isnan(v)) m = v; }}\n\
           m = block_max(m, sh);\n\
           A shift = m_isfinite(m) ? m : (A)0;\n\
           A sum = 0;\n\
           for (i64 j = threadIdx.x; j < c; j += blockDim.x) sum += m_exp((A)ld{t}(x, j) - shift);\n\
           sum = block_sum(sum, sh);\n\
           *shift_out = shift;\n\
           *sum_out = sum;\n\
         }}\n"
    )
}

/// The loss of a row at `x` (`sce_loss{t}`: NaN for a label out of range), and
/// `k_mean`, the mean of the rows' losses stored as `T`.
fn sce_loss_and_mean(t: &str) -> String {
    format!(
        "__device__ A sce_loss{t}(const T{t}* x, i64 c, i64 label, A shift, A sum) {{\n\
           return (label < 0 || label >= c) ? (A)F_NAN : (m_log(sum) + shift) - (A)ld{t}(x, label);\n\
         }}\n\
         extern \"C\" __global__ void k_mean(const A* rows, T* py, i64 n) {{\n\
           __shared__ A sh[32];\n\
           A s = 0;\n\
           for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += rows[j];\n\
           s = block_sum(s, sh);\n\
           if (threadIdx.x == 0) st(py, 0, (C)(s / (A)n));\n\
         }}\n"
    )
}

/// One element of the loss gradient, `(softmax - onehot(label)) * scale` from the
/// element's `exp(x - shift)` and the row's `1 / sum` (a product, not a quotient, per
/// logit: GPT-2's [16384, 50264] kernel was bound by its instructions, 69% of the SMs'
/// issue against 23% of DRAM's bandwidth), NaN for a label out of range. The CPU
/// kernel takes the label's as `-(sum of the others) / sum`, NaN where a `+inf` logit
/// made the sum infinite; so is this one.
const SCE_DX: &str = r#"
__device__ __forceinline__ C sce_dx(A e, A sum, A inv, bool is_label, bool bad, C scale) {
  C p = (C)(e * inv);
  C target = is_label ? (C)1 : (C)0;
  return bad || (is_label && isinf(sum)) ? (C)F_NAN : (p - target) * scale;
}
"#;

/// The statements storing the gradient ([`SCE_DX`]) of the row at `x` through
/// `st{g}` into the row at `dx`, from logits read by `ld{t}`.
fn sce_grad_row(t: &str, g: &str) -> String {
    format!(
        "bool bad = label < 0 || label >= c;\n\
         A inv = (A)1 / sum;\n\
         for (i64 j = threadIdx.x; j < c; j += blockDim.x)\n\
           st{g}(dx, j, sce_dx(m_exp((A)ld{t}(x, j) - shift), sum, inv, j == label, bad, scale));\n"
    )
}

/// SoftmaxCrossEntropy: `k_rows` writes each row's loss (f32/f64), `k_mean` their mean.
pub(super) fn sce(d: DType, labels: DType) -> String {
    module_multi(
        &[("", d), ("L", labels)],
        &format!(
            "{}{}extern \"C\" __global__ void k_rows(const T* px, const TL* pl, A* rows_out, i64 n, i64 c) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                 const T* x = px + row * c;\n\
                 A shift, sum; sce_row(x, c, sh, &shift, &sum);\n\
                 if (threadIdx.x == 0) rows_out[row] = sce_loss(x, c, (i64)pl[row], shift, sum);\n\
               }}\n}}\n",
            sce_row(""),
            sce_loss_and_mean("")
        ),
    )
}

pub(super) fn sce_grad(d: DType, labels: DType) -> String {
    module_multi(
        &[("", d), ("L", labels)],
        &format!(
            "{SCE_DX}{}extern \"C\" __global__ void k(const T* px, const TL* pl, const T* pdl, T* pdx, i64 n, i64 c) {{\n\
               __shared__ A sh[32];\n\
               C scale = ld(pdl, 0) / (C)n;\n\
               for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                 const T* x = px + row * c;\n\
                 T* dx = pdx + row * c;\n\
                 A shift, sum; sce_row(x, c, sh, &shift, &sum);\n\
                 i64 label = (i64)pl[row];\n\
                 {}\
               }}\n}}\n",
            sce_row(""),
            sce_grad_row("", "")
        ),
    )
}

/// Threads of a block of the cross-entropy kernel that sums its gradient's columns.
const SCE_SUM_THREADS: usize = 256;

/// Elements a thread of [`sce_with_grad`]'s row kernel moves as one 16-byte vector.
fn sce_vector(logits: DType, grad: DType) -> usize {
    vector_len(logits.size_bytes().max(grad.size_bytes()))
}

/// Threads of a block of [`sce_with_grad`]'s row kernel (without column sums): a
/// vector each across the row, up to 1024 (fewer rows in flight, so the second read
/// of each finds it in L2).
fn sce_threads(width: usize, vector: usize) -> u32 {
    (width.div_ceil(vector).div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// SoftmaxCrossEntropyWithGrad: `k_rows` reads each row of logits (`TX`, widened to
/// the compute type `T`) for both its loss and its gradient (stored as `TG`), then
/// `k_mean` as [`sce`]'s. A row stores `w` logits of which the first `c` are classes
/// (the op's `classes`; the rest padding, whose gradient is zero).
///
/// Without column sums, a block per row reads it twice: once for its maximum and sum
/// together (each thread keeps a running maximum and rescales its sum when that
/// grows, as online softmax does; the threads' sums are rescaled to the row's maximum
/// when added up), once for the gradient; in 16-byte vectors where the rows are
/// aligned. Where the maximum is infinite the sum is taken again as [`sce`]'s.
///
/// With `summed` (the row width, at most
/// [`MAX_SUMMED_CLASSES`](ampgraph_graph::ops::MAX_SUMMED_CLASSES)) the kernel also
/// adds up the gradient's columns: a block of [`SCE_SUM_THREADS`] takes a chunk of
/// rows, each thread the same columns of every row, held in registers (one read of
/// the logits, the exponentials kept), so its column sums are registers too; it writes
/// them to `part` as the chunk's partial sums and `k_cols_fin` adds the chunks. The
/// values, their order and the block reductions are those of [`sce_grad`].
pub(super) fn sce_with_grad(
    logits: DType,
    compute: DType,
    grad: DType,
    labels: DType,
    summed: Option<usize>,
) -> String {
    let types = [("", compute), ("X", logits), ("G", grad), ("L", labels)];
    let params =
        "const TX* px, const TL* pl, const T* pdl, TG* pdx, A* rows_out, A* part, i64 n, i64 c, i64 w";
    let Some(width) = summed else {
        let v = sce_vector(logits, grad);
        return module_multi(
            &types,
            &format!(
                "{SCE_DX}{}{}\
                 // One logit into a thread's running maximum `m` and its sum of exp(x - m).\n\
                 __device__ __forceinline__ void sce_online(A& m, A& s, A v) {{\n\
                   if (v > m) {{ s = s * m_exp(m - v) + (A)1; m = v; }} else s += m_exp(v - m);\n\
                 }}\n\
                 // Two blocks of 1024 a multiprocessor (32 registers, none spilled): at 38\n\
                 // registers one block left half the warps idle.\n\
                 extern \"C\" __global__ void __launch_bounds__(1024, 2) k_rows({params}) {{\n\
                   __shared__ A sh[32];\n\
                   C scale = ld(pdl, 0) / (C)n;\n\
                   // The lowest finite value starts the running maximum: a -inf logit adds\n\
                   // exp(-inf) = 0 to a sum, never exp(-inf - -inf).\n\
                   const A lowest = (A)(sizeof(A) == 8 ? -1.7976931348623157e308 : -3.4028234663852886e38);\n\
                   const bool vec = ALIGNED(px, {v}) && ALIGNED(pdx, {v}) && w % {v} == 0;\n\
                   typedef VEC_T(px, {v}) VX;\n\
                   typedef VEC_T(pdx, {v}) VG;\n\
                   for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                     const TX* x = px + row * w;\n\
                     TG* dx = pdx + row * w;\n\
                     A m = lowest, s = 0;\n\
                     if (vec) {{\n\
                       for (i64 j0 = threadIdx.x * {v}; j0 < c; j0 += (i64)blockDim.x * {v}) {{\n\
                         const VX xv = *(const VX*)(x + j0);\n\
                         #pragma unroll\n\
                         for (int u = 0; u < {v}; ++u) if (j0 + u < c) sce_online(m, s, (A)ldX(xv.v, u));\n\
                       }}\n\
                     }} else {{\n\
                       for (i64 j = threadIdx.x; j < c; j += blockDim.x) sce_online(m, s, (A)ldX(x, j));\n\
                     }}\n\
                     A shift = block_max(m, sh), sum;\n\
                     if (m_isfinite(shift)) sum = block_sum(s * m_exp(m - shift), sh);\n\
                     else sce_rowX(x, c, sh, &shift, &sum);\n\
                     i64 label = (i64)pl[row];\n\
                     if (threadIdx.x == 0) rows_out[row] = sce_lossX(x, c, label, shift, sum);\n\
                     bool bad = label < 0 || label >= c;\n\
                     A inv = (A)1 / sum;\n\
                     // The gradient of logit `v` in column `j`: zero in the padding.\n\
                     auto grad_of = [&](A v, i64 j) {{ return j < c ? sce_dx(m_exp(v - shift), sum, inv, j == label, bad, scale) : (C)0; }};\n\
                     if (vec) {{\n\
                       for (i64 j0 = threadIdx.x * {v}; j0 < w; j0 += (i64)blockDim.x * {v}) {{\n\
                         const VX xv = *(const VX*)(x + j0);\n\
                         VG g;\n\
                         #pragma unroll\n\
                         for (int u = 0; u < {v}; ++u) stG(g.v, u, grad_of((A)ldX(xv.v, u), j0 + u));\n\
                         *(VG*)(dx + j0) = g;\n\
                       }}\n\
                     }} else {{\n\
                       for (i64 j = threadIdx.x; j < w; j += blockDim.x) stG(dx, j, grad_of((A)ldX(x, j), j));\n\
                     }}\n\
                   }}\n}}\n",
                sce_row("X"),
                sce_loss_and_mean("X"),
            ),
        );
    };
    let per = width.div_ceil(SCE_SUM_THREADS).max(1);
    module_multi(
        &types,
        &format!(
            "{SCE_DX}{}extern \"C\" __global__ void __launch_bounds__({SCE_SUM_THREADS}) k_rows({params}) {{\n\
               __shared__ A sh[32];\n\
               C scale = ld(pdl, 0) / (C)n;\n\
               A acc[{per}], e[{per}];\n\
               #pragma unroll\n\
               for (int k = 0; k < {per}; ++k) acc[k] = 0;\n\
               for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                 const TX* x = px + row * w;\n\
                 A m = (A)(-F_INF);\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) {{\n\
                   i64 j = threadIdx.x + k * {SCE_SUM_THREADS};\n\
                   e[k] = j < c ? (A)ldX(x, j) : (A)(-F_INF);\n\
                   if (e[k] > m || m_isnan(e[k])) m = e[k];\n\
                 }}\n\
                 m = block_max(m, sh);\n\
                 A shift = m_isfinite(m) ? m : (A)0;\n\
                 A sum = 0;\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) if (threadIdx.x + k * {SCE_SUM_THREADS} < c) {{ e[k] = m_exp(e[k] - shift); sum += e[k]; }}\n\
                 sum = block_sum(sum, sh);\n\
                 i64 label = (i64)pl[row];\n\
                 if (threadIdx.x == 0) rows_out[row] = sce_lossX(x, c, label, shift, sum);\n\
                 bool bad = label < 0 || label >= c;\n\
                 A inv = (A)1 / sum;\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) {{\n\
                   i64 j = threadIdx.x + k * {SCE_SUM_THREADS};\n\
                   if (j < w) {{\n\
                     C d = j < c ? sce_dx(e[k], sum, inv, j == label, bad, scale) : (C)0;\n\
                     stG(pdx, row * w + j, d);\n\
                     acc[k] += (A)d;\n\
                   }}\n\
                 }}\n\
               }}\n\
               #pragma unroll\n\
               for (int k = 0; k < {per}; ++k) {{ i64 j = threadIdx.x + k * {SCE_SUM_THREADS}; if (j < w) part[blockIdx.x * w + j] = acc[k]; }}\n\
             }}\n{}",
            sce_loss_and_mean("X"),
            column_sums_fin("", &[""]),
        ),
    )
}
