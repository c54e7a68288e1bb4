//! Automatic mixed precision: TensorFlow Grappler's `auto_mixed_precision` rewrite.
//!
//! [`paint`] decides which tensors become 16-bit (f16 or bf16) from the op
//! [`lists`]; [`rewrite`] inserts the casts; [`fp8`] then gives FP8 operands to the
//! 16-bit products where they pay (when asked); [`report`] summarises and explains.

pub mod fp8;
pub mod lists;
pub mod paint;
pub mod report;
pub mod rewrite;

use std::path::PathBuf;

use ampgraph_graph::{DType, Graph};

pub use fp8::{FastAccumulation, Fp8Config, Fp8Recipe, GemmCost};
pub use lists::{ListClass, PrecisionLists};
pub use paint::{Painting, Step};
pub use report::{AmpReport, Explanation};
pub use rewrite::RewriteStats;

use crate::{Pass, PassError, PassSummary};

/// Settings of the AMP pass; [`AmpConfig::from_env`] reads the `AMPGRAPH_AMP_*` overrides.
///
/// ```
/// use ampgraph_graph::{DType, Graph};
/// use ampgraph_passes::amp::{AmpConfig, AutoMixedPrecision};
///
/// let mut g = Graph::new();
/// let x = g.placeholder("x", DType::F32, [4, 8])?;
/// let w = g.placeholder("w", DType::F32, [8, 8])?;
/// let y = g.matmul(x, w)?;
/// g.set_outputs(vec![y])?;
/// let amp = AutoMixedPrecision::new(AmpConfig::with_profile(DType::F16, "tensorflow")?);
/// amp.rewrite(&mut g)?;
/// // The product runs in f16 between casts; the output keeps its f32 type.
/// assert_eq!(g.ty(g.outputs()[0]).dtype, DType::F32);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct AmpConfig {
    /// F16 or BF16.
    pub target: DType,
    pub lists: PrecisionLists,
    /// Where to dump the graph before and after the rewrite (JSON, DOT, SVG).
    pub log_path: Option<PathBuf>,
    /// A computation on constants alone (an embedding lookup, the sum of two) whose
    /// every reader runs in 16 bits runs in 16 bits too, its constants stored so,
    /// rather than in f32 with its result cast (what onnxconverter-common's fp16
    /// models do). TensorFlow has no such phase: off in the `tensorflow` profile,
    /// which decides exactly as TensorFlow does.
    pub constant_regions: bool,
    /// FP8 operands for the 16-bit products where they pay (`None`: no FP8).
    pub fp8: Option<Fp8Config>,
}

impl AmpConfig {
    /// ampgraph's own lists for the target: `default_fp16` or `default_bf16`. An
    /// FP8 target (`f8e4m3`) means BF16 AMP with FP8 products ([`Fp8Config`]'s
    /// defaults).
    pub fn new(target: DType) -> Result<Self, PassError> {
        let profile = if target == DType::BF16 || target.is_fp8() {
            "default_bf16"
        } else {
            "default_fp16"
        };
        Self::with_profile(target, profile)
    }

    /// The lists of `profile` for the target (an FP8 target as in [`AmpConfig::new`]).
    pub fn with_profile(target: DType, profile: &str) -> Result<Self, PassError> {
        let (target, fp8) = match target {
            t if t.is_half() => (t, None),
            t if t.is_fp8() => (DType::BF16, Some(Fp8Config::default())),
            t => {
                return Err(PassError::Lists(format!(
                    "the AMP target must be f16, bf16 or f8e4m3 (FP8 products on bf16), not {t}"
                )))
            }
        };
        Ok(AmpConfig {
            target,
            lists: PrecisionLists::profile(profile)?,
            log_path: None,
            constant_regions: profile != "tensorflow",
            fp8,
        })
    }

    /// These settings with FP8 products as `fp8` says.
    pub fn with_fp8(mut self, fp8: Fp8Config) -> Self {
        self.fp8 = Some(fp8);
        self
    }

    /// These settings with every product the GPU's FP8 kernels take in FP8
    /// ([`Fp8Config::every_device_product`]), their FP8 recipe kept; no change where
    /// FP8 is off.
    pub fn on_every_device_product(mut self) -> Self {
        if let Some(fp8) = &mut self.fp8 {
            *fp8 = Fp8Config {
                fast_accumulation: fp8.fast_accumulation,
                ..Fp8Config::every_device_product(fp8.recipe)
            };
        }
        self
    }

