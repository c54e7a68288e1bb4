//! The fuse-attention pass on random explicit attentions (the bench transformer's
//! form: heads split by transposes, `softmax(q k^T * scale) v`, heads merged; causal
//! ones with a `-inf` mask above the diagonal added to the scores, and key-biased ones
//! with a fed `[B, 1, 1, Sk]` padding mask or bias added), with
//! and without their autodiff gradients, in f16 and bf16: the pass fuses exactly one
//! attention (and its gradient), leaves a valid graph that survives JSON, changes
//! nothing on a second run, and the CPU computes the outputs and gradients within
//! the 16-bit rounding bound of the same graph evaluated in f64.

mod common;

use std::collections::HashMap;

use ampgraph::exec::{CpuExecutor, Executor};
use ampgraph::graph::autodiff::gradients;
use ampgraph::graph::ops::{
    BatchMatMul, Binary, BinaryGrad, BinaryKind, Cast, Const, Dropout, FusedAttention,
    FusedAttentionGrad, Softmax,
};
use ampgraph::graph::Op;
use ampgraph::graph::{DType, Graph, NodeId, Port, Tensor};
use ampgraph::passes::attention::FuseAttention;
use ampgraph::passes::simplify::{Dce, ScaleIntoMatmul};
use ampgraph::passes::{Pass, PassSummary};
use common::json;
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    q_len: usize,
    k_len: usize,
    head_dim: usize,
    scale: f64,
    train: bool,
    causal: bool,
    key_bias: bool,
    /// A Dropout of the probabilities (rate 0.25) at the step count `count`.
    dropout: bool,
}

/// A small training attention the unit tests vary.
const SMALL: Case = Case {
    batch: 1,
    heads: 2,
    q_len: 8,
    k_len: 12,
    head_dim: 16,
    scale: 0.25,
    train: true,
    causal: false,
    key_bias: false,
    dropout: false,
};

/// The causal mask of `case` in `dtype`, `[Sq, Sk]`: `-inf` where key `j > i`.
fn causal_mask(case: Case, dtype: DType) -> Tensor {
    let values: Vec<f64> = (0..case.q_len * case.k_len)
        .map(|n| {
            if n % case.k_len > n / case.k_len {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_f64(dtype, vec![case.q_len, case.k_len], &values).unwrap()
}

/// The explicit attention of `case` in `dtype` (a power-of-two scale, which
/// `scale-into-matmul` folds into a 16-bit product, or 1/sqrt(head_dim), which stays
/// a Mul for 32 and 48); outputs y (and dq, dk, dv when training, of the loss
/// sum(y * w)).
fn explicit(case: Case, dtype: DType) -> Graph {
    let bias = [case.batch, 1, 1, case.k_len];
    explicit_with(case, dtype, &bias, false)
}

/// [`explicit`] with the key bias (where `case.key_bias`) of shape `bias`, and its
/// gradient an output too where `bias_grad`.
fn explicit_with(case: Case, dtype: DType, bias: &[usize], bias_grad: bool) -> Graph {
    let Case {
        batch: b,
        heads: h,
        q_len,
        k_len,
        head_dim: d,
        ..
    } = case;
    let mut g = Graph::new();
    let q = g.placeholder("q", dtype, [b, q_len, h, d]).unwrap();
    let k = g.placeholder("k", dtype, [b, k_len, h, d]).unwrap();
    let v = g.placeholder("v", dtype, [b, k_len, h, d]).unwrap();
    let split = |g: &mut Graph, x: Port| g.transpose(x, [0, 2, 1, 3]).unwrap();
    let (qt, kt, vt) = (split(&mut g, q), split(&mut g, k), split(&mut g, v));
    let s = g.batch_matmul_adj(qt, kt, false, true).unwrap();
    let scale = g.scalar(dtype, case.scale).unwrap();
    let mut s = g.mul(s, scale).unwrap();
    if case.causal {
        let mask = g.constant(causal_mask(case, dtype)).unwrap();
        s = g.plus(s, mask).unwrap();
    }
    let mut differentiate = vec![q, k, v];
    if case.key_bias {
        let bias = g.placeholder("bias", dtype, bias.to_vec()).unwrap();
        s = g.plus(bias, s).unwrap();
        if bias_grad {
            differentiate.push(bias);
        }
    }
    let mut p = g.softmax(s, -1).unwrap();
    if case.dropout {
        let count = g.placeholder("count", DType::F32, []).unwrap();
        let dropout = Dropout::new(0.25, 77).unwrap();
        p = g.add(dropout, &[p, count]).unwrap();
    }
    let y = g.batch_matmul(p, vt).unwrap();
    let y = g.transpose(y, [0, 2, 1, 3]).unwrap();
    let mut outputs = vec![y];
    if case.train {
        let w = g.placeholder("w", dtype, [b, q_len, h, d]).unwrap();
        let yw = g.mul(y, w).unwrap();
        let loss = g.sum(yw, None, false).unwrap();
        outputs.extend(gradients(&mut g, loss, &differentiate).unwrap());
    }
    g.set_outputs(outputs).unwrap();
    g
}

/// Values in [-2, 2] for q and k, [-1, 1] for v and w, rounded to `dtype`; a key
/// bias in [-1, 1], `-inf` (padding) on the last third of batch 0's keys.
fn feeds(case: Case, dtype: DType, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = common::Rng(seed);
    let (b, h, d) = (case.batch, case.heads, case.head_dim);
    let mut bias: Vec<f64> = (0..b * case.k_len)
        .map(|_| 2.0 * rng.unit() - 1.0)
        .collect();
    // Key 0 always stays, so no row is masked whole.
    let padded = (2 * case.k_len).div_ceil(3).max(1);
    bias[padded..case.k_len].fill(f64::NEG_INFINITY);
    let bias = Tensor::from_f64(dtype, vec![b, 1, 1, case.k_len], &bias).unwrap();
    let bias = ("bias".to_string(), bias);
    [
        ("q", case.q_len, 2.0),
        ("k", case.k_len, 2.0),
        ("v", case.k_len, 1.0),
        ("w", case.q_len, 1.0),
    ]
    .into_iter()
    .map(|(name, len, range)| {
        let values: Vec<f64> = (0..b * len * h * d)
            .map(|_| (2.0 * rng.unit() - 1.0) * range)
            .collect();
        let t = Tensor::from_f64(dtype, vec![b, len, h, d], &values).unwrap();
        (name.to_string(), t)
    })
    .chain(case.key_bias.then_some(bias))
    .chain(
        case.dropout
            .then(|| ("count".to_string(), Tensor::scalar(DType::F32, 5.0))),
    )
    .collect()
}

fn widened(feeds: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    feeds
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                if n == "count" {
                    t.clone()
                } else {
                    t.cast(DType::F64)
                },
            )
        })
        .collect()
}

