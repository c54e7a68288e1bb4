//! Range-aware precision: run a graph in f32 on sample inputs, record the largest
//! magnitude of every f32 tensor, and keep in f32 the nodes whose values the 16-bit
//! type cannot hold (lists alone cannot know a model's value ranges).
//!
//! ```
//! use ampgraph::numerics::calibrate::{calibrate, DEFAULT_MARGIN};
//! use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
//! use ampgraph::{DType, Graph, Tensor};
//!
//! let mut g = Graph::new();
//! let x = g.placeholder("x", DType::F32, [2, 2])?;
//! let w = g.placeholder("w", DType::F32, [2, 2])?;
//! let y = g.matmul(x, w)?;
//! g.set_outputs(vec![y])?;
//! let big = Tensor::from_f64(DType::F32, vec![2, 2], &[3e2; 4])?;
//! let feeds = [("x", &big), ("w", &big)]
//!     .into_iter()
//!     .map(|(n, t)| (n.to_string(), t.clone()))
//!     .collect();
//! let calibration = calibrate(&g, &[feeds])?;
//! let mut config = AmpConfig::with_profile(DType::F16, "tensorflow")?;
//! // 300 * 300 * 2 = 1.8e5 does not fit f16: the product stays in f32.
//! let kept = calibration.apply(&mut config, DEFAULT_MARGIN);
//! assert_eq!(kept[0].1, "observed |x| up to 1.8e5, beyond f16's range");
//! AutoMixedPrecision::new(config).rewrite(&mut g)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;

use ampgraph_exec::{CpuExecutor, Evaluated, ExecError, Executor, Feeds};
use ampgraph_graph::ops::QuantizeFp8;
use ampgraph_graph::{DType, Data, Graph, GraphError, Port, Tensor};
use ampgraph_passes::amp::fp8::calibration_key;
use ampgraph_passes::amp::lists::keep_f32_toml;
use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision, Fp8Recipe, PrecisionLists};
use ampgraph_passes::PassError;
use thiserror::Error;

/// Headroom for inputs beyond the samples: a tensor is kept in f32 when twice its
/// largest observed magnitude would not fit the 16-bit type (for f16: max |x| above
/// 32752), so inputs up to twice as large as the samples' still fit.
pub const DEFAULT_MARGIN: f64 = 2.0;

#[derive(Debug, Error)]
pub enum CalibrateError {
    #[error("calibration needs at least one sample (one set of feeds)")]
    NoSamples,
    #[error("calibration sample {sample} (on the CPU): {source}")]
    Exec {
        sample: usize,
        #[source]
        source: ExecError,
    },
    #[error("FP8 calibration needs an AMP configuration with FP8 products (--dtype fp8)")]
    NoFp8,
    #[error(transparent)]
    Lists(#[from] PassError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("{path}: {msg}")]
    Amaxes { path: String, msg: String },
}

/// What the samples put in one tensor (or one node's f32 outputs together).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Range {
    /// The largest finite |x| seen; 0 where none was.
    pub max_abs: f64,
    /// Some value was NaN or infinite already in f32 (no precision helps that).
    pub nonfinite: bool,
}

impl Range {
    fn of(t: &Tensor) -> Range {
        let mut r = Range::default();
        let mut add = |x: f64| {
            if x.is_finite() {
                r.max_abs = r.max_abs.max(x.abs());
            } else {
                r.nonfinite = true;
            }
        };
        // Only f32 outputs are recorded; the direct loop spares a dynamic call per value.
        match t.data() {
            Data::F32(v) => v.iter().for_each(|&x| add(f64::from(x))),
            other => other.iter_f64().for_each(add),
        }
        r
    }

    fn merge(&mut self, other: Range) {
        self.max_abs = self.max_abs.max(other.max_abs);
        self.nonfinite |= other.nonfinite;
    }
}

/// One node as calibration saw it.
#[derive(Clone, Debug)]
struct Observed {
    name: String,
    /// Per output: its range where the output is f32 (what AMP may convert).
    outputs: Vec<Option<Range>>,
    /// Where each input comes from: (index in `Calibration::nodes`, output).
    inputs: Vec<(usize, usize)>,
    /// Computed in some sample (a node no sink needs never is).
    seen: bool,
}

