//! FP8 (issue 44): the scaled casts (`QuantizeFp8` with its amax, `DequantizeFp8`),
//! the scales of current and delayed scaling (`Fp8Scale`, `Fp8ScaleOfAmax`,
//! `Fp8ScaleUpdate`) and the
//! FP8 product (`Fp8MatMul`) through cuBLASLt. Each kernel computes what the op's CPU
//! reference does, bit for bit: products and quotients in f32 with IEEE rounding, the
//! conversion `cuda_fp8.h`'s saturating one (`cvt.rn.satfinite`, as
//! `ampgraph_graph::fp8` rounds).
//!
//! Hopper's FP8 products take both operands K-major (cuBLASLt's "TN"): `a` as
//! `[m, k]` and `b` as `[n, k]`, row-major; an operand the product's flags hold the
//! other way is transposed into the node's scratch first. cuBLASLt also needs `k` and
//! `n` multiples of 16 (16-byte leading dimensions): other shapes are refused by name.

use ampgraph_graph::fp8::Fp8;
use ampgraph_graph::ops::{
    AmaxChoice, DequantizeFp8, Epilogue, Fp8MatMul, Fp8Scale, Fp8ScaleOfAmax, Fp8ScaleUpdate,
    FusedAttentionGradQuantizeFp8, FusedAttentionQuantizeFp8, FusedElementwise, FusedQuantizeFp8,
    GroupedQuantizeFp8, LayerNormGradQuantizeFp8, LayerNormQuantizeFp8, QuantizeFp8, UnaryKind,
};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    column_sums_fin, copy_async_source, elementwise, module_multi, At, Load, Store, VECTOR,
};
use super::fused::{FusedParts, ROUNDING};
use super::{
    first, input, kernel, launch_column_sums_fin, launch_grouped, one_output, update_table, Ctx,
    KernelResult, KernelSpec, Lowering,
};
use crate::cuda::device::{items_grid, update_table_declaration, Arg, DTensor, GROUP_MEMBERS};
use crate::cuda::gemm::Product;
use ampgraph_graph::ops::fused::{column_sum_dtype, Expr};

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Debug, PartialEq)]
    enum Spec in "fp8" {
        /// `k(const TX* px, i64 n, unsigned* amax)`: `amax` (zeroed first) becomes the
        /// bits of `max |x|` (NaN where one is); `x` is the activation's value where
        /// the op has one (each kernel reading `x` likewise).
        Amax { x: DType, activation: Option<UnaryKind> } => amax(x, activation),
        /// `k(const TX* px, const float* ps, TY* py, unsigned* amax, i64 n)`:
        /// `y = fp8(x * s)` and, as [`Spec::Amax`], `max |x|`.
        Quantize { x: DType, to: DType, activation: Option<UnaryKind> } => quantize(x, to, activation),
        /// `k(const TX* px, const float* ps, TY* py, TY* pt, unsigned* amax, i64 rows,
        /// i64 cols)`: [`Spec::Quantize`] of a `rows x cols` matrix (both multiples of
        /// 8) also writing `pt = y^T`, per 64x64 tile through shared memory.
        /// `whole`: the sides are multiples of 64 and the matrix under 2^31 elements
        /// ([`Tiles::of`]).
        QuantizeTransposed { x: DType, to: DType, activation: Option<UnaryKind>, whole: bool } => quantize_transposed(x, to, activation, Tiles { whole }),
        /// `k_group(const UpdateTable t, int members)`: [`Spec::QuantizeTransposed`] of
        /// up to 32 matrices, each its own blocks of the grid, into zeroed amaxes
        /// ([`group_head`] has the table's rows).
        QuantizeTransposedGroup { x: DType, to: DType, whole: bool } => quantize_transposed_group(x, to, Tiles { whole }),
        /// `k(<inputs>, const float* ps, TY* py, TY* pt, unsigned* amax[, AS* part],
        /// i64 rows, i64 cols)`: [`Spec::QuantizeTransposed`] of the value `program`
        /// computes from its inputs (all of the matrix's size) per tile, with the
        /// program's column sums per tile into `part[(tile row * sums + k) * cols + j]`,
        /// which `k_cols_fin` adds.
        QuantizeProgram { program: FusedElementwise, to: DType, whole: bool } => quantize_program(&program, to, Tiles { whole }),
        /// `k(const TY* py, const float* pinv, TO* po, i64 n)`: `o = y * inv`.
        Dequantize { y: DType, to: DType } => dequantize(y, to),
        /// `k(const float* amax, float* scale, float* inv)`: one thread.
        Scale { format: DType, margin: i32 } => scale(format, margin),
        /// `k(const UpdateTable t)`: block `m` steps member `m` (row `m`: its history,
        /// amax, scale and inverse (unread), then its next history, scale and inverse;
        /// `t.n[m]` the history's length), at least as many threads as the longest
        /// history.
        ScaleUpdate { format: DType, margin: i32, most_recent: bool } => scale_update(format, margin, most_recent),
        /// `k(const u8* x, u8* y, i64 rows, i64 cols)`: `y = x^T` of bytes, a block of
        /// 256 threads per 32x32 tile; `k_words`, rows and columns multiples of 4, per
        /// 64x64 tile in 4-byte words.
        Transpose {} => transpose(),
    }
}

/// The longest amax history one block updates.
const MAX_HISTORY: usize = 1024;

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(q) = op.downcast_ref::<QuantizeFp8>() {
        return Some(lower_quantize(q, ins, outs));
    }
    if let Some(g) = op.downcast_ref::<GroupedQuantizeFp8>() {
        return Some(lower_grouped_quantize(g, ins, outs));
    }
    if let Some(f) = op.downcast_ref::<FusedQuantizeFp8>() {
        return Some(lower_quantize_program(f, ins, outs));
    }
    if let Some(f) = op.downcast_ref::<LayerNormQuantizeFp8>() {
        return Some(super::norm::lower_layer_norm_fp8(f, ins, outs));
    }
    if let Some(f) = op.downcast_ref::<LayerNormGradQuantizeFp8>() {
        return Some(super::norm::lower_layer_norm_grad_fp8(f, ins, outs));
    }
    if op.is::<FusedAttentionGradQuantizeFp8>() || op.is::<FusedAttentionQuantizeFp8>() {
        return super::attention::lower(op, ins, outs);
    }
    if let Some(d) = op.downcast_ref::<DequantizeFp8>() {
        return Some(lower_dequantize(d, ins, outs));
    }
    if let Some(s) = op.downcast_ref::<Fp8Scale>() {
        return Some(lower_scale(s, false, ins, outs));
    }
    if let Some(s) = op.downcast_ref::<Fp8ScaleOfAmax>() {
        return Some(lower_scale(&s.scale, true, ins, outs));
    }
    if let Some(u) = op.downcast_ref::<Fp8ScaleUpdate>() {
        return Some(lower_scale_update(u, ins, outs));
    }
    if let Some(m) = op.downcast_ref::<Fp8MatMul>() {
        return Some(lower_matmul(m, ins, outs));
    }
    None
}

/// The largest finite value of an FP8 dtype (the ops check theirs is one), as a C
/// float literal.
fn largest(format: DType) -> String {
    format!("{:?}f", Fp8::of(format).unwrap_or(Fp8::E4M3).max())
}

/// A module of the named dtypes with `cuda_fp8.h`'s types.
pub(super) fn fp8_module(types: &[(&str, DType)], body: &str) -> String {
    format!("#include <cuda_fp8.h>\n{}", module_multi(types, body))
}

/// Declares the per-thread amax `m`: the bits of `max |x|` so far. Non-negative
/// floats (NaN included, its sign cleared) order as their bits do, so one integer max
/// measures an element, NaN winning ([`amax_measure`]), where a float max that lets NaN
/// win took five instructions.
pub(super) fn amax_declaration(m: &str) -> String {
    format!("unsigned int {m} = 0u;\n")
}

