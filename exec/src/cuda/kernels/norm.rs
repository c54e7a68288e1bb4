//! LayerNorm over the trailing axes and its gradient (with the epilogue
//! `norm-grad-epilogue` folds in: a residual gradient added, column sums of dx and the
//! residual): a warp per row held in registers for rows of up to
//! [`WARP_ROW_MAX`] values, else a block per row. `LayerNormQuantizeFp8`: the warp
//! kernels' rows cast to FP8 as they are normalised.

use ampgraph_graph::ops::fused::column_sum_dtype;
use ampgraph_graph::ops::{
    LayerNorm, LayerNormGrad, LayerNormGradQuantizeFp8, LayerNormQuantizeFp8, NormGradEpilogue,
    ReduceKind,
};
use ampgraph_graph::shape::normalize_axis;
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    column_sums, column_sums_fin, column_vector, lit, module_multi, warp_load_words, warp_rows,
    WARP_ROW_MAX,
};
use super::fp8::{
    amax_declaration, amax_fold, amax_measure, fp8_module, fp8_pairs, lower_quantize,
    pair_rounding, AMAX_BLOCKS, STATIC_SHARED_BYTES,
};
use super::reduce::reduce_into;
use super::{
    acc_dtype, block_rows, first, float_only, input, kernel, launch_column_sums,
    launch_column_sums_fin, numel, one_output, row_kernel, warp_row_form, Ctx, KernelResult,
    Lowering, Partials,
};
use crate::cuda::device::{Arg, DTensor};

kernel_specs! {
    /// The modules of the family (`per` values a lane in the warp kernels).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Spec in "norm" {
        /// `k` (a block per row), `k_warp`, `k_warp_vec(const TX* px, const T* pg, const
        /// T* pb, TY* py, i64 rows, i64 len)`.
        LayerNorm { types: NormTypes, epsilon: f64, per: usize } => layer_norm(types, epsilon, per),
        /// `k_warp`, `k_warp_vec(const TX* px, const T* pg, const T* pb, const float* ps,
        /// TQ* py, TQ* pt, unsigned* amax, i64 rows, i64 len)`: [`Spec::LayerNorm`]'s
        /// warp rows, each value rounded to `TY` and cast to `TQ` (`to`) as
        /// `QuantizeFp8` casts, `pt` (where not null) the transposed copy.
        LayerNormFp8 { types: NormTypes, epsilon: f64, per: usize, to: DType } => layer_norm_fp8(types, epsilon, per, to),
        /// `k_warp`, `k_warp_vec(const TX* px, const T* pg, const TD* pdy, [const TY* pr,]
        /// TY* pdx, A* stats, A* part, i64 rows, i64 len)`, then `k_cols_fin`.
        GradRows { types: NormTypes, epsilon: f64, per: usize, epilogue: NormGradEpilogue } => layer_norm_grad_rows(types, epsilon, per, epilogue, None),
        /// `k_warp_vec(...[GradRows]'s, const float* ps, TQ* py, TQ* pt, unsigned* amax)`,
        /// then `k_cols_fin`: [`Spec::GradRows`]' word rows, dx also cast to `TQ`
        /// (`to`) as `QuantizeFp8` casts it, with its transposed copy `pt`.
        GradRowsFp8 { types: NormTypes, epsilon: f64, per: usize, epilogue: NormGradEpilogue, to: DType } => layer_norm_grad_rows(types, epsilon, per, epilogue, Some(to)),
        /// `k(const TX* px, const T* pg, const TD* pdy, [const TY* pr,] TY* pdx, A* stats,
        /// i64 rows, i64 len)`, then `k_cols_part` and `k_cols_fin` for dgamma and dbeta.
        GradBlock { types: NormTypes, epsilon: f64, residual: bool } => layer_norm_grad_block(types, epsilon, residual),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(ln) = op.downcast_ref::<LayerNorm>() {
        return Some(lower_layer_norm(ln, ins, outs));
    }
    if let Some(ln) = op.downcast_ref::<LayerNormGrad>() {
        let ln = ln.clone();
        let outs = outs.to_vec();
        if let Err(e) = normalized_rows(ins.first()?, ln.axis) {
            return Some(Err(e));
        }
        return Some(Ok(kernel(move |c, inputs| {
            layer_norm_grad(c, &ln, inputs, &outs)
        })));
    }
    None
}

/// The rows a layer norm over the axes from `axis` on normalises: (rows, values per
/// row).
fn normalized_rows(x: &TensorType, axis: i64) -> Result<(usize, usize), String> {
    float_only(x.dtype)?;
    let axis = normalize_axis(axis, x.shape.len())?;
    let len = numel(&x.shape[axis..]);
    let rows = numel(&x.shape).checked_div(len).unwrap_or(0);
    Ok((rows, len))
}

fn lower_layer_norm(ln: &LayerNorm, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let [x, g, ..] = ins else {
        return Err("LayerNorm takes x, gamma and beta".into());
    };
    let (rows, len) = normalized_rows(x, ln.axis)?;
    let out = first(outs)?;
    let types = NormTypes {
        params: g.dtype,
        x: x.dtype,
        dy: x.dtype,
        y: out.dtype,
    };
    let epsilon = ln.epsilon;
    Ok(one_output(out, move |c, inputs, y| {
        let (x, g, b) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
        let (per, warp) = warp_row_form(len, x.dtype, types.same_words(), &[x, y]);
        row_kernel(
            c,
            &Spec::LayerNorm {
                types,
                epsilon,
                per,
            },
            ("k", warp),
            &[x.arg(), g.arg(), b.arg(), y.arg()],
            (rows, len, None),
        )?;
        Ok(())
    }))
}

