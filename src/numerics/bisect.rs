//! Bisection: which few nodes to keep in f32 so that a mixed-precision graph's outputs
//! stay within tolerance of the f32 graph's.
//!
//! **The error of a rewrite** is, per output, `max |y16 - y32| / max |y32|` (over the
//! elements, in f64; the f32 graph's outputs are the reference), and the worst of that
//! over the outputs. An element that is non-finite in one and not (or not the same
//! non-finite value) in the other counts as an infinite error, so a NaN output is
//! never within tolerance; where the reference is all zeros any difference is infinite.
//!
//! **Ranking.** An observed run of the rewritten graph measures each node that runs in
//! 16 bits: its op is evaluated again in f32 on the very 16-bit inputs it read, so the
//! difference from its 16-bit output is the error the node's *own* arithmetic adds
//! (its rounding on store, or an overflow), whatever its inputs already carried. A
//! node's local error is the larger of
//! - that own error over the node's f32 magnitude, and
//! - for each reader, how much the reader's f32 op on its 16-bit inputs moves when the
//!   node's input is replaced by its exact value, over the reader's f32 magnitude.
//!
//! The second term is what finds a cancellation: `1024 + x` rounded to 0.5 is a tiny
//! error next to 1024 but the whole of `(1024 + x) - 1024`, and the fix is the
//! producer's f32 (the Sub kept in f32 still reads the rounded sum, and a kept node's
//! f32 spreads forward to its infer readers, not back). A node whose output is
//! non-finite from finite inputs ranks first (infinite error). Comparing the error a
//! node's output carries with its inputs' (err(out) - max err(in)) would point at the
//! cancelling Sub instead, which is why the measure re-runs the ops. It looks one
//! reader ahead only: a rounding that matters only several ops later ranks by its
//! effect one op later, and is found by the batches' growth.
//!
//! **Search.** The top-ranked nodes are kept in f32 ([`PrecisionLists::keep_f32`]) in
//! growing batches (1, 2, 4, ... more), ranked again after each batch from that
//! evaluation's own observed run (an overflow's inf or NaN hides the errors after it
//! until it is kept), until the rewrite is within tolerance. Then the shortest prefix
//! of the last batch that suffices is found by halving, and each chosen node, the last
//! chosen first, is dropped where the outputs stay within tolerance without it.
//! Every evaluation is one rewrite and one CPU run (the f32 reference run is not
//! counted); a set already evaluated is not run again.

use std::collections::HashMap;
use std::ops::ControlFlow;

use thiserror::Error;

use ampgraph_exec::{CpuExecutor, Evaluated, ExecError, Feeds};
use ampgraph_graph::ops::Cast;
use ampgraph_graph::{Graph, NodeId, Port, Tensor};
use ampgraph_passes::amp::lists::keep_f32_toml;
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision, PrecisionLists};
use ampgraph_passes::PassError;

#[derive(Debug, Error)]
pub enum BisectError {
    #[error("bisect: rtol must be a finite number >= 0, not {0}")]
    Tolerance(f64),
    #[error("bisect: {0}")]
    Exec(#[from] ExecError),
    #[error("bisect: {0}")]
    Pass(#[from] PassError),
    #[error(
        "bisect: with all {kept} nodes whose 16-bit arithmetic erred kept in f32, the \
         outputs still differ by {error:.2e} (rtol {rtol:.1e})"
    )]
    Unreachable { kept: usize, error: f64, rtol: f64 },
}

/// What [`bisect`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Bisection {
    /// The nodes to keep in f32, in rank order, with why (the reason `explain` gives).
    pub keep_f32: Vec<(String, String)>,
    /// Rewrites run and compared with the reference (the f32 run not counted).
    pub evaluations: usize,
    /// The plain rewrite's error (see the module's metric).
    pub error_before: f64,
    /// The error with `keep_f32` kept in f32 (`error_before` where the set is empty).
    pub error_after: f64,
}

impl Bisection {
    /// The overrides file to save (a list file of one `[keep_f32]` table, for
    /// `--overrides`): the nodes `lists` already kept in f32 and this set.
    pub fn overrides_toml(&self, lists: &PrecisionLists) -> Result<String, PassError> {
        let mut kept = lists.nodes_kept_f32().clone();
        kept.extend(self.keep_f32.iter().cloned());
        keep_f32_toml(&kept)
    }
}

