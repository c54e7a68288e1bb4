//! Pooling over 2-D images in NHWC or NCHW, TensorFlow's semantics as the CPU kernels
//! (`graph/src/ops/conv.rs`) have them: MaxPool and AvgPool a thread per output;
//! MaxPoolGrad and AvgPoolGrad a thread per input element, gathering from the output
//! windows that cover it, so no atomics and the same result every run. MaxPoolGrad
//! first finds each window's maximum once (a byte per window, in the node's scratch)
//! rather than once per element the window covers.
//!
//! Every kernel adds in the CPU's order (a window's elements row-major; an input
//! element's window gradients in output order oy, ox) and rounds as it does (f32 for
//! the 16-bit types, once on store; AvgPoolGrad scales by the reciprocal of the count,
//! AvgPool divides by it), so the results are the CPU's bit for bit.

use ampgraph_graph::ops::{AvgPool, AvgPoolGrad, DataFormat, MaxPool, MaxPoolGrad, Padding};
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::module;
use super::{first, float_input, input, numel, one_output, Ctx, KernelResult, Lowering};
use crate::cuda::device::{Arg, DTensor};

kernel_specs! {
    /// The modules of the family, one per op, dtype, index width (`wide`: 64-bit) and
    /// `lanes`: the channels a thread takes (1, or a 16-byte vector's worth of an NHWC
    /// tensor whose channel count it divides); `GEOMETRY` stands for [`GEOMETRY`]'s
    /// parameters and `total` counts the threads' items (elements / lanes).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Spec in "pool" {
        /// `k(const T* px, T* py, i64 total, GEOMETRY)`, an item per output.
        MaxPool { dtype: DType, wide: bool, lanes: u8 } => max_pool(dtype, wide, lanes),
        /// `k(const T* px, T* py, i64 total, GEOMETRY)`, an item per output.
        AvgPool { dtype: DType, wide: bool, lanes: u8 } => avg_pool(dtype, wide, lanes),
        /// `k_argmax(const T* px, u8* pat, i64 total, GEOMETRY)`, an item per output;
        /// then `k(const u8* pat, const T* pdy, T* pdx, i64 total, GEOMETRY)`, an item
        /// per input element. For windows of more than [`MAX_WINDOW_PLACES`]
        /// elements, `k_direct(const T* px, const T* pdy, T* pdx, i64 total, GEOMETRY)`.
        MaxPoolGrad { dtype: DType, wide: bool, lanes: u8 } => max_pool_grad(dtype, wide, lanes),
        /// `k(const T* pdy, T* pdx, i64 total, GEOMETRY)`, an item per input element.
        AvgPoolGrad { dtype: DType, wide: bool, lanes: u8 } => avg_pool_grad(dtype, wide, lanes),
    }
}

/// The parameters every kernel takes after its tensors and item count: the layout
/// (`int nhwc`), then each size by name, as an `i64` where [`DIVIDED`] does not name
/// it, else as an `i64` with its divider (`unsigned NAME_m, unsigned NAME_s`): the
/// input's channels, rows and columns, the output's rows and columns, and the window's
/// size, stride and padding before, by axis (rows first). [`Geometry::new`] makes the
/// arguments in this order.
const GEOMETRY: [&str; 11] = [
    "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw",
];

/// The sizes of [`GEOMETRY`] the kernels divide by.
const DIVIDED: [&str; 7] = ["c", "h", "w", "oh", "ow", "sh", "sw"];

