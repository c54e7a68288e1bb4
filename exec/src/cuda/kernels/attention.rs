//! FusedAttention and FusedAttentionGrad on the device: FlashAttention-2's algorithm
//! on Tensor Cores (f16 or bf16 operands, f32 accumulators).
//!
//! A block of 8 warps takes 128 rows (queries; keys in the gradient's dK/dV kernel,
//! whose blocks are 4 warps and 64 rows, tiles 32: [`NARROW`], as every kernel's for
//! heads wider than 64) of one (batch, head), a
//! warp 16 of them, and walks the other side in tiles of 64 staged in shared memory.
//! On Hopper, for heads of 64, a warpgroup (4 warps, 64 rows) takes each product
//! whole with `wgmma`, B read by the tensor cores from the tile (rows of 128 bytes,
//! swizzled as they expect); elsewhere each warp's `mma.sync` m16n8k16 takes B's
//! fragments by `ldmatrix` (transposing where the product needs it). The
//! scores of a tile live in the accumulator registers
//! and go straight back into the next product as its A operand: the `[Sq, Sk]` scores
//! are never stored. The forward keeps a running maximum and sum per row (online
//! softmax) and saves each row's log-sum-exp; the gradient recomputes the
//! probabilities from it, `dk`/`dv` in one kernel per key tile and `dq` in another
//! per query tile (which first writes `delta = rowsum(do * o)` for the former), so no
//! atomics are needed. A causal attention walks only the tiles at or below the
//! diagonal, masks the scores above it in the tiles that cross it, and a warp skips
//! a tile whose scores it masks whole (its contribution would be exactly zero).
//! Where only a delayed FP8 cast reads a packed gradient
//! (`FusedAttentionGradQuantizeFp8`), the gradient kernels of a `Q8` module cast each
//! tile as they store it, into both FP8 copies and the column sums' partials; where
//! one reads a non-causal output (`FusedAttentionQuantizeFp8`), the forward kernel of a
//! `Q8` module stores o and both FP8 copies of it from the same rounded pairs.

use ampgraph_graph::ops::attention::{check_key_bias, tensor_core_head_dim, AttentionDims};
use ampgraph_graph::ops::attention::{qkv_inputs, unpacked_type};
use ampgraph_graph::ops::fused::column_sum_dtype;
use ampgraph_graph::ops::{Dropout, FusedAttention, FusedAttentionGrad};
use ampgraph_graph::ops::{FusedAttentionGradQuantizeFp8, FusedAttentionQuantizeFp8};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{column_sums_fin, copy_async_source, module_multi};
use super::fp8::fp8_pairs;
use super::{kernel, launch_column_sums_fin, Ctx, KernelSpec, Lowering};
use crate::cuda::device::{Arg, DTensor, Target};

/// The module of one attention: `k_fwd(q, k, v, o, lse, ...)`, `k_dq(q, k, v, o, lse,
/// do, dq, delta, ...)` and `k_dkv(q, k, v, lse, delta, do, dk, dv, ...)`, each then
/// taking `int heads, int xs, int q_len, int k_len, const T* key_bias, int
/// bias_stride, double scale, long long seed, const float* count, long long threshold,
/// double drop_scale`: `xs` the distance between the rows of q, k, v and their
/// gradients (`heads * head_dim`; three times that in a packed qkv, whose q, k and v
/// start `heads * head_dim` apart); the last four the probabilities' dropout (unread
/// in a module without it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Spec {
    dtype: DType,
    head_dim: usize,
    shape: Shape,
    /// Whether the products are Hopper's warpgroup products ([`warpgroup_products`]).
    warpgroups: bool,
    causal: bool,
    key_bias: bool,
    dropout: bool,
    /// The FP8 dtype the kernels cast o (FusedAttentionQuantizeFp8) or dqkv
    /// (FusedAttentionGradQuantizeFp8) to as they store it, where they do.
    cast: Option<DType>,
}

impl KernelSpec for Spec {
    const FAMILY: &'static str = "attention";
    const TARGET: Target = Target::ArchSpecific;
    fn source(&self) -> String {
        source(
            self.dtype,
            self.head_dim,
            (self.shape, self.warpgroups),
            (self.causal, self.key_bias, self.dropout),
            self.cast,
        )
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    let outs = outs.to_vec();
    if let Some(a) = op.downcast_ref::<FusedAttention>() {
        let a = a.clone();
        return Some(
            static_check(a.scale, a.packed, ins)
                .map(|()| kernel(move |c, inputs| forward(c, &a, inputs, &outs, None))),
        );
    }
    if let Some(a) = op.downcast_ref::<FusedAttentionGrad>() {
        let a = a.clone();
        return Some(
            static_check(a.scale, a.packed, ins)
                .map(|()| kernel(move |c, inputs| backward(c, &a, inputs, &outs))),
        );
    }
    if let Some(a) = op.downcast_ref::<FusedAttentionQuantizeFp8>() {
        let (to, a) = (a.quantize.to, a.attention.clone());
        return Some(
            static_check(a.scale, a.packed, ins)
                .and_then(|()| cast_check(a.packed, ins))
                .map(|()| kernel(move |c, inputs| forward(c, &a, inputs, &outs, Some(to)))),
        );
    }
    if let Some(a) = op.downcast_ref::<FusedAttentionGradQuantizeFp8>() {
        let a = a.clone();
        return Some(
            static_check(a.grad.scale, a.grad.packed, ins)
                .and_then(|()| cast_check(a.grad.packed, ins))
                .map(|()| kernel(move |c, inputs| backward_cast(c, &a, inputs, &outs))),
        );
    }
    None
}

/// What the kernels that cast o or dqkv as they store it take beyond the attention's:
/// sequences a multiple of 64 (a block's rows in one sequence, the column sums' bands
/// of 64 rows whole).
fn cast_check(packed: bool, ins: &[TensorType]) -> Result<(), String> {
    let first = ins.first().ok_or("attention takes q, k and v")?;
    let q = if packed {
        unpacked_type(first)?
    } else {
        first.clone()
    };
    match q.shape[..] {
        [_, s, _, _] if s % 64 == 0 => Ok(()),
        _ => Err(format!(
            "an attention's output or gradient is cast as it is stored for sequences a multiple of 64 long, not {q}"
        )),
    }
}

/// What [`checked_dims`] can refuse before any device is there: the scale, the dtype,
/// the head width and the kernels' 32-bit offsets.
fn static_check(scale: f64, packed: bool, ins: &[TensorType]) -> Result<(), String> {
    attention_dims(scale, packed, ins).map(|_| ())
}

/// The sizes of the attention over `ins` (q, k and v first, or one packed qkv) that the
/// kernels can take, or why not.
fn attention_dims(scale: f64, packed: bool, ins: &[TensorType]) -> Result<AttentionDims, String> {
    if packed {
        let q = unpacked_type(ins.first().ok_or("attention takes a packed qkv")?)?;
        return dims_of(scale, &q, &q, &q, 3);
    }
    let [q, k, v, ..] = ins else {
        return Err("attention takes q, k and v".into());
    };
    dims_of(scale, q, k, v, 1)
}

/// A module's blocks: `warps` warps of 16 rows of the block's own side each (`ROWS`
/// in the source), walking the other side in tiles of `tile` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    warps: usize,
    tile: usize,
}

/// The forward and dq kernels' shape for heads of up to 64.
pub const WIDE: Shape = Shape { warps: 8, tile: 64 };
/// k_dkv's: with 166 registers it runs three blocks a multiprocessor (12 warps; one
/// block of 8 in WIDE's): 138 -> 124 us on the transformer's [16, 512, 12, 64] f16
/// heads (H100), where the forward and dq kernels are slower in it (71 -> 79 us, 115
/// -> 117).
pub const NARROW: Shape = Shape { warps: 4, tile: 32 };

/// The shape of `kernel`'s blocks for heads `head_dim` wide: wider than 64, every
/// kernel takes NARROW's (WIDE's double-buffered tiles would not fit in 48 KiB, and
/// its accumulators would spill); with warpgroup products k_dq too (106 us against
/// 114 in WIDE's, where its two products' accumulators at once spill; the
/// transformer's heads, H200).
pub fn shape_of(kernel: &str, head_dim: usize, warpgroups: bool) -> Shape {
    if kernel == "k_dkv" || head_dim > 64 || (kernel == "k_dq" && warpgroups) {
        NARROW
    } else {
        WIDE
    }
}

/// Whether an attention's kernels take Hopper's warpgroup products (`wgmma`) on a GPU
/// of compute capability `sm`: heads of 64 (their rows are one 128-byte swizzle
/// atom). The transformer's heads (H200, us, A in registers): forward 72.6 -> 64.0,
/// dq 115.1 -> 106.5, dk/dv 128.3 -> 109.4.
pub fn warpgroup_products(sm: u32, head_dim: usize) -> bool {
    sm == 90 && head_dim == 64
}

impl Shape {
    fn rows(self) -> usize {
        16 * self.warps
    }
}