/// Folds `|x|` (a float) into the amax `m`.
pub(super) fn amax_measure(m: &str, x: &str) -> String {
    format!("{m} = max({m}, __float_as_uint({x}) & 0x7fffffffu);")
}

/// The per-thread amax `m` ([`amax_declaration`]) folded over the block and into
/// `amax` (a `unsigned int*`) by its bits. Every thread of the block runs it. One
/// atomic a block: atomics on one address serialise (a warp's each made the amax pass
/// 4x slower than its reads), so the amax kernels run [`AMAX_BLOCKS`] blocks at most.
pub(super) fn amax_fold(m: &str, amax: &str) -> String {
    format!(
        "  {{ __shared__ float sh_amax[32];\n\
           const float m_block = block_max(__uint_as_float({m}), sh_amax);\n\
           if (threadIdx.x == 0) atomicMax({amax}, __float_as_uint(fabsf(m_block))); }}\n"
    )
}

/// The amax kernels' largest grid: about the blocks of 256 threads Hopper's 132 SMs
/// hold at once; their grid-stride loops cover larger tensors.
pub(super) const AMAX_BLOCKS: u32 = 1024;

/// An amax kernel's launch over `n` elements: one atomic a block per amax, so a grid
/// the GPU holds at once, striding.
pub(super) fn launch_amax<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    n: usize,
    args: &[Arg],
) -> Result<(), String> {
    let blocks = items_grid(n, VECTOR).min(AMAX_BLOCKS);
    c.launch(spec, "k", (blocks, 256), args)
}

/// `x` of dtype `d` at `px`, read into a float `x` by the vectorised loops.
fn x_load(d: DType) -> Load<'static> {
    Load {
        ty: "float",
        name: "x",
        loader: "ldX",
        ptr: "px",
        bytes: d.size_bytes(),
        at: At::Own,
    }
}

/// The statements replacing the float `x` just read by its activation's value, rounded
/// to the stored dtype `X` as the activation's node stored it (nothing without one).
fn activate(activation: Option<UnaryKind>) -> String {
    match activation {
        None => String::new(),
        Some(kind) => format!(
            "{{ typedef float C; {} TX r[1]; stX(r, 0, y); x = ldX(r, 0); }}\n",
            kind.cuda_expr()
        ),
    }
}

/// [`activate`] leaving the value unrounded, for a kernel that rounds it in pairs
/// ([`CastTranspose::paired`]).
fn activate_unrounded(kind: UnaryKind) -> String {
    format!("{{ typedef float C; {} x = y; }}\n", kind.cuda_expr())
}

/// The 16-bit dtypes a [`cast_transpose`] kernel rounds its values to two at a time:
/// `u32 round2(lo, hi)` packs the pair as the dtype's stores would, `lo_of` and `hi_of`
/// widen the halves back, `round_measure2(lo, hi, m2)` rounds a pair and folds its
/// magnitudes into `m2` (a `__vmaxu2` of the pairs, signs cleared), and
/// `pair_amax_bits(m2)` turns that into the bits of their float amax, as
/// [`amax_measure`] keeps it.
pub(super) fn pair_rounding(d: DType) -> Option<String> {
    let (pair, pack, widen) = match d {
        DType::BF16 => (
            "__nv_bfloat162",
            "__floats2bfloat162_rn",
            "__uint_as_float((u32)(h) << 16)",
        ),
        DType::F16 => (
            "__half2",
            "__floats2half2_rn",
            "__half2float(__ushort_as_half((unsigned short)(h)))",
        ),
        _ => return None,
    };
    Some(format!(
        "__device__ __forceinline__ u32 round2(float lo, float hi) {{ {pair} v = {pack}(lo, hi); return *reinterpret_cast<u32*>(&v); }}\n\
         __device__ __forceinline__ float widen16(u32 h) {{ return {widen}; }}\n\
         __device__ __forceinline__ float lo_of(u32 w) {{ return widen16(w & 0xffffu); }}\n\
         __device__ __forceinline__ float hi_of(u32 w) {{ return widen16(w >> 16); }}\n\
         __device__ __forceinline__ u32 round_measure2(float lo, float hi, u32& m2) {{ const u32 w = round2(lo, hi); m2 = __vmaxu2(m2, w & 0x7fff7fffu); return w; }}\n\
         __device__ __forceinline__ u32 pair_amax_bits(u32 m2) {{ return __float_as_uint(widen16(max(m2 & 0xffffu, m2 >> 16))); }}\n"
    ))
}

pub(super) fn amax(x: DType, activation: Option<UnaryKind>) -> String {
    let measure = format!("{}{}", activate(activation), amax_measure("m", "x"));
    let body = elementwise(&[x_load(x)], &measure, &[]);
    let (declaration, fold) = (amax_declaration("m"), amax_fold("m", "amax"));
    fp8_module(
        &[("X", x)],
        &format!(
            "extern \"C\" __global__ void k(const TX* px, i64 n, unsigned int* amax) {{\n\
               {declaration}{body}{fold}}}\n"
        ),
    )
}

pub(super) fn quantize(x: DType, to: DType, activation: Option<UnaryKind>) -> String {
    let y = Store {
        storer: "stY",
        ptr: "py",
        bytes: 1,
        value: "__fmul_rn(x, s)",
    };
    let measure = format!("{}{}", activate(activation), amax_measure("m", "x"));
    let body = elementwise(&[x_load(x)], &measure, &[y]);
    let (declaration, fold) = (amax_declaration("m"), amax_fold("m", "amax"));
    fp8_module(
        &[("X", x), ("Y", to)],
        &format!(
            "extern \"C\" __global__ void k(const TX* px, const float* ps, TY* py, unsigned int* amax, i64 n) {{\n\
               const float s = ps[0];\n\
               {declaration}{body}{fold}}}\n"
        ),
    )
}

/// The side of [`quantize_transposed`]'s square tiles (128 measured slower).
const QT_TILE: usize = 64;

/// `x` cast with its transposed copy ([`cast_transpose`]), `x` the activation's value
/// where the op has one.
pub(super) fn quantize_transposed(
    x: DType,
    to: DType,
    activation: Option<UnaryKind>,
    tiles: Tiles,
) -> String {
    cast_transpose_of_x(
        x,
        to,
        activation,
        tiles,
        &kernel_head("const TX* __restrict__ px", ""),
    )
}

/// [`quantize_transposed`] of a group's members, each with its own blocks of one grid
/// ([`group_head`]).
pub(super) fn quantize_transposed_group(x: DType, to: DType, tiles: Tiles) -> String {
    cast_transpose_of_x(x, to, None, tiles, &group_head())
}

/// The cast-transpose kernel of one input `px` under `head`. An activation's values
/// are rounded to `x`'s dtype two at a time where it is 16 bits.
fn cast_transpose_of_x(
    x: DType,
    to: DType,
    activation: Option<UnaryKind>,
    tiles: Tiles,
    head: &str,
) -> String {
    let paired = activation.and(pair_rounding(x)).map(|_| x);
    let activated = match (activation, paired) {
        (Some(kind), Some(_)) => activate_unrounded(kind),
        _ => activate(activation),
    };
    cast_transpose(CastTranspose {
        types: &[("X", x)],
        to,
        tiles,
        prefix: "",
        head,
        shared: "",
        shared_bytes: 0,
        rows: &[RowInput {
            ty: "TX",
            bytes: x.size_bytes(),
            name: "xs",
            ptr: "px",
        }],
        block_start: "",
        element: &format!("float x = ldX(xs[i].v, b);\n{activated}"),
        element_end: "",
        paired,
        pair_end: "",
        block_end: "",
        after: "",
    })
}

/// The head of a cast-transpose kernel `k` of its own grid: its parameters are the
/// inputs (`inputs`), the scale, the outputs, the amax, any `partials` and the sides.
fn kernel_head(inputs: &str, partials: &str) -> String {
    format!(
        "extern \"C\" __global__ void __launch_bounds__(256, 4) k({inputs}, const float* __restrict__ ps, TY* __restrict__ py, TY* __restrict__ pt, unsigned int* amax{partials}, i64 rows_in, i64 cols_in) {{\n\
           const ix rows = (ix)rows_in, cols = (ix)cols_in;\n\
           const ix block = blockIdx.x, blocks = gridDim.x;\n"
    )
}

