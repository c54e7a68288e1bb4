//! ONNX models nobody here wrote the graph of (tests/data/onnx, made by
//! scripts/onnx/make_models.py, and the folders under `AMPGRAPH_ONNX_MODELS` where it
//! is set, e.g. torchvision's exports by scripts/onnx/torchvision_models.py): imported
//! and run on the CPU, every output matches onnxruntime's on the same inputs; on the
//! GPU (skipped with a printed reason without one) too, in f32 and after AMP within
//! the fp16 bound.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ampgraph::exec::cuda;
use ampgraph::graph::ops::QuantizeFp8;
use ampgraph::numerics::calibrate::fp8_amaxes;
use ampgraph::onnx::{import_file, tensor, ImportOptions};
use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision, Fp8Config, Fp8Recipe};
use ampgraph::{DType, Device, Graph, Session, Tensor};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx")
}

/// The `*_K.pb` tensors of a test-data folder, in K order.
fn tensors(dir: &Path, stem: &str) -> Vec<(String, Tensor)> {
    (0..)
        .map(|k| dir.join(format!("{stem}_{k}.pb")))
        .take_while(|p| p.exists())
        .map(|p| tensor::load(&p).unwrap())
        .collect()
}

/// Named tensors, as ONNX's test data holds them.
type Named = Vec<(String, Tensor)>;

/// A model folder (ONNX's backend-test layout) imported with its test inputs' shapes;
/// the inputs and onnxruntime's outputs.
fn load(dir: &Path) -> (Graph, Named, Named) {
    let data = dir.join("test_data_set_0");
    let inputs = tensors(&data, "input");
    let expected = tensors(&data, "output");
    let opts = ImportOptions {
        input_shapes: inputs
            .iter()
            .map(|(n, t)| (n.clone(), t.shape().to_vec()))
            .collect::<BTreeMap<_, _>>(),
        ..ImportOptions::default()
    };
    let g = import_file(&dir.join("model.onnx"), &opts)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (g, inputs, expected)
}

/// `g`'s outputs on `device` from `inputs`, checked against `expected`'s count and
/// shapes.
fn run_outputs(
    what: &str,
    g: Graph,
    device: Device,
    inputs: &[(String, Tensor)],
    expected: &[(String, Tensor)],
) -> Vec<Tensor> {
    let fetches = g.outputs().to_vec();
    assert_eq!(fetches.len(), expected.len(), "{what}: outputs");
    let mut session = Session::new(g, device).unwrap_or_else(|e| panic!("{what}: {e}"));
    let feeds = inputs.iter().cloned().collect();
    let got = session
        .run(&fetches, &feeds)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for (k, (out, (oname, want))) in got.iter().zip(expected).enumerate() {
        assert_eq!(out.shape(), want.shape(), "{what} output {k} ({oname})");
    }
    got
}

/// Runs `g` on `device` and checks every output within `tol` of onnxruntime's.
fn check_outputs(
    what: &str,
    g: Graph,
    device: Device,
    inputs: &[(String, Tensor)],
    expected: &[(String, Tensor)],
    tol: f64,
) {
    let got = run_outputs(what, g, device, inputs, expected);
    for (k, (out, (oname, want))) in got.iter().zip(expected).enumerate() {
        let err = common::tensor_relative_error(out, want);
        println!("{what} output {k} ({oname}): relative error {err:.2e}");
        assert!(
            err < tol,
            "{what} output {k} ({oname}): relative error {err:e}"
        );
    }
}

fn check_model(name: &str) {
    let (g, inputs, expected) = load(&data_dir().join(name));
    check_outputs(name, g, Device::Cpu, &inputs, &expected, 1e-4);
}

/// The checked-in models and those under `AMPGRAPH_ONNX_MODELS`.
fn all_models() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(data_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    if let Some(extra) = std::env::var_os("AMPGRAPH_ONNX_MODELS") {
        dirs.extend(
            std::fs::read_dir(extra)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.join("model.onnx").exists()),
        );
    }
    dirs.sort();
    dirs
}