const BODY: &str = concat!(
    r#"
#define HD @HD@
#define WARPS @WARPS@
#define ROWS (16 * WARPS)
#define TILE @TILE@
// A causal module: a compile-time flag, so a plain attention's kernels carry none of
// the masking's registers.
#define CAUSAL @CAUSAL@
// A key bias (`bias[b * bias_stride + key]`, added to the scaled scores): a module of
// its own too.
#define BIAS @BIAS@
// Dropout of the probabilities (`m_dropout_keeps`, the Dropout op's mask): a module of
// its own.
#define DROP @DROP@
// Hopper's warpgroup products (`wgmma`, the sm_90a target) for heads of 64, where the
// module asks for them: four warps' 64 rows take a product together, B read from the
// shared tile by the tensor cores themselves; else each warp's `mma.sync` of its 16
// rows, B fragments loaded by `ldmatrix`.
#if @WGMMA@ && defined(__CUDA_ARCH_FEAT_SM90_ALL) && HD == 64
#define WGMMA 1
#else
#define WGMMA 0
#endif
// The warps that skip a causal tile together (a warpgroup's under WGMMA).
#define SKIP_WARPS (WGMMA ? 4 : 1)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  @T2@ v = @PACK@(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned ld32(const T* p) { return *reinterpret_cast<const unsigned*>(p); }
// Element (r, c) of a shared tile of rows HD wide. Rows of 128 bytes (heads of 64)
// have their 16-byte chunks swizzled by the row (chunk ^ row % 8), the layout of
// wgmma's 128-byte swizzle (tiles start 1024 bytes apart); other rows are padded by
// 16 bytes. Either way ldmatrix's eight rows and a row's copies meet no bank conflict.
#if HD == 64
#define ROW_LEN 64
__device__ __forceinline__ int tile_at(int r, int c) { return r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7); }
#else
#define ROW_LEN (HD + 8)
__device__ __forceinline__ int tile_at(int r, int c) { return r * ROW_LEN + c; }
#endif
// c += a b for a 16x16 A fragment and a 16x8 B fragment (registers as PTX lays them out:
// lane = 4 g + t holds rows g and g + 8, columns 2t, 2t + 1 (+ 8)).
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#ifdef __CUDA_ARCH__
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.@MMA@.@MMA@.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// The B fragments of n-tiles n0 (b[0], b[1]) and n0 + 8 (b[2], b[3]) at k-step k0 of a
// shared tile m: `trans` false reads B[k][n] = m[n][k], true B[k][n] = m[k][n].
template <bool trans> __device__ __forceinline__ void ldm_b(unsigned* b, const T* m, int n0, int k0, int lane) {
  const int row = lane & 7, hi_n = (lane >> 4) << 3, hi_k = ((lane >> 3) & 1) << 3;
  const T* p = m + (trans ? tile_at(k0 + row + hi_k, n0 + hi_n) : tile_at(n0 + row + hi_n, k0 + hi_k));
#ifdef __CUDA_ARCH__
  unsigned a = (unsigned)__cvta_generic_to_shared(p);
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
#else
  b[0] = b[1] = b[2] = b[3] = ld32(p);
#endif
}
// The A fragment at rows r0.., columns c0.. of a shared tile.
__device__ __forceinline__ void load_a(unsigned* a, const T* m, int r0, int c0, int g, int t) {
  a[0] = ld32(m + tile_at(r0 + g, c0 + 2 * t));
  a[1] = ld32(m + tile_at(r0 + g + 8, c0 + 2 * t));
  a[2] = ld32(m + tile_at(r0 + g, c0 + 2 * t + 8));
  a[3] = ld32(m + tile_at(r0 + g + 8, c0 + 2 * t + 8));
}
#if WGMMA
// The descriptor of a 128-byte-swizzled tile from `m` on: 8-row groups 1024 bytes
// apart (the one stride a 64-wide tile needs either way round).
__device__ __forceinline__ unsigned long long tile_desc(const T* m) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(m);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
@WGMMA_PRODUCTS@
// The descriptors of a product's k-steps over the shared tile from m on: k-major
// (`K_MAJOR`: steps of 16 columns, 32 bytes along the rows), as A (a block's kept rows)
// and as B of `a_mt` (B = m^T); else n-major (steps of 16 rows), as B of `s_m` (B = m).
template <bool K_MAJOR> __device__ __forceinline__ void descs(unsigned long long* b, const T* m) {
#pragma unroll
  for (int kc = 0; kc < (K_MAJOR ? HD : TILE) / 16; kc++) b[kc] = tile_desc(m + (K_MAJOR ? 16 * kc : 16 * kc * ROW_LEN));
}
#endif
// The A operand of the products whose rows are the block's own (q and do, or k and v
// in the dk/dv kernel), the same through its walk: under WGMMA the warpgroup's 64 rows
// of a shared tile kept for the walk, which the tensor cores read (as registers, ptxas
// of CUDA 13.0 gave their registers to other values after the first product, in a
// dropout module, and the next tile's product read those); else this warp's fragments.
struct Staged {
#if WGMMA
  const T* rows;
#else
  unsigned f[HD / 16][4];
#endif
};
// c (16 x TILE) += a (16 x HD) m^T, m a shared [TILE][HD] tile.
__device__ __forceinline__ void mma_a_mt(float (*c)[4], const Staged& a, const T* m, int lane) {
#if WGMMA
  unsigned long long ad[HD / 16], b[HD / 16];
  descs<true>(ad, a.rows);
  descs<true>(b, m);
  wg_a_mt(&c[0][0], ad, b);
#else
#pragma unroll
  for (int j = 0; j < TILE / 8; j += 2)
#pragma unroll
    for (int kc = 0; kc < HD / 16; kc++) {
      unsigned b[4];
      ldm_b<false>(b, m, 8 * j, 16 * kc, lane);
      mma(c[j], a.f[kc], b[0], b[1]);
      mma(c[j + 1], a.f[kc], b[2], b[3]);
    }
#endif
}
// Two such products (issued together on Hopper).
__device__ __forceinline__ void mma_a_mt2(float (*c0)[4], const Staged& a0, const T* m0, float (*c1)[4],
                                          const Staged& a1, const T* m1, int lane) {
#if WGMMA
  unsigned long long ad0[HD / 16], b0[HD / 16], ad1[HD / 16], b1[HD / 16];
  descs<true>(ad0, a0.rows);
  descs<true>(b0, m0);
  descs<true>(ad1, a1.rows);
  descs<true>(b1, m1);
  wg_a_mt2(&c0[0][0], ad0, b0, &c1[0][0], ad1, b1);
#else
  mma_a_mt(c0, a0, m0, lane);
  mma_a_mt(c1, a1, m1, lane);
#endif
}
// The A fragments of s (16 x TILE accumulators) rounded to T.
__device__ __forceinline__ void round_a(unsigned (*a)[4], float (*s)[4]) {
#pragma unroll
  for (int kc = 0; kc < TILE / 16; kc++) {
    a[kc][0] = pack2(s[2 * kc][0], s[2 * kc][1]);
    a[kc][1] = pack2(s[2 * kc][2], s[2 * kc][3]);
    a[kc][2] = pack2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
    a[kc][3] = pack2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
  }
}
// c (16 x HD) += s (16 x TILE accumulators, rounded to T) m, m a shared [TILE][HD] tile.
__device__ __forceinline__ void mma_s_m(float (*c)[4], float (*s)[4], const T* m, int lane) {
  unsigned a[TILE / 16][4];
  round_a(a, s);
#if WGMMA
  unsigned long long b[TILE / 16];
  descs<false>(b, m);
  wg_s_m(&c[0][0], a, b);
#else
#pragma unroll
  for (int kc = 0; kc < TILE / 16; kc++)
#pragma unroll
    for (int j = 0; j < HD / 8; j += 2) {
      unsigned b[4];
      ldm_b<true>(b, m, 8 * j, 16 * kc, lane);
      mma(c[j], a[kc], b[0], b[1]);
      mma(c[j + 1], a[kc], b[2], b[3]);
    }
#endif
}
// Two such products (issued together on Hopper).
__device__ __forceinline__ void mma_s_m2(float (*c0)[4], float (*s0)[4], const T* m0, float (*c1)[4],
                                         float (*s1)[4], const T* m1, int lane) {
#if WGMMA
  unsigned a0[TILE / 16][4], a1[TILE / 16][4];
  round_a(a0, s0);
  round_a(a1, s1);
  unsigned long long b0[TILE / 16], b1[TILE / 16];
  descs<false>(b0, m0);
  descs<false>(b1, m1);
  wg_s_m2(&c0[0][0], a0, b0, &c1[0][0], a1, b1);
#else
  mma_s_m(c0, s0, m0, lane);
  mma_s_m(c1, s1, m1, lane);
#endif
}
"#,
    copy_async_source!(),
    r#"// Starts copying rows r0 .. r0 + n of one (batch, head) of a [B, S, H, HD] tensor (`x`