/// LayerNormQuantizeFp8: rows of at most [`WARP_ROW_MAX`] values of a matrix whose
/// sides are multiples of 8 (what `norm-into-fp8` folds), a band of 32 rows a block
/// (lowered with the FP8 family's ops, the only ones writing FP8 tensors).
pub(super) fn lower_layer_norm_fp8(
    f: &LayerNormQuantizeFp8,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let [x, g, _, _] = ins else {
        return Err("LayerNormQuantizeFp8 takes x, gamma, beta and the scale".into());
    };
    let (rows, len) = normalized_rows(x, f.norm.axis)?;
    if x.shape.len() != 2 || len > WARP_ROW_MAX || rows % 8 != 0 || len % 8 != 0 {
        return Err(format!(
            "LayerNormQuantizeFp8 on CUDA normalises the rows of a matrix with sides multiples of 8 and at most {WARP_ROW_MAX} columns, not {:?}",
            x.shape
        ));
    }
    let types = NormTypes {
        params: g.dtype,
        x: x.dtype,
        dy: x.dtype,
        y: f.norm.to.unwrap_or(g.dtype),
    };
    let (epsilon, to) = (f.norm.epsilon, f.quantize.to);
    let outs = outs.to_vec();
    if outs.len() != 2 + usize::from(f.quantize.transposed) {
        return Err(
            "LayerNormQuantizeFp8 gives the values, their amax and any transposed copy".into(),
        );
    }
    Ok(kernel(move |c, inputs| {
        let (x, g) = (input(inputs, 0)?, input(inputs, 1)?);
        let (b, s) = (input(inputs, 2)?, input(inputs, 3)?);
        let y = c.alloc(&outs[0])?;
        let amax = c.alloc_zeroed(&outs[1])?;
        let t = outs.get(2).map(|ty| c.alloc(ty)).transpose()?;
        if rows > 0 {
            // The LayerNorm kernel's form, so the values are its own bit for bit.
            let (per, warp) = warp_row_form(len, x.dtype, types.same_words(), &[x]);
            let spec = Spec::LayerNormFp8 {
                types,
                epsilon,
                per,
                to,
            };
            let grid = rows.div_ceil(FP8_BAND).min(AMAX_BLOCKS as usize) as u32;
            let args = [
                x.arg(),
                g.arg(),
                b.arg(),
                s.arg(),
                y.arg(),
                t.as_ref().map_or(Arg::Ptr(0), |t| t.arg()),
                amax.arg(),
                Arg::I64(rows as i64),
                Arg::I64(len as i64),
            ];
            c.launch(&spec, warp, (grid, 256), &args)?;
        }
        Ok([y, amax].into_iter().chain(t).collect())
    }))
}

/// LayerNormGrad and its epilogue. Rows of at most [`WARP_ROW_MAX`] values: a
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
    let (x, g, dy) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
    let epi = ln.epilogue;
    let residual = if epi.residual {
        Some(input(inputs, 3)?)
    } else {
        None
    };
    let (rows, len) = normalized_rows(&x.ty(), ln.axis)?;
    let out = c.alloc_all(outs)?;
    let [dx, dg, db, sums @ ..] = &out[..] else {
        return Err("LayerNormGrad has three outputs".into());
    };
    let types = NormTypes {
        params: g.dtype,
        x: x.dtype,
        dy: dy.dtype,
        y: dx.dtype,
    };
    let mut tensors = vec![x.arg(), g.arg(), dy.arg()];
    tensors.extend(residual.map(DTensor::arg));
    tensors.push(dx.arg());
    let epsilon = ln.epsilon;
    // The summed columns are the normalised rows' values (the last axis normalised).
    let columns_are_rows = x.shape.last() == Some(&len);
    if rows > 0 && len > 0 && len <= WARP_ROW_MAX {
        let mut checked = vec![x, dy, dx];
        checked.extend(residual);
        let (per, warp) = warp_row_form(len, x.dtype, types.same_words(), &checked);
        // The kernels take the epilogue's sums where their columns are the rows'.
        let in_rows = NormGradEpilogue {
            sum_dx: epi.sum_dx && columns_are_rows,
            sum_residual: epi.sum_residual && columns_are_rows,
            ..epi
        };
        let spec = Spec::GradRows {
            types,
            epsilon,
            per,
            epilogue: in_rows,
        };
        // A wave of blocks of at least 32 rows: few partials for `k_cols_fin`.
        let blocks = c
            .resident_blocks(&spec, warp, 256)?
            .min(rows.div_ceil(32).min(1 << 20) as u32);
        let mut outputs = vec![(dg, 1.0), (db, 1.0)];
        if columns_are_rows {
            outputs.extend(sums.iter().map(|s| (s, 1.0)));
        }
        let launch = (warp, blocks);
        launch_grad_rows(c, &spec, launch, (tensors, vec![]), (rows, len), &outputs)?;
        if columns_are_rows {
            return Ok(out);
        }
    } else {
        let spec = Spec::GradBlock {
            types,
            epsilon,
            residual: epi.residual,
        };
        let stats = c.temp(acc_dtype(g.dtype), 2 * rows)?;
        let mut args = tensors;
        args.push(stats.arg());
        block_rows(c, &spec, "k", &args, (rows, len))?;
        // With no rows this writes dgamma's and dbeta's zeros.
        if len > 0 {
            launch_column_sums(
                c,
                &spec,
                &[x.arg(), dy.arg(), stats.arg()],
                (rows, len),
                &[(dg, 1.0), (db, 1.0)],
                Partials::Tiles,
            )?;
        }
    }
    for (t, sum) in epi.summed(dx, residual).into_iter().zip(sums) {
        let leading: Vec<usize> = (0..t.shape.len().saturating_sub(1)).collect();
        reduce_into(c, t, sum, ReduceKind::Sum, &leading)?;
    }
    Ok(out)
}

