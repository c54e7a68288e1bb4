//! Training ops: writing Variables, optimizer updates, dynamic loss scaling.
//!
//! Every update takes a `finite` flag (a bool scalar) as input 0: when it is false the
//! outputs are the inputs, bit for bit, so a step whose gradients overflowed is
//! skipped inside the graph with no host round trip.

use crate::attrs::{AttrReader, AttrValue};
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::{Graph, NodeId, Port};
use crate::kernel::{eval_float, FloatKernel, Real};
use crate::op::{fixed, per_member, Arity, Op, OpEntry, OpResult};
use crate::ops::{Fp8ScaleUpdate, Init, Variable};
use crate::tensor::{Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "AssignVariable",
        parse: |_, _| Ok(Box::new(AssignVariable)),
    },
    OpEntry {
        name: "Group",
        parse: |_, _| Ok(Box::new(Group)),
    },
    OpEntry {
        name: "AllFinite",
        parse: |_, a| {
            Ok(Box::new(AllFinite {
                scaled: a.bool_or("scaled", false)?,
            }))
        },
    },
    OpEntry {
        name: "IncrementIf",
        parse: |_, _| Ok(Box::new(IncrementIf)),
    },
    OpEntry {
        name: "OptimizerUpdate",
        parse: |_, a| Ok(Box::new(OptimizerUpdate::parse(a)?)),
    },
    OpEntry {
        name: "GroupedOptimizerUpdate",
        parse: |_, a| {
            let members = a.positive("members")?;
            Ok(Box::new(GroupedOptimizerUpdate {
                update: OptimizerUpdate::parse(a)?,
                members,
            }))
        },
    },
    OpEntry {
        name: "LossScaleUpdate",
        parse: |_, a| {
            Ok(Box::new(LossScaleUpdate {
                growth_interval: a.opt_int("growth_interval")?.unwrap_or(2000),
                growth_factor: a.float_or("growth_factor", 2.0)?,
                backoff_factor: a.float_or("backoff_factor", 0.5)?,
            }))
        },
    },
];

fn bool_scalar() -> TensorType {
    TensorType::new(DType::Bool, vec![])
}

fn require_flag(ty: &TensorType) -> OpResult<()> {
    if *ty == bool_scalar() {
        Ok(())
    } else {
        Err(format!("input 0 (finite) must be a bool scalar, got {ty}"))
    }
}

fn flag(t: &Tensor) -> bool {
    matches!(t.data(), Data::Bool(v) if v.first() == Some(&true))
}

/// Writes input 1 into the Variable at input 0 when the step ends (reads in the same
/// step see the old value). Outputs the new value.
#[derive(Clone, Debug, PartialEq)]
pub struct AssignVariable;

impl Op for AssignVariable {
    fn name(&self) -> &'static str {
        "AssignVariable"
    }
    fn is_view(&self) -> bool {
        true
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [var, value] = fixed(inputs)?;
        if var != value {
            return Err(format!("the variable is {var} but the value is {value}"));
        }
        Ok(vec![(*value).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [_, value] = fixed(inputs)?;
        Ok(vec![(*value).clone()])
    }
}

/// Depends on all its inputs and produces `true`: one fetch that runs a whole step.
#[derive(Clone, Debug, PartialEq)]
pub struct Group;

impl Op for Group {
    fn name(&self) -> &'static str {
        "Group"
    }
    fn arity(&self) -> Arity {
        Arity::AtLeast(0)
    }
    fn infer(&self, _: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![bool_scalar()])
    }
    fn eval(&self, _: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        Ok(vec![Tensor::scalar(DType::Bool, 1.0)])
    }
}

/// True when every element of every (float) input is finite. `scaled`: the last
/// input is an f32 or f64 scalar `s` and the elements checked are the products
/// `x * s`, each in `s`'s dtype (what `AllFinite(Mul(Cast(x), s))` checks, without
/// writing the products: the `unscale-into-update` pass folds the loss-scale
/// unscaling in).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AllFinite {
    pub scaled: bool,
}

/// The scalar a scaled op multiplies by: an f32 or f64 scalar.
fn require_scale(ty: &TensorType) -> OpResult<()> {
    if ty.shape.is_empty() && matches!(ty.dtype, DType::F32 | DType::F64) {
        Ok(())
    } else {
        Err(format!("the scale must be an f32 or f64 scalar, got {ty}"))
    }
}

