//! CUDA C++ source of the NVRTC kernels, generated per (op, dtype).
//!
//! Every kernel loads its inputs into the compute type (`float` for f32/f16/bf16,
//! `double` for f64), computes there and rounds once on store, as the CPU reference
//! kernels do. Op attributes (alphas, learning rates, epsilons) are baked into the
//! source as literals; shapes and strides are kernel arguments, so one compiled module
//! serves every shape. Block reductions accumulate in the compute type (f32 for the
//! 16-bit types).

use ampgraph_graph::ops::fused::{column_sum_dtype, Expr, Operand};
use ampgraph_graph::ops::{
    BinaryKind, ElementOp, FusedElementwise, FusedSoftmax, NormGradEpilogue, ReduceKind, Rule,
    UnaryKind,
};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::DType;

/// The most dimensions a strided kernel argument holds (larger ranks are refused).
pub const MAX_RANK: usize = 8;

/// A C literal for an f64 constant (full precision; non-finite values spelled out).
pub fn lit(v: f64) -> String {
    if v.is_nan() {
        "F_NAN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "F_INF" } else { "(-F_INF)" }.into()
    } else {
        format!("{v:e}")
    }
}

const PRELUDE: &str = r#"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef long long i64;
typedef unsigned char u8;
#define F_NAN __int_as_float(0x7fc00000)
#define F_INF __int_as_float(0x7f800000)
struct Dims { i64 n[8]; };

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
// exp by the hardware's base-2 exponential (a few ulp; used where a 16-bit result
// cannot see the difference and the full expf's range reduction costs throughput).
__device__ __forceinline__ float m_exp_approx(float x) { return __expf(x); }
__device__ __forceinline__ double m_exp_approx(double x) { return exp(x); }
__device__ __forceinline__ float m_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double m_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_max(float x, float y) { return fmaxf(x, y); }
__device__ __forceinline__ double m_max(double x, double y) { return fmax(x, y); }
__device__ __forceinline__ float m_min(float x, float y) { return fminf(x, y); }
__device__ __forceinline__ double m_min(double x, double y) { return fmin(x, y); }
__device__ __forceinline__ bool m_isnan(float x) { return isnan(x); }
__device__ __forceinline__ bool m_isnan(double x) { return isnan(x); }
__device__ __forceinline__ bool m_isfinite(float x) { return isfinite(x); }
__device__ __forceinline__ bool m_isfinite(double x) { return isfinite(x); }
// A product never contracted into an fma with what follows: folded unscaling
// (`x * s` then the update) rounds as the separate multiplication did.
__device__ __forceinline__ float m_mul_rn(float x, float y) { return __fmul_rn(x, y); }
__device__ __forceinline__ double m_mul_rn(double x, double y) { return __dmul_rn(x, y); }
// Eigen's rational erf for f32, as the CPU reference kernels use, its polynomials
// evaluated with fused multiply-adds (the kernels are built without contraction, so
// they are written out) and the quotient by the fast reciprocal (2 ulp): with separate
// products and sums, or an IEEE division, GELU and its gradient were bound by
// arithmetic rather than memory. Straight-line code: NaN is chosen at the end rather
// than branched to, and the denominator (at most -0.0142 over the clamped range) needs
// none of `__fdividef`'s guard against tiny divisors; each cost GELU's kernels about
// five of their 35 instructions an element, and the power-capped H100 runs them
// bound by instruction issue.
__device__ __forceinline__ float m_rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float m_erf(float x0) {
  float x = fminf(fmaxf(x0, -4.0f), 4.0f);
  float x2 = x * x;
  float p = -2.72614225801306e-10f;
  p = __fmaf_rn(p, x2, 2.77068142495902e-08f);
  p = __fmaf_rn(p, x2, -2.10102402082508e-06f);
  p = __fmaf_rn(p, x2, -5.69250639462346e-05f);
  p = __fmaf_rn(p, x2, -7.34990630326855e-04f);
  p = __fmaf_rn(p, x2, -2.95459980854025e-03f);
  p = __fmaf_rn(p, x2, -1.60960333262415e-02f);
  p = p * x;
  float q = -1.45660718464996e-05f;
  q = __fmaf_rn(q, x2, -2.13374055278905e-04f);
  q = __fmaf_rn(q, x2, -1.68282697438203e-03f);
  q = __fmaf_rn(q, x2, -7.37332916720468e-03f);
  q = __fmaf_rn(q, x2, -1.42647390514189e-02f);
  float y = p * m_rcp_approx(q);
  return isnan(x0) ? x0 : y;
}
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
// Max that lets NaN win.
template <typename A> __device__ __forceinline__ A nanmax(A a, A b) {
  return m_isnan(a) ? a : (m_isnan(b) ? b : (a > b ? a : b));
}
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) v = nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide reductions; `sh` holds 32 values; every thread gets the result.
template <typename A> __device__ A block_sum(A v, A* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < nw ? sh[lane] : (A)0;
    v = warp_sum(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}
template <typename A> __device__ A block_max(A v, A* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < nw ? sh[lane] : (A)(-F_INF);
    v = warp_max(v);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  v = sh[0];
  __syncthreads();
  return v;
}
// Offset of row-major index `i` over `shape` (rank `r`) with `strides`. Unrolled
// over the constant rank limit: a loop indexing the Dims parameters with a variable
// would copy them into local memory in every thread, which made every strided kernel
// several times slower than its memory traffic.
__device__ __forceinline__ i64 strided(i64 i, int r, const Dims& shape, const Dims& strides) {
  i64 off = 0;
#pragma unroll
  for (int d = 7; d >= 0; --d) {
    if (d < r) {
      i64 n = shape.n[d];
      off += (i % n) * strides.n[d];
      i /= n;
    }
  }
  return off;
}
#define GRID_LOOP(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
// N consecutive elements of a pointer's type, moved as one vector load or store.
template <typename P> struct Elem;
template <typename T> struct Elem<T*> { typedef T t; };
template <typename T> struct Elem<const T*> { typedef T t; };
template <typename T> struct Elem<T* __restrict__> { typedef T t; };
template <typename T> struct Elem<const T* __restrict__> { typedef T t; };
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };
#define VEC_T(p, N) Vec<typename Elem<decltype(p)>::t, N>
#define ALIGNED(p, N) ((unsigned long long)(p) % sizeof(VEC_T(p, N)) == 0)
"#;

/// Storage type, compute type, load and store expressions of a dtype.
fn type_parts(d: DType) -> (&'static str, &'static str, &'static str, &'static str) {
    match d {
        DType::F32 => ("float", "float", "p[i]", "p[i] = v"),
        DType::F16 => (
            "__half",
            "float",
            "__half2float(p[i])",
            "p[i] = __float2half_rn(v)",
        ),
        DType::BF16 => (
            "__nv_bfloat16",
            "float",
            "__bfloat162float(p[i])",
            "p[i] = __float2bfloat16_rn(v)",
        ),
        DType::F64 => ("double", "double", "p[i]", "p[i] = v"),
        DType::I32 => ("int", "int", "p[i]", "p[i] = v"),
        DType::I64 => ("long long", "long long", "p[i]", "p[i] = v"),
        DType::Bool => ("unsigned char", "int", "(int)p[i]", "p[i] = (v != 0)"),
    }
}

/// Typedefs `T<s>`, `C<s>` (compute) and `A<s>` (accumulator) and `ld<s>`/`st<s>`.
fn type_block(suffix: &str, d: DType) -> String {
    let (t, c, ld, st) = type_parts(d);
    let a = if d == DType::F64 { "double" } else { "float" };
    format!(
        "typedef {t} T{suffix}; typedef {c} C{suffix}; typedef {a} A{suffix};\n\
         __device__ __forceinline__ C{suffix} ld{suffix}(const T{suffix}* p, i64 i) {{ return {ld}; }}\n\
         __device__ __forceinline__ void st{suffix}(T{suffix}* p, i64 i, C{suffix} v) {{ {st}; }}\n"
    )
}

/// A module of one dtype (unsuffixed `T`, `C`, `A`, `ld`, `st`) and `body`.
pub fn module(d: DType, body: &str) -> String {
    format!("{PRELUDE}{}{body}", type_block("", d))
}

/// A module with several named dtypes (`T<suffix>` ...).
pub fn module_multi(types: &[(&str, DType)], body: &str) -> String {
    let mut s = PRELUDE.to_string();
    for (suffix, d) in types {
        s.push_str(&type_block(suffix, *d));
    }
    s.push_str(body);
    s
}

const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
const SELU_SCALE: f64 = 1.050_700_987_355_480_5;

/// Statement computing `C y` from `C x`.
pub fn unary_expr(kind: UnaryKind) -> String {
    use UnaryKind::*;
    let e = match kind {
        Relu => "m_max(x, (C)0)".to_string(),
        Relu6 => "m_min(m_max(x, (C)0), (C)6)".to_string(),
        Elu => "x > (C)0 ? x : m_expm1(x)".to_string(),
        Selu => format!(
            "(C){} * (x > (C)0 ? x : (C){} * m_expm1(x))",
            lit(SELU_SCALE),
            lit(SELU_ALPHA)
        ),
        Gelu { approximate: false } => format!(
            "(C)0.5 * x * ((C)1 + m_erf(x * (C){}))",
            lit(std::f64::consts::FRAC_1_SQRT_2)
        ),
        Gelu { approximate: true } => format!(
            "(C)0.5 * x * ((C)1 + m_tanh((C){} * (x + (C)0.044715 * x * x * x)))",
            lit((2.0 / std::f64::consts::PI).sqrt())
        ),
        LeakyRelu { alpha } => format!("x > (C)0 ? x : (C){} * x", lit(alpha)),
        Tanh => "m_tanh(x)".into(),
        Sigmoid => "(C)1 / ((C)1 + m_exp(-x))".into(),
        Exp => "m_exp(x)".into(),
        Log => "m_log(x)".into(),
        Log1p => "m_log1p(x)".into(),
        Sqrt => "m_sqrt(x)".into(),
        Rsqrt => "(C)1 / m_sqrt(x)".into(),
        Square => "x * x".into(),
        Neg => "-x".into(),
        Abs => "m_abs(x)".into(),
        Erf => "m_erf(x)".into(),
        Softplus => "m_max(x, (C)0) + m_log1p(m_exp(-m_abs(x)))".into(),
        Reciprocal => "(C)1 / x".into(),
        Sign => "x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : x)".into(),
        Identity => "x".into(),
    };
    format!("C y = {e};")
}

/// Statements computing `C d`, the derivative at `C x`.
pub fn derivative_expr(kind: UnaryKind) -> String {
    use UnaryKind::*;
    match kind {
        Relu => "C d = x > (C)0 ? (C)1 : (C)0;".into(),
        Relu6 => "C d = (x > (C)0 && x < (C)6) ? (C)1 : (C)0;".into(),
        Elu => "C d = x < (C)0 ? m_exp(x) : (C)1;".into(),
        Selu => format!(
            "C d = (C){} * (x < (C)0 ? (C){} * m_exp(x) : (C)1);",
            lit(SELU_SCALE),
            lit(SELU_ALPHA)
        ),
        Gelu { approximate: false } => format!(
            "C cdf = (C)0.5 * ((C)1 + m_erf(x * (C){}));\n\
             C pdf = m_exp_approx(-(C)0.5 * x * x) * (C){};\n\
             C d = pdf == (C)0 ? cdf : cdf + x * pdf;",
            lit(std::f64::consts::FRAC_1_SQRT_2),
            lit(1.0 / (2.0 * std::f64::consts::PI).sqrt())
        ),
        Gelu { approximate: true } => format!(
            "C c = (C){}; C k = (C)0.044715;\n\
             C t = m_tanh(c * (x + k * x * x * x));\n\
             C sech2 = (C)1 - t * t;\n\
             C tail = sech2 == (C)0 ? (C)0 : (C)0.5 * x * sech2 * c * ((C)1 + (C)3 * k * x * x);\n\
             C d = (C)0.5 * ((C)1 + t) + tail;",
            lit((2.0 / std::f64::consts::PI).sqrt())
        ),
        LeakyRelu { alpha } => format!("C d = x > (C)0 ? (C)1 : (C){};", lit(alpha)),
        Tanh => "C t = m_tanh(x); C d = (C)1 - t * t;".into(),
        Sigmoid => "C s = (C)1 / ((C)1 + m_exp(-x)); C d = s * ((C)1 - s);".into(),
        Exp => "C d = m_exp(x);".into(),
        Log => "C d = (C)1 / x;".into(),
        Log1p => "C d = (C)1 / ((C)1 + x);".into(),
        Sqrt => "C d = (C)0.5 / m_sqrt(x);".into(),
        Rsqrt => "C r = (C)1 / m_sqrt(x); C d = -(C)0.5 * r * r * r;".into(),
        Square => "C d = (C)2 * x;".into(),
        Neg => "C d = (C)-1;".into(),
        Abs => "C d = x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : x);".into(),
        Erf => format!(
            "C d = (C){} * m_exp(-x * x);",
            lit(std::f64::consts::FRAC_2_SQRT_PI)
        ),
        Softplus => "C d; if (x >= (C)0) { d = (C)1 / ((C)1 + m_exp(-x)); } else { C e = m_exp(x); d = e / ((C)1 + e); }".into(),
        Reciprocal => "C r = (C)1 / x; C d = -(r * r);".into(),
        Sign => "C d = (C)0;".into(),
        Identity => "C d = (C)1;".into(),
    }
}