/// The grouped casts' kernel ([`Spec::QuantizeTransposedGroup`]): `k_group(const
/// UpdateTable t, int members)` casts each member, its row of the table (`x, s, y,
/// y^T, amax, rows, cols`; `t.n[member]` its first block), with the blocks from
/// `t.n[m]` to the next member's first, into zeroed amaxes. What follows is
/// [`kernel_head`]'s body.
fn group_head() -> String {
    format!(
        "{table}extern \"C\" __global__ void __launch_bounds__(256, 4) k_group(const UpdateTable t, int members) {{\n\
           int member = 0;\n\
           while (member + 1 < members && (i64)blockIdx.x >= t.n[member + 1]) ++member;\n\
           const ix first = (ix)t.n[member], block = (ix)blockIdx.x - first;\n\
           const ix blocks = (ix)(member + 1 < members ? t.n[member + 1] : (i64)gridDim.x) - first;\n\
           const TX* __restrict__ px = (const TX*)t.p[member][0];\n\
           const float* __restrict__ ps = (const float*)t.p[member][1];\n\
           TY* __restrict__ py = (TY*)t.p[member][2];\n\
           TY* __restrict__ pt = (TY*)t.p[member][3];\n\
           unsigned int* amax = (unsigned int*)t.p[member][4];\n\
           const ix rows = (ix)(i64)t.p[member][5], cols = (ix)(i64)t.p[member][6];\n",
        table = update_table_declaration()
    )
}

/// A [`cast_transpose`] kernel's grid over a `rows x cols` matrix, and its bands: each
/// column of tiles gets the same number of blocks, `bands`, as many as keep the grid
/// within [`AMAX_BLOCKS`] (one amax atomic a block) and no more than the column's
/// tiles; a matrix of more tile columns than that gets one block per column.
fn cast_transpose_grid(rows: usize, cols: usize) -> Result<(u32, usize), String> {
    let (tiles_r, tiles_c) = (rows.div_ceil(QT_TILE), cols.div_ceil(QT_TILE));
    let bands = (AMAX_BLOCKS as usize / tiles_c.max(1)).clamp(1, tiles_r.max(1));
    let blocks = u32::try_from(tiles_c * bands)
        .map_err(|_| format!("a {rows}x{cols} FP8 cast has too many columns of tiles"))?;
    Ok((blocks, bands))
}

/// The tiles a block of the grouped casts walks at least, where its matrix has them:
/// weights are narrow, so [`cast_transpose_grid`] gave each block one tile, its load
/// never overlapped with work. The transformer's 26.5M weights cast in 40.5 us as 6480
/// one-tile blocks, 28.9 us as 1620 blocks of four tiles (32.3 us as 540 of twelve).
const GROUP_TILES_PER_BLOCK: usize = 4;

/// A grouped member's blocks: [`cast_transpose_grid`]'s bands, no more than leave
/// each block [`GROUP_TILES_PER_BLOCK`] tiles of its column.
fn grouped_cast_blocks(rows: usize, cols: usize) -> Result<u32, String> {
    let (blocks, bands) = cast_transpose_grid(rows, cols)?;
    let walked = bands.min(rows.div_ceil(QT_TILE).div_ceil(GROUP_TILES_PER_BLOCK));
    // No more bands than cast_transpose_grid's, so no more blocks than its grid.
    Ok(blocks / bands as u32 * walked.max(1) as u32)
}

/// What a cast-transpose kernel may assume of its matrices' sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tiles {
    /// Whole tiles (sides multiples of 64) of a matrix under 2^31 elements: the
    /// kernel's indices are 32-bit and it checks no bounds. Its 64-bit indices and
    /// bounds had taken about three of the GELU casts' forty instructions an element
    /// (those casts are bound by instruction issue).
    pub whole: bool,
}

impl Tiles {
    /// The tiles of a `rows x cols` matrix.
    pub(super) fn of(rows: usize, cols: usize) -> Tiles {
        Tiles {
            whole: rows % QT_TILE == 0
                && cols % QT_TILE == 0
                && rows.checked_mul(cols).is_some_and(|n| n < 1 << 31),
        }
    }

    /// The tiles of matrices all of which must be whole for the kernel to take them so.
    fn of_all(sides: impl IntoIterator<Item = (usize, usize)>) -> Tiles {
        Tiles {
            whole: sides.into_iter().all(|(r, c)| Tiles::of(r, c).whole),
        }
    }

    /// The index type `ix` and `WHOLE_TILES`, for the kernel's source.
    fn declarations(self) -> String {
        let (ix, whole) = if self.whole { ("int", 1) } else { ("i64", 0) };
        format!("typedef {ix} ix;\n#define WHOLE_TILES {whole}\n")
    }
}

/// A cast-transpose kernel's parts ([`cast_transpose`]).
struct CastTranspose<'a> {
    /// The module's named dtypes besides `Y`, the FP8 one (`to`).
    types: &'a [(&'a str, DType)],
    to: DType,
    tiles: Tiles,
    /// Source before the kernel.
    prefix: &'a str,
    /// The kernel's signature and the locals it gives the body: the inputs' pointers,
    /// `ps`, `py`, `pt`, `amax`, any partials, `rows`, `cols`, and the block's place
    /// `block` in the `blocks` the body sees ([`kernel_head`], [`group_head`]).
    head: &'a str,
    /// Shared memory beside the tile, and its bytes.
    shared: &'a str,
    shared_bytes: usize,
    /// The inputs each tile reads: 8 elements of each of the thread's two rows (row
    /// `i` at `r0 + 2 rr + i`, from column `c`).
    rows: &'a [RowInput<'a>],
    /// Per block, before its first tile: declarations (the block's columns `c0 ..
    /// c0 + 63` stay the same over its tiles).
    block_start: &'a str,
    /// Per element `b` of row `i`: statements defining the float `x` to cast, in a
    /// block `element_end` closes.
    element: &'a str,
    element_end: &'a str,
    /// The 16-bit dtype `x` is to be rounded to, two elements at a time (one
    /// conversion a pair, their magnitudes maxed by `__vmaxu2`: an element's
    /// conversion and amax had taken three of the GELU cast's forty instructions);
    /// `element` then leaves `x` unrounded. `None`: `x` is cast as it is.
    paired: Option<DType>,
    /// Per pair `p` of a paired row: statements using its rounded values `lo` and `hi`
    /// (elements `2 p` and `2 p + 1`).
    pair_end: &'a str,
    /// Per block, after its last tile (its band `band` of `bands`), before the amax
    /// fold.
    block_end: &'a str,
    /// Source after the kernel.
    after: &'a str,
}

/// An input of a cast-transpose kernel: `Vec<ty, 8> name[2]` holds the thread's two
/// rows of `ptr` (a matrix of `rows x cols` elements of `bytes` each) in each tile.
struct RowInput<'a> {
    ty: &'a str,
    bytes: usize,
    name: &'a str,
    ptr: &'a str,
}

