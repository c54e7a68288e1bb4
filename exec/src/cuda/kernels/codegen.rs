//! What the kernel generators share: the prelude every module starts with, the
//! typedefs and load/store helpers of a dtype, elementwise loops that move 16-byte
//! vectors, and the warp-row and column-sum pieces of the row kernels.
//!
//! Every kernel loads its inputs into the compute type (`float` for f32/f16/bf16,
//! `double` for f64), computes there and rounds once on store, as the CPU reference
//! kernels do. Op attributes (alphas, learning rates, epsilons) are baked into the
//! source as literals; shapes and strides are kernel arguments, so one compiled module
//! serves every shape. Block reductions accumulate in the compute type (f32 for the
//! 16-bit types).

use ampgraph_graph::DType;

pub(crate) use crate::cuda::device::MAX_RANK;

/// A C literal for an f64 constant (the one the elementwise ops' expressions use).
pub(crate) use ampgraph_graph::ops::elementwise::cuda_lit as lit;

pub(crate) const PRELUDE: &str = r#"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef long long i64;
typedef unsigned char u8;
#define F_NAN __int_as_float(0x7fc00000)
#define F_INF __int_as_float(0x7f800000)
struct Dims { i64 n[8]; };

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double m_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
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
// Dropout's mask (graph/src/ops/dropout.rs, bit for bit): element i of the splitmix64
// stream keyed by the seed and the step count, its high 32 bits against the threshold.
__device__ __forceinline__ unsigned long long m_mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
template <class C> __device__ __forceinline__ bool m_dropout_keeps(unsigned long long seed, C count, i64 i, unsigned long long threshold) {
  const unsigned long long c = count > (C)0 ? (unsigned long long)count : 0ull;
  const unsigned long long key = m_mix64(seed ^ (c * 0xD1B54A32D192ED03ull));
  return (m_mix64(key + (unsigned long long)i * 0x9E3779B97F4A7C15ull) >> 32) >= threshold;
}
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
// m_erf_clamped leaves out the NaN select: a NaN x gives a finite value. GELU and
// its gradient take it so (their results have x, or x's density, as a factor and are
// NaN where x is), two instructions an element fewer in kernels bound by issue.
__device__ __forceinline__ float m_erf_clamped(float x0) {
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
  return p * m_rcp_approx(q);
}
__device__ __forceinline__ float m_erf(float x0) {
  const float y = m_erf_clamped(x0);
  return isnan(x0) ? x0 : y;
}
__device__ __forceinline__ double m_erf_clamped(double x) { return erf(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
// a b + c rounded once (the kernels are built without contraction: where a rounding
// step may go, it is written out).
__device__ __forceinline__ float m_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double m_fma(double a, double b, double c) { return __fma_rn(a, b, c); }
// GELU by erf, `h + h erf(x / sqrt 2)` with `h = x / 2` (one fused multiply-add for
// the product and the sum).
template <typename F> __device__ __forceinline__ F m_gelu(F x) {
  const F h = (F)0.5 * x;
  return m_fma(h, m_erf_clamped(x * (F)7.071067811865476e-1), h);
}
// The standard normal density (GELU's gradient) by one hardware base-2 exponential:
// `2^(x^2 K + L)`, `K = -log2(e) / 2`, `L = log2(1 / sqrt(2 pi))`, the exponent one
// fused multiply-add. Within a few ulp of float64 where it is above 2^-126 (a 16-bit
// result cannot see them); 0 below, where f32 went on through its subnormals (the
// gradient then is the cdf, as for an underflowed density). __expf's product, its
// subnormal guard and the scaling by `1 / sqrt(2 pi)` had cost five more
// instructions an element, of the FP8 gradient casts bound by instruction issue.
__device__ __forceinline__ float m_normal_pdf(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmaf_rn(x * x, -7.213475204444817e-1f, -1.3257480647361594f)));
  return e;
}
__device__ __forceinline__ double m_normal_pdf(double x) { return exp(-0.5 * x * x) * 3.989422804014327e-1; }
// tanh-GELU as `x s`, `s = 1 / (1 + e)`, `e = exp(-2u)` (graph/src/ops/elementwise/kinds.rs
// says why), and its derivative from the same `e` and `s`. `u = c (x + k x^3)`, so
// `e = 2^(x (K1 + K2 x^2))` with `K1 = -2 c log2(e)`, `K2 = K1 k`, and the derivative's
// tail `2 c x s^2 e (1 + 3 k x^2) = s^2 e x (K3 + K4 x^2)`: the constants folded, `x^2`
// shared, five fewer products an element of the gradient. In f32 the exponential and
// the reciprocal are the hardware's approximations: the value within a few ulp of
// float64 above -1, more below (the exponent's argument, rounded, grows there);
// tanhf's 22 instructions an element had bound the FP8 casts computing them.
__device__ __forceinline__ float m_gelu_tanh_e(float x, float x2) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * (-2.302208198144325f + -1.029432395800235e-1f * x2)));
  return e;
}
__device__ __forceinline__ double m_gelu_tanh_e(double x, double x2) {
  return exp2(x * (-2.302208198144325 + -1.029432395800235e-1 * x2));
}
__device__ __forceinline__ float m_over(float x, float d) { return x * m_rcp_approx(d); }
__device__ __forceinline__ double m_over(double x, double d) { return x / d; }
template <typename F> __device__ __forceinline__ F m_gelu_tanh(F x) {
  return m_over(x, (F)1 + m_gelu_tanh_e(x, x * x));
}
template <typename F> __device__ __forceinline__ F m_gelu_tanh_grad(F x) {
  const F x2 = x * x, e = m_gelu_tanh_e(x, x2), s = m_over((F)1, (F)1 + e), slope = e * s * s;
  const F tail = (slope == (F)0 || s == (F)0) ? (F)0
      : slope * x * ((F)1.5957691216057308 + (F)2.1406444881780076e-1 * x2);
  return s + tail;
}
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
pub(crate) fn type_parts(d: DType) -> (&'static str, &'static str, &'static str, &'static str) {
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
        // cuda_fp8.h's types (their conversion from float is `cvt.rn.satfinite`): only
        // the FP8 family's modules, which include that header, use them.
        DType::F8E4M3 => (
            "__nv_fp8_e4m3",
            "float",
            "(float)p[i]",
            "p[i] = __nv_fp8_e4m3(v)",
        ),
        DType::F8E5M2 => (
            "__nv_fp8_e5m2",
            "float",
            "(float)p[i]",
            "p[i] = __nv_fp8_e5m2(v)",
        ),
    }
}

