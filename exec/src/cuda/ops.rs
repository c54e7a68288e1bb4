//! One node on the device: the op's kernels (NVRTC) or GEMM (cuBLASLt).

use ampgraph_graph::ops::{
    AllFinite, AssignVariable, BatchMatMul, BiasAdd, Binary, BinaryGrad, BroadcastTo, Cast, Concat,
    Const, DataFormat, FusedAttention, FusedAttentionGrad, FusedElementwise, FusedMatMul,
    FusedSoftmax, Group, GroupedOptimizerUpdate, IncrementIf, LayerNorm, LayerNormGrad, LogSoftmax,
    LossScaleUpdate, MatMul, NormGradEpilogue, OptimizerUpdate, Reduce, ReduceGrad, ReduceKind,
    Reshape, Rule, Slice, Softmax, SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad,
    SoftmaxCrossEntropyWithGrad, SoftmaxGrad, SumTo, Transpose, Unary, UnaryGrad, UnaryKind,
};
use ampgraph_graph::shape::{broadcast_index_map, normalize_axis};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Op, Tensor, TensorType};

use super::device::{row_block, row_grid, Arg, DTensor, Device, Dims, UpdateTable};
use super::gemm::{Gemm, GemmOptions, Product};
use super::{attention, src};

/// Ops that wait for cuDNN.
pub const CUDNN_OPS: &[&str] = &[
    "Conv2D",
    "Conv2DBackpropInput",
    "Conv2DBackpropFilter",
    "MaxPool",
    "AvgPool",
    "MaxPoolGrad",
    "AvgPoolGrad",
    "BatchNorm",
    "BatchNormGrad",
];

/// Every op with a CUDA kernel (sources are the executor's own business).
const SUPPORTED: &[&str] = &[
    "Placeholder",
    "Variable",
    "Const",
    "Cast",
    "Relu",
    "Relu6",
    "Elu",
    "Selu",
    "Gelu",
    "LeakyRelu",
    "Tanh",
    "Sigmoid",
    "Exp",
    "Log",
    "Log1p",
    "Sqrt",
    "Rsqrt",
    "Square",
    "Neg",
    "Abs",
    "Erf",
    "Softplus",
    "Reciprocal",
    "Sign",
    "Identity",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Maximum",
    "Minimum",
    "Pow",
    "SquaredDifference",
    "BiasAdd",
    "UnaryGrad",
    "BinaryGrad",
    "FusedElementwise",
    "MatMul",
    "FusedMatMul",
    "BatchMatMul",
    "FusedAttention",
    "FusedAttentionGrad",
    "LayerNorm",
    "LayerNormGrad",
    "Sum",
    "Mean",
    "Max",
    "SumTo",
    "ReduceGrad",
    "Softmax",
    "LogSoftmax",
    "FusedSoftmax",
    "SoftmaxCrossEntropy",
    "SoftmaxGrad",
    "SoftmaxCrossEntropyGrad",
    "SoftmaxCrossEntropyWithGrad",
    "Reshape",
    "Transpose",
    "Concat",
    "Slice",
    "BroadcastTo",
    "AssignVariable",
    "Group",
    "AllFinite",
    "IncrementIf",
    "OptimizerUpdate",
    "GroupedOptimizerUpdate",
    "LossScaleUpdate",
];

/// Why `op` cannot run on the device, if it cannot.
pub fn unsupported(op: &dyn Op) -> Option<String> {
    let name = op.name();
    if CUDNN_OPS.contains(&name) {
        return Some(format!(
            "{name} has no CUDA kernel yet (cuDNN comes later); use Device::Cpu"
        ));
    }
    if !SUPPORTED.contains(&name) {
        return Some(format!("{name} has no CUDA kernel; use Device::Cpu"));
    }
    None
}

/// What a node's kernels need besides the device.
pub struct Ctx<'a> {
    pub dev: &'a Device,
    pub gemm: &'a Gemm,
    pub gemm_options: GemmOptions,
    /// The node's name, for out-of-memory errors.
    pub name: &'a str,
    /// The node's outputs' slots in the step's arena, by output index (`None`: a
    /// buffer of its own). Every op allocates its outputs in order.
    pub planned: &'a [Option<DTensor>],
    pub allocated: std::cell::Cell<usize>,
}

impl Ctx<'_> {
    /// The next output's buffer: its planned slot, or one from the pool.
    pub(super) fn alloc(&self, ty: &TensorType) -> Result<DTensor, String> {
        let k = self.allocated.get();
        self.allocated.set(k + 1);
        match self.planned.get(k) {
            Some(Some(slot)) if slot.ty() == *ty => Ok(slot.clone()),
            _ => self
                .dev
                .alloc(ty.dtype, &ty.shape, &Owner("node", self.name)),
        }
    }
    pub(super) fn temp(&self, dtype: DType, n: usize) -> Result<DTensor, String> {
        self.dev
            .alloc(dtype, &[n], &Owner("scratch of node", self.name))
    }
}

/// What a buffer is for, as an out-of-memory error says it: `node 'mm'`.
pub(crate) struct Owner<'a>(pub &'static str, pub &'a str);

impl std::fmt::Display for Owner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} '{}'", self.0, self.1)
    }
}

fn float_only(d: DType) -> Result<(), String> {
    if matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        Ok(())
    } else {
        Err(format!("no CUDA kernel for dtype {d}"))
    }
}

/// The accumulator dtype of float kernels' scratch buffers.
fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// Strides of `shape` read as `out` (NumPy broadcasting; 0 where it repeats).
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
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

/// How a binary operand is indexed: (mode, strides); see `src::binary`.
fn operand(shape: &[usize], out: &[usize]) -> Result<(i32, Dims), String> {
    let (n, total) = (numel(shape), numel(out));
    Ok(if n == total {
        (0, Dims::default())
    } else if n == 1 {
        (1, Dims::default())
    } else {
        (2, Dims::new(&broadcast_strides(shape, out))?)
    })
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
    let mut s = Split {
        ks: vec![],
        kst: vec![],
        rs: vec![],
        rst: vec![],
    };
    for (i, (&d, &t)) in shape.iter().zip(&st).enumerate() {
        if axes.contains(&i) {
            s.rs.push(d);
            s.rst.push(t);
        } else {
            s.ks.push(d);
            s.kst.push(t);
        }
    }
    s
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

fn reduce_into(
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
        let v = src::column_vector(x.dtype);
        let part = if out_len % v == 0 && x.ptr() % 16 == 0 {
            ("k_cols_part_vec", 32 * v)
        } else {
            ("k_cols_part", 32)
        };
        return column_sums(
            c,
            &format!("column_sum/{}/{}", x.dtype, y.dtype),
            || src::column_sum(x.dtype, y.dtype),
            &[x.arg()],
            (count, out_len),
            &[(y, scale)],
            part,
        );
    }
    let mut args = vec![x.arg(), y.arg()];
    args.extend(split_args(&s)?);
    let key = format!("reduce/{}/{}/{}", x.dtype, y.dtype, kind.name());
    let make = || src::reduce(x.dtype, y.dtype, kind);
    if count <= 64 || (out_len >= 4096 && count <= 4096) {
        let grid = out_len.div_ceil(256).min(1 << 20) as u32;
        c.dev.launch(&key, make, "k_thread", grid, 256, &args)
    } else {
        c.dev
            .launch(&key, make, "k", row_grid(out_len), row_block(count), &args)
    }
}

