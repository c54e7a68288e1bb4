//! The reference workloads of `../shared/bench/torch_anchor.py` (`mlp`, `transformer`,
//! `convnet`), timed as a training step and as an inference forward pass in fp32, tf32,
//! AMP fp16 and AMP bf16, printed in torch_anchor.py's format so the two tables paste
//! side by side; or, with `--max-batch-under-mib N`, the largest batch each mode's
//! planned step fits in N MiB.
//!
//! ```sh
//! cargo run --release --example bench -- --workload mlp
//! cargo run --release --example bench -- --workload transformer --modes amp_fp16 --phases train
//! cargo run --release --example bench -- --workload mlp --device cpu --batch 8 --hidden 32 --din 16 --classes 10
//! cargo run --release --example bench -- --workload convnet --device cpu --batch 2 --hw 8 --width 4
//! cargo run --release --example bench -- --workload convnet --max-batch-under-mib 8192
//! ```
//!
//! Every dimension is a flag whose default is torch_anchor.py's size:
//!
//! - `mlp`: x[8192,1024] -> 4 x (Linear 4096 + GELU) -> Linear 1000, cross-entropy on
//!   integer labels [8192].
//! - `transformer`: x[16,512,768] -> 4 pre-LN blocks (LayerNorm, one d -> 3d q/k/v
//!   Linear sliced into q, k and v as torch splits it, 12 heads, explicit attention
//!   `softmax(QK^T / sqrt(d_head)) @ V`, output projection, residual; LayerNorm, Linear 4d + GELU, Linear d, residual) -> LayerNorm
//!   -> Linear 1000 on every token; cross-entropy over the [16*512, 1000] logits against
//!   integer labels [16*512].
//! - `convnet`: x[256,3,64,64] in NCHW, PyTorch's layout (`--batch`, `--hw`) -> 8 x
//!   (Conv2D 3x3 without bias + BatchNorm + Relu) with widths c,c,2c,2c,4c,4c,8c,8c
//!   (`--width` c = 64) and strides 1,1,2,1,2,1,2,1 -> the mean over H and W -> Linear
//!   10 (`--classes`), cross-entropy on integer labels [256]. The convolutions pad
//!   explicitly 1 on every side, PyTorch's `padding=1`: the same windows as PyTorch's
//!   at every stride (TensorFlow's SAME would pad (0, 1) at stride 2). The batch norms
//!   (epsilon 1e-5) normalise with the batch's statistics in the train step, which
//!   also assigns their running mean and variance as PyTorch updates them (momentum
//!   0.1, the unbiased batch variance); the inference graph reads those. torch_anchor.py
//!   runs PyTorch's in channels-last memory except in fp32; the graph is NCHW for the
//!   CUDA pipeline's layout pass to convert. No TFLOP/s (torch_anchor.py has no FLOP
//!   count for it either).
//!
//! A train step is forward, loss, backward and the SGD-momentum update (lr 1e-3,
//! momentum 0.9; AdamW, lr 3e-4 and decay 0.01, for the zoo's transformers as their
//! PyTorch peers), all in one graph; the AMP modes wrap the optimizer with
//! [`enable_mixed_precision_graph_rewrite`] (dynamic loss scaling in the graph for fp16;
//! none in bf16, `LossScale::None`, where PyTorch turns its GradScaler off). Inference is the forward pass of a
//! graph pruned to the logits, as [`ampgraph::Session::inference`] prunes it. Modes:
//! `fp32` (TF32 off), `tf32` (f32 GEMMs on TF32 Tensor Cores), `amp_fp16`, `amp_bf16`,
//! `amp_fp8` (BF16 AMP with FP8 products where the cost model says they pay).
//!
//! Timing: CUDA events recorded on the executor's stream before and after each step
//! (`CudaExecutor::run_timed`), as torch_anchor.py times PyTorch's. A step is one `run`,
//! which returns after the stream has synchronised (it downloads the fetched value: the
//! step's 1-byte `Group` flag); where the GPU waits for the host's scheduling and
//! launches, the events count that wait, as they do for PyTorch's eager step. The median
//! of `--iters` after `--warmup`. On the CPU: the wall clock around each step.
//!
//! Initial values (`--init torch`, the default): the Linear and convolution layers
//! start as torch's `nn.Linear` and `nn.Conv2d` do (kernel and bias uniform in
//! ±1/sqrt(fan_in)), not from the graph's Keras-style initialisers, so the GEMMs see
//! the same value distributions as PyTorch's (under the GPU's power limit a GEMM's
//! speed depends on its operands). Batch norms start as PyTorch's (scale ones, offset
//! zeros, running mean zeros, running variance ones).
//!
//! Power: an H100 holds its boost clock for the first 100 ms or so of a dense
//! training loop, then its 700 W limit lowers the clock; a run of 30 steps of a few
//! milliseconds straddles that point (`--print-times` shows it), so medians move by a
//! few percent between runs. Past that point a step's energy sets its time: where
//! the timed steps take a second or more (`--iters 300`), the record carries the
//! joules a step took and the mean watts (NVML's energy counter, host time between
//! steps included); `scripts/energy.py` measures PyTorch's the same way beside ours.
//!
//! Feeds: x and the labels are generated once on the host (normal x, uniform labels).
//! With `--feeds resident` (the default) they are uploaded once and stay on the device,
//! as torch_anchor.py's tensors do: after the training graph is built they become
//! non-trainable Variables. `--feeds upload` feeds them as Placeholders, uploaded
//! every step (the header says which).
//!
//! Peak memory: the executor's device pool high-water mark over the timed steps
//! (bytes of live tensors, variables included; reset after the warm-up), like
//! `torch.cuda.max_memory_allocated` after torch_anchor.py's
//! `reset_peak_memory_stats`. Beside it, from the memory plan made on the host
//! ([`step_footprint`], as `ampgraph plan` prints it): `planned_arena_mib`, the arena
//! of the step's computed tensors as the CUDA executor plans it (the 16-bit casts it
//! keeps between steps outside it), and `planned_peak_mib`, that arena with everything
//! beside it: every variable (weights, optimizer slots, loss-scale state, resident
//! inputs), the casts kept, fed inputs, constants, and the variables' next values that
//! updates do not write in place (the first step holds a kept cast beside its f32
//! variable, so both count). Neither counts the GEMM library's workspace.
//!
//! Largest batch (`--max-batch-under-mib N`): for each mode and phase, the largest
//! batch whose `planned_peak_mib` is at most N MiB, found by doubling the batch from 1
//! and then bisecting; each candidate's graph is built and goes through the same passes
//! as a timed run, and is planned on the host. That plan cannot know cuDNN's
//! workspaces, which autotuning picks on the device: with `--device cpu` it is the
//! answer (no device needed); on the GPU the search goes on down from it, each batch
//! run for two steps on a fresh executor and planned again with the workspaces the
//! step took and the GEMM library's, the device's measured peak beside the plan
//! (`fit.rs`). One JSON line per mode and phase with the batch, its plan's parts, the
//! next batch's peak and the measured peak, and for the AMP modes `batch_vs_fp32`,
//! their batch over fp32's; then a table.
//!
//! The graph goes through the session's [`Pipeline`] (AMP for a marked graph, then the
//! passes after it) and runs on the executor [`Device::executor`] makes, through the
//! [`Executor`](ampgraph::exec::Executor) trait (timing, peak memory, launch counts and
//! the profile included), as in a `Session`; but the passes run once, on a graph whose
//! outputs are the step's flag and the loss: the step computes the loss, as PyTorch's
//! does, while downloading one byte (a session's copy per set of fetches would drop
//! what is not fetched). `--allow-tf32`, `--allow-fp16-reduced-precision-reduction` and
//! `--kernel-cache DIR|off` are `ampgraph run`'s executor flags (the `tf32` mode turns
//! TF32 on by itself).
//!
//! Without CUDA the example says so and exits 0; `--device cpu` runs the same graphs on
//! the CPU executor (use tiny sizes).

