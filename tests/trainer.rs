//! The trainer on the CPU: a run resumed from a checkpoint taken mid-epoch ends with
//! the bits of an uninterrupted run; the number of loader workers changes nothing;
//! evaluation pads a short last batch and counts only its real rows; a loader whose
//! batches do not fit the graph is refused naming the Placeholder.

mod common;

use std::path::Path;
use std::sync::Arc;

use ampgraph::data::{Dataset, Loader, LoaderOptions, Mnist, TensorDataset};
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::{DType, Graph, Port, Tensor};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd, TrainStep};
use ampgraph::train::{self, Position, Saved, TrainOptions, Trainer};
use ampgraph::{Device, Session};
use common::ScratchDir;

struct Net {
    session: Session,
    step: TrainStep,
    images: Port,
    labels: Port,
}

/// An AMP MLP on `[batch, 1, 28, 28]` images (so the loss scale is part of the state).
fn net(batch: usize) -> Net {
    let mut g = Graph::new();
    let images = g
        .placeholder("images", DType::F32, [batch, 1, 28, 28])
        .unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch]).unwrap();
    let x = g.reshape(images, [batch as i64, 784]).unwrap();
    let h = nn::dense(&mut g, x, 32, Some(Activation::Relu)).unwrap();
    let logits = nn::dense(&mut g, h, 10, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.05, 0.9))
        .minimize(&mut g, loss)
        .unwrap();
    let session = Session::new(g, Device::Cpu).unwrap();
    Net {
        session,
        step,
        images,
        labels,
    }
}

fn loader(workers: usize) -> Loader {
    let data = Arc::new(Mnist::synthetic(256, 7));
    let options = LoaderOptions {
        batch_size: 32,
        drop_last: true,
        seed: 3,
        workers,
        prefetch: 4,
        ..LoaderOptions::default()
    };
    Loader::new(data, options).unwrap()
}

/// A trainer of `net` with the default options.
fn trainer_of(net: &mut Net) -> Trainer<'_> {
    Trainer::new(
        &mut net.session,
        net.step.clone(),
        net.images,
        net.labels,
        TrainOptions::default(),
    )
    .unwrap()
}

/// Trains from `at` to the end of epoch `last`, saving to `checkpoint` every
/// `every` steps; the reports.
fn train(
    net: &mut Net,
    loader: &Loader,
    checkpoint: &Path,
    every: Option<usize>,
    mut at: Position,
    last: usize,
) -> Vec<(usize, f64)> {
    let options = TrainOptions {
        checkpoint: Some(checkpoint.to_path_buf()),
        checkpoint_every: every,
        progress: false,
    };
    let mut trainer = Trainer::new(
        &mut net.session,
        net.step.clone(),
        net.images,
        net.labels,
        options,
    )
    .unwrap();
    if at != Position::START {
        assert_eq!(trainer.resume().unwrap(), at);
    }
    let mut reports = Vec::new();
    while at.epoch <= last {
        let report = trainer.epoch(loader, at).unwrap();
        assert_eq!(report.saved, Saved::Written(checkpoint.to_path_buf()));
        reports.push((report.steps, report.loss));
        at = report.next;
    }
    reports
}

#[test]
fn a_run_resumed_mid_epoch_ends_with_the_bits_of_an_uninterrupted_one() {
    let dir = ScratchDir::new("trainer-resume");
    let whole = dir.join("whole.ckpt");
    let reports = train(&mut net(32), &loader(2), &whole, None, Position::START, 2);
    assert_eq!(reports.iter().map(|r| r.0).collect::<Vec<_>>(), [8, 8]);
    assert!(reports[1].1 < reports[0].1, "it learns: {reports:?}");

    // Every 3 steps: after step 6 of epoch 1 the checkpoint says (1, 6); the save at
    // the epoch's end keeps it as `.prev`, which a "crashed" run resumes from.
    let parts = dir.join("parts.ckpt");
    train(
        &mut net(32),
        &loader(2),
        &parts,
        Some(3),
        Position::START,
        1,
    );
    let crashed = dir.join("crashed.ckpt");
    std::fs::copy(parts.with_extension("ckpt.prev"), &crashed).unwrap();
    let at = Position { epoch: 1, batch: 6 };
    let tail = train(&mut net(32), &loader(5), &crashed, None, at, 2);
    assert_eq!(tail[0].0, 2, "the two batches left of epoch 1");
    assert_eq!(tail[1], reports[1], "epoch 2 as uninterrupted");
    assert_eq!(
        std::fs::read(&whole).unwrap(),
        std::fs::read(&crashed).unwrap()
    );
}