/// Whether every element of `t` times `scale` (both rounded to `scale`'s dtype, the
/// product too) is finite.
fn products_finite(t: &Tensor, scale: &Tensor) -> bool {
    let s = scale.to_f64_vec()[0];
    let v = t.to_f64_vec();
    // An f32 product computed in f64 is exact, and rounds to the f32 product.
    match scale.dtype() {
        DType::F32 => v.iter().all(|&x| ((x as f32) * (s as f32)).is_finite()),
        _ => v.iter().all(|&x| (x * s).is_finite()),
    }
}

impl Op for AllFinite {
    fn name(&self) -> &'static str {
        "AllFinite"
    }
    fn arity(&self) -> Arity {
        Arity::AtLeast(1 + usize::from(self.scaled))
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        if self.scaled {
            vec![("scaled", true.into())]
        } else {
            vec![]
        }
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let checked = inputs.len() - usize::from(self.scaled);
        if let Some((i, t)) = inputs[..checked]
            .iter()
            .enumerate()
            .find(|(_, t)| !t.dtype.is_float())
        {
            return Err(format!("input {i} must be a float tensor, got {t}"));
        }
        if self.scaled {
            require_scale(inputs[checked])?;
        }
        Ok(vec![bool_scalar()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let finite = match inputs.split_last() {
            Some((scale, xs)) if self.scaled => xs.iter().all(|t| products_finite(t, scale)),
            _ => inputs.iter().all(|t| match t.data() {
                Data::F32(v) => v.iter().all(|x| x.is_finite()),
                Data::F16(v) => v.iter().all(|x| x.is_finite()),
                Data::BF16(v) => v.iter().all(|x| x.is_finite()),
                Data::F64(v) => v.iter().all(|x| x.is_finite()),
                Data::F8E4M3(v) => v.iter().all(|x| x.is_finite()),
                Data::F8E5M2(v) => v.iter().all(|x| x.is_finite()),
                _ => true,
            }),
        };
        Ok(vec![Tensor::scalar(
            DType::Bool,
            f64::from(u8::from(finite)),
        )])
    }
}

/// `counter + 1` when `finite`, else `counter`: step counts of optimizers.
#[derive(Clone, Debug, PartialEq)]
pub struct IncrementIf;

impl Op for IncrementIf {
    fn name(&self) -> &'static str {
        "IncrementIf"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [finite, counter] = fixed(inputs)?;
        require_flag(finite)?;
        if !counter.shape.is_empty() || counter.dtype == DType::Bool {
            return Err(format!(
                "the counter must be a numeric scalar, got {counter}"
            ));
        }
        Ok(vec![(*counter).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [finite, counter] = fixed(inputs)?;
        let add = if flag(finite) { 1.0 } else { 0.0 };
        Ok(vec![Tensor::scalar(
            counter.dtype(),
            counter.to_f64_vec()[0] + add,
        )])
    }
}

/// The step count of a training graph: a scalar f32 Variable the optimizers advance
/// on each step they apply; Adam's bias corrections, learning-rate schedules and
/// dropout masks read it.
pub const STEP_COUNT: &str = "optimizer/step";

/// The graph's step count [`STEP_COUNT`]: its Variable, made (a scalar f32 from 0)
/// where the graph has none.
pub fn step_count(g: &mut Graph) -> Result<Port, GraphError> {
    if let Some(id) = g.find(STEP_COUNT) {
        return Ok(id.into());
    }
    let counter = Variable::with_init(TensorType::new(DType::F32, vec![]), Init::Zeros);
    Ok(g.add_node(STEP_COUNT, Box::new(counter), &[])?.into())
}

/// Requires a step count as an input: a numeric scalar.
pub(crate) fn require_step_count(count: &TensorType) -> OpResult<()> {
    if !count.shape.is_empty() || count.dtype == DType::Bool {
        return Err(format!(
            "the step count must be a numeric scalar, got {count}"
        ));
    }
    Ok(())
}

/// The update rule of an optimizer, applied to one variable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// PyTorch's SGD: `buf = momentum*buf + g; var -= lr*(nesterov ? g + momentum*buf : buf)`.
    Sgd { momentum: f64, nesterov: bool },
    /// Adam (`decoupled`: AdamW's weight decay) with bias correction.
    Adam {
        beta1: f64,
        beta2: f64,
        epsilon: f64,
        decoupled: bool,
    },
    /// LAMB: Adam's direction scaled per layer by ||var|| / ||update||.
    Lamb {
        beta1: f64,
        beta2: f64,
        epsilon: f64,
    },
}

impl Rule {
    /// Plain SGD: `var -= lr * g`, no momentum and no state.
    pub const PLAIN_SGD: Rule = Rule::Sgd {
        momentum: 0.0,
        nesterov: false,
    };

    /// Optimizer state tensors per variable, besides the shared step count.
    pub fn slots(self) -> &'static [&'static str] {
        match self {
            Rule::Sgd { momentum: 0.0, .. } => &[],
            Rule::Sgd { .. } => &["momentum"],
            Rule::Adam { .. } | Rule::Lamb { .. } => &["m", "v"],
        }
    }

    /// Whether the rule reads the step count (for bias correction).
    pub fn uses_step(self) -> bool {
        !matches!(self, Rule::Sgd { .. })
    }
}

