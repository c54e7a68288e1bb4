//! Softmax and LogSoftmax along an axis (a warp per short contiguous row held in
//! registers, else a block per row), their gradient, and FusedSoftmax: a softmax whose
//! rows an elementwise prologue computes as the kernel loads them.

use ampgraph_graph::ops::{FusedSoftmax, LogSoftmax, Softmax, SoftmaxGrad};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    column_vector, module, module_multi, streams, warp_load_words, warp_row_values, warp_rows,
    warp_store_words, Streams, WARP_ROW_MAX,
};
use super::fused::{fused_vector, streams_aligned, FusedParts, ROUNDING};
use super::{
    along, first, float_input, float_only, input, one_output, row_kernel, warp_row_form, Ctx,
    KernelResult, Lowering, ProgramSpec,
};
use crate::cuda::device::{Arg, DTensor};

kernel_specs! {
    /// The modules of Softmax and SoftmaxGrad: `per` values a lane in the warp kernels.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "softmax" {
        /// `k(const T* px, T* py, i64 rows, i64 len, i64 inner)` (a block per row),
        /// `k_warp` and `k_warp_vec(const T* px, T* py, i64 rows, i64 len)`.
        Softmax { dtype: DType, log: bool, per: usize } => softmax(dtype, log, per),
        /// `k(const T* py, const T* pdy, T* pdx, i64 rows, i64 len, i64 inner)`, `k_warp`.
        SoftmaxGrad { dtype: DType, log: bool, per: usize } => softmax_grad(dtype, log, per),
    }
}

/// A FusedSoftmax's module: `k_warp` and `k_warp_vec(<prologue's inputs>, TO0* out0,
/// i64 rows, i64 len)`. Its key holds the prologue's text (every dtype and shape the
/// source bakes in), made once.
type FusedSoftmaxSpec = ProgramSpec<(FusedSoftmax, usize)>;

/// The spec of `op`'s module with `per` values a lane.
fn fused_softmax_spec(op: &FusedSoftmax, per: usize) -> FusedSoftmaxSpec {
    // The prologue's stored value is part of the key, as a fused program's outputs.
    let key = format!(
        "softmax/FusedSoftmax {{ prologue: {}, outputs: {:?}, log: {}, per: {per} }}",
        op.prologue(),
        op.prologue().outputs(),
        op.log
    );
    ProgramSpec::new(key, (op.clone(), per), |(op, per)| fused_softmax(op, *per))
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    let softmax_axis = op
        .downcast_ref::<Softmax>()
        .map(|s| (s.axis, false))
        .or_else(|| op.downcast_ref::<LogSoftmax>().map(|s| (s.axis, true)));
    if let Some((axis, log)) = softmax_axis {
        return Some(lower_softmax(axis, log, ins, outs));
    }
    if let Some(f) = op.downcast_ref::<FusedSoftmax>() {
        return Some(lower_fused_softmax(f, outs));
    }
    if let Some(s) = op.downcast_ref::<SoftmaxGrad>() {
        return Some(lower_softmax_grad(s, ins, outs));
    }
    None
}

fn lower_softmax(axis: i64, log: bool, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    float_input(ins)?;
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, y| {
        softmax_into(c, input(inputs, 0)?, y, axis, log)?;
        Ok(())
    }))
}

fn lower_softmax_grad(s: &SoftmaxGrad, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let (len, inner, rows) = along(&ins[0].shape, s.axis)?;
    let spec = Spec::SoftmaxGrad {
        dtype,
        log: s.log,
        per: warp_row_values(len),
    };
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, dx| {
        let (y, dy) = (input(inputs, 0)?, input(inputs, 1)?);
        row_kernel(
            c,
            &spec,
            ("k", "k_warp"),
            &[y.arg(), dy.arg(), dx.arg()],
            (rows, len, Some(inner)),
        )?;
        Ok(())
    }))
}

