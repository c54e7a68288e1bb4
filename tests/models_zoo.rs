//! The zoo of models people train (`graph::models`): the parameter counts of their
//! reference configurations equal torchvision's and Hugging Face's, and small
//! configurations train on the CPU (the loss of a fixed batch falls).

mod common;

use std::collections::HashMap;

use common::{amp_and_cuda_passes, count};

use ampgraph::exec::memory_plan::step_footprint;
use ampgraph::graph::models::bert::{self, BertConfig};
use ampgraph::graph::models::gpt2::{self, Gpt2Config};
use ampgraph::graph::models::resnet::{self, ResNetConfig};
use ampgraph::graph::models::vit::{self, VitConfig};
use ampgraph::graph::models::NormNames;
use ampgraph::graph::ops::{Group, Variable};
use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Adam, LossScale, Optimizer, Sgd};
use ampgraph::passes::recompute::RecomputeActivations;
use ampgraph::passes::Pass;
use ampgraph::pretrained::{load_safetensors, WeightsError, WeightsReport};
use ampgraph::{DType, Device, Graph, Port, Session, Tensor};

/// The trainable parameters of `g`: its Variables but the batch norms' running
/// averages (PyTorch's buffers).
fn parameters(g: &Graph) -> usize {
    g.node_ids()
        .filter(|&id| g.node(id).op.is::<Variable>())
        .filter(|&id| !NormNames::is_running_average(&g.node(id).name))
        .map(|id| g.node(id).outputs()[0].shape.iter().product::<usize>())
        .sum()
}

/// Trains the model `g` built (its `logits` against `labels`, both placeholders fed by
/// `feeds`) with Adam at `learning_rate` for `steps` steps: the first and last loss.
fn trained_with_adam(
    mut g: Graph,
    (logits, labels): (Port, Port),
    learning_rate: f64,
    feeds: &HashMap<String, Tensor>,
    steps: usize,
) -> (f64, f64) {
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = Adam::new(learning_rate).minimize(&mut g, loss).unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    first_and_last_loss(&mut session, [loss, step.step], feeds, steps)
}

/// The loss of the first and the last of `steps` training steps (`[loss, step]`).
fn first_and_last_loss(
    session: &mut Session,
    fetches: [Port; 2],
    feeds: &HashMap<String, Tensor>,
    steps: usize,
) -> (f64, f64) {
    let mut losses = (0..steps).map(|_| session.run(&fetches, feeds).unwrap()[0].to_f64_vec()[0]);
    let first = losses.next().unwrap();
    (first, losses.last().unwrap_or(first))
}

#[test]
fn resnet50_has_torchvisions_parameter_count() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [1, 3, 224, 224]).unwrap();
    let net = resnet::build(&mut g, x, &ResNetConfig::RESNET50, false).unwrap();
    // torchvision.models.resnet50(): sum(p.numel() for p in m.parameters()).
    assert_eq!(parameters(&g), 25_557_032);
    assert_eq!(g.ty(net.logits).shape, [1, 1000]);
    let convolutions = (g.node_ids())
        .filter(|&id| g.node(id).op_name() == "Conv2D")
        .count();
    assert_eq!(
        convolutions, 53,
        "the stem, 16 bottlenecks of 3, 4 projections"
    );
}

/// A small ResNet (one bottleneck a stage, width 4) trains on one batch of 8 images of
/// 3 classes on the CPU: SGD with momentum takes its loss below half the first step's
/// in 30 steps, and the batch norms' running averages move.
#[test]
fn a_small_resnet_trains_on_the_cpu() {
    let config = TINY_RESNET;
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [8, 3, 32, 32]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [8]).unwrap();
    let net = resnet::build(&mut g, x, &config, true).unwrap();
    let loss = g.softmax_cross_entropy(net.logits, labels).unwrap();
    let mut step = Sgd::momentum(0.05, 0.9).minimize(&mut g, loss).unwrap();
    step.step = g
        .add(Group, &[&[step.step], &net.running_updates[..]].concat())
        .unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let feeds = HashMap::from([
        (
            "x".to_string(),
            Tensor::from_f64(
                DType::F32,
                vec![8, 3, 32, 32],
                &common::uniform_values(8 * 3 * 32 * 32, 1),
            )
            .unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, vec![8], &[0., 1., 2., 0., 1., 2., 0., 1.]).unwrap(),
        ),
    ]);
    let (first, last) = first_and_last_loss(&mut session, [loss, step.step], &feeds, 31);
    assert!(
        last.is_finite() && last < 0.5 * first,
        "loss {first} -> {last}"
    );
    let mean = session.variable("bn1.running_mean").unwrap().to_f64_vec();
    assert!(mean.iter().any(|&m| m != 0.0), "running mean {mean:?}");
}

