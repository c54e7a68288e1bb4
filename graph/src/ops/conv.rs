//! Convolution and pooling over 2-D images (NHWC or NCHW), TensorFlow's semantics.
//!
//! Conv2D lowers to im2col + one `gemm` per block of output positions, in the kernel's
//! compute type; the filter is HWIO (`[kh, kw, cin, cout]`), whose row-major layout is
//! already the `[kh*kw*cin, cout]` matrix the product needs. A grouped convolution
//! (`groups` > 1, the filter `[kh, kw, cin / groups, cout]`) runs one such product per
//! group: its channels' im2col and its columns of the filter.

use rayon::prelude::*;

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::linalg::{gemm_into, MatView};
use crate::ops::types_of;
use crate::ops::{DataFormat, Padding};
use crate::tensor::{checked_numel, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "Conv2D",
        parse: |_, a| Ok(Box::new(read_conv(a)?)),
    },
    OpEntry {
        name: "MaxPool",
        parse: |_, a| {
            let (ksize, strides, padding, data_format) = read_pool_attrs(a)?;
            Ok(Box::new(MaxPool {
                ksize,
                strides,
                padding,
                data_format,
            }))
        },
    },
    OpEntry {
        name: "AvgPool",
        parse: |_, a| {
            let (ksize, strides, padding, data_format) = read_pool_attrs(a)?;
            Ok(Box::new(AvgPool {
                ksize,
                strides,
                padding,
                data_format,
            }))
        },
    },
    OpEntry {
        name: "Conv2DBackpropInput",
        parse: |_, a| {
            let conv = read_conv(a)?;
            Ok(Box::new(Conv2DBackpropInput {
                input_shape: a.shape("input_shape")?,
                conv,
            }))
        },
    },
    OpEntry {
        name: "Conv2DBackpropFilter",
        parse: |_, a| {
            let conv = read_conv(a)?;
            Ok(Box::new(Conv2DBackpropFilter {
                filter_shape: a.shape("filter_shape")?,
                conv,
            }))
        },
    },
    OpEntry {
        name: "MaxPoolGrad",
        parse: |_, a| {
            let (ksize, strides, padding, data_format) = read_pool_attrs(a)?;
            Ok(Box::new(MaxPoolGrad {
                ksize,
                strides,
                padding,
                data_format,
            }))
        },
    },
    OpEntry {
        name: "AvgPoolGrad",
        parse: |_, a| {
            let input_shape = a.shape("input_shape")?;
            let (ksize, strides, padding, data_format) = read_pool_attrs(a)?;
            Ok(Box::new(AvgPoolGrad {
                input_shape,
                ksize,
                strides,
                padding,
                data_format,
            }))
        },
    },
];

/// The attrs the three convolution ops share, as the forward op.
fn read_conv(a: &mut AttrReader) -> OpResult<Conv2D> {
    let strides = a.pair("strides", Some([1, 1]))?;
    let data_format = DataFormat::read(a)?;
    let padding = Padding::read(a, data_format)?;
    let groups = match a.opt_int(GROUPS)? {
        None => 1,
        Some(g) => usize::try_from(g)
            .ok()
            .filter(|&g| g > 0)
            .ok_or_else(|| format!("attr '{GROUPS}' must be a positive integer, got {g}"))?,
    };
    let dilations = a.pair(DILATIONS, Some([1, 1]))?;
    Ok(Conv2D::new(strides, padding, data_format)
        .with_groups(groups)
        .with_dilations(dilations))
}

/// The convolutions' attr of their group count, written only when not 1.
const GROUPS: &str = "groups";

/// The convolutions' attr of their dilations, written only when not `[1, 1]`.
const DILATIONS: &str = "dilations";

type PoolAttrs = ([usize; 2], [usize; 2], Padding, DataFormat);

fn read_pool_attrs(a: &mut AttrReader) -> OpResult<PoolAttrs> {
    let ksize = a.pair("ksize", None)?;
    let strides = a.pair("strides", None)?;
    let data_format = DataFormat::read(a)?;
    Ok((ksize, strides, Padding::read(a, data_format)?, data_format))
}

/// im2col buffers hold at most about this many elements; larger batches are split.
const COLS_BUDGET: usize = 1 << 23;

fn pair_attr(v: [usize; 2]) -> AttrValue {
    AttrValue::Ints(v.iter().map(|&d| d as i64).collect())
}

fn check_pair(what: &str, v: [usize; 2]) -> OpResult<()> {
    if v.iter().all(|&d| d > 0) {
        Ok(())
    } else {
        Err(format!("{what} must be two positive integers, got {v:?}"))
    }
}

/// An image tensor's dimensions and element strides, whatever its layout.
#[derive(Clone, Copy, Debug)]
struct Image {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    /// Strides of (image, channel, row, column).
    sn: usize,
    sc: usize,
    sy: usize,
    sx: usize,
}

impl Image {
    fn new(format: DataFormat, n: usize, c: usize, h: usize, w: usize) -> Image {
        match format {
            DataFormat::Nhwc => Image {
                n,
                c,
                h,
                w,
                sn: h * w * c,
                sc: 1,
                sy: w * c,
                sx: c,
            },
            DataFormat::Nchw => Image {
                n,
                c,
                h,
                w,
                sn: c * h * w,
                sc: h * w,
                sy: w,
                sx: 1,
            },
        }
    }

    fn from_shape(format: DataFormat, what: &str, shape: &[usize]) -> OpResult<Image> {
        let &[d0, d1, d2, d3] = shape else {
            return Err(format!(
                "{what} must have rank 4 ({}), got {}",
                format.as_str(),
                ShapeDisplay(shape)
            ));
        };
        Ok(match format {
            DataFormat::Nhwc => Image::new(format, d0, d3, d1, d2),
            DataFormat::Nchw => Image::new(format, d0, d1, d2, d3),
        })
    }

