//! Ops that only move data: Transpose, Slice and BroadcastTo as one strided gather
//! (its indexing fixed when the node is lowered; a gather that moves the contiguous
//! axis, as a filter's HWIO -> KRSC or an image's NCHW -> NHWC does, goes through
//! shared-memory tiles so that both its reads and its writes are coalesced), Concat,
//! and the views that launch nothing (Reshape, AssignVariable's value). Copies of long
//! rows (a slice or concat along the last axis of wide rows, whose words cannot widen:
//! GPT-2's padded vocabulary of 50,264 sliced to 50,257) go a block per row, with no
//! division per element.

use ampgraph_graph::ops::{AssignVariable, BroadcastTo, Concat, Reshape, Slice, Transpose};
use ampgraph_graph::shape::normalize_axis;
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{Op, TensorType};

use super::codegen::{word, PRELUDE};
use super::elementwise::broadcast_strides;
use super::{first, input, kernel, merged, numel, one_output, Ctx, KernelResult, Lowering};
use crate::cuda::device::{row_grid, Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family, by the bytes of the words they move.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "shape" {
        /// `k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, i64 offset)`
        Gather { bytes: usize } => gather(bytes),
        /// `k(const E* px, E* py, i64 rows, i64 inner, i64 stride, i64 offset)`: a block
        /// per row of `inner` words read `stride` apart.
        Rows { bytes: usize } => rows(bytes),
        /// `k(const E* px, E* py, i64 batches, i64 p, i64 q, i64 sb, i64 sq, i64 offset,
        /// int tp, int tq)`
        Transpose { bytes: usize } => transpose(bytes),
        /// `k(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off)`, and
        /// `k_rows` (same arguments) a block per row.
        Concat { bytes: usize } => concat(bytes),
        /// `k(const E* pa, const E* pb, E* py, i64 n, i64 ia, i64 ib)`, and `k_rows`
        /// (same arguments) a block per row.
        ConcatPair { bytes: usize } => concat_pair(bytes),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    let x = ins.first();
    let out = outs.first();
    let (Some(x), Some(out)) = (x, out) else {
        return None;
    };
    if op.is::<Reshape>() {
        let shape = out.shape.clone();
        return Some(Ok(kernel(move |_, inputs| {
            Ok(vec![input(inputs, 0)?.reshaped(shape.clone())])
        })));
    }
    if op.is::<AssignVariable>() {
        return Some(Ok(kernel(|_, inputs| Ok(vec![input(inputs, 1)?.clone()]))));
    }
    if let Some(t) = op.downcast_ref::<Transpose>() {
        let in_st = strides(&x.shape);
        let st: Vec<usize> = t.perm.iter().map(|&p| in_st[p]).collect();
        return Some(lower_gather(x, out, &st, 0));
    }
    if let Some(s) = op.downcast_ref::<Slice>() {
        let st = strides(&x.shape);
        let offset = s.begin.iter().zip(&st).map(|(b, s)| b * s).sum();
        return Some(lower_gather(x, out, &st, offset));
    }
    if op.is::<BroadcastTo>() {
        if x.shape == out.shape {
            return Some(Ok(kernel(|_, inputs| Ok(vec![input(inputs, 0)?.clone()]))));
        }
        return Some(lower_gather(
            x,
            out,
            &broadcast_strides(&x.shape, &out.shape),
            0,
        ));
    }
    if let Some(cc) = op.downcast_ref::<Concat>() {
        return Some(lower_concat(cc.axis, ins, outs));
    }
    None
}

/// `y[i] = x[offset + strided(i)]` for transposes, slices and broadcasts.
fn lower_gather(x: &TensorType, out: &TensorType, st: &[usize], offset: usize) -> KernelResult {
    let gather = Gather::new(x.dtype.size_bytes(), &out.shape, st, offset)?;
    Ok(one_output(out.clone(), move |c, inputs, y| {
        gather.launch(c, input(inputs, 0)?, y)
    }))
}

/// A strided gather fixed when its node is lowered: `y[i] = x[offset + strided(i)]`
/// over an output of `shape`, reading `x` with strides `st` (elements), its
/// neighbouring axes merged where one stride walks them. Where the last axis is
/// contiguous in both, its runs move as words of up to 16 bytes; where the output's
/// last axis is strided and the one before it contiguous (a batch of matrix
/// transposes), through shared-memory tiles.
pub(super) struct Gather {
    spec: Spec,
    /// Items the kernel walks: words, or tiles of the transpose.
    n: usize,
    sizes: Vec<Arg>,
}

/// The elements of a transpose's tile, and its widest side (a warp's width): 32 x 32,
/// or narrower along `q` and longer along `p` where `q` is short (an RGB image's 3
/// channels: 4 x 256), so that a block still moves a thousand elements.
const TILE_ELEMENTS: usize = 1024;
const TILE: usize = 32;

/// Rows of at least this many words are copied a block (of 256 threads) per row,
/// where there are at least [`ROW_BLOCKS`] of them: fewer blocks would leave the GPU
/// idle (a concat along the first axis is one row: one block copied GPT-2's 77 MB
/// embedding in 7.7 ms).
const ROW_WORDS: usize = 1024;
const ROW_BLOCKS: usize = 512;

/// Whether `n` words in rows of `row` words go a block per row.
fn by_rows(n: usize, row: usize) -> bool {
    row >= ROW_WORDS && n / row >= ROW_BLOCKS
}

impl Gather {
    /// The gather of elements of `esize` bytes.
    pub(super) fn new(
        esize: usize,
        shape: &[usize],
        st: &[usize],
        offset: usize,
    ) -> Result<Gather, String> {
        let (mut shape, mut st) = merged(shape, st);
        if shape.is_empty() {
            (shape, st) = (vec![1], vec![0]);
        }
        if let Some(t) = Self::transpose(esize, &shape, &st, offset) {
            return Ok(t);
        }
        let mut offset = offset;
        let mut group = 1;
        if let (Some(&inner), Some(&1)) = (shape.last(), st.last()) {
            let outer = &st[..st.len() - 1];
            group = (16 / esize).max(1);
            while group > 1
                && !(inner % group == 0
                    && offset % group == 0
                    && outer.iter().all(|s| s % group == 0))
            {
                group /= 2;
            }
        }
        if group > 1 {
            let last = shape.len() - 1;
            shape[last] /= group;
            for s in &mut st[..last] {
                *s /= group;
            }
            offset /= group;
        }
        let bytes = esize * group;
        if let (&[rows, inner], &[stride, 1]) = (&shape[..], &st[..]) {
            if by_rows(rows * inner, inner) {
                return Ok(Gather {
                    spec: Spec::Rows { bytes },
                    n: rows,
                    sizes: [rows, inner, stride, offset]
                        .map(|v| Arg::I64(v as i64))
                        .to_vec(),
                });
            }
        }
        let n = numel(&shape);
        Ok(Gather {
            spec: Spec::Gather { bytes },
            n,
            sizes: vec![
                Arg::I64(n as i64),
                Arg::I32(shape.len() as i32),
                Arg::Dims(Dims::new(&shape)?),
                Arg::Dims(Dims::new(&st)?),
                Arg::I64(offset as i64),
            ],
        })
    }

    /// The tiled transpose `y[b, p, q] = x[offset + b sb + p + q sq]` where the merged
    /// output is `[batches,] p, q` with `p` contiguous in `x` and `q` not.
    fn transpose(esize: usize, shape: &[usize], st: &[usize], offset: usize) -> Option<Gather> {
        let (batches, sb, p, q, sq) = match (shape, st) {
            (&[p, q], &[1, sq]) => (1, 0, p, q, sq),
            (&[b, p, q], &[sb, 1, sq]) => (b, sb, p, q, sq),
            _ => return None,
        };
        if sq == 0 {
            return None;
        }
        let tq = q.next_power_of_two().min(TILE);
        let tp = TILE_ELEMENTS / tq;
        let tiles = batches * p.div_ceil(tp) * q.div_ceil(tq);
        let mut sizes: Vec<Arg> = [batches, p, q, sb, sq, offset]
            .map(|v| Arg::I64(v as i64))
            .to_vec();
        sizes.extend([tp, tq].map(|v| Arg::I32(v as i32)));
        Some(Gather {
            spec: Spec::Transpose { bytes: esize },
            n: tiles,
            sizes,
        })
    }

    pub(super) fn launch(&self, c: &Ctx, x: &DTensor, y: &DTensor) -> Result<(), String> {
        let mut args = vec![x.arg(), y.arg()];
        args.extend(self.sizes.iter().cloned());
        match self.spec {
            // A block of 8 warps per tile or row, a grid-stride loop over them.
            Spec::Transpose { .. } | Spec::Rows { .. } => {
                let grid = row_grid(self.n);
                c.launch(&self.spec, "k", (grid, 256), &args)
            }
            _ => c.launch_items(&self.spec, self.n, 1, &args),
        }
    }
}

/// The widest word (up to 16 bytes) that divides every one of `sizes` (bytes).
pub(super) fn widest_word(sizes: &[usize]) -> usize {
    [16, 8, 4, 2, 1]
        .into_iter()
        .find(|w| sizes.iter().all(|b| b % w == 0))
        .unwrap_or(1)
}

/// `word` where every one of `buffers` starts on it, else `esize`: a view's buffer may
/// start off the word, and is then copied element by element.
pub(super) fn word_at(word: usize, esize: usize, buffers: &[&DTensor]) -> usize {
    if buffers.iter().all(|t| t.ptr() % word as u64 == 0) {
        word
    } else {
        esize
    }
}

/// Two inputs (a channel padding: an image and its zero channels) in one launch over
/// the output, each row written whole in the widest words both blocks are made of:
/// copying the zeros after the image, a word per row, had L2 merge partial sectors
/// with what the first launch wrote (twice the memory traffic). More inputs: each
/// copied into its place, a launch each, in its own widest words.
fn lower_concat(axis: i64, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let out = first(outs)?;
    let axis = normalize_axis(axis, out.shape.len())?;
    let esize = out.dtype.size_bytes();
    let inner_out = numel(&out.shape[axis..]);
    let below = numel(&out.shape[axis + 1..]);
    if let [a, b] = ins {
        let blocks = [numel(&a.shape[axis..]), numel(&b.shape[axis..])];
        let word = widest_word(&blocks.map(|e| e * esize)).max(esize);
        let n = numel(&out.shape);
        return Ok(one_output(out, move |c, inputs, y| {
            let (a, b) = (input(inputs, 0)?, input(inputs, 1)?);
            let word = word_at(word, esize, &[a, b, y]);
            let [n, ia, ib] = [n, blocks[0], blocks[1]].map(|v| v * esize / word);
            if n == 0 {
                return Ok(());
            }
            let args: Vec<Arg> = [a.arg(), b.arg(), y.arg()]
                .into_iter()
                .chain([n, ia, ib].map(|v| Arg::I64(v as i64)))
                .collect();
            launch_copy(c, &Spec::ConcatPair { bytes: word }, n, ia + ib, &args)
        }));
    }
    // Per input: the widest word in bytes, and (elements, inner size, output inner
    // size, offset in the output's inner block) in elements.
    let mut parts = Vec::new();
    let mut off = 0usize;
    for x in ins {
        let (n, inner_in) = (numel(&x.shape), numel(&x.shape[axis..]));
        // Every size here is whole elements: the element's own size always divides.
        let word = widest_word(&[inner_in, inner_out, off].map(|e| e * esize)).max(esize);
        parts.push((word, [n, inner_in, inner_out, off]));
        off += x.shape[axis] * below;
    }
    Ok(one_output(out, move |c, inputs, y| {
        for (k, &(word, elements)) in parts.iter().enumerate() {
            let x = input(inputs, k)?;
            let word = word_at(word, esize, &[x, y]);
            let [n, inner_in, inner_out, off] = elements.map(|v| v * esize / word);
            if n > 0 {
                let args: Vec<Arg> = [x.arg(), y.arg()]
                    .into_iter()
                    .chain([n, inner_in, inner_out, off].map(|v| Arg::I64(v as i64)))
                    .collect();
                launch_copy(c, &Spec::Concat { bytes: word }, n, inner_in, &args)?;
            }
        }
        Ok(())
    }))
}

/// A concat's copy of `n` words in rows of `row` words: `k_rows`, a block per row, for
/// long rows, else `k`, a thread per word.
fn launch_copy(c: &Ctx, spec: &Spec, n: usize, row: usize, args: &[Arg]) -> Result<(), String> {
    if by_rows(n, row) {
        let grid = row_grid(n / row);
        c.launch(spec, "k_rows", (grid, 256), args)
    } else {
        c.launch_items(spec, n, 1, args)
    }
}

/// `y[i] = x[offset + strided(i)]`: transposes, slices, broadcasts.
pub(super) fn gather(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, i64 offset) {{\n\
           GRID_LOOP(i, n) {{ py[i] = px[offset + strided(i, r, shape, st)]; }}\n}}\n",
        word(bytes)
    )
}