/// Every model under `AMPGRAPH_ONNX_MODELS` (e.g. the zoo of `scripts/onnx/
/// torchvision_models.py --zoo`), each checked whatever the others do: one coverage
/// row per model ([`zoo_row`], or what stopped it), then a failure listing those that
/// did not import or match.
#[test]
fn models_under_ampgraph_onnx_models_match_onnxruntime() {
    let Some(extra) = std::env::var_os("AMPGRAPH_ONNX_MODELS") else {
        println!("skipping: AMPGRAPH_ONNX_MODELS is not set");
        return;
    };
    let mut dirs: Vec<PathBuf> = (std::fs::read_dir(extra).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|d| d.join("model.onnx").exists())
        .collect();
    dirs.sort();
    let mut failed = Vec::new();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let run = std::panic::catch_unwind(|| zoo_row(&name, &dir));
        match run {
            Ok(row) => println!("| {name} | {row} |"),
            Err(e) => {
                let why = (e.downcast_ref::<String>().cloned())
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let line = why.lines().next().unwrap_or_default().to_string();
                println!("| {name} | | | | {line} |");
                failed.push(name);
            }
        }
    }
    assert!(failed.is_empty(), "failed: {}", failed.join(", "));
}

/// One model of the zoo on the CPU in f32: its coverage row (nodes, the relative error
/// against onnxruntime, and against the float64 reference the exporter wrote, beside
/// onnxruntime's own). It passes within 1e-4 of onnxruntime, or, where the model's
/// f32 rounding alone is larger (DeepLabV3: onnxruntime is 1.4e-4 from float64, and
/// PyTorch's f32 2.2e-4 from onnxruntime), at most 1.5 times as far from the float64
/// reference as onnxruntime is.
fn zoo_row(name: &str, dir: &Path) -> String {
    let (g, inputs, expected) = load(dir);
    let nodes = g.len();
    let lowers = lowers_on_cuda(&g);
    let got = run_outputs(name, g, Device::Cpu, &inputs, &expected);
    let truth = tensors(&dir.join("test_data_set_0"), "reference_f64");
    let mut cells = (Vec::new(), Vec::new());
    for (k, (out, (oname, want))) in got.iter().zip(&expected).enumerate() {
        let vs_ort = common::tensor_relative_error(out, want);
        let vs_f64 = truth.get(k).map(|(_, t)| {
            (
                common::tensor_relative_error(out, t),
                common::tensor_relative_error(want, t),
            )
        });
        let within = vs_ort < 1e-4 || vs_f64.is_some_and(|(ours, ort)| ours <= 1.5 * ort);
        assert!(
            within,
            "{name} output {k} ({oname}): relative error {vs_ort:.2e} against onnxruntime; against float64 (ours, onnxruntime's): {vs_f64:?}"
        );
        cells.0.push(format!("{vs_ort:.1e}"));
        cells.1.push(match vs_f64 {
            Some((ours, ort)) => format!("{ours:.1e} ({ort:.1e})"),
            None => "-".into(),
        });
    }
    format!(
        "{nodes} | {} | {} | ok; {lowers}",
        cells.0.join(", "),
        cells.1.join(", ")
    )
}

/// Whether every node of `g` has a CUDA kernel after the CUDA executor's passes (no
/// device needed: planning the lowering is enough, though a convolution's loads cuDNN,
/// e.g. pip's `nvidia/cudnn/lib` on `LD_LIBRARY_PATH`), as a cell of the coverage
/// table.
fn lowers_on_cuda(g: &Graph) -> String {
    let mut g = g.clone();
    let names = ampgraph::exec::cuda::pipeline_names(&Default::default());
    let lowered = ampgraph::session::registry_passes(&names)
        .and_then(|passes| passes.run(&mut g))
        .map_err(|e| e.to_string())
        .and_then(|_| ampgraph::exec::CudaExecutor::check_supported(&g).map_err(|e| e.to_string()));
    match lowered {
        Ok(()) => "lowers on CUDA".into(),
        // Lowering a convolution loads cuDNN: without it here nothing is known.
        Err(e) if e.contains("not found on the library path") => {
            format!(
                "CUDA lowering not checked: {}",
                e.lines().next().unwrap_or_default()
            )
        }
        Err(e) => format!("not on CUDA: {}", e.lines().next().unwrap_or_default()),
    }
}

/// The checked-in models with ops that have no CUDA kernel yet: none (kept for the
/// next op added for ONNX before its kernel).
const ON_THE_CPU: [&str; 0] = [];