    fn shape(&self, format: DataFormat) -> Vec<usize> {
        match format {
            DataFormat::Nhwc => vec![self.n, self.h, self.w, self.c],
            DataFormat::Nchw => vec![self.n, self.c, self.h, self.w],
        }
    }

    fn per_image(&self) -> usize {
        self.c * self.h * self.w
    }
}

/// The input elements a window of `taps` taps, `dilation` elements apart, spans: what
/// padding and the output length count (every convolution path reads it from here).
pub fn dilated_span(taps: usize, dilation: usize) -> usize {
    (taps.max(1) - 1) * dilation + 1
}

/// Where the windows of one spatial axis go: output length and padding before.
#[derive(Clone, Copy, Debug)]
struct Axis {
    out: usize,
    pad: usize,
    /// Taps of the window.
    window: usize,
    stride: usize,
    /// Input elements between consecutive taps (1: a dense window).
    dilation: usize,
    len: usize,
}

impl Axis {
    /// Spatial axis `axis` (0 height, 1 width) of a windowed op with a dense window.
    fn new(
        padding: Padding,
        axis: usize,
        len: usize,
        window: usize,
        stride: usize,
    ) -> OpResult<Axis> {
        Axis::dilated(padding, axis, len, window, stride, 1)
    }

    /// As [`new`](Self::new), the window's taps `dilation` elements apart: it spans
    /// `(window - 1) * dilation + 1` elements, which is what padding and the output
    /// length count.
    fn dilated(
        padding: Padding,
        axis: usize,
        len: usize,
        window: usize,
        stride: usize,
        dilation: usize,
    ) -> OpResult<Axis> {
        // Window arithmetic runs in isize; sizes this large are mistakes, not images.
        const MAX: usize = 1 << 40;
        if [len, window, stride, dilation].iter().any(|&v| v > MAX) {
            return Err(format!(
                "length {len}, window {window}, stride {stride} or dilation {dilation} \
                 exceeds 2^40"
            ));
        }
        let p = padding.output_len(axis, len, dilated_span(window, dilation), stride)?;
        if p.before > MAX || p.after > MAX {
            return Err(format!("padding {} + {} exceeds 2^40", p.before, p.after));
        }
        Ok(Axis {
            out: p.out,
            pad: p.before,
            window,
            stride,
            dilation,
            len,
        })
    }

    /// The in-bounds input range of output position `o`'s dense window, and the
    /// window offset of its first element.
    fn range(&self, o: usize) -> (usize, usize, usize) {
        debug_assert_eq!(self.dilation, 1, "pooling windows are dense");
        let start = (o * self.stride) as isize - self.pad as isize;
        let lo = start.max(0) as usize;
        let hi = (start + self.window as isize).clamp(0, self.len as isize) as usize;
        (lo, hi.max(lo), (lo as isize - start) as usize)
    }

    /// The taps of output position `o`'s window that fall inside the input: (tap,
    /// input index) pairs, in order.
    fn taps(&self, o: usize) -> impl Iterator<Item = (usize, usize)> {
        let (start, d) = (
            (o * self.stride) as isize - self.pad as isize,
            self.dilation,
        );
        // The first tap at or after index 0 and the first at or after the end.
        let first = |at: isize| ((at - start).max(0) as usize).div_ceil(d);
        let (lo, hi) = (first(0), first(self.len as isize).min(self.window));
        (lo..hi.max(lo)).map(move |k| (k, (start + (k * d) as isize) as usize))
    }
}

/// 2-D convolution (cross-correlation, as TensorFlow) of `x` with an HWIO filter.
///
/// With `groups` > 1 (TensorFlow's, PyTorch's and ONNX's grouped convolution; depthwise
/// when it equals the input channels) the input channels and the output channels are
/// split into `groups` runs of consecutive channels, and output run `g` convolves
/// input run `g` alone: the filter is `[kh, kw, in_channels / groups, out_channels]`,
/// both channel counts divisible by `groups`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conv2D {
    pub strides: [usize; 2],
    pub padding: Padding,
    pub data_format: DataFormat,
    pub groups: usize,
    /// Input rows and columns between the filter's taps (`[1, 1]`: a dense window;
    /// atrous convolutions, as DeepLab's, dilate).
    pub dilations: [usize; 2],
}

/// The shape facts of one convolution.
struct ConvDims {
    x: Image,
    y: Image,
    rows: Axis,
    cols: Axis,
    kh: usize,
    kw: usize,
    groups: usize,
}

impl Conv2D {
    /// An ungrouped convolution (`groups` 1).
    pub fn new(strides: [usize; 2], padding: Padding, data_format: DataFormat) -> Self {
        Conv2D {
            strides,
            padding,
            data_format,
            groups: 1,
            dilations: [1, 1],
        }
    }

    /// This convolution with its channels in `groups` groups.
    pub fn with_groups(self, groups: usize) -> Self {
        Conv2D { groups, ..self }
    }

    /// This convolution with its filter's taps `dilations` apart.
    pub fn with_dilations(self, dilations: [usize; 2]) -> Self {
        Conv2D { dilations, ..self }
    }

    fn dims(&self, x: &[usize], filter: &[usize]) -> OpResult<ConvDims> {
        self.dims_of("x", x, filter)
    }