/// Typedefs `T<s>`, `C<s>` (compute) and `A<s>` (accumulator) and `ld<s>`/`st<s>`.
pub(crate) fn type_block(suffix: &str, d: DType) -> String {
    let (t, c, ld, st) = type_parts(d);
    let a = if d == DType::F64 { "double" } else { "float" };
    format!(
        "typedef {t} T{suffix}; typedef {c} C{suffix}; typedef {a} A{suffix};\n\
         __device__ __forceinline__ C{suffix} ld{suffix}(const T{suffix}* p, i64 i) {{ return {ld}; }}\n\
         __device__ __forceinline__ void st{suffix}(T{suffix}* p, i64 i, C{suffix} v) {{ {st}; }}\n"
    )
}

/// A module of one dtype (unsuffixed `T`, `C`, `A`, `ld`, `st`) and `body`.
pub(crate) fn module(d: DType, body: &str) -> String {
    format!("{PRELUDE}{}{body}", type_block("", d))
}

/// A module with several named dtypes (`T<suffix>` ...).
pub(crate) fn module_multi(types: &[(&str, DType)], body: &str) -> String {
    let mut s = PRELUDE.to_string();
    for (suffix, d) in types {
        s.push_str(&type_block(suffix, *d));
    }
    s.push_str(body);
    s
}

/// The asynchronous copies into shared memory (`cp.async`, compute capability 8.0):
/// `copy_async` (16 bytes, or the first `bytes` and zeros), `copy_async4`, `commit`
/// and `wait<n>`. A macro for `concat!`, so the modules that hold them keep their
/// source text (and the kernel cache its entries).
macro_rules! copy_async_source {
    () => {
        r#"// Copies 16 bytes (or `bytes` < 16, 4 or 0: zeros past the end) to shared memory, in
// the background (cp.async); `commit` closes a group, `wait<n>` waits for all but n.
__device__ __forceinline__ void copy_async(void* sm, const void* x, int bytes) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;"
               :: "r"((unsigned)__cvta_generic_to_shared(sm)), "l"(x), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void copy_async4(void* sm, const void* x, bool in) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
               :: "r"((unsigned)__cvta_generic_to_shared(sm)), "l"(x), "r"(in ? 4 : 0) : "memory");
#endif
}
__device__ __forceinline__ void commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int n> __device__ __forceinline__ void wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" :: "n"(n) : "memory");
#endif
}
"#
    };
}
pub(crate) use copy_async_source;