/// Finds a small set of nodes of `graph` to keep in f32 so that its AMP rewrite under
/// `config` has outputs within `rtol` of the f32 graph's on `feeds` (the module's
/// metric and search). The set is empty where the plain rewrite already is.
pub fn bisect(
    graph: &Graph,
    feeds: &Feeds,
    config: &AmpConfig,
    rtol: f64,
) -> Result<Bisection, BisectError> {
    if !(rtol.is_finite() && rtol >= 0.0) {
        return Err(BisectError::Tolerance(rtol));
    }
    let reference = Reference::run(graph, feeds)?;
    let mut search = Search {
        graph,
        feeds,
        config,
        reference: &reference,
        seen: HashMap::new(),
        evaluations: 0,
    };
    let (error_before, mut ranked) = search.measure(&[])?;
    // Growing batches of the top-ranked nodes until the outputs are within tolerance,
    // ranked again after each batch: an overflow's inf or NaN hides the errors of the
    // nodes after it until it is kept in f32. Nodes already chosen are not taken again
    // (keeping some in f32 changes nothing, e.g. a Const that the rewrite still stores
    // in 16 bits for its 16-bit readers).
    let mut chosen: Vec<(String, f64)> = Vec::new();
    let (mut batch, mut error, mut failed) = (1, error_before, 0);
    while !within(error, rtol) {
        failed = chosen.len();
        let fresh: Vec<(String, f64)> = ranked
            .into_iter()
            .filter(|(name, _)| !chosen.iter().any(|(c, _)| c == name))
            .take(batch)
            .collect();
        if fresh.is_empty() {
            return Err(BisectError::Unreachable {
                kept: chosen.len(),
                error,
                rtol,
            });
        }
        chosen.extend(fresh);
        batch *= 2;
        (error, ranked) = search.measure(&chosen)?;
    }
    // The shortest prefix of the last batch that suffices, by halving (more nodes in
    // f32 being taken to err less): a poor ranking costs log2(batch) evaluations here
    // rather than one per node below.
    let (mut lo, mut hi) = (failed, chosen.len());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let e = search.evaluate(&chosen[..mid])?;
        if within(e, rtol) {
            (hi, error) = (mid, e);
        } else {
            lo = mid;
        }
    }
    chosen.truncate(hi);
    // Pruning, the last chosen first: a node the others make unnecessary goes.
    let order: Vec<String> = chosen.iter().rev().map(|(n, _)| n.clone()).collect();
    for name in order {
        let without: Vec<(String, f64)> =
            chosen.iter().filter(|(n, _)| *n != name).cloned().collect();
        let e = search.evaluate(&without)?;
        if within(e, rtol) {
            chosen = without;
            error = e;
        }
    }
    Ok(Bisection {
        keep_f32: chosen
            .into_iter()
            .map(|(name, score)| (name, reason(score)))
            .collect(),
        evaluations: search.evaluations,
        error_before,
        error_after: error,
    })
}

fn within(error: f64, rtol: f64) -> bool {
    error <= rtol
}

fn reason(score: f64) -> String {
    if score.is_infinite() {
        "bisection: its 16-bit output was non-finite where f32's is finite (overflow)".into()
    } else {
        format!("bisection: its 16-bit output carried {score:.1e} error relative to the values it feeds")
    }
}

/// The f32 graph's outputs and, by node name, each node's largest finite magnitude.
struct Reference {
    outputs: Vec<Tensor>,
    magnitude: HashMap<String, f64>,
}

impl Reference {
    fn run(graph: &Graph, feeds: &Feeds) -> Result<Reference, BisectError> {
        let mut magnitude = HashMap::new();
        let fetches = graph.outputs().to_vec();
        let outputs = CpuExecutor::new().run_observed(graph, feeds, &fetches, &mut |e| {
            let floats = e.outputs.iter().filter(|t| t.dtype().is_float());
            let m = floats.map(max_finite_abs).fold(0.0, f64::max);
            magnitude.insert(graph.node(e.id).name.clone(), m);
            ControlFlow::Continue(())
        })?;
        let Some(outputs) = outputs else {
            unreachable!("the observer never stops the step")
        };
        Ok(Reference { outputs, magnitude })
    }

    /// Node `name`'s largest finite f32 magnitude; the smallest positive number where
    /// it is all zeros (any error there is large).
    fn scale(&self, name: &str) -> f64 {
        self.magnitude
            .get(name)
            .copied()
            .unwrap_or(0.0)
            .max(f64::MIN_POSITIVE)
    }
}

struct Search<'a> {
    graph: &'a Graph,
    feeds: &'a Feeds,
    config: &'a AmpConfig,
    reference: &'a Reference,
    /// Errors of the sets (sorted node names) already evaluated.
    seen: HashMap<Vec<String>, f64>,
    evaluations: usize,
}

