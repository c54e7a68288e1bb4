//! Trains an MLP (or a small CNN) on MNIST with automatic mixed precision.
//!
//! ```sh
//! cargo run --release --example mnist -- --data ../shared/data/mnist
//! cargo run --release --example mnist -- --data ../shared/data/mnist --fp32
//! cargo run --release --example mnist -- --model cnn --epochs 2
//! ```
//!
//! With `--data DIR` it reads MNIST's idx files (gzip or not); the first `--train`
//! images train and the last `--eval` evaluate. With no data it trains on a built-in
//! synthetic set so the command works anywhere.
//!
//! `--checkpoint PATH` saves every variable after each epoch whose loss is finite,
//! with the count of epochs done (the variable `epochs_done`); `--resume` restores it
//! and goes on from the next epoch, whose batches come in the order an uninterrupted
//! run would give them (each epoch shuffles with the seed plus its number).

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use ampgraph::cli::DeviceArg;
use ampgraph::data::{Dataset, Mnist};
use ampgraph::exec::Feeds;
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::{DataFormat, Init, Padding, Variable};
use ampgraph::graph::{DType, Graph, Port, Tensor, TensorType};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd, TrainStep};
use ampgraph::Session;

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Model {
    Mlp,
    Cnn,
}

#[derive(Parser, Debug)]
#[command(about = "Train on MNIST with automatic mixed precision")]
struct Args {
    /// Folder with MNIST idx files (t10k-* or train-*, gzip or not).
    #[arg(long)]
    data: Option<PathBuf>,
    /// mlp: 784-512-512-10 with GELU; cnn: two 3x3 convolutions with max pooling,
    /// then 128 and 10.
    #[arg(long, value_enum, default_value = "mlp")]
    model: Model,
    /// Epochs to train (with --resume, counting those in the checkpoint).
    #[arg(long, default_value_t = 6)]
    epochs: usize,
    /// Images per training step.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// SGD's learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// SGD's momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Images to train on (the first ones).
    #[arg(long, default_value_t = 8000)]
    train: usize,
    /// Images to evaluate on (the last ones).
    #[arg(long, default_value_t = 2000)]
    eval: usize,
    /// Train in plain f32 instead of mixed precision.
    #[arg(long)]
    fp32: bool,
    /// Mixed precision in bf16 instead of f16.
    #[arg(long)]
    bf16: bool,
    /// Seed of the initial weights, the shuffles and the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save all variables here after every epoch (atomically).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Start from the checkpoint instead of a fresh initialisation, after the epochs
    /// it holds (`--epochs` counts them too).
    #[arg(long)]
    resume: bool,
    /// Where to train: `auto` is CUDA device 0 where it runs every node, else the CPU.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
}