/// In the CUDA pipeline after AMP every bottleneck's last batch norm takes the block's
/// residual Add and its Relu (a side input, `fuse-batchnorm-activation`): the forward
/// has no elementwise pass over images left.
#[test]
fn a_resnets_residual_adds_fold_into_its_batch_norms() {
    use ampgraph::graph::ops::{BatchNorm, NormActivation};
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 3, 32, 32]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [2]).unwrap();
    let net = resnet::build(&mut g, x, &TINY_RESNET, true).unwrap();
    let loss = g.softmax_cross_entropy(net.logits, labels).unwrap();
    let step = Sgd::momentum(0.05, 0.9).minimize(&mut g, loss).unwrap();
    g.set_outputs(vec![step.loss, step.step]).unwrap();
    amp_and_cuda_passes(&mut g);
    let with_side: Vec<&BatchNorm> = g
        .node_ids()
        .filter(|&id| g.inputs(id).len() == 6)
        .filter_map(|id| g.node(id).op.downcast_ref::<BatchNorm>())
        .collect();
    assert_eq!(with_side.len(), TINY_RESNET.blocks.iter().sum::<usize>());
    assert!(with_side
        .iter()
        .all(|bn| bn.activation == NormActivation::Relu));
    // No elementwise pass over images is left in the forward (the backward still
    // sums the gradients reaching the max pool's output from both branches).
    let forward_image_passes = g.node_ids().filter(|&id| {
        let node = g.node(id);
        let elementwise = ["Add", "Relu", "FusedElementwise"].contains(&node.op_name());
        elementwise && node.outputs()[0].rank() == 4 && !node.name.contains("gradients/")
    });
    assert_eq!(forward_image_passes.count(), 0);
}

#[test]
fn gpt2_124m_has_hugging_faces_parameter_count() {
    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [1, 1024]).unwrap();
    let logits = gpt2::build(&mut g, tokens, &Gpt2Config::GPT2_124M).unwrap();
    // GPT2LMHeadModel.from_pretrained("gpt2"): its parameters, lm_head tied to wte.
    assert_eq!(parameters(&g), 124_439_808);
    assert_eq!(g.ty(logits).shape, [1024, 50257]);
    assert!(g.find("transformer.h.11.mlp.c_proj.weight").is_some());
}

/// One bottleneck a stage, width 4 (scripts/zoo's `RESNET`).
const TINY_RESNET: ResNetConfig = ResNetConfig {
    blocks: [1, 1, 1, 1],
    width: 4,
    classes: 3,
};

/// BERT small enough for the CPU, heads the fused kernels take (scripts/zoo's `BERT`).
const TINY_BERT: BertConfig = BertConfig {
    vocab: 16,
    positions: 12,
    token_types: 2,
    layers: 2,
    heads: 2,
    width: 32,
    intermediate: 64,
    dropout: 0.0,
    attention_dropout: 0.0,
};

/// A ViT of 8x8 images in 4x4 patches (scripts/zoo's `VIT`).
const TINY_VIT: VitConfig = VitConfig {
    image: 8,
    patch: 4,
    layers: 2,
    heads: 2,
    width: 32,
    mlp: 64,
    classes: 3,
};

/// Two layers, two heads of 16: small enough for the CPU, heads the fused kernels take.
const TINY_GPT2: Gpt2Config = Gpt2Config {
    vocab: 16,
    positions: 12,
    layers: 2,
    heads: 2,
    width: 32,
    dropout: 0.0,
    attention_dropout: 0.0,
};