/// Row chunks (blocks) of a cross-entropy kernel that sums its gradient's columns:
/// about a wave of blocks (fewer left the GPU waiting on each row's reductions).
const SCE_SUM_CHUNKS: usize = 1024;

/// `k_mean` of a cross-entropy module: the mean of the `n` rows' losses into `y`.
fn sce_mean(
    c: &Ctx,
    key: &str,
    make: impl Fn() -> String,
    rows: &DTensor,
    y: &DTensor,
    n: usize,
) -> Result<(), String> {
    c.dev.launch(
        key,
        make,
        "k_mean",
        1,
        1024,
        &[rows.arg(), y.arg(), Arg::I64(n as i64)],
    )
}

/// Launches the column-sum kernels of module `key` (see `src::column_sums`) over a
/// `[rows, len]` matrix read through `inputs`, writing each `(output, scale)`. The
/// partial sums come from kernel `part` (`k_cols_part`, or a form such as
/// `k_cols_part_vec` whose tiles are `width` columns wide).
fn column_sums(
    c: &Ctx,
    key: &str,
    make: impl Fn() -> String,
    inputs: &[Arg],
    (rows, len): (usize, usize),
    outs: &[(&DTensor, f64)],
    (part_kernel, width): (&'static str, usize),
) -> Result<(), String> {
    let acc = acc_dtype(outs.first().ok_or("no outputs")?.0.dtype);
    let tiles = len.div_ceil(width);
    let most_blocks = (i32::MAX as usize) / tiles.max(1);
    let chunks = rows
        .div_ceil(64)
        .clamp(1, src::COLUMN_CHUNKS.min(most_blocks.max(1)));
    let chunk_rows = rows.div_ceil(chunks);
    let blocks = u32::try_from(tiles * chunks).map_err(|_| "too many columns for one launch")?;
    let part = c.temp(acc, chunks * outs.len() * len)?;
    let mut args = inputs.to_vec();
    args.extend([
        part.arg(),
        Arg::I64(rows as i64),
        Arg::I64(len as i64),
        Arg::I64(chunk_rows as i64),
    ]);
    c.dev.launch(key, &make, part_kernel, blocks, 256, &args)?;
    column_sums_fin(c, key, make, &part, len, chunks, outs)
}

/// `k_cols_fin`: adds `chunks` rows of partial column sums (`len` each, per output) in
/// `part` and writes each `(output, scale)`.
fn column_sums_fin(
    c: &Ctx,
    key: &str,
    make: impl Fn() -> String,
    part: &DTensor,
    len: usize,
    chunks: usize,
    outs: &[(&DTensor, f64)],
) -> Result<(), String> {
    let mut args = vec![part.arg(), Arg::I64(len as i64), Arg::I64(chunks as i64)];
    for (y, scale) in outs {
        args.extend([y.arg(), Arg::F64(*scale)]);
    }
    let grid = len.div_ceil(32).min(1 << 20) as u32;
    c.dev.launch(key, &make, "k_cols_fin", grid, 256, &args)
}

/// Kernel `name` of module `key` with a block per row (of `len` values) of `rows`:
/// arguments `tensors`, then `rows` and `len`.
fn block_rows(
    c: &Ctx,
    key: &str,
    make: impl Fn() -> String,
    name: &'static str,
    tensors: &[Arg],
    (rows, len): (usize, usize),
) -> Result<(), String> {
    if rows == 0 {
        return Ok(());
    }
    let mut args = tensors.to_vec();
    args.extend([Arg::I64(rows as i64), Arg::I64(len as i64)]);
    c.dev
        .launch(key, &make, name, row_grid(rows), row_block(len), &args)
}

/// Launches a module's row kernels over `rows` rows of `len` values: `warp` (a warp
/// per row, held in registers) when the rows are contiguous and short, else `block`
/// (a block per row). Both take `tensors`, rows and len; `inner` (the distance
/// between a row's values) goes to `block` too where the module's rows may be
/// strided (softmax), and is `None` where they are always contiguous.
fn row_kernel(
    c: &Ctx,
    key: &str,
    make: impl Fn() -> String,
    (block, warp): (&'static str, &'static str),
    tensors: &[Arg],
    (rows, len, inner): (usize, usize, Option<usize>),
) -> Result<(), String> {
    if rows == 0 {
        return Ok(());
    }
    let mut args = tensors.to_vec();
    args.extend([Arg::I64(rows as i64), Arg::I64(len as i64)]);
    if inner.unwrap_or(1) == 1 && len <= src::WARP_ROW_MAX {
        let grid = rows.div_ceil(8).min(1 << 20) as u32;
        return c.dev.launch(key, &make, warp, grid, 256, &args);
    }
    args.extend(inner.map(|i| Arg::I64(i as i64)));
    c.dev
        .launch(key, &make, block, row_grid(rows), row_block(len), &args)
}

/// The rows a layer norm over the axes from `axis` on normalises: (rows, values per
/// row).
fn normalized_rows(x: &DTensor, axis: i64) -> Result<(usize, usize), String> {
    float_only(x.dtype)?;
    let axis = normalize_axis(axis, x.shape.len())?;
    let len = numel(&x.shape[axis..]);
    let rows = x.len().checked_div(len).unwrap_or(0);
    Ok((rows, len))
}

/// LayerNormGrad and its epilogue. Rows of at most [`src::WARP_ROW_MAX`] values: a
/// wave of blocks each writes dx for a range of rows and adds up their dgamma, dbeta
/// and the epilogue's column sums (where the normalised rows are the summed columns);
/// `k_cols_fin` adds the blocks' partials. Longer rows: a block per row, then a column pass over x
/// and dy for dgamma and dbeta. Column sums left over are those of a Sum.
fn layer_norm_grad(
    c: &Ctx,
    ln: &LayerNormGrad,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let input = |k: usize| inputs.get(k).ok_or(format!("missing input {k}"));
    let (x, g, dy) = (input(0)?, input(1)?, input(2)?);
    let epi = ln.epilogue;
    let residual = if epi.residual { Some(input(3)?) } else { None };
    let (rows, len) = normalized_rows(x, ln.axis)?;
    let out: Vec<DTensor> = outs.iter().map(|t| c.alloc(t)).collect::<Result<_, _>>()?;
    let [dx, dg, db, sums @ ..] = &out[..] else {
        return Err("LayerNormGrad has three outputs".into());
    };
    let types = src::NormTypes {
        params: g.dtype,
        x: x.dtype,
        dy: dy.dtype,
        y: dx.dtype,
    };
    let mut tensors = vec![x.arg(), g.arg(), dy.arg()];
    tensors.extend(residual.map(DTensor::arg));
    tensors.push(dx.arg());
    let eps = ln.epsilon;
    // The summed columns are the normalised rows' values (the last axis normalised).
    let columns_are_rows = x.shape.last() == Some(&len);
    if rows > 0 && len > 0 && len <= src::WARP_ROW_MAX {
        let mut checked = vec![x, dy, dx];
        checked.extend(residual);
        let (per, warp) = warp_row_form(len, x.dtype, types.same_words(), &checked);
        // The kernels take the epilogue's sums where their columns are the rows'.
        let in_rows = NormGradEpilogue {
            sum_dx: epi.sum_dx && columns_are_rows,
            sum_residual: epi.sum_residual && columns_are_rows,
            ..epi
        };
        let key = format!("layer_norm_grad_rows/{types:?}/{eps:e}/{per}/{in_rows:?}");
        let make = || src::layer_norm_grad_rows(types, eps, per, in_rows);
        // A wave of blocks of at least 32 rows: few partials for `k_cols_fin`.
        let blocks = c
            .dev
            .resident_blocks(&key, make, warp, 256)?
            .min(rows.div_ceil(32).min(1 << 20) as u32);
        let mut outputs = vec![(dg, 1.0), (db, 1.0)];
        if columns_are_rows {
            outputs.extend(sums.iter().map(|s| (s, 1.0)));
        }
        let acc = acc_dtype(g.dtype);
        let stats = c.temp(acc, 2 * rows)?;
        let part = c.temp(acc, blocks as usize * outputs.len() * len)?;
        let mut args = tensors;
        args.extend([
            stats.arg(),
            part.arg(),
            Arg::I64(rows as i64),
            Arg::I64(len as i64),
        ]);
        c.dev.launch(&key, make, warp, blocks, 256, &args)?;
        column_sums_fin(c, &key, make, &part, len, blocks as usize, &outputs)?;
        if columns_are_rows {
            return Ok(out);
        }
    } else {
        let key = format!("layer_norm_grad_block/{types:?}/{eps:e}/{:?}", epi.residual);
        let make = || src::layer_norm_grad_block(types, eps, epi.residual);
        let stats = c.temp(acc_dtype(g.dtype), 2 * rows)?;
        let mut args = tensors;
        args.push(stats.arg());
        block_rows(c, &key, make, "k", &args, (rows, len))?;
        // With no rows this writes dgamma's and dbeta's zeros.
        if len > 0 {
            column_sums(
                c,
                &key,
                make,
                &[x.arg(), dy.arg(), stats.arg()],
                (rows, len),
                &[(dg, 1.0), (db, 1.0)],
                ("k_cols_part", 32),
            )?;
        }
    }
    for (t, sum) in epi.summed(dx, residual).into_iter().zip(sums) {
        let leading: Vec<usize> = (0..t.shape.len().saturating_sub(1)).collect();
        reduce_into(c, t, sum, ReduceKind::Sum, &leading)?;
    }
    Ok(out)
}

/// The values per lane and the warp kernel of a row module over rows of `len`
/// values: `k_warp_vec` (16-byte words, rows of exactly `32 * per` values) where the
/// rows are contiguous, `len` is a multiple of 32 words and every tensor is 16-byte
/// aligned, else `k_warp`.
fn warp_row_form(
    len: usize,
    dtype: DType,
    contiguous: bool,
    tensors: &[&DTensor],
) -> (usize, &'static str) {
    let words = 32 * src::column_vector(dtype);
    let vector = contiguous
        && len > 0
        && len <= src::WARP_ROW_MAX
        && len % words == 0
        && tensors.iter().all(|t| t.ptr() % 16 == 0);
    if vector {
        (len / 32, "k_warp_vec")
    } else {
        (src::warp_row_values(len), "k_warp")
    }
}

/// The kernel-cache key of a fused program's module: the program text and its column
/// sums hold every dtype and shape the source bakes in.
fn fused_key(f: &FusedElementwise) -> String {
    format!("fused/{f}/{:?}", f.column_sums())
}

/// Whether the tensors a fused program's vector kernels move in 16-byte words are
/// aligned to them: its streamed inputs (`src::fused_streamed_inputs`) and `outputs`.
fn streams_aligned<'a>(
    p: &FusedElementwise,
    inputs: &'a [DTensor],
    outputs: impl IntoIterator<Item = &'a DTensor>,
) -> bool {
    let streamed = src::fused_streamed_inputs(p);
    (streamed.iter().map(|&k| &inputs[k]).chain(outputs)).all(|t| t.ptr() % 16 == 0)
}