// at its row 0, rows `stride` apart) into the shared tile sm, zeros past S.
__device__ __forceinline__ void load_rows(T* sm, const T* x, int stride, int S, int r0, int n) {
  for (int i = threadIdx.x; i < n * (HD / 8); i += blockDim.x) {
    int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
    bool in = r0 + r < S;
    copy_async(sm + tile_at(r, c), x + (in ? (r0 + r) * stride + c : 0), in ? 16 : 0);
  }
}
// Starts copying n values of a row statistic from `x` (zeros past S).
__device__ __forceinline__ void load_stat(float* sm, const float* x, int S, int r0, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) copy_async4(sm + i, x + (r0 + i < S ? r0 + i : 0), r0 + i < S);
}
// Rows r and r + 8 (accumulators times mul0, mul1) of such a tensor, where they exist.
__device__ __forceinline__ void store_rows(T* y, float (*acc)[4], float mul0, float mul1, int stride, int S, int r, int t) {
#pragma unroll
  for (int j = 0; j < HD / 8; j++) {
    int c = 8 * j + 2 * t;
    if (r < S) *reinterpret_cast<unsigned*>(y + r * stride + c) = pack2(acc[j][0] * mul0, acc[j][1] * mul0);
    if (r + 8 < S) *reinterpret_cast<unsigned*>(y + (r + 8) * stride + c) = pack2(acc[j][2] * mul1, acc[j][3] * mul1);
  }
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
template <int N> __device__ __forceinline__ void zero(float (*a)[4]) {
#pragma unroll
  for (int i = 0; i < N; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
}
// The block's (batch, head) and first row, and the lane's place. Blocks take the
// (batch, head)s slowest; in a causal attention the row tiles go slowest instead,
// those with the most work first (`late_heavy`: the later rows, as queries), so
// the short blocks fill the last wave.
struct Place {
  int lane, w, g, t, first;
  i64 b, h;
  __device__ Place(int len, int H, bool late_heavy) {
    lane = threadIdx.x & 31; w = threadIdx.x >> 5; g = lane >> 2; t = lane & 3;
    const int tiles = (len + ROWS - 1) / ROWS;
    i64 bh;
    int tile;
    if (CAUSAL) {
      const int heads = gridDim.x / tiles, slow = blockIdx.x / heads;
      bh = blockIdx.x % heads;
      tile = late_heavy ? tiles - 1 - slow : slow;
    } else {
      bh = blockIdx.x / tiles;
      tile = blockIdx.x % tiles;
    }
    first = tile * ROWS;
    b = bh / H; h = bh % H;
  }
  // Row 0 of this (batch, head) in a [B, len, H, HD] tensor whose rows are `rs` apart
  // (H * HD, or 3 H HD in a packed qkv).
  template <typename P> __device__ P* at(P* x, int len, int rs) const { return x + b * len * rs + h * HD; }
  __device__ i64 stat(int len, int H) const { return (b * H + h) * len; }
  // The first and last rows of the warps that skip a causal tile together with this
  // one (a warpgroup takes its products whole).
  __device__ int skip_first() const { return first + 16 * (w & ~(SKIP_WARPS - 1)); }
  __device__ int skip_last() const { return first + 16 * (w | (SKIP_WARPS - 1)) + 15; }
  // This warp's warpgroup's 64 rows of a shared tile of the block's rows.
  __device__ const T* warpgroup_rows(const T* tile) const { return tile + 16 * (w & ~3) * ROW_LEN; }
};
typedef T Buffer[2 * TILE * ROW_LEN];
#if Q8
// Where the output or the gradient is cast as it is stored (FusedAttentionQuantizeFp8,
// FusedAttentionGradQuantizeFp8): o's tiles go into the FP8 [B S, H HD] matrix `y` of
// o's rows, or dq, dk and dv's into the [B S, 3 H HD] matrix of the packed dqkv's, with
// its transpose `yt` and, for the gradient, the column sums' partials `part` (a row of
// 3 H HD per 64 rows of y); S is a multiple of 64. Each value is rounded to T as the
// unfused kernel stores it, measured into the amax, scaled and cast; both copies are
// staged in the block's shared memory (free after its walk) and written in 16-byte
// words. A column's 16-byte pieces are staged in an order turned by the column
// (`col_at`): the four lanes of a quad (columns 2 apart) store their bytes to
// different banks, where in order they shared one.
struct Q8Out {
  const float s;
  unsigned char *y, *yt, *st_row, *st_col;
  float *part, *cs;
  __device__ Q8Out(const float* scale, unsigned char* y_, unsigned char* yt_, float* part_, T* shared)
      : s(scale[0]), y(y_), yt(yt_), st_row((unsigned char*)shared), st_col((unsigned char*)shared + ROWS * HD),
        part(part_), cs((float*)((unsigned char*)shared + 2 * ROWS * HD)) {}
  // Byte `r` of column `c` in the column stage.
  __device__ __forceinline__ static int col_at(int c, int r) {
    return c * ROWS + (r ^ (16 * ((c >> 1) & (ROWS / 16 - 1))));
  }
  // The block's rows of section `sec` of `parts` (the output's 1; the gradient's 3: dq,
  // dk, dv) from the accumulators times `mul0` (rows g) and `mul1` (rows g + 8); the
  // magnitudes into `m`; with SUMS (the gradient's) the column sums' partials; where
  // `keep` is set (the output's o, rows `ks` apart from this (batch, head)'s first),
  // the rounded values also stored there. Every thread of the block calls it. Values
  // are rounded and measured in pairs, a 32-bit word of T each: their magnitudes' bits
  // order as the values do (NaN's above infinity's), so a word's two are maxed at once.
  template <bool SUMS>
  __device__ void store(float (*acc)[4], float mul0, float mul1, const Place& p, int S, int H, int parts, int sec,
                        unsigned& m, T* keep, int ks) const {
    const int W = parts * H * HD, r = 16 * p.w + p.g;
    const i64 total = (i64)gridDim.x / ((S + ROWS - 1) / ROWS) / H * S, row0 = p.b * S + p.first;
    const int col0 = (sec * H + (int)p.h) * HD;
    const bool in0 = p.first + r < S, in1 = p.first + r + 8 < S;
    unsigned pair_max = 0u;
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
      const int c = 8 * j + 2 * p.t;
      const unsigned w0 = in0 ? pack2(acc[j][0] * mul0, acc[j][1] * mul0) : 0u;
      const unsigned w1 = in1 ? pack2(acc[j][2] * mul1, acc[j][3] * mul1) : 0u;
      if (keep) {
        if (in0) *reinterpret_cast<unsigned*>(keep + (p.first + r) * ks + c) = w0;
        if (in1) *reinterpret_cast<unsigned*>(keep + (p.first + r + 8) * ks + c) = w1;
      }
      pair_max = __vmaxu2(pair_max, __vmaxu2(w0 & 0x7fff7fffu, w1 & 0x7fff7fffu));
      const T *t0 = reinterpret_cast<const T*>(&w0), *t1 = reinterpret_cast<const T*>(&w1);
      const float v[4] = {ld(t0, 0), ld(t0, 1), ld(t1, 0), ld(t1, 1)};
      const u32 lo = fp8x2(__fmul_rn(v[0], s), __fmul_rn(v[1], s)), hi = fp8x2(__fmul_rn(v[2], s), __fmul_rn(v[3], s));
      *(unsigned short*)(st_row + r * HD + c) = (unsigned short)lo;
      *(unsigned short*)(st_row + (r + 8) * HD + c) = (unsigned short)hi;
      st_col[col_at(c, r)] = (unsigned char)lo;
      st_col[col_at(c + 1, r)] = (unsigned char)(lo >> 8);
      st_col[col_at(c, r + 8)] = (unsigned char)hi;
      st_col[col_at(c + 1, r + 8)] = (unsigned char)(hi >> 8);
      if (SUMS) {
        // The warp's 16 rows' column sums, in its lanes g = 0.
        float s0 = v[0] + v[2], s1 = v[1] + v[3];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          s0 += __shfl_xor_sync(0xffffffffu, s0, o);
          s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        }
        if (p.g == 0) { cs[p.w * HD + c] = s0; cs[p.w * HD + c + 1] = s1; }
      }
    }
    const T* pm = reinterpret_cast<const T*>(&pair_max);
    m = max(m, max(__float_as_uint(ld(pm, 0)), __float_as_uint(ld(pm, 1))));
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * HD / 16; i += blockDim.x) {
      const int rr = i / (HD / 16), c16 = 16 * (i % (HD / 16));
      if (p.first + rr < S) *(uint4*)(y + (row0 + rr) * W + col0 + c16) = *(const uint4*)(st_row + rr * HD + c16);
    }
    for (int i = threadIdx.x; i < HD * ROWS / 16; i += blockDim.x) {
      const int c = i / (ROWS / 16), r16 = 16 * (i % (ROWS / 16));
      if (p.first + r16 < S) *(uint4*)(yt + (col0 + c) * total + row0 + r16) = *(const uint4*)(st_col + col_at(c, r16));
    }
    for (int i = threadIdx.x; SUMS && part && i < ROWS / 64 * HD; i += blockDim.x) {
      const int band = i / HD, c = i % HD;
      if (p.first + 64 * band < S) {
        float t = 0.f;
        for (int w = 4 * band; w < 4 * band + 4; w++) t += cs[w * HD + c];
        part[(row0 / 64 + band) * W + col0 + c] = t;
      }
    }
    __syncthreads();
  }
};
// The block's largest magnitude `m` (bits) into the amax: one atomic a block.
__device__ __forceinline__ void q8_amax_fold(unsigned m, unsigned int* amax, Buffer* sm) {
  // sm is free again once the stores are staged and written (the block maximum's 32
  // words there keep a 48 KiB forward within the static limit).
  const float mb = block_max(__uint_as_float(m), reinterpret_cast<float*>(sm));
  if (threadIdx.x == 0) atomicMax(amax, __float_as_uint(fabsf(mb)));
}
#endif
// Starts copying the tiles at rows r0.. of `a` and `b` (rows `as` and `bs` apart)
// into `buf`, a's rows first.
__device__ __forceinline__ void load_pair(T* buf, const T* a, int as, const T* b, int bs, int S, int r0) {
  load_rows(buf, a, as, S, r0, TILE);
  load_rows(buf + TILE * ROW_LEN, b, bs, S, r0, TILE);
}
// Before a double-buffered walk uses its tile `it` (rows r0.. of S): starts the next
// one, where there is one (`start(buffer, first row)` issues its copies), then waits
// for this one.
template <typename F> __device__ __forceinline__ void next_tile(int it, int r0, int S, F start) {
  if (r0 + TILE < S) {
    start((it + 1) & 1, r0 + TILE);
    commit();
    wait<1>();
  } else {
    wait<0>();
  }
#if WGMMA && defined(__CUDA_ARCH__)
  // The copies wrote through the generic proxy; wgmma reads through the async one.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
  __syncthreads();
}
// The A operands of the block's ROWS rows of x and y: under WGMMA its warpgroup's 64
// rows, kept in `kept` (two tiles of ROWS rows) whose copies the walk's first tile
// waits for (next_tile); else this warp's 16 rows' fragments, through sm's buffers.
__device__ __forceinline__ void stage_a(Staged& xa, Staged& ya, Buffer* sm, T* kept, const T* x, int xs,
                                        const T* y, int ys, int S, const Place& p) {
#if WGMMA
  load_rows(kept, x, xs, S, p.first, ROWS);
  load_rows(kept + ROWS * ROW_LEN, y, ys, S, p.first, ROWS);
  commit();
  xa.rows = p.warpgroup_rows(kept);
  ya.rows = p.warpgroup_rows(kept + ROWS * ROW_LEN);
#else
  load_rows(sm[0], x, xs, S, p.first, ROWS);
  load_rows(sm[1], y, ys, S, p.first, ROWS);
  commit();
  wait<0>();
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < HD / 16; kc++) {
    load_a(xa.f[kc], sm[0], 16 * p.w, 16 * kc, p.g, p.t);
    load_a(ya.f[kc], sm[1], 16 * p.w, 16 * kc, p.g, p.t);
  }
  __syncthreads();
