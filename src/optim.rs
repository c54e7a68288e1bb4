//! Optimizers as graph updates of Variables, and the mixed-precision wrapper.
//!
//! `minimize` adds the gradients, one `OptimizerUpdate` per variable with its slots
//! (Variables named `<var>/<slot>`, plus a shared `optimizer/step` for Adam and LAMB),
//! the `AssignVariable`s, and a `Group` that runs them all: fetching
//! [`TrainStep::step`] runs one training step.
//!
//! [`enable_mixed_precision_graph_rewrite`] wraps an optimizer with dynamic loss
//! scaling, all inside the graph: scaled loss -> gradients -> unscale (in f32) ->
//! all-finite check -> apply or skip -> scale update. No step needs the host.

use ampgraph_graph::autodiff::gradients_if_any;
use ampgraph_graph::ops::{
    step_count, AllFinite, AssignVariable, Binary, BinaryKind, Cast, Const, Group, IncrementIf,
    Init, LossScaleUpdate, OptimizerUpdate, Rule, Unary, UnaryKind, Variable,
};
use ampgraph_graph::{DType, Graph, GraphError, NodeId, Port, Tensor, TensorType};

pub use ampgraph_graph::ops::{Anneal, LearningRateSchedule};

/// What `minimize` built.
#[derive(Clone, Debug)]
pub struct TrainStep {
    /// Fetch this to run one step (forward, backward, update).
    pub step: Port,
    /// The (unscaled) loss.
    pub loss: Port,
    /// The variables it trains (those a gradient of the loss reaches), in graph order.
    pub variables: Vec<NodeId>,
    /// The loss scale in use (dynamic scaling only).
    pub loss_scale: Option<Port>,
}

/// An optimizer that adds its update rule to a graph.
pub trait Optimizer {
    /// Adds the updates of `vars` by `grads` (skipped when `finite` is false) and
    /// returns the nodes that write the new values.
    fn apply_gradients(
        &self,
        g: &mut Graph,
        vars: &[NodeId],
        grads: &[Port],
        finite: Port,
    ) -> Result<Vec<Port>, GraphError>;

    /// Adds the backward pass of `loss` and the updates of every float Variable a
    /// gradient of it reaches.
    fn minimize(&self, g: &mut Graph, loss: Port) -> Result<TrainStep, GraphError> {
        let vars = trainable_variables(g, loss)?;
        let (vars, grads) = with_gradients(g, loss, vars)?;
        let finite = g.add(Const::new(Tensor::scalar(DType::Bool, 1.0)), &[])?;
        let writes = self.apply_gradients(g, &vars, &grads, finite)?;
        finish(g, loss, vars, writes, None)
    }
}

/// Groups the writes into the step node and keeps the loss and step as graph outputs,
/// so rewrites leave their types alone.
fn finish(
    g: &mut Graph,
    loss: Port,
    variables: Vec<NodeId>,
    writes: Vec<Port>,
    loss_scale: Option<Port>,
) -> Result<TrainStep, GraphError> {
    let name = g.fresh_name("train_step");
    let step: Port = g.add_node(name, Box::new(Group), &writes)?.into();
    let mut outputs = g.outputs().to_vec();
    for p in [loss, step] {
        if !outputs.contains(&p) {
            outputs.push(p);
        }
    }
    g.set_outputs(outputs)?;
    Ok(TrainStep {
        step,
        loss,
        variables,
        loss_scale,
    })
}

/// The float Variables `loss` depends on, but the step count (which dropout reads).
pub fn trainable_variables(g: &Graph, loss: Port) -> Result<Vec<NodeId>, GraphError> {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![loss.node];
    while let Some(id) = stack.pop() {
        if seen.insert(id) {
            stack.extend(g.inputs(id).into_iter().map(|p| p.node));
        }
    }
    Ok(g.topo_order()?
        .into_iter()
        .filter(|id| seen.contains(id))
        .filter(|&id| g.node(id).op.is::<Variable>() && g.node(id).outputs()[0].dtype.is_float())
        .filter(|&id| g.node(id).name != STEP_VARIABLE)
        .collect())
}

