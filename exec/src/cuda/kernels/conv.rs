//! Convolutions through cuDNN (`crate::cuda::dnn`: algorithms autotuned once per
//! shape): Conv2D, Conv2DBackpropInput and Conv2DBackpropFilter in NHWC and NCHW.
//!
//! Two things cuDNN does not take as the graph has them, bridged here:
//! - the filter is HWIO (TensorFlow's); cuDNN wants KRSC with NHWC tensors and KCRS
//!   with NCHW: the filter is gathered into that order (and a filter gradient back),
//!   small next to the images;
//! - padding may be asymmetric: SAME when the padding a window needs is odd (TensorFlow
//!   pads the extra row or column at the end), EXPLICIT as it says; cuDNN pads both
//!   sides alike, so it gets the symmetric part and the input the rest as zeros at its
//!   start or its end (`Spec::Pad`; a data gradient is computed for the extended input
//!   and cropped). Symmetric padding costs no copy.
//!
//! Grouped convolutions (`groups` > 1) are cuDNN's own (`cudnnSetConvolutionGroupCount`):
//! the HWIO filter `[r, s, c / groups, k]` gathers into the same orders, cuDNN's
//! grouped filter (`k` filters of `c / groups` channels, filter `j` in group
//! `j / (k / groups)`, as in TensorFlow).

use ampgraph_graph::ops::{
    dilated_span, Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, Padding,
};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{word, PRELUDE};
use super::shape::Gather;
use super::{first, float_input, input, one_output, Ctx, KernelResult, Lowering};
use crate::cuda::device::{Arg, DTensor, Dims};
use crate::cuda::dnn::{self, ConvOperands, ConvShape, Direction};

kernel_specs! {
    /// The module of the family, by the bytes of the elements it moves.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "conv" {
        /// `k(const E* px, E* py, i64 n, Dims in, Dims out, Dims start)`: `y` (4-D,
        /// `out`) holds `x` (4-D, `in`) from index `start` on and zeros around it.
        Pad { bytes: usize } => pad(bytes),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(conv) = op.downcast_ref::<Conv2D>() {
        let (x, w) = (ins.first()?, ins.get(1)?);
        let dir = Direction::Forward;
        return Some(lower_conv(dir, conv, &x.shape, &w.shape, ins, outs));
    }
    if let Some(b) = op.downcast_ref::<Conv2DBackpropInput>() {
        let w = ins.first()?;
        let dir = Direction::BackwardData;
        return Some(lower_conv(
            dir,
            &b.conv,
            &b.input_shape,
            &w.shape,
            ins,
            outs,
        ));
    }
    if let Some(b) = op.downcast_ref::<Conv2DBackpropFilter>() {
        let x = ins.first()?;
        let dir = Direction::BackwardFilter;
        return Some(lower_conv(
            dir,
            &b.conv,
            &x.shape,
            &b.filter_shape,
            ins,
            outs,
        ));
    }
    None
}

/// One spatial axis: the output length, the symmetric padding cuDNN applies and the
/// zeros added at the input's start and end for the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AxisPad {
    out: usize,
    pad: usize,
    start: usize,
    end: usize,
}

/// Spatial axis `axis` (0 height, 1 width) of a convolution whose window spans
/// `window` input elements (its taps, dilated).
fn axis_pad(
    padding: Padding,
    axis: usize,
    len: usize,
    window: usize,
    stride: usize,
) -> Result<AxisPad, String> {
    let p = padding.output_len(axis, len, window, stride)?;
    // The zeros after the input that the last window reads; an explicit `after` may
    // hold more, never read. Any count in between gives the same windows: the one
    // nearest `before` adds the fewest zeros to the input.
    let read = (p.out.saturating_sub(1) * stride + window).saturating_sub(len + p.before);
    let after = p.before.min(p.after).max(read);
    let pad = p.before.min(after);
    Ok(AxisPad {
        out: p.out,
        pad,
        start: p.before - pad,
        end: after - pad,
    })
}

/// `[n, c, h, w]` of an image of `shape` in `layout`.
fn nchw(layout: DataFormat, shape: &[usize]) -> Result<[usize; 4], String> {
    match (layout, shape) {
        (DataFormat::Nhwc, &[n, h, w, c]) => Ok([n, c, h, w]),
        (DataFormat::Nchw, &[n, c, h, w]) => Ok([n, c, h, w]),
        _ => Err(format!("a 4-D image was expected, got shape {shape:?}")),
    }
}

