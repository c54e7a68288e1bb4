//! Check-numerics on the GPU against planted overflows (tests/common/plant.rs): a step
//! on `Device::Cuda(0)` whose outputs come out non-finite, or whose loss scale backs
//! off, is re-run on the CPU from the variables before it, and the report names exactly
//! the planted node. Each test prints "skipping: <reason>" and passes without CUDA.

mod common;
#[path = "common/plant.rs"]
mod plant;

use ampgraph::graph::DType;
use ampgraph::numerics::check::{Collapse, NumericsReport, COLLAPSE_BACKOFFS};
use ampgraph::train::{Position, TrainOptions, Trainer};
use ampgraph::{Device, Session, SessionOptions};
use plant::{any_non_finite, planted_random_graph, training_net, FACTOR, PLANTED};

/// Check-numerics on, the AMP rewrite as the ground truth's, and `passes` after it
/// (`Some(vec![])`: none, so that the nodes keep their names; `None`: the CUDA
/// pipeline, whose fusions rename them).
fn checking(passes: Option<Vec<String>>) -> SessionOptions {
    SessionOptions {
        check_numerics: true,
        amp: Some(plant::amp()),
        passes,
        ..Default::default()
    }
}

fn assert_names_the_plant(report: &NumericsReport) {
    assert_eq!(report.node, PLANTED, "{report}");
    assert_eq!(report.op, "Mul", "{report}");
    assert_eq!(report.dtype, DType::F16, "{report}");
    assert!(report.output.inf > 0, "{report}");
    assert!(report.inputs.iter().all(|r| r.is_finite()), "{report}");
    assert_eq!(report.inputs[1].finite, Some((FACTOR, FACTOR)), "{report}");
    assert!(report.explanation.is_some(), "{report}");
}

#[test]
fn check_numerics_names_the_planted_node_of_random_graphs_on_the_gpu() {
    if !common::cuda_or_skip() {
        return;
    }
    let (mut planted_cases, mut reached) = (0, 0);
    for seed in 0..24u64 {
        let size = 8 + (seed as usize * 7) % 32;
        let Some((clean, planted, feeds)) = planted_random_graph(seed, size) else {
            continue;
        };
        planted_cases += 1;
        let fetches = clean.outputs().to_vec();
        let mut session =
            Session::with_options(clean, Device::Cuda(0), checking(Some(vec![]))).unwrap();
        let out = session.run(&fetches, &feeds).unwrap();
        assert!(
            !any_non_finite(&out),
            "seed {seed}: no plant, finite outputs"
        );
        assert!(session.last_numerics_report().is_none(), "seed {seed}");

        let fetches = planted.outputs().to_vec();
        let mut session =
            Session::with_options(planted, Device::Cuda(0), checking(Some(vec![]))).unwrap();
        let out = session.run(&fetches, &feeds).unwrap();
        let report = session.last_numerics_report();
        if !any_non_finite(&out) {
            assert!(report.is_none(), "seed {seed}: {report:?}");
            continue;
        }
        reached += 1;
        let report = report.unwrap_or_else(|| panic!("seed {seed}: no report"));
        assert_names_the_plant(report);
        assert_eq!(report.step, 0);
    }
    assert!(
        planted_cases >= 16 && reached >= 8,
        "{planted_cases} planted, {reached} reaching an output, of 24"
    );
}

#[test]
fn a_planted_overflow_in_gpu_training_is_named_and_collapses_the_scale() {
    if !common::cuda_or_skip() {
        return;
    }
    // Unfused, the report names the plant; with the CUDA pipeline's fusions a fused
    // node holding it makes the first non-finite value.
    for passes in [Some(vec![]), None] {
        let fused = passes.is_none();
        let (g, step, images, labels) = training_net(true, 32768.0);
        let mut session = Session::with_options(g, Device::Cuda(0), checking(passes)).unwrap();
        let mut trainer =
            Trainer::new(&mut session, step, images, labels, TrainOptions::default()).unwrap();
        let report = trainer.epoch(&plant::loader(), Position::START).unwrap();
        let halves: Vec<(u64, f64)> = (0..8)
            .map(|k| (k, 32768.0 / 2f64.powi(k as i32 + 1)))
            .collect();
        assert_eq!(trainer.loss_scale_history(), halves, "fused: {fused}");
        assert_eq!(
            report.loss_scale_alarms.len(),
            1,
            "{:?}",
            report.loss_scale_alarms
        );
        let alarm = &report.loss_scale_alarms[0];
        assert_eq!(alarm.step, COLLAPSE_BACKOFFS as u64 - 1);
        assert!(matches!(alarm.collapse, Collapse::Backoffs { .. }));
        let numerics = session.last_numerics_report().expect("a report");
        println!("{numerics}");
        assert_eq!(numerics.step, 7);
        if fused {
            assert!(numerics.output.inf + numerics.output.nan > 0, "{numerics}");
            assert!(numerics.inputs.iter().all(|r| r.is_finite()), "{numerics}");
        } else {
            assert_names_the_plant(numerics);
            let culprit = alarm.culprit.as_deref().unwrap_or_default();
            assert!(culprit.contains(&format!("'{PLANTED}'")), "{alarm}");
        }
    }
}