    /// As [`dims`](Self::dims), naming the input tensor `what` in errors.
    fn dims_of(&self, what: &str, x: &[usize], filter: &[usize]) -> OpResult<ConvDims> {
        check_pair("strides", self.strides)?;
        check_pair(DILATIONS, self.dilations)?;
        for (name, shape) in [(what, x), ("the filter", filter)] {
            if checked_numel(shape).is_none() {
                return Err(format!(
                    "{name} {} has more elements than can be addressed",
                    ShapeDisplay(shape)
                ));
            }
        }
        let xi = Image::from_shape(self.data_format, what, x)?;
        let &[kh, kw, cin, cout] = filter else {
            return Err(format!(
                "filter must have rank 4 (HWIO: [height, width, in_channels, out_channels]), got {}",
                ShapeDisplay(filter)
            ));
        };
        let groups = self.groups;
        if groups == 0 {
            return Err("groups must be positive, got 0".into());
        }
        let x_desc = || format!("{what} {} ({})", ShapeDisplay(x), self.data_format.as_str());
        if xi.c % groups != 0 {
            return Err(format!(
                "{} has {} channels, not divisible by groups {groups}",
                x_desc(),
                xi.c
            ));
        }
        if cout % groups != 0 {
            return Err(format!(
                "the filter {} has {cout} output channels, not divisible by groups {groups}",
                ShapeDisplay(filter)
            ));
        }
        if groups == 1 && cin != xi.c {
            return Err(format!(
                "{} has {} channels but the filter {} expects {cin} input channels",
                x_desc(),
                xi.c,
                ShapeDisplay(filter)
            ));
        }
        if cin != xi.c / groups {
            return Err(format!(
                "{} has {} channels, {} per group of {groups}, but the filter {} expects \
                 {cin} input channels per group",
                x_desc(),
                xi.c,
                xi.c / groups,
                ShapeDisplay(filter)
            ));
        }
        if kh == 0 || kw == 0 {
            return Err(format!(
                "filter {} has an empty window",
                ShapeDisplay(filter)
            ));
        }
        let axis = |axis, len, window| {
            let (stride, dilation) = (self.strides[axis], self.dilations[axis]);
            Axis::dilated(self.padding, axis, len, window, stride, dilation)
        };
        let rows = axis(0, xi.h, kh).map_err(|e| format!("height: {e}"))?;
        let cols = axis(1, xi.w, kw).map_err(|e| format!("width: {e}"))?;
        if checked_numel(&[xi.n, cout, rows.out, cols.out]).is_none() {
            return Err("the output shape overflows".into());
        }
        let y = Image::new(self.data_format, xi.n, cout, rows.out, cols.out);
        Ok(ConvDims {
            x: xi,
            y,
            rows,
            cols,
            kh,
            kw,
            groups,
        })
    }
}

/// Fills `cols` (one row of R = kh*kw*cg values per output position, from output
/// position `first` counted over the whole batch in (image, oy, ox) order) with the
/// input patches of group `group`'s cg channels, zeros where the window leaves the
/// image.
fn im2col<T: Real>(d: &ConvDims, x: &[T], first: usize, group: usize, cols: &mut [T]) {
    let (r, cg) = (d.patch(), d.in_group());
    let per_image = d.positions();
    cols.par_chunks_mut(r).enumerate().for_each(|(p, row)| {
        let img = (first + p) / per_image;
        let q = (first + p) % per_image;
        let (oy, ox) = (q / d.cols.out, q % d.cols.out);
        row.iter_mut().for_each(|v| *v = T::zero());
        let base = img * d.x.sn + group * cg * d.x.sc;
        for (ky, iy) in d.rows.taps(oy) {
            for (kx, ix) in d.cols.taps(ox) {
                let src = base + iy * d.x.sy + ix * d.x.sx;
                let dst = &mut row[(ky * d.kw + kx) * cg..][..cg];
                if d.x.sc == 1 {
                    dst.copy_from_slice(&x[src..src + cg]);
                } else {
                    for (ci, v) in dst.iter_mut().enumerate() {
                        *v = x[src + ci * d.x.sc];
                    }
                }
            }
        }
    });
}

/// `dst` (rows of `cout`) gets `lhs [m, k] x rhs [k, kg]` in its columns of group
/// `group` (`group * kg..`): written directly when the group is every column, else
/// through `tmp`, since the product writes dense rows.
fn gemm_group_cols<T: Real>(
    dst: &mut [T],
    (cout, kg, group): (usize, usize, usize),
    k: usize,
    lhs: MatView<'_, T>,
    rhs: MatView<'_, T>,
    tmp: &mut Vec<T>,
) -> OpResult<()> {
    let m = dst.len() / cout;
    if kg == cout {
        return gemm_into(m, cout, k, dst, lhs, rhs, true);
    }
    tmp.resize(m * kg, T::zero());
    gemm_into(m, kg, k, tmp, lhs, rhs, true)?;
    dst.par_chunks_mut(cout)
        .zip(tmp.par_chunks(kg))
        .for_each(|(row, vals)| row[group * kg..][..kg].copy_from_slice(vals));
    Ok(())
}

