//! Normalisation ops: BatchNorm (TensorFlow's FusedBatchNormV3) and LayerNorm.
//!
//! Statistics accumulate in the compute type (f32 for f16/bf16/f32, f64 for f64) and
//! every output is rounded once on store.

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::ops::fused::column_sum_of;
use crate::ops::types_of;
use crate::ops::{widens_exactly, Binary, BinaryKind, DataFormat, Unary, UnaryGrad, UnaryKind};
use crate::shape::normalize_axis;
use crate::tensor::{ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "BatchNorm",
        parse: |_, a| Ok(Box::new(BatchNorm::parse(a)?)),
    },
    OpEntry {
        name: "LayerNorm",
        parse: |_, a| Ok(Box::new(LayerNorm::parse(a)?)),
    },
    OpEntry {
        name: "BatchNormGrad",
        parse: |_, a| Ok(Box::new(BatchNormGrad::parse(a)?)),
    },
    OpEntry {
        name: "LayerNormGrad",
        parse: |_, a| Ok(Box::new(LayerNormGrad::parse(a)?)),
    },
];

fn read_epsilon(a: &mut AttrReader, default: f64) -> OpResult<f64> {
    let eps = a.float_or("epsilon", default)?;
    if eps < 0.0 {
        return Err(format!("attr 'epsilon' must be non-negative, got {eps}"));
    }
    Ok(eps)
}

/// The activation a batch norm applies to its output, TensorFlow's
/// `_FusedBatchNormEx` `activation_mode` (attr `activation_mode`, written only when not
/// `Identity`): `fuse-batchnorm-activation` folds a following Relu in, so the
/// normalised values and their ReLU are one pass over memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormActivation {
    #[default]
    Identity,
    Relu,
}

impl NormActivation {
    fn read(a: &mut AttrReader) -> OpResult<NormActivation> {
        a.choice(
            "activation_mode",
            &[
                ("Identity", NormActivation::Identity),
                ("Relu", NormActivation::Relu),
            ],
            Some(NormActivation::Identity),
        )
    }

    /// The attribute, where it is not the default.
    fn attr(self) -> Option<(&'static str, AttrValue)> {
        match self {
            NormActivation::Identity => None,
            NormActivation::Relu => Some(("activation_mode", AttrValue::Str("Relu".into()))),
        }
    }

    /// The activation of `y`, as the Unary op computes it.
    fn apply<T: Real>(self, y: T) -> T {
        match self {
            NormActivation::Identity => y,
            NormActivation::Relu => y.max(T::zero()),
        }
    }
}

/// Batch normalisation over every axis but the channel axis, as TensorFlow's
/// `FusedBatchNormV3`.
///
/// Inputs: `x` (rank 4 in `data_format`, or rank 2 `[N, C]`), then `scale`, `offset`,
/// `mean`, `variance`, each `[C]` of one float dtype U: f32 when `x` is f16, bf16 or
/// f32, f64 when `x` is f64. Outputs: `y` (x's dtype), `batch_mean` and
/// `batch_variance` (U).
///
/// - `training = false`: `y` normalises with the given `mean` and `variance`, which
///   are passed through as `batch_mean` and `batch_variance`.
/// - `training = true`: `y` normalises with the batch mean and the biased batch
///   variance; `batch_mean` is the batch mean and `batch_variance` the batch variance
///   with Bessel's correction (`n / (n - 1)`, n the count per channel; unchanged when
///   n = 1), as TensorFlow outputs it for the running averages. In training the
///   `mean` and `variance` inputs are not read and may also be empty (`[0]`).
///
/// With `activation = Relu`, `y` is the ReLU of the normalised values.
///
/// An optional sixth input `side` (x's type and shape), TensorFlow's
/// `_FusedBatchNormEx` side input (a residual connection), is added to the normalised
/// values before the activation: `y = act(round(round(norm(x)) + side))`, each rounding
/// to x's dtype, so that the op equals the BatchNorm, Add and Relu it replaces bit for
/// bit. Its gradient is the activation's gradient of `dy` (by `y`), both for `side`
/// and as the `dy` of an identity BatchNormGrad.
///
/// `sync_replicas` (attr, written only when not 0; inference form only): `mean` and
/// `variance` are this batch's own statistics over `sync_replicas` replicas' equal
/// shards (the synchronised batch norm's, `passes::sync_batch_norm`), so the gradient
/// of `x` also takes their terms, as a training batch norm's does, with the sums
/// all-reduced: `dx = a * (dy - mean(dy) - xhat * mean(dy * xhat))`, the means over the
/// global batch. The statistics themselves get no gradient (nor do they with 0, where
/// they are running averages).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNorm {
    pub epsilon: f64,
    pub training: bool,
    pub data_format: DataFormat,
    pub activation: NormActivation,
    pub sync_replicas: usize,
}

/// Per channel, the mean of `f(channel, x)` over `xs` laid out `[outer, c, inner]`,
/// added in f64 and rounded once.
fn channel_means<T: Real>(
    xs: &[T],
    (outer, c, inner): (usize, usize, usize),
    f: impl Fn(usize, T) -> f64,
) -> Vec<T> {
    let mut sums = vec![0f64; c];
    for o in 0..outer {
        for (ch, acc) in sums.iter_mut().enumerate() {
            let base = (o * c + ch) * inner;
            *acc += xs[base..base + inner]
                .iter()
                .map(|&v| f(ch, v))
                .sum::<f64>();
        }
    }
    let n = (outer * inner) as f64;
    sums.into_iter().map(|s| T::lit(s / n)).collect()
}

