//! Trains GPT-2 (`graph::models::gpt2`, 124M by default) on a token file in llm.c's
//! format, with AdamW and automatic mixed precision: next-token cross-entropy on every
//! position, batches of consecutive windows as llm.c's loader takes them.
//!
//! ```sh
//! cargo run --release --example gpt2 -- --data train.bin --val val.bin --steps 300
//! cargo run --release --example gpt2 -- --data train.bin --precision fp32
//! ```
//!
//! A token file (llm.c's `dev/data` scripts write them) is a header of 256 little-endian
//! i32 (magic 20240520, version 1, the token count) and the tokens as u16.
//! `--precision bf16` (the default) trains as llm.c and PyTorch's bf16 autocast do,
//! without loss scaling; `fp16` with a dynamic loss scale; `fp32` in f32 throughout;
//! `fp8` as bf16 with FP8 products where the cost model says they pay
//! (`AMPGRAPH_AMP_FP8_SCALING` picks the scaling), every product the GPU runs in
//! FP8 with `--fp8-everywhere`.
//! AdamW (`--lr`, `--weight-decay`) clips the gradients' global norm to `--clip` and
//! with `--warmup N` follows llm.c's schedule. The loss is printed every `--print-every` steps and the validation loss (the mean
//! over `--val-batches` batches from the file's start) every `--val-every` steps and at
//! the end.

use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};

use ampgraph::cli::DeviceArg;
use ampgraph::exec::Feeds;
use ampgraph::graph::models::gpt2::{self, Gpt2Config};
use ampgraph::graph::ops::LearningRateSchedule;
use ampgraph::optim::{
    enable_mixed_precision_graph_rewrite, Adam, ClipGlobalNorm, LossScale, Optimizer, TrainStep,
};
use ampgraph::passes::amp::AmpConfig;
use ampgraph::{DType, Graph, GraphError, Port, Session, SessionOptions, Tensor};

#[derive(Parser, Debug)]
#[command(about = "Train GPT-2 on a token file in llm.c's format")]
struct Args {
    /// Training tokens (llm.c's .bin format).
    #[arg(long)]
    data: PathBuf,
    /// Validation tokens, same format.
    #[arg(long)]
    val: Option<PathBuf>,
    /// Training steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 12)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Residual stream width.
    #[arg(long, default_value_t = 768)]
    width: usize,
    /// Vocabulary size (the file's tokens must be below it).
    #[arg(long, default_value_t = 50257)]
    vocab: usize,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Steps of linear warmup, after which the rate falls along a cosine to a tenth at
    /// the last step (llm.c's schedule); 0: a constant rate.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Clip the gradients to this global L2 norm (GPT-2's 1.0; 0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    #[arg(long, value_enum, default_value = "bf16")]
    precision: Precision,
    /// With --precision fp8: every product the GPU runs in FP8 (no cost model, first
    /// and last layers too).
    #[arg(long)]
    fp8_everywhere: bool,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Print the training loss every this many steps.
    #[arg(long, default_value_t = 10)]
    print_every: usize,
    /// Evaluate on --val every this many steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    val_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 8)]
    val_batches: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    Fp32,
    Bf16,
    Fp16,
    /// BF16 with FP8 products.
    Fp8,
}

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(|| run(Args::parse()))
}

/// llm.c's token file header: magic, version, token count (of 256 i32).
const MAGIC: i32 = 20240520;
const HEADER_BYTES: usize = 256 * 4;