/// Elements each thread of an [`elementwise`] kernel takes per grid step, at most
/// (16 bytes of its widest streamed type): the launch sizes its grid by it.
pub(crate) const VECTOR: usize = 8;

/// Where an elementwise kernel reads one of its inputs for element `i`.
pub(crate) enum At<'a> {
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
pub(crate) struct Load<'a> {
    pub(crate) ty: &'a str,
    pub(crate) name: &'a str,
    pub(crate) loader: &'a str,
    pub(crate) ptr: &'a str,
    /// Bytes of the stored element (sizes the vectors).
    pub(crate) bytes: usize,
    pub(crate) at: At<'a>,
}

/// An output of an elementwise kernel: `storer(ptr, i, value)`, always at `i`.
pub(crate) struct Store<'a> {
    pub(crate) storer: &'a str,
    pub(crate) ptr: &'a str,
    pub(crate) bytes: usize,
    pub(crate) value: &'a str,
}

/// Elements a vector of an elementwise loop moves when its widest streamed type has
/// `widest` bytes: 16 bytes of it, at most [`VECTOR`] elements.
pub(crate) fn vector_len(widest: usize) -> usize {
    (16 / widest.max(1)).clamp(1, VECTOR)
}

/// What an elementwise loop streams, as source fragments: per vector of `v` elements
/// at `i0`, the inputs' loads and outputs' declarations (`fetch`), each element `u`
/// bound (`bind_vec`) and put (`put_vec`), then the outputs' stores (`flush`); per
/// element `i` alone, `bind_one` and `put_one`. `aligned` tests every streamed pointer.
pub(crate) struct Streams {
    pub(crate) v: usize,
    pub(crate) aligned: String,
    pub(crate) fetch: String,
    pub(crate) bind_vec: String,
    pub(crate) put_vec: String,
    pub(crate) flush: String,
    pub(crate) bind_one: String,
    pub(crate) put_one: String,
}