#endif
}

// The keys a causal walk over the block's queries needs (all of them otherwise).
__device__ __forceinline__ int keys_needed(int Sk, int first) { return CAUSAL ? min(Sk, first + ROWS) : Sk; }
// The key bias of `key` in log2 units (the scores' exponents are base 2); callers
// pass key 0 for the columns past Sk, so no load leaves the row.
__device__ __forceinline__ float key_bias(const T* row, int key) { return BIAS ? ld(row, key) * LOG2E : 0.f; }
// One past the last key query `r` sees.
__device__ __forceinline__ int key_limit(int Sk, int r) { return CAUSAL ? min(Sk, r + 1) : Sk; }
// What the probability of (`query`, `key`) of this (batch, head) is multiplied by:
// the dropout's scale where its mask keeps it, else 0 (1 without dropout). The mask's
// element is that of the `[B, H, Sq, Sk]` probabilities.
struct Drop {
  unsigned long long seed, threshold;
  float count, scale;
  __device__ __forceinline__ float factor(i64 bh, int Sq, int Sk, int query, int key) const {
    if (!DROP) return 1.f;
    const i64 i = (bh * Sq + query) * (i64)Sk + key;
    return m_dropout_keeps(seed, count, i, threshold) ? scale : 0.f;
  }
};
__device__ __forceinline__ Drop make_drop(long long seed, const float* count, long long threshold, double scale) {
  Drop d;
  d.seed = (unsigned long long)seed; d.threshold = (unsigned long long)threshold;
  d.count = DROP ? count[0] : 0.f; d.scale = (float)scale;
  return d;
}

