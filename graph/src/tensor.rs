//! Host tensors: the values a graph computes on the CPU, and the values of Consts.
//!
//! Storage follows the dtype (`half` types for f16/bf16); arithmetic on 16-bit and
//! 32-bit floats happens in f32 and on f64 in f64, and every store rounds to the
//! storage type, as a GPU kernel does.

use std::fmt;

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::dtype::DType;
use crate::fp8::{F8E4M3, F8E5M2};

/// Element storage of a tensor, one variant per dtype.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
    F8E4M3(Vec<F8E4M3>),
    F8E5M2(Vec<F8E5M2>),
}

/// A dtype and a static shape: what an edge of the graph carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements, or `None` when it overflows `usize`.
    pub fn checked_len(&self) -> Option<usize> {
        checked_numel(&self.shape)
    }

    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType::new(dtype, self.shape.clone())
    }

    /// Bytes a tensor of this type holds (0 when its element count overflows).
    pub fn size_bytes(&self) -> usize {
        self.checked_len().unwrap_or(0) * self.dtype.size_bytes()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, ShapeDisplay(&self.shape))
    }
}

/// Displays a shape as `[64, 784]`.
pub struct ShapeDisplay<'a>(pub &'a [usize]);

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Row-major strides of a shape, in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// A shape and its elements. The elements are shared: cloning a tensor is cheap, and
/// so is handing the same value to many readers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Arc<Data>,
}

/// `v` as the f32 whose last bit is set when rounding dropped anything ("round to
/// odd"): rounding that f32 again to a format at least two bits narrower (f16, bf16)
/// gives `v` correctly rounded, with no double-rounding error.
fn f32_round_to_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if !nearest.is_finite() || f64::from(nearest) == v {
        return nearest;
    }
    let bits = nearest.to_bits();
    // The same sign-magnitude bits one step toward zero when rounding went away from it.
    let toward_zero = if f64::from(nearest).abs() > v.abs() {
        bits - 1
    } else {
        bits
    };
    f32::from_bits(toward_zero | 1)
}

/// `v` correctly rounded to f16 (half's own f64 conversion drops the low 32 bits of
/// the mantissa before rounding, which can round a value past a midpoint wrongly).
pub fn f16_from_f64(v: f64) -> f16 {
    f16::from_f32(f32_round_to_odd(v))
}

/// `v` correctly rounded to bf16 (see [`f16_from_f64`]).
pub fn bf16_from_f64(v: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(v))
}

/// `$body` on the vector `$v` of whichever variant `$data` is (the same code for every
/// element type).
macro_rules! each_vector {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F16($v) => $body,
            Data::BF16($v) => $body,
            Data::F64($v) => $body,
            Data::I32($v) => $body,
            Data::I64($v) => $body,
            Data::Bool($v) => $body,
            Data::F8E4M3($v) => $body,
            Data::F8E5M2($v) => $body,
        }
    };
}

