//! Check-numerics mode and loss-scale health: which op made a step's first non-finite
//! value, and when a dynamic loss scale is collapsing.
//!
//! With [`SessionOptions::check_numerics`](crate::SessionOptions::check_numerics) (or
//! `AMPGRAPH_CHECK_NUMERICS=1`) a session snapshots the variables and keeps the feeds
//! before each step. When the step fetches a float value that is NaN or infinite, or
//! its dynamic loss scale backs off, the step is run again on a
//! [`CpuExecutor`] from that snapshot through [`CpuExecutor::run_observed`], stopping
//! at the first node, in execution order, whose output is not finite while its inputs
//! are: a [`NumericsReport`]. The CPU stores 16-bit tensors and rounds once per op as
//! the GPU kernels do, so what overflowed f16 on the device overflows in the re-run.
//! With the mode off a step pays one test of a flag.
//!
//! [`LossScaleMonitor`] follows the loss scale step by step (the
//! [`Trainer`](crate::train::Trainer) feeds it): its history, and a warning when the
//! gradients overflow [`COLLAPSE_BACKOFFS`] steps in a row or the scale falls to 1,
//! its floor ([`LossScaleUpdate`](ampgraph_graph::ops::LossScaleUpdate) never takes it
//! lower: where PyTorch's GradScaler falls toward 1e-200, ours sits at 1 while every
//! step is skipped).

use std::collections::HashMap;
use std::fmt;
use std::ops::ControlFlow;

use half::{bf16, f16};

use ampgraph_exec::{CpuExecutor, ExecError, Executor, Feeds};
use ampgraph_graph::{DType, Data, Graph, Port, Tensor};
use ampgraph_passes::amp::report::explain;
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision, Painting};
use ampgraph_passes::PassError;

use crate::optim::{GOOD_STEPS_VARIABLE, LOSS_SCALE_VARIABLE};
use crate::session::Session;

/// Where this module logs its reports (the CLI prints a report itself where the log
/// would not show it).
pub(crate) const LOG_TARGET: &str = module_path!();

/// The values of one tensor: finite extremes and how many are NaN or infinite.
#[derive(Clone, Debug, PartialEq)]
pub struct Range {
    /// The tensor: its node's name, with `:k` for output k > 0.
    pub tensor: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// The smallest and largest finite values (`None`: no finite value).
    pub finite: Option<(f64, f64)>,
    pub nan: usize,
    pub inf: usize,
}

impl Range {
    /// The range of `value`, the tensor called `tensor`.
    pub fn of(tensor: String, value: &Tensor) -> Range {
        let (mut finite, mut nan, mut inf) = (None::<(f64, f64)>, 0, 0);
        for x in value.to_f64_vec() {
            if x.is_nan() {
                nan += 1;
            } else if x.is_infinite() {
                inf += 1;
            } else {
                finite = Some(finite.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))));
            }
        }
        Range {
            tensor,
            dtype: value.dtype(),
            shape: value.shape().to_vec(),
            finite,
            nan,
            inf,
        }
    }

    pub fn is_finite(&self) -> bool {
        self.nan == 0 && self.inf == 0
    }
}

/// A value in a few significant digits (65504, 0.0312, 1.2e-7).
fn short(x: f64) -> String {
    if x == 0.0 || (1e-3..1e6).contains(&x.abs()) {
        let s = format!("{x:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.3e}")
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "'{}' {}{}: ",
            self.tensor,
            self.dtype,
            ampgraph_graph::tensor::ShapeDisplay(&self.shape)
        )?;
        match self.finite {
            Some((lo, hi)) => write!(f, "finite values in [{}, {}]", short(lo), short(hi))?,
            None => write!(f, "no finite value")?,
        }
        write!(f, ", {} NaN, {} inf", self.nan, self.inf)
    }
}

/// What made a session re-run a step under check-numerics.
#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// A fetched float tensor holds NaN or infinity.
    NonFiniteFetch { tensor: String },
    /// The dynamic loss scale backed off, or stayed at its floor of 1 with its count
    /// of good steps reset: the step's gradients were not finite.
    LossScaleBackoff { from: f64, to: f64 },
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Trigger::NonFiniteFetch { tensor } => {
                write!(f, "the fetched tensor '{tensor}' is not finite")
            }
            Trigger::LossScaleBackoff { from, to } => write!(
                f,
                "the gradients were not finite (the loss scale backed off, {} -> {})",
                short(*from),
                short(*to)
            ),
        }
    }
}

