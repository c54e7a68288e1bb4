//! Resize (ONNX Resize of opsets 11-19 and Upsample, TensorFlow's ResizeNearestNeighbor
//! and ResizeBilinear) and its gradient ResizeGrad, the scatter-add of `dy` back to the
//! input positions each output read.
//!
//! `x` (any float dtype, rank 1 or more) becomes a tensor of the static `shape` (same
//! rank). Only the axes whose length changes are resized (ONNX maps the others too, at
//! scale 1, which shifts them under `tf_half_pixel_for_nn` with ceil rounding), each
//! independently: output position `o` of an axis of `n` inputs and `m` outputs maps
//! back to the coordinate `c(o)` of `coordinate_transformation_mode` (ONNX's formulas
//! with the scale `m / n`, as ONNX when `sizes` are given; given `scales` enter its
//! formulas as they are, the same wherever `n * scale` is whole), which nearest mode
//! rounds by `nearest_mode` and clamps to `[0, n - 1]`, and linear mode clamps to
//! `[0, n - 1]` and interpolates between its two neighbours (ONNX with `exclude_outside`
//! 0; several resized axes make it bi-, trilinear...). Antialiasing and
//! `tf_crop_and_resize` are not supported. Cubic interpolation is not an op: ONNX
//! import computes it where its input is known ([`resize_cubic`]: position embeddings
//! resized to the image's patch grid, as DINOv2's and YOLOS's exports do).
//!
//! The mode is in the op's name: `ResizeNearest` / `ResizeLinear` (and
//! `ResizeNearestGrad` / `ResizeLinearGrad`), because the precision lists class ops by
//! name and the two modes belong in different lists (nearest copies, clear; linear
//! computes, infer), as TensorFlow's two ops do. Attrs:
//! - `shape`: the output's shape (ResizeGrad: the input's, which it produces).
//! - `coordinate_transformation_mode`: `half_pixel` (the default), `asymmetric`,
//!   `align_corners`, `pytorch_half_pixel` or `tf_half_pixel_for_nn`.
//! - `nearest_mode` (nearest only): `round_prefer_floor` (the default),
//!   `round_prefer_ceil`, `floor` or `ceil`.

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::shape_ops::float_type;
use crate::tensor::{checked_numel, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "ResizeNearest",
        parse: |_, a| Ok(Box::new(Resize::parse(Interp::Nearest, a)?)),
    },
    OpEntry {
        name: "ResizeLinear",
        parse: |_, a| Ok(Box::new(Resize::parse(Interp::Linear, a)?)),
    },
    OpEntry {
        name: "ResizeNearestGrad",
        parse: |_, a| Ok(Box::new(ResizeGrad::parse(Interp::Nearest, a)?)),
    },
    OpEntry {
        name: "ResizeLinearGrad",
        parse: |_, a| Ok(Box::new(ResizeGrad::parse(Interp::Linear, a)?)),
    },
];

/// How an output position's source coordinate is rounded to an input position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NearestMode {
    /// The nearest; halfway goes down.
    #[default]
    RoundPreferFloor,
    /// The nearest; halfway goes up.
    RoundPreferCeil,
    Floor,
    Ceil,
}

impl NearestMode {
    const ALL: [NearestMode; 4] = [
        NearestMode::RoundPreferFloor,
        NearestMode::RoundPreferCeil,
        NearestMode::Floor,
        NearestMode::Ceil,
    ];

    /// ONNX's name for it.
    pub fn name(self) -> &'static str {
        match self {
            NearestMode::RoundPreferFloor => "round_prefer_floor",
            NearestMode::RoundPreferCeil => "round_prefer_ceil",
            NearestMode::Floor => "floor",
            NearestMode::Ceil => "ceil",
        }
    }

    /// The mode ONNX's `nearest_mode` names.
    pub fn from_name(name: &str) -> OpResult<NearestMode> {
        from_name("nearest_mode", name, &Self::ALL, Self::name)
    }

    fn round(self, c: f64) -> f64 {
        match self {
            NearestMode::RoundPreferFloor => (c - 0.5).ceil(),
            NearestMode::RoundPreferCeil => (c + 0.5).floor(),
            NearestMode::Floor => c.floor(),
            NearestMode::Ceil => c.ceil(),
        }
    }
}

