//! The AMP pass's FP8 phase (issue 44): which products take FP8 operands in which
//! format, the values they compute against a float64 reference of the formats, the
//! scaling state it keeps in the graph, and MNIST trained in FP8 against BF16.

mod common;

use ampgraph::exec::Feeds;
use ampgraph::graph::format::{to_json, GraphDef};
use ampgraph::graph::fp8::Fp8;
use ampgraph::graph::nn::{self, Activation};
use ampgraph::graph::ops::{
    AmaxChoice, Const, Fp8MatMul, Fp8Scale, FusedQuantizeFp8, GroupedQuantizeFp8, MatMul,
    QuantizeFp8,
};
use ampgraph::numerics::calibrate::fp8_amaxes;
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, LossScale, Optimizer, Sgd, TrainStep};
use ampgraph::passes::amp::fp8::{plan, CastSite, Decision, Kept};
use ampgraph::passes::amp::report::explain;
use ampgraph::passes::amp::{
    AmpConfig, AutoMixedPrecision, FastAccumulation, Fp8Config, Fp8Recipe, GemmCost,
};
use ampgraph::{DType, Device, Graph, Port, Session, SessionOptions, Tensor};

const BATCH: usize = 16;

/// A three-layer MLP of 24 inputs with a training step (SGD, `loss_scale`), marked
/// for BF16 AMP.
fn mlp(loss_scale: LossScale) -> (Graph, TrainStep, Port) {
    mlp_of(24, loss_scale)
}

/// [`mlp`] of `inputs` inputs.
fn mlp_of(inputs: usize, loss_scale: LossScale) -> (Graph, TrainStep, Port) {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, inputs]).unwrap();
    let y = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let h = nn::dense(&mut g, x, 32, Some(Activation::Relu)).unwrap();
    // A GELU's output only the next layer's FP8 casts read (its gradient reads its
    // input): `activation-into-fp8` folds it under delayed scaling.
    let h = nn::dense(&mut g, h, 32, Some(Activation::Gelu)).unwrap();
    let logits = nn::dense(&mut g, h, 8, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, y).unwrap();
    let step = enable_mixed_precision_graph_rewrite(Sgd::new(0.1))
        .with_dtype(DType::BF16)
        .with_loss_scale(loss_scale)
        .minimize(&mut g, loss)
        .unwrap();
    (g, step, logits)
}

fn options(fp8: Fp8Config) -> SessionOptions {
    SessionOptions {
        amp: Some(AmpConfig::new(DType::BF16).unwrap().with_fp8(fp8)),
        ..SessionOptions::default()
    }
}

fn feeds(step: u64, poison: Option<f32>) -> Feeds {
    let mut x: Vec<f64> = (0..BATCH * 24)
        .map(|i| ((i as u64 * 37 + step * 11) % 101) as f64 / 25.0 - 2.0)
        .collect();
    if let Some(v) = poison {
        x[5] = f64::from(v);
    }
    let labels: Vec<f64> = (0..BATCH).map(|i| ((i as u64 + step) % 8) as f64).collect();
    Feeds::from([
        (
            "x".into(),
            Tensor::from_f64(DType::F32, [BATCH, 24], &x).unwrap(),
        ),
        (
            "labels".into(),
            Tensor::from_f64(DType::I64, [BATCH], &labels).unwrap(),
        ),
    ])
}

/// The graph the pass leaves with `fp8`.
fn rewritten(fp8: Fp8Config) -> Graph {
    let (mut g, _, _) = mlp(LossScale::None);
    AutoMixedPrecision::new(AmpConfig::new(DType::BF16).unwrap().with_fp8(fp8))
        .rewrite(&mut g)
        .unwrap();
    g
}

/// The formats of every FP8 product's operands, by the node name of the product.
fn formats(g: &Graph) -> Vec<(String, DType, DType)> {
    let mut out: Vec<(String, DType, DType)> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<Fp8MatMul>())
        .map(|id| {
            let inputs = g.inputs(id);
            for p in &inputs[..2] {
                let op = &g.node(p.node).op;
                assert!(
                    op.is::<QuantizeFp8>()
                        || op.is::<FusedQuantizeFp8>()
                        || op.is::<GroupedQuantizeFp8>(),
                    "an FP8 operand of '{}' is not quantised",
                    g.node(id).name
                );
            }
            (
                g.node(id).name.clone(),
                g.ty(inputs[0]).dtype,
                g.ty(inputs[1]).dtype,
            )
        })
        .collect();
    out.sort();
    out
}

/// Forward products take E4M3 operands; the input-gradient product dY W^T takes the
/// gradient in E5M2 and the weight in E4M3, the weight-gradient product X^T dY the
/// reverse; the first layer has no input gradient. Every product of the step is FP8
/// (3 forward, 3 weight gradients, 2 input gradients), each weight quantised once.
#[test]
fn forward_products_take_e4m3_and_gradients_e5m2() {
    let g = rewritten(Fp8Config::everywhere(Fp8Recipe::Current));
    g.validate().unwrap();
    let f = formats(&g);
    assert_eq!(f.len(), 8, "{f:?}");
    let (e4, e5) = (DType::F8E4M3, DType::F8E5M2);
    let count = |a, b| f.iter().filter(|(_, x, y)| (*x, *y) == (a, b)).count();
    assert_eq!(count(e4, e4), 3, "{f:?}");
    assert_eq!(count(e4, e5) + count(e5, e4), 5, "{f:?}");
    assert_eq!(count(e5, e5), 0);
    // The first layer's input gradient, which nothing reads, is left as it was.
    let needed = g.needed_by(g.outputs());
    assert!(g
        .node_ids()
        .all(|id| !(needed[id.index()] && g.node(id).op.is::<MatMul>())));
    // One quantisation per (tensor, format): 3 weights, 3 activations in E4M3, 3
    // output gradients in E5M2.
    let quantizations = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<QuantizeFp8>())
        .count();
    assert_eq!(quantizations, 9);
    // Every product sums in the fast mode by default; `Forward` keeps f32 steps for
    // the products of a gradient, `Never` for all.
    let fast = |g: &Graph| -> Vec<(DType, DType)> {
        let mut v: Vec<_> = (g.node_ids())
            .filter(|&id| {
                let op = g.node(id).op.downcast_ref::<Fp8MatMul>();
                op.is_some_and(|p| p.fast_accumulation)
            })
            .map(|id| (g.ty(g.inputs(id)[0]).dtype, g.ty(g.inputs(id)[1]).dtype))
            .collect();
        v.sort();
        v
    };
    assert_eq!(fast(&g).len(), 8);
    let with = |fast_accumulation| {
        rewritten(Fp8Config {
            fast_accumulation,
            ..Fp8Config::everywhere(Fp8Recipe::Current)
        })
    };
    assert_eq!(fast(&with(FastAccumulation::Forward)), vec![(e4, e4); 3]);
    assert_eq!(fast(&with(FastAccumulation::Never)), vec![]);
    // Every product reads K-major operands, a transposed copy where the tensor is
    // stored the other way round (the weight in its forward product, the activation
    // and the gradient in the weight gradient's), written by the quantisation.
    for id in g.node_ids() {
        let Some(p) = g.node(id).op.downcast_ref::<Fp8MatMul>() else {
            continue;
        };
        let name = &g.node(id).name;
        assert!(
            !p.product.transpose_a && p.product.transpose_b,
            "'{name}' is not K-major"
        );
    }
    let copies = (g.node_ids())
        .filter(|&id| {
            let q = g.node(id).op.downcast_ref::<QuantizeFp8>();
            q.is_some_and(|q| q.transposed)
        })
        .count();
    // 3 weights (forward), 3 activations and 3 gradients (weight gradients): the
    // first layer's gradient is read only by its weight gradient, the others by an
    // input gradient too.
    assert_eq!(copies, 9);
}