/// Those of `vars` that a gradient of `of` reaches, and their gradients. The rest
/// (batch norm's moving statistics in training, read only where no gradient flows)
/// are not trained: TensorFlow makes them untrainable, and an update would at best
/// keep them and with weight decay shrink them.
fn with_gradients(
    g: &mut Graph,
    of: Port,
    vars: Vec<NodeId>,
) -> Result<(Vec<NodeId>, Vec<Port>), GraphError> {
    let ports: Vec<Port> = vars.iter().map(|&v| v.into()).collect();
    let grads = gradients_if_any(g, of, &ports)?;
    Ok(vars
        .into_iter()
        .zip(grads)
        .filter_map(|(var, grad)| Some((var, grad?)))
        .unzip())
}

/// A scalar Variable of `dtype` with a constant initial value.
fn scalar_variable(
    g: &mut Graph,
    name: &str,
    dtype: DType,
    value: f64,
) -> Result<Port, GraphError> {
    let ty = TensorType::new(dtype, vec![]);
    let init = if value == 0.0 {
        Init::Zeros
    } else {
        Init::Constant(value)
    };
    Ok(
        g.add_node(name, Box::new(Variable::with_init(ty, init)), &[])?
            .into(),
    )
}

/// The optimizers of this crate: one update rule with a learning rate and weight decay.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleOptimizer {
    pub rule: Rule,
    /// The rate; with a `schedule`, its peak.
    pub learning_rate: f64,
    pub weight_decay: f64,
    /// Which variables the weight decay applies to.
    pub decay: Decay,
    /// The rate's schedule over the steps, computed in the graph from the step count.
    pub schedule: Option<LearningRateSchedule>,
}

/// Which variables weight decay applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Decay {
    /// Every variable, as TensorFlow's and torch's optimizers do when given them all.
    #[default]
    All,
    /// Matrices and kernels (rank 2 and more) only: biases and the norms' scales and
    /// offsets are not decayed, as GPT-2 and BERT train (llm.c, Hugging Face).
    Matrices,
}

impl RuleOptimizer {
    fn of(rule: Rule, learning_rate: f64, weight_decay: f64) -> RuleOptimizer {
        RuleOptimizer {
            rule,
            learning_rate,
            weight_decay,
            decay: Decay::All,
            schedule: None,
        }
    }
}

/// Stochastic gradient descent, optionally with (Nesterov) momentum: constructors of
/// [`RuleOptimizer`], so that models read `Sgd::momentum(0.05, 0.9)`.
pub struct Sgd;

#[allow(clippy::new_ret_no_self)] // a namespace of RuleOptimizer constructors
impl Sgd {
    pub fn new(learning_rate: f64) -> RuleOptimizer {
        Self::momentum(learning_rate, 0.0)
    }

    pub fn momentum(learning_rate: f64, momentum: f64) -> RuleOptimizer {
        RuleOptimizer::of(
            Rule::Sgd {
                momentum,
                nesterov: false,
            },
            learning_rate,
            0.0,
        )
    }

    pub fn nesterov(learning_rate: f64, momentum: f64) -> RuleOptimizer {
        RuleOptimizer::of(
            Rule::Sgd {
                momentum,
                nesterov: true,
            },
            learning_rate,
            0.0,
        )
    }
}

/// Adam, AdamW (decoupled weight decay) and LAMB (layer-wise trust ratio):
/// constructors of [`RuleOptimizer`].
pub struct Adam;

#[allow(clippy::new_ret_no_self)] // a namespace of RuleOptimizer constructors
impl Adam {
    pub fn new(learning_rate: f64) -> RuleOptimizer {
        RuleOptimizer::of(
            Rule::Adam {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-7,
                decoupled: false,
            },
            learning_rate,
            0.0,
        )
    }