/// The interpolation of the resized axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResizeMode {
    /// Each output copies one input, its coordinate rounded.
    Nearest(NearestMode),
    /// Each output mixes the two inputs around its coordinate, per resized axis.
    Linear,
}

impl ResizeMode {
    /// The mode of ONNX's `mode` and `nearest_mode` attrs (the latter matters for
    /// `nearest` only, as in ONNX; absent, `round_prefer_floor`).
    pub fn from_names(mode: &str, nearest_mode: Option<&str>) -> OpResult<ResizeMode> {
        match mode {
            "nearest" => Ok(ResizeMode::Nearest(
                nearest_mode.map_or(Ok(NearestMode::default()), NearestMode::from_name)?,
            )),
            "linear" => Ok(ResizeMode::Linear),
            "cubic" => Err(
                "Resize mode 'cubic' is not supported: only nearest and linear interpolation"
                    .into(),
            ),
            other => Err(format!(
                "unknown Resize mode '{other}': must be nearest or linear (cubic is not supported)"
            )),
        }
    }

    fn interp(self) -> Interp {
        match self {
            ResizeMode::Nearest(_) => Interp::Nearest,
            ResizeMode::Linear => Interp::Linear,
        }
    }
}

/// The mode without its rounding: what the op's name tells.
#[derive(Clone, Copy)]
enum Interp {
    Nearest,
    Linear,
}

/// How an output position maps back to a coordinate along the input (ONNX's
/// `coordinate_transformation_mode`), for an axis of `n` inputs and `m` outputs,
/// `scale = m / n`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CoordinateTransform {
    /// `(o + 0.5) / scale - 0.5`: pixel centres line up.
    #[default]
    HalfPixel,
    /// `o / scale`.
    Asymmetric,
    /// `o * (n - 1) / (m - 1)`, 0 when `m` is 1: the corner pixels line up.
    AlignCorners,
    /// As half-pixel, but 0 when `m` is 1 (PyTorch's `align_corners=False`).
    PytorchHalfPixel,
    /// `(o + 0.5) / scale` (TensorFlow 1's `half_pixel_centers` nearest resize).
    TfHalfPixelForNn,
}

impl CoordinateTransform {
    const ALL: [CoordinateTransform; 5] = [
        CoordinateTransform::HalfPixel,
        CoordinateTransform::Asymmetric,
        CoordinateTransform::AlignCorners,
        CoordinateTransform::PytorchHalfPixel,
        CoordinateTransform::TfHalfPixelForNn,
    ];

    /// ONNX's name for it.
    pub fn name(self) -> &'static str {
        match self {
            CoordinateTransform::HalfPixel => "half_pixel",
            CoordinateTransform::Asymmetric => "asymmetric",
            CoordinateTransform::AlignCorners => "align_corners",
            CoordinateTransform::PytorchHalfPixel => "pytorch_half_pixel",
            CoordinateTransform::TfHalfPixelForNn => "tf_half_pixel_for_nn",
        }
    }

    /// The transform ONNX's `coordinate_transformation_mode` names.
    pub fn from_name(name: &str) -> OpResult<CoordinateTransform> {
        from_name(COORDINATES, name, &Self::ALL, Self::name)
    }

    /// The input coordinate of output position `o`. Written with `n / m` rather than
    /// dividing by the scale, so that exact halves (ties of the nearest modes) stay
    /// exact.
    fn source(self, o: usize, n: usize, m: usize) -> f64 {
        let (o, n, m) = (o as f64, n as f64, m as f64);
        match self {
            CoordinateTransform::HalfPixel => (o + 0.5) * n / m - 0.5,
            CoordinateTransform::PytorchHalfPixel if m > 1.0 => (o + 0.5) * n / m - 0.5,
            CoordinateTransform::Asymmetric => o * n / m,
            CoordinateTransform::AlignCorners if m > 1.0 => o * (n - 1.0) / (m - 1.0),
            CoordinateTransform::AlignCorners | CoordinateTransform::PytorchHalfPixel => 0.0,
            CoordinateTransform::TfHalfPixelForNn => (o + 0.5) * n / m,
        }
    }
}