/// Running the pass again changes nothing: the FP8 products and their scale
/// computations are not 16-bit candidates.
#[test]
fn the_pass_is_idempotent() {
    for recipe in [Fp8Recipe::Current, Fp8Recipe::delayed()] {
        let mut g = rewritten(Fp8Config::everywhere(recipe));
        let once = to_json(&GraphDef::from_graph(&g));
        AutoMixedPrecision::new(
            AmpConfig::new(DType::BF16)
                .unwrap()
                .with_fp8(Fp8Config::everywhere(recipe)),
        )
        .rewrite(&mut g)
        .unwrap();
        assert_eq!(to_json(&GraphDef::from_graph(&g)), once, "{recipe:?}");
    }
}

/// The default keeps the first and last layers 16-bit, and the cost model keeps
/// this small middle layer too; `explain` says why for each.
#[test]
fn first_last_and_small_products_stay_16_bit_and_explain_says_why() {
    let (g, _, _) = mlp(LossScale::None);
    let config = AmpConfig::new(DType::BF16)
        .unwrap()
        .with_fp8(Fp8Config::default());
    let mut after = g.clone();
    let report = AutoMixedPrecision::new(config.clone())
        .rewrite(&mut after)
        .unwrap();
    let stats = report.fp8.clone().unwrap();
    // The first layer's forward and weight-gradient products, the last one's three.
    assert_eq!((stats.gemms, stats.kept_by_cost), (0, 3), "{stats:?}");
    assert_eq!(stats.kept_by_layer, 5, "{stats:?}");
    let summary = report.summary().to_string();
    assert!(summary.contains("FP8 GEMMs (E4M3 forward, E5M2 gradients): 0; kept BF16 by the cost model: 3, as first/last or listed layers: 5"), "{summary}");

    let painting = AutoMixedPrecision::new(config.clone()).analyze(&g).unwrap();
    let first = explain(&g, &painting, &config, "dense/matmul").unwrap();
    assert!(
        first
            .to_string()
            .contains("kept bf16 rather than FP8: its layer is the model's first or last"),
        "{first}"
    );
    let middle = explain(&g, &painting, &config, "dense_1/matmul").unwrap();
    assert!(
        middle.to_string().contains("the cost model gives"),
        "{middle}"
    );
    // Listed by name: kept, with its gradient products.
    let mut listed = Fp8Config::everywhere(Fp8Recipe::Current);
    listed.keep.insert("dense_1/matmul".into());
    let g = rewritten(listed);
    assert_eq!(formats(&g).len(), 5);
}

/// A training step of three dense layers (widths and activations) over an `x` of
/// `shape`, after BF16 AMP: the graph the FP8 phase decides on.
fn three_layers_in_bf16(shape: [usize; 2], layers: [(usize, Option<Activation>); 3]) -> Graph {
    let mut g = Graph::new();
    let mut h = g.placeholder("x", DType::F32, shape).unwrap();
    for (width, activation) in layers {
        h = nn::dense(&mut g, h, width, activation).unwrap();
    }
    let loss = g.mean(h, None, false).unwrap();
    Sgd::new(0.1).minimize(&mut g, loss).unwrap();
    AutoMixedPrecision::new(AmpConfig::new(DType::BF16).unwrap())
        .rewrite(&mut g)
        .unwrap();
    g
}

/// With shapes where FP8 pays, the cost model converts the middle layer's products
/// (forward and both gradients) and keeps the first and last layers 16-bit.
#[test]
fn large_products_take_fp8() {
    let g = three_layers_in_bf16([8192, 4096], [(8192, None), (16384, None), (4096, None)]);
    let decided = plan(&g, &Fp8Config::default()).unwrap();
    let fp8: Vec<&str> = decided
        .decisions
        .iter()
        .filter(|(_, d)| matches!(d, Decision::Fp8 { .. }))
        .map(|(id, _)| g.node(*id).name.as_str())
        .collect();
    assert_eq!(fp8.len(), 3, "{fp8:?}");
    assert!(fp8.contains(&"dense_1/matmul"), "{fp8:?}");
    assert!(decided
        .decisions
        .iter()
        .all(|(_, d)| matches!(d, Decision::Fp8 { .. } | Decision::Kept(Kept::FirstOrLast))));

    // A width cuBLASLt's FP8 products do not take (n = 8200, not a multiple of 16).
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [8192, 4096]).unwrap();
    let h = nn::dense(&mut g, x, 8200, None).unwrap();
    g.set_outputs(vec![h]).unwrap();
    AutoMixedPrecision::new(AmpConfig::new(DType::BF16).unwrap())
        .rewrite(&mut g)
        .unwrap();
    let config = Fp8Config {
        keep_first_and_last: false,
        ..Fp8Config::default()
    };
    let unaligned = plan(&g, &config).unwrap();
    assert_eq!(
        unaligned
            .decisions
            .iter()
            .map(|(_, d)| d.clone())
            .collect::<Vec<_>>(),
        vec![Decision::Kept(Kept::Shape { k: 4096, n: 8200 })]
    );
    // Without the cost model the shape rule still holds for the GPU's products, and
    // goes with `everywhere` (the CPU runs any shape).
    for (config, fp8) in [
        (Fp8Config::every_device_product(Fp8Recipe::Current), false),
        (Fp8Config::everywhere(Fp8Recipe::Current), true),
    ] {
        let d = plan(&g, &config).unwrap().decisions;
        assert_eq!(d.len(), 1);
        assert_eq!(
            matches!(d[0].1, Decision::Fp8 { .. }),
            fp8,
            "{config:?}: {d:?}"
        );
    }
    // The AMP settings' form keeps the recipe chosen before it.
    let delayed = AmpConfig::new(DType::F8E4M3)
        .unwrap()
        .with_fp8(Fp8Config {
            recipe: Fp8Recipe::delayed(),
            ..Fp8Config::default()
        })
        .on_every_device_product();
    assert_eq!(
        delayed.fp8,
        Some(Fp8Config::every_device_product(Fp8Recipe::delayed()))
    );
}

