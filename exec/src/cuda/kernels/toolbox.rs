//! What the kernel families share: the module spec a compiled module is keyed by
//! ([`KernelSpec`], the `kernel_specs!` rows), the context a kernel launches in
//! ([`Ctx`]: the device, the libraries, the step's scratch), and the launch shapes
//! several families use (row kernels, column sums).

use std::cell::{Cell, RefCell};
use std::fmt::Debug;

use ampgraph_graph::{DType, TensorType};

use crate::cuda::device::{
    items_grid, row_block, row_grid, Arg, DTensor, Device, Target, UpdateTable, GROUP_MEMBERS,
};
use crate::cuda::dnn::{Dnn, DnnOptions};
use crate::cuda::gemm::{Gemm, GemmOptions};
use crate::cuda::nccl::Nccl;
use crate::memory_plan::ALIGNMENT;

use super::codegen::{self, FIN_WARPS, VECTOR};

/// A family's module specs from one row per module: the `Spec` enum (the kernels' C
/// signatures in each variant's doc comment) and its [`KernelSpec`], each variant's
/// source the expression after its `=>` (its fields bound by value).
macro_rules! kernel_specs {
    (
        $(#[$attr:meta])*
        enum Spec in $family:literal {
            $(
                $(#[doc = $doc:literal])*
                $variant:ident { $($field:ident: $ty:ty),* } => $source:expr,
            )+
        }
    ) => {
        $(#[$attr])*
        pub(crate) enum Spec {
            $($(#[doc = $doc])* $variant { $($field: $ty),* },)+
        }

        impl super::KernelSpec for Spec {
            const FAMILY: &'static str = $family;
            fn source(&self) -> String {
                match self {
                    $(Spec::$variant { $($field),* } => {
                        $(let $field = $field.clone();)*
                        $source
                    })+
                }
            }
        }
    };
}

/// What a compiled module is generated from. Its `Debug` form (derived) is the module's
/// cache key: every field the source reads is in it.
pub(crate) trait KernelSpec: Debug {
    /// The family, naming the key (`elementwise/Unary { .. }`).
    const FAMILY: &'static str;
    /// The module's CUDA C++ source.
    fn source(&self) -> String;
    /// What the module is compiled for.
    const TARGET: Target = Target::Portable;
    /// The module's cache key.
    fn key(&self) -> String {
        format!("{}/{self:?}", Self::FAMILY)
    }
}

/// The spec of a module generated from a program (a fused elementwise program, a
/// softmax's prologue): its key, made once from the program's text (long to format
/// at every launch), and its source generator.
pub(crate) struct ProgramSpec<T> {
    key: String,
    program: T,
    source: fn(&T) -> String,
}

impl<T> ProgramSpec<T> {
    pub(super) fn new(key: String, program: T, source: fn(&T) -> String) -> Self {
        ProgramSpec {
            key,
            program,
            source,
        }
    }
}

impl<T> Debug for ProgramSpec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}

impl<T> KernelSpec for ProgramSpec<T> {
    const FAMILY: &'static str = "program";
    fn source(&self) -> String {
        (self.source)(&self.program)
    }
    fn key(&self) -> String {
        self.key.clone()
    }
}

/// What a node's kernels need besides the device.
pub struct Ctx<'a> {
    pub dev: &'a Device,
    pub gemm: &'a Gemm,
    pub gemm_options: GemmOptions,
    pub dnn: &'a Dnn,
    pub dnn_options: DnnOptions,
    /// The node's name, for out-of-memory errors.
    pub name: &'a str,
    /// The node's outputs' slots in the step's arena, by output index (`None`: a
    /// buffer of its own). Every op allocates its outputs in order.
    pub planned: &'a [Option<DTensor>],
    /// Whether the step zeroed each output's planned slot before its first kernel.
    pub prezeroed: &'a [bool],
    /// The outputs [`alloc_zeroed`](Self::alloc_zeroed) zeroed itself: the executor
    /// has the step zero them next time.
    pub zeroed_here: RefCell<Vec<usize>>,
    pub allocated: Cell<usize>,
    /// The node's scratch in the step's arena, where the plan has one: its kernels'
    /// temporaries and cuDNN's workspace are carved from it in order.
    pub scratch: Option<DTensor>,
    /// Bytes of scratch the node's kernels took so far (planned or not): what the
    /// executor plans for the node once it has seen a step.
    pub scratch_used: Cell<usize>,
    /// What a convolution's workspace may take while the node runs, where the step
    /// has a plan: the arena's bytes not alive then, and a little more.
    pub workspace_room: Option<usize>,
    /// The replica's communicator, in a data-parallel group.
    pub collective: Option<&'a Nccl>,
    /// Events of work on other streams that the readers of the node's outputs must
    /// wait for (a collective's end).
    pub joins: RefCell<Vec<cudarc::driver::CudaEvent>>,
}

impl Ctx<'_> {
    /// The next output's buffer: its planned slot, or one from the pool.
    pub(crate) fn alloc(&self, ty: &TensorType) -> Result<DTensor, String> {
        let k = self.allocated.get();
        self.allocated.set(k + 1);
        match self.planned.get(k) {
            Some(Some(slot)) if slot.ty() == *ty => Ok(slot.clone()),
            _ => self
                .dev
                .alloc(ty.dtype, &ty.shape, &Owner("node", self.name)),
        }
    }

    /// The next output's buffer, zeroed for kernels that fold values into it (an
    /// amax's atomics): zeroed by the step at its start where the plan holds it there,
    /// else now.
    pub(crate) fn alloc_zeroed(&self, ty: &TensorType) -> Result<DTensor, String> {
        let k = self.allocated.get();
        let t = self.alloc(ty)?;
        let in_slot = matches!(self.planned.get(k), Some(Some(slot)) if slot.ptr() == t.ptr());
        if !(in_slot && self.prezeroed.get(k).copied().unwrap_or(false)) {
            self.dev.zero(&t)?;
            self.zeroed_here.borrow_mut().push(k);
        }
        Ok(t)
    }

    /// Every output's buffer, in order.
    pub(super) fn alloc_all(&self, outs: &[TensorType]) -> Result<Vec<DTensor>, String> {
        outs.iter().map(|t| self.alloc(t)).collect()
    }

    /// A temporary of the node's launch: from its planned scratch where that holds it,
    /// else from the pool.
    pub(crate) fn temp(&self, dtype: DType, n: usize) -> Result<DTensor, String> {
        match self.scratch(&TensorType::new(dtype, [n]))? {
            Some(t) => Ok(t),
            None => self
                .dev
                .alloc(dtype, &[n], &Owner("scratch of node", self.name)),
        }
    }

    /// The next `ty`'s bytes of the node's planned scratch, counted as taken; `None`
    /// where the plan has no room for them.
    pub(crate) fn scratch(&self, ty: &TensorType) -> Result<Option<DTensor>, String> {
        let at = self.scratch_used.get();
        let end = at + ty.size_bytes().div_ceil(ALIGNMENT) * ALIGNMENT;
        self.scratch_used.set(end);
        match &self.scratch {
            Some(s) if end <= s.bytes() => s.slot(at, ty).map(Some),
            _ => Ok(None),
        }
    }

    /// Launches kernel `name` of the module `spec` over `grid` blocks of `block` threads.
    pub(super) fn launch<S: KernelSpec>(
        &self,
        spec: &S,
        name: &'static str,
        (grid, block): (u32, u32),
        args: &[Arg],
    ) -> Result<(), String> {
        self.dev.launch(
            (&spec.key(), S::TARGET),
            || spec.source(),
            name,
            grid,
            block,
            args,
        )
    }

    /// How many blocks of `block` threads of kernel `name` of `spec` fill the GPU once.
    pub(super) fn resident_blocks<S: KernelSpec>(
        &self,
        spec: &S,
        name: &'static str,
        block: u32,
    ) -> Result<u32, String> {
        self.dev
            .resident_blocks((&spec.key(), S::TARGET), || spec.source(), name, block)
    }

    /// An elementwise launch of `spec`'s `k` whose threads take up to [`VECTOR`] items.
    pub(super) fn launch_elementwise<S: KernelSpec>(
        &self,
        spec: &S,
        n: usize,
        args: &[Arg],
    ) -> Result<(), String> {
        self.launch_items(spec, n, VECTOR, args)
    }

    /// An elementwise launch of `spec`'s `k` over `n` items, `per_thread` a thread
    /// (1: a thread per item).
    pub(super) fn launch_items<S: KernelSpec>(
        &self,
        spec: &S,
        n: usize,
        per_thread: usize,
        args: &[Arg],
    ) -> Result<(), String> {
        self.launch_items_of(spec, "k", n, per_thread, args)
    }

    /// [`launch_items`](Self::launch_items) of `spec`'s kernel `name`.
    pub(super) fn launch_items_of<S: KernelSpec>(
        &self,
        spec: &S,
        name: &'static str,
        n: usize,
        per_thread: usize,
        args: &[Arg],
    ) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        self.launch(spec, name, (items_grid(n, per_thread), 256), args)
    }
}

/// What a buffer is for, as an out-of-memory error says it: `node 'mm'`.
pub(crate) struct Owner<'a>(pub &'static str, pub &'a str);

impl std::fmt::Display for Owner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} '{}'", self.0, self.1)
    }
}

