//! Pad (ONNX Pad; TensorFlow Pad, PadV2 and MirrorPad): grows or crops each axis of
//! `x` at both ends. Works for every dtype and never rounds the values it copies.
//!
//! Attrs:
//! - `pads`: a `(before, after)` pair per axis, flattened: `[b0, a0, b1, a1, ...]`
//!   (TensorFlow's `paddings` row by row, the order of `explicit_paddings`; ONNX's
//!   `[b0, b1, ..., a0, a1, ...]` holds the same numbers in another order). A
//!   negative count crops that many elements instead, as ONNX allows.
//! - `mode`: `constant` (the default), `reflect` or `edge`, ONNX's names. Reflect
//!   mirrors without repeating the edge (`[1, 2, 3]` with 2 before is
//!   `[3, 2, 1, 2, 3]`), again and again where a pad is wider than the axis (as
//!   NumPy); edge repeats the edge element. Crops apply first: both copy from the
//!   elements kept.
//! - `value`: what constant mode fills with (default 0), rounded to x's dtype as a
//!   Const would be; the other modes take none.

use std::ops::Range;

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::{not_differentiable, GradBuilder};
use crate::error::GraphError;
use crate::graph::Port;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::shape_ops::{dispatch, float_type, typed, Elem};
use crate::ops::{grad0, Slice};
use crate::tensor::{checked_numel, strides, Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "Pad",
    parse: |_, a| Ok(Box::new(Pad::parse(a)?)),
}];

/// What fills the padding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PadMode {
    /// This value.
    Constant(f64),
    /// The kept elements mirrored about the edge element, which is not repeated.
    Reflect,
    /// The edge element repeated.
    Edge,
}

impl PadMode {
    /// The name attr `mode` gives it.
    pub fn name(self) -> &'static str {
        match self {
            PadMode::Constant(_) => "constant",
            PadMode::Reflect => "reflect",
            PadMode::Edge => "edge",
        }
    }
}

/// Pads (or crops) each axis of `x`: see the module's comment for the attrs.
#[derive(Clone, Debug, PartialEq)]
pub struct Pad {
    /// `[before, after]` per axis; negative crops.
    pub pads: Vec<[i64; 2]>,
    pub mode: PadMode,
}

/// One axis of a pad: the input elements it keeps and how many it adds around them.
struct AxisPad {
    keep: Range<usize>,
    before: usize,
    after: usize,
}

impl AxisPad {
    /// The pad `[before, after]` of an axis of `n` elements; `None` when the crops
    /// exceed it.
    fn new(n: usize, [before, after]: [i64; 2]) -> Option<AxisPad> {
        let crop = |p: i64| usize::try_from(p.min(0).unsigned_abs()).ok();
        let grow = |p: i64| usize::try_from(p.max(0)).ok();
        let start = crop(before)?;
        let end = n.checked_sub(crop(after)?)?;
        (start <= end).then_some(AxisPad {
            keep: start..end,
            before: grow(before)?,
            after: grow(after)?,
        })
    }

    fn len(&self) -> Option<usize> {
        self.keep
            .len()
            .checked_add(self.before)?
            .checked_add(self.after)
    }

    /// The input element output position `o` copies; `None` for constant fill. The
    /// reflect and edge modes need a kept element (`Pad::axes` checks).
    fn source(&self, o: usize, mode: PadMode) -> Option<usize> {
        let m = self.keep.len() as i128;
        // Position relative to the first kept element.
        let j = o as i128 - self.before as i128;
        let k = if (0..m).contains(&j) {
            j
        } else {
            match mode {
                PadMode::Constant(_) => return None,
                PadMode::Edge => j.clamp(0, m - 1),
                PadMode::Reflect if m == 1 => 0,
                PadMode::Reflect => {
                    // Mirroring repeats with period 2(m - 1): 0 1 .. m-1 .. 1 0 1 ..
                    let period = 2 * (m - 1);
                    let r = j.rem_euclid(period);
                    if r < m {
                        r
                    } else {
                        period - r
                    }
                }
            }
        };
        Some(self.keep.start + k as usize)
    }
}

impl Pad {
    pub fn new(pads: impl Into<Vec<[i64; 2]>>, mode: PadMode) -> Self {
        Pad {
            pads: pads.into(),
            mode,
        }
    }

    /// Constant mode: the padding holds `value`.
    pub fn constant(pads: impl Into<Vec<[i64; 2]>>, value: f64) -> Self {
        Pad::new(pads, PadMode::Constant(value))
    }

    fn parse(a: &mut AttrReader) -> OpResult<Pad> {
        let flat = a.ints("pads")?;
        if flat.len() % 2 != 0 {
            return Err(format!(
                "attr 'pads' must hold a (before, after) pair per axis, got {} integers {flat:?}",
                flat.len()
            ));
        }
        let pads: Vec<[i64; 2]> = flat.chunks_exact(2).map(|p| [p[0], p[1]]).collect();
        let modes = [PadMode::Constant(0.0), PadMode::Reflect, PadMode::Edge];
        let named = modes.map(|m| (m.name(), m));
        let mode = match a.choice("mode", &named, Some(PadMode::Constant(0.0)))? {
            PadMode::Constant(_) => PadMode::Constant(a.float_or("value", 0.0)?),
            other if a.opt_float("value")?.is_some() => {
                return Err(format!(
                    "attr 'value' is for mode constant only, not {}",
                    other.name()
                ))
            }
            other => other,
        };
        Ok(Pad::new(pads, mode))
    }