/// Two layers whose weights are Consts (an imported model in inference) or Variables
/// holding the same values, marked for BF16 AMP.
fn two_layers(constant: bool) -> (Graph, Port, [(String, Tensor); 2]) {
    let weight = |rows: usize, cols: usize, seed: usize| {
        let v: Vec<f64> = (0..rows * cols)
            .map(|i| (((i + seed) * 7919 % 257) as f64 - 128.0) / 64.0)
            .collect();
        Tensor::from_f64(DType::F32, [rows, cols], &v).unwrap()
    };
    let (w1, w2) = (weight(32, 48, 1), weight(48, 16, 2));
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [16, 32]).unwrap();
    let read = |g: &mut Graph, name: &str, w: &Tensor| match constant {
        true => g.constant(w.clone()).unwrap(),
        false => g.variable(name, DType::F32, w.shape().to_vec()).unwrap(),
    };
    let (p1, p2) = (read(&mut g, "w1", &w1), read(&mut g, "w2", &w2));
    let h = g.matmul(x, p1).unwrap();
    let h = g.relu(h).unwrap();
    let y = g.matmul(h, p2).unwrap();
    let y = g.relu(y).unwrap();
    g.set_outputs(vec![y]).unwrap();
    g.mixed_precision = Some(DType::BF16);
    (g, y, [("w1".into(), w1), ("w2".into(), w2)])
}

/// Under current scaling an inference graph's constant weights are quantised once, by
/// the pass (a Const of their FP8 values and one of the scale's inverse, the 16-bit
/// weight gone), and nothing measures or casts them in a step: the outputs equal, bit
/// for bit, those of the same weights held as Variables (quantised every step). The
/// cost model charges such a weight nothing.
#[test]
fn constant_weights_are_quantised_once_by_the_pass() {
    let x: Vec<f64> = (0..16 * 32)
        .map(|i| ((i * 37 % 101) as f64) / 25.0 - 2.0)
        .collect();
    let feeds = Feeds::from([(
        "x".into(),
        Tensor::from_f64(DType::F32, [16, 32], &x).unwrap(),
    )]);
    let run = |constant: bool| {
        let (g, y, weights) = two_layers(constant);
        let fp8 = Fp8Config::everywhere(Fp8Recipe::Current);
        let mut s = Session::with_options(g, Device::Cpu, options(fp8)).unwrap();
        if !constant {
            for (name, w) in weights {
                s.set_variable(&name, w).unwrap();
            }
        }
        let out = s.run(&[y], &feeds).unwrap().remove(0);
        let summary = s.passes[0].summary.to_string();
        (s.graph_for(&[y]).clone(), out, summary)
    };
    let (folded, from_constants, summary) = run(true);
    assert!(
        summary.contains("FP8 GEMMs (E4M3 forward, E5M2 gradients): 2;")
            && summary.contains("constants quantised once by the pass: 2"),
        "{summary}"
    );
    let (_, from_variables, summary) = run(false);
    assert!(!summary.contains("constants quantised"), "{summary}");
    assert_eq!(from_constants.to_f64_vec(), from_variables.to_f64_vec());
    let products: Vec<_> = (folded.node_ids())
        .filter(|&id| folded.node(id).op.is::<Fp8MatMul>())
        .collect();
    assert_eq!(products.len(), 2);
    for id in products {
        let weight = folded.inputs(id)[1];
        let op = &folded.node(weight.node).op;
        assert!(op.is::<Const>(), "{}", folded.node(weight.node).name);
        assert_eq!(folded.ty(weight).dtype, DType::F8E4M3);
    }
    for id in folded.node_ids() {
        let node = folded.node(id);
        let reads_a_constant = (folded.inputs(id).iter())
            .any(|p| folded.node(p.node).op.is::<Const>() && folded.ty(*p).dtype.is_float());
        assert!(
            !(node.op.is::<QuantizeFp8>() || node.op.is::<Fp8Scale>()) || !reads_a_constant,
            "{} quantises a constant every step",
            node.name
        );
        let sixteen_bit_weight = node.op.is::<Const>() && node.outputs()[0].dtype == DType::BF16;
        assert!(!sixteen_bit_weight, "{} is left unread", node.name);
    }
    // The CUDA executor takes the FP8 Consts (planning the lowering, no device).
    let (mut g, _, _) = two_layers(true);
    AutoMixedPrecision::new(
        AmpConfig::new(DType::BF16)
            .unwrap()
            .with_fp8(Fp8Config::everywhere(Fp8Recipe::Current)),
    )
    .rewrite(&mut g)
    .unwrap();
    common::cuda_passes(&mut g);
    ampgraph::exec::CudaExecutor::check_supported(&g).unwrap();
    let cost = GemmCost::H100;
    assert_eq!(
        cost.cast_seconds(1 << 20, CastSite::Constant, Fp8Recipe::Current),
        0.0
    );
    assert_eq!(
        cost.cast_seconds(1 << 20, CastSite::Constant, Fp8Recipe::delayed()),
        cost.cast_seconds(1 << 20, CastSite::Alone, Fp8Recipe::delayed())
    );
}

