//! What the optimizers do beyond their update rules, against hand-computed values and
//! equivalent steps: weight decay restricted to matrices, gradients clipped to a
//! global norm, gradients accumulated over micro-batches, learning-rate schedules.

use std::collections::HashMap;

use ampgraph::graph::format::{self, GraphDef};
use ampgraph::graph::models::f32_variable;
use ampgraph::graph::ops::Init;
use ampgraph::optim::{
    enable_mixed_precision_graph_rewrite, Accumulate, Adam, ClipGlobalNorm, Decay,
    LearningRateSchedule, LossScale, Optimizer, Sgd, STEP_VARIABLE,
};
use ampgraph::{DType, Device, Graph, Session, Tensor};

/// `loss = sum(w * c) + sum(b * d)` for a matrix `w [2, 3]` and a vector `b [3]`
/// (both starting at 1): the gradients are the constants `c` and `d`.
fn linear_loss(c: &[f64; 6], d: &[f64; 3]) -> (Graph, ampgraph::Port) {
    let mut g = Graph::new();
    let ones = |g: &mut Graph, name: &str, shape: Vec<usize>| {
        f32_variable(g, name.into(), shape, Init::Constant(1.0)).unwrap()
    };
    let w = ones(&mut g, "w", vec![2, 3]);
    let b = ones(&mut g, "b", vec![3]);
    let c = g
        .constant(Tensor::from_f64(DType::F32, vec![2, 3], c).unwrap())
        .unwrap();
    let d = g
        .constant(Tensor::from_f64(DType::F32, vec![3], d).unwrap())
        .unwrap();
    let wc = g.mul(w, c).unwrap();
    let bd = g.mul(b, d).unwrap();
    let sw = g.sum(wc, None, false).unwrap();
    let sb = g.sum(bd, None, false).unwrap();
    let loss = g.plus(sw, sb).unwrap();
    (g, loss)
}

/// One step of `optimizer`; the new `w` and `b`.
fn one_step(optimizer: &dyn Optimizer, c: &[f64; 6], d: &[f64; 3]) -> (Vec<f64>, Vec<f64>) {
    let (mut g, loss) = linear_loss(c, d);
    let step = optimizer.minimize(&mut g, loss).unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    session.run(&[step.step], &HashMap::new()).unwrap();
    let value = |name| session.variable(name).unwrap().to_f64_vec();
    (value("w"), value("b"))
}

/// With zero gradients AdamW moves a variable by its decay alone: `w (1 - lr wd)`;
/// `Decay::Matrices` leaves the vector where it was and decays the matrix the same.
#[test]
fn decay_on_matrices_leaves_biases_and_norms_alone() {
    let (lr, wd) = (0.1, 0.5);
    let zeros = ([0.0; 6], [0.0; 3]);
    let (w_all, b_all) = one_step(&Adam::adamw(lr, wd), &zeros.0, &zeros.1);
    let matrices = Adam::adamw(lr, wd).decaying(Decay::Matrices);
    let (w_mat, b_mat) = one_step(&matrices, &zeros.0, &zeros.1);
    let decayed = (1.0 - lr * wd) as f32 as f64;
    assert!(
        w_all.iter().all(|&v| (v - decayed).abs() < 1e-6),
        "{w_all:?}"
    );
    assert!(
        b_all.iter().all(|&v| (v - decayed).abs() < 1e-6),
        "{b_all:?}"
    );
    assert_eq!(w_mat, w_all);
    assert_eq!(b_mat, [1.0; 3]);
}

