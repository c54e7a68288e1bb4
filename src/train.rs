//! Training a session's step on a [`Loader`]'s batches: epochs with a progress bar,
//! evaluation, the loss scale, and checkpoints a run resumes from exactly.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use ampgraph::data::{Loader, LoaderOptions, Mnist};
//! # use ampgraph::optim::TrainStep;
//! # use ampgraph::train::{Trainer, TrainOptions};
//! # use ampgraph::{Port, Session};
//! # fn f(session: &mut Session, step: TrainStep, images: Port, labels: Port)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! let data = Arc::new(Mnist::load("examples/data/mnist")?);
//! let loader = Loader::new(data, LoaderOptions { batch_size: 128, drop_last: true, ..Default::default() })?;
//! let options = TrainOptions { checkpoint: Some("mnist.ckpt".into()), ..Default::default() };
//! let mut trainer = Trainer::new(session, step, images, labels, options)?;
//! let mut at = trainer.resume_if_saved()?; // where a saved run stopped, or epoch 1
//! while at.epoch <= 10 {
//!     let report = trainer.epoch(&loader, at)?;
//!     println!("{report}");
//!     at = report.next;
//! }
//! # Ok(()) }
//! ```
//!
//! The position (the epoch under way and the batch it takes next) travels in the
//! checkpoint with every variable (weights, optimizer slots, the loss scale and its
//! counter), as two i64 scalars the trainer adds to the session, [`EPOCH_VARIABLE`]
//! and [`BATCH_VARIABLE`]. The loader's order and its random transforms depend only on
//! its seed, the epoch and the example, so a resumed run takes the batches an
//! uninterrupted one would, and ends with the same bits.

use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use ampgraph_data::{Batch, DataError, Loader};
use ampgraph_exec::{Feeds, Staged};
use ampgraph_graph::{DType, Port, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use thiserror::Error;

use crate::numerics::check::{LossScaleAlarm, LossScaleMonitor};
use crate::optim::TrainStep;
use crate::session::{Session, SessionError};

/// The names of the trainer's own variables begin so, under the library's
/// [`LIBRARY_PREFIX`](crate::checkpoint::LIBRARY_PREFIX): a session restoring a
/// checkpoint without them (outside a trainer) skips them.
pub const VARIABLE_PREFIX: &str = "ampgraph/trainer/";
/// The variable holding the epoch a checkpoint stopped in (counted from 1).
pub const EPOCH_VARIABLE: &str = "ampgraph/trainer/epoch";
/// The variable holding the batch of that epoch to take next.
pub const BATCH_VARIABLE: &str = "ampgraph/trainer/batch";

#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Data(#[from] DataError),
    /// The loader and the graph do not agree (batch size, example shape).
    #[error("{0}")]
    Mismatch(String),
    #[error("progress bar: {0}")]
    Progress(String),
}

/// Where training stands: the epoch under way (from 1) and its next batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub epoch: usize,
    pub batch: usize,
}

impl Position {
    /// The start of training.
    pub const START: Position = Position { epoch: 1, batch: 0 };
}

/// How a [`Trainer`] reports and saves.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Save every variable and the position here (atomically, the previous file kept
    /// as `PATH.prev`) at the end of each epoch.
    pub checkpoint: Option<PathBuf>,
    /// Also save every this many steps within an epoch.
    pub checkpoint_every: Option<usize>,
    /// Draw a progress bar (on stderr, where it is a terminal) with throughput and
    /// loss.
    pub progress: bool,
}

/// Whether an epoch ended with a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub enum Saved {
    /// No checkpoint path was given.
    NotAsked,
    Written(PathBuf),
    /// The mean loss was not finite: the last good checkpoint stays.
    RefusedNonFinite(PathBuf),
}