/// The tokens of a file in llm.c's format, each checked to be below `vocab`.
fn read_tokens(path: &Path, vocab: usize) -> Result<Vec<u16>, String> {
    let err = |msg: String| format!("{}: {msg}", path.display());
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let header = bytes.get(..HEADER_BYTES).ok_or_else(|| {
        err(format!(
            "{} bytes, shorter than the 1024-byte header",
            bytes.len()
        ))
    })?;
    let field = |k: usize| {
        i32::from_le_bytes([
            header[4 * k],
            header[4 * k + 1],
            header[4 * k + 2],
            header[4 * k + 3],
        ])
    };
    if field(0) != MAGIC {
        return Err(err(format!(
            "magic {} is not llm.c's token file magic {MAGIC}",
            field(0)
        )));
    }
    if field(1) != 1 {
        return Err(err(format!(
            "version {} (only version 1 is read)",
            field(1)
        )));
    }
    let count = usize::try_from(field(2)).map_err(|_| err(format!("token count {}", field(2))))?;
    let body = &bytes[HEADER_BYTES..];
    if body.len() != 2 * count {
        return Err(err(format!(
            "the header counts {count} tokens but {} bytes follow it (2 a token)",
            body.len()
        )));
    }
    let tokens: Vec<u16> = body
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    if let Some((at, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(err(format!(
            "token {at} is {t}, not below the vocabulary of {vocab}"
        )));
    }
    Ok(tokens)
}

/// Consecutive windows of `batch` sequences of `seq` tokens and their next tokens,
/// wrapping to the start where the file runs out (llm.c's loader without shuffling).
struct Windows {
    tokens: Vec<u16>,
    at: usize,
    batch: usize,
    seq: usize,
}

impl Windows {
    fn new(tokens: Vec<u16>, batch: usize, seq: usize, path: &Path) -> Result<Self, String> {
        if tokens.len() < batch * seq + 1 {
            return Err(format!(
                "{}: {} tokens, fewer than one batch of {batch} x {seq} and the next token",
                path.display(),
                tokens.len()
            ));
        }
        Ok(Windows {
            tokens,
            at: 0,
            batch,
            seq,
        })
    }

    fn next_feeds(&mut self) -> Result<Feeds, Box<dyn std::error::Error>> {
        let n = self.batch * self.seq;
        if self.at + n + 1 > self.tokens.len() {
            self.at = 0;
        }
        let window = &self.tokens[self.at..self.at + n + 1];
        self.at += n;
        let values = |w: &[u16]| w.iter().map(|&t| t as f64).collect::<Vec<f64>>();
        Ok(Feeds::from([
            (
                "tokens".into(),
                Tensor::from_f64(DType::I64, [self.batch, self.seq], &values(&window[..n]))?,
            ),
            (
                "targets".into(),
                Tensor::from_f64(DType::I64, [n], &values(&window[1..]))?,
            ),
        ]))
    }
}

/// The training step of `loss` by `optimizer` in `precision`.
fn minimize<O: Optimizer>(
    optimizer: O,
    precision: Precision,
    g: &mut Graph,
    loss: Port,
) -> Result<TrainStep, GraphError> {
    match precision {
        Precision::Fp32 => optimizer.minimize(g, loss),
        Precision::Bf16 | Precision::Fp8 => enable_mixed_precision_graph_rewrite(optimizer)
            .with_dtype(if precision == Precision::Fp8 {
                DType::F8E4M3
            } else {
                DType::BF16
            })
            .with_loss_scale(LossScale::None)
            .minimize(g, loss),
        Precision::Fp16 => enable_mixed_precision_graph_rewrite(optimizer)
            .with_dtype(DType::F16)
            .minimize(g, loss),
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let config = Gpt2Config {
        vocab: args.vocab,
        positions: args.seq,
        layers: args.layers,
        heads: args.heads,
        width: args.width,
        dropout: 0.0,
        attention_dropout: 0.0,
    };
    if args.steps == 0 || args.batch == 0 || args.seq == 0 {
        return Err("--steps, --batch and --seq must be positive".into());
    }
    let mut train = Windows::new(
        read_tokens(&args.data, args.vocab)?,
        args.batch,
        args.seq,
        &args.data,
    )?;
    let mut val = match &args.val {
        Some(path) => Some(Windows::new(
            read_tokens(path, args.vocab)?,
            args.batch,
            args.seq,
            path,
        )?),
        None => None,
    };

    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [args.batch, args.seq])?;
    let targets = g.placeholder("targets", DType::I64, [args.batch * args.seq])?;
    let logits = gpt2::build(&mut g, tokens, &config)?;
    let loss = g.softmax_cross_entropy(logits, targets)?;
    let mut adamw = Adam::adamw(args.lr, args.weight_decay);
    if args.warmup > 0 {
        let total = args.steps as u64;
        adamw = adamw.scheduled(LearningRateSchedule::warmup_cosine(args.warmup, total, 0.1));
    }
    let step = if args.clip > 0.0 {
        minimize(
            ClipGlobalNorm::new(adamw, args.clip),
            args.precision,
            &mut g,
            loss,
        )?
    } else {
        minimize(adamw, args.precision, &mut g, loss)?
    };
    let device = args.device.for_graph(&g);
    if args.fp8_everywhere && args.precision != Precision::Fp8 {
        return Err("--fp8-everywhere needs --precision fp8".into());
    }
    let mut options = SessionOptions::default();
    if args.fp8_everywhere {
        let config = AmpConfig::new(DType::F8E4M3)?.from_env()?;
        options.amp = Some(config.on_every_device_product());
    }
    let mut session = Session::with_options(g, device, options)?;
    println!(
        "GPT-2 ({} layers, {} heads, width {}, vocabulary {}) on {} tokens of {}, batch {} x {}, AdamW lr {}, {:?}, {}",
        args.layers,
        args.heads,
        args.width,
        args.vocab,
        train.tokens.len(),
        args.data.display(),
        args.batch,
        args.seq,
        args.lr,
        args.precision,
        session.executor().device_name()
    );
    let eval_loss = step.loss;
    let mut evaluate =
        |session: &mut Session, step: usize| -> Result<(), Box<dyn std::error::Error>> {
            let Some(val) = val.as_mut() else {
                return Ok(());
            };
            val.at = 0;
            let mut sum = 0.0;
            for _ in 0..args.val_batches {
                // The loss alone: the forward, no update.
                sum += session.run(&[eval_loss], &val.next_feeds()?)?[0].to_f64_vec()[0];
            }
            println!("step {step}: val loss {:.4}", sum / args.val_batches as f64);
            Ok(())
        };
    let started = std::time::Instant::now();
    for k in 1..=args.steps {
        let out = session.run(&[step.loss, step.step], &train.next_feeds()?)?;
        let value = out[0].to_f64_vec()[0];
        if !value.is_finite() {
            return Err(format!("step {k}: the loss is {value}").into());
        }
        if k % args.print_every.max(1) == 0 || k == args.steps {
            let ms = started.elapsed().as_secs_f64() * 1e3 / k as f64;
            println!("step {k}: loss {value:.4} ({ms:.1} ms a step so far)");
        }
        if args.val_every > 0 && k % args.val_every == 0 && k != args.steps {
            evaluate(&mut session, k)?;
        }
    }
    evaluate(&mut session, args.steps)
}
