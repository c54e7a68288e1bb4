//! Ops that only move data: Transpose, Slice and BroadcastTo as one strided gather
//! (its indexing fixed when the node is lowered), Concat, and the views that launch
//! nothing (Reshape, AssignVariable's value).

use ampgraph_graph::ops::{AssignVariable, BroadcastTo, Concat, Reshape, Slice, Transpose};
use ampgraph_graph::shape::normalize_axis;
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{Op, TensorType};

use super::codegen::{word, PRELUDE};
use super::elementwise::broadcast_strides;
use super::{first, input, kernel, numel, one_output, Ctx, KernelResult, Lowering};
use crate::cuda::device::{Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family, by the bytes of the words they move.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "shape" {
        /// `k(const E* px, E* py, i64 n, int r, Dims shape, Dims st, i64 offset)`
        Gather { bytes: usize } => gather(bytes),
        /// `k(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off)`
        Concat { bytes: usize } => concat(bytes),
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
/// over an output of `shape`, reading `x` with strides `st` (elements). Where the last
/// axis is contiguous in both, its runs move as words of up to 16 bytes.
pub(super) struct Gather {
    spec: Spec,
    n: usize,
    sizes: [Arg; 5],
}

impl Gather {
    /// The gather of elements of `esize` bytes.
    pub(super) fn new(
        esize: usize,
        shape: &[usize],
        st: &[usize],
        offset: usize,
    ) -> Result<Gather, String> {
        let (mut shape, mut st, mut offset) = (shape.to_vec(), st.to_vec(), offset);
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
        let n = numel(&shape);
        Ok(Gather {
            spec: Spec::Gather {
                bytes: esize * group,
            },
            n,
            sizes: [
                Arg::I64(n as i64),
                Arg::I32(shape.len() as i32),
                Arg::Dims(Dims::new(&shape)?),
                Arg::Dims(Dims::new(&st)?),
                Arg::I64(offset as i64),
            ],
        })
    }

    pub(super) fn launch(&self, c: &Ctx, x: &DTensor, y: &DTensor) -> Result<(), String> {
        let mut args = vec![x.arg(), y.arg()];
        args.extend(self.sizes.iter().cloned());
        c.launch_n(&self.spec, self.n, &args)
    }
}

/// Each input copied into its place in the output, a launch each, in the widest words
/// (up to 16 bytes) that its blocks and their places are made of: a channel padding
/// of f16 images (60 channels and 4 zeros into 64) moves 8-byte words, not 2-byte
/// elements.
fn lower_concat(axis: i64, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let out = first(outs)?;
    let axis = normalize_axis(axis, out.shape.len())?;
    let esize = out.dtype.size_bytes();
    let inner_out = numel(&out.shape[axis..]);
    let below = numel(&out.shape[axis + 1..]);
    // Per input: the widest word in bytes, and (elements, inner size, output inner
    // size, offset in the output's inner block) in elements.
    let mut parts = Vec::new();
    let mut off = 0usize;
    for x in ins {
        let (n, inner_in) = (numel(&x.shape), numel(&x.shape[axis..]));
        // Every size here is whole elements: the element's own size always divides.
        let word = [16, 8, 4, 2, 1]
            .into_iter()
            .find(|w| {
                [inner_in, inner_out, off]
                    .iter()
                    .all(|e| e * esize % w == 0)
            })
            .unwrap_or(esize);
        parts.push((word, [n, inner_in, inner_out, off]));
        off += x.shape[axis] * below;
    }
    Ok(one_output(out, move |c, inputs, y| {
        for (k, &(word, elements)) in parts.iter().enumerate() {
            let x = input(inputs, k)?;
            // A view's buffer may start off the word: then element by element.
            let aligned = x.ptr() % word as u64 == 0 && y.ptr() % word as u64 == 0;
            let word = if aligned { word } else { esize };
            let [n, inner_in, inner_out, off] = elements.map(|v| v * esize / word);
            if n > 0 {
                let args = [x.arg(), y.arg()]
                    .into_iter()
                    .chain([n, inner_in, inner_out, off].map(|v| Arg::I64(v as i64)));
                c.launch_n(&Spec::Concat { bytes: word }, n, &args.collect::<Vec<_>>())?;
            }
        }
        Ok(())
    }))
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

/// Copies one concat input into its place in the output.
pub(super) fn concat(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, i64 inner_in, i64 inner_out, i64 off) {{\n\
           GRID_LOOP(i, n) {{ py[(i / inner_in) * inner_out + off + i % inner_in] = px[i]; }}\n}}\n",
        word(bytes)
    )
}