const COORDINATES: &str = "coordinate_transformation_mode";
const NEAREST: &str = "nearest_mode";

/// The choice among `all` whose `name` is `value`; the error lists them.
fn from_name<T: Copy>(
    attr: &str,
    value: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> OpResult<T> {
    all.iter()
        .copied()
        .find(|&v| name(v) == value)
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|&v| name(v)).collect();
            format!(
                "attr '{attr}' must be one of {}, got '{value}'",
                names.join(" ")
            )
        })
}

/// Reads the attrs besides `shape` of an op whose name says `interp`.
fn read_mode(interp: Interp, a: &mut AttrReader) -> OpResult<(ResizeMode, CoordinateTransform)> {
    let coordinates = match a.opt_str(COORDINATES)? {
        Some(name) => CoordinateTransform::from_name(&name)?,
        None => CoordinateTransform::default(),
    };
    let mode = match interp {
        Interp::Nearest => ResizeMode::Nearest(match a.opt_str(NEAREST)? {
            Some(name) => NearestMode::from_name(&name)?,
            None => NearestMode::default(),
        }),
        Interp::Linear => ResizeMode::Linear,
    };
    Ok((mode, coordinates))
}

/// The attrs besides `shape`.
fn mode_attrs(
    mode: ResizeMode,
    coordinates: CoordinateTransform,
) -> Vec<(&'static str, AttrValue)> {
    let mut a = vec![(COORDINATES, coordinates.name().into())];
    if let ResizeMode::Nearest(nearest) = mode {
        a.push((NEAREST, nearest.name().into()));
    }
    a
}

/// Checks that `input` can be resized to `output`.
fn check_shapes(input: &[usize], output: &[usize]) -> OpResult<()> {
    if input.is_empty() {
        return Err("Resize needs an input of rank 1 or more, got a scalar".into());
    }
    if output.len() != input.len() {
        return Err(format!(
            "the resized shape {} has rank {} but the input {} has rank {}",
            ShapeDisplay(output),
            output.len(),
            ShapeDisplay(input),
            input.len()
        ));
    }
    for (what, shape) in [("resized", output), ("input", input)] {
        if checked_numel(shape).is_none() {
            return Err(format!(
                "the {what} shape {} has too many elements",
                ShapeDisplay(shape)
            ));
        }
    }
    if let Some(ax) = (0..input.len()).find(|&ax| input[ax] == 0 && output[ax] > 0) {
        return Err(format!(
            "axis {ax} of the input {} is empty: nothing to resize to {} elements",
            ShapeDisplay(input),
            output[ax]
        ));
    }
    Ok(())
}

/// The inputs output position `o` reads along one axis, with their weights: one or two,
/// none of weight 0, so that an input a position does not mix in (even an infinite
/// one) never reaches it.
pub type Taps = Vec<(usize, f64)>;

/// The taps of each output position of an axis of `n > 0` inputs and `m` outputs: what
/// the CPU kernels read, and what the CUDA kernels are given.
pub fn axis_taps(
    mode: ResizeMode,
    coordinates: CoordinateTransform,
    n: usize,
    m: usize,
) -> Vec<Taps> {
    let last = (n - 1) as f64;
    (0..m)
        .map(|o| {
            let c = coordinates.source(o, n, m);
            match mode {
                ResizeMode::Nearest(nearest) => {
                    vec![(nearest.round(c).clamp(0.0, last) as usize, 1.0)]
                }
                ResizeMode::Linear => {
                    let c = c.clamp(0.0, last);
                    let lo = c.floor();
                    let w = c - lo;
                    let lo = lo as usize;
                    if w > 0.0 {
                        vec![(lo, 1.0 - w), (lo + 1, w)]
                    } else {
                        vec![(lo, 1.0)]
                    }
                }
            }
        })
        .collect()
}