/// Launches the row kernel `name` of a [`layer_norm_grad_rows`] module on `blocks`
/// blocks: its pointers through dx (`tensors`), the rows' statistics and the blocks'
/// partial column sums it writes, `rows`, `len`, then `extra` (an FP8 cast's); then
/// `k_cols_fin` adds the partials into `outputs` (dgamma, dbeta, the sums), in
/// dgamma's compute type.
fn launch_grad_rows(
    c: &Ctx,
    spec: &Spec,
    (name, blocks): (&'static str, u32),
    (tensors, extra): (Vec<Arg>, Vec<Arg>),
    (rows, len): (usize, usize),
    outputs: &[(&DTensor, f64)],
) -> Result<(), String> {
    let acc = acc_dtype(outputs.first().ok_or("no dgamma")?.0.dtype);
    let stats = c.temp(acc, 2 * rows)?;
    let part = c.temp(acc, blocks as usize * outputs.len() * len)?;
    let mut args = tensors;
    args.extend([
        stats.arg(),
        part.arg(),
        Arg::I64(rows as i64),
        Arg::I64(len as i64),
    ]);
    args.extend(extra);
    c.launch(spec, name, (blocks, 256), &args)?;
    launch_column_sums_fin(c, spec, &part, len, blocks as usize, outputs)
}

/// LayerNormGradQuantizeFp8: [`layer_norm_grad`]'s word rows (`k_warp_vec` of
/// [`Spec::GradRowsFp8`]) casting dx as they store it, where the kernel takes the rows
/// (16-byte words, the band beside the column pass in shared memory; the pass folds
/// only matrices with sides multiples of 8 and a transposed cast); otherwise the
/// gradient's kernels, then the cast's.
pub(super) fn lower_layer_norm_grad_fp8(
    f: &LayerNormGradQuantizeFp8,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    const INPUTS: &str = "LayerNormGradQuantizeFp8 takes the gradient's inputs and the scale";
    let (scale_ty, grad_ins) = ins.split_last().ok_or(INPUTS)?;
    let x = grad_ins.first().ok_or("LayerNormGradQuantizeFp8 takes x")?;
    let (rows, len) = normalized_rows(x, f.grad.axis)?;
    let grad_outs = 3 + f.grad.epilogue.sums();
    if outs.len() != grad_outs + 2 + usize::from(f.quantize.transposed) {
        return Err(
            "LayerNormGradQuantizeFp8 gives the gradient's outputs, then the cast's".into(),
        );
    }
    let (grad, to) = (f.grad.clone(), f.quantize.to);
    let (outs, cast_outs) = (outs[..grad_outs].to_vec(), outs[grad_outs..].to_vec());
    let apart = lower_quantize(
        &f.quantize,
        &[outs[0].clone(), scale_ty.clone()],
        &cast_outs,
    )?;
    let params = grad_ins.get(1).map_or(x.dtype, |g| g.dtype);
    let types = NormTypes {
        params,
        x: x.dtype,
        dy: grad_ins.get(2).map_or(x.dtype, |d| d.dtype),
        y: outs[0].dtype,
    };
    let per = len / 32;
    let v = column_vector(x.dtype);
    // Shared memory: the band, the column pass's sums, staged gamma, the amax fold's.
    let shared = FP8_BAND * (len + 4)
        + 8 * 32 * v * acc_dtype(params).size_bytes()
        + len * params.size_bytes()
        + 128;
    let fused = x.shape.len() == 2
        && f.quantize.transposed
        && len > 0
        && len <= WARP_ROW_MAX
        && rows % 8 == 0
        && len % 8 == 0
        && shared <= STATIC_SHARED_BYTES;
    Ok(kernel(move |c, inputs| {
        let (scale, grad_inputs) = inputs.split_last().ok_or(INPUTS)?;
        let (x, g, dy) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
        let residual = grad
            .epilogue
            .residual
            .then(|| input(inputs, 3))
            .transpose()?;
        let mut checked = vec![x, dy];
        checked.extend(residual);
        let words = fused
            && rows > 0
            && warp_row_form(len, x.dtype, types.same_words(), &checked).1 == "k_warp_vec";
        if !words {
            let mut out = layer_norm_grad(c, &grad, grad_inputs, &outs)?;
            out.extend(apart.launch(c, &[out[0].clone(), scale.clone()])?);
            return Ok(out);
        }
        let out = c.alloc_all(&outs)?;
        let [dx, dg, db, sums @ ..] = &out[..] else {
            return Err("LayerNormGrad has three outputs".into());
        };
        let y = c.alloc(&cast_outs[0])?;
        let amax = c.alloc_zeroed(&cast_outs[1])?;
        let t = c.alloc(&cast_outs[2])?;
        let spec = Spec::GradRowsFp8 {
            types,
            epsilon: grad.epsilon,
            per,
            epilogue: grad.epilogue,
            to,
        };
        // A wave of blocks of at least a band of rows each.
        let blocks = c
            .resident_blocks(&spec, "k_warp_vec", 256)?
            .min(rows.div_ceil(FP8_BAND).min(AMAX_BLOCKS as usize) as u32);
        let mut outputs = vec![(dg, 1.0), (db, 1.0)];
        outputs.extend(sums.iter().map(|s| (s, 1.0)));
        let mut tensors = vec![x.arg(), g.arg(), dy.arg()];
        tensors.extend(residual.map(DTensor::arg));
        tensors.push(dx.arg());
        let cast = vec![scale.arg(), y.arg(), t.arg(), amax.arg()];
        let launch = ("k_warp_vec", blocks);
        launch_grad_rows(c, &spec, launch, (tensors, cast), (rows, len), &outputs)?;
        Ok(out.iter().cloned().chain([y, amax, t]).collect())
    }))
}

/// Mean and 1/sqrt(var + eps) of row `row` of `len` elements (block-wide).
const LN_STATS: &str = r#"
__device__ void ln_stats(const TX* px, i64 row, i64 len, A eps, A* sh, A* mean_out, A* inv_out) {
  A s = 0;
  for (i64 j = threadIdx.x; j < len; j += blockDim.x) s += (A)ldX(px, row * len + j);
  A mean = block_sum(s, sh) / (A)len;
  A v = 0;
  for (i64 j = threadIdx.x; j < len; j += blockDim.x) { A t = (A)ldX(px, row * len + j) - mean; v += t * t; }
  A var = block_sum(v, sh) / (A)len;
  *mean_out = mean;
  *inv_out = (A)1 / m_sqrt(var + eps);
}
"#;

/// Mean and 1/sqrt(var + eps) of the row a warp holds in `v` (`per` values a lane,
/// value `t` at column `lane + 32 t`), both passes in registers. An `exact` row (the
/// word kernels': `32 * per` values) has no padding lanes to leave out of the
/// variance (their test was a sixth of a word kernel's instructions).
fn ln_warp_stats(per: usize, exact: bool) -> String {
    let centred = if exact {
        "A c = v[t] - mean;"
    } else {
        "int j = lane + 32 * t; A c = j < len ? v[t] - mean : (A)0;"
    };
    format!(
        "A s = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) s += v[t];\n\
         A mean = warp_sum(s) / (A)len;\n\
         A q = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ {centred} q += c * c; }}\n\
         A inv = (A)1 / m_sqrt(warp_sum(q) / (A)len + eps);\n"
    )
}

/// Gamma (and beta) copied into shared memory once a block for the word kernels'
/// rows of `width` values, as `(shared, global)` name pairs: a lane reads its
/// parameters a word at a time ([`param_word`]). (Read from global memory a value at
/// a time, a lane's values 32 bytes apart, each load touched eight cache lines:
/// GPT-2's [16384, 768] LayerNorm took 25 us in the step, now 19.)
fn stage_params(width: usize, names: &[(&str, &str)]) -> String {
    let arrays: Vec<String> = names
        .iter()
        .map(|(sh, _)| format!("{sh}[{width}]"))
        .collect();
    let copies: String = names
        .iter()
        .map(|(sh, global)| format!("{sh}[j] = {global}[j]; "))
        .collect();
    format!(
        "__align__(32) __shared__ T {};\n\
         for (int j = threadIdx.x; j < len; j += blockDim.x) {{ {copies}}}\n\
         __syncthreads();\n",
        arrays.join(", ")
    )
}

/// The `v` parameters of a lane's word `w` (columns `(32 w + lane) v` on) from the
/// staged `shared`, as `Vec<T, v> name`.
fn param_word(name: &str, shared: &str, v: usize) -> String {
    format!("const Vec<T, {v}> {name} = *(const Vec<T, {v}>*)&{shared}[(32 * w + lane) * {v}];\n")
}

/// LayerNorm over rows of `len`: `k` gives each row a block (three passes over it);
/// `k_warp` (rows of at most `32 * per` values, [`WARP_ROW_MAX`]) gives each row a
/// warp that reads it once into registers; `k_warp_vec` does so for rows of exactly
/// `32 * per` values, moving 16-byte words.
pub(super) fn layer_norm(types: NormTypes, eps: f64, per: usize) -> String {
    let warp = warp_rows(&format!(
        "A v[{per}];\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; v[t] = j < len ? (A)ldX(px, base + j) : (A)0; }}\n\
         {stats}\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; if (j < len) stY(py, base + j, (CY)((v[t] - mean) * inv * (A)ld(pg, j) + (A)ld(pb, j))); }}",
        stats = ln_warp_stats(per, false)
    ));
    // Rows of exactly 32 * per values in 16-byte words (`k_warp_vec`; x and y of one
    // size).
    let v = column_vector(types.x);
    let warp_vec = warp_rows(&format!(
        "A v[{per}];\n{load}{stats}\
         #pragma unroll\n\
         for (int w = 0; w < {words}; ++w) {{\n\
           {gw}{bw}\
           __align__(16) TY o[{v}];\n\
           #pragma unroll\n\
           for (int q = 0; q < {v}; ++q) stY(o, q, (CY)((v[w * {v} + q] - mean) * inv * (A)ld(gw.v, q) + (A)ld(bw.v, q)));\n\
           *(uint4*)(py + base + (i64)(32 * w + lane) * {v}) = *(const uint4*)o;\n\
         }}\n",
        load = warp_load_words("px", "v", per, v, "X"),
        stats = ln_warp_stats(per, true),
        words = per / v,
        gw = param_word("gw", "gs", v),
        bw = param_word("bw", "bs", v),
    ));
    let params = "const TX* px, const T* pg, const T* pb, TY* py, i64 rows, i64 len";
    module_multi(
        &types.blocks(),
        &format!(
            "{LN_STATS}extern \"C\" __global__ void k({params}) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
                 A mean, inv; ln_stats(px, row, len, (A)(C){eps}, sh, &mean, &inv);\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{\n\
                   i64 at = row * len + j;\n\
                   stY(py, at, (CY)(((A)ldX(px, at) - mean) * inv * (A)ld(pg, j) + (A)ld(pb, j)));\n\
                 }}\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_warp({params}) {{\n\
               const A eps = (A)(C){eps};\n{warp}}}\n\
             extern \"C\" __global__ void {bounds}k_warp_vec({params}) {{\n\
               const A eps = (A)(C){eps};\n{stage}{warp_vec}}}\n",
            eps = lit(eps),
            // Four blocks a multiprocessor where the values fit in 64 registers (GPT-2's
            // [16384, 768] bf16: 23 against 21 us apart).
            bounds = if acc_dtype(types.params) == DType::F64 || per > 24 {
                ""
            } else {
                "__launch_bounds__(256, 4) "
            },
            stage = stage_params(32 * per, &[("gs", "pg"), ("bs", "pb")]),
        ),
    )
}