fn fuse(g: &mut Graph) -> PassSummary {
    Dce.run(g).unwrap();
    ScaleIntoMatmul.run(g).unwrap();
    FuseAttention.run(g).unwrap()
}

/// The number at the end of summary line `k`.
fn count(summary: &PassSummary, k: usize) -> usize {
    let line = &summary.lines[k];
    line.rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{line}"))
}

fn has<T: Op>(g: &Graph) -> bool {
    g.node_ids().any(|id| g.node(id).op.is::<T>())
}

/// The causal mask's Const (the one of rank 2), if the graph has it.
fn mask(g: &Graph) -> Option<NodeId> {
    g.node_ids()
        .find(|&id| g.node(id).op.is::<Const>() && g.ty(Port::new(id, 0)).rank() == 2)
}

fn check(case: Case, dtype: DType, seed: u64) -> Result<(), TestCaseError> {
    let mut g = explicit(case, dtype);
    let summary = fuse(&mut g);
    g.validate().unwrap();
    prop_assert_eq!(count(&summary, 0), 1, "{}", summary);
    prop_assert_eq!(count(&summary, 1), usize::from(case.train), "{}", summary);
    let masks = |id| {
        let op = &g.node(id).op;
        op.downcast_ref::<FusedAttention>()
            .map(|a| (a.causal, a.key_bias, a.dropout.is_some()))
            .or(op
                .downcast_ref::<FusedAttentionGrad>()
                .map(|a| (a.causal, a.key_bias, a.dropout.is_some())))
    };
    let flags: Vec<(bool, bool, bool)> = g.node_ids().filter_map(masks).collect();
    let want = (case.causal, case.key_bias, case.dropout);
    prop_assert_eq!(flags, vec![want; 1 + usize::from(case.train)]);
    prop_assert!(
        !has::<Softmax>(&g) && !has::<BatchMatMul>(&g) && !has::<Dropout>(&g) && mask(&g).is_none(),
        "the explicit form (and any mask or dropout) is gone"
    );
    // JSON round trip and idempotence.
    let text = json(&g);
    let back = ampgraph::graph::format::graph_from_bytes(text.as_bytes()).unwrap();
    prop_assert_eq!(&text, &json(&back));
    let mut again = g.clone();
    prop_assert_eq!(count(&FuseAttention.run(&mut again).unwrap(), 0), 0);
    prop_assert_eq!(&text, &json(&again));
    // Values: the fused 16-bit graph against the explicit graph in f64.
    let f = feeds(case, dtype, seed);
    let truth_graph = explicit(case, DType::F64);
    let truth = CpuExecutor::new()
        .run(&truth_graph, &widened(&f), truth_graph.outputs())
        .unwrap();
    let got = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
    let unit_roundoff = if dtype == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    };
    for (k, (want, got)) in truth.iter().zip(&got).enumerate() {
        prop_assert_eq!(got.dtype(), dtype);
        prop_assert_eq!(got.shape(), want.shape());
        let want = want.to_f64_vec();
        let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        // A few roundings (probabilities, dS, the output) of values up to `scale`.
        let bound = 16.0 * unit_roundoff * scale;
        for (i, (a, b)) in want.iter().zip(got.to_f64_vec()).enumerate() {
            prop_assert!(
                (a - b).abs() <= bound,
                "output {k} element {i}: {a} vs {b} (bound {bound})"
            );
        }
    }
    Ok(())
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=2, 1usize..=3, 1usize..=70, 1usize..=70),
        prop::sample::select(vec![16usize, 32, 48, 64, 80, 128]),
        // 0: 1/sqrt(head_dim), as attention scales.
        0i32..=4,
        any::<bool>(),
        (any::<bool>(), any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (batch, heads, q_len, k_len),
                head_dim,
                halvings,
                train,
                (causal, key_bias, dropout),
            )| Case {
                batch,
                heads,
                q_len,
                k_len,
                head_dim,
                scale: match halvings {
                    0 => 1.0 / (head_dim as f64).sqrt(),
                    h => 2f64.powi(-h),
                },
                train,
                causal,
                key_bias,
                dropout,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn fused_attention_is_valid_accurate_and_idempotent(
        c in case(),
        bf16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        check(c, if bf16 { DType::BF16 } else { DType::F16 }, seed)?;
    }
}