/// `[batch, seq]` tokens and the next tokens as labels: `t -> (3 t + 1) mod vocab`
/// from a seeded start per row, a rule the model can learn.
fn next_token_batch(batch: usize, seq: usize) -> (Tensor, Tensor) {
    let vocab = TINY_GPT2.vocab as u64;
    let mut tokens = Vec::new();
    let mut labels = Vec::new();
    for row in 0..batch as u64 {
        let mut t = (row * 5 + 2) % vocab;
        for _ in 0..seq {
            tokens.push(t as f64);
            t = (3 * t + 1) % vocab;
            labels.push(t as f64);
        }
    }
    (
        Tensor::from_f64(DType::I64, vec![batch, seq], &tokens).unwrap(),
        Tensor::from_f64(DType::I64, vec![batch * seq], &labels).unwrap(),
    )
}

/// A GPT-2 of `config` on `[batch, seq]` token placeholders: the graph, its logits and
/// labels, and feeds of the next-token rule.
fn gpt2_on_the_rule(
    config: &Gpt2Config,
    (batch, seq): (usize, usize),
) -> (Graph, (Port, Port), HashMap<String, Tensor>) {
    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [batch, seq]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch * seq]).unwrap();
    let logits = gpt2::build(&mut g, tokens, config).unwrap();
    let (x, y) = next_token_batch(batch, seq);
    let feeds = HashMap::from([("tokens".to_string(), x), ("labels".to_string(), y)]);
    (g, (logits, labels), feeds)
}

/// A tiny GPT-2 learns a next-token rule on the CPU (Adam: the loss falls below a
/// fifth of the first step's in 60 steps).
#[test]
fn a_tiny_gpt2_learns_a_next_token_rule_on_the_cpu() {
    let (g, logits_labels, feeds) = gpt2_on_the_rule(&TINY_GPT2, (4, 8));
    let (first, last) = trained_with_adam(g, logits_labels, 0.01, &feeds, 60);
    assert!(
        last.is_finite() && last < 0.2 * first,
        "loss {first} -> {last}"
    );
}

/// With Hugging Face's dropout of 0.1 (after the embeddings and each sublayer: 5
/// Dropout nodes in two layers) a tiny GPT-2 learns the rule too, its masks change
/// every step (the step count advances), and the training step after AMP and the CUDA
/// passes has no Dropout node of its own: each is an instruction of a fused kernel,
/// its gradient too.
#[test]
fn a_tiny_gpt2_with_dropout_learns_and_its_dropouts_fuse() {
    let config = Gpt2Config {
        dropout: 0.1,
        ..TINY_GPT2
    };
    let (mut g, (logits, labels), feeds) = gpt2_on_the_rule(&config, (4, 8));
    assert_eq!(count(&g, "Dropout"), 5);
    let (first, last) = trained_with_adam(g.clone(), (logits, labels), 0.01, &feeds, 60);
    assert!(
        last.is_finite() && last < 0.3 * first,
        "loss {first} -> {last}"
    );
    // The same logits twice at one step count; others after a step.
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = Adam::new(0.0).minimize(&mut g, loss).unwrap();
    let mut training = g.clone();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let at_0 = session.run(&[logits], &feeds).unwrap();
    assert_eq!(session.run(&[logits], &feeds).unwrap(), at_0);
    session.run(&[step.step], &feeds).unwrap();
    assert_ne!(session.run(&[logits], &feeds).unwrap(), at_0, "a new mask");
    amp_and_cuda_passes(&mut training);
    assert_eq!(count(&training, "Dropout"), 0, "every dropout fused");
}

