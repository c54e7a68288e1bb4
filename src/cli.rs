//! The command line, as a library module so tests can call it in-process.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::Value;
use thiserror::Error;

use ampgraph_exec::feeds::{initial_value, seeded_tensor};
use ampgraph_exec::{
    check_tensor_size, ExecError, ExecOptions, Feeds, KernelCache, DEFAULT_MAX_TENSOR_BYTES,
};
use ampgraph_exec::{cuda, host_memory, memory_plan};
use ampgraph_graph::format::{self, GraphDef};
use ampgraph_graph::fp8::{F8E4M3, F8E5M2};
use ampgraph_graph::ops::{AmaxChoice, Placeholder, Variable};
use ampgraph_graph::tensor::{bf16_from_f64, f16_from_f64};
use ampgraph_graph::{DType, Data, Graph, GraphError, Tensor};
use ampgraph_onnx::Probes;
use ampgraph_passes::amp::fp8::DEFAULT_AMAX_HISTORY;
use ampgraph_passes::amp::report::explain;
use ampgraph_passes::amp::{
    AmpConfig, AutoMixedPrecision, FastAccumulation, Fp8Recipe, PrecisionLists,
};
use ampgraph_passes::{registry, PassError};

use crate::session::{registry_passes, Device, Pipeline, Session, SessionError, SessionOptions};