/// The model's logits for `x` [batch, 784]; variables get the same names in every
/// graph built by this function, so a training and an evaluation graph share them.
fn logits(
    g: &mut Graph,
    model: Model,
    x: Port,
    batch: usize,
) -> Result<Port, Box<dyn std::error::Error>> {
    Ok(match model {
        Model::Mlp => {
            let h = nn::dense(g, x, 512, Some(Activation::Gelu))?;
            let h = nn::dense(g, h, 512, Some(Activation::Gelu))?;
            nn::dense(g, h, 10, None)?
        }
        Model::Cnn => {
            let img = g.reshape(x, [batch as i64, 28, 28, 1])?;
            let c = nn::conv2d_layer(
                g,
                img,
                16,
                [3, 3],
                [1, 1],
                Padding::Same,
                Some(Activation::Relu),
            )?
            .output;
            let p = g.max_pool(c, [2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc)?;
            let c = nn::conv2d_layer(
                g,
                p,
                32,
                [3, 3],
                [1, 1],
                Padding::Same,
                Some(Activation::Relu),
            )?
            .output;
            let p = g.max_pool(c, [2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc)?;
            let flat = g.reshape(p, [batch as i64, 7 * 7 * 32])?;
            let h = nn::dense(g, flat, 128, Some(Activation::Relu))?;
            nn::dense(g, h, 10, None)?
        }
    })
}

struct Net {
    graph: Graph,
    x: Port,
    labels: Port,
    logits: Port,
}

fn build(model: Model, batch: usize) -> Result<Net, Box<dyn std::error::Error>> {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [batch, 784])?;
    let labels = g.placeholder("labels", DType::I64, [batch])?;
    let logits = logits(&mut g, model, x, batch)?;
    g.set_outputs(vec![logits])?;
    Ok(Net {
        graph: g,
        x,
        labels,
        logits,
    })
}

fn feeds(net: &Net, data: &Mnist, indices: &[usize]) -> Result<Feeds, Box<dyn std::error::Error>> {
    let (x, y) = data.batch(indices)?;
    let name = |p: Port| net.graph.node(p.node).name.clone();
    Ok(Feeds::from([(name(net.x), x), (name(net.labels), y)]))
}

/// The variable that counts the epochs a checkpoint holds.
const EPOCHS_DONE: &str = "epochs_done";

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    if let Err(e) = train(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn train(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let all = match &args.data {
        Some(dir) => Mnist::load(dir)?,
        None => {
            eprintln!(
                "No --data given: training on a built-in synthetic set. Point --data at a folder of \
                 MNIST idx files (e.g. --data ../shared/data/mnist) for the real thing."
            );
            Mnist::synthetic(args.train + args.eval, args.seed)
        }
    };
    if args.train + args.eval > all.len() {
        return Err(format!(
            "--train {} + --eval {} exceeds the {} images available",
            args.train,
            args.eval,
            all.len()
        )
        .into());
    }
    let train = all.slice(0, args.train);
    let eval = all.slice(all.len() - args.eval, all.len());
    let amp_dtype = match (args.fp32, args.bf16) {
        (true, _) => None,
        (false, true) => Some(DType::BF16),
        (false, false) => Some(DType::F16),
    };

    // Training graph: the model, the loss, the optimizer's step, and the epoch count
    // (an output, so that it stays in the graph and its checkpoints).
    let mut net = build(args.model, args.batch)?;
    let counter = Variable::with_init(TensorType::new(DType::I64, vec![]), Init::Zeros);
    let epochs_done = net.graph.add_node(EPOCHS_DONE, Box::new(counter), &[])?;
    let mut outputs = net.graph.outputs().to_vec();
    outputs.push(epochs_done.into());
    net.graph.set_outputs(outputs)?;
    let loss = net.graph.softmax_cross_entropy(net.logits, net.labels)?;
    let sgd = Sgd::momentum(args.lr, args.momentum);
    let step: TrainStep = match amp_dtype {
        Some(d) => enable_mixed_precision_graph_rewrite(sgd)
            .with_dtype(d)
            .minimize(&mut net.graph, loss)?,
        None => sgd.minimize(&mut net.graph, loss)?,
    };
    // Evaluation graph: the same variables, the whole eval set as batches of 500 or less.
    let eval_batch = (1..=500.min(eval.len()))
        .rev()
        .find(|b| eval.len() % b == 0)
        .unwrap_or(1);
    let mut eval_net = build(args.model, eval_batch)?;
    eval_net.graph.mixed_precision = amp_dtype;

    let options = ampgraph::SessionOptions {
        seed: args.seed,
        ..Default::default()
    };
    let mut session = Session::with_options(
        net.graph.clone(),
        args.device.for_graph(&net.graph),
        options.clone(),
    )?;
    let mut eval_session = Session::with_options(
        eval_net.graph.clone(),
        args.device.for_graph(&eval_net.graph),
        options,
    )?;
    for record in &session.passes {
        println!("{}", record.summary);
    }
    let mut first_epoch = 1;
    if args.resume {
        let path = args
            .checkpoint
            .as_ref()
            .ok_or("--resume needs --checkpoint PATH")?;
        session.restore(path)?;
        let done = session
            .variable(EPOCHS_DONE)
            .and_then(|t| t.to_i64_vec())
            .and_then(|v| v.first().copied())
            .ok_or_else(|| format!("{}: no epoch count ({EPOCHS_DONE})", path.display()))?;
        first_epoch = done as usize + 1;
        println!("resumed from {} after epoch {done}", path.display());
    }
    let precision = amp_dtype.map_or("fp32".to_string(), |d| format!("AMP {d}"));
    println!(
        "{:?} on {} training / {} eval images, batch {}, {precision}",
        args.model,
        train.len(),
        eval.len(),
        args.batch
    );
    let style = ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg}")?
        .progress_chars("=> ");
    for epoch in first_epoch..=args.epochs {
        let batches = train.batches(args.batch, args.seed.wrapping_add(epoch as u64));
        let bar = ProgressBar::new(batches.len() as u64)
            .with_style(style.clone())
            .with_prefix(epoch.to_string());
        let start = Instant::now();
        let mut loss_sum = 0.0;
        for (i, indices) in batches.iter().enumerate() {
            let out = session.run(&[step.loss, step.step], &feeds(&net, &train, indices)?)?;
            loss_sum += out[0].to_f64_vec()[0];
            bar.inc(1);
            if i % 10 == 0 {
                bar.set_message(format!("loss {:.4}", loss_sum / (i + 1) as f64));
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        // Copy the trained weights into the evaluation session.
        for v in &step.variables {
            let name = &session.graph().node(*v).name;
            if let Some(value) = session.variable(name) {
                eval_session.set_variable(name, value.clone())?;
            }
        }
        let mut correct = 0;
        let order: Vec<usize> = (0..eval.len()).collect();
        for chunk in order.chunks(eval_batch) {
            let out = eval_session.run(&[eval_net.logits], &feeds(&eval_net, &eval, chunk)?)?;
            let logits = out[0].to_f64_vec();
            for (row, &i) in logits.chunks(10).zip(chunk) {
                let predicted = (0..10)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .unwrap_or(0);
                correct += usize::from(Some(predicted as u8) == eval.label(i));
            }
        }
        let scale = match step.loss_scale {
            Some(s) => format!(
                ", loss scale {}",
                session
                    .variable(&session.graph().node(s.node).name)
                    .map_or(0.0, |t| t.to_f64_vec()[0])
            ),
            None => String::new(),
        };
        let loss = loss_sum / batches.len() as f64;
        println!(
            "epoch {epoch}: loss {loss:.4}, eval accuracy {:.2}%{scale}, {seconds:.2} s ({:.0} images/s)",
            100.0 * correct as f64 / eval.len() as f64,
            (batches.len() * args.batch) as f64 / seconds
        );
        match &args.checkpoint {
            Some(path) if !loss.is_finite() => eprintln!(
                "warning: epoch {epoch}'s loss is {loss}: not saving {} (the last checkpoint stays)",
                path.display()
            ),
            Some(path) => {
                let count = Tensor::from_f64(DType::I64, vec![], &[epoch as f64])?;
                session.set_variable(EPOCHS_DONE, count)?;
                session.save(path)?;
            }
            None => {}
        }
    }
    if first_epoch > args.epochs {
        println!("the checkpoint holds all {} epochs already", args.epochs);
    }
    Ok(())
}