pub(crate) fn streams(loads: &[Load], stores: &[Store]) -> Streams {
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
pub(crate) fn elementwise(loads: &[Load], body: &str, stores: &[Store]) -> String {
    elementwise_in(loads, body, stores, ("blockIdx.x", "gridDim.x"))
}

/// [`elementwise`]'s loop with the blocks in reverse order, so that the pass starts at
/// the end of its tensors: after a pass that swept them from the start (batch norm's
/// statistics), the first reads find the L2 cache's contents.
pub(crate) fn elementwise_from_end(loads: &[Load], body: &str, stores: &[Store]) -> String {
    elementwise_in(
        loads,
        body,
        stores,
        ("(gridDim.x - 1 - blockIdx.x)", "gridDim.x"),
    )
}

/// [`elementwise`]'s loop as run by block `block` of `blocks` (expressions): a
/// grouped kernel runs each member's loop in blocks of its own.
pub(crate) fn elementwise_in(
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
pub(crate) fn own<'a>(d: DType, name: &'a str, ptr: &'a str) -> Load<'a> {
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
pub(crate) fn store<'a>(d: DType, ptr: &'a str, value: &'a str) -> Store<'a> {
    Store {
        storer: "st",
        ptr,
        bytes: d.size_bytes(),
        value,
    }
}

/// The unsigned type of a byte width, for kernels that only move data.
pub(crate) fn word(bytes: usize) -> &'static str {
    match bytes {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        _ => "uint4",
    }
}

/// The longest softmax row a warp holds in registers (`k_warp`), and the values per
/// lane a row of `len` needs there (a power of two, so few variants compile).
pub(crate) const WARP_ROW_MAX: usize = 1024;

pub(crate) fn warp_row_values(len: usize) -> usize {
    len.div_ceil(32).next_power_of_two()
}

/// The loop of a warp-per-row kernel: each warp takes rows `row` of `len` values
/// (`len <= 32 * per`), lane `lane` holding values `lane + 32 t`.
pub(crate) fn warp_rows(body: &str) -> String {
    format!(
        "int lane = threadIdx.x & 31;\n\
         for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows; row += (i64)gridDim.x * (blockDim.x >> 5)) {{\n\
           i64 base = row * len;\n{body}\n}}\n"
    )
}

/// Rows of exactly `32 * per` values whose lanes move 16-byte words of `v` values
/// ([`column_vector`]): value `w * v + q` of a lane is column `(32 * w + lane) * v + q`.
/// The code loading row `base` of `ptr` (of the module's type `T<ty>`) into `A arr[per]`.
pub(crate) fn warp_load_words(ptr: &str, arr: &str, per: usize, v: usize, ty: &str) -> String {
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
pub(crate) fn warp_store_words(ptr: &str, value: &str, per: usize, v: usize, ty: &str) -> String {
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

/// Rows a block of the column-sum kernels reads at once (its warps), and the most row
/// chunks (blocks per column tile) they use.
pub(crate) const COLUMN_ROWS: usize = 8;
pub(crate) const COLUMN_CHUNKS: usize = 128;
/// Warps of a block adding chunk partials (`k_cols_fin`, batch norm's `k_stats`):
/// each reads every 32nd chunk. With 8, adding 512 chunks of 64 channels took 11-17 us
/// on the H100 (two blocks, each warp's loads one after another).
pub(crate) const FIN_WARPS: usize = 32;

/// Column sums of a `[rows, len]` matrix, deterministic, in two kernels.
/// `k_cols_part` (grid: column tiles of 32 x row chunks, 256 threads) has each warp
/// read 32 adjacent columns of a row (coalesced), adds the [`COLUMN_ROWS`] warps'
/// partials in shared memory and writes one partial per (chunk, column); `k_cols_fin`
/// (grid: column tiles of 32 times sums, [`FIN_WARPS`] warps) adds a column's chunk partials, each warp
/// a stride of chunks (coalesced rows of partials; a thread per column adding all of
/// them in turn left most of the GPU idle), and stores `scale<k> * sum`. `params` are the input
/// parameters, `row_setup` runs per element with `row`, `j` and `at = row * len + j`
/// defined, and `terms` are the summed expressions, one output `py<k>` each, of type
/// `T<out>` (accumulated in `A<out>`, `out` a type suffix of the module).
/// The row loop is unrolled so that each warp has several rows' loads in flight: one
/// at a time kept a third of the memory bandwidth busy.
pub(crate) fn column_sums(params: &str, row_setup: &str, terms: &[&str], out: &str) -> String {
    column_sums_and(params, row_setup, terms, out, ("", ""))
}

/// [`column_sums`] with more per-thread state: `decl` runs before the row loop (after
/// the accumulators) and `fin` after the partials, in every thread of the block (a
/// fused program's amaxes, [`super::fp8::amax_fold`]).
pub(crate) fn column_sums_and(
    params: &str,
    row_setup: &str,
    terms: &[&str],
    out: &str,
    (decl, fin): (&str, &str),
) -> String {
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
           {accs}{decl}\n\
           if (j < len) {{\n\
             #pragma unroll 8\n\
             for (i64 row = chunk * chunk_rows + ty; row < end; row += {COLUMN_ROWS}) {{ i64 at = row * len + j; {row_setup} {adds} }}\n\
           }}\n\
           {shares}\n\
           __syncthreads();\n\
           if (ty == 0 && j < len) {{\n{partials}}}\n\
           {fin}\
         }}\n{}",
        column_sums_fin(out, &vec![out; n])
    )
}

/// `k_cols_fin` of [`column_sums`] (grid: column tiles of 32 times sums, [`FIN_WARPS`]
/// warps; a block per tile adding the sums in turn left most of the GPU idle on GPT-2's
/// 768 columns): adds the chunks' partials `part[(chunk * n + k) * len + j]` (of type `A<acc>`) of each of the `n = outs.len()` sums and stores
/// `scale<k> * sum` into `py<k>`, of the module's type `T<outs[k]>`.
pub(crate) fn column_sums_fin(acc: &str, outs: &[&str]) -> String {
    let n = outs.len();
    let mut params = String::new();
    let mut finals = String::new();
    for (k, out) in outs.iter().enumerate() {
        params.push_str(&format!(", T{out}* py{k}, double scale{k}"));
        finals.push_str(&format!(
            "if (k == {k}) {{ A{acc} s = 0; if (j < len) {{\n\
                 #pragma unroll 8\n\
                 for (i64 c = ty; c < chunks; c += {FIN_WARPS}) s += part[(c * {n} + {k}) * len + j]; }}\n\
               fin[ty][tx] = s; __syncthreads();\n\
               if (ty == 0 && j < len) {{ for (int w = 1; w < {FIN_WARPS}; ++w) s += fin[w][tx]; st{out}(py{k}, j, (C{out})(s * (A{acc})scale{k})); }}\n\
               __syncthreads(); }}\n"
        ));
    }
    format!(
        "extern \"C\" __global__ void k_cols_fin(const A{acc}* part, i64 len, i64 chunks{params}) {{\n\
           __shared__ A{acc} fin[{FIN_WARPS}][33];\n\
           int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
           const i64 tiles = (len + 31) / 32;\n\
           for (i64 b = blockIdx.x; b < tiles * {n}; b += gridDim.x) {{\n\
             const i64 k = b / tiles, j = (b % tiles) * 32 + tx;\n{finals}}}\n\
         }}\n"
    )
}