/// The largest magnitudes of every f32 tensor of a graph over some samples, from
/// [`calibrate`].
#[derive(Clone, Debug)]
pub struct Calibration {
    /// In the graph's node order.
    nodes: Vec<Observed>,
    /// By `NodeId::index()`: the node's place in `nodes`.
    slot: Vec<usize>,
    samples: usize,
}

/// Runs `graph` in f32 on the CPU over each set of feeds and records, for every
/// node's f32 outputs, the largest finite magnitude and whether any value was
/// non-finite. The graph is run as given (before AMP). Each set of feeds must give
/// every Placeholder and Variable a value (`ampgraph::exec::feeds::seeded_tensor`
/// makes seeded ones, as `ampgraph run` does); to take Variables from an executor,
/// use [`calibrate_on`].
pub fn calibrate(graph: &Graph, samples: &[Feeds]) -> Result<Calibration, CalibrateError> {
    calibrate_on(&mut CpuExecutor::new(), graph, samples)
}

/// [`calibrate`] on `exec`, whose variables give the Variables not fed. The samples
/// run as consecutive steps (a training graph's assignments carry from one to the
/// next, as in training); `exec`'s variables are restored afterwards.
pub fn calibrate_on(
    exec: &mut CpuExecutor,
    graph: &Graph,
    samples: &[Feeds],
) -> Result<Calibration, CalibrateError> {
    if samples.is_empty() {
        return Err(CalibrateError::NoSamples);
    }
    let mut calibration = Calibration::new(graph);
    let fetches = sinks(graph);
    let saved = exec.variables.clone();
    let run = samples.iter().enumerate().try_for_each(|(sample, feeds)| {
        exec.run_observed(graph, feeds, &fetches, &mut |seen| {
            calibration.observe(seen);
            ControlFlow::Continue(())
        })
        .map(drop)
        .map_err(|source| CalibrateError::Exec { sample, source })
    });
    exec.variables = saved;
    run?;
    calibration.samples = samples.len();
    Ok(calibration)
}

/// The amaxes static FP8 scaling fixes its scales by ([`Fp8Recipe::Static`],
/// `Fp8Config::calibrated`): `graph` rewritten by `config` with every product in FP8
/// under current scaling and run on the CPU on each sample; each cast's largest input
/// magnitude over the samples, by its [`calibration_key`]. Calibrated on the inputs it
/// then runs on, a static graph computes what current scaling computes, bit for bit.
///
/// ```
/// use ampgraph::numerics::calibrate::fp8_amaxes;
/// use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, Fp8Config, Fp8Recipe};
/// use ampgraph::{DType, Graph, Tensor};
///
/// let mut g = Graph::new();
/// let x = g.placeholder("x", DType::F32, [16, 32])?;
/// let w = g.constant(Tensor::from_f64(DType::F32, vec![32, 16], &[0.5; 512])?)?;
/// let y = g.matmul(x, w)?;
/// let y = g.relu(y)?;
/// g.set_outputs(vec![y])?;
/// let sample = Tensor::from_f64(DType::F32, vec![16, 32], &[1.5; 512])?;
/// let samples = [[("x".to_string(), sample)].into_iter().collect()];
/// let amp = |recipe| AmpConfig::new(DType::BF16).map(|c| c.with_fp8(Fp8Config::everywhere(recipe)));
/// let mut config = amp(Fp8Recipe::Static)?;
/// if let Some(fp8) = config.fp8.as_mut() {
///     // x's amax (the weight, a constant, is quantised by the pass itself).
///     fp8.calibrated = fp8_amaxes(&g, &amp(Fp8Recipe::Current)?, &samples)?;
///     assert_eq!(fp8.calibrated.values().copied().collect::<Vec<_>>(), [1.5]);
/// }
/// AutoMixedPrecision::new(config).rewrite(&mut g)?;
/// // The scale is a constant: no step measures x.
/// assert!(g.node_ids().all(|id| g.node(id).op.name() != "Fp8Scale"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn fp8_amaxes(
    graph: &Graph,
    config: &AmpConfig,
    samples: &[Feeds],
) -> Result<BTreeMap<String, f32>, CalibrateError> {
    if samples.is_empty() {
        return Err(CalibrateError::NoSamples);
    }
    let mut config = config.clone();
    let fp8 = config.fp8.as_mut().ok_or(CalibrateError::NoFp8)?;
    // Every product the static rewrite may choose, each operand measured by its cast.
    fp8.recipe = Fp8Recipe::Current;
    fp8.cost = None;
    fp8.keep_first_and_last = false;
    fp8.keep.clear();
    let mut g = graph.clone();
    AutoMixedPrecision::new(config).rewrite(&mut g)?;
    let casts: Vec<(String, Port)> = (g.node_ids())
        .filter(|&id| g.node(id).op.is::<QuantizeFp8>())
        .filter_map(|id| {
            Some((
                calibration_key(&g.node(id).name)?.to_string(),
                Port::new(id, 1),
            ))
        })
        .collect();
    let fetches: Vec<Port> = casts.iter().map(|(_, amax)| *amax).collect();
    let mut exec = CpuExecutor::new();
    let mut amaxes = BTreeMap::new();
    for (sample, feeds) in samples.iter().enumerate() {
        let values = (exec.run(&g, feeds, &fetches))
            .map_err(|source| CalibrateError::Exec { sample, source })?;
        for ((key, _), value) in casts.iter().zip(values) {
            let amax = value.to_f32_vec().first().copied().unwrap_or(0.0);
            let kept = amaxes.entry(key.clone()).or_insert(amax);
            *kept = kept.max(amax);
        }
    }
    Ok(amaxes)
}