/// The taps of ONNX's cubic mode for an axis of `n > 0` inputs and `m` outputs: the
/// four inputs around the coordinate `c` with Keys' weights of coefficient `a` (ONNX's
/// `cubic_coeff_a`; PyTorch's bicubic is -0.75) at distances `1 + t`, `t`, `1 - t`, `2 -
/// t` (`t` the fraction of `c`; a whole `c` reads that input alone). Positions outside
/// the axis read its edge, as ONNX pads; with `exclude_outside` they are left out and
/// the other weights scaled to sum to 1. Taps of one position are merged, and those of
/// weight 0 dropped.
pub fn cubic_taps(
    coordinates: CoordinateTransform,
    a: f64,
    exclude_outside: bool,
    n: usize,
    m: usize,
) -> Vec<Taps> {
    (0..m)
        .map(|o| {
            let c = coordinates.source(o, n, m);
            let floor = c.floor();
            let t = c - floor;
            if t == 0.0 {
                let k = floor.clamp(0.0, (n - 1) as f64) as usize;
                return vec![(k, 1.0)];
            }
            // Keys' kernel: |d| <= 1 and 1 < |d| < 2.
            let near = |d: f64| ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0;
            let far = |d: f64| ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a;
            let weights = [far(1.0 + t), near(t), near(1.0 - t), far(2.0 - t)];
            let mut terms: Vec<(i64, f64)> = (0..4)
                .map(|j| (floor as i64 - 1 + j as i64, weights[j]))
                .collect();
            if exclude_outside {
                terms.retain(|&(k, _)| (0..n as i64).contains(&k));
                let total: f64 = terms.iter().map(|&(_, w)| w).sum();
                terms.iter_mut().for_each(|(_, w)| *w /= total);
            }
            let mut taps: Taps = Vec::with_capacity(4);
            for (k, w) in terms {
                let k = k.clamp(0, n as i64 - 1) as usize;
                match taps.iter_mut().find(|(j, _)| *j == k) {
                    Some((_, sum)) => *sum += w,
                    None => taps.push((k, w)),
                }
            }
            taps.retain(|&(_, w)| w != 0.0);
            taps
        })
        .collect()
}

/// `x` (a float tensor) resized to `shape` by ONNX's cubic mode ([`cubic_taps`]), one
/// resized axis after another, in f64, rounded once to `x`'s dtype.
pub fn resize_cubic(
    x: &Tensor,
    shape: &[usize],
    coordinates: CoordinateTransform,
    a: f64,
    exclude_outside: bool,
) -> OpResult<Tensor> {
    if !x.dtype().is_float() {
        return Err(format!("a cubic Resize of {} values", x.dtype()));
    }
    check_shapes(x.shape(), shape)?;
    let mut now = x.shape().to_vec();
    let mut values = x.to_f64_vec();
    for (axis, &m) in shape.iter().enumerate() {
        let n = now[axis];
        if n != m {
            let taps = cubic_taps(coordinates, a, exclude_outside, n, m);
            values = resample(&values, &now, axis, &taps);
            now[axis] = m;
        }
    }
    Tensor::from_f64(x.dtype(), now, &values)
}