impl Default for BatchNorm {
    fn default() -> Self {
        BatchNorm {
            epsilon: 0.001,
            training: false,
            data_format: DataFormat::Nhwc,
            activation: NormActivation::Identity,
            sync_replicas: 0,
        }
    }
}

impl BatchNorm {
    fn parse(a: &mut AttrReader) -> OpResult<BatchNorm> {
        let bn = BatchNorm {
            epsilon: read_epsilon(a, 0.001)?,
            training: a.bool_or("training", false)?,
            data_format: DataFormat::read(a)?,
            activation: NormActivation::read(a)?,
            sync_replicas: match a.opt_int("sync_replicas")? {
                None => 0,
                Some(n) => usize::try_from(n)
                    .map_err(|_| format!("attr 'sync_replicas' must be a count, got {n}"))?,
            },
        };
        if bn.training && bn.sync_replicas > 0 {
            return Err("attr 'sync_replicas' goes with training false (given statistics)".into());
        }
        Ok(bn)
    }

    /// The channel axis of `x` of the given rank (2 or 4).
    pub fn channel_axis(&self, rank: usize) -> usize {
        match (rank, self.data_format) {
            (4, DataFormat::Nchw) => 1,
            _ => rank.saturating_sub(1),
        }
    }

    /// The input slots of x's type: x, and the side input where there is one.
    fn images(num_inputs: usize) -> Vec<usize> {
        if num_inputs > 5 {
            vec![0, 5]
        } else {
            vec![0]
        }
    }

    /// The statistics' dtype U for an `x` of `dtype`.
    fn stats_dtype(dtype: DType) -> DType {
        if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// The outputs, `y` before the activation where `activation` is Identity.
    fn compute<T: Real>(
        &self,
        inputs: &[&Tensor],
        activation: NormActivation,
    ) -> OpResult<[Vec<T>; 3]> {
        let [x, scale, offset, mean, variance] = fixed(&inputs[..5])?;
        let shape = x.shape();
        let axis = self.channel_axis(shape.len());
        let c = shape.get(axis).copied().ok_or("x has no channel axis")?;
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let xs = T::read(x);
        let scale = T::read(scale);
        let offset = T::read(offset);
        let (m, v, out_m, out_v) = if self.training {
            let count = outer * inner;
            // The statistics add in f64 and round once: a channel of a large batch has
            // millions of elements, past where an f32 running sum keeps its terms.
            let dims = (outer, c, inner);
            let m = channel_means(&xs, dims, |_, val| val.wide());
            let v = channel_means(&xs, dims, |ch, val| (val - m[ch]).wide().powi(2));
            let adjust = if count > 1 {
                T::lit(count as f64 / (count - 1) as f64)
            } else {
                T::one()
            };
            let unbiased = v.iter().map(|&s| s * adjust).collect();
            (m.clone(), v, m, unbiased)
        } else {
            let m = T::read(mean).into_owned();
            let v = T::read(variance).into_owned();
            (m.clone(), v.clone(), m, v)
        };
        let eps = T::lit(self.epsilon);
        // y = x * a + b per channel, a = scale / sqrt(var + eps), b = offset - mean * a.
        let a: Vec<T> = (0..c).map(|ch| scale[ch] / (v[ch] + eps).sqrt()).collect();
        let b: Vec<T> = (0..c).map(|ch| offset[ch] - m[ch] * a[ch]).collect();
        let y = xs
            .iter()
            .enumerate()
            .map(|(i, &val)| {
                let ch = (i / inner.max(1)) % c.max(1);
                activation.apply(val * a[ch] + b[ch])
            })
            .collect();
        Ok([y, out_m, out_v])
    }

    fn run<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let x = inputs.first().ok_or("missing input x")?;
        let c = x
            .shape()
            .get(self.channel_axis(x.shape().len()))
            .copied()
            .unwrap_or(0);
        let u = Self::stats_dtype(x.dtype());
        let shape = x.shape().to_vec();
        let (y, m, v) = match inputs.get(5) {
            None => {
                let [y, m, v] = self.compute::<T>(inputs, self.activation)?;
                (T::store(x.dtype(), shape, y)?, m, v)
            }
            Some(side) => {
                let [y, m, v] = self.compute::<T>(inputs, NormActivation::Identity)?;
                let y = T::store(x.dtype(), shape.clone(), y)?;
                let sum = (T::read(&y).iter().zip(T::read(side).iter()))
                    .map(|(&y, &s)| y + s)
                    .collect();
                let sum = T::store(x.dtype(), shape.clone(), sum)?;
                let y = (T::read(&sum).iter())
                    .map(|&v| self.activation.apply(v))
                    .collect();
                (T::store(x.dtype(), shape, y)?, m, v)
            }
        };
        Ok(vec![y, T::store(u, vec![c], m)?, T::store(u, vec![c], v)?])
    }
}

