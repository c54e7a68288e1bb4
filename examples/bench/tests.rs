//! The convnet against a float64 reference written from PyTorch's definitions, its
//! training on the CPU in every mode, and the batch search against the planner
//! (`cargo test --example bench`).

use std::collections::HashMap;

use ampgraph::exec::CpuExecutor;
use ampgraph::optim::trainable_variables;
use ampgraph::Executor;

use super::*;

const TINY: [&str; 6] = ["--width", "4", "--hw", "16", "--batch", "4"];

/// The bench's flags for the convnet on the CPU, with `extra`.
fn args(extra: &[&str]) -> Args {
    let base = ["bench", "--workload", "convnet", "--device", "cpu"];
    Args::parse_from(base.iter().chain(extra))
}

fn tiny() -> (Args, Config) {
    let args = args(&TINY);
    let cfg = Config::from_args(&args).unwrap();
    (args, cfg)
}

/// An executor holding every Variable's first value.
fn executor(args: &Args, graph: &Graph, data: &(Tensor, Tensor)) -> CpuExecutor {
    let mut exec = CpuExecutor::new();
    for (name, value) in initial_values(args, graph, data).unwrap() {
        exec.set_variable(&name, value).unwrap();
    }
    exec
}

fn scalar(exec: &mut CpuExecutor, graph: &Graph, port: Port) -> f64 {
    exec.run(graph, &Feeds::new(), &[port]).unwrap()[0].to_f64_vec()[0]
}

/// The convnet's forward pass in f64, written out from PyTorch's `ConvNet`
/// (torch_anchor.py) with its `padding=1` windows: the logits `[batch, classes]` and
/// each batch norm's batch mean and biased variance per channel.
struct Reference {
    logits: Vec<f64>,
    batch_stats: Vec<(Vec<f64>, Vec<f64>)>,
}

fn reference(
    values: &HashMap<String, Vec<f64>>,
    x: &[f64],
    (batch, hw, width): (usize, usize, usize),
    training: bool,
) -> Reference {
    const WIDTHS: [usize; 8] = [1, 1, 2, 2, 4, 4, 8, 8];
    const STRIDES: [usize; 8] = [1, 1, 2, 1, 2, 1, 2, 1];
    let (mut h, mut cin, mut size) = (x.to_vec(), 3, hw);
    let mut batch_stats = Vec::new();
    for layer in 0..8 {
        let (cout, s) = (WIDTHS[layer] * width, STRIDES[layer]);
        // PyTorch's padding=1: one zero on every side.
        let before = 1;
        let out = (size + 2 * before - 3) / s + 1;
        let k = &values[&format!("conv_{layer}/kernel")];
        let mut y = vec![0.0; batch * cout * out * out];
        for n in 0..batch {
            for co in 0..cout {
                for oy in 0..out {
                    for ox in 0..out {
                        let mut acc = 0.0;
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let iy = (oy * s + ky).checked_sub(before).filter(|&i| i < size);
                                let ix = (ox * s + kx).checked_sub(before).filter(|&i| i < size);
                                let (Some(iy), Some(ix)) = (iy, ix) else {
                                    continue;
                                };
                                for ci in 0..cin {
                                    let xv = h[((n * cin + ci) * size + iy) * size + ix];
                                    acc += xv * k[((ky * 3 + kx) * cin + ci) * cout + co];
                                }
                            }
                        }
                        y[((n * cout + co) * out + oy) * out + ox] = acc;
                    }
                }
            }
        }
        let per_channel = batch * out * out;
        let channel = |i: usize| (i / (out * out)) % cout;
        let mut mean = vec![0.0; cout];
        let mut var = vec![0.0; cout];
        for (i, v) in y.iter().enumerate() {
            mean[channel(i)] += v / per_channel as f64;
        }
        for (i, v) in y.iter().enumerate() {
            var[channel(i)] += (v - mean[channel(i)]).powi(2) / per_channel as f64;
        }
        let stat = |leaf: &str| &values[&format!("bn_{layer}/{leaf}")];
        let (m, v) = if training {
            (mean.clone(), var.clone())
        } else {
            (stat("moving_mean").clone(), stat("moving_variance").clone())
        };
        let (scale, offset) = (stat("scale"), stat("offset"));
        h = y
            .iter()
            .enumerate()
            .map(|(i, &val)| {
                let c = channel(i);
                ((val - m[c]) / (v[c] + 1e-5).sqrt() * scale[c] + offset[c]).max(0.0)
            })
            .collect();
        batch_stats.push((mean, var));
        (cin, size) = (cout, out);
    }
    let (kernel, bias) = (&values["dense/kernel"], &values["dense/bias"]);
    let classes = bias.len();
    let mut logits = Vec::with_capacity(batch * classes);
    for n in 0..batch {
        let pooled: Vec<f64> = (0..cin)
            .map(|c| {
                let plane = &h[(n * cin + c) * size * size..(n * cin + c + 1) * size * size];
                plane.iter().sum::<f64>() / (size * size) as f64
            })
            .collect();
        for k in 0..classes {
            let dot: f64 = (0..cin).map(|c| pooled[c] * kernel[c * classes + k]).sum();
            logits.push(dot + bias[k]);
        }
    }
    Reference {
        logits,
        batch_stats,
    }
}