/// Writes FP8 amaxes ([`fp8_amaxes`]) to `path` as a JSON object (a cast's key, its
/// amax), whole, then renamed: calibrated once (at any batch: the keys name tensors,
/// not shapes), read back by [`load_fp8_amaxes`] for later rewrites.
pub fn save_fp8_amaxes(path: &Path, amaxes: &BTreeMap<String, f32>) -> Result<(), CalibrateError> {
    let text = serde_json::to_string_pretty(amaxes).map_err(|e| CalibrateError::Amaxes {
        path: path.display().to_string(),
        msg: e.to_string(),
    })?;
    Ok(ampgraph_graph::format::write_atomic(path, text.as_bytes())?)
}

/// The FP8 amaxes [`save_fp8_amaxes`] wrote to `path`: finite and not negative.
pub fn load_fp8_amaxes(path: &Path) -> Result<BTreeMap<String, f32>, CalibrateError> {
    let error = |msg: String| CalibrateError::Amaxes {
        path: path.display().to_string(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let amaxes: BTreeMap<String, f32> = serde_json::from_str(&text)
        .map_err(|e| error(format!("not a JSON object of FP8 amaxes: {e}")))?;
    match amaxes.iter().find(|(_, a)| !(a.is_finite() && **a >= 0.0)) {
        Some((key, a)) => Err(error(format!("{key}: amax {a} is not a finite magnitude"))),
        None => Ok(amaxes),
    }
}

/// The first output of every node nothing reads (and the graph's outputs): fetching
/// them makes a step compute every node that has an output.
fn sinks(graph: &Graph) -> Vec<Port> {
    let mut fetches = graph.outputs().to_vec();
    for id in graph.node_ids() {
        let unread = graph.consumers(id).is_empty();
        if unread && !graph.node(id).outputs().is_empty() {
            fetches.push(Port::new(id, 0));
        }
    }
    fetches.sort_unstable();
    fetches.dedup();
    fetches
}

/// The largest finite value and the smallest positive normal value of a 16-bit type.
fn limits(target: DType) -> Option<(f64, f64)> {
    match target {
        DType::F16 => Some((half::f16::MAX.to_f64(), half::f16::MIN_POSITIVE.to_f64())),
        DType::BF16 => Some((half::bf16::MAX.to_f64(), half::bf16::MIN_POSITIVE.to_f64())),
        _ => None,
    }
}

impl Calibration {
    fn new(graph: &Graph) -> Calibration {
        let mut slot = vec![usize::MAX; graph.node_bound()];
        for (i, id) in graph.node_ids().enumerate() {
            slot[id.index()] = i;
        }
        let nodes = graph
            .node_ids()
            .map(|id| {
                let node = graph.node(id);
                Observed {
                    name: node.name.clone(),
                    outputs: node
                        .outputs()
                        .iter()
                        .map(|t| (t.dtype == DType::F32).then(Range::default))
                        .collect(),
                    inputs: graph
                        .inputs(id)
                        .iter()
                        .map(|p| (slot[p.node.index()], p.index))
                        .collect(),
                    seen: false,
                }
            })
            .collect();
        Calibration {
            nodes,
            slot,
            samples: 0,
        }
    }

    fn observe(&mut self, seen: &Evaluated) {
        let Some(node) = self.nodes.get_mut(self.slot[seen.id.index()]) else {
            return;
        };
        node.seen = true;
        for (range, t) in node.outputs.iter_mut().zip(seen.outputs) {
            if let Some(range) = range {
                range.merge(Range::of(t));
            }
        }
    }

    /// How many samples were run.
    pub fn samples(&self) -> usize {
        self.samples
    }

    /// The range of node `name`'s f32 outputs together over every sample; `None`
    /// where the node has no f32 output, was not computed or is not in the graph.
    pub fn range(&self, name: &str) -> Option<Range> {
        let node = self.nodes.iter().find(|n| n.name == name)?;
        let mut ranges = node.outputs.iter().flatten().copied().peekable();
        ranges.peek()?;
        node.seen.then(|| {
            ranges.fold(Range::default(), |mut all, r| {
                all.merge(r);
                all
            })
        })
    }

    /// The nodes with an f32 output that was NaN or infinite already in f32, in graph
    /// order: a 16-bit type cannot be blamed for them.
    pub fn nonfinite(&self) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|n| n.outputs.iter().flatten().any(|r| r.nonfinite))
            .map(|n| n.name.as_str())
            .collect()
    }

    /// The nodes to keep in f32 for `target` (f16 or bf16; any other type keeps
    /// none), each with the reason `explain` gives, in graph order. An f32 tensor
    /// does not fit when
    ///
    /// - `max |x| * margin` exceeds the type's largest finite value (f16: 65504;
    ///   bf16: 3.4e38, which only values near f32's own limit reach): "observed |x| up
    ///   to 1.2e5, beyond f16's range"; a `margin` below 1 counts as 1;
    /// - or every value is finite, some nonzero, and all below the type's smallest
    ///   normal value (f16: 6.1e-5), so every value is subnormal there, with at most
    ///   9 bits, or zero (an untrained network's logits, 1e-10): "observed |x| at most
    ///   1.0e-9, below f16's normal range".
    ///
    /// The node producing such a tensor is kept, and so is every node with an f32
    /// output reading it: converted, such a reader would take the tensor through a
    /// cast to the 16-bit type, overflowing there ("its input 'mul' has observed |x|
    /// up to ..."). Non-finite values are ignored: they were so already in f32.
    pub fn keep_f32(&self, target: DType, margin: f64) -> Vec<(String, String)> {
        let Some((max, min_normal)) = limits(target) else {
            return Vec::new();
        };
        let margin = margin.max(1.0);
        let does_not_fit = |r: &Range| {
            if r.max_abs * margin > max {
                Some(format!(
                    "|x| up to {:.1e}, beyond {target}'s range",
                    r.max_abs
                ))
            } else if !r.nonfinite && r.max_abs > 0.0 && r.max_abs < min_normal {
                Some(format!(
                    "|x| at most {:.1e}, below {target}'s normal range",
                    r.max_abs
                ))
            } else {
                None
            }
        };
        // Per node, per output: why that tensor does not fit.
        let misfits: Vec<Vec<Option<String>>> = self
            .nodes
            .iter()
            .map(|n| {
                let seen = n.seen;
                n.outputs
                    .iter()
                    .map(|r| r.as_ref().filter(|_| seen).and_then(does_not_fit))
                    .collect()
            })
            .collect();
        let mut kept = Vec::new();
        for (node, misfit) in self.nodes.iter().zip(&misfits) {
            if let Some(why) = misfit.iter().flatten().next() {
                kept.push((node.name.clone(), format!("observed {why}")));
                continue;
            }
            if !node.outputs.iter().any(Option::is_some) {
                continue;
            }
            let read = node.inputs.iter().find_map(|&(producer, port)| {
                let why = misfits.get(producer)?.get(port)?.as_ref()?;
                Some((&self.nodes[producer].name, why))
            });
            if let Some((producer, why)) = read {
                kept.push((
                    node.name.clone(),
                    format!("its input '{producer}' has observed {why}"),
                ));
            }
        }
        kept
    }

    /// Keeps [`keep_f32`](Self::keep_f32)'s nodes in f32 under `config` (for its
    /// target), so the AMP pass paints them as denylisted nodes; returns them.
    pub fn apply(&self, config: &mut AmpConfig, margin: f64) -> Vec<(String, String)> {
        let kept = self.keep_f32(config.target, margin);
        for (node, why) in &kept {
            config.lists.keep_f32(node, why.clone());
        }
        kept
    }
}