/// What an epoch did.
#[derive(Clone, Debug)]
pub struct EpochReport {
    pub epoch: usize,
    pub steps: usize,
    pub examples: usize,
    /// The mean of the steps' losses.
    pub loss: f64,
    /// Wall time of the epoch.
    pub seconds: f64,
    /// Wall time inside steps (from a step's call to its loss on the host): the rest
    /// went to waiting for batches and the loop's own work.
    pub step_seconds: f64,
    /// The steps' time on the device (CUDA events around their kernels), where the
    /// backend times it.
    pub device_seconds: Option<f64>,
    /// The loss scale after the epoch (dynamic loss scaling only).
    pub loss_scale: Option<f64>,
    /// The epoch's warnings of a collapsing loss scale ([`LossScaleMonitor`]; logged
    /// as they happen).
    pub loss_scale_alarms: Vec<LossScaleAlarm>,
    pub saved: Saved,
    /// Where the next epoch starts.
    pub next: Position,
    /// The evaluation set's accuracy and loss after the epoch, where [`Trainer::fit`]
    /// evaluated.
    pub evaluated: Option<Evaluated>,
}

impl EpochReport {
    pub fn examples_per_second(&self) -> f64 {
        self.examples as f64 / self.seconds
    }

    /// Why the epoch's checkpoint was not written, where it was asked for.
    pub fn warning(&self) -> Option<String> {
        match &self.saved {
            Saved::RefusedNonFinite(path) => Some(format!(
                "epoch {}'s loss is {}: not saving {} (the last checkpoint stays)",
                self.epoch,
                self.loss,
                path.display()
            )),
            _ => None,
        }
    }
}

impl fmt::Display for EpochReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {}: loss {:.4}, {:.3} s ({:.0} examples/s, steps {:.1}% of it",
            self.epoch,
            self.loss,
            self.seconds,
            self.examples_per_second(),
            100.0 * self.step_seconds / self.seconds
        )?;
        if let Some(d) = self.device_seconds {
            write!(f, ", the GPU {:.1}%", 100.0 * d / self.seconds)?;
        }
        write!(f, ")")?;
        if let Some(s) = self.loss_scale {
            write!(f, ", loss scale {s}")?;
        }
        if !self.loss_scale_alarms.is_empty() {
            let n = self.loss_scale_alarms.len();
            write!(
                f,
                " ({n} loss-scale warning{})",
                if n == 1 { "" } else { "s" }
            )?;
        }
        if let Some(e) = self.evaluated {
            write!(
                f,
                ", eval loss {:.4}, eval accuracy {:.2}%",
                e.loss,
                100.0 * e.accuracy
            )?;
        }
        Ok(())
    }
}

/// Keeps `at` in `session`'s position variables, where a checkpoint takes it.
pub(crate) fn write_position(session: &mut Session, at: Position) -> Result<(), SessionError> {
    let executor = session.executor_mut();
    executor.set_variable(EPOCH_VARIABLE, scalar(at.epoch))?;
    executor.set_variable(BATCH_VARIABLE, scalar(at.batch))?;
    Ok(())
}

/// The position a checkpoint restored into `session` (from `path`) holds.
pub(crate) fn read_position(
    session: &Session,
    path: &std::path::Path,
) -> Result<Position, TrainError> {
    let read = |name: &str| -> Result<usize, TrainError> {
        let value = session
            .variable(name)
            .and_then(|t| t.to_i64_vec())
            .and_then(|v| v.first().copied())
            .filter(|&v| v >= 0)
            .ok_or_else(|| {
                TrainError::Mismatch(format!(
                    "checkpoint {}: no training position ({name})",
                    path.display()
                ))
            })?;
        Ok(value as usize)
    };
    Ok(Position {
        epoch: read(EPOCH_VARIABLE)?.max(1),
        batch: read(BATCH_VARIABLE)?,
    })
}

/// Runs a training step over a loader's batches.
pub struct Trainer<'s> {
    session: &'s mut Session,
    step: TrainStep,
    images: Port,
    labels: Port,
    options: TrainOptions,
    /// The loss scale after every step (dynamic loss scaling only).
    monitor: LossScaleMonitor,
}

fn scalar(value: usize) -> Tensor {
    Tensor::new([], ampgraph_graph::Data::I64(vec![value as i64])).expect("a scalar")
}