#[test]
fn models_run_on_the_gpu_in_f32_and_with_amp() {
    if let Err(why) = cuda::available() {
        println!("skipping: {why}");
        return;
    }
    for dir in all_models() {
        let what = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (g, inputs, expected) = load(&dir);
        // Ops without CUDA kernels keep a model on the CPU, as
        // Device::auto_for says; every other model must run on the GPU.
        if Device::auto_for(&g) == Device::Cpu {
            assert!(
                ON_THE_CPU.contains(&what.as_str()),
                "{what}: runs on the CPU"
            );
            println!("{what}: on the CPU (an op without a CUDA kernel)");
            continue;
        }
        check_outputs(
            &format!("{what} cuda f32"),
            g.clone(),
            Device::Cuda(0),
            &inputs,
            &expected,
            1e-4,
        );
        let mut amp = g;
        AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap())
            .rewrite(&mut amp)
            .unwrap();
        check_outputs(
            &format!("{what} cuda amp f16"),
            amp,
            Device::Cuda(0),
            &inputs,
            &expected,
            1e-2,
        );
    }
}

#[test]
fn resnet_tiny_matches_onnxruntime() {
    check_model("resnet_tiny");
}

#[test]
fn external_data_matches_onnxruntime() {
    check_model("external_data");
}

#[test]
fn mobilenet_tiny_matches_onnxruntime() {
    check_model("mobilenet_tiny");
}

#[test]
fn mobilenet_v3_style_matches_onnxruntime() {
    check_model("mobilenet_v3_style");
}

#[test]
fn transformer_tiny_matches_onnxruntime() {
    check_model("transformer_tiny");
}

#[test]
fn opset_misc_matches_onnxruntime() {
    check_model("opset_misc");
}

#[test]
fn unet_tiny_matches_onnxruntime() {
    check_model("unet_tiny");
}

/// Attention as HF BERT, torch's SDPA decomposition, nn.TransformerEncoderLayer and
/// GPT-2 export it (explicit key transposes, `/ sqrt(d)`, operands scaled by
/// sqrt(scale), a padding mask `[B, 1, 1, S]` or expanded to `[B, 1, S, S]`, a causal
/// mask as a Where of a sliced buffer or as an added `[B, 1, S, S]` constant) fuses after AMP with the CUDA pipeline's passes,
/// and the fused graph computes onnxruntime's output within the fp16 bound (on the
/// CPU's kernels).
#[test]
fn exporters_attention_forms_fuse_and_keep_their_values() {
    let (mut g, inputs, expected) = load(&data_dir().join("attention_forms"));
    common::amp_and_cuda_passes(&mut g);
    assert_eq!(common::count(&g, "FusedAttention"), 6, "the six forms fuse");
    check_outputs(
        "attention_forms fused",
        g,
        Device::Cpu,
        &inputs,
        &expected,
        1e-2,
    );
}

/// Every checked-in model after AMP (f16) and the CUDA executor's passes, run on the
/// CPU's kernels, computes what the AMP graph alone computes: the rewrites that only
/// the GPU's pipeline runs (layouts, products taking their epilogues and residuals,
/// fusions) keep each model's values, on graphs exporters wrote.
#[test]
fn every_model_keeps_its_values_through_the_cuda_passes() {
    for dir in all_models() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (g, inputs, expected) = load(&dir);
        let mut amp = g.clone();
        AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap())
            .rewrite(&mut amp)
            .unwrap();
        let want = run_outputs(&name, amp, Device::Cpu, &inputs, &expected);
        let mut piped = g;
        common::amp_and_cuda_passes(&mut piped);
        let got = run_outputs(&name, piped, Device::Cpu, &inputs, &expected);
        for (k, (got, want)) in got.iter().zip(&want).enumerate() {
            let err = common::tensor_relative_error(got, want);
            println!("{name} output {k}: {err:.2e}");
            assert!(
                err <= 2e-3,
                "{name} output {k}: {err:.2e} from the AMP graph's"
            );
        }
    }
}