    pub fn adamw(learning_rate: f64, weight_decay: f64) -> RuleOptimizer {
        RuleOptimizer::of(
            Rule::Adam {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-7,
                decoupled: true,
            },
            learning_rate,
            weight_decay,
        )
    }

    pub fn lamb(learning_rate: f64, weight_decay: f64) -> RuleOptimizer {
        RuleOptimizer::of(
            Rule::Lamb {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-6,
            },
            learning_rate,
            weight_decay,
        )
    }
}

impl RuleOptimizer {
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// This optimizer with its weight decay applied to `decay`'s variables.
    pub fn decaying(mut self, decay: Decay) -> Self {
        self.decay = decay;
        self
    }

    /// This optimizer with its learning rate (then the peak) following `schedule`:
    /// `Adam::adamw(6e-4, 0.1).scheduled(LearningRateSchedule::warmup_cosine(700,
    /// 19_073, 0.1))` is llm.c's GPT-2 run. The factor is a graph node fed by the
    /// step count (`optimizer/step`, which counts the steps applied: a step skipped
    /// for an overflow does not advance the schedule), so no step re-plans.
    pub fn scheduled(mut self, schedule: LearningRateSchedule) -> Self {
        self.schedule = Some(schedule);
        self
    }
}

/// Name of the shared step count (Adam's and LAMB's bias corrections, schedules,
/// dropout).
pub const STEP_VARIABLE: &str = ampgraph_graph::ops::STEP_COUNT;

impl Optimizer for RuleOptimizer {
    fn apply_gradients(
        &self,
        g: &mut Graph,
        vars: &[NodeId],
        grads: &[Port],
        finite: Port,
    ) -> Result<Vec<Port>, GraphError> {
        let mut writes = Vec::new();
        // Dropout made the counter already: it must advance whatever the rule.
        let counted = self.rule.uses_step() || self.schedule.is_some();
        let count = if counted || g.find(STEP_VARIABLE).is_some() {
            let counter = step_count(g)?;
            let next = g.add(IncrementIf, &[finite, counter])?;
            writes.push(g.add(AssignVariable, &[counter, next])?);
            Some(next)
        } else {
            None
        };
        let step = count.filter(|_| self.rule.uses_step());
        let factor = match (self.schedule, count) {
            (Some(schedule), Some(count)) => {
                let name = g.fresh_name("optimizer/learning_rate_factor");
                Some(Port::from(g.add_node(
                    name,
                    Box::new(schedule),
                    &[count],
                )?))
            }
            _ => None,
        };
        for (&var, &grad) in vars.iter().zip(grads) {
            let var_name = g.node(var).name.clone();
            let ty = g.node(var).outputs()[0].clone();
            let mut slots = Vec::new();
            for slot in self.rule.slots() {
                let v = Variable::with_init(ty.clone(), Init::Zeros);
                slots.push(Port::from(g.add_node(
                    format!("{var_name}/{slot}"),
                    Box::new(v),
                    &[],
                )?));
            }
            let mut inputs = vec![finite, var.into(), grad];
            inputs.extend(&slots);
            inputs.extend(step);
            inputs.extend(factor);
            let weight_decay = match self.decay {
                Decay::Matrices if ty.rank() < 2 => 0.0,
                _ => self.weight_decay,
            };
            let op = OptimizerUpdate {
                scheduled: factor.is_some(),
                ..OptimizerUpdate::new(self.rule, self.learning_rate, weight_decay)
            };
            let name = g.fresh_name(format!("{var_name}/update"));
            let update = g.add_node(name, Box::new(op), &inputs)?;
            for (k, target) in std::iter::once(Port::from(var)).chain(slots).enumerate() {
                writes.push(g.add(AssignVariable, &[target, Port::new(update, k)])?);
            }
        }
        Ok(writes)
    }
}

/// `inner` after every gradient is scaled by `min(1, max_norm / norm)`, `norm` the
/// global L2 norm of all of them (torch's `clip_grad_norm_`, GPT-2's and BERT's 1.0),
/// in the graph: under mixed precision the gradients it clips are the unscaled ones,
/// and a step with a non-finite gradient is skipped as before.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipGlobalNorm<O> {
    pub inner: O,
    pub max_norm: f64,
}