/// `y = softmax(x)` (or log-softmax) along `axis`.
fn softmax_into(c: &Ctx, x: &DTensor, y: &DTensor, axis: i64, log: bool) -> Result<(), String> {
    float_only(x.dtype)?;
    let (len, inner, rows) = along(&x.shape, axis)?;
    let (per, warp) = warp_row_form(len, x.dtype, inner == 1, &[x, y]);
    let key = format!("softmax/{}/{log}/{per}", x.dtype);
    let make = || src::softmax(x.dtype, log, per);
    row_kernel(
        c,
        &key,
        make,
        ("k", warp),
        &[x.arg(), y.arg()],
        (rows, len, Some(inner)),
    )
}

/// `y = FusedSoftmax(inputs)`. Contiguous rows a warp holds: one kernel computing the
/// prologue as it loads each row (16-byte words where the rows are whole words of the
/// prologue's vectors and the streamed tensors aligned). Other rows: the prologue's
/// elementwise kernel into a temporary, then the softmax kernels.
fn fused_softmax(c: &Ctx, f: &FusedSoftmax, inputs: &[DTensor], y: &DTensor) -> Result<(), String> {
    float_only(y.dtype)?;
    let p = f.prologue();
    let (len, inner, rows) = along(&y.shape, f.axis)?;
    let n = p.domain_len();
    let mut args: Vec<Arg> = inputs.iter().map(DTensor::arg).collect();
    if inner != 1 || len > src::WARP_ROW_MAX {
        let x = c.temp(y.dtype, n)?.reshaped(y.shape.clone());
        args.extend([x.arg(), Arg::I64(n as i64)]);
        c.dev
            .launch_elementwise(&fused_key(p), || src::fused(p), n, &args)?;
        return softmax_into(c, &x, y, f.axis, f.log);
    }
    let v = src::fused_vector(p);
    let (per, kernel) = if len % (32 * v) == 0 && streams_aligned(p, inputs, [y]) {
        (len / 32, "k_warp_vec")
    } else {
        (src::warp_row_values(len), "k_warp")
    };
    args.push(y.arg());
    let key = format!("fused_softmax/{p}/{}/{per}", f.log);
    // Rows a warp holds: `row_kernel` launches the warp kernel.
    row_kernel(
        c,
        &key,
        || src::fused_softmax(f, per),
        (kernel, kernel),
        &args,
        (rows, len, None),
    )
}