/// An output of a mixed-precision graph that underflowed: more than half of its
/// values that are nonzero in f32 are 0 there.
#[derive(Clone, Debug, PartialEq)]
pub struct Underflow {
    pub output: String,
    /// Values nonzero in f32 and 0 after the rewrite, and values nonzero in f32.
    pub lost: usize,
    pub nonzero: usize,
    /// The largest finite |y| in f32.
    pub max_abs: f64,
}

impl std::fmt::Display for Underflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "output '{}' underflows: {} of its {} nonzero values in f32 are 0 after mixed \
             precision (f32 |y| up to {:.1e})",
            self.output, self.lost, self.nonzero, self.max_abs
        )
    }
}

/// `graph`'s outputs on each sample, run on the CPU: taken before a rewrite, what
/// [`underflows`] compares the rewritten graph's with.
pub fn outputs_on(graph: &Graph, samples: &[Feeds]) -> Result<Vec<Vec<Tensor>>, CalibrateError> {
    let mut exec = CpuExecutor::new();
    (samples.iter().enumerate())
        .map(|(sample, feeds)| {
            (exec.run(graph, feeds, graph.outputs()))
                .map_err(|source| CalibrateError::Exec { sample, source })
        })
        .collect()
}

/// The outputs of `rewritten` (a graph after mixed precision, whose outputs before it
/// were `wide` on the samples: [`outputs_on`]) that underflow on the samples, run on
/// the CPU (which rounds 16-bit values as the GPU kernels do).
pub fn underflows(
    wide: &[Vec<Tensor>],
    rewritten: &Graph,
    samples: &[Feeds],
) -> Result<Vec<Underflow>, CalibrateError> {
    let mut found: Vec<Underflow> = (rewritten.outputs().iter())
        .map(|&p| Underflow {
            output: rewritten.port_name(p),
            lost: 0,
            nonzero: 0,
            max_abs: 0.0,
        })
        .collect();
    for (wide, narrow) in wide.iter().zip(outputs_on(rewritten, samples)?) {
        for ((u, w), n) in found.iter_mut().zip(wide).zip(&narrow) {
            for (w, n) in w.to_f64_vec().into_iter().zip(n.to_f64_vec()) {
                if w != 0.0 && w.is_finite() {
                    u.nonzero += 1;
                    u.lost += usize::from(n == 0.0);
                    u.max_abs = u.max_abs.max(w.abs());
                }
            }
        }
    }
    found.retain(|u| u.lost * 2 > u.nonzero);
    Ok(found)
}