/// The multiplier and shift that divide by `d` with a multiply-high: for `0 <= n <
/// 2^31`, `n / d == (umulhi(n, m) + n) >> s` (Granlund and Montgomery's method, as
/// PyTorch's `IntDivider`). Sizes of 0 (an empty tensor: no kernel runs) divide as 1.
fn divider(d: usize) -> (u32, u32) {
    let d = d.clamp(1, 1 << 31) as u64;
    let s = (0..32).find(|&s| 1u64 << s >= d).unwrap_or(31);
    let m = ((1u64 << 32) * ((1u64 << s) - d)) / d + 1;
    (m as u32, s)
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(p) = op.downcast_ref::<MaxPool>() {
        let attrs = Attrs::new(p.ksize, p.strides, p.padding, p.data_format);
        return Some(lower_forward(
            |dtype, wide, lanes| Spec::MaxPool { dtype, wide, lanes },
            &attrs,
            ins,
            outs,
        ));
    }
    if let Some(p) = op.downcast_ref::<AvgPool>() {
        let attrs = Attrs::new(p.ksize, p.strides, p.padding, p.data_format);
        return Some(lower_forward(
            |dtype, wide, lanes| Spec::AvgPool { dtype, wide, lanes },
            &attrs,
            ins,
            outs,
        ));
    }
    if let Some(p) = op.downcast_ref::<MaxPoolGrad>() {
        let attrs = Attrs::new(p.ksize, p.strides, p.padding, p.data_format);
        return Some(lower_max_pool_grad(&attrs, ins, outs));
    }
    if let Some(p) = op.downcast_ref::<AvgPoolGrad>() {
        let attrs = Attrs::new(p.ksize, p.strides, p.padding, p.data_format);
        return Some(lower_avg_pool_grad(&attrs, &p.input_shape, ins, outs));
    }
    None
}

/// The attributes the four pooling ops share.
struct Attrs {
    ksize: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
    format: DataFormat,
}

impl Attrs {
    fn new(ksize: [usize; 2], strides: [usize; 2], padding: Padding, format: DataFormat) -> Self {
        Attrs {
            ksize,
            strides,
            padding,
            format,
        }
    }
}

/// The spec of one of the family's ops from its dtype, index width and lanes.
type SpecOf = fn(DType, bool, u8) -> Spec;

/// A pooling's input and output shapes and its kernels' [`GEOMETRY`] arguments.
struct Geometry {
    dtype: DType,
    input: Vec<usize>,
    output: Vec<usize>,
    args: Vec<Arg>,
    /// The channels a thread takes where its tensors are aligned to them.
    lanes: usize,
}

impl Geometry {
    /// The pooling of a `dtype` input of shape `input` (in the attrs' layout).
    fn new(attrs: &Attrs, dtype: DType, input: &[usize]) -> Result<Geometry, String> {
        let &[d0, d1, d2, d3] = input else {
            return Err(format!(
                "pooling takes a rank-4 image tensor, got {}",
                ShapeDisplay(input)
            ));
        };
        let nhwc = attrs.format == DataFormat::Nhwc;
        let (n, c, h, w) = if nhwc {
            (d0, d3, d1, d2)
        } else {
            (d0, d1, d2, d3)
        };
        let [kh, kw] = attrs.ksize;
        let [sh, sw] = attrs.strides;
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
            return Err(format!(
                "pooling needs positive ksize and strides, got ksize {:?}, strides {:?}",
                attrs.ksize, attrs.strides
            ));
        }
        // Explicit pads leave no window without an input element: the kernels'
        // clipped windows need no case for one.
        attrs.padding.check_pool(attrs.ksize, [h, w])?;
        let rows = attrs
            .padding
            .output_len(0, h, kh, sh)
            .map_err(|e| format!("height: {e}"))?;
        let cols = attrs
            .padding
            .output_len(1, w, kw, sw)
            .map_err(|e| format!("width: {e}"))?;
        let (oh, ph, ow, pw) = (rows.out, rows.before, cols.out, cols.before);
        let output = if nhwc {
            vec![n, oh, ow, c]
        } else {
            vec![n, c, oh, ow]
        };
        let mut args = vec![Arg::I32(nhwc.into())];
        for (name, v) in GEOMETRY
            .iter()
            .zip([c, h, w, oh, ow, kh, kw, sh, sw, ph, pw])
        {
            args.push(Arg::I64(v as i64));
            if DIVIDED.contains(name) {
                let (m, s) = divider(v);
                args.extend([Arg::I32(m as i32), Arg::I32(s as i32)]);
            }
        }
        // A channels-last thread takes a 16-byte vector of channels (one pixel's index
        // math for all of them), or the largest power of two of them dividing `c`.
        let lanes = if nhwc {
            let vector = (16 / dtype.size_bytes()).max(1);
            1 << c.trailing_zeros().min(vector.ilog2())
        } else {
            1
        };
        Ok(Geometry {
            dtype,
            input: input.to_vec(),
            output,
            args,
            lanes,
        })
    }

    /// Launches kernel `name` of the spec `of` makes, a thread per `lanes` of
    /// `elements` (1 where a tensor is not aligned to them): its arguments `tensors`,
    /// then the item count and the geometry.
    fn launch(
        &self,
        c: &Ctx,
        of: SpecOf,
        name: &'static str,
        tensors: &[&DTensor],
        elements: usize,
    ) -> Result<(), String> {
        let aligned = |t: &&DTensor| t.ptr() % (self.lanes * t.dtype.size_bytes()) as u64 == 0;
        let lanes = if tensors.iter().all(aligned) {
            self.lanes
        } else {
            1
        };
        let spec = of(self.dtype, wide(&self.input, &self.output), lanes as u8);
        let items = elements / lanes;
        let mut args: Vec<Arg> = tensors.iter().map(|t| t.arg()).collect();
        args.push(Arg::I64(items as i64));
        args.extend(self.args.iter().cloned());
        c.launch_items_of(&spec, name, items, 1, &args)
    }
}