/// Elements each thread of an [`elementwise`] kernel takes per grid step, at most
/// (16 bytes of its widest streamed type): the launch sizes its grid by it.
pub const VECTOR: usize = 8;

/// Where an elementwise kernel reads one of its inputs for element `i`.
enum At<'a> {
    /// At `i` itself, in a tensor of the domain's size: read in 16-byte vectors.
    Own,
    /// At an index expression of `i` (a broadcast read).
    Gather(&'a str),
    /// At `i` where the runtime condition holds, else at the index expression (an
    /// operand whose broadcast mode is a kernel argument).
    OwnIf(&'a str, &'a str),
    /// At an index expression of `i` (a broadcast read) that moves with `i` along
    /// the last axis, whose length is a multiple of the vectors: the vector of `i0`
    /// is `V` consecutive elements at the second expression (the first's at `i0`).
    Rows(&'a str, &'a str),
}

/// An input of an elementwise kernel, bound as `ty name = loader(ptr, index)`.
struct Load<'a> {
    ty: &'a str,
    name: &'a str,
    loader: &'a str,
    ptr: &'a str,
    /// Bytes of the stored element (sizes the vectors).
    bytes: usize,
    at: At<'a>,
}

/// An output of an elementwise kernel: `storer(ptr, i, value)`, always at `i`.
struct Store<'a> {
    storer: &'a str,
    ptr: &'a str,
    bytes: usize,
    value: &'a str,
}

/// Elements a vector of an elementwise loop moves when its widest streamed type has
/// `widest` bytes: 16 bytes of it, at most [`VECTOR`] elements.
fn vector_len(widest: usize) -> usize {
    (16 / widest.max(1)).clamp(1, VECTOR)
}

/// What an elementwise loop streams, as source fragments: per vector of `v` elements
/// at `i0`, the inputs' loads and outputs' declarations (`fetch`), each element `u`
/// bound (`bind_vec`) and put (`put_vec`), then the outputs' stores (`flush`); per
/// element `i` alone, `bind_one` and `put_one`. `aligned` tests every streamed pointer.
struct Streams {
    v: usize,
    aligned: String,
    fetch: String,
    bind_vec: String,
    put_vec: String,
    flush: String,
    bind_one: String,
    put_one: String,
}

fn streams(loads: &[Load], stores: &[Store]) -> Streams {
    let mut streamed: Vec<(&str, usize, Option<&str>)> = Vec::new();
    for l in loads {
        match l.at {
            At::Own => streamed.push((l.ptr, l.bytes, None)),
            At::OwnIf(cond, _) => streamed.push((l.ptr, l.bytes, Some(cond))),
            // Gathers load an element at a time; rows are checked for alignment below
            // but do not set the vectors' length.
            At::Gather(_) | At::Rows(..) => {}
        }
    }
    streamed.extend(stores.iter().map(|s| (s.ptr, s.bytes, None)));
    let v = vector_len(streamed.iter().map(|s| s.1).max().unwrap_or(1));
    for l in loads {
        if let At::Rows(..) = l.at {
            streamed.push((l.ptr, l.bytes, None));
        }
    }
    let mut aligned: Vec<String> = streamed
        .iter()
        .map(|(p, _, cond)| match cond {
            None => format!("ALIGNED({p}, V)"),
            Some(c) => format!("(!({c}) || ALIGNED({p}, V))"),
        })
        .collect();
    if aligned.is_empty() {
        aligned.push("true".into());
    }
    let (mut fetch, mut bind_vec, mut bind_one) = (String::new(), String::new(), String::new());
    for l in loads {
        let (ty, name, ld, p) = (l.ty, l.name, l.loader, l.ptr);
        match l.at {
            At::Own => {
                fetch.push_str(&format!(
                    "const VEC_T({p}, V) s_{p} = *(const VEC_T({p}, V)*)({p} + i0);\n"
                ));
                bind_vec.push_str(&format!("{ty} {name} = {ld}(s_{p}.v, u); "));
                bind_one.push_str(&format!("{ty} {name} = {ld}({p}, i); "));
            }
            At::Gather(index) => {
                bind_vec.push_str(&format!("{ty} {name} = {ld}({p}, {index}); "));
                bind_one.push_str(&format!("{ty} {name} = {ld}({p}, {index}); "));
            }
            At::Rows(index, at_i0) => {
                fetch.push_str(&format!(
                    "const VEC_T({p}, V) s_{p} = *(const VEC_T({p}, V)*)({p} + {at_i0});\n"
                ));
                bind_vec.push_str(&format!("{ty} {name} = {ld}(s_{p}.v, u); "));
                bind_one.push_str(&format!("{ty} {name} = {ld}({p}, {index}); "));
            }
            At::OwnIf(cond, index) => {
                fetch.push_str(&format!(
                    "VEC_T({p}, V) s_{p}; if ({cond}) s_{p} = *(const VEC_T({p}, V)*)({p} + i0);\n"
                ));
                bind_vec.push_str(&format!(
                    "{ty} {name} = ({cond}) ? {ld}(s_{p}.v, u) : {ld}({p}, {index}); "
                ));
                bind_one.push_str(&format!("{ty} {name} = {ld}({p}, {index}); "));
            }
        }
    }
    let (mut put_vec, mut put_one, mut flush) = (String::new(), String::new(), String::new());
    for s in stores {
        let (st, p, value) = (s.storer, s.ptr, s.value);
        fetch.push_str(&format!("VEC_T({p}, V) s_{p};\n"));
        put_vec.push_str(&format!("{st}(s_{p}.v, u, {value}); "));
        put_one.push_str(&format!("{st}({p}, i, {value}); "));
        flush.push_str(&format!("*(VEC_T({p}, V)*)({p} + i0) = s_{p};\n"));
    }
    Streams {
        v,
        aligned: aligned.join(" && "),
        fetch,
        bind_vec,
        put_vec,
        flush,
        bind_one,
        put_one,
    }
}

/// The loop of an elementwise kernel over the `n` elements `i` of its domain: every
/// input bound, `body` run, every output stored. Where every streamed pointer is
/// aligned, each thread moves [`VECTOR`] (or fewer, to keep to 16 bytes) consecutive
/// elements of each streamed tensor with one vector load or store; the rest, and
/// misaligned views, go one element at a time. One 2-byte load per thread left the
/// memory system mostly idle (half of PyTorch's bandwidth).
fn elementwise(loads: &[Load], body: &str, stores: &[Store]) -> String {
    elementwise_in(loads, body, stores, ("blockIdx.x", "gridDim.x"))
}

/// [`elementwise`]'s loop as run by block `block` of `blocks` (expressions): a
/// grouped kernel runs each member's loop in blocks of its own.
fn elementwise_in(
    loads: &[Load],
    body: &str,
    stores: &[Store],
    (block, blocks): (&str, &str),
) -> String {
    let Streams {
        v,
        aligned,
        fetch,
        bind_vec,
        put_vec,
        flush,
        bind_one,
        put_one,
    } = streams(loads, stores);
    format!(
        "constexpr int V = {v};\n\
         const i64 nv = ({aligned}) ? n / V : 0;\n\
         for (i64 b = (i64)({block}) * blockDim.x + threadIdx.x; b < nv; b += (i64)({blocks}) * blockDim.x) {{\n\
           const i64 i0 = b * V;\n\
           {fetch}\
           #pragma unroll\n\
           for (int u = 0; u < V; ++u) {{ const i64 i = i0 + u; {bind_vec}\n{body}\n{put_vec} }}\n\
           {flush}\
         }}\n\
         for (i64 i = nv * V + (i64)({block}) * blockDim.x + threadIdx.x; i < n; i += (i64)({blocks}) * blockDim.x) {{ {bind_one}\n{body}\n{put_one} }}\n"
    )
}

/// A full-size input `ptr` of the kernel's one dtype `d`, bound as `C name`.
fn own<'a>(d: DType, name: &'a str, ptr: &'a str) -> Load<'a> {
    Load {
        ty: "C",
        name,
        loader: "ld",
        ptr,
        bytes: d.size_bytes(),
        at: At::Own,
    }
}

/// The output `ptr` of the kernel's one dtype `d`.
fn store<'a>(d: DType, ptr: &'a str, value: &'a str) -> Store<'a> {
    Store {
        storer: "st",
        ptr,
        bytes: d.size_bytes(),
        value,
    }
}

pub fn unary(d: DType, kind: UnaryKind) -> String {
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, T* py, i64 n) {{\n{}}}\n",
            elementwise(
                &[own(d, "x", "px")],
                &unary_expr(kind),
                &[store(d, "py", "y")]
            )
        ),
    )
}

pub fn unary_grad(d: DType, kind: UnaryKind) -> String {
    module(
        d,
        &format!(
            "extern \"C\" __global__ void k(const T* px, const T* pdy, T* pdx, i64 n) {{\n{}}}\n",
            elementwise(
                &[own(d, "x", "px"), own(d, "g", "pdy")],
                &derivative_expr(kind),
                &[store(d, "pdx", "(d == (C)0 ? d : d * g)")]
            )
        ),
    )
}

/// Expression of `C a` and `C b`.
pub fn binary_expr(kind: BinaryKind) -> &'static str {
    match kind {
        BinaryKind::Add => "a + b",
        BinaryKind::Sub => "a - b",
        BinaryKind::Mul => "a * b",
        BinaryKind::Div => "a / b",
        BinaryKind::Maximum => "(m_isnan(a) || m_isnan(b)) ? (C)F_NAN : m_max(a, b)",
        BinaryKind::Minimum => "(m_isnan(a) || m_isnan(b)) ? (C)F_NAN : m_min(a, b)",
        BinaryKind::Pow => "m_pow(a, b)",
        BinaryKind::SquaredDifference => "(a - b) * (a - b)",
    }
}

/// Expression of `C a`, `C b` and the output gradient `C g`.
pub fn binary_grad_expr(kind: BinaryKind, wrt: usize) -> &'static str {
    let first = wrt == 0;
    match (kind, first) {
        (BinaryKind::Add, _) => "g",
        (BinaryKind::Sub, true) => "g",
        (BinaryKind::Sub, false) => "-g",
        (BinaryKind::Mul, true) => "g * b",
        (BinaryKind::Mul, false) => "g * a",
        (BinaryKind::Div, true) => "g / b",
        (BinaryKind::Div, false) => "g * (-a / b) / b",
        (BinaryKind::Maximum, true) => "(a >= b) ? g : (C)0",
        (BinaryKind::Maximum, false) => "(a >= b) ? (C)0 : g",
        (BinaryKind::Minimum, true) => "(a <= b) ? g : (C)0",
        (BinaryKind::Minimum, false) => "(a <= b) ? (C)0 : g",
        (BinaryKind::Pow, true) => "b == (C)0 ? (C)0 : g * b * m_pow(a, b - (C)1)",
        (BinaryKind::Pow, false) => "a > (C)0 ? g * m_pow(a, b) * m_log(a) : (C)0",
        (BinaryKind::SquaredDifference, true) => "(C)2 * (a - b) * g",
        (BinaryKind::SquaredDifference, false) => "-((C)2 * (a - b) * g)",
    }
}