/// Refuses the dtypes the float kernels do not take.
pub(super) fn float_only(d: DType) -> Result<(), String> {
    if matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        Ok(())
    } else {
        Err(format!("no CUDA kernel for dtype {d}"))
    }
}

/// The accumulator dtype of float kernels' scratch buffers.
pub(super) fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

pub(super) fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// `shape` and `strides` with each pair of neighbouring axes that one stride walks
/// (the outer's stride the inner's times its size: contiguous, or both broadcast) made
/// one axis, and axes of size 1 dropped: the same offsets for every row-major index,
/// with fewer divisions to compute each (a global average pool's H and W become one
/// reduced axis).
pub(super) fn merged(shape: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let (dims, mut steps) = merged_jointly(shape, &[strides]);
    (dims, steps.pop().unwrap_or_default())
}

/// [`merged`] for several tensors indexed over one `shape` (each its own `strides`):
/// two axes merge where they merge in every tensor.
pub(super) fn merged_jointly(
    shape: &[usize],
    strides: &[&[usize]],
) -> (Vec<usize>, Vec<Vec<usize>>) {
    let (mut dims, mut steps): (Vec<usize>, Vec<Vec<usize>>) =
        (vec![], vec![vec![]; strides.len()]);
    // An axis of size 1 adds nothing to an offset.
    for (axis, &d) in shape.iter().enumerate().filter(|(_, &d)| d != 1) {
        let merges = !dims.is_empty()
            && (steps.iter().zip(strides)).all(|(s, t)| s.last() == Some(&(t[axis] * d)));
        if merges {
            if let Some(outer) = dims.last_mut() {
                *outer *= d;
            }
            for (s, t) in steps.iter_mut().zip(strides) {
                if let Some(outer_step) = s.last_mut() {
                    *outer_step = t[axis];
                }
            }
        } else {
            dims.push(d);
            for (s, t) in steps.iter_mut().zip(strides) {
                s.push(t[axis]);
            }
        }
    }
    (dims, steps)
}