/// Refuses `t` (the op's `what`) unless it is of `dtype` and shape `shape`.
fn expect(what: &str, t: Option<&TensorType>, dtype: DType, shape: &[usize]) -> Result<(), String> {
    let t = t.ok_or_else(|| format!("the pooling op has no {what}"))?;
    if t.dtype != dtype || t.shape != shape {
        return Err(format!(
            "{what} is {}{} but the pooling needs {dtype}{}",
            t.dtype,
            ShapeDisplay(&t.shape),
            ShapeDisplay(shape)
        ));
    }
    Ok(())
}

/// MaxPool or AvgPool (the spec `of`): `y` from `x`.
fn lower_forward(
    of: SpecOf,
    attrs: &Attrs,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let dtype = float_input(ins)?;
    let g = Geometry::new(attrs, dtype, &ins[0].shape)?;
    let y = first(outs)?;
    expect("y", Some(&y), dtype, &g.output)?;
    let total = numel(&g.output);
    Ok(one_output(y, move |c, ins, y| {
        g.launch(c, of, "k", &[input(ins, 0)?, y], total)
    }))
}

/// The most elements a window may have for MaxPoolGrad to note its maximum's place in
/// a byte (255 marks a window without one).
const MAX_WINDOW_PLACES: usize = 255;

/// MaxPoolGrad: `dx` from `x`, `y` (its type checked only, as on the CPU) and `dy`.
fn lower_max_pool_grad(attrs: &Attrs, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let dtype = float_input(ins)?;
    let g = Geometry::new(attrs, dtype, &ins[0].shape)?;
    expect("y", ins.get(1), dtype, &g.output)?;
    expect("dy", ins.get(2), dtype, &g.output)?;
    let dx = first(outs)?;
    expect("dx", Some(&dx), dtype, &g.input)?;
    let of: SpecOf = |dtype, wide, lanes| Spec::MaxPoolGrad { dtype, wide, lanes };
    let (inputs, outputs) = (numel(&g.input), numel(&g.output));
    let direct = attrs.ksize[0] * attrs.ksize[1] > MAX_WINDOW_PLACES;
    Ok(one_output(dx, move |c, ins, dx| {
        let (x, dy) = (input(ins, 0)?, input(ins, 2)?);
        if direct {
            return g.launch(c, of, "k_direct", &[x, dy, dx], inputs);
        }
        // A byte per window (Bool's storage): its first maximum's place.
        let places = c.temp(DType::Bool, outputs)?;
        g.launch(c, of, "k_argmax", &[x, &places], outputs)?;
        g.launch(c, of, "k", &[&places, dy, dx], inputs)
    }))
}