use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};

use ampgraph::cli::{passes_after_amp, ExecutorArgs};
use ampgraph::exec::cuda::{self, LaunchCounts};
use ampgraph::exec::feeds::{initial_value, seeded_tensor};
use ampgraph::exec::memory_plan::{mib, step_footprint};
use ampgraph::exec::{ExecOptions, Executor, Feeds};
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::{Group, Init, Slice, Variable};
use ampgraph::graph::rng::SplitMix64;
use ampgraph::graph::{DType, Data, Graph, Port, Tensor, TensorType};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Adam, LossScale, Optimizer, Sgd};
use ampgraph::passes::amp::AmpConfig;
use ampgraph::passes::sync_batch_norm::SyncBatchNorm;
use ampgraph::passes::{Pass, PassRecord};
use ampgraph::session::Pipeline;
use ampgraph::{Device, SessionOptions};

use ampgraph::graph::models::bert::{self, BertConfig};
use ampgraph::graph::models::gpt2::{self, Gpt2Config};
use ampgraph::graph::models::resnet::{self, ResNetConfig};
use ampgraph::graph::models::vit::{self, VitConfig};
use ampgraph::graph::models::{convnet, f32_variable};
mod energy;
mod fit;
mod replicas;
#[cfg(test)]
mod tests;

use energy::EnergyCounter;

type Res<T> = Result<T, Box<dyn Error>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Mlp,
    Transformer,
    Convnet,
    /// torchvision's ResNet-50 (224x224 images, 1000 classes).
    Resnet50,
    /// torchvision's ViT-B/16 (224x224 images, 1000 classes).
    #[value(name = "vit_b_16")]
    VitB16,
    /// GPT-2 124M, next-token loss on every position.
    Gpt2,
    /// BERT-base with its masked-LM head, the loss on every position.
    #[value(name = "bert_base")]
    BertBase,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp",
            Workload::Transformer => "transformer",
            Workload::Convnet => "convnet",
            Workload::Resnet50 => "resnet50",
            Workload::VitB16 => "vit_b_16",
            Workload::Gpt2 => "gpt2",
            Workload::BertBase => "bert_base",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    Cuda,
    Cpu,
}

impl DeviceArg {
    fn device(self, ordinal: usize) -> Device {
        match self {
            DeviceArg::Cuda => Device::Cuda(ordinal),
            DeviceArg::Cpu => Device::Cpu,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FeedMode {
    /// Uploaded once; they stay on the device (as in torch_anchor.py).
    Resident,
    /// Fed as Placeholders and uploaded every step.
    Upload,
}

#[derive(Parser, Debug)]
#[command(about = "Time torch_anchor.py's workloads on ampgraph (train step and inference)")]
struct Args {
    /// Which of torch_anchor.py's models to time.
    #[arg(long, value_enum, default_value = "mlp")]
    workload: Workload,
    /// Batch size (mlp 8192, transformer 16, convnet 256).
    #[arg(long)]
    batch: Option<usize>,
    /// mlp: input features (1024).
    #[arg(long)]
    din: Option<usize>,
    /// mlp: hidden width (4096).
    #[arg(long)]
    hidden: Option<usize>,
    /// mlp: hidden layers; transformer: blocks (4).
    #[arg(long)]
    layers: Option<usize>,
    /// mlp: the hidden layers' activation (torch_anchor.py's is the exact GELU).
    #[arg(long, value_enum, default_value = "gelu")]
    activation: ActivationArg,
    /// transformer: sequence length (512).
    #[arg(long)]
    seq: Option<usize>,
    /// transformer: attention heads (12).
    #[arg(long)]
    heads: Option<usize>,
    /// transformer: model width (768).
    #[arg(long)]
    dmodel: Option<usize>,
    /// transformer: causal attention, a mask added to the scores before the softmax
    /// (torch_anchor.py's attention has none). `fuse-attention` makes the fused
    /// attention causal; without that pass, `softmax-prologue` gives the softmax the
    /// masked scores.
    #[arg(long)]
    causal: bool,
    /// transformer: a key padding mask `[batch, 1, 1, seq]` added to the scores (batch
    /// element i pads its last i * seq / (2 * batch) keys with -inf), as
    /// `scripts/torch_causal.py --padding` does PyTorch's; `fuse-attention` makes it
    /// the fused attention's key bias.
    #[arg(long)]
    key_padding: bool,
    /// convnet: the first layers' channels, c in widths c,c,2c,2c,4c,4c,8c,8c (64).
    #[arg(long)]
    width: Option<usize>,
    /// convnet: the images' height and width (64).
    #[arg(long)]
    hw: Option<usize>,
    /// Output classes (mlp and transformer 1000, convnet 10).
    #[arg(long)]
    classes: Option<usize>,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 30)]
    iters: usize,
    /// Untimed steps first (torch_anchor.py's 8: both sides time the same stretch of
    /// steps).
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// Print every timed step's time in order (the power limiter shows as a step up
    /// after the first 100 ms or so of sustained load).
    #[arg(long)]
    print_times: bool,
    /// Comma-separated: fp32, tf32, amp_fp16, amp_bf16, amp_fp8 (BF16 AMP with FP8
    /// products where they pay).
    #[arg(long, default_value = "fp32,tf32,amp_fp16,amp_bf16")]
    modes: String,
    /// Comma-separated: train, infer.
    #[arg(long, default_value = "train,infer")]
    phases: String,
    /// Where to run (the CPU for host-only work such as --max-batch-under-mib).
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceArg,
    /// How the inputs reach the step.
    #[arg(long, value_enum, default_value = "resident")]
    feeds: FeedMode,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Seed of the variables' initial values and of the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// After timing, run this many more steps timing every op with CUDA events and
    /// print where the time goes, per kind of op (CUDA only).
    #[arg(long, default_value_t = 0)]
    profile: usize,
    /// The passes run after AMP, comma-separated registry names, or `none`
    /// (default: the CUDA pipeline, `exec::cuda::pipeline`, on either device; with
    /// TF32, as in the tf32 mode, its layout pass converts f32 graphs too).
    #[arg(long, value_delimiter = ',')]
    passes: Option<Vec<String>>,
    /// Build each graph, run the passes and print what each did; run no step (no
    /// device needed).
    #[arg(long)]
    passes_only: bool,
    /// With --passes-only: how many of the largest tensors alive at the planned peak
    /// to list.
    #[arg(long, default_value_t = 12)]
    peak_top: usize,
    /// gpt2, bert_base: the dropout after the embeddings and each sublayer (Hugging
    /// Face's configs: 0.1; llm.c's GPT-2: none).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// gpt2, bert_base: the dropout on attention's probabilities (Hugging Face's
    /// configs: 0.1; `scripts/torch_zoo_train.py --attention-dropout` matches it),
    /// fused with the attention's kernels.
    #[arg(long, default_value_t = 0.0)]
    attention_dropout: f64,
    /// Initial values of the Linear layers: `torch` (nn.Linear's defaults, as
    /// torch_anchor.py's model starts) or `keras` (the graph's own initialisers:
    /// Glorot-uniform kernels, zero biases).
    #[arg(long, value_enum, default_value = "torch")]
    init: InitStyle,
    /// Write each graph after the passes (also with --passes-only) to DIR/<workload>-<phase>-<mode>.txt.
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
    /// For each mode and phase, find the largest batch whose planned step (the
    /// memory plan's arena, the variables, casts kept and inputs beside it) fits this
    /// many MiB, after the same passes as a timed run: with `--device cpu` planned on
    /// the host alone; on the GPU each candidate also runs two steps and is planned
    /// with the workspaces they took. The other sizes are the flags' (the batch's is
    /// ignored).
    #[arg(long, value_name = "MIB")]
    max_batch_under_mib: Option<f64>,
    /// Train data-parallel over GPUs 0..N (NCCL), each on a batch of the workload's
    /// size, and print one JSON line per mode (`scripts/torch_ddp.py` is PyTorch DDP's).
    #[arg(long, value_name = "N")]
    replicas: Option<usize>,
    /// With --replicas: batch statistics over the global batch (SyncBatchNorm).
    #[arg(long)]
    sync_batch_norm: bool,
    /// With --replicas: the gradient buckets' size (PyTorch DDP's `bucket_cap_mb`).
    #[arg(long, value_name = "MIB", default_value_t = 25.0)]
    bucket_mib: f64,
    /// amp_fp8: every 16-bit product the GPU runs in FP8 (no cost model, first and
    /// last layers too), to time what the cost model would keep.
    #[arg(long)]
    fp8_everywhere: bool,
    /// amp_fp8: every 16-bit product the GPU runs in FP8 but the first and last
    /// layers' (no cost model), to time the cost model's choice against.
    #[arg(long, conflicts_with = "fp8_everywhere")]
    fp8_without_cost_model: bool,
    #[command(flatten)]
    executor: ExecutorArgs,
}

impl Args {
    /// The session options of a run in `mode`: the executor's switches and the passes
    /// run after AMP (`--passes`, else the CUDA pipeline for those switches).
    fn session_options(&self, mode: Mode) -> Res<SessionOptions> {
        let mut options = self.executor.session_options();
        options.executor.gemm.allow_tf32 |= mode == Mode::Tf32;
        options.passes = Some(self.pipeline(&options.executor));
        if self.fp8_everywhere && mode == Mode::AmpFp8 {
            let config = AmpConfig::new(DType::F8E4M3)?.from_env()?;
            options.amp = Some(config.on_every_device_product());
        }
        if self.fp8_without_cost_model && mode == Mode::AmpFp8 {
            let mut config = AmpConfig::new(DType::F8E4M3)?.from_env()?;
            if let Some(fp8) = &mut config.fp8 {
                fp8.cost = None;
            }
            options.amp = Some(config);
        }
        Ok(options)
    }