/// Static scaling (inference): each cast's scale fixed at rewrite time from its amax on
/// calibration samples. Calibrated on the inputs it then runs on, the graph computes
/// what current scaling computes, bit for bit, with no amax pass (no Fp8Scale left);
/// on other inputs it stays within FP8's rounding of current scaling. A training
/// graph, and a cast without a calibrated amax, are refused.
#[test]
fn static_scales_calibrated_on_the_inputs_compute_what_current_scaling_computes() {
    // Other inputs than the calibration's: smaller, so their own scales differ.
    let input = |seed: usize| {
        let x: Vec<f64> = (0..16 * 32)
            .map(|i| ((((i + seed) * 37 % 101) as f64) / 25.0 - 2.0) / (1 + seed) as f64)
            .collect();
        Feeds::from([(
            "x".into(),
            Tensor::from_f64(DType::F32, [16, 32], &x).unwrap(),
        )])
    };
    let config = |recipe| {
        AmpConfig::new(DType::BF16)
            .unwrap()
            .with_fp8(Fp8Config::everywhere(recipe))
    };
    let (g, y, _) = two_layers(true);
    let amaxes = fp8_amaxes(&g, &config(Fp8Recipe::Current), &[input(0)]).unwrap();
    // The first layer's input and the ReLU's output (the weights are quantised once).
    assert_eq!(amaxes.len(), 2, "{amaxes:?}");
    let mut calibrated = config(Fp8Recipe::Static);
    if let Some(fp8) = calibrated.fp8.as_mut() {
        fp8.calibrated = amaxes.clone();
    }
    let run = |amp: AmpConfig, feeds: &Feeds| {
        let options = SessionOptions {
            amp: Some(amp),
            ..SessionOptions::default()
        };
        let mut s = Session::with_options(g.clone(), Device::Cpu, options).unwrap();
        let out = s.run(&[y], feeds).unwrap().remove(0).to_f64_vec();
        (s.graph_for(&[y]).clone(), out)
    };
    let (fixed, on_calibration) = run(calibrated.clone(), &input(0));
    let (_, current) = run(config(Fp8Recipe::Current), &input(0));
    assert_eq!(on_calibration, current);
    assert_eq!(common::count(&fixed, "Fp8MatMul"), 2);
    assert_eq!(common::count(&fixed, "Fp8Scale"), 0);
    // Other inputs: the calibrated scales are near each tensor's own.
    let (_, other) = run(calibrated.clone(), &input(1));
    let (_, other_current) = run(config(Fp8Recipe::Current), &input(1));
    let top = other_current.iter().fold(0f64, |m, v| m.max(v.abs()));
    let worst = (other.iter().zip(&other_current)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst > 0.0 && worst < 0.1 * top, "{worst} of {top}");
    // Refused: a cast without its amax, by name; a training graph.
    let mut missing = calibrated;
    if let Some(fp8) = missing.fp8.as_mut() {
        fp8.calibrated.pop_first();
    }
    let err = (AutoMixedPrecision::new(missing).rewrite(&mut g.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no calibrated amax for its FP8 cast ampgraph/fp8/"),
        "{err}"
    );
    let (mut training, _, _) = mlp(LossScale::None);
    let err = (AutoMixedPrecision::new(config(Fp8Recipe::Static)).rewrite(&mut training))
        .unwrap_err()
        .to_string();
    assert!(err.contains("use delayed or current scaling"), "{err}");
}

/// A layer's three products share its input, weight and output gradient, each
/// quantised once: the cost model decides them together. GPT-2's feed-forward
/// down-projection (16384 tokens, 3072 -> 768) measured faster in FP8 under both
/// recipes (every layer in FP8: 1.06x delayed, 1.04x current); a per-product model,
/// charging each product its operands' casts, kept its two gradient products 16-bit.
/// At the transformer's 8192 tokens the layer stays 16-bit under current scaling
/// (every layer in FP8 measured 0.90x), all three products together.
#[test]
fn a_layers_products_are_decided_together_by_their_shared_casts() {
    let decide = |tokens: usize, recipe| {
        let g = three_layers_in_bf16(
            [tokens, 768],
            [(3072, Some(Activation::Gelu)), (768, None), (768, None)],
        );
        let config = Fp8Config {
            recipe,
            ..Fp8Config::default()
        };
        let decided = plan(&g, &config).unwrap().decisions;
        let in_fp8 = (decided.iter())
            .filter(|(_, d)| matches!(d, Decision::Fp8 { .. }))
            .count();
        let by_cost = (decided.iter())
            .filter(|(_, d)| matches!(d, Decision::Kept(Kept::Cost { .. })))
            .count();
        (in_fp8, by_cost)
    };
    // The middle layer: forward, input and weight gradients.
    assert_eq!(decide(16384, Fp8Recipe::delayed()), (3, 0));
    assert_eq!(decide(16384, Fp8Recipe::Current), (3, 0));
    assert_eq!(decide(8192, Fp8Recipe::Current), (0, 3));
}

fn e4m3(v: f64) -> f64 {
    f64::from(Fp8::E4M3.decode(Fp8::E4M3.encode(v as f32)))
}

fn bf16(v: f64) -> f64 {
    f64::from(half::bf16::from_f64(v).to_f32())
}

/// An FP8 forward product, against a float64 reference: both operands rounded to
/// bf16 (AMP), scaled by 448 / amax (current scaling), rounded to E4M3, multiplied
/// in f64 and unscaled; the result rounded to bf16. The reference's f64 sum differs
/// from the f32 accumulation by far less than a bf16 ulp.
#[test]
fn an_fp8_product_equals_a_float64_reference() {
    let (m, k, n) = (5, 24, 7);
    let mut g = Graph::new();
    let a = g.placeholder("a", DType::F32, [m, k]).unwrap();
    let b = g.placeholder("b", DType::F32, [k, n]).unwrap();
    let y = g.matmul(a, b).unwrap();
    let out = g.cast(y, DType::F32).unwrap();
    g.set_outputs(vec![out]).unwrap();
    g.mixed_precision = Some(DType::BF16);
    let av: Vec<f64> = (0..m * k)
        .map(|i| ((i * 7919) % 613) as f64 / 97.0 - 3.1)
        .collect();
    let bv: Vec<f64> = (0..k * n)
        .map(|i| ((i * 104729) % 331) as f64 / 1300.0 - 0.12)
        .collect();
    let mut s = Session::with_options(
        g,
        Device::Cpu,
        options(Fp8Config::everywhere(Fp8Recipe::Current)),
    )
    .unwrap();
    assert_eq!(formats(s.graph()).len(), 1);
    let feeds = Feeds::from([
        (
            "a".into(),
            Tensor::from_f64(DType::F32, [m, k], &av).unwrap(),
        ),
        (
            "b".into(),
            Tensor::from_f64(DType::F32, [k, n], &bv).unwrap(),
        ),
    ]);
    let got = s.run(&[out], &feeds).unwrap()[0].to_f64_vec();
    let quantized = |v: &[f64]| -> (Vec<f64>, f64) {
        let halves: Vec<f64> = v.iter().map(|&x| bf16(x)).collect();
        let amax = halves.iter().fold(0f64, |m, x| m.max(x.abs()));
        let scale = f64::from(448f32 / amax as f32);
        (
            halves
                .iter()
                .map(|&x| e4m3(f64::from((x as f32) * scale as f32)))
                .collect(),
            scale,
        )
    };
    let ((qa, sa), (qb, sb)) = (quantized(&av), quantized(&bv));
    let inv = f64::from((1.0 / sa as f32) * (1.0 / sb as f32));
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|l| qa[i * k + l] * qb[l * n + j]).sum();
            let want = dot * inv;
            let g = got[i * n + j];
            assert!(
                (g - bf16(want)).abs() <= want.abs() * 2f64.powi(-8) + 1e-12,
                "[{i}, {j}]: {g} vs {want}"
            );
        }
    }
    // FP8 is coarser than bf16: the product differs from the bf16 one.
    let exact: f64 = (0..k).map(|l| bf16(av[l]) * bf16(bv[l * n])).sum();
    assert!((got[0] - exact).abs() > 0.0);
}

fn scalar(s: &Session, name: &str) -> f64 {
    s.variable(name).unwrap().to_f64_vec()[0]
}

