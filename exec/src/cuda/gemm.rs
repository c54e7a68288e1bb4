//! Matrix products through cuBLASLt.
//!
//! Tensors are row-major and cuBLASLt is column-major: a row-major `C = op(A) op(B)`
//! is the column-major `C^T = op(B)^T op(A)^T`, so the operands swap and each keeps
//! its own transpose flag (folded into the op descriptor, never materialised).
//! Batches use the strided-batched layout; an operand whose batch broadcasts has
//! stride 0.

use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use half::f16;

use ampgraph_graph::DType;

use super::device::{DTensor, Device};

/// Precision settings of the GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmOptions {
    /// f32 GEMMs may use TF32 Tensor Cores (PyTorch's `allow_tf32`).
    pub allow_tf32: bool,
    /// f16 GEMMs may accumulate in f16 (PyTorch's
    /// `allow_fp16_reduced_precision_reduction`); by default they accumulate in f32.
    pub allow_fp16_reduced_precision_reduction: bool,
}

const WORKSPACE_BYTES: usize = 32 << 20;

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: DTensor,
}

// SAFETY: the handle is used from one executor at a time (`&mut` access).
unsafe impl Send for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: created by `Gemm::new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn err(what: &str) -> impl FnOnce(lt::CublasError) -> String + '_ {
    move |e| format!("cuBLASLt {what}: {e:?}")
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
}

impl Gemm {
    pub fn new(dev: &Device) -> Result<Gemm, String> {
        let handle = lt::create_handle().map_err(err("create"))?;
        let workspace =
            match dev.alloc(DType::F32, &[WORKSPACE_BYTES / 4], "the cuBLASLt workspace") {
                Ok(w) => w,
                Err(e) => {
                    // SAFETY: just created.
                    let _ = unsafe { lt::destroy_handle(handle) };
                    return Err(e);
                }
            };
        Ok(Gemm { handle, workspace })
    }

    pub fn run(&self, dev: &Device, p: &Product, opts: GemmOptions) -> Result<(), String> {
        let dtype = p.c.dtype;
        let (m, n, k) = (p.m, p.n, p.k);
        if m == 0 || n == 0 || p.batch == 0 {
            return Ok(());
        }
        if k == 0 {
            return dev.zero(p.c);
        }
        let esize = dtype.size_bytes() as u64;
        let (mat_ty, compute, scale_ty) = match dtype {
            DType::F32 => (
                sys::cudaDataType::CUDA_R_32F,
                if opts.allow_tf32 {
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
                } else {
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
                },
                sys::cudaDataType::CUDA_R_32F,
            ),
            DType::F16 if opts.allow_fp16_reduced_precision_reduction => (
                sys::cudaDataType::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_16F,
                sys::cudaDataType::CUDA_R_16F,
            ),
            DType::F16 => (
                sys::cudaDataType::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
            DType::BF16 => (
                sys::cudaDataType::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            ),
            DType::F64 => (
                sys::cudaDataType::CUDA_R_64F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                sys::cudaDataType::CUDA_R_64F,
            ),
            other => return Err(format!("no matrix product for {other}")),
        };
        let batch = i32::try_from(p.batch).map_err(|_| "batch too large for cuBLASLt")?;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        // Column-major view: first operand is B (as stored), second is A.
        let (b_rows, b_cols, ldb) = if p.transpose_b {
            (k64, n64, k as i64)
        } else {
            (n64, k64, n as i64)
        };
        let (a_rows, a_cols, lda) = if p.transpose_a {
            (m64, k64, m as i64)
        } else {
            (k64, m64, k as i64)
        };
        let lb = layout(mat_ty, b_rows, b_cols, ldb, batch, p.stride_b as i64)?;
        let la = layout(mat_ty, a_rows, a_cols, lda, batch, p.stride_a as i64)?;
        let lc = layout(mat_ty, n64, m64, n as i64, batch, (m * n) as i64)?;
        let desc = Desc(lt::create_matmul_desc(compute, scale_ty).map_err(err("descriptor"))?);
        let (tb, ta) = (i32::from(p.transpose_b), i32::from(p.transpose_a));
        // SAFETY: cublasOperation_t is an i32 enum (0 = N, 1 = T).
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&tb) as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .map_err(err("transpose"))?;
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                (&ta) as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .map_err(err("transpose"))?;
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
        // SAFETY: every descriptor is live.
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc.0, lb.0, la.0, lc.0, lc.0, pref.0)
        }
        .map_err(|e| {
            format!(
                "cuBLASLt has no algorithm for a {dtype} product [{m}x{k}] x [{k}x{n}] (batch {}): {e:?}",
                p.batch
            )
        })?;
        let (one32, zero32) = (1f32, 0f32);
        let (one64, zero64) = (1f64, 0f64);
        let (one16, zero16) = (f16::ONE, f16::ZERO);
        let (alpha, beta): (*const c_void, *const c_void) = match scale_ty {
            sys::cudaDataType::CUDA_R_64F => {
                ((&one64) as *const f64 as _, (&zero64) as *const f64 as _)
            }
            sys::cudaDataType::CUDA_R_16F => {
                ((&one16) as *const f16 as _, (&zero16) as *const f16 as _)
            }
            _ => ((&one32) as *const f32 as _, (&zero32) as *const f32 as _),
        };
        let a = p.a.ptr() + p.offset_a as u64 * esize;
        let b = p.b.ptr() + p.offset_b as u64 * esize;
        let c = p.c.ptr() + p.offset_c as u64 * esize;
        // SAFETY: the caller checked that each operand's buffer holds the matrices the
        // layouts describe; alpha/beta have the scale type; ordered on the stream.
        unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                alpha,
                beta,
                b as *const c_void,
                lb.0,
                a as *const c_void,
                la.0,
                c as *const c_void,
                lc.0,
                c as *mut c_void,
                lc.0,
                (&heuristic.algo) as *const _,
                self.workspace.ptr() as *mut c_void,
                ws,
                dev.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(err("matmul"))
    }
}