impl FloatKernel for Conv2D {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, filter] = fixed(inputs)?;
        let d = self.dims(x.shape(), filter.shape())?;
        let shape = d.y.shape(self.data_format);
        let total = checked_numel(&shape).ok_or("the output shape overflows")?;
        let mut out = vec![T::zero(); total];
        let r = d.patch();
        let (cout, kg) = (d.y.c, d.out_group());
        let per_image = d.positions();
        if total == 0 || r == 0 {
            return Ok(vec![(shape, out)]);
        }
        let (xv, fv) = (T::read(x), T::read(filter));
        // Group g's [R, kg] columns of the row-major [R, cout] filter.
        let filter_mat = |g: usize| MatView {
            data: &fv[g * kg..],
            rs: cout,
            cs: 1,
        };
        let mut tmp = Vec::new();
        // A 1x1 window at stride 1 without padding: each output pixel is its input's.
        let pointwise = d.kh == 1
            && d.kw == 1
            && self.strides == [1, 1]
            && (d.rows.out, d.cols.out) == (d.x.h, d.x.w);
        match self.data_format {
            DataFormat::Nhwc if pointwise => {
                // A 1x1 convolution of an NHWC batch is one product per group with the
                // pixels' channels of the group (r of them).
                for g in 0..d.groups {
                    let lhs = MatView {
                        data: &xv[g * r..],
                        rs: d.x.c,
                        cs: 1,
                    };
                    gemm_group_cols(&mut out, (cout, kg, g), r, lhs, filter_mat(g), &mut tmp)?;
                }
            }
            DataFormat::Nhwc => {
                // Output rows (image, oy, ox) are contiguous: each block of rows is
                // one product [rows, R] x [R, kg] per group.
                let block = (COLS_BUDGET / r).clamp(1, d.x.n * per_image);
                let mut cols = vec![T::zero(); block * r];
                for (bi, dst) in out.chunks_mut(block * cout).enumerate() {
                    let m = dst.len() / cout;
                    let cols = &mut cols[..m * r];
                    for g in 0..d.groups {
                        im2col(&d, &xv, bi * block, g, cols);
                        let lhs = MatView::dense(cols, r, false);
                        let at = (cout, kg, g);
                        gemm_group_cols(dst, at, r, lhs, filter_mat(g), &mut tmp)?;
                    }
                }
            }
            DataFormat::Nchw if per_image.saturating_mul(r) <= COLS_BUDGET => {
                // Per image and group: the group's channel planes [kg, P] =
                // filter_g^T [kg, R] x cols^T [R, P].
                let mut cols = vec![T::zero(); per_image * r];
                for (img, planes) in out.chunks_mut(cout * per_image).enumerate() {
                    for (g, dst) in planes.chunks_mut(kg * per_image).enumerate() {
                        im2col(&d, &xv, img * per_image, g, &mut cols);
                        let lhs = MatView {
                            data: &fv[g * kg..],
                            rs: 1,
                            cs: cout,
                        };
                        let rhs = MatView {
                            data: &cols,
                            rs: 1,
                            cs: r,
                        };
                        gemm_into(kg, per_image, r, dst, lhs, rhs, true)?;
                    }
                }
            }
            DataFormat::Nchw => {
                // Images too large for one im2col buffer: blocks of output positions
                // as for NHWC, scattered into the group's channel planes.
                let rows = d.x.n * per_image;
                let block = (COLS_BUDGET / r).clamp(1, rows);
                let mut cols = vec![T::zero(); block * r];
                tmp.resize(block * kg, T::zero());
                for first in (0..rows).step_by(block) {
                    let m = block.min(rows - first);
                    let (cols, tmp) = (&mut cols[..m * r], &mut tmp[..m * kg]);
                    for g in 0..d.groups {
                        im2col(&d, &xv, first, g, cols);
                        let lhs = MatView::dense(cols, r, false);
                        gemm_into(m, kg, r, tmp, lhs, filter_mat(g), true)?;
                        for (p, vals) in (first..).zip(tmp.chunks(kg)) {
                            let (img, q) = (p / per_image, p % per_image);
                            let at = (img * cout + g * kg) * per_image;
                            let planes = &mut out[at..][..kg * per_image];
                            for (co, &v) in vals.iter().enumerate() {
                                planes[co * per_image + q] = v;
                            }
                        }
                    }
                }
            }
        }
        Ok(vec![(shape, out)])
    }
}

impl Op for Conv2D {
    fn name(&self) -> &'static str {
        "Conv2D"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("strides", pair_attr(self.strides))];
        a.extend(self.padding.attrs(self.data_format));
        a.push(("data_format", self.data_format.into()));
        // Absent when 1: dense, ungrouped convolutions write what they wrote before
        // groups and dilations.
        if self.groups != 1 {
            a.push((GROUPS, AttrValue::Int(self.groups as i64)));
        }
        if self.dilations != [1, 1] {
            a.push((DILATIONS, pair_attr(self.dilations)));
        }
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, filter] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        let d = self.dims(&x.shape, &filter.shape)?;
        Ok(vec![TensorType::new(dtype, d.y.shape(self.data_format))])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, filter] = fixed(inputs)?;
        if x.dtype() != filter.dtype() {
            return Err(format!(
                "x is {} but the filter is {}",
                x.dtype(),
                filter.dtype()
            ));
        }
        eval_float(self, x.dtype(), inputs)
    }
    /// `dx = Conv2DBackpropInput(filter, dy)`, `dfilter = Conv2DBackpropFilter(x, dy)`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (&[x, filter], Some(&Some(dy))) = (inputs, grads.first()) else {
            return Ok(vec![None; inputs.len()]);
        };
        let dx = Conv2DBackpropInput {
            input_shape: b.ty(x).shape.clone(),
            conv: self.clone(),
        };
        let dfilter = Conv2DBackpropFilter {
            filter_shape: b.ty(filter).shape.clone(),
            conv: self.clone(),
        };
        Ok(vec![
            Some(b.add(dx, &[filter, dy])?),
            Some(b.add(dfilter, &[x, dy])?),
        ])
    }
}

impl ConvDims {
    /// Output positions per image.
    fn positions(&self) -> usize {
        self.rows.out * self.cols.out
    }

    /// Input channels per group (the filter's I).
    fn in_group(&self) -> usize {
        self.x.c / self.groups
    }

    /// Output channels per group.
    fn out_group(&self) -> usize {
        self.y.c / self.groups
    }

    /// Elements of one im2col row (one group's patch): kh * kw * cin / groups.
    fn patch(&self) -> usize {
        self.kh * self.kw * self.in_group()
    }