/// AvgPoolGrad: `dx` (of shape `input_shape`) from `dy`.
fn lower_avg_pool_grad(
    attrs: &Attrs,
    input_shape: &[usize],
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let dtype = float_input(ins)?;
    let g = Geometry::new(attrs, dtype, input_shape)?;
    expect("dy", ins.first(), dtype, &g.output)?;
    let dx = first(outs)?;
    expect("dx", Some(&dx), dtype, &g.input)?;
    let total = numel(&g.input);
    let of: SpecOf = |dtype, wide, lanes| Spec::AvgPoolGrad { dtype, wide, lanes };
    Ok(one_output(dx, move |c, ins, dx| {
        g.launch(c, of, "k", &[input(ins, 0)?, dx], total)
    }))
}

/// What every pooling kernel uses: an element's place in an image tensor, the input
/// range of an output's window (the CPU's `Axis::range`), the outputs whose windows
/// cover an input position, and a window's first maximum, all for the `V` channels
/// (lanes) of an item.
const POOLING: &str = r#"
// A size with the multiplier and shift that divide by it: in 32-bit modules n / d is
// a multiply-high, an add and a shift (n < 2^31), as PyTorch's IntDivider does.
struct Div { I d; unsigned m, s; };
__device__ __forceinline__ I quot(I n, Div v) {
#if FAST_DIV
  return (I)((__umulhi((unsigned)n, v.m) + (unsigned)n) >> v.s);
#else
  return n / v.d;
#endif
}
// Where an element of an image tensor lies: image, channel, row, column.
struct Pixel { I b, ch, y, x; };
// Positions [lo, hi) along one axis.
struct Range { I lo, hi; };
__device__ __forceinline__ I range_len(Range r) { return r.hi - r.lo; }
struct Pooling {
  int nhwc;
  Div c, h, w, oh, ow;
  I kh, kw;
  Div sh, sw;
  I ph, pw;
  // Element `i` of a contiguous tensor of images of `rows` x `cols`.
  __device__ __forceinline__ Pixel pixel(I i, Div rows, Div cols) const {
    Pixel p;
    I q;
    if (nhwc) {
      q = quot(i, c); p.ch = i - q * c.d; i = q;
      q = quot(i, cols); p.x = i - q * cols.d; i = q;
      q = quot(i, rows); p.y = i - q * rows.d; p.b = q;
    } else {
      q = quot(i, cols); p.x = i - q * cols.d; i = q;
      q = quot(i, rows); p.y = i - q * rows.d; i = q;
      q = quot(i, c); p.ch = i - q * c.d; p.b = q;
    }
    return p;
  }
  __device__ __forceinline__ I offset(I b, I ch, I y, I x, I rows, I cols) const {
    return nhwc ? ((b * rows + y) * cols + x) * c.d + ch : ((b * c.d + ch) * rows + y) * cols + x;
  }
  __device__ __forceinline__ I input_offset(I b, I ch, I y, I x) const { return offset(b, ch, y, x, h.d, w.d); }
  __device__ __forceinline__ I output_offset(I b, I ch, I y, I x) const { return offset(b, ch, y, x, oh.d, ow.d); }
};
// The in-bounds input positions of output position `o`'s window along an axis of
// `len` (padding takes no part).
__device__ __forceinline__ Range window(I o, I stride, I pad, I size, I len) {
  I start = o * stride - pad, end = start + size;
  Range r;
  r.lo = start < 0 ? 0 : start;
  r.hi = end > len ? len : end;
  if (r.hi < r.lo) r.hi = r.lo;
  return r;
}
// The output positions (of `out`) whose windows along an axis hold input position `i`:
// o * stride - pad <= i < o * stride - pad + size.
__device__ __forceinline__ Range covering(I i, Div stride, I pad, I size, I out) {
  I first = i + pad - size + 1;
  Range r;
  r.lo = first <= 0 ? 0 : quot(first + stride.d - 1, stride);
  r.hi = quot(i + pad, stride) + 1;
  if (r.hi > out) r.hi = out;
  return r;
}
// The V lanes at offset `at` (a multiple of V) as the compute type.
struct Lanes { A v[V]; };
__device__ __forceinline__ Lanes load_lanes(const T* p, I at) {
  Vec<T, V> w = *(const Vec<T, V>*)(p + at);
  Lanes l;
#pragma unroll
  for (int u = 0; u < V; ++u) l.v[u] = (A)ld(w.v, u);
  return l;
}
__device__ __forceinline__ void store_lanes(T* p, I at, const Lanes& l) {
  Vec<T, V> w;
#pragma unroll
  for (int u = 0; u < V; ++u) st(w.v, u, (C)l.v[u]);
  *(Vec<T, V>*)(p + at) = w;
}
// The place of input position (y, x) in output position (oy, ox)'s window, counting
// row-major from the window's first (maybe padded) position.
__device__ __forceinline__ int window_place(const Pooling& g, I oy, I ox, I y, I x) {
  return (int)((y - (oy * g.sh.d - g.ph)) * g.kw + (x - (ox * g.sw.d - g.pw)));
}
// Each lane's first maximum of the window (output position `oy`, `ox`; rows `ry`,
// columns `rx`) of image `b` from channel `ch`, in row-major order, with a NaN counting
// as the maximum: its value (-inf for an empty window) and place in the window (-1).
// MaxPool's value is the CPU's (NaN propagates); MaxPoolGrad's place the element the
// CPU gives the window's gradient.
struct Max { A value[V]; int place[V]; };
__device__ __forceinline__ Max first_max(const T* px, const Pooling& g, I b, I ch, I oy, I ox, Range ry, Range rx) {
  Max m;
#pragma unroll
  for (int u = 0; u < V; ++u) { m.value[u] = (A)(-F_INF); m.place[u] = -1; }
  for (I y = ry.lo; y < ry.hi; ++y) {
    for (I x = rx.lo; x < rx.hi; ++x) {
      Lanes v = load_lanes(px, g.input_offset(b, ch, y, x));
      int place = window_place(g, oy, ox, y, x);
#pragma unroll
      for (int u = 0; u < V; ++u) {
        if (m.place[u] < 0 || (!m_isnan(m.value[u]) && (m_isnan(v.v[u]) || v.v[u] > m.value[u]))) {
          m.value[u] = v.v[u];
          m.place[u] = place;
        }
      }
    }
  }
  return m;
}
"#;