    /// The names of the passes run after AMP with the executor's `switches`.
    fn pipeline(&self, switches: &ExecOptions) -> Vec<String> {
        passes_after_amp(self.passes.as_deref()).unwrap_or_else(|| {
            let names = cuda::pipeline_names(switches);
            names.iter().map(|s| s.to_string()).collect()
        })
    }
}

/// The sizes of one workload, each from its flag or torch_anchor.py's default.
#[derive(Clone, Copy, Debug)]
enum Config {
    Mlp {
        batch: usize,
        d_in: usize,
        hidden: usize,
        depth: usize,
        classes: usize,
        activation: Activation,
    },
    Transformer {
        batch: usize,
        seq: usize,
        d: usize,
        heads: usize,
        layers: usize,
        classes: usize,
        causal: bool,
        key_padding: bool,
    },
    Convnet {
        batch: usize,
        hw: usize,
        width: usize,
        classes: usize,
    },
    /// A model of the zoo (`graph::models`) at its reference size; `seq` tokens a
    /// sequence for the language models.
    Zoo {
        model: Workload,
        batch: usize,
        seq: usize,
        /// GPT-2's and BERT's dropout after the embeddings and each sublayer, and
        /// on attention's probabilities.
        dropout: (f64, f64),
    },
}

impl Config {
    fn from_args(a: &Args) -> Res<Config> {
        let c = match a.workload {
            Workload::Mlp => Config::Mlp {
                batch: a.batch.unwrap_or(8192),
                d_in: a.din.unwrap_or(1024),
                hidden: a.hidden.unwrap_or(4096),
                depth: a.layers.unwrap_or(4),
                classes: a.classes.unwrap_or(1000),
                activation: a.activation.layer(),
            },
            Workload::Transformer => {
                let d = a.dmodel.unwrap_or(768);
                let heads = a.heads.unwrap_or(12);
                if heads == 0 || d % heads != 0 {
                    return Err(
                        format!("--dmodel {d} must be a multiple of --heads {heads}").into(),
                    );
                }
                Config::Transformer {
                    batch: a.batch.unwrap_or(16),
                    seq: a.seq.unwrap_or(512),
                    d,
                    heads,
                    layers: a.layers.unwrap_or(4),
                    classes: a.classes.unwrap_or(1000),
                    causal: a.causal,
                    key_padding: a.key_padding,
                }
            }
            Workload::Convnet => Config::Convnet {
                batch: a.batch.unwrap_or(256),
                hw: a.hw.unwrap_or(64),
                width: a.width.unwrap_or(64),
                classes: a.classes.unwrap_or(10),
            },
            // The issues' sizes: ResNet-50 b256, ViT-B/16 b32 (images); GPT-2 b16 x
            // 1024 (llm.c's), BERT b32 x 128.
            model @ (Workload::Resnet50 | Workload::VitB16) => Config::Zoo {
                model,
                batch: a
                    .batch
                    .unwrap_or(if model == Workload::Resnet50 { 256 } else { 32 }),
                seq: 0,
                dropout: (0.0, 0.0),
            },
            Workload::Gpt2 => Config::Zoo {
                model: Workload::Gpt2,
                batch: a.batch.unwrap_or(16),
                seq: a.seq.unwrap_or(1024),
                dropout: (a.dropout, a.attention_dropout),
            },
            Workload::BertBase => Config::Zoo {
                model: Workload::BertBase,
                batch: a.batch.unwrap_or(32),
                seq: a.seq.unwrap_or(128),
                dropout: (a.dropout, a.attention_dropout),
            },
        };
        Ok(c)
    }