/// A tensor's elements as `(outer, len, inner)` blocks around one axis.
fn split(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// The taps in the compute type.
fn taps_in<T: Real>(taps: &[Taps]) -> Vec<Vec<(usize, T)>> {
    taps.iter()
        .map(|t| t.iter().map(|&(k, w)| (k, T::lit(w))).collect())
        .collect()
}

/// `x` of `shape` resampled along `axis` by `taps` (one per output position).
fn resample<T: Real>(x: &[T], shape: &[usize], axis: usize, taps: &[Taps]) -> Vec<T> {
    let (outer, n, inner) = split(shape, axis);
    let taps = taps_in::<T>(taps);
    let mut y = Vec::with_capacity(outer * taps.len() * inner);
    // `n > 0` (check_shapes): a block is empty only where the whole result is.
    if inner == 0 {
        return y;
    }
    for block in x.chunks_exact(n * inner).take(outer) {
        for t in &taps {
            for i in 0..inner {
                // Starting from the first term (not 0) keeps a copied -0 negative.
                let mut terms = t.iter().map(|&(k, w)| block[k * inner + i] * w);
                let first = terms.next().unwrap_or_else(T::zero);
                y.push(terms.fold(first, |acc, v| acc + v));
            }
        }
    }
    y
}

/// The adjoint of [`resample`]: `dy` of `shape` (`taps.len()` along `axis`) added
/// back into `n` positions along `axis`, each with the weight it was read with.
fn scatter<T: Real>(dy: &[T], shape: &[usize], axis: usize, taps: &[Taps], n: usize) -> Vec<T> {
    let (outer, m, inner) = split(shape, axis);
    let taps = taps_in::<T>(taps);
    let mut dx = vec![T::zero(); outer * n * inner];
    if m * inner == 0 {
        return dx;
    }
    for (g, d) in dy
        .chunks_exact(m * inner)
        .zip(dx.chunks_exact_mut(n * inner))
    {
        for (row, t) in g.chunks_exact(inner).zip(&taps) {
            for &(k, w) in t {
                for (d, &v) in d[k * inner..(k + 1) * inner].iter_mut().zip(row) {
                    *d = *d + v * w;
                }
            }
        }
    }
    dx
}

/// Resizes `x` to `shape`: see the module's comment.
#[derive(Clone, Debug, PartialEq)]
pub struct Resize {
    /// The output's shape.
    pub shape: Vec<usize>,
    pub mode: ResizeMode,
    pub coordinate_transformation_mode: CoordinateTransform,
}

impl Resize {
    pub fn new(
        shape: impl Into<Vec<usize>>,
        mode: ResizeMode,
        coordinate_transformation_mode: CoordinateTransform,
    ) -> Self {
        Resize {
            shape: shape.into(),
            mode,
            coordinate_transformation_mode,
        }
    }

    fn parse(interp: Interp, a: &mut AttrReader) -> OpResult<Resize> {
        let shape = a.shape("shape")?;
        let (mode, coordinates) = read_mode(interp, a)?;
        Ok(Resize::new(shape, mode, coordinates))
    }
}

impl FloatKernel for Resize {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        check_shapes(x.shape(), &self.shape)?;
        let mut shape = x.shape().to_vec();
        let mut values = T::read(x).into_owned();
        for (axis, &m) in self.shape.iter().enumerate() {
            let n = shape[axis];
            if n != m {
                let taps = axis_taps(self.mode, self.coordinate_transformation_mode, n, m);
                values = resample(&values, &shape, axis, &taps);
                shape[axis] = m;
            }
        }
        Ok(vec![(shape, values)])
    }
}

impl Op for Resize {
    fn name(&self) -> &'static str {
        match self.mode.interp() {
            Interp::Nearest => "ResizeNearest",
            Interp::Linear => "ResizeLinear",
        }
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("shape", self.shape.as_slice().into())];
        a.extend(mode_attrs(self.mode, self.coordinate_transformation_mode));
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        require_float("x", x.dtype)?;
        check_shapes(&x.shape, &self.shape)?;
        Ok(vec![TensorType::new(x.dtype, self.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        require_float("x", x.dtype())?;
        eval_float(self, x.dtype(), inputs)
    }
    /// `dx = ResizeGrad(dy)` into x's shape, with the same mode.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[x] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(dy), Some(ty)) = (grad0(grads), float_type(b, x)) else {
            return Ok(vec![None]);
        };
        let op = ResizeGrad::new(ty.shape, self.mode, self.coordinate_transformation_mode);
        Ok(vec![Some(b.add(op, &[dy])?)])
    }
}

/// The gradient of [`Resize`]: input `dy` (the resized shape), output zeros of `shape`
/// (the input's) with each element of `dy` added to the inputs its output read,
/// times the weights it read them with (in the kernel's compute type, one rounding
/// per element). Attrs as Resize's, `shape` being the input's.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeGrad {
    /// The shape of the resized input, which this produces.
    pub shape: Vec<usize>,
    pub mode: ResizeMode,
    pub coordinate_transformation_mode: CoordinateTransform,
}