/// The rows a block of [`layer_norm_fp8`] casts together: its transposed copy's
/// stores are 32 bytes of a column, a whole sector.
const FP8_BAND: usize = 32;

/// LayerNormQuantizeFp8: [`layer_norm`]'s `k_warp` and `k_warp_vec` rows (eight warps
/// of 256 threads, four rows each), each value rounded to the norm's dtype `TY` as it
/// stored it, measured and cast to `TQ` as `QuantizeFp8` casts, and stored from the
/// lane's registers (`k_warp_vec`: 8 bytes a word, converted in pairs). Gamma and
/// beta are staged in shared memory once a block ([`stage_params`]; read per value from
/// global memory, the kernel ran twice as long on GPT-2's [16384, 768]: 45 against 23
/// us apart). Where `pt` is not null the values also go into a band of [`FP8_BAND`]
/// rows in shared memory, which the block then writes transposed ([`band_transpose`]).
pub(super) fn layer_norm_fp8(types: NormTypes, eps: f64, per: usize, to: DType) -> String {
    let width = 32 * per;
    let band_bytes = FP8_BAND * (width + 4);
    // Gamma and beta staged (as T, each read as the plain kernel reads them) where
    // they fit beside the band: f64 parameters of the widest rows do not.
    let staged = band_bytes + 2 * width * types.params.size_bytes() <= STATIC_SHARED_BYTES;
    let (g, b, stage) = if staged {
        (
            "gs",
            "bs",
            stage_params(width, &[("gs", "pg"), ("bs", "pb")]),
        )
    } else {
        ("pg", "pb", String::new())
    };
    // The value of lane index `t` at column `j`, rounded to `TY` and measured, into the
    // float `x` (the statistics' code names its sums `s` and `q`).
    let value = |gamma: &str, beta: &str| {
        format!(
            "TY r[1]; stY(r, 0, (CY)((v[t] - mean) * inv * (A)ld({gamma}) + (A)ld({beta})));\n\
             const float x = (float)ldY(r, 0);\n\
             {}\n",
            amax_measure("m", "x")
        )
    };
    let stats = ln_warp_stats(per, false);
    let scalar = value(&format!("{g}, j"), &format!("{b}, j"));
    let warp = format!(
        "A v[{per}];\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; v[t] = j < len ? (A)ldX(px, base + j) : (A)0; }}\n\
         {stats}\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{\n\
           int j = lane + 32 * t;\n\
           if (j < len) {{\n\
             {scalar}\
             TQ cast[1]; stQ(cast, 0, __fmul_rn(x, scale));\n\
             py[base + j] = cast[0];\n\
             if (pt) band[jr][j] = *(const u8*)cast;\n\
           }}\n\
         }}\n"
    );
    let v = column_vector(types.x);
    let store = fp8_word_store(v);
    // A 16-bit y's values are rounded two at a time, their magnitudes maxed in pairs
    // (`pair_rounding`: one conversion a pair).
    let pairs = pair_rounding(types.y).filter(|_| v % 2 == 0);
    let word = match pairs {
        Some(_) => format!(
            "#pragma unroll\n\
             for (int k = 0; k < {v}; ++k) {{\n\
               const int t = w * {v} + k;\n\
               pre[k] = (float)(CY)((v[t] - mean) * inv * (A)ld(gw.v, k) + (A)ld(bw.v, k));\n\
             }}\n\
             #pragma unroll\n\
             for (int p = 0; p < {v} / 2; ++p) {{\n\
               const u32 pw = round_measure2(pre[2 * p], pre[2 * p + 1], m2);\n\
               scaled[2 * p] = __fmul_rn(lo_of(pw), scale);\n\
               scaled[2 * p + 1] = __fmul_rn(hi_of(pw), scale);\n\
             }}\n"
        ),
        None => format!(
            "#pragma unroll\n\
             for (int k = 0; k < {v}; ++k) {{\n\
               const int t = w * {v} + k;\n\
               {}\
               scaled[k] = __fmul_rn(x, scale);\n\
             }}\n",
            value("gw.v, k", "bw.v, k")
        ),
    };
    let warp_vec = format!(
        "A v[{per}];\n{load}{stats}\
         #pragma unroll\n\
         for (int w = 0; w < {words}; ++w) {{\n\
           const int j0 = (32 * w + lane) * {v};\n\
           const Vec<T, {v}> gw = *(const Vec<T, {v}>*)&{g}[j0], bw = *(const Vec<T, {v}>*)&{b}[j0];\n\
           float scaled[{v}];\n\
           {word}\
           {store}\
         }}\n",
        load = warp_load_words("px", "v", per, v, "X"),
        stats = ln_warp_stats(per, true),
        words = per / v
    );
    // The pairs' amax (and their values before rounding) beside `m`, for k_warp_vec.
    let (pair_declaration, pair_fold) = match pairs {
        Some(_) => (
            format!("u32 m2 = 0u;\nfloat pre[{v}];\n"),
            "m = max(m, pair_amax_bits(m2));\n",
        ),
        None => (String::new(), ""),
    };
    let kernel = |name: &str, row: &str, (pair_declaration, pair_fold): (&str, &str)| {
        format!(
            "extern \"C\" __global__ void __launch_bounds__(256, 4) {name}(const TX* __restrict__ px, const T* __restrict__ pg, const T* __restrict__ pb, const float* __restrict__ ps, TQ* __restrict__ py, TQ* __restrict__ pt, unsigned int* amax, i64 rows, i64 len) {{\n\
               __align__(4) __shared__ u8 band[{FP8_BAND}][{band_width}];\n\
               {stage}\
               const A eps = (A)(C){eps};\n\
               const float scale = ps[0];\n\
               {declaration}{pair_declaration}\
               const int lane = threadIdx.x & 31;\n\
               for (i64 r0 = (i64)blockIdx.x * {FP8_BAND}; r0 < rows; r0 += (i64)gridDim.x * {FP8_BAND}) {{\n\
                 for (int jr = threadIdx.x >> 5; jr < {FP8_BAND}; jr += 8) {{\n\
                   const i64 row = r0 + jr, base = row * len;\n\
                   if (row < rows) {{\n{row}}}\n\
                 }}\n\
                 if (!pt) continue;\n\
                 __syncthreads();\n{transpose}\
                 __syncthreads();\n\
               }}\n{pair_fold}{fold}}}\n",
            band_width = width + 4,
            transpose = band_transpose("rows"),
            eps = lit(eps),
            declaration = amax_declaration("m"),
            fold = amax_fold("m", "amax"),
        )
    };
    let mut blocks = types.blocks().to_vec();
    blocks.push(("Q", to));
    fp8_module(
        &blocks,
        &format!(
            "{}{}{}{}",
            fp8_band_prelude(to),
            pairs.as_deref().unwrap_or(""),
            kernel("k_warp", &warp, ("", "")),
            kernel("k_warp_vec", &warp_vec, (&pair_declaration, pair_fold))
        ),
    )
}