/// Delayed scaling's state, step by step: each weight's history holds its amaxes,
/// newest first; its scale is 448 over the history's max, beside its inverse; a
/// restored checkpoint carries them.
#[test]
fn delayed_scaling_keeps_amax_histories_and_scales_in_the_graph() {
    let recipe = Fp8Recipe::Delayed {
        history: 3,
        amax: AmaxChoice::Max,
    };
    let (g, step, _) = mlp(LossScale::None);
    let mut s =
        Session::with_options(g, Device::Cpu, options(Fp8Config::everywhere(recipe))).unwrap();
    let kernel = "dense_1/kernel";
    let state = |what: &str| format!("ampgraph/fp8/{kernel}/e4m3/{what}");
    let (history, scale, scale_inv) = (state("amax_history"), state("scale"), state("scale_inv"));
    assert_eq!(s.variable(&history).unwrap().to_f64_vec(), vec![0.0; 3]);
    assert_eq!((scalar(&s, &scale), scalar(&s, &scale_inv)), (1.0, 1.0));
    let mut amaxes = Vec::new();
    for t in 0..5 {
        let w = s.variable(kernel).unwrap().to_f64_vec();
        amaxes.insert(0, w.iter().fold(0f64, |m, &v| m.max(bf16(v).abs())));
        s.run(&[step.step], &feeds(t, None)).unwrap();
        let want: Vec<f64> = (0..3)
            .map(|i| amaxes.get(i).copied().unwrap_or(0.0))
            .collect();
        assert_eq!(s.variable(&history).unwrap().to_f64_vec(), want, "step {t}");
        let max = want.iter().fold(0f64, |m, &v| m.max(v));
        let next = 448f32 / max as f32;
        assert_eq!(scalar(&s, &scale), f64::from(next), "step {t}");
        assert_eq!(scalar(&s, &scale_inv), f64::from(1.0 / next), "step {t}");
    }
    let dir = common::ScratchDir::new("fp8-state");
    let path = dir.join("state.ckpt");
    s.save(&path).unwrap();
    let (g, _, _) = mlp(LossScale::None);
    let mut restored =
        Session::with_options(g, Device::Cpu, options(Fp8Config::everywhere(recipe))).unwrap();
    restored.restore(&path).unwrap();
    assert_eq!(
        restored.variable(&history).unwrap().to_f64_vec(),
        s.variable(&history).unwrap().to_f64_vec()
    );
    assert_eq!(scalar(&restored, &scale), scalar(&s, &scale));
    assert_eq!(scalar(&restored, &scale_inv), scalar(&s, &scale_inv));
}

/// Delayed scaling's step is one `Fp8ScaleUpdate` per format with a member for each
/// quantised tensor, and no product waits for it: the products read the scales'
/// inverses from the state, and nothing an update computes flows into a product.
#[test]
fn one_update_per_format_steps_every_tensor_after_the_products() {
    use ampgraph::graph::ops::Fp8ScaleUpdate;
    let g = rewritten(Fp8Config::everywhere(Fp8Recipe::delayed()));
    let updates: Vec<(DType, usize)> = g
        .node_ids()
        .filter_map(|id| g.node(id).op.downcast_ref::<Fp8ScaleUpdate>())
        .map(|u| (u.scale.format, u.members))
        .collect();
    let quantised = |format: DType| {
        g.node_ids()
            .filter(|&id| {
                let op = &g.node(id).op;
                (op.is::<QuantizeFp8>() || op.is::<FusedQuantizeFp8>())
                    && g.node(id).outputs()[0].dtype == format
            })
            .count()
    };
    // x, the three weights and two hidden layers in E4M3; three output gradients
    // in E5M2 (the mlp's 8 products, each tensor quantised once).
    assert_eq!(
        updates,
        [
            (DType::F8E4M3, quantised(DType::F8E4M3)),
            (DType::F8E5M2, quantised(DType::F8E5M2))
        ]
    );
    assert_eq!((updates[0].1, updates[1].1), (6, 3));
    let products: Vec<_> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<Fp8MatMul>())
        .collect();
    let products_read = g.needed_by(&products.iter().map(|&p| p.into()).collect::<Vec<_>>());
    for id in g.node_ids() {
        if g.node(id).op.is::<Fp8ScaleUpdate>() {
            let name = &g.node(id).name;
            assert!(!products_read[id.index()], "a product waits for '{name}'");
        }
    }
    for &p in &products {
        for inv in &g.inputs(p)[2..4] {
            let name = &g.node(inv.node).name;
            assert!(
                name.ends_with("/scale_inv"),
                "{} reads {name}",
                g.node(p).name
            );
        }
    }
}

/// A non-finite input makes its amax non-finite: the loss-scaled step is skipped
/// (weights unchanged) and the scale backs off, as for an overflowing gradient (current
/// scaling's product is NaN; delayed scaling's amaxes join the step's all-finite
/// check); delayed scaling's history ignores the amax.
#[test]
fn a_non_finite_amax_skips_the_step_as_an_overflow_does() {
    for recipe in [Fp8Recipe::Current, Fp8Recipe::delayed()] {
        let (g, step, _) = mlp(LossScale::Dynamic {
            initial: 1024.0,
            growth_interval: 1000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
        });
        let mut s =
            Session::with_options(g, Device::Cpu, options(Fp8Config::everywhere(recipe))).unwrap();
        s.run(&[step.step], &feeds(0, None)).unwrap();
        let before = s.variable("dense/kernel").unwrap().clone();
        let history = s.variable("ampgraph/fp8/x/e4m3/amax_history").cloned();
        s.run(&[step.step], &feeds(1, Some(f32::INFINITY))).unwrap();
        assert_eq!(s.variable("dense/kernel").unwrap(), &before, "{recipe:?}");
        assert_eq!(scalar(&s, "loss_scale/scale"), 512.0, "{recipe:?}");
        assert_eq!(
            s.variable("ampgraph/fp8/x/e4m3/amax_history").cloned(),
            history,
            "{recipe:?}"
        );
        // And the next finite step trains again.
        s.run(&[step.step], &feeds(2, None)).unwrap();
        assert_ne!(s.variable("dense/kernel").unwrap(), &before, "{recipe:?}");
    }
}

/// Delayed scaling updates its state in a training step: an inference graph is a
/// clear error naming the alternative.
#[test]
fn delayed_scaling_without_a_training_step_is_refused() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 8]).unwrap();
    let y = nn::dense(&mut g, x, 8, None).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let err = AutoMixedPrecision::new(
        AmpConfig::new(DType::BF16)
            .unwrap()
            .with_fp8(Fp8Config::everywhere(Fp8Recipe::delayed())),
    )
    .rewrite(&mut g)
    .unwrap_err()
    .to_string();
    assert!(err.contains("use current scaling"), "{err}");
}