/// One optimizer step for one variable. Inputs: `finite`, `var`, `grad`, the slots of
/// the rule, then (Adam, LAMB) the step count after this step, then (`scheduled`) the
/// learning rate's factor, then (`grad_scale`) the gradient's scale. Outputs: the new
/// variable, then the new slots, computed in the variable's compute type.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerUpdate {
    pub rule: Rule,
    /// The rate; with `scheduled`, its peak.
    pub learning_rate: f64,
    pub weight_decay: f64,
    /// An input after the step count, an f32 scalar (a [`LearningRateSchedule`]'s
    /// output), multiplies the learning rate (in f64, then rounded to the variable's
    /// compute type): the rate changes every step and the update's kernel does not.
    ///
    /// [`LearningRateSchedule`]: crate::ops::LearningRateSchedule
    pub scheduled: bool,
    /// A last input, a scalar of the variable's dtype, multiplies the gradient (in
    /// that dtype) before the rule: the loss-scale unscaling, folded in by the
    /// `unscale-into-update` pass so the gradient is read in its own (16-bit) type.
    pub grad_scale: bool,
    /// A last output: the new variable cast to this dtype (the copy AMP's forward
    /// pass reads next step), written by the update instead of a Cast kernel of its
    /// own (the `cast-into-update` pass sets it; executors may keep it for the next
    /// step's Cast).
    pub cast_to: Option<DType>,
    /// The gradient is read rounded to this narrower float dtype, as a narrowing Cast
    /// folded in by `grad-round-into-update` gave it (the update reads the wide
    /// gradient once where a Cast kernel wrote the narrow one for it to read).
    pub grad_rounded_to: Option<DType>,
}