impl Data {
    /// The values as little-endian bytes (bools one byte each, 0 or 1): a device
    /// buffer's layout and a checkpoint's.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut bytes = vec![0; self.len() * self.dtype().size_bytes()];
        self.write_le_bytes(&mut bytes);
        bytes
    }

    /// [`to_le_bytes`](Self::to_le_bytes) without a copy where the host is
    /// little-endian (every value type here is plain bytes in memory: IEEE floats,
    /// two's complement integers, `half`'s 16-bit types, bools as one byte 0 or 1).
    pub fn le_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        if cfg!(target_endian = "big") {
            return std::borrow::Cow::Owned(self.to_le_bytes());
        }
        fn view<T: Copy>(v: &[T]) -> &[u8] {
            // SAFETY: T is one of Data's element types: no padding, every byte
            // initialised; the view borrows `v` and reads only.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        std::borrow::Cow::Borrowed(each_vector!(self, v => view(v)))
    }

    /// Writes [`to_le_bytes`](Self::to_le_bytes) into `out` (a staging buffer), which
    /// holds exactly that many bytes.
    pub fn write_le_bytes(&self, out: &mut [u8]) {
        fn each<const N: usize, T: Copy>(v: &[T], out: &mut [u8], f: impl Fn(T) -> [u8; N]) {
            debug_assert_eq!(out.len(), v.len() * N);
            for (o, &x) in out.chunks_exact_mut(N).zip(v) {
                o.copy_from_slice(&f(x));
            }
        }
        match self {
            Data::F32(v) => each(v, out, f32::to_le_bytes),
            Data::F16(v) => each(v, out, |x| x.to_bits().to_le_bytes()),
            Data::BF16(v) => each(v, out, |x| x.to_bits().to_le_bytes()),
            Data::F64(v) => each(v, out, f64::to_le_bytes),
            Data::I32(v) => each(v, out, i32::to_le_bytes),
            Data::I64(v) => each(v, out, i64::to_le_bytes),
            Data::Bool(v) => each(v, out, |b| [u8::from(b)]),
            Data::F8E4M3(v) => each(v, out, |x| [x.0]),
            Data::F8E5M2(v) => each(v, out, |x| [x.0]),
        }
    }

    /// The inverse of [`to_le_bytes`](Self::to_le_bytes): values of `dtype`, or why
    /// `bytes` are not such values (a partial value, a bool byte other than 0 or 1).
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Result<Data, String> {
        let size = dtype.size_bytes();
        if bytes.len() % size != 0 {
            return Err(format!(
                "{} bytes is not a whole number of {dtype} values",
                bytes.len()
            ));
        }
        fn each<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    f(a)
                })
                .collect()
        }
        Ok(match dtype {
            DType::F32 => Data::F32(each(bytes, f32::from_le_bytes)),
            DType::F16 => Data::F16(each(bytes, |b| f16::from_bits(u16::from_le_bytes(b)))),
            DType::BF16 => Data::BF16(each(bytes, |b| bf16::from_bits(u16::from_le_bytes(b)))),
            DType::F64 => Data::F64(each(bytes, f64::from_le_bytes)),
            DType::I32 => Data::I32(each(bytes, i32::from_le_bytes)),
            DType::I64 => Data::I64(each(bytes, i64::from_le_bytes)),
            DType::Bool => Data::Bool(
                bytes
                    .iter()
                    .map(|&b| match b {
                        0 => Ok(false),
                        1 => Ok(true),
                        _ => Err(format!("bool byte {b} is neither 0 nor 1")),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            DType::F8E4M3 => Data::F8E4M3(bytes.iter().map(|&b| F8E4M3(b)).collect()),
            DType::F8E5M2 => Data::F8E5M2(bytes.iter().map(|&b| F8E5M2(b)).collect()),
        })
    }
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::F64(_) => DType::F64,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::Bool(_) => DType::Bool,
            Data::F8E4M3(_) => DType::F8E4M3,
            Data::F8E5M2(_) => DType::F8E5M2,
        }
    }

    pub fn len(&self) -> usize {
        each_vector!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values rounded into `dtype` storage from f64 (ints truncate toward zero,
    /// bools are `v != 0`).
    pub fn from_f64(dtype: DType, values: impl IntoIterator<Item = f64>) -> Data {
        let it = values.into_iter();
        match dtype {
            DType::F32 => Data::F32(it.map(|v| v as f32).collect()),
            DType::F16 => Data::F16(it.map(f16_from_f64).collect()),
            DType::BF16 => Data::BF16(it.map(bf16_from_f64).collect()),
            DType::F64 => Data::F64(it.collect()),
            DType::I32 => Data::I32(it.map(|v| v as i32).collect()),
            DType::I64 => Data::I64(it.map(|v| v as i64).collect()),
            DType::Bool => Data::Bool(it.map(|v| v != 0.0).collect()),
            // Rounded to odd in f32 first, so that rounding that to far fewer bits gives
            // the f64 correctly rounded.
            DType::F8E4M3 | DType::F8E5M2 => {
                Data::from_f32(dtype, it.map(f32_round_to_odd).collect())
            }
        }
    }

    /// Values rounded into `dtype` storage from f32.
    pub fn from_f32(dtype: DType, values: Vec<f32>) -> Data {
        // half's slice conversions use the CPU's conversion instructions where present.
        match dtype {
            DType::F32 => Data::F32(values),
            DType::F16 => {
                let mut out = vec![f16::ZERO; values.len()];
                out.convert_from_f32_slice(&values);
                Data::F16(out)
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; values.len()];
                out.convert_from_f32_slice(&values);
                Data::BF16(out)
            }
            // Each as the GPU's `cvt.rn.satfinite` rounds it.
            DType::F8E4M3 => Data::F8E4M3(values.into_iter().map(F8E4M3::from_f32).collect()),
            DType::F8E5M2 => Data::F8E5M2(values.into_iter().map(F8E5M2::from_f32).collect()),
            other => Data::from_f64(other, values.into_iter().map(f64::from)),
        }
    }

    /// Every element widened (or, for i64 beyond 2^53, rounded) to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            Data::F64(v) => v.clone(),
            _ => self.iter_f64().collect(),
        }
    }

    /// [`Data::to_f64`]'s values one at a time, without a copy of the whole.
    pub fn iter_f64(&self) -> Box<dyn Iterator<Item = f64> + '_> {
        match self {
            Data::F32(v) => Box::new(v.iter().map(|&x| x as f64)),
            Data::F16(v) => Box::new(v.iter().map(|x| x.to_f64())),
            Data::BF16(v) => Box::new(v.iter().map(|x| x.to_f64())),
            Data::F64(v) => Box::new(v.iter().copied()),
            Data::I32(v) => Box::new(v.iter().map(|&x| x as f64)),
            Data::I64(v) => Box::new(v.iter().map(|&x| x as f64)),
            Data::Bool(v) => Box::new(v.iter().map(|&x| if x { 1.0 } else { 0.0 })),
            Data::F8E4M3(v) => Box::new(v.iter().map(|x| f64::from(x.to_f32()))),
            Data::F8E5M2(v) => Box::new(v.iter().map(|x| f64::from(x.to_f32()))),
        }
    }

    /// Every element as f32: the compute type of f32, f16 and bf16 kernels.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Data::F32(v) => v.clone(),
            Data::F16(v) => v.to_f32_vec(),
            Data::BF16(v) => v.to_f32_vec(),
            other => other.to_f64().into_iter().map(|x| x as f32).collect(),
        }
    }
}