/// `y = x` converted to `y`'s dtype, element by element.
fn cast_into(c: &Ctx, x: &DTensor, y: &DTensor) -> Result<(), String> {
    let n = x.len();
    c.dev.launch_elementwise(
        &format!("cast/{}/{}", x.dtype, y.dtype),
        || src::cast(x.dtype, y.dtype),
        n,
        &[x.arg(), y.arg(), Arg::I64(n as i64)],
    )
}

/// (len, inner, rows) of a softmax-like op along `axis`.
fn along(shape: &[usize], axis: i64) -> Result<(usize, usize, usize), String> {
    let axis = normalize_axis(axis, shape.len())?;
    let len = shape[axis];
    let inner = numel(&shape[axis + 1..]);
    let total = numel(shape);
    let rows = if len == 0 || inner == 0 {
        0
    } else {
        total / len
    };
    Ok((len, inner, rows))
}

/// `y[i] = x[offset + strided(i)]` for transposes, slices and broadcasts. Where the
/// last axis is contiguous in both, its runs move as words of up to 16 bytes.
fn gather(c: &Ctx, x: &DTensor, y: &DTensor, st: &[usize], offset: usize) -> Result<(), String> {
    let esize = x.dtype.size_bytes();
    let (mut shape, mut st, mut offset) = (y.shape.clone(), st.to_vec(), offset);
    let mut group = 1;
    if let (Some(&inner), Some(&1)) = (shape.last(), st.last()) {
        let outer = &st[..st.len() - 1];
        group = (16 / esize).max(1);
        while group > 1
            && !(inner % group == 0 && offset % group == 0 && outer.iter().all(|s| s % group == 0))
        {
            group /= 2;
        }
    }
    if group > 1 {
        let last = shape.len() - 1;
        shape[last] /= group;
        for s in &mut st[..last] {
            *s /= group;
        }
        offset /= group;
    }
    let bytes = esize * group;
    let n = numel(&shape);
    c.dev.launch_n(
        &format!("gather/{bytes}"),
        || src::gather(bytes),
        n,
        &[
            x.arg(),
            y.arg(),
            Arg::I64(n as i64),
            Arg::I32(shape.len() as i32),
            Arg::Dims(Dims::new(&shape)?),
            Arg::Dims(Dims::new(&st)?),
            Arg::I64(offset as i64),
        ],
    )
}