/// How far a model's outputs with FP8 products may be from onnxruntime's, relative to
/// their largest value: E4M3 operands round by up to 2^-4 of their value; through these
/// models' layers the outputs stayed within 0.095 (a wrong scale or layout is off by
/// its whole magnitude).
const FP8_BOUND: f64 = 0.15;

/// Every checked-in model in FP8 (BF16 AMP, current scaling, the constant weights
/// quantised by the pass): with every product the GPU's FP8 kernels take in FP8 it
/// lowers on CUDA; with every product in FP8, then the CUDA executor's passes, run on
/// the CPU's kernels (whose FP8 conversions are the GPU's, bit for bit), each output
/// is within the FP8 operands' bound of onnxruntime's. Exporters' patterns (attention
/// forms, einsums, recurrent cells, layer norms written out, convolutions as
/// products) meet the FP8 pass here.
#[test]
fn every_model_runs_with_fp8_products_near_onnxruntime() {
    let mut fp8_products = 0;
    for dir in all_models() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (g, inputs, expected) = load(&dir);
        let bf16 = AmpConfig::new(DType::BF16).unwrap();
        let amp = |config: AmpConfig| {
            let mut g = g.clone();
            AutoMixedPrecision::new(config)
                .rewrite(&mut g)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            g
        };
        let fp8 = |fp8: Fp8Config| amp(bf16.clone().with_fp8(fp8));
        let on_device = fp8(Fp8Config::every_device_product(Fp8Recipe::Current));
        let lowered = lowers_on_cuda(&on_device);
        assert!(!lowered.starts_with("not on CUDA"), "{name}: {lowered}");
        // On the CPU every product, whatever its shape.
        let mut g = fp8(Fp8Config::everywhere(Fp8Recipe::Current));
        common::cuda_passes(&mut g);
        let products = common::count(&g, "Fp8MatMul");
        // FP8 products copy nothing more than 16-bit ones: the views around them
        // (an exported nn.MultiheadAttention's sequence-first Transposes) compose
        // away as they do in BF16.
        let mut bf16 = amp(bf16.clone());
        common::cuda_passes(&mut bf16);
        let copies = |g: &Graph| common::count(g, "Transpose") + common::count(g, "Slice");
        assert!(
            copies(&g) <= copies(&bf16),
            "{name}: {} Transposes and Slices with FP8 products, {} in BF16",
            copies(&g),
            copies(&bf16)
        );
        fp8_products += products;
        println!("{name}: {products} FP8 products");
        check_outputs(&name, g, Device::Cpu, &inputs, &expected, FP8_BOUND);
    }
    assert!(fp8_products > 0);
}

/// Static FP8 scaling on every checked-in ONNX model: amaxes calibrated on the model's
/// own test inputs, every product the GPU takes in FP8 lowers on CUDA (the casts
/// folded into the layer norms and activations computing their tensors, through the
/// exporters' views; no amax pass left), and with every product in FP8 after the CUDA
/// passes the outputs on the CPU stay within the FP8 bound of onnxruntime's.
#[test]
fn every_model_runs_with_static_fp8_scales_near_onnxruntime() {
    let mut folded = 0;
    for dir in all_models() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (g, inputs, expected) = load(&dir);
        let feeds: ampgraph::exec::Feeds = inputs.iter().cloned().collect();
        let config = |recipe, everywhere: bool| {
            let fp8 = match everywhere {
                true => Fp8Config::everywhere(recipe),
                false => Fp8Config::every_device_product(recipe),
            };
            AmpConfig::new(DType::BF16).unwrap().with_fp8(fp8)
        };
        let amaxes = fp8_amaxes(&g, &config(Fp8Recipe::Current, true), &[feeds])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let fixed = |everywhere: bool| {
            let mut config = config(Fp8Recipe::Static, everywhere);
            if let Some(fp8) = config.fp8.as_mut() {
                fp8.calibrated = amaxes.clone();
            }
            let mut g = g.clone();
            AutoMixedPrecision::new(config)
                .rewrite(&mut g)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            g
        };
        let lowered = lowers_on_cuda(&fixed(false));
        assert!(!lowered.starts_with("not on CUDA"), "{name}: {lowered}");
        let mut g = fixed(true);
        common::cuda_passes(&mut g);
        assert_eq!(common::count(&g, "Fp8Scale"), 0, "{name}");
        folded += common::count(&g, "LayerNormQuantizeFp8");
        folded += (g.node_ids())
            .filter_map(|id| g.node(id).op.downcast_ref::<QuantizeFp8>())
            .filter(|q| q.activation.is_some())
            .count();
        check_outputs(&name, g, Device::Cpu, &inputs, &expected, FP8_BOUND);
    }
    println!("{folded} casts folded into the layer norms and activations before them");
    assert!(folded > 0, "no cast folded into its producer");
}