/// Partial column sums of a `[rows, len]` matrix read in whole 16-byte words of `v`
/// values (`len % v == 0`, every streamed matrix 16-byte aligned): kernels
/// `k_cols_rows` and `k_cols_rows_n` ([`column_rows_kernel`]; `params, A<out>* part,
/// i64 rows, i64 len, i64 chunk_rows`), their blocks
/// ([`column_rows_form`]'s threads) a row chunk of `chunk_rows` rows times a column
/// tile (chunk `blockIdx.x / tiles`, tile `blockIdx.x % tiles`). A tile spans `span =
/// min(len / v, blockDim.x)` words; thread `t` owns word `t % span` of it (columns
/// `j ..= j + v - 1`) in every `per`-th row of the chunk from row `t / span` (`per =
/// blockDim.x / span`: rows of fewer than 256 words are read several at once). A block
/// reads its rows whole and in order, each thread's sums stay in its registers, and
/// only the `per` threads of a column meet in shared memory before the block writes
/// `part[(chunk * n + k) * len + j]`, the layout [`column_sums_fin`] reads. Against
/// tiles of 8 rows by 32 words ([`column_sums`]' layout moved in words), GPT-2's
/// [16384, 3072] bf16 GELU gradient with its bias sum took 82 us where it took 199
/// (H200, one wave of blocks; an elementwise pass without the sum 76): each warp
/// there read 512 bytes of a row, then jumped 8 rows. `row` is the code for one row
/// with `i0 = row * len + j` defined (the loop unrolled `unroll` times: a row of
/// little arithmetic needs several rows' loads in flight); it adds the summed values of element `u` into
/// `acc<k>[u]`, `A<out>` each, `n = sums`. `decl` runs before the row loop and `fin`
/// at the end, in every thread of the block (a fused program's amaxes).
pub(crate) fn column_sums_rows(
    params: &str,
    (v, unroll): (usize, usize),
    row: &str,
    (sums, out): (usize, &str),
    (decl, fin): (&str, &str),
) -> String {
    [false, true]
        .map(|several| {
            let shape = RowsKernel { v, unroll, several };
            column_sums_rows_kernel(params, shape, row, (sums, out), (decl, fin))
        })
        .concat()
}

/// What a [`column_sums_rows`] kernel is generated for: words of `v` values, its row
/// loop unrolled `unroll` times, several rows a pass or one.
#[derive(Clone, Copy)]
struct RowsKernel {
    v: usize,
    unroll: usize,
    several: bool,
}