/// Computes a node's outputs from its inputs, on the device.
pub fn eval(
    c: &Ctx,
    op: &dyn Op,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let out0 = outs.first().ok_or("the node has no outputs")?;
    let input = |i: usize| -> Result<&DTensor, String> {
        inputs.get(i).ok_or_else(|| format!("missing input {i}"))
    };
    let dev = c.dev;

    if let Some(u) = op.downcast_ref::<Unary>() {
        let x = input(0)?;
        if u.kind == UnaryKind::Identity {
            return Ok(vec![x.clone()]);
        }
        float_only(x.dtype)?;
        let y = c.alloc(out0)?;
        let n = x.len();
        dev.launch_elementwise(
            &format!("unary/{}/{:?}", x.dtype, u.kind),
            || src::unary(x.dtype, u.kind),
            n,
            &[x.arg(), y.arg(), Arg::I64(n as i64)],
        )?;
        return Ok(vec![y]);
    }
    if let Some(u) = op.downcast_ref::<UnaryGrad>() {
        let (x, dy) = (input(0)?, input(1)?);
        float_only(x.dtype)?;
        let dx = c.alloc(out0)?;
        let n = x.len();
        dev.launch_elementwise(
            &format!("unary_grad/{}/{:?}", x.dtype, u.kind),
            || src::unary_grad(x.dtype, u.kind),
            n,
            &[x.arg(), dy.arg(), dx.arg(), Arg::I64(n as i64)],
        )?;
        return Ok(vec![dx]);
    }
    if op.downcast_ref::<Binary>().is_some() || op.downcast_ref::<BinaryGrad>().is_some() {
        let (a, b) = (input(0)?, input(1)?);
        float_only(a.dtype)?;
        let y = c.alloc(out0)?;
        let shape = &out0.shape;
        let n = numel(shape);
        let (ma, sa) = operand(&a.shape, shape)?;
        let (mb, sb) = operand(&b.shape, shape)?;
        let mut args = vec![a.arg(), b.arg()];
        let key;
        let make: Box<dyn FnOnce() -> String>;
        if let Some(bin) = op.downcast_ref::<Binary>() {
            key = format!("binary/{}/{:?}", a.dtype, bin.kind);
            let (d, k) = (a.dtype, bin.kind);
            make = Box::new(move || src::binary(d, k));
        } else {
            let g = op
                .downcast_ref::<BinaryGrad>()
                .ok_or("internal: BinaryGrad")?;
            args.push(input(2)?.arg());
            key = format!("binary_grad/{}/{:?}/{}", a.dtype, g.kind, g.wrt);
            let (d, k, w) = (a.dtype, g.kind, g.wrt);
            make = Box::new(move || src::binary_grad(d, k, w));
        }
        args.extend([
            y.arg(),
            Arg::I64(n as i64),
            Arg::I32(shape.len() as i32),
            Arg::Dims(Dims::new(if ma == 2 || mb == 2 { shape } else { &[] })?),
            Arg::I32(ma),
            Arg::Dims(sa),
            Arg::I32(mb),
            Arg::Dims(sb),
        ]);
        dev.launch_elementwise(&key, make, n, &args)?;
        return Ok(vec![y]);
    }
    if let Some(b) = op.downcast_ref::<BiasAdd>() {
        let (x, bias) = (input(0)?, input(1)?);
        float_only(x.dtype)?;
        let rank = x.shape.len();
        let axis = match b.data_format {
            DataFormat::Nhwc => rank - 1,
            DataFormat::Nchw => 1,
        };
        let inner = numel(&x.shape[axis + 1..]);
        let ch = x.shape[axis];
        let y = c.alloc(out0)?;
        let n = x.len();
        dev.launch_elementwise(
            &format!("bias_add/{}", x.dtype),
            || src::bias_add(x.dtype),
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
        return Ok(vec![y]);
    }
    if let Some(f) = op.downcast_ref::<FusedElementwise>() {
        let outputs = outs
            .iter()
            .map(|t| c.alloc(t))
            .collect::<Result<Vec<_>, _>>()?;
        let n = f.domain_len();
        let (stored, sums) = outputs.split_at(f.outputs().len());
        let mut args: Vec<Arg> = inputs.iter().map(DTensor::arg).collect();
        args.extend(stored.iter().map(DTensor::arg));
        let key = fused_key(f);
        if sums.is_empty() {
            args.push(Arg::I64(n as i64));
            dev.launch_elementwise(&key, || src::fused(f), n, &args)?;
        } else {
            // Column sums of the domain's rows (its last axis).
            let len = out0.shape.last().copied().unwrap_or(1).max(1);
            let v = src::fused_vector(f);
            let part = if len % v == 0 && streams_aligned(f, inputs, stored) {
                ("k_cols_part_vec", 32 * v)
            } else {
                ("k_cols_part", 32)
            };
            let outs: Vec<(&DTensor, f64)> = sums.iter().map(|s| (s, 1.0)).collect();
            column_sums(
                c,
                &key,
                || src::fused(f),
                &args,
                (n / len, len),
                &outs,
                part,
            )?;
        }
        return Ok(outputs);
    }
    if let Some(cast) = op.downcast_ref::<Cast>() {
        let x = input(0)?;
        if x.dtype == cast.to {
            return Ok(vec![x.clone()]);
        }
        let y = c.alloc(out0)?;
        cast_into(c, x, &y)?;
        return Ok(vec![y]);
    }
    if op.downcast_ref::<Reshape>().is_some() {
        return Ok(vec![input(0)?.reshaped(out0.shape.clone())]);
    }
    if op.downcast_ref::<AssignVariable>().is_some() {
        return Ok(vec![input(1)?.clone()]);
    }
    if let Some(t) = op.downcast_ref::<Transpose>() {
        let x = input(0)?;
        let in_st = strides(&x.shape);
        let st: Vec<usize> = t.perm.iter().map(|&p| in_st[p]).collect();
        let y = c.alloc(out0)?;
        gather(c, x, &y, &st, 0)?;
        return Ok(vec![y]);
    }
    if let Some(s) = op.downcast_ref::<Slice>() {
        let x = input(0)?;
        let st = strides(&x.shape);
        let offset = s.begin.iter().zip(&st).map(|(b, s)| b * s).sum();
        let y = c.alloc(out0)?;
        gather(c, x, &y, &st, offset)?;
        return Ok(vec![y]);
    }
    if op.downcast_ref::<BroadcastTo>().is_some() {
        let x = input(0)?;
        if x.shape == out0.shape {
            return Ok(vec![x.clone()]);
        }
        let y = c.alloc(out0)?;
        gather(c, x, &y, &broadcast_strides(&x.shape, &out0.shape), 0)?;
        return Ok(vec![y]);
    }
    if let Some(cc) = op.downcast_ref::<Concat>() {
        let y = c.alloc(out0)?;
        let axis = normalize_axis(cc.axis, out0.shape.len())?;
        let inner_out = numel(&out0.shape[axis..]);
        let below = numel(&out0.shape[axis + 1..]);
        let bytes = out0.dtype.size_bytes();
        let mut off = 0usize;
        for x in inputs {
            let n = x.len();
            let inner_in = numel(&x.shape[axis..]);
            if n > 0 {
                dev.launch_n(
                    &format!("concat/{bytes}"),
                    || src::concat(bytes),
                    n,
                    &[
                        x.arg(),
                        y.arg(),
                        Arg::I64(n as i64),
                        Arg::I64(inner_in as i64),
                        Arg::I64(inner_out as i64),
                        Arg::I64(off as i64),
                    ],
                )?;
            }
            off += x.shape[axis] * below;
        }
        return Ok(vec![y]);
    }
    if let Some(r) = op.downcast_ref::<Reduce>() {
        let x = input(0)?;
        let axes = r.reduced_axes(x.shape.len())?;
        let y = c.alloc(out0)?;
        reduce_into(c, x, &y, r.kind, &axes)?;
        return Ok(vec![y]);
    }
    if let Some(s) = op.downcast_ref::<SumTo>() {
        let x = input(0)?;
        let (r, t) = (x.shape.len(), s.shape.len());
        let axes: Vec<usize> = (0..r)
            .filter(|&a| a + t < r || (s.shape[a + t - r] == 1 && x.shape[a] != 1))
            .collect();
        if axes.is_empty() {
            return Ok(vec![x.reshaped(out0.shape.clone())]);
        }
        let y = c.alloc(out0)?;
        reduce_into(c, x, &y, ReduceKind::Sum, &axes)?;
        return Ok(vec![y]);
    }
    if let Some(r) = op.downcast_ref::<ReduceGrad>() {
        let (x, dy) = (input(0)?, input(1)?);
        float_only(x.dtype)?;
        let axes = Reduce::new(r.kind, r.axes.clone(), r.keep_dims).reduced_axes(x.shape.len())?;
        let dx = c.alloc(out0)?;
        let n = x.len();
        if r.kind == ReduceKind::Max {
            let s = split(&x.shape, &axes);
            if numel(&s.ks) > 0 {
                let mut args = vec![x.arg(), dy.arg(), dx.arg()];
                args.extend(split_args(&s)?);
                dev.launch(
                    &format!("reduce_max_grad/{}", x.dtype),
                    || src::reduce_max_grad(x.dtype),
                    "k",
                    row_grid(numel(&s.ks)),
                    row_block(numel(&s.rs)),
                    &args,
                )?;
            }
        } else {
            let kept: Vec<usize> = x
                .shape
                .iter()
                .enumerate()
                .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
                .collect();
            let div = if r.kind == ReduceKind::Mean {
                n.checked_div(dy.len()).unwrap_or(0) as f64
            } else {
                1.0
            };
            dev.launch_n(
                &format!("broadcast_div/{}", x.dtype),
                || src::broadcast_div(x.dtype),
                n,
                &[
                    dy.arg(),
                    dx.arg(),
                    Arg::I64(n as i64),
                    Arg::I32(x.shape.len() as i32),
                    Arg::Dims(Dims::new(&x.shape)?),
                    Arg::Dims(Dims::new(&broadcast_strides(&kept, &x.shape))?),
                    Arg::F64(div),
                ],
            )?;
        }
        return Ok(vec![dx]);
    }
    let softmax_axis = op
        .downcast_ref::<Softmax>()
        .map(|s| (s.axis, false))
        .or_else(|| op.downcast_ref::<LogSoftmax>().map(|s| (s.axis, true)));
    if let Some((axis, log)) = softmax_axis {
        let y = c.alloc(out0)?;
        softmax_into(c, input(0)?, &y, axis, log)?;
        return Ok(vec![y]);
    }
    if let Some(f) = op.downcast_ref::<FusedSoftmax>() {
        let y = c.alloc(out0)?;
        fused_softmax(c, f, inputs, &y)?;
        return Ok(vec![y]);
    }
    if let Some(s) = op.downcast_ref::<SoftmaxGrad>() {
        let (y, dy) = (input(0)?, input(1)?);
        float_only(y.dtype)?;
        let (len, inner, rows) = along(&y.shape, s.axis)?;
        let dx = c.alloc(out0)?;
        let per = src::warp_row_values(len);
        let key = format!("softmax_grad/{}/{}/{per}", y.dtype, s.log);
        let make = || src::softmax_grad(y.dtype, s.log, per);
        row_kernel(
            c,
            &key,
            make,
            ("k", "k_warp"),
            &[y.arg(), dy.arg(), dx.arg()],
            (rows, len, Some(inner)),
        )?;
        return Ok(vec![dx]);
    }
    if op.downcast_ref::<SoftmaxCrossEntropy>().is_some() {
        let (x, labels) = (input(0)?, input(1)?);
        float_only(x.dtype)?;
        let (n, classes) = (x.shape[0], x.shape[1]);
        let rows = c.temp(acc_dtype(x.dtype), n)?;
        let y = c.alloc(out0)?;
        let key = format!("sce/{}/{}", x.dtype, labels.dtype);
        let make = || src::sce(x.dtype, labels.dtype);
        block_rows(
            c,
            &key,
            make,
            "k_rows",
            &[x.arg(), labels.arg(), rows.arg()],
            (n, classes),
        )?;
        sce_mean(c, &key, make, &rows, &y, n)?;
        return Ok(vec![y]);
    }
    if let Some(f) = op.downcast_ref::<SoftmaxCrossEntropyWithGrad>() {
        let (x, labels, dl) = (input(0)?, input(1)?, input(2)?);
        float_only(x.dtype)?;
        let (n, classes) = (x.shape[0], x.shape[1]);
        let rows = c.temp(acc_dtype(dl.dtype), n)?;
        let output = |k: usize| {
            outs.get(k)
                .ok_or("the node lacks an output")
                .map(|t| c.alloc(t))
        };
        let (loss, grad) = (output(0)??, output(1)??);
        let sums = if f.column_sum {
            Some(output(2)??)
        } else {
            None
        };
        let summed = f.column_sum.then_some(classes);
        // With column sums, a block per chunk of rows: its sums are one partial each.
        let (blocks, threads, part_len) = match summed {
            Some(_) => {
                let blocks = n.min(SCE_SUM_CHUNKS);
                (blocks, src::SCE_SUM_THREADS as u32, blocks * classes)
            }
            None => (n, row_block(classes), 1),
        };
        let part = c.temp(acc_dtype(dl.dtype), part_len)?;
        let key = format!(
            "sce_with_grad/{}/{}/{}/{}/{summed:?}",
            x.dtype, dl.dtype, grad.dtype, labels.dtype
        );
        let types = (x.dtype, dl.dtype, grad.dtype, labels.dtype);
        let make = || src::sce_with_grad(types.0, types.1, types.2, types.3, summed);
        if n > 0 {
            dev.launch(
                &key,
                make,
                "k_rows",
                row_grid(blocks),
                threads,
                &[
                    x.arg(),
                    labels.arg(),
                    dl.arg(),
                    grad.arg(),
                    rows.arg(),
                    part.arg(),
                    Arg::I64(n as i64),
                    Arg::I64(classes as i64),
                ],
            )?;
        }
        sce_mean(c, &key, make, &rows, &loss, n)?;
        let mut out = vec![loss, grad];
        if let Some(sums) = sums {
            column_sums_fin(
                c,
                &key,
                make,
                &part,
                classes,
                blocks.max(1),
                &[(&sums, 1.0)],
            )?;
            out.push(sums);
        }
        return Ok(out);
    }
    if op.downcast_ref::<SoftmaxCrossEntropyGrad>().is_some() {
        let (x, labels, dl) = (input(0)?, input(1)?, input(2)?);
        float_only(x.dtype)?;
        let (n, classes) = (x.shape[0], x.shape[1]);
        let dx = c.alloc(out0)?;
        block_rows(
            c,
            &format!("sce_grad/{}/{}", x.dtype, labels.dtype),
            || src::sce_grad(x.dtype, labels.dtype),
            "k",
            &[x.arg(), labels.arg(), dl.arg(), dx.arg()],
            (n, classes),
        )?;
        return Ok(vec![dx]);
    }
    if let Some(a) = op.downcast_ref::<FusedAttention>() {
        return attention::forward(c, a, inputs, outs);
    }
    if let Some(a) = op.downcast_ref::<FusedAttentionGrad>() {
        return attention::backward(c, a, inputs, outs);
    }
    if let Some(ln) = op.downcast_ref::<LayerNorm>() {
        let (x, g, b) = (input(0)?, input(1)?, input(2)?);
        let (rows, len) = normalized_rows(x, ln.axis)?;
        let y = c.alloc(out0)?;
        let types = src::NormTypes {
            params: g.dtype,
            x: x.dtype,
            dy: x.dtype,
            y: y.dtype,
        };
        let (per, warp) = warp_row_form(len, x.dtype, types.same_words(), &[x, &y]);
        row_kernel(
            c,
            &format!("layer_norm/{types:?}/{:e}/{per}", ln.epsilon),
            || src::layer_norm(types, ln.epsilon, per),
            ("k", warp),
            &[x.arg(), g.arg(), b.arg(), y.arg()],
            (rows, len, None),
        )?;
        return Ok(vec![y]);
    }
    if let Some(ln) = op.downcast_ref::<LayerNormGrad>() {
        return layer_norm_grad(c, ln, inputs, outs);
    }
    let fused = op.downcast_ref::<FusedMatMul>();
    if let Some(m) = op.downcast_ref::<MatMul>().or(fused.map(|f| &f.product)) {
        let (a, b) = (input(0)?, input(1)?);
        float_only(a.dtype)?;
        let bias = match fused {
            Some(f) => Some((input(2)?, f.epilogue)),
            None => None,
        };
        let residual = match fused {
            Some(f) if f.residual => Some(input(3)?),
            _ => None,
        };
        let y = c.alloc(out0)?;
        let (mm, nn) = (out0.shape[0], out0.shape[1]);
        let k = if m.transpose_a {
            a.shape[0]
        } else {
            a.shape[1]
        };
        let product = |out, bias| Product {
            a,
            b,
            c: out,
            m: mm,
            n: nn,
            k,
            transpose_a: m.transpose_a,
            transpose_b: m.transpose_b,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            offset_a: 0,
            offset_b: 0,
            offset_c: 0,
            alpha: 1.0,
            bias,
            residual,
        };
        // cuBLASLt adds a bias of the output's type: a 16-bit bias of a product
        // stored in f32 is widened first (exactly; a kernel over the bias alone).
        let wide_bias = match bias {
            Some((b, e)) if b.dtype != y.dtype => {
                let wide = c.temp(y.dtype, b.len())?;
                cast_into(c, b, &wide)?;
                Some((wide, e))
            }
            _ => None,
        };
        let stored_bias = wide_bias.as_ref().map(|(b, e)| (b, *e)).or(bias);
        let run = c.gemm.run(dev, &product(&y, stored_bias), c.gemm_options);
        if let (Err(why), true) = (&run, y.dtype != a.dtype) {
            // No cuBLASLt kernel stores this product wide: in its own type, then a cast.
            log::debug!("{}: {why}; storing the product, then casting", c.name);
            let narrow = c.temp(a.dtype, y.len())?;
            c.gemm.run(dev, &product(&narrow, bias), c.gemm_options)?;
            cast_into(c, &narrow, &y)?;
            return Ok(vec![y]);
        }
        run?;
        return Ok(vec![y]);
    }
    if let Some(bm) = op.downcast_ref::<BatchMatMul>() {
        let (a, b) = (input(0)?, input(1)?);
        float_only(a.dtype)?;
        let y = c.alloc(out0)?;
        let (ra, rb, ro) = (a.shape.len(), b.shape.len(), out0.shape.len());
        let (mm, nn) = (out0.shape[ro - 2], out0.shape[ro - 1]);
        let k = if bm.adj_x {
            a.shape[ra - 2]
        } else {
            a.shape[ra - 1]
        };
        let batch_shape = &out0.shape[..ro - 2];
        let total = numel(batch_shape);
        let (ba, bb) = (numel(&a.shape[..ra - 2]), numel(&b.shape[..rb - 2]));
        let (sa, sb) = (mm * k, k * nn);
        let stride = |n: usize, s: usize| -> Option<usize> {
            if n == total {
                Some(s)
            } else if n == 1 {
                Some(0)
            } else {
                None
            }
        };
        let product = |batch, stride_a, stride_b, offset_a, offset_b, offset_c| Product {
            a,
            b,
            c: &y,
            m: mm,
            n: nn,
            k,
            transpose_a: bm.adj_x,
            transpose_b: bm.adj_y,
            batch,
            stride_a,
            stride_b,
            offset_a,
            offset_b,
            offset_c,
            alpha: bm.alpha,
            bias: None,
            residual: None,
        };
        match (stride(ba, sa), stride(bb, sb)) {
            (Some(s1), Some(s2)) => {
                c.gemm
                    .run(dev, &product(total, s1, s2, 0, 0, 0), c.gemm_options)?
            }
            _ => {
                // Batches that broadcast both ways: one product per output matrix.
                let ia = broadcast_index_map(&a.shape[..ra - 2], batch_shape);
                let ib = broadcast_index_map(&b.shape[..rb - 2], batch_shape);
                for (o, (&i, &j)) in ia.iter().zip(&ib).enumerate() {
                    c.gemm.run(
                        dev,
                        &product(1, 0, 0, i * sa, j * sb, o * mm * nn),
                        c.gemm_options,
                    )?;
                }
            }
        }
        return Ok(vec![y]);
    }
    if let Some(a) = op.downcast_ref::<AllFinite>() {
        let (checked, scale) = match inputs.split_last() {
            Some((s, xs)) if a.scaled => (xs, Some(s)),
            _ => (inputs, None),
        };
        let flag = c.alloc(out0)?;
        dev.launch(
            "fill_flag",
            src::fill_flag,
            "k",
            1,
            1,
            &[flag.arg(), Arg::I32(1)],
        )?;
        // One launch for all, in lists of one dtype and at most MAX_RANK tensors: ten
        // gradients' checks launched one by one cost more than reading them.
        let mut by_dtype: Vec<(DType, Vec<&DTensor>)> = Vec::new();
        for x in checked {
            float_only(x.dtype)?;
            match by_dtype.iter_mut().find(|(d, _)| *d == x.dtype) {
                Some((_, xs)) => xs.push(x),
                None => by_dtype.push((x.dtype, vec![x])),
            }
        }
        let lists: Vec<(DType, &[&DTensor])> = by_dtype
            .iter()
            .flat_map(|(d, xs)| xs.chunks(src::MAX_RANK).map(|list| (*d, list)))
            .collect();
        if lists.is_empty() {
            return Ok(vec![flag]);
        }
        let mut args = Vec::new();
        for (_, list) in &lists {
            let ptrs: Vec<usize> = list.iter().map(|x| x.ptr() as usize).collect();
            let lens: Vec<usize> = list.iter().map(|x| x.len()).collect();
            args.extend([
                Arg::Dims(Dims::new(&ptrs)?),
                Arg::Dims(Dims::new(&lens)?),
                Arg::I32(list.len() as i32),
            ]);
        }
        args.push(flag.arg());
        args.extend(scale.map(|s| s.arg()));
        let dtypes: Vec<DType> = lists.iter().map(|(d, _)| *d).collect();
        let scale_dtype = scale.map(|s| s.dtype);
        dev.launch_elementwise(
            &format!("all_finite/{dtypes:?}/{scale_dtype:?}"),
            || src::all_finite(&dtypes, scale_dtype),
            checked.iter().map(|x| x.len()).max().unwrap_or(0),
            &args,
        )?;
        return Ok(vec![flag]);
    }
    if op.downcast_ref::<IncrementIf>().is_some() {
        let (f, counter) = (input(0)?, input(1)?);
        let y = c.alloc(out0)?;
        dev.launch(
            &format!("increment_if/{}", counter.dtype),
            || src::increment_if(counter.dtype),
            "k",
            1,
            1,
            &[f.arg(), counter.arg(), y.arg()],
        )?;
        return Ok(vec![y]);
    }
    if let Some(l) = op.downcast_ref::<LossScaleUpdate>() {
        let (f, s, g) = (input(0)?, input(1)?, input(2)?);
        let s_out = c.alloc(out0)?;
        let g_out = c.alloc(outs.get(1).ok_or("missing output 1")?)?;
        dev.launch(
            &format!(
                "loss_scale_update/{}/{}/{}/{:e}/{:e}",
                s.dtype, g.dtype, l.growth_interval, l.growth_factor, l.backoff_factor
            ),
            || {
                src::loss_scale_update(
                    s.dtype,
                    g.dtype,
                    l.growth_interval,
                    l.growth_factor,
                    l.backoff_factor,
                )
            },
            "k",
            1,
            1,
            &[f.arg(), s.arg(), g.arg(), s_out.arg(), g_out.arg()],
        )?;
        return Ok(vec![s_out, g_out]);
    }
    if let Some(u) = op.downcast_ref::<OptimizerUpdate>() {
        return optimizer(c, u, inputs, outs);
    }
    if let Some(g) = op.downcast_ref::<GroupedOptimizerUpdate>() {
        return grouped_optimizer(c, g, inputs, outs);
    }
    if let Some(k) = op.downcast_ref::<Const>() {
        // Normally served from the executor's constant cache; this uploads afresh.
        let t = match &k.values {
            Some(v) => Tensor::new(k.ty.shape.clone(), v.clone())?,
            None => Tensor::zeros(&k.ty),
        };
        return Ok(vec![dev.upload(&t, &Owner("node", c.name))?]);
    }
    if op.downcast_ref::<Group>().is_some() {
        return Ok(vec![dev.upload(
            &Tensor::scalar(DType::Bool, 1.0),
            &Owner("node", c.name),
        )?]);
    }
    Err(unsupported(op).unwrap_or_else(|| format!("{} has no CUDA kernel", op.name())))
}

/// One update's operands, checked: `inputs` in an update's order.
struct UpdateOperands<'a> {
    flag: &'a DTensor,
    var: &'a DTensor,
    grad: &'a DTensor,
    grad_scale: Option<&'a DTensor>,
    slots: &'a [DTensor],
    step: Option<&'a DTensor>,
}