    /// Runs of at most `block` output positions (counted over the batch in (image, oy,
    /// ox) order) whose dy rows form one strided `[m, cout]` matrix: any run in NHWC,
    /// runs inside one image in NCHW (unless cout = 1). Yields (first position, length).
    fn position_blocks(&self, block: usize) -> Vec<(usize, usize)> {
        let per_image = self.positions();
        let total = self.x.n * per_image;
        let block = block.max(1);
        if self.y.sn == per_image * self.y.sx {
            // Consecutive positions are one stride apart across images too.
            (0..total)
                .step_by(block)
                .map(|f| (f, block.min(total - f)))
                .collect()
        } else {
            (0..self.x.n)
                .flat_map(|img| {
                    (0..per_image)
                        .step_by(block)
                        .map(move |q| (img * per_image + q, block.min(per_image - q)))
                })
                .collect()
        }
    }

    /// dy's rows for output positions `first..first + m` as a `[m, cout]` matrix, from
    /// channel `channel` on (a group's first).
    fn dy_rows<'a, T>(&self, dy: &'a [T], first: usize, channel: usize) -> MatView<'a, T> {
        let per_image = self.positions().max(1);
        let (img, q) = (first / per_image, first % per_image);
        let at = img * self.y.sn + q * self.y.sx + channel * self.y.sc;
        MatView {
            data: dy.get(at..).unwrap_or(&[]),
            rs: self.y.sx,
            cs: self.y.sc,
        }
    }
}

/// The inverse of [`im2col`]: adds each row of `cols` (output positions from `first`,
/// counted over the batch) into the input positions (of group `group`'s channels) its
/// patch was read from.
fn col2im<T: Real>(d: &ConvDims, cols: &[T], first: usize, group: usize, dx: &mut [T]) {
    let (r, cg) = (d.patch(), d.in_group());
    let per_image = d.positions();
    for (p, row) in cols.chunks(r).enumerate() {
        let img = (first + p) / per_image;
        let q = (first + p) % per_image;
        let (oy, ox) = (q / d.cols.out, q % d.cols.out);
        let base = img * d.x.sn + group * cg * d.x.sc;
        for (ky, iy) in d.rows.taps(oy) {
            for (kx, ix) in d.cols.taps(ox) {
                let dst = base + iy * d.x.sy + ix * d.x.sx;
                let src = &row[(ky * d.kw + kx) * cg..][..cg];
                for (ci, &v) in src.iter().enumerate() {
                    let t = &mut dx[dst + ci * d.x.sc];
                    *t = *t + v;
                }
            }
        }
    }
}

/// The conv facts shared by the two backprop ops: a Conv2D of `x` (shape `x`) and
/// `filter`, whose output gradient `dy` must have the convolution's output shape.
fn backprop_dims(
    conv: &Conv2D,
    what: &str,
    x: &[usize],
    filter: &[usize],
    dy: &[usize],
) -> OpResult<ConvDims> {
    let d = conv.dims_of(what, x, filter)?;
    let want = d.y.shape(conv.data_format);
    if dy != want.as_slice() {
        return Err(format!(
            "dy has shape {} but the convolution of {what} {} ({}) with filter {} gives {}",
            ShapeDisplay(dy),
            ShapeDisplay(x),
            conv.data_format.as_str(),
            ShapeDisplay(filter),
            ShapeDisplay(&want)
        ));
    }
    Ok(d)
}

/// Requires two inputs of one float dtype.
fn float_pair(inputs: &[&TensorType], what: [&str; 2]) -> OpResult<DType> {
    let [a, b] = fixed(inputs)?;
    require_float(what[0], a.dtype)?;
    if a.dtype != b.dtype {
        return Err(format!(
            "{} is {} but {} is {}",
            what[0], a.dtype, what[1], b.dtype
        ));
    }
    Ok(a.dtype)
}

fn conv_attrs(
    shape_key: &'static str,
    shape: &[usize],
    conv: &Conv2D,
) -> Vec<(&'static str, AttrValue)> {
    let mut a = vec![(shape_key, AttrValue::from(shape))];
    a.extend(conv.attrs());
    a
}

/// The gradient of [`Conv2D`] with respect to its input, TensorFlow's
/// `Conv2DBackpropInput` (the input's shape an attr rather than a tensor): inputs
/// `filter` (HWIO) and `dy` (the convolution's output shape); output `dx` of shape
/// `input_shape`. Computed as `dy x filter^T` (one gemm per block of output
/// positions and group) scattered back through col2im.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conv2DBackpropInput {
    pub input_shape: Vec<usize>,
    /// The convolution whose input gradient this is.
    pub conv: Conv2D,
}

impl FloatKernel for Conv2DBackpropInput {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [filter, dy] = fixed(inputs)?;
        let shape = self.input_shape.clone();
        let d = backprop_dims(
            &self.conv,
            "input_shape",
            &shape,
            filter.shape(),
            dy.shape(),
        )?;
        let total = checked_numel(&shape).ok_or("input_shape overflows")?;
        let mut dx = vec![T::zero(); total];
        let (r, cout, kg) = (d.patch(), d.y.c, d.out_group());
        if total == 0 || r == 0 || cout == 0 || d.positions() == 0 {
            return Ok(vec![(shape, dx)]);
        }
        let (fv, dyv) = (T::read(filter), T::read(dy));
        let block = (COLS_BUDGET / r).clamp(1, d.x.n * d.positions());
        let mut cols = vec![T::zero(); block * r];
        for (first, m) in d.position_blocks(block) {
            let cols = &mut cols[..m * r];
            for g in 0..d.groups {
                // filter_g^T [kg, R], read from group g's columns of the row-major
                // [R, cout] filter.
                let filter_t = MatView {
                    data: &fv[g * kg..],
                    rs: 1,
                    cs: cout,
                };
                let dy_g = d.dy_rows(&dyv, first, g * kg);
                gemm_into(m, r, kg, cols, dy_g, filter_t, true)?;
                col2im(&d, cols, first, g, &mut dx);
            }
        }
        Ok(vec![(shape, dx)])
    }
}