/// Index of an operand: mode 0 identity, 1 scalar, 2 strided over the output shape.
const OPERAND_INDEX: &str = r#"
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

pub fn binary(d: DType, kind: BinaryKind) -> String {
    module(
        d,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const T* pa, const T* pb, T* py, i64 n, int r, Dims shape, int ma, Dims sa, int mb, Dims sb) {{\n{}}}\n",
            elementwise(&binary_loads(d)[..2], "", &[store(d, "py", binary_expr(kind))])
        ),
    )
}

pub fn binary_grad(d: DType, kind: BinaryKind, wrt: usize) -> String {
    module(
        d,
        &format!(
            "{OPERAND_INDEX}extern \"C\" __global__ void k(const T* pa, const T* pb, const T* pg, T* py, i64 n, int r, Dims shape, int ma, Dims sa, int mb, Dims sb) {{\n{}}}\n",
            elementwise(
                &binary_loads(d),
                "",
                &[store(d, "py", binary_grad_expr(kind, wrt))]
            )
        ),
    )
}

pub fn bias_add(d: DType) -> String {
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

pub fn cast(from: DType, to: DType) -> String {
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

/// The unsigned type of a byte width, for kernels that only move data.
fn word(bytes: usize) -> &'static str {
    match bytes {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        _ => "uint4",
    }
}

/// `y[i] = x[offset + strided(i)]`: transposes, slices, broadcasts.
pub fn gather(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, i64 offset) {{\n\
           GRID_LOOP(i, n) {{ py[i] = px[offset + strided(i, r, shape, st)]; }}\n}}\n",
        word(bytes)
    )
}

/// Copies one concat input into its place in the output.
pub fn concat(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off) {{\n\
           GRID_LOOP(i, n) {{ py[(i / inner_in) * inner_out + off + i % inner_in] = px[i]; }}\n}}\n",
        word(bytes)
    )
}

/// `y[i] = x[strided(i)] / div` (ReduceGrad of Sum and Mean).
pub fn broadcast_div(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const T* px, T* py, i64 n, int r, Dims shape, Dims sst, double div) {\n\
           GRID_LOOP(i, n) { st(py, i, ld(px, strided(i, r, shape, sst)) / (C)div); }\n}\n",
    )
}

/// Reductions over arbitrary axes: the kept axes (`ks`, `kst`) index outputs, the
/// reduced ones (`rs`, `rst`) the elements summed into each. `k` gives each output a
/// block; `k_thread` gives each output a thread (few elements per output).
/// Reductions of `d` storing `out` (the same, or a type `d` widens into exactly).
pub fn reduce(d: DType, out: DType, kind: ReduceKind) -> String {
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
               }}\n}}\n"
        ),
    )
}

/// ReduceGrad of Max: the gradient goes to the maxima, split evenly between ties.
pub fn reduce_max_grad(d: DType) -> String {
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

/// The longest softmax row a warp holds in registers (`k_warp`), and the values per
/// lane a row of `len` needs there (a power of two, so few variants compile).
pub const WARP_ROW_MAX: usize = 1024;

pub fn warp_row_values(len: usize) -> usize {
    len.div_ceil(32).next_power_of_two()
}

/// The loop of a warp-per-row kernel: each warp takes rows `row` of `len` values
/// (`len <= 32 * per`), lane `lane` holding values `lane + 32 t`.
fn warp_rows(body: &str) -> String {
    format!(
        "int lane = threadIdx.x & 31;\n\
         for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows; row += (i64)gridDim.x * (blockDim.x >> 5)) {{\n\
           i64 base = row * len;\n{body}\n}}\n"
    )
}

/// Rows of exactly `32 * per` values whose lanes move 16-byte words of `v` values
/// ([`column_vector`]): value `w * v + q` of a lane is column `(32 * w + lane) * v + q`.
/// The code loading row `base` of `ptr` (of the module's type `T<ty>`) into `A arr[per]`.
fn warp_load_words(ptr: &str, arr: &str, per: usize, v: usize, ty: &str) -> String {
    format!(
        "#pragma unroll\n\
         for (int w = 0; w < {words}; ++w) {{\n\
           uint4 word = *(const uint4*)({ptr} + base + (i64)(32 * w + lane) * {v});\n\
           const T{ty}* e = (const T{ty}*)&word;\n\
           #pragma unroll\n\
           for (int q = 0; q < {v}; ++q) {arr}[w * {v} + q] = (A)ld{ty}(e, q);\n\
         }}\n",
        words = per / v
    )
}

/// The code storing `value` (an expression of the value's index `t` and column `j`)
/// for each of a lane's values into row `base` of `ptr`, a word at a time.
fn warp_store_words(ptr: &str, value: &str, per: usize, v: usize, ty: &str) -> String {
    format!(
        "#pragma unroll\n\
         for (int w = 0; w < {words}; ++w) {{\n\
           i64 j0 = (i64)(32 * w + lane) * {v};\n\
           __align__(16) T{ty} o[{v}];\n\
           #pragma unroll\n\
           for (int q = 0; q < {v}; ++q) {{ int t = w * {v} + q; i64 j = j0 + q; st{ty}(o, q, (C{ty})({value})); }}\n\
           *(uint4*)({ptr} + base + j0) = *(const uint4*)o;\n\
         }}\n",
        words = per / v
    )
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
pub fn softmax(d: DType, log: bool, per: usize) -> String {
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
pub fn softmax_grad(d: DType, log: bool, per: usize) -> String {
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

/// The shift (the row's maximum, where finite) and the sum of `exp(x - shift)` of
/// row `row` of `c` logits, block-wide; `sce_row{t}` reads logits of type `T{t}`.
fn sce_row(t: &str) -> String {
    format!(
        "__device__ void sce_row{t}(const T{t}* px, i64 row, i64 c, A* sh, A* shift_out, A* sum_out) {{\n\
           A m = (A)(-F_INF);\n\
           for (i64 j = threadIdx.x; j < c; j += blockDim.x) {{ A v = (A)ld{t}(px, row * c + j); if (v > m || m_isnan(v)) m = v; }}\n\
           m = block_max(m, sh);\n\
           A shift = m_isfinite(m) ? m : (A)0;\n\
           A sum = 0;\n\
           for (i64 j = threadIdx.x; j < c; j += blockDim.x) sum += m_exp((A)ld{t}(px, row * c + j) - shift);\n\
           sum = block_sum(sum, sh);\n\
           *shift_out = shift;\n\
           *sum_out = sum;\n\
         }}\n"
    )
}

/// The loss of each row (`sce_loss{t}`: NaN for a label out of range), and `k_mean`,
/// the mean of the rows' losses stored as `T`.
fn sce_loss_and_mean(t: &str) -> String {
    format!(
        "__device__ A sce_loss{t}(const T{t}* px, i64 row, i64 c, i64 label, A shift, A sum) {{\n\
           return (label < 0 || label >= c) ? (A)F_NAN : (m_log(sum) + shift) - (A)ld{t}(px, row * c + label);\n\
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
/// element's `exp(x - shift)` and the row's sum, NaN for a label out of range.
const SCE_DX: &str = r#"
__device__ __forceinline__ C sce_dx(A e, A sum, bool is_label, bool bad, C scale) {
  C p = (C)(e / sum);
  C target = is_label ? (C)1 : (C)0;
  return bad ? (C)F_NAN : (p - target) * scale;
}
"#;

/// The statements storing row `row`'s gradient ([`SCE_DX`]) through `st{g}` into
/// `pdx`, from logits read by `ld{t}`.
fn sce_grad_row(t: &str, g: &str) -> String {
    format!(
        "bool bad = label < 0 || label >= c;\n\
         for (i64 j = threadIdx.x; j < c; j += blockDim.x)\n\
           st{g}(pdx, row * c + j, sce_dx(m_exp((A)ld{t}(px, row * c + j) - shift), sum, j == label, bad, scale));\n"
    )
}

/// SoftmaxCrossEntropy: `k_rows` writes each row's loss (f32/f64), `k_mean` their mean.
pub fn sce(d: DType, labels: DType) -> String {
    module_multi(
        &[("", d), ("L", labels)],
        &format!(
            "{}{}extern \"C\" __global__ void k_rows(const T* px, const TL* pl, A* rows_out, i64 n, i64 c) {{\n\
               __shared__ A sh[32];\n\
               for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                 A shift, sum; sce_row(px, row, c, sh, &shift, &sum);\n\
                 if (threadIdx.x == 0) rows_out[row] = sce_loss(px, row, c, (i64)pl[row], shift, sum);\n\
               }}\n}}\n",
            sce_row(""),
            sce_loss_and_mean("")
        ),
    )
}

pub fn sce_grad(d: DType, labels: DType) -> String {
    module_multi(
        &[("", d), ("L", labels)],
        &format!(
            "{SCE_DX}{}extern \"C\" __global__ void k(const T* px, const TL* pl, const T* pdl, T* pdx, i64 n, i64 c) {{\n\
               __shared__ A sh[32];\n\
               C scale = ld(pdl, 0) / (C)n;\n\
               for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                 A shift, sum; sce_row(px, row, c, sh, &shift, &sum);\n\
                 i64 label = (i64)pl[row];\n\
                 {}\
               }}\n}}\n",
            sce_row(""),
            sce_grad_row("", "")
        ),
    )
}

/// Threads of a block of the cross-entropy kernel that sums its gradient's columns.
pub const SCE_SUM_THREADS: usize = 256;

/// SoftmaxCrossEntropyWithGrad: `k_rows` reads each row of logits (`TX`, widened to
/// the compute type `T`) for both its loss and its gradient (stored as `TG`), then
/// `k_mean` as [`sce`]'s. With `summed_classes` (the class count, at most
/// [`MAX_SUMMED_CLASSES`](ampgraph_graph::ops::MAX_SUMMED_CLASSES)) the kernel also
/// adds up the gradient's columns: a block of [`SCE_SUM_THREADS`] takes a chunk of
/// rows, each thread the same columns of every row, held in registers (one read of
/// the logits, the exponentials kept), so its column sums are registers too; it writes
/// them to `part` as the chunk's partial sums and `k_cols_fin` adds the chunks. The
/// values, their order and the block reductions are those of [`sce_grad`].
pub fn sce_with_grad(
    logits: DType,
    compute: DType,
    grad: DType,
    labels: DType,
    summed_classes: Option<usize>,
) -> String {
    let types = [("", compute), ("X", logits), ("G", grad), ("L", labels)];
    let params =
        "const TX* px, const TL* pl, const T* pdl, TG* pdx, A* rows_out, A* part, i64 n, i64 c";
    let Some(classes) = summed_classes else {
        return module_multi(
            &types,
            &format!(
                "{SCE_DX}{}{}extern \"C\" __global__ void k_rows({params}) {{\n\
                   __shared__ A sh[32];\n\
                   C scale = ld(pdl, 0) / (C)n;\n\
                   for (i64 row = blockIdx.x; row < n; row += gridDim.x) {{\n\
                     A shift, sum; sce_rowX(px, row, c, sh, &shift, &sum);\n\
                     i64 label = (i64)pl[row];\n\
                     if (threadIdx.x == 0) rows_out[row] = sce_lossX(px, row, c, label, shift, sum);\n\
                     {}\
                   }}\n}}\n",
                sce_row("X"),
                sce_loss_and_mean("X"),
                sce_grad_row("X", "G")
            ),
        );
    };
    let per = classes.div_ceil(SCE_SUM_THREADS).max(1);
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
                 A m = (A)(-F_INF);\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) {{\n\
                   i64 j = threadIdx.x + k * {SCE_SUM_THREADS};\n\
                   e[k] = j < c ? (A)ldX(px, row * c + j) : (A)(-F_INF);\n\
                   if (e[k] > m || m_isnan(e[k])) m = e[k];\n\
                 }}\n\
                 m = block_max(m, sh);\n\
                 A shift = m_isfinite(m) ? m : (A)0;\n\
                 A sum = 0;\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) if (threadIdx.x + k * {SCE_SUM_THREADS} < c) {{ e[k] = m_exp(e[k] - shift); sum += e[k]; }}\n\
                 sum = block_sum(sum, sh);\n\
                 i64 label = (i64)pl[row];\n\
                 if (threadIdx.x == 0) rows_out[row] = sce_lossX(px, row, c, label, shift, sum);\n\
                 bool bad = label < 0 || label >= c;\n\
                 #pragma unroll\n\
                 for (int k = 0; k < {per}; ++k) {{\n\
                   i64 j = threadIdx.x + k * {SCE_SUM_THREADS};\n\
                   if (j < c) {{\n\
                     C d = sce_dx(e[k], sum, j == label, bad, scale);\n\
                     stG(pdx, row * c + j, d);\n\
                     acc[k] += (A)d;\n\
                   }}\n\
                 }}\n\
               }}\n\
               #pragma unroll\n\
               for (int k = 0; k < {per}; ++k) {{ i64 j = threadIdx.x + k * {SCE_SUM_THREADS}; if (j < c) part[blockIdx.x * c + j] = acc[k]; }}\n\
             }}\n{}",
            sce_loss_and_mean("X"),
            column_sums_fin("", &[""]),
        ),
    )
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
/// value `t` at column `lane + 32 t`), both passes in registers.
fn ln_warp_stats(per: usize) -> String {
    format!(
        "A s = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) s += v[t];\n\
         A mean = warp_sum(s) / (A)len;\n\
         A q = 0;\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; A c = j < len ? v[t] - mean : (A)0; q += c * c; }}\n\
         A inv = (A)1 / m_sqrt(warp_sum(q) / (A)len + eps);\n"
    )
}