impl Op for BatchNorm {
    fn name(&self) -> &'static str {
        "BatchNorm"
    }
    fn arity(&self) -> Arity {
        Arity::AtLeast(5)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![
            ("epsilon", self.epsilon.into()),
            ("training", self.training.into()),
            ("data_format", self.data_format.into()),
        ];
        attrs.extend(self.activation.attr());
        if self.sync_replicas > 0 {
            attrs.push(("sync_replicas", (self.sync_replicas as i64).into()));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        if inputs.len() > 6 {
            return Err(format!(
                "expected 5 inputs and an optional side input, got {}",
                inputs.len()
            ));
        }
        let [x, scale, offset, mean, variance] = fixed(&inputs[..inputs.len().min(5)])?;
        require_float("x", x.dtype)?;
        if let Some(side) = inputs.get(5) {
            if side != x {
                return Err(format!("the side input is {side} but must be x's type {x}"));
            }
        }
        if x.rank() != 4 && x.rank() != 2 {
            return Err(format!(
                "x must have rank 4 ({}) or rank 2 [N, C], got shape {}",
                match self.data_format {
                    DataFormat::Nhwc => "NHWC",
                    DataFormat::Nchw => "NCHW",
                },
                ShapeDisplay(&x.shape)
            ));
        }
        let c = x.shape[self.channel_axis(x.rank())];
        let u = Self::stats_dtype(x.dtype);
        for (what, t) in [
            ("scale", scale),
            ("offset", offset),
            ("mean", mean),
            ("variance", variance),
        ] {
            if t.dtype != u {
                return Err(format!(
                    "{what} is {} but must be {u} when x is {}",
                    t.dtype, x.dtype
                ));
            }
            let empty_ok = self.training && matches!(what, "mean" | "variance");
            if t.shape != [c] && !(empty_ok && t.shape == [0]) {
                return Err(format!(
                    "{what} has shape {} but x {} has {c} channels (expected [{c}])",
                    ShapeDisplay(&t.shape),
                    ShapeDisplay(&x.shape)
                ));
            }
        }
        Ok(vec![
            (*x).clone(),
            TensorType::new(u, [c]),
            TensorType::new(u, [c]),
        ])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        self.infer(&types.iter().collect::<Vec<_>>())?;
        match inputs[0].dtype() {
            DType::F64 => self.run::<f64>(inputs),
            _ => self.run::<f32>(inputs),
        }
    }
    /// Only `x` (and the side input) follow the compute type; the statistics keep
    /// theirs (f32 under AMP).
    fn typed_inputs(&self, num_inputs: usize) -> Vec<usize> {
        Self::images(num_inputs)
    }
    /// TensorFlow's T (x, the side input, y) and U (the statistics in and out, never
    /// 16-bit).
    fn type_groups(&self, num_inputs: usize, _num_outputs: usize) -> Vec<TypeGroup> {
        vec![
            TypeGroup::new(Self::images(num_inputs), vec![0]),
            TypeGroup::new(vec![1, 2, 3, 4], vec![1, 2]).fixed(),
        ]
    }
    /// One [`BatchNormGrad`] node gives dx, dscale and doffset. In training it reads
    /// the batch statistics the forward computed (outputs 1 and 2); in inference the
    /// given `mean` and `variance`, which get no gradient (as in TensorFlow: they are
    /// running averages, not trained).
    ///
    /// The gradients of outputs 1 and 2 (the batch statistics, which feed the running
    /// averages and not the loss) are ignored, as TensorFlow's `FusedBatchNorm`
    /// gradient ignores them. With an activation the gradient also reads `offset`.
    ///
    /// With a side input, the activation's gradient (by `y`) is the side input's
    /// gradient and the `dy` of an identity BatchNormGrad.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (&[x, scale, offset, mean, variance], Some(&Some(dy))) =
            (&inputs[..inputs.len().min(5)], grads.first())
        else {
            return Ok(vec![None; inputs.len()]);
        };
        let (mean, variance) = match (self.training, outputs) {
            (true, &[_, batch_mean, batch_variance]) => (batch_mean, batch_variance),
            (true, _) => return Err(GraphError::Format("BatchNorm has 3 outputs".into())),
            (false, _) => (mean, variance),
        };
        let side = inputs.len() > 5;
        let (activation, dy) = match (side, self.activation) {
            (true, NormActivation::Relu) => {
                let y = *outputs
                    .first()
                    .ok_or_else(|| GraphError::Format("BatchNorm has 3 outputs".into()))?;
                let mask = UnaryGrad {
                    kind: UnaryKind::Relu,
                };
                (
                    NormActivation::Identity,
                    b.add_node(Box::new(mask), &[y, dy])?.into(),
                )
            }
            (true, NormActivation::Identity) => (NormActivation::Identity, dy),
            (false, activation) => (activation, dy),
        };
        let grad = BatchNormGrad {
            epsilon: self.epsilon,
            training: self.training,
            data_format: self.data_format,
            activation,
        };
        let mut operands = vec![x, scale, mean, variance, dy];
        if activation != NormActivation::Identity {
            operands.push(offset);
        }
        let id = b.add_node(Box::new(grad), &operands)?;
        let (dscale, doffset) = (Port::new(id, 1), Port::new(id, 2));
        let mut dx = Port::new(id, 0);
        if self.sync_replicas > 0 && !self.training {
            let stats = Statistics {
                x,
                scale,
                mean,
                variance,
            };
            dx = self.global_terms(b, stats, dx, dscale, doffset)?;
        }
        let mut grads = vec![Some(dx), Some(dscale), Some(doffset), None, None];
        if side {
            grads.push(Some(dy));
        }
        Ok(grads)
    }
}