/// `y = softmax(x)` (or log-softmax) along `axis`.
fn softmax_into(c: &Ctx, x: &DTensor, y: &DTensor, axis: i64, log: bool) -> Result<(), String> {
    float_only(x.dtype)?;
    let (len, inner, rows) = along(&x.shape, axis)?;
    let (per, warp) = warp_row_form(len, x.dtype, inner == 1, &[x, y]);
    let spec = Spec::Softmax {
        dtype: x.dtype,
        log,
        per,
    };
    row_kernel(
        c,
        &spec,
        ("k", warp),
        &[x.arg(), y.arg()],
        (rows, len, Some(inner)),
    )
}

/// `y = FusedSoftmax(inputs)`. Contiguous rows a warp holds: one kernel computing the
/// prologue as it loads each row (16-byte words where the rows are whole words of the
/// prologue's vectors and the streamed tensors aligned). Other rows: the prologue's
/// elementwise kernel into a temporary, then the softmax kernels.
fn lower_fused_softmax(f: &FusedSoftmax, outs: &[TensorType]) -> KernelResult {
    let out = first(outs)?;
    float_only(out.dtype)?;
    let p = f.prologue();
    let (len, inner, rows) = along(&out.shape, f.axis)?;
    let n = p.domain_len();
    let (axis, log) = (f.axis, f.log);
    if inner != 1 || len > WARP_ROW_MAX {
        let prologue = super::fused::spec(p);
        return Ok(one_output(out, move |c, inputs, y| {
            let x = c.temp(y.dtype, n)?.reshaped(y.shape.clone());
            let mut args: Vec<Arg> = inputs.iter().map(DTensor::arg).collect();
            args.extend([x.arg(), Arg::I64(n as i64)]);
            c.launch_elementwise(&prologue, n, &args)?;
            softmax_into(c, &x, y, axis, log)?;
            Ok(())
        }));
    }
    let v = fused_vector(p);
    let whole_words = len % (32 * v) == 0;
    let vector = fused_softmax_spec(f, len / 32);
    let plain = fused_softmax_spec(f, warp_row_values(len));
    let program = p.clone();
    Ok(one_output(out, move |c, inputs, y| {
        let (spec, name) = if whole_words && streams_aligned(&program, inputs, [y]) {
            (&vector, "k_warp_vec")
        } else {
            (&plain, "k_warp")
        };
        let mut args: Vec<Arg> = inputs.iter().map(DTensor::arg).collect();
        args.push(y.arg());
        // Rows a warp holds: `row_kernel` launches the warp kernel.
        row_kernel(c, spec, (name, name), &args, (rows, len, None))?;
        Ok(())
    }))
}

/// The body of a warp-per-row softmax kernel ([`warp_rows`]): `load` puts the row's
/// values of the lane into `A v[per]`, padding with -inf where `guarded` (lane values
/// `j = lane + 32 t` of a row shorter than `32 * per`; `in_row` runs code only for
/// values of the row), and `store(value)` stores them, `value` the expression of
/// output `t`. The kernel computes each exponential once (kept in `v`) and multiplies
/// by the sum's reciprocal: with two exponentials and a division per element it was
/// bound by arithmetic, at half of PyTorch's speed.
fn softmax_warp(
    log: bool,
    per: usize,
    load: &str,
    guarded: bool,
    store: &dyn Fn(&str) -> String,
) -> String {
    let (accumulate, finish, value) = if log {
        (
            "sum += m_exp(v[t] - shift);",
            "A lse = m_log(sum);",
            "v[t] - shift - lse",
        )
    } else {
        (
            "v[t] = m_exp(v[t] - shift); sum += v[t];",
            "A inv = (A)1 / sum;",
            "v[t] * inv",
        )
    };
    let accumulate = if guarded {
        in_row(accumulate)
    } else {
        accumulate.to_string()
    };
    warp_rows(&format!(
        "A v[{per}]; A m = (A)(-F_INF);\n{load}\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) m = nanmax(m, v[t]);\n\
         m = warp_max(m);\n\
         A shift = m_isfinite(m) ? m : (A)0;\n\
         A sum = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ {accumulate} }}\n\
         sum = warp_sum(sum);\n\
         {finish}\n{}",
        store(value)
    ))
}

