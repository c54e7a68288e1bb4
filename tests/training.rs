//! Training: dynamic loss scaling in the graph, optimizers, checkpoints, inference
//! sessions, and a short MNIST run with and without AMP.

use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::autodiff::gradients;
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::{
    AllFinite, Binary, BinaryKind, Concat, Const, Epilogue, FusedMatMul, FusedSoftmax, Init,
    LayerNormGrad, NormGradEpilogue, OptimizerUpdate, Reduce, ReduceKind, Rule, Slice, Unary,
    UnaryKind, Variable,
};
use ampgraph::graph::{DType, Graph, Port, Tensor, TensorType};
use ampgraph::optim::{
    enable_mixed_precision_graph_rewrite, Adam, LossScale, Optimizer, RuleOptimizer, Sgd,
    TrainStep, GOOD_STEPS_VARIABLE, LOSS_SCALE_VARIABLE,
};
use ampgraph::session::SessionError;
use ampgraph::{Device, Session, SessionOptions};

mod common;

const BATCH: usize = 8;

/// x[8,4] -> dense 16 tanh -> dense 3 -> cross-entropy.
fn model() -> (Graph, Port, Port, Port) {
    model_with(Activation::Tanh)
}

/// x[8,4] -> dense 16 `act` -> dense 3 -> cross-entropy.
fn model_with(act: Activation) -> (Graph, Port, Port, Port) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, 4]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let h = nn::dense(&mut g, x, 16, Some(act)).unwrap();
    let logits = nn::dense(&mut g, h, 3, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    g.set_outputs(vec![logits]).unwrap();
    (g, loss, logits, labels)
}

fn feeds(step: u64, poison: Option<f32>) -> Feeds {
    let mut x: Vec<f64> = (0..BATCH * 4)
        .map(|i| (((i as u64 * 7 + step * 13) % 17) as f64 - 8.0) / 8.0)
        .collect();
    if let Some(p) = poison {
        x[5] = p as f64;
    }
    let labels: Vec<f64> = (0..BATCH).map(|i| ((i as u64 + step) % 3) as f64).collect();
    Feeds::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![BATCH, 4], &x).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, vec![BATCH], &labels).unwrap(),
        ),
    ])
}

fn amp_session(loss_scale: LossScale) -> (Session, TrainStep) {
    let (mut g, loss, _, _) = model();
    let opt =
        enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9)).with_loss_scale(loss_scale);
    let step = opt.minimize(&mut g, loss).unwrap();
    assert_eq!(g.mixed_precision, Some(DType::F16));
    let session = Session::new(g, Device::Cpu).unwrap();
    (session, step)
}

fn scalar(s: &Session, name: &str) -> f64 {
    s.variable(name).unwrap().to_f64_vec()[0]
}