/// The acceptance run, on the CPU: the MNIST MLP (784-256-256-10, GELU) trained
/// 5 epochs on 4000 real images, every product in FP8 (first and last layers too),
/// evaluates within half a point of the same model in BF16, with both recipes.
#[test]
fn mnist_in_fp8_matches_bf16() {
    let accuracy = |fp8: Option<Fp8Recipe>| -> f64 {
        let minimize = |g: &mut Graph, loss: Port| {
            enable_mixed_precision_graph_rewrite(Sgd::momentum(0.05, 0.9))
                .with_dtype(DType::BF16)
                .with_loss_scale(LossScale::None)
                .minimize(g, loss)
                .unwrap()
        };
        let mut amp = AmpConfig::new(DType::BF16).unwrap();
        amp.fp8 = fp8.map(Fp8Config::everywhere);
        let options = SessionOptions {
            amp: Some(amp),
            ..SessionOptions::default()
        };
        let (accuracy, ran) = common::mnist_mlp_accuracy(&[256, 256], 5, minimize, options);
        assert_eq!(formats(&ran).len(), if fp8.is_some() { 8 } else { 0 });
        accuracy
    };
    let bf16 = accuracy(None);
    let current = accuracy(Some(Fp8Recipe::Current));
    let delayed = accuracy(Some(Fp8Recipe::delayed()));
    println!(
        "eval accuracy: bf16 {bf16:.1}%, FP8 current {current:.1}%, FP8 delayed {delayed:.1}%"
    );
    assert!(bf16 > 84.0, "bf16 {bf16}");
    for fp8 in [current, delayed] {
        assert!((bf16 - fp8).abs() <= 0.5, "bf16 {bf16}, fp8 {fp8}");
    }
}

/// A graph marked `f8e4m3` (the optimizer's `with_dtype`) runs BF16 AMP with the FP8
/// defaults, and keeps its mark through a file.
#[test]
fn a_graph_marked_f8e4m3_runs_bf16_amp_with_fp8_products() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [BATCH, 24]).unwrap();
    let y = g.placeholder("labels", DType::I64, [BATCH]).unwrap();
    let logits = nn::dense(&mut g, x, 8, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, y).unwrap();
    enable_mixed_precision_graph_rewrite(Sgd::new(0.1))
        .with_dtype(DType::F8E4M3)
        .minimize(&mut g, loss)
        .unwrap();
    let g =
        ampgraph::graph::format::graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes())
            .unwrap();
    assert_eq!(g.mixed_precision, Some(DType::F8E4M3));
    let s = Session::new(g, Device::Cpu).unwrap();
    let summary = s.passes[0].summary.to_string();
    assert!(summary.contains("Total BF16 Cast ops"), "{summary}");
    assert!(
        summary.contains("FP8 GEMMs (E4M3 forward, E5M2 gradients): 0"),
        "{summary}"
    );
}

/// A random MLP: `depth` dense layers of random widths, trained or not.
fn random_mlp(seed: u64, depth: usize, train: bool) -> Graph {
    let width = |i: u64| 4 + ((seed >> (i * 5)) % 13) as usize;
    let batch = 2 + (seed % 7) as usize;
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [batch, width(9)]).unwrap();
    let mut h = x;
    for i in 0..depth {
        let act = (i + 1 < depth).then_some(Activation::Relu);
        h = nn::dense(&mut g, h, width(i as u64), act).unwrap();
    }
    if train {
        let loss = g.mean(h, None, false).unwrap();
        Sgd::new(0.01).minimize(&mut g, loss).unwrap();
    } else {
        g.set_outputs(vec![h]).unwrap();
    }
    g
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// On random MLPs, trained or not, with either recipe: the rewritten graph is
    /// valid; every product reads quantised operands, E5M2 exactly where an operand
    /// is a gradient (the product is autodiff's); a second run changes nothing; and
    /// the FP8 forward pass stays within FP8's error of the BF16 one.
    #[test]
    fn the_fp8_phase_is_type_consistent_idempotent_and_close_to_bf16(
        seed in proptest::prelude::any::<u64>(),
        depth in 1usize..5,
        train in proptest::prelude::any::<bool>(),
        delayed in proptest::prelude::any::<bool>(),
    ) {
        let recipe = if delayed && train { Fp8Recipe::delayed() } else { Fp8Recipe::Current };
        let config = AmpConfig::new(DType::BF16).unwrap().with_fp8(Fp8Config::everywhere(recipe));
        let original = random_mlp(seed, depth, train);
        let mut g = original.clone();
        let report = AutoMixedPrecision::new(config.clone()).rewrite(&mut g).unwrap();
        g.validate().unwrap();
        let f = formats(&g);
        proptest::prop_assert_eq!(report.fp8.unwrap().gemms, f.len());
        // depth forward products, depth weight gradients, depth - 1 input gradients.
        proptest::prop_assert_eq!(f.len(), if train { 3 * depth - 1 } else { depth });
        for (name, a, b) in &f {
            let e5m2 = usize::from(*a == DType::F8E5M2) + usize::from(*b == DType::F8E5M2);
            proptest::prop_assert_eq!(e5m2, usize::from(name.starts_with("gradients/")), "{}", name);
        }
        let once = to_json(&GraphDef::from_graph(&g));
        AutoMixedPrecision::new(config).rewrite(&mut g).unwrap();
        proptest::prop_assert_eq!(to_json(&GraphDef::from_graph(&g)), once);

        // The forward output: FP8 against BF16, relative to the output's scale.
        let out = |mut g: Graph, amp: AmpConfig| -> Vec<f64> {
            let fetch = g.outputs()[0];
            g.mixed_precision = Some(DType::BF16);
            let options = SessionOptions { amp: Some(amp), ..SessionOptions::default() };
            let mut s = Session::with_options(g, Device::Cpu, options).unwrap();
            let x = s.graph().find("x").unwrap();
            let shape = s.graph().node(x).outputs()[0].shape.clone();
            let n: usize = shape.iter().product();
            let values: Vec<f64> = (0..n).map(|i| ((i as u64 * 31 + seed) % 17) as f64 / 8.0 - 1.0).collect();
            let feeds = Feeds::from([("x".into(), Tensor::from_f64(DType::F32, shape, &values).unwrap())]);
            s.run(&[fetch], &feeds).unwrap()[0].to_f64_vec()
        };
        if !train {
            let bf16 = out(original.clone(), AmpConfig::new(DType::BF16).unwrap());
            let fp8 = out(original, AmpConfig::new(DType::BF16).unwrap().with_fp8(Fp8Config::everywhere(Fp8Recipe::Current)));
            let scale = bf16.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            // Each layer's two operands carry at most E4M3's 2^-4 relative rounding.
            let bound = scale * ((1.0 + 2f64.powi(-4)).powi(2 * depth as i32) - 1.0);
            for (a, b) in bf16.iter().zip(&fp8) {
                proptest::prop_assert!((a - b).abs() <= bound, "bf16 {} fp8 {} bound {}", a, b, bound);
            }
        }
    }
}

