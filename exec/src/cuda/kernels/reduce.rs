//! Reductions: Sum, Mean and Max over any axes (a block or a thread per output), sums
//! over leading axes as column sums (bias gradients), SumTo, and ReduceGrad.

use ampgraph_graph::ops::{Reduce, ReduceGrad, ReduceKind, SumTo};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{column_sums, column_sums_rows, column_vector, module, module_multi};
use super::elementwise::broadcast_strides;
use super::{
    acc_dtype, first, float_input, float_only, input, kernel, merged, numel, one_output, Ctx,
    KernelResult, Lowering, Partials,
};
use crate::cuda::device::{row_block, row_grid, Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "reduce" {
        /// `k` and `k_thread(const T* px, TO* py, i64 out_len, i64 count, int kr, Dims ks,
        /// Dims kst, int rr, Dims rs, Dims rst)`
        Reduce { dtype: DType, out: DType, kind: ReduceKind } => reduce(dtype, out, kind),
        /// `k(const T* px, const T* pdy, T* pdx, ...)`, the sizes as `Reduce`'s.
        ReduceMaxGrad { dtype: DType } => reduce_max_grad(dtype),
        /// `k(const T* px, T* py, i64 n, int r, Dims shape, Dims sst, double div)`
        BroadcastDiv { dtype: DType } => broadcast_div(dtype),
        /// Column sums of a `[rows, len]` matrix: `k_cols_part` or `k_cols_rows` (`const
        /// T* px, AO* part, i64 rows, i64 len, i64 chunk_rows`), then `k_cols_fin`.
        ColumnSum { dtype: DType, out: DType } => column_sum(dtype, out),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(r) = op.downcast_ref::<Reduce>() {
        return Some(lower_reduce(r, ins, outs));
    }
    if let Some(s) = op.downcast_ref::<SumTo>() {
        return Some(lower_sum_to(s, ins, outs));
    }
    if let Some(r) = op.downcast_ref::<ReduceGrad>() {
        return Some(lower_reduce_grad(r, ins, outs));
    }
    None
}

fn lower_reduce(r: &Reduce, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let x = ins.first().ok_or("Reduce takes one input")?;
    float_only(x.dtype)?;
    let axes = r.reduced_axes(x.shape.len())?;
    let (out, kind) = (first(outs)?, r.kind);
    Ok(one_output(out, move |c, inputs, y| {
        reduce_into(c, input(inputs, 0)?, y, kind, &axes)?;
        Ok(())
    }))
}

fn lower_sum_to(s: &SumTo, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let x = ins.first().ok_or("SumTo takes one input")?;
    let out = first(outs)?;
    let (r, t) = (x.shape.len(), s.shape.len());
    let axes: Vec<usize> = (0..r)
        .filter(|&a| a + t < r || (s.shape[a + t - r] == 1 && x.shape[a] != 1))
        .collect();
    if axes.is_empty() {
        return Ok(kernel(move |_, inputs| {
            Ok(vec![input(inputs, 0)?.reshaped(out.shape.clone())])
        }));
    }
    float_only(x.dtype)?;
    Ok(one_output(out, move |c, inputs, y| {
        reduce_into(c, input(inputs, 0)?, y, ReduceKind::Sum, &axes)?;
        Ok(())
    }))
}

fn lower_reduce_grad(r: &ReduceGrad, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let x = &ins[0];
    let axes = Reduce::new(r.kind, r.axes.clone(), r.keep_dims).reduced_axes(x.shape.len())?;
    let out = first(outs)?;
    let n = numel(&x.shape);
    if r.kind == ReduceKind::Max {
        let s = split(&x.shape, &axes);
        let (kept, count) = (numel(&s.ks), numel(&s.rs));
        let sizes = split_args(&s)?;
        let spec = Spec::ReduceMaxGrad { dtype };
        return Ok(one_output(out, move |c, inputs, dx| {
            let (x, dy) = (input(inputs, 0)?, input(inputs, 1)?);
            if kept > 0 {
                let mut args = vec![x.arg(), dy.arg(), dx.arg()];
                args.extend(sizes.iter().cloned());
                c.launch(&spec, "k", (row_grid(kept), row_block(count)), &args)?;
            }
            Ok(())
        }));
    }
    let kept: Vec<usize> = x
        .shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let dy_len = ins.get(1).map_or(0, |t| numel(&t.shape));
    let div = if r.kind == ReduceKind::Mean {
        n.checked_div(dy_len).unwrap_or(0) as f64
    } else {
        1.0
    };
    let (shape, strides) = merged(&x.shape, &broadcast_strides(&kept, &x.shape));
    let sizes = [
        Arg::I64(n as i64),
        Arg::I32(shape.len() as i32),
        Arg::Dims(Dims::new(&shape)?),
        Arg::Dims(Dims::new(&strides)?),
        Arg::F64(div),
    ];
    let spec = Spec::BroadcastDiv { dtype };
    Ok(one_output(out, move |c, inputs, dx| {
        let dy = input(inputs, 1)?;
        let mut args = vec![dy.arg(), dx.arg()];
        args.extend(sizes.iter().cloned());
        c.launch_items(&spec, n, 1, &args)?;
        Ok(())
    }))
}

/// The kept and reduced (dims, strides) of reducing `shape` over sorted `axes`.
struct Split {
    ks: Vec<usize>,
    kst: Vec<usize>,
    rs: Vec<usize>,
    rst: Vec<usize>,
}

fn split(shape: &[usize], axes: &[usize]) -> Split {
    let st = strides(shape);
    let (mut ks, mut kst, mut rs, mut rst) = (vec![], vec![], vec![], vec![]);
    for (i, (&d, &t)) in shape.iter().zip(&st).enumerate() {
        if axes.contains(&i) {
            rs.push(d);
            rst.push(t);
        } else {
            ks.push(d);
            kst.push(t);
        }
    }
    let ((ks, kst), (rs, rst)) = (merged(&ks, &kst), merged(&rs, &rst));
    Split { ks, kst, rs, rst }
}

fn split_args(s: &Split) -> Result<Vec<Arg>, String> {
    Ok(vec![
        Arg::I64(numel(&s.ks) as i64),
        Arg::I64(numel(&s.rs) as i64),
        Arg::I32(s.ks.len() as i32),
        Arg::Dims(Dims::new(&s.ks)?),
        Arg::Dims(Dims::new(&s.kst)?),
        Arg::I32(s.rs.len() as i32),
        Arg::Dims(Dims::new(&s.rs)?),
        Arg::Dims(Dims::new(&s.rst)?),
    ])
}

/// `y = reduce(x)` over sorted `axes`.
pub(super) fn reduce_into(
    c: &Ctx,
    x: &DTensor,
    y: &DTensor,
    kind: ReduceKind,
    axes: &[usize],
) -> Result<(), String> {
    float_only(x.dtype)?;
    let s = split(&x.shape, axes);
    let (out_len, count) = (numel(&s.ks), numel(&s.rs));
    if out_len == 0 {
        return Ok(());
    }
    // Reducing the leading axes (bias gradients, batch sums): column sums of a
    // [count, out_len] matrix.
    if kind != ReduceKind::Max && count > 1 && axes.iter().enumerate().all(|(i, &a)| i == a) {
        let scale = if kind == ReduceKind::Mean {
            1.0 / count as f64
        } else {
            1.0
        };
        let v = column_vector(x.dtype);
        let part = if out_len % v == 0 && x.ptr() % 16 == 0 {
            Partials::Rows(v)
        } else {
            Partials::Tiles
        };
        return super::launch_column_sums(
            c,
            &Spec::ColumnSum {
                dtype: x.dtype,
                out: y.dtype,
            },
            &[x.arg()],
            (count, out_len),
            &[(y, scale)],
            part,
        );
    }
    let spec = Spec::Reduce {
        dtype: x.dtype,
        out: y.dtype,
        kind,
    };
    if let Some(shape) = middle(&s).filter(|_| count > 64) {
        return reduce_middle(c, &spec, x, y, shape);
    }
    let mut args = vec![x.arg(), y.arg()];
    args.extend(split_args(&s)?);
    if count <= 64 || (out_len >= 4096 && count <= 4096) {
        let grid = out_len.div_ceil(256).min(1 << 20) as u32;
        c.launch(&spec, "k_thread", (grid, 256), &args)
    } else {
        c.launch(&spec, "k", (row_grid(out_len), row_block(count)), &args)
    }
}

/// `[batch, rows, len]` where the reduction is over the middle axis of a contiguous
/// tensor (an NHWC image's H and W: the global average pool), `None` otherwise.
fn middle(s: &Split) -> Option<[usize; 3]> {
    match (&s.ks[..], &s.kst[..], &s.rs[..], &s.rst[..]) {
        (&[batch, len], &[outer, 1], &[rows], &[inner]) if inner == len && outer == rows * len => {
            Some([batch, rows, len])
        }
        _ => None,
    }
}

/// Threads of a `k_mid` block: 32 columns by [`MID_WARPS`] rows.
const MID_WARPS: usize = 8;

/// A reduction over the middle axis of `[batch, rows, len]`: each `k_mid` block sums
/// a chunk of rows of 32 columns of one batch (a warp reads 32 neighbouring values, 8
/// warps interleave the rows), in enough chunks that the blocks fill the GPU; `k_mid_fin`
/// adds the chunks' partials. The thread-per-output kernel read a 56x56x144 image's
/// pooling in 1 ms on the H200, a thread summing 3136 values 144 apart.
fn reduce_middle(
    c: &Ctx,
    spec: &Spec,
    x: &DTensor,
    y: &DTensor,
    [batch, rows, len]: [usize; 3],
) -> Result<(), String> {
    let tiles = len.div_ceil(32);
    let blocks = (tiles * batch).max(1);
    // About four blocks per multiprocessor, each thread reading 8 rows or more.
    let chunks = (4 * c.dev.multiprocessors as usize)
        .div_ceil(blocks)
        .min(rows.div_ceil(8 * MID_WARPS))
        .max(1);
    let grid = u32::try_from(blocks * chunks).map_err(|_| "too many outputs for one launch")?;
    let part = c.temp(acc_dtype(y.dtype), chunks * batch * len)?;
    let size = |n: usize| Arg::I64(n as i64);
    let args = [
        x.arg(),
        part.arg(),
        size(batch),
        size(rows),
        size(len),
        size(rows.div_ceil(chunks)),
    ];
    c.launch(spec, "k_mid", (grid, (32 * MID_WARPS) as u32), &args)?;
    let n = batch * len;
    let args = [part.arg(), y.arg(), size(n), size(chunks), size(rows)];
    c.launch(
        spec,
        "k_mid_fin",
        (n.div_ceil(256).min(1 << 20) as u32, 256),
        &args,
    )
}

/// `y[i] = x[strided(i)] / div` (ReduceGrad of Sum and Mean).
pub(super) fn broadcast_div(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const T* px, T* py, i64 n, int r, Dims shape, Dims sst, double div) {\n\
           GRID_LOOP(i, n) { st(py, i, ld(px, strided(i, r, shape, sst)) / (C)div); }\n}\n",
    )
}