impl RowInput<'_> {
    /// The 16-byte pieces of one row's 8 elements.
    fn pieces(&self) -> usize {
        self.bytes / 2
    }

    /// Shared memory of its staging buffers: two tiles' rows, per thread.
    fn staging_bytes(&self) -> usize {
        2 * 2 * self.pieces() * 256 * 16
    }

    /// Loads of the thread's two rows straight into the registers.
    fn load(&self) -> String {
        let RowInput { ty, name, ptr, .. } = self;
        format!(
            "Vec<{ty}, 8> {name}[2];\n\
             #pragma unroll\n\
             for (int i = 0; i < 2; ++i) {{\n\
               const ix r = r0 + 2 * rr + i;\n\
               if (WHOLE_TILES || (r < rows && c < cols)) {name}[i] = *(const Vec<{ty}, 8>*)({ptr} + r * cols + c);\n\
             }}\n"
        )
    }

    /// The staging buffers `stage_<name>[buffer][row piece][thread]`.
    fn stage_declaration(&self) -> String {
        format!(
            "__shared__ uint4 stage_{}[2][{}][256];\n",
            self.name,
            2 * self.pieces()
        )
    }

    /// The running source of the thread's rows: row `2 rr` of the block's first tile,
    /// a stride of `bands` tiles apart ([`RowInput::stage`] advances it).
    fn source(&self) -> String {
        let RowInput { ty, name, ptr, .. } = self;
        format!("const {ty}* src_{name} = {ptr} + (band * 64 + 2 * rr) * cols + c;\n")
    }

    /// Starts copying the next tile's two rows of the thread (the row `next_row`) into
    /// buffer `to`, then moves the source a stride on.
    fn stage(&self) -> String {
        let RowInput { ty, name, ptr, .. } = self;
        let pieces = self.pieces();
        format!(
            "#pragma unroll\n\
             for (int i = 0; i < 2; ++i) {{\n\
               const bool in = WHOLE_TILES || (c < cols && next_row + i < rows);\n\
               #pragma unroll\n\
               for (int q = 0; q < {pieces}; ++q)\n\
                 copy_async(&stage_{name}[to][{pieces} * i + q][threadIdx.x], in ? (const void*)(src_{name} + i * cols + q * (16 / sizeof({ty}))) : (const void*){ptr}, in ? 16 : 0);\n\
             }}\n\
             src_{name} += stride;\n"
        )
    }

    /// The registers from buffer `buf`.
    fn unstage(&self) -> String {
        let RowInput { ty, name, .. } = self;
        let pieces = self.pieces();
        format!(
            "Vec<{ty}, 8> {name}[2];\n\
             #pragma unroll\n\
             for (int i = 0; i < 2; ++i)\n\
               #pragma unroll\n\
               for (int q = 0; q < {pieces}; ++q) ((uint4*)&{name}[i])[q] = stage_{name}[buf][{pieces} * i + q][threadIdx.x];\n"
        )
    }
}

/// The shared memory a kernel's static arrays may take.
pub(super) const STATIC_SHARED_BYTES: usize = 48 << 10;

/// `u32 fp8x2(float a, float b)`: `a` and `b` cast to the FP8 dtype `to` as
/// `QuantizeFp8` casts (saturating), `a` in the low byte: one conversion for two
/// values; `u32 fp8x4(a, b, c, d)` four such, `a` lowest. Needs `u32`.
pub(super) fn fp8_pairs(to: DType) -> String {
    let kind = if to == DType::F8E5M2 {
        "__NV_E5M2"
    } else {
        "__NV_E4M3"
    };
    format!(
        "__device__ __forceinline__ u32 fp8x2(float a, float b) {{\n\
           return (u32)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, {kind});\n\
         }}\n\
         __device__ __forceinline__ u32 fp8x4(float a, float b, float c, float d) {{\n\
           return __byte_perm(fp8x2(a, b), fp8x2(c, d), 0x5410);\n\
         }}\n"
    )
}

/// A thread loads 8 elements of two adjacent rows of the tile (16 bytes of bf16 each)
/// before it converts and stores any (one row at a time, the kernel ran at two thirds
/// of the bandwidth of a quantisation and a transpose apart), converts them in pairs
/// and stores each row's 8 bytes of `y` whole. Rows and columns are multiples of 8. A
/// block keeps to one column of tiles, walking its rows of tiles in a stride of
/// `bands` (the grid is [`cast_transpose_grid`]'s, a whole number of tile columns): no
/// division per tile, and a column sum stays in the thread's registers until the
/// block's last tile, one partial per band.
///
/// The transpose: the thread's two rows' bytes are interleaved by `PRMT` into a
/// 16-bit piece per column, stored into a column-major tile (a column's 64 rows in 16
/// words, the words swizzled by the column's group so that a warp's stores and
/// 16-byte loads meet no bank twice), and each column read back in 16-byte words: `y^T`
/// is written in 16-byte stores (8-byte ones where the rows are no multiple of 16,
/// the stores' alignment). With one byte loaded per element and the rows 32
/// apart, GPT-2's [16384, 3072] GELU-gradient cast ran 117 us on the H200; like this,
/// 96-99 (the harness of benchmark-history, fifty-second session).
///
/// The rows of the next tile are copied into shared memory (`cp.async`, two buffers,
/// each input's source a running pointer) while the block converts and stores this
/// one: Nsight Compute found these kernels neither memory- nor compute-bound (DRAM
/// 39-44% of peak), and a prefetch into registers cost more occupancy than it hid.
/// Inputs of 1-byte elements, or staging past the static shared memory, load straight
/// into registers. At most 64 registers a thread (four blocks a multiprocessor): the
/// GELU gradient's cast took 89 unbounded (two blocks) and ran no faster, 48 at five
/// blocks and ran 12% slower.
fn cast_transpose(k: CastTranspose) -> String {
    let CastTranspose {
        types,
        to,
        tiles,
        prefix,
        head,
        shared,
        shared_bytes,
        rows,
        block_start,
        element,
        element_end,
        paired,
        pair_end,
        block_end,
        after,
    } = k;
    let tile_bytes = 64 * 64;
    let staging: usize = rows.iter().map(RowInput::staging_bytes).sum();
    let staged = rows.iter().all(|r| r.bytes >= 2)
        && tile_bytes + shared_bytes + staging <= STATIC_SHARED_BYTES;
    let concat = |f: &dyn Fn(&RowInput) -> String| rows.iter().map(f).collect::<String>();
    let (helpers, stage_shared, sources, first, next, loads) = if staged {
        let stage = format!("{}next_row += bands * 64;\n", concat(&|r| r.stage()));
        (
            copy_async_source!(),
            concat(&|r| r.stage_declaration()),
            format!(
                "const ix stride = bands * 64 * cols;\n\
                 ix next_row = band * 64 + 2 * rr;\n{}",
                concat(&|r| r.source())
            ),
            format!("if (band < tiles_r) {{ const int to = 0;\n{stage}}}\ncommit();\n"),
            format!(
                "if (tr + bands < tiles_r) {{ const int to = buf ^ 1;\n{stage}}}\n\
                 commit();\n\
                 wait<1>();\n"
            ),
            concat(&|r| r.unstage()),
        )
    } else {
        (
            "",
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            concat(&|r| r.load()),
        )
    };
    let fp8_pairs = fp8_pairs(to);
    let tile_declarations = tiles.declarations();
    let types: Vec<(&str, DType)> = types.iter().copied().chain([("Y", to)]).collect();
    let (declaration, measure, fold) = (
        amax_declaration("m"),
        amax_measure("m", "x"),
        amax_fold("m", "amax"),
    );
    // Each element's value and its scaling, or its unrounded value, the pairs rounded,
    // measured and scaled after the row's eight.
    let (pair_helpers, pair_declaration, per_element, pairs, pair_fold) =
        match paired.and_then(pair_rounding) {
            Some(helpers) => (
                helpers,
                "u32 m2 = 0u;\nfloat pre[8];\n",
                "pre[b] = x;".to_string(),
                format!(
                    "#pragma unroll\n\
                     for (int p = 0; p < 4; ++p) {{\n\
                       const u32 w = round_measure2(pre[2 * p], pre[2 * p + 1], m2);\n\
                       const float lo = lo_of(w), hi = hi_of(w);\n\
                       {pair_end}\
                       scaled[2 * p] = __fmul_rn(lo, s);\n\
                       scaled[2 * p + 1] = __fmul_rn(hi, s);\n\
                     }}\n"
                ),
                "m = max(m, pair_amax_bits(m2));\n",
            ),
            None => (
                String::new(),
                "",
                format!("{measure}\nscaled[b] = __fmul_rn(x, s);"),
                String::new(),
                "",
            ),
        };
    fp8_module(
        &types,
        &format!(
            "{prefix}{helpers}typedef unsigned int u32;\n{tile_declarations}\
             {fp8_pairs}{pair_helpers}{head}\
               __align__(16) __shared__ u32 tile[64][16];\n\
               {shared}{stage_shared}\
               const float s = ps[0];\n\
               {declaration}{pair_declaration}\
               const ix tiles_c = (cols + 63) / 64, tiles_r = (rows + 63) / 64, bands = blocks / tiles_c;\n\
               const ix band = block / tiles_c, c0 = (block - band * tiles_c) * 64;\n\
               const int cg = threadIdx.x & 7, rr = threadIdx.x >> 3;\n\
               const ix c = c0 + 8 * cg;\n\
               {sources}{block_start}{first}\
               int buf = 0;\n\
               for (ix tr = band; tr < tiles_r; tr += bands, buf ^= 1) {{\n\
                 const ix r0 = tr * 64;\n\
                 {next}{loads}\
                 uint2 qw[2];\n\
                 #pragma unroll\n\
                 for (int i = 0; i < 2; ++i) {{\n\
                   const ix r = r0 + 2 * rr + i;\n\
                   qw[i] = make_uint2(0, 0);\n\
                   if (WHOLE_TILES || (r < rows && c < cols)) {{\n\
                     float scaled[8];\n\
                     #pragma unroll\n\
                     for (int b = 0; b < 8; ++b) {{\n\
                       {element}\
                       {per_element}{element_end}\n\
                     }}\n\
                     {pairs}\
                     qw[i] = make_uint2(fp8x4(scaled[0], scaled[1], scaled[2], scaled[3]),\n\
                                        fp8x4(scaled[4], scaled[5], scaled[6], scaled[7]));\n\
                     *(uint2*)(py + r * cols + c) = qw[i];\n\
                   }}\n\
                 }}\n\
                 {{\n\
                   const u32 pair[4] = {{__byte_perm(qw[0].x, qw[1].x, 0x5140), __byte_perm(qw[0].x, qw[1].x, 0x7362),\n\
                                         __byte_perm(qw[0].y, qw[1].y, 0x5140), __byte_perm(qw[0].y, qw[1].y, 0x7362)}};\n\
                   unsigned short* t16 = (unsigned short*)&tile[0][0];\n\
                   const int word = (rr >> 1) ^ (2 * cg), half = rr & 1;\n\
                   #pragma unroll\n\
                   for (int k = 0; k < 8; ++k)\n\
                     t16[2 * ((8 * cg + k) * 16 + word) + half] = (unsigned short)(pair[k >> 1] >> (16 * (k & 1)));\n\
                 }}\n\
                 __syncthreads();\n\
                 {{\n\
                   const int col = threadIdx.x >> 2, quarter = threadIdx.x & 3, swizzle = 2 * (col >> 3);\n\
                   uint4 w = *(const uint4*)&tile[col][(4 * quarter) ^ (swizzle & 12)];\n\
                   if (swizzle & 2) w = make_uint4(w.z, w.w, w.x, w.y);\n\
                   const ix cj = c0 + col, r = r0 + 16 * quarter;\n\
                   if (WHOLE_TILES || (cj < cols && r < rows)) {{\n\
                     TY* o = pt + cj * rows + r;\n\
                     if (WHOLE_TILES || (rows & 15) == 0) *(uint4*)o = w;\n\
                     else {{\n\
                       *(uint2*)o = make_uint2(w.x, w.y);\n\
                       if (r + 8 < rows) *(uint2*)(o + 8) = make_uint2(w.z, w.w);\n\
                     }}\n\
                   }}\n\
                 }}\n\
                 __syncthreads();\n\
               }}\n{block_end}{pair_fold}{fold}}}\n{after}"
        ),
    )
}