/// With Hugging Face's attention dropout too (`attn_pdrop` 0.1: one more Dropout a
/// layer, on the Softmax's probabilities before their product with v), a tiny GPT-2
/// learns the rule; after AMP and the CUDA passes each attention is fused with its
/// dropout, forward and gradient, no Dropout is left (the others fuse into elementwise
/// kernels) and the step lowers on the CUDA executor.
#[test]
fn a_tiny_gpt2_with_attention_dropout_learns_and_fuses_it() {
    let config = Gpt2Config {
        dropout: 0.1,
        attention_dropout: 0.1,
        ..TINY_GPT2
    };
    let (g, (logits, labels), feeds) = gpt2_on_the_rule(&config, (4, 8));
    assert_eq!(count(&g, "Dropout"), 7);
    let on_probabilities = g
        .node_ids()
        .filter(|&id| g.node(id).op_name() == "Dropout")
        .filter(|&id| g.node(g.inputs(id)[0].node).op_name() == "Softmax")
        .filter(|&id| {
            g.consumers(id)
                .iter()
                .all(|&(c, slot, _)| g.node(c).op_name() == "BatchMatMul" && slot == 0)
        })
        .count();
    assert_eq!(on_probabilities, 2);
    let (first, last) = trained_with_adam(g.clone(), (logits, labels), 0.01, &feeds, 60);
    assert!(
        last.is_finite() && last < 0.3 * first,
        "loss {first} -> {last}"
    );
    let mut training = g;
    let loss = training.softmax_cross_entropy(logits, labels).unwrap();
    Adam::new(0.01).minimize(&mut training, loss).unwrap();
    amp_and_cuda_passes(&mut training);
    assert_eq!(count(&training, "FusedAttention"), 2);
    assert_eq!(count(&training, "FusedAttentionGrad"), 2);
    assert_eq!(count(&training, "Dropout"), 0);
    training.validate().unwrap();
    // Every node lowers on the CUDA executor (no device needed to plan it).
    ampgraph::exec::CudaExecutor::check_supported(&training).unwrap();
}

/// Mixed precision trains as fp32 does: a tiny GPT-2 on the next-token rule, 40 AdamW
/// steps from the same weights in fp32, AMP bf16 (no loss scale, as PyTorch trains
/// bf16) and AMP fp16 (dynamic loss scale): the last losses within 1% of fp32's.
#[test]
fn amp_reaches_fp32s_loss_on_a_tiny_gpt2() {
    let train = |amp: Option<(DType, LossScale)>| -> (f64, f64) {
        let (mut g, (logits, labels), feeds) = gpt2_on_the_rule(&TINY_GPT2, (4, 8));
        let loss = g.softmax_cross_entropy(logits, labels).unwrap();
        let adamw = Adam::adamw(3e-3, 0.01);
        let step = match amp {
            Some((dtype, scale)) => enable_mixed_precision_graph_rewrite(adamw)
                .with_dtype(dtype)
                .with_loss_scale(scale)
                .minimize(&mut g, loss),
            None => adamw.minimize(&mut g, loss),
        }
        .unwrap();
        let mut session = Session::new(g, Device::Cpu).unwrap();
        first_and_last_loss(&mut session, [loss, step.step], &feeds, 40)
    };
    let (first, fp32) = train(None);
    assert!(fp32 < 0.5 * first, "fp32 trained: {first} -> {fp32}");
    for (what, amp) in [
        ("bf16", (DType::BF16, LossScale::None)),
        ("fp16", (DType::F16, LossScale::default())),
    ] {
        let (_, last) = train(Some(amp));
        let gap = (last - fp32).abs() / fp32;
        println!("{what}: {last} against fp32's {fp32} ({gap:.4})");
        assert!(gap < 0.01, "{what}: {last} against fp32's {fp32}");
    }
}