/// Row `r` of `y` (`inner` words) from `x` at `offset + r stride`, a block per row.
pub(super) fn rows(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 rows, i64 inner, i64 stride, i64 offset) {{\n\
           for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {{\n\
             const E* x = px + offset + r * stride;\n\
             E* y = py + r * inner;\n\
             for (i64 j = threadIdx.x; j < inner; j += blockDim.x) y[j] = x[j];\n\
           }}\n}}\n",
        word(bytes)
    )
}

/// `y[b, p, q] = x[offset + b sb + p + q sq]`, a tile of `tp` x `tq` (1024 elements)
/// per block of 256 threads: read along `p` into shared memory, written along `q`
/// (the padding column keeps the tile's column reads off one bank).
pub(super) fn transpose(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 batches, i64 p, i64 q, i64 sb, i64 sq, i64 offset, int tp, int tq) {{\n\
           __shared__ E tile[{TILE_ELEMENTS} + {TILE}];\n\
           i64 np = (p + tp - 1) / tp, nq = (q + tq - 1) / tq;\n\
           for (i64 t = blockIdx.x; t < batches * np * nq; t += gridDim.x) {{\n\
             i64 b = t / (np * nq), p0 = (t / nq) % np * tp, q0 = t % nq * tq;\n\
             const E* x = px + offset + b * sb;\n\
             E* y = py + b * p * q;\n\
             for (int l = threadIdx.x; l < tp * tq; l += blockDim.x) {{\n\
               int i = l % tp, j = l / tp;\n\
               if (p0 + i < p && q0 + j < q) tile[j * (tp + 1) + i] = x[p0 + i + (q0 + j) * sq];\n\
             }}\n\
             __syncthreads();\n\
             for (int l = threadIdx.x; l < tp * tq; l += blockDim.x) {{\n\
               int j = l % tq, i = l / tq;\n\
               if (p0 + i < p && q0 + j < q) y[(p0 + i) * q + q0 + j] = tile[j * (tp + 1) + i];\n\
             }}\n\
             __syncthreads();\n\
           }}\n}}\n",
        word(bytes)
    )
}

