//! Batch normalisation: BatchNorm in training (batch statistics; the batch mean and
//! Bessel-corrected variance as outputs, which the graph's running averages read) and
//! inference, and BatchNormGrad in both forms (the inference form channels-last only:
//! the synchronised batch norm's, whose statistics come from all replicas).
//!
//! Channels-last tensors (NHWC images, `[N, C]` matrices) are a `[rows, C]` matrix:
//! the statistics are column sums (`codegen::column_sums`, deterministic), then one
//! elementwise pass applies them — three launches each way. cuDNN's NHWC batch norm
//! took 7 ms forward and 17 ms backward on a `[256, 64, 64, 64]` f16 batch on the H100,
//! a hundred times these. NCHW images go to cuDNN (`crate::cuda::dnn`).

use ampgraph_graph::ops::{BatchNorm, BatchNormGrad, DataFormat, NormActivation, UnaryKind};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    column_sums, column_sums_words, column_vector, elementwise_from_end, module_multi, own, store,
    vector_len, At, Load, FIN_WARPS,
};
use super::elementwise::Spec as ElementwiseSpec;
use super::{
    acc_dtype, float_input, input, kernel, launch_column_partials, launch_column_sums, Ctx,
    KernelResult, Lowering, Partials,
};
use crate::cuda::device::{Arg, DTensor};
use crate::cuda::dnn;

kernel_specs! {
    /// The modules of the family, by the dtypes of `x` and of the statistics.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "batch_norm" {
        /// `k_cols_part(const T* px, AU* part, i64 rows, i64 len, i64 chunk_rows)` (sums
        /// of x and x^2 shifted by row 0), `k_stats(const AU* part, const T* px, const
        /// TU* pscale, const TU* poffset, TU* pmean, TU* pvar, AU* pab, i64 len, i64
        /// chunks, i64 rows, double eps)`, `k_affine(const TU* pscale, const TU*
        /// poffset, const TU* pmean, const TU* pvar, AU* pab, i64 len, double eps)`,
        /// `k(const T* px, const AU* pa, const AU* pb, T* py, i64 n, i64 len)`.
        /// With `relu`, `k` stores the ReLU of the normalised values; with `side`, it
        /// takes `const T* ps` after `pb` and adds it to them (rounded to T first, as
        /// the CPU) before the ReLU; with `vectors` (`len` a multiple of its vectors),
        /// `k` reads `a` and `b` as vectors too.
        Forward { x: DType, u: DType, relu: bool, side: bool, vectors: bool } => forward(x, u, relu, side, vectors),
        /// `k_cols_part(const T* px, const T* pdy, const TU* pmean, const TU* pvar,
        /// double unbias, double eps, AU* part, i64 rows, i64 len, i64 chunk_rows)` and
        /// `k_cols_fin` (sum dy, sum dy * xhat), `k_coef(const TU* pscale, const TU*
        /// pmean, const TU* pvar, const TU* pdoff, const TU* pdscale, AU* pc, i64 len,
        /// double unbias, double eps, double inv_n)` (dx's per-channel coefficients)
        /// and `k(const T* px, const T* pdy, const AU* pc, T* pdx, i64 n, i64 len)`.
        /// With `relu`, the column sums also read `const TU* pscale, const TU* poffset`
        /// after `pvar`, `k_coef` `const TU* poffset` after `pdscale` (a fifth row of
        /// coefficients) and `k` that row after `pc_c`: dy counts as 0 where the
        /// forward's pre-activation is not positive. `vectors` as in `Forward`.
        Backward { x: DType, u: DType, relu: bool, vectors: bool } => backward(x, u, relu, vectors),
        /// `k(const T* px, const T* pdy, const TU* pscale, const TU* poffset, const TU*
        /// pmean, const TU* pvar, T* pg, i64 n, i64 inner, i64 len, double unbias,
        /// double eps)`: the ReLU's gradient of an NCHW batch norm (`inner` = H * W).
        ReluMask { x: DType, u: DType } => relu_mask(x, u),
    }
}