/// `code` run for lane value `t` of a warp's row only where it is in the row.
fn in_row(code: &str) -> String {
    format!("int j = lane + 32 * t; if (j < len) {{ {code} }}")
}

/// [`softmax_warp`] over rows of at most `32 * per` values, lane value `t` at column
/// `j = lane + 32 t` (-inf past the row's end): `load` is code setting `v[t]` from
/// column `j` (at `base + j`), `store(value)` code storing `value` there.
fn softmax_warp_lanes(log: bool, per: usize, load: &str, store: &dyn Fn(&str) -> String) -> String {
    softmax_warp(
        log,
        per,
        &format!(
            "#pragma unroll\n\
             for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; if (j < len) {{ {load} }} else v[t] = (A)(-F_INF); }}\n"
        ),
        true,
        &|value| {
            format!(
                "#pragma unroll\n\
                 for (int t = 0; t < {per}; ++t) {{ {} }}",
                in_row(&store(value))
            )
        },
    )
}

/// Softmax or LogSoftmax along a contiguous axis. `k` gives each row a block and reads
/// it three times; `k_warp` (rows of at most `32 * per` values, [`WARP_ROW_MAX`]) gives
/// each row a warp that reads it once into registers; `k_warp_vec` does so for rows of
/// exactly `32 * per` values, moving 16-byte words.
pub(super) fn softmax(d: DType, log: bool, per: usize) -> String {
    let write = if log {
        "st(py, at, (C)((A)ld(px, at) - shift - lse));"
    } else {
        "st(py, at, (C)(m_exp((A)ld(px, at) - shift) / sum));"
    };
    let warp = softmax_warp_lanes(log, per, "v[t] = (A)ld(px, base + j);", &|value| {
        format!("st(py, base + j, (C)({value}));")
    });
    // Rows of exactly 32 * per values in 16-byte words (`k_warp_vec`): no masks.
    let v = column_vector(d);
    let warp_vec = softmax_warp(
        log,
        per,
        &warp_load_words("px", "v", per, v, ""),
        false,
        &|value| warp_store_words("py", value, per, v, ""),
    );
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, T* py, i64 rows, i64 len, i64 inner) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
                 i64 base = (row / inner) * len * inner + row % inner;\n\
                 A m = (A)(-F_INF);\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{ A v = (A)ld(px, base + j * inner); if (v > m || m_isnan(v)) m = v; }}\n\
                 m = block_max(m, sh);\n\
                 A shift = m_isfinite(m) ? m : (A)0;\n\
                 A sum = 0;\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) sum += m_exp((A)ld(px, base + j * inner) - shift);\n\
                 sum = block_sum(sum, sh);\n\
                 A lse = m_log(sum);\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{ i64 at = base + j * inner; {write} }}\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_warp(const T* px, T* py, i64 rows, i64 len) {{\n{warp}}}\n\
             extern \"C\" __global__ void k_warp_vec(const T* px, T* py, i64 rows, i64 len) {{\n{warp_vec}}}\n"
        ),
    )
}