/// Kernel `name` over `total` items `i` of tensors `tensors` (the parameters before
/// `total`): `body` runs per item, its first element `e`, with the geometry `g` bound.
fn pooling_kernel_source(name: &str, tensors: &str, body: &str) -> String {
    let mut params = vec!["int nhwc".to_string()];
    let mut fields = vec!["nhwc".to_string()];
    for n in GEOMETRY {
        params.push(format!("i64 {n}"));
        if DIVIDED.contains(&n) {
            params.push(format!("unsigned {n}_m, unsigned {n}_s"));
            fields.push(format!("{{(I){n}, {n}_m, {n}_s}}"));
        } else {
            fields.push(format!("(I){n}"));
        }
    }
    format!(
        "extern \"C\" __global__ void {name}({tensors}, i64 total, {}) {{\n\
           const Pooling g = {{{}}};\n\
           GRID_LOOP(i, total) {{\nconst I e = (I)i * V;\n{body}\n}}\n}}\n",
        params.join(", "),
        fields.join(", ")
    )
}

/// The module of `kernels` (their sources) with what pooling kernels share, `lanes`
/// channels an item, its index math in 64 bits where `wide` (a tensor of 2^31 elements
/// or more), else in 32: a 64-bit division is several times a 32-bit one's
/// instructions, and the gradients divide to place every element (ResNet-50's
/// MaxPoolGrad spent most of its time so).
fn pooling_module(d: DType, wide: bool, lanes: u8, kernels: &[String]) -> String {
    let (index, fast) = if wide { ("long long", 0) } else { ("int", 1) };
    module(
        d,
        &format!(
            "typedef {index} I;\n#define FAST_DIV {fast}\n#define V {lanes}\n{POOLING}{}",
            kernels.concat()
        ),
    )
}