fn as_f64(values: Vec<(String, Tensor)>) -> HashMap<String, Vec<f64>> {
    values
        .into_iter()
        .map(|(name, t)| (name, t.to_f64_vec()))
        .collect()
}

/// The largest difference between `got` and `want`, relative to `want`'s largest value.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    diff / scale
}

#[test]
fn every_layer_has_pytorchs_shape_and_the_parameters_are_pytorchs() {
    let (_, cfg) = tiny();
    let model = build(&cfg, true).unwrap();
    let g = &model.graph;
    let shapes = |op: &str| -> Vec<Vec<usize>> {
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter(|&id| g.node(id).op.name() == op)
            .map(|id| g.node(id).outputs()[0].shape.clone())
            .collect()
    };
    // PyTorch's Conv2d(3, stride, padding=1) on 16x16: 16, 16, 8, 8, 4, 4, 2, 2.
    let want = [
        [4, 4, 16, 16],
        [4, 4, 16, 16],
        [4, 8, 8, 8],
        [4, 8, 8, 8],
        [4, 16, 4, 4],
        [4, 16, 4, 4],
        [4, 32, 2, 2],
        [4, 32, 2, 2],
    ];
    assert_eq!(shapes("Conv2D"), want);
    // PyTorch's windows: one zero on every side, at stride 2 too.
    let paddings: Vec<_> = g
        .node_ids()
        .filter_map(|id| g.node(id).op.downcast_ref::<ampgraph::graph::ops::Conv2D>())
        .map(|c| c.padding)
        .collect();
    assert_eq!(paddings, [convnet::PADDING; 8]);
    assert_eq!(shapes("BatchNorm"), want);
    assert_eq!(shapes("Relu"), want);
    assert_eq!(shapes("Mean"), [[4, 32]]);
    assert_eq!(g.ty(model.logits).shape, [4, 10]);
    // sum(p.numel() for p in ConvNet(width=c, classes=k).parameters()): the conv
    // weights 9 * (3c + c^2 + 2c^2 + 4c^2 + 8c^2 + 16c^2 + 32c^2 + 64c^2), the batch
    // norms' weights and biases 2 * 30c, the head 8c * k + k; running statistics are
    // buffers, not parameters. c = 4, k = 10: 18396 + 240 + 330; c = 64, k = 10:
    // 4683456 + 3840 + 5130.
    for (flags, count) in [
        (&TINY[..], 18_966),
        (
            &["--width", "64", "--hw", "64", "--batch", "2"][..],
            4_692_426,
        ),
    ] {
        let cfg = Config::from_args(&args(flags)).unwrap();
        let model = build(&cfg, true).unwrap();
        let trained = trainable_variables(&model.graph, model.loss).unwrap();
        let numel: usize = trained
            .iter()
            .map(|&v| model.graph.ty(v.into()).shape.iter().product::<usize>())
            .sum();
        assert_eq!(numel, count, "{flags:?}");
        assert!(trained
            .iter()
            .all(|&v| !model.graph.node(v).name.contains("moving")));
    }
}