/// The first node of a step whose output is not finite while its inputs are.
#[derive(Clone, Debug, PartialEq)]
pub struct NumericsReport {
    /// The session's step, counted from 0 ([`Session::step_count`] before it ran).
    pub step: u64,
    /// What showed that the step went wrong (set by the session; `None` from
    /// [`first_non_finite`] alone).
    pub trigger: Option<Trigger>,
    pub node: String,
    pub op: String,
    /// The type of the non-finite output.
    pub dtype: DType,
    pub inputs: Vec<Range>,
    /// The first non-finite output.
    pub output: Range,
    /// `explain`'s view of why the node runs in its precision, where the node is in
    /// the graph before the AMP rewrite.
    pub explanation: Option<String>,
}

impl NumericsReport {
    /// The report in one line (the CLI's error line).
    pub fn summary(&self) -> String {
        let total: usize = self.output.shape.iter().product();
        format!(
            "step {}: node '{}' ({}, {}) made the first non-finite value ({} NaN, {} inf of {total}) from finite inputs",
            self.step, self.node, self.op, self.dtype, self.output.nan, self.output.inf
        )
    }
}

impl fmt::Display for NumericsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "check-numerics: {}", self.summary())?;
        if let Some(trigger) = &self.trigger {
            writeln!(f, "  seen because {trigger}")?;
        }
        for (k, input) in self.inputs.iter().enumerate() {
            writeln!(f, "  input {k}: {input}")?;
        }
        writeln!(f, "  output: {}", self.output)?;
        if let Some(why) = &self.explanation {
            writeln!(f, "  why {}:", self.dtype)?;
            for line in why.lines() {
                writeln!(f, "    {line}")?;
            }
        }
        Ok(())
    }
}

/// Whether a step's gradients overflowed, from the loss scale before it (`before`)
/// and after it (`after`): a non-finite step backs the scale off, or at its floor of
/// 1 leaves it there and only resets the count of good steps, read from `good_steps`
/// in that case alone (on CUDA each read is a copy from the device).
fn overflowed(before: f64, after: f64, good_steps: impl FnOnce() -> Option<f64>) -> bool {
    if after != before {
        return after < before;
    }
    after <= 1.0 && good_steps() == Some(0.0)
}

/// A scalar variable's value.
fn scalar(t: &Tensor) -> Option<f64> {
    t.to_f64_vec().first().copied()
}

/// Whether `data` holds a NaN or an infinity (false for non-float types).
fn has_non_finite(data: &Data) -> bool {
    match data {
        Data::F32(v) => v.iter().any(|x| !x.is_finite()),
        Data::F16(v) => v.iter().any(|x| !f16::is_finite(*x)),
        Data::BF16(v) => v.iter().any(|x| !bf16::is_finite(*x)),
        Data::F64(v) => v.iter().any(|x| !x.is_finite()),
        Data::F8E4M3(v) => v.iter().any(|x| !x.is_finite()),
        Data::F8E5M2(v) => v.iter().any(|x| !x.is_finite()),
        Data::I32(_) | Data::I64(_) | Data::Bool(_) => false,
    }
}

/// Runs a step of `graph` on the CPU from `variables` and `feeds`, stopping at the
/// first node in execution order whose float output is not finite while its inputs
/// are all finite: `None` where no node does. Sources (constants, feeds, variables)
/// holding NaN or infinity are not blamed, nor ops fed by them (an attention mask's
/// -inf is meant): a value that is non-finite only downstream of them gives `None`.
pub fn first_non_finite(
    graph: &Graph,
    fetches: &[Port],
    feeds: &Feeds,
    variables: HashMap<String, Tensor>,
    step: u64,
) -> Result<Option<NumericsReport>, ExecError> {
    let mut cpu = CpuExecutor::new();
    cpu.variables = variables;
    let mut found = None;
    let name = |p: Port| match p.index {
        0 => graph.node(p.node).name.clone(),
        k => format!("{}:{k}", graph.node(p.node).name),
    };
    cpu.run_observed(graph, feeds, fetches, &mut |seen| {
        let Some(bad) = seen.outputs.iter().position(|t| has_non_finite(t.data())) else {
            return ControlFlow::Continue(());
        };
        if seen.inputs.is_empty() || seen.inputs.iter().any(|t| has_non_finite(t.data())) {
            return ControlFlow::Continue(());
        }
        let node = graph.node(seen.id);
        let inputs = graph
            .inputs(seen.id)
            .into_iter()
            .zip(seen.inputs)
            .map(|(p, t)| Range::of(name(p), t))
            .collect();
        let output = Range::of(name(Port::new(seen.id, bad)), &seen.outputs[bad]);
        found = Some(NumericsReport {
            step,
            trigger: None,
            node: node.name.clone(),
            op: node.op.name().to_string(),
            dtype: output.dtype,
            inputs,
            output,
            explanation: None,
        });
        ControlFlow::Break(())
    })?;
    Ok(found)
}