/// LayerNorm over rows of `len`: `k` gives each row a block (three passes over it);
/// `k_warp` (rows of at most `32 * per` values, [`WARP_ROW_MAX`]) gives each row a
/// warp that reads it once into registers; `k_warp_vec` does so for rows of exactly
/// `32 * per` values, moving 16-byte words.
pub fn layer_norm(types: NormTypes, eps: f64, per: usize) -> String {
    let warp = warp_rows(&format!(
        "A v[{per}];\n\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; v[t] = j < len ? (A)ldX(px, base + j) : (A)0; }}\n\
         {stats}\
         #pragma unroll\n\
         for (int t = 0; t < {per}; ++t) {{ int j = lane + 32 * t; if (j < len) stY(py, base + j, (CY)((v[t] - mean) * inv * (A)ld(pg, j) + (A)ld(pb, j))); }}",
        stats = ln_warp_stats(per)
    ));
    // Rows of exactly 32 * per values in 16-byte words (`k_warp_vec`; x and y of one
    // size).
    let v = column_vector(types.x);
    let warp_vec = warp_rows(&format!(
        "A v[{per}];\n{load}{stats}{store}",
        load = warp_load_words("px", "v", per, v, "X"),
        stats = ln_warp_stats(per),
        store = warp_store_words(
            "py",
            "(v[t] - mean) * inv * (A)ld(pg, j) + (A)ld(pb, j)",
            per,
            v,
            "Y"
        ),
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
             extern \"C\" __global__ void k_warp_vec({params}) {{\n\
               const A eps = (A)(C){eps};\n{warp_vec}}}\n",
            eps = lit(eps)
        ),
    )
}

/// The dtypes of a normalisation's kernels: `T` the parameters' (gamma, beta; the
/// math in their compute type), `TX` x's, `TD` dy's (gradients), `TY` the normalised
/// output's or dx's. A 16-bit x or dy with f32 parameters is a widening Cast folded in,
/// a 16-bit y an output Cast.
#[derive(Clone, Copy, Debug)]
pub struct NormTypes {
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

/// Rows a block of the column-sum kernels reads at once (its warps), and the most row
/// chunks (blocks per column tile) they use.
pub const COLUMN_ROWS: usize = 8;
pub const COLUMN_CHUNKS: usize = 128;

/// Column sums of a `[rows, len]` matrix, deterministic, in two kernels.
/// `k_cols_part` (grid: column tiles of 32 x row chunks, 256 threads) has each warp
/// read 32 adjacent columns of a row (coalesced), adds the [`COLUMN_ROWS`] warps'
/// partials in shared memory and writes one partial per (chunk, column); `k_cols_fin`
/// (grid: column tiles of 32, 256 threads) adds a column's chunk partials, each warp
/// a stride of chunks (coalesced rows of partials; a thread per column adding all of
/// them in turn left most of the GPU idle), and stores `scale<k> * sum`. `params` are the input
/// parameters, `row_setup` runs per element with `row`, `j` and `at = row * len + j`
/// defined, and `terms` are the summed expressions, one output `py<k>` each, of type
/// `T<out>` (accumulated in `A<out>`, `out` a type suffix of the module).
/// The row loop is unrolled so that each warp has several rows' loads in flight: one
/// at a time kept a third of the memory bandwidth busy.
fn column_sums(params: &str, row_setup: &str, terms: &[&str], out: &str) -> String {
    let n = terms.len();
    let mut accs = String::new();
    let mut adds = String::new();
    let mut shares = String::new();
    let mut partials = String::new();
    for (k, term) in terms.iter().enumerate() {
        accs.push_str(&format!("A{out} acc{k} = 0; "));
        adds.push_str(&format!("acc{k} += {term}; "));
        shares.push_str(&format!("sh[{k}][ty][tx] = acc{k}; "));
        partials.push_str(&format!(
            "{{ A{out} s = 0; for (int w = 0; w < {COLUMN_ROWS}; ++w) s += sh[{k}][w][tx]; part[(chunk * {n} + {k}) * len + j] = s; }}\n"
        ));
    }
    format!(
        "extern \"C\" __global__ void k_cols_part({params}, A{out}* part, i64 rows, i64 len, i64 chunk_rows) {{\n\
           __shared__ A{out} sh[{n}][{COLUMN_ROWS}][33];\n\
           int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
           i64 tiles = (len + 31) / 32;\n\
           i64 j = (blockIdx.x % tiles) * 32 + tx, chunk = blockIdx.x / tiles;\n\
           i64 end = min(rows, (chunk + 1) * chunk_rows);\n\
           {accs}\n\
           if (j < len) {{\n\
             #pragma unroll 8\n\
             for (i64 row = chunk * chunk_rows + ty; row < end; row += {COLUMN_ROWS}) {{ i64 at = row * len + j; {row_setup} {adds} }}\n\
           }}\n\
           {shares}\n\
           __syncthreads();\n\
           if (ty == 0 && j < len) {{\n{partials}}}\n\
         }}\n{}",
        column_sums_fin(out, &vec![out; n])
    )
}

/// `k_cols_fin` of [`column_sums`]: adds the chunks' partials `part[(chunk * n + k)
/// * len + j]` (of type `A<acc>`) of each of the `n = outs.len()` sums and stores
/// `scale<k> * sum` into `py<k>`, of the module's type `T<outs[k]>`.
fn column_sums_fin(acc: &str, outs: &[&str]) -> String {
    let n = outs.len();
    let mut params = String::new();
    let mut finals = String::new();
    for (k, out) in outs.iter().enumerate() {
        params.push_str(&format!(", T{out}* py{k}, double scale{k}"));
        finals.push_str(&format!(
            "{{ A{acc} s = 0; if (j < len) {{\n\
                 #pragma unroll 8\n\
                 for (i64 c = ty; c < chunks; c += {COLUMN_ROWS}) s += part[(c * {n} + {k}) * len + j]; }}\n\
               fin[ty][tx] = s; __syncthreads();\n\
               if (ty == 0 && j < len) {{ for (int w = 1; w < {COLUMN_ROWS}; ++w) s += fin[w][tx]; st{out}(py{k}, j, (C{out})(s * (A{acc})scale{k})); }}\n\
               __syncthreads(); }}\n"
        ));
    }
    format!(
        "extern \"C\" __global__ void k_cols_fin(const A{acc}* part, i64 len, i64 chunks{params}) {{\n\
           __shared__ A{acc} fin[{COLUMN_ROWS}][33];\n\
           int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
           for (i64 j0 = (i64)blockIdx.x * 32; j0 < len; j0 += (i64)gridDim.x * 32) {{\n\
             i64 j = j0 + tx;\n{finals}}}\n\
         }}\n"
    )
}

/// Sum over the rows of a `[rows, len]` matrix of `d` (Mean through the scale),
/// stored as `out`. Besides [`column_sums`]' kernels, `k_cols_part_vec` does
/// `k_cols_part`'s work with each lane reading a 16-byte word of [`column_vector`]
/// adjacent columns (a warp reads 512 contiguous bytes of a row, not 64): for `len` a
/// multiple of that and a 16-byte aligned matrix.
pub fn column_sum(d: DType, out: DType) -> String {
    let v = column_vector(d);
    module_multi(
        &[("", d), ("O", out)],
        &format!(
            "{}extern \"C\" __global__ void k_cols_part_vec(const T* px, AO* part, i64 rows, i64 len, i64 chunk_rows) {{\n\
               __shared__ AO sh[{COLUMN_ROWS}][{width}];\n\
               int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
               i64 tiles = (len + {width} - 1) / {width};\n\
               i64 j = (blockIdx.x % tiles) * {width} + tx * {v}, chunk = blockIdx.x / tiles;\n\
               i64 end = min(rows, (chunk + 1) * chunk_rows);\n\
               AO acc[{v}];\n\
               #pragma unroll\n\
               for (int e = 0; e < {v}; ++e) acc[e] = 0;\n\
               if (j < len) {{\n\
                 #pragma unroll 4\n\
                 for (i64 row = chunk * chunk_rows + ty; row < end; row += {COLUMN_ROWS}) {{\n\
                   uint4 word = *(const uint4*)(px + row * len + j);\n\
                   const T* x = (const T*)&word;\n\
                   #pragma unroll\n\
                   for (int e = 0; e < {v}; ++e) acc[e] += (AO)ld(x, e);\n\
                 }}\n\
               }}\n\
               #pragma unroll\n\
               for (int e = 0; e < {v}; ++e) sh[ty][tx * {v} + e] = acc[e];\n\
               __syncthreads();\n\
               if (ty == 0 && j < len) {{\n\
                 #pragma unroll\n\
                 for (int e = 0; e < {v}; ++e) {{ AO s = 0; for (int w = 0; w < {COLUMN_ROWS}; ++w) s += sh[w][tx * {v} + e]; part[chunk * len + j + e] = s; }}\n\
               }}\n\
             }}\n",
            column_sums("const T* px", "", &["(AO)ld(px, at)"], "O"),
            width = 32 * v,
        ),
    )
}