impl Tensor {
    /// A tensor of `shape` holding `data`; the element count must match.
    pub fn new(shape: impl Into<Vec<usize>>, data: Data) -> Result<Tensor, String> {
        Tensor::shared(shape, Arc::new(data))
    }

    /// A tensor of `shape` sharing `data` (no copy); the element count must match.
    pub fn shared(shape: impl Into<Vec<usize>>, data: Arc<Data>) -> Result<Tensor, String> {
        let shape = shape.into();
        let numel = checked_numel(&shape).ok_or("shape overflows the address space")?;
        if numel != data.len() {
            return Err(format!(
                "shape {} has {numel} elements but {} values were given",
                ShapeDisplay(&shape),
                data.len()
            ));
        }
        Ok(Tensor { shape, data })
    }

    /// Zeros of the given type. The caller has checked that the size is sane.
    pub fn zeros(ty: &TensorType) -> Tensor {
        Tensor::full(ty, 0.0)
    }

    /// `value` (rounded to the dtype) everywhere in a tensor of type `ty`, made in the
    /// dtype directly (no f64 copy of every element). The caller has checked that the
    /// size is sane.
    pub fn full(ty: &TensorType, value: f64) -> Tensor {
        let n = ty.checked_len().unwrap_or(0);
        Tensor {
            shape: ty.shape.clone(),
            data: Arc::new(Data::from_f64(ty.dtype, std::iter::repeat_n(value, n))),
        }
    }

    pub fn from_f64(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        values: &[f64],
    ) -> Result<Tensor, String> {
        Tensor::new(shape, Data::from_f64(dtype, values.iter().copied()))
    }

    pub fn scalar(dtype: DType, value: f64) -> Tensor {
        Tensor {
            shape: vec![],
            data: Arc::new(Data::from_f64(dtype, [value])),
        }
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }

    /// Whether `other` is this tensor or a clone of it (one buffer, one shape): a check
    /// that costs nothing, where `==` compares every value.
    pub fn is_clone_of(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.data, &other.data) && self.shape == other.shape
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn data(&self) -> &Data {
        &self.data
    }

