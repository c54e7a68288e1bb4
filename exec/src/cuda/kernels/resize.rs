//! Resize (ResizeNearest, ResizeLinear), a thread per output element. The taps of each
//! resized axis (its source positions and weights, which depend only on the shapes and
//! attrs) come from the graph crate's `axis_taps`, as the CPU kernel's do, computed
//! once at lowering and uploaded at the kernel's first launch.
//!
//! The CPU kernel resamples one axis after another, each pass rounding in the compute
//! type (f32 for the 16-bit types); a thread folds its taps in that same order and
//! nesting (the first resized axis innermost, each axis's first term then its second),
//! and the kernels are built without contraction, so the results match it bit for bit.

use std::sync::OnceLock;

use ampgraph_graph::ops::resize::axis_taps;
use ampgraph_graph::ops::Resize;
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Data, Op, Tensor, TensorType};

use super::codegen::module;
use super::{first, float_input, input, numel, one_output, KernelResult, Lowering, Owner};
use crate::cuda::device::{Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Spec in "resize" {
        /// `k(const T* px, T* py, i64 n, int r, Dims shape, Dims stride, Dims level,
        /// Dims base, int k, const i64* toff, const double* tw)`
        Resize { dtype: DType } => resize(dtype),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    op.downcast_ref::<Resize>()
        .map(|r| lower_resize(r, ins, outs))
}

/// The taps of every resized axis as two tables of a row per output position (the
/// rows of an axis from its `base`): each tap's input offset (its position times the
/// axis's input stride; -1 for a missing second tap) and its weight.
fn lower_resize(r: &Resize, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let x = &ins[0];
    let out = first(outs)?;
    if out.shape.len() != x.shape.len() {
        return Err(format!(
            "Resize: rank {} resized to rank {}",
            x.shape.len(),
            out.shape.len()
        ));
    }
    let st = strides(&x.shape);
    let rank = x.shape.len();
    // Axes that keep their length are not resampled, as on the CPU.
    // `level`: 0 for an axis kept, else 1 + its place among the resized axes.
    let (mut level, mut base) = (vec![0; rank], vec![0; rank]);
    let (mut offsets, mut weights) = (vec![], vec![]);
    let mut k = 0;
    for axis in 0..rank {
        let (n, m) = (x.shape[axis], out.shape[axis]);
        if n == m {
            continue;
        }
        if n == 0 {
            return Err(format!("Resize: axis {axis} of the input is empty"));
        }
        k += 1;
        level[axis] = k;
        base[axis] = offsets.len() / 2;
        for taps in axis_taps(r.mode, r.coordinate_transformation_mode, n, m) {
            for t in 0..2 {
                let (o, w) = taps
                    .get(t)
                    .map_or((-1, 0.0), |&(p, w)| ((p * st[axis]) as i64, w));
                offsets.push(o);
                weights.push(w);
            }
        }
    }
    let rows = offsets.len() / 2;
    let tables = [
        Tensor::new(vec![rows, 2], Data::I64(offsets))?,
        Tensor::new(vec![rows, 2], Data::F64(weights))?,
    ];
    let n = numel(&out.shape);
    let sizes = [
        Arg::I64(n as i64),
        Arg::I32(rank as i32),
        Arg::Dims(Dims::new(&out.shape)?),
        Arg::Dims(Dims::new(&st)?),
        Arg::Dims(Dims::new(&level)?),
        Arg::Dims(Dims::new(&base)?),
        Arg::I32(k as i32),
    ];
    let spec = Spec::Resize { dtype };
    let uploaded: OnceLock<[DTensor; 2]> = OnceLock::new();
    Ok(one_output(out, move |c, inputs, y| {
        if n == 0 {
            return Ok(());
        }
        let [toff, tw] = match uploaded.get() {
            Some(t) => t,
            None => {
                let who = Owner("resize taps of node", c.name);
                let [o, w] = &tables;
                // Another thread may have raced us here: either upload serves.
                let _ = uploaded.set([c.dev.upload(o, &who)?, c.dev.upload(w, &who)?]);
                uploaded.get().ok_or("internal: resize taps not uploaded")?
            }
        };
        let mut args = vec![input(inputs, 0)?.arg(), y.arg()];
        args.extend(sizes.iter().cloned());
        args.extend([toff.arg(), tw.arg()]);
        c.launch_items(&spec, n, 1, &args)
    }))
}

/// Output element `i`: its offset along the axes kept, its table row per resized axis
/// (`row[level - 1]`), then the `2^k` combinations of taps (level 0's fastest), those with
/// a missing tap skipped. Each value is multiplied by its level-0 weight; a level's
/// first term waits in `acc` for its second, and a level's last term completes its sum,
/// which goes on up as the next level's value.
pub(super) fn resize(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const T* px, T* py, i64 n, int r, Dims shape, Dims stride, Dims level, Dims base, int k, const i64* toff, const double* tw) {\n\
           GRID_LOOP(i, n) {\n\
             i64 rest = i, off = 0, row[8];\n\
         #pragma unroll\n\
             for (int d = 7; d >= 0; --d) {\n\
               if (d < r) {\n\
                 i64 len = shape.n[d], j = rest % len;\n\
                 rest /= len;\n\
                 if (level.n[d] == 0) off += j * stride.n[d]; else row[level.n[d] - 1] = base.n[d] + j;\n\
               }\n\
             }\n\
             A acc[8], out = 0;\n\
             for (int c = 0; c < (1 << k); ++c) {\n\
               i64 o = off;\n\
               int l = 0;\n\
               for (; l < k; ++l) {\n\
                 i64 s = toff[2 * row[l] + ((c >> l) & 1)];\n\
                 if (s < 0) break;\n\
                 o += s;\n\
               }\n\
               if (l < k) continue;\n\
               A v = (A)ld(px, o);\n\
               for (l = 0; l < k; ++l) {\n\
                 int t = (c >> l) & 1;\n\
                 A term = v * (A)tw[2 * row[l] + t];\n\
                 if (t == 0 && toff[2 * row[l] + 1] >= 0) { acc[l] = term; break; }\n\
                 v = t == 0 ? term : acc[l] + term;\n\
               }\n\
               if (l == k) out = v;\n\
             }\n\
             st(py, i, (C)out);\n\
           }\n}\n",
    )
}
