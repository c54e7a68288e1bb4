//! Dropout in the graph: each element kept with probability `1 - rate` (and scaled by
//! `1 / (1 - rate)`) or zeroed, by a counter-based hash of (seed, step count, element
//! index) — no random state, no stored mask. The same three numbers give the same mask
//! on every backend and every time, so the gradient is the same op on the output's
//! gradient (the mask is recomputed, not kept), and the fused elementwise kernels hold
//! it as one more instruction.

use crate::attrs::AttrValue;
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::tensor::{Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "Dropout",
    parse: |_, a| {
        let rate = a.opt_float("rate")?.ok_or("missing attr 'rate'")?;
        let seed = a.opt_int("seed")?.ok_or("missing attr 'seed'")?;
        Ok(Box::new(Dropout::new(rate, seed as u64)?))
    },
}];

/// Inputs `(x, count)`: `x` a float tensor, `count` a float scalar (the step count,
/// `optimizer/step`, so each step draws a new mask). Output: `x` with each element
/// kept and scaled by `1 / (1 - rate)` or set to 0, as [`Dropout::keeps`] says. The
/// count is read in `x`'s compute type and truncated to an integer (negative or NaN
/// counts as 0). Nodes of one graph need different seeds for independent masks
/// (`nn::dropout` derives one from the node's name).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    pub rate: f64,
    pub seed: u64,
}

/// The splitmix64 finaliser: a bijection of 64-bit words whose every output bit
/// depends on every input bit.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dropout {
    /// Dropout of `rate` in [0, 1).
    pub fn new(rate: f64, seed: u64) -> OpResult<Dropout> {
        if !(0.0..1.0).contains(&rate) {
            return Err(format!(
                "the dropout rate must be within [0, 1), got {rate}"
            ));
        }
        Ok(Dropout { rate, seed })
    }

    /// The 32 random bits of element `i` at step count `count`: element `i` of the
    /// splitmix64 stream seeded by the seed and the count.
    pub fn bits(&self, count: u64, i: u64) -> u32 {
        let key = mix64(self.seed ^ count.wrapping_mul(0xD1B5_4A32_D192_ED03));
        (mix64(key.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))) >> 32) as u32
    }

    /// Elements whose bits are below this are dropped: `floor(rate * 2^32)`.
    pub fn threshold(&self) -> u64 {
        (self.rate * 4_294_967_296.0) as u64
    }

    /// Whether element `i` is kept at step count `count`.
    pub fn keeps(&self, count: u64, i: u64) -> bool {
        u64::from(self.bits(count, i)) >= self.threshold()
    }

    /// What kept elements are multiplied by: `1 / (1 - rate)`, rounded to the compute
    /// type.
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.rate)
    }

    /// A count read in the compute type as the integer the mask is drawn for.
    pub fn count_of<T: Real>(count: T) -> u64 {
        if count > T::zero() {
            count.to_u64().unwrap_or(0)
        } else {
            0
        }
    }

    /// Element `i` of the output: `x * scale` where kept, else 0, in the compute type.
    pub fn apply<T: Real>(&self, x: T, count: T, i: u64) -> T {
        if self.keeps(Self::count_of(count), i) {
            x * T::lit(self.scale())
        } else {
            T::zero()
        }
    }
}

impl Op for Dropout {
    fn name(&self) -> &'static str {
        "Dropout"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("rate", self.rate.into()),
            ("seed", (self.seed as i64).into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, count] = fixed(inputs)?;
        if !x.dtype.is_float() {
            return Err(format!("dropout needs a float tensor, got {x}"));
        }
        if !count.shape.is_empty() || !count.dtype.is_float() {
            return Err(format!(
                "the step count must be a float scalar, got {count}"
            ));
        }
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(self, inputs[0].dtype(), inputs)
    }
    fn typed_inputs(&self, _: usize) -> Vec<usize> {
        vec![0]
    }
    fn type_groups(&self, _: usize, _: usize) -> Vec<TypeGroup> {
        vec![
            TypeGroup::new(vec![0], vec![0]),
            TypeGroup::new(vec![1], vec![]).fixed(),
        ]
    }
    /// `dy` through the same mask and scale: the same op at the same count.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let &[_, count] = fixed(inputs).map_err(GraphError::Format)?;
        let Some(dy) = grads.first().copied().flatten() else {
            return Ok(vec![None, None]);
        };
        Ok(vec![Some(b.add(*self, &[dy, count])?), None])
    }
}

impl FloatKernel for Dropout {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let x = T::read(inputs[0]);
        let count = T::lit(inputs[1].to_f64_vec()[0]);
        let y = x
            .iter()
            .enumerate()
            .map(|(i, &v)| self.apply(v, count, i as u64))
            .collect();
        Ok(vec![(inputs[0].shape().to_vec(), y)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64 seeded with 0 (Vigna's reference implementation) starts with
    /// 0xE220A8397B1DCDAF: `mix64(0x9E3779B97F4A7C15)`.
    #[test]
    fn the_mixer_is_splitmix64s() {
        assert_eq!(mix64(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
    }

    /// A tenth dropped, of a million elements: within 5 standard deviations of 10%;
    /// the kept ones scaled by 1/0.9; a new count draws another mask, agreeing with
    /// the first on 82% of elements (0.9^2 + 0.1^2) as independent masks do.
    #[test]
    fn masks_drop_the_rate_and_change_with_the_count() {
        let d = Dropout::new(0.1, 7).unwrap();
        let n = 1_000_000u64;
        let dropped = (0..n).filter(|&i| !d.keeps(3, i)).count() as f64;
        let sd = (n as f64 * 0.1 * 0.9).sqrt();
        assert!((dropped - 1e5).abs() < 5.0 * sd, "{dropped}");
        let same = (0..n).filter(|&i| d.keeps(3, i) == d.keeps(4, i)).count() as f64;
        assert!((same / n as f64 - 0.82).abs() < 0.003, "{same}");
        let other_seed = Dropout::new(0.1, 8).unwrap();
        let same = (0..n)
            .filter(|&i| d.keeps(3, i) == other_seed.keeps(3, i))
            .count() as f64;
        assert!((same / n as f64 - 0.82).abs() < 0.003, "{same}");
        let kept = 2.0 * (1.0 / 0.9f64) as f32;
        assert_eq!(
            d.apply(2.0f32, 3.0, 0),
            if d.keeps(3, 0) { kept } else { 0.0 }
        );
    }

    #[test]
    fn rates_outside_zero_to_one_are_refused() {
        for rate in [-0.1, 1.0, f64::NAN] {
            let e = Dropout::new(rate, 0).unwrap_err();
            assert!(e.contains("within [0, 1)"), "{e}");
        }
        assert!(Dropout::new(0.0, 0).unwrap().keeps(0, 12345));
    }
}