/// The variables and feeds of a step about to run, kept under check-numerics.
pub(crate) struct Snapshot {
    step: u64,
    variables: HashMap<String, Tensor>,
    feeds: Feeds,
}

impl Snapshot {
    /// Copies every variable of `executor` (on CUDA a download) and `feeds`.
    pub(crate) fn take(
        executor: &dyn Executor,
        feeds: &Feeds,
        step: u64,
    ) -> Result<Snapshot, ExecError> {
        let mut variables = HashMap::new();
        for name in executor.variable_names() {
            if let Some(value) = executor.try_variable(&name)? {
                variables.insert(name, value);
            }
        }
        Ok(Snapshot {
            step,
            variables,
            feeds: feeds.clone(),
        })
    }

    /// Why the step just run needs a look: a non-finite fetched tensor (`names` are
    /// the fetches' names) or gradients that overflowed (by the loss-scale state).
    fn trigger(
        &self,
        executor: &dyn Executor,
        names: impl Fn(usize) -> String,
        outputs: &[Tensor],
    ) -> Result<Option<Trigger>, ExecError> {
        if let Some(k) = outputs.iter().position(|t| has_non_finite(t.data())) {
            return Ok(Some(Trigger::NonFiniteFetch { tensor: names(k) }));
        }
        let Some(before) = self.variables.get(LOSS_SCALE_VARIABLE) else {
            return Ok(None);
        };
        let after = executor.try_variable(LOSS_SCALE_VARIABLE)?;
        let good = executor.try_variable(GOOD_STEPS_VARIABLE)?;
        let good = || good.as_ref().and_then(scalar);
        Ok(match (scalar(before), after.as_ref().and_then(scalar)) {
            (Some(from), Some(to)) if overflowed(from, to, good) => {
                Some(Trigger::LossScaleBackoff { from, to })
            }
            _ => None,
        })
    }
}

/// A session's check-numerics state: what `explain` needs and the last report.
pub(crate) struct Checker {
    /// The graph before the AMP rewrite and its settings (`None`: no AMP).
    before_amp: Option<(Graph, AmpConfig)>,
    /// The AMP decisions on that graph, made when a report first needs them.
    painting: Option<Painting>,
    pub(crate) last: Option<NumericsReport>,
}

impl Checker {
    pub(crate) fn new(before_amp: Option<(Graph, AmpConfig)>) -> Checker {
        Checker {
            before_amp,
            painting: None,
            last: None,
        }
    }

    /// After a step: where `snapshot`'s step fetched a non-finite value or backed the
    /// loss scale off, re-runs it on the CPU (`graph` and `fetches` as the executor
    /// ran them), and keeps and logs the report.
    pub(crate) fn check(
        &mut self,
        snapshot: Snapshot,
        executor: &dyn Executor,
        graph: &Graph,
        fetches: &[Port],
        outputs: &[Tensor],
    ) -> Result<(), CheckError> {
        let names = |k: usize| graph.port_name(fetches[k]);
        let step = snapshot.step;
        let Some(trigger) = snapshot
            .trigger(executor, names, outputs)
            .map_err(|source| CheckError::Rerun { step, source })?
        else {
            return Ok(());
        };
        let found = first_non_finite(
            graph,
            fetches,
            &snapshot.feeds,
            snapshot.variables,
            snapshot.step,
        )
        .map_err(|source| CheckError::Rerun { step, source })?;
        let Some(mut report) = found else {
            log::warn!(
                "check-numerics: step {step}: {trigger}, but its re-run on the CPU made every value finite \
                 (a device kernel whose arithmetic differs from the CPU reference, or non-finite feeds or variables)"
            );
            return Ok(());
        };
        report.trigger = Some(trigger);
        report.explanation = self.explain(&report.node)?;
        log::warn!("{report}");
        self.last = Some(report);
        Ok(())
    }