/// What the kernels cannot take, or a probability tensor somebody else reads, stays
/// explicit.
#[test]
fn unsupported_attentions_stay_explicit() {
    let base = Case { k_len: 8, ..SMALL };
    let wide = Case {
        head_dim: 144,
        ..base
    };
    // The kernels take the scores' row maximum before scaling.
    let negative = Case {
        scale: -0.25,
        ..base
    };
    for (what, mut g) in [
        ("f32", explicit(base, DType::F32)),
        ("head width 144", explicit(wide, DType::F16)),
        ("negative scale", explicit(negative, DType::F16)),
    ] {
        let summary = fuse(&mut g);
        assert_eq!(count(&summary, 0), 0, "{what}: {summary}");
        assert!(has::<Softmax>(&g), "{what}");
    }
    // The probabilities as a graph output.
    let mut g = explicit(base, DType::F16);
    let p = g
        .node_ids()
        .find(|&id| g.node(id).op.is::<Softmax>())
        .unwrap();
    let mut outputs = g.outputs().to_vec();
    outputs.push(p.into());
    g.set_outputs(outputs).unwrap();
    assert_eq!(count(&fuse(&mut g), 0), 0);
}

/// Only the causal mask makes a causal attention: a mask that differs from it in one
/// entry, or a 16-bit mask with a finite value, keeps the explicit form (and its
/// Add); an f32 mask of -1e9 is `-inf` once cast to 16 bits, and fuses.
#[test]
fn other_masks_stay_explicit() {
    let case = Case {
        causal: true,
        ..SMALL
    };
    let mut g = explicit(case, DType::F16);
    assert_eq!(count(&fuse(&mut g), 0), 1, "the causal mask fuses");
    let causal = causal_mask(case, DType::F16).to_f64_vec();
    let mut one_off = causal.clone();
    one_off[3] = 0.0; // query 0 sees key 3
    let finite: Vec<f64> = causal.iter().map(|&v| v.max(-1e4)).collect();
    for (what, values) in [("one entry off", one_off), ("finite", finite)] {
        let mut g = explicit(case, DType::F16);
        let t = Tensor::from_f64(DType::F16, vec![case.q_len, case.k_len], &values).unwrap();
        g.set_op(mask(&g).unwrap(), Box::new(Const::new(t)));
        let summary = fuse(&mut g);
        assert_eq!(count(&summary, 0), 0, "{what}: {summary}");
        assert!(has::<Softmax>(&g), "{what}");
    }
    let mut g = explicit(case, DType::F16);
    let f16_mask = mask(&g).unwrap();
    let large: Vec<f64> = causal.iter().map(|&v| v.max(-1e9)).collect();
    let large = Tensor::from_f64(DType::F32, vec![case.q_len, case.k_len], &large).unwrap();
    let large = g.constant(large).unwrap();
    g.set_node(f16_mask, Box::new(Cast { to: DType::F16 }), &[large])
        .unwrap();
    let summary = fuse(&mut g);
    assert_eq!(count(&summary, 0), 1, "-1e9 cast to f16: {summary}");
    assert_eq!(count(&summary, 1), 1, "{summary}");
}

