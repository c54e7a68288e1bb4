//! Helpers for CPU reference kernels: the compute type and dtype dispatch.
//!
//! Float kernels are written once, generic over [`Real`]; [`eval_float`] runs them in
//! f64 for f64 tensors and in f32 for f32/f16/bf16 ones, rounding the result to the
//! storage dtype (one rounding per op, as a GPU kernel stores once).

use std::borrow::Cow;

use crate::dtype::DType;
use crate::op::OpResult;
use crate::tensor::{Data, Tensor};

/// The arithmetic type of float kernels: f32 or f64.
pub trait Real:
    num_traits::Float
    + num_traits::FloatConst
    + std::iter::Sum
    + Send
    + Sync
    + std::fmt::Debug
    + Default
    + 'static
{
    fn erf(self) -> Self;
    fn lit(x: f64) -> Self;
    /// The value in f64, exactly (long sums add there and round once).
    fn wide(self) -> f64 {
        self.to_f64().unwrap_or(f64::NAN)
    }
    /// The input tensor's values in this compute type.
    fn read(t: &Tensor) -> Cow<'_, [Self]>;
    /// Rounds the computed values into a tensor of `dtype`.
    fn store(dtype: DType, shape: Vec<usize>, values: Vec<Self>) -> OpResult<Tensor>;
}

impl Real for f32 {
    /// Eigen's rational approximation (as in TensorFlow's f32 kernels): at most
    /// 4.2e-7 from the true erf, branch-free and several times faster than libm.
    fn erf(self) -> Self {
        const ALPHA: [f32; 7] = [
            -2.726_142_3e-10,
            2.770_681_4e-8,
            -2.101_024e-6,
            -5.692_506_4e-5,
            -7.349_906_4e-4,
            -2.954_6e-3,
            -1.609_603_3e-2,
        ];
        const BETA: [f32; 5] = [
            -1.456_607_2e-5,
            -2.133_740_6e-4,
            -1.682_827e-3,
            -7.373_329e-3,
            -1.426_474e-2,
        ];
        if self.is_nan() {
            return self;
        }
        let x = self.clamp(-4.0, 4.0);
        let x2 = x * x;
        let p = ALPHA.iter().skip(1).fold(ALPHA[0], |acc, &c| acc * x2 + c) * x;
        let q = BETA.iter().skip(1).fold(BETA[0], |acc, &c| acc * x2 + c);
        p / q
    }
    fn lit(x: f64) -> Self {
        x as f32
    }
    fn read(t: &Tensor) -> Cow<'_, [f32]> {
        match t.data() {
            Data::F32(v) => Cow::Borrowed(v),
            d => Cow::Owned(d.to_f32()),
        }
    }
    fn store(dtype: DType, shape: Vec<usize>, values: Vec<f32>) -> OpResult<Tensor> {
        Tensor::new(shape, Data::from_f32(dtype, values))
    }
}

impl Real for f64 {
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn lit(x: f64) -> Self {
        x
    }
    fn read(t: &Tensor) -> Cow<'_, [f64]> {
        match t.data() {
            Data::F64(v) => Cow::Borrowed(v),
            d => Cow::Owned(d.to_f64()),
        }
    }
    fn store(dtype: DType, shape: Vec<usize>, values: Vec<f64>) -> OpResult<Tensor> {
        Tensor::new(shape, Data::from_f64(dtype, values))
    }
}

/// A float kernel written once for both compute types.
pub trait FloatKernel {
    /// Computes the outputs from the inputs, given in the compute type.
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>>;
}

/// Runs `kernel` in the compute type of `dtype` and stores every output as `dtype`.
pub fn eval_float<K: FloatKernel>(
    kernel: &K,
    dtype: DType,
    inputs: &[&Tensor],
) -> OpResult<Vec<Tensor>> {
    fn run<T: Real, K: FloatKernel>(
        k: &K,
        dtype: DType,
        inputs: &[&Tensor],
    ) -> OpResult<Vec<Tensor>> {
        k.compute::<T>(inputs)?
            .into_iter()
            .map(|(shape, values)| T::store(dtype, shape, values))
            .collect()
    }
    match dtype {
        DType::F64 => run::<f64, K>(kernel, dtype, inputs),
        DType::F32 | DType::F16 | DType::BF16 => run::<f32, K>(kernel, dtype, inputs),
        other => Err(format!("no float kernel for dtype {other}")),
    }
}

/// Requires a float dtype, naming the role of the tensor in the error.
pub fn require_float(what: &str, dtype: DType) -> OpResult<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a float tensor, got {dtype}"))
    }
}

/// Requires every input to share one dtype and returns it.
pub fn same_dtype(types: &[&crate::tensor::TensorType]) -> OpResult<DType> {
    let first = types.first().ok_or("no inputs")?.dtype;
    for (i, t) in types.iter().enumerate().skip(1) {
        if t.dtype != first {
            return Err(format!("input {i} is {} but input 0 is {first}", t.dtype));
        }
    }
    Ok(first)
}

/// Below this many elements an elementwise kernel runs on one thread: splitting
/// smaller work costs more than it saves.
const PARALLEL_MIN: usize = 1 << 15;

/// `out[i] = f(i)` for `i` in `0..n`, split over the cores when `n` is large.
pub fn par_fill<U: Send>(n: usize, f: impl Fn(usize) -> U + Sync + Send) -> Vec<U> {
    use rayon::prelude::*;
    if n < PARALLEL_MIN {
        (0..n).map(f).collect()
    } else {
        (0..n).into_par_iter().map(f).collect()
    }
}