/// Reductions over arbitrary axes: the kept axes (`ks`, `kst`) index outputs, the
/// reduced ones (`rs`, `rst`) the elements summed into each. `k` gives each output a
/// block; `k_thread` gives each output a thread (few elements per output); `k_mid` and
/// `k_mid_fin` reduce the middle axis of `[batch, rows, len]` ([`reduce_middle`]).
/// Reductions of `d` storing `out` (the same, or a type `d` widens into exactly).
pub(super) fn reduce(d: DType, out: DType, kind: ReduceKind) -> String {
    let (init, combine, block) = match kind {
        ReduceKind::Max => ("(AO)(-F_INF)", "acc = nanmax(acc, v);", "block_max"),
        _ => ("(AO)0", "acc += v;", "block_sum"),
    };
    let finish = if kind == ReduceKind::Mean {
        "acc / (AO)count"
    } else {
        "acc"
    };
    module_multi(
        &[("", d), ("O", out)],
        &format!(
            "extern \"C\" __global__ void k(const T* px, TO* py, i64 out_len, i64 count, int kr, Dims ks, Dims kst, int rr, Dims rs, Dims rst) {{\n\
               __shared__ AO sh[32];\n\
               for (i64 o = blockIdx.x; o < out_len; o += gridDim.x) {{\n\
                 i64 base = strided(o, kr, ks, kst);\n\
                 AO acc = {init};\n\
                 for (i64 j = threadIdx.x; j < count; j += blockDim.x) {{ AO v = (AO)ld(px, base + strided(j, rr, rs, rst)); {combine} }}\n\
                 acc = {block}(acc, sh);\n\
                 if (threadIdx.x == 0) stO(py, o, (CO)({finish}));\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_thread(const T* px, TO* py, i64 out_len, i64 count, int kr, Dims ks, Dims kst, int rr, Dims rs, Dims rst) {{\n\
               GRID_LOOP(o, out_len) {{\n\
                 i64 base = strided(o, kr, ks, kst);\n\
                 AO acc = {init};\n\
                 for (i64 j = 0; j < count; ++j) {{ AO v = (AO)ld(px, base + strided(j, rr, rs, rst)); {combine} }}\n\
                 stO(py, o, (CO)({finish}));\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_mid(const T* px, AO* part, i64 batch, i64 rows, i64 len, i64 chunk) {{\n\
               __shared__ AO sh[{MID_WARPS}][33];\n\
               int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
               i64 tiles = (len + 31) / 32, blk = blockIdx.x;\n\
               i64 col = (blk % tiles) * 32 + tx, b = (blk / tiles) % batch, z = blk / tiles / batch;\n\
               i64 r1 = min(rows, (z + 1) * chunk);\n\
               AO acc = {init};\n\
               if (col < len) for (i64 r = z * chunk + ty; r < r1; r += {MID_WARPS}) {{ AO v = (AO)ld(px, (b * rows + r) * len + col); {combine} }}\n\
               sh[ty][tx] = acc;\n\
               __syncthreads();\n\
               if (ty == 0 && col < len) {{\n\
                 for (int w = 1; w < {MID_WARPS}; ++w) {{ AO v = sh[w][tx]; {combine} }}\n\
                 part[(z * batch + b) * len + col] = acc;\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_mid_fin(const AO* part, TO* py, i64 n, i64 chunks, i64 count) {{\n\
               GRID_LOOP(o, n) {{\n\
                 AO acc = {init};\n\
                 for (i64 z = 0; z < chunks; ++z) {{ AO v = part[z * n + o]; {combine} }}\n\
                 stO(py, o, (CO)({finish}));\n\
               }}\n}}\n"
        ),
    )
}

/// ReduceGrad of Max: the gradient goes to the maxima, split evenly between ties.
pub(super) fn reduce_max_grad(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const T* px, const T* pdy, T* pdx, i64 out_len, i64 count, int kr, Dims ks, Dims kst, int rr, Dims rs, Dims rst) {\n\
           __shared__ A sh[32];\n\
           for (i64 o = blockIdx.x; o < out_len; o += gridDim.x) {\n\
             i64 base = strided(o, kr, ks, kst);\n\
             A m = (A)(-F_INF);\n\
             for (i64 j = threadIdx.x; j < count; j += blockDim.x) m = nanmax(m, (A)ld(px, base + strided(j, rr, rs, rst)));\n\
             m = block_max(m, sh);\n\
             A ties = 0;\n\
             for (i64 j = threadIdx.x; j < count; j += blockDim.x) ties += ((A)ld(px, base + strided(j, rr, rs, rst)) == m) ? (A)1 : (A)0;\n\
             ties = block_sum(ties, sh);\n\
             C g = ld(pdy, o);\n\
             for (i64 j = threadIdx.x; j < count; j += blockDim.x) {\n\
               i64 at = base + strided(j, rr, rs, rst);\n\
               st(pdx, at, ((A)ld(px, at) == m) ? (C)(g / (C)ties) : (C)0);\n\
             }\n\
           }\n}\n",
    )
}