/// The ports a synchronised batch norm's gradient reads: `x`, `scale` and the
/// global `mean` and `variance` it normalised by.
struct Statistics {
    x: Port,
    scale: Port,
    mean: Port,
    variance: Port,
}

impl BatchNorm {
    /// `dx` of a synchronised batch norm from its inference-form gradient `local =
    /// a * dy` and the replica's sums `dscale = sum dy * xhat`, `doffset = sum dy`: with
    /// their means over the replicas `S` and `O` (one AllReduce of both) and `n` values
    /// a channel in each replica, `dx = local - a * O / n - (x - mean) * a * inv * S /
    /// n`, `a = scale * inv`, `inv = 1 / sqrt(variance + eps)`: the training form's
    /// gradient with the global batch's means of `dy` and `dy * xhat`.
    fn global_terms(
        &self,
        b: &mut GradBuilder,
        at: Statistics,
        local: Port,
        dscale: Port,
        doffset: Port,
    ) -> Result<Port, GraphError> {
        let xt = b.ty(at.x).clone();
        let u = b.ty(at.variance).dtype;
        let axis = self.channel_axis(xt.rank());
        let channels = xt.shape[axis];
        let count = xt.shape.iter().product::<usize>() / channels.max(1);
        let sums = b.add_node(
            Box::new(crate::ops::AllReduce::mean(self.sync_replicas)),
            &[dscale, doffset],
        )?;
        let (dscale, doffset) = (Port::new(sums, 0), Port::new(sums, 1));
        let epsilon = b.scalar(u, self.epsilon)?;
        let shifted = b.binary(BinaryKind::Add, at.variance, epsilon)?;
        let inv = b.add(Unary::new(UnaryKind::Rsqrt), &[shifted])?;
        let a = b.binary(BinaryKind::Mul, at.scale, inv)?;
        let minus_a_n = b.scalar(u, -1.0 / count.max(1) as f64)?;
        let minus_a_n = b.binary(BinaryKind::Mul, a, minus_a_n)?;
        let shift = b.binary(BinaryKind::Mul, minus_a_n, doffset)?;
        let slope = b.binary(BinaryKind::Mul, minus_a_n, inv)?;
        let slope = b.binary(BinaryKind::Mul, slope, dscale)?;
        // [C] along the channel axis of x, in x's dtype.
        let along = |b: &mut GradBuilder, v: Port| -> Result<Port, GraphError> {
            let v = match xt.dtype == u {
                true => v,
                false => b.add(crate::ops::Cast { to: xt.dtype }, &[v])?,
            };
            match (xt.rank(), axis) {
                (4, 1) => b.add(
                    crate::ops::Reshape::new(vec![1, channels as i64, 1, 1]),
                    &[v],
                ),
                _ => Ok(v),
            }
        };
        let (mean, slope, shift) = (along(b, at.mean)?, along(b, slope)?, along(b, shift)?);
        let centred = b.binary(BinaryKind::Sub, at.x, mean)?;
        let sloped = b.binary(BinaryKind::Mul, centred, slope)?;
        let terms = b.binary(BinaryKind::Add, sloped, shift)?;
        b.binary(BinaryKind::Add, local, terms)
    }
}

/// The gradient of [`BatchNorm`], TensorFlow's `FusedBatchNormGradV3`: inputs `x`,
/// `scale`, `mean`, `variance` and `dy` (x's type); outputs `dx` (x's type), `dscale`
/// and `doffset` (`[C]`, the statistics' dtype U as in BatchNorm).
///
/// - `training = true`: `mean` and `variance` are the forward's `batch_mean` and
///   `batch_variance` outputs (the variance with Bessel's correction, which the kernel
///   undoes); with `xhat = (x - mean) / sqrt(var + eps)` per channel over its n
///   elements: `doffset = sum dy`, `dscale = sum dy * xhat`,
///   `dx = scale / sqrt(var + eps) * (dy - doffset / n - xhat * dscale / n)`.
/// - `training = false`: `mean` and `variance` are the forward's inputs and
///   `dx = dy * scale / sqrt(variance + eps)` (dscale and doffset as above).
///
/// With `activation = Relu` (the gradient of a BatchNorm with that activation,
/// TensorFlow's `_FusedBatchNormGradEx`) a sixth input `offset`, the forward's (`[C]`,
/// U), masks `dy` first: the gradient of the normalised values is `dy` where the
/// forward's pre-activation `(x - mean) * a + offset` is positive, with
/// `a = scale / sqrt(var + eps)` as above, else 0. TensorFlow's op reads the forward's
/// output `y` for the mask; recomputing it from `x` spares reading `y` in each of the
/// gradient's two passes over memory. The two masks differ only where the
/// pre-activation is within rounding of 0, where either is a gradient of the ReLU.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNormGrad {
    pub epsilon: f64,
    pub training: bool,
    pub data_format: DataFormat,
    pub activation: NormActivation,
}