impl OptimizerUpdate {
    /// An update by `rule` that reads its gradient as it is and writes no cast (the
    /// passes set `grad_scale` and `cast_to`).
    pub fn new(rule: Rule, learning_rate: f64, weight_decay: f64) -> OptimizerUpdate {
        OptimizerUpdate {
            rule,
            learning_rate,
            weight_decay,
            scheduled: false,
            grad_scale: false,
            cast_to: None,
            grad_rounded_to: None,
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<OptimizerUpdate> {
        let beta1 = a.float_or("beta1", 0.9)?;
        let beta2 = a.float_or("beta2", 0.999)?;
        let epsilon = a.float_or("epsilon", 1e-7)?;
        let rule = match a.opt_str("rule")?.as_deref() {
            Some("sgd") => Rule::Sgd {
                momentum: a.float_or("momentum", 0.0)?,
                nesterov: a.bool_or("nesterov", false)?,
            },
            Some("adam") => Rule::Adam {
                beta1,
                beta2,
                epsilon,
                decoupled: false,
            },
            Some("adamw") => Rule::Adam {
                beta1,
                beta2,
                epsilon,
                decoupled: true,
            },
            Some("lamb") => Rule::Lamb {
                beta1,
                beta2,
                epsilon,
            },
            Some(other) => {
                return Err(format!(
                    "unknown rule '{other}' (known: sgd adam adamw lamb)"
                ))
            }
            None => return Err("missing attr 'rule'".into()),
        };
        Ok(OptimizerUpdate {
            rule,
            learning_rate: a
                .opt_float("learning_rate")?
                .ok_or("missing attr 'learning_rate'")?,
            weight_decay: a.float_or("weight_decay", 0.0)?,
            scheduled: a.bool_or("scheduled", false)?,
            grad_scale: a.bool_or("grad_scale", false)?,
            cast_to: a.opt_dtype("cast_to")?,
            grad_rounded_to: a.opt_dtype("grad_rounded_to")?,
        })
    }

    /// `finite`, the variable, its gradient, the slots, the step count (Adam, LAMB),
    /// the rate's factor (`scheduled`) and the gradient scale (`grad_scale`).
    pub fn num_inputs(&self) -> usize {
        3 + self.rule.slots().len()
            + usize::from(self.rule.uses_step())
            + usize::from(self.scheduled)
            + usize::from(self.grad_scale)
    }

    /// The input holding the learning rate's factor, when `scheduled`.
    pub fn factor_input(&self) -> Option<usize> {
        self.scheduled
            .then(|| 3 + self.rule.slots().len() + usize::from(self.rule.uses_step()))
    }

    /// The new variable, its new slots and its cast (`cast_to`).
    pub fn num_outputs(&self) -> usize {
        1 + self.rule.slots().len() + usize::from(self.cast_to.is_some())
    }

    /// The outputs that are new values of inputs, each with that input's slot: the
    /// variable (input 1), then each slot (inputs 3..).
    pub fn replaced_inputs(&self) -> impl Iterator<Item = (usize, usize)> {
        (0..=self.rule.slots().len()).map(|k| (k, if k == 0 { 1 } else { 2 + k }))
    }

    /// The output holding the new variable cast to `cast_to`, when there is one.
    pub fn cast_output(&self) -> Option<usize> {
        self.cast_to.map(|_| 1 + self.rule.slots().len())
    }
}

impl Op for OptimizerUpdate {
    fn name(&self) -> &'static str {
        "OptimizerUpdate"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(self.num_inputs())
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a: Vec<(&'static str, AttrValue)> = vec![
            ("learning_rate", self.learning_rate.into()),
            ("weight_decay", self.weight_decay.into()),
        ];
        match self.rule {
            Rule::Sgd { momentum, nesterov } => a.extend([
                ("rule", "sgd".into()),
                ("momentum", momentum.into()),
                ("nesterov", nesterov.into()),
            ]),
            Rule::Adam {
                beta1,
                beta2,
                epsilon,
                decoupled,
            } => a.extend([
                ("rule", if decoupled { "adamw" } else { "adam" }.into()),
                ("beta1", beta1.into()),
                ("beta2", beta2.into()),
                ("epsilon", epsilon.into()),
            ]),
            Rule::Lamb {
                beta1,
                beta2,
                epsilon,
            } => a.extend([
                ("rule", "lamb".into()),
                ("beta1", beta1.into()),
                ("beta2", beta2.into()),
                ("epsilon", epsilon.into()),
            ]),
        }
        if self.scheduled {
            a.push(("scheduled", true.into()));
        }
        if self.grad_scale {
            a.push(("grad_scale", true.into()));
        }
        if let Some(to) = self.cast_to {
            a.push(("cast_to", to.into()));
        }
        if let Some(to) = self.grad_rounded_to {
            a.push(("grad_rounded_to", to.into()));
        }
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        require_flag(inputs[0])?;
        let var = inputs[1];
        if !var.dtype.is_float() {
            return Err(format!("the variable must be a float tensor, got {var}"));
        }
        let n_slots = self.rule.slots().len();
        for (i, t) in inputs.iter().enumerate().skip(2).take(1 + n_slots) {
            if t.shape != var.shape || !t.dtype.is_float() {
                return Err(format!(
                    "input {i} is {t} but the variable is {}{}",
                    var.dtype,
                    ShapeDisplay(&var.shape)
                ));
            }
        }
        if self.rule.uses_step() {
            require_step_count(inputs[3 + n_slots])?;
        }
        if let Some(k) = self.factor_input() {
            let factor = inputs[k];
            if factor.dtype != DType::F32 || !factor.shape.is_empty() {
                return Err(format!(
                    "the learning rate's factor must be an f32 scalar, got {factor}"
                ));
            }
        }
        if self.grad_scale {
            let scale = inputs[inputs.len() - 1];
            require_scale(scale)?;
            if scale.dtype != var.dtype {
                return Err(format!(
                    "the gradient scale is {scale} but the variable is {}",
                    var.dtype
                ));
            }
        }
        if let Some(to) = self.cast_to.filter(|d| !d.is_float()) {
            return Err(format!("cast_to must be a float dtype, got {to}"));
        }
        if let Some(to) = self.grad_rounded_to {
            let grad = inputs[2].dtype;
            if !to.is_float() || to.size_bytes() >= grad.size_bytes() {
                return Err(format!(
                    "grad_rounded_to must be a float dtype narrower than the gradient's {grad}, got {to}"
                ));
            }
        }
        // The variable and its slots keep their types; then the cast, if any.
        let cast = self
            .cast_to
            .map(|to| TensorType::new(to, var.shape.clone()));
        Ok(inputs[1..2]
            .iter()
            .chain(&inputs[3..3 + n_slots])
            .map(|t| (*t).clone())
            .chain(cast)
            .collect())
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let n_slots = self.rule.slots().len();
        let keep = || -> Vec<Tensor> {
            inputs[1..2]
                .iter()
                .chain(&inputs[3..3 + n_slots])
                .map(|t| (*t).clone())
                .collect()
        };
        let rounded = self.grad_rounded_to.map(|to| inputs[2].cast(to));
        let mut read: Vec<&Tensor> = inputs.to_vec();
        if let Some(g) = &rounded {
            read[2] = g;
        }
        let mut outputs = if flag(inputs[0]) {
            eval_float(self, inputs[1].dtype(), &read)?
        } else {
            keep()
        };
        if let Some(to) = self.cast_to {
            outputs.push(outputs[0].cast(to));
        }
        Ok(outputs)
    }
}

impl FloatKernel for OptimizerUpdate {
    /// The update in the variable's compute type (f32 for f32 master weights).
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let n_slots = self.rule.slots().len();
        let mut var = T::read(inputs[1]).into_owned();
        let mut grad = T::read(inputs[2]);
        if self.grad_scale {
            let s = T::read(inputs[inputs.len() - 1])[0];
            grad = grad.iter().map(|&g| g * s).collect::<Vec<T>>().into();
        }
        let mut slots: Vec<Vec<T>> = inputs[3..3 + n_slots]
            .iter()
            .map(|t| T::read(t).into_owned())
            .collect();
        let factor = match self.factor_input() {
            Some(k) => inputs[k].to_f64_vec()[0],
            None => 1.0,
        };
        let (lr, wd) = (
            T::lit(self.learning_rate * factor),
            T::lit(self.weight_decay),
        );
        let one = T::one();
        // Bias corrections 1 - beta^t, from the step count after this step.
        let corrections = |beta1: f64, beta2: f64| -> (T, T) {
            let t = inputs[3 + n_slots].to_f64_vec()[0];
            (T::lit(1.0 - beta1.powf(t)), T::lit(1.0 - beta2.powf(t)))
        };
        match self.rule {
            Rule::Sgd { momentum, nesterov } => {
                let m = T::lit(momentum);
                match slots.first_mut() {
                    None => var
                        .iter_mut()
                        .zip(grad.iter())
                        .for_each(|(w, &g)| *w = *w - lr * (g + wd * *w)),
                    Some(buf) => {
                        for ((w, &g), b) in var.iter_mut().zip(grad.iter()).zip(buf.iter_mut()) {
                            let g = g + wd * *w;
                            *b = m * *b + g;
                            let step = if nesterov { g + m * *b } else { *b };
                            *w = *w - lr * step;
                        }
                    }
                }
            }
            Rule::Adam {
                beta1,
                beta2,
                epsilon,
                decoupled,
            } => {
                let (c1, c2) = corrections(beta1, beta2);
                let (b1, b2, eps) = (T::lit(beta1), T::lit(beta2), T::lit(epsilon));
                let [m, v] = slots.as_mut_slice() else {
                    return Err("Adam keeps two slots".into());
                };
                for i in 0..var.len() {
                    let g = if decoupled {
                        grad[i]
                    } else {
                        grad[i] + wd * var[i]
                    };
                    m[i] = b1 * m[i] + (one - b1) * g;
                    v[i] = b2 * v[i] + (one - b2) * g * g;
                    let update = (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
                    let decay = if decoupled { wd * var[i] } else { T::zero() };
                    var[i] = var[i] - lr * (update + decay);
                }
            }
            Rule::Lamb {
                beta1,
                beta2,
                epsilon,
            } => {
                let (c1, c2) = corrections(beta1, beta2);
                let (b1, b2, eps) = (T::lit(beta1), T::lit(beta2), T::lit(epsilon));
                let [m, v] = slots.as_mut_slice() else {
                    return Err("LAMB keeps two slots".into());
                };
                let mut update = vec![T::zero(); var.len()];
                for i in 0..var.len() {
                    m[i] = b1 * m[i] + (one - b1) * grad[i];
                    v[i] = b2 * v[i] + (one - b2) * grad[i] * grad[i];
                    update[i] = (m[i] / c1) / ((v[i] / c2).sqrt() + eps) + wd * var[i];
                }
                let norm = |x: &[T]| x.iter().map(|&a| a * a).sum::<T>().sqrt();
                let (w_norm, u_norm) = (norm(&var), norm(&update));
                let trust = if w_norm > T::zero() && u_norm > T::zero() {
                    w_norm / u_norm
                } else {
                    one
                };
                for (w, u) in var.iter_mut().zip(&update) {
                    *w = *w - lr * trust * *u;
                }
            }
        }
        let shape = inputs[1].shape().to_vec();
        Ok(std::iter::once(var)
            .chain(slots)
            .map(|v| (shape.clone(), v))
            .collect())
    }
}

/// Several [`OptimizerUpdate`]s of one configuration as one node (PyTorch's
/// multi-tensor optimizers), so that an executor updates many small variables in one
/// launch: the inputs are each member's inputs in turn, in an update's order, and the
/// outputs each member's outputs in turn. Members may differ in shape. The
/// `group-updates` pass makes them.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedOptimizerUpdate {
    pub update: OptimizerUpdate,
    pub members: usize,
}