// Two blocks a multiprocessor (128 registers): the causal module's took 130 and ran
// one (61 against 50 us on the transformer's heads).
extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) k_fwd(const T* q, const T* k, const T* v, T* o, float* lse,
                                                               int H, int xs, int Sq, int Sk, const T* bias, int bias_stride, double scale,
                                                               long long seed, const float* count, long long threshold, double drop_scale Q8_PARAMS) {
  const Drop drop = make_drop(seed, count, threshold, drop_scale);
  // Two buffers of a K and a V tile: the next tile arrives while this one is used.
  __align__(1024) __shared__ Buffer sm[2];
  const Place p(Sq, H, true);
  // o's rows are `stride` apart; q's, k's and v's `xs` (3 H HD where packed).
  const int stride = H * HD;
  const T *kb = p.at(k, Sk, xs), *vb = p.at(v, Sk, xs), *bias_row = bias + p.b * bias_stride;
  const float sl2 = (float)scale * LOG2E;
  // q's rows: kept for the walk under WGMMA (Staged), else staged in the second buffer.
  __align__(1024) __shared__ T kept[WGMMA ? ROWS * ROW_LEN : 8];
  Staged qa;
  load_rows(WGMMA ? kept : sm[1], p.at(q, Sq, xs), xs, Sq, p.first, ROWS);
  commit();
  auto start = [&](int buf, int r0) { load_pair(sm[buf], kb, xs, vb, xs, Sk, r0); };
  start(0, 0);
  commit();
#if WGMMA
  qa.rows = p.warpgroup_rows(kept);
#else
  wait<1>();
  __syncthreads();
#pragma unroll
  for (int kc = 0; kc < HD / 16; kc++) load_a(qa.f[kc], sm[1], 16 * p.w, 16 * kc, p.g, p.t);
  __syncthreads();
#endif
  float acc[HD / 8][4];
  zero<HD / 8>(acc);
  // Running maximum (log2 units) and sum of rows g and g + 8; the sums are this lane's part.
  float m0 = -F_INF, m1 = -F_INF, l0 = 0.f, l1 = 0.f;
  const int r = p.first + 16 * p.w + p.g;
  const int kend = keys_needed(Sk, p.first);
  for (int k0 = 0, it = 0; k0 < kend; k0 += TILE, it++) {
    const T* ks = sm[it & 1];
    const T* vs = ks + TILE * ROW_LEN;
    next_tile(it, k0, kend, start);
    if (CAUSAL && k0 > p.skip_last()) {  // the warps' rows see none of the tile's keys
      __syncthreads();
      continue;
    }
    // The keys of the tile rows g and g + 8 see, counted from this lane's first
    // column: a compare with a constant per score.
    const int left0 = key_limit(Sk, r) - k0 - 2 * p.t, left1 = key_limit(Sk, r + 8) - k0 - 2 * p.t;
    float s[TILE / 8][4];
    zero<TILE / 8>(s);
    mma_a_mt(s, qa, ks, p.lane);
    float mx0 = -F_INF, mx1 = -F_INF;
#pragma unroll
    for (int j = 0; j < TILE / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        bool in = 8 * j + (e & 1) < (e < 2 ? left0 : left1);
#if BIAS
        // Biased scores in log2 units: their maximum is taken after the bias.
        s[j][e] = in ? fmaf(s[j][e], sl2, key_bias(bias_row, in ? k0 + 8 * j + 2 * p.t + (e & 1) : 0)) : -F_INF;
#else
        s[j][e] = in ? s[j][e] : -F_INF;
#endif
        if (e < 2) mx0 = fmaxf(mx0, s[j][e]); else mx1 = fmaxf(mx1, s[j][e]);
      }
#if BIAS
    float n0 = fmaxf(m0, quad_max(mx0)), n1 = fmaxf(m1, quad_max(mx1));
    // A row whose keys so far are all masked keeps a maximum of -inf: shift by 0.
    const float sh0 = n0 == -F_INF ? 0.f : n0, sh1 = n1 == -F_INF ? 0.f : n1;
    float a0 = exp2f(m0 - sh0), a1 = exp2f(m1 - sh1);
#else
    // The maximum of the raw scores, scaled (the scale is positive); the exponent by
    // fmaf (see k_dq): 72.5 -> 70.5 us, and no spill.
    float n0 = fmaxf(m0, quad_max(mx0) * sl2), n1 = fmaxf(m1, quad_max(mx1) * sl2);
    float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
#endif
    m0 = n0; m1 = n1; l0 *= a0; l1 *= a1;
#pragma unroll
    for (int j = 0; j < HD / 8; j++) { acc[j][0] *= a0; acc[j][1] *= a0; acc[j][2] *= a1; acc[j][3] *= a1; }
#pragma unroll
    for (int j = 0; j < TILE / 8; j++) {
#if BIAS
      s[j][0] = exp2f(s[j][0] - sh0); s[j][1] = exp2f(s[j][1] - sh0);
      s[j][2] = exp2f(s[j][2] - sh1); s[j][3] = exp2f(s[j][3] - sh1);
#else
      s[j][0] = exp2f(fmaf(s[j][0], sl2, -n0)); s[j][1] = exp2f(fmaf(s[j][1], sl2, -n0));
      s[j][2] = exp2f(fmaf(s[j][2], sl2, -n1)); s[j][3] = exp2f(fmaf(s[j][3], sl2, -n1));
#endif
      l0 += s[j][0] + s[j][1]; l1 += s[j][2] + s[j][3];
    }
#if DROP
    // The sums are of the undropped probabilities; the product takes the dropped.
#pragma unroll
    for (int j = 0; j < TILE / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        s[j][e] *= drop.factor(p.b * H + p.h, Sq, Sk, e < 2 ? r : r + 8, k0 + 8 * j + 2 * p.t + (e & 1));
#endif
    mma_s_m(acc, s, vs, p.lane);
    __syncthreads();
  }
  l0 = quad_sum(l0); l1 = quad_sum(l1);
#if !Q8
  store_rows(p.at(o, Sq, stride), acc, 1.f / l0, 1.f / l1, stride, Sq, r, p.t);
#endif
  if (p.t == 0) {
    float* l = lse + p.stat(Sq, H);
    if (r < Sq) l[r] = (m0 + log2f(l0)) * LN2;
    if (r + 8 < Sq) l[r + 8] = (m1 + log2f(l1)) * LN2;
  }
#if Q8
  const Q8Out out(q8_scale, q8_y, q8_yt, q8_part, &sm[0][0]);
  unsigned m = 0u;
  out.store<false>(acc, 1.f / l0, 1.f / l1, p, Sq, H, 1, 0, m, p.at(o, Sq, stride), stride);
  q8_amax_fold(m, q8_amax, sm);
#endif
}

// Warpgroup modules run the gradient kernels in narrow blocks (shape_of): wide blocks'
// kept rows (64 KiB with the tiles) would pass the static limit.
#if !(WGMMA && WARPS > 4)
// dq for ROWS queries; first delta = rowsum(do * o) of them, for k_dkv. Two blocks a
// multiprocessor: 128 registers (167 unbounded, one block), 156 -> 117 us on the
// transformer's [16, 512, 12, 64] f16 heads (H100).
extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) k_dq(const T* q, const T* k, const T* v, const T* o,
    const float* lse, const T* d_o, T* dq, float* delta, int H, int xs, int Sq, int Sk, const T* bias, int bias_stride, double scale,
    long long seed, const float* count, long long threshold, double drop_scale Q8_PARAMS) {
  const Drop drop = make_drop(seed, count, threshold, drop_scale);
  __align__(1024) __shared__ Buffer sm[2];
  const Place p(Sq, H, true);
  const int stride = H * HD;
  const T *kb = p.at(k, Sk, xs), *vb = p.at(v, Sk, xs), *ob = p.at(o, Sq, stride), *db = p.at(d_o, Sq, stride);
  const T* bias_row = bias + p.b * bias_stride;
  const float sl2 = (float)scale * LOG2E;
  __align__(1024) __shared__ T kept[WGMMA ? 2 * ROWS * ROW_LEN : 8];
  Staged qa, da;
  stage_a(qa, da, sm, kept, p.at(q, Sq, xs), xs, db, stride, Sq, p);
  auto start = [&](int buf, int r0) { load_pair(sm[buf], kb, xs, vb, xs, Sk, r0); };
  start(0, 0);
  commit();
  // delta and the log-sum-exp (log2 units) of rows g and g + 8.
  float d0 = 0.f, d1 = 0.f, L0 = 0.f, L1 = 0.f;
  const float* lb = lse + p.stat(Sq, H);
  float* deltab = delta + p.stat(Sq, H);
  for (int rr = 0; rr < 16; rr++) {
    const int row = p.first + 16 * p.w + rr;
    float part = 0.f;
    if (row < Sq)
      for (int c = p.lane; c < HD; c += 32) part += ld(db, row * stride + c) * ld(ob, row * stride + c);
    const float sum = warp_sum(part);
    const float l = row < Sq ? lb[row] * LOG2E : 0.f;
    if (p.lane == 0 && row < Sq) deltab[row] = sum;
    if (rr == p.g) { d0 = sum; L0 = l; }
    if (rr == p.g + 8) { d1 = sum; L1 = l; }
  }
  float acc[HD / 8][4];
  zero<HD / 8>(acc);
  const int r = p.first + 16 * p.w + p.g;
  const int kend = keys_needed(Sk, p.first);
  for (int k0 = 0, it = 0; k0 < kend; k0 += TILE, it++) {
    const T* ks = sm[it & 1];
    const T* vs = ks + TILE * ROW_LEN;
    next_tile(it, k0, kend, start);
    if (CAUSAL && k0 > p.skip_last()) {  // the warps' rows see none of the tile's keys
      __syncthreads();
      continue;
    }
    // The keys of the tile rows g and g + 8 see, counted from this lane's first
    // column: a compare with a constant per score.
    const int left0 = key_limit(Sk, r) - k0 - 2 * p.t, left1 = key_limit(Sk, r + 8) - k0 - 2 * p.t;
    float s[TILE / 8][4], dp[TILE / 8][4];
    zero<TILE / 8>(s);
    zero<TILE / 8>(dp);
    mma_a_mt2(s, qa, ks, dp, da, vs, p.lane);
#pragma unroll
    for (int j = 0; j < TILE / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        bool in = 8 * j + (e & 1) < (e < 2 ? left0 : left1);
        // fmaf by hand: modules compile with --fmad=false (elementwise kernels match the
        // CPU bit for bit); as a multiply and a subtract, k_dkv's took 231 registers
        // and 212 us, against 212 and 139 us with fmaf (the shapes above).
#if BIAS
        const float shift = key_bias(bias_row, in ? k0 + 8 * j + 2 * p.t + (e & 1) : 0) - (e < 2 ? L0 : L1);
#else
        const float shift = -(e < 2 ? L0 : L1);
#endif
        float pr = in ? exp2f(fmaf(s[j][e], sl2, shift)) : 0.f;
#if DROP
        dp[j][e] *= drop.factor(p.b * H + p.h, Sq, Sk, e < 2 ? r : r + 8, k0 + 8 * j + 2 * p.t + (e & 1));
#endif
        s[j][e] = pr * (dp[j][e] - (e < 2 ? d0 : d1));
      }
    mma_s_m(acc, s, ks, p.lane);
    __syncthreads();
  }
#if Q8
  const Q8Out out(q8_scale, q8_y, q8_yt, q8_part, &sm[0][0]);
  unsigned m = 0u;
  out.store<true>(acc, (float)scale, (float)scale, p, Sq, H, 3, 0, m, nullptr, 0);
  q8_amax_fold(m, q8_amax, sm);
#else
  store_rows(p.at(dq, Sq, xs), acc, (float)scale, (float)scale, xs, Sq, r, p.t);
#endif
}

