#!/usr/bin/env python3
"""Export real torch models to ONNX with the TorchScript exporter, plus reference data.

Needs torch 2.x, torchvision, onnx, onnxruntime, numpy. Writes, for each of
resnet18, mobilenet_v3_small (torchvision, weights=None) and a 2-layer
torch.nn.TransformerEncoder (d_model 64, nhead 4, dim_feedforward 128,
batch_first=True):

    OUT/NAME/model.onnx
    OUT/NAME/test_data_set_0/input_0.pb, output_K.pb   (outputs from onnxruntime CPU)

Models are built after torch.manual_seed(0) and exported in eval mode with
torch.onnx.export(..., dynamo=False, opset_version=17, do_constant_folding=True,
dynamic_axes: batch symbolic on the input and the outputs)
(the `dynamo` keyword is left out on torch versions that do not have it).
Inputs: 1x3x224x224 for the CNNs, [2, 16, 64] for the encoder (numpy, seeded).

With weights=None, torchvision's init (kaiming fan_out, also on depthwise
convs) shrinks activations layer by layer: mobilenet_v3_small's logits come
out around 1e-15, useless as a precision reference. So, before export, the
CNNs' BatchNorm running statistics are re-estimated from a few seeded random
batches in train mode (cumulative average, no weight update); the weights
stay torch.manual_seed(0)'s. --no-bn-calibration skips this.

    python3 scripts/onnx/torchvision_models.py --out DIR [--no-bn-calibration]

--zoo writes instead the models users bring (issue 42's list: torchvision
classification, segmentation and detection models and Hugging Face encoders and
decoders, random weights, batch 1), each one whatever the others do: a model
that fails to export is listed on stdout and left out. Run the ONNX tests over
DIR (AMPGRAPH_ONNX_MODELS=DIR) for the coverage table.
"""

import argparse
import inspect
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torchvision
from onnx import numpy_helper

OPSET = 17


def export(model, example, path, input_names, output_names):
    kwargs = dict(
        export_params=True,
        opset_version=OPSET,
        do_constant_folding=True,
        input_names=input_names,
        output_names=output_names,
        # As users export for deployment: the batch is symbolic (import fixes it from
        # the test data; the AMP export must keep it symbolic: tests/onnx_export.rs).
        dynamic_axes={n: {0: "batch"} for n in [*input_names, *output_names]},
    )
    try:
        has_dynamo = "dynamo" in inspect.signature(torch.onnx.export).parameters
    except (TypeError, ValueError):
        has_dynamo = True  # cannot tell; try it and fall back below
    if has_dynamo:
        try:
            torch.onnx.export(model, (example,), path, dynamo=False, **kwargs)
            return
        except TypeError as e:
            if "dynamo" not in str(e):
                raise
        except torch.onnx.errors.UnsupportedOperatorError as e:
            # Newer models use ops the TorchScript exporter lacks (transformers 5's
            # GPT-2: aten::diff); the torch.export-based exporter writes them, as
            # users of those versions get by default.
            print(f"  TorchScript exporter: {str(e).splitlines()[0][:200]}; exporting with dynamo=True")
            dynamic = {k: {0: torch.export.Dim("batch")} for k in kwargs.pop("dynamic_axes")}
            # Its decompositions write opset 18's forms (Split's num_outputs).
            kwargs["opset_version"] = max(OPSET, 18)
            torch.onnx.export(model, (example,), path, dynamo=True, external_data=False,
                              dynamic_shapes=(dynamic[kwargs["input_names"][0]],), **kwargs)
            return
    torch.onnx.export(model, (example,), path, **kwargs)


def write_tensor(path, arr, name):
    with open(path, "wb") as f:
        f.write(numpy_helper.from_array(np.ascontiguousarray(arr), name).SerializeToString())


def op_counts(model):
    counts = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items()))