/// Input `k` of a kernel's inputs.
pub(super) fn input(inputs: &[DTensor], k: usize) -> Result<&DTensor, String> {
    inputs.get(k).ok_or_else(|| format!("missing input {k}"))
}

/// The first input's dtype, refused where it is not a float.
pub(super) fn float_input(inputs: &[TensorType]) -> Result<DType, String> {
    let d = inputs.first().ok_or("the node has no inputs")?.dtype;
    float_only(d)?;
    Ok(d)
}

/// The first output's type.
pub(super) fn first(outs: &[TensorType]) -> Result<TensorType, String> {
    outs.first()
        .cloned()
        .ok_or_else(|| "the node has no outputs".into())
}

/// Kernel `name` of module `spec` with a block per row (of `len` values) of `rows`:
/// arguments `tensors`, then `rows` and `len`.
pub(super) fn block_rows<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    name: &'static str,
    tensors: &[Arg],
    (rows, len): (usize, usize),
) -> Result<(), String> {
    if rows == 0 {
        return Ok(());
    }
    let mut args = tensors.to_vec();
    args.extend([Arg::I64(rows as i64), Arg::I64(len as i64)]);
    c.launch(spec, name, (row_grid(rows), row_block(len)), &args)
}

/// Launches a module's row kernels over `rows` rows of `len` values: `warp` (a warp
/// per row, held in registers) when the rows are contiguous and short, else `block`
/// (a block per row). Both take `tensors`, rows and len; `inner` (the distance
/// between a row's values) goes to `block` too where the module's rows may be
/// strided (softmax), and is `None` where they are always contiguous.
pub(super) fn row_kernel<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    (block, warp): (&'static str, &'static str),
    tensors: &[Arg],
    (rows, len, inner): (usize, usize, Option<usize>),
) -> Result<(), String> {
    if rows == 0 {
        return Ok(());
    }
    let mut args = tensors.to_vec();
    args.extend([Arg::I64(rows as i64), Arg::I64(len as i64)]);
    if inner.unwrap_or(1) == 1 && len <= codegen::WARP_ROW_MAX {
        let grid = rows.div_ceil(8).min(1 << 20) as u32;
        return c.launch(spec, warp, (grid, 256), &args);
    }
    args.extend(inner.map(|i| Arg::I64(i as i64)));
    c.launch(spec, block, (row_grid(rows), row_block(len)), &args)
}