/// The shape of `[n, c, h, w]` in `layout`.
fn in_layout(layout: DataFormat, [n, c, h, w]: [usize; 4]) -> Vec<usize> {
    match layout {
        DataFormat::Nhwc => vec![n, h, w, c],
        DataFormat::Nchw => vec![n, c, h, w],
    }
}

fn lower_conv(
    direction: Direction,
    conv: &Conv2D,
    x_shape: &[usize],
    w_shape: &[usize],
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    dnn::available()?;
    let Conv2D {
        strides,
        padding,
        data_format: layout,
        groups,
        dilations,
    } = *conv;
    let dtype = float_input(ins)?;
    if ins.iter().any(|t| t.dtype != dtype) {
        return Err("cuDNN convolutions take operands of one dtype".into());
    }
    if dtype == DType::F64 && layout == DataFormat::Nhwc && direction != Direction::Forward {
        return Err("cuDNN has no f64 NHWC convolution gradients; use NCHW or Device::Cpu".into());
    }
    let out = first(outs)?;
    let [n, c, h, w] = nchw(layout, x_shape)?;
    let &[r, s, wc, k] = w_shape else {
        return Err(format!("the filter must be HWIO, got shape {w_shape:?}"));
    };
    if groups == 0 || c % groups != 0 || k % groups != 0 || wc * groups != c {
        return Err(format!(
            "the filter takes {wc} channels per group and gives {k} with groups {groups} \
             but the image has {c}"
        ));
    }
    let rows = axis_pad(padding, 0, h, dilated_span(r, dilations[0]), strides[0])?;
    let cols = axis_pad(padding, 1, w, dilated_span(s, dilations[1]), strides[1])?;
    let padded = [n, c, h + rows.start + rows.end, w + cols.start + cols.end];
    let shape = ConvShape {
        dtype,
        layout,
        input: padded,
        filter: [k, r, s],
        groups,
        pad: [rows.pad, cols.pad],
        strides,
        dilations,
        out: [rows.out, cols.out],
        allow_tf32: false,
    };
    let esize = dtype.size_bytes();
    // The input extended with the asymmetric padding's zeros, and the data gradient
    // cropped back.
    let extended = (padded != [n, c, h, w]).then(|| {
        Extension::new(
            layout,
            esize,
            [n, c, h, w],
            padded,
            [rows.start, cols.start],
        )
    });
    let crop = extended.as_ref().map(Extension::crop).transpose()?;
    // HWIO <-> the layout's filter order.
    let (cudnn_filter, to_cudnn, from_cudnn) = filter_orders(layout, [r, s, wc, k]);
    let to_cudnn = Gather::new(esize, &cudnn_filter, &to_cudnn, 0)?;
    let from_cudnn = Gather::new(esize, w_shape, &from_cudnn, 0)?;
    let filter_len = r * s * wc * k;
    Ok(one_output(out, move |ctx, inputs, y| {
        let shape = ConvShape {
            allow_tf32: ctx.gemm_options.allow_tf32,
            ..shape
        };
        let run = |x: &DTensor, w: &DTensor, y: &DTensor| {
            ctx.dnn.conv(
                ctx.dev,
                direction,
                &shape,
                ctx.dnn_options,
                ctx.workspace_room,
                ConvOperands { x, w, y },
                |bytes| ctx.scratch(&TensorType::new(DType::F32, [bytes.div_ceil(4)])),
            )
        };
        let filter_in = |f: &DTensor| -> Result<DTensor, String> {
            let t = ctx.temp(dtype, filter_len)?;
            to_cudnn.launch(ctx, f, &t)?;
            Ok(t)
        };
        let image_in = |x: &DTensor| -> Result<DTensor, String> {
            match &extended {
                Some(e) => e.launch(ctx, x),
                None => Ok(x.clone()),
            }
        };
        match direction {
            Direction::Forward => {
                let x = image_in(input(inputs, 0)?)?;
                let f = filter_in(input(inputs, 1)?)?;
                run(&x, &f, y)
            }
            Direction::BackwardData => {
                let f = filter_in(input(inputs, 0)?)?;
                let dy = input(inputs, 1)?;
                match &crop {
                    Some(crop) => {
                        let dx = ctx.temp(dtype, padded.iter().product())?;
                        run(&dx, &f, dy)?;
                        crop.launch(ctx, &dx, y)
                    }
                    None => run(y, &f, dy),
                }
            }
            Direction::BackwardFilter => {
                let x = image_in(input(inputs, 0)?)?;
                let dy = input(inputs, 1)?;
                let df = ctx.temp(dtype, filter_len)?;
                run(&x, &df, dy)?;
                from_cudnn.launch(ctx, &df, y)
            }
        }
    }))
}

