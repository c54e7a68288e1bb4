//! Trains an MLP or PyTorch's MNIST CNN on MNIST with automatic mixed precision,
//! fed by the data loader (worker threads, batches staged to the GPU while the step
//! before them computes) and the trainer (progress bar, checkpoints, exact resume).
//!
//! ```sh
//! cargo run --release --example mnist -- --data examples/data/mnist
//! cargo run --release --example mnist -- --data examples/data/mnist --fp32
//! cargo run --release --example mnist -- --model cnn --epochs 2
//! ```
//!
//! With `--data DIR` it reads MNIST-format idx files (gzip or not; MNIST, Fashion-MNIST,
//! any image size the files declare); the first `--train` images train and the last
//! `--eval` evaluate. With no data it trains on a built-in synthetic set so the command
//! works anywhere. Images are normalised as torchvision's MNIST example does.
//!
//! `--checkpoint PATH` saves every variable and the position after each epoch (and
//! every `--checkpoint-every` steps) whose loss is finite; `--resume` continues from
//! it exactly: the same next batch, the same loss scale.
//!
//! `--replicas N` trains data-parallel (`ampgraph::parallel::Replicas`) on GPUs
//! 0..N (or N CPU replicas with `--device cpu`), each on its shard of every global
//! batch of N x `--batch` images; `--checkpoint` is then written once per epoch, by
//! replica 0, and `--resume` continues after its last epoch in every replica.
//!
//! Started by a launcher, one process per GPU, it trains the same way, each process
//! its replica (GPU `LOCAL_RANK`), rank 0 printing and writing the checkpoint:
//!
//! ```sh
//! torchrun --no-python --nproc-per-node 2 target/release/examples/mnist --data examples/data/mnist
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, ValueEnum};

use ampgraph::cli::TrainArgs;
use ampgraph::data::{Dataset, Loader, LoaderOptions, Mnist, Transform};
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::{DataFormat, Padding};
use ampgraph::graph::{DType, Graph, Port};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd, TrainStep};
use ampgraph::parallel::{ProcessGroup, ReplicaOptions, Replicas};
use ampgraph::train::{Evaluation, Position, Trainer};
use ampgraph::{Device, Session};

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Model {
    Mlp,
    Cnn,
}

#[derive(Parser, Debug)]
#[command(about = "Train on MNIST with automatic mixed precision")]
struct Args {
    /// Folder with MNIST idx files (train-* or t10k-*, gzip or not).
    #[arg(long)]
    data: Option<PathBuf>,
    /// mlp: 512-512-classes with GELU; cnn: PyTorch's MNIST example (3x3 convolutions
    /// of 32 and 64 filters, 2x2 max pooling, 128, classes).
    #[arg(long, value_enum, default_value = "mlp")]
    model: Model,
    /// Images to train on (the first ones; a last batch short of --batch is left out).
    #[arg(long, default_value_t = 8000)]
    train: usize,
    /// Images to evaluate on (the last ones); 0: no evaluation.
    #[arg(long, default_value_t = 2000)]
    eval: usize,
    /// Train data-parallel over N devices (GPUs 0..N, or N CPU replicas), --batch
    /// images each.
    #[arg(long, value_name = "N")]
    replicas: Option<usize>,
    #[command(flatten)]
    run: TrainArgs,
}

