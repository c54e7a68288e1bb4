//! Matrix products through cuBLASLt.
//!
//! Tensors are row-major and cuBLASLt is column-major: a row-major `C = op(A) op(B)`
//! is the column-major `C^T = op(B)^T op(A)^T`, so the operands swap and each keeps
//! its own transpose flag (folded into the op descriptor, never materialised).
//! Batches use the strided-batched layout; an operand whose batch broadcasts has
//! stride 0. FP8 products (E4M3 or E5M2 operands, not both E5M2) take each operand's
//! scale inverse by pointer and store f32, f16 or bf16; Hopper runs them only with
//! both operands K-major (`a` not transposed, `b` transposed), which the caller
//! arranges.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use half::f16;

use ampgraph_graph::ops::Epilogue;
use ampgraph_graph::DType;

use super::device::{loading, DTensor, Device, Launches};

/// Precision settings of the GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemmOptions {
    /// f32 matrix products may round their operands to TF32 (10-bit mantissa) on the
    /// Tensor Cores (PyTorch's `allow_tf32`): each term `a_ik b_kj` then carries up to
    /// about 1e-3 relative error, a product's about 1e-4 of `sum_k |a_ik b_kj|` (the
    /// GPU tests allow 1e-2 for K = 256, and plain f32 1e-5).
    pub allow_tf32: bool,
    /// f16 matrix products may accumulate in f16 (PyTorch's
    /// `allow_fp16_reduced_precision_reduction`): every partial sum rounds to f16
    /// (2^-11 relative), so the error grows with the inner dimension (the GPU tests
    /// allow 1e-2 of `sum_k |a_ik b_kj|` for K = 256, and 1e-3 for the default f32
    /// accumulation with the result's one f16 rounding).
    pub allow_fp16_reduced_precision_reduction: bool,
    /// Take cuBLASLt's first heuristic pick for every product instead of timing its
    /// candidates on first use (autotuning: the pick can be tens of percent slower,
    /// e.g. TF32 products with a non-transposed weight; the timed choice may differ
    /// between runs, so results are reproducible bit for bit only with this set).
    pub heuristic_only: bool,
}

/// The cuBLASLt types of a product: its matrices' data type, the compute type and
/// the type of alpha and beta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeTypes {
    pub data: sys::cudaDataType,
    pub compute: sys::cublasComputeType_t,
    pub scale: sys::cudaDataType,
}