/// The filter order cuDNN takes with `layout` (KRSC for NHWC, KCRS for NCHW) for an
/// HWIO filter `[r, s, c, k]`: its shape, the strides that gather it from HWIO, and the
/// strides that gather HWIO back from it.
fn filter_orders(
    layout: DataFormat,
    [r, s, c, k]: [usize; 4],
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    // HWIO strides of r, s, c, k.
    let (hr, hs, hc, hk) = (s * c * k, c * k, k, 1);
    match layout {
        DataFormat::Nhwc => {
            // KRSC strides of k, r, s, c.
            let (kk, kr, ks, kc) = (r * s * c, s * c, c, 1);
            (vec![k, r, s, c], vec![hk, hr, hs, hc], vec![kr, ks, kc, kk])
        }
        DataFormat::Nchw => {
            // KCRS strides of k, c, r, s.
            let (kk, kc, kr, ks) = (c * r * s, r * s, s, 1);
            (vec![k, c, r, s], vec![hk, hc, hr, hs], vec![kr, ks, kc, kk])
        }
    }
}

/// The input extended with zeros (the asymmetric part of the padding): shape `from`
/// into shape `to`, from index `start` on.
struct Extension {
    esize: usize,
    from: Vec<usize>,
    to: Vec<usize>,
    start: Vec<usize>,
}

impl Extension {
    /// An input `[n, c, h, w]` in `layout` extended to `padded`, its first row and
    /// column at `[row, col]`.
    fn new(
        layout: DataFormat,
        esize: usize,
        input: [usize; 4],
        padded: [usize; 4],
        [row, col]: [usize; 2],
    ) -> Extension {
        Extension {
            esize,
            from: in_layout(layout, input),
            to: in_layout(layout, padded),
            start: in_layout(layout, [0, 0, row, col]),
        }
    }

    /// Where the input starts in the extended tensor, in elements.
    fn offset(&self) -> usize {
        let st = ampgraph_graph::tensor::strides(&self.to);
        self.start.iter().zip(&st).map(|(a, b)| a * b).sum()
    }

    /// The gather of the input's part of an extended tensor.
    fn crop(&self) -> Result<Gather, String> {
        let st = ampgraph_graph::tensor::strides(&self.to);
        Gather::new(self.esize, &self.from, &st, self.offset())
    }

    fn launch(&self, c: &Ctx, x: &DTensor) -> Result<DTensor, String> {
        let y = c.temp(x.dtype, self.to.iter().product())?;
        let n = y.len();
        let args = [
            x.arg(),
            y.arg(),
            Arg::I64(n as i64),
            Arg::Dims(Dims::new(&self.from)?),
            Arg::Dims(Dims::new(&self.to)?),
            Arg::Dims(Dims::new(&self.start)?),
        ];
        c.launch_items(&Spec::Pad { bytes: self.esize }, n, 1, &args)?;
        Ok(y)
    }
}