/// [`quantize_transposed`]'s tiles of the value a program computes: each input's 8
/// elements of the thread's two rows loaded, the program's body per element (its
/// value rounded as the fused node stored it), then the cast; each column sum adds
/// the thread's two rows of every tile of its block, then the block's 32 thread rows
/// through shared memory, into one partial per band and column.
pub(super) fn quantize_program(p: &FusedElementwise, to: DType, tiles: Tiles) -> String {
    let x = p.outputs().first().copied().unwrap_or(0);
    // The cast value computed here and read by no other instruction is rounded in
    // pairs (its column sums then added from the pairs).
    let x_dtype = p.instrs()[x].ty.dtype;
    let read_here = p.instrs().iter().any(|ins| match &ins.expr {
        Expr::Apply(_, args) => args.contains(&x),
        Expr::Input(_) => false,
    });
    let computed = matches!(p.instrs()[x].expr, Expr::Apply(..));
    let paired = (computed && !read_here && pair_rounding(x_dtype).is_some()).then_some(x_dtype);
    let parts = FusedParts::leaving_unrounded(p, paired.map(|_| x));
    let inputs: Vec<(usize, usize)> = (p.instrs().iter().enumerate())
        .filter_map(|(j, ins)| match ins.expr {
            Expr::Input(k) => Some((j, k)),
            Expr::Apply(..) => None,
        })
        .collect();
    let mut types: Vec<(String, DType)> = (inputs.iter())
        .map(|&(j, k)| (format!("I{k}"), p.instrs()[j].ty.dtype))
        .collect();
    let sums = p.column_sums();
    let sum_dtype = (sums.first()).map(|&v| column_sum_dtype(p.instrs()[v].ty.dtype));
    types.extend(sum_dtype.map(|d| ("S".to_string(), d)));
    let params: Vec<String> = (inputs.iter())
        .map(|&(_, k)| format!("const TI{k}* __restrict__ in{k}"))
        .collect();
    let names: Vec<[String; 3]> = (inputs.iter())
        .map(|&(_, k)| [format!("TI{k}"), format!("x{k}"), format!("in{k}")])
        .collect();
    let rows: Vec<RowInput> = (inputs.iter().zip(&names))
        .map(|(&(j, _), [ty, name, ptr])| RowInput {
            ty,
            bytes: p.instrs()[j].ty.dtype.size_bytes(),
            name,
            ptr,
        })
        .collect();
    let binds: String = (inputs.iter())
        .map(|&(j, k)| format!("float v{j} = ldI{k}(x{k}[i].v, b);\n"))
        .collect();
    let (mut sum_decl, mut sum_add, mut sum_tile) = (String::new(), String::new(), String::new());
    let mut pair_sums = String::new();
    for (k, &v) in sums.iter().enumerate() {
        sum_decl.push_str(&format!("AS acc{k}[8] = {{}};\n"));
        match paired.is_some() && v == x {
            true => pair_sums.push_str(&format!(
                "acc{k}[2 * p] += (AS)lo; acc{k}[2 * p + 1] += (AS)hi;\n"
            )),
            false => sum_add.push_str(&format!("acc{k}[b] += (AS)v{v};\n")),
        }
        sum_tile.push_str(&format!(
            "for (int b = 0; b < 8; ++b) csum[{k}][rr][8 * cg + b] = acc{k}[b];\n"
        ));
    }
    let n_sums = sums.len();
    let sum_bytes = sum_dtype.map_or(0, |d| n_sums * 32 * 64 * d.size_bytes());
    let (partials, shared, block_end, fin) = if n_sums == 0 {
        Default::default()
    } else {
        (
            ", AS* __restrict__ part".to_string(),
            format!("__shared__ AS csum[{n_sums}][32][64];\n"),
            format!(
                "{sum_tile}__syncthreads();\n\
                 if (threadIdx.x < 64 && c0 + threadIdx.x < cols) {{\n\
                   for (int k = 0; k < {n_sums}; ++k) {{\n\
                     AS t = 0;\n\
                     for (int w = 0; w < 32; ++w) t += csum[k][w][threadIdx.x];\n\
                     part[(band * {n_sums} + k) * cols + c0 + threadIdx.x] = t;\n\
                   }}\n\
                 }}\n"
            ),
            column_sums_fin("S", &vec!["S"; n_sums]),
        )
    };
    let types: Vec<(&str, DType)> = types.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    cast_transpose(CastTranspose {
        types: &types,
        to,
        tiles,
        prefix: ROUNDING,
        head: &kernel_head(&params.join(", "), &partials),
        shared: &shared,
        shared_bytes: sum_bytes,
        rows: &rows,
        block_start: &sum_decl,
        element: &format!(
            "const ix i_el = r * cols + c + b; (void)i_el;\n{binds}\
             {{ const i64 i = i_el; (void)i;\n{}\nfloat x = (float)v{x};\n{sum_add}",
            parts.body
        ),
        element_end: " }",
        paired,
        pair_end: &pair_sums,
        block_end: &block_end,
        after: &fin,
    })
}