impl Op for Conv2DBackpropInput {
    fn name(&self) -> &'static str {
        "Conv2DBackpropInput"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        conv_attrs("input_shape", &self.input_shape, &self.conv)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let dtype = float_pair(inputs, ["the filter", "dy"])?;
        let [filter, dy] = fixed(inputs)?;
        backprop_dims(
            &self.conv,
            "input_shape",
            &self.input_shape,
            &filter.shape,
            &dy.shape,
        )?;
        Ok(vec![TensorType::new(dtype, self.input_shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        let dtype = float_pair(&types.iter().collect::<Vec<_>>(), ["the filter", "dy"])?;
        eval_float(self, dtype, inputs)
    }
}

/// The gradient of [`Conv2D`] with respect to its filter, TensorFlow's
/// `Conv2DBackpropFilter` (the filter's shape an attr): inputs `x` and `dy`; output
/// `dfilter` of shape `filter_shape` (HWIO). Computed as `im2col(x)^T x dy`, one gemm
/// per block of output positions and group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conv2DBackpropFilter {
    pub filter_shape: Vec<usize>,
    /// The convolution whose filter gradient this is.
    pub conv: Conv2D,
}

impl FloatKernel for Conv2DBackpropFilter {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, dy] = fixed(inputs)?;
        let shape = self.filter_shape.clone();
        let d = backprop_dims(&self.conv, "x", x.shape(), &shape, dy.shape())?;
        let (r, cout, kg) = (d.patch(), d.y.c, d.out_group());
        let mut dfilter = vec![T::zero(); r * cout];
        if dfilter.is_empty() || d.x.n * d.positions() == 0 {
            return Ok(vec![(shape, dfilter)]);
        }
        let (xv, dyv) = (T::read(x), T::read(dy));
        let block = (COLS_BUDGET / r).clamp(1, d.x.n * d.positions());
        let mut cols = vec![T::zero(); block * r];
        let mut part = vec![T::zero(); r * kg];
        for (first, m) in d.position_blocks(block) {
            let cols = &mut cols[..m * r];
            for g in 0..d.groups {
                im2col(&d, &xv, first, g, cols);
                // cols^T [R, m] x dy rows [m, kg]: group g's columns of the [R, cout]
                // filter gradient.
                let lhs = MatView {
                    data: &cols[..],
                    rs: 1,
                    cs: r,
                };
                let dy_g = d.dy_rows(&dyv, first, g * kg);
                gemm_into(r, kg, m, &mut part, lhs, dy_g, true)?;
                for (row, vals) in dfilter.chunks_mut(cout).zip(part.chunks(kg)) {
                    let row = &mut row[g * kg..][..kg];
                    row.iter_mut().zip(vals).for_each(|(a, &v)| *a = *a + v);
                }
            }
        }
        Ok(vec![(shape, dfilter)])
    }
}

impl Op for Conv2DBackpropFilter {
    fn name(&self) -> &'static str {
        "Conv2DBackpropFilter"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        conv_attrs("filter_shape", &self.filter_shape, &self.conv)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let dtype = float_pair(inputs, ["x", "dy"])?;
        let [x, dy] = fixed(inputs)?;
        backprop_dims(&self.conv, "x", &x.shape, &self.filter_shape, &dy.shape)?;
        Ok(vec![TensorType::new(dtype, self.filter_shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        let dtype = float_pair(&types.iter().collect::<Vec<_>>(), ["x", "dy"])?;
        eval_float(self, dtype, inputs)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PoolKind {
    Max,
    Avg,
}

/// The pooling ops' shared attributes and kernel.
#[derive(Clone, Copy, Debug)]
struct Pool {
    kind: PoolKind,
    ksize: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    data_format: DataFormat,
}

impl Pool {
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![
            ("ksize", pair_attr(self.ksize)),
            ("strides", pair_attr(self.strides)),
        ];
        a.extend(self.padding.attrs(self.data_format));
        a.push(("data_format", self.data_format.into()));
        a
    }

    fn dims(&self, x: &[usize]) -> OpResult<(Image, Image, Axis, Axis)> {
        check_pair("ksize", self.ksize)?;
        check_pair("strides", self.strides)?;
        let xi = Image::from_shape(self.data_format, "x", x)?;
        self.padding.check_pool(self.ksize, [xi.h, xi.w])?;
        let rows = Axis::new(self.padding, 0, xi.h, self.ksize[0], self.strides[0])
            .map_err(|e| format!("height: {e}"))?;
        let cols = Axis::new(self.padding, 1, xi.w, self.ksize[1], self.strides[1])
            .map_err(|e| format!("width: {e}"))?;
        let y = Image::new(self.data_format, xi.n, xi.c, rows.out, cols.out);
        Ok((xi, y, rows, cols))
    }

    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        require_float("x", x.dtype)?;
        let (_, y, _, _) = self.dims(&x.shape)?;
        Ok(vec![TensorType::new(x.dtype, y.shape(self.data_format))])
    }
}

impl FloatKernel for Pool {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        let (xi, yi, rows, cols) = self.dims(x.shape())?;
        let shape = yi.shape(self.data_format);
        let total = checked_numel(&shape).ok_or("the output shape overflows")?;
        let mut out = vec![T::zero(); total];
        if total == 0 {
            return Ok(vec![(shape, out)]);
        }
        let xv = T::read(x);
        let kind = self.kind;
        out.par_chunks_mut(yi.per_image())
            .enumerate()
            .for_each(|(img, dst)| {
                let src = &xv[img * xi.sn..][..xi.per_image()];
                for oy in 0..rows.out {
                    let (y0, y1, _) = rows.range(oy);
                    for ox in 0..cols.out {
                        let (x0, x1, _) = cols.range(ox);
                        for c in 0..xi.c {
                            // Only in-bounds elements take part: padding is ignored.
                            let mut acc = match kind {
                                PoolKind::Max => T::neg_infinity(),
                                PoolKind::Avg => T::zero(),
                            };
                            for iy in y0..y1 {
                                for ix in x0..x1 {
                                    let v = src[c * xi.sc + iy * xi.sy + ix * xi.sx];
                                    acc = match kind {
                                        // NaN propagates, as in TensorFlow.
                                        PoolKind::Max if v.is_nan() || v > acc => v,
                                        PoolKind::Max => acc,
                                        PoolKind::Avg => acc + v,
                                    };
                                }
                            }
                            if kind == PoolKind::Avg {
                                let count = (y1 - y0) * (x1 - x0);
                                if count > 0 {
                                    acc = acc / T::lit(count as f64);
                                }
                            }
                            dst[c * yi.sc + oy * yi.sy + ox * yi.sx] = acc;
                        }
                    }
                }
            });
        Ok(vec![(shape, out)])
    }
}

macro_rules! pool_op {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $kind:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $ty {
            pub ksize: [usize; 2],
            pub strides: [usize; 2],
            pub padding: Padding,
            pub data_format: DataFormat,
        }

        impl $ty {
            pub fn new(
                ksize: [usize; 2],
                strides: [usize; 2],
                padding: Padding,
                data_format: DataFormat,
            ) -> Self {
                $ty {
                    ksize,
                    strides,
                    padding,
                    data_format,
                }
            }

            fn pool(&self) -> Pool {
                Pool {
                    kind: $kind,
                    ksize: self.ksize,
                    strides: self.strides,
                    padding: self.padding,
                    data_format: self.data_format,
                }
            }
        }

        impl Op for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn arity(&self) -> Arity {
                Arity::Exactly(1)
            }
            fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
                self.pool().attrs()
            }
            fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
                self.pool().infer(inputs)
            }
            fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
                let [x] = fixed(inputs)?;
                eval_float(&self.pool(), x.dtype(), inputs)
            }
            fn gradient(
                &self,
                b: &mut GradBuilder,
                inputs: &[Port],
                outputs: &[Port],
                grads: &[Option<Port>],
            ) -> Result<Vec<Option<Port>>, GraphError> {
                let (&[x], &[y], Some(&Some(dy))) = (inputs, outputs, grads.first()) else {
                    return Ok(vec![None; inputs.len()]);
                };
                Ok(vec![Some(self.pool_gradient(b, x, y, dy)?)])
            }
        }
    };
}