/// The code storing a lane's word of `v` FP8 values (`float scaled[v]`, already
/// scaled) at column `j0` of row `base` of `py`, and where `pt` is set into the band's
/// row `jr`: 4 bytes at a time (2 for f64 rows' words of 2 values).
fn fp8_word_store(v: usize) -> String {
    if v >= 4 {
        format!(
            "#pragma unroll\n\
             for (int k = 0; k < {v} / 4; ++k) {{\n\
               const u32 four = fp8x4(scaled[4 * k], scaled[4 * k + 1], scaled[4 * k + 2], scaled[4 * k + 3]);\n\
               *(u32*)(py + base + j0 + 4 * k) = four;\n\
               if (pt) *(u32*)&band[jr][j0 + 4 * k] = four;\n\
             }}\n"
        )
    } else {
        "const unsigned short two = (unsigned short)fp8x2(scaled[0], scaled[1]);\n\
         *(unsigned short*)(py + base + j0) = two;\n\
         if (pt) *(unsigned short*)&band[jr][j0] = two;\n"
            .to_string()
    }
}

/// The code writing the band of [`FP8_BAND`] rows from row `r0` (rows before `limit`)
/// into the transposed copy `pt` of a `rows`-row matrix: a thread takes 4 columns of
/// 8 rows (8 words), transposes them by `PRMT` and stores 8 bytes of each column (rows
/// and columns multiples of 8). A band row's 4 bytes of padding put the reads of a warp
/// (4 groups of 8 rows, 8 groups of columns) in different banks.
fn band_transpose(limit: &str) -> String {
    let groups = FP8_BAND / 8;
    format!(
        "for (int i = threadIdx.x; i < (int)len * {groups} / 4; i += 256) {{\n\
           const int c = 4 * (i / {groups}), g = 8 * (i % {groups});\n\
           if (r0 + g < {limit}) {{\n\
             u32 w[8];\n\
             #pragma unroll\n\
             for (int k = 0; k < 8; ++k) w[k] = *(const u32*)&band[g + k][c];\n\
             u32 lo[4], hi[4];\n\
             byte_transpose4(w[0], w[1], w[2], w[3], lo);\n\
             byte_transpose4(w[4], w[5], w[6], w[7], hi);\n\
             #pragma unroll\n\
             for (int k = 0; k < 4; ++k) *(uint2*)(pt + (i64)(c + k) * rows + r0 + g) = make_uint2(lo[k], hi[k]);\n\
           }}\n\
         }}\n"
    )
}