impl<O> ClipGlobalNorm<O> {
    pub fn new(inner: O, max_norm: f64) -> Self {
        ClipGlobalNorm { inner, max_norm }
    }
}

impl<O: Optimizer> Optimizer for ClipGlobalNorm<O> {
    fn apply_gradients(
        &self,
        g: &mut Graph,
        vars: &[NodeId],
        grads: &[Port],
        finite: Port,
    ) -> Result<Vec<Port>, GraphError> {
        if !(self.max_norm > 0.0 && self.max_norm.is_finite()) {
            return Err(GraphError::Format(format!(
                "gradient clipping needs a positive finite norm, got {}",
                self.max_norm
            )));
        }
        // The sum of squares in f32, whatever the gradients' dtype.
        let mut total: Option<Port> = None;
        for &grad in grads {
            let grad = match g.ty(grad).dtype {
                DType::F32 => grad,
                _ => g.cast(grad, DType::F32)?,
            };
            let squares = g.mul(grad, grad)?;
            let sum = g.sum(squares, None, false)?;
            total = Some(match total {
                None => sum,
                Some(t) => g.plus(t, sum)?,
            });
        }
        let Some(total) = total else {
            return self.inner.apply_gradients(g, vars, grads, finite);
        };
        let norm = g.sqrt(total)?;
        let limit = g.scalar(DType::F32, self.max_norm)?;
        let above = g.maximum(norm, limit)?;
        let factor = g.div(limit, above)?;
        let mut clipped = Vec::with_capacity(grads.len());
        for &grad in grads {
            let dtype = g.ty(grad).dtype;
            let factor = match dtype {
                DType::F32 => factor,
                _ => g.cast(factor, dtype)?,
            };
            clipped.push(g.mul(grad, factor)?);
        }
        self.inner.apply_gradients(g, vars, &clipped, finite)
    }
}

/// `inner` applied once every `steps` steps, to the mean of those steps' gradients:
/// gradient accumulation over micro-batches (the effective batch is `steps` times
/// the graph's), in the graph. Each variable's running sum is a Variable
/// `<variable>/accumulated`; the step within the cycle `accumulation/step` and
/// whether every gradient of the cycle was finite `accumulation/finite` (under mixed
/// precision an overflow in any micro-batch skips the cycle's update, as it would
/// skip the step).
#[derive(Clone, Debug, PartialEq)]
pub struct Accumulate<O> {
    pub inner: O,
    pub steps: usize,
}

impl<O> Accumulate<O> {
    pub fn new(inner: O, steps: usize) -> Self {
        Accumulate { inner, steps }
    }
}

/// The name of [`Accumulate`]'s step within its cycle.
pub const ACCUMULATION_STEP_VARIABLE: &str = "accumulation/step";
/// The name of [`Accumulate`]'s flag: every gradient of the cycle so far was finite.
pub const ACCUMULATION_FINITE_VARIABLE: &str = "accumulation/finite";