impl Search<'_> {
    /// The AMP rewrite with the nodes of `keep` (name, local error) kept in f32.
    fn rewritten(&self, keep: &[(String, f64)]) -> Result<Graph, BisectError> {
        let mut config = self.config.clone();
        for (name, score) in keep {
            config.lists.keep_f32(name, reason(*score));
        }
        let mut g = self.graph.clone();
        AutoMixedPrecision::new(config).rewrite(&mut g)?;
        Ok(g)
    }

    /// The error of the rewrite keeping `keep` in f32 (one evaluation, unless seen).
    fn evaluate(&mut self, keep: &[(String, f64)]) -> Result<f64, BisectError> {
        if let Some(&e) = self.seen.get(&key(keep)) {
            return Ok(e);
        }
        let g = self.rewritten(keep)?;
        self.evaluations += 1;
        let fetches = g.outputs().to_vec();
        let outputs = CpuExecutor::new()
            .run_observed(&g, self.feeds, &fetches, &mut |_| ControlFlow::Continue(()))?;
        let Some(outputs) = outputs else {
            unreachable!("the observer never stops the step")
        };
        let e = output_error(&outputs, &self.reference.outputs);
        self.seen.insert(key(keep), e);
        Ok(e)
    }

    /// The error of the rewrite keeping `keep` in f32 and its 16-bit nodes ranked by
    /// local error, worst first (one evaluation).
    fn measure(
        &mut self,
        keep: &[(String, f64)],
    ) -> Result<(f64, Vec<(String, f64)>), BisectError> {
        let g = self.rewritten(keep)?;
        self.evaluations += 1;
        let mut local = Local {
            f32_graph: self.graph,
            g16: &g,
            reference: self.reference,
            measured: HashMap::new(),
        };
        let mut failure: Option<ExecError> = None;
        let fetches = g.outputs().to_vec();
        let mut observe = |e: &Evaluated| match local.observe(e) {
            Ok(()) => ControlFlow::Continue(()),
            Err(err) => {
                failure = Some(err);
                ControlFlow::Break(())
            }
        };
        let outputs = CpuExecutor::new().run_observed(&g, self.feeds, &fetches, &mut observe)?;
        let outputs = match (outputs, failure) {
            (_, Some(err)) => return Err(err.into()),
            (Some(outputs), None) => outputs,
            (None, None) => unreachable!("the observer stops the step only on a failure"),
        };
        let error = output_error(&outputs, &self.reference.outputs);
        self.seen.insert(key(keep), error);
        // Worst first (NaN, an undefined error, counts as the worst); ties in execution
        // order. Nodes whose 16-bit arithmetic was exact are no candidates.
        let worst = |s: f64| if s.is_nan() { f64::INFINITY } else { s };
        let mut scored: Vec<(f64, usize, String)> = local
            .measured
            .into_values()
            .filter(|m| worst(m.score) > 0.0)
            .map(|m| (worst(m.score), m.order, m.name))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        Ok((error, scored.into_iter().map(|(s, _, n)| (n, s)).collect()))
    }
}

/// A set's key in [`Search::seen`]: its names, sorted.
fn key(keep: &[(String, f64)]) -> Vec<String> {
    let mut names: Vec<String> = keep.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    names
}

/// One node of the rewritten graph that runs in 16 bits, as measured.
struct Measured {
    name: String,
    /// Execution order, for ties.
    order: usize,
    /// Its local error: the largest of its own error relative to its f32 magnitude
    /// and the disturbance of each reader relative to the reader's.
    score: f64,
    /// Its outputs computed in f32 from its 16-bit inputs, until its readers are seen.
    exact: Vec<Tensor>,
    /// Readers (of the f32 graph) not yet seen.
    readers_left: usize,
}

/// The measurement of local errors along one observed run of the rewritten graph.
struct Local<'a> {
    f32_graph: &'a Graph,
    g16: &'a Graph,
    reference: &'a Reference,
    /// By node of the rewritten graph.
    measured: HashMap<NodeId, Measured>,
}