/// `pack-qkv` (in the CUDA pipeline): GPT-2's attentions read their packed q/k/v
/// projection and their gradients write it packed, so each layer's three activation
/// Slices and its gradients' Concat are gone; three AdamW steps on the CPU compute the
/// same bits with and without the pass (the packed ops unpack and run the same
/// kernels).
#[test]
fn gpt2s_attention_reads_its_packed_projection_bit_for_bit() {
    use ampgraph::exec::{CpuExecutor, Executor};
    let (mut g, (logits, labels), feeds) = gpt2_on_the_rule(&TINY_GPT2, (2, 8));
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = Adam::new(0.01).minimize(&mut g, loss).unwrap();
    let mut packed = g.clone();
    amp_and_cuda_passes(&mut packed);
    let mut plain = g;
    ampgraph::passes::amp::AutoMixedPrecision::new(
        ampgraph::passes::amp::AmpConfig::new(DType::F16).unwrap(),
    )
    .rewrite(&mut plain)
    .unwrap();
    for pass in ampgraph::exec::cuda::pipeline(&Default::default()) {
        if pass.name() != "pack-qkv" {
            pass.run(&mut plain).unwrap();
        }
    }
    let layers = TINY_GPT2.layers;
    assert_eq!(count(&packed, "Slice") + 3 * layers, count(&plain, "Slice"));
    assert_eq!(count(&packed, "Concat") + layers, count(&plain, "Concat"));
    let losses = |g: &Graph| -> Vec<Tensor> {
        let mut cpu = CpuExecutor::new();
        for id in g.node_ids() {
            let node = g.node(id);
            if let Some(var) = node.op.downcast_ref::<Variable>() {
                let value = ampgraph::exec::feeds::initial_value(&node.name, var, 0);
                cpu.set_variable(&node.name, value).unwrap();
            }
        }
        (0..3)
            .map(|_| cpu.run(g, &feeds, &[step.loss, step.step]).unwrap()[0].clone())
            .collect()
    };
    let (a, b) = (losses(&plain), losses(&packed));
    assert_eq!(a, b);
    assert_ne!(a[0], a[2], "the steps trained");
}

/// An attention whose q slice is read elsewhere too (here a graph output) keeps its
/// slices: of the tiny GPT-2's two layers only the other is packed.
#[test]
fn a_projection_slice_read_elsewhere_keeps_its_attention_unpacked() {
    use ampgraph::graph::ops::{FusedAttention, Slice};
    let (mut g, (logits, _), _) = gpt2_on_the_rule(&TINY_GPT2, (2, 8));
    let first_q = g
        .node_ids()
        .find(|&id| {
            let slice = g.node(id).op.downcast_ref::<Slice>();
            let width = TINY_GPT2.width;
            slice.is_some_and(|s| s.begin == [0, 0])
                && g.ty(g.inputs(id)[0]).shape == [16, 3 * width]
        })
        .expect("layer 0's q slice");
    g.set_outputs(vec![logits, first_q.into()]).unwrap();
    amp_and_cuda_passes(&mut g);
    let packed: Vec<bool> = g
        .node_ids()
        .filter_map(|id| g.node(id).op.downcast_ref::<FusedAttention>())
        .map(|a| a.packed)
        .collect();
    assert_eq!(packed, [false, true]);
}

/// After AMP the CUDA pipeline makes each layer's attention one causal FusedAttention
/// (the scale folded, the mask recognised), and the fused graph computes the f32
/// graph's logits within the fp16 bound (on the CPU's kernels).
#[test]
fn gpt2s_attention_fuses_after_amp() {
    let (batch, seq) = (2, 8);
    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [batch, seq]).unwrap();
    let logits = gpt2::build(&mut g, tokens, &TINY_GPT2).unwrap();
    g.set_outputs(vec![logits]).unwrap();
    let (x, _) = next_token_batch(batch, seq);
    let feeds = HashMap::from([("tokens".to_string(), x)]);
    let run = |g: Graph| {
        let out = g.outputs()[0];
        Session::new(g, Device::Cpu)
            .unwrap()
            .run(&[out], &feeds)
            .unwrap()[0]
            .to_f64_vec()
    };
    let want = run(g.clone());
    amp_and_cuda_passes(&mut g);
    let fused: Vec<String> = (g.node_ids())
        .filter(|&id| g.node(id).op_name() == "FusedAttention")
        .map(|id| format!("{:?}", g.node(id).op))
        .collect();
    assert_eq!(fused.len(), TINY_GPT2.layers, "{fused:?}");
    assert!(
        fused.iter().all(|op| op.contains("causal: true")),
        "{fused:?}"
    );
    let got = run(g);
    let err = common::relative_error(&got, &want);
    assert!(err < 1e-2, "relative error {err}");
}

#[test]
fn vit_b_16_has_torchvisions_parameter_count() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 3, 224, 224]).unwrap();
    let logits = vit::build(&mut g, x, &VitConfig::VIT_B_16).unwrap();
    // torchvision.models.vit_b_16(): sum(p.numel() for p in m.parameters()).
    assert_eq!(parameters(&g), 86_567_656);
    assert_eq!(g.ty(logits).shape, [2, 1000]);
}