/// Whether a pooling of these shapes needs 64-bit index math.
fn wide(input: &[usize], output: &[usize]) -> bool {
    numel(input).max(numel(output)) > i32::MAX as usize
}

/// Binds output item `e`'s place `o` and its window's rows `ry` and columns `rx`.
const OUTPUT_WINDOW: &str = "Pixel o = g.pixel(e, g.oh, g.ow);\n\
     Range ry = window(o.y, g.sh.d, g.ph, g.kh, g.h.d), rx = window(o.x, g.sw.d, g.pw, g.kw, g.w.d);\n";

/// A forward kernel: output item `e`'s window ([`OUTPUT_WINDOW`]) bound for `body`,
/// which sets `out`'s lanes.
fn forward(d: DType, wide: bool, lanes: u8, body: &str) -> String {
    let kernel = pooling_kernel_source(
        "k",
        "const T* px, T* py",
        &format!(
            "{OUTPUT_WINDOW}Lanes out;\n\
             {body}\n\
             store_lanes(py, e, out);"
        ),
    );
    pooling_module(d, wide, lanes, &[kernel])
}

/// Gradient kernel `name`: input item `e` (`p`) gathers into `acc` what
/// `contribution` adds for each output window (`oy`, `ox`, its offset `o_at`, rows
/// `ry`, columns `rx`, the item's place in it `here`) covering it, in the CPU's order,
/// and stores it in `pdx`.
fn gradient(name: &str, tensors: &str, contribution: &str) -> String {
    pooling_kernel_source(
        name,
        &format!("{tensors}, T* pdx"),
        &format!(
            "Pixel p = g.pixel(e, g.h, g.w);\n\
             Range oys = covering(p.y, g.sh, g.ph, g.kh, g.oh.d), oxs = covering(p.x, g.sw, g.pw, g.kw, g.ow.d);\n\
             Lanes acc;\n\
             for (int u = 0; u < V; ++u) acc.v[u] = 0;\n\
             for (I oy = oys.lo; oy < oys.hi; ++oy) {{\n\
               for (I ox = oxs.lo; ox < oxs.hi; ++ox) {{\n\
                 Range ry = window(oy, g.sh.d, g.ph, g.kh, g.h.d), rx = window(ox, g.sw.d, g.pw, g.kw, g.w.d);\n\
                 I o_at = g.output_offset(p.b, p.ch, oy, ox);\n\
                 int here = window_place(g, oy, ox, p.y, p.x);\n\
                 {contribution}\n\
               }}\n\
             }}\n\
             store_lanes(pdx, e, acc);"
        ),
    )
}

pub(super) fn max_pool(d: DType, wide: bool, lanes: u8) -> String {
    forward(
        d,
        wide,
        lanes,
        "Max m = first_max(px, g, o.b, o.ch, o.y, o.x, ry, rx);\n\
         for (int u = 0; u < V; ++u) out.v[u] = m.value[u];",
    )
}