impl BatchNormGrad {
    fn parse(a: &mut AttrReader) -> OpResult<BatchNormGrad> {
        Ok(BatchNormGrad {
            epsilon: read_epsilon(a, 0.001)?,
            training: a.bool_or("training", true)?,
            data_format: DataFormat::read(a)?,
            activation: NormActivation::read(a)?,
        })
    }

    fn forward(&self) -> BatchNorm {
        BatchNorm {
            epsilon: self.epsilon,
            training: self.training,
            data_format: self.data_format,
            activation: self.activation,
            ..BatchNorm::default()
        }
    }

    /// Inputs: 5, and `offset` with an activation.
    fn inputs(&self) -> usize {
        match self.activation {
            NormActivation::Identity => 5,
            NormActivation::Relu => 6,
        }
    }

    /// Checks the input types; returns x's type and the channel count.
    fn check(&self, inputs: &[&TensorType]) -> OpResult<(TensorType, usize)> {
        if inputs.len() != self.inputs() {
            return Err(format!(
                "expected {} inputs, got {}",
                self.inputs(),
                inputs.len()
            ));
        }
        let [x, scale, mean, variance, dy] = fixed(&inputs[..5])?;
        require_float("x", x.dtype)?;
        if x.rank() != 4 && x.rank() != 2 {
            return Err(format!(
                "x must have rank 4 ({}) or rank 2 [N, C], got shape {}",
                match self.data_format {
                    DataFormat::Nhwc => "NHWC",
                    DataFormat::Nchw => "NCHW",
                },
                ShapeDisplay(&x.shape)
            ));
        }
        if *dy != *x {
            return Err(format!("dy is {dy} but must match x {x}"));
        }
        let c = x.shape[self.forward().channel_axis(x.rank())];
        let u = BatchNorm::stats_dtype(x.dtype);
        let offset = inputs.get(5).map(|t| ("offset", t));
        let stats = [("scale", scale), ("mean", mean), ("variance", variance)];
        for (what, t) in stats.into_iter().chain(offset) {
            if t.dtype != u {
                return Err(format!(
                    "{what} is {} but must be {u} when x is {}",
                    t.dtype, x.dtype
                ));
            }
            if t.shape != [c] {
                return Err(format!(
                    "{what} has shape {} but x {} has {c} channels (expected [{c}])",
                    ShapeDisplay(&t.shape),
                    ShapeDisplay(&x.shape)
                ));
            }
        }
        Ok(((*x).clone(), c))
    }

    fn run<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let x = inputs.first().ok_or("missing input x")?;
        let u = BatchNorm::stats_dtype(x.dtype());
        let mut outs = self.compute::<T>(inputs)?.into_iter();
        let mut store = |dtype| match outs.next() {
            Some((shape, values)) => T::store(dtype, shape, values),
            None => Err("internal: missing output".to_string()),
        };
        Ok(vec![store(x.dtype())?, store(u)?, store(u)?])
    }
}

impl FloatKernel for BatchNormGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, scale, mean, variance, dy] = fixed(&inputs[..inputs.len().min(5)])?;
        let shape = x.shape();
        let axis = self.forward().channel_axis(shape.len());
        let c = shape.get(axis).copied().ok_or("x has no channel axis")?;
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let (xs, dys) = (T::read(x), T::read(dy));
        let (scale, mean, var) = (T::read(scale), T::read(mean), T::read(variance));
        if xs.len() != dys.len() || [scale.len(), mean.len(), var.len()] != [c; 3] {
            return Err("the inputs' shapes disagree".into());
        }
        let count = outer * inner;
        let n = T::lit(count as f64);
        // The biased variance the forward normalised with.
        let unbias = if self.training && count > 1 {
            T::lit((count - 1) as f64 / count as f64)
        } else {
            T::one()
        };
        let eps = T::lit(self.epsilon);
        let inv: Vec<T> = var
            .iter()
            .map(|&v| T::one() / (v * unbias + eps).sqrt())
            .collect();
        let channel = |i: usize| (i / inner.max(1)) % c.max(1);
        let dys: Vec<T> = match inputs.get(5) {
            // The ReLU's gradient: dy where the pre-activation was positive, else 0.
            Some(offset) => {
                let offset = T::read(offset);
                if offset.len() != c {
                    return Err("the inputs' shapes disagree".into());
                }
                let mask = |i: usize, xv: T| {
                    let ch = channel(i);
                    (xv - mean[ch]) * (scale[ch] * inv[ch]) + offset[ch] > T::zero()
                };
                (xs.iter().zip(dys.iter()).enumerate())
                    .map(|(i, (&xv, &g))| if mask(i, xv) { g } else { T::zero() })
                    .collect()
            }
            None => dys.to_vec(),
        };
        // Sums in f64, rounded once (as the statistics).
        let (mut sum_dy, mut sum_dy_xc) = (vec![0f64; c], vec![0f64; c]);
        for (i, (&xv, &g)) in xs.iter().zip(dys.iter()).enumerate() {
            let ch = channel(i);
            sum_dy[ch] += g.wide();
            sum_dy_xc[ch] += (g * (xv - mean[ch])).wide();
        }
        let sum_dy: Vec<T> = sum_dy.into_iter().map(T::lit).collect();
        let sum_dy_xc: Vec<T> = sum_dy_xc.into_iter().map(T::lit).collect();
        let dscale: Vec<T> = (0..c).map(|ch| sum_dy_xc[ch] * inv[ch]).collect();
        let dx = xs
            .iter()
            .zip(dys.iter())
            .enumerate()
            .map(|(i, (&xv, &g))| {
                let ch = channel(i);
                let a = scale[ch] * inv[ch];
                if self.training {
                    let xc = xv - mean[ch];
                    a * (g - sum_dy[ch] / n - xc * inv[ch] * inv[ch] * sum_dy_xc[ch] / n)
                } else {
                    a * g
                }
            })
            .collect();
        Ok(vec![
            (shape.to_vec(), dx),
            (vec![c], dscale),
            (vec![c], sum_dy),
        ])
    }
}