impl<'s> Trainer<'s> {
    /// A trainer feeding each batch's images to the Placeholder `images` and its labels
    /// to `labels`, and running `step`.
    pub fn new(
        session: &'s mut Session,
        step: TrainStep,
        images: Port,
        labels: Port,
        options: TrainOptions,
    ) -> Result<Trainer<'s>, TrainError> {
        let mut trainer = Trainer {
            session,
            step,
            images,
            labels,
            options,
            monitor: LossScaleMonitor::default(),
        };
        trainer.set_position(Position::START)?;
        Ok(trainer)
    }

    pub fn session(&mut self) -> &mut Session {
        self.session
    }

    /// The loss scale after each step trained so far, with the session's step number
    /// (dynamic loss scaling only; empty otherwise).
    pub fn loss_scale_history(&self) -> &[(u64, f64)] {
        self.monitor.history()
    }

    /// Replaces the loss-scale monitor (another number of backoffs in a row to warn
    /// at), dropping the history.
    pub fn set_loss_scale_monitor(&mut self, monitor: LossScaleMonitor) {
        self.monitor = monitor;
    }

    fn set_position(&mut self, at: Position) -> Result<(), TrainError> {
        Ok(write_position(self.session, at)?)
    }

    fn read_position(&self, path: &std::path::Path) -> Result<Position, TrainError> {
        read_position(self.session, path)
    }

    /// Restores the checkpoint of [`TrainOptions::checkpoint`] and returns where it
    /// stopped.
    pub fn resume(&mut self) -> Result<Position, TrainError> {
        let path = self
            .options
            .checkpoint
            .clone()
            .ok_or_else(|| TrainError::Mismatch("resuming needs a checkpoint path".into()))?;
        self.session.restore(&path)?;
        self.read_position(&path)
    }

    /// [`resume`](Self::resume) where the checkpoint file exists, else the start.
    pub fn resume_if_saved(&mut self) -> Result<Position, TrainError> {
        match &self.options.checkpoint {
            Some(path) if path.exists() => self.resume(),
            _ => Ok(Position::START),
        }
    }

    fn feeds(&self, batch: Batch) -> Feeds {
        let name = |p: Port| self.session.graph().node(p.node).name.clone();
        Feeds::from([
            (name(self.images), batch.images),
            (name(self.labels), batch.labels),
        ])
    }

    /// Checks that the loader's batches fit the graph's Placeholders.
    fn check(&self, loader: &Loader) -> Result<(), TrainError> {
        let graph = self.session.graph();
        let want = graph.ty(self.images).clone();
        let data = loader.dataset();
        let got = batch_shape(loader);
        let short = !loader.options().drop_last && data.len() % loader.options().batch_size != 0;
        if want.shape != got || short {
            return Err(TrainError::Mismatch(format!(
                "{}: batches of shape {:?}{} do not fit the Placeholder '{}' {} (a graph's batch size is fixed: drop the last batch or pick a size dividing {})",
                data.describe(),
                got,
                if short { " and a short last batch" } else { "" },
                graph.node(self.images.node).name,
                want,
                data.len()
            )));
        }
        Ok(())
    }

    /// Trains epoch `at.epoch` from batch `at.batch` to its end, saving a checkpoint
    /// where asked.
    pub fn epoch(&mut self, loader: &Loader, at: Position) -> Result<EpochReport, TrainError> {
        self.check(loader)?;
        let total = loader.batches_per_epoch();
        if total == 0 {
            return Err(TrainError::Mismatch(format!(
                "an epoch has no batch: {} examples in batches of {}{}",
                loader.dataset().len(),
                loader.global_batch_size(),
                if loader.options().drop_last {
                    ", the last one incomplete and dropped"
                } else {
                    ""
                }
            )));
        }
        if at.batch >= total {
            return Err(TrainError::Mismatch(format!(
                "the position to start from, batch {} of epoch {}, is past the epoch's last \
                 batch ({total} batches an epoch): the checkpoint was not written for this data",
                at.batch, at.epoch
            )));
        }
        let bar = match self.options.progress {
            true => ProgressBar::new(total as u64)
                .with_style(
                    ProgressStyle::with_template(
                        "epoch {prefix} [{bar:30}] {pos}/{len} {per_sec} {msg}",
                    )
                    .map_err(|e| TrainError::Progress(e.to_string()))?
                    .progress_chars("=> "),
                )
                .with_prefix(at.epoch.to_string())
                .with_position(at.batch as u64),
            false => ProgressBar::hidden(),
        };
        let fetches = [self.step.loss, self.step.step];
        let start = Instant::now();
        let mut batches = loader.epoch_from(at.epoch as u64, at.batch);
        let mut current = batches
            .next()
            .transpose()?
            .map(|b| Staged::host(self.feeds(b)));
        let (mut steps, mut examples, mut loss_sum) = (0, 0, 0.0);
        let (mut step_seconds, mut device_ms) = (0.0, None::<f64>);
        let mut saved = Saved::NotAsked;
        let mut alarms = Vec::new();
        if let Some(scale) = self.loss_scale() {
            self.monitor.start(scale);
        }
        while let Some(staged) = current {
            // The next batch is taken before the step, so that its copy to the device
            // runs while the step computes.
            let next = batches.next().transpose()?;
            let rows = staged.feeds().values().next().map_or(0, |t| t.shape()[0]);
            let next_feeds = next.map(|b| self.feeds(b));
            let started = Instant::now();
            let out = self.session.run_overlapped(&fetches, staged, next_feeds)?;
            step_seconds += started.elapsed().as_secs_f64();
            if let Some(ms) = out.device_ms {
                device_ms = Some(device_ms.unwrap_or(0.0) + ms);
            }
            if self.step.loss_scale.is_some() {
                alarms.extend(self.monitor.after_step(self.session));
            }
            let loss = out.outputs[0].to_f64_vec()[0];
            steps += 1;
            examples += rows;
            loss_sum += loss;
            bar.inc(1);
            bar.set_message(format!("loss {:.4}", loss_sum / steps as f64));
            current = out.next;
            let done = at.batch + steps;
            let due = self
                .options
                .checkpoint_every
                .is_some_and(|n| n > 0 && done % n == 0);
            if due && current.is_some() {
                saved = self.save(
                    Position {
                        epoch: at.epoch,
                        batch: done,
                    },
                    loss_sum / steps as f64,
                )?;
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let loss = loss_sum / steps.max(1) as f64;
        let next = Position {
            epoch: at.epoch + 1,
            batch: 0,
        };
        if self.options.checkpoint.is_some() {
            saved = self.save(next, loss)?;
        }
        Ok(EpochReport {
            epoch: at.epoch,
            steps,
            examples,
            loss,
            seconds,
            step_seconds,
            device_seconds: device_ms.map(|ms| ms / 1e3),
            loss_scale: self.loss_scale(),
            loss_scale_alarms: alarms,
            saved,
            next,
            evaluated: None,
        })
    }

    /// Trains from `at` to the end of epoch `last`, evaluating after each epoch where
    /// `eval` is given; `on_epoch` sees each epoch's report as it ends (to print it).
    /// Returns the position after the last epoch.
    pub fn fit(
        &mut self,
        loader: &Loader,
        mut at: Position,
        last: usize,
        mut eval: Option<&mut Evaluation>,
        mut on_epoch: impl FnMut(&EpochReport),
    ) -> Result<Position, TrainError> {
        while at.epoch <= last {
            let mut report = self.epoch(loader, at)?;
            if let Some(eval) = eval.as_mut() {
                report.evaluated = Some(eval.evaluate(self.session)?);
            }
            on_epoch(&report);
            at = report.next;
        }
        Ok(at)
    }

    /// The current loss scale (dynamic loss scaling only).
    pub fn loss_scale(&self) -> Option<f64> {
        let scale = self.step.loss_scale?;
        let name = &self.session.graph().node(scale.node).name;
        self.session.variable(name).map(|t| t.to_f64_vec()[0])
    }

    /// Saves the session at `at`, unless the loss so far is not finite.
    fn save(&mut self, at: Position, loss: f64) -> Result<Saved, TrainError> {
        let Some(path) = self.options.checkpoint.clone() else {
            return Ok(Saved::NotAsked);
        };
        if !loss.is_finite() {
            return Ok(Saved::RefusedNonFinite(path));
        }
        self.set_position(at)?;
        self.session.save(&path)?;
        Ok(Saved::Written(path))
    }
}

/// An inference session of the model being trained (its own batch size, batch norms
/// on their running averages) and the data it is evaluated on.
pub struct Evaluation {
    pub session: Session,
    pub logits: Port,
    pub images: Port,
    pub loader: Loader,
}

impl Evaluation {
    /// The accuracy and loss of `trained`'s current weights (copied into this session
    /// first).
    pub fn evaluate(&mut self, trained: &Session) -> Result<Evaluated, TrainError> {
        self.session.copy_variables_from(trained)?;
        evaluate(&mut self.session, self.logits, self.images, &self.loader)
    }
}

/// How a model did on an evaluation set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluated {
    /// The share of examples whose largest logit is at their label.
    pub accuracy: f64,
    /// The mean softmax cross-entropy of the logits against the labels (in f64): a
    /// held-out loss, smoother than the accuracy for comparing two runs.
    pub loss: f64,
}