#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Onnx(#[from] ampgraph_onnx::OnnxError),
    #[error(transparent)]
    Calibrate(#[from] crate::numerics::calibrate::CalibrateError),
    #[error(transparent)]
    Bisect(#[from] crate::numerics::bisect::BisectError),
    #[error("{0}")]
    Usage(String),
    /// `run --check-numerics`: the step's outputs are not finite; the report in one line.
    #[error("check-numerics: {0}")]
    NonFinite(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, CliError>;

#[derive(Parser, Debug)]
#[command(
    name = "ampgraph",
    version,
    about = "Automatic mixed precision for dataflow graphs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// The shape of an ONNX model's input, `NAME=DxDx...` (e.g. `x=1x3x224x224`):
    /// needed where the model's dims are symbolic (`batch`), and it overrides them.
    #[arg(long = "input", global = true, value_name = "NAME=SHAPE")]
    pub inputs: Vec<String>,
    /// With an ONNX output: inputs and outputs in the rewritten graph's 16-bit type
    /// (by default they keep their f32 types, onnxruntime's `keep_io_types`).
    #[arg(long, global = true)]
    pub half_io: bool,
}

/// Import options from `--input NAME=SHAPE` flags.
fn import_options(inputs: &[String]) -> Result<ampgraph_onnx::ImportOptions> {
    let mut opts = ampgraph_onnx::ImportOptions::default();
    for arg in inputs {
        let bad = || {
            CliError::Usage(format!(
                "--input {arg}: expected NAME=DxDx... (e.g. x=1x3x224x224)"
            ))
        };
        let (name, dims) = arg.rsplit_once('=').ok_or_else(bad)?;
        let shape = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split(['x', ','])
                .map(|d| d.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| bad())?
        };
        if name.is_empty() || opts.input_shapes.insert(name.to_string(), shape).is_some() {
            return Err(bad());
        }
    }
    Ok(opts)
}

/// How the command line reads and writes graph files: our JSON and binary formats,
/// and ONNX (by the `.onnx` extension).
struct Files {
    import: ampgraph_onnx::ImportOptions,
    export: ampgraph_onnx::ExportOptions,
}

impl Files {
    fn new(cli: &Cli) -> Result<Files> {
        Ok(Files {
            import: import_options(&cli.inputs)?,
            export: ampgraph_onnx::ExportOptions {
                keep_io_types: !cli.half_io,
                ..Default::default()
            },
        })
    }

    /// Loads `path`; with `probe`, an ONNX model's symbolic input dims are probed
    /// too, so that an ONNX file written from it keeps them (see [`ampgraph_onnx::SymbolicDims`]).
    fn load_probed(&self, path: &str, probe: bool) -> Result<(Graph, Option<Probes>)> {
        if probe && ampgraph_onnx::is_onnx_path(Path::new(path)) {
            let (g, probes) = ampgraph_onnx::import_file_probed(Path::new(path), &self.import)?;
            return Ok((g, Some(probes)));
        }
        Ok((self.load(path)?, None))
    }

    fn load(&self, path: &str) -> Result<Graph> {
        if ampgraph_onnx::is_onnx_path(Path::new(path)) {
            return Ok(ampgraph_onnx::import_file(Path::new(path), &self.import)?);
        }
        if !self.import.input_shapes.is_empty() {
            return Err(CliError::Usage(format!(
                "--input is for ONNX models; {path} is not one"
            )));
        }
        Ok(format::load(path)?)
    }

    /// Writes `g` by `path`'s extension: `.onnx` (its Variables as initializers holding
    /// their initial values, as a session with seed 0 gives them: ONNX has no
    /// variables), `.bin`, or JSON (any other).
    /// `probes` (of the model `g` was imported from, rewritten as `g` was) keep its
    /// symbolic dims symbolic in an ONNX file; a dim that cannot be is warned about.
    fn save(&self, g: &Graph, path: &Path, probes: Option<&Probes>) -> Result<()> {
        if ampgraph_onnx::is_onnx_path(path) {
            let dims = probes.map(|p| p.dims(g));
            for (symbol, why) in dims.iter().flat_map(|d| d.fixed()) {
                log::warn!(
                    "{}: the symbolic dim '{}' stays {}: {why}",
                    path.display(),
                    symbol.name,
                    symbol.value
                );
            }
            let mut g = g.clone();
            let variables: Vec<_> = (g.node_ids())
                .filter(|&id| g.node(id).op.is::<Variable>())
                .collect();
            for id in variables {
                let node = g.node(id);
                let Some(var) = node.op.downcast_ref::<Variable>() else {
                    continue;
                };
                check_tensor_size(&node.name, "Variable", &var.ty, DEFAULT_MAX_TENSOR_BYTES)?;
                let value = initial_value(&node.name, var, 0);
                g.set_node(id, Box::new(ampgraph_graph::ops::Const::new(value)), &[])?;
            }
            return Ok(ampgraph_onnx::export_file_with_dims(
                &g,
                dims.as_ref(),
                path,
                &self.export,
            )?);
        }
        let fmt = if path.extension().is_some_and(|e| e == "bin") {
            DumpFormat::Bin
        } else {
            DumpFormat::Json
        };
        write_file(path, &render(g, fmt)?)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
pub enum DumpFormat {
    Text,
    Json,
    Dot,
    Bin,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
}

impl DeviceArg {
    /// The device to run `g` on (`auto`: CUDA device 0 where it runs every node).
    pub fn for_graph(self, g: &ampgraph_graph::Graph) -> Device {
        match self {
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => Device::Cuda(0),
            DeviceArg::Auto => Device::auto_for(g),
        }
    }
}

/// The flags of a training run, shared by the examples that train (flatten them into
/// a command's own with `#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// Epochs to train (with --resume, counting those in the checkpoint).
    #[arg(long, default_value_t = 6)]
    pub epochs: usize,
    /// Examples per training step.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// SGD's learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,
    /// SGD's momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Train in plain f32 instead of mixed precision.
    #[arg(long)]
    pub fp32: bool,
    /// Mixed precision in bf16 instead of f16.
    #[arg(long, conflicts_with = "fp32")]
    pub bf16: bool,
    /// Mixed precision in bf16 with FP8 matrix products where the cost model says
    /// they pay (docs/amp-algorithm.md §3.9; `AMPGRAPH_AMP_FP8_SCALING` picks the
    /// scaling).
    #[arg(long, conflicts_with_all = ["fp32", "bf16"])]
    pub fp8: bool,
    /// The dynamic loss scale's first value under f16 AMP (halved on each overflow,
    /// that step skipped; doubled after 2000 finite steps). The default is
    /// TensorFlow's 2^15 (PyTorch's GradScaler starts at 2^16); a model whose
    /// gradients overflow there skips its first steps until the scale fits.
    #[arg(long, default_value_t = 32768.0, value_parser = positive)]
    pub initial_loss_scale: f64,
    /// Seed of the initial weights, the shuffles and the random transforms.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Threads making batches (0: on the training thread); default: the cores.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Save all variables and the position here after every epoch (atomically).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Also save every this many steps.
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Start from the checkpoint where it stopped (`--epochs` counts its epochs too).
    #[arg(long)]
    pub resume: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Where to train: `auto` is CUDA device 0 where it runs every node, else the CPU.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
}

/// A finite number above 0 (a loss scale).
fn positive(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number above 0")),
        Err(e) => Err(e.to_string()),
    }
}

impl TrainArgs {
    /// The AMP dtype (`f8e4m3` for FP8 products on bf16), or `None` for plain f32.
    pub fn amp(&self) -> Option<DType> {
        match (self.fp32, self.bf16, self.fp8) {
            (true, ..) => None,
            (_, true, _) => Some(DType::BF16),
            (_, _, true) => Some(DType::F8E4M3),
            _ => Some(DType::F16),
        }
    }

    /// The dynamic loss scale, from `--initial-loss-scale`.
    pub fn loss_scale(&self) -> crate::optim::LossScale {
        crate::optim::LossScale::dynamic(self.initial_loss_scale)
    }

    /// The precision as a run's header says it: `fp32`, `AMP f16`, `AMP bf16`, or
    /// `AMP bf16 with FP8 products`.
    pub fn precision(&self) -> String {
        match self.amp() {
            None => "fp32".into(),
            Some(DType::F8E4M3) => "AMP bf16 with FP8 products".into(),
            Some(d) => format!("AMP {d}"),
        }
    }

    /// Refuses `--resume` without `--checkpoint`.
    pub fn check(&self) -> std::result::Result<(), String> {
        match (self.resume, &self.checkpoint) {
            (true, None) => Err("--resume needs --checkpoint PATH".into()),
            _ => Ok(()),
        }
    }

    /// Shuffled batches of `--batch` (the last short one left out: a graph's batch
    /// size is fixed), seeded, on `--workers` threads two batches ahead each.
    pub fn loader_options(&self) -> ampgraph_data::LoaderOptions {
        let defaults = ampgraph_data::LoaderOptions::default();
        let workers = self.workers.unwrap_or(defaults.workers);
        ampgraph_data::LoaderOptions {
            batch_size: self.batch,
            drop_last: true,
            seed: self.seed,
            workers,
            prefetch: 2 * workers.max(1),
            ..defaults
        }
    }

    pub fn train_options(&self) -> crate::train::TrainOptions {
        crate::train::TrainOptions {
            checkpoint: self.checkpoint.clone(),
            checkpoint_every: self.checkpoint_every,
            progress: !self.quiet,
        }
    }

    pub fn session_options(&self) -> SessionOptions {
        SessionOptions {
            seed: self.seed,
            ..Default::default()
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print a graph as text, JSON, Graphviz DOT or binary.
    Dump {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// text: one line a node; json: the interchange format; dot: Graphviz, nodes
        /// colored by precision; bin: the binary format.
        #[arg(long, value_enum, default_value = "text")]
        format: DumpFormat,
        /// Where to write it; standard output otherwise (binary only to a file or a
        /// pipe, never to a terminal).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Convert between .json, .bin and .onnx (by the output's extension).
    Convert {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// The file to write: `.json`, `.bin` or `.onnx` decides the format.
        #[arg(short, long)]
        output: PathBuf,
        /// Make the model's weights trainable for fine-tuning: its float constants of
        /// two or more elements (but batch norms' statistics) become Variables of their
        /// names in the written graph (.json or .bin), their values saved to this
        /// checkpoint, which a session of the graph restores.
        #[arg(long, value_name = "CHECKPOINT")]
        trainable: Option<PathBuf>,
    },
    /// Rewrite a graph: automatic mixed precision and other passes.
    Rewrite {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        #[arg(required_unless_present = "list_passes")]
        graph: Option<String>,
        /// Print the passes --passes can name (besides `amp`), one a line with what each
        /// does, and exit.
        #[arg(long, exclusive = true)]
        list_passes: bool,
        /// Run the automatic mixed precision pass.
        #[arg(long)]
        amp: bool,
        #[command(flatten)]
        precision: PrecisionArgs,
        #[arg(long, value_delimiter = ',', help = passes_help())]
        passes: Vec<String>,
        /// Where to write the result (.json, .bin or .onnx); JSON on standard output
        /// otherwise.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Print the AMP summary, per-op counts and casts (to standard error when the
        /// graph goes to standard output).
        #[arg(long)]
        report: bool,
        /// Before AMP, run the graph in f32 on the CPU on sample inputs and keep in f32
        /// every node whose values would not fit the 16-bit type (twice the largest
        /// |x| seen beyond its range, or all values below its normal range), and the
        /// nodes reading them; after AMP, warn of an output that underflows on the
        /// samples. FEEDS: `seed:N` for N samples of the seeded values `ampgraph run
        /// --seed K` gives (K = 0..N-1), or one sample as `run --feeds` takes it (a
        /// JSON file or text; what it leaves out is seeded).
        #[arg(long, value_name = "seed:N|FILE|JSON")]
        calibrate: Option<String>,
        /// Save the nodes --calibrate keeps in f32 as a list file (`[keep_f32]`), for
        /// --overrides.
        #[arg(long, value_name = "FILE.toml", requires = "calibrate")]
        save_overrides: Option<PathBuf>,
        /// Save the amaxes --calibrate measured for `--fp8-scaling static` (JSON), for
        /// --fp8-amaxes: calibrate once, at any batch, and rewrite at others.
        #[arg(long, value_name = "FILE.json", requires = "calibrate")]
        save_fp8_amaxes: Option<PathBuf>,
        /// `--fp8-scaling static` with the amaxes --save-fp8-amaxes saved, instead of
        /// calibrating.
        #[arg(long, value_name = "FILE.json", conflicts_with = "calibrate")]
        fp8_amaxes: Option<PathBuf>,
    },
    /// Explain why NODE gets its precision under the AMP rewrite.
    Explain {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// The node's name.
        node: String,
        #[command(flatten)]
        precision: PrecisionArgs,
    },
    /// Run a graph and print every output.
    Run {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// Where to run: `auto` is CUDA device 0 where it runs every node, else the CPU.
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceArg,
        /// Seed of the values given to Placeholders and Variables not in --feeds.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Values for Placeholders and Variables: a JSON file, or the JSON itself (text
        /// starting with `{`), an object {"name": nested lists} or {"name": {"shape":
        /// [...], "values": [...]}}; a value the node's dtype cannot hold is an error.
        #[arg(long, value_name = "FILE|JSON")]
        feeds: Option<String>,
        /// Print the outputs as JSON (every value).
        #[arg(long)]
        json: bool,
        /// Where the step's values are not finite, name the first node whose output is
        /// not finite while its inputs are (re-run on the CPU), print the report on
        /// stderr and fail (also with AMPGRAPH_CHECK_NUMERICS=1).
        #[arg(long)]
        check_numerics: bool,
        #[command(flatten)]
        executor: ExecutorArgs,
    },
    /// Find a few nodes to keep in f32 so that the AMP rewrite's outputs are within
    /// --rtol of the f32 graph's (CPU runs, nodes ranked by the error their own 16-bit
    /// arithmetic adds, then kept in growing batches and pruned); print them and the
    /// errors, and save them as an overrides file for --overrides.
    Bisect {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// Values for Placeholders and Variables, as `run --feeds` takes them.
        #[arg(long, value_name = "FILE|JSON")]
        feeds: Option<String>,
        /// Seed of the values given to Placeholders and Variables not in --feeds.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The largest relative error allowed per output: max |y16 - y32| / max |y32|.
        #[arg(long)]
        rtol: f64,
        #[command(flatten)]
        precision: PrecisionArgs,
        /// Where to save the set as a list file of a `[keep_f32]` table.
        #[arg(short, long, value_name = "LIST.toml")]
        output: Option<PathBuf>,
    },
    /// Time a model's inference step as a session runs it (AMP where asked, then the
    /// device's passes): device, wall and host enqueue milliseconds per step (median,
    /// p90, p99), throughput, peak device memory, how the step was launched and, with
    /// --profile, the per-op table.
    Bench {
        /// The graph file: JSON (`.json`), binary (`.bin`) or an ONNX model (`.onnx`).
        graph: String,
        /// Rewrite with automatic mixed precision to this 16-bit type first.
        #[arg(long, value_enum)]
        amp: Option<HalfArg>,
        /// Where to run: `auto` is CUDA device 0 where it runs every node, else the CPU.
        #[arg(long, value_enum, default_value = "auto")]
        device: DeviceArg,
        /// Timed steps.
        #[arg(long, default_value_t = 50)]
        iterations: usize,
        /// Steps run before the timed ones.
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        /// Seed of the Placeholders' values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The model's float constants (weights) become Variables holding the same
        /// values, as in a graph being trained.
        #[arg(long)]
        weights_as_variables: bool,
        /// Launch every step op by op rather than replaying it as one CUDA graph.
        #[arg(long)]
        op_by_op: bool,
        /// Each step uploads its own inputs (by default they are copied while the
        /// step before computes, from page-locked memory on a stream of their own).
        #[arg(long)]
        sync_feeds: bool,
        /// After the timed steps, profile this many op by op (each op between CUDA
        /// events) and print the per-op table.
        #[arg(long, default_value_t = 0, value_name = "STEPS")]
        profile: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        executor: ExecutorArgs,
    },
    /// Plan the device memory of one step on the host, as the CUDA executor plans
    /// it (after AMP where the graph is marked for it and the passes after it): the
    /// planned peak and its parts (the arena, the variables, what else lives beside
    /// the arena), the lower bound, the peak step and the largest tensors alive there.
    Plan {
        /// The graph file: JSON (`.json`, or `-` for standard input), binary (`.bin`) or
        /// an ONNX model (`.onnx`).
        graph: String,
        /// What the step computes: `name` or `name:k`, comma-separated (default: the
        /// graph's outputs).
        #[arg(long, value_delimiter = ',', value_name = "PORT")]
        fetch: Vec<String>,
        /// The passes after AMP: registry names, comma-separated, or `none` (default:
        /// the CUDA pipeline, as a CUDA session runs them).
        #[arg(long, value_delimiter = ',', value_name = "LIST")]
        passes: Option<Vec<String>>,
        /// How many of the largest tensors alive at the peak to list.
        #[arg(long, default_value_t = 10)]
        top: usize,
    },
}

/// A `--passes` list after AMP that may be `none`: the names to run, or `None` where
/// it was not given (the executor's defaults).
pub fn passes_after_amp(names: Option<&[String]>) -> Option<Vec<String>> {
    names.map(|names| {
        if names.iter().any(|n| n == "none") {
            Vec::new()
        } else {
            names.to_vec()
        }
    })
}

/// The executor's switches (`SessionOptions::executor` and `kernel_cache`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ExecutorArgs {
    /// f32 matrix products may use TF32 Tensor Cores (CUDA; PyTorch's `allow_tf32`).
    #[arg(long)]
    pub allow_tf32: bool,
    /// f16 matrix products may accumulate in f16 (CUDA; PyTorch's
    /// `allow_fp16_reduced_precision_reduction`).
    #[arg(long)]
    pub allow_fp16_reduced_precision_reduction: bool,
    /// Convolutions use only deterministic cuDNN algorithms (CUDA; PyTorch's
    /// `cudnn.deterministic`); by default the fastest, timed on first use.
    #[arg(long)]
    pub deterministic_convolutions: bool,
    /// The most workspace one cuDNN convolution algorithm may use (CUDA; TensorFlow's
    /// `TF_CUDNN_WORKSPACE_LIMIT_IN_MB`; default 1024).
    #[arg(long, value_name = "MIB")]
    pub conv_workspace_limit_mib: Option<usize>,
    /// Matrix products take cuBLASLt's first heuristic pick rather than the fastest of
    /// its candidates timed on first use (CUDA; reproducible bit for bit across runs).
    #[arg(long)]
    pub gemm_heuristic_only: bool,
    /// Where compiled CUDA kernels are kept, or `off` (overrides AMPGRAPH_KERNEL_CACHE).
    #[arg(long, value_name = "DIR|off")]
    pub kernel_cache: Option<KernelCache>,
}

impl ExecutorArgs {
    /// Session options with these switches (and the defaults otherwise).
    pub fn session_options(&self) -> SessionOptions {
        SessionOptions {
            executor: ExecOptions {
                gemm: cuda::GemmOptions {
                    allow_tf32: self.allow_tf32,
                    allow_fp16_reduced_precision_reduction: self
                        .allow_fp16_reduced_precision_reduction,
                    heuristic_only: self.gemm_heuristic_only,
                },
                conv: cuda::DnnOptions {
                    deterministic: self.deterministic_convolutions,
                    workspace_limit_mib: self.conv_workspace_limit_mib,
                },
                ..ExecOptions::default()
            },
            kernel_cache: self.kernel_cache.clone().unwrap_or_default(),
            ..SessionOptions::default()
        }
    }
}

/// The target precision and lists of the AMP pass.
#[derive(clap::Args, Debug, Clone)]
pub struct PrecisionArgs {
    /// The 16-bit type to convert to; `fp8`: bf16, with FP8 operands for the
    /// products where they pay (see --fp8-*).
    #[arg(long, value_enum, default_value = "f16")]
    dtype: HalfArg,
    /// FP8 scaling (with --dtype fp8): `current` (each tensor's own amax), `delayed`
    /// (an amax history in the graph, updated by the training step) or `static`
    /// (inference: scales fixed from the amaxes on `rewrite --calibrate`'s samples, no
    /// amax pass, casts fused into the kernels before them). Default:
    /// `AMPGRAPH_AMP_FP8_SCALING`, else current.
    #[arg(long, value_enum)]
    fp8_scaling: Option<Fp8ScalingArg>,
    /// Delayed scaling's amax history length (default 1024, TransformerEngine's).
    #[arg(long, value_name = "STEPS")]
    fp8_amax_history: Option<usize>,
    /// Which amax of the history delayed scaling scales by (default: max).
    #[arg(long, value_enum)]
    fp8_amax: Option<AmaxArg>,
    /// Which FP8 products sum in Hopper's fast accumulation mode: `all` (errors 50x
    /// below the operands' FP8 rounding), `forward` (torchao's and
    /// TransformerEngine's choice) or `never`. Default:
    /// `AMPGRAPH_AMP_FP8_FAST_ACCUMULATION`, else all.
    #[arg(long, value_enum)]
    fp8_fast_accumulation: Option<FastAccumulationArg>,
    /// Every 16-bit MatMul the GPU's FP8 products take (k and n multiples of 16) in
    /// FP8: no cost model, first and last layers too; `explain` names the others.
    #[arg(long)]
    fp8_everywhere: bool,
    /// MatMuls kept 16-bit by name, comma-separated (their gradients' products too).
    #[arg(long, value_delimiter = ',', value_name = "NODES")]
    fp8_keep: Vec<String>,
    /// The precision lists: a profile (`default`: ampgraph's for --dtype, that is
    /// `default_fp16` or `default_bf16`; `tensorflow`: TensorFlow's CUDA lists) or a
    /// TOML list file (`.toml`).
    #[arg(long, default_value = "default", value_name = "PROFILE|FILE.toml")]
    lists: String,
    /// Nodes to keep in f32 by name: a list file of a `[keep_f32]` table, as
    /// `rewrite --calibrate --save-overrides` writes.
    #[arg(long, value_name = "FILE.toml")]
    overrides: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum HalfArg {
    F16,
    Bf16,
    /// BF16 AMP with FP8 products.
    Fp8,
}

impl HalfArg {
    /// The graph's mark for this target (`f8e4m3` for FP8 on BF16).
    pub fn dtype(self) -> DType {
        match self {
            HalfArg::F16 => DType::F16,
            HalfArg::Bf16 => DType::BF16,
            HalfArg::Fp8 => DType::F8E4M3,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fp8ScalingArg {
    Current,
    Delayed,
    Static,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FastAccumulationArg {
    Never,
    Forward,
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AmaxArg {
    Max,
    MostRecent,
}

impl PrecisionArgs {
    /// The AMP settings these flags and the `AMPGRAPH_AMP_*` environment select.
    pub fn config(&self) -> Result<AmpConfig> {
        let target = self.dtype.dtype();
        let mut config = match self.lists.as_str() {
            "default" => AmpConfig::new(target)?,
            profile if !profile.ends_with(".toml") => AmpConfig::with_profile(target, profile)
                .map_err(|_| {
                    CliError::Usage(format!(
                        "--lists {profile}: no such profile (default, tensorflow, default_fp16, \
                         default_bf16) and not a .toml file"
                    ))
                })?,
            file => {
                let mut c = AmpConfig::new(target)?;
                c.lists = PrecisionLists::from_file(Path::new(file))?;
                c
            }
        };
        if let Some(path) = &self.overrides {
            crate::numerics::calibrate::load_overrides(&mut config.lists, path)?;
        }
        // The environment first: the flags override it.
        config.apply_vars(|k| std::env::var(k).ok())?;
        let fp8_options = self.fp8_everywhere
            || !self.fp8_keep.is_empty()
            || self.fp8_scaling.is_some()
            || self.fp8_fast_accumulation.is_some();
        let delayed_options = self.fp8_amax_history.is_some() || self.fp8_amax.is_some();
        if self.fp8_everywhere {
            config = config.on_every_device_product();
        }
        match &mut config.fp8 {
            None if fp8_options || delayed_options => {
                return Err(CliError::Usage(
                    "the --fp8-* options need --dtype fp8".into(),
                ))
            }
            None => {}
            Some(_) if delayed_options && self.fp8_scaling != Some(Fp8ScalingArg::Delayed) => {
                return Err(CliError::Usage(
                    "--fp8-amax-history and --fp8-amax need --fp8-scaling delayed".into(),
                ))
            }
            Some(fp8) => {
                if let Some(fast) = self.fp8_fast_accumulation {
                    fp8.fast_accumulation = match fast {
                        FastAccumulationArg::Never => FastAccumulation::Never,
                        FastAccumulationArg::Forward => FastAccumulation::Forward,
                        FastAccumulationArg::All => FastAccumulation::All,
                    };
                }
                fp8.keep.extend(self.fp8_keep.iter().cloned());
                match self.fp8_scaling {
                    Some(Fp8ScalingArg::Current) => fp8.recipe = Fp8Recipe::Current,
                    Some(Fp8ScalingArg::Static) => fp8.recipe = Fp8Recipe::Static,
                    Some(Fp8ScalingArg::Delayed) => {
                        fp8.recipe = Fp8Recipe::Delayed {
                            history: self.fp8_amax_history.unwrap_or(DEFAULT_AMAX_HISTORY),
                            amax: match self.fp8_amax {
                                Some(AmaxArg::MostRecent) => AmaxChoice::MostRecent,
                                Some(AmaxArg::Max) | None => AmaxChoice::Max,
                            },
                        }
                    }
                    // The environment's, or the default.
                    None => {}
                }
            }
        }
        Ok(config)
    }
}

/// Every pass name `--passes` accepts.
fn known_passes() -> impl Iterator<Item = &'static str> {
    std::iter::once("amp").chain(registry::names())
}

/// The `--passes` help: the known names, from the registry.
fn passes_help() -> String {
    format!(
        "Passes to run, comma-separated, in order (known: {}; simplification pipeline: {})",
        known_passes().collect::<Vec<_>>().join(", "),
        registry::SIMPLIFY_PIPELINE.join(",")
    )
}

/// `rewrite --list-passes`: each registered pass's name and summary, one a line.
fn list_passes(out: &mut dyn Write) -> Result<()> {
    let width = registry::names().map(str::len).max().unwrap_or(0);
    for entry in registry::PASSES {
        writeln!(out, "{:width$}  {}", entry.name, entry.summary).map_err(io_err("<stdout>"))?;
    }
    Ok(())
}

/// The passes named on the command line, in order; `--amp` puts AMP first.
fn selected_passes(amp: bool, names: &[String]) -> Result<Vec<&str>> {
    let mut selected: Vec<&str> = names.iter().map(String::as_str).collect();
    if amp && !selected.contains(&"amp") {
        selected.insert(0, "amp");
    }
    if selected.is_empty() {
        return Err(CliError::Usage(
            "no passes selected: use --amp and/or --passes NAME[,NAME...]".into(),
        ));
    }
    match selected.iter().find(|n| !known_passes().any(|k| k == **n)) {
        Some(unknown) => Err(CliError::Usage(format!(
            "unknown pass '{unknown}' (known: {})",
            known_passes().collect::<Vec<_>>().join(", ")
        ))),
        None => Ok(selected),
    }
}

/// The most characters of an error line (a message listing 60k nodes is cut, saying
/// how much was left out).
const MOST_ERROR_CHARS: usize = 2000;

/// `message` as one bounded terminal line: line breaks and tabs become spaces, other
/// control characters (a node name's ESC or BEL) are written as `\u{1b}`, and past
/// 2000 characters the rest is cut, with its length.
pub fn error_line(message: &str) -> String {
    let mut line = String::new();
    let mut chars = message.chars();
    for c in chars.by_ref().take(MOST_ERROR_CHARS) {
        match c {
            '\n' | '\r' | '\t' => line.push(' '),
            c if c.is_control() => line.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => line.push(c),
        }
    }
    let rest = chars.count();
    if rest > 0 {
        line.push_str(&format!(" ... ({rest} more characters)"));
    }
    line
}

/// A binary's `main`: warnings and worse logged (`RUST_LOG` sets more), then `run`,
/// whose error is printed as [`report_error`] prints it.
pub fn main_with<E: std::fmt::Display>(
    run: impl FnOnce() -> std::result::Result<(), E>,
) -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => report_error(&e),
    }
}

/// Prints `error` to stderr as the command line's binaries do (`error: ` and
/// [`error_line`]) and returns their exit status for bad input, 2.
pub fn report_error(error: &dyn std::fmt::Display) -> std::process::ExitCode {
    eprintln!("error: {}", error_line(&error.to_string()));
    std::process::ExitCode::from(2)
}

pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    let files = Files::new(&cli)?;
    match cli.command {
        Command::Rewrite {
            list_passes: true, ..
        } => list_passes(out),
        Command::Rewrite {
            graph,
            amp,
            precision,
            passes,
            output,
            report,
            calibrate,
            save_overrides,
            save_fp8_amaxes,
            fp8_amaxes,
            ..
        } => {
            let graph = graph.ok_or_else(|| CliError::Usage("rewrite needs a GRAPH".into()))?;
            let onnx_out = output.as_deref().is_some_and(ampgraph_onnx::is_onnx_path);
            let (mut g, mut probes) = files.load_probed(&graph, onnx_out)?;
            let selected = selected_passes(amp, &passes)?;
            if calibrate.is_some() && !selected.contains(&"amp") {
                return Err(CliError::Usage(
                    "--calibrate is for the AMP pass: add --amp".into(),
                ));
            }
            let mut config = precision.config()?;
            let static_fp8 = config.fp8.as_ref().map(|f| f.recipe) == Some(Fp8Recipe::Static);
            if (save_fp8_amaxes.is_some() || fp8_amaxes.is_some()) && !static_fp8 {
                return Err(CliError::Usage(
                    "--save-fp8-amaxes and --fp8-amaxes are for --fp8-scaling static".into(),
                ));
            }
            match (&fp8_amaxes, config.fp8.as_mut()) {
                (Some(path), Some(fp8)) => {
                    fp8.calibrated = crate::numerics::calibrate::load_fp8_amaxes(path)?;
                }
                _ if static_fp8 && calibrate.is_none() => {
                    return Err(CliError::Usage(
                        "--fp8-scaling static fixes its scales from samples: add --calibrate \
                         (or --fp8-amaxes)"
                            .into(),
                    ))
                }
                _ => {}
            }
            let calibration = calibrate.as_deref().map(|samples| Calibration {
                samples,
                save_overrides: save_overrides.as_deref(),
                save_fp8_amaxes: save_fp8_amaxes.as_deref(),
            });
            let text = rewrite_graph(&mut g, &selected, &mut config, calibration)?;
            if let Some(probes) = &mut probes {
                // The same rewrite, calibrated overrides included.
                probes.rewrite(|p| rewrite_graph(p, &selected, &mut config.clone(), None));
            }
            match &output {
                Some(path) => {
                    files.save(&g, path, probes.as_ref())?;
                    if report {
                        out.write_all(text.as_bytes()).map_err(io_err("<stdout>"))?;
                    }
                }
                None => {
                    out.write_all(&render(&g, DumpFormat::Json)?)
                        .map_err(io_err("<stdout>"))?;
                    if report {
                        eprint!("{text}");
                    }
                }
            }
            Ok(())
        }
        Command::Explain {
            graph,
            node,
            precision,
        } => {
            let g = files.load(&graph)?;
            let amp = AutoMixedPrecision::new(precision.config()?);
            let painting = amp.analyze(&g)?;
            let explanation = explain(&g, &painting, &amp.config, &node)?;
            write!(out, "{explanation}").map_err(io_err("<stdout>"))
        }
        Command::Dump {
            graph,
            format,
            output,
        } => dump(&files.load(&graph)?, format, output.as_deref(), out),
        Command::Convert {
            graph,
            output,
            trainable,
        } => {
            let onnx_out = ampgraph_onnx::is_onnx_path(&output);
            let (mut g, probes) = files.load_probed(&graph, onnx_out)?;
            let extension = output.extension().and_then(|e| e.to_str());
            if !matches!(extension, Some("bin" | "json" | "onnx")) {
                return Err(CliError::Usage(format!(
                    "{}: the output must end in .json, .bin or .onnx",
                    output.display()
                )));
            }
            let Some(checkpoint) = trainable else {
                return files.save(&g, &output, probes.as_ref());
            };
            if onnx_out {
                return Err(CliError::Usage(
                    "--trainable writes Variables, which ONNX has not: write .json or .bin".into(),
                ));
            }
            let values = crate::pretrained::trainable_constants(&mut g)?;
            let mut session = Session::new(g.clone(), Device::Cpu)?;
            crate::pretrained::set_values(&mut session, values)?;
            session.save(&checkpoint)?;
            files.save(&g, &output, None)
        }
        Command::Plan {
            graph,
            fetch,
            passes,
            top,
        } => plan(
            &graph,
            files.load(&graph)?,
            &fetch,
            passes.as_deref(),
            top,
            out,
        ),
        Command::Bisect {
            graph,
            feeds,
            seed,
            rtol,
            precision,
            output,
        } => {
            let g = files.load(&graph)?;
            let feeds = make_feeds(&g, seed, feeds.as_deref())?;
            let config = precision.config()?;
            let found = crate::numerics::bisect::bisect(&g, &feeds, &config, rtol)?;
            print_bisection(&found, rtol, out).map_err(io_err("<stdout>"))?;
            if let Some(path) = output {
                let text = found.overrides_toml(&config.lists)?;
                format::write_atomic(&path, text.as_bytes())?;
            }
            Ok(())
        }
        Command::Bench {
            graph,
            amp,
            device,
            iterations,
            warmup,
            seed,
            weights_as_variables,
            op_by_op,
            sync_feeds,
            profile,
            json,
            executor,
        } => {
            let g = files.load(&graph)?;
            let mut feeds = Feeds::new();
            seed_missing(&g, seed, &mut feeds, |n| n.op.is::<Placeholder>())?;
            let mut session = executor.session_options();
            session.executor.op_by_op = op_by_op;
            let options = crate::benchmark::BenchOptions {
                amp: amp.map(HalfArg::dtype),
                device: device.for_graph(&g),
                warmup,
                iterations,
                weights_as_variables,
                profile_steps: profile,
                sync_feeds,
                session,
            };
            let report = crate::benchmark::bench(g, &feeds, &options)?;
            let text = match json {
                true => {
                    serde_json::to_string_pretty(&report)
                        .map_err(|e| CliError::Usage(format!("the report as JSON: {e}")))?
                        + "\n"
                }
                false => report.to_string(),
            };
            write!(out, "{text}").map_err(io_err("<stdout>"))
        }
        Command::Run {
            graph,
            device,
            seed,
            feeds,
            json,
            check_numerics,
            executor,
        } => {
            let g = files.load(&graph)?;
            let feeds = make_feeds(&g, seed, feeds.as_deref())?;
            let device = device.for_graph(&g);
            // As a session runs it: AMP where the graph is marked for it, then the
            // device's passes; the feeds give every Variable its value.
            let options = SessionOptions {
                check_numerics,
                ..executor.session_options()
            };
            let mut session = Session::with_options(g, device, options)?;
            let fetches = session.graph().outputs().to_vec();
            let outputs = session.run(&fetches, &feeds)?;
            if let Some(report) = session.last_numerics_report() {
                // The session logged it at warn level; print it where the log did not.
                if !log::log_enabled!(target: crate::numerics::check::LOG_TARGET, log::Level::Warn)
                {
                    eprint!("{report}");
                }
                return Err(CliError::NonFinite(report.summary()));
            }
            print_outputs(session.graph(), &outputs, json, out)
        }
    }
}

/// `bisect`'s report: the set with reasons, the errors and the evaluations.
fn print_bisection(
    b: &crate::numerics::bisect::Bisection,
    rtol: f64,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    if b.keep_f32.is_empty() {
        writeln!(
            out,
            "the AMP rewrite is within rtol {rtol:.1e}: nothing to keep in f32"
        )?;
    } else {
        writeln!(out, "keep in f32 ({}):", b.keep_f32.len())?;
        for (node, why) in &b.keep_f32 {
            writeln!(out, "  {node}: {why}")?;
        }
    }
    writeln!(
        out,
        "relative error: {:.3e} before, {:.3e} after (rtol {rtol:.1e})",
        b.error_before, b.error_after
    )?;
    writeln!(out, "evaluations: {}", b.evaluations)
}

fn io_err(path: &str) -> impl FnOnce(std::io::Error) -> CliError + '_ {
    move |source| CliError::Io {
        path: path.to_string(),
        source,
    }
}

fn render(g: &Graph, fmt: DumpFormat) -> Result<Vec<u8>> {
    Ok(match fmt {
        DumpFormat::Text => format::to_text(g).into_bytes(),
        DumpFormat::Json => format::to_json(&GraphDef::from_graph(g)).into_bytes(),
        DumpFormat::Dot => format::to_dot(g, &format::default_color).into_bytes(),
        DumpFormat::Bin => format::to_bin(&GraphDef::from_graph(g))?,
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(format::write_atomic(path, bytes)?)
}

fn dump(g: &Graph, fmt: DumpFormat, output: Option<&Path>, out: &mut dyn Write) -> Result<()> {
    let bytes = render(g, fmt)?;
    match output {
        Some(p) => write_file(p, &bytes),
        None if fmt == DumpFormat::Bin && std::io::IsTerminal::is_terminal(&std::io::stdout()) => {
            Err(CliError::Usage(
                "the binary format does not go to a terminal: give -o FILE or pipe it".into(),
            ))
        }
        None => out.write_all(&bytes).map_err(io_err("<stdout>")),
    }
}

/// `ampgraph plan`: the graph through the pipeline a CUDA session runs (with
/// `passes` after AMP where given), then its step's memory plan.
fn plan(
    path: &str,
    mut g: Graph,
    fetch: &[String],
    passes: Option<&[String]>,
    top: usize,
    out: &mut dyn Write,
) -> Result<()> {
    let fetches = match fetch {
        [] => g.outputs().to_vec(),
        names => names
            .iter()
            .map(|name| {
                g.port_by_name(name)
                    .map_err(|e| CliError::Usage(format!("--fetch {name}: {e}")))
            })
            .collect::<Result<_>>()?,
    };
    if fetches.is_empty() {
        return Err(CliError::Usage(format!(
            "{path}: the graph has no outputs; name what the step computes with --fetch NAME[,NAME...]"
        )));
    }
    let options = SessionOptions {
        passes: passes_after_amp(passes),
        ..SessionOptions::default()
    };
    let pipeline = Pipeline::new(&g, &options, cuda::pipeline(&options.executor))?;
    let (_, fetches) = pipeline.run_for(&mut g, &fetches)?;
    let footprint = memory_plan::step_footprint(&g, &fetches, &Default::default())?;
    out.write_all(footprint.report(&g, top).as_bytes())
        .map_err(io_err("<stdout>"))
}

/// `rewrite --calibrate`'s samples and where to save what they measured.
#[derive(Clone, Copy)]
struct Calibration<'a> {
    samples: &'a str,
    save_overrides: Option<&'a Path>,
    save_fp8_amaxes: Option<&'a Path>,
}

/// Runs the selected passes on `g`, AMP with `config` (calibrated on the graph as
/// AMP gets it where `calibration` gives samples, saving the overrides and the static
/// FP8 amaxes where asked: `config` keeps them); returns the passes' report.
fn rewrite_graph(
    g: &mut Graph,
    selected: &[&str],
    config: &mut AmpConfig,
    calibration: Option<Calibration>,
) -> Result<String> {
    let mut text = String::new();
    for &name in selected {
        match name {
            // Run directly rather than through a PassManager to keep the full report.
            "amp" => {
                // On the graph as AMP gets it, so the names are its nodes'.
                let calibrated = match calibration {
                    Some(calibration) => {
                        let (done, feeds) = calibrate_amp(
                            g,
                            calibration.samples,
                            config,
                            calibration.save_overrides,
                        )?;
                        text.push_str(&done);
                        let recipe = config.fp8.as_ref().map(|f| f.recipe);
                        if recipe == Some(Fp8Recipe::Static) {
                            let amaxes = crate::numerics::calibrate::fp8_amaxes(g, config, &feeds)?;
                            text.push_str(&format!(
                                "FP8 static scales: the amaxes of {} tensors on the samples\n",
                                amaxes.len()
                            ));
                            if let Some(path) = calibration.save_fp8_amaxes {
                                crate::numerics::calibrate::save_fp8_amaxes(path, &amaxes)?;
                                text.push_str(&format!("FP8 amaxes saved to {}\n", path.display()));
                            }
                            if let Some(fp8) = config.fp8.as_mut() {
                                fp8.calibrated = amaxes;
                            }
                        }
                        let wide = crate::numerics::calibrate::outputs_on(g, &feeds)?;
                        Some((wide, feeds))
                    }
                    None => None,
                };
                let amp_report = AutoMixedPrecision::new(config.clone()).rewrite(g)?;
                log::info!("{}", amp_report.summary());
                text.push_str(&amp_report.detailed());
                // What calibration could not keep wide: the samples' outputs checked.
                if let Some((wide, feeds)) = calibrated {
                    for u in crate::numerics::calibrate::underflows(&wide, g, &feeds)? {
                        log::warn!("{u}");
                        text.push_str(&format!("Warning: {u}\n"));
                    }
                }
            }
            other => {
                let mut manager = registry_passes(&[other])?;
                manager.validate = true;
                for record in manager.run(g)? {
                    text.push_str(&record.summary.to_string());
                }
            }
        }
    }
    Ok(text)
}

/// `rewrite --calibrate SAMPLES`: runs `g` in f32 on the samples, keeps under `config`
/// the nodes whose values do not fit its target (saving them to `save` where given),
/// and returns what `--report` says of it with the samples' feeds.
fn calibrate_amp(
    g: &Graph,
    samples: &str,
    config: &mut AmpConfig,
    save: Option<&Path>,
) -> Result<(String, Vec<ampgraph_exec::Feeds>)> {
    use crate::numerics::calibrate::{calibrate, save_overrides, DEFAULT_MARGIN};
    let feeds = match samples.strip_prefix("seed:") {
        Some(n) => {
            let n: u64 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                CliError::Usage(format!(
                    "--calibrate {samples}: seed:N needs a number of samples N >= 1"
                ))
            })?;
            (0..n)
                .map(|seed| make_feeds(g, seed, None))
                .collect::<Result<Vec<_>>>()?
        }
        None => vec![make_feeds(g, 0, Some(samples))?],
    };
    let calibration = calibrate(g, &feeds)?;
    let kept = calibration.apply(config, DEFAULT_MARGIN);
    let mut text = format!(
        "Calibration: {} sample(s) in f32; nodes kept in f32 by their observed range: {}\n",
        calibration.samples(),
        kept.len()
    );
    for (node, why) in &kept {
        text.push_str(&format!("  {node}: {why}\n"));
    }
    let nonfinite = calibration.nonfinite();
    if !nonfinite.is_empty() {
        // Already NaN or infinite in f32: no precision choice fixes these.
        text.push_str(&format!(
            "Nodes with non-finite values already in f32 (not kept for it): {}\n",
            nonfinite.join(", ")
        ));
    }
    if let Some(path) = save {
        save_overrides(path, &kept)?;
        text.push_str(&format!("Overrides saved to {}\n", path.display()));
    }
    log::info!("calibration kept {} node(s) in f32", kept.len());
    Ok((text, feeds))
}

/// Feeds from the file where given, seeded values for every other Placeholder and Variable.
fn make_feeds(g: &Graph, seed: u64, given: Option<&str>) -> Result<Feeds> {
    let mut feeds = match given {
        Some(text) if text.trim_start().starts_with('{') => parse_feeds(g, "--feeds", text)?,
        Some(file) => {
            let text = std::fs::read_to_string(file).map_err(io_err(file))?;
            parse_feeds(g, file, &text)?
        }
        None => HashMap::new(),
    };
    seed_missing(g, seed, &mut feeds, |n| {
        n.op.is::<Placeholder>() || n.op.is::<Variable>()
    })?;
    Ok(feeds)
}

/// Gives each node `take` accepts that `feeds` lacks its seeded value (`run --seed`'s),
/// after checking that they all fit the host's available memory (before any is made).
fn seed_missing(
    g: &Graph,
    seed: u64,
    feeds: &mut Feeds,
    take: impl Fn(&ampgraph_graph::Node) -> bool,
) -> Result<()> {
    let missing: Vec<&ampgraph_graph::Node> = (g.node_ids())
        .map(|id| g.node(id))
        .filter(|n| take(n) && !feeds.contains_key(&n.name))
        .collect();
    for n in &missing {
        check_tensor_size(
            &n.name,
            n.op.name(),
            &n.outputs()[0],
            DEFAULT_MAX_TENSOR_BYTES,
        )?;
    }
    let bytes = |n: &ampgraph_graph::Node| n.outputs()[0].size_bytes();
    let total: usize = missing.iter().map(|n| bytes(n)).sum();
    if let Some(available) = host_memory::available_bytes().filter(|&a| total > a) {
        let largest = missing
            .iter()
            .max_by_key(|n| bytes(n))
            .map_or(String::new(), |n| {
                format!(" (the largest: '{}' {})", n.name, n.outputs()[0])
            });
        return Err(ExecError::Memory(format!(
            "the seeded feeds take {:.1} MiB{largest} but the host has {:.1} MiB available: \
             feed smaller values with --feeds, or run on a larger machine",
            memory_plan::mib(total),
            memory_plan::mib(available)
        ))
        .into());
    }
    for n in missing {
        feeds.insert(
            n.name.clone(),
            seeded_tensor(&n.name, &n.outputs()[0], seed),
        );
    }
    Ok(())
}

/// The feeds of `text` (JSON, from `shown`: a file or `--feeds`): each names a
/// Placeholder or Variable and holds values its dtype can.
fn parse_feeds(g: &Graph, shown: &str, text: &str) -> Result<Feeds> {
    let v = format::json_value(text.as_bytes())
        .map_err(|e| CliError::Usage(format!("{shown}: not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| {
        CliError::Usage(format!(
            "{shown}: feeds must be a JSON object of name -> values"
        ))
    })?;
    let mut feeds = Feeds::new();
    for (name, value) in obj {
        let feed_err = |msg: String| ExecError::Feed {
            name: name.clone(),
            msg,
        };
        let id = g
            .find(name)
            .ok_or_else(|| feed_err("no node of this name in the graph".into()))?;
        let node = g.node(id);
        if !(node.op.is::<Placeholder>() || node.op.is::<Variable>()) {
            return Err(feed_err(format!(
                "is a {} node: only Placeholders and Variables take values",
                node.op.name()
            ))
            .into());
        }
        let want = node.outputs()[0].clone();
        let (shape, values) = match value {
            Value::Object(o) => {
                let shape = o
                    .get("shape")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .map(|d| d.as_u64().map(|d| d as usize))
                            .collect::<Option<Vec<_>>>()
                    })
                    .unwrap_or(Some(want.shape.clone()))
                    .ok_or_else(|| {
                        feed_err("'shape' must be a list of non-negative integers".into())
                    })?;
                let mut flat = Vec::new();
                flatten(
                    o.get("values").unwrap_or(&Value::Null),
                    &mut Vec::new(),
                    0,
                    &mut flat,
                )
                .map_err(feed_err)?;
                (shape, flat)
            }
            nested => {
                let mut shape = Vec::new();
                let mut flat = Vec::new();
                flatten(nested, &mut shape, 0, &mut flat).map_err(feed_err)?;
                (shape, flat)
            }
        };
        if let Some((i, v)) = values
            .iter()
            .enumerate()
            .find(|(_, &v)| !holds(want.dtype, v))
        {
            return Err(feed_err(format!(
                "value {v:?} (index {i}) does not fit {}",
                want.dtype
            ))
            .into());
        }
        let t = Tensor::new(shape, Data::from_f64(want.dtype, values)).map_err(feed_err)?;
        feeds.insert(name.clone(), t);
    }
    Ok(feeds)
}

/// Whether `dtype` holds `v`: a float type without overflowing to infinity, an
/// integer type exactly, a bool as 0 or 1.
fn holds(dtype: DType, v: f64) -> bool {
    match dtype {
        DType::F64 => v.is_finite(),
        DType::F32 => (v as f32).is_finite(),
        DType::F16 => f16_from_f64(v).is_finite(),
        DType::BF16 => bf16_from_f64(v).is_finite(),
        DType::I32 => v.fract() == 0.0 && v >= i32::MIN as f64 && v <= i32::MAX as f64,
        // 2^63 itself is one past i64::MAX.
        DType::I64 => v.fract() == 0.0 && v >= -(2f64.powi(63)) && v < 2f64.powi(63),
        DType::Bool => v == 0.0 || v == 1.0,
        // Stores to FP8 saturate: a value past the largest is not held.
        DType::F8E4M3 => v.abs() <= f64::from(F8E4M3::FORMAT.max()),
        DType::F8E5M2 => v.abs() <= f64::from(F8E5M2::FORMAT.max()),
    }
}

/// Flattens nested JSON lists of numbers, recording the shape and checking it is regular.
fn flatten(
    v: &Value,
    shape: &mut Vec<usize>,
    depth: usize,
    out: &mut Vec<f64>,
) -> std::result::Result<(), String> {
    match v {
        Value::Number(n) => {
            if depth != shape.len() {
                return Err("ragged nested lists".into());
            }
            out.push(n.as_f64().ok_or("number out of range")?);
            Ok(())
        }
        Value::Bool(b) => {
            out.push(if *b { 1.0 } else { 0.0 });
            Ok(())
        }
        Value::Array(items) => {
            if depth == shape.len() {
                shape.push(items.len());
            } else if shape.get(depth) != Some(&items.len()) {
                return Err("ragged nested lists".into());
            }
            items
                .iter()
                .try_for_each(|x| flatten(x, shape, depth + 1, out))
        }
        _ => Err("values must be numbers or nested lists of numbers".into()),
    }
}

fn json_number(x: f64) -> Value {
    if x.is_finite() {
        Value::from(x)
    } else {
        Value::from(if x.is_nan() {
            "nan"
        } else if x > 0.0 {
            "inf"
        } else {
            "-inf"
        })
    }
}

/// Up to this many values are printed in full in text mode; longer tensors show a summary.
const TEXT_VALUES: usize = 64;

/// Prints the outputs as they stream from the tensors, through a buffer of bounded
/// size (no copy of a tensor's values): text shows the first [`TEXT_VALUES`] values of
/// each and a summary of the rest; JSON every value.
fn print_outputs(g: &Graph, outputs: &[Tensor], json: bool, out: &mut dyn Write) -> Result<()> {
    let names: Vec<String> = g.outputs().iter().map(|&p| g.port_name(p)).collect();
    let mut out = std::io::BufWriter::new(out);
    let written = if json {
        write_json_outputs(&names, outputs, &mut out)
    } else {
        names
            .iter()
            .zip(outputs)
            .try_for_each(|(name, t)| write_text_output(name, t, &mut out))
    };
    written
        .and_then(|()| out.flush())
        .map_err(io_err("<stdout>"))
}

/// `{"outputs":[{"dtype":..,"name":..,"shape":..,"values":[..]}, ..]}` and a newline,
/// non-finite values as the strings `nan`, `inf` and `-inf`.
fn write_json_outputs(
    names: &[String],
    outputs: &[Tensor],
    out: &mut dyn Write,
) -> std::io::Result<()> {
    out.write_all(b"{\"outputs\":[")?;
    for (k, (name, t)) in names.iter().zip(outputs).enumerate() {
        let head =
            serde_json::json!({"dtype": t.dtype().as_str(), "name": name, "shape": t.shape()});
        let head = head.to_string();
        // The object without its closing brace, then the values.
        let open = head.strip_suffix('}').unwrap_or(&head);
        write!(out, "{}{open},\"values\":[", if k > 0 { "," } else { "" })?;
        for (i, x) in t.data().iter_f64().enumerate() {
            if i > 0 {
                out.write_all(b",")?;
            }
            serde_json::to_writer(&mut *out, &json_number(x))?;
        }
        out.write_all(b"]}")?;
    }
    out.write_all(b"]}\n")
}

/// `x` for a person: six decimals, or six significant digits in scientific notation
/// where decimals would hide it (1e-10 is not `0.000000`, nor 3e12 thirteen digits).
fn readable(x: f64) -> String {
    match x.abs() {
        a if a == 0.0 || !a.is_finite() || (1e-4..1e9).contains(&a) => format!("{x:.6}"),
        _ => format!("{x:.5e}"),
    }
}

/// `name: type`, then the first values and, for a longer tensor, how many values there
/// are, how many are NaN or infinite, and the finite ones' range and mean.
fn write_text_output(name: &str, t: &Tensor, out: &mut dyn Write) -> std::io::Result<()> {
    write!(out, "{name}: {}\n  [", t.ty())?;
    let (mut nan, mut inf) = (0usize, 0usize);
    let (mut min, mut max, mut sum) = (f64::INFINITY, f64::NEG_INFINITY, 0.0);
    for (i, x) in t.data().iter_f64().enumerate() {
        if i < TEXT_VALUES {
            write!(out, "{}{}", if i > 0 { ", " } else { "" }, readable(x))?;
        }
        if x.is_nan() {
            nan += 1;
        } else if x.is_infinite() {
            inf += 1;
        } else {
            (min, max, sum) = (min.min(x), max.max(x), sum + x);
        }
    }
    let count = t.len();
    let finite = count - nan - inf;
    if count <= TEXT_VALUES {
        return out.write_all(b"]\n");
    }
    write!(out, ", ...] ({count} values")?;
    for (n, what) in [(nan, "NaN"), (inf, "infinite")] {
        if n > 0 {
            write!(out, ", {n} {what}")?;
        }
    }
    match finite {
        0 => out.write_all(b", none finite)\n"),
        _ => writeln!(
            out,
            "; finite: min {}, max {}, mean {})",
            readable(min),
            readable(max),
            readable(sum / finite as f64)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_values_read_as_themselves() {
        assert_eq!(readable(0.0), "0.000000");
        assert_eq!(readable(-1.5), "-1.500000");
        assert_eq!(readable(1e-10), "1.00000e-10");
        assert_eq!(readable(-2.5e-7), "-2.50000e-7");
        assert_eq!(readable(3e12), "3.00000e12");
        assert_eq!(readable(f64::NAN), "NaN");
        assert_eq!(readable(f64::NEG_INFINITY), "-inf");
    }

    fn run_args(extra: &[&str]) -> std::result::Result<ExecutorArgs, clap::Error> {
        let args = ["ampgraph", "run", "g.json"].iter().chain(extra);
        match Cli::try_parse_from(args)?.command {
            Command::Run { executor, .. } => Ok(executor),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn run_flags_set_the_session_options() {
        let plain = run_args(&[]).unwrap().session_options();
        assert_eq!(plain.executor, ExecOptions::default());
        assert_eq!(plain.kernel_cache, KernelCache::FromEnv);
        let set = run_args(&[
            "--allow-tf32",
            "--allow-fp16-reduced-precision-reduction",
            "--deterministic-convolutions",
            "--kernel-cache",
            "/tmp/kernels",
        ])
        .unwrap()
        .session_options();
        assert!(set.executor.gemm.allow_tf32);
        assert!(set.executor.gemm.allow_fp16_reduced_precision_reduction);
        assert!(set.executor.conv.deterministic);
        assert_eq!(set.kernel_cache, KernelCache::Dir("/tmp/kernels".into()));
        let off = run_args(&["--kernel-cache", "off"]).unwrap();
        assert_eq!(off.session_options().kernel_cache, KernelCache::Off);
        assert!(run_args(&["--kernel-cache", ""]).is_err());
    }
}

#[cfg(test)]
mod error_line_tests {
    use super::{error_line, MOST_ERROR_CHARS};

    #[test]
    fn error_lines_are_one_bounded_line_with_control_characters_escaped() {
        assert_eq!(
            error_line("node 'a\u{1b}[31mred\u{7}' (Add):\nbad\tinput"),
            "node 'a\\u{1b}[31mred\\u{7}' (Add): bad input"
        );
        let long = "x".repeat(MOST_ERROR_CHARS + 1234);
        let line = error_line(&long);
        assert!(
            line.ends_with(" ... (1234 more characters)"),
            "{}",
            &line[MOST_ERROR_CHARS..]
        );
        assert_eq!(line.chars().filter(|&c| c == 'x').count(), MOST_ERROR_CHARS);
        assert_eq!(error_line("fine"), "fine");
    }
}