impl ResizeGrad {
    pub fn new(
        shape: impl Into<Vec<usize>>,
        mode: ResizeMode,
        coordinate_transformation_mode: CoordinateTransform,
    ) -> Self {
        ResizeGrad {
            shape: shape.into(),
            mode,
            coordinate_transformation_mode,
        }
    }

    fn parse(interp: Interp, a: &mut AttrReader) -> OpResult<ResizeGrad> {
        let shape = a.shape("shape")?;
        let (mode, coordinates) = read_mode(interp, a)?;
        Ok(ResizeGrad::new(shape, mode, coordinates))
    }
}

impl FloatKernel for ResizeGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [dy] = fixed(inputs)?;
        check_shapes(&self.shape, dy.shape())?;
        let mut shape = dy.shape().to_vec();
        let mut values = T::read(dy).into_owned();
        // The axes are independent: undoing them in any order gives the same sums.
        for (axis, &n) in self.shape.iter().enumerate() {
            let m = shape[axis];
            if n != m {
                let taps = axis_taps(self.mode, self.coordinate_transformation_mode, n, m);
                values = scatter(&values, &shape, axis, &taps, n);
                shape[axis] = n;
            }
        }
        Ok(vec![(shape, values)])
    }
}

impl Op for ResizeGrad {
    fn name(&self) -> &'static str {
        match self.mode.interp() {
            Interp::Nearest => "ResizeNearestGrad",
            Interp::Linear => "ResizeLinearGrad",
        }
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("shape", self.shape.as_slice().into())];
        a.extend(mode_attrs(self.mode, self.coordinate_transformation_mode));
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [dy] = fixed(inputs)?;
        require_float("dy", dy.dtype)?;
        check_shapes(&self.shape, &dy.shape)?;
        Ok(vec![TensorType::new(dy.dtype, self.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [dy] = fixed(inputs)?;
        require_float("dy", dy.dtype())?;
        eval_float(self, dy.dtype(), inputs)
    }
    /// It is linear in `dy`, the adjoint of Resize: `d(dy) = Resize(ddx)` back to dy's
    /// shape.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[dy] = fixed(inputs).map_err(GraphError::Format)?;
        let (Some(ddx), Some(ty)) = (grad0(grads), float_type(b, dy)) else {
            return Ok(vec![None]);
        };
        let op = Resize::new(ty.shape, self.mode, self.coordinate_transformation_mode);
        Ok(vec![Some(b.add(op, &[ddx])?)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys' weights (a = -0.75) by hand, in 256ths: at fractions 1/4 and 3/4 the four
    /// taps weigh -27, 225, 67 and -9 (reversed for 3/4); positions past the edge
    /// read it, or with `exclude_outside` drop out and the rest are scaled to sum to 1;
    /// a whole coordinate reads one input.
    #[test]
    fn cubic_taps_weigh_as_keys_kernel_at_the_edges_too() {
        let w = |k: f64| k / 256.0;
        let taps = cubic_taps(CoordinateTransform::HalfPixel, -0.75, false, 2, 4);
        // Coordinates -0.25, 0.25, 0.75, 1.25 on an axis of 2.
        assert_eq!(taps[0], vec![(0, w(-9.0 + 67.0 + 225.0)), (1, w(-27.0))]);
        assert_eq!(taps[1], vec![(0, w(-27.0 + 225.0)), (1, w(67.0 - 9.0))]);
        assert_eq!(taps[3], vec![(0, w(-27.0)), (1, w(225.0 + 67.0 - 9.0))]);
        let kept = cubic_taps(CoordinateTransform::HalfPixel, -0.75, true, 2, 4);
        assert_eq!(kept[0], vec![(0, 225.0 / 198.0), (1, -27.0 / 198.0)]);
        let whole = cubic_taps(CoordinateTransform::AlignCorners, -0.5, false, 4, 2);
        assert_eq!(whole, vec![vec![(0, 1.0)], vec![(3, 1.0)]]);
    }
}