/// Elements of `d` in a 16-byte word: the columns a lane of `k_cols_part_vec` sums.
pub fn column_vector(d: DType) -> usize {
    16 / d.size_bytes()
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
pub fn layer_norm_grad_rows(
    types: NormTypes,
    eps: f64,
    per: usize,
    epi: NormGradEpilogue,
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
        "const TX* px, const T* pg, const TD* pdy, {}TY* pdx, A* stats, A* part, i64 rows, i64 len",
        residual_param(epi.residual)
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
    let kernel = |name: &str, row: &str, vals: usize| -> String {
        format!(
            "extern \"C\" __global__ void __launch_bounds__(256) {name}({params}) {{\n\
               const A eps = (A)(C){eps};\n\
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
    // Given x in `v` and dy in `dy`: xhat in `v`, dy * gamma in `dy`, dx's row means.
    let middle = |gamma: &str| {
        format!(
            "{stats}\
             A sg = 0, sgx = 0;\n\
             #pragma unroll\n\
             for (int t = 0; t < {per}; ++t) {{ v[t] = (v[t] - mean) * inv; dy[t] *= {gamma}; sg += dy[t]; sgx += dy[t] * v[t]; }}\n\
             A mg = warp_sum(sg) / (A)len, mgx = warp_sum(sgx) / (A)len;\n",
            stats = ln_warp_stats(per)
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
        middle = middle("(lane + 32 * t < len ? (A)ld(pg, lane + 32 * t) : (A)0)"),
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
           *(uint4*)(pdx + base + j0) = *(const uint4*)ow;\n\
         }}\n",
        load_x = warp_load_words("px", "v", per, v, "X"),
        load_dy = warp_load_words("pdy", "dy", per, v, "D"),
        middle = middle(&format!(
            "(A)ld(pg, (i64)(32 * (t / {v}) + lane) * {v} + t % {v})"
        )),
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
    module_multi(
        &blocks,
        &format!(
            "{}{}{}",
            kernel("k_warp", &warp, 1),
            kernel("k_warp_vec", &warp_vec, v),
            column_sums_fin("", &outs)
        ),
    )
}

/// LayerNormGrad over rows of any length, a block per row: `k` writes dx (plus the
/// `residual`, as [`norm_grad_output`]) and each row's mean and inverse deviation;
/// the column sums (see [`column_sums`]) give dgamma and dbeta from them. The
/// epilogue's column sums are left to the caller.
pub fn layer_norm_grad_block(types: NormTypes, eps: f64, residual: bool) -> String {
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

/// Sets `flag[0] = v`.
pub fn fill_flag() -> String {
    format!("{PRELUDE}extern \"C\" __global__ void k(u8* flag, int v) {{ flag[0] = (u8)v; }}\n")
}

/// AllFinite in one launch: `lists` are the dtypes of lists of up to [`MAX_RANK`]
/// tensors each (list `q`: their addresses and lengths in `ptrs<q>` and `lens<q>`,
/// `count<q>` of them), checked one after another by the whole grid. Clears `flag` at
/// a value that is not finite (times the scale `ps`, in its dtype, when folded
/// unscaling gave one). One launch for all dtypes: the mlp's f32 bias gradients in a
/// launch of their own ran on two blocks for 7.5 us.
pub fn all_finite(lists: &[DType], scale: Option<DType>) -> String {
    let suffixes: Vec<String> = (0..lists.len()).map(|q| format!("L{q}")).collect();
    let mut types: Vec<(&str, DType)> = suffixes
        .iter()
        .map(String::as_str)
        .zip(lists.iter().copied())
        .collect();
    types.push(("S", scale.or(lists.first().copied()).unwrap_or(DType::F32)));
    let mut params: Vec<String> = (0..lists.len())
        .map(|q| format!("Dims ptrs{q}, Dims lens{q}, int count{q}"))
        .collect();
    params.push("u8* flag".into());
    if scale.is_some() {
        params.push("const TS* ps".into());
    }
    let mut body = String::new();
    for (q, (suffix, d)) in suffixes.iter().zip(lists).enumerate() {
        let (ty, loader) = (format!("C{suffix}"), format!("ld{suffix}"));
        let check = match scale {
            Some(_) => "m_mul_rn((CS)x, ldS(ps, 0))".to_string(),
            None => format!("(A{suffix})x"),
        };
        let x = Load {
            ty: &ty,
            name: "x",
            loader: &loader,
            ptr: "px",
            bytes: d.size_bytes(),
            at: At::Own,
        };
        // Unrolled over the list's limit: the Dims indexed by a variable would be
        // copied into local memory by every thread.
        body.push_str(&format!(
            "#pragma unroll\n\
             for (int t = 0; t < {MAX_RANK}; ++t) {{\n\
               if (t >= count{q}) break;\n\
               const T{suffix}* px = (const T{suffix}*)ptrs{q}.n[t]; const i64 n = lens{q}.n[t];\n{}}}\n",
            elementwise(&[x], &format!("if (!m_isfinite({check})) flag[0] = 0;"), &[])
        ));
    }
    module_multi(
        &types,
        &format!(
            "extern \"C\" __global__ void k({}) {{\n{body}}}\n",
            params.join(", ")
        ),
    )
}

pub fn increment_if(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const u8* f, const T* pc, T* py) {\n\
           C v = ld(pc, 0); if (f[0]) v = v + (C)1; st(py, 0, v);\n}\n",
    )
}

pub fn loss_scale_update(
    scale: DType,
    good: DType,
    interval: i64,
    growth: f64,
    backoff: f64,
) -> String {
    module_multi(
        &[("S", scale), ("G", good)],
        &format!(
            "extern \"C\" __global__ void k(const u8* f, const TS* ps, const TG* pg, TS* ps_out, TG* pg_out) {{\n\
               double s = (double)ldS(ps, 0), n = (double)ldG(pg, 0);\n\
               if (f[0]) {{ if (n + 1.0 >= (double){interval}) {{ s = s * {growth}; n = 0.0; }} else {{ n = n + 1.0; }} }}\n\
               else {{ s = fmax(s * {backoff}, 1.0); n = 0.0; }}\n\
               stS(ps_out, 0, (CS)s); stG(pg_out, 0, (CG)n);\n}}\n",
            growth = lit(growth),
            backoff = lit(backoff)
        ),
    )
}

/// The members of a grouped update one `k_group` launch takes, and the pointers of
/// each (an update's inputs and outputs): its table is a by-value kernel parameter,
/// 3.3 KiB of CUDA's 4 KiB.
pub const GROUP_MEMBERS: usize = 32;
pub const GROUP_POINTERS: usize = 12;

/// OptimizerUpdate. Arguments: flag, var, grad, [grad scale], slots..., [step], out
/// var, out slots..., [cast out], [lamb scratch, lamb sums], n. Skipped steps copy
/// the inputs. With `grad_scale` the gradient is multiplied by the scalar (of the
/// variable's dtype) first; with `cast_to` the kernel that writes the variable also
/// writes its cast (of the stored value, as a Cast kernel would). SGD and Adam
/// modules also have `k_group`, a GroupedOptimizerUpdate's kernel: block `m` updates
/// member `m`, whose arguments but `n` are row `m` of an `UpdateTable`.
#[allow(clippy::too_many_arguments)]
pub fn optimizer(
    var: DType,
    grad: DType,
    grad_scale: bool,
    step: Option<DType>,
    cast_to: Option<DType>,
    rule: Rule,
    lr: f64,
    wd: f64,
) -> String {
    let mut types = vec![("", var), ("G", grad)];
    if let Some(s) = step {
        types.push(("S", s));
    }
    if let Some(k) = cast_to {
        types.push(("K", k));
    }
    let (lr, wd) = (lit(lr), lit(wd));
    // LAMB's update needs the norms of the whole update: two grid loops of its own.
    let Rule::Lamb {
        beta1,
        beta2,
        epsilon,
    } = rule
    else {
        return module_multi(
            &types,
            &elementwise_update(var, grad, grad_scale, cast_to, rule, &lr, &wd),
        );
    };
    let (cp, cs) = match cast_to {
        Some(_) => (", TK* pk_out", " stK(pk_out, i, (CK)ld(pw_out, i));"),
        None => ("", ""),
    };
    let (grad_in, head) = if grad_scale {
        (
            "const TG* pg, const T* pgs",
            "C w = ld(pw, i); C g = m_mul_rn((C)ldG(pg, i), ld(pgs, 0));",
        )
    } else {
        ("const TG* pg", "C w = ld(pw, i); C g = (C)ldG(pg, i);")
    };
    let body = format!(
            "extern \"C\" __global__ void k(const u8* f, const T* pw, {grad_in}, const T* pm, const T* pv, const TS* ps, T* pm_out, T* pv_out, A* scratch, A* sums, i64 n) {{\n\
               double t = (double)ldS(ps, 0);\n\
               C c1 = (C)(1.0 - pow({b1}, t)), c2 = (C)(1.0 - pow({b2}, t));\n\
               C b1 = (C){b1}, b2 = (C){b2}, eps = (C){eps};\n\
               __shared__ A sh[32];\n\
               A ws = 0, us = 0;\n\
               GRID_LOOP(i, n) {{\n\
                 if (!f[0]) {{ pm_out[i] = pm[i]; pv_out[i] = pv[i]; continue; }}\n\
                 {head}\n\
                 C m = b1 * ld(pm, i) + ((C)1 - b1) * g;\n\
                 C v = b2 * ld(pv, i) + ((C)1 - b2) * g * g;\n\
                 C u = (m / c1) / (m_sqrt(v / c2) + eps) + (C){wd} * w;\n\
                 st(pm_out, i, m); st(pv_out, i, v); scratch[i] = (A)u;\n\
                 ws += (A)w * (A)w; us += (A)u * (A)u;\n\
               }}\n\
               ws = block_sum(ws, sh); us = block_sum(us, sh);\n\
               if (threadIdx.x == 0) {{ atomicAdd(&sums[0], ws); atomicAdd(&sums[1], us); }}\n}}\n\
             extern \"C\" __global__ void k_apply(const u8* f, const T* pw, const A* scratch, const A* sums, T* pw_out{cp}, i64 n) {{\n\
               A wn = m_sqrt(sums[0]), un = m_sqrt(sums[1]);\n\
               A trust = (wn > (A)0 && un > (A)0) ? wn / un : (A)1;\n\
               GRID_LOOP(i, n) {{\n\
                 if (!f[0]) {{ pw_out[i] = pw[i];{cs} continue; }}\n\
                 st(pw_out, i, (C)((A)ld(pw, i) - (A){lr} * trust * scratch[i]));{cs}\n\
               }}\n}}\n",
            b1 = lit(beta1),
            b2 = lit(beta2),
            eps = lit(epsilon),
        );
    module_multi(&types, &body)
}

/// The kernel of an SGD or Adam update on the vectorised [`elementwise`] loop (one
/// element per thread and a 4-byte load at a time kept the updates under 2.8 TB/s).
/// A skipped step (flag 0) writes the inputs back.
fn elementwise_update(
    var: DType,
    grad: DType,
    grad_scale: bool,
    cast_to: Option<DType>,
    rule: Rule,
    lr: &str,
    wd: &str,
) -> String {
    let own_grad = Load {
        ty: "C",
        name: "g_in",
        loader: "ldG",
        ptr: "pg",
        bytes: grad.size_bytes(),
        at: At::Own,
    };
    let mut loads = vec![own(var, "w", "pw"), own_grad];
    let mut stores = vec![store(var, "pw_out", "w_new")];
    // Per rule: the slot (and step) parameters, the outputs, code before the loop and
    // the loop's body, which sets w_new (and the slots' new values) where `ok`.
    let (slots, outs, setup, body) = match rule {
        Rule::Sgd { momentum, nesterov } if momentum != 0.0 => {
            loads.push(own(var, "b", "pb"));
            stores.push(store(var, "pb_out", "b_new"));
            let mo = lit(momentum);
            let step = if nesterov {
                format!("g + (C){mo} * b_new")
            } else {
                "b_new".into()
            };
            (
                "const T* pb, ",
                "T* pw_out, T* pb_out",
                String::new(),
                format!(
                    "C b_new = b;\n\
                     if (ok) {{ g = g + (C){wd} * w; b_new = (C){mo} * b + g; w_new = w - (C){lr} * ({step}); }}"
                ),
            )
        }
        Rule::Sgd { .. } => (
            "",
            "T* pw_out",
            String::new(),
            format!("if (ok) w_new = w - (C){lr} * (g + (C){wd} * w);"),
        ),
        Rule::Adam {
            beta1,
            beta2,
            epsilon,
            decoupled,
        } => {
            loads.push(own(var, "m", "pm"));
            loads.push(own(var, "v", "pv"));
            stores.push(store(var, "pm_out", "m_new"));
            stores.push(store(var, "pv_out", "v_new"));
            let (b1, b2, eps) = (lit(beta1), lit(beta2), lit(epsilon));
            let (coupled, decay) = if decoupled {
                (String::new(), format!("(C){wd} * w"))
            } else {
                (format!("g = g + (C){wd} * w;"), "(C)0".into())
            };
            (
                "const T* pm, const T* pv, const TS* ps, ",
                "T* pw_out, T* pm_out, T* pv_out",
                format!(
                    "const double t = (double)ldS(ps, 0);\n\
                     const C c1 = (C)(1.0 - pow({b1}, t)), c2 = (C)(1.0 - pow({b2}, t));\n"
                ),
                format!(
                    "C m_new = m, v_new = v;\n\
                     if (ok) {{\n\
                       {coupled}\n\
                       m_new = (C){b1} * m + ((C)1 - (C){b1}) * g;\n\
                       v_new = (C){b2} * v + ((C)1 - (C){b2}) * g * g;\n\
                       C update = (m_new / c1) / (m_sqrt(v_new / c2) + (C){eps});\n\
                       w_new = w - (C){lr} * (update + {decay});\n\
                     }}"
                ),
            )
        }
        Rule::Lamb { .. } => unreachable!("LAMB needs the norms of the whole update"),
    };
    // The cast is of the value as stored (rounded to the variable's type).
    let (cast_out, kept) = match cast_to {
        Some(k) => {
            stores.push(Store {
                storer: "stK",
                ptr: "pk_out",
                bytes: k.size_bytes(),
                value: "(CK)w_kept",
            });
            (
                ", TK* pk_out",
                "T w_t[1]; st(w_t, 0, w_new); const C w_kept = ld(w_t, 0);",
            )
        }
        None => ("", ""),
    };
    let (scale, gs, g) = if grad_scale {
        (
            "const T* pgs, ",
            "const C gs = ld(pgs, 0);\n",
            "m_mul_rn(g_in, gs)",
        )
    } else {
        ("", "", "g_in")
    };
    let params = format!("const u8* f, const T* pw, const TG* pg, {scale}{slots}{outs}{cast_out}");
    // The parameters' names, and each as k_group reads it from its table row.
    let declared: Vec<(&str, &str)> = params
        .split(',')
        .filter_map(|p| p.trim().rsplit_once(' '))
        .collect();
    let names: Vec<&str> = declared.iter().map(|(_, name)| *name).collect();
    let from_table: Vec<String> = declared
        .iter()
        .enumerate()
        .map(|(k, (ty, _))| format!("({ty})t.p[m][{k}]"))
        .collect();
    format!(
        "__device__ __forceinline__ void update({params}, i64 n, i64 block, i64 blocks) {{\n\
           const bool ok = f[0] != 0;\n\
           {gs}{setup}{loop}}}\n\
         extern \"C\" __global__ void k({params}, i64 n) {{ update({names}, n, blockIdx.x, gridDim.x); }}\n\
         struct UpdateTable {{ const void* p[{GROUP_MEMBERS}][{GROUP_POINTERS}]; i64 n[{GROUP_MEMBERS}]; }};\n\
         // A grouped update: block m updates member m (its pointers in row m).\n\
         extern \"C\" __global__ void k_group(const UpdateTable t) {{\n\
           const int m = blockIdx.x;\n\
           update({from_table}, t.n[m], 0, 1);\n}}\n",
        loop = elementwise_in(
            &loads,
            &format!("C g = {g}; C w_new = w;\n{body}\n{kept}"),
            &stores,
            ("block", "blocks"),
        ),
        names = names.join(", "),
        from_table = from_table.join(", "),
    )
}

/// `r_<dtype>(x)`: a compute value (float or double) rounded to a float dtype, in
/// that dtype's compute type. From double, 16-bit types round once, as the CPU does.
const ROUNDING: &str = r#"
__device__ __forceinline__ float r_f32(float x) { return x; }
__device__ __forceinline__ float r_f32(double x) { return (float)x; }
__device__ __forceinline__ float r_f16(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float r_f16(double x) { return __half2float(__double2half(x)); }
__device__ __forceinline__ float r_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float r_bf16(double x) { return __bfloat162float(__double2bfloat16(x)); }
__device__ __forceinline__ double r_f64(float x) { return (double)x; }
__device__ __forceinline__ double r_f64(double x) { return x; }
"#;

/// The compute type of a float dtype.
fn compute_type(d: DType) -> &'static str {
    if d == DType::F64 {
        "double"
    } else {
        "float"
    }
}

/// Index into a `view`-shaped input of element `var` (`i`, say) of the row-major
/// shape `into` (NumPy broadcasting; shapes are the program's, baked in).
fn broadcast_index(view: &[usize], into: &[usize], var: &str) -> String {
    let rank = into.len();
    let offset = rank - view.len().min(rank);
    let view_strides = strides(view);
    let terms: Vec<String> = (offset..rank)
        .filter(|&d| view[d - offset] != 1)
        .map(|d| {
            let inner: usize = into[d + 1..].iter().product();
            format!(
                "({var} / {inner} % {}) * {}",
                into[d],
                view_strides[d - offset]
            )
        })
        .collect();
    if terms.is_empty() {
        "0".into()
    } else {
        terms.join(" + ")
    }
}

/// A fused program as kernel source fragments: the module's dtypes (`I<k>` per input,
/// `O<o>` per output), the parameters (inputs, then outputs; `__restrict__`: a node's
/// output never shares memory with its inputs, and the column-sum kernels' row loop
/// may then load the next rows before storing this one), the body computing each
/// value `vj` of element `i` (in its compute type, rounded to its dtype as the unfused
/// op stored it; inputs with fewer elements read at their broadcast index), and the
/// streamed inputs (full-size, and broadcast along the last axis: [`row_broadcast`])
/// and the outputs.
struct FusedParts {
    types: Vec<(String, DType)>,
    params: Vec<String>,
    body: String,
    streamed: Vec<StreamedInput>,
    /// (storer, pointer, value name, stored bytes) of each output.
    outputs: Vec<(String, String, String, usize)>,
}

/// An input a fused kernel streams: bound as `ty name = loader(ptr, ...)` at `i`
/// itself (`rows: None`) or at its broadcast index along the last axis (`rows`: the
/// index at `i` and at `i0`).
struct StreamedInput {
    ty: &'static str,
    name: String,
    loader: String,
    ptr: String,
    bytes: usize,
    rows: Option<(String, String)>,
}

/// How input value `j` (of fewer elements than the domain) is broadcast, `(view,
/// into)`, when every use reads it at the same index and that index moves with the
/// element along the domain's last axis, whose length is a multiple of `v`. A vector
/// of `v` elements at `i0` then reads `v` consecutive values of the input, at most 16
/// bytes (a 16-byte aligned tensor holds such vectors aligned).
fn row_broadcast(p: &FusedElementwise, j: usize, v: usize) -> Option<(Vec<usize>, Vec<usize>)> {
    if p.instrs()[j].ty.dtype.size_bytes() * v > 16 {
        return None;
    }
    let mut uses = p
        .instrs()
        .iter()
        .enumerate()
        .flat_map(|(k, ins)| match &ins.expr {
            Expr::Apply(_, args) => (0..args.len())
                .filter(|&slot| args[slot] == j)
                .map(|slot| p.operand(k, slot))
                .collect(),
            Expr::Input(_) => Vec::new(),
        });
    let first = uses.next()?;
    if uses.any(|u| u != first) {
        return None;
    }
    let Operand::Broadcast { view, into, .. } = first else {
        return None;
    };
    let last = *into.last()?;
    (view.last() == Some(&last) && last % v == 0).then_some((view, into))
}

/// The inputs (numbers `k` of `in<k>`) a fused program's vector loops load in
/// vectors: those of the domain's size and those [`row_broadcast`] reads. A launch
/// choosing a vector kernel checks their alignment.
pub fn fused_streamed_inputs(p: &FusedElementwise) -> Vec<usize> {
    let (n, v) = (p.domain_len(), fused_vector(p));
    p.instrs()
        .iter()
        .enumerate()
        .filter_map(|(j, ins)| match ins.expr {
            Expr::Input(k)
                if ins.ty.checked_len() == Some(n) || row_broadcast(p, j, v).is_some() =>
            {
                Some(k)
            }
            _ => None,
        })
        .collect()
}

impl FusedParts {
    fn new(p: &FusedElementwise) -> FusedParts {
        let instrs = p.instrs();
        let (n, v) = (p.domain_len(), fused_vector(p));
        let mut parts = FusedParts {
            types: Vec::new(),
            params: Vec::new(),
            body: String::new(),
            streamed: Vec::new(),
            outputs: Vec::new(),
        };
        for ins in instrs {
            if let Expr::Input(k) = ins.expr {
                parts.types.push((format!("I{k}"), ins.ty.dtype));
                parts
                    .params
                    .push(format!("const TI{k}* __restrict__ in{k}"));
            }
        }
        for (o, &v) in p.outputs().iter().enumerate() {
            let dtype = instrs[v].ty.dtype;
            parts.types.push((format!("O{o}"), dtype));
            parts.params.push(format!("TO{o}* __restrict__ out{o}"));
            parts.outputs.push((
                format!("stO{o}"),
                format!("out{o}"),
                format!("v{v}"),
                dtype.size_bytes(),
            ));
        }
        let mut bound = vec![false; instrs.len()];
        for (j, ins) in instrs.iter().enumerate() {
            let ty = compute_type(ins.ty.dtype);
            let (op, args) = match &ins.expr {
                Expr::Input(k) => {
                    let rows = row_broadcast(p, j, v).map(|(view, into)| {
                        (
                            broadcast_index(&view, &into, "i"),
                            broadcast_index(&view, &into, "i0"),
                        )
                    });
                    // Other broadcast inputs are read where used.
                    if ins.ty.checked_len() == Some(n) || rows.is_some() {
                        bound[j] = true;
                        parts.streamed.push(StreamedInput {
                            ty,
                            name: format!("v{j}"),
                            loader: format!("ldI{k}"),
                            ptr: format!("in{k}"),
                            bytes: ins.ty.dtype.size_bytes(),
                            rows,
                        });
                    }
                    continue;
                }
                Expr::Apply(op, args) => (*op, args),
            };
            let operand = |slot: usize| match p.operand(j, slot) {
                Operand::Broadcast { input, view, into } if !bound[args[slot]] => {
                    format!(
                        "ldI{input}(in{input}, {})",
                        broadcast_index(&view, &into, "i")
                    )
                }
                _ => format!("v{}", args[slot]),
            };
            let names = ["a", "b", "c"];
            let mut block = format!("typedef {} C;", compute_type(instrs[args[0]].ty.dtype));
            for (slot, name) in names.iter().enumerate().take(args.len()) {
                block.push_str(&format!(" C {name} = {};", operand(slot)));
            }
            let compute = match op {
                ElementOp::Unary(kind) => format!("C x = a; {}", unary_expr(kind)),
                ElementOp::UnaryGrad(kind) => format!(
                    "C x = a; {}\n      C y = d == (C)0 ? d : d * b;",
                    derivative_expr(kind)
                ),
                ElementOp::Binary(kind) => format!("C y = {};", binary_expr(kind)),
                ElementOp::BinaryGrad(kind, wrt) => {
                    format!("C g = c; C y = {};", binary_grad_expr(kind, wrt))
                }
                ElementOp::BiasAdd(_) => "C y = a + b;".into(),
                ElementOp::Cast(_) => "C y = a;".into(),
            };
            parts.body.push_str(&format!(
                "    {ty} v{j};\n    {{ {block}\n      {compute}\n      v{j} = r_{}(y); }}\n",
                ins.ty.dtype
            ));
        }
        parts
    }

    fn loads(&self) -> Vec<Load<'_>> {
        self.streamed
            .iter()
            .map(|s| Load {
                ty: s.ty,
                name: &s.name,
                loader: &s.loader,
                ptr: &s.ptr,
                bytes: s.bytes,
                at: match &s.rows {
                    None => At::Own,
                    Some((at_i, at_i0)) => At::Rows(at_i, at_i0),
                },
            })
            .collect()
    }

    fn stores(&self) -> Vec<Store<'_>> {
        self.outputs
            .iter()
            .map(|(storer, ptr, value, bytes)| Store {
                storer,
                ptr,
                bytes: *bytes,
                value,
            })
            .collect()
    }
}