impl<'a> UpdateOperands<'a> {
    fn of(u: &OptimizerUpdate, inputs: &'a [DTensor]) -> Result<Self, String> {
        let n_slots = u.rule.slots().len();
        if inputs.len() != u.num_inputs() {
            return Err(format!("expected {} inputs", u.num_inputs()));
        }
        let (flag, var, grad) = (&inputs[0], &inputs[1], &inputs[2]);
        float_only(var.dtype)?;
        float_only(grad.dtype)?;
        let slots = &inputs[3..3 + n_slots];
        if let Some(s) = slots.iter().find(|s| s.dtype != var.dtype) {
            return Err(format!(
                "slots must have the variable's dtype {} on CUDA, got {}",
                var.dtype, s.dtype
            ));
        }
        Ok(UpdateOperands {
            flag,
            var,
            grad,
            grad_scale: u.grad_scale.then(|| &inputs[inputs.len() - 1]),
            slots,
            step: u.rule.uses_step().then(|| &inputs[3 + n_slots]),
        })
    }

    /// The kernels' module for these operands' dtypes: its cache key and source.
    fn module(&self, u: &OptimizerUpdate) -> (String, impl Fn() -> String) {
        let (var, grad, step) = (self.var.dtype, self.grad.dtype, self.step.map(|s| s.dtype));
        let key = format!(
            "optimizer/{var}/{grad}/{}/{step:?}/{:?}/{:?}/{:e}/{:e}",
            u.grad_scale, u.cast_to, u.rule, u.learning_rate, u.weight_decay
        );
        let u = u.clone();
        let make = move || {
            src::optimizer(
                var,
                grad,
                u.grad_scale,
                step,
                u.cast_to,
                u.rule,
                u.learning_rate,
                u.weight_decay,
            )
        };
        (key, make)
    }