/// Saves nodes kept in f32 (with their reasons) as a list file of one `[keep_f32]`
/// table, atomically, for [`load_overrides`] (or `--overrides`) to apply later.
pub fn save_overrides(path: &Path, kept: &[(String, String)]) -> Result<(), CalibrateError> {
    let table: BTreeMap<String, String> = kept.iter().cloned().collect();
    let text = keep_f32_toml(&table)?;
    Ok(ampgraph_graph::format::write_atomic(path, text.as_bytes())?)
}

/// Adds the nodes kept in f32 by a saved overrides file (a list file's `[keep_f32]`
/// table) to `lists`; returns how many. A file with op lists is refused: those
/// replace a profile, so they belong to `--lists`.
pub fn load_overrides(lists: &mut PrecisionLists, path: &Path) -> Result<usize, PassError> {
    let file = PrecisionLists::from_file(path)?;
    if let Some(class) = ampgraph_passes::amp::ListClass::ALL
        .into_iter()
        .find(|&c| !file.ops(c).is_empty())
    {
        return Err(PassError::Lists(format!(
            "{}: an overrides file holds only a [keep_f32] table, not op lists ({class} \
             has ops); give a whole list file to --lists",
            path.display()
        )));
    }
    for (node, why) in file.nodes_kept_f32() {
        lists.keep_f32(node, why.clone());
    }
    Ok(file.nodes_kept_f32().len())
}