/// The simplification and CUDA pipelines leave an FP8 training graph computing the
/// same bits on the CPU (both recipes, a poisoned step among them): no pass mistakes
/// an FP8 product, quantisation or scale update for something it may rewrite.
#[test]
fn fp8_training_with_the_fusion_passes_is_bit_identical() {
    for recipe in [Fp8Recipe::Current, Fp8Recipe::delayed()] {
        let session = |passes: &[&str]| {
            let (g, step, logits) = mlp(LossScale::Dynamic {
                initial: 1024.0,
                growth_interval: 2,
                growth_factor: 2.0,
                backoff_factor: 0.5,
            });
            let options = SessionOptions {
                passes: Some(passes.iter().map(|p| p.to_string()).collect()),
                ..options(Fp8Config::everywhere(recipe))
            };
            let s = Session::with_options(g, Device::Cpu, options).unwrap();
            (s, vec![step.step, step.loss, logits])
        };
        let what = format!("{recipe:?}");
        let (plain, fused, fused_fetch) =
            common::assert_same_bits_through_the_pipelines(session, feeds, &what);
        let fused_graph = fused.graph_for(&fused_fetch);
        assert_eq!(formats(fused_graph).len(), 8, "{recipe:?}");
        // The forward products took their layers' biases (gemm-epilogue).
        let with_bias = (fused_graph.node_ids())
            .filter_map(|id| fused_graph.node(id).op.downcast_ref::<Fp8MatMul>())
            .filter(|p| p.bias)
            .count();
        assert_eq!(with_bias, 3, "{recipe:?}");
        // Under delayed scaling the GELU is computed by the cast quantising it
        // (activation-into-fp8); current scaling's Fp8Scale reads it too, and it stays.
        let activated = (fused_graph.node_ids())
            .filter_map(|id| fused_graph.node(id).op.downcast_ref::<QuantizeFp8>())
            .filter(|q| q.activation.is_some())
            .count();
        let delayed = matches!(recipe, Fp8Recipe::Delayed { .. });
        assert_eq!(activated, usize::from(delayed), "{recipe:?}");
        // Current scaling's amaxes come from the kernels computing the tensors
        // (amax-into-elementwise); under delayed scaling the GELU gradient is computed
        // by its cast (elementwise-into-fp8).
        let count = |name: &str| {
            (fused_graph.node_ids())
                .filter(|&id| fused_graph.node(id).op_name() == name)
                .count()
        };
        let (measured, gradients) = (count("Fp8ScaleOfAmax"), count("FusedQuantizeFp8"));
        assert_eq!(
            (measured > 0, gradients > 0),
            (!delayed, delayed),
            "{recipe:?}"
        );
        for name in [
            "dense/kernel",
            "dense_1/kernel",
            "ampgraph/fp8/x/e4m3/scale",
        ] {
            assert_eq!(
                plain.variable(name).map(|t| t.to_f64_vec()),
                fused.variable(name).map(|t| t.to_f64_vec()),
                "{recipe:?} {name}"
            );
        }
    }
}

/// A pre-LN transformer's FP8 training step under delayed scaling (a tiny GPT-2, every
/// product FP8): with the CUDA pipeline each of its layer norms is computed by
/// the casts quantising them (`norm-into-fp8`: their 16-bit outputs are gone), their
/// gradients cast for the products before them as they are stored
/// (`norm-grad-into-fp8`) and its weights are cast by one node (`group-fp8-casts`),
/// five steps compute the same bits
/// on the CPU as the pipeline without those passes (the
/// fused attention's online softmax rounds apart from the graph's, so the pipelines
/// are compared with each other, not with no passes), and the step lowers on the CUDA
/// executor.
#[test]
fn a_transformers_norms_are_computed_by_their_fp8_casts() {
    use ampgraph::exec::cuda::pipeline_names;
    use ampgraph::exec::CudaExecutor;
    use ampgraph::graph::models::gpt2::{self, Gpt2Config};
    use ampgraph::passes::registry::SIMPLIFY_PIPELINE;
    let config = Gpt2Config {
        vocab: 16,
        positions: 8,
        layers: 2,
        heads: 2,
        width: 32,
        dropout: 0.0,
        attention_dropout: 0.0,
    };
    let (batch, seq) = (4, 8);
    let session = |fold: bool| {
        let mut g = Graph::new();
        let tokens = g.placeholder("tokens", DType::I64, [batch, seq]).unwrap();
        let labels = g.placeholder("labels", DType::I64, [batch * seq]).unwrap();
        let logits = gpt2::build(&mut g, tokens, &config).unwrap();
        let loss = g.softmax_cross_entropy(logits, labels).unwrap();
        let step = enable_mixed_precision_graph_rewrite(Sgd::new(0.1))
            .with_dtype(DType::BF16)
            .with_loss_scale(LossScale::None)
            .minimize(&mut g, loss)
            .unwrap();
        let passes = [SIMPLIFY_PIPELINE, &pipeline_names(&Default::default())].concat();
        let passes = (passes.into_iter())
            .filter(|&p| {
                fold || !["norm-into-fp8", "norm-grad-into-fp8", "group-fp8-casts"].contains(&p)
            })
            .map(String::from);
        let options = SessionOptions {
            passes: Some(passes.collect()),
            ..options(Fp8Config::everywhere(Fp8Recipe::delayed()))
        };
        let s = Session::with_options(g, Device::Cpu, options).unwrap();
        (s, vec![step.step, step.loss, logits])
    };
    let feeds = |step: u64| {
        let at = |i: u64| ((i * 7 + step * 3) % 16) as f64;
        let tokens: Vec<f64> = (0..(batch * seq) as u64).map(at).collect();
        let labels: Vec<f64> = (0..(batch * seq) as u64).map(|i| at(i + 1)).collect();
        Feeds::from([
            (
                "tokens".into(),
                Tensor::from_f64(DType::I64, [batch, seq], &tokens).unwrap(),
            ),
            (
                "labels".into(),
                Tensor::from_f64(DType::I64, [batch * seq], &labels).unwrap(),
            ),
        ])
    };
    let ((mut apart, fetch_apart), (mut folded, fetch)) = (session(false), session(true));
    for k in 0..5 {
        let want = apart.run(&fetch_apart, &feeds(k)).unwrap();
        let got = folded.run(&fetch, &feeds(k)).unwrap();
        assert_eq!(want, got, "step {k}");
    }
    let count = |g: &Graph, name: &str| {
        g.node_ids()
            .filter(|&id| g.node(id).op_name() == name)
            .count()
    };
    let g = folded.graph_for(&fetch);
    // Each block's two and the final one (the tied head's product is FP8 too here).
    assert_eq!(count(g, "LayerNormQuantizeFp8"), 2 * config.layers + 1);
    assert_eq!(count(g, "LayerNorm"), 0);
    // Every weight's cast: each block's four products' and the tied head's.
    assert_eq!(count(g, "GroupedQuantizeFp8"), 1);
    let grouped = (g.node_ids())
        .filter_map(|id| g.node(id).op.downcast_ref::<GroupedQuantizeFp8>())
        .map(|q| q.members)
        .sum::<usize>();
    assert_eq!(grouped, 4 * config.layers + 1);
    // The gradients of each block's norms and the final one's, cast for the products
    // before them (the first block's first norm's gradient goes to the embeddings).
    assert_eq!(count(g, "LayerNormGradQuantizeFp8"), 2 * config.layers);
    for name in [
        "LayerNormQuantizeFp8",
        "LayerNormGradQuantizeFp8",
        "GroupedQuantizeFp8",
    ] {
        assert_eq!(count(apart.graph_for(&fetch_apart), name), 0, "{name}");
    }
    CudaExecutor::check_supported(g).unwrap();
}