/// The accuracy and loss over `loader`'s examples: `logits` is a session's
/// `[batch, classes]` output for the Placeholder `images` fed each batch of `loader`
/// (in its order; shuffle off for a fixed order). A short last batch is padded with
/// zeros to the graph's batch size and only its real rows count (each row's logits
/// depend on that row alone in inference).
pub fn evaluate(
    session: &mut Session,
    logits: Port,
    images: Port,
    loader: &Loader,
) -> Result<Evaluated, TrainError> {
    let want = session.graph().ty(images).clone();
    let name = session.graph().node(images.node).name.clone();
    let rows = want.shape.first().copied().unwrap_or(0);
    let (mut correct, mut total, mut loss) = (0usize, 0usize, 0.0);
    for batch in loader.epoch(0) {
        let batch = batch?;
        let n = batch.labels.shape()[0];
        let images = pad_rows(batch.images, rows).map_err(TrainError::Mismatch)?;
        if images.shape() != want.shape {
            return Err(TrainError::Mismatch(format!(
                "{}: batches of shape {:?} do not fit the Placeholder '{name}' {want}",
                loader.dataset().describe(),
                batch_shape(loader),
            )));
        }
        let out = session.run(&[logits], &Feeds::from([(name.clone(), images)]))?;
        let values = out[0].to_f64_vec();
        let classes = out[0].shape().last().copied().unwrap_or(1).max(1);
        let labels = batch.labels.to_i64_vec().unwrap_or_default();
        for (row, &label) in values.chunks(classes).zip(&labels).take(n) {
            let predicted = (0..classes).max_by(|&a, &b| row[a].total_cmp(&row[b]));
            correct += usize::from(predicted == Some(label as usize));
            loss += cross_entropy(row, label);
        }
        total += n;
    }
    let total = total.max(1) as f64;
    Ok(Evaluated {
        accuracy: correct as f64 / total,
        loss: loss / total,
    })
}

/// `-log softmax(row)[label]`, by the log-sum-exp around the row's largest logit (a
/// label outside the row counts as infinitely wrong).
fn cross_entropy(row: &[f64], label: i64) -> f64 {
    let top = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let log_sum = top + row.iter().map(|v| (v - top).exp()).sum::<f64>().ln();
    usize::try_from(label)
        .ok()
        .and_then(|l| row.get(l))
        .map_or(f64::INFINITY, |v| log_sum - v)
}

fn batch_shape(loader: &Loader) -> Vec<usize> {
    [&[loader.options().batch_size][..], loader.dataset().shape()].concat()
}

/// `t` with zero rows appended up to `rows` (f32 images).
fn pad_rows(t: Tensor, rows: usize) -> Result<Tensor, String> {
    let n = t.shape().first().copied().unwrap_or(0);
    if n >= rows || t.dtype() != DType::F32 {
        return Ok(t);
    }
    let mut shape = t.shape().to_vec();
    let per_row = t.len() / n.max(1);

    let mut values = t.into_data().to_f32();
    values.resize(rows * per_row, 0.0);
    shape[0] = rows;
    Tensor::new(shape, ampgraph_graph::Data::F32(values))
}