#[test]
fn the_forward_pass_matches_a_float64_reference_in_training_and_inference() {
    let (args, cfg) = tiny();
    let data = cfg.data(0).unwrap();
    let x = data.0.to_f64_vec();
    let sizes = (4, 16, 4);
    // Training: the batch's statistics.
    let model = build(&cfg, true).unwrap();
    let feeds: Feeds = [(X.to_string(), data.0.clone())].into_iter().collect();
    let mut exec = executor(&args, &model.graph, &data);
    let got = exec.run(&model.graph, &feeds, &[model.logits]).unwrap()[0].to_f64_vec();
    let mut values = as_f64(initial_values(&args, &model.graph, &data).unwrap());
    let trained = reference(&values, &x, sizes, true);
    let error = relative_error(&got, &trained.logits);
    assert!(error < 1e-5, "training logits off by {error:e}");
    // Inference: the running statistics, here set to the batch's, which gives the
    // training pass's logits.
    let model = build(&cfg, false).unwrap();
    let mut exec = executor(&args, &model.graph, &data);
    for (layer, (mean, var)) in trained.batch_stats.iter().enumerate() {
        for (leaf, stat) in [("moving_mean", mean), ("moving_variance", var)] {
            let name = format!("bn_{layer}/{leaf}");
            let t = Tensor::new(vec![stat.len()], Data::from_f64(DType::F32, stat.clone()));
            exec.set_variable(&name, t.unwrap()).unwrap();
            values.insert(name, stat.clone());
        }
    }
    let got = exec.run(&model.graph, &feeds, &[model.logits]).unwrap()[0].to_f64_vec();
    let inferred = reference(&values, &x, sizes, false);
    assert!(relative_error(&inferred.logits, &trained.logits) < 1e-9);
    let error = relative_error(&got, &inferred.logits);
    assert!(error < 1e-5, "inference logits off by {error:e}");
}

#[test]
fn a_training_step_updates_the_running_averages_as_pytorch_and_the_loss_falls() {
    let (args, cfg) = tiny();
    let data = cfg.data(0).unwrap();
    let step = prepare(&args, &cfg, Mode::Fp32, false).unwrap();
    let mut exec = executor(&args, &step.graph, &data);
    let values = as_f64(initial_values(&args, &step.graph, &data).unwrap());
    let want = reference(&values, &data.0.to_f64_vec(), (4, 16, 4), true);
    let loss = step.loss.unwrap();
    let first = scalar(&mut exec, &step.graph, loss);
    exec.run(&step.graph, &Feeds::new(), &[step.fetch]).unwrap();
    // running = 0.9 * running + 0.1 * batch statistic (the variance unbiased), from 0
    // and 1.
    for (layer, (mean, var)) in want.batch_stats.iter().enumerate() {
        // batch * H * W values per channel: 4 * 16 * 16, ..., 4 * 2 * 2.
        let n = [1024.0, 1024.0, 256.0, 256.0, 64.0, 64.0, 16.0, 16.0][layer];
        let expected = [
            mean.iter().map(|m| 0.1 * m).collect::<Vec<_>>(),
            var.iter().map(|v| 0.9 + 0.1 * v * n / (n - 1.0)).collect(),
        ];
        for (leaf, expected) in ["moving_mean", "moving_variance"].iter().zip(expected) {
            let name = format!("bn_{layer}/{leaf}");
            let got = exec.variable(&name).unwrap().to_f64_vec();
            let error = relative_error(&got, &expected);
            assert!(error < 1e-5, "{name}: {got:?} against {expected:?}");
        }
    }
    for _ in 0..20 {
        exec.run(&step.graph, &Feeds::new(), &[step.fetch]).unwrap();
    }
    let last = scalar(&mut exec, &step.graph, loss);
    assert!(last < 0.9 * first, "loss {first} -> {last} after 21 steps");
}