/// cuDNN's smallest epsilon (`CUDNN_BN_MIN_EPSILON`).
const MIN_EPSILON: f64 = 1e-5;

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(bn) = op.downcast_ref::<BatchNorm>() {
        return Some(lower_batch_norm(bn, ins, outs));
    }
    if let Some(g) = op.downcast_ref::<BatchNormGrad>() {
        return Some(lower_batch_norm_grad(g, ins, outs));
    }
    None
}

/// `[n, c, h, w]` and the layout cuDNN reads `x` of `shape` in (a matrix is NCHW with
/// 1x1 images), after checking what cuDNN takes.
fn geometry(
    layout: DataFormat,
    epsilon: f64,
    training: bool,
    ins: &[TensorType],
) -> Result<(DataFormat, [usize; 4]), String> {
    dnn::available()?;
    float_input(ins)?;
    if epsilon < MIN_EPSILON {
        return Err(format!(
            "cuDNN's batch norm takes epsilon >= {MIN_EPSILON:e}, got {epsilon:e}"
        ));
    }
    let (layout, nchw) = match (&ins[0].shape[..], layout) {
        (&[n, c], _) => (DataFormat::Nchw, [n, c, 1, 1]),
        (&[n, h, w, c], DataFormat::Nhwc) => (layout, [n, c, h, w]),
        (&[n, c, h, w], DataFormat::Nchw) => (layout, [n, c, h, w]),
        (s, _) => return Err(format!("batch norm takes rank 2 or 4, got {s:?}")),
    };
    let count = nchw[0] * nchw[2] * nchw[3];
    if training && count < 2 {
        return Err(format!(
            "a training batch norm over {count} value per channel has no variance"
        ));
    }
    Ok((layout, nchw))
}

/// Whether the per-channel values of a channels-last pass over `x` with `len`
/// channels are read as vectors: one row offset per vector rather than one 64-bit
/// remainder per element, which kept the passes well below the memory's bandwidth.
fn channel_vectors(x: DType, len: usize) -> bool {
    len % vector_len(x.size_bytes()) == 0
}

/// Whether the statistics are column sums of a `[rows, C]` matrix (channels last).
fn channels_last(layout: DataFormat, nchw: [usize; 4]) -> bool {
    layout == DataFormat::Nhwc || nchw[2] * nchw[3] == 1
}

fn lower_batch_norm(bn: &BatchNorm, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let (layout, nchw) = geometry(bn.data_format, bn.epsilon, bn.training, ins)?;
    let (epsilon, training) = (bn.epsilon, bn.training);
    let [y_ty, mean_ty, var_ty] = outs else {
        return Err("BatchNorm has three outputs".into());
    };
    let (y_ty, mean_ty, var_ty) = (y_ty.clone(), mean_ty.clone(), var_ty.clone());
    let relu = bn.activation == NormActivation::Relu;
    let side = ins.len() > 5;
    let (rows, len) = (nchw[0] * nchw[2] * nchw[3], nchw[1]);
    let own = channels_last(layout, nchw).then_some(Spec::Forward {
        x: y_ty.dtype,
        u: mean_ty.dtype,
        relu,
        side,
        vectors: channel_vectors(y_ty.dtype, len),
    });
    if side && own.is_none() {
        return Err(
            "a batch norm with a side input runs on channels-last images (NHWC) \
             on CUDA; run the layout-nhwc pass first"
                .into(),
        );
    }
    Ok(kernel(move |c, inputs| {
        let x = input(inputs, 0)?;
        let params = [input(inputs, 1)?, input(inputs, 2)?];
        let y = c.alloc(&y_ty)?;
        let (mean, var) = if training {
            (c.alloc(&mean_ty)?, c.alloc(&var_ty)?)
        } else {
            // The given statistics pass through as outputs 1 and 2.
            (input(inputs, 3)?.clone(), input(inputs, 4)?.clone())
        };
        match &own {
            Some(spec) => {
                let stats = [&mean, &var];
                let ab = if training {
                    batch_statistics(c, spec, x, params, stats, (rows, len), epsilon)?
                } else {
                    affine(c, spec, params, stats, len, epsilon)?
                };
                let side = if side { Some(input(inputs, 5)?) } else { None };
                apply(c, spec, [x, &ab, &y], side, len)?;
            }
            None => {
                c.dnn.batch_norm(
                    c.dev,
                    layout,
                    nchw,
                    epsilon,
                    training,
                    x,
                    params,
                    [&mean, &var],
                    &y,
                )?;
                if relu {
                    // The Relu op's kernel, in place: each element is read before it
                    // is written.
                    let spec = ElementwiseSpec::Unary {
                        dtype: y.dtype,
                        kind: UnaryKind::Relu,
                    };
                    let args = [y.arg(), y.arg(), Arg::I64(y.len() as i64)];
                    c.launch_elementwise(&spec, y.len(), &args)?;
                }
            }
        }
        Ok(vec![y, mean, var])
    }))
}