/// What a module casting rows to FP8 `to` through a band needs: `u32`, the pair
/// conversions and `byte_transpose4`.
fn fp8_band_prelude(to: DType) -> String {
    format!(
        "typedef unsigned int u32;\n{}\
         // The 4x4 bytes of words w0..w3 (rows) transposed: t[k] holds byte k of each.\n\
         __device__ __forceinline__ void byte_transpose4(u32 w0, u32 w1, u32 w2, u32 w3, u32* t) {{\n\
           const u32 a = __byte_perm(w0, w1, 0x5140), b = __byte_perm(w0, w1, 0x7362);\n\
           const u32 c = __byte_perm(w2, w3, 0x5140), d = __byte_perm(w2, w3, 0x7362);\n\
           t[0] = __byte_perm(a, c, 0x5410); t[1] = __byte_perm(a, c, 0x7632);\n\
           t[2] = __byte_perm(b, d, 0x5410); t[3] = __byte_perm(b, d, 0x7632);\n\
         }}\n",
        fp8_pairs(to)
    )
}

/// The dtypes of a normalisation's kernels: `T` the parameters' (gamma, beta; the
/// math in their compute type), `TX` x's, `TD` dy's (gradients), `TY` the normalised
/// output's or dx's. A 16-bit x or dy with f32 parameters is a widening Cast folded in,
/// a 16-bit y an output Cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct NormTypes {
    pub params: DType,
    pub x: DType,
    pub dy: DType,
    pub y: DType,
}

impl NormTypes {
    /// Every tensor of one dtype.
    #[cfg(test)]
    pub fn uniform(d: DType) -> NormTypes {
        NormTypes {
            params: d,
            x: d,
            dy: d,
            y: d,
        }
    }

    fn blocks(self) -> [(&'static str, DType); 4] {
        [
            ("", self.params),
            ("X", self.x),
            ("D", self.dy),
            ("Y", self.y),
        ]
    }

    /// Whether the word kernels (`k_warp_vec`) can move them: x, dy and y hold as many
    /// values per 16-byte word.
    pub fn same_words(self) -> bool {
        let bytes = self.x.size_bytes();
        self.dy.size_bytes() == bytes && self.y.size_bytes() == bytes
    }
}

/// The residual pointer parameter of a LayerNormGrad kernel, when it adds one.
fn residual_param(residual: bool) -> &'static str {
    if residual {
        "const TY* pr, "
    } else {
        ""
    }
}

/// The code rounding `value` to dx's dtype into `TY o`; with a `residual`, then adding
/// `A r` (loaded by `load`) and rounding again, as the Add read the rounded dx.
fn norm_grad_output(residual: bool, value: &str, load: &str) -> String {
    let add = if residual {
        format!("A r = (A){load}; stY(&o, 0, (CY)((A)ldY(&o, 0) + r));")
    } else {
        String::new()
    };
    format!("TY o; stY(&o, 0, (CY)({value})); {add}")
}