pub(super) fn pad(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, Dims in, Dims out,\n\
                                     Dims start) {{\n\
           GRID_LOOP(i, n) {{\n\
             i64 rest = i, src = 0, step = 1, inside = 1;\n\
             for (int d = 3; d >= 0; --d) {{\n\
               i64 at = rest % out.n[d] - start.n[d]; rest /= out.n[d];\n\
               inside &= at >= 0 && at < in.n[d];\n\
               src += at * step; step *= in.n[d];\n\
             }}\n\
             py[i] = inside ? px[src] : E{{}};\n\
           }}\n}}\n",
        word(bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (out, pad, start, end) of the height axis.
    fn split(padding: Padding, len: usize, window: usize, stride: usize) -> [usize; 4] {
        let a = axis_pad(padding, 0, len, window, stride).unwrap();
        [a.out, a.pad, a.start, a.end]
    }

    fn explicit(before: usize, after: usize) -> Padding {
        Padding::Explicit([[before, after], [0, 0]])
    }

    #[test]
    fn same_padding_splits_into_symmetric_and_extra() {
        // TensorFlow pads 0 before and 1 after: cuDNN pads 0, one zero row is added.
        assert_eq!(split(Padding::Same, 64, 3, 2), [32, 0, 0, 1]);
        // Odd input: 1 before and 1 after.
        assert_eq!(split(Padding::Same, 65, 3, 2), [33, 1, 0, 0]);
        assert_eq!(split(Padding::Same, 7, 3, 1), [7, 1, 0, 0]);
        // A 4-wide window at stride 1 needs 3: 1 before, 2 after.
        assert_eq!(split(Padding::Same, 9, 4, 1), [9, 1, 0, 1]);
        // VALID never pads, even where the windows leave the end unread.
        assert_eq!(split(Padding::Valid, 8, 3, 2), [3, 0, 0, 0]);
        // A 1x1 window at stride 2: no padding.
        assert_eq!(split(Padding::Same, 4, 1, 2), [2, 0, 0, 0]);
    }

    #[test]
    fn explicit_padding_splits_into_symmetric_and_extra() {
        // PyTorch's padding 1: all of it cuDNN's, no copy.
        assert_eq!(split(explicit(1, 1), 64, 3, 2), [32, 1, 0, 0]);
        // More before than after: the rest at the input's start.
        assert_eq!(split(explicit(3, 1), 8, 3, 1), [10, 1, 2, 0]);
        // More after than before: the rest at its end.
        assert_eq!(split(explicit(0, 2), 8, 3, 1), [8, 0, 0, 2]);
        // Pads wider than the window: windows of zeros only.
        assert_eq!(split(explicit(4, 0), 2, 3, 1), [4, 0, 4, 0]);
        assert_eq!(split(explicit(1, 6), 2, 2, 2), [4, 1, 0, 4]);
        // Zeros after the last window are never read: (0, 1) with 2-wide windows at
        // stride 2 over 8 is VALID's, (1, 2) over 9 with 3-wide ones at stride 2 is
        // (1, 1).
        assert_eq!(split(explicit(0, 1), 8, 2, 2), [4, 0, 0, 0]);
        assert_eq!(split(explicit(1, 2), 9, 3, 2), [5, 1, 0, 0]);
        assert!(split(explicit(0, 1), 8, 2, 2) == split(Padding::Valid, 8, 2, 2));
        // Too little for one window.
        assert!(axis_pad(explicit(1, 0), 0, 1, 3, 1).is_err());
    }

    /// `x` of shape `from` placed in zeros of shape `to` from index `start` on, as the
    /// pad kernel does.
    fn pad_host(x: &[f64], e: &Extension) -> Vec<f64> {
        let n: usize = e.to.iter().product();
        (0..n)
            .map(|mut i| {
                let (mut src, mut step) = (0, 1);
                for d in (0..4).rev() {
                    let at = (i % e.to[d]) as isize - e.start[d] as isize;
                    i /= e.to[d];
                    if at < 0 || at >= e.from[d] as isize {
                        return 0.0;
                    }
                    src += at as usize * step;
                    step *= e.from[d];
                }
                x[src]
            })
            .collect()
    }

    /// The convolution and both gradients as `lower_conv` runs them (the input
    /// extended, cuDNN's symmetric padding, the data gradient cropped), on the CPU
    /// kernels, equal the graph's ops with the padding as given.
    #[test]
    fn split_padding_computes_the_same_convolution() {
        use ampgraph_graph::{tensor, Tensor};
        let (n, c, k) = (2, 3, 2);
        let t = |shape: &[usize], seed: usize| {
            let len: usize = shape.iter().product();
            let v: Vec<f64> = (0..len)
                .map(|i| ((i * 7 + seed) % 11) as f64 - 5.0)
                .collect();
            Tensor::from_f64(DType::F64, shape.to_vec(), &v).unwrap()
        };
        let eval = |op: &dyn Op, ins: &[&Tensor]| op.eval(ins).unwrap().remove(0);
        let explicit = Padding::Explicit;
        // (height, width, window, strides, dilations, padding)
        let cases = [
            (6, 7, [3, 3], [2, 2], [1, 1], Padding::Same),
            (6, 7, [3, 2], [1, 2], [1, 1], explicit([[1, 1], [2, 2]])),
            (6, 7, [3, 3], [2, 1], [1, 1], explicit([[2, 0], [0, 3]])),
            (5, 4, [2, 3], [1, 3], [1, 1], explicit([[0, 4], [5, 1]])),
            (4, 4, [3, 3], [2, 2], [1, 1], explicit([[0, 1], [1, 2]])),
            // Dilated: SAME over the dilated span (odd needs: the extra at the end),
            // explicit pads asymmetric both ways.
            (9, 8, [3, 2], [1, 1], [2, 3], Padding::Same),
            (9, 8, [3, 3], [2, 1], [3, 2], explicit([[4, 1], [0, 3]])),
        ];
        for (h, w, [r, s], strides, dilations, padding) in cases {
            for layout in [DataFormat::Nhwc, DataFormat::Nchw] {
                let what = format!(
                    "{h}x{w} window {r}x{s} {strides:?} dilations {dilations:?} {padding:?} \
                     {layout:?}"
                );
                let span = |taps, axis: usize| dilated_span(taps, dilations[axis]);
                let rows = axis_pad(padding, 0, h, span(r, 0), strides[0]).unwrap();
                let cols = axis_pad(padding, 1, w, span(s, 1), strides[1]).unwrap();
                let padded = [n, c, h + rows.start + rows.end, w + cols.start + cols.end];
                let e = Extension::new(layout, 8, [n, c, h, w], padded, [rows.start, cols.start]);
                let sym = Padding::Explicit([[rows.pad; 2], [cols.pad; 2]]);
                let (x, f) = (t(&e.from, 1), t(&[r, s, c, k], 2));
                let xp = Tensor::from_f64(DType::F64, e.to.clone(), &pad_host(&x.to_f64_vec(), &e))
                    .unwrap();
                let conv =
                    |padding| Conv2D::new(strides, padding, layout).with_dilations(dilations);
                let y = eval(&conv(padding), &[&x, &f]);
                let split_y = eval(&conv(sym), &[&xp, &f]);
                assert_eq!(split_y, y, "forward {what}");
                let dy = t(y.shape(), 3);
                let dx = Conv2DBackpropInput {
                    input_shape: e.from.clone(),
                    conv: conv(padding),
                };
                let dxp = Conv2DBackpropInput {
                    input_shape: e.to.clone(),
                    conv: conv(sym),
                };
                let dxp = eval(&dxp, &[&f, &dy]).to_f64_vec();
                // The crop, as `Extension::crop`'s gather reads it.
                let cropped = gather(&dxp[e.offset()..], &e.from, &tensor::strides(&e.to));
                assert_eq!(
                    cropped,
                    eval(&dx, &[&f, &dy]).to_f64_vec(),
                    "data gradient {what}"
                );
                let df = Conv2DBackpropFilter {
                    filter_shape: vec![r, s, c, k],
                    conv: conv(padding),
                };
                let dfp = Conv2DBackpropFilter {
                    filter_shape: vec![r, s, c, k],
                    conv: conv(sym),
                };
                assert_eq!(
                    eval(&dfp, &[&xp, &dy]),
                    eval(&df, &[&x, &dy]),
                    "filter gradient {what}"
                );
            }
        }
    }

    /// Gathers with the given strides, on the host, as the gather kernel does.
    fn gather<T: Copy>(x: &[T], shape: &[usize], st: &[usize]) -> Vec<T> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|mut i| {
                let mut at = 0;
                for d in (0..shape.len()).rev() {
                    at += (i % shape[d]) * st[d];
                    i /= shape[d];
                }
                x[at]
            })
            .collect()
    }

    #[test]
    fn filter_orders_gather_there_and_back() {
        let (r, s, c, k) = (2, 3, 4, 5);
        let hwio: Vec<usize> = (0..r * s * c * k).collect();
        for layout in [DataFormat::Nhwc, DataFormat::Nchw] {
            let (shape, to, back) = filter_orders(layout, [r, s, c, k]);
            let there = gather(&hwio, &shape, &to);
            // Element (k, r, s, c) of KRSC / (k, c, r, s) of KCRS is HWIO's (r, s, c, k).
            let at = |ri: usize, si: usize, ci: usize, ki: usize| ((ri * s + si) * c + ci) * k + ki;
            let want: Vec<usize> = match layout {
                DataFormat::Nhwc => (0..k)
                    .flat_map(|ki| {
                        (0..r).flat_map(move |ri| {
                            (0..s).flat_map(move |si| (0..c).map(move |ci| at(ri, si, ci, ki)))
                        })
                    })
                    .collect(),
                DataFormat::Nchw => (0..k)
                    .flat_map(|ki| {
                        (0..c).flat_map(move |ci| {
                            (0..r).flat_map(move |ri| (0..s).map(move |si| at(ri, si, ci, ki)))
                        })
                    })
                    .collect(),
            };
            assert_eq!(there, want, "{layout:?}");
            assert_eq!(gather(&there, &[r, s, c, k], &back), hwio, "{layout:?}");
        }
    }
}