/// The batch's mean and Bessel-corrected variance into `stats`, and the per-channel
/// `a = scale / sqrt(var + eps)` and `b = offset - mean * a` (returned, `[2, len]`).
fn batch_statistics(
    c: &Ctx,
    spec: &Spec,
    x: &DTensor,
    [scale, offset]: [&DTensor; 2],
    [mean, var]: [&DTensor; 2],
    (rows, len): (usize, usize),
    epsilon: f64,
) -> Result<DTensor, String> {
    let acc = acc_dtype(mean.dtype);
    let (part, chunks) = launch_column_partials(
        c,
        spec,
        &[x.arg()],
        (rows, len),
        (acc, 2),
        Partials::for_rows(len, x.dtype, &[x]),
    )?;
    let ab = c.temp(acc, 2 * len)?;
    let args = [
        part.arg(),
        x.arg(),
        scale.arg(),
        offset.arg(),
        mean.arg(),
        var.arg(),
        ab.arg(),
        Arg::I64(len as i64),
        Arg::I64(chunks as i64),
        Arg::I64(rows as i64),
        Arg::F64(epsilon),
    ];
    let threads = FIN_WARPS as u32 * 32;
    c.launch(spec, "k_stats", (len.div_ceil(32) as u32, threads), &args)?;
    Ok(ab)
}

/// `a` and `b` (as [`batch_statistics`]) from given statistics.
fn affine(
    c: &Ctx,
    spec: &Spec,
    [scale, offset]: [&DTensor; 2],
    [mean, var]: [&DTensor; 2],
    len: usize,
    epsilon: f64,
) -> Result<DTensor, String> {
    let ab = c.temp(acc_dtype(mean.dtype), 2 * len)?;
    let args = [
        scale.arg(),
        offset.arg(),
        mean.arg(),
        var.arg(),
        ab.arg(),
        Arg::I64(len as i64),
        Arg::F64(epsilon),
    ];
    c.launch(spec, "k_affine", (len.div_ceil(256) as u32, 256), &args)?;
    Ok(ab)
}

/// `y = x * a + b` per channel (`+ side` where there is one).
fn apply(
    c: &Ctx,
    spec: &Spec,
    [x, ab, y]: [&DTensor; 3],
    side: Option<&DTensor>,
    len: usize,
) -> Result<(), String> {
    let n = x.len();
    let mut args = vec![x.arg(), channel_row(ab, 0, len), channel_row(ab, 1, len)];
    args.extend(side.map(DTensor::arg));
    args.extend([y.arg(), Arg::I64(n as i64), Arg::I64(len as i64)]);
    c.launch_elementwise(spec, n, &args)
}