/// 1/sqrt(32) and 1/sqrt(48) are no powers of two: `scale-into-matmul` leaves their
/// 16-bit Mul (and its gradient's), and the fused ops take the scale from it.
#[test]
fn scales_left_as_a_mul_fuse() {
    for (head_dim, causal) in [(32, false), (48, true)] {
        let case = Case {
            batch: 2,
            heads: 3,
            q_len: 40,
            k_len: 40,
            head_dim,
            scale: 1.0 / (head_dim as f64).sqrt(),
            train: true,
            causal,
            key_bias: false,
            dropout: causal,
        };
        let mut g = explicit(case, DType::F16);
        Dce.run(&mut g).unwrap();
        ScaleIntoMatmul.run(&mut g).unwrap();
        // Muls (and Mul gradients) of the scores [B, H, Sq, Sk].
        let scores = [case.batch, case.heads, case.q_len, case.k_len];
        let muls = |g: &Graph| {
            g.node_ids()
                .filter(|&id| {
                    let op = &g.node(id).op;
                    let mul = op.downcast_ref::<Binary>().map(|b| b.kind) == Some(BinaryKind::Mul)
                        || op.downcast_ref::<BinaryGrad>().map(|b| b.kind) == Some(BinaryKind::Mul);
                    mul && g.ty(Port::new(id, 0)).shape == scores
                })
                .count()
        };
        assert_eq!(muls(&g), 2, "the scale and its gradient stay Muls");
        check(case, DType::F16, 7).unwrap();
        let fused = {
            let mut g = g.clone();
            FuseAttention.run(&mut g).unwrap();
            g
        };
        let scale = fused
            .node_ids()
            .find_map(|id| fused.node(id).op.downcast_ref::<FusedAttention>())
            .unwrap()
            .scale;
        let want = Tensor::from_f64(DType::F16, vec![], &[case.scale])
            .unwrap()
            .to_f64_vec()[0];
        assert_eq!(scale, want, "the 16-bit scale the Mul multiplied by");
        assert_eq!(muls(&fused), 0, "the scale's Mul and its gradient are gone");
    }
}

/// A key bias is any `[B or 1, 1, 1, Sk]` tensor that takes no gradient: one row
/// shared by the batches fuses; a bias per query, or one whose gradient is asked for,
/// keeps the explicit form.
#[test]
fn key_bias_rules() {
    let case = Case {
        batch: 2,
        key_bias: true,
        ..SMALL
    };
    let (b, sq, sk) = (case.batch, case.q_len, case.k_len);
    let expect = [
        ("shared row", vec![1, 1, 1, sk], false, 1),
        ("per query", vec![b, 1, sq, sk], false, 0),
        ("with its gradient", vec![b, 1, 1, sk], true, 0),
    ];
    for (what, shape, bias_grad, fused) in expect {
        let mut g = explicit_with(case, DType::F16, &shape, bias_grad);
        let summary = fuse(&mut g);
        g.validate().unwrap();
        assert_eq!(count(&summary, 0), fused, "{what}: {summary}");
        assert_eq!(has::<Softmax>(&g), fused == 0, "{what}");
    }
}