/// One of [`column_sums_rows`]' kernels: `k_cols_rows_n` reads several rows at once
/// (`several`), `k_cols_rows` one (`per` = 1, `span` = `blockDim.x`). Two kernels,
/// as the several rows' place (`per`, `span`, the thread's row and word) held through
/// the row loop took GPT-2's [16384, 3072] bias gradient from 32 registers to 48 (from
/// five resident blocks of 384 threads a multiprocessor to three; 81 -> 94 us).
fn column_sums_rows_kernel(
    params: &str,
    RowsKernel { v, unroll, several }: RowsKernel,
    row: &str,
    (sums, out): (usize, &str),
    (decl, fin): (&str, &str),
) -> String {
    let mut accs = String::new();
    let mut partials = String::new();
    for k in 0..sums {
        accs.push_str(&format!("A{out} acc{k}[V] = {{}};\n"));
        let at = format!("part[(chunk * {sums} + {k}) * len + j + e]");
        partials.push_str(&if several {
            format!(
                "__syncthreads();\n\
                 if (active) for (int e = 0; e < V; ++e) sh[threadIdx.x * V + e] = acc{k}[e];\n\
                 __syncthreads();\n\
                 if (r == 0 && j < len) for (int e = 0; e < V; ++e) {{\n\
                   A{out} s = 0;\n\
                   for (int q = 0; q < per; ++q) s += sh[(q * span + w) * V + e];\n\
                   {at} = s;\n\
                 }}\n"
            )
        } else {
            format!("if (active) for (int e = 0; e < V; ++e) {at} = acc{k}[e];\n")
        });
    }
    let (name, place) = if several {
        (
            "k_cols_rows_n",
            format!(
                "__shared__ A{out} sh[{ROWS_SHARED} * V];\n\
                 const i64 span = min(len / V, (i64)blockDim.x);\n\
                 const int per = (int)(blockDim.x / span), r = (int)(threadIdx.x / span), w = (int)(threadIdx.x % span);\n"
            ),
        )
    } else {
        (
            "k_cols_rows",
            "const i64 span = blockDim.x;\nconst int per = 1, r = 0, w = threadIdx.x;\n".into(),
        )
    };
    format!(
        "extern \"C\" __global__ void {name}({params}, A{out}* part, i64 rows, i64 len, i64 chunk_rows) {{\n\
           constexpr int V = {v};\n\
           {place}\
           const i64 tiles = (len / V + span - 1) / span;\n\
           const i64 chunk = blockIdx.x / tiles, j = ((blockIdx.x % tiles) * span + w) * V;\n\
           const i64 end = min(rows, (chunk + 1) * chunk_rows);\n\
           const bool active = r < per && j < len;\n\
           {accs}{decl}\
           if (active) {{\n\
             #pragma unroll {unroll}\n\
             for (i64 row = chunk * chunk_rows + r; row < end; row += per) {{\n\
               const i64 i0 = row * len + j;\n\
               {row}\
             }}\n\
           }}\n\
           {partials}\
           {fin}\
         }}\n"
    )
}

/// The most threads of a [`column_sums_rows`] block that read several rows at once
/// (its shared memory holds a word of each).
const ROWS_SHARED: usize = 256;

/// How [`column_sums_rows`] blocks read rows of `words` words: (threads, per, tiles).
/// A block takes a whole row up to 512 words (a row of more takes `tiles` tiles of
/// 512); a row of fewer than 256 as many times (`per`) as fit in 256 threads; a whole
/// number of warps. `per` and the tiles' span are the kernel's own (`blockDim.x /
/// span`, `span = min(words, blockDim.x)`).
pub(crate) fn column_rows_form(words: usize) -> (usize, usize, usize) {
    let words = words.max(1);
    let threads = if words >= ROWS_SHARED {
        words.min(512)
    } else {
        ROWS_SHARED / words * words
    };
    let threads = threads.div_ceil(32) * 32;
    let span = words.min(threads);
    (threads, threads / span, words.div_ceil(span))
}

/// The [`column_sums_rows`] kernel whose blocks read `per` rows at once.
pub(crate) fn column_rows_kernel(per: usize) -> &'static str {
    if per > 1 {
        "k_cols_rows_n"
    } else {
        "k_cols_rows"
    }
}

/// Threads of a [`column_sums_words`] block.
pub(crate) const COLUMN_WORD_THREADS: usize = 256;

