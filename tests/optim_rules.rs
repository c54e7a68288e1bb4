//! What the optimizers do beyond their update rules, against hand-computed values:
//! weight decay restricted to matrices, and gradients clipped to a global norm.

use std::collections::HashMap;

use ampgraph::graph::models::f32_variable;
use ampgraph::graph::ops::Init;
use ampgraph::optim::{Adam, ClipGlobalNorm, Decay, Optimizer, Sgd};
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
