//! Trains the convnet (torch_anchor.py's `ConvNet`: eight 3x3 convolutions with batch
//! norm and ReLU, the mean over the image, a linear layer), or with `--model resnet50`
//! torchvision's ResNet-50, on an image folder, with automatic mixed precision,
//! augmentation and the trainer's checkpoints.
//!
//! ```sh
//! cargo run --release --example image_folder -- --data DIR/train --eval-data DIR/val
//! cargo run --release --example image_folder -- --epochs 2    # a synthetic folder
//! ```
//!
//! A folder holds one sub-folder per class with PNG or JPEG images of one size
//! (torchvision's `ImageFolder`). Training images are padded by 4 and randomly cropped
//! back, flipped at random, and normalised to `(x - 0.5) / 0.5`; evaluation images are
//! only normalised. With no `--data` the example writes a small synthetic folder
//! (coloured digits, 32x32 PNGs) under the system's temporary folder and trains on it.
//! `--checkpoint PATH` and `--resume` work as in the mnist example. `--warmup N` warms the
//! learning rate up over N steps, then lowers it along a cosine to a tenth at the last.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Parser;

use ampgraph::cli::TrainArgs;
use ampgraph::data::{Dataset, ImageFolder, Loader, LoaderOptions, Mnist, Transform};
use ampgraph::graph::models::{convnet, resnet};
use ampgraph::graph::ops::Group;
use ampgraph::graph::{DType, Graph, Port};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, LearningRateSchedule, Optimizer, Sgd};
use ampgraph::train::{Evaluation, Position, Trainer};
use ampgraph::Session;