/// The values per lane and the warp kernel of a row module over rows of `len`
/// values: `k_warp_vec` (16-byte words, rows of exactly `32 * per` values) where the
/// rows are contiguous, `len` is a multiple of 32 words and every tensor is 16-byte
/// aligned, else `k_warp`.
pub(super) fn warp_row_form(
    len: usize,
    dtype: DType,
    contiguous: bool,
    tensors: &[&DTensor],
) -> (usize, &'static str) {
    let words = 32 * codegen::column_vector(dtype);
    let vector = contiguous
        && len > 0
        && len <= codegen::WARP_ROW_MAX
        && len % words == 0
        && tensors.iter().all(|t| t.ptr() % 16 == 0);
    if vector {
        (len / 32, "k_warp_vec")
    } else {
        (codegen::warp_row_values(len), "k_warp")
    }
}

/// The kernel of a module that writes partial column sums (see `codegen::column_sums`).
#[derive(Clone, Copy, Debug)]
pub(super) enum Partials {
    /// `k_cols_part` (`codegen::column_sums`): tiles of 32 columns times row chunks.
    Tiles,
    /// `k_cols_rows` or `k_cols_rows_n` (`codegen::column_sums_rows`): row chunks
    /// read whole, a thread taking a 16-byte word of this many values of each row.
    Rows(usize),
    /// `k_cols_words` (`codegen::column_sums_words`): blocks reading interleaved
    /// bands of whole rows in 16-byte words of this many values.
    Words(usize),
}

impl Partials {
    /// `k_cols_words` where `len` columns of `dtype` are whole words and at most a block's
    /// threads' worth of them and every matrix is 16-byte aligned, else `k_cols_part`.
    pub(super) fn for_rows(len: usize, dtype: DType, matrices: &[&DTensor]) -> Partials {
        let v = codegen::column_vector(dtype);
        if len > 0
            && len % v == 0
            && len / v <= codegen::COLUMN_WORD_THREADS
            && matrices.iter().all(|t| t.ptr() % 16 == 0)
        {
            Partials::Words(v)
        } else {
            Partials::Tiles
        }
    }
}

/// Launches the column-sum kernels of module `spec` (see `codegen::column_sums`) over
/// a `[rows, len]` matrix read through `inputs`, writing each `(output, scale)`; the
/// partial sums come from `partials`.
pub(super) fn launch_column_sums<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    inputs: &[Arg],
    (rows, len): (usize, usize),
    outs: &[(&DTensor, f64)],
    partials: Partials,
) -> Result<(), String> {
    let acc = acc_dtype(outs.first().ok_or("no outputs")?.0.dtype);
    let (part, chunks) =
        launch_column_partials(c, spec, inputs, (rows, len), (acc, outs.len()), partials)?;
    launch_column_sums_fin(c, spec, &part, len, chunks, outs)
}