/// A tiny ViT (4x4 patches of 8x8 images, two layers of two heads of 16) learns to
/// tell 3 fixed images apart on the CPU, and after AMP its attention is fused.
#[test]
fn a_tiny_vit_trains_on_the_cpu_and_its_attention_fuses() {
    let config = TINY_VIT;
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [6, 3, 8, 8]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [6]).unwrap();
    let logits = vit::build(&mut g, x, &config).unwrap();
    let mut inference = g.clone();
    inference.set_outputs(vec![logits]).unwrap();
    let images = common::uniform_values(6 * 3 * 8 * 8, 3);
    let feeds = HashMap::from([
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![6, 3, 8, 8], &images).unwrap(),
        ),
        (
            "labels".to_string(),
            Tensor::from_f64(DType::I64, vec![6], &[0., 1., 2., 0., 1., 2.]).unwrap(),
        ),
    ]);
    let (first, last) = trained_with_adam(g, (logits, labels), 0.003, &feeds, 40);
    assert!(
        last.is_finite() && last < 0.2 * first,
        "loss {first} -> {last}"
    );
    let mut g = inference;
    amp_and_cuda_passes(&mut g);
    let fused = count(&g, "FusedAttention");
    assert_eq!(fused, config.layers);
}

#[test]
fn bert_base_has_hugging_faces_parameter_count() {
    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [2, 128]).unwrap();
    let logits = bert::build(&mut g, tokens, &BertConfig::BERT_BASE).unwrap();
    // BertForMaskedLM(bert-base-uncased): its parameters, the decoder tied to the word
    // embeddings.
    assert_eq!(parameters(&g), 109_514_298);
    assert_eq!(g.ty(logits).shape, [256, 30522]);
}

/// A tiny BERT learns to give each position its token back (what a masked-LM head
/// does unmasked) on the CPU, and after AMP its attention is fused.
#[test]
fn a_tiny_bert_learns_on_the_cpu_and_its_attention_fuses() {
    let config = TINY_BERT;
    let (batch, seq) = (4, 8);
    let mut g = Graph::new();
    let tokens = g.placeholder("tokens", DType::I64, [batch, seq]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [batch * seq]).unwrap();
    let logits = bert::build(&mut g, tokens, &config).unwrap();
    let mut inference = g.clone();
    inference.set_outputs(vec![logits]).unwrap();
    let (x, _) = next_token_batch(batch, seq);
    let same = Tensor::from_f64(DType::I64, vec![batch * seq], &x.to_f64_vec()).unwrap();
    let feeds = HashMap::from([("tokens".to_string(), x), ("labels".to_string(), same)]);
    let (first, last) = trained_with_adam(g, (logits, labels), 0.01, &feeds, 40);
    assert!(
        last.is_finite() && last < 0.2 * first,
        "loss {first} -> {last}"
    );
    let mut g = inference;
    amp_and_cuda_passes(&mut g);
    let fused = count(&g, "FusedAttention");
    assert_eq!(fused, config.layers);
}