/// Two inputs' rows side by side: output word `o` from `a` or `b`.
pub(super) fn concat_pair(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* pa, const E* pb, E* py, i64 n, i64 ia, i64 ib) {{\n\
           i64 io = ia + ib;\n\
           GRID_LOOP(o, n) {{ i64 row = o / io, c = o - row * io; py[o] = c < ia ? pa[row * ia + c] : pb[row * ib + c - ia]; }}\n}}\n\
         extern \"C\" __global__ void k_rows(const E* pa, const E* pb, E* py, i64 n, i64 ia, i64 ib) {{\n\
           i64 io = ia + ib;\n\
           for (i64 row = blockIdx.x; row < n / io; row += gridDim.x) {{\n\
             for (i64 c = threadIdx.x; c < ia; c += blockDim.x) py[row * io + c] = pa[row * ia + c];\n\
             for (i64 c = threadIdx.x; c < ib; c += blockDim.x) py[row * io + ia + c] = pb[row * ib + c];\n\
           }}\n}}\n",
        word(bytes)
    )
}

/// Copies one concat input into its place in the output.
pub(super) fn concat(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off) {{\n\
           GRID_LOOP(i, n) {{ py[(i / inner_in) * inner_out + off + i % inner_in] = px[i]; }}\n}}\n\
         extern \"C\" __global__ void k_rows(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off) {{\n\
           for (i64 row = blockIdx.x; row < n / inner_in; row += gridDim.x) {{\n\
             for (i64 j = threadIdx.x; j < inner_in; j += blockDim.x) py[row * inner_out + off + j] = px[row * inner_in + j];\n\
           }}\n}}\n",
        word(bytes)
    )
}