/// Sum over the rows of a `[rows, len]` matrix of `d` (Mean through the scale),
/// stored as `out`: [`column_sums`]' kernels, and [`column_sums_rows`]' `k_cols_rows`
/// reading 16-byte words of [`column_vector`] adjacent columns, for `len` a multiple
/// of that and a 16-byte aligned matrix.
pub(super) fn column_sum(d: DType, out: DType) -> String {
    let v = column_vector(d);
    let row = "uint4 word = *(const uint4*)(px + i0); const T* x = (const T*)&word;\n\
               #pragma unroll\n\
               for (int u = 0; u < V; ++u) acc0[u] += (AO)ld(x, u);\n";
    module_multi(
        &[("", d), ("O", out)],
        &format!(
            "{}{}",
            column_sums("const T* px", "", &["(AO)ld(px, at)"], "O"),
            column_sums_rows("const T* px", (v, 4), row, (1, "O"), ("", "")),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_merges_the_kept_and_the_reduced_axes_apart() {
        // A global average pool of NHWC [2, 3, 4, 5]: N, C kept, H, W one reduced axis.
        let s = split(&[2, 3, 4, 5], &[1, 2]);
        assert_eq!(
            (s.ks, s.kst, s.rs, s.rst),
            (vec![2, 5], vec![60, 1], vec![12], vec![5])
        );
    }
}