impl Op for BatchNormGrad {
    fn name(&self) -> &'static str {
        "BatchNormGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(self.inputs())
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.forward().attrs()
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (x, c) = self.check(inputs)?;
        let u = BatchNorm::stats_dtype(x.dtype);
        Ok(vec![x, TensorType::new(u, [c]), TensorType::new(u, [c])])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        self.check(&types.iter().collect::<Vec<_>>())?;
        match inputs[0].dtype() {
            DType::F64 => self.run::<f64>(inputs),
            _ => self.run::<f32>(inputs),
        }
    }
    /// `x` and `dy` follow the compute type; the statistics keep theirs.
    fn typed_inputs(&self, _num_inputs: usize) -> Vec<usize> {
        vec![0, 4]
    }
    /// As BatchNorm: T (x, dy, dx) and U (scale, statistics and offset, dscale and
    /// doffset; never 16-bit).
    fn type_groups(&self, num_inputs: usize, _num_outputs: usize) -> Vec<TypeGroup> {
        let stats = [1, 2, 3, 5]
            .into_iter()
            .filter(|&i| i < num_inputs)
            .collect();
        vec![
            TypeGroup::new(self.typed_inputs(num_inputs), vec![0]),
            TypeGroup::new(stats, vec![1, 2]).fixed(),
        ]
    }
}