/// The first kernel of [`launch_column_sums`]: `sums` partial column sums of `acc` per
/// row chunk, `part[(chunk * sums + k) * len + j]`; returns them and the chunk count.
pub(super) fn launch_column_partials<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    inputs: &[Arg],
    (rows, len): (usize, usize),
    (acc, sums): (DType, usize),
    partials: Partials,
) -> Result<(DTensor, usize), String> {
    // Tiles and rows read contiguous chunks of rows (`chunk_rows`, a last argument);
    // words interleave bands of rows.
    let (name, chunks, tiles, threads, chunk_rows) = match partials {
        Partials::Tiles => {
            let tiles = len.div_ceil(32);
            let most_blocks = (i32::MAX as usize) / tiles.max(1);
            let chunks = rows
                .div_ceil(64)
                .clamp(1, codegen::COLUMN_CHUNKS.min(most_blocks.max(1)));
            (
                "k_cols_part",
                chunks,
                tiles,
                256,
                Some(rows.div_ceil(chunks)),
            )
        }
        Partials::Rows(v) => {
            let (threads, per, tiles) = codegen::column_rows_form(len / v.max(1));
            // One wave of resident blocks (their loads in flight together), each
            // thread of a block taking 8 rows or more, and at most ROW_CHUNKS partials
            // a column for k_cols_fin to add.
            let name = codegen::column_rows_kernel(per);
            let resident = c.resident_blocks(spec, name, threads as u32)? as usize;
            let chunks = (resident / tiles.max(1))
                .min(rows.div_ceil(8 * per))
                .clamp(1, ROW_CHUNKS);
            let threads = threads as u32;
            (name, chunks, tiles, threads, Some(rows.div_ceil(chunks)))
        }
        Partials::Words(v) => {
            // Rows a block reads at once; each thread then takes 16 or more rows, in
            // enough blocks to keep every multiprocessor's loads in flight.
            let per = codegen::COLUMN_WORD_THREADS / (len / v).max(1);
            let chunks = rows.div_ceil(per * 16).clamp(1, WORD_CHUNKS);
            let threads = codegen::COLUMN_WORD_THREADS as u32;
            ("k_cols_words", chunks, 1, threads, None)
        }
    };
    let blocks = u32::try_from(tiles * chunks).map_err(|_| "too many columns for one launch")?;
    let part = c.temp(acc, chunks * sums * len)?;
    let mut args = inputs.to_vec();
    args.extend([part.arg(), Arg::I64(rows as i64), Arg::I64(len as i64)]);
    args.extend(chunk_rows.map(|r| Arg::I64(r as i64)));
    c.launch(spec, name, (blocks, threads), &args)?;
    Ok((part, chunks))
}

/// The most row chunks of `k_cols_rows`: GPT-2's [16384, 3072] bias gradients take
/// about 660 (one wave of five blocks a multiprocessor).
const ROW_CHUNKS: usize = 1024;

/// The most row chunks (blocks) of `k_cols_words`: about four per multiprocessor.
pub(super) const WORD_CHUNKS: usize = 512;

/// `k_cols_fin`: adds `chunks` rows of partial column sums (`len` each, per output) in
/// `part` and writes each `(output, scale)`.
pub(super) fn launch_column_sums_fin<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    part: &DTensor,
    len: usize,
    chunks: usize,
    outs: &[(&DTensor, f64)],
) -> Result<(), String> {
    let mut args = vec![part.arg(), Arg::I64(len as i64), Arg::I64(chunks as i64)];
    for (y, scale) in outs {
        args.extend([y.arg(), Arg::F64(*scale)]);
    }
    let grid = (len.div_ceil(32) * outs.len()).min(1 << 20) as u32;
    c.launch(spec, "k_cols_fin", (grid, FIN_WARPS as u32 * 32), &args)
}