// dk and dv for ROWS keys, walking every query tile.
extern "C" __global__ void __launch_bounds__(32 * WARPS) k_dkv(const T* q, const T* k, const T* v,
    const float* lse, const float* delta, const T* d_o, T* dk, T* dv, int H, int xs, int Sq, int Sk, const T* bias, int bias_stride, double scale,
    long long seed, const float* count, long long threshold, double drop_scale Q8_PARAMS) {
  const Drop drop = make_drop(seed, count, threshold, drop_scale);
  __align__(1024) __shared__ Buffer sm[2];
  __shared__ float stats[2][2][TILE];
  const Place p(Sk, H, false);
  const int stride = H * HD;
  const T *qb = p.at(q, Sq, xs), *db = p.at(d_o, Sq, stride);
  const float *lb = lse + p.stat(Sq, H), *deltab = delta + p.stat(Sq, H);
  const float sl2 = (float)scale * LOG2E;
  __align__(1024) __shared__ T kept[WGMMA ? 2 * ROWS * ROW_LEN : 8];
  Staged ka, va;
  stage_a(ka, va, sm, kept, p.at(k, Sk, xs), xs, p.at(v, Sk, xs), xs, Sk, p);
  float dka[HD / 8][4], dva[HD / 8][4];
  zero<HD / 8>(dka);
  zero<HD / 8>(dva);
  auto start = [&](int buf, int r0) {
    load_pair(sm[buf], qb, xs, db, stride, Sq, r0);
    load_stat(stats[buf][0], lb, Sq, r0, TILE);
    load_stat(stats[buf][1], deltab, Sq, r0, TILE);
  };
  // A causal walk starts at the tile of the block's first key: earlier queries see
  // none of its keys.
  const int r = p.first + 16 * p.w + p.g, qbegin = CAUSAL ? p.first / TILE * TILE : 0;
  const int qmin0 = CAUSAL ? r : 0, qmin1 = CAUSAL ? r + 8 : 0;
#if BIAS
  // This lane's keys' bias (log2 units): the same in every query tile.
  const T* bias_row = bias + p.b * bias_stride;
  const float kb0 = r < Sk ? key_bias(bias_row, r) : 0.f, kb1 = r + 8 < Sk ? key_bias(bias_row, r + 8) : 0.f;
#endif
  if (qbegin < Sq) {
    start(0, qbegin);
    commit();
  }
  for (int q0 = qbegin, it = 0; q0 < Sq; q0 += TILE, it++) {
    const T* qs = sm[it & 1];
    const T* ds = qs + TILE * ROW_LEN;
    const float *ls = stats[it & 1][0], *dl = stats[it & 1][1];
    next_tile(it, q0, Sq, start);
    if (CAUSAL && q0 + TILE <= p.skip_first()) {  // the tile's queries see none of the warps' keys
      __syncthreads();
      continue;
    }
    // Transposed tiles: rows are this warp's keys, columns the tile's queries.
    float s[TILE / 8][4], dp[TILE / 8][4];
    zero<TILE / 8>(s);
    zero<TILE / 8>(dp);
    mma_a_mt2(s, ka, qs, dp, va, ds, p.lane);
#pragma unroll
    for (int j = 0; j < TILE / 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int col = 8 * j + 2 * p.t + (e & 1);
        bool in = q0 + col < Sq && q0 + col >= (e < 2 ? qmin0 : qmin1);
#if BIAS
        const float shift = (e < 2 ? kb0 : kb1) - ls[col] * LOG2E;
#else
        const float shift = -ls[col] * LOG2E;
#endif
        float pr = in ? exp2f(fmaf(s[j][e], sl2, shift)) : 0.f;
#if DROP
        // Rows are keys here, columns queries.
        const float m = drop.factor(p.b * H + p.h, Sq, Sk, q0 + col, e < 2 ? r : r + 8);
        s[j][e] = pr * m;
        dp[j][e] = pr * (dp[j][e] * m - dl[col]);
#else
        s[j][e] = pr;
        dp[j][e] = pr * (dp[j][e] - dl[col]);
#endif
      }
    mma_s_m2(dva, s, ds, dka, dp, qs, p.lane);
    __syncthreads();
  }
#if Q8
  const Q8Out out(q8_scale, q8_y, q8_yt, q8_part, &sm[0][0]);
  unsigned m = 0u;
  out.store<true>(dka, (float)scale, (float)scale, p, Sk, H, 3, 1, m, nullptr, 0);
  out.store<true>(dva, 1.f, 1.f, p, Sk, H, 3, 2, m, nullptr, 0);
  q8_amax_fold(m, q8_amax, sm);
#else
  store_rows(p.at(dk, Sk, xs), dka, (float)scale, (float)scale, xs, Sk, r, p.t);
  store_rows(p.at(dv, Sk, xs), dva, 1.f, 1.f, xs, Sk, r, p.t);
#endif
}
#endif
"#
);

/// The module of the three kernels for `dtype` (f16 or bf16), head width `head_dim`,
/// block shape `shape` (its rows at most two tiles: `stage_a` stages them in the
/// two tile buffers), with or without the masks `(causal, key bias)`; where `cast` is
/// an FP8 dtype, the kernels cast o or dqkv to it as they store it (taking `const
/// float* scale, u8* y, u8* y^T, unsigned* amax, float* part` last) and `k_cols_fin`
/// adds the gradient's column sums' partials.
pub fn source(
    dtype: DType,
    head_dim: usize,
    (shape, warpgroups): (Shape, bool),
    (causal, key_bias, dropout): (bool, bool, bool),
    cast: Option<DType>,
) -> String {
    let (pair, pack, mma) = match dtype {
        DType::BF16 => ("__nv_bfloat162", "__floats2bfloat162_rn", "bf16"),
        _ => ("__half2", "__floats2half2_rn", "f16"),
    };
    let (cast_head, cast_tail) = match cast {
        Some(to) => (
            format!(
                "#include <cuda_fp8.h>\ntypedef unsigned int u32;\n{}#define Q8 1\n\
                 #define Q8_PARAMS , const float* q8_scale, unsigned char* q8_y, unsigned char* q8_yt, unsigned int* q8_amax, float* q8_part\n",
                fp8_pairs(to)
            ),
            column_sums_fin("S", &["S"]),
        ),
        None => ("#define Q8 0\n#define Q8_PARAMS\n".to_string(), String::new()),
    };
    let body = BODY
        .replace("@HD@", &head_dim.to_string())
        .replace("@WARPS@", &shape.warps.to_string())
        .replace("@WGMMA@", if warpgroups { "1" } else { "0" })
        .replace("@TILE@", &shape.tile.to_string())
        .replace("@CAUSAL@", if causal { "1" } else { "0" })
        .replace("@BIAS@", if key_bias { "1" } else { "0" })
        .replace("@DROP@", if dropout { "1" } else { "0" })
        .replace("@T2@", pair)
        .replace("@PACK@", pack)
        .replace("@MMA@", mma)
        .replace("@WGMMA_PRODUCTS@", &wgmma_products(shape.tile, mma));
    let sums = column_sum_dtype(dtype);
    module_multi(
        &[("", dtype), ("S", sums)],
        &format!("{cast_head}{body}{cast_tail}"),
    )
}