/// Layer normalisation over the trailing dims `axis..rank` of `x`, with `gamma` and
/// `beta` of shape `x.shape[axis..]` and x's dtype:
/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` (biased variance).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub axis: i64,
    pub epsilon: f64,
    /// The output's dtype when it is not gamma's (attr `to`): a Cast of the output
    /// folded in, the result rounded once as the Cast rounded it.
    pub to: Option<DType>,
}

impl Default for LayerNorm {
    fn default() -> Self {
        LayerNorm {
            axis: -1,
            epsilon: 1e-5,
            to: None,
        }
    }
}

impl LayerNorm {
    fn parse(a: &mut AttrReader) -> OpResult<LayerNorm> {
        LayerNorm::parse_with_to(a, "to")
    }

    /// Its attrs, the output dtype's under the name `to` (an op holding a LayerNorm
    /// beside attrs of its own names it otherwise).
    pub(crate) fn parse_with_to(a: &mut AttrReader, to: &str) -> OpResult<LayerNorm> {
        Ok(LayerNorm {
            axis: a.opt_int("axis")?.unwrap_or(-1),
            epsilon: read_epsilon(a, 1e-5)?,
            to: a.opt_dtype(to)?,
        })
    }

    /// Its attrs as [`LayerNorm::parse_with_to`] reads them.
    pub(crate) fn attrs_with_to(&self, to: &'static str) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![("axis", self.axis.into()), ("epsilon", self.epsilon.into())];
        if let Some(dtype) = self.to {
            attrs.push((to, AttrValue::Str(dtype.to_string())));
        }
        attrs
    }
}

/// The dtype a normalisation computes in: gamma's. `x` (and LayerNormGrad's `dy`)
/// may be narrower when that type holds every value of it (a widening Cast folded in:
/// the kernel reads the narrow tensor and widens it as the Cast did).
fn norm_dtype(what: &str, dtype: DType, params: DType) -> OpResult<()> {
    require_float(what, dtype)?;
    if widens_exactly(dtype, params) {
        Ok(())
    } else {
        Err(format!(
            "{what} is {dtype} but gamma is {params}: {what} must be gamma's dtype or one it widens from exactly"
        ))
    }
}

impl FloatKernel for LayerNorm {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, gamma, beta] = fixed(inputs)?;
        let shape = x.shape();
        let axis = normalize_axis(self.axis, shape.len())?;
        let len: usize = shape[axis..].iter().product();
        let xs = T::read(x);
        let gamma = T::read(gamma);
        let beta = T::read(beta);
        if gamma.len() != len || beta.len() != len {
            return Err("gamma and beta must match x.shape[axis..]".into());
        }
        let n = T::lit(len as f64);
        let eps = T::lit(self.epsilon);
        let mut y = Vec::with_capacity(xs.len());
        if len > 0 {
            for row in xs.chunks(len) {
                let mean = row.iter().copied().sum::<T>() / n;
                let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
                let inv = T::one() / (var + eps).sqrt();
                y.extend(
                    row.iter()
                        .zip(gamma.iter().zip(beta.iter()))
                        .map(|(&v, (&g, &b))| (v - mean) * inv * g + b),
                );
            }
        }
        Ok(vec![(shape.to_vec(), y)])
    }
}

impl Op for LayerNorm {
    fn name(&self) -> &'static str {
        "LayerNorm"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.attrs_with_to("to")
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, gamma, beta] = fixed(inputs)?;
        let dtype = same_dtype(&[gamma, beta])?;
        require_float("gamma", dtype)?;
        norm_dtype("x", x.dtype, dtype)?;
        let out = self.to.unwrap_or(dtype);
        require_float("to", out)?;
        let axis = normalize_axis(self.axis, x.rank())?;
        let want = &x.shape[axis..];
        for (what, t) in [("gamma", gamma), ("beta", beta)] {
            if t.shape != want {
                return Err(format!(
                    "{what} has shape {} but must be {} (x {} from axis {axis})",
                    ShapeDisplay(&t.shape),
                    ShapeDisplay(want),
                    ShapeDisplay(&x.shape)
                ));
            }
        }
        Ok(vec![TensorType::new(out, x.shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        let out = self.infer(&types.iter().collect::<Vec<_>>())?[0].dtype;
        let y = eval_float(self, inputs[1].dtype(), inputs)?;
        // A folded output Cast rounds as the Cast did.
        Ok(y.into_iter()
            .map(|y| if y.dtype() == out { y } else { y.cast(out) })
            .collect())
    }
    /// One [`LayerNormGrad`] node gives dx, dgamma and dbeta.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (&[x, gamma, _beta], Some(&Some(dy))) = (inputs, grads.first()) else {
            return Ok(vec![None; inputs.len()]);
        };
        let grad = LayerNormGrad::new(self.axis, self.epsilon);
        let id = b.add_node(Box::new(grad), &[x, gamma, dy])?;
        Ok((0..3).map(|k| Some(Port::new(id, k))).collect())
    }
}

/// The gradient of [`LayerNorm`]: inputs `x`, `gamma` and `dy` (gamma's float dtype,
/// or for `x` and `dy` one it widens from exactly); outputs `dx` (x's shape),
/// `dgamma` and `dbeta` (gamma's shape), all in gamma's dtype. Per normalised row
/// of L elements, with `xhat = (x - mean) / sqrt(var + eps)` and `g = dy * gamma`:
/// `dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps)`; `dgamma` sums
/// `dy * xhat` and `dbeta` sums `dy` over the rows.
///
/// With an [`NormGradEpilogue`] (fused by the `norm-grad-epilogue` pass) it also adds
/// a fourth input to dx and outputs column sums after dbeta.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormGrad {
    pub axis: i64,
    pub epsilon: f64,
    pub epilogue: NormGradEpilogue,
}

/// What a [`LayerNormGrad`] does past dx, dgamma and dbeta. In a pre-LN transformer
/// each norm's dx is added to the gradient arriving along the residual branch, and
/// that sum's column sums are a bias gradient: one pass over the rows does it all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NormGradEpilogue {
    /// A fourth input `r` (x's shape, dx's dtype): output 0 is `Add(dx, r)`, with dx
    /// rounded to its dtype first, as the Add read it (attr `residual`).
    pub residual: bool,
    /// One more output: output 0's column sums (attr `sum_dx`).
    pub sum_dx: bool,
    /// One more output, after `sum_dx`'s: the residual's column sums (attr
    /// `sum_residual`).
    pub sum_residual: bool,
}

impl NormGradEpilogue {
    /// How many column sums it outputs.
    pub fn sums(self) -> usize {
        usize::from(self.sum_dx) + usize::from(self.sum_residual)
    }

    /// The tensors its column sums sum, in output order: `dx` (the output, the residual
    /// added) and the `residual`.
    pub fn summed<'a, T>(self, dx: &'a T, residual: Option<&'a T>) -> Vec<&'a T> {
        let dx = self.sum_dx.then_some(dx);
        let residual = residual.filter(|_| self.sum_residual);
        dx.into_iter().chain(residual).collect()
    }
}

impl LayerNormGrad {
    /// Without an epilogue.
    pub fn new(axis: i64, epsilon: f64) -> LayerNormGrad {
        LayerNormGrad {
            axis,
            epsilon,
            epilogue: NormGradEpilogue::default(),
        }
    }

    pub(crate) fn parse(a: &mut AttrReader) -> OpResult<LayerNormGrad> {
        Ok(LayerNormGrad {
            axis: a.opt_int("axis")?.unwrap_or(-1),
            epsilon: read_epsilon(a, 1e-5)?,
            epilogue: NormGradEpilogue {
                residual: a.bool_or("residual", false)?,
                sum_dx: a.bool_or("sum_dx", false)?,
                sum_residual: a.bool_or("sum_residual", false)?,
            },
        })
    }

    /// Checks the input types; returns dx's type (x's shape, gamma's dtype) and gamma's.
    fn check(&self, inputs: &[&TensorType]) -> OpResult<(TensorType, TensorType)> {
        let epi = self.epilogue;
        if epi.sum_residual && !epi.residual {
            return Err("sum_residual needs a residual".into());
        }
        if epi.sums() > 0 && inputs.first().is_some_and(|x| x.rank() < 2) {
            return Err("column sums need x of rank 2 or more".into());
        }
        let (dx, gamma) = self.check_norm(inputs.get(..3).ok_or("missing inputs")?)?;
        if let Some(r) = inputs.get(3) {
            if **r != dx {
                return Err(format!(
                    "the residual is {} but must be dx's type {}",
                    r, dx
                ));
            }
        }
        Ok((dx, gamma))
    }

    /// Checks x, gamma and dy.
    fn check_norm(&self, inputs: &[&TensorType]) -> OpResult<(TensorType, TensorType)> {
        let [x, gamma, dy] = fixed(inputs)?;
        require_float("gamma", gamma.dtype)?;
        norm_dtype("x", x.dtype, gamma.dtype)?;
        norm_dtype("dy", dy.dtype, gamma.dtype)?;
        let axis = normalize_axis(self.axis, x.rank())?;
        let want = &x.shape[axis..];
        if gamma.shape != want {
            return Err(format!(
                "gamma has shape {} but must be {} (x {} from axis {axis})",
                ShapeDisplay(&gamma.shape),
                ShapeDisplay(want),
                ShapeDisplay(&x.shape)
            ));
        }
        if dy.shape != x.shape {
            return Err(format!(
                "dy has shape {} but must match x {}",
                ShapeDisplay(&dy.shape),
                ShapeDisplay(&x.shape)
            ));
        }
        Ok((
            TensorType::new(gamma.dtype, x.shape.clone()),
            (*gamma).clone(),
        ))
    }
}

impl FloatKernel for LayerNormGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, gamma, dy] = fixed(inputs)?;
        let shape = x.shape();
        let axis = normalize_axis(self.axis, shape.len())?;
        let len: usize = shape[axis..].iter().product();
        let (xs, gamma, dys) = (T::read(x), T::read(gamma), T::read(dy));
        if gamma.len() != len || dys.len() != xs.len() {
            return Err("gamma must match x.shape[axis..] and dy must match x".into());
        }
        let mut dx = Vec::with_capacity(xs.len());
        let mut dgamma = vec![T::zero(); len];
        let mut dbeta = vec![T::zero(); len];
        if len > 0 {
            let n = T::lit(len as f64);
            let eps = T::lit(self.epsilon);
            let mut xhat = vec![T::zero(); len];
            for (row, drow) in xs.chunks(len).zip(dys.chunks(len)) {
                let mean = row.iter().copied().sum::<T>() / n;
                let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
                let inv = T::one() / (var + eps).sqrt();
                xhat.iter_mut()
                    .zip(row)
                    .for_each(|(h, &v)| *h = (v - mean) * inv);
                let (mut sum_g, mut sum_gx) = (T::zero(), T::zero());
                for j in 0..len {
                    let g = drow[j] * gamma[j];
                    sum_g = sum_g + g;
                    sum_gx = sum_gx + g * xhat[j];
                    dgamma[j] = dgamma[j] + drow[j] * xhat[j];
                    dbeta[j] = dbeta[j] + drow[j];
                }
                let (mean_g, mean_gx) = (sum_g / n, sum_gx / n);
                dx.extend(
                    (0..len).map(|j| (drow[j] * gamma[j] - mean_g - xhat[j] * mean_gx) * inv),
                );
            }
        }
        let gshape = shape[axis..].to_vec();
        Ok(vec![
            (shape.to_vec(), dx),
            (gshape.clone(), dgamma),
            (gshape, dbeta),
        ])
    }
}

impl Op for LayerNormGrad {
    fn name(&self) -> &'static str {
        "LayerNormGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(if self.epilogue.residual { 4 } else { 3 })
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![("axis", self.axis.into()), ("epsilon", self.epsilon.into())];
        let epi = self.epilogue;
        for (name, on) in [
            ("residual", epi.residual),
            ("sum_dx", epi.sum_dx),
            ("sum_residual", epi.sum_residual),
        ] {
            if on {
                attrs.push((name, AttrValue::Bool(true)));
            }
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (dx, gamma) = self.check(inputs)?;
        let sum = column_sum_of(&dx).infer(&[&dx])?.remove(0);
        let mut out = vec![dx, gamma.clone(), gamma];
        out.extend(std::iter::repeat_n(sum, self.epilogue.sums()));
        Ok(out)
    }
    /// The fused epilogue runs as the ops it replaced: an Add of the rounded dx and the
    /// residual, then Sums.
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types = types_of(inputs);
        self.check(&types.iter().collect::<Vec<_>>())?;
        let mut out = eval_float(self, inputs[1].dtype(), &inputs[..3])?;
        let epi = self.epilogue;
        if let (true, Some(r)) = (epi.residual, inputs.get(3)) {
            out[0] = Binary::new(BinaryKind::Add).eval(&[&out[0], r])?.remove(0);
        }
        let sums = epi
            .summed(&out[0], inputs.get(3).copied())
            .into_iter()
            .map(|t| Ok(column_sum_of(&t.ty()).eval(&[t])?.remove(0)))
            .collect::<OpResult<Vec<_>>>()?;
        out.extend(sums);
        Ok(out)
    }
    /// One type for x, gamma, dy (and the residual), dx, dgamma and dbeta; the column
    /// sums keep theirs.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        let mut groups = vec![TypeGroup::new(
            (0..num_inputs).collect(),
            (0..num_outputs.min(3)).collect(),
        )];
        if num_outputs > 3 {
            groups.push(TypeGroup::new(vec![], (3..num_outputs).collect()).fixed());
        }
        groups
    }
}