    /// `explain`'s text for `node`, where it is in the graph before AMP.
    fn explain(&mut self, node: &str) -> Result<Option<String>, CheckError> {
        let Some((before, config)) = &self.before_amp else {
            return Ok(None);
        };
        if before.find(node).is_none() {
            return Ok(None);
        }
        let painting = match &mut self.painting {
            Some(p) => p,
            none => none.insert(AutoMixedPrecision::new(config.clone()).analyze(before)?),
        };
        Ok(Some(explain(before, painting, config, node)?.to_string()))
    }
}

/// Why check-numerics could not report on a step.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("check-numerics: re-running step {step} on the CPU: {source}")]
    Rerun { step: u64, source: ExecError },
    #[error("check-numerics: explaining the node's precision: {0}")]
    Explain(#[from] PassError),
}

/// Overflowing steps in a row after which a [`LossScaleMonitor`] says the loss scale
/// is collapsing: a healthy dynamic scale backs off once or twice in a row (at the
/// start, or after it grew), while one that halves five times running has lost a
/// factor of 32 to gradients that overflow whatever the scale.
pub const COLLAPSE_BACKOFFS: usize = 5;

/// How a loss scale collapses.
#[derive(Clone, Debug, PartialEq)]
pub enum Collapse {
    /// The gradients overflowed `count` steps in a row, the scale backing off from
    /// `from`.
    Backoffs { count: usize, from: f64 },
    /// It backed off to 1 or below: it no longer scales the loss up, and every
    /// overflow from now on is a skipped step (at 1, the floor of our loss-scale
    /// update, a skipped step leaves it there).
    BelowOne,
}

/// A warning of a [`LossScaleMonitor`].
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaleAlarm {
    /// The step after which the scale was seen (as [`NumericsReport::step`]).
    pub step: u64,
    pub scale: f64,
    pub collapse: Collapse,
    /// Check-numerics' one-line report on the op that overflowed, where the mode is on.
    pub culprit: Option<String>,
}

impl fmt::Display for LossScaleAlarm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loss scale collapsing at step {}: ", self.step)?;
        match &self.collapse {
            Collapse::Backoffs { count, from } => write!(
                f,
                "the gradients overflowed {count} steps in a row ({} -> {})",
                short(*from),
                short(self.scale)
            )?,
            Collapse::BelowOne => write!(
                f,
                "it backed off to {}, where it no longer scales the loss up",
                short(self.scale)
            )?,
        }
        match &self.culprit {
            Some(c) => write!(f, "; check-numerics: {c}"),
            None => write!(
                f,
                "; some gradient overflows at every scale (SessionOptions::check_numerics or \
                 AMPGRAPH_CHECK_NUMERICS=1 names the op)"
            ),
        }
    }
}

/// Follows a dynamic loss scale after every step: its history, and an alarm when the
/// gradients overflow `backoff_limit` steps in a row or the scale backs off to 1 or
/// below (each once, until it recovers).
#[derive(Clone, Debug)]
pub struct LossScaleMonitor {
    backoff_limit: usize,
    history: Vec<(u64, f64)>,
    /// The scale before the next step.
    previous: Option<f64>,
    /// The overflowing steps in a row so far, the scale before the first and its step.
    streak: usize,
    streak_from: (f64, u64),
    /// The scale is at 1 or below and was reported so.
    below_one: bool,
}

impl Default for LossScaleMonitor {
    fn default() -> Self {
        Self::new(COLLAPSE_BACKOFFS)
    }
}

impl LossScaleMonitor {
    /// A monitor alarmed by `backoff_limit` backoffs in a row (at least 1).
    pub fn new(backoff_limit: usize) -> LossScaleMonitor {
        LossScaleMonitor {
            backoff_limit: backoff_limit.max(1),
            history: Vec::new(),
            previous: None,
            streak: 0,
            streak_from: (0.0, 0),
            below_one: false,
        }
    }