pool_op!(
    /// Maximum over each window; with SAME or EXPLICIT padding only in-bounds elements
    /// count.
    MaxPool,
    "MaxPool",
    PoolKind::Max
);
pool_op!(
    /// Mean over each window; with SAME or EXPLICIT padding it divides by the number of
    /// in-bounds elements, as TensorFlow does (ONNX's `count_include_pad` 0).
    AvgPool,
    "AvgPool",
    PoolKind::Avg
);

impl MaxPool {
    /// `dx = MaxPoolGrad(x, y, dy)`.
    fn pool_gradient(
        &self,
        b: &mut GradBuilder,
        x: Port,
        y: Port,
        dy: Port,
    ) -> Result<Port, GraphError> {
        let grad = MaxPoolGrad::new(self.ksize, self.strides, self.padding, self.data_format);
        b.add(grad, &[x, y, dy])
    }
}

impl AvgPool {
    /// `dx = AvgPoolGrad(dy)`.
    fn pool_gradient(
        &self,
        b: &mut GradBuilder,
        x: Port,
        _y: Port,
        dy: Port,
    ) -> Result<Port, GraphError> {
        let grad = AvgPoolGrad {
            input_shape: b.ty(x).shape.clone(),
            ksize: self.ksize,
            strides: self.strides,
            padding: self.padding,
            data_format: self.data_format,
        };
        b.add(grad, &[dy])
    }
}

/// Requires `t` to have the pooled shape `want` and the dtype `dtype`.
fn check_pooled(what: &str, t: &TensorType, dtype: DType, want: &[usize]) -> OpResult<()> {
    if t.dtype != dtype {
        return Err(format!("{what} is {} but must be {dtype}", t.dtype));
    }
    if t.shape != want {
        return Err(format!(
            "{what} has shape {} but the pooling output is {}",
            ShapeDisplay(&t.shape),
            ShapeDisplay(want)
        ));
    }
    Ok(())
}

/// The gradient of [`MaxPool`], TensorFlow's `MaxPoolGrad`: inputs `x`, `y` (the
/// pooling's output) and `dy`; output `dx` (x's type). Each window's gradient goes to
/// the first maximum of the window in row-major order (a NaN counts as the maximum),
/// which the kernel finds again in `x`, as TensorFlow's CPU kernel does; `y` is
/// checked for its type only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaxPoolGrad {
    pub ksize: [usize; 2],
    pub strides: [usize; 2],
    pub padding: Padding,
    pub data_format: DataFormat,
}

impl MaxPoolGrad {
    pub fn new(
        ksize: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        data_format: DataFormat,
    ) -> Self {
        MaxPoolGrad {
            ksize,
            strides,
            padding,
            data_format,
        }
    }

    fn pool(&self) -> Pool {
        Pool {
            kind: PoolKind::Max,
            ksize: self.ksize,
            strides: self.strides,
            padding: self.padding,
            data_format: self.data_format,
        }
    }