    /// Applies the environment overrides (`AMPGRAPH_AMP_*LIST_ADD/_REMOVE`,
    /// `AMPGRAPH_AMP_LOG_PATH`), as TensorFlow users know them, and where FP8 is on
    /// `AMPGRAPH_AMP_FP8_SCALING` (`current` or `delayed`: TransformerEngine's
    /// recipe) and `AMPGRAPH_AMP_FP8_FAST_ACCUMULATION` (`never`, `forward` or `all`:
    /// [`FastAccumulation`]).
    pub fn from_env(mut self) -> Result<Self, PassError> {
        self.apply_vars(|k| std::env::var(k).ok())?;
        Ok(self)
    }

    /// Same as [`from_env`](Self::from_env), with the variables looked up through `var`.
    pub fn apply_vars(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), PassError> {
        self.lists.apply_overrides(&var)?;
        if let Some(dir) = var("AMPGRAPH_AMP_LOG_PATH").filter(|d| !d.is_empty()) {
            self.log_path = Some(PathBuf::from(dir));
        }
        if let Some(fp8) = &mut self.fp8 {
            let recipes = [
                ("current", Fp8Recipe::Current),
                ("delayed", Fp8Recipe::delayed()),
            ];
            if let Some(recipe) = env_choice(&var, "AMPGRAPH_AMP_FP8_SCALING", &recipes)? {
                fp8.recipe = recipe;
            }
            let modes = [
                ("never", FastAccumulation::Never),
                ("forward", FastAccumulation::Forward),
                ("all", FastAccumulation::All),
            ];
            if let Some(fast) = env_choice(&var, "AMPGRAPH_AMP_FP8_FAST_ACCUMULATION", &modes)? {
                fp8.fast_accumulation = fast;
            }
        }
        Ok(())
    }
}

/// The value among `choices` that the environment variable `name` (looked up through
/// `var`) names, where it is set and not empty; any other value is an error naming the
/// variable, the value and the choices.
fn env_choice<T: Clone>(
    var: &impl Fn(&str) -> Option<String>,
    name: &str,
    choices: &[(&str, T)],
) -> Result<Option<T>, PassError> {
    let Some(value) = var(name).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    let value = value.trim();
    if let Some((_, chosen)) = choices.iter().find(|(key, _)| *key == value) {
        return Ok(Some(chosen.clone()));
    }
    let keys: Vec<&str> = choices.iter().map(|(key, _)| *key).collect();
    let listed = match keys.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(PassError::Lists(format!("{name} is '{value}': {listed}")))
}

/// The AMP pass.
#[derive(Clone, Debug)]
pub struct AutoMixedPrecision {
    pub config: AmpConfig,
}

impl AutoMixedPrecision {
    pub fn new(config: AmpConfig) -> Self {
        AutoMixedPrecision { config }
    }

    /// Decides every node's precision without changing the graph.
    pub fn analyze(&self, graph: &Graph) -> Result<Painting, PassError> {
        Painting::paint(graph, &self.config)
    }

    /// Rewrites `graph` and returns the full report (decisions, counts, reasons).
    pub fn rewrite(&self, graph: &mut Graph) -> Result<AmpReport, PassError> {
        let before = self.config.log_path.as_ref().map(|_| graph.clone());
        let painting = self.analyze(graph)?;
        let report_base = AmpReport::decisions(&painting, &self.config);
        let stats = rewrite::apply(graph, &painting, self.config.target)?;
        let mut report = report_base.with_stats(stats);
        if let Some(fp8) = &self.config.fp8 {
            let plan = fp8::plan(graph, fp8)?;
            report.fp8 = Some(fp8::apply(graph, &plan, fp8)?);
        }
        if let (Some(dir), Some(before)) = (&self.config.log_path, before) {
            report::dump(dir, &before, graph, &report)?;
        }
        Ok(report)
    }
}

impl Pass for AutoMixedPrecision {
    fn name(&self) -> &'static str {
        "amp"
    }

    fn run(&self, graph: &mut Graph) -> Result<PassSummary, PassError> {
        Ok(self.rewrite(graph)?.summary())
    }
}