/// An FP8 training step (both recipes, a dynamic loss scale, every product FP8 but
/// the 8-class head's, whose n = 8 cuBLASLt's FP8 kernels do not take) lowers on the CUDA executor after
/// the CUDA pipeline, every node (no device needed: planning the lowering is enough).
#[test]
fn an_fp8_training_step_lowers_on_cuda() {
    use ampgraph::exec::CudaExecutor;
    for recipe in [Fp8Recipe::Current, Fp8Recipe::delayed()] {
        // 32 inputs: every product's k and n multiples of 16 but the head's.
        let (mut g, _, _) = mlp_of(32, LossScale::default());
        let mut fp8 = Fp8Config::everywhere(recipe);
        fp8.keep.insert("dense_2/matmul".into());
        AutoMixedPrecision::new(AmpConfig::new(DType::BF16).unwrap().with_fp8(fp8))
            .rewrite(&mut g)
            .unwrap();
        common::cuda_passes(&mut g);
        assert_eq!(formats(&g).len(), 5, "{recipe:?}");
        CudaExecutor::check_supported(&g).unwrap();
    }
}

/// A checkpoint moves between precisions: a BF16 run's restores into an FP8 session
/// (delayed scaling's state starts afresh: zero histories, unit scales) and the FP8
/// run's back into a BF16 session (which skips that state), the weights the same.
#[test]
fn checkpoints_move_between_bf16_and_fp8_sessions() {
    let dir = common::ScratchDir::new("fp8-switch");
    let path = dir.join("switch.ckpt");
    let bf16 = || {
        let (g, step, _) = mlp(LossScale::None);
        let options = SessionOptions {
            amp: Some(AmpConfig::new(DType::BF16).unwrap()),
            ..SessionOptions::default()
        };
        (
            Session::with_options(g, Device::Cpu, options).unwrap(),
            step,
        )
    };
    let (mut first, step) = bf16();
    first.run(&[step.step], &feeds(0, None)).unwrap();
    first.save(&path).unwrap();
    let (g, step, _) = mlp(LossScale::None);
    let mut fp8 = Session::with_options(
        g,
        Device::Cpu,
        options(Fp8Config::everywhere(Fp8Recipe::delayed())),
    )
    .unwrap();
    fp8.run(&[step.step], &feeds(0, None)).unwrap();
    fp8.restore(&path).unwrap();
    assert_eq!(fp8.variable("dense/kernel"), first.variable("dense/kernel"));
    let history = "ampgraph/fp8/dense/kernel/e4m3/amax_history";
    assert_eq!(fp8.variable(history).unwrap().to_f64_vec(), vec![0.0; 1024]);
    assert_eq!(scalar(&fp8, "ampgraph/fp8/dense/kernel/e4m3/scale"), 1.0);
    fp8.run(&[step.step], &feeds(1, None)).unwrap();
    fp8.save(&path).unwrap();
    let (mut back, _) = bf16();
    back.restore(&path).unwrap();
    assert_eq!(back.variable("dense/kernel"), fp8.variable("dense/kernel"));

    // A checkpoint holding a tensor's history and scale but not its inverse (as
    // written before the inverse was state) restarts that tensor's state whole; the
    // others' come back as saved.
    let state = |what: &str| format!("ampgraph/fp8/dense/kernel/e4m3/{what}");
    let saved = ampgraph::checkpoint::read(&path, false).unwrap();
    let without: Vec<(String, Tensor)> = saved
        .iter()
        .filter(|(name, _)| *name != state("scale_inv"))
        .cloned()
        .collect();
    assert_eq!(without.len() + 1, saved.len());
    assert_ne!(scalar(&fp8, &state("scale")), 1.0);
    ampgraph::checkpoint::write(&path, &without).unwrap();
    fp8.restore(&path).unwrap();
    assert_eq!(
        fp8.variable(&state("amax_history")).unwrap().to_f64_vec(),
        vec![0.0; 1024]
    );
    assert_eq!(
        (
            scalar(&fp8, &state("scale")),
            scalar(&fp8, &state("scale_inv"))
        ),
        (1.0, 1.0)
    );
    let x_scale = "ampgraph/fp8/x/e4m3/scale";
    let saved_x = saved.iter().find(|(name, _)| name == x_scale).unwrap();
    assert_eq!(fp8.variable(x_scale), Some(&saved_x.1));
}

/// Data parallelism with delayed scaling: two replicas fed different inputs keep the
/// same amax histories, scales and inverses, those of the larger of their amaxes (the
/// input's history reads each replica's own amax otherwise).
#[test]
fn replicas_share_delayed_scaling_state_through_the_max_of_their_amaxes() {
    use ampgraph::parallel::{ReplicaOptions, Replicas};
    let (g, step, _) = mlp(LossScale::None);
    let options = ReplicaOptions {
        session: options(Fp8Config::everywhere(Fp8Recipe::delayed())),
        ..ReplicaOptions::default()
    };
    let mut replicas = Replicas::new(g, &[Device::Cpu, Device::Cpu], options).unwrap();
    let graph = replicas.session(0).unwrap().graph().clone();
    assert!(graph
        .node_ids()
        .any(|id| graph.node(id).name.starts_with("data_parallel/amax_max")));
    // Replica 1's inputs twice replica 0's: its amax of x is the larger.
    let scaled = |step: u64, by: f64| {
        let mut f = feeds(step, None);
        let x = f["x"]
            .to_f64_vec()
            .iter()
            .map(|v| v * by)
            .collect::<Vec<_>>();
        f.insert(
            "x".into(),
            Tensor::from_f64(DType::F32, [BATCH, 24], &x).unwrap(),
        );
        f
    };
    let feeds = [scaled(0, 1.0), scaled(0, 2.0)];
    let amax = |f: &Feeds| {
        f["x"]
            .to_f64_vec()
            .iter()
            .fold(0f64, |m, &v| m.max(bf16(v).abs()))
    };
    let want = amax(&feeds[0]).max(amax(&feeds[1]));
    replicas.run(&[step.step], &feeds).unwrap();
    let history = "ampgraph/fp8/x/e4m3/amax_history";
    for rank in 0..2 {
        let s = replicas.session(rank).unwrap();
        assert_eq!(
            s.variable(history).unwrap().to_f64_vec()[0],
            want,
            "replica {rank}"
        );
        assert_eq!(
            s.variable("ampgraph/fp8/x/e4m3/scale")
                .unwrap()
                .to_f64_vec()[0],
            f64::from(448f32 / want as f32),
            "replica {rank}"
        );
        assert_eq!(
            s.variable("ampgraph/fp8/x/e4m3/scale_inv")
                .unwrap()
                .to_f64_vec()[0],
            f64::from(1.0 / (448f32 / want as f32)),
            "replica {rank}"
        );
    }
}