    fn check(&self, inputs: &[&TensorType]) -> OpResult<TensorType> {
        let [x, y, dy] = fixed(inputs)?;
        require_float("x", x.dtype)?;
        let (_, yi, _, _) = self.pool().dims(&x.shape)?;
        let want = yi.shape(self.data_format);
        check_pooled("y", y, x.dtype, &want)?;
        check_pooled("dy", dy, x.dtype, &want)?;
        Ok((*x).clone())
    }
}

impl FloatKernel for MaxPoolGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, _y, dy] = fixed(inputs)?;
        let (xi, yi, rows, cols) = self.pool().dims(x.shape())?;
        if dy.shape() != yi.shape(self.data_format) {
            return Err("dy does not have the pooling output's shape".into());
        }
        let shape = x.shape().to_vec();
        let mut dx = vec![T::zero(); x.len()];
        if dx.is_empty() || dy.is_empty() {
            return Ok(vec![(shape, dx)]);
        }
        let (xv, dyv) = (T::read(x), T::read(dy));
        dx.par_chunks_mut(xi.per_image())
            .zip(xv.par_chunks(xi.per_image()))
            .zip(dyv.par_chunks(yi.per_image()))
            .for_each(|((dst, src), grad)| {
                for oy in 0..rows.out {
                    let (y0, y1, _) = rows.range(oy);
                    for ox in 0..cols.out {
                        let (x0, x1, _) = cols.range(ox);
                        for c in 0..xi.c {
                            let mut best: Option<(usize, T)> = None;
                            for iy in y0..y1 {
                                for ix in x0..x1 {
                                    let i = c * xi.sc + iy * xi.sy + ix * xi.sx;
                                    let v = src[i];
                                    let better = match best {
                                        None => true,
                                        Some((_, b)) => !b.is_nan() && (v.is_nan() || v > b),
                                    };
                                    if better {
                                        best = Some((i, v));
                                    }
                                }
                            }
                            if let Some((i, _)) = best {
                                let g = grad[c * yi.sc + oy * yi.sy + ox * yi.sx];
                                dst[i] = dst[i] + g;
                            }
                        }
                    }
                }
            });
        Ok(vec![(shape, dx)])
    }
}

impl Op for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "MaxPoolGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.pool().attrs()
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.check(inputs)?])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        let x = self.check(&types.iter().collect::<Vec<_>>())?;
        eval_float(self, x.dtype, inputs)
    }
}

/// The gradient of [`AvgPool`], TensorFlow's `AvgPoolGrad` (the input's shape an
/// attr): input `dy`; output `dx` of shape `input_shape`. Each window's gradient is
/// spread evenly over its in-bounds elements (the count the forward divided by).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AvgPoolGrad {
    pub input_shape: Vec<usize>,
    pub ksize: [usize; 2],
    pub strides: [usize; 2],
    pub padding: Padding,
    pub data_format: DataFormat,
}

impl AvgPoolGrad {
    fn pool(&self) -> Pool {
        Pool {
            kind: PoolKind::Avg,
            ksize: self.ksize,
            strides: self.strides,
            padding: self.padding,
            data_format: self.data_format,
        }
    }

    fn dims(&self, dy: &[usize]) -> OpResult<(Image, Image, Axis, Axis)> {
        if checked_numel(&self.input_shape).is_none() {
            return Err(format!(
                "input_shape {} has more elements than can be addressed",
                ShapeDisplay(&self.input_shape)
            ));
        }
        let input = self.input_shape.as_slice();
        if input.len() != 4 {
            return Err(format!(
                "input_shape must have rank 4 ({}), got {}",
                self.data_format.as_str(),
                ShapeDisplay(input)
            ));
        }
        let dims = self.pool().dims(input)?;
        let want = dims.1.shape(self.data_format);
        if dy != want.as_slice() {
            return Err(format!(
                "dy has shape {} but pooling input_shape {} gives {}",
                ShapeDisplay(dy),
                ShapeDisplay(input),
                ShapeDisplay(&want)
            ));
        }
        Ok(dims)
    }
}

impl FloatKernel for AvgPoolGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [dy] = fixed(inputs)?;
        let (xi, yi, rows, cols) = self.dims(dy.shape())?;
        let shape = self.input_shape.clone();
        let mut dx = vec![T::zero(); xi.n * xi.per_image()];
        if dx.is_empty() || dy.is_empty() {
            return Ok(vec![(shape, dx)]);
        }
        let dyv = T::read(dy);
        dx.par_chunks_mut(xi.per_image())
            .zip(dyv.par_chunks(yi.per_image()))
            .for_each(|(dst, grad)| {
                for oy in 0..rows.out {
                    let (y0, y1, _) = rows.range(oy);
                    for ox in 0..cols.out {
                        let (x0, x1, _) = cols.range(ox);
                        let count = (y1 - y0) * (x1 - x0);
                        if count == 0 {
                            continue;
                        }
                        let inv = T::one() / T::lit(count as f64);
                        for c in 0..xi.c {
                            let g = grad[c * yi.sc + oy * yi.sy + ox * yi.sx] * inv;
                            for iy in y0..y1 {
                                for ix in x0..x1 {
                                    let i = c * xi.sc + iy * xi.sy + ix * xi.sx;
                                    dst[i] = dst[i] + g;
                                }
                            }
                        }
                    }
                }
            });
        Ok(vec![(shape, dx)])
    }
}

impl Op for AvgPoolGrad {
    fn name(&self) -> &'static str {
        "AvgPoolGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("input_shape", AttrValue::from(self.input_shape.as_slice()))];
        a.extend(self.pool().attrs());
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [dy] = fixed(inputs)?;
        require_float("dy", dy.dtype)?;
        self.dims(&dy.shape)?;
        Ok(vec![TensorType::new(dy.dtype, self.input_shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [dy] = fixed(inputs)?;
        require_float("dy", dy.dtype())?;
        eval_float(self, dy.dtype(), inputs)
    }
}