pub(super) fn dequantize(y: DType, to: DType) -> String {
    let load = Load {
        ty: "float",
        name: "y",
        loader: "ldY",
        ptr: "py",
        bytes: 1,
        at: At::Own,
    };
    let o = Store {
        storer: "stO",
        ptr: "po",
        bytes: to.size_bytes(),
        value: "__fmul_rn(y, s)",
    };
    let body = elementwise(&[load], "", &[o]);
    fp8_module(
        &[("Y", y), ("O", to)],
        &format!(
            "extern \"C\" __global__ void k(const TY* py, const float* pinv, TO* po, i64 n) {{\n\
               const float s = pinv[0];\n{body}}}\n"
        ),
    )
}

/// `max / amax / 2^margin` in f32, as `Fp8Scale::of_amax`.
fn scale_of(format: DType, margin: i32, amax: &str) -> String {
    format!(
        "__fdiv_rn(__fdiv_rn({}, {amax}), {:?}f)",
        largest(format),
        (1u32 << margin) as f32
    )
}

pub(super) fn scale(format: DType, margin: i32) -> String {
    fp8_module(
        &[],
        &format!(
            "extern \"C\" __global__ void k(const float* pa, float* ps, float* pi) {{\n\
               const float a = pa[0];\n\
               float s;\n\
               if (isfinite(a) && a > 0.0f) s = {};\n\
               else if (a == 0.0f) s = 1.0f;\n\
               else s = F_NAN;\n\
               ps[0] = s; pi[0] = __fdiv_rn(1.0f, s);\n}}\n",
            scale_of(format, margin, "a")
        ),
    )
}

/// Every thread reads its entries before any writes: the new history may be the old
/// one's buffer.
pub(super) fn scale_update(format: DType, margin: i32, most_recent: bool) -> String {
    // Thread 0's `v` is the newest amax of the history.
    let chosen = if most_recent { "v" } else { "best" };
    // In place, the history's and the scale's reads come before block_max's first
    // barrier, their writes after its last.
    fp8_module(
        &[],
        &format!(
            "{table}extern \"C\" __global__ void k(const UpdateTable t) {{\n\
               __shared__ float sh[32];\n\
               const int member = blockIdx.x;\n\
               const float* ph = (const float*)t.p[member][0];\n\
               const float m = ((const float*)t.p[member][1])[0], s = ((const float*)t.p[member][2])[0];\n\
               float* ph_out = (float*)t.p[member][4];\n\
               float* ps_out = (float*)t.p[member][5];\n\
               float* pi_out = (float*)t.p[member][6];\n\
               const i64 n = t.n[member];\n\
               const bool push = isfinite(m);\n\
               const i64 i = threadIdx.x;\n\
               const float v = i < n ? (push ? (i == 0 ? m : ph[i - 1]) : ph[i]) : 0.0f;\n\
               const float best = block_max(fmaxf(v, 0.0f), sh);\n\
               if (i < n) ph_out[i] = v;\n\
               if (i == 0) {{\n\
                 const float chosen = {chosen};\n\
                 const float next = isfinite(chosen) && chosen > 0.0f ? {} : s;\n\
                 ps_out[0] = next;\n\
                 pi_out[0] = __fdiv_rn(1.0f, next);\n\
               }}\n}}\n",
            scale_of(format, margin, "chosen"),
            table = update_table_declaration(),
        ),
    )
}

/// A block of 256 threads per tile, through shared memory (padded against bank
/// conflicts): both the reads and the writes walk rows. `k` moves bytes (32x32 tiles);
/// `k_words` 4-byte words (64x64 tiles: a thread reads four rows' words and writes four
/// columns' bytes as one word), a quarter of the memory instructions: byte by byte the
/// FP8 weight gradient's two transposed operands took as long as a third of its
/// product (0.06 ms per 32 MB on the H200).
pub(super) fn transpose() -> String {
    fp8_module(
        &[],
        "typedef unsigned int u32;\n\
         extern \"C\" __global__ void k_words(const u8* x, u8* y, i64 rows, i64 cols) {\n\
           __shared__ u8 tile[64][68];\n\
           const i64 tiles = (cols + 63) / 64, r0 = (blockIdx.x / tiles) * 64, c0 = (blockIdx.x % tiles) * 64;\n\
           const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;\n\
           for (int j = ty; j < 64; j += 16) {\n\
             const i64 r = r0 + j, c = c0 + 4 * tx;\n\
             if (r < rows && c < cols) {\n\
               const u32 w = ((const u32*)x)[(r * cols + c) / 4];\n\
               for (int b = 0; b < 4; ++b) tile[j][4 * tx + b] = (u8)(w >> (8 * b));\n\
             }\n\
           }\n\
           __syncthreads();\n\
           for (int j = ty; j < 64; j += 16) {\n\
             const i64 c = c0 + j, r = r0 + 4 * tx;\n\
             if (c < cols && r < rows) {\n\
               u32 w = 0;\n\
               for (int b = 0; b < 4; ++b) w |= (u32)tile[4 * tx + b][j] << (8 * b);\n\
               ((u32*)y)[(c * rows + r) / 4] = w;\n\
             }\n\
           }\n}\n\
         extern \"C\" __global__ void k(const u8* x, u8* y, i64 rows, i64 cols) {\n\
           __shared__ u8 tile[32][33];\n\
           const i64 tiles = (cols + 31) / 32, r0 = (blockIdx.x / tiles) * 32, c0 = (blockIdx.x % tiles) * 32;\n\
           const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n\
           for (int j = ty; j < 32; j += 8) {\n\
             const i64 r = r0 + j, c = c0 + tx;\n\
             if (r < rows && c < cols) tile[j][tx] = x[r * cols + c];\n\
           }\n\
           __syncthreads();\n\
           for (int j = ty; j < 32; j += 8) {\n\
             const i64 c = c0 + j, r = r0 + tx;\n\
             if (r < rows && c < cols) y[c * rows + r] = tile[tx][j];\n\
           }\n}\n",
    )
}

pub(super) fn lower_quantize(
    q: &QuantizeFp8,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let [x, ..] = ins else {
        return Err("QuantizeFp8 takes x and its scale".into());
    };
    let spec = Spec::Quantize {
        x: x.dtype,
        to: q.to,
        activation: q.activation,
    };
    let outs = outs.to_vec();
    if outs.len() != 2 + usize::from(q.transposed) {
        return Err("QuantizeFp8 gives the values, their amax and any transposed copy".into());
    }
    // A matrix whose sides are multiples of 8 is transposed as it is quantised (from
    // the same tiles: `cast_transpose`); another one after.
    let matrix = q.transposed_sides(&x.shape)?;
    let fused = (q.tiled_sides(&x.shape)).map(|(rows, cols)| Spec::QuantizeTransposed {
        x: x.dtype,
        to: q.to,
        activation: q.activation,
        whole: Tiles::of(rows, cols).whole,
    });
    Ok(kernel(move |c, inputs| {
        let (x, s) = (input(inputs, 0)?, input(inputs, 1)?);
        let y = c.alloc(&outs[0])?;
        let amax = c.alloc_zeroed(&outs[1])?;
        let n = x.len();
        let quantize = || {
            let args = [x.arg(), s.arg(), y.arg(), amax.arg(), Arg::I64(n as i64)];
            launch_amax(c, &spec, n, &args)
        };
        let Some((rows, cols)) = matrix else {
            quantize()?;
            return Ok(vec![y, amax]);
        };
        let t = c.alloc(&outs[2])?;
        if let Some(fused) = &fused {
            let (blocks, _) = cast_transpose_grid(rows, cols)?;
            c.launch(
                fused,
                "k",
                (blocks, 256),
                &[
                    x.arg(),
                    s.arg(),
                    y.arg(),
                    t.arg(),
                    amax.arg(),
                    Arg::I64(rows as i64),
                    Arg::I64(cols as i64),
                ],
            )?;
        } else {
            quantize()?;
            transpose_into(c, &y, &t, rows, cols)?;
        }
        Ok(vec![y, amax, t])
    }))
}