/// SGD at rate 1 after clipping: the gradients `(c, d)` of global norm 5 (3, 4 and
/// zeros) clipped to 2 move the variables by `(c, d) * 2 / 5`; clipped to 10 they move
/// by the gradients themselves.
#[test]
fn gradients_clip_to_the_global_norm() {
    let c = [3.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let d = [0.0, 4.0, 0.0];
    for (max_norm, factor) in [(2.0, 0.4), (10.0, 1.0)] {
        let clipped = ClipGlobalNorm::new(Sgd::new(1.0), max_norm);
        let (w, b) = one_step(&clipped, &c, &d);
        let want_w: Vec<f64> = c.iter().map(|g| 1.0 - g * factor).collect();
        let want_b: Vec<f64> = d.iter().map(|g| 1.0 - g * factor).collect();
        for (got, want) in w.iter().chain(&b).zip(want_w.iter().chain(&want_b)) {
            assert!((got - want).abs() < 1e-6, "max {max_norm}: {got} vs {want}");
        }
    }
    let bad = ClipGlobalNorm::new(Sgd::new(1.0), 0.0);
    let (mut g, loss) = linear_loss(&c, &d);
    let e = bad.minimize(&mut g, loss).unwrap_err().to_string();
    assert!(e.contains("positive finite norm"), "{e}");
}

/// Least squares `mean((x w - y)^2)` of `x [rows, 2]` against `y [rows]`, `w` starting
/// at (0.5, -0.5); the graph, its loss, and the feeds of each batch.
fn least_squares(rows: usize) -> (Graph, ampgraph::Port) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [rows, 2]).unwrap();
    let y = g.placeholder("y", DType::F32, [rows, 1]).unwrap();
    let w = g
        .constant(Tensor::from_f64(DType::F32, vec![2, 1], &[0.5, -0.5]).unwrap())
        .unwrap();
    let w0 = f32_variable(&mut g, "w".into(), vec![2, 1], Init::Zeros).unwrap();
    let w = g.plus(w0, w).unwrap();
    let p = g.matmul(x, w).unwrap();
    let e = g.sub(p, y).unwrap();
    let e2 = g.mul(e, e).unwrap();
    let loss = g.mean(e2, None, false).unwrap();
    (g, loss)
}

fn batch(rows: &[[f64; 3]]) -> HashMap<String, Tensor> {
    let x: Vec<f64> = rows.iter().flat_map(|r| [r[0], r[1]]).collect();
    let y: Vec<f64> = rows.iter().map(|r| r[2]).collect();
    HashMap::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![rows.len(), 2], &x).unwrap(),
        ),
        (
            "y".to_string(),
            Tensor::from_f64(DType::F32, vec![rows.len(), 1], &y).unwrap(),
        ),
    ])
}

/// Accumulating over two micro-batches of two rows moves the weights as one step on
/// the four rows (the mean of two half-batch means is the whole batch's), and the
/// first micro-step moves nothing; twice over, with momentum.
#[test]
fn accumulation_over_micro_batches_steps_as_the_whole_batch() {
    let rows = [
        [1.0, 2.0, 0.5],
        [-1.0, 0.5, 1.0],
        [2.0, -1.0, -0.5],
        [0.5, 0.5, 2.0],
    ];
    let (mut whole, loss) = least_squares(4);
    let step = Sgd::momentum(0.1, 0.9).minimize(&mut whole, loss).unwrap();
    let mut whole = Session::new(whole, Device::Cpu).unwrap();
    let (mut micro, loss) = least_squares(2);
    let accumulated = ClipGlobalNorm::new(Sgd::momentum(0.1, 0.9), 1e9);
    let micro_step = Accumulate::new(accumulated, 2)
        .minimize(&mut micro, loss)
        .unwrap();
    let mut micro = Session::new(micro, Device::Cpu).unwrap();
    let w = |s: &Session| s.variable("w").unwrap().to_f64_vec();
    for _ in 0..2 {
        whole.run(&[step.step], &batch(&rows)).unwrap();
        let before = w(&micro);
        micro.run(&[micro_step.step], &batch(&rows[..2])).unwrap();
        assert_eq!(w(&micro), before, "the first micro-step applies nothing");
        micro.run(&[micro_step.step], &batch(&rows[2..])).unwrap();
        for (a, b) in w(&whole).iter().zip(w(&micro)) {
            assert!((a - b).abs() < 1e-6, "{:?} vs {:?}", w(&whole), w(&micro));
        }
    }
    assert_ne!(w(&whole), [0.0, 0.0]);
}