    /// The scale before the next step, where a loop starts or resumes (so that its
    /// first step's backoff counts).
    pub fn start(&mut self, scale: f64) {
        self.previous = Some(scale);
    }

    /// Every (step, scale after the step) recorded, in order.
    pub fn history(&self) -> &[(u64, f64)] {
        &self.history
    }

    /// Records the scale after `step`, whose gradients `overflowed` or not; an alarm
    /// where the scale collapses.
    pub fn record(&mut self, step: u64, scale: f64, overflowed: bool) -> Option<LossScaleAlarm> {
        self.history.push((step, scale));
        let before = self.previous.replace(scale).unwrap_or(scale);
        if !overflowed {
            self.streak = 0;
        } else {
            if self.streak == 0 {
                self.streak_from = (before, step);
            }
            self.streak += 1;
        }
        let collapse = if self.streak == self.backoff_limit {
            Collapse::Backoffs {
                count: self.streak,
                from: self.streak_from.0,
            }
        } else if overflowed && scale <= 1.0 && !self.below_one {
            Collapse::BelowOne
        } else {
            self.below_one &= scale <= 1.0;
            return None;
        };
        self.below_one |= scale <= 1.0;
        Some(LossScaleAlarm {
            step,
            scale,
            collapse,
            culprit: None,
        })
    }

    /// Records `session`'s loss scale ([`LOSS_SCALE_VARIABLE`], and whether the step
    /// overflowed by it and [`GOOD_STEPS_VARIABLE`]) after the step it just ran
    /// (nothing without one); an alarm, logged and naming check-numerics' culprit where
    /// the session found one among the overflowing steps, where the scale collapses.
    pub fn after_step(&mut self, session: &Session) -> Option<LossScaleAlarm> {
        let scale = scalar(session.variable(LOSS_SCALE_VARIABLE)?)?;
        let good = || session.variable(GOOD_STEPS_VARIABLE).and_then(scalar);
        // Without the scale before the step (no `start`), only a reset count tells.
        let overflowed = match self.previous {
            Some(before) => overflowed(before, scale, good),
            None => good() == Some(0.0),
        };
        let step = session.step_count().saturating_sub(1);
        let mut alarm = self.record(step, scale, overflowed)?;
        let since = if self.streak > 0 {
            self.streak_from.1
        } else {
            step
        };
        alarm.culprit = session
            .last_numerics_report()
            .filter(|r| r.step >= since)
            .map(NumericsReport::summary);
        log::warn!("{alarm}");
        Some(alarm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monitor_warns_once_per_streak_and_below_one() {
        let mut m = LossScaleMonitor::new(3);
        m.start(16.0);
        let steps = [
            (8.0, true),
            (4.0, true),
            (2.0, true),
            (2.0, false),
            (1.0, true),
            (1.0, true),
            (1.0, true),
            (1.0, false),
            (2.0, false),
            (1.0, true),
        ];
        let alarms: Vec<_> = steps
            .into_iter()
            .enumerate()
            .filter_map(|(i, (s, overflowed))| m.record(i as u64, s, overflowed))
            .collect();
        assert_eq!(
            alarms
                .iter()
                .map(|a| (a.step, &a.collapse))
                .collect::<Vec<_>>(),
            [
                (
                    2,
                    &Collapse::Backoffs {
                        count: 3,
                        from: 16.0
                    }
                ),
                (4, &Collapse::BelowOne),
                (
                    6,
                    &Collapse::Backoffs {
                        count: 3,
                        from: 2.0
                    }
                ),
                (9, &Collapse::BelowOne),
            ]
        );
        assert_eq!(m.history().len(), 10);
        assert_eq!(m.history()[3], (3, 2.0));
        let text = alarms[1].to_string();
        assert!(text.contains("backed off to 1, where"), "{text}");
    }

    #[test]
    fn ranges_count_what_is_not_finite() {
        let t = Tensor::from_f64(DType::F16, vec![4], &[1.0, -2.5, 7e4, f64::NAN]).unwrap();
        let r = Range::of("x".into(), &t);
        assert_eq!((r.finite, r.nan, r.inf), (Some((-2.5, 1.0)), 1, 1));
        assert_eq!(
            r.to_string(),
            "'x' f16[4]: finite values in [-2.5, 1], 1 NaN, 1 inf"
        );
    }
}