/// Partial column sums of a `[rows, len]` matrix read in whole 16-byte words of `v`
/// values, for rows of at most [`COLUMN_WORD_THREADS`] words (`len % v == 0`): the
/// statistics of channels-last batch norms, whose few channels leave most lanes of
/// [`column_sums`]' 32-column tiles idle (and a warp reading 64 bytes of a row). Kernel
/// `k_cols_words(params, A* part, i64 rows, i64 len)` (grid: `chunks` blocks;
/// [`COLUMN_WORD_THREADS`] threads): thread `t` sums columns `g * v ..= g * v + v - 1`
/// (`g = t % groups`, `groups = len / v`) of rows `(k * chunks + b) * per + r` for
/// k = 0, 1, ... (`r = t / groups`, `per = threads / groups`, `b` its block), so a warp
/// reads up to 512 contiguous bytes and the blocks sweep the matrix together from its
/// first row to its last (what the L2 cache holds after is the matrix's end, which an
/// elementwise pass reading [`elementwise_from_end`] finds there); the block adds its `per` partials of
/// each column in shared memory and writes `part[(chunk * n + k) * len + j]`, the
/// layout [`column_sums_fin`] reads. `words` are `(pointer, name)`: each row's word of
/// `pointer` is readable as `const T* name` (by `ld(name, e)`); `prologue` runs once
/// per thread with `j0` (its first column) and `V` defined, `setup` per value with `e`
/// and `j = j0 + e`, and `terms` are the summed expressions, accumulated in `A<out>`.
pub(crate) fn column_sums_words(
    params: &str,
    words: &[(&str, &str)],
    (prologue, setup): (&str, &str),
    terms: &[&str],
    (out, v): (&str, usize),
) -> String {
    let n = terms.len();
    let threads = COLUMN_WORD_THREADS;
    let mut loads = String::new();
    for (ptr, name) in words {
        loads.push_str(&format!(
            "uint4 w_{name} = *(const uint4*)({ptr} + row * len + j0); const T* {name} = (const T*)&w_{name};\n"
        ));
    }
    let (mut accs, mut adds, mut shares, mut partials) =
        (String::new(), String::new(), String::new(), String::new());
    for (k, term) in terms.iter().enumerate() {
        accs.push_str(&format!(
            "A{out} acc{k}[V]; for (int e = 0; e < V; ++e) acc{k}[e] = 0;\n"
        ));
        adds.push_str(&format!("acc{k}[e] += {term}; "));
        shares.push_str(&format!("sh[{k}][t * V + e] = acc{k}[e]; "));
        partials.push_str(&format!(
            "{{ A{out} s = 0; for (int q = 0; q < per; ++q) s += sh[{k}][(q * groups + cg) * V + ce]; part[((i64)blockIdx.x * {n} + {k}) * len + c] = s; }}\n"
        ));
    }
    format!(
        "extern \"C\" __global__ void k_cols_words({params}, A{out}* part, i64 rows, i64 len) {{\n\
           const int V = {v};\n\
           __shared__ A{out} sh[{n}][{threads} * V];\n\
           int groups = (int)(len / V), per = {threads} / groups, t = threadIdx.x, r = t / groups;\n\
           i64 j0 = (i64)(t % groups) * V;\n\
           {accs}\
           if (r < per) {{\n\
             {prologue}\n\
             #pragma unroll 4\n\
             for (i64 row = (i64)blockIdx.x * per + r; row < rows; row += (i64)gridDim.x * per) {{\n\
               {loads}\
               #pragma unroll\n\
               for (int e = 0; e < V; ++e) {{ i64 j = j0 + e; (void)j; {setup} {adds}}}\n\
             }}\n\
           }}\n\
           #pragma unroll\n\
           for (int e = 0; e < V; ++e) {{ {shares}}}\n\
           __syncthreads();\n\
           for (i64 c = t; c < len; c += {threads}) {{\n\
             int cg = (int)(c / V), ce = (int)(c % V);\n\
             {partials}\
           }}\n\
         }}\n"
    )
}

/// Elements of `d` in a 16-byte word: the columns a thread of `k_cols_rows` sums.
pub(crate) fn column_vector(d: DType) -> usize {
    16 / d.size_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of 256 words or more is one pass (in tiles of 512 words); narrower rows
    /// are read as many at once as fit in 256 threads; blocks are whole warps, and the
    /// kernel's own `per` (threads / min(words, threads)) and tiles are the host's.
    #[test]
    fn column_rows_blocks_take_whole_rows() {
        for (words, form) in [
            (384, (384, 1, 1)),
            (600, (512, 1, 2)),
            (300, (320, 1, 1)),
            (96, (192, 2, 1)),
            (33, (256, 7, 1)),
            (1, (256, 256, 1)),
        ] {
            assert_eq!(column_rows_form(words), form, "{words} words");
            assert_eq!(column_rows_kernel(form.1) == "k_cols_rows_n", form.1 > 1);
        }
    }
}