def calibrate_bn(model, rng, shape, steps=4):
    """Re-estimate BatchNorm running mean/var on seeded random data."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average over the steps
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    model.eval()
    return model


def build(name, model, x, input_name, output_names, out_dir):
    d = os.path.join(out_dir, name)
    data = os.path.join(d, "test_data_set_0")
    os.makedirs(data, exist_ok=True)
    path = os.path.join(d, "model.onnx")
    model.eval()
    export(model, torch.from_numpy(x), path, [input_name], output_names)

    m = onnx.load(path)
    onnx.checker.check_model(path, full_check=True)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed_name = sess.get_inputs()[0].name
    names = [o.name for o in sess.get_outputs()]
    outs = sess.run(names, {feed_name: x})

    write_tensor(os.path.join(data, "input_0.pb"), x, feed_name)
    for k, (n, a) in enumerate(zip(names, outs)):
        write_tensor(os.path.join(data, f"output_{k}.pb"), a, n)

    # sanity: onnxruntime against torch eager
    with torch.no_grad():
        ref = model(torch.from_numpy(x))
    refs = ref if isinstance(ref, (tuple, list)) else [ref]
    diffs = [float(np.max(np.abs(o.astype(np.float64) - r.numpy().astype(np.float64))))
             for o, r in zip(outs, refs)]
    # The float64 truth the import is also judged by (the model's own f32 rounding can
    # exceed 1e-4 of onnxruntime's: DeepLabV3's dilated backbone); models whose float64
    # forward fails (integer-float mixes) have none.
    try:
        with torch.no_grad():
            truth = model.double()(torch.from_numpy(x).double() if x.dtype.kind == "f"
                                   else torch.from_numpy(x))
        truths = truth if isinstance(truth, (tuple, list)) else [truth]
        for k, (n, t) in enumerate(zip(names, truths)):
            write_tensor(os.path.join(data, f"reference_f64_{k}.pb"), t.numpy(), n)
    except Exception as e:  # noqa: BLE001 - the reference is optional
        print(f"  no float64 reference: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print(f"{name}: opset {m.opset_import[0].version}, ir_version {m.ir_version}, {len(m.graph.node)} nodes, "
          f"{len(m.graph.initializer)} initializers, {os.path.getsize(path)} bytes")
    print(f"  outputs {[(n, list(a.shape), str(a.dtype)) for n, a in zip(names, outs)]}, "
          f"max |output| {[float(np.max(np.abs(a))) for a in outs]}")
    print(f"  max |ort - torch| per output: {diffs}")
    print(f"  ops: {op_counts(m)}")


class FirstTensor(torch.nn.Module):
    """A model whose output is one tensor: HF's `last_hidden_state` or `logits`,
    torchvision segmentation's `out`, detection's first image's `boxes`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.pick(self.model(x))

    def pick(self, y):
        if isinstance(y, dict):  # HF's ModelOutput is one too
            for key in ("last_hidden_state", "logits", "out", "boxes"):
                if key in y:
                    return y[key]
        if isinstance(y, (tuple, list)):
            return self.pick(y[0])
        return y