/// LayerNormGrad over rows of at most [`WARP_ROW_MAX`] values. Each block takes a
/// contiguous range of rows. First a warp per row, held in registers: `k_warp` (value
/// `t` of a lane at column `lane + 32 t`) or `k_warp_vec` (rows of exactly `32 * per`
/// values moved in 16-byte words) writes dx (plus the residual) and the row's mean and
/// inverse deviation. Then the block's eight warps add the range's column terms up,
/// reading the rows just read and written again (from the cache, not memory) a 16-byte
/// word a lane where the rows are words: dgamma, dbeta and the epilogue's sums (all
/// of `epi` is computed here), one partial per block and column
/// (`part[(block * n + k) * len + j]`, n sums) that `k_cols_fin` adds. (Adding the
/// terms up in the warps' registers instead took 210 registers, a block per
/// multiprocessor, and ran at half the speed.)
pub(super) fn layer_norm_grad_rows(
    types: NormTypes,
    eps: f64,
    per: usize,
    epi: NormGradEpilogue,
    fp8: Option<DType>,
) -> String {
    // The summed terms of element `e` of a lane's columns (`xhat` and `dy` given).
    let mut terms = vec!["dy * xhat", "dy"];
    let mut loaded = vec![("px", "X", "x"), ("pdy", "D", "dy")];
    if epi.sum_dx {
        terms.push("o_e");
        loaded.push(("pdx", "Y", "o"));
    }
    if epi.sum_residual {
        terms.push("r_e");
        loaded.push(("pr", "Y", "r"));
    }
    let n = terms.len();
    let params = format!(
        "const TX* px, const T* pg, const TD* pdy, {}TY* pdx, A* stats, A* part, i64 rows, i64 len{}",
        residual_param(epi.residual),
        if fp8.is_some() {
            ", const float* __restrict__ ps, TQ* __restrict__ py, TQ* __restrict__ pt, unsigned int* amax"
        } else {
            ""
        }
    );
    // The column pass over the block's rows: warp `ty` takes rows `first + ty + 8 i`,
    // lane `tx` `vals` adjacent columns of a tile of `32 * vals` (a 16-byte word of
    // each tensor where `vals > 1`); the eight warps' sums meet in shared memory.
    let column_pass = |vals: usize| -> String {
        let mut loads = String::new();
        let mut elements = String::new();
        for (ptr, ty, name) in &loaded {
            if vals > 1 {
                loads.push_str(&format!(
                    "uint4 w_{name} = *(const uint4*)({ptr} + at); const T{ty}* e_{name} = (const T{ty}*)&w_{name};\n"
                ));
                elements.push_str(&format!("A {name}_e = (A)ld{ty}(e_{name}, e); "));
            } else {
                elements.push_str(&format!("A {name}_e = (A)ld{ty}({ptr}, at); "));
            }
        }
        let adds: String = terms
            .iter()
            .enumerate()
            .map(|(k, term)| format!("s{k}[e] += {term}; "))
            .collect();
        let accs: String = (0..n)
            .map(|k| format!("A s{k}[{vals}]; for (int e = 0; e < {vals}; ++e) s{k}[e] = 0;\n"))
            .collect();
        let mut combine = String::new();
        for k in 0..n {
            combine.push_str(&format!(
                "for (int e = 0; e < {vals}; ++e) sh[ty][tx * {vals} + e] = s{k}[e];\n\
                 __syncthreads();\n\
                 for (int c = threadIdx.x; c < {width}; c += blockDim.x) if (j0 + c < len) {{\n\
                   A t = 0; for (int w = 0; w < 8; ++w) t += sh[w][c];\n\
                   part[((i64)blockIdx.x * {n} + {k}) * len + j0 + c] = t;\n\
                 }}\n\
                 __syncthreads();\n",
                width = 32 * vals
            ));
        }
        format!(
            "__shared__ A sh[8][{width}];\n\
             int tx = lane, ty = threadIdx.x >> 5;\n\
             for (i64 j0 = 0; j0 < len; j0 += {width}) {{\n\
               i64 j = j0 + tx * {vals};\n\
               {accs}\
               if (j < len) {{\n\
                 #pragma unroll 4\n\
                 for (i64 row = first + ty; row < end; row += 8) {{\n\
                   i64 at = row * len + j;\n\
                   A mean = stats[2 * row], inv = stats[2 * row + 1];\n\
                   {loads}\
                   #pragma unroll\n\
                   for (int e = 0; e < {vals}; ++e) {{ {elements}A dy = dy_e, xhat = (x_e - mean) * inv; {adds}}}\n\
                 }}\n\
               }}\n\
               {combine}\
             }}\n",
            width = 32 * vals
        )
    };
    // With `fp8`: the block's rows (a multiple of the band) a band at a time, each
    // band written transposed before the next.
    let kernel_fp8 = |row: &str, vals: usize, stage: &str| -> String {
        format!(
            "extern \"C\" __global__ void __launch_bounds__(256, 2) k_warp_vec({params}) {{\n\
               const A eps = (A)(C){eps};\n{stage}\
               __align__(4) __shared__ u8 band[{FP8_BAND}][{band_width}];\n\
               const float scale = ps[0];\n\
               {declaration}\
               i64 span = ((rows + gridDim.x - 1) / gridDim.x + {FP8_BAND} - 1) / {FP8_BAND} * {FP8_BAND};\n\
               i64 first = (i64)blockIdx.x * span, end = min(rows, first + span);\n\
               int lane = threadIdx.x & 31;\n\
               for (i64 r0 = first; r0 < end; r0 += {FP8_BAND}) {{\n\
                 for (int jr = threadIdx.x >> 5; jr < {FP8_BAND}; jr += 8) {{\n\
                   const i64 row = r0 + jr;\n\
                   if (row < end) {{\n\
                     i64 base = row * len;\n{row}\n\
                     if (lane == 0) {{ stats[2 * row] = mean; stats[2 * row + 1] = inv; }}\n\
                   }}\n\
                 }}\n\
                 __syncthreads();\n{transpose}\
                 __syncthreads();\n\
               }}\n{pass}{fold}}}\n",
            eps = lit(eps),
            band_width = 32 * per + 4,
            declaration = amax_declaration("m"),
            transpose = band_transpose("end"),
            pass = column_pass(vals),
            fold = amax_fold("m", "amax"),
        )
    };
    let kernel = |name: &str, row: &str, vals: usize, stage: &str| -> String {
        format!(
            "extern \"C\" __global__ void __launch_bounds__(256) {name}({params}) {{\n\
               const A eps = (A)(C){eps};\n{stage}\
               i64 span = (rows + gridDim.x - 1) / gridDim.x;\n\
               i64 first = (i64)blockIdx.x * span, end = min(rows, first + span);\n\
               int lane = threadIdx.x & 31;\n\
               for (i64 row = first + (threadIdx.x >> 5); row < end; row += blockDim.x >> 5) {{\n\
                 i64 base = row * len;\n{row}\n\
                 if (lane == 0) {{ stats[2 * row] = mean; stats[2 * row + 1] = inv; }}\n\
               }}\n\
               __syncthreads();\n{pass}}}\n",
            eps = lit(eps),
            pass = column_pass(vals),
        )
    };
    // Given x in `v` and dy in `dy`: xhat in `v`, dy * gamma in `dy` (by `scale`),
    // dx's row means.
    let middle = |scale: &str, exact: bool| {
        format!(
            "{stats}{scale}\
             A sg = 0, sgx = 0;\n\
             #pragma unroll\n\
             for (int t = 0; t < {per}; ++t) {{ v[t] = (v[t] - mean) * inv; sg += dy[t]; sgx += dy[t] * v[t]; }}\n\
             A mg = warp_sum(sg) / (A)len, mgx = warp_sum(sgx) / (A)len;\n",
            stats = ln_warp_stats(per, exact)
        )
    };
    let dx = "(dy[t] - mg - v[t] * mgx) * inv";
    let warp = format!(
        "A v[{per}], dy[{per}];\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; bool in = j < len; v[t] = in ? (A)ldX(px, base + j) : (A)0; dy[t] = in ? (A)ldD(pdy, base + j) : (A)0; }}\n\
         {middle}\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ i64 j = lane + 32 * t; if (j < len) {{ {out} pdx[base + j] = o; }} }}\n",
        middle = middle(
            &format!(
                "#pragma unroll\n\
                 for (int t = 0; t < {per}; ++t) dy[t] *= lane + 32 * t < len ? (A)ld(pg, lane + 32 * t) : (A)0;\n"
            ),
            false
        ),
        out = norm_grad_output(epi.residual, dx, "ldY(pr, base + j)"),
    );
    let v = column_vector(types.x);
    // The residual's words are loaded with x and dy: one wait for memory a row.
    let warp_vec = format!(
        "A v[{per}], dy[{per}];\n\
         {load_x}{load_dy}{load_r}{middle}\
         #pragma unroll\n\
         for (int w = 0; w < {words}; ++w) {{\n\
           i64 j0 = (i64)(32 * w + lane) * {v};\n\
           __align__(16) TY ow[{v}];\n\
           {residual_word}\
           #pragma unroll\n\
           for (int q = 0; q < {v}; ++q) {{ int t = w * {v} + q; {out} ow[q] = o; }}\n\
           *(uint4*)(pdx + base + j0) = *(const uint4*)ow;\n{cast}\
         }}\n",
        // dx as stored, measured and cast to FP8 as `QuantizeFp8` casts it.
        cast = if fp8.is_some() {
            format!(
                "float scaled[{v}];\n\
                 #pragma unroll\n\
                 for (int q = 0; q < {v}; ++q) {{ const float x = (float)ldY(ow, q);\n{measure}\nscaled[q] = __fmul_rn(x, scale); }}\n{store}",
                measure = amax_measure("m", "x"),
                store = fp8_word_store(v),
            )
        } else {
            String::new()
        },
        load_x = warp_load_words("px", "v", per, v, "X"),
        load_dy = warp_load_words("pdy", "dy", per, v, "D"),
        middle = middle(
            &format!(
                "#pragma unroll\n\
                 for (int w = 0; w < {words}; ++w) {{\n\
                   {gw}\
                   #pragma unroll\n\
                   for (int q = 0; q < {v}; ++q) dy[w * {v} + q] *= (A)ld(gw.v, q);\n\
                 }}\n",
                words = per / v,
                gw = param_word("gw", "gs", v),
            ),
            true
        ),
        words = per / v,
        load_r = if epi.residual {
            format!(
                "uint4 rw[{size}];\n\
                 #pragma unroll\n\
                 for (int w = 0; w < {words}; ++w) rw[w] = *(const uint4*)(pr + base + (i64)(32 * w + lane) * {v});\n",
                words = per / v,
                // A module of rows shorter than a warp's words still compiles
                // `k_warp_vec` (never launched): no array of size zero.
                size = (per / v).max(1),
            )
        } else {
            String::new()
        },
        residual_word = if epi.residual {
            "const TY* re = (const TY*)&rw[w];\n"
        } else {
            ""
        },
        out = norm_grad_output(epi.residual, dx, "ldY(re, q)"),
    );
    // dgamma and dbeta in the parameters' dtype, the form's sums in dx's column-sum
    // dtype (`S`).
    let mut blocks = types.blocks().to_vec();
    blocks.push(("S", column_sum_dtype(types.y)));
    let mut outs = vec![""; 2];
    outs.resize(n, "S");
    let stage = stage_params(32 * per, &[("gs", "pg")]);
    let Some(to) = fp8 else {
        return module_multi(
            &blocks,
            &format!(
                "{}{}{}",
                kernel("k_warp", &warp, 1, ""),
                kernel("k_warp_vec", &warp_vec, v, &stage),
                column_sums_fin("", &outs)
            ),
        );
    };
    blocks.push(("Q", to));
    fp8_module(
        &blocks,
        &format!(
            "{}{}{}",
            fp8_band_prelude(to),
            kernel_fp8(&warp_vec, v, &stage),
            column_sums_fin("", &outs)
        ),
    )
}