#[test]
fn the_number_of_workers_changes_no_bit() {
    let dir = ScratchDir::new("trainer-workers");
    let runs: Vec<Vec<u8>> = [0, 1, 3]
        .iter()
        .map(|&workers| {
            let path = dir.join(format!("workers-{workers}.ckpt"));
            train(
                &mut net(32),
                &loader(workers),
                &path,
                None,
                Position::START,
                1,
            );
            std::fs::read(path).unwrap()
        })
        .collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
}

#[test]
fn evaluation_pads_a_short_last_batch_and_counts_its_real_rows() {
    // 5 examples, evaluated 4 at a time: a batch of 4 and one of 1 padded to 4.
    // The "model" is the identity on 10 pixels, so the prediction is the brightest.
    let mut g = Graph::new();
    let images = g.placeholder("images", DType::F32, [4, 1, 1, 10]).unwrap();
    let logits = g.reshape(images, [4, 10]).unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let mut pixels = vec![0.0; 50];
    for (example, brightest) in [3, 1, 4, 1, 5].into_iter().enumerate() {
        pixels[example * 10 + brightest] = 1.0;
    }
    let labels = [3.0, 1.0, 0.0, 1.0, 5.0]; // the third is wrong
    let data = TensorDataset::new(
        &Tensor::from_f64(DType::F32, [5, 1, 1, 10], &pixels).unwrap(),
        &Tensor::from_f64(DType::I64, [5], &labels).unwrap(),
        10,
    )
    .unwrap();
    let options = LoaderOptions {
        batch_size: 4,
        shuffle: false,
        workers: 0,
        ..LoaderOptions::default()
    };
    let loader = Loader::new(Arc::new(data), options).unwrap();
    let evaluated = train::evaluate(&mut session, logits, images, &loader).unwrap();
    assert_eq!(evaluated.accuracy, 0.8);
    // Each row's logits are 1 at its brightest pixel and 0 elsewhere: -log(e / (e + 9))
    // for the four right, -log(1 / (e + 9)) for the wrong one.
    let e = std::f64::consts::E;
    let want = (4.0 * ((e + 9.0) / e).ln() + (e + 9.0).ln()) / 5.0;
    assert!(
        (evaluated.loss - want).abs() < 1e-12,
        "{} {want}",
        evaluated.loss
    );
}

#[test]
fn batches_that_do_not_fit_the_graph_are_refused_naming_the_placeholder() {
    let mut n = net(32);
    let mut trainer = trainer_of(&mut n);
    let data: Arc<dyn Dataset> = Arc::new(Mnist::synthetic(100, 1));
    for (batch, drop_last) in [(16, true), (32, false)] {
        let options = LoaderOptions {
            batch_size: batch,
            drop_last,
            workers: 0,
            ..LoaderOptions::default()
        };
        let loader = Loader::new(data.clone(), options).unwrap();
        let err = trainer
            .epoch(&loader, Position::START)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Placeholder 'images'"), "{err}");
        assert!(err.contains(&format!("[{batch}, 1, 28, 28]")), "{err}");
    }
}

#[test]
fn a_trainers_checkpoint_restores_into_a_session_without_a_trainer() {
    let dir = ScratchDir::new("trainer-plain");
    let path = dir.join("plain.ckpt");
    let mut trained = net(32);
    train(&mut trained, &loader(0), &path, None, Position::START, 1);
    let mut plain = net(32);
    plain.session.restore(&path).unwrap();
    let kernel = trained
        .session
        .graph()
        .node(trained.step.variables[0])
        .name
        .clone();
    assert_eq!(
        plain.session.variable(&kernel),
        trained.session.variable(&kernel)
    );
}

/// A loader whose epoch has no batch, and a position past the epoch's last batch (a
/// forged or foreign checkpoint), are errors: neither trains no step and reports a
/// loss of 0.
#[test]
fn an_epoch_without_a_step_is_an_error() {
    let mut n = net(32);
    let mut trainer = trainer_of(&mut n);
    let data: Arc<dyn Dataset> = Arc::new(Mnist::synthetic(20, 1));
    let options = LoaderOptions {
        batch_size: 32,
        drop_last: true,
        workers: 0,
        ..LoaderOptions::default()
    };
    let empty = Loader::new(data, options).unwrap();
    let err = trainer
        .epoch(&empty, Position::START)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("an epoch has no batch: 20 examples in batches of 32"),
        "{err}"
    );
    let full = loader(0);
    let past = Position { epoch: 1, batch: 8 };
    let err = trainer.epoch(&full, past).unwrap_err().to_string();
    assert!(
        err.contains("batch 8 of epoch 1, is past the epoch's last batch (8 batches an epoch)"),
        "{err}"
    );
}