/// Every variable except the loss-scale state.
fn weights_and_slots(s: &Session) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = s
        .graph()
        .node_ids()
        .map(|id| s.graph().node(id).name.clone())
        .filter(|n| s.variable(n).is_some() && !n.starts_with("loss_scale/"))
        .map(|n| (n.clone(), s.variable(&n).unwrap().clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn dynamic(initial: f64, growth_interval: i64) -> LossScale {
    LossScale::Dynamic {
        initial,
        growth_interval,
        growth_factor: 2.0,
        backoff_factor: 0.5,
    }
}

#[test]
fn non_finite_gradients_skip_the_step_and_halve_the_scale() {
    let (mut s, step) = amp_session(dynamic(1024.0, 1000));
    // The AMP pass ran: the matrix products are f16.
    assert!(s
        .graph()
        .node_ids()
        .any(|id| s.graph().node(id).outputs()[0].dtype == DType::F16));
    s.run(&[step.step], &feeds(0, None)).unwrap();
    s.run(&[step.step], &feeds(1, None)).unwrap();
    assert_eq!(scalar(&s, GOOD_STEPS_VARIABLE), 2.0);
    for (i, poison) in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        let before = weights_and_slots(&s);
        assert!(before
            .iter()
            .any(|(n, t)| n.ends_with("/momentum") && t.to_f64_vec().iter().any(|&v| v != 0.0)));
        let scale = scalar(&s, LOSS_SCALE_VARIABLE);
        s.run(&[step.step], &feeds(2 + i as u64, Some(poison)))
            .unwrap();
        // Weights and momentum slots unchanged bit for bit; scale halved; count reset.
        assert_eq!(
            weights_and_slots(&s),
            before,
            "step with {poison} changed the weights"
        );
        assert_eq!(scalar(&s, LOSS_SCALE_VARIABLE), scale / 2.0);
        assert_eq!(scalar(&s, GOOD_STEPS_VARIABLE), 0.0);
    }
    // A finite step applies again.
    let before = weights_and_slots(&s);
    s.run(&[step.step], &feeds(9, None)).unwrap();
    assert_ne!(weights_and_slots(&s), before);
}

/// Batch norm in training reads its moving statistics where no gradient flows: the
/// optimizers train its scale and offset and leave the statistics alone (no update,
/// no slots), as TensorFlow's untrainable variables, weight decay or not, with and
/// without loss scaling.
#[test]
fn batch_norms_moving_statistics_are_not_trained() {
    for loss_scale in [LossScale::None, dynamic(1024.0, 2)] {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [BATCH, 4]).unwrap();
        let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
        let h = nn::dense(&mut g, x, 6, None).unwrap();
        let bn = nn::batch_norm_layer(&mut g, h, true).unwrap();
        let h = g.relu(bn.output).unwrap();
        let logits = nn::dense(&mut g, h, 3, None).unwrap();
        let loss = g.softmax_cross_entropy(logits, labels).unwrap();
        g.set_outputs(vec![logits]).unwrap();
        let sgd = RuleOptimizer {
            weight_decay: 0.1,
            ..Sgd::momentum(0.1, 0.9)
        };
        let step = enable_mixed_precision_graph_rewrite(sgd)
            .with_loss_scale(loss_scale)
            .minimize(&mut g, loss)
            .unwrap();
        let case = format!("{loss_scale:?}");
        let trained = |id| step.variables.contains(&id);
        assert!(trained(bn.scale.node) && trained(bn.offset.node), "{case}");
        assert!(!trained(bn.moving_mean.node), "{case}");
        assert!(!trained(bn.moving_variance.node), "{case}");
        assert_eq!(
            step.variables.len(),
            6,
            "{case}: two dense layers, scale, offset"
        );
        let mut s = Session::new(g, Device::Cpu).unwrap();
        let value = |s: &Session, name: &str| s.variable(name).unwrap().to_f64_vec();
        let scale = value(&s, "batch_norm/scale");
        for k in 0..2 {
            s.run(&[step.step], &feeds(k, None)).unwrap();
        }
        assert_eq!(value(&s, "batch_norm/moving_mean"), vec![0.0; 6], "{case}");
        assert_eq!(
            value(&s, "batch_norm/moving_variance"),
            vec![1.0; 6],
            "{case}"
        );
        assert_ne!(value(&s, "batch_norm/scale"), scale, "{case}");
        let slots = s
            .graph()
            .node_ids()
            .map(|id| s.graph().node(id).name.clone());
        let slots: Vec<String> = slots
            .filter(|n| n.starts_with("batch_norm/moving_"))
            .collect();
        assert!(
            slots
                .iter()
                .all(|n| n == "batch_norm/moving_mean" || n == "batch_norm/moving_variance"),
            "{case}: {slots:?}"
        );
        // A checkpoint written when the statistics were trained holds their momentum
        // slots: they are passed over, the rest restored. An unknown slot of a trained
        // variable is still refused.
        let dir = std::env::temp_dir().join(format!("ampgraph-bn-slots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let names = s
            .graph()
            .node_ids()
            .map(|id| s.graph().node(id).name.clone());
        let mut saved: Vec<(String, Tensor)> = names
            .filter_map(|n| s.variable(&n).map(|t| (n.clone(), t.clone())))
            .collect();
        let zeros = Tensor::from_f64(DType::F32, vec![6], &[0.0; 6]).unwrap();
        for stat in ["moving_mean", "moving_variance"] {
            saved.push((format!("batch_norm/{stat}/momentum"), zeros.clone()));
        }
        let old = dir.join("old.ckpt");
        ampgraph::checkpoint::write(&old, &saved).unwrap();
        let kept = value(&s, "batch_norm/scale");
        s.run(&[step.step], &feeds(7, None)).unwrap();
        s.restore(&old).unwrap();
        assert_eq!(value(&s, "batch_norm/scale"), kept, "{case}");
        saved.push(("batch_norm/scale/velocity".into(), zeros.clone()));
        let bad = dir.join("bad.ckpt");
        ampgraph::checkpoint::write(&bad, &saved).unwrap();
        let err = s.restore(&bad).unwrap_err().to_string();
        assert!(
            err.contains("'batch_norm/scale/velocity' is not in the graph"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn scale_grows_after_the_interval_and_never_drops_below_one() {
    let (mut s, step) = amp_session(dynamic(4.0, 3));
    for k in 1..=2 {
        s.run(&[step.step], &feeds(k, None)).unwrap();
        assert_eq!(scalar(&s, GOOD_STEPS_VARIABLE), k as f64);
        assert_eq!(scalar(&s, LOSS_SCALE_VARIABLE), 4.0);
    }
    s.run(&[step.step], &feeds(3, None)).unwrap();
    assert_eq!(scalar(&s, LOSS_SCALE_VARIABLE), 8.0);
    assert_eq!(scalar(&s, GOOD_STEPS_VARIABLE), 0.0);
    for k in 0..5 {
        s.run(&[step.step], &feeds(k, Some(f32::NAN))).unwrap();
    }
    assert_eq!(scalar(&s, LOSS_SCALE_VARIABLE), 1.0);
}

#[test]
fn tensorflow_default_loss_scale() {
    let (s, step) = amp_session(LossScale::default());
    assert_eq!(scalar(&s, LOSS_SCALE_VARIABLE), 32768.0);
    assert!(step.loss_scale.is_some());
    let update = s
        .graph()
        .node_ids()
        .find(|&id| s.graph().node(id).op.name() == "LossScaleUpdate")
        .unwrap();
    let attrs = s.graph().node(update).op.attrs();
    assert!(attrs
        .iter()
        .any(|(k, v)| *k == "growth_interval" && *v == 2000i64.into()));
}

#[test]
fn fixed_scale_skips_non_finite_steps_too() {
    let (mut s, step) = amp_session(LossScale::Fixed(128.0));
    assert!(s.variable(LOSS_SCALE_VARIABLE).is_none());
    assert!(step.loss_scale.is_none());
    s.run(&[step.step], &feeds(0, None)).unwrap();
    let before = weights_and_slots(&s);
    s.run(&[step.step], &feeds(1, Some(f32::INFINITY))).unwrap();
    assert_eq!(weights_and_slots(&s), before);
}

/// `LossScale::None` (bf16 as PyTorch trains it without a GradScaler): no scale, no
/// finiteness check in the graph; a finite step moves the weights as a scale of 1
/// does, and a non-finite one is applied too.
#[test]
fn no_loss_scale_checks_nothing_and_applies_every_step() {
    let (mut none, step) = amp_session(LossScale::None);
    let (mut one, one_step) = amp_session(LossScale::Fixed(1.0));
    assert!(step.loss_scale.is_none());
    let ops = |s: &Session| -> Vec<String> {
        let g = s.graph();
        g.node_ids()
            .map(|id| g.node(id).op.name().to_string())
            .collect()
    };
    assert!(!ops(&none).iter().any(|n| n == "AllFinite"));
    assert!(ops(&one).iter().any(|n| n == "AllFinite"));
    none.run(&[step.step], &feeds(0, None)).unwrap();
    one.run(&[one_step.step], &feeds(0, None)).unwrap();
    assert_eq!(weights_and_slots(&none), weights_and_slots(&one));
    let before = weights_and_slots(&none);
    none.run(&[step.step], &feeds(1, Some(f32::INFINITY)))
        .unwrap();
    assert_ne!(weights_and_slots(&none), before, "the step was applied");
}

#[test]
fn resumed_training_is_bit_identical() {
    let dir = std::env::temp_dir().join(format!("ampgraph_ckpt_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("model.ckpt");
    let (mut a, step) = amp_session(dynamic(1024.0, 2));
    for k in 0..3 {
        a.run(&[step.step], &feeds(k, None)).unwrap();
    }
    a.save(&ckpt).unwrap();
    for k in 3..6 {
        a.run(
            &[step.step],
            &feeds(k, if k == 4 { Some(f32::NAN) } else { None }),
        )
        .unwrap();
    }
    // A session initialised from another seed, restored, then the same steps.
    let (mut g, loss, _, _) = model();
    let opt = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9))
        .with_loss_scale(dynamic(1024.0, 2));
    let step_b = opt.minimize(&mut g, loss).unwrap();
    let mut b = Session::with_options(
        g,
        Device::Cpu,
        SessionOptions {
            seed: 99,
            ..Default::default()
        },
    )
    .unwrap();
    assert_ne!(weights_and_slots(&a), weights_and_slots(&b));
    b.restore(&ckpt).unwrap();
    for k in 3..6 {
        b.run(
            &[step_b.step],
            &feeds(k, if k == 4 { Some(f32::NAN) } else { None }),
        )
        .unwrap();
    }
    assert_eq!(weights_and_slots(&a), weights_and_slots(&b));
    assert_eq!(
        scalar(&a, LOSS_SCALE_VARIABLE),
        scalar(&b, LOSS_SCALE_VARIABLE)
    );
    assert_eq!(
        scalar(&a, GOOD_STEPS_VARIABLE),
        scalar(&b, GOOD_STEPS_VARIABLE)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fusion passes run per set of fetches: training with them computes bitwise
/// what training without them does (the CPU runs fused nodes exactly), a skipped
/// non-finite step included, and a fetched tensor inside a fused group is still there.
/// For each rule: the unscaling folded into the updates (`unscale-into-update`)
/// multiplies as the separate products did.
/// Trains `model` (graph, loss, logits) under AMP with `optimizer` for five steps (the
/// third poisoned with an infinity) without passes and with the simplification and
/// CUDA pipelines, asserts that both train bit for bit alike (loss, logits, weights,
/// slots and loss scale), and returns the graph the pipeline's session ran.
fn assert_trains_alike_with_the_passes(
    model: impl Fn() -> (Graph, Port, Port),
    optimizer: &RuleOptimizer,
    what: &str,
) -> Graph {
    let session = |passes: &[&str]| {
        let (mut g, loss, logits) = model();
        let opt = enable_mixed_precision_graph_rewrite(optimizer.clone())
            .with_loss_scale(dynamic(1024.0, 2));
        let step = opt.minimize(&mut g, loss).unwrap();
        let options = SessionOptions {
            passes: Some(passes.iter().map(|p| p.to_string()).collect()),
            ..Default::default()
        };
        let s = Session::with_options(g, Device::Cpu, options).unwrap();
        (s, vec![step.step, step.loss, logits])
    };
    // Bit for bit; a poisoned step's Relu logits are NaN on both sides.
    let (plain, fused, fused_fetch) =
        common::assert_same_bits_through_the_pipelines(session, feeds, what);
    assert_eq!(weights_and_slots(&plain), weights_and_slots(&fused));
    assert_eq!(
        scalar(&plain, LOSS_SCALE_VARIABLE),
        scalar(&fused, LOSS_SCALE_VARIABLE)
    );
    fused.graph_for(&fused_fetch).clone()
}

#[test]
fn training_with_the_fusion_passes_is_bit_identical() {
    let runs = [
        (Activation::Tanh, Sgd::momentum(0.1, 0.9)),
        (
            Activation::Tanh,
            Sgd::nesterov(0.1, 0.9).with_weight_decay(0.01),
        ),
        (Activation::Tanh, Adam::new(0.01)),
        (Activation::Tanh, Adam::adamw(0.01, 0.1)),
        (Activation::Tanh, Adam::lamb(0.01, 0.01)),
        (Activation::Relu, Sgd::momentum(0.1, 0.9)),
    ];
    for (act, optimizer) in runs {
        let model = || {
            let (g, loss, logits, _) = model_with(act);
            (g, loss, logits)
        };
        let what = format!("{act:?}, {optimizer:?}");
        let ran = assert_trains_alike_with_the_passes(model, &optimizer, &what);
        // The passes did fire.
        let count = |op: &str| {
            ran.node_ids()
                .filter(|&id| ran.node(id).op_name() == op)
                .count()
        };
        // The hidden layer's product takes its bias; the logits' bias is added in f32
        // after a cast (the loss is denylisted), so it fuses with that cast instead.
        // A Relu's gradient reads the Relu's output, so the pre-activation need not be
        // kept and the Relu folds into the product too (Tanh's gradient needs it).
        assert_eq!(count("FusedMatMul"), 1);
        let epilogues: Vec<Epilogue> = ran
            .node_ids()
            .filter_map(|id| ran.node(id).op.downcast_ref::<FusedMatMul>())
            .map(|f| f.epilogue)
            .collect();
        let (want_epilogue, unary) = match act {
            Activation::Relu => (Epilogue::BiasRelu, "Relu"),
            _ => (Epilogue::Bias, "Tanh"),
        };
        assert_eq!(epilogues, [want_epilogue], "{act:?}");
        assert_eq!(
            count(unary),
            usize::from(act != Activation::Relu),
            "{act:?}"
        );
        assert!(count("FusedElementwise") > 0);
        // The loss and its gradient in one op (the fetched loss included).
        assert_eq!(count("SoftmaxCrossEntropyWithGrad"), 1);
        assert_eq!(count("SoftmaxCrossEntropyGrad"), 0);
        let unscaling_folded = ran.node_ids().all(|id| {
            let op = &ran.node(id).op;
            op.downcast_ref::<OptimizerUpdate>()
                .is_none_or(|u| u.grad_scale)
                && op.downcast_ref::<AllFinite>().is_none_or(|a| a.scaled)
        });
        assert!(unscaling_folded, "{optimizer:?}");
        // The small variables' updates share nodes (LAMB's need their own norms).
        let lamb = matches!(optimizer.rule, Rule::Lamb { .. });
        assert_eq!(count("GroupedOptimizerUpdate") > 0, !lamb, "{optimizer:?}");
    }

    let (g, _, _, _) = model();
    let options = SessionOptions {
        passes: Some(vec!["fuse".into(), "no-such-pass".into()]),
        ..Default::default()
    };
    let err = Session::with_options(g, Device::Cpu, options)
        .err()
        .unwrap();
    assert!(err.to_string().contains("'no-such-pass'"), "{err}");
}

/// x[8,4] -> dense 6 -> two pre-LN residual blocks `x + dense(gelu(dense(LN(x))))`
/// -> LayerNorm -> dense 3 -> cross-entropy: each block's LayerNorm gradient is added
/// to the gradient along the residual.
fn pre_ln_model() -> (Graph, Port, Port) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, 4]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let mut h = nn::dense(&mut g, x, 6, None).unwrap();
    let layer_norm = |g: &mut Graph, x: Port, k: usize| {
        let ty = TensorType::new(DType::F32, vec![6]);
        let param = |g: &mut Graph, name: &str, init: Init| -> Port {
            let v = Variable::with_init(ty.clone(), init);
            g.add_node(format!("ln_{k}/{name}"), Box::new(v), &[])
                .unwrap()
                .into()
        };
        let gamma = param(g, "gamma", Init::Constant(1.0));
        let beta = param(g, "beta", Init::Zeros);
        g.layer_norm(x, gamma, beta, 1, 1e-5).unwrap()
    };
    for k in 0..2 {
        let n = layer_norm(&mut g, h, k);
        let wide = nn::dense(&mut g, n, 12, Some(Activation::Gelu)).unwrap();
        let back = nn::dense(&mut g, wide, 6, None).unwrap();
        h = g.plus(h, back).unwrap();
    }
    let n = layer_norm(&mut g, h, 2);
    let logits = nn::dense(&mut g, n, 3, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    g.set_outputs(vec![logits]).unwrap();
    (g, loss, logits)
}

/// AMP training of a pre-LN residual model: the pipeline (the LayerNorm gradients'
/// epilogue included) trains bit for bit as the unfused graph, a skipped step too.
#[test]
fn pre_ln_training_with_the_norm_grad_epilogue_is_bit_identical() {
    let optimizer = Sgd::momentum(0.1, 0.9);
    let ran = assert_trains_alike_with_the_passes(pre_ln_model, &optimizer, "pre-LN");
    // Both blocks' LayerNorm gradients took the Add and the bias gradient's sum.
    let epilogues: Vec<NormGradEpilogue> = ran
        .node_ids()
        .filter_map(|id| ran.node(id).op.downcast_ref::<LayerNormGrad>())
        .map(|ln| ln.epilogue)
        .filter(|e| e.residual)
        .collect();
    assert_eq!(epilogues.len(), 2, "{epilogues:?}");
    assert!(epilogues.iter().all(|e| e.sum_dx), "{epilogues:?}");
}

/// x[8,4] -> dense 8 = h -> causal self-attention over the 8 rows,
/// `softmax(h h^T * 0.25 + mask) h` -> dense 3 -> cross-entropy: the masked softmax is
/// not fused attention, and its scaled, masked scores are the prologue.
fn masked_attention_model() -> (Graph, Port, Port) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, 4]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let h = nn::dense(&mut g, x, 8, None).unwrap();
    let scores = g.matmul_t(h, h, false, true).unwrap();
    let quarter = g.scalar(DType::F32, 0.25).unwrap();
    let scaled = g.mul(scores, quarter).unwrap();
    let mask: Vec<f64> = (0..BATCH * BATCH)
        .map(|i| if i % BATCH > i / BATCH { -1e4 } else { 0.0 })
        .collect();
    let mask = g
        .constant(Tensor::from_f64(DType::F32, vec![BATCH, BATCH], &mask).unwrap())
        .unwrap();
    let masked = g.plus(scaled, mask).unwrap();
    let p = g.softmax(masked, -1).unwrap();
    let context = g.matmul(p, h).unwrap();
    let logits = nn::dense(&mut g, context, 3, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    g.set_outputs(vec![logits]).unwrap();
    (g, loss, logits)
}

/// AMP training through a masked softmax: the pipeline (the softmax computing its
/// scaled, masked scores itself) trains bit for bit as the unfused graph.
#[test]
fn masked_attention_training_with_the_softmax_prologue_is_bit_identical() {
    let optimizer = Sgd::momentum(0.1, 0.9);
    let ran = assert_trains_alike_with_the_passes(masked_attention_model, &optimizer, "masked");
    let fused: Vec<&FusedSoftmax> = ran
        .node_ids()
        .filter_map(|id| ran.node(id).op.downcast_ref::<FusedSoftmax>())
        .collect();
    assert_eq!(fused.len(), 1);
    // The scale and the mask at least.
    assert!(fused[0].prologue().instrs().len() >= 5, "{:?}", fused[0]);
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("ampgraph_badckpt_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut s, _) = amp_session(LossScale::default());
    let good = dir.join("good.ckpt");
    s.save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.join("truncated.ckpt");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let garbage = dir.join("garbage.ckpt");
    std::fs::write(&garbage, b"hello world").unwrap();
    for (path, want) in [
        (&truncated, "corrupt"),
        (&garbage, "bad magic"),
        (&dir.join("missing.ckpt"), "missing.ckpt"),
    ] {
        let err = s.restore(path).unwrap_err();
        assert!(matches!(err, SessionError::Checkpoint { .. }), "{err}");
        assert!(err.to_string().contains(want), "{err}");
    }
    // A checkpoint of another model names the variable that does not fit.
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, 4]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let h = nn::dense(&mut g, x, 5, Some(Activation::Tanh)).unwrap();
    let logits = nn::dense(&mut g, h, 3, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9))
        .minimize(&mut g, loss)
        .unwrap();
    let mut other = Session::new(g, Device::Cpu).unwrap();
    let err = other.restore(&good).unwrap_err().to_string();
    assert!(
        err.contains("in the checkpoint but") && err.contains("f32[16]") && err.contains("f32[5]"),
        "{err}"
    );
    let _ = step;
    // Saving is atomic: no temporary file is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".tmp")
        })
        .collect();
    assert!(leftovers.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inference_session_prunes_training_nodes_and_restores_weights() {
    let dir = std::env::temp_dir().join(format!("ampgraph_infer_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("m.ckpt");
    let (mut g, loss, logits, _) = model();
    let step = Sgd::momentum(0.1, 0.9).minimize(&mut g, loss).unwrap();
    let forward = g.clone();
    let mut train = Session::new(g, Device::Cpu).unwrap();
    for k in 0..3 {
        train.run(&[step.step], &feeds(k, None)).unwrap();
    }
    train.save(&ckpt).unwrap();
    let want = train.run(&[logits], &feeds(7, None)).unwrap();
    let mut infer = Session::inference(forward, &[logits], Device::Cpu).unwrap();
    for id in infer.graph().node_ids() {
        let n = infer.graph().node(id);
        assert!(
            !matches!(n.op.name(), "AssignVariable" | "OptimizerUpdate" | "Group")
                && !n.name.starts_with("gradients/")
                && !n.name.ends_with("/momentum"),
            "inference graph keeps {} ({})",
            n.name,
            n.op.name()
        );
    }
    infer.restore(&ckpt).unwrap();
    let got = infer.run(&[logits], &feeds(7, None)).unwrap();
    assert_eq!(want, got);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// loss = sum((w - target)^2) for a 3-vector w: the gradient is 2 (w - target).
fn quadratic(opt: &dyn Optimizer) -> (Session, TrainStep) {
    let mut g = Graph::new();
    let w = g
        .add_node(
            "w",
            Box::new(Variable::with_init(
                TensorType::new(DType::F32, vec![3]),
                Init::Constant(1.0),
            )),
            &[],
        )
        .unwrap();
    let target = g
        .add(
            Const::new(Tensor::from_f64(DType::F32, vec![3], &[0.5, -1.0, 2.0]).unwrap()),
            &[],
        )
        .unwrap();
    let d = g
        .add(Binary::new(BinaryKind::Sub), &[w.into(), target])
        .unwrap();
    let sq = g.add(Unary::new(UnaryKind::Square), &[d]).unwrap();
    let loss = g
        .add(Reduce::new(ReduceKind::Sum, None, false), &[sq])
        .unwrap();
    let step = opt.minimize(&mut g, loss).unwrap();
    (Session::new(g, Device::Cpu).unwrap(), step)
}

fn w(s: &Session) -> Vec<f64> {
    s.variable("w").unwrap().to_f64_vec()
}

fn assert_close(got: &[f64], want: &[f64]) {
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
            "{got:?} != {want:?}"
        );
    }
}

#[test]
fn optimizers_follow_their_update_rules() {
    let target = [0.5, -1.0, 2.0];
    let grad =
        |w: &[f64]| -> Vec<f64> { w.iter().zip(&target).map(|(w, t)| 2.0 * (w - t)).collect() };
    // SGD with momentum (PyTorch form), and Nesterov.
    for nesterov in [false, true] {
        let opt = if nesterov {
            Sgd::nesterov(0.1, 0.9)
        } else {
            Sgd::momentum(0.1, 0.9)
        };
        let (mut s, step) = quadratic(&opt);
        let (mut wv, mut buf) = (vec![1.0; 3], vec![0.0; 3]);
        for _ in 0..3 {
            s.run(&[step.step], &Feeds::new()).unwrap();
            let g = grad(&wv);
            for i in 0..3 {
                buf[i] = 0.9 * buf[i] + g[i];
                wv[i] -= 0.1
                    * if nesterov {
                        g[i] + 0.9 * buf[i]
                    } else {
                        buf[i]
                    };
            }
            assert_close(&w(&s), &wv);
        }
    }
    // Adam with bias correction; AdamW decays the weights separately.
    for decoupled in [false, true] {
        let opt = if decoupled {
            Adam::adamw(0.01, 0.1)
        } else {
            Adam::new(0.01)
        };
        let (mut s, step) = quadratic(&opt);
        let (mut wv, mut m, mut v) = (vec![1.0; 3], vec![0.0; 3], vec![0.0; 3]);
        for t in 1..=3 {
            s.run(&[step.step], &Feeds::new()).unwrap();
            let g = grad(&wv);
            for i in 0..3 {
                m[i] = 0.9 * m[i] + 0.1 * g[i];
                v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
                let update = (m[i] / (1.0 - 0.9f64.powi(t)))
                    / ((v[i] / (1.0 - 0.999f64.powi(t))).sqrt() + 1e-7);
                wv[i] -= 0.01 * (update + if decoupled { 0.1 * wv[i] } else { 0.0 });
            }
            assert_close(&w(&s), &wv);
        }
    }
    // LAMB: Adam's direction scaled by ||w|| / ||update||.
    let (mut s, step) = quadratic(&Adam::lamb(0.01, 0.0));
    s.run(&[step.step], &Feeds::new()).unwrap();
    let g = grad(&[1.0; 3]);
    let update: Vec<f64> = g
        .iter()
        .map(|g| (0.1 * g / 0.1) / ((0.001 * g * g / 0.001).sqrt() + 1e-6))
        .collect();
    let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
    let trust = norm(&[1.0; 3]) / norm(&update);
    let want: Vec<f64> = update.iter().map(|u| 1.0 - 0.01 * trust * u).collect();
    assert_close(&w(&s), &want);
}

/// The acceptance run of the MNIST issue, shortened: 3 epochs on the first 4000 real
/// images, evaluated on the last 1000; AMP is within a point of fp32. Fed by the
/// loader and the trainer, as the example is.
#[test]
fn mnist_amp_matches_fp32() {
    let accuracy = |amp: bool| -> f64 {
        let minimize = |g: &mut Graph, loss: Port| {
            let opt = Sgd::momentum(0.05, 0.9);
            if amp {
                enable_mixed_precision_graph_rewrite(opt).minimize(g, loss)
            } else {
                opt.minimize(g, loss)
            }
            .unwrap()
        };
        common::mnist_mlp_accuracy(&[256], 3, minimize, SessionOptions::default()).0
    };
    let (fp32, amp) = (accuracy(false), accuracy(true));
    println!("eval accuracy: fp32 {fp32:.1}%, AMP {amp:.1}%");
    assert!(fp32 > 84.0 && amp > 84.0, "fp32 {fp32}, amp {amp}");
    assert!((fp32 - amp).abs() <= 1.0, "fp32 {fp32}, amp {amp}");
}

/// The gradient of Slices splitting a tensor along one axis (a packed q, k, v) is one
/// Concat of their gradients, zeros where no Slice read (here column 5), not a
/// zero-padded copy per Slice added up; its values are the hand-computed ones.
#[test]
fn slices_splitting_a_tensor_have_one_concat_as_gradient() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 9]).unwrap();
    let mut loss = None;
    for (k, (begin, len)) in [(6, 3), (0, 3), (3, 2)].into_iter().enumerate() {
        let s = g
            .add(Slice::new([0, begin], [2, len as i64]), &[x])
            .unwrap();
        let c: Vec<f64> = (0..2 * len).map(|i| (10 * (k + 1) + i) as f64).collect();
        let c = g
            .constant(Tensor::from_f64(DType::F32, [2, len], &c).unwrap())
            .unwrap();
        let term = g.mul(s, c).unwrap();
        let term = g.sum(term, None, false).unwrap();
        loss = Some(match loss {
            Some(l) => g.plus(l, term).unwrap(),
            None => term,
        });
    }
    let dx = gradients(&mut g, loss.unwrap(), &[x]).unwrap()[0];
    g.validate().unwrap();
    assert_eq!(
        g.node(dx.node).op.downcast_ref::<Concat>(),
        Some(&Concat::new(1))
    );
    let widths: Vec<usize> = g
        .inputs(dx.node)
        .iter()
        .map(|p| g.ty(*p).shape[1])
        .collect();
    assert_eq!(widths, [3, 2, 1, 3]);
    // Each Slice's constant in its place, 0 in column 5.
    let mut feeds = Feeds::new();
    feeds.insert(
        "x".into(),
        Tensor::zeros(&TensorType::new(DType::F32, [2, 9])),
    );
    let got = CpuExecutor::new().run(&g, &feeds, &[dx]).unwrap();
    let want = [
        20.0, 21.0, 22.0, 30.0, 31.0, 0.0, 10.0, 11.0, 12.0, //
        23.0, 24.0, 25.0, 32.0, 33.0, 0.0, 13.0, 14.0, 15.0,
    ];
    assert_eq!(got[0].to_f64_vec(), want);
}