def zoo_models():
    """(name, constructor, input) of the zoo: images 1x3x224x224, token ids 1x128,
    Whisper's log-mel frames 1x80x3000."""
    tvm = torchvision.models
    rng = np.random.default_rng(2)
    img = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    ids = rng.integers(0, 1000, size=(1, 128)).astype(np.int64)
    out = [
        (n, lambda n=n: getattr(tvm, n)(weights=None), img) for n in (
            "resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny",
            "regnet_y_400mf", "densenet121", "vit_b_16", "swin_t", "maxvit_t",
            "shufflenet_v2_x1_0", "squeezenet1_1", "mnasnet1_0", "efficientnet_v2_s",
            "resnext50_32x4d")
    ]
    # Inception's two: without their auxiliary heads (inference), initialised.
    out.append(("googlenet", lambda: tvm.googlenet(weights=None, aux_logits=False,
                                                   init_weights=True), img))
    # Inputs drawn after the first models' come from their own generator, so those
    # models' inputs stay as measured.
    extra = np.random.default_rng(3)
    img299 = extra.standard_normal((1, 3, 299, 299)).astype(np.float32)
    out.append(("inception_v3", lambda: tvm.inception_v3(weights=None, aux_logits=False,
                                                         init_weights=True), img299))
    out.append(("deeplabv3_resnet50",
                lambda: FirstTensor(tvm.segmentation.deeplabv3_resnet50(weights=None,
                                                                        weights_backbone=None)), img))
    out.append(("fasterrcnn_resnet50_fpn",
                lambda: FirstTensor(tvm.detection.fasterrcnn_resnet50_fpn(
                    weights=None, weights_backbone=None)), img))
    try:
        import transformers as hf
    except ImportError:
        print("transformers is not installed: the Hugging Face models are left out")
        return out
    eager = dict(attn_implementation="eager")
    for name, build in (
        ("bert_base", lambda: hf.BertModel(hf.BertConfig(**eager))),
        ("distilbert", lambda: hf.DistilBertModel(hf.DistilBertConfig(**eager))),
        ("gpt2", lambda: hf.GPT2LMHeadModel(hf.GPT2Config(use_cache=False, **eager))),
        ("t5_encoder", lambda: hf.T5EncoderModel(hf.T5Config(use_cache=False, **eager))),
    ):
        out.append((name, lambda build=build: FirstTensor(build()), ids))
    # Decoder LLMs (RMSNorm, rotary positions, gated SiLU, grouped-query attention),
    # small configurations of their architectures: 4 layers, d512, 8 heads, 4 KV heads.
    small = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                 use_cache=False, **eager)
    for name, build in (
        ("llama", lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**small))),
        ("qwen2", lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**small))),
        ("mistral", lambda: hf.MistralForCausalLM(hf.MistralConfig(**small))),
        # Phi-3's padding token is id 32000: its vocabulary's 32064.
        ("phi3", lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**{**small, "vocab_size": 32064}))),
        ("gemma", lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**small, head_dim=64))),
        ("stablelm", lambda: hf.StableLmForCausalLM(hf.StableLmConfig(**{**small, "num_key_value_heads": 8}))),
        ("phi", lambda: hf.PhiForCausalLM(hf.PhiConfig(**small))),
        ("gpt_neox", lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**small))),
        ("falcon", lambda: hf.FalconForCausalLM(hf.FalconConfig(**small))),
        ("opt", lambda: hf.OPTForCausalLM(hf.OPTConfig(
            hidden_size=512, num_hidden_layers=4, num_attention_heads=8, ffn_dim=1408,
            word_embed_proj_dim=512, use_cache=False, **eager))),
        ("bloom", lambda: hf.BloomForCausalLM(hf.BloomConfig(
            hidden_size=512, n_layer=4, n_head=8, use_cache=False, **eager))),
        ("gptj", lambda: hf.GPTJForCausalLM(hf.GPTJConfig(
            n_embd=512, n_layer=4, n_head=8, rotary_dim=32, use_cache=False, **eager))),
    ):
        out.append((name, lambda build=build: FirstTensor(build()), ids))
    # Encoders at their base sizes (the configurations' defaults are the large ones).
    base = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, **eager)
    bart_base = dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                     decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, **eager)
    for name, build in (
        ("roberta", lambda: hf.RobertaModel(hf.RobertaConfig(**eager))),
        ("xlm_roberta", lambda: hf.XLMRobertaModel(hf.XLMRobertaConfig(vocab_size=30000, **eager))),
        ("electra", lambda: hf.ElectraModel(hf.ElectraConfig(**eager))),
        ("mpnet", lambda: hf.MPNetModel(hf.MPNetConfig(**eager))),
        ("deberta_v2", lambda: hf.DebertaV2Model(hf.DebertaV2Config(**base, num_hidden_layers=12))),
        ("albert", lambda: hf.AlbertModel(hf.AlbertConfig(**base))),
        ("bart_encoder", lambda: hf.BartModel(hf.BartConfig(**bart_base)).get_encoder()),
    ):
        out.append((name, lambda build=build: FirstTensor(build()), ids))
    out.append(("clip_vision", lambda: FirstTensor(hf.CLIPVisionModel(hf.CLIPVisionConfig(**eager))), img))
    for name, build in (
        ("hf_vit", lambda: hf.ViTModel(hf.ViTConfig(**eager))),
        ("hf_convnext", lambda: hf.ConvNextModel(hf.ConvNextConfig())),
        ("segformer", lambda: hf.SegformerForSemanticSegmentation(hf.SegformerConfig())),
        ("deit", lambda: hf.DeiTModel(hf.DeiTConfig(**eager))),
        ("beit", lambda: hf.BeitModel(hf.BeitConfig(**eager))),
        ("levit", lambda: hf.LevitModel(hf.LevitConfig())),
        ("poolformer", lambda: hf.PoolFormerModel(hf.PoolFormerConfig())),
        ("convnextv2", lambda: hf.ConvNextV2Model(hf.ConvNextV2Config())),
        ("swinv2", lambda: hf.Swinv2Model(hf.Swinv2Config(**eager))),
        ("mobilevit", lambda: hf.MobileViTModel(hf.MobileViTConfig())),
        # DINOv2 and YOLOS resize their position embeddings bicubically (at import).
        ("dinov2", lambda: hf.Dinov2Model(hf.Dinov2Config(**eager))),
        ("yolos", lambda: hf.YolosModel(hf.YolosConfig(**eager))),
    ):
        out.append((name, lambda build=build: FirstTensor(build()), img))
    # CLIP's text tower: 77 tokens.
    out.append(("clip_text", lambda: FirstTensor(hf.CLIPTextModel(hf.CLIPTextConfig(**eager))),
                ids[:, :77]))
    # One second of 16 kHz audio.
    wav = extra.standard_normal((1, 16000)).astype(np.float32)
    out.append(("wav2vec2", lambda: FirstTensor(hf.Wav2Vec2Model(hf.Wav2Vec2Config(**eager))), wav))
    mel = rng.standard_normal((1, 80, 3000)).astype(np.float32)
    out.append(("whisper_encoder",
                lambda: FirstTensor(hf.WhisperModel(hf.WhisperConfig(**eager)).get_encoder()), mel))
    return out