    /// The arguments the kernels take before their outputs: flag, var, grad, [grad
    /// scale], slots..., [step].
    fn args(&self) -> Vec<Arg> {
        let mut args = vec![self.flag.arg(), self.var.arg(), self.grad.arg()];
        args.extend(self.grad_scale.map(|s| s.arg()));
        args.extend(self.slots.iter().map(|s| s.arg()));
        args.extend(self.step.map(|s| s.arg()));
        args
    }
}

fn optimizer(
    c: &Ctx,
    u: &OptimizerUpdate,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let operands = UpdateOperands::of(u, inputs)?;
    if outs.len() != u.num_outputs() {
        return Err(format!("expected {} outputs", u.num_outputs()));
    }
    let outputs = outs
        .iter()
        .map(|t| c.alloc(t))
        .collect::<Result<Vec<_>, _>>()?;
    let (var, n, n_slots) = (operands.var, operands.var.len(), u.rule.slots().len());
    let (key, make) = operands.module(u);
    let mut args = operands.args();
    if let Rule::Lamb { .. } = u.rule {
        let acc = acc_dtype(var.dtype);
        let scratch = c.temp(acc, n)?;
        let sums = c.temp(acc, 2)?;
        c.dev.zero(&sums)?;
        args.extend(outputs[1..1 + n_slots].iter().map(|o| o.arg()));
        args.extend([scratch.arg(), sums.arg(), Arg::I64(n as i64)]);
        let grid = n.div_ceil(256).clamp(1, 1024) as u32;
        c.dev.launch(&key, &make, "k", grid, 256, &args)?;
        // The variable's outputs: itself, then its cast if any (the slots came above).
        let mut apply = vec![operands.flag.arg(), var.arg(), scratch.arg(), sums.arg()];
        apply.extend(
            std::iter::once(&outputs[0])
                .chain(&outputs[1 + n_slots..])
                .map(|o| o.arg()),
        );
        apply.push(Arg::I64(n as i64));
        c.dev.launch(
            &key,
            make,
            "k_apply",
            n.div_ceil(256).clamp(1, 1 << 20) as u32,
            256,
            &apply,
        )?;
        return Ok(outputs);
    }
    args.extend(outputs.iter().map(|o| o.arg()));
    args.push(Arg::I64(n as i64));
    c.dev.launch_elementwise(&key, make, n, &args)?;
    Ok(outputs)
}