/// The elements per vector of a fused program's column-sum kernel `k_cols_part_vec`
/// (16 bytes of the widest tensor it streams: its full-size inputs and its outputs):
/// the launch takes it for rows whose length is a multiple of it. Read from the
/// program's types, not its generated source: the launch asks at every run.
pub fn fused_vector(p: &FusedElementwise) -> usize {
    let (instrs, n) = (p.instrs(), p.domain_len());
    let inputs = instrs
        .iter()
        .filter(|ins| matches!(ins.expr, Expr::Input(_)) && ins.ty.checked_len() == Some(n));
    let outputs = p.outputs().iter().map(|&v| &instrs[v]);
    let widest = inputs
        .chain(outputs)
        .map(|ins| ins.ty.dtype.size_bytes())
        .max();
    vector_len(widest.unwrap_or(1))
}

/// The kernels of a fused program. Without column sums, `k` over the elements `i` of
/// its domain ([`elementwise`]: the full-size inputs streamed in vectors); arguments:
/// the inputs, the outputs, then `n`. With column sums, [`column_sums`]' kernels over
/// the domain as `[rows, len]` rows of its last axis: each computes and stores the
/// outputs of the elements it reads and adds up the summed values as it goes (the
/// sums in `S`, f32 or f64), and `k_cols_part_vec` does the same moving vectors of
/// [`fused_vector`] elements of a row (aligned rows whose length is a multiple of
/// it). Its row loop is not unrolled: with 16-byte vectors a row is a long enough
/// stretch of loads and arithmetic, and unrolling only costs registers and so resident
/// blocks. The mlp's GELU gradient with its bias sum on a [8192, 4096] f16 matrix
/// (H100, alone): unrolled 4 times 103 us (54 registers), twice 102 (62), not at all
/// 83 (40); an f16 Add with its column sum 99, 100 and 82 (in the step: the GELU
/// gradient 98 -> 83 us).
pub fn fused(p: &FusedElementwise) -> String {
    let parts = FusedParts::new(p);
    let (loads, stores) = (parts.loads(), parts.stores());
    let params = parts.params.join(", ");
    let mut types: Vec<(&str, DType)> = parts.types.iter().map(|(s, d)| (s.as_str(), *d)).collect();
    let Some(&first_sum) = p.column_sums().first() else {
        return module_multi(
            &types,
            &format!(
                "{ROUNDING}extern \"C\" __global__ void k({params}, i64 n) {{\n{}}}\n",
                elementwise(&loads, &parts.body, &stores)
            ),
        );
    };
    types.push(("S", column_sum_dtype(p.instrs()[first_sum].ty.dtype)));
    let sums: Vec<String> = p
        .column_sums()
        .iter()
        .map(|v| format!("(AS)v{v}"))
        .collect();
    let Streams {
        v,
        fetch,
        bind_vec,
        put_vec,
        flush,
        bind_one,
        put_one,
        ..
    } = streams(&loads, &stores);
    let (width, count) = (32 * v, sums.len());
    let (mut accs, mut adds, mut shares, mut partials) =
        (String::new(), String::new(), String::new(), String::new());
    for (k, term) in sums.iter().enumerate() {
        accs.push_str(&format!("AS acc{k}[V] = {{}};\n"));
        adds.push_str(&format!("acc{k}[u] += {term}; "));
        shares.push_str(&format!(
            "for (int e = 0; e < V; ++e) sh[{k}][ty][tx * V + e] = acc{k}[e];\n"
        ));
        partials.push_str(&format!(
            "for (int e = 0; e < V; ++e) {{ AS s = 0; for (int w = 0; w < {COLUMN_ROWS}; ++w) s += sh[{k}][w][tx * V + e]; part[(chunk * {count} + {k}) * len + j + e] = s; }}\n"
        ));
    }
    let row_setup = format!("const i64 i = at; {bind_one}\n{}\n{put_one}", parts.body);
    let terms: Vec<&str> = sums.iter().map(String::as_str).collect();
    module_multi(
        &types,
        &format!(
            "{ROUNDING}{}extern \"C\" __global__ void k_cols_part_vec({params}, AS* part, i64 rows, i64 len, i64 chunk_rows) {{\n\
               constexpr int V = {v};\n\
               __shared__ AS sh[{count}][{COLUMN_ROWS}][{width}];\n\
               int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
               i64 tiles = (len + {width} - 1) / {width};\n\
               i64 j = (blockIdx.x % tiles) * {width} + tx * V, chunk = blockIdx.x / tiles;\n\
               i64 end = min(rows, (chunk + 1) * chunk_rows);\n\
               {accs}\
               if (j < len) {{\n\
                 #pragma unroll 1\n\
                 for (i64 row = chunk * chunk_rows + ty; row < end; row += {COLUMN_ROWS}) {{\n\
                   const i64 i0 = row * len + j;\n\
                   {fetch}\
                   #pragma unroll\n\
                   for (int u = 0; u < V; ++u) {{ const i64 i = i0 + u; {bind_vec}\n{body}\n{put_vec} {adds}}}\n\
                   {flush}\
                 }}\n\
               }}\n\
               {shares}\
               __syncthreads();\n\
               if (ty == 0 && j < len) {{\n{partials}}}\n\
             }}\n",
            column_sums(&params, &row_setup, &terms, "S"),
            body = parts.body,
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
pub fn fused_softmax(op: &FusedSoftmax, per: usize) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::attrs::{AttrMap, AttrReader, AttrValue};
    use ampgraph_graph::ops::parse_op;

    fn program(text: &str, outputs: Vec<i64>) -> FusedElementwise {
        let mut attrs = AttrMap::new();
        attrs.insert("program".into(), AttrValue::Str(text.into()));
        attrs.insert("outputs".into(), AttrValue::Ints(outputs));
        let op = parse_op("FusedElementwise", AttrReader::new(attrs)).unwrap();
        op.downcast_ref::<FusedElementwise>().unwrap().clone()
    }

    #[test]
    fn broadcast_index_follows_numpy_rules() {
        assert_eq!(broadcast_index(&[6], &[4, 6], "i"), "(i / 1 % 6) * 1");
        assert_eq!(broadcast_index(&[4, 1], &[4, 6], "i"), "(i / 6 % 4) * 1");
        assert_eq!(
            broadcast_index(&[3, 1, 1], &[2, 3, 4, 5], "i"),
            "(i / 20 % 3) * 1"
        );
        assert_eq!(broadcast_index(&[], &[4, 6], "i"), "0");
        assert_eq!(broadcast_index(&[1, 1], &[4, 6], "i"), "0");
    }

    /// The launch's vector width is the one the column-sum kernel was generated with:
    /// f16 streams move 8, an f32 input or output 4, an f64 one 2; a broadcast input
    /// does not count.
    #[test]
    fn fused_vector_is_the_generated_kernels() {
        for (text, outputs, want) in [
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f32[16]; v2 = Cast<to=f32>(v0): f32[8, 16]; \
                 v3 = BiasAdd<data_format=NHWC>(v2, v1): f32[8, 16]; v4 = Cast<to=f16>(v3): f16[8, 16]",
                vec![4],
                8,
            ),
            (
                "v0 = in0: f32[8, 16]; v1 = Cast<to=f16>(v0): f16[8, 16]",
                vec![1],
                4,
            ),
            ("v0 = in0: f16[8, 16]; v1 = Cast<to=f64>(v0): f64[8, 16]", vec![1], 2),
        ] {
            let p = program(text, outputs).with_column_sums(vec![0]).unwrap();
            assert_eq!(fused_vector(&p), want, "{text}");
            assert!(
                fused(&p).contains(&format!("constexpr int V = {want};")),
                "{text}"
            );
        }
    }

    /// Broadcast inputs move in vectors where every use reads them along the last
    /// axis in whole vectors of at most 16 bytes; the launch checks those inputs'
    /// alignment with the full-size ones'.
    #[test]
    fn row_broadcasts_are_streamed_in_vectors() {
        for (text, want) in [
            // f16 vectors of 8: a [16] row bias streams, a [8, 1] column does not.
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f16[16]; v2 = Add(v0, v1): f16[8, 16]; \
                 v3 = in2: f16[8, 1]; v4 = Mul(v2, v3): f16[8, 16]",
                vec![0, 1],
            ),
            // An f32 row under f16 vectors of 8 would be 32 bytes a vector.
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f32[16]; v2 = Cast<to=f32>(v0): f32[8, 16]; \
                 v3 = Add(v2, v1): f32[8, 16]; v4 = Cast<to=f16>(v3): f16[8, 16]",
                vec![0],
            ),
            // Rows of 12 are not whole vectors of 8.
            (
                "v0 = in0: f16[8, 12]; v1 = in1: f16[12]; v2 = Add(v0, v1): f16[8, 12]",
                vec![0],
            ),
            // Read at two different indices: along the rows and along the channels.
            (
                "v0 = in0: f32[2, 4, 4]; v1 = in1: f32[4]; v2 = Add(v0, v1): f32[2, 4, 4]; \
                 v3 = BiasAdd<data_format=NCHW>(v2, v1): f32[2, 4, 4]",
                vec![0],
            ),
        ] {
            // The last value is the output.
            let last = text.matches("; ").count() as i64;
            let p = program(text, vec![last]);
            assert_eq!(fused_streamed_inputs(&p), want, "{text}");
            let source = fused(&p);
            for k in &want[1..] {
                assert!(source.contains(&format!("s_in{k}.v")), "{text}");
            }
        }
    }

    #[test]
    fn fused_source_rounds_each_value_and_stores_each_output() {
        let p = program(
            "v0 = in0: f32[4, 6]; v1 = in1: f32[6]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[4, 6]; \
             v3 = Relu(v2): f32[4, 6]; v4 = Cast<to=f16>(v3): f16[4, 6]; v5 = in2: f16[]; \
             v6 = Mul(v4, v5): f16[4, 6]; v7 = UnaryGrad<kind=Tanh>(v6, v4): f16[4, 6]",
            vec![3, 7],
        );
        let src = fused(&p);
        for want in [
            "void k(const TI0* __restrict__ in0, const TI1* __restrict__ in1, const TI2* __restrict__ in2, TO0* __restrict__ out0, TO1* __restrict__ out1, i64 n)",
            "s_in0 = *(const VEC_T(in0, V)*)(in0 + i0);",
            "float v0 = ldI0(s_in0.v, u);",
            "float v0 = ldI0(in0, i);",
            "C b = ldI1(in1, (i / 1 % 6) * 1);",
            "v2 = r_f32(y);",
            "m_max(x, (C)0)",
            "v4 = r_f16(y);",
            "C b = ldI2(in2, 0);",
            "C y = d == (C)0 ? d : d * b;",
            "stO0(out0, i, v3);",
            "stO1(out1, i, v7);",
            "stO1(s_out1.v, u, v7);",
            "*(VEC_T(out1, V)*)(out1 + i0) = s_out1;",
            // 16 bytes of f32 at a time.
            "constexpr int V = 4;",
        ] {
            assert!(src.contains(want), "missing `{want}` in\n{src}");
        }
        // Broadcast inputs are not loaded at the domain index.
        assert!(!src.contains("ldI1(in1, i)"), "{src}");
    }
}