def tiny_models():
    """(name, constructor, input) of small configurations (2 layers, width 64) of the
    zoo's Hugging Face architectures that import through paths of their own: RoBERTa's
    position ids computed at run time (integer CumSum, Mul and Add, GatherElements),
    Falcon's and GPT-J's GatherND, BLOOM's Tile, Wav2Vec2's InstanceNormalization,
    ConvNeXt V2's and SwinV2's ReduceL2, MobileViT's Ceil, DINOv2's and YOLOS's cubic
    Resize, Funnel's and XLNet's Sin and Cos, CodeGen's IsNaN, FNet's DFT, Flaubert's
    integer ReduceSum, RWKV's ScatterND of run-time values. A few MB
    each: they travel to the GPU machine, where the ONNX tests run
    them on CUDA in f32 and AMP (scripts/gpu_onnx.sh TINY=1)."""
    import transformers as hf
    rng = np.random.default_rng(4)
    img = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    ids = rng.integers(0, 1000, size=(2, 32)).astype(np.int64)
    ids[0, 24:] = 1  # RoBERTa's padding id: its positions skip the padding
    eager = dict(attn_implementation="eager")
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=1000, **eager)
    decoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                   use_cache=False, **eager)
    vision = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  image_size=64, patch_size=8, **eager)
    out = [
        ("tiny_roberta", lambda: hf.RobertaModel(hf.RobertaConfig(**text)), ids),
        ("tiny_falcon", lambda: hf.FalconForCausalLM(hf.FalconConfig(**decoder)), ids),
        ("tiny_gptj", lambda: hf.GPTJForCausalLM(hf.GPTJConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=1000, use_cache=False, **eager)), ids),
        ("tiny_bloom", lambda: hf.BloomForCausalLM(hf.BloomConfig(
            hidden_size=64, n_layer=2, n_head=4, vocab_size=1000, use_cache=False, **eager)), ids),
        ("tiny_dinov2", lambda: hf.Dinov2Model(hf.Dinov2Config(**{**vision, "image_size": 32})), img),
        ("tiny_yolos", lambda: hf.YolosModel(hf.YolosConfig(**{**vision, "image_size": [32, 32],
                                                                 "num_detection_tokens": 4})), img),
        ("tiny_convnextv2", lambda: hf.ConvNextV2Model(hf.ConvNextV2Config(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])), img),
        ("tiny_swinv2", lambda: hf.Swinv2Model(hf.Swinv2Config(
            image_size=64, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, **eager)), img),
        # Initialised 10x wider than its default (0.02), where its activations shrink
        # to 1e-14 by the third stage: f32 keeps them and the LayerNorms scale them
        # back, 16 bits flush them to zero (`ampgraph bisect` names the layers), as
        # any fp16 run of those weights would.
        ("tiny_mobilevit", lambda: hf.MobileViTModel(hf.MobileViTConfig(
            image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 160],
            initializer_range=0.2)), img),
    ]
    out += [
        # Sinusoidal relative positions (Sin, Cos).
        ("tiny_funnel", lambda: hf.FunnelModel(hf.FunnelConfig(
            d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1], vocab_size=1000)), ids),
        ("tiny_xlnet", lambda: hf.XLNetModel(hf.XLNetConfig(
            d_model=64, n_layer=2, n_head=4, d_inner=128, vocab_size=1000)), ids),
        # Its attention mask through IsNaN.
        ("tiny_codegen", lambda: hf.CodeGenForCausalLM(hf.CodeGenConfig(
            n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=1000, use_cache=False)), ids),
        # Token mixing by the real part of a two-axis DFT.
        ("tiny_fnet", lambda: hf.FNetModel(hf.FNetConfig(
            hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=1000)), ids),
        # (MobileViTV2, Col2Im, is not here: at random weights its fp16 outputs either
        # vanish (initialised at 0.02 or 0.1) or drift 2% from f32's (at 0.2, on the CPU
        # as on the GPU; `ampgraph bisect` keeps 25 of its convolutions in f32 for
        # 5e-3). The checked-in col2im_blocks runs Col2Im's import on the GPU.)
        # Its lengths, an integer ReduceSum of the input at run time.
        ("tiny_flaubert", lambda: hf.FlaubertModel(hf.FlaubertConfig(
            emb_dim=64, n_layers=2, n_heads=4, vocab_size=1000)), ids),
        # Its outputs written a time step at a time (ScatterND of run-time values).
        ("tiny_rwkv", lambda: hf.RwkvForCausalLM(hf.RwkvConfig(
            hidden_size=64, num_hidden_layers=2, vocab_size=1000, attention_hidden_size=64,
            intermediate_size=128, use_cache=False)), ids),
    ]
    wav = rng.standard_normal((1, 4000)).astype(np.float32)
    out.append(("tiny_wav2vec2", lambda: hf.Wav2Vec2Model(hf.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, **eager)), wav))
    return [(n, lambda c=c: FirstTensor(c()), x) for n, c, x in out]