#[test]
fn every_mode_and_phase_runs_on_the_cpu() {
    let (args, cfg) = tiny();
    let data = cfg.data(0).unwrap();
    let mut first_losses = Vec::new();
    for mode in ["fp32", "tf32", "amp_fp16", "amp_bf16", "amp_fp8"] {
        let mode = Mode::parse(mode).unwrap();
        for infer in [false, true] {
            let step = prepare(&args, &cfg, mode, infer).unwrap();
            let mut exec = executor(&args, &step.graph, &data);
            if let Some(loss) = step.loss {
                first_losses.push((mode, scalar(&mut exec, &step.graph, loss)));
            }
            for _ in 0..3 {
                exec.run(&step.graph, &Feeds::new(), &[step.fetch]).unwrap();
            }
            if let Some(loss) = step.loss {
                let after = scalar(&mut exec, &step.graph, loss);
                assert!(after.is_finite(), "{} loss {after}", mode.name());
            }
        }
    }
    // The same initial values give every mode fp32's loss, within 16-bit rounding.
    let fp32 = first_losses[0].1;
    for (mode, loss) in first_losses {
        assert!(
            (loss - fp32).abs() < 2e-2,
            "{}: {loss} against {fp32}",
            mode.name()
        );
    }
}

#[test]
fn the_planned_peak_grows_with_the_batch() {
    let (args, cfg) = tiny();
    for (mode, infer) in [
        (Mode::Fp32, false),
        (Mode::AmpF16, false),
        (Mode::AmpBf16, true),
    ] {
        let peaks: Vec<usize> = (1..=4)
            .map(|batch| {
                fit::planned_step(&args, &cfg, mode, infer, batch)
                    .unwrap()
                    .peak_bytes()
            })
            .collect();
        assert!(
            peaks.windows(2).all(|w| w[0] < w[1]),
            "{} {}: {peaks:?}",
            mode.name(),
            phase_name(infer)
        );
    }
}

#[test]
fn the_search_finds_the_largest_batch_whose_plan_fits() {
    let (args, cfg) = tiny();
    for (mode, infer) in [(Mode::AmpF16, false), (Mode::Fp32, true)] {
        let peak = |batch| {
            fit::planned_step(&args, &cfg, mode, infer, batch)
                .unwrap()
                .peak_bytes()
        };
        let budget = peak(6);
        let found = fit::max_batch(&args, &cfg, mode, infer, budget)
            .unwrap()
            .unwrap();
        assert_eq!(found.batch, 6);
        assert!(peak(found.batch) <= budget && peak(found.batch + 1) > budget);
        assert_eq!(found.planned.peak_bytes(), peak(6));
        assert_eq!(found.next_peak_bytes, Some(peak(7)));
        assert!(fit::max_batch(&args, &cfg, mode, infer, peak(1) - 1)
            .unwrap()
            .is_none());
    }
}

#[test]
fn the_search_doubles_then_bisects() {
    let mut asked = Vec::new();
    let found = fit::largest_batch(1, |b| {
        asked.push(b);
        Ok(b * b <= 1000)
    });
    assert_eq!(found.unwrap(), Some(31));
    // 1 to 16 fit, 32 does not (1024 > 1000); bisecting 16..32 asks 24, 28, 30, 31.
    assert_eq!(asked, [1, 2, 4, 8, 16, 32, 24, 28, 30, 31]);
    // From above (the device's search, from the host's answer): stepping down 1, 2,
    // 4, ... to batch 1 at most (99, 98, 96, 92, 84, 68, 36, 1), then bisecting 1..36;
    // an answer a few below the start takes few probes.
    asked.clear();
    let found = fit::largest_batch(100, |b| {
        asked.push(b);
        Ok(b * b <= 1000)
    });
    assert_eq!(found.unwrap(), Some(31));
    assert_eq!(
        asked,
        [100, 99, 98, 96, 92, 84, 68, 36, 1, 18, 27, 31, 33, 32]
    );
    asked.clear();
    let found = fit::largest_batch(498, |b| {
        asked.push(b);
        Ok(b <= 497)
    });
    assert_eq!(found.unwrap(), Some(497));
    assert_eq!(asked, [498, 497]);
    asked.clear();
    let found = fit::largest_batch(498, |b| {
        asked.push(b);
        Ok(b <= 493)
    });
    assert_eq!(found.unwrap(), Some(493));
    assert_eq!(asked, [498, 497, 496, 494, 490, 492, 493]);
    for start in [1, 7] {
        assert_eq!(fit::largest_batch(start, |_| Ok(false)).unwrap(), None);
        assert_eq!(fit::largest_batch(start, |b| Ok(b == 1)).unwrap(), Some(1));
        assert!(
            fit::largest_batch(start, |_| Ok(true)).is_err(),
            "an endless fit stops"
        );
    }
}