#[derive(Parser, Debug)]
#[command(about = "Train a convnet on an image folder with automatic mixed precision")]
struct Args {
    /// Training images: one sub-folder per class.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Evaluation images, with the same class sub-folders.
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// The model.
    #[arg(long, value_enum, default_value = "convnet")]
    model: Model,
    /// The convnet's first layer's channels (the last has eight times as many).
    #[arg(long, default_value_t = 16)]
    width: usize,
    /// Steps of linear warmup, after which the rate falls along a cosine to a tenth at
    /// the last step (0: the rate stays constant).
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Training images per class in the synthetic folder (a quarter as many to
    /// evaluate).
    #[arg(long, default_value_t = 64)]
    synthetic_per_class: usize,
    #[command(flatten)]
    run: TrainArgs,
}

fn main() -> std::process::ExitCode {
    ampgraph::cli::main_with(|| run(Args::parse()))
}

/// Writes `count` synthetic 32x32 RGB PNGs per class into `root/<digit>/`: the mnist
/// example's synthetic digits, each in a colour of its own, on a dark background.
fn write_synthetic_folder(
    root: &Path,
    count: usize,
    seed: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let digits = Mnist::synthetic(10 * count, seed);
    for i in 0..digits.len() {
        let (Some(image), Some(label)) = (digits.image(i), digits.label(i)) else {
            continue;
        };
        let dir = root.join(label.to_string());
        std::fs::create_dir_all(&dir)?;
        let tint = [
            (i * 97) % 200 + 55,
            (i * 57) % 200 + 55,
            (i * 31) % 200 + 55,
        ];
        let mut rgb = vec![0u8; 32 * 32 * 3];
        for y in 0..28 {
            for x in 0..28 {
                let p = image[y * 28 + x] as usize;
                for c in 0..3 {
                    rgb[((y + 2) * 32 + x + 2) * 3 + c] = (p * tint[c] / 255) as u8;
                }
            }
        }
        let path = dir.join(format!("{i:05}.png"));
        image::save_buffer(&path, &rgb, 32, 32, image::ExtendedColorType::Rgb8)?;
    }
    Ok(())
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Model {
    /// torch_anchor.py's convnet, `--width` wide.
    Convnet,
    /// torchvision's ResNet-50 (`graph::models::resnet`).
    Resnet50,
}

struct Net {
    graph: Graph,
    images: Port,
    labels: Port,
    logits: Port,
    running_updates: Vec<Port>,
}

fn build(
    batch: usize,
    data: &dyn Dataset,
    args: &Args,
    training: bool,
) -> Result<Net, Box<dyn std::error::Error>> {
    let mut g = Graph::new();
    let images = g.placeholder("images", DType::F32, [&[batch][..], data.shape()].concat())?;
    let labels = g.placeholder("labels", DType::I64, [batch])?;
    let (logits, running_updates) = match args.model {
        Model::Convnet => {
            let net = convnet::build(&mut g, images, args.width, data.classes(), training)?;
            (net.logits, net.running_updates)
        }
        Model::Resnet50 => {
            let config = resnet::ResNetConfig {
                classes: data.classes(),
                ..resnet::ResNetConfig::RESNET50
            };
            let net = resnet::build(&mut g, images, &config, training)?;
            (net.logits, net.running_updates)
        }
    };
    g.set_outputs(vec![logits])?;
    Ok(Net {
        graph: g,
        images,
        labels,
        logits,
        running_updates,
    })
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let run = &args.run;
    run.check()?;
    let (train_dir, eval_dir) = match &args.data {
        Some(dir) => (dir.clone(), args.eval_data.clone()),
        None => {
            let count = args.synthetic_per_class.max(4);
            let root =
                std::env::temp_dir().join(format!("ampgraph-image-folder-{}-{count}", run.seed));
            if !root.join("train").exists() {
                write_synthetic_folder(&root.join("train"), count, run.seed)?;
                write_synthetic_folder(&root.join("val"), count / 4, run.seed + 1)?;
            }
            eprintln!(
                "No --data given: training on synthetic images in {}",
                root.display()
            );
            (root.join("train"), Some(root.join("val")))
        }
    };
    let train_set: Arc<dyn Dataset> = Arc::new(ImageFolder::open(&train_dir)?);
    let channels = train_set.shape()[0];
    let normalize = Transform::normalize(&vec![0.5; channels], &vec![0.5; channels]);
    let options = run.loader_options();
    let loader = Loader::new(train_set.clone(), options.clone())?.with_transforms(vec![
        Transform::RandomCrop { padding: 4 },
        Transform::RandomFlip,
        normalize.clone(),
    ]);
    let amp = run.amp();

    // The training step also writes the batch norms' running averages.
    let mut net = build(run.batch, train_set.as_ref(), &args, true)?;
    let loss = net.graph.softmax_cross_entropy(net.logits, net.labels)?;
    let mut sgd = Sgd::momentum(run.lr, run.momentum);
    if args.warmup > 0 {
        let total = (run.epochs * loader.batches_per_epoch()) as u64;
        sgd = sgd.scheduled(LearningRateSchedule::warmup_cosine(args.warmup, total, 0.1));
    }
    let mut step = match amp {
        Some(d) => enable_mixed_precision_graph_rewrite(sgd)
            .with_dtype(d)
            .with_loss_scale(run.loss_scale())
            .minimize(&mut net.graph, loss)?,
        None => sgd.minimize(&mut net.graph, loss)?,
    };
    step.step = net
        .graph
        .add(Group, &[&[step.step], &net.running_updates[..]].concat())?;
    let device = run.device.for_graph(&net.graph);
    let mut session = Session::with_options(net.graph.clone(), device, run.session_options())?;

    // Evaluation: batch norms on the running averages.
    let mut eval = match &eval_dir {
        None => None,
        Some(dir) => {
            let set: Arc<dyn Dataset> = Arc::new(ImageFolder::open(dir)?);
            if set.shape() != train_set.shape() || set.classes() != train_set.classes() {
                return Err(format!(
                    "{}: images {:?} in {} classes, but the training images are {:?} in {}",
                    dir.display(),
                    set.shape(),
                    set.classes(),
                    train_set.shape(),
                    train_set.classes()
                )
                .into());
            }
            let batch = set.len().min(100);
            let mut eval_net = build(batch, set.as_ref(), &args, false)?;
            eval_net.graph.mixed_precision = amp;
            let eval_session =
                Session::inference(eval_net.graph.clone(), &[eval_net.logits], device)?;
            let eval_loader = Loader::new(
                set,
                LoaderOptions {
                    batch_size: batch,
                    shuffle: false,
                    drop_last: false,
                    ..options
                },
            )?
            .with_transforms(vec![normalize]);
            Some(Evaluation {
                session: eval_session,
                logits: eval_net.logits,
                images: eval_net.images,
                loader: eval_loader,
            })
        }
    };

    let mut trainer = Trainer::new(
        &mut session,
        step,
        net.images,
        net.labels,
        run.train_options(),
    )?;
    let mut at = Position::START;
    if run.resume {
        at = trainer.resume()?;
        println!("resumed in epoch {} at batch {}", at.epoch, at.batch);
    }
    let model = match args.model {
        Model::Convnet => format!("convnet (width {})", args.width),
        Model::Resnet50 => "ResNet-50".to_string(),
    };
    println!(
        "{model} on {} images {:?} of {} classes from {}, batch {}, {}, {}",
        train_set.len(),
        train_set.shape(),
        train_set.classes(),
        train_dir.display(),
        run.batch,
        run.precision(),
        trainer.session().executor().device_name()
    );
    trainer.fit(&loader, at, run.epochs, eval.as_mut(), |report| {
        println!("{report}");
        if let Some(warning) = report.warning() {
            eprintln!("warning: {warning}");
        }
    })?;
    Ok(())
}