def zoo(out_dir, calibrate, only=None, models=zoo_models):
    for name, ctor, x in models():
        if only and name not in only:
            continue
        try:
            torch.manual_seed(0)
            model = ctor()
            # torchvision's ViT starts with a zero classifier (all logits 0, which
            # would compare nothing): seeded weights instead.
            if name.startswith("vit_"):
                torch.nn.init.normal_(model.heads.head.weight, std=0.02)
            # Detection models take targets in train mode: their statistics stay.
            if x.ndim == 4 and calibrate and not name.startswith("fasterrcnn"):
                calibrate_bn(model, np.random.default_rng(1), (2, *x.shape[1:]))
            build(name, model, x, "input", ["output"], out_dir)
        except Exception as e:  # one model's failure is a row of the table, not the end
            print(f"{name}: export failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def main():
    ap = argparse.ArgumentParser(description="Export torchvision / torch.nn models to ONNX with reference data.")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--no-bn-calibration", action="store_true",
                    help="export the CNNs with their initial BatchNorm statistics (tiny outputs)")
    ap.add_argument("--zoo", action="store_true",
                    help="export the zoo of models users bring instead (see the module doc)")
    ap.add_argument("--tiny", action="store_true",
                    help="export small configurations of the zoo's Hugging Face models instead "
                         "(tiny_models: a few MB each, for the GPU machine)")
    ap.add_argument("--only", default="",
                    help="with --zoo or --tiny, these models only (comma-separated names)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"onnx {onnx.__version__}, onnxruntime {ort.__version__}")
    if args.zoo or args.tiny:
        zoo(args.out, not args.no_bn_calibration, set(filter(None, args.only.split(","))),
            tiny_models if args.tiny else zoo_models)
        return 0

    rng = np.random.default_rng(0)
    img = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)

    for name, ctor in (("resnet18", torchvision.models.resnet18),
                       ("mobilenet_v3_small", torchvision.models.mobilenet_v3_small)):
        torch.manual_seed(0)
        model = ctor(weights=None)
        if not args.no_bn_calibration:
            calibrate_bn(model, np.random.default_rng(1), (8, 3, 224, 224))
        build(name, model, img, "input", ["output"], args.out)

    # The MHA "fast path" (aten::_transformer_encoder_layer_fwd) has no ONNX export;
    # switch it off where torch lets us (pytorch/pytorch#177013, #94434).
    mha = getattr(torch.backends, "mha", None)
    if mha is not None and hasattr(mha, "set_fastpath_enabled"):
        mha.set_fastpath_enabled(False)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    try:
        enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    except TypeError:  # very old torch without enable_nested_tensor
        enc = torch.nn.TransformerEncoder(layer, num_layers=2)
    seq = rng.standard_normal((2, 16, 64)).astype(np.float32)
    build("transformer_encoder", enc, seq, "src", ["output"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