/// The mean over the window's in-bounds elements (zero for an empty window, as the
/// CPU's).
pub(super) fn avg_pool(d: DType, wide: bool, lanes: u8) -> String {
    forward(
        d,
        wide,
        lanes,
        "for (int u = 0; u < V; ++u) out.v[u] = 0;\n\
         for (I y = ry.lo; y < ry.hi; ++y) {\n\
           for (I x = rx.lo; x < rx.hi; ++x) {\n\
             Lanes v = load_lanes(px, g.input_offset(o.b, o.ch, y, x));\n\
             for (int u = 0; u < V; ++u) out.v[u] += v.v[u];\n\
           }\n\
         }\n\
         I count = range_len(ry) * range_len(rx);\n\
         if (count > 0) for (int u = 0; u < V; ++u) out.v[u] /= (A)count;",
    )
}

/// Each covering window's gradient where this element is the window's first maximum:
/// `k_argmax` notes each window's maximum's place, `k` compares its own; `k_direct`
/// finds the maximum again in `x` for every window covering the element.
pub(super) fn max_pool_grad(d: DType, wide: bool, lanes: u8) -> String {
    let argmax = pooling_kernel_source(
        "k_argmax",
        "const T* px, u8* pat",
        &format!(
            "{OUTPUT_WINDOW}Max m = first_max(px, g, o.b, o.ch, o.y, o.x, ry, rx);\n\
             Vec<u8, V> at;\n\
             for (int u = 0; u < V; ++u) at.v[u] = m.place[u] < 0 ? (u8)255 : (u8)m.place[u];\n\
             *(Vec<u8, V>*)(pat + e) = at;"
        ),
    );
    let gather = gradient(
        "k",
        "const u8* pat, const T* pdy",
        "Vec<u8, V> at = *(const Vec<u8, V>*)(pat + o_at);\n\
         Lanes d = load_lanes(pdy, o_at);\n\
         for (int u = 0; u < V; ++u) if ((int)at.v[u] == here) acc.v[u] += d.v[u];",
    );
    let direct = gradient(
        "k_direct",
        "const T* px, const T* pdy",
        "Max m = first_max(px, g, p.b, p.ch, oy, ox, ry, rx);\n\
         Lanes d = load_lanes(pdy, o_at);\n\
         for (int u = 0; u < V; ++u) if (m.place[u] == here) acc.v[u] += d.v[u];",
    );
    pooling_module(d, wide, lanes, &[argmax, gather, direct])
}

/// Each covering window's gradient spread evenly over its in-bounds elements.
pub(super) fn avg_pool_grad(d: DType, wide: bool, lanes: u8) -> String {
    let kernel = gradient(
        "k",
        "const T* pdy",
        "Lanes d = load_lanes(pdy, o_at);\n\
         A r = (A)1 / (A)(range_len(ry) * range_len(rx));\n\
         for (int u = 0; u < V; ++u) acc.v[u] += d.v[u] * r;",
    );
    pooling_module(d, wide, lanes, &[kernel])
}

#[cfg(test)]
mod tests {
    use super::divider;

    /// What the kernels compute: `(umulhi(n, m) + n) >> s`.
    fn quot(n: u32, d: usize) -> u32 {
        let (m, s) = divider(d);
        let high = ((n as u64 * m as u64) >> 32) as u32;
        (high + n) >> s
    }

    #[test]
    fn dividers_divide_every_index_below_2_31() {
        let mut divisors: Vec<usize> = (1..=300).collect();
        divisors.extend([
            511,
            512,
            513,
            1000,
            4095,
            50257,
            65536,
            1 << 20,
            (1 << 31) - 1,
            1 << 31,
        ]);
        let mut n: u64 = 0x9E37_79B9;
        for d in divisors {
            let edges = [
                0u32,
                1,
                d as u32 - 1,
                d as u32,
                (i32::MAX as u32) - 1,
                i32::MAX as u32,
            ];
            for &x in &edges {
                assert_eq!(quot(x, d), x / d as u32, "{x} / {d}");
            }
            for _ in 0..2000 {
                n ^= n << 13;
                n ^= n >> 7;
                n ^= n << 17;
                let x = (n % (1u64 << 31)) as u32;
                assert_eq!(quot(x, d), x / d as u32, "{x} / {d}");
            }
        }
        assert_eq!(divider(0), divider(1));
    }
}