/// A key bias of the wrong shape or dtype, or a missing one, is an error naming the
/// node and the problem.
#[test]
fn bad_key_biases_are_clear_errors() {
    let op = FusedAttention {
        scale: 0.25,
        causal: false,
        key_bias: true,
        packed: false,
        dropout: None,
    };
    for (bias_shape, bias_dtype, want) in [
        (
            vec![2, 1, 4, 12],
            DType::F16,
            "key bias must be [2 or 1, 1, 1, 12], got [2, 1, 4, 12]",
        ),
        (
            vec![3, 1, 1, 12],
            DType::F16,
            "key bias must be [2 or 1, 1, 1, 12]",
        ),
        (
            vec![1, 1, 1, 12],
            DType::F32,
            "key bias is f32 but q is f16",
        ),
    ] {
        let mut g = Graph::new();
        let q = g.placeholder("q", DType::F16, [2, 8, 2, 16]).unwrap();
        let k = g.placeholder("k", DType::F16, [2, 12, 2, 16]).unwrap();
        let v = g.placeholder("v", DType::F16, [2, 12, 2, 16]).unwrap();
        let bias = g.placeholder("bias", bias_dtype, bias_shape).unwrap();
        let err = g
            .add_node("att", Box::new(op.clone()), &[q, k, v, bias])
            .unwrap_err()
            .to_string();
        assert!(err.contains(want) && err.contains("att"), "{err}");
        let err = g
            .add_node("no_bias", Box::new(op.clone()), &[q, k, v])
            .unwrap_err()
            .to_string();
        assert!(err.contains("no_bias") && err.contains("4 inputs"), "{err}");
    }
}

/// [`explicit`] with no key bias placeholder but a constant `mask` `[B, 1, Sq, Sk]`
/// added to the scaled scores, as HF transformers' eager attention adds its expanded
/// padding mask.
fn with_constant_mask(case: Case, dtype: DType, mask: &[f64]) -> Graph {
    let mut g = explicit(case, dtype);
    let softmax = g
        .node_ids()
        .find(|&id| g.node(id).op.is::<Softmax>())
        .unwrap();
    let scores = g.inputs(softmax)[0];
    let shape = vec![case.batch, 1, case.q_len, case.k_len];
    let mask = Tensor::from_f64(dtype, shape, mask).unwrap();
    let mask = g.constant(mask).unwrap();
    let masked = g.plus(scores, mask).unwrap();
    g.set_input(softmax, 0, masked).unwrap();
    g
}

/// A constant mask expanded over the queries (every row of a matrix alike) is a key
/// bias of its rows, one of zeros no mask at all; a mask whose rows differ keeps the
/// explicit form. The fused graphs compute the explicit one's values.
#[test]
fn constant_masks_alike_over_the_queries_become_key_biases() {
    let case = Case { batch: 2, ..SMALL };
    let (b, sq, sk) = (case.batch, case.q_len, case.k_len);
    // Batch 0 pads its last three keys; batch 1 biases its keys by a ramp.
    let padded = |i: usize| -> f64 {
        let (batch, key) = (i / (sq * sk), i % sk);
        match batch {
            0 if key >= sk - 3 => f64::NEG_INFINITY,
            0 => 0.0,
            _ => key as f64 / 8.0 - 0.5,
        }
    };
    let zeros = vec![0.0; b * sq * sk];
    let alike: Vec<f64> = (0..b * sq * sk).map(padded).collect();
    let mut differ = alike.clone();
    differ[sk + 1] = -1.0; // query 1 of batch 0
    for (what, mask, fused, key_bias) in [
        ("zeros", &zeros, 1, false),
        ("alike", &alike, 1, true),
        ("rows differ", &differ, 0, false),
    ] {
        let mut g = with_constant_mask(case, DType::F16, mask);
        let summary = fuse(&mut g);
        g.validate().unwrap();
        assert_eq!(count(&summary, 0), fused, "{what}: {summary}");
        if fused == 0 {
            assert!(has::<Softmax>(&g), "{what}");
            continue;
        }
        let flags: Vec<bool> = (g.node_ids())
            .filter_map(|id| g.node(id).op.downcast_ref::<FusedAttention>())
            .map(|a| a.key_bias)
            .collect();
        assert_eq!(flags, [key_bias], "{what}");
        let f = feeds(case, DType::F16, 7);
        let truth_graph = with_constant_mask(case, DType::F64, mask);
        let truth = CpuExecutor::new()
            .run(&truth_graph, &widened(&f), truth_graph.outputs())
            .unwrap();
        let got = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
        for (k, (want, got)) in truth.iter().zip(&got).enumerate() {
            let want = want.to_f64_vec();
            let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            let bound = 16.0 * 2f64.powi(-11) * scale;
            for (a, b) in want.iter().zip(got.to_f64_vec()) {
                assert!((a - b).abs() <= bound, "{what} output {k}: {a} vs {b}");
            }
        }
    }
}