/// Hopper's warpgroup products for heads of 64, each one asm statement that fences,
/// issues its k-steps and waits for them (the compiler sees the accumulators written
/// when they are): `wg_a_mt` (n = `tile`, four k-steps, A and B k-major in shared
/// memory: S = Q K^T) and `wg_s_m` (n = 64, `tile` / 16 k-steps, A in registers, B
/// n-major: O += P V), each taking a thread's accumulators `d`, A (descriptors or
/// fragments) `a[k-step]` and B's descriptors `b[k-step]`; `wg_a_mt2` and `wg_s_m2`
/// issue two such products before they wait.
fn wgmma_products(tile: usize, mma: &str) -> String {
    // `a_in_registers`: A as four fragments a k-step (B n-major), else a descriptor
    // (B k-major).
    let products = |name: &str, n: usize, steps: usize, a_in_registers: bool, count: usize| {
        let accs = n / 2;
        let list = |from: usize, len: usize| {
            (from..from + len)
                .map(|i| format!("%{i}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let a_words = if a_in_registers { 4 } else { 1 };
        let mut body =
            String::from("{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\nwgmma.fence.sync.aligned;\\n");
        let (mut outs, mut ins, mut params) = (Vec::new(), Vec::new(), Vec::new());
        let a_type = if a_in_registers {
            "const unsigned (*a{q})[4]"
        } else {
            "const unsigned long long* a{q}"
        };
        for q in 0..count {
            params.push(format!(
                "float* d{q}, {}, const unsigned long long* b{q}",
                a_type.replace("{q}", &q.to_string())
            ));
            outs.extend((0..accs).map(|i| format!("\"+f\"(d{q}[{i}])")));
        }
        let inputs = count * accs;
        for q in 0..count {
            let d = list(q * accs, accs);
            let first = inputs + q * (a_words + 1) * steps;
            for k in 0..steps {
                let b = first + a_words * steps + k;
                let (a, modes) = if a_in_registers {
                    (format!("{{{}}}", list(first + 4 * k, 4)), "1")
                } else {
                    (format!("%{}", first + k), "0, 0")
                };
                body += &format!(
                    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{mma}.{mma} {{{d}}}, {a}, %{b}, p, 1, 1, {modes};\\n"
                );
            }
            if a_in_registers {
                ins.extend(
                    (0..steps).flat_map(|k| (0..4).map(move |j| format!("\"r\"(a{q}[{k}][{j}])"))),
                );
            } else {
                ins.extend((0..steps).map(|k| format!("\"l\"(a{q}[{k}])")));
            }
            ins.extend((0..steps).map(|k| format!("\"l\"(b{q}[{k}])")));
        }
        body += "wgmma.commit_group.sync.aligned;\\nwgmma.wait_group.sync.aligned 0;\\n}\\n";
        format!(
            "__device__ __forceinline__ void {name}({}) {{\n\
             #ifdef __CUDA_ARCH__\n\
             \x20 asm volatile(\"{body}\"\n\
             \x20              : {}\n\
             \x20              : {} : \"memory\");\n\
             #endif\n}}\n",
            params.join(", "),
            outs.join(", "),
            ins.join(", ")
        )
    };
    [
        products("wg_a_mt", tile, 4, false, 1),
        products("wg_a_mt2", tile, 4, false, 2),
        products("wg_s_m", 64, tile / 16, true, 1),
        products("wg_s_m2", 64, tile / 16, true, 2),
    ]
    .concat()
}

/// The sizes of an attention of these types that the kernels can take, or why not;
/// `parts` tensors of q's width in a row (3 packed, else 1).
fn dims_of(
    scale: f64,
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    parts: usize,
) -> Result<AttentionDims, String> {
    if !(scale > 0.0 && scale.is_finite()) {
        // The forward kernel scales each row's maximum of the raw scores.
        return Err(format!(
            "no CUDA attention kernel for the scale {scale} (positive only)"
        ));
    }
    let dims = AttentionDims::of(q, k, v)?;
    if !matches!(q.dtype, DType::F16 | DType::BF16) {
        return Err(format!("no CUDA attention kernel for {}", q.dtype));
    }
    if !tensor_core_head_dim(dims.head_dim) {
        return Err(format!(
            "no CUDA attention kernel for head width {} (a multiple of 16 up to 128)",
            dims.head_dim
        ));
    }
    // Offsets within one (batch, head) are 32-bit.
    if dims.q_len.max(dims.k_len) * parts * dims.heads * dims.head_dim > i32::MAX as usize {
        return Err("attention too large for the kernels' 32-bit offsets".into());
    }
    Ok(dims)
}

/// The sizes of an attention whose tensors the kernels can take, or why not: q, k and
/// v packed in `tensors[0]` where `packed`.
fn checked_dims(
    c: &Ctx,
    scale: f64,
    packed: bool,
    tensors: &[&DTensor],
) -> Result<AttentionDims, String> {
    let types: Vec<TensorType> = tensors
        .iter()
        .take(qkv_inputs(packed))
        .map(|t| t.ty())
        .collect();
    let dims = attention_dims(scale, packed, &types)?;
    let q = tensors
        .first()
        .ok_or("internal: attention without q, k and v")?;
    if c.dev.sm < 80 {
        return Err("the attention kernels need Tensor Core mma (compute capability 8.0)".into());
    }
    // q, k, v (and do) are read in 16-byte words.
    if tensors
        .iter()
        .any(|t| t.dtype == q.dtype && t.ptr() % 16 != 0)
    {
        return Err("internal: attention tensors must be 16-byte aligned".into());
    }
    Ok(dims)
}

/// The scale, which every kernel takes, whether the attention is causal, its key
/// bias and the probabilities' dropout with its step count (each a module of its own).
#[derive(Clone, Copy)]
struct Rule<'a> {
    scale: f64,
    causal: bool,
    key_bias: Option<&'a DTensor>,
    dropout: Option<(Dropout, &'a DTensor)>,
}

impl<'a> Rule<'a> {
    /// The rule of an op's attrs; its key bias, the input after `fixed` ones, and
    /// the dropout's step count, the last.
    fn new(
        (scale, causal, dropout): (f64, bool, Option<Dropout>),
        inputs: &'a [DTensor],
        fixed: usize,
    ) -> Result<Rule<'a>, String> {
        let mut rest = &inputs[fixed.min(inputs.len())..];
        let dropout = match dropout {
            Some(d) => {
                let (count, before) = rest.split_last().ok_or("missing the step count")?;
                rest = before;
                Some((d, count))
            }
            None => None,
        };
        let key_bias = match rest {
            [] => None,
            [bias] => Some(bias),
            _ => return Err(format!("attention takes at most {} inputs", fixed + 2)),
        };
        Ok(Rule {
            scale,
            causal,
            key_bias,
            dropout,
        })
    }

    /// The dropout's seed, step count, threshold and scale; zeros where there is none.
    fn dropout_args(&self) -> [Arg; 4] {
        match self.dropout {
            Some((d, count)) => [
                Arg::I64(d.seed as i64),
                count.arg(),
                Arg::I64(d.threshold() as i64),
                Arg::F64(d.scale()),
            ],
            None => [Arg::I64(0), Arg::Ptr(0), Arg::I64(0), Arg::F64(1.0)],
        }
    }

    /// The key bias's pointer and batch stride (0 where one row serves every batch);
    /// a null pointer where there is none.
    fn key_bias_args(&self, dims: &AttentionDims, dtype: DType) -> Result<[Arg; 2], String> {
        let Some(bias) = self.key_bias else {
            return Ok([Arg::Ptr(0), Arg::I32(0)]);
        };
        let ty = TensorType::new(bias.dtype, bias.shape.clone());
        check_key_bias(&ty, (dims.batch, dims.k_len), dtype)?;
        let stride = if bias.shape[0] == 1 { 0 } else { dims.k_len };
        let stride = i32::try_from(stride).map_err(|_| "key bias too long".to_string())?;
        Ok([bias.arg(), Arg::I32(stride)])
    }
}

/// q, k and v (or dq, dk and dv) as kernel arguments, and the distance between their
/// rows: three tensors, or three places in one packed tensor.
fn parts(tensors: &[&DTensor], dims: &AttentionDims) -> ([Arg; 3], usize) {
    let width = dims.heads * dims.head_dim;
    match tensors {
        [packed] => {
            let at =
                |j: usize| Arg::Ptr(packed.ptr() + (j * width * packed.dtype.size_bytes()) as u64);
            ([at(0), at(1), at(2)], 3 * width)
        }
        _ => (
            [tensors[0].arg(), tensors[1].arg(), tensors[2].arg()],
            width,
        ),
    }
}

/// The module `kernel` of an attention of `dims` and `dtype` under `rule` is in, o or
/// the gradient cast to `cast` as it is stored where given.
fn spec_of(
    (kernel, sm): (&str, u32),
    dims: &AttentionDims,
    dtype: DType,
    rule: &Rule,
    cast: Option<DType>,
) -> Spec {
    let warpgroups = warpgroup_products(sm, dims.head_dim);
    Spec {
        dtype,
        head_dim: dims.head_dim,
        shape: shape_of(kernel, dims.head_dim, warpgroups),
        warpgroups,
        causal: rule.causal,
        key_bias: rule.key_bias.is_some(),
        dropout: rule.dropout.is_some(),
        cast,
    }
}

/// Launches `kernel` over `rows` rows a (batch, head) with `args` (its pointers) and
/// `xs`, the distance between the rows of q, k, v and their gradients; where o or the
/// gradient is cast as it is stored, `cast` has the FP8 dtype and the cast's
/// arguments, which come last.
#[allow(clippy::too_many_arguments)]
fn launch(
    c: &Ctx,
    kernel: &'static str,
    dims: &AttentionDims,
    rows: usize,
    dtype: DType,
    mut args: Vec<Arg>,
    xs: usize,
    rule: Rule,
    cast: Option<(DType, &[Arg])>,
) -> Result<(), String> {
    let spec = spec_of(
        (kernel, c.dev.sm),
        dims,
        dtype,
        &rule,
        cast.map(|(to, _)| to),
    );
    let blocks = dims.batch * dims.heads * rows.div_ceil(spec.shape.rows());
    if blocks == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(blocks).map_err(|_| "attention too large for one grid")?;
    let int = |n: usize| i32::try_from(n).map_err(|_| "attention too large".to_string());
    args.extend([
        Arg::I32(int(dims.heads)?),
        Arg::I32(int(xs)?),
        Arg::I32(int(dims.q_len)?),
        Arg::I32(int(dims.k_len)?),
    ]);
    args.extend(rule.key_bias_args(dims, dtype)?);
    args.push(Arg::F64(rule.scale));
    args.extend(rule.dropout_args());
    args.extend(cast.into_iter().flat_map(|(_, a)| a.iter().cloned()));
    let threads = 32 * spec.shape.warps as u32;
    c.launch(&spec, kernel, (blocks, threads), &args)
}

/// `o, lse = FusedAttention(q, k, v[, key bias])` (or of a packed qkv); with `cast`,
/// `o, lse, y, amax, y^T = FusedAttentionQuantizeFp8(the same, scale)`: the kernel
/// casts o's rows to `cast` as it stores them.
fn forward(
    c: &Ctx,
    op: &FusedAttention,
    inputs: &[DTensor],
    outs: &[TensorType],
    cast: Option<DType>,
) -> Result<Vec<DTensor>, String> {
    let (inputs, scale) = match cast {
        Some(_) => {
            let (scale, rest) = inputs.split_last().ok_or("missing the scale")?;
            (rest, Some(scale))
        }
        None => (inputs, None),
    };
    let n_qkv = qkv_inputs(op.packed);
    if inputs.len() < n_qkv {
        return Err("FusedAttention takes q, k and v".into());
    }
    let qkv: Vec<&DTensor> = inputs[..n_qkv].iter().collect();
    let rule = Rule::new((op.scale, op.causal, op.dropout), inputs, n_qkv)?;
    let (o_ty, lse_ty, cast_tys) = match (outs, cast) {
        ([o, lse], None) => (o, lse, &[][..]),
        ([o, lse, rest @ ..], Some(_)) if rest.len() == 3 => (o, lse, rest),
        (_, None) => return Err("FusedAttention has two outputs".into()),
        (_, Some(_)) => {
            return Err("FusedAttentionQuantizeFp8 gives o, lse, y, its amax and y^T".into())
        }
    };
    let o = c.alloc(o_ty)?;
    let lse = c.alloc(lse_ty)?;
    let dims = checked_dims(c, op.scale, op.packed, &[&qkv[..], &[&o, &lse]].concat())?;
    let (qkv_args, xs) = parts(&qkv, &dims);
    let mut args = qkv_args.to_vec();
    args.extend([o.arg(), lse.arg()]);
    let d = o.dtype;
    let mut outputs = vec![o, lse];
    let mut cast_args = Vec::new();
    if let (Some(scale), [y, amax, yt]) = (scale, cast_tys) {
        let (y, amax, yt) = (c.alloc(y)?, c.alloc_zeroed(amax)?, c.alloc(yt)?);
        cast_args = vec![scale.arg(), y.arg(), yt.arg(), amax.arg(), Arg::Ptr(0)];
        outputs.extend([y, amax, yt]);
    }
    let cast = cast.map(|to| (to, &cast_args[..]));
    launch(c, "k_fwd", &dims, dims.q_len, d, args, xs, rule, cast)?;
    Ok(outputs)
}

/// `dq, dk, dv = FusedAttentionGrad(q, k, v, o, lse, do[, key bias])` (or `dqkv` of a
/// packed qkv).
fn backward(
    c: &Ctx,
    op: &FusedAttentionGrad,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let n_qkv = qkv_inputs(op.packed);
    let [o, lse, d_o] = match inputs.get(n_qkv..n_qkv + 3) {
        Some([o, lse, d_o]) => [o, lse, d_o],
        _ => return Err("FusedAttentionGrad takes q, k, v, o, lse and do".into()),
    };
    let qkv: Vec<&DTensor> = inputs[..n_qkv].iter().collect();
    let rule = Rule::new((op.scale, op.causal, op.dropout), inputs, n_qkv + 3)?;
    if outs.len() != n_qkv {
        return Err(format!("FusedAttentionGrad has {n_qkv} outputs"));
    }
    let grads = c.alloc_all(outs)?;
    let grad_refs: Vec<&DTensor> = grads.iter().collect();
    let all = [&qkv[..], &[o, lse, d_o], &grad_refs[..]].concat();
    let dims = checked_dims(c, op.scale, op.packed, &all)?;
    let delta = c.temp(DType::F32, lse.len())?;
    let (qkv_args, xs) = parts(&qkv, &dims);
    let (grad_args, _) = parts(&grad_refs, &dims);
    let saved = [o.arg(), lse.arg(), d_o.arg(), delta.arg()];
    let kernels = (&dims, xs, rule, o.dtype);
    launch_gradient(c, kernels, qkv_args, saved, grad_args, None)?;
    Ok(grads)
}

/// Launches the gradient's kernels: k_dq (which writes delta first), then k_dkv, over
/// q, k and v, the forward's o and lse, do and delta, into dq, dk and dv (null where
/// `cast` has the kernels cast them as they store them).
fn launch_gradient(
    c: &Ctx,
    (dims, xs, rule, dtype): (&AttentionDims, usize, Rule, DType),
    [q, k, v]: [Arg; 3],
    [o, lse, d_o, delta]: [Arg; 4],
    [dq, dk, dv]: [Arg; 3],
    cast: Option<(DType, &[Arg])>,
) -> Result<(), String> {
    let dq_args = vec![
        q.clone(),
        k.clone(),
        v.clone(),
        o,
        lse.clone(),
        d_o.clone(),
        dq,
        delta.clone(),
    ];
    launch(c, "k_dq", dims, dims.q_len, dtype, dq_args, xs, rule, cast)?;
    let dkv_args = vec![q, k, v, lse, delta, d_o, dk, dv];
    launch(
        c, "k_dkv", dims, dims.k_len, dtype, dkv_args, xs, rule, cast,
    )
}

/// `y, amax, y^T[, column sums] = FusedAttentionGradQuantizeFp8(qkv, o, lse, do[, key
/// bias][, count], scale)`: the gradient kernels cast dq, dk and dv into the FP8
/// matrix of dqkv's rows as they store them (no 16-bit dqkv), `k_cols_fin` adds the
/// column sums' partials, one row per 64 rows.
fn backward_cast(
    c: &Ctx,
    op: &FusedAttentionGradQuantizeFp8,
    inputs: &[DTensor],
    outs: &[TensorType],
) -> Result<Vec<DTensor>, String> {
    let g = &op.grad;
    let (scale, grad_inputs) = inputs.split_last().ok_or("missing the scale")?;
    let [qkv, o, lse, d_o] = match grad_inputs.get(..4) {
        Some([qkv, o, lse, d_o]) => [qkv, o, lse, d_o],
        _ => {
            return Err("FusedAttentionGradQuantizeFp8 takes qkv, o, lse, do and the scale".into())
        }
    };
    let rule = Rule::new((g.scale, g.causal, g.dropout), grad_inputs, 4)?;
    let (y_ty, amax_ty, yt_ty) = match outs {
        [y, amax, yt, ..] => (y, amax, yt),
        _ => return Err("FusedAttentionGradQuantizeFp8 gives y, its amax and y^T".into()),
    };
    let y = c.alloc(y_ty)?;
    let amax = c.alloc_zeroed(amax_ty)?;
    let yt = c.alloc(yt_ty)?;
    let sums = outs.get(3).map(|t| c.alloc(t)).transpose()?;
    let dims = checked_dims(c, g.scale, true, &[qkv, o, lse, d_o])?;
    let delta = c.temp(DType::F32, lse.len())?;
    let width = 3 * dims.heads * dims.head_dim;
    let bands = dims.batch * dims.q_len / 64;
    let part = c.temp(DType::F32, bands * width)?;
    let (qkv_args, xs) = parts(&[qkv], &dims);
    let d = o.dtype;
    let to = op.cast.quantize.to;
    let cast_args = [scale.arg(), y.arg(), yt.arg(), amax.arg(), part.arg()];
    let saved = [o.arg(), lse.arg(), d_o.arg(), delta.arg()];
    let grads = [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0)];
    let cast = Some((to, &cast_args[..]));
    launch_gradient(c, (&dims, xs, rule, d), qkv_args, saved, grads, cast)?;
    let mut outputs = vec![y, amax, yt];
    if let Some(sums) = sums {
        let spec = spec_of(("k_dq", c.dev.sm), &dims, d, &rule, Some(to));
        launch_column_sums_fin(c, &spec, &part, width, bands, &[(&sums, 1.0)])?;
        outputs.push(sums);
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::wgmma_products;

    /// The operands an asm statement's template names (`%N`), in order of first use.
    fn named_operands(template: &str) -> Vec<usize> {
        let mut names = Vec::new();
        let mut rest = template;
        while let Some(at) = rest.find('%') {
            rest = &rest[at + 1..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(n) = digits.parse() {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
        names
    }

    /// The host compilers of the parse check never see inside the warpgroup products'
    /// asm (it is device code), and the GPU only runs it: here every statement names
    /// each operand it declares and no other, and issues its products' k-steps with
    /// the widths and layouts the kernels expect.
    #[test]
    fn warpgroup_products_name_every_operand_they_declare() {
        for tile in [32, 64] {
            for mma in ["bf16", "f16"] {
                let source = wgmma_products(tile, mma);
                let functions: Vec<&str> = source.split("__device__").skip(1).collect();
                assert_eq!(functions.len(), 4, "{source}");
                for f in functions {
                    let name: String = f
                        .split('(')
                        .next()
                        .and_then(|head| head.split_whitespace().last())
                        .unwrap()
                        .to_string();
                    let start = f.find("asm volatile(\"").unwrap() + "asm volatile(\"".len();
                    let template = &f[start..start + f[start..].find("\"\n").unwrap()];
                    let declared = ["\"+f\"(", "\"r\"(", "\"l\"("]
                        .iter()
                        .map(|c| f.matches(c).count())
                        .sum::<usize>();
                    let mut named = named_operands(template);
                    named.sort_unstable();
                    assert_eq!(named, (0..declared).collect::<Vec<_>>(), "{name}: {f}");
                    let (count, n, steps, a_in_registers) = match name.as_str() {
                        "wg_a_mt" => (1, tile, 4, false),
                        "wg_a_mt2" => (2, tile, 4, false),
                        "wg_s_m" => (1, 64, tile / 16, true),
                        "wg_s_m2" => (2, 64, tile / 16, true),
                        other => panic!("unexpected product {other}"),
                    };
                    let shape = format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{mma}.{mma} ");
                    assert_eq!(template.matches(&shape).count(), count * steps, "{name}");
                    // A from registers takes B n-major (one mode), by descriptor k-major (two).
                    let modes = if a_in_registers {
                        "p, 1, 1, 1;"
                    } else {
                        "p, 1, 1, 0, 0;"
                    };
                    assert_eq!(template.matches(modes).count(), count * steps, "{name}");
                    assert_eq!(
                        declared,
                        count * (n / 2 + steps * if a_in_registers { 5 } else { 2 })
                    );
                    assert!(template.contains("wgmma.fence.sync.aligned;"), "{name}");
                    assert!(
                        template.ends_with("wgmma.wait_group.sync.aligned 0;\\n}\\n"),
                        "{name}"
                    );
                }
            }
        }
    }
}