/// How a product of `dtype` matrices computes under `opts`: the one place the
/// precision switches act. f32 computes in f32 (`CUBLAS_COMPUTE_32F_FAST_TF32` with
/// `allow_tf32`: operands rounded to TF32's 10-bit mantissa), f16 and bf16 accumulate
/// in f32 (f16 in f16, `CUBLAS_COMPUTE_16F` with f16 alpha and beta, with
/// `allow_fp16_reduced_precision_reduction`), f64 in f64.
pub fn compute_type(dtype: DType, opts: GemmOptions) -> Result<ComputeTypes, String> {
    use sys::cublasComputeType_t as C;
    use sys::cudaDataType as T;
    let (data, compute, scale) = match dtype {
        DType::F32 if opts.allow_tf32 => (
            T::CUDA_R_32F,
            C::CUBLAS_COMPUTE_32F_FAST_TF32,
            T::CUDA_R_32F,
        ),
        DType::F32 => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::F16 if opts.allow_fp16_reduced_precision_reduction => {
            (T::CUDA_R_16F, C::CUBLAS_COMPUTE_16F, T::CUDA_R_16F)
        }
        DType::F16 => (T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::BF16 => (T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::F64 => (T::CUDA_R_64F, C::CUBLAS_COMPUTE_64F, T::CUDA_R_64F),
        DType::F8E4M3 => (T::CUDA_R_8F_E4M3, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        DType::F8E5M2 => (T::CUDA_R_8F_E5M2, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        other => return Err(format!("no matrix product for {other}")),
    };
    Ok(ComputeTypes {
        data,
        compute,
        scale,
    })
}

const WORKSPACE_BYTES: usize = 32 << 20;

/// The heuristic's candidates timed per product shape, the runs timed per candidate
/// (after one untimed run) and the rounds over all candidates: each keeps its best
/// round, so a clock still ramping up in the first round does not decide.
const CANDIDATES: usize = 16;
const TIMED_RUNS: usize = 3;
const ROUNDS: usize = 2;

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: DTensor,
    /// Descriptors and the chosen algorithm per product shape: building them and asking
    /// the heuristic costs more host time than launching the product.
    plans: Mutex<HashMap<PlanKey, Arc<Plan>>>,
}

/// What a plan depends on: everything about a product but its pointers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    /// `b`'s dtype: `dtype` but in FP8 products, whose operands' formats may differ.
    dtype_b: DType,
    /// The output's dtype: `dtype`, or f32 for a 16-bit product stored wide.
    out: DType,
    m: usize,
    n: usize,
    k: usize,
    transpose_a: bool,
    transpose_b: bool,
    batch: usize,
    stride_a: usize,
    stride_b: usize,
    opts: GemmOptions,
    epilogue: Option<Epilogue>,
    residual: bool,
    fast_accumulation: bool,
}

/// A product's descriptors and algorithm, ready to run on any operands of its shape.
struct Plan {
    desc: Desc,
    la: Layout,
    lb: Layout,
    lc: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
    scale_ty: sys::cudaDataType,
}

// SAFETY: the handle is used from one executor at a time (`&mut` access).
unsafe impl Send for Gemm {}
// SAFETY: a plan is used only through the Gemm that built it, whose executor runs one
// product at a time (`&mut` access): setting the bias pointer on its descriptor before
// a product never races another use.
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Gemm {
    fn drop(&mut self) {
        // cublasLtDestroy synchronizes the context: while another thread captured a
        // stream it crashed inside the driver (SIGSEGV in cuCtxSynchronize, sessions
        // dropped in threads beside others capturing convolutions).
        // SAFETY: created by `Gemm::new`, destroyed once.
        let _ = loading(|| unsafe { lt::destroy_handle(self.handle) });
    }
}

/// cuBLASLt's ids of an algorithm and its configuration (for the autotuning log):
/// algo/tile/cluster shape/stages/swizzle/split-k/custom option.
fn algo_id(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    let attr = |which| {
        let (mut v, mut written) = (-1i32, 0usize);
        // SAFETY: both attributes are 32-bit; `algo` was filled by the heuristic.
        let _ = unsafe {
            sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                which,
                (&mut v) as *mut i32 as *mut c_void,
                size_of::<i32>(),
                &mut written,
            )
        };
        v
    };
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    format!(
        "{}/{}/c{}/s{}/w{}/k{}/o{}",
        attr(A::CUBLASLT_ALGO_CONFIG_ID),
        attr(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        attr(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        attr(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        attr(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        attr(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        attr(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)
    )
}

fn err(what: &str) -> impl FnOnce(lt::CublasError) -> String + '_ {
    move |e| format!("cuBLASLt {what}: {e:?}")
}

/// Sets attribute `attr` of a matmul descriptor to `value`.
///
/// # Safety
/// `T` must be the attribute's documented type, and `desc` a live descriptor.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
    what: &str,
) -> Result<(), String> {
    // SAFETY: the caller's contract; the pointer and size describe `value`.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
    .map_err(err(what))
}

struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_desc, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_pref, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn layout(
    ty: sys::cudaDataType,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: i32,
    stride: i64,
) -> Result<Layout, String> {
    let l = Layout(lt::create_matrix_layout(ty, rows, cols, ld).map_err(err("layout"))?);
    if batch > 1 {
        // SAFETY: the attribute values have the documented types (i32, i64).
        unsafe {
            lt::set_matrix_layout_attribute(
                l.0,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&batch) as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .map_err(err("batch count"))?;
            lt::set_matrix_layout_attribute(
                l.0,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&stride) as *const i64 as *const c_void,
                size_of::<i64>(),
            )
            .map_err(err("batch stride"))?;
        }
    }
    Ok(l)
}

/// One (possibly batched) product, in row-major terms.
pub struct Product<'a> {
    pub a: &'a DTensor,
    pub b: &'a DTensor,
    pub c: &'a DTensor,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub batch: usize,
    /// Element strides between batch matrices (0 broadcasts).
    pub stride_a: usize,
    pub stride_b: usize,
    /// Element offsets of the first matrix (for products split per batch).
    pub offset_a: usize,
    pub offset_b: usize,
    pub offset_c: usize,
    /// Scales the product (BLAS's alpha).
    pub alpha: f64,
    /// A bias over the output's columns (and an activation) applied in the epilogue,
    /// of the output's dtype (cuBLASLt's default bias type; it has no f16 bias for an
    /// f16 product stored in f32).
    pub bias: Option<(&'a DTensor, Epilogue)>,
    /// A matrix of the output's type and shape added to the product (cuBLASLt's `C`,
    /// beta 1; never the output's own buffer, so autotuning's repeated runs write the
    /// same result).
    pub residual: Option<&'a DTensor>,
    /// An FP8 product's scale inverses (f32 scalars on the device) of `a` and `b`,
    /// multiplied into the product; `None` for every other product.
    pub scales: Option<(&'a DTensor, &'a DTensor)>,
    /// An FP8 product summed in Hopper's fast mode (cuBLASLt's `FAST_ACCUM`).
    pub fast_accumulation: bool,
}

impl<'a> Product<'a> {
    /// The one product `c = op(a) op(b)` of `[m x k]` by `[k x n]` (the transposes
    /// `op`), nothing added: the other fields' neutral values.
    pub fn single(
        [a, b, c]: [&'a DTensor; 3],
        (m, k, n): (usize, usize, usize),
        (transpose_a, transpose_b): (bool, bool),
    ) -> Self {
        Product {
            a,
            b,
            c,
            m,
            n,
            k,
            transpose_a,
            transpose_b,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            offset_a: 0,
            offset_b: 0,
            offset_c: 0,
            alpha: 1.0,
            bias: None,
            residual: None,
            scales: None,
            fast_accumulation: false,
        }
    }
}

impl Gemm {
    pub fn new(dev: &Device) -> Result<Gemm, String> {
        // Starting cuBLASLt may load kernels: not while another thread captures.
        let handle = loading(lt::create_handle).map_err(err("create"))?;
        let workspace = match dev.alloc(
            DType::F32,
            &[WORKSPACE_BYTES / 4],
            &"the cuBLASLt workspace",
        ) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: just created (destroyed as in Gemm's drop).
                let _ = loading(|| unsafe { lt::destroy_handle(handle) });
                return Err(e);
            }
        };
        Ok(Gemm {
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
        })
    }

    pub fn run(&self, dev: &Device, p: &Product, opts: GemmOptions) -> Result<(), String> {
        let (dtype, out) = (p.a.dtype, p.c.dtype);
        let fp8 = dtype.is_fp8();
        let wide_16_bit = matches!(dtype, DType::F16 | DType::BF16) && out == DType::F32;
        let allowed = if fp8 {
            matches!(out, DType::F32 | DType::F16 | DType::BF16)
                && p.b.dtype.is_fp8()
                && !(dtype == DType::F8E5M2 && p.b.dtype == DType::F8E5M2)
                && p.scales.is_some()
                && !p.transpose_a
                && p.transpose_b
                // cuBLASLt's FP8 epilogue adds a 16-bit bias, and a 16-bit C, to a
                // 16-bit result.
                && p.bias.is_none_or(|(_, e)| e == Epilogue::Bias && out != DType::F32)
                && (p.residual.is_none() || out != DType::F32)
                && p.batch == 1
        } else {
            p.b.dtype == dtype
                && p.scales.is_none()
                && !p.fast_accumulation
                && (out == dtype || (wide_16_bit && !opts.allow_fp16_reduced_precision_reduction))
        };
        if !allowed {
            return Err(format!(
                "no {dtype} x {} product stored as {out} with these operands",
                p.b.dtype
            ));
        }
        if let Some((bias, _)) = p.bias.filter(|(b, _)| b.dtype != out) {
            return Err(format!(
                "a {} bias for a product stored as {out}",
                bias.dtype
            ));
        }
        if let Some(r) = p.residual {
            if r.dtype != out || r.len() != p.c.len() || r.ptr() == p.c.ptr() || p.batch != 1 {
                return Err(format!(
                    "a residual must be a separate {out} matrix of the output's size (one product)"
                ));
            }
        }
        if p.m == 0 || p.n == 0 || p.batch == 0 {
            return Ok(());
        }
        if p.k == 0 && p.residual.is_none() {
            return dev.zero(p.c);
        }
        let key = PlanKey {
            dtype,
            dtype_b: p.b.dtype,
            out,
            m: p.m,
            n: p.n,
            k: p.k,
            transpose_a: p.transpose_a,
            transpose_b: p.transpose_b,
            batch: p.batch,
            stride_a: p.stride_a,
            stride_b: p.stride_b,
            opts,
            epilogue: p.bias.map(|(_, e)| e),
            residual: p.residual.is_some(),
            fast_accumulation: p.fast_accumulation,
        };
        let cached = self
            .plans
            .lock()
            .map_err(|_| "poisoned")?
            .get(&key)
            .cloned();
        // A new plan comes with the heuristic's candidates, timed below on first use.
        let (mut plan, candidates) = match cached {
            Some(plan) => (plan, None),
            None => {
                // cuBLASLt's heuristic loads kernels.
                let (plan, candidates) = loading(|| self.plan(&key))?;
                (Arc::new(plan), Some(candidates))
            }
        };
        let esize = dtype.size_bytes() as u64;
        let scale_ty = plan.scale_ty;
        let ws = self.workspace.bytes();
        let beta_value = if p.residual.is_some() { 1.0 } else { 0.0 };
        let (alpha32, beta32) = (p.alpha as f32, beta_value as f32);
        let (alpha64, beta64) = (p.alpha, beta_value);
        let (alpha16, beta16) = (f16::from_f64(p.alpha), f16::from_f64(beta_value));
        let (alpha, beta): (*const c_void, *const c_void) = match scale_ty {
            sys::cudaDataType::CUDA_R_64F => {
                ((&alpha64) as *const f64 as _, (&beta64) as *const f64 as _)
            }
            sys::cudaDataType::CUDA_R_16F => {
                ((&alpha16) as *const f16 as _, (&beta16) as *const f16 as _)
            }
            _ => ((&alpha32) as *const f32 as _, (&beta32) as *const f32 as _),
        };
        if let Some((bias, _)) = p.bias {
            let ptr = bias.ptr() as *const c_void;
            // SAFETY: the attribute is a device pointer; the bias holds n elements of the
            // output's type (checked above and by the op's type rule).
            unsafe {
                set_desc(
                    plan.desc.0,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &ptr,
                    "bias pointer",
                )
            }?;
        }
        if let Some((a_inv, b_inv)) = p.scales {
            // cuBLASLt's A is our b (the operands swap for the column-major view).
            let (a_ptr, b_ptr) = (b_inv.ptr() as *const c_void, a_inv.ptr() as *const c_void);
            // SAFETY: the attributes are device pointers to f32 scalars, as FP8
            // products take their scales.
            unsafe {
                set_desc(
                    plan.desc.0,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &a_ptr,
                    "a scale pointer",
                )?;
                set_desc(
                    plan.desc.0,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &b_ptr,
                    "b scale pointer",
                )?;
            }
        }
        let a = p.a.ptr() + p.offset_a as u64 * esize;
        let b = p.b.ptr() + p.offset_b as u64 * p.b.dtype.size_bytes() as u64;
        let c = p.c.ptr() + p.offset_c as u64 * out.size_bytes() as u64;
        // cuBLASLt reads C: the residual, else the output itself (times beta 0).
        let c_in = p.residual.map_or(c, |r| r.ptr());
        let matmul = |plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t| {
            // SAFETY: the caller checked that each operand's buffer holds the matrices
            // the layouts describe; alpha/beta have the scale type; ordered on the stream.
            loading(|| unsafe {
                lt::matmul(
                    self.handle,
                    plan.desc.0,
                    alpha,
                    beta,
                    b as *const c_void,
                    plan.lb.0,
                    a as *const c_void,
                    plan.la.0,
                    c_in as *const c_void,
                    plan.lc.0,
                    c as *mut c_void,
                    plan.lc.0,
                    algo as *const _,
                    self.workspace.ptr() as *mut c_void,
                    ws,
                    dev.stream.cu_stream() as sys::cudaStream_t,
                )
            })
            .map_err(err("matmul"))
        };
        if let Some(candidates) = candidates {
            if !opts.heuristic_only && candidates.len() > 1 {
                // Not shared yet: the plan is still ours to change.
                let algo = Self::fastest(dev, &key, &plan, &candidates, &matmul)?;
                if let Some(p) = Arc::get_mut(&mut plan) {
                    p.algo = algo;
                }
            }
            self.plans
                .lock()
                .map_err(|_| "poisoned")?
                .insert(key, plan.clone());
        }
        Launches::count(&dev.launches.gemms);
        matmul(&plan, &plan.algo)
    }

    /// Times each of `candidates` on the product's own operands (the output is
    /// overwritten by the real run after) and returns the fastest. Synchronises the
    /// stream, once per product shape.
    fn fastest(
        dev: &Device,
        key: &PlanKey,
        plan: &Plan,
        candidates: &[sys::cublasLtMatmulAlgo_t],
        matmul: &dyn Fn(&Plan, &sys::cublasLtMatmulAlgo_t) -> Result<(), String>,
    ) -> Result<sys::cublasLtMatmulAlgo_t, String> {
        // A candidate the heuristic offered but that fails to run is passed over.
        let runnable: Vec<_> = candidates
            .iter()
            .filter(|algo| matmul(plan, algo).is_ok())
            .collect();
        let mut ms = vec![f32::INFINITY; runnable.len()];
        for _ in 0..ROUNDS {
            for (algo, best) in runnable.iter().zip(&mut ms) {
                let start = dev.timing_event()?;
                for _ in 0..TIMED_RUNS {
                    matmul(plan, algo)?;
                }
                let end = dev.timing_event()?;
                let t = start
                    .elapsed_ms(&end)
                    .map_err(|e| format!("CUDA event: {e:?}"))?;
                *best = best.min(t / TIMED_RUNS as f32);
            }
        }
        let mut best = (f32::INFINITY, plan.algo);
        let mut times = Vec::with_capacity(runnable.len());
        for (algo, &t) in runnable.iter().zip(&ms) {
            times.push(format!("{}:{t:.3}", algo_id(algo)));
            if t < best.0 {
                best = (t, **algo);
            }
        }
        log::debug!(
            "GEMM {key:?}: ms per run of each candidate (algo id:ms) {}; took {}",
            times.join(" "),
            algo_id(&best.1)
        );
        Ok(best.1)
    }

    /// Builds the descriptors of a product and asks cuBLASLt's heuristic for its
    /// algorithm: the plan takes the first candidate, all of them come back too.
    fn plan(&self, key: &PlanKey) -> Result<(Plan, Vec<sys::cublasLtMatmulAlgo_t>), String> {
        let PlanKey {
            dtype,
            dtype_b,
            out,
            m,
            n,
            k,
            transpose_a,
            transpose_b,
            batch,
            stride_a,
            stride_b,
            opts,
            epilogue,
            // Descriptors are the same with a residual (beta and C's pointer differ).
            residual: _,
            fast_accumulation,
        } = *key;
        let ComputeTypes {
            data: mat_ty,
            compute,
            scale: scale_ty,
        } = compute_type(dtype, opts)?;
        let batch_count = i32::try_from(batch).map_err(|_| "batch too large for cuBLASLt")?;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        // Column-major view: first operand is B (as stored), second is A.
        let (b_rows, b_cols, ldb) = if transpose_b {
            (k64, n64, k as i64)
        } else {
            (n64, k64, n as i64)
        };
        let (a_rows, a_cols, lda) = if transpose_a {
            (m64, k64, m as i64)
        } else {
            (k64, m64, k as i64)
        };
        let b_ty = compute_type(dtype_b, opts)?.data;
        let lb = layout(b_ty, b_rows, b_cols, ldb, batch_count, stride_b as i64)?;
        let la = layout(mat_ty, a_rows, a_cols, lda, batch_count, stride_a as i64)?;
        // The output's own type: the operands' but for a 16-bit product stored in f32
        // or an FP8 one stored wider (run() allows no other mix).
        let out_ty = compute_type(out, opts)?.data;
        let lc = layout(out_ty, n64, m64, n as i64, batch_count, (m * n) as i64)?;
        let desc = Desc(lt::create_matmul_desc(compute, scale_ty).map_err(err("descriptor"))?);
        let (tb, ta) = (i32::from(transpose_b), i32::from(transpose_a));
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        // SAFETY: cublasOperation_t is an i32 enum (0 = N, 1 = T).
        unsafe {
            set_desc(desc.0, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &tb, "transpose")?;
            set_desc(desc.0, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &ta, "transpose")?;
        }
        if fast_accumulation {
            // SAFETY: the attribute is an int8_t.
            unsafe {
                set_desc(
                    desc.0,
                    Attr::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    &1i8,
                    "fast accumulation",
                )
            }?;
        }
        if let Some(e) = epilogue {
            // Column-major, the output is [n x m]: the bias runs along its rows, as
            // cuBLASLt's epilogue adds it.
            let code = match e {
                Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                Epilogue::BiasRelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
                Epilogue::BiasGeluTanh => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            };
            // The bias has the output's type (said outright for a widened output).
            // SAFETY: the attributes are a cublasLtEpilogue_t and a cudaDataType.
            unsafe {
                set_desc(
                    desc.0,
                    Attr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &code,
                    "epilogue",
                )?;
                set_desc(
                    desc.0,
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &out_ty,
                    "bias type",
                )?;
            }
        }
        let pref = Pref(lt::create_matmul_pref().map_err(err("preference"))?);
        let ws = self.workspace.bytes();
        // SAFETY: the attribute is a size_t.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws) as *const usize as *const c_void,
                size_of::<usize>(),
            )
            .map_err(err("workspace size"))?;
        }
        // SAFETY: zeroed is a valid bit pattern for the plain-data result struct.
        let mut found: [sys::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
            unsafe { std::mem::zeroed() };
        let mut count = 0;
        // SAFETY: every descriptor is live; `found` has room for CANDIDATES results.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc.0,
                lb.0,
                la.0,
                lc.0,
                lc.0,
                pref.0,
                CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            )
        };
        let candidates: Vec<sys::cublasLtMatmulAlgo_t> = found
            [..count.clamp(0, CANDIDATES as i32) as usize]
            .iter()
            .filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|h| h.algo)
            .collect();
        let Some(&algo) = candidates.first() else {
            return Err(format!(
                "cuBLASLt has no algorithm for a {dtype} product [{m}x{k}] x [{k}x{n}] (batch {batch}): {status:?}"
            ));
        };
        let plan = Plan {
            desc,
            la,
            lb,
            lc,
            algo,
            scale_ty,
        };
        Ok((plan, candidates))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::cublasComputeType_t as C;
    use sys::cudaDataType as T;

    fn types(dtype: DType, allow_tf32: bool, reduced: bool) -> ComputeTypes {
        let opts = GemmOptions {
            allow_tf32,
            allow_fp16_reduced_precision_reduction: reduced,
            ..GemmOptions::default()
        };
        compute_type(dtype, opts).unwrap()
    }

    #[test]
    fn by_default_products_compute_in_f32_or_wider() {
        let plain = |data, compute, scale| ComputeTypes {
            data,
            compute,
            scale,
        };
        assert_eq!(
            types(DType::F32, false, false),
            plain(T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
        );
        assert_eq!(
            types(DType::F16, false, false),
            plain(T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
        );
        assert_eq!(
            types(DType::BF16, false, false),
            plain(T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
        );
        assert_eq!(
            types(DType::F64, false, false),
            plain(T::CUDA_R_64F, C::CUBLAS_COMPUTE_64F, T::CUDA_R_64F)
        );
        assert!(compute_type(DType::I32, GemmOptions::default()).is_err());
    }

    #[test]
    fn allow_tf32_changes_only_f32_products() {
        assert_eq!(
            types(DType::F32, true, false).compute,
            C::CUBLAS_COMPUTE_32F_FAST_TF32
        );
        for dtype in [DType::F16, DType::BF16, DType::F64] {
            assert_eq!(
                types(dtype, true, false),
                types(dtype, false, false),
                "{dtype}"
            );
        }
    }

    #[test]
    fn reduced_precision_reduction_changes_only_f16_products() {
        assert_eq!(
            types(DType::F16, false, true),
            ComputeTypes {
                data: T::CUDA_R_16F,
                compute: C::CUBLAS_COMPUTE_16F,
                scale: T::CUDA_R_16F,
            }
        );
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            assert_eq!(
                types(dtype, false, true),
                types(dtype, false, false),
                "{dtype}"
            );
        }
    }
}