/// The zoo's fixtures (tests/data/zoo, made by scripts/zoo/references.py): weights
/// under a checkpoint's names and layouts, the inputs, and the logits of an
/// independent float64 numpy forward pass.
fn zoo_fixture(name: &str) -> (std::path::PathBuf, Vec<f64>, Vec<f64>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zoo");
    let json = std::fs::read(dir.join(format!("{name}_tiny.json"))).unwrap();
    let reference: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let numbers = |key: &str| -> Vec<f64> {
        (reference[key].as_array().unwrap().iter())
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let weights = dir.join(format!("{name}_tiny.safetensors"));
    (weights, numbers("inputs"), numbers("logits"))
}

/// Loads the fixture `name` into the model `build` makes on its input `x` (`dtype`,
/// `shape`), checks the load's report with `report`, and the logits against numpy's
/// within `1e-5` of their scale.
fn matches_numpy(
    name: &str,
    (dtype, shape): (DType, &[usize]),
    build: impl FnOnce(&mut Graph, Port) -> Port,
    report: impl FnOnce(&WeightsReport),
) {
    let (weights, inputs, want) = zoo_fixture(name);
    let mut g = Graph::new();
    let x = g.placeholder("x", dtype, shape.to_vec()).unwrap();
    let logits = build(&mut g, x);
    let mut session = Session::new(g, Device::Cpu).unwrap();
    report(&load_safetensors(&mut session, &weights).unwrap());
    let feeds = HashMap::from([(
        "x".to_string(),
        Tensor::from_f64(dtype, shape.to_vec(), &inputs).unwrap(),
    )]);
    let got = session.run(&[logits], &feeds).unwrap()[0].to_f64_vec();
    assert_eq!(got.len(), want.len(), "{name}");
    let err = common::relative_error(&got, &want);
    assert!(err < 1e-5, "{name}: relative error {err}");
}

/// A load that took every tensor of the file for every variable of the model.
fn complete(report: &WeightsReport) {
    assert!(
        report.missing.is_empty() && report.unused.is_empty(),
        "{report:?}"
    );
}

/// Hugging Face's `gpt2` names (without the `transformer.` prefix, its causal-mask
/// buffers beside them) load into the zoo's GPT-2, which then computes numpy's logits.
#[test]
fn gpt2_loads_hugging_face_weights_and_computes_numpys_logits() {
    let build = |g: &mut Graph, x| gpt2::build(g, x, &TINY_GPT2).unwrap();
    matches_numpy("gpt2", (DType::I64, &[2, 8]), build, |report| {
        assert_eq!(report.loaded.len(), 4 + 12 * TINY_GPT2.layers);
        assert!(report.missing.is_empty(), "{:?}", report.missing);
        assert_eq!(report.unused, ["h.0.attn.bias", "h.1.attn.bias"]);
        let wte = ("transformer.wte.weight".into(), "wte.weight".into());
        assert!(report.loaded.contains(&wte));
    });
}

/// `BertForMaskedLM`'s names load into the zoo's BERT (its decoder tied to the word
/// embeddings), which then computes numpy's logits.
#[test]
fn bert_loads_hugging_face_weights_and_computes_numpys_logits() {
    let config = TINY_BERT;
    let build = |g: &mut Graph, x| bert::build(g, x, &config).unwrap();
    matches_numpy("bert", (DType::I64, &[2, 8]), build, complete);
}

/// torchvision's ViT names, the patch kernel in torch's OIHW, load into the zoo's ViT
/// (the kernel transposed to HWIO), which then computes numpy's logits.
#[test]
fn vit_loads_torchvision_weights_and_computes_numpys_logits() {
    let config = TINY_VIT;
    let build = |g: &mut Graph, x| vit::build(g, x, &config).unwrap();
    matches_numpy("vit", (DType::F32, &[2, 3, 8, 8]), build, complete);
}

/// torchvision's ResNet names (OIHW kernels, the batch norms' running statistics)
/// load into the zoo's ResNet, which then computes numpy's inference logits.
#[test]
fn resnet_loads_torchvision_weights_and_computes_numpys_logits() {
    let config = TINY_RESNET;
    let build = |g: &mut Graph, x| resnet::build(g, x, &config, false).unwrap().logits;
    matches_numpy("resnet", (DType::F32, &[2, 3, 32, 32]), build, complete);
}

/// A safetensors file of f32 tensors `(name, shape, values)`, written as the format
/// says (a little-endian header length, the JSON header, the data).
fn safetensors_file(path: &std::path::Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    let (mut header, mut data) = (Vec::new(), Vec::new());
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.push(format!(
            r#""{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{start},{}]}}"#,
            data.len()
        ));
    }
    let header = format!("{{{}}}", header.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// TensorFlow-converted checkpoints name a norm's scale and offset `gamma` and `beta`
/// (bert-base-uncased's on the Hub): they load into `.weight` and `.bias`.
#[test]
fn legacy_gamma_and_beta_load_into_weight_and_bias() {
    let path = std::env::temp_dir().join(format!(
        "ampgraph-legacy-{}.safetensors",
        std::process::id()
    ));
    let c = TINY_BERT.width;
    let gamma: Vec<f32> = (0..c).map(|i| 1.0 + i as f32 / 100.0).collect();
    let beta: Vec<f32> = (0..c).map(|i| i as f32 / 50.0).collect();
    safetensors_file(
        &path,
        &[
            ("bert.embeddings.LayerNorm.gamma", vec![c], gamma.clone()),
            ("embeddings.LayerNorm.beta", vec![c], beta.clone()),
        ],
    );
    let mut g = Graph::new();
    let ids = g.placeholder("tokens", DType::I64, [2, 8]).unwrap();
    bert::build(&mut g, ids, &TINY_BERT).unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let report = load_safetensors(&mut session, &path).unwrap();
    assert_eq!(report.loaded.len(), 2, "{report:?}");
    let value = |name: &str| session.variable(name).unwrap().to_f64_vec();
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    assert_eq!(value("bert.embeddings.LayerNorm.weight"), f64s(&gamma));
    assert_eq!(value("bert.embeddings.LayerNorm.bias"), f64s(&beta));
    std::fs::remove_file(path).unwrap();
}

/// A file that is no safetensors file, and a tensor of another shape than its
/// variable, are one-line errors naming the file (and the tensor and the variable).
#[test]
fn bad_weights_files_are_errors_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("ampgraph-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut g = Graph::new();
    let ids = g.placeholder("tokens", DType::I64, [2, 8]).unwrap();
    gpt2::build(&mut g, ids, &TINY_GPT2).unwrap();
    let mut session = Session::new(g, Device::Cpu).unwrap();
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint").unwrap();
    let e = load_safetensors(&mut session, &junk)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("junk.safetensors") && e.contains("not a safetensors file"),
        "{e}"
    );
    // wte of the 124M model's width into the tiny model.
    let wide = dir.join("wide.safetensors");
    safetensors_file(&wide, &[("wte.weight", vec![16, 768], vec![0.0; 16 * 768])]);
    let e = load_safetensors(&mut session, &wide).unwrap_err();
    assert!(matches!(e, WeightsError::Shape { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("wide.safetensors")
            && e.contains("'wte.weight' is [16, 768]")
            && e.contains("'transformer.wte.weight' is [16, 32]"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Recomputing GPT-2's GELUs and LayerNorms for the backward pass (opt-in,
/// `recompute-activations`) trains to the same bits and plans a smaller step: the
/// 4x-wide GELU outputs and the norms' outputs no longer live through the step.
#[test]
fn recomputed_activations_train_the_same_in_less_memory() {
    let (batch, seq) = (4, 8);
    let build = |recompute: bool| {
        let mut g = Graph::new();
        let tokens = g.placeholder("tokens", DType::I64, [batch, seq]).unwrap();
        let labels = g.placeholder("labels", DType::I64, [batch * seq]).unwrap();
        let logits = gpt2::build(&mut g, tokens, &TINY_GPT2).unwrap();
        let loss = g.softmax_cross_entropy(logits, labels).unwrap();
        let step = Adam::new(0.01).minimize(&mut g, loss).unwrap();
        if recompute {
            let summary = RecomputeActivations.run(&mut g).unwrap();
            // 2 GELUs, 2 x 2 block norms and the final one.
            let copies = count(&g, "Gelu") + count(&g, "LayerNorm");
            assert_eq!(copies, 2 * (2 + 5), "{summary}");
        }
        (g, loss, step.step)
    };
    let mut runs = Vec::new();
    let mut peaks = Vec::new();
    for recompute in [false, true] {
        let (g, loss, step) = build(recompute);
        peaks.push(
            step_footprint(&g, &[step], &HashMap::new())
                .unwrap()
                .peak_bytes(),
        );
        let mut session = Session::new(g, Device::Cpu).unwrap();
        let (x, y) = next_token_batch(batch, seq);
        let feeds = HashMap::from([("tokens".to_string(), x), ("labels".to_string(), y)]);
        let losses: Vec<Vec<f64>> = (0..3)
            .map(|_| session.run(&[loss, step], &feeds).unwrap()[0].to_f64_vec())
            .collect();
        runs.push((
            losses,
            session
                .variable("transformer.h.1.mlp.c_fc.weight")
                .unwrap()
                .to_f64_vec(),
        ));
    }
    assert_eq!(runs[0], runs[1], "the same bits");
    assert!(peaks[1] < peaks[0], "planned peaks {peaks:?}");
}