impl<O: Optimizer> Optimizer for Accumulate<O> {
    fn apply_gradients(
        &self,
        g: &mut Graph,
        vars: &[NodeId],
        grads: &[Port],
        finite: Port,
    ) -> Result<Vec<Port>, GraphError> {
        if self.steps == 0 {
            return Err(GraphError::Format(
                "gradient accumulation needs at least one step".into(),
            ));
        }
        let counter = scalar_variable(g, ACCUMULATION_STEP_VARIABLE, DType::F32, 0.0)?;
        let ok = scalar_variable(g, ACCUMULATION_FINITE_VARIABLE, DType::Bool, 1.0)?;
        let one = g.scalar(DType::F32, 1.0)?;
        let next = g.plus(counter, one)?;
        let steps = g.scalar(DType::F32, self.steps as f64)?;
        let last = g.equal(next, steps)?;
        let cycle_ok = g.logical_and(ok, finite)?;
        let apply = g.logical_and(cycle_ok, last)?;
        let mut writes = Vec::new();
        let mut means = Vec::with_capacity(grads.len());
        for (&var, &grad) in vars.iter().zip(grads) {
            let ty = g.ty(grad).clone();
            let name = format!("{}/accumulated", g.node(var).name);
            let acc: Port = g
                .add_node(
                    name,
                    Box::new(Variable::with_init(ty.clone(), Init::Zeros)),
                    &[],
                )?
                .into();
            let sum = g.plus(acc, grad)?;
            let inv = g.scalar(ty.dtype, 1.0 / self.steps as f64)?;
            means.push(g.mul(sum, inv)?);
            // The sum starts again after the cycle's last step.
            let zero = g.scalar(ty.dtype, 0.0)?;
            let kept = g.where_(last, zero, sum)?;
            writes.push(g.add(AssignVariable, &[acc, kept])?);
        }
        writes.extend(self.inner.apply_gradients(g, vars, &means, apply)?);
        let zero = g.scalar(DType::F32, 0.0)?;
        let wrapped = g.where_(last, zero, next)?;
        writes.push(g.add(AssignVariable, &[counter, wrapped])?);
        let fresh = g.scalar(DType::Bool, 1.0)?;
        let ok_next = g.where_(last, fresh, cycle_ok)?;
        writes.push(g.add(AssignVariable, &[ok, ok_next])?);
        Ok(writes)
    }
}

/// How the loss is scaled under mixed precision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossScale {
    /// TensorFlow's dynamic loss scale: start at `initial`, multiply by
    /// `growth_factor` after `growth_interval` finite steps, by `backoff_factor` on
    /// overflow (and skip that step).
    Dynamic {
        initial: f64,
        growth_interval: i64,
        growth_factor: f64,
        backoff_factor: f64,
    },
    /// A constant scale (steps with non-finite gradients are still skipped).
    Fixed(f64),
    /// No scale and no check: every step applies its gradients, finite or not, as
    /// PyTorch's bf16 autocast without a GradScaler and TensorFlow's `mixed_bfloat16`
    /// policy train (bf16 has f32's range: its gradients do not underflow).
    None,
}

impl LossScale {
    /// TensorFlow's dynamic loss scale from `initial`: doubled after 2000 finite
    /// steps, halved on overflow.
    pub fn dynamic(initial: f64) -> Self {
        LossScale::Dynamic {
            initial,
            growth_interval: 2000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
        }
    }
}

impl Default for LossScale {
    /// Dynamic from 2^15, TensorFlow's start.
    fn default() -> Self {
        LossScale::dynamic(32768.0)
    }
}

/// An optimizer whose `minimize` builds a loss-scaled, mixed-precision training step.
#[derive(Clone, Debug)]
pub struct MixedPrecision<O> {
    pub inner: O,
    pub loss_scale: LossScale,
    /// The 16-bit type the session's AMP pass converts to; `F8E4M3` for BF16 with FP8
    /// products where they pay (`AmpConfig::new`'s defaults; a session's
    /// `SessionOptions::amp` picks the recipe).
    pub dtype: DType,
}

impl<O> MixedPrecision<O> {
    pub fn with_loss_scale(mut self, loss_scale: LossScale) -> Self {
        self.loss_scale = loss_scale;
        self
    }

    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }
}

