//! Check-numerics and the loss-scale monitor on the CPU, against planted overflows: a
//! `Mul` by 65504 after a node whose f16 values pass 1 (tests/common/plant.rs), the
//! first value of the step that is not finite. Check-numerics must name exactly that
//! node, nothing without it; a training step whose loss scale backs off because of it
//! names it too, and the monitor warns after the configured backoffs in a row.

mod common;
#[path = "common/plant.rs"]
mod plant;

use std::cell::Cell;
use std::path::PathBuf;

use common::ScratchDir;
use std::process::Command;

use ampgraph::graph::format;
use ampgraph::graph::{DType, Graph};
use ampgraph::numerics::check::{Collapse, NumericsReport, Trigger, COLLAPSE_BACKOFFS};
use ampgraph::train::{EpochReport, Position, TrainOptions, Trainer};
use ampgraph::{Device, Session, SessionOptions};
use plant::{any_non_finite, planted_random_graph, training_net, FACTOR, PLANTED};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRng, TestRunner};

fn checking() -> SessionOptions {
    SessionOptions {
        check_numerics: true,
        amp: Some(plant::amp()),
        ..Default::default()
    }
}

/// What a report on the plant must say.
fn check_names_the_plant(report: &NumericsReport) -> Result<(), TestCaseError> {
    prop_assert_eq!(&report.node, PLANTED, "{}", report);
    prop_assert_eq!(&report.op, "Mul");
    prop_assert_eq!(report.dtype, DType::F16);
    prop_assert!(report.output.inf > 0, "{}", report);
    prop_assert!(report.inputs.iter().all(|r| r.is_finite()), "{}", report);
    let factor = report.inputs[1].finite;
    prop_assert_eq!(factor, Some((FACTOR, FACTOR)));
    let why = report.explanation.as_deref().unwrap_or_default();
    prop_assert!(why.contains(&format!("'{PLANTED}'")), "{}", report);
    Ok(())
}

#[test]
fn check_numerics_names_the_planted_node_of_random_graphs() {
    let (planted_cases, reached) = (Cell::new(0), Cell::new(0));
    // A fixed seed: the count of graphs whose infinity reaches an output is a property
    // of the sample, which a random seed made flaky (7 of 24 once, against 8 wanted).
    let config = Config::with_cases(24);
    let rng = TestRng::deterministic_rng(config.rng_algorithm);
    let mut runner = TestRunner::new_with_rng(config, rng);
    runner
        .run(&(any::<u64>(), 8usize..40), |(seed, size)| {
            let Some((clean, planted, feeds)) = planted_random_graph(seed, size) else {
                return Ok(());
            };
            planted_cases.set(planted_cases.get() + 1);
            // Without the plant, every value is finite: no report.
            let fetches = clean.outputs().to_vec();
            let mut session = Session::with_options(clean, Device::Cpu, checking()).unwrap();
            let out = session.run(&fetches, &feeds).unwrap();
            prop_assert!(!any_non_finite(&out));
            prop_assert!(session.last_numerics_report().is_none());

            let fetches = planted.outputs().to_vec();
            let mut session = Session::with_options(planted, Device::Cpu, checking()).unwrap();
            let out = session.run(&fetches, &feeds).unwrap();
            let report = session.last_numerics_report();
            if !any_non_finite(&out) {
                // The infinity was squashed on its way (tanh, relu6, a minimum): the
                // step looks right, and is not looked into.
                prop_assert!(report.is_none(), "{:?}", report);
                return Ok(());
            }
            reached.set(reached.get() + 1);
            let report = report.expect("a report where the outputs are not finite");
            check_names_the_plant(report)?;
            prop_assert_eq!(report.step, 0);
            let fetch_trigger = matches!(report.trigger, Some(Trigger::NonFiniteFetch { .. }));
            prop_assert!(fetch_trigger, "{:?}", report.trigger);
            Ok(())
        })
        .unwrap();
    // Most graphs have a node reaching past 1 and pass its infinity to an output.
    assert!(
        planted_cases.get() >= 16 && reached.get() >= 8,
        "{} planted, {} reaching an output, of 24",
        planted_cases.get(),
        reached.get()
    );
}

/// One epoch of the training net (8 steps) in a session with `options`.
fn train_epoch(
    planted: bool,
    initial_scale: f64,
    options: SessionOptions,
) -> (Session, EpochReport, Vec<(u64, f64)>) {
    let (g, step, images, labels) = training_net(planted, initial_scale);
    let mut session = Session::with_options(g, Device::Cpu, options).unwrap();
    let mut trainer =
        Trainer::new(&mut session, step, images, labels, TrainOptions::default()).unwrap();
    let report = trainer.epoch(&plant::loader(), Position::START).unwrap();
    let history = trainer.loss_scale_history().to_vec();
    (session, report, history)
}