/// Layer norms written out as exporters do before opset 17 (torch's and a Keras-like
/// form, with and without the affine part) import as three LayerNorms, no Pow or
/// Reciprocal left, and match onnxruntime.
#[test]
fn layer_norm_forms_import_as_layer_norms() {
    let (g, inputs, expected) = load(&data_dir().join("layer_norm_forms"));
    let count = |op: &str| common::count(&g, op);
    assert_eq!(count("LayerNorm"), 3);
    for op in ["Mean", "Sub", "Pow", "Mul", "Sqrt", "Reciprocal", "Div"] {
        assert_eq!(count(op), 0, "{op}: the decompositions went");
    }
    check_outputs("layer_norm_forms", g, Device::Cpu, &inputs, &expected, 1e-4);
}

#[test]
fn triangles_match_onnxruntime() {
    check_model("triangles");
}

#[test]
fn deeplab_tiny_matches_onnxruntime() {
    check_model("deeplab_tiny");
}

#[test]
fn exporter_constants_match_onnxruntime() {
    check_model("exporter_constants");
}

#[test]
fn einsum_cases_match_onnxruntime() {
    check_model("einsum_cases");
}

#[test]
fn control_flow_matches_onnxruntime() {
    check_model("control_flow");
}

#[test]
fn dynamic_axes_matches_onnxruntime() {
    check_model("dynamic_axes");
}

#[test]
fn positions_match_onnxruntime() {
    check_model("positions");
}

/// Position embeddings resized by cubic Resizes (PyTorch's bicubic up, a downscale
/// with exclude_outside), computed at import, match onnxruntime's.
#[test]
fn cubic_positions_match_onnxruntime() {
    check_model("cubic_positions");
}

/// FNet's token mixing (the real part of a DFT along two axes of a signal made
/// complex), a one-sided transform of a real signal and an inverse one match
/// onnxruntime, each axis's transform imported as products with its cosines and sines.
#[test]
fn fourier_mixing_matches_onnxruntime() {
    check_model("fourier_mixing");
    let (g, _, _) = load(&data_dir().join("fourier_mixing"));
    let count = |op: &str| common::count(&g, op);
    // Four transforms: two of complex signals (four products), a real one and an
    // inverse complex one (two and four).
    assert_eq!(count("MatMul"), 4 + 4 + 2 + 4);
}

/// MobileViTV2's fold of its patches (Col2Im of blocks that tile the image) matches
/// onnxruntime as a Reshape, a Transpose and a Reshape.
#[test]
fn col2im_blocks_match_onnxruntime() {
    check_model("col2im_blocks");
}

/// Exporters' GELUs (GPT-2's tanh form with Pow, torch's erf form) import as one
/// Gelu each and still match onnxruntime.
#[test]
fn gelu_forms_import_as_gelus_matching_onnxruntime() {
    check_model("gelu_forms");
    let (g, _, _) = load(&data_dir().join("gelu_forms"));
    let count = |op: &str| common::count(&g, op);
    assert_eq!(count("Gelu"), 2);
    assert_eq!(count("Pow") + count("Erf") + count("Tanh"), 0);
    let (t, _, _) = load(&data_dir().join("transformer_tiny"));
    assert_eq!(common::count(&t, "Erf"), 0);
}

/// LSTM and GRU (batch-first, reverse and bidirectional, initial and last states,
/// both reset forms, full sequence lengths) unrolled at import match onnxruntime.
#[test]
fn recurrent_cells_match_onnxruntime() {
    check_model("recurrent_cells");
}

/// A video transformer's tubelet embedding (a 3-D Conv whose windows tile the clip),
/// imported as the product it is, matches onnxruntime.
#[test]
fn tubelet_embedding_matches_onnxruntime() {
    check_model("tubelet_embedding");
}