impl Local<'_> {
    fn observe(&mut self, e: &Evaluated) -> Result<(), ExecError> {
        let node = self.g16.node(e.id);
        // Inserted casts have no counterpart in the f32 graph; they are looked through.
        let Some(id32) = self.f32_graph.find(&node.name) else {
            return Ok(());
        };
        let reduced = node
            .outputs()
            .iter()
            .zip(self.f32_graph.node(id32).outputs())
            .any(|(t16, t32)| t16.dtype.is_half() && !t32.dtype.is_half());
        // The measured nodes this one reads, each with the input slots it feeds.
        let mut producers: Vec<(NodeId, Vec<(usize, usize)>)> = Vec::new();
        for (slot, p) in self.g16.inputs(e.id).iter().enumerate() {
            let p = self.through_casts(*p);
            if self.measured.contains_key(&p.node) {
                match producers.iter_mut().find(|(n, _)| *n == p.node) {
                    Some((_, slots)) => slots.push((slot, p.index)),
                    None => producers.push((p.node, vec![(slot, p.index)])),
                }
            }
        }
        if !reduced && producers.is_empty() {
            return Ok(());
        }
        // The node's f32 op on its inputs as they are (16-bit values widened exactly).
        let op32 = &self.f32_graph.node(id32).op;
        let eval = |args: &[Tensor]| {
            let refs: Vec<&Tensor> = args.iter().collect();
            op32.eval(&refs)
                .map_err(|m| ExecError::node(&node.name, op32.name(), m))
        };
        let widened: Vec<Tensor> = e
            .inputs
            .iter()
            .zip(self.f32_graph.inputs(id32))
            .map(|(t, p)| t.cast(self.f32_graph.ty(p).dtype))
            .collect();
        let base = eval(&widened)?;
        let scale = self.reference.scale(&node.name);
        for (producer, slots) in producers {
            let exact = &self.measured[&producer].exact;
            let mut args = widened.clone();
            for &(slot, port) in &slots {
                // Dropped once every reader the f32 graph names has been seen.
                let Some(v) = exact.get(port) else { continue };
                args[slot] = v.clone();
            }
            let disturbance = max_diff(&base, &eval(&args)?) / scale;
            let m = self
                .measured
                .get_mut(&producer)
                .expect("a measured producer");
            m.score = m.score.max(disturbance);
            m.readers_left = m.readers_left.saturating_sub(1);
            if m.readers_left == 0 {
                m.exact = Vec::new();
            }
        }
        if reduced {
            let own = if finite(e.inputs.iter().copied()) && !finite(e.outputs.iter()) {
                f64::INFINITY
            } else {
                max_diff(e.outputs, &base)
            };
            let mut readers: Vec<NodeId> = self
                .f32_graph
                .consumers(id32)
                .into_iter()
                .map(|(c, _, _)| c)
                .collect();
            readers.sort_unstable();
            readers.dedup();
            let order = self.measured.len();
            self.measured.insert(
                e.id,
                Measured {
                    name: node.name.clone(),
                    order,
                    score: own / scale,
                    exact: if readers.is_empty() { Vec::new() } else { base },
                    readers_left: readers.len(),
                },
            );
        }
        Ok(())
    }

    /// The port of the rewritten graph that `p` casts, through inserted casts.
    fn through_casts(&self, mut p: Port) -> Port {
        loop {
            let n = self.g16.node(p.node);
            let inserted = self.f32_graph.find(&n.name).is_none() && n.op.is::<Cast>();
            match self.g16.inputs(p.node).first() {
                Some(&src) if inserted => p = src,
                _ => return p,
            }
        }
    }
}

/// Every float value of `tensors` is finite.
fn finite<'t>(tensors: impl IntoIterator<Item = &'t Tensor>) -> bool {
    tensors
        .into_iter()
        .filter(|t| t.dtype().is_float())
        .all(|t| t.data().iter_f64().all(f64::is_finite))
}

/// The largest absolute difference between two lists of tensors.
fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f64::max)
}

/// Largest |a - b| over the elements; infinite where one is non-finite and the other
/// not the same value.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    a.data()
        .iter_f64()
        .zip(b.data().iter_f64())
        .map(|(x, y)| {
            if x.is_finite() && y.is_finite() {
                (x - y).abs()
            } else if x == y || (x.is_nan() && y.is_nan()) {
                0.0
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

fn max_finite_abs(t: &Tensor) -> f64 {
    t.data()
        .iter_f64()
        .filter(|v| v.is_finite())
        .fold(0.0, |m, v| m.max(v.abs()))
}

/// The module's metric: the worst over outputs of max |got - want| / max |want|.
fn output_error(got: &[Tensor], want: &[Tensor]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.shape() != w.shape() {
                return f64::INFINITY;
            }
            let diff = max_abs_diff(g, w);
            let scale = max_finite_abs(w);
            if diff == 0.0 {
                0.0
            } else if scale == 0.0 {
                f64::INFINITY
            } else {
                diff / scale
            }
        })
        .fold(0.0, f64::max)
}
