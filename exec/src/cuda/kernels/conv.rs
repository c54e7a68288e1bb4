//! Convolutions through cuDNN (`crate::cuda::dnn`: algorithms autotuned once per
//! shape): Conv2D, Conv2DBackpropInput and Conv2DBackpropFilter in NHWC and NCHW.
//!
//! Two things cuDNN does not take as the graph has them, bridged here:
//! - the filter is HWIO (TensorFlow's); cuDNN wants KRSC with NHWC tensors and KCRS
//!   with NCHW: the filter is gathered into that order (and a filter gradient back),
//!   small next to the images;
//! - SAME padding is asymmetric when the padding a window needs is odd (TensorFlow pads
//!   the extra row or column at the end); cuDNN pads both sides alike, so the input
//!   gets the extra zeros at its end (`Spec::PadEnd`) and cuDNN the symmetric part (a
//!   data gradient is computed for the extended input and cropped).

use ampgraph_graph::ops::{Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, Padding};
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
        /// `k(const E* px, E* py, i64 n, Dims in, Dims out)`: `y` (4-D, `out`) holds `x`
        /// (4-D, `in`, no dimension larger) at its start and zeros past it.
        PadEnd { bytes: usize } => pad_end(bytes),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(conv) = op.downcast_ref::<Conv2D>() {
        let (x, w) = (ins.first()?, ins.get(1)?);
        let attrs = (conv.strides, conv.padding, conv.data_format);
        return Some(lower_conv(
            Direction::Forward,
            attrs,
            &x.shape,
            &w.shape,
            ins,
            outs,
        ));
    }
    if let Some(b) = op.downcast_ref::<Conv2DBackpropInput>() {
        let w = ins.first()?;
        let attrs = (b.strides, b.padding, b.data_format);
        let dir = Direction::BackwardData;
        return Some(lower_conv(dir, attrs, &b.input_shape, &w.shape, ins, outs));
    }
    if let Some(b) = op.downcast_ref::<Conv2DBackpropFilter>() {
        let x = ins.first()?;
        let attrs = (b.strides, b.padding, b.data_format);
        let dir = Direction::BackwardFilter;
        return Some(lower_conv(dir, attrs, &x.shape, &b.filter_shape, ins, outs));
    }
    None
}

/// One spatial axis: the output length, the symmetric padding cuDNN applies and the
/// zeros added at the input's end for the rest.
#[derive(Clone, Copy, Debug)]
struct AxisPad {
    out: usize,
    pad: usize,
    extra: usize,
}

fn axis_pad(padding: Padding, len: usize, window: usize, stride: usize) -> Result<AxisPad, String> {
    let (out, before) = padding.output_len(len, window, stride)?;
    let covered = (out.saturating_sub(1)) * stride + window;
    let after = (covered.saturating_sub(len)).saturating_sub(before);
    Ok(AxisPad {
        out,
        pad: before,
        extra: after.saturating_sub(before),
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
    (strides, padding, layout): ([usize; 2], Padding, DataFormat),
    x_shape: &[usize],
    w_shape: &[usize],
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    dnn::available()?;
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
    if wc != c {
        return Err(format!(
            "the filter takes {wc} channels but the image has {c}"
        ));
    }
    let rows = axis_pad(padding, h, r, strides[0])?;
    let cols = axis_pad(padding, w, s, strides[1])?;
    let padded = [n, c, h + rows.extra, w + cols.extra];
    let shape = ConvShape {
        dtype,
        layout,
        input: padded,
        filter: [k, r, s],
        pad: [rows.pad, cols.pad],
        strides,
        out: [rows.out, cols.out],
        allow_tf32: false,
    };
    let esize = dtype.size_bytes();
    // The input as the graph has it and extended with the asymmetric padding's zeros.
    let x_ty = in_layout(layout, [n, c, h, w]);
    let x_padded = in_layout(layout, padded);
    let extended = (padded != [n, c, h, w]).then(|| Extension {
        spec: Spec::PadEnd { bytes: esize },
        from: x_ty.clone(),
        to: x_padded.clone(),
    });
    let crop = match &extended {
        Some(_) => Some(Gather::new(
            esize,
            &x_ty,
            &ampgraph_graph::tensor::strides(&x_padded),
            0,
        )?),
        None => None,
    };
    // HWIO <-> the layout's filter order.
    let (cudnn_filter, to_cudnn, from_cudnn) = filter_orders(layout, [r, s, c, k]);
    let to_cudnn = Gather::new(esize, &cudnn_filter, &to_cudnn, 0)?;
    let from_cudnn = Gather::new(esize, w_shape, &from_cudnn, 0)?;
    let filter_len = r * s * c * k;
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
                ConvOperands { x, w, y },
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

/// The input extended at its end with zeros (the asymmetric part of SAME padding).
struct Extension {
    spec: Spec,
    from: Vec<usize>,
    to: Vec<usize>,
}

impl Extension {
    fn launch(&self, c: &Ctx, x: &DTensor) -> Result<DTensor, String> {
        let y = c.temp(x.dtype, self.to.iter().product())?;
        let n = y.len();
        let args = [
            x.arg(),
            y.arg(),
            Arg::I64(n as i64),
            Arg::Dims(Dims::new(&self.from)?),
            Arg::Dims(Dims::new(&self.to)?),
        ];
        c.launch_n(&self.spec, n, &args)?;
        Ok(y)
    }
}

pub(super) fn pad_end(bytes: usize) -> String {
    format!(
        "{PRELUDE}typedef {} E;\n\
         extern \"C\" __global__ void k(const E* px, E* py, i64 n, Dims in, Dims out) {{\n\
           GRID_LOOP(i, n) {{\n\
             i64 rest = i, src = 0, step = 1, inside = 1;\n\
             for (int d = 3; d >= 0; --d) {{\n\
               i64 at = rest % out.n[d]; rest /= out.n[d];\n\
               inside &= at < in.n[d];\n\
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

    #[test]
    fn same_padding_splits_into_symmetric_and_extra() {
        // TensorFlow pads 0 before and 1 after: cuDNN pads 0, one zero row is added.
        let a = axis_pad(Padding::Same, 64, 3, 2).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (32, 0, 1));
        // Odd input: 1 before and 1 after.
        let a = axis_pad(Padding::Same, 65, 3, 2).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (33, 1, 0));
        let a = axis_pad(Padding::Same, 7, 3, 1).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (7, 1, 0));
        // A 4-wide window at stride 1 needs 3: 1 before, 2 after.
        let a = axis_pad(Padding::Same, 9, 4, 1).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (9, 1, 1));
        // VALID never pads, even where the windows leave the end unread.
        let a = axis_pad(Padding::Valid, 8, 3, 2).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (3, 0, 0));
        // A 1x1 window at stride 2: no padding.
        let a = axis_pad(Padding::Same, 4, 1, 2).unwrap();
        assert_eq!((a.out, a.pad, a.extra), (2, 0, 0));
    }

    /// Gathers with the given strides, on the host, as the gather kernel does.
    fn gather(x: &[usize], shape: &[usize], st: &[usize]) -> Vec<usize> {
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