/// Every kind of generated kernel, in every dtype it serves, must at least parse: with
/// no GPU in CI, a C++ compiler and stand-ins for the CUDA declarations catch a broken
/// template (a stray brace, an undeclared name) before a GPU run does.
#[cfg(test)]
mod parse_tests {
    use super::*;
    use ampgraph_graph::attrs::{AttrMap, AttrReader, AttrValue};
    use ampgraph_graph::ops::parse_op;
    use std::path::Path;
    use std::process::Command;

    /// The CUDA names the kernels use, declared for a host C++ compiler.
    const CUDA_STANDINS: &str = r#"
#include <math.h>
#include <cmath>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)
struct dim3_ { unsigned x, y, z; };
extern dim3_ threadIdx, blockIdx, blockDim, gridDim;
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
float __half2float(__half); __half __float2half_rn(float); __half __double2half(double);
float __bfloat162float(__nv_bfloat16); __nv_bfloat16 __float2bfloat16_rn(float);
__nv_bfloat16 __double2bfloat16(double);
float __int_as_float(int); float __expf(float);
float __fmul_rn(float, float); float __fmaf_rn(float, float, float); double __dmul_rn(double, double);
template <class T> T __shfl_xor_sync(unsigned, T, int);
template <class T> T atomicAdd(T*, T);
void __syncthreads();
struct uint4 { unsigned x, y, z, w; };
uint4 make_uint4(unsigned, unsigned, unsigned, unsigned);
#define __launch_bounds__(...)
struct __half2 { unsigned x; };
struct __nv_bfloat162 { unsigned x; };
__half2 __floats2half2_rn(float, float); __nv_bfloat162 __floats2bfloat162_rn(float, float);
using std::isnan; using std::isfinite;
inline long long min(long long a, long long b) { return a < b ? a : b; }
"#;