/// The gradient of [`softmax`], with the same two kernels.
pub(super) fn softmax_grad(d: DType, log: bool, per: usize) -> String {
    let (acc, write) = if log {
        (
            "s += (A)ld(pg, at);",
            "st(pdx, at, (C)((A)ld(pg, at) - m_exp((A)ld(py, at)) * s));",
        )
    } else {
        (
            "s += (A)ld(pg, at) * (A)ld(py, at);",
            "st(pdx, at, (C)((A)ld(py, at) * ((A)ld(pg, at) - s)));",
        )
    };
    let (acc_warp, write_warp) = if log {
        ("s += gv[t];", "(C)(gv[t] - m_exp(yv[t]) * s)")
    } else {
        ("s += gv[t] * yv[t];", "(C)(yv[t] * (gv[t] - s))")
    };
    let warp = warp_rows(&format!(
        "A yv[{per}], gv[{per}]; A s = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; yv[t] = j < len ? (A)ld(py, base + j) : (A)0; gv[t] = j < len ? (A)ld(pg, base + j) : (A)0; }}\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ {acc_warp} }}\n\
         s = warp_sum(s);\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; if (j < len) st(pdx, base + j, {write_warp}); }}"
    ));
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* py, const T* pg, T* pdx, i64 rows, i64 len, i64 inner) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
                 i64 base = (row / inner) * len * inner + row % inner;\n\
                 A s = 0;\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{ i64 at = base + j * inner; {acc} }}\n\
                 s = block_sum(s, sh);\n\
                 for (i64 j = threadIdx.x; j < len; j += blockDim.x) {{ i64 at = base + j * inner; {write} }}\n\
               }}\n}}\n\
             extern \"C\" __global__ void k_warp(const T* py, const T* pg, T* pdx, i64 rows, i64 len) {{\n{warp}}}\n"
        ),
    )
}

/// The kernels of a [`FusedSoftmax`] whose rows are contiguous and at most
/// [`WARP_ROW_MAX`] long: [`softmax`]'s `k_warp` and `k_warp_vec` with each value of
/// the row computed by the prologue as it is loaded (the prologue's inputs bound at
/// element `i = base + j` of the domain, broadcast ones at their index) instead of
/// read from memory. `k_warp_vec` takes rows of exactly `32 * per` values that are a
/// whole number of vectors of [`fused_vector`] elements (aligned tensors): each lane
/// loads and stores such vectors. Arguments: the prologue's inputs, the output (`out0`,
/// of type `TO0`), `rows` and `len`.
pub(super) fn fused_softmax(op: &FusedSoftmax, per: usize) -> String {
    let p = op.prologue();
    let parts = FusedParts::new(p);
    let loads = parts.loads();
    let Streams {
        fetch,
        bind_vec,
        bind_one,
        ..
    } = streams(&loads, &[]);
    let value = format!("v{}", p.outputs()[0]);
    let body = &parts.body;
    let mut types: Vec<(&str, DType)> = parts.types.iter().map(|(s, d)| (s.as_str(), *d)).collect();
    types.push(("", p.instrs()[p.outputs()[0]].ty.dtype));
    let params = parts.params.join(", ");
    let warp = softmax_warp_lanes(
        op.log,
        per,
        &format!("const i64 i = base + j; {bind_one}\n{body}\n v[t] = (A){value};"),
        &|out| format!("stO0(out0, base + j, (CO0)({out}));"),
    );
    let words = |code: &str| {
        format!(
            "#pragma unroll\n\
             for (int w = 0; w < {per} / V; ++w) {{\n\
               const i64 i0 = base + (i64)(32 * w + lane) * V;\n{code}}}\n"
        )
    };
    let warp_vec = softmax_warp(
        op.log,
        per,
        &words(&format!(
            "{fetch}\
             #pragma unroll\n\
             for (int u = 0; u < V; ++u) {{ const i64 i = i0 + u; {bind_vec}\n{body}\n v[w * V + u] = (A){value}; }}\n"
        )),
        false,
        &|out| {
            words(&format!(
                "VEC_T(out0, V) o;\n\
                 #pragma unroll\n\
                 for (int u = 0; u < V; ++u) {{ const int t = w * V + u; stO0(o.v, u, (CO0)({out})); }}\n\
                 *(VEC_T(out0, V)*)(out0 + i0) = o;\n"
            ))
        },
    );
    module_multi(
        &types,
        &format!(
            "{ROUNDING}extern \"C\" __global__ void k_warp({params}, i64 rows, i64 len) {{\n{warp}}}\n\
             extern \"C\" __global__ void k_warp_vec({params}, i64 rows, i64 len) {{\n\
               constexpr int V = {v};\n{warp_vec}}}\n",
            v = fused_vector(p),
        ),
    )
}