/// The zoo's workloads at their reference sizes (small batches) build and go through
/// AMP and the CUDA pipeline (no step: the CPU would take minutes): each transformer's
/// attention is fused in every layer, forward and backward.
#[test]
fn the_zoo_workloads_prepare_with_their_attention_fused() {
    for (workload, layers) in [
        ("gpt2", 12),
        ("bert_base", 12),
        ("vit_b_16", 12),
        ("resnet50", 0),
    ] {
        let flags = [
            "bench",
            "--device",
            "cpu",
            "--workload",
            workload,
            "--batch",
            "1",
        ];
        let args = Args::parse_from(flags.iter().chain(&["--seq", "32"]));
        let cfg = Config::from_args(&args).unwrap();
        let step = prepare(&args, &cfg, Mode::AmpBf16, false).unwrap();
        let count = |op: &str| {
            (step.graph.node_ids())
                .filter(|&id| step.graph.node(id).op_name() == op)
                .count()
        };
        assert_eq!(count("FusedAttention"), layers, "{workload}");
        assert_eq!(count("FusedAttentionGrad"), layers, "{workload}");
        // The bias sums the fusions leave in f32 are rounded by the updates reading
        // them (`grad-round-into-update`): no update reads a Cast.
        let g = &step.graph;
        let reads_a_cast = (g.node_ids())
            .filter(|&id| g.node(id).op_name().ends_with("OptimizerUpdate"))
            .any(|id| {
                g.inputs(id)
                    .iter()
                    .any(|p| g.node(p.node).op_name() == "Cast")
            });
        assert!(!reads_a_cast, "{workload}");
        let data = cfg.data(0).unwrap();
        assert_eq!(
            data.0.dtype() == DType::I64,
            layers > 0 && workload != "vit_b_16"
        );
    }
}

/// GPT-2 at llm.c's size (b16 x 1024): the LM head's three products over the
/// vocabulary of 50,257 (logits, the hidden state's and the embedding's gradients) run
/// padded to 50,264, the logits' gradient padded once for the two products reading it.
#[test]
fn gpt2s_lm_head_products_are_padded_for_tensor_cores() {
    let flags = ["bench", "--device", "cpu", "--workload", "gpt2"];
    let args = Args::parse_from(flags);
    let cfg = Config::from_args(&args).unwrap();
    let step = prepare(&args, &cfg, Mode::AmpBf16, false).unwrap();
    let g = &step.graph;
    let padded: Vec<_> = (g.node_ids())
        .filter(|&id| g.node(id).op_name() == "MatMul" && g.node(id).name.ends_with("/padded"))
        .collect();
    assert_eq!(padded.len(), 3, "the LM head's products");
    let padded_vocab = |id| g.node(id).outputs()[0].shape.contains(&50_264);
    assert!(padded.iter().all(|&id| {
        padded_vocab(id)
            || g.inputs(id)
                .iter()
                .any(|p| g.ty(*p).shape.contains(&50_264))
    }));
    // The loss reads the padded logits and writes its gradient padded: neither is
    // copied.
    let logit_sized = |op: &str| {
        (g.node_ids())
            .filter(|&id| g.node(id).op_name() == op)
            .filter(|&id| {
                let io = g.inputs(id).into_iter().map(|p| g.ty(p).clone());
                io.chain(g.node(id).outputs().iter().cloned())
                    .any(|t| t.shape[..] == [16_384, 50_264])
            })
            .count()
    };
    assert_eq!((logit_sized("Concat"), logit_sized("Slice")), (0, 0));
    assert_eq!(logit_sized("SoftmaxCrossEntropyWithGrad"), 1);
}