impl Op for GroupedOptimizerUpdate {
    fn name(&self) -> &'static str {
        "GroupedOptimizerUpdate"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(self.members * self.update.num_inputs())
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = self.update.attrs();
        a.push(("members", (self.members as i64).into()));
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        per_member(inputs, self.update.num_inputs(), |member| {
            self.update.infer(member)
        })
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        per_member(inputs, self.update.num_inputs(), |member| {
            self.update.eval(member)
        })
    }
}

/// The update configuration of an [`OptimizerUpdate`] (one member) or a
/// [`GroupedOptimizerUpdate`] (its members), with the member count. Member `m`'s
/// inputs start at slot `m * update.num_inputs()`, its outputs at port
/// `m * update.num_outputs()`.
pub fn update_members(op: &dyn Op) -> Option<(&OptimizerUpdate, usize)> {
    if let Some(u) = op.downcast_ref::<OptimizerUpdate>() {
        return Some((u, 1));
    }
    op.downcast_ref::<GroupedOptimizerUpdate>()
        .map(|g| (&g.update, g.members))
}

/// The outputs of `op` that are new values of its inputs, each as (output, input
/// slot): an optimizer update's variables and slots (every member's), delayed
/// scaling's amax history, scale and scale inverse ([`Fp8ScaleUpdate`]). Their kernels read every old
/// value they need before they write a new one, so an executor may write such an
/// output over its input's buffer where nothing later reads the old value.
pub fn replaced_inputs(op: &dyn Op) -> Vec<(usize, usize)> {
    if let Some((update, members)) = update_members(op) {
        let (n_in, n_out) = (update.num_inputs(), update.num_outputs());
        return (0..members)
            .flat_map(|m| {
                (update.replaced_inputs()).map(move |(k, slot)| (m * n_out + k, m * n_in + slot))
            })
            .collect();
    }
    if let Some(update) = op.downcast_ref::<Fp8ScaleUpdate>() {
        return update.replaced_inputs();
    }
    Vec::new()
}