/// `GroupedQuantizeFp8`: per [`GROUP_MEMBERS`] members one launch casting them all,
/// each member its own [`grouped_cast_blocks`] (its first in its row of the
/// table); their amaxes zeroed with the step's. Matrices of sides multiples of 8 only
/// (what `group-fp8-casts` groups).
fn lower_grouped_quantize(
    q: &GroupedQuantizeFp8,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let (n_in, n_out) = (
        GroupedQuantizeFp8::MEMBER_INPUTS,
        GroupedQuantizeFp8::MEMBER_OUTPUTS,
    );
    check_members("GroupedQuantizeFp8", q.members, (n_in, n_out), (ins, outs))?;
    let mut sides = Vec::with_capacity(q.members);
    for (m, x) in ins.iter().step_by(n_in).enumerate() {
        let (rows, cols) = (q.quantize.tiled_sides(&x.shape)).ok_or_else(|| {
            format!(
                "member {m}: a grouped FP8 cast takes matrices of sides multiples of 8, not {x}"
            )
        })?;
        sides.push((rows, cols, grouped_cast_blocks(rows, cols)?));
    }
    let spec = Spec::QuantizeTransposedGroup {
        x: first(ins)?.dtype,
        to: q.quantize.to,
        whole: Tiles::of_all(sides.iter().map(|&(r, c, _)| (r, c))).whole,
    };
    let outs = outs.to_vec();
    Ok(kernel(move |c, inputs| {
        // Each member's cast, amax (folded into by atomics) and transposed copy.
        let outputs = (outs.iter().enumerate())
            .map(|(k, ty)| match k % n_out {
                1 => c.alloc_zeroed(ty),
                _ => c.alloc(ty),
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (launch, chunk) in sides.chunks(GROUP_MEMBERS).enumerate() {
            let mut rows = Vec::with_capacity(chunk.len());
            let mut blocks = 0u32;
            for (i, &(r, cols, grid)) in chunk.iter().enumerate() {
                let m = launch * GROUP_MEMBERS + i;
                let (x, s) = (input(inputs, n_in * m)?, input(inputs, n_in * m + 1)?);
                let [y, amax, t] = [0, 1, 2].map(|k| outputs[n_out * m + k].arg());
                let (r, cols) = (Arg::I64(r as i64), Arg::I64(cols as i64));
                rows.push((vec![x.arg(), s.arg(), y, t, amax, r, cols], blocks as usize));
                blocks =
                    (blocks.checked_add(grid)).ok_or("a grouped FP8 cast of too many blocks")?;
            }
            let table = Arg::Table(Box::new(update_table(&rows)?));
            if blocks > 0 {
                c.launch(
                    &spec,
                    "k_group",
                    (blocks, 256),
                    &[table, Arg::I32(chunk.len() as i32)],
                )?;
            }
        }
        Ok(outputs)
    }))
}

/// `FusedQuantizeFp8`: its program's inputs and the scale in; the cast's values, amax
/// and transposed copy, then the program's column sums (per-tile partials added by
/// `k_cols_fin`) out. Only the fused tiles: a transposed matrix with sides multiples
/// of 8, every input of its size (what `elementwise-into-fp8` folds).
fn lower_quantize_program(
    f: &FusedQuantizeFp8,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let program = f.prologue().clone();
    let n_in = program.num_inputs();
    let x_ty = &program.instrs()[program.outputs().first().copied().ok_or("no value")?].ty;
    let (rows, cols) = (f.quantize.tiled_sides(&x_ty.shape))
        .ok_or("an FP8 cast with a prologue runs transposed, on sides that are multiples of 8")?;
    if ins[..n_in.min(ins.len())]
        .iter()
        .any(|t| t.shape != x_ty.shape)
    {
        return Err("an FP8 cast's prologue reads inputs of its value's shape only".into());
    }
    let sums = program.column_sums().len();
    let acc = (program.column_sums().first())
        .map(|&v| column_sum_dtype(program.instrs()[v].ty.dtype))
        .unwrap_or(DType::F32);
    let spec = Spec::QuantizeProgram {
        program,
        to: f.quantize.to,
        whole: Tiles::of(rows, cols).whole,
    };
    let outs = outs.to_vec();
    if outs.len() != 3 + sums {
        return Err("the cast's values, amax and transposed copy, then the column sums".into());
    }
    Ok(kernel(move |c, inputs| {
        let y = c.alloc(&outs[0])?;
        let amax = c.alloc_zeroed(&outs[1])?;
        let t = c.alloc(&outs[2])?;
        let mut args: Vec<Arg> = inputs[..n_in].iter().map(DTensor::arg).collect();
        args.extend([input(inputs, n_in)?.arg(), y.arg(), t.arg(), amax.arg()]);
        let (blocks, bands) = cast_transpose_grid(rows, cols)?;
        let part = match sums {
            0 => None,
            n => Some(c.temp(acc, bands * n * cols)?),
        };
        args.extend(part.as_ref().map(DTensor::arg));
        args.extend([Arg::I64(rows as i64), Arg::I64(cols as i64)]);
        c.launch(&spec, "k", (blocks, 256), &args)?;
        let mut results = vec![y, amax, t];
        if let Some(part) = part {
            let sums: Vec<DTensor> =
                (outs[3..].iter().map(|o| c.alloc(o))).collect::<Result<_, _>>()?;
            let pairs: Vec<(&DTensor, f64)> = sums.iter().map(|s| (s, 1.0)).collect();
            launch_column_sums_fin(c, &spec, &part, cols, bands, &pairs)?;
            results.extend(sums);
        }
        Ok(results)
    }))
}

fn lower_dequantize(d: &DequantizeFp8, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let spec = Spec::Dequantize {
        y: first(ins)?.dtype,
        to: d.to,
    };
    Ok(one_output(first(outs)?, move |c, inputs, o| {
        let (y, inv) = (input(inputs, 0)?, input(inputs, 1)?);
        let n = y.len();
        c.launch_elementwise(&spec, n, &[y.arg(), inv.arg(), o.arg(), Arg::I64(n as i64)])
    }))
}

/// `Fp8Scale`: the amax pass, then the scale from it; `Fp8ScaleOfAmax`
/// (`measured`): the scale from the amax its input holds.
fn lower_scale(
    s: &Fp8Scale,
    measured: bool,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let amax_spec = Spec::Amax {
        x: first(ins)?.dtype,
        activation: s.activation,
    };
    let spec = Spec::Scale {
        format: s.format,
        margin: s.margin,
    };
    let outs = outs.to_vec();
    if outs.len() != 2 {
        return Err("an FP8 scale gives the scale and its inverse".into());
    }
    Ok(kernel(move |c, inputs| {
        let x = input(inputs, 0)?;
        let (scale, inv) = (c.alloc(&outs[0])?, c.alloc(&outs[1])?);
        if measured {
            c.launch(&spec, "k", (1, 1), &[x.arg(), scale.arg(), inv.arg()])?;
            return Ok(vec![scale, inv]);
        }
        let amax = c.temp(DType::F32, 1)?;
        c.dev.zero(&amax)?;
        let n = x.len();
        launch_amax(c, &amax_spec, n, &[x.arg(), Arg::I64(n as i64), amax.arg()])?;
        c.launch(&spec, "k", (1, 1), &[amax.arg(), scale.arg(), inv.arg()])?;
        Ok(vec![scale, inv])
    }))
}

/// An Fp8ScaleUpdate: [`GROUP_MEMBERS`](crate::cuda::device::GROUP_MEMBERS) members a
/// launch, a block each, their pointers in a by-value table.
fn lower_scale_update(u: &Fp8ScaleUpdate, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let (n_in, n_out) = (
        Fp8ScaleUpdate::MEMBER_INPUTS,
        Fp8ScaleUpdate::MEMBER_OUTPUTS,
    );
    check_members("Fp8ScaleUpdate", u.members, (n_in, n_out), (ins, outs))?;
    let lengths: Vec<usize> = ins
        .iter()
        .step_by(n_in)
        .map(|history| history.shape.iter().product())
        .collect();
    let longest = lengths.iter().copied().max().unwrap_or(1);
    if longest > MAX_HISTORY {
        return Err(format!(
            "an amax history of {longest} steps has no CUDA kernel (at most {MAX_HISTORY})"
        ));
    }
    let spec = Spec::ScaleUpdate {
        format: u.scale.format,
        margin: u.scale.margin,
        most_recent: u.amax == AmaxChoice::MostRecent,
    };
    let outs = outs.to_vec();
    let threads = longest.next_multiple_of(32) as u32;
    Ok(kernel(move |c, inputs| {
        let outputs = c.alloc_all(&outs)?;
        let members: Vec<(Vec<Arg>, usize)> = (inputs.chunks(n_in).zip(outputs.chunks(n_out)))
            .zip(&lengths)
            .map(|((member, next), &n)| (member.iter().chain(next).map(DTensor::arg).collect(), n))
            .collect();
        launch_grouped(c, &spec, "k", threads, &members)?;
        Ok(outputs)
    }))
}

/// Whether a grouped op `op` of `members` members, `n_in` tensors in and `n_out` out
/// each, has them all.
fn check_members(
    op: &str,
    members: usize,
    (n_in, n_out): (usize, usize),
    (ins, outs): (&[TensorType], &[TensorType]),
) -> Result<(), String> {
    if ins.len() == members * n_in && outs.len() == members * n_out {
        return Ok(());
    }
    Err(format!(
        "{op} of {members} members takes {} tensors and gives {}",
        members * n_in,
        members * n_out
    ))
}

/// `x` (`rows x cols` bytes) transposed into a temporary.
fn transposed(c: &Ctx, x: &DTensor, rows: usize, cols: usize) -> Result<DTensor, String> {
    let y = c.temp(x.dtype, rows * cols)?;
    transpose_into(c, x, &y, rows, cols)?;
    Ok(y)
}

/// `x` (`rows x cols` bytes) transposed into `y`: in words where both are multiples
/// of 4 (the buffers are aligned), else byte by byte.
fn transpose_into(
    c: &Ctx,
    x: &DTensor,
    y: &DTensor,
    rows: usize,
    cols: usize,
) -> Result<(), String> {
    let (name, tile) = if rows % 4 == 0 && cols % 4 == 0 {
        ("k_words", 64)
    } else {
        ("k", 32)
    };
    let tiles = rows.div_ceil(tile) * cols.div_ceil(tile);
    let blocks =
        u32::try_from(tiles).map_err(|_| format!("{rows}x{cols} is too large to transpose"))?;
    c.launch(
        &Spec::Transpose {},
        name,
        (blocks, 256),
        &[
            x.arg(),
            y.arg(),
            Arg::I64(rows as i64),
            Arg::I64(cols as i64),
        ],
    )
}

fn lower_matmul(f: &Fp8MatMul, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let [a, b, ..] = ins else {
        return Err("Fp8MatMul takes a, b and their scales' inverses".into());
    };
    let (m, k, n) = f.product.dims(&a.shape, &b.shape)?;
    if k % 16 != 0 || n % 16 != 0 {
        return Err(format!(
            "cuBLASLt's FP8 products need k and n multiples of 16, not [{m}x{k}] x [{k}x{n}] \
             (the FP8 pass keeps such products 16-bit unless told to convert everything)"
        ));
    }
    let (transpose_a, transpose_b) = (f.product.transpose_a, f.product.transpose_b);
    let (fast_accumulation, bias, residual) = (f.fast_accumulation, f.bias, f.residual);
    Ok(one_output(first(outs)?, move |c, inputs, y| {
        let (a, b) = (input(inputs, 0)?, input(inputs, 1)?);
        let (a_inv, b_inv) = (input(inputs, 2)?, input(inputs, 3)?);
        let bias = bias.then(|| input(inputs, 4)).transpose()?;
        let residual = residual
            .then(|| input(inputs, 4 + usize::from(bias.is_some())))
            .transpose()?;
        // K-major: a as [m, k], b as [n, k].
        let a_rows = transpose_a.then(|| transposed(c, a, k, m)).transpose()?;
        let b_rows = (!transpose_b).then(|| transposed(c, b, k, n)).transpose()?;
        let operands = [
            a_rows.as_ref().unwrap_or(a),
            b_rows.as_ref().unwrap_or(b),
            y,
        ];
        let product = Product {
            scales: Some((a_inv, b_inv)),
            fast_accumulation,
            bias: bias.map(|b| (b, Epilogue::Bias)),
            residual,
            ..Product::single(operands, (m, k, n), (false, true))
        };
        c.gemm.run(c.dev, &product, c.gemm_options)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scale's literals are the formats' largest values and the margin's power.
    #[test]
    fn scales_bake_in_the_formats_largest_values() {
        assert!(scale(DType::F8E4M3, 0).contains("__fdiv_rn(__fdiv_rn(448.0f, a), 1.0f)"));
        assert!(scale(DType::F8E5M2, 3).contains("__fdiv_rn(__fdiv_rn(57344.0f, a), 8.0f)"));
        assert!(quantize(DType::BF16, DType::F8E4M3, None).starts_with("#include <cuda_fp8.h>"));
    }

    /// Every column of tiles gets `bands` blocks, no more than its tiles, and the grid
    /// stays within the amax budget unless the matrix has more tile columns than it.
    #[test]
    fn cast_transpose_grids_cover_whole_columns_of_tiles() {
        for (rows, cols, blocks, bands) in [
            (16384, 768, 12 * 85, 85), // 12 tile columns of 256 tiles
            (8192, 3072, 48 * 21, 21), // 48 columns of 128 tiles
            (64, 64, 1, 1),            // one tile
            (128, 8, 2, 2),            // two tiles in one column
            (8, 200_000, 3125, 1),     // more tile columns than the budget
        ] {
            assert_eq!(
                cast_transpose_grid(rows, cols),
                Ok((blocks, bands)),
                "{rows}x{cols}"
            );
        }
    }

    #[test]
    fn whole_tiles_are_multiples_of_64_under_2_to_the_31() {
        assert!(Tiles::of(8192, 3072).whole);
        assert!(Tiles::of(64, 64).whole);
        assert!(!Tiles::of(64, 96).whole);
        assert!(!Tiles::of(72, 128).whole);
        assert!(!Tiles::of(1 << 16, 1 << 15).whole);
        assert!(Tiles::of((1 << 16) - 64, 1 << 15).whole);
        assert!(Tiles::of_all([(64, 128), (2112, 2048)]).whole);
        assert!(!Tiles::of_all([(64, 128), (8, 8)]).whole);
    }

    /// A grouped member's blocks walk four tiles of their column where it has them.
    #[test]
    fn grouped_cast_blocks_walk_four_tiles() {
        for (rows, cols, blocks) in [
            (768, 768, 12 * 3),   // 12 tiles a column: 3 blocks of 4
            (3072, 768, 12 * 12), // 48 tiles a column: 12 blocks of 4
            (768, 3072, 48 * 3),  // 12 tiles a column
            (200, 64, 1),         // 4 tiles (the last partial): one block
            (64, 64, 1),          // one tile
            (8, 200_000, 3125),   // one tile a column, as cast_transpose_grid
        ] {
            assert_eq!(grouped_cast_blocks(rows, cols), Ok(blocks), "{rows}x{cols}");
        }
    }
}