/// A grouped update's launches: `name` once per [`GROUP_MEMBERS`] members, block `m`
/// on member `m`, each member's pointer arguments and length in its row of a by-value
/// [`UpdateTable`].
pub(super) fn launch_grouped<S: KernelSpec>(
    c: &Ctx,
    spec: &S,
    name: &'static str,
    threads: u32,
    members: &[(Vec<Arg>, usize)],
) -> Result<(), String> {
    for chunk in members.chunks(GROUP_MEMBERS) {
        let launch = (chunk.len() as u32, threads);
        c.launch(
            spec,
            name,
            launch,
            &[Arg::Table(Box::new(update_table(chunk)?))],
        )?;
    }
    Ok(())
}

/// The table of one grouped launch (at most [`GROUP_MEMBERS`] members): a member's
/// pointer arguments and a number (its length, or its first block) in its row.
pub(super) fn update_table(members: &[(Vec<Arg>, usize)]) -> Result<UpdateTable, String> {
    let mut table = UpdateTable::default();
    for (row, (args, number)) in members.iter().enumerate() {
        table.set(row, args, *number)?;
    }
    Ok(table)
}

/// (len, inner, rows) of a softmax-like op along `axis`.
pub(super) fn along(shape: &[usize], axis: i64) -> Result<(usize, usize, usize), String> {
    let axis = ampgraph_graph::shape::normalize_axis(axis, shape.len())?;
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

#[cfg(test)]
mod tests {
    use super::{merged, merged_jointly};

    /// Every row-major index of `shape` at its offset under `strides`.
    fn offsets(shape: &[usize], strides: &[usize]) -> Vec<usize> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|mut i| {
                let mut off = 0;
                for (&d, &t) in shape.iter().zip(strides).rev() {
                    off += (i % d) * t;
                    i /= d;
                }
                off
            })
            .collect()
    }

    #[test]
    fn merged_axes_keep_every_offset_with_fewer_axes() {
        // A global average pool of NHWC [2, 3, 4, 5] and its gradient's broadcast.
        let cases: [(&[usize], &[usize], usize); 5] = [
            (&[3, 4], &[20, 5], 1),            // the reduced H, W
            (&[2, 5], &[60, 1], 2),            // the kept N, C stay apart
            (&[2, 3, 4, 5], &[5, 0, 0, 1], 3), // dy broadcast over H, W
            (&[2, 3, 4], &[12, 4, 1], 1),      // contiguous
            (&[2, 1, 3], &[3, 7, 1], 1),       // a size-1 axis with any stride
        ];
        for (shape, strides, axes) in cases {
            let (s, t) = merged(shape, strides);
            assert_eq!(s.len(), axes, "{shape:?} {strides:?} -> {s:?} {t:?}");
            assert_eq!(
                offsets(&s, &t),
                offsets(shape, strides),
                "{shape:?} {strides:?}"
            );
        }
    }

    #[test]
    fn jointly_merged_axes_keep_every_tensors_offsets() {
        // An NHWC image's [N, 1, 1, C] scale and a [1, H, W, C] tensor over [2, 3, 4, 5]:
        // H and W merge in both; C does not merge into them (the scale repeats there).
        let shape = [2, 3, 4, 5];
        let (a, b): (&[usize], &[usize]) = (&[5, 0, 0, 1], &[0, 20, 5, 1]);
        let (dims, steps) = merged_jointly(&shape, &[a, b]);
        assert_eq!(dims, [2, 12, 5]);
        assert_eq!(offsets(&dims, &steps[0]), offsets(&shape, a));
        assert_eq!(offsets(&dims, &steps[1]), offsets(&shape, b));
        // Where one tensor cannot merge two axes, neither does the other.
        let c: &[usize] = &[60, 20, 1, 4];
        let (dims, steps) = merged_jointly(&shape, &[a, c]);
        assert_eq!(dims, [2, 3, 4, 5]);
        assert_eq!(offsets(&dims, &steps[1]), offsets(&shape, c));
    }
}