    /// The elements, copied only when another tensor shares them.
    pub fn into_data(self) -> Data {
        Arc::try_unwrap(self.data).unwrap_or_else(|shared| (*shared).clone())
    }

    /// The elements as shared with every clone of this tensor (no copy).
    pub fn into_shared_data(self) -> Arc<Data> {
        self.data
    }

    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.data.to_f64()
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.data.to_f32()
    }

    /// The same values with another shape of equal element count.
    pub fn reshaped(self, shape: Vec<usize>) -> Result<Tensor, String> {
        let n = checked_numel(&shape).ok_or("shape overflows the address space")?;
        if n != self.data.len() {
            return Err(format!(
                "cannot reshape {} values to {}",
                self.data.len(),
                ShapeDisplay(&shape)
            ));
        }
        Ok(Tensor {
            shape,
            data: self.data,
        })
    }

    /// Elementwise conversion, rounding to nearest (floats) or truncating (ints).
    pub fn cast(&self, to: DType) -> Tensor {
        if to == self.dtype() {
            return self.clone();
        }
        let data = if to == DType::F64 || self.dtype() == DType::F64 || !to.is_float() {
            Data::from_f64(to, self.data.to_f64())
        } else {
            Data::from_f32(to, self.data.to_f32())
        };
        Tensor {
            shape: self.shape.clone(),
            data: Arc::new(data),
        }
    }

    /// Integer view of an i32/i64 tensor (labels, indices).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        match &*self.data {
            Data::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            Data::I64(v) => Some(v.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod rounding_tests {
    use super::*;

    #[test]
    fn f64_rounds_to_16_bits_once() {
        // Just above the midpoint of two bf16 values, by less than f64's low 32 bits can
        // say: half's own conversion rounds it down, the correct result is up.
        let (lo, hi) = (212.0 * 2f64.powi(-13), 213.0 * 2f64.powi(-13));
        let mid = (lo + hi) / 2.0;
        let above = mid + 2f64.powi(-40);
        assert_eq!(bf16_from_f64(above).to_f64(), hi);
        assert_eq!(bf16_from_f64(mid - 2f64.powi(-40)).to_f64(), lo);
        // Ties go to even, exact values stay, specials pass through.
        assert_eq!(bf16_from_f64(mid).to_f64(), lo);
        assert_eq!(f16_from_f64(1.0 + 2f64.powi(-11)).to_f64(), 1.0);
        assert_eq!(
            f16_from_f64(1.0 + 2f64.powi(-11) + 2f64.powi(-45)).to_f64(),
            1.0 + 2f64.powi(-10)
        );
        assert_eq!(f16_from_f64(-0.25).to_f64(), -0.25);
        assert!(f16_from_f64(f64::NAN).is_nan());
        assert_eq!(f16_from_f64(1e6).to_f64(), f64::INFINITY);
        assert_eq!(bf16_from_f64(-1e300).to_f64(), f64::NEG_INFINITY);
        // An f32 value converts as f32's own conversion does.
        for x in [0.1f32, -3.3, 65519.0, 1e-7, -2.5e-39] {
            assert_eq!(f16_from_f64(f64::from(x)), f16::from_f32(x), "{x}");
            assert_eq!(bf16_from_f64(f64::from(x)), bf16::from_f32(x), "{x}");
        }
        // Tiny values round to odd in f32's subnormals, then correctly to 16 bits.
        assert_eq!(
            bf16_from_f64(1e-45).to_f64(),
            bf16::from_f32(1e-45).to_f64()
        );
    }
}

#[cfg(test)]
mod byte_tests {
    use super::*;

    /// The borrowed view is the layout `to_le_bytes` writes, for every dtype, and
    /// `from_le_bytes` reads it back.
    #[test]
    fn le_bytes_borrow_what_to_le_bytes_writes() {
        let values = [-2.5, 0.0, 1.0, 3.25, 65504.0, -1e-3];
        for dtype in DType::ALL {
            let t = Tensor::from_f64(dtype, vec![values.len()], &values).unwrap();
            let view = t.data().le_bytes();
            assert_eq!(&*view, &t.data().to_le_bytes()[..], "{dtype}");
            assert_eq!(
                &Data::from_le_bytes(dtype, &view).unwrap(),
                t.data(),
                "{dtype}"
            );
        }
    }
}