/// LayerNormGrad over rows of any length, a block per row: `k` writes dx (plus the
/// `residual`, as [`norm_grad_output`]) and each row's mean and inverse deviation;
/// the column sums (see [`column_sums`]) give dgamma and dbeta from them. The
/// epilogue's column sums are left to the caller.
pub(super) fn layer_norm_grad_block(types: NormTypes, eps: f64, residual: bool) -> String {
    let out = norm_grad_output(
        residual,
        "((A)ldD(pdy, at) * (A)ld(pg, j) - mg - xhat * mgx) * inv",
        "ldY(pr, at)",
    );
    module_multi(
        &types.blocks(),
        &format!(
            "{LN_STATS}extern \"C\" __global__ void k(const TX* px, const T* pg, const TD* pdy, {residual}TY* pdx, A* stats, i64 rows, i64 len) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
                 A mean, inv; ln_stats(px, row, len, (A)(C){eps}, sh, &mean, &inv);\n\
                 A sg = 0, sgx = 0;\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{\n\
                   i64 at = row * len + j;\n\
                   A g = (A)ldD(pdy, at) * (A)ld(pg, j);\n\
                   sg += g; sgx += g * (((A)ldX(px, at) - mean) * inv);\n\
                 }}\n\
                 A mg = block_sum(sg, sh) / (A)len;\n\
                 A mgx = block_sum(sgx, sh) / (A)len;\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{\n\
                   i64 at = row * len + j;\n\
                   A xhat = ((A)ldX(px, at) - mean) * inv;\n\
                   {out} pdx[at] = o;\n\
                 }}\n\
                 if (threadIdx.x == 0) {{ stats[2 * row] = mean; stats[2 * row + 1] = inv; }}\n\
               }}\n}}\n{cols}",
            residual = residual_param(residual),
            eps = lit(eps),
            cols = column_sums(
                "const TX* px, const TD* pdy, const A* stats",
                "A dy = (A)ldD(pdy, at);",
                &["dy * (((A)ldX(px, at) - stats[2 * row]) * stats[2 * row + 1])", "dy"],
                "",
            )
        ),
    )
}