/// The model's logits for `images` [batch, channels, height, width]; variables get
/// the same names in every graph built by this function, so a training and an
/// evaluation graph share them.
fn logits(
    g: &mut Graph,
    model: Model,
    images: Port,
    classes: usize,
) -> Result<Port, Box<dyn std::error::Error>> {
    let &[batch, channels, height, width] = &g.ty(images).shape[..] else {
        return Err("images must be [batch, channels, height, width]".into());
    };
    let dims = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<_>>();
    Ok(match model {
        Model::Mlp => {
            let x = g.reshape(images, dims(&[batch, channels * height * width]))?;
            let h = nn::dense(g, x, 512, Some(Activation::Gelu))?;
            let h = nn::dense(g, h, 512, Some(Activation::Gelu))?;
            nn::dense(g, h, classes, None)?
        }
        Model::Cnn => {
            let x = match channels {
                1 => g.reshape(images, dims(&[batch, height, width, 1]))?,
                _ => g.transpose(images, vec![0, 2, 3, 1])?,
            };
            let relu = Some(Activation::Relu);
            let c = nn::conv2d_layer(g, x, 32, [3, 3], [1, 1], Padding::Valid, relu)?.output;
            let c = nn::conv2d_layer(g, c, 64, [3, 3], [1, 1], Padding::Valid, relu)?.output;
            let p = g.max_pool(c, [2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc)?;
            let features: usize = g.ty(p).shape[1..].iter().product();
            let flat = g.reshape(p, dims(&[batch, features]))?;
            let h = nn::dense(g, flat, 128, relu)?;
            nn::dense(g, h, classes, None)?
        }
    })
}

struct Net {
    graph: Graph,
    images: Port,
    labels: Port,
    logits: Port,
}

fn build(
    model: Model,
    batch: usize,
    data: &dyn Dataset,
) -> Result<Net, Box<dyn std::error::Error>> {
    let mut g = Graph::new();
    let shape = [&[batch][..], data.shape()].concat();
    let images = g.placeholder("images", DType::F32, shape)?;
    let labels = g.placeholder("labels", DType::I64, [batch])?;
    let logits = logits(&mut g, model, images, data.classes())?;
    g.set_outputs(vec![logits])?;
    Ok(Net {
        graph: g,
        images,
        labels,
        logits,
    })
}

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(|| run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let run = &args.run;
    run.check()?;
    let all = match &args.data {
        Some(dir) => Mnist::load(dir)?,
        None => {
            eprintln!(
                "No --data given: training on a built-in synthetic set. Point --data at a folder of \
                 MNIST idx files (e.g. --data examples/data/mnist) for the real thing."
            );
            Mnist::synthetic(args.train + args.eval, run.seed)
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
    let train_set = Arc::new(all.slice(0, args.train));
    let eval_set = Arc::new(all.slice(all.len() - args.eval, all.len()));
    let amp = run.amp();
    // torchvision's MNIST normalisation.
    let transforms = vec![Transform::normalize(&[0.1307], &[0.3081])];
    let loader_options = run.loader_options();
    let loader =
        Loader::new(train_set.clone(), loader_options.clone())?.with_transforms(transforms.clone());

    // Training graph: the model, the loss and the optimizer's step.
    let mut net = build(args.model, run.batch, train_set.as_ref())?;
    let loss = net.graph.softmax_cross_entropy(net.logits, net.labels)?;
    let sgd = Sgd::momentum(run.lr, run.momentum);
    let step: TrainStep = match amp {
        Some(d) => enable_mixed_precision_graph_rewrite(sgd)
            .with_dtype(d)
            .with_loss_scale(run.loss_scale())
            .minimize(&mut net.graph, loss)?,
        None => sgd.minimize(&mut net.graph, loss)?,
    };
    let device = run.device.for_graph(&net.graph);
    // Evaluation: the logits alone, in batches of 500 or fewer, on the same variables.
    let mut eval = match args.eval {
        0 => None,
        n => {
            let mut eval_net = build(args.model, n.min(500), eval_set.as_ref())?;
            eval_net.graph.mixed_precision = amp;
            let eval_session =
                Session::inference(eval_net.graph.clone(), &[eval_net.logits], device)?;
            let eval_loader = Loader::new(
                eval_set.clone(),
                LoaderOptions {
                    batch_size: n.min(500),
                    shuffle: false,
                    ..loader_options.clone()
                },
            )?
            .with_transforms(transforms);
            Some(Evaluation {
                session: eval_session,
                logits: eval_net.logits,
                images: eval_net.images,
                loader: eval_loader,
            })
        }
    };

    let replica_options = ReplicaOptions {
        session: run.session_options(),
        ..ReplicaOptions::default()
    };
    let replicas = match (ProcessGroup::launched()?, args.replicas) {
        (Some(_), Some(_)) => {
            return Err(
                "--replicas with a launcher's environment (RANK, WORLD_SIZE): a \
                        launcher starts one replica per process; leave --replicas out"
                    .into(),
            )
        }
        (Some(group), None) => {
            let device = match device {
                Device::Cuda(_) => Device::Cuda(group.local_rank),
                cpu => cpu,
            };
            Some(Replicas::in_process_group(
                net.graph.clone(),
                &group,
                device,
                replica_options,
            )?)
        }
        (None, Some(world)) => {
            let devices: Vec<Device> = match device {
                Device::Cuda(_) => (0..world).map(Device::Cuda).collect(),
                Device::Cpu => vec![Device::Cpu; world],
            };
            Some(Replicas::new(net.graph.clone(), &devices, replica_options)?)
        }
        (None, None) => None,
    };
    if let Some(replicas) = replicas {
        return train_replicas(&args, replicas, &net, step, &loader, eval.as_mut());
    }
    let mut session = Session::with_options(net.graph.clone(), device, run.session_options())?;
    for record in &session.passes {
        println!("{}", record.summary);
    }
    let mut trainer = Trainer::new(
        &mut session,
        step,
        net.images,
        net.labels,
        run.train_options(),
    )?;
    let mut at = Position::START;
    if let (true, Some(path)) = (run.resume, &run.checkpoint) {
        at = trainer.resume()?;
        match at.batch {
            0 => println!(
                "resumed from {} after epoch {}",
                path.display(),
                at.epoch - 1
            ),
            b => println!(
                "resumed from {} in epoch {} at batch {b}",
                path.display(),
                at.epoch
            ),
        }
    }
    println!(
        "{:?} on {} training / {} eval images of {:?}, batch {}, {}, {} loader workers, {}",
        args.model,
        train_set.len(),
        eval_set.len(),
        train_set.shape(),
        run.batch,
        run.precision(),
        loader_options.workers,
        trainer.session().executor().device_name()
    );
    let mut epoch_seconds = Vec::new();
    trainer.fit(&loader, at, run.epochs, eval.as_mut(), |report| {
        println!("{report}");
        if let Some(warning) = report.warning() {
            eprintln!("warning: {warning}");
        }
        epoch_seconds.push((report.seconds, report.step_seconds, report.device_seconds));
    })?;
    if epoch_seconds.is_empty() {
        println!("the checkpoint holds all {} epochs already", run.epochs);
    }
    if epoch_seconds.len() > 1 {
        // The first epoch warms up (kernels compiled, cuDNN's algorithms timed).
        let mut rest = epoch_seconds[1..].to_vec();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (seconds, steps, device) = rest[rest.len() / 2];
        let gpu = device.map_or(String::new(), |d| {
            format!(", the GPU {:.1}%", 100.0 * d / seconds)
        });
        println!(
            "median epoch after the first: {seconds:.3} s (steps {:.1}%{gpu})",
            100.0 * steps / seconds
        );
    }
    Ok(())
}

/// `--replicas` or a launcher's processes: the epochs data-parallel, replica 0's
/// process printing.
fn train_replicas(
    args: &Args,
    mut replicas: Replicas,
    net: &Net,
    step: TrainStep,
    loader: &Loader,
    mut eval: Option<&mut Evaluation>,
) -> Result<(), Box<dyn std::error::Error>> {
    let run = &args.run;
    let world = replicas.world();
    let leads = replicas.leads();
    if let Some(s) = replicas.session(0) {
        for record in &s.passes {
            println!("{}", record.summary);
        }
    }
    let mut at = Position::START;
    if let (true, Some(path)) = (run.resume, &run.checkpoint) {
        at = replicas.resume(path)?;
        if leads {
            println!("resumed from {} at epoch {}", path.display(), at.epoch);
        }
    }
    if let Some(s) = replicas.session(0) {
        println!(
            "{:?} data-parallel over {world} x {}, {} images a replica, global batch {}",
            args.model,
            s.executor().device_name(),
            run.batch,
            run.batch * world
        );
    }
    while at.epoch <= run.epochs {
        let epoch = at.epoch;
        let report = replicas.epoch(loader, &step, net.images, net.labels, at)?;
        at = report.next;
        let accuracy = match (eval.as_deref_mut(), replicas.session(0)) {
            (Some(e), Some(s)) => {
                let e = e.evaluate(s)?;
                format!(", eval loss {:.4}, eval accuracy {:.4}", e.loss, e.accuracy)
            }
            _ => String::new(),
        };
        if leads {
            println!(
                "epoch {epoch}: loss {:.4}, {:.3} s ({:.0} examples/s){accuracy}",
                report.loss,
                report.seconds,
                report.examples_per_second()
            );
        }
        if let Some(path) = &run.checkpoint {
            replicas.save(path)?;
        }
    }
    Ok(())
}