/// A Variable that an optimizer update writes: the update's node and its member
/// (0 for a plain [`OptimizerUpdate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VariableUpdate {
    pub variable: NodeId,
    pub node: NodeId,
    pub member: usize,
}

/// The optimizer updates whose new value (a member's first output) an assignment
/// writes to the Variable they update, in node order.
pub fn variable_updates(graph: &Graph) -> Vec<VariableUpdate> {
    graph
        .node_ids()
        .filter(|&id| graph.node(id).op.is::<AssignVariable>())
        .filter_map(|id| {
            let &[var, value] = &graph.inputs(id)[..] else {
                return None;
            };
            let (update, _) = update_members(graph.node(value.node).op.as_ref())?;
            let (n_in, n_out) = (update.num_inputs(), update.num_outputs());
            let member = value.index / n_out;
            let updates_var = graph.inputs(value.node).get(member * n_in + 1) == Some(&var);
            let is_variable = graph.node(var.node).op.is::<Variable>();
            (value.index % n_out == 0 && updates_var && is_variable).then_some(VariableUpdate {
                variable: var.node,
                node: value.node,
                member,
            })
        })
        .collect()
}

/// Dynamic loss scaling, as TensorFlow's: inputs (`finite`, scale, good steps);
/// outputs the new scale and count. After `growth_interval` finite steps in a row the
/// scale grows by `growth_factor`; a non-finite step multiplies it by `backoff_factor`
/// (never below 1) and restarts the count.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaleUpdate {
    pub growth_interval: i64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
}