/// Wraps `optimizer` for automatic mixed precision, as TensorFlow's function of the
/// same name: dynamic loss scaling in the graph, and the graph marked so that a
/// session runs the AMP rewrite (FP16 unless [`MixedPrecision::with_dtype`]).
///
/// ```
/// use ampgraph::graph::nn;
/// use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd};
/// use ampgraph::{DType, Device, Graph, Session};
///
/// let mut g = Graph::new();
/// let x = g.placeholder("x", DType::F32, [8, 16])?;
/// let labels = g.placeholder("labels", DType::I64, [8])?;
/// let logits = nn::dense(&mut g, x, 4, None)?;
/// let loss = g.softmax_cross_entropy(logits, labels)?;
/// let train = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9))
///     .with_dtype(DType::BF16)
///     .minimize(&mut g, loss)?;
/// assert!(train.loss_scale.is_some(), "dynamic loss scaling by default");
/// let session = Session::new(g, Device::Cpu)?; // the AMP pass runs here
/// assert!(session.passes.iter().any(|r| r.summary.to_string().contains("Grappler")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn enable_mixed_precision_graph_rewrite<O: Optimizer>(optimizer: O) -> MixedPrecision<O> {
    MixedPrecision {
        inner: optimizer,
        loss_scale: LossScale::default(),
        dtype: DType::F16,
    }
}

/// Names of the loss-scale state variables.
pub const LOSS_SCALE_VARIABLE: &str = "loss_scale/scale";
pub const GOOD_STEPS_VARIABLE: &str = "loss_scale/good_steps";

impl<O: Optimizer> Optimizer for MixedPrecision<O> {
    fn apply_gradients(
        &self,
        g: &mut Graph,
        vars: &[NodeId],
        grads: &[Port],
        finite: Port,
    ) -> Result<Vec<Port>, GraphError> {
        self.inner.apply_gradients(g, vars, grads, finite)
    }

    fn minimize(&self, g: &mut Graph, loss: Port) -> Result<TrainStep, GraphError> {
        if self.loss_scale == LossScale::None {
            g.mixed_precision = Some(self.dtype);
            return self.inner.minimize(g, loss);
        }
        let vars = trainable_variables(g, loss)?;
        let loss32 = match g.ty(loss).dtype {
            DType::F32 => loss,
            _ => g.add(Cast { to: DType::F32 }, &[loss])?,
        };
        let (scale, dynamic) = match self.loss_scale {
            LossScale::Dynamic {
                initial,
                growth_interval,
                growth_factor,
                backoff_factor,
            } => {
                let scale = scalar_variable(g, LOSS_SCALE_VARIABLE, DType::F32, initial)?;
                let good = scalar_variable(g, GOOD_STEPS_VARIABLE, DType::F32, 0.0)?;
                let update = LossScaleUpdate {
                    growth_interval,
                    growth_factor,
                    backoff_factor,
                };
                (scale, Some((good, update)))
            }
            LossScale::Fixed(s) => (g.add(Const::new(Tensor::scalar(DType::F32, s)), &[])?, None),
            LossScale::None => unreachable!("handled above"),
        };
        let scaled = g.add(Binary::new(BinaryKind::Mul), &[loss32, scale])?;
        let (vars, grads) = with_gradients(g, scaled, vars)?;
        // Unscale in f32: the explicit cast keeps the AMP pass from moving the
        // multiplication into 16 bits, where 1/scale would underflow.
        let inv = g.add(Unary::new(UnaryKind::Reciprocal), &[scale])?;
        let mut unscaled = Vec::with_capacity(grads.len());
        for grad in grads {
            let grad32 = g.add(Cast { to: DType::F32 }, &[grad])?;
            unscaled.push(g.add(Binary::new(BinaryKind::Mul), &[grad32, inv])?);
        }
        let finite = g.add(AllFinite::default(), &unscaled)?;
        let mut writes = self.inner.apply_gradients(g, &vars, &unscaled, finite)?;
        let dynamic_scale = dynamic.as_ref().map(|_| scale);
        if let Some((good, update)) = dynamic {
            let node = g.add_node(
                g.fresh_name("loss_scale/update"),
                Box::new(update),
                &[finite, scale, good],
            )?;
            writes.push(g.add(AssignVariable, &[scale, Port::new(node, 0)])?);
            writes.push(g.add(AssignVariable, &[good, Port::new(node, 1)])?);
        }
        g.mixed_precision = Some(self.dtype);
        finish(g, loss, vars, writes, dynamic_scale)
    }
}