    /// The batch size.
    fn batch(&self) -> usize {
        match *self {
            Config::Mlp { batch, .. }
            | Config::Transformer { batch, .. }
            | Config::Convnet { batch, .. }
            | Config::Zoo { batch, .. } => batch,
        }
    }

    /// The same workload at another batch size.
    fn with_batch(mut self, size: usize) -> Config {
        match &mut self {
            Config::Mlp { batch, .. }
            | Config::Transformer { batch, .. }
            | Config::Convnet { batch, .. }
            | Config::Zoo { batch, .. } => *batch = size,
        }
        self
    }

    fn describe(&self) -> String {
        match *self {
            Config::Mlp {
                batch,
                d_in,
                hidden,
                depth,
                classes,
                activation,
            } => format!(
                "x[{batch},{d_in}] -> {depth} x (Linear {hidden} + {activation:?}) -> Linear {classes}, cross-entropy"
            ),
            Config::Transformer {
                batch,
                seq,
                d,
                heads,
                layers,
                classes,
                causal,
                key_padding,
            } => format!(
                "x[{batch},{seq},{d}], {layers} pre-LN blocks ({heads} heads, explicit {}{}softmax attention, MLP 4x GELU), LayerNorm, Linear {classes}",
                if causal { "causal " } else { "" },
                if key_padding { "key-padded " } else { "" }
            ),
            Config::Convnet {
                batch,
                hw,
                width,
                classes,
            } => {
                let (widths, strides): (Vec<String>, Vec<String>) = convnet::LAYERS
                    .iter()
                    .map(|&(times, stride)| ((times * width).to_string(), stride.to_string()))
                    .unzip();
                format!(
                    "x[{batch},3,{hw},{hw}] NCHW -> {} x (Conv 3x3 pad 1, no bias + BatchNorm + ReLU) with widths {} and strides {} -> mean over H,W -> Linear {classes}, cross-entropy",
                    convnet::LAYERS.len(),
                    widths.join(","),
                    strides.join(",")
                )
            }
            Config::Zoo {
                model, batch, seq, ..
            } => match model {
                Workload::Resnet50 => format!(
                    "x[{batch},3,224,224] NCHW -> torchvision's ResNet-50 v1.5, cross-entropy over 1000 classes"
                ),
                Workload::VitB16 => format!(
                    "x[{batch},3,224,224] NCHW -> torchvision's ViT-B/16, cross-entropy over 1000 classes"
                ),
                Workload::Gpt2 => format!(
                    "tokens[{batch},{seq}] -> GPT-2 124M (causal attention, tied head), next-token cross-entropy"
                ),
                _ => format!(
                    "tokens[{batch},{seq}] -> BERT-base with its masked-LM head, cross-entropy on every position"
                ),
            },
        }
    }

    /// torch_anchor.py's `flops_train`: 6 * (2-D parameters) * tokens, plus the
    /// attention products for the transformer; none for the convnet (as there).
    fn flops_train(&self) -> Option<f64> {
        let flops = match *self {
            Config::Mlp {
                batch,
                d_in,
                hidden,
                depth,
                classes,
                ..
            } => {
                let n = if depth == 0 {
                    d_in * classes
                } else {
                    d_in * hidden + (depth - 1) * hidden * hidden + hidden * classes
                };
                6.0 * n as f64 * batch as f64
            }
            Config::Transformer {
                batch,
                seq,
                d,
                layers,
                classes,
                ..
            } => {
                let n = layers * 12 * d * d + d * classes;
                let tok = (batch * seq) as f64;
                let att = 4.0 * batch as f64 * (seq * seq) as f64 * d as f64 * layers as f64;
                6.0 * n as f64 * tok + 3.0 * att
            }
            Config::Convnet { .. } => return None,
            // The language models as the transformer (6 x the matrices' parameters per
            // token, attention's products), plus the head's vocab x width.
            Config::Zoo {
                model, batch, seq, ..
            } => {
                let (layers, d, vocab) = match model {
                    Workload::Gpt2 => (12, 768, 50257),
                    Workload::BertBase => (12, 768, 30522),
                    _ => return None,
                };
                let n = layers * 12 * d * d + d * vocab;
                let tok = (batch * seq) as f64;
                let att = 4.0 * batch as f64 * (seq * seq) as f64 * d as f64 * layers as f64;
                6.0 * n as f64 * tok + 3.0 * att
            }
        };
        Some(flops)
    }