impl Op for LossScaleUpdate {
    fn name(&self) -> &'static str {
        "LossScaleUpdate"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("growth_interval", self.growth_interval.into()),
            ("growth_factor", self.growth_factor.into()),
            ("backoff_factor", self.backoff_factor.into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [finite, scale, good] = fixed(inputs)?;
        require_flag(finite)?;
        for (what, t) in [("scale", scale), ("good-step count", good)] {
            if !t.shape.is_empty() || t.dtype == DType::Bool {
                return Err(format!("the {what} must be a numeric scalar, got {t}"));
            }
        }
        if self.growth_interval < 1 {
            return Err("growth_interval must be at least 1".into());
        }
        Ok(vec![(*scale).clone(), (*good).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [finite, scale, good] = fixed(inputs)?;
        let (s, n) = (scale.to_f64_vec()[0], good.to_f64_vec()[0]);
        let (s, n) = if flag(finite) {
            if n + 1.0 >= self.growth_interval as f64 {
                (s * self.growth_factor, 0.0)
            } else {
                (s, n + 1.0)
            }
        } else {
            ((s * self.backoff_factor).max(1.0), 0.0)
        };
        Ok(vec![
            Tensor::scalar(scale.dtype(), s),
            Tensor::scalar(good.dtype(), n),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Port;

    fn eval(op: &dyn Op, inputs: &[Tensor]) -> Vec<Tensor> {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let types: Vec<TensorType> = inputs.iter().map(Tensor::ty).collect();
        op.infer(&types.iter().collect::<Vec<_>>()).unwrap();
        op.eval(&refs).unwrap()
    }

    #[test]
    fn scaled_all_finite_checks_the_products_in_the_scales_dtype() {
        let x = Tensor::from_f64(DType::F16, vec![2], &[60000.0, -1.0]).unwrap();
        let check = |s: Tensor| eval(&AllFinite { scaled: true }, &[x.clone(), s])[0].clone();
        let yes = Tensor::scalar(DType::Bool, 1.0);
        let no = Tensor::scalar(DType::Bool, 0.0);
        assert_eq!(check(Tensor::scalar(DType::F32, 1.0 / 1024.0)), yes);
        // 60000 * 1e35 = 6e39: past f32's 3.4e38, within f64's range.
        assert_eq!(check(Tensor::scalar(DType::F32, 1e35)), no);
        assert_eq!(check(Tensor::scalar(DType::F64, 1e35)), yes);
        let bad_scale = AllFinite { scaled: true }.infer(&[&x.ty(), &x.ty()]);
        assert!(bad_scale.unwrap_err().contains("f32 or f64 scalar"));
    }

    #[test]
    fn variable_updates_pair_each_variable_with_the_update_writing_it() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![3]);
        let mut var = |name: &str| {
            g.add_node(name, Box::new(Variable::new(ty.clone())), &[])
                .unwrap()
        };
        let (w, m, other, a, b) = (
            var("w"),
            var("w/momentum"),
            var("other"),
            var("a"),
            var("b"),
        );
        let yes = g.scalar(DType::Bool, 1.0).unwrap();
        let momentum = Rule::Sgd {
            momentum: 0.9,
            nesterov: false,
        };
        let update = g
            .add_node(
                "update",
                Box::new(OptimizerUpdate::new(momentum, 0.1, 0.0)),
                &[yes, w.into(), other.into(), m.into()],
            )
            .unwrap();
        for (target, value) in [(w, Port::new(update, 0)), (m, Port::new(update, 1))] {
            g.add(AssignVariable, &[target.into(), value]).unwrap();
        }
        // Written, but not by an update.
        g.add(AssignVariable, &[other.into(), w.into()]).unwrap();
        // Two members of a grouped update (plain SGD: one input less, no slot).
        let grouped = g
            .add_node(
                "grouped",
                Box::new(GroupedOptimizerUpdate {
                    update: OptimizerUpdate::new(Rule::PLAIN_SGD, 0.1, 0.0),
                    members: 2,
                }),
                &[yes, a.into(), other.into(), yes, b.into(), other.into()],
            )
            .unwrap();
        assert_eq!(g.node(grouped).outputs().len(), 2);
        for (target, k) in [(b, 1), (a, 0)] {
            g.add(AssignVariable, &[target.into(), Port::new(grouped, k)])
                .unwrap();
        }
        // The slot is output 1, not the variable the update updates.
        let found = |variable, node, member| VariableUpdate {
            variable,
            node,
            member,
        };
        assert_eq!(
            variable_updates(&g),
            vec![
                found(w, update, 0),
                found(b, grouped, 1),
                found(a, grouped, 0)
            ]
        );
    }

    #[test]
    fn a_grouped_update_computes_its_members_updates() {
        let adam = OptimizerUpdate {
            grad_scale: true,
            cast_to: Some(DType::F16),
            ..OptimizerUpdate::new(
                Rule::Adam {
                    beta1: 0.9,
                    beta2: 0.999,
                    epsilon: 1e-7,
                    decoupled: true,
                },
                0.01,
                0.1,
            )
        };
        let t = |shape: Vec<usize>, v: &[f64]| Tensor::from_f64(DType::F32, shape, v).unwrap();
        let yes = Tensor::scalar(DType::Bool, 1.0);
        let (step, scale) = (
            Tensor::scalar(DType::F32, 3.0),
            Tensor::scalar(DType::F32, 0.5),
        );
        let first = [
            yes.clone(),
            t(vec![2], &[1.0, -2.0]),
            t(vec![2], &[0.5, 4.0]),
            t(vec![2], &[0.1, 0.2]),
            t(vec![2], &[0.3, 0.4]),
            step.clone(),
            scale.clone(),
        ];
        let second = [
            yes,
            t(vec![1, 3], &[3.0, 0.0, -1.0]),
            t(vec![1, 3], &[-1.0, 2.0, 8.0]),
            t(vec![1, 3], &[0.0, 0.5, 0.0]),
            t(vec![1, 3], &[1.0, 0.0, 2.0]),
            step,
            scale,
        ];
        let grouped = GroupedOptimizerUpdate {
            update: adam.clone(),
            members: 2,
        };
        let all: Vec<Tensor> = first.iter().chain(&second).cloned().collect();
        let mut want = eval(&adam, &first);
        want.extend(eval(&adam, &second));
        assert_eq!(eval(&grouped, &all), want);
        let types: Vec<TensorType> = all.iter().map(|t| t.ty()).collect();
        let refs: Vec<&TensorType> = types.iter().collect();
        let out = grouped.infer(&refs).unwrap();
        assert_eq!(out.len(), 8, "each member: w, m, v and the f16 copy");
        assert_eq!(out[7], TensorType::new(DType::F16, vec![1, 3]));
        // A member with a wrong input names itself.
        let mut bad = refs.clone();
        let wrong = TensorType::new(DType::F32, vec![4]);
        bad[9] = &wrong;
        let err = grouped.infer(&bad).unwrap_err();
        assert!(err.starts_with("member 1: "), "{err}");
    }

    #[test]
    fn a_scaled_gradient_is_unscaled_before_the_rule() {
        let sgd = |grad_scale| OptimizerUpdate {
            grad_scale,
            ..OptimizerUpdate::new(Rule::PLAIN_SGD, 0.5, 0.0)
        };
        let yes = Tensor::scalar(DType::Bool, 1.0);
        let w = Tensor::from_f64(DType::F32, vec![2], &[1.0, 2.0]).unwrap();
        let g = Tensor::from_f64(DType::F16, vec![2], &[1024.0, -2048.0]).unwrap();
        let s = Tensor::scalar(DType::F32, 1.0 / 1024.0);
        // w - 0.5 * g / 1024.
        let out = eval(&sgd(true), &[yes.clone(), w.clone(), g.clone(), s]);
        assert_eq!(out[0].to_f64_vec(), vec![0.5, 3.0]);
        let out = eval(&sgd(false), &[yes.clone(), w.clone(), g.clone()]);
        assert_eq!(out[0].to_f64_vec(), vec![-511.0, 1026.0]);
        // The scale has the variable's dtype.
        let f64_scale = Tensor::scalar(DType::F64, 1.0);
        let types = [yes.ty(), w.ty(), g.ty(), f64_scale.ty()];
        let err = sgd(true)
            .infer(&types.iter().collect::<Vec<_>>())
            .unwrap_err();
        assert!(err.contains("gradient scale"), "{err}");
    }
}