    fn fused_program(text: &str, outputs: Vec<i64>) -> FusedElementwise {
        let mut attrs = AttrMap::new();
        attrs.insert("program".into(), AttrValue::Str(text.into()));
        attrs.insert("outputs".into(), AttrValue::Ints(outputs));
        let op = parse_op("FusedElementwise", AttrReader::new(attrs)).unwrap();
        op.downcast_ref::<FusedElementwise>().unwrap().clone()
    }

    fn every_kind_of_kernel() -> Vec<(String, String)> {
        let mut k: Vec<(String, String)> = Vec::new();
        for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let gelu = UnaryKind::Gelu { approximate: false };
            let tanh_gelu = UnaryKind::Gelu { approximate: true };
            k.extend([
                (format!("unary_{d}"), unary(d, gelu)),
                (format!("unary_selu_{d}"), unary(d, UnaryKind::Selu)),
                (format!("unary_grad_{d}"), unary_grad(d, tanh_gelu)),
                (format!("binary_{d}"), binary(d, BinaryKind::Maximum)),
                (
                    format!("binary_grad_{d}"),
                    binary_grad(d, BinaryKind::Pow, 1),
                ),
                (format!("bias_add_{d}"), bias_add(d)),
                (format!("broadcast_div_{d}"), broadcast_div(d)),
                (format!("reduce_mean_{d}"), reduce(d, d, ReduceKind::Mean)),
                (
                    format!("reduce_max_{d}"),
                    reduce(d, DType::F64, ReduceKind::Max),
                ),
                (format!("reduce_max_grad_{d}"), reduce_max_grad(d)),
                (format!("column_sum_{d}"), column_sum(d, d)),
                (format!("column_sum_{d}_f64"), column_sum(d, DType::F64)),
                (format!("log_softmax_{d}"), softmax(d, true, 4)),
                (format!("softmax_{d}"), softmax(d, false, 32)),
                (format!("softmax_grad_{d}"), softmax_grad(d, false, 8)),
                (format!("log_softmax_grad_{d}"), softmax_grad(d, true, 1)),
                (
                    format!("layer_norm_{d}"),
                    layer_norm(NormTypes::uniform(d), 1e-5, 32),
                ),
                (
                    format!("layer_norm_grad_{d}"),
                    layer_norm_grad_rows(
                        NormTypes::uniform(d),
                        1e-5,
                        32,
                        NormGradEpilogue::default(),
                    ),
                ),
                (
                    format!("layer_norm_grad_residual_{d}"),
                    layer_norm_grad_rows(
                        NormTypes::uniform(d),
                        1e-5,
                        24,
                        NormGradEpilogue {
                            residual: true,
                            sum_dx: true,
                            sum_residual: true,
                        },
                    ),
                ),
                (
                    format!("layer_norm_grad_residual_short_{d}"),
                    layer_norm_grad_rows(
                        NormTypes::uniform(d),
                        1e-5,
                        1,
                        NormGradEpilogue {
                            residual: true,
                            ..NormGradEpilogue::default()
                        },
                    ),
                ),
                (
                    format!("layer_norm_grad_block_{d}"),
                    layer_norm_grad_block(NormTypes::uniform(d), 1e-5, true),
                ),
                (format!("sce_{d}"), sce(d, DType::I64)),
                (format!("sce_grad_{d}"), sce_grad(d, DType::I32)),
                (
                    format!("sce_with_grad_{d}"),
                    sce_with_grad(d, d, d, DType::I32, None),
                ),
                (
                    format!("sce_with_grad_summed_{d}"),
                    sce_with_grad(DType::F16, d, DType::F16, DType::I64, Some(1000)),
                ),
                (format!("all_finite_{d}"), all_finite(&[d], None)),
                (
                    format!("all_finite_scaled_{d}"),
                    all_finite(&[d, DType::F32], Some(DType::F32)),
                ),
                (format!("increment_if_{d}"), increment_if(d)),
            ]);
            let rules = [
                Rule::PLAIN_SGD,
                Rule::Sgd {
                    momentum: 0.9,
                    nesterov: true,
                },
                Rule::Adam {
                    beta1: 0.9,
                    beta2: 0.999,
                    epsilon: 1e-8,
                    decoupled: true,
                },
                Rule::Lamb {
                    beta1: 0.9,
                    beta2: 0.999,
                    epsilon: 1e-6,
                },
            ];
            for (r, rule) in rules.into_iter().enumerate() {
                for scaled in [false, true] {
                    let cast = scaled.then_some(DType::F16);
                    let src = optimizer(
                        DType::F32,
                        d,
                        scaled,
                        Some(DType::I64),
                        cast,
                        rule,
                        1e-3,
                        1e-2,
                    );
                    k.push((format!("optimizer_{r}_{d}_{scaled}"), src));
                }
            }
        }
        for (from, to) in [
            (DType::F16, DType::F32),
            (DType::F32, DType::Bool),
            (DType::I64, DType::F16),
            (DType::BF16, DType::I32),
        ] {
            k.push((format!("cast_{from}_{to}"), cast(from, to)));
        }
        for bytes in [1, 2, 4, 8, 16] {
            k.push((format!("gather_{bytes}"), gather(bytes)));
        }
        k.push(("concat".into(), concat(2)));
        use super::super::attention::{NARROW, WIDE};
        for (d, head_dim, shape, causal, key_bias) in [
            (DType::F16, 64, WIDE, false, false),
            (DType::BF16, 32, NARROW, false, true),
            (DType::F16, 128, NARROW, true, false),
            (DType::F16, 64, WIDE, true, true),
        ] {
            k.push((
                format!("attention_{d}_{head_dim}_{causal}_{key_bias}"),
                super::super::attention::source(d, head_dim, shape, (causal, key_bias)),
            ));
        }
        // Casts folded into the normalisations: f16 x and dy, f32 math, f16 or f32 out.
        for y in [DType::F16, DType::F32] {
            let types = NormTypes {
                params: DType::F32,
                x: DType::F16,
                dy: DType::BF16,
                y,
            };
            k.push((format!("layer_norm_mixed_{y}"), layer_norm(types, 1e-5, 8)));
            k.push((
                format!("layer_norm_grad_mixed_{y}"),
                layer_norm_grad_rows(types, 1e-5, 8, NormGradEpilogue::default()),
            ));
            k.push((
                format!("layer_norm_grad_block_mixed_{y}"),
                layer_norm_grad_block(types, 1e-5, false),
            ));
        }
        k.push(("fill_flag".into(), fill_flag()));
        k.push((
            "loss_scale_update".into(),
            loss_scale_update(DType::F32, DType::I64, 2000, 2.0, 0.5),
        ));
        let programs = [
            (
                "v0 = in0: f32[4, 6]; v1 = in1: f32[6]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[4, 6]; \
                 v3 = Relu(v2): f32[4, 6]; v4 = Cast<to=f16>(v3): f16[4, 6]; v5 = in2: f16[]; \
                 v6 = Mul(v4, v5): f16[4, 6]; v7 = UnaryGrad<kind=Tanh>(v6, v4): f16[4, 6]",
                vec![3, 7],
            ),
            (
                "v0 = in0: bf16[4, 6]; v1 = in1: bf16[4, 1]; v2 = BinaryGrad<kind=Div, wrt=1>(v0, v1, v0): bf16[4, 6]; \
                 v3 = Cast<to=f64>(v2): f64[4, 6]; v4 = Gelu<approximate=true>(v3): f64[4, 6]; \
                 v5 = Cast<to=f16>(v4): f16[4, 6]",
                vec![5],
            ),
        ];
        for (i, (text, outputs)) in programs.into_iter().enumerate() {
            k.push((format!("fused_{i}"), fused(&fused_program(text, outputs))));
        }
        // Column sums: an f16 GELU gradient summed in f32 (with a summed input), f64, and
        // a row bias.
        let sums = [
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f16[8, 16]; \
                 v2 = UnaryGrad<kind=Gelu, approximate=false>(v0, v1): f16[8, 16]",
                vec![2],
                vec![2, 0],
            ),
            (
                "v0 = in0: f64[2, 3, 4]; v1 = Exp(v0): f64[2, 3, 4]",
                vec![1],
                vec![1],
            ),
            // A bias along the rows, loaded in vectors.
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f16[16]; v2 = Add(v0, v1): f16[8, 16]",
                vec![2],
                vec![2],
            ),
        ];
        for (i, (text, outputs, summed)) in sums.into_iter().enumerate() {
            let p = fused_program(text, outputs)
                .with_column_sums(summed)
                .unwrap();
            k.push((format!("fused_sums_{i}"), fused(&p)));
        }
        // Softmax prologues: f16 scores scaled, an f32 mask added (vectors of 4), and
        // bf16 widened to f64 (a log-softmax).
        let prologues = [
            (
                "v0 = in0: f16[2, 4, 64]; v1 = in1: f16[]; v2 = Mul(v0, v1): f16[2, 4, 64]; \
                 v3 = Cast<to=f32>(v2): f32[2, 4, 64]; v4 = in2: f32[4, 64]; \
                 v5 = Add(v3, v4): f32[2, 4, 64]",
                5,
                false,
            ),
            (
                "v0 = in0: bf16[3, 40]; v1 = Cast<to=f64>(v0): f64[3, 40]",
                1,
                true,
            ),
        ];
        for (i, (text, value, log)) in prologues.into_iter().enumerate() {
            let op = FusedSoftmax::new(-1, log, fused_program(text, vec![value])).unwrap();
            k.push((format!("fused_softmax_{i}"), fused_softmax(&op, 2)));
        }
        k
    }

    /// Whether `source` parses; the compiler's complaint otherwise.
    fn parses(cxx: &str, dir: &Path, name: &str, source: &str) -> Result<(), String> {
        let file = dir.join(format!("{name}.cu"));
        std::fs::write(&file, source).map_err(|e| e.to_string())?;
        let out = Command::new(cxx)
            .args(["-std=c++17", "-fsyntax-only", "-x", "c++", "-I"])
            .arg(dir)
            .arg("-include")
            .arg(dir.join("cuda_standins.h"))
            .arg(&file)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{name}: {}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// With `AMPGRAPH_DUMP_KERNELS=DIR`, writes one source of every kind of kernel to
    /// DIR/<name>.cu, for `nvcc -arch=sm_90 --fmad=false -Xptxas -v -c` on the GPU
    /// machine (registers, spills) or a microbenchmark; otherwise does nothing.
    #[test]
    fn dump_kernels_when_asked() {
        let Some(dir) = std::env::var_os("AMPGRAPH_DUMP_KERNELS") else {
            return;
        };
        let dir = Path::new(&dir);
        std::fs::create_dir_all(dir).unwrap();
        for (name, source) in every_kind_of_kernel() {
            std::fs::write(dir.join(format!("{name}.cu")), source).unwrap();
        }
    }

    #[test]
    fn every_generated_kernel_parses() {
        let Some(cxx) = ["c++", "g++", "clang++"]
            .into_iter()
            .find(|c| Command::new(c).arg("--version").output().is_ok())
        else {
            println!("skipping: no C++ compiler to parse the kernels with");
            return;
        };
        let dir = std::env::temp_dir().join(format!("ampgraph-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for header in ["cuda_fp16.h", "cuda_bf16.h"] {
            std::fs::write(dir.join(header), "").unwrap();
        }
        std::fs::write(dir.join("cuda_standins.h"), CUDA_STANDINS).unwrap();
        let kernels = every_kind_of_kernel();
        let half = kernels.len() / 2;
        let (first, second) = kernels.split_at(half);
        let check = |part: &[(String, String)]| -> Vec<String> {
            part.iter()
                .filter_map(|(name, src)| parses(cxx, &dir, name, src).err())
                .collect()
        };
        let failures: Vec<String> = std::thread::scope(|s| {
            let other = s.spawn(|| check(second));
            let mut f = check(first);
            f.extend(other.join().unwrap());
            f
        });
        let _ = std::fs::remove_dir_all(&dir);
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(kernels.len() > 100);
    }
}