/// A GroupedOptimizerUpdate: [`src::GROUP_MEMBERS`] members a launch of `k_group`,
/// a block each, their pointers in a by-value table. Every member has the first's
/// dtypes (the `group-updates` pass groups only such updates).
fn grouped_optimizer(
    c: &Ctx,
    g: &GroupedOptimizerUpdate,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let u = &g.update;
    if let Rule::Lamb { .. } = u.rule {
        return Err("LAMB updates are not grouped: each needs its own variable's norms".into());
    }
    let (n_in, n_out) = (u.num_inputs(), u.num_outputs());
    if inputs.len() != g.members * n_in || outs.len() != g.members * n_out {
        return Err(format!(
            "expected {} inputs and {} outputs",
            g.members * n_in,
            g.members * n_out
        ));
    }
    let outputs = outs
        .iter()
        .map(|t| c.alloc(t))
        .collect::<Result<Vec<_>, _>>()?;
    let members = inputs
        .chunks(n_in)
        .map(|member| UpdateOperands::of(u, member))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = members.first() else {
        return Ok(outputs);
    };
    let dtypes = |m: &[DTensor]| m.iter().map(|t| t.dtype).collect::<Vec<_>>();
    let first_dtypes = dtypes(&inputs[..n_in]);
    if let Some(k) = inputs.chunks(n_in).position(|m| dtypes(m) != first_dtypes) {
        return Err(format!("member {k}'s dtypes differ from member 0's"));
    }
    let (key, make) = first.module(u);
    let rows: Vec<(&UpdateOperands, &[DTensor])> =
        members.iter().zip(outputs.chunks(n_out)).collect();
    for chunk in rows.chunks(src::GROUP_MEMBERS) {
        let mut table = UpdateTable::default();
        for (row, (operands, outs)) in chunk.iter().enumerate() {
            let mut args = operands.args();
            args.extend(outs.iter().map(|o| o.arg()));
            table.set(row, &args, operands.var.len())?;
        }
        c.dev.launch(
            &key,
            &make,
            "k_group",
            chunk.len() as u32,
            256,
            &[Arg::Table(Box::new(table))],
        )?;
    }
    Ok(outputs)
}