    /// Each axis's pad for an input shape, checked against it.
    fn axes(&self, input: &[usize]) -> OpResult<Vec<AxisPad>> {
        if self.pads.len() != input.len() {
            return Err(format!(
                "attr 'pads' has {} (before, after) pairs but the input {} has rank {}",
                self.pads.len(),
                ShapeDisplay(input),
                input.len()
            ));
        }
        let copies = !matches!(self.mode, PadMode::Constant(_));
        let mut axes = Vec::with_capacity(input.len());
        for (ax, (&pad, &n)) in self.pads.iter().zip(input).enumerate() {
            let axis = AxisPad::new(n, pad).ok_or_else(|| {
                format!("pads {pad:?} crop more than the {n} elements of axis {ax}")
            })?;
            if copies && axis.keep.is_empty() && (axis.before > 0 || axis.after > 0) {
                return Err(format!(
                    "mode {} pads axis {ax} but keeps none of its {n} elements to copy",
                    self.mode.name()
                ));
            }
            axes.push(axis);
        }
        Ok(axes)
    }

    /// The output shape for an input shape.
    pub fn output_shape(&self, input: &[usize]) -> OpResult<Vec<usize>> {
        self.axes(input)?
            .iter()
            .map(AxisPad::len)
            .collect::<Option<Vec<usize>>>()
            .filter(|s| checked_numel(s).is_some())
            .ok_or_else(|| {
                format!(
                    "pads {:?} on the input {} give a result with too many elements",
                    self.pads,
                    ShapeDisplay(input)
                )
            })
    }
}

/// `x` padded: `sources[ax][o]` is the input position along `ax` that output
/// position `o` copies, `None` for `fill` (a one-element `Data` of x's dtype).
fn pad_typed<T: Elem>(
    x: &Tensor,
    sources: &[Vec<Option<usize>>],
    shape: &[usize],
    fill: &Data,
) -> OpResult<Data> {
    let xs = typed::<T>(x)?;
    let fill = T::slice(fill)
        .and_then(|f| f.first().copied())
        .ok_or("the fill value has another dtype")?;
    let in_strides = strides(x.shape());
    let n = checked_numel(shape).ok_or("the padded shape has too many elements")?;
    let mut out = Vec::with_capacity(n);
    // An odometer over the output index.
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let from = idx
            .iter()
            .zip(sources)
            .zip(&in_strides)
            .try_fold(0, |at, ((&i, axis), &stride)| {
                axis[i].map(|k| at + k * stride)
            });
        out.push(match from {
            Some(at) => *xs.get(at).ok_or("pad index out of range")?,
            None => fill,
        });
        for ax in (0..shape.len()).rev() {
            idx[ax] += 1;
            if idx[ax] < shape[ax] {
                break;
            }
            idx[ax] = 0;
        }
    }
    Ok(T::wrap(out))
}

impl Op for Pad {
    fn name(&self) -> &'static str {
        "Pad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let flat: Vec<i64> = self.pads.iter().flatten().copied().collect();
        let mut a = vec![("pads", flat.into()), ("mode", self.mode.name().into())];
        if let PadMode::Constant(value) = self.mode {
            a.push(("value", value.into()));
        }
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        Ok(vec![TensorType::new(x.dtype, self.output_shape(&x.shape)?)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        let shape = self.output_shape(x.shape())?;
        let sources: Vec<Vec<Option<usize>>> = self
            .axes(x.shape())?
            .iter()
            .zip(&shape)
            .map(|(axis, &len)| (0..len).map(|o| axis.source(o, self.mode)).collect())
            .collect();
        let value = match self.mode {
            PadMode::Constant(v) => v,
            PadMode::Reflect | PadMode::Edge => 0.0,
        };
        let fill = Data::from_f64(x.dtype(), [value]);
        let data = dispatch!(x.dtype(), pad_typed(x, &sources, &shape, &fill))?;
        Ok(vec![Tensor::new(shape, data)?])
    }
    /// Constant mode only: `dx` is the block of `dy` that holds x. Where every pad
    /// grows, that is a Slice (an op every executor has); where some crop, the adjoint
    /// is the opposite pad, zeros where x was cropped. Reflect and edge would need a
    /// scatter-add of the mirrored elements: no gradient.
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
        if !matches!(self.mode, PadMode::Constant(_)) {
            return Err(not_differentiable(&format!(
                "Pad in mode {}",
                self.mode.name()
            )));
        }
        let axes = self.axes(&ty.shape).map_err(GraphError::Format)?;
        let dx = if self.pads.iter().flatten().all(|&p| p >= 0) {
            let begin: Vec<usize> = axes.iter().map(|a| a.before).collect();
            let size: Vec<i64> = ty.shape.iter().map(|&d| d as i64).collect();
            b.add(Slice::new(begin, size), &[dy])?
        } else {
            // `axes` checked that every crop fits its axis, so no count is i64::MIN.
            let opposite = self
                .pads
                .iter()
                .map(|&[before, after]| Some([before.checked_neg()?, after.checked_neg()?]))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| GraphError::Format(format!("pads {:?} overflow", self.pads)))?;
            b.add(Pad::constant(opposite, 0.0), &[dy])?
        };
        Ok(vec![Some(dx)])
    }
}