#[test]
fn a_planted_overflow_backs_the_loss_scale_off_and_check_numerics_names_it() {
    let (session, report, history) = train_epoch(true, 32768.0, checking());
    assert_eq!(report.steps, 8);
    // Every step overflows: the scale halves after each, and the history holds it.
    let halves: Vec<(u64, f64)> = (0..8)
        .map(|k| (k, 32768.0 / 2f64.powi(k as i32 + 1)))
        .collect();
    assert_eq!(history, halves);
    let numerics = session.last_numerics_report().expect("a report");
    check_names_the_plant(numerics).unwrap();
    assert_eq!(numerics.step, 7, "the last step's report");
    println!("{numerics}");
    // One warning, at the configured number of backoffs in a row, naming the plant.
    assert_eq!(
        report.loss_scale_alarms.len(),
        1,
        "{:?}",
        report.loss_scale_alarms
    );
    let alarm = &report.loss_scale_alarms[0];
    assert_eq!(alarm.step, COLLAPSE_BACKOFFS as u64 - 1);
    assert_eq!(
        alarm.collapse,
        Collapse::Backoffs {
            count: COLLAPSE_BACKOFFS,
            from: 32768.0
        }
    );
    let culprit = alarm.culprit.as_deref().unwrap_or_default();
    assert!(
        culprit.contains(&format!("'{PLANTED}' (Mul, f16)")),
        "{alarm}"
    );
    assert!(
        culprit.starts_with(&format!("step {}:", alarm.step)),
        "{alarm}"
    );
}

#[test]
fn a_scale_falling_to_one_warns_and_without_the_mode_names_no_op() {
    let (session, report, history) = train_epoch(true, 8.0, SessionOptions::default());
    // The scale stops at 1, where every step is still skipped.
    let scales: Vec<f64> = history.iter().map(|h| h.1).collect();
    assert_eq!(scales, [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    assert!(session.last_numerics_report().is_none(), "the mode is off");
    let alarms: Vec<_> = report
        .loss_scale_alarms
        .iter()
        .map(|a| (a.step, a.collapse.clone(), a.culprit.clone()))
        .collect();
    assert_eq!(
        alarms,
        [
            (2, Collapse::BelowOne, None),
            (
                COLLAPSE_BACKOFFS as u64 - 1,
                Collapse::Backoffs {
                    count: COLLAPSE_BACKOFFS,
                    from: 8.0
                },
                None
            ),
        ]
    );
    assert!(report.loss_scale_alarms[0]
        .to_string()
        .contains("AMPGRAPH_CHECK_NUMERICS=1"));
}

#[test]
fn a_healthy_training_run_keeps_its_scale_and_reports_nothing() {
    let (session, report, history) = train_epoch(false, 32768.0, checking());
    assert!(report.loss.is_finite());
    assert_eq!(history, (0..8).map(|k| (k, 32768.0)).collect::<Vec<_>>());
    assert!(report.loss_scale_alarms.is_empty());
    assert!(session.last_numerics_report().is_none());
}

/// x[2,3] @ w[3,3] -> planted (x 65504) -> relu -> output, marked for f16 AMP, as a
/// JSON file in `dir`.
fn planted_cli_graph(dir: &ScratchDir) -> PathBuf {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 3]).unwrap();
    let w = g.placeholder("w", DType::F32, [3, 3]).unwrap();
    let mm = g.matmul(x, w).unwrap();
    let relu = g
        .add(
            ampgraph::graph::ops::Unary::new(ampgraph::graph::ops::UnaryKind::Relu),
            &[mm],
        )
        .unwrap();
    g.set_outputs(vec![relu]).unwrap();
    plant::plant(&mut g, mm.node);
    g.mixed_precision = Some(DType::F16);
    let path = dir.join("planted.json");
    std::fs::write(&path, format::to_json(&format::GraphDef::from_graph(&g))).unwrap();
    path
}

const FEEDS: &str =
    r#"{"x": [[1, 2, 0.5], [0.25, -1, 1]], "w": [[1, 0, 0.5], [0, 1, 0], [0.5, 0.5, 1]]}"#;

fn run_cli(path: &PathBuf, flag: Option<&str>, env: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ampgraph"));
    cmd.arg("run")
        .arg(path)
        .args(["--device", "cpu", "--feeds", FEEDS]);
    cmd.args(flag);
    cmd.env_remove("AMPGRAPH_CHECK_NUMERICS");
    if let Some(v) = env {
        cmd.env("AMPGRAPH_CHECK_NUMERICS", v);
    }
    cmd.output().unwrap()
}

#[test]
fn the_cli_fails_naming_the_planted_node() {
    let dir = ScratchDir::new("numerics");
    let path = planted_cli_graph(&dir);
    let off = run_cli(&path, None, None);
    assert!(off.status.success(), "{off:?}");
    assert!(
        String::from_utf8_lossy(&off.stdout).contains("inf"),
        "{off:?}"
    );
    for (flag, env) in [(Some("--check-numerics"), None), (None, Some("1"))] {
        let out = run_cli(&path, flag, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(
            errors[0].starts_with("error: check-numerics: step 0: node 'planted' (Mul, f16)"),
            "{stderr}"
        );
        // The report: the inputs' and output's ranges and why the node is in f16.
        assert!(stderr.contains("input 0: 'matmul' f16[2, 3]"), "{stderr}");
        assert!(stderr.contains("output: 'planted' f16[2, 3]"), "{stderr}");
        assert!(stderr.contains("why f16:"), "{stderr}");
    }
}