/// Plain SGD at peak rate 0.1 with a warmup of 2 steps and a cosine to 0.1 of the
/// peak at step 5: with constant gradients `c` each step moves `w` by `0.1 f_s c`,
/// the factors by hand 0.5, 1, 1, 0.775 (cos(pi/3)), 0.325 (cos(2pi/3)), then 0.1.
/// The same graph written to JSON and read back takes the same steps.
#[test]
fn scheduled_rates_follow_the_warmup_and_the_cosine() {
    let factors = [0.5, 1.0, 1.0, 0.775, 0.325, 0.1, 0.1];
    let c = [1.0, -2.0, 0.5, 0.0, 3.0, -1.0];
    let d = [0.25, 0.0, -4.0];
    let (mut g, loss) = linear_loss(&c, &d);
    let sgd = Sgd::new(0.1).scheduled(LearningRateSchedule::warmup_cosine(2, 5, 0.1));
    let step = sgd.minimize(&mut g, loss).unwrap();
    let json = format::to_json(&GraphDef::from_graph(&g));
    assert!(json.contains("LearningRateSchedule") && json.contains("\"scheduled\""));
    let reread = format::graph_from_bytes(json.as_bytes()).unwrap();
    for graph in [g, reread] {
        let mut session = Session::new(graph, Device::Cpu).unwrap();
        let mut moved = 0.0;
        for (k, f) in factors.iter().enumerate() {
            session.run(&[step.step], &HashMap::new()).unwrap();
            moved += 0.1 * f;
            let w = session.variable("w").unwrap().to_f64_vec();
            let b = session.variable("b").unwrap().to_f64_vec();
            for (got, grad) in w.iter().chain(&b).zip(c.iter().chain(&d)) {
                let want = 1.0 - moved * grad;
                assert!((got - want).abs() < 1e-6, "step {k}: {got} vs {want}");
            }
        }
        let count = session.variable(STEP_VARIABLE).unwrap().to_f64_vec();
        assert_eq!(count, [factors.len() as f64]);
    }
}

/// A step skipped for an overflow does not advance the schedule: with a loss scale
/// that makes the gradient of magnitude 4 overflow f32, nothing moves and the count
/// stays at 0; a scale that fits takes the schedule's first step (factor 0.5 of 0.1).
#[test]
fn skipped_steps_do_not_advance_the_schedule() {
    let c = [1.0, -2.0, 0.5, 0.0, 3.0, -1.0];
    let d = [0.25, 0.0, -4.0];
    let schedule = LearningRateSchedule::warmup_linear(2, 4, 0.0);
    let run = |scale: f64| {
        let (mut g, loss) = linear_loss(&c, &d);
        let step = enable_mixed_precision_graph_rewrite(Sgd::new(0.1).scheduled(schedule))
            .with_loss_scale(LossScale::Fixed(scale))
            .minimize(&mut g, loss)
            .unwrap();
        let mut session = Session::new(g, Device::Cpu).unwrap();
        session.run(&[step.step], &HashMap::new()).unwrap();
        let w = session.variable("w").unwrap().to_f64_vec();
        (w, session.variable(STEP_VARIABLE).unwrap().to_f64_vec())
    };
    let (w, count) = run(3e38);
    assert_eq!((w, count), (vec![1.0; 6], vec![0.0]));
    let (w, count) = run(1.0);
    assert_eq!(count, [1.0]);
    for (got, grad) in w.iter().zip(&c) {
        assert!((got - (1.0 - 0.05 * grad)).abs() < 1e-3, "{got}");
    }
}

#[test]
fn schedules_that_cannot_be_are_refused_when_built() {
    let (mut g, loss) = linear_loss(&[0.0; 6], &[0.0; 3]);
    let bad = Adam::adamw(1e-3, 0.0).scheduled(LearningRateSchedule::warmup_cosine(10, 5, 0.0));
    let e = bad.minimize(&mut g, loss).unwrap_err().to_string();
    assert!(e.contains("shorter than its warmup"), "{e}");
}