/// Row `k` of a `[rows, len]` table of per-channel values (`a` and `b`, dx's
/// coefficients), as a kernel's pointer argument.
fn channel_row(table: &DTensor, k: usize, len: usize) -> Arg {
    Arg::Ptr(table.ptr() + (k * len * table.dtype.size_bytes()) as u64)
}

/// The per-channel values of a channels-last elementwise pass, read as `name` from
/// `ptr` of type `ty` with `loader`: a vector of them per vector of the pass with
/// `vectors`.
fn per_channel<'a>(
    (ty, loader): (&'a str, &'a str),
    name: &'a str,
    ptr: &'a str,
    bytes: usize,
    vectors: bool,
) -> Load<'a> {
    Load {
        ty,
        name,
        loader,
        ptr,
        bytes,
        at: if vectors {
            At::Rows("i % len", "i0 % len")
        } else {
            At::Gather("i % len")
        },
    }
}

pub(super) fn forward(x: DType, u: DType, relu: bool, side: bool, vectors: bool) -> String {
    let ab = acc_dtype(u).size_bytes();
    // The side input adds to the normalised values as stored in T, as the Add it
    // replaces read them.
    let pre = if side {
        "(AU)rounded((AU)x * a + b) + (AU)s"
    } else {
        "(AU)x * a + b"
    };
    let normalised = if relu {
        format!("(C)m_max({pre}, (AU)0)")
    } else {
        format!("(C)({pre})")
    };
    let mut loads = vec![
        own(x, "x", "px"),
        per_channel(("AU", "ldA"), "a", "pa", ab, vectors),
        per_channel(("AU", "ldA"), "b", "pb", ab, vectors),
    ];
    if side {
        loads.push(own(x, "s", "ps"));
    }
    let side_param = if side { "const T* ps, " } else { "" };
    let apply = elementwise_from_end(&loads, "", &[store(x, "py", &normalised)]);
    // Sums of x and x^2 shifted by row 0 (no cancellation for a large mean).
    let sums = column_sums(
        "const T* px",
        "AU v = (AU)ld(px, at) - (AU)ld(px, j);",
        &["v", "v * v"],
        "U",
    );
    let word_sums = column_sums_words(
        "const T* px",
        &[("px", "x")],
        (
            "AU x0[V]; for (int e = 0; e < V; ++e) x0[e] = (AU)ld(px, j0 + e);",
            "AU v = (AU)ld(x, e) - x0[e];",
        ),
        &["v", "v * v"],
        ("U", column_vector(x)),
    );
    module_multi(
        &[("", x), ("U", u)],
        &format!(
            "__device__ __forceinline__ AU ldA(const AU* p, i64 i) {{ return p[i]; }}
             __device__ __forceinline__ C rounded(AU v) {{ T t; st(&t, 0, (C)v); return ld(&t, 0); }}
             {sums}{word_sums}\
             extern \"C\" __global__ void k_stats(const AU* part, const T* px, const TU* pscale, const TU* poffset, TU* pmean, TU* pvar, AU* pab, i64 len, i64 chunks, i64 rows, double eps) {{\n\
               __shared__ AU sh[2][{FIN_WARPS}][33];\n\
               int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
               i64 j = (i64)blockIdx.x * 32 + tx;\n\
               AU s = 0, q = 0;\n\
               if (j < len) for (i64 c = ty; c < chunks; c += {FIN_WARPS}) {{ s += part[(c * 2) * len + j]; q += part[(c * 2 + 1) * len + j]; }}\n\
               sh[0][ty][tx] = s; sh[1][ty][tx] = q;\n\
               __syncthreads();\n\
               if (ty == 0 && j < len) {{\n\
                 for (int w = 1; w < {FIN_WARPS}; ++w) {{ s += sh[0][w][tx]; q += sh[1][w][tx]; }}\n\
                 AU n = (AU)rows, d = s / n, var = q / n - d * d;\n\
                 if (var < 0) var = 0;\n\
                 AU mean = (AU)ld(px, j) + d;\n\
                 stU(pmean, j, (CU)mean); stU(pvar, j, (CU)(var * n / (n - 1)));\n\
                 AU a = (AU)ldU(pscale, j) / sqrt(var + (AU)eps);\n\
                 pab[j] = a; pab[len + j] = (AU)ldU(poffset, j) - mean * a;\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_affine(const TU* pscale, const TU* poffset, const TU* pmean, const TU* pvar, AU* pab, i64 len, double eps) {{\n\
               GRID_LOOP(j, len) {{\n\
                 AU a = (AU)ldU(pscale, j) / sqrt((AU)ldU(pvar, j) + (AU)eps);\n\
                 pab[j] = a; pab[len + j] = (AU)ldU(poffset, j) - (AU)ldU(pmean, j) * a;\n\
               }}\n}}\n\
             extern \"C\" __global__ void k(const T* px, const AU* pa, const AU* pb, {side_param}T* py, i64 n, i64 len) {{\n{apply}}}\n"
        ),
    )
}

pub(super) fn backward(x: DType, u: DType, relu: bool, vectors: bool) -> String {
    let coef = acc_dtype(u).size_bytes();
    // With the ReLU, dy counts where the forward's pre-activation `(x - m) * a + offset`
    // (`a = scale * inv`, as `k_coef` computes it) is positive.
    let (relu_params, tile_dy, word_setup, word_dy, masked) = if relu {
        (
            ", const TU* pscale, const TU* poffset",
            "AU g = d * ((AU)ldU(pscale, j) * inv) + (AU)ldU(poffset, j) > (AU)0 ? (AU)ld(pdy, at) : (AU)0;",
            "AU sa[V], off[V];\n\
             for (int e = 0; e < V; ++e) { sa[e] = (AU)ldU(pscale, j0 + e) * inv[e]; off[e] = (AU)ldU(poffset, j0 + e); }",
            "AU g = d * sa[e] + off[e] > (AU)0 ? (AU)ld(dy, e) : (AU)0;",
            "AU g0 = ((AU)x - cm) * ca + co > (AU)0 ? (AU)dy : (AU)0;",
        )
    } else {
        (
            "",
            "AU g = (AU)ld(pdy, at);",
            "",
            "AU g = (AU)ld(dy, e);",
            "AU g0 = (AU)dy;",
        )
    };
    // dx = scale * inv * (g - (doff + xhat * dscale) / n) with xhat = (x - m) * inv,
    // as A g + B (x - m) + C with per-channel A, B, m and C (`k_coef`): no square
    // root or division per element.
    let ld = ("AU", "ldA");
    let mut streams = vec![
        own(x, "x", "px"),
        own(x, "dy", "pdy"),
        per_channel(ld, "ca", "pc", coef, vectors),
        per_channel(ld, "cb", "pc_b", coef, vectors),
        per_channel(ld, "cm", "pc_m", coef, vectors),
        per_channel(ld, "cc", "pc_c", coef, vectors),
    ];
    if relu {
        streams.push(per_channel(ld, "co", "pc_o", coef, vectors));
    }
    let dx = elementwise_from_end(
        &streams,
        masked,
        &[store(x, "pdx", "(C)(ca * g0 + cb * ((AU)x - cm) + cc)")],
    );
    let params = format!(
        "const T* px, const T* pdy, const TU* pmean, const TU* pvar{relu_params}, double unbias, double eps"
    );
    let sums = column_sums(
        &params,
        &format!(
            "AU d = (AU)ld(px, at) - (AU)ldU(pmean, j);\n\
             AU inv = (AU)1 / sqrt((AU)ldU(pvar, j) * (AU)unbias + (AU)eps);\n\
             AU xh = d * inv;\n\
             {tile_dy}"
        ),
        &["g", "g * xh"],
        "U",
    );
    let word_sums = column_sums_words(
        &params,
        &[("px", "x"), ("pdy", "dy")],
        (
            &format!(
                "AU m[V], inv[V];\n\
                 for (int e = 0; e < V; ++e) {{ m[e] = (AU)ldU(pmean, j0 + e); inv[e] = (AU)1 / sqrt((AU)ldU(pvar, j0 + e) * (AU)unbias + (AU)eps); }}\n\
                 {word_setup}"
            ),
            &format!("AU d = (AU)ld(x, e) - m[e]; AU xh = d * inv[e]; {word_dy}"),
        ),
        &["g", "g * xh"],
        ("U", column_vector(x)),
    );
    let (offset_param, offset_row, offset_arg) = if relu {
        (
            ", const TU* poffset",
            "pc[4 * len + j] = (AU)ldU(poffset, j);",
            ", const AU* pc_o",
        )
    } else {
        ("", "", "")
    };
    module_multi(
        &[("", x), ("U", u)],
        &format!(
            "__device__ __forceinline__ AU ldA(const AU* p, i64 i) {{ return p[i]; }}
             {sums}{word_sums}\
             extern \"C\" __global__ void k_coef(const TU* pscale, const TU* pmean, const TU* pvar, const TU* pdoff, const TU* pdscale{offset_param}, AU* pc, i64 len, double unbias, double eps, double inv_n) {{\n\
               GRID_LOOP(j, len) {{\n\
                 AU inv = (AU)1 / sqrt((AU)ldU(pvar, j) * (AU)unbias + (AU)eps);\n\
                 AU a = (AU)ldU(pscale, j) * inv;\n\
                 pc[j] = a;\n\
                 pc[len + j] = -a * (AU)inv_n * (AU)ldU(pdscale, j) * inv;\n\
                 pc[2 * len + j] = (AU)ldU(pmean, j);\n\
                 pc[3 * len + j] = -a * (AU)inv_n * (AU)ldU(pdoff, j);\n\
                 {offset_row}\n\
               }}\n}}\n\
             extern \"C\" __global__ void k(const T* px, const T* pdy, const AU* pc, const AU* pc_b, const AU* pc_m, const AU* pc_c{offset_arg}, T* pdx, i64 n, i64 len) {{\n{dx}}}\n"
        ),
    )
}

/// The ReLU's gradient of an NCHW batch norm before cuDNN's gradient: `dy` where the
/// pre-activation recomputed from `x` (as `backward`'s kernels do) is positive.
pub(super) fn relu_mask(x: DType, u: DType) -> String {
    module_multi(
        &[("", x), ("U", u)],
        "extern \"C\" __global__ void k(const T* px, const T* pdy, const TU* pscale, const TU* poffset, const TU* pmean, const TU* pvar, T* pg, i64 n, i64 inner, i64 len, double unbias, double eps) {\n\
           GRID_LOOP(i, n) {\n\
             i64 j = (i / inner) % len;\n\
             AU inv = (AU)1 / sqrt((AU)ldU(pvar, j) * (AU)unbias + (AU)eps);\n\
             AU z = ((AU)ld(px, i) - (AU)ldU(pmean, j)) * ((AU)ldU(pscale, j) * inv) + (AU)ldU(poffset, j);\n\
             st(pg, i, z > (AU)0 ? (C)ld(pdy, i) : (C)0);\n\
           }\n}\n",
    )
}

fn lower_batch_norm_grad(
    g: &BatchNormGrad,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let (layout, nchw) = geometry(g.data_format, g.epsilon, g.training, ins)?;
    if !g.training && !channels_last(layout, nchw) {
        return Err("BatchNormGrad of an inference-form batch norm on NCHW images has no CUDA kernel (channels-last only)".into());
    }
    let (epsilon, training) = (g.epsilon, g.training);
    let outs = outs.to_vec();
    let relu = g.activation == NormActivation::Relu;
    let (rows, len) = (nchw[0] * nchw[2] * nchw[3], nchw[1]);
    let own = channels_last(layout, nchw).then_some(Spec::Backward {
        x: outs[0].dtype,
        u: outs[1].dtype,
        relu,
        vectors: channel_vectors(outs[0].dtype, len),
    });
    Ok(kernel(move |c, inputs| {
        let (x, scale, dy) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 4)?);
        let (mean, var) = (input(inputs, 2)?, input(inputs, 3)?);
        // The forward's offset, with which the kernels recompute the ReLU's mask.
        let offset = relu.then(|| input(inputs, 5)).transpose()?;
        let [dx, dscale, doffset]: [_; 3] = c
            .alloc_all(&outs)?
            .try_into()
            .map_err(|_| "BatchNormGrad has three outputs")?;
        // In training `var` is the batch's Bessel-corrected variance (undone here) and
        // dx takes the batch means of dy and dy * xhat; in the inference form `var` is
        // the given variance and dx = a * dy: the same kernels with 1 / n = 0.
        let n = rows as f64;
        let (unbias, inv_n) = match training {
            true => ((n - 1.0) / n, 1.0 / n),
            false => (1.0, 0.0),
        };
        match &own {
            Some(spec) => {
                let relu_args = offset.iter().flat_map(|o| [scale.arg(), o.arg()]);
                let stats: Vec<Arg> = [x.arg(), dy.arg(), mean.arg(), var.arg()]
                    .into_iter()
                    .chain(relu_args)
                    .chain([Arg::F64(unbias), Arg::F64(epsilon)])
                    .collect();
                let outs = [(&doffset, 1.0), (&dscale, 1.0)];
                let partials = Partials::for_rows(len, x.dtype, &[x, dy]);
                launch_column_sums(c, spec, &stats, (rows, len), &outs, partials)?;
                let rows_of_coef = 4 + usize::from(relu);
                let coef = c.temp(acc_dtype(mean.dtype), rows_of_coef * len)?;
                let args: Vec<Arg> = [scale, mean, var, &doffset, &dscale]
                    .into_iter()
                    .chain(offset)
                    .map(|t| t.arg())
                    .chain([
                        coef.arg(),
                        Arg::I64(len as i64),
                        Arg::F64(unbias),
                        Arg::F64(epsilon),
                        Arg::F64(inv_n),
                    ])
                    .collect();
                c.launch(spec, "k_coef", (len.div_ceil(256) as u32, 256), &args)?;
                let args: Vec<Arg> = [x.arg(), dy.arg()]
                    .into_iter()
                    .chain((0..rows_of_coef).map(|k| channel_row(&coef, k, len)))
                    .chain([dx.arg(), Arg::I64(x.len() as i64), Arg::I64(len as i64)])
                    .collect();
                c.launch_elementwise(spec, x.len(), &args)?;
            }
            None => {
                let masked = match offset {
                    Some(offset) => {
                        let g = c.temp(dy.dtype, dy.len())?;
                        let spec = Spec::ReluMask {
                            x: dy.dtype,
                            u: mean.dtype,
                        };
                        let args = [
                            x.arg(),
                            dy.arg(),
                            scale.arg(),
                            offset.arg(),
                            mean.arg(),
                            var.arg(),
                            g.arg(),
                            Arg::I64(dy.len() as i64),
                            Arg::I64((nchw[2] * nchw[3]) as i64),
                            Arg::I64(len as i64),
                            Arg::F64(unbias),
                            Arg::F64(epsilon),
                        ];
                        c.launch_items(&spec, dy.len(), 1, &args)?;
                        Some(g)
                    }
                    None => None,
                };
                c.dnn.batch_norm_grad(
                    c.dev,
                    layout,
                    nchw,
                    epsilon,
                    [x, scale, masked.as_ref().unwrap_or(dy)],
                    [&dx, &dscale, &doffset],
                )?
            }
        }
        Ok(vec![dx, dscale, doffset])
    }))
}