    /// x and labels, generated on the host: x standard normal, labels uniform.
    fn data(&self, seed: u64) -> Res<(Tensor, Tensor)> {
        let (x_shape, n_labels, classes) = match *self {
            Config::Mlp {
                batch,
                d_in,
                classes,
                ..
            } => (vec![batch, d_in], batch, classes),
            Config::Transformer {
                batch,
                seq,
                d,
                classes,
                ..
            } => (vec![batch, seq, d], batch * seq, classes),
            Config::Convnet {
                batch, hw, classes, ..
            } => (vec![batch, 3, hw, hw], batch, classes),
            Config::Zoo {
                model, batch, seq, ..
            } => match model {
                Workload::Gpt2 | Workload::BertBase => {
                    (vec![batch, seq], batch * seq, zoo_classes(model))
                }
                _ => (vec![batch, 3, 224, 224], batch, 1000),
            },
        };
        let mut rng = SplitMix64::new(seed ^ 0xB3_4C_4D_41_52_4B);
        let n: usize = x_shape.iter().product();
        let mut uniform = |m: usize| (rng.next_u64() % m.max(1) as u64) as i64;
        let x = match *self {
            // Token ids, uniform over the vocabulary.
            Config::Zoo {
                model: model @ (Workload::Gpt2 | Workload::BertBase),
                ..
            } => Data::I64((0..n).map(|_| uniform(zoo_classes(model))).collect()),
            _ => Data::F32((0..n).map(|_| standard_normal(&mut rng) as f32).collect()),
        };
        let labels: Vec<i64> = (0..n_labels)
            .map(|_| (rng.next_u64() % classes.max(1) as u64) as i64)
            .collect();
        Ok((
            Tensor::new(x_shape, x)?,
            Tensor::new(vec![n_labels], Data::I64(labels))?,
        ))
    }
}

/// The classes of a zoo language model's loss: its vocabulary.
fn zoo_classes(model: Workload) -> usize {
    if model == Workload::Gpt2 {
        Gpt2Config::GPT2_124M.vocab
    } else {
        BertConfig::BERT_BASE.vocab
    }
}

/// A standard normal value (Box-Muller on uniforms in (0, 1], so the log is finite).
fn standard_normal(rng: &mut SplitMix64) -> f64 {
    let mut unit = || ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let (u, v) = (unit(), unit());
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ActivationArg {
    Gelu,
    Relu,
}

impl ActivationArg {
    fn layer(self) -> Activation {
        match self {
            ActivationArg::Gelu => Activation::Gelu,
            ActivationArg::Relu => Activation::Relu,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum InitStyle {
    Torch,
    Keras,
}

/// With `--init torch`, the initial value of a layer's `<scope>/kernel` (an
/// `nn::dense` kernel `[in, out]`, a convolution's HWIO `[kh, kw, cin, cout]`) or
/// `<scope>/bias`: uniform in ±1/sqrt(fan_in) for both, fan_in the kernel's elements
/// per output (`in`, `kh * kw * cin`), as torch's `nn.Linear` and `nn.Conv2d` start
/// (kaiming-uniform with a = sqrt(5), and their bias rule). The values feed the GEMMs,
/// whose speed under the power cap depends on them, so the comparison with
/// torch_anchor.py starts from the same distributions. None for other variables.
fn torch_value(graph: &Graph, name: &str, ty: &TensorType, args: &Args) -> Option<Res<Tensor>> {
    if args.init != InitStyle::Torch {
        return None;
    }
    let scope = name
        .strip_suffix("/kernel")
        .or_else(|| name.strip_suffix("/bias"))?;
    let kernel = graph.find(&format!("{scope}/kernel"))?;
    let (_, per_output) = graph
        .node(kernel)
        .op
        .downcast_ref::<Variable>()?
        .ty
        .shape
        .split_last()?;
    let fan_in: usize = per_output.iter().product();
    let limit = 1.0 / (fan_in as f64).sqrt();
    let unit = seeded_tensor(name, ty, args.seed).to_f64_vec();
    let values = Data::from_f64(ty.dtype, unit.into_iter().map(|u| u * limit));
    Some(Tensor::new(ty.shape.clone(), values).map_err(Into::into))
}

/// The shortest run of timed steps whose energy the bench reports.
const MIN_ENERGY_SECONDS: f64 = 1.0;

/// The forward graph of a workload: logits and the mean cross-entropy loss.
struct Model {
    graph: Graph,
    logits: Port,
    loss: Port,
    /// In training, the assignments a step makes besides the optimizer's: the batch
    /// norms' running averages.
    running_updates: Vec<Port>,
}

const X: &str = "x";
const LABELS: &str = "labels";

/// The forward graph of `cfg`, its batch norms (if any) in training mode or not.
fn build(cfg: &Config, training: bool) -> Res<Model> {
    let mut g = Graph::new();
    let mut running_updates = Vec::new();
    let (logits, labels) = match *cfg {
        Config::Mlp {
            batch,
            d_in,
            hidden,
            depth,
            classes,
            activation,
        } => {
            let x = g.placeholder(X, DType::F32, [batch, d_in])?;
            let labels = g.placeholder(LABELS, DType::I64, [batch])?;
            let mut h = x;
            for _ in 0..depth {
                h = nn::dense(&mut g, h, hidden, Some(activation))?;
            }
            (nn::dense(&mut g, h, classes, None)?, labels)
        }
        Config::Transformer {
            batch,
            seq,
            d,
            heads,
            layers,
            classes,
            causal,
            key_padding,
        } => {
            let x = g.placeholder(X, DType::F32, [batch, seq, d])?;
            let labels = g.placeholder(LABELS, DType::I64, [batch * seq])?;
            // The residual stream as [b*t, d]: the Linear layers see 2-D inputs.
            let mut h = g.reshape(x, [(batch * seq) as i64, d as i64])?;
            // -inf where a query may not look: above the diagonal (token i attends to
            // tokens 0..=i), on the padded keys.
            let mask = |shape: Vec<usize>, masked: &dyn Fn(usize) -> bool| {
                let values = (0..shape.iter().product())
                    .map(|i| if masked(i) { f32::NEG_INFINITY } else { 0.0 })
                    .collect();
                Tensor::new(shape, Data::F32(values))
            };
            let mut masks = Vec::new();
            if causal {
                let causal = mask(vec![seq, seq], &|i| i % seq > i / seq)?;
                masks.push(g.constant(causal)?);
            }
            if key_padding {
                let kept = |b: usize| seq - b * seq / (2 * batch);
                let padding = mask(vec![batch, 1, 1, seq], &|i| i % seq >= kept(i / seq))?;
                masks.push(g.constant(padding)?);
            }
            for _ in 0..layers {
                h = block(&mut g, h, (batch, seq), d, heads, &masks)?;
            }
            let h = layer_norm(&mut g, h, d)?;
            // Linear on every token; torch's cross_entropy(out.reshape(-1, classes), y).
            (nn::dense(&mut g, h, classes, None)?, labels)
        }
        Config::Convnet {
            batch,
            hw,
            width,
            classes,
        } => {
            let x = g.placeholder(X, DType::F32, [batch, 3, hw, hw])?;
            let labels = g.placeholder(LABELS, DType::I64, [batch])?;
            let net = convnet::build(&mut g, x, width, classes, training)?;
            running_updates = net.running_updates;
            (net.logits, labels)
        }
        Config::Zoo {
            model,
            batch,
            seq,
            dropout: (dropout, attention_dropout),
        } => match model {
            Workload::Gpt2 | Workload::BertBase => {
                let tokens = g.placeholder(X, DType::I64, [batch, seq])?;
                let labels = g.placeholder(LABELS, DType::I64, [batch * seq])?;
                let logits = if model == Workload::Gpt2 {
                    let config = Gpt2Config {
                        dropout,
                        attention_dropout,
                        ..Gpt2Config::GPT2_124M
                    };
                    gpt2::build(&mut g, tokens, &config)?
                } else {
                    let config = BertConfig {
                        dropout,
                        attention_dropout,
                        ..BertConfig::BERT_BASE
                    };
                    bert::build(&mut g, tokens, &config)?
                };
                (logits, labels)
            }
            _ => {
                let x = g.placeholder(X, DType::F32, [batch, 3, 224, 224])?;
                let labels = g.placeholder(LABELS, DType::I64, [batch])?;
                let logits = if model == Workload::Resnet50 {
                    let net = resnet::build(&mut g, x, &ResNetConfig::RESNET50, training)?;
                    running_updates = net.running_updates;
                    net.logits
                } else {
                    vit::build(&mut g, x, &VitConfig::VIT_B_16)?
                };
                (logits, labels)
            }
        },
    };
    let loss = g.softmax_cross_entropy(logits, labels)?;
    Ok(Model {
        graph: g,
        logits,
        loss,
        running_updates,
    })
}

/// torch's `nn.LayerNorm(d)` (epsilon 1e-5, gamma ones, beta zeros) over the last axis.
fn layer_norm(g: &mut Graph, x: Port, d: usize) -> Res<Port> {
    let mut i = 0;
    while g.find(&format!("layer_norm_{i}/gamma")).is_some() {
        i += 1;
    }
    let scope = format!("layer_norm_{i}");
    let gamma = f32_variable(g, format!("{scope}/gamma"), vec![d], Init::Constant(1.0))?;
    let beta = f32_variable(g, format!("{scope}/beta"), vec![d], Init::Zeros)?;
    let axis = g.ty(x).rank() as i64 - 1;
    Ok(g.layer_norm(x, gamma, beta, axis, 1e-5)?)
}

/// torch_anchor.py's `Block.forward` on the residual stream `x [b*t, d]`, with `masks`
/// added to the attention scores.
fn block(
    g: &mut Graph,
    x: Port,
    (b, t): (usize, usize),
    d: usize,
    heads: usize,
    masks: &[Port],
) -> Res<Port> {
    let dh = d / heads;
    let n = b * t;
    let h = layer_norm(g, x, d)?;
    // torch: q, k, v = qkv(h).split(d, dim=-1), one d -> 3 d Linear (`pack-qkv` gives
    // the attention the projection whole, and its gradient writes it packed); each
    // .view(b, t, heads, dh).transpose(1, 2).
    let qkv = nn::dense(g, h, 3 * d, None)?;
    let mut split = Vec::with_capacity(3);
    for from in [0, d, 2 * d] {
        let part = g.add(Slice::new([0, from], [n as i64, d as i64]), &[qkv])?;
        let part = g.reshape(part, [b as i64, t as i64, heads as i64, dh as i64])?;
        split.push(g.transpose(part, [0, 2, 1, 3])?);
    }
    let (q, k, v) = (split[0], split[1], split[2]);
    // att = (q @ k^T) * (1 / sqrt(dh)); softmax; @ v
    let att = g.batch_matmul_adj(q, k, false, true)?;
    let scale = g.scalar(DType::F32, 1.0 / (dh as f64).sqrt())?;
    let mut att = g.mul(att, scale)?;
    for &mask in masks {
        att = g.plus(att, mask)?;
    }
    let att = g.softmax(att, -1)?;
    let y = g.batch_matmul(att, v)?;
    // (att @ v).transpose(1, 2).reshape(b, t, d)
    let y = g.transpose(y, [0, 2, 1, 3])?;
    let y = g.reshape(y, [n as i64, d as i64])?;
    let x = {
        let p = nn::dense(g, y, d, None)?;
        g.plus(x, p)?
    };
    let h = layer_norm(g, x, d)?;
    let h = nn::dense(g, h, 4 * d, Some(Activation::Gelu))?;
    let h = nn::dense(g, h, d, None)?;
    Ok(g.plus(x, h)?)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Fp32,
    Tf32,
    AmpF16,
    AmpBf16,
    /// BF16 AMP with FP8 products where the cost model says they pay.
    AmpFp8,
}

impl Mode {
    fn parse(s: &str) -> Res<Mode> {
        Ok(match s {
            "fp32" => Mode::Fp32,
            "tf32" => Mode::Tf32,
            "amp_fp16" => Mode::AmpF16,
            "amp_bf16" => Mode::AmpBf16,
            "amp_fp8" => Mode::AmpFp8,
            other => {
                return Err(format!(
                    "unknown mode '{other}' (fp32, tf32, amp_fp16, amp_bf16, amp_fp8)"
                )
                .into())
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Fp32 => "fp32",
            Mode::Tf32 => "tf32",
            Mode::AmpF16 => "amp_fp16",
            Mode::AmpBf16 => "amp_bf16",
            Mode::AmpFp8 => "amp_fp8",
        }
    }

    fn amp(self) -> Option<DType> {
        match self {
            Mode::AmpF16 => Some(DType::F16),
            Mode::AmpBf16 => Some(DType::BF16),
            Mode::AmpFp8 => Some(DType::F8E4M3),
            _ => None,
        }
    }
}

struct Record {
    workload: &'static str,
    mode: &'static str,
    phase: &'static str,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    peak_mib: Option<f64>,
    /// The memory plan's arena for the step's computed tensors (variables apart).
    planned_mib: f64,
    /// The planned peak: the arena and what lives beside it (`StepFootprint`).
    planned_peak_mib: f64,
    /// What one step puts on the stream (CUDA only).
    launches: Option<LaunchCounts>,
    tflops: Option<f64>,
    loss: Option<f64>,
    /// Joules a timed step took and the mean watts over the timed steps (NVML).
    joules: Option<(f64, f64)>,
}

/// Python's `round(v, n)` as `print` writes it (shortest form, at least one decimal).
fn py(v: f64, digits: i32) -> String {
    let p = 10f64.powi(digits);
    let r = (v * p).round() / p;
    let s = format!("{r}");
    if s.contains('.') || s.contains('e') || !r.is_finite() {
        s
    } else {
        format!("{s}.0")
    }
}

/// The JSON line of a mode and phase that failed, as torch_anchor.py prints one.
fn error_line(args: &Args, mode: Mode, infer: bool, e: &dyn Error) -> String {
    format!(
        "{{\"workload\": \"{}\", \"mode\": \"{}\", \"infer\": {infer}, \"error\": {}}}",
        args.workload.name(),
        mode.name(),
        serde_json::Value::String(e.to_string().chars().take(300).collect())
    )
}

fn phase_name(infer: bool) -> &'static str {
    if infer {
        "infer"
    } else {
        "train"
    }
}

fn py_opt(v: Option<f64>, digits: i32) -> String {
    v.map_or("None".into(), |v| py(v, digits))
}

fn json_opt(v: Option<f64>, digits: i32) -> String {
    v.map_or("null".into(), |v| py(v, digits))
}

/// A workload's step after the passes, as a timed run executes it.
struct Step {
    graph: Graph,
    /// What each step fetches: the training step's flag, or in inference a `Group` of
    /// the logits (one fetch that needs them but downloads one byte, not them).
    fetch: Port,
    /// The training loss.
    loss: Option<Port>,
    nodes_before: usize,
    records: Vec<PassRecord>,
}

/// Builds the graph of `cfg`'s training step (`infer` false) or forward pass in
/// `mode`, and runs the session's pipeline on it: the AMP pass for a marked graph,
/// then the passes after it.
fn prepare(args: &Args, cfg: &Config, mode: Mode, infer: bool) -> Res<Step> {
    prepare_with(args, cfg, mode, infer, &args.session_options(mode)?)
}

/// [`prepare`] with the session `options` (the data-parallel pass).
fn prepare_with(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    options: &SessionOptions,
) -> Res<Step> {
    let Model {
        mut graph,
        logits,
        loss,
        running_updates,
    } = build(cfg, !infer)?;
    if let (true, Some(world)) = (args.sync_batch_norm, args.replicas) {
        let summary = SyncBatchNorm::new(world).run(&mut graph)?;
        print!("# {summary}");
    }
    let (fetch, loss) = if infer {
        let done = graph.add(Group, &[logits])?;
        graph.mixed_precision = mode.amp();
        graph.prune(&[done])?;
        (done, None)
    } else {
        // The peers' optimizers (scripts/torch_zoo_train.py): AdamW (PyTorch's default
        // decay of 0.01 on every parameter) for the zoo's transformers, else momentum
        // SGD.
        let optimizer = match cfg {
            Config::Zoo { model, .. } if *model != Workload::Resnet50 => Adam::adamw(3e-4, 0.01),
            _ => Sgd::momentum(1e-3, 0.9),
        };
        let step = match mode.amp() {
            Some(dtype) => {
                let loss_scale = match dtype {
                    // FP8 products sit on BF16 AMP.
                    DType::BF16 | DType::F8E4M3 => LossScale::None,
                    _ => LossScale::default(),
                };
                enable_mixed_precision_graph_rewrite(optimizer)
                    .with_dtype(dtype)
                    .with_loss_scale(loss_scale)
                    .minimize(&mut graph, loss)?
            }
            None => optimizer.minimize(&mut graph, loss)?,
        };
        // The running averages are written by the same step, skipped or not (as
        // PyTorch's forward writes them whatever the GradScaler then does).
        let fetch = match running_updates[..] {
            [] => step.step,
            _ => graph.add(Group, &[&[step.step], &running_updates[..]].concat())?,
        };
        (fetch, Some(step.loss))
    };
    // Resident feeds: the (already differentiated) graph reads x and the labels from
    // non-trainable Variables, set once (`initial_values`).
    if args.feeds == FeedMode::Resident {
        for name in [X, LABELS] {
            if let Some(id) = graph.find(name) {
                let ty = graph.ty(id.into()).clone();
                graph.set_op(id, Box::new(Variable::with_init(ty, Init::Zeros)));
            }
        }
    }
    let nodes_before = graph.len();
    let pipeline = Pipeline::new(&graph, options, Vec::new())?;
    let fetches: Vec<Port> = [fetch].into_iter().chain(loss).collect();
    let (records, fetched) = pipeline.run_for(&mut graph, &fetches)?;
    Ok(Step {
        graph,
        fetch: fetched[0],
        loss: fetched.get(1).copied(),
        nodes_before,
        records,
    })
}

/// What each step feeds: x and the labels where they are uploaded every step.
fn step_feeds(args: &Args, graph: &Graph, data: &(Tensor, Tensor)) -> Feeds {
    let mut feeds = Feeds::new();
    if args.feeds == FeedMode::Upload {
        for (name, value) in [(X, &data.0), (LABELS, &data.1)] {
            if graph.find(name).is_some() {
                feeds.insert(name.to_string(), value.clone());
            }
        }
    }
    feeds
}

/// Every Variable's first value: the data where x and the labels are resident, else
/// torch's initial values (`--init torch`) or the graph's.
fn initial_values(
    args: &Args,
    graph: &Graph,
    data: &(Tensor, Tensor),
) -> Res<Vec<(String, Tensor)>> {
    let mut values = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        if let Some(var) = node.op.downcast_ref::<Variable>() {
            let value = match (args.feeds, node.name.as_str()) {
                (FeedMode::Resident, X) => data.0.clone(),
                (FeedMode::Resident, LABELS) => data.1.clone(),
                _ => match torch_value(graph, &node.name, &var.ty, args) {
                    Some(value) => value?,
                    None => initial_value(&node.name, var, args.seed),
                },
            };
            values.push((node.name.clone(), value));
        }
    }
    Ok(values)
}

/// The milliseconds of `--iters` steps fetching `fetch`, in order: on the device
/// where the executor times it there, else the wall clock.
fn timed_steps(
    args: &Args,
    exec: &mut dyn Executor,
    graph: &Graph,
    feeds: &Feeds,
    fetch: Port,
) -> Res<Vec<f64>> {
    (0..args.iters.max(1))
        .map(|_| {
            let start = Instant::now();
            let (_, device_ms) = exec.run_timed(graph, feeds, &[fetch])?;
            Ok(device_ms.unwrap_or(start.elapsed().as_secs_f64() * 1e3))
        })
        .collect()
}

/// With `--profile N`: N more steps timed op by op (CUDA events), and their table
/// printed where `shown` names the phase and mode (a data-parallel replica other than
/// rank 0 runs the steps, whose all-reduces need it, and prints nothing).
fn print_profile(
    args: &Args,
    exec: &mut dyn Executor,
    graph: &Graph,
    feeds: &Feeds,
    fetch: Port,
    shown: Option<(&str, Mode)>,
) -> Res<()> {
    if args.profile == 0 {
        return Ok(());
    }
    let plain = exec.options();
    exec.set_options(ExecOptions {
        profile: true,
        ..plain
    });
    for _ in 0..args.profile {
        exec.run(graph, feeds, &[fetch])?;
    }
    exec.set_options(plain);
    let Some((phase, mode)) = shown else {
        return Ok(());
    };
    if let Some(table) = exec.stats().map(|s| s.profile_table(30)) {
        println!(
            "# profile of {} {} {} ({} steps, each op timed with CUDA events):\n{}",
            args.workload.name(),
            phase,
            mode.name(),
            args.profile,
            table
        );
    }
    Ok(())
}

/// With `--dump DIR`: `graph` after the passes, as text, to `DIR/<workload>-<phase>-<mode>.txt`.
fn dump(args: &Args, graph: &Graph, phase: &str, mode: Mode) -> Res<()> {
    let Some(dir) = &args.dump else {
        return Ok(());
    };
    let path = dir.join(format!(
        "{}-{phase}-{}.txt",
        args.workload.name(),
        mode.name()
    ));
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&path, ampgraph::graph::format::to_text(graph)))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

fn run_one(
    args: &Args,
    cfg: &Config,
    mode: Mode,
    infer: bool,
    data: &(Tensor, Tensor),
) -> Res<Option<Record>> {
    let Step {
        graph,
        fetch,
        loss,
        nodes_before,
        records,
    } = prepare(args, cfg, mode, infer)?;
    let feeds = step_feeds(args, &graph, data);
    let footprint = step_footprint(&graph, &[fetch], &Default::default())?;
    let phase = phase_name(infer);
    dump(args, &graph, phase, mode)?;
    if args.passes_only {
        let (workload, mode) = (args.workload.name(), mode.name());
        println!(
            "# {workload} {phase} {mode}: {nodes_before} nodes before the passes, {} after",
            graph.len()
        );
        for r in &records {
            println!(
                "## {} ({:.1} ms)\n{}",
                r.pass,
                r.elapsed.as_secs_f64() * 1e3,
                r.summary
            );
        }
        print!(
            "## memory plan\n{}",
            footprint.report(&graph, args.peak_top)
        );
        return Ok(None);
    }
    let options = args.session_options(mode)?;
    let mut exec = args
        .device
        .device(args.ordinal)
        .executor(options.executor, &options.kernel_cache)?;
    exec.check_supported(&graph)?;
    for (name, value) in initial_values(args, &graph, data)? {
        exec.set_variable(&name, value)?;
    }
    for _ in 0..args.warmup {
        exec.run(&graph, &feeds, &[fetch])?;
    }
    if let Some(stats) = exec.stats() {
        stats.reset_peak_bytes();
    }
    let energy = match args.device {
        DeviceArg::Cuda => EnergyCounter::open(args.ordinal as u32),
        DeviceArg::Cpu => None,
    };
    let energy_before = energy.as_ref().and_then(|e| e.millijoules());
    let timed_from = Instant::now();
    let mut times = timed_steps(args, exec.as_mut(), &graph, &feeds, fetch)?;
    // Joules and watts over the timed steps, host time between steps included; only
    // over a second or more, as NVML's counter moves in steps of tens of milliseconds.
    let wall_s = timed_from.elapsed().as_secs_f64();
    let energy_used = energy
        .as_ref()
        .filter(|_| wall_s >= MIN_ENERGY_SECONDS)
        .and_then(|e| Some((e.millijoules()? - energy_before?) as f64));
    let joules = energy_used.map(|mj| (mj / 1e3 / times.len() as f64, mj / 1e3 / wall_s));
    if args.print_times {
        let shown: Vec<String> = times.iter().map(|t| format!("{t:.3}")).collect();
        println!("# step ms in order: {}", shown.join(" "));
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let launches = match exec.stats().map(|s| s.launches()) {
        Some(before) => {
            exec.run(&graph, &feeds, &[fetch])?;
            exec.stats().map(|s| s.launches() - before)
        }
        None => None,
    };
    let peak = exec.stats().map(|s| mib(s.peak_bytes()));
    // As torch_anchor.py: the loss after the timed steps (a forward pass only: the
    // fetch needs no update).
    let loss = match loss {
        Some(l) => Some(exec.run(&graph, &feeds, &[l])?[0].to_f64_vec()[0]),
        None => None,
    };
    if args.device == DeviceArg::Cuda {
        print_profile(
            args,
            exec.as_mut(),
            &graph,
            &feeds,
            fetch,
            Some((phase, mode)),
        )?;
    }
    let flops = cfg.flops_train().map(|f| f / if infer { 3.0 } else { 1.0 });
    Ok(Some(Record {
        workload: args.workload.name(),
        mode: mode.name(),
        phase,
        median_ms: median,
        min_ms: times[0],
        max_ms: times[times.len() - 1],
        peak_mib: peak,
        planned_mib: mib(footprint.plan.arena_bytes),
        planned_peak_mib: mib(footprint.peak_bytes()),
        launches,
        tflops: flops.map(|f| f / median / 1e9),
        loss,
        joules,
    }))
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    match bench(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => ampgraph::cli::report_error(&e),
    }
}

fn bench(args: &Args) -> Res<()> {
    let cfg = Config::from_args(args)?;
    let modes = args
        .modes
        .split(',')
        .map(|m| Mode::parse(m.trim()))
        .collect::<Res<Vec<_>>>()?;
    let phases = args
        .phases
        .split(',')
        .map(|p| match p.trim() {
            "train" => Ok(false),
            "infer" => Ok(true),
            other => Err(format!("unknown phase '{other}' (train, infer)").into()),
        })
        .collect::<Res<Vec<bool>>>()?;
    let device_name = match args.device {
        DeviceArg::Cpu if args.max_batch_under_mib.is_some() => {
            "no device (memory planned on the host)".to_string()
        }
        _ if args.passes_only => "no device (passes only)".to_string(),
        DeviceArg::Cuda => {
            if let Err(why) = cuda::available() {
                println!(
                    "bench: no CUDA device here ({why}); nothing to measure. Run it on the GPU \
                     machine, or pass --device cpu with tiny sizes."
                );
                return Ok(());
            }
            let options = args.executor.session_options();
            Device::Cuda(args.ordinal)
                .executor(options.executor, &options.kernel_cache)?
                .device_name()
        }
        DeviceArg::Cpu => Device::Cpu
            .executor(ExecOptions::default(), &Default::default())?
            .device_name(),
    };
    println!("# ampgraph {} on {device_name}", env!("CARGO_PKG_VERSION"));
    println!("# {}: {}", args.workload.name(), cfg.describe());
    let switches = args.executor.session_options();
    let pipeline = args.pipeline(&switches.executor);
    println!(
        "# passes after AMP: {}{}",
        if pipeline.is_empty() {
            "none".to_string()
        } else {
            pipeline.join(",")
        },
        if args.passes.is_none() && !switches.executor.gemm.allow_tf32 {
            " (tf32 mode: layout-nhwc-all for layout-nhwc)"
        } else {
            ""
        }
    );
    let mut set = Vec::new();
    if switches.executor.gemm.allow_tf32 {
        set.push("TF32 for f32 products in every mode".to_string());
    }
    if switches
        .executor
        .gemm
        .allow_fp16_reduced_precision_reduction
    {
        set.push("f16 products accumulate in f16".to_string());
    }
    if let Some(cache) = &args.executor.kernel_cache {
        set.push(format!("kernel cache {cache:?}"));
    }
    if !set.is_empty() {
        println!("# executor: {}", set.join(", "));
    }
    println!(
        "# feeds: {}",
        match args.feeds {
            FeedMode::Resident =>
                "generated once on the host, uploaded once, resident on the device",
            FeedMode::Upload => "generated once on the host, UPLOADED EVERY STEP (x and labels)",
        }
    );
    if let Some(budget_mib) = args.max_batch_under_mib {
        return fit::report(args, &cfg, &modes, &phases, budget_mib);
    }
    println!(
        "# timing: CUDA events around each step (wall clock on the CPU), median of {} after {} warm-up",
        args.iters.max(1),
        args.warmup
    );
    if let Some(world) = args.replicas {
        for &mode in &modes {
            replicas::run(args, &cfg, mode, world)?;
        }
        return Ok(());
    }
    let data = cfg.data(args.seed)?;
    let mut rows = Vec::new();
    for &mode in &modes {
        for &infer in &phases {
            match run_one(args, &cfg, mode, infer, &data) {
                Ok(None) => {}
                Ok(Some(r)) => {
                    let mut line = format!(
                        "{{\"workload\": \"{}\", \"mode\": \"{}\", \"phase\": \"{}\", \"median_ms\": {}, \"min_ms\": {}, \"max_ms\": {}, \"peak_mem_mib\": {}, \"planned_arena_mib\": {}, \"planned_peak_mib\": {}, \"tflops\": {}",
                        r.workload,
                        r.mode,
                        r.phase,
                        py(r.median_ms, 3),
                        py(r.min_ms, 3),
                        py(r.max_ms, 3),
                        json_opt(r.peak_mib, 1),
                        py(r.planned_mib, 1),
                        py(r.planned_peak_mib, 1),
                        json_opt(r.tflops, 1),
                    );
                    if let Some(l) = r.loss {
                        line += &format!(", \"loss\": {}", py(l, 4));
                    }
                    if let Some((j, w)) = r.joules {
                        line += &format!(", \"joules\": {}, \"watts\": {}", py(j, 3), py(w, 0));
                    }
                    if let Some(c) = r.launches {
                        line += &format!(
                            ", \"launches\": {{\"kernel\": {}, \"gemm\": {}, \"cudnn\": {}, \"cudnn_replayed\": {}, \"memset\": {}, \"memcpy\": {}, \"total\": {}}}",
                            c.kernels,
                            c.gemms,
                            c.dnn,
                            c.dnn_replays,
                            c.memsets,
                            c.memcpys,
                            c.total()
                        );
                    }
                    println!("{line}}}");
                    rows.push(r);
                }
                Err(e) => println!("{}", error_line(args, mode, infer, e.as_ref())),
            }
        }
    }
    println!("\n| workload | phase | mode | median ms | TFLOP/s | peak MiB |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.workload,
            r.phase,
            r.mode,
            py(r.median_ms, 3),
            py_opt(r.tflops, 1),
            py_opt(r.peak_mib, 1)
        );
    }
    Ok(())
}
