//! Learning-rate schedules in the graph: the factor of an optimizer's peak rate at the
//! current step, computed from the step counter on the device, so a rate that changes
//! every step changes no kernel and no plan (an [`OptimizerUpdate`] with `scheduled`
//! multiplies its rate by this factor).
//!
//! [`OptimizerUpdate`]: crate::ops::OptimizerUpdate

use crate::attrs::{AttrReader, AttrValue};
use crate::dtype::DType;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::train::require_step_count;
use crate::tensor::{Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "LearningRateSchedule",
    parse: |_, a| Ok(Box::new(LearningRateSchedule::parse(a)?)),
}];

/// How the rate falls from its peak after the warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anneal {
    /// Half a cosine (llm.c's GPT-2, Hugging Face's `get_cosine_schedule_with_warmup`).
    Cosine,
    /// A straight line (BERT, `get_linear_schedule_with_warmup`).
    Linear,
}

/// Linear warmup over `warmup` steps, then `anneal` from the peak down to
/// `final_ratio` of it at step `total`, and `final_ratio` after. Input: the step count
/// after this step (1 on the first step, the optimizers' `optimizer/step`); output: an
/// f32 scalar factor. Step `s` (from 0, `s = count - 1`) gets `(s + 1) / warmup` during
/// the warmup, as llm.c's (the first step does not have a zero rate), then
/// `final + (1 - final) * c(p)` with `p = (s - warmup) / (total - warmup)`,
/// `c = (1 + cos(pi p)) / 2` or `1 - p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearningRateSchedule {
    pub warmup: u64,
    pub total: u64,
    pub final_ratio: f64,
    pub anneal: Anneal,
}

impl LearningRateSchedule {
    /// Warmup then half a cosine down to `final_ratio` of the peak at step `total`.
    pub fn warmup_cosine(warmup: u64, total: u64, final_ratio: f64) -> Self {
        LearningRateSchedule {
            warmup,
            total,
            final_ratio,
            anneal: Anneal::Cosine,
        }
    }

    /// Warmup then a straight line down to `final_ratio` of the peak at step `total`.
    pub fn warmup_linear(warmup: u64, total: u64, final_ratio: f64) -> Self {
        LearningRateSchedule {
            anneal: Anneal::Linear,
            ..Self::warmup_cosine(warmup, total, final_ratio)
        }
    }

    /// Why this schedule is not one, if it is not.
    pub fn check(&self) -> OpResult<()> {
        if self.total < self.warmup {
            return Err(format!(
                "the schedule's total of {} steps is shorter than its warmup of {}",
                self.total, self.warmup
            ));
        }
        if !(0.0..=1.0).contains(&self.final_ratio) {
            return Err(format!(
                "the schedule's final ratio must be within [0, 1], got {}",
                self.final_ratio
            ));
        }
        Ok(())
    }

    /// The factor at the step whose count after it is `count`, in f64 (the CUDA kernel
    /// computes the same in double and rounds once to f32).
    pub fn factor(&self, count: f64) -> f64 {
        let s = (count - 1.0).max(0.0);
        let (warmup, total) = (self.warmup as f64, self.total as f64);
        if s < warmup {
            return (s + 1.0) / warmup;
        }
        if s >= total {
            return self.final_ratio;
        }
        let p = (s - warmup) / (total - warmup);
        let c = match self.anneal {
            Anneal::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
            Anneal::Linear => 1.0 - p,
        };
        self.final_ratio + (1.0 - self.final_ratio) * c
    }

    fn parse(a: &mut AttrReader) -> OpResult<Self> {
        let steps = |a: &mut AttrReader, name: &str| -> OpResult<u64> {
            let v = a
                .opt_int(name)?
                .ok_or_else(|| format!("missing attr '{name}'"))?;
            u64::try_from(v).map_err(|_| format!("attr '{name}' must not be negative, got {v}"))
        };
        let anneal = match a.opt_str("anneal")?.as_deref() {
            Some("cosine") | None => Anneal::Cosine,
            Some("linear") => Anneal::Linear,
            Some(other) => return Err(format!("unknown anneal '{other}' (known: cosine linear)")),
        };
        let schedule = LearningRateSchedule {
            warmup: steps(a, "warmup")?,
            total: steps(a, "total")?,
            final_ratio: a.float_or("final_ratio", 0.0)?,
            anneal,
        };
        schedule.check()?;
        Ok(schedule)
    }
}

impl Op for LearningRateSchedule {
    fn name(&self) -> &'static str {
        "LearningRateSchedule"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let anneal = match self.anneal {
            Anneal::Cosine => "cosine",
            Anneal::Linear => "linear",
        };
        vec![
            ("warmup", (self.warmup as i64).into()),
            ("total", (self.total as i64).into()),
            ("final_ratio", self.final_ratio.into()),
            ("anneal", anneal.into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [count] = fixed(inputs)?;
        require_step_count(count)?;
        self.check()?;
        Ok(vec![TensorType::new(DType::F32, vec![])])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [count] = fixed(inputs)?;
        let factor = self.factor(count.to_f64_vec()[0]);
        Ok(vec![Tensor::scalar(DType::F32, factor)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed factors: warmup 4 of 10 steps, down to 0.1.
    #[test]
    fn factors_warm_up_then_anneal_to_the_final_ratio() {
        let cosine = LearningRateSchedule::warmup_cosine(4, 10, 0.1);
        let linear = LearningRateSchedule::warmup_linear(4, 10, 0.1);
        for (count, want) in [(1.0, 0.25), (2.0, 0.5), (4.0, 1.0), (5.0, 1.0)] {
            assert_eq!(cosine.factor(count), want, "count {count}");
            assert_eq!(linear.factor(count), want, "count {count}");
        }
        // Step 7 (count 8) is half way through the annealing: cos(pi/2) = 0.
        assert!((cosine.factor(8.0) - 0.55).abs() < 1e-15);
        assert!((linear.factor(8.0) - 0.55).abs() < 1e-15);
        // A quarter of the way: (1 + cos(pi/4)) / 2 = 0.853553...; linear 0.75.
        let quarter = 0.1 + 0.9 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2);
        assert!((cosine.factor(6.5) - quarter).abs() < 1e-15);
        assert!((linear.factor(6.5) - (0.1 + 0.9 * 0.75)).abs() < 1e-15);
        for count in [11.0, 12.0, 1e6] {
            assert_eq!(cosine.factor(count), 0.1);
            assert_eq!(linear.factor(count), 0.1);
        }
        // No warmup: the first step has the peak rate.
        assert_eq!(
            LearningRateSchedule::warmup_cosine(0, 10, 0.0).factor(1.0),
            1.0
        );
    }

    #[test]
    fn schedules_that_cannot_be_are_refused() {
        let short = LearningRateSchedule::warmup_cosine(10, 5, 0.0);
        assert!(short
            .check()
            .unwrap_err()
            .contains("shorter than its warmup"));
        let ratio = LearningRateSchedule::warmup_linear(1, 5, 1.5);
        assert!(ratio.check().unwrap_err().contains("within [0, 1]"));
        let count = TensorType::new(DType::F32, vec![2]);
        let err = LearningRateSchedule::warmup_cosine(1, 5, 0.0)
            .infer(&[&count])
            .unwrap_err();
        assert!(err.contains("numeric scalar"), "{err}");
    }
}
