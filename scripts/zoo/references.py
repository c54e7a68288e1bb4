#!/usr/bin/env python3
"""Writes tests/data/zoo/<model>_tiny.safetensors and <model>_tiny.json for tiny
configurations of the zoo's GPT-2, BERT, ViT and ResNet (graph::models): seeded weights under
their checkpoints' names and layouts, and the logits of each model's forward pass on
fixed inputs, computed here in float64 numpy, independently of ampgraph.

- gpt2: Hugging Face's `gpt2` checkpoint names (no `transformer.` prefix, Conv1D
  weights [in, out], the attention's causal-mask buffers `h.N.attn.bias` beside them);
  vocab 16, positions 12, 2 layers, 2 heads, width 32; tokens [2, 8].
- bert: `BertForMaskedLM`'s names (torch Linear weights [out, in]); vocab 16,
  positions 12, 2 layers, 2 heads, width 32, intermediate 64; tokens [2, 8].
- vit: torchvision's `vit_b_16` names, the patch embedding's kernel in torch's OIHW;
  8x8 images in 4x4 patches, 2 layers, 2 heads, width 32, MLP 64, 3 classes; images
  [2, 3, 8, 8].
- resnet: torchvision's `resnet50` names (kernels OIHW, the batch norms' running
  statistics), inference; one bottleneck a stage, width 4, 3 classes; images
  [2, 3, 32, 32].

    python3 scripts/zoo/references.py     (needs numpy and safetensors)
"""

import json
import math
import os

import numpy as np
from safetensors.numpy import save_file

VOCAB, POSITIONS, LAYERS, HEADS, WIDTH = 16, 12, 2, 2, 32
OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "zoo")


def gpt2_weights(rng):
    w = {}
    f = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w["wte.weight"] = f(VOCAB, WIDTH)
    w["wpe.weight"] = f(POSITIONS, WIDTH)
    for i in range(LAYERS):
        p = f"h.{i}"
        for ln in ("ln_1", "ln_2"):
            w[f"{p}.{ln}.weight"] = (1.0 + f(WIDTH, s=0.1)).astype(np.float32)
            w[f"{p}.{ln}.bias"] = f(WIDTH, s=0.1)
        w[f"{p}.attn.c_attn.weight"] = f(WIDTH, 3 * WIDTH)
        w[f"{p}.attn.c_attn.bias"] = f(3 * WIDTH, s=0.1)
        w[f"{p}.attn.c_proj.weight"] = f(WIDTH, WIDTH)
        w[f"{p}.attn.c_proj.bias"] = f(WIDTH, s=0.1)
        w[f"{p}.mlp.c_fc.weight"] = f(WIDTH, 4 * WIDTH)
        w[f"{p}.mlp.c_fc.bias"] = f(4 * WIDTH, s=0.1)
        w[f"{p}.mlp.c_proj.weight"] = f(4 * WIDTH, WIDTH)
        w[f"{p}.mlp.c_proj.bias"] = f(WIDTH, s=0.1)
        # The buffer old checkpoints carry: not a parameter.
        w[f"{p}.attn.bias"] = np.tril(np.ones((POSITIONS, POSITIONS), dtype=np.float32))[None, None]
    w["ln_f.weight"] = (1.0 + f(WIDTH, s=0.1)).astype(np.float32)
    w["ln_f.bias"] = f(WIDTH, s=0.1)
    return w


def layer_norm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gpt2_forward(w, tokens):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, t = tokens.shape
    d = WIDTH // HEADS
    x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(LAYERS):
        p = f"h.{i}"
        h = layer_norm(x, w[f"{p}.ln_1.weight"], w[f"{p}.ln_1.bias"])
        qkv = h @ w[f"{p}.attn.c_attn.weight"] + w[f"{p}.attn.c_attn.bias"]
        q, k, v = (qkv[..., j * WIDTH:(j + 1) * WIDTH].reshape(b, t, HEADS, d).transpose(0, 2, 1, 3)
                   for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        a = a.transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
        x = x + a @ w[f"{p}.attn.c_proj.weight"] + w[f"{p}.attn.c_proj.bias"]
        h = layer_norm(x, w[f"{p}.ln_2.weight"], w[f"{p}.ln_2.bias"])
        h = gelu_tanh(h @ w[f"{p}.mlp.c_fc.weight"] + w[f"{p}.mlp.c_fc.bias"])
        x = x + h @ w[f"{p}.mlp.c_proj.weight"] + w[f"{p}.mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    return x @ w["wte.weight"].T


def gelu_erf(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)))


def attention(x, wqkv, bqkv, heads, mask=None):
    """Multi-head self-attention of x [b, t, c] with packed [3c, c] torch weights."""
    b, t, c = x.shape
    d = c // heads
    qkv = x @ wqkv.T + bqkv
    q, k, v = (qkv[..., j * c:(j + 1) * c].reshape(b, t, heads, d).transpose(0, 2, 1, 3)
               for j in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    if mask is not None:
        s = s + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    a = (s / s.sum(-1, keepdims=True)) @ v
    return a.transpose(0, 2, 1, 3).reshape(b, t, c)


BERT = dict(vocab=16, positions=12, layers=2, heads=2, width=32, inter=64)


def bert_weights(rng):
    c, i_w = BERT["width"], BERT["inter"]
    f = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w = {}
    e = "bert.embeddings"
    w[f"{e}.word_embeddings.weight"] = f(BERT["vocab"], c)
    w[f"{e}.position_embeddings.weight"] = f(BERT["positions"], c)
    w[f"{e}.token_type_embeddings.weight"] = f(2, c)

    def ln(name):
        w[f"{name}.weight"] = (1.0 + f(c, s=0.1)).astype(np.float32)
        w[f"{name}.bias"] = f(c, s=0.1)

    def linear(name, out, inp):
        w[f"{name}.weight"] = f(out, inp)
        w[f"{name}.bias"] = f(out, s=0.1)

    ln(f"{e}.LayerNorm")
    for layer in range(BERT["layers"]):
        p = f"bert.encoder.layer.{layer}"
        for part in ("query", "key", "value"):
            linear(f"{p}.attention.self.{part}", c, c)
        linear(f"{p}.attention.output.dense", c, c)
        ln(f"{p}.attention.output.LayerNorm")
        linear(f"{p}.intermediate.dense", i_w, c)
        linear(f"{p}.output.dense", c, i_w)
        ln(f"{p}.output.LayerNorm")
    linear("cls.predictions.transform.dense", c, c)
    ln("cls.predictions.transform.LayerNorm")
    w["cls.predictions.bias"] = f(BERT["vocab"], s=0.1)
    return w


def bert_forward(w, tokens):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, t = tokens.shape
    e = "bert.embeddings"
    ln = lambda x, n: layer_norm(x, w[f"{n}.weight"], w[f"{n}.bias"], 1e-12)  # noqa: E731
    lin = lambda x, n: x @ w[f"{n}.weight"].T + w[f"{n}.bias"]  # noqa: E731
    x = (w[f"{e}.word_embeddings.weight"][tokens] + w[f"{e}.position_embeddings.weight"][:t]
         + w[f"{e}.token_type_embeddings.weight"][0])
    x = ln(x, f"{e}.LayerNorm")
    for layer in range(BERT["layers"]):
        p = f"bert.encoder.layer.{layer}"
        parts = [f"{p}.attention.self.{n}" for n in ("query", "key", "value")]
        wqkv = np.concatenate([w[f"{n}.weight"] for n in parts])
        bqkv = np.concatenate([w[f"{n}.bias"] for n in parts])
        a = lin(attention(x, wqkv, bqkv, BERT["heads"]), f"{p}.attention.output.dense")
        x = ln(x + a, f"{p}.attention.output.LayerNorm")
        h = lin(gelu_erf(lin(x, f"{p}.intermediate.dense")), f"{p}.output.dense")
        x = ln(x + h, f"{p}.output.LayerNorm")
    h = gelu_erf(lin(x, "cls.predictions.transform.dense"))
    h = ln(h, "cls.predictions.transform.LayerNorm")
    return h @ w[f"{e}.word_embeddings.weight"].T + w["cls.predictions.bias"]


VIT = dict(image=8, patch=4, layers=2, heads=2, width=32, mlp=64, classes=3)


def vit_weights(rng):
    c, p = VIT["width"], VIT["patch"]
    seq = (VIT["image"] // p) ** 2 + 1
    f = lambda *shape, s=0.2: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w = {"conv_proj.weight": f(c, 3, p, p), "conv_proj.bias": f(c, s=0.1),
         "class_token": f(1, 1, c), "encoder.pos_embedding": f(1, seq, c)}

    def ln(name):
        w[f"{name}.weight"] = (1.0 + f(c, s=0.1)).astype(np.float32)
        w[f"{name}.bias"] = f(c, s=0.1)

    for layer in range(VIT["layers"]):
        n = f"encoder.layers.encoder_layer_{layer}"
        ln(f"{n}.ln_1")
        w[f"{n}.self_attention.in_proj_weight"] = f(3 * c, c)
        w[f"{n}.self_attention.in_proj_bias"] = f(3 * c, s=0.1)
        w[f"{n}.self_attention.out_proj.weight"] = f(c, c)
        w[f"{n}.self_attention.out_proj.bias"] = f(c, s=0.1)
        ln(f"{n}.ln_2")
        w[f"{n}.mlp.0.weight"] = f(VIT["mlp"], c)
        w[f"{n}.mlp.0.bias"] = f(VIT["mlp"], s=0.1)
        w[f"{n}.mlp.3.weight"] = f(c, VIT["mlp"])
        w[f"{n}.mlp.3.bias"] = f(c, s=0.1)
    ln("encoder.ln")
    w["heads.head.weight"] = f(VIT["classes"], c)
    w["heads.head.bias"] = f(VIT["classes"], s=0.1)
    return w


def vit_forward(w, images):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b = images.shape[0]
    p, c = VIT["patch"], VIT["width"]
    side = VIT["image"] // p
    ln = lambda x, n: layer_norm(x, w[f"{n}.weight"], w[f"{n}.bias"], 1e-6)  # noqa: E731
    lin = lambda x, n: x @ w[f"{n}.weight"].T + w[f"{n}.bias"]  # noqa: E731
    # The strided convolution: each patch [3, p, p] against each filter.
    patches = images.reshape(b, 3, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
    tokens = patches.reshape(b, side * side, 3 * p * p) @ w["conv_proj.weight"].reshape(c, -1).T
    tokens = tokens + w["conv_proj.bias"]
    x = np.concatenate([np.broadcast_to(w["class_token"], (b, 1, c)), tokens], axis=1)
    x = x + w["encoder.pos_embedding"]
    for layer in range(VIT["layers"]):
        n = f"encoder.layers.encoder_layer_{layer}"
        a = attention(ln(x, f"{n}.ln_1"), w[f"{n}.self_attention.in_proj_weight"],
                      w[f"{n}.self_attention.in_proj_bias"], VIT["heads"])
        x = x + lin(a, f"{n}.self_attention.out_proj")
        h = lin(gelu_erf(lin(ln(x, f"{n}.ln_2"), f"{n}.mlp.0")), f"{n}.mlp.3")
        x = x + h
    return lin(ln(x, "encoder.ln")[:, 0], "heads.head")


RESNET = dict(blocks=[1, 1, 1, 1], width=4, classes=3)


def resnet_weights(rng):
    f = lambda *shape, s=0.3: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w = {}

    def conv_bn(conv, bn, cout, cin, k):
        w[f"{conv}.weight"] = f(cout, cin, k, k, s=np.sqrt(2.0 / (cin * k * k)))
        w[f"{bn}.weight"] = (1.0 + f(cout, s=0.1)).astype(np.float32)
        w[f"{bn}.bias"] = f(cout, s=0.1)
        w[f"{bn}.running_mean"] = f(cout, s=0.1)
        w[f"{bn}.running_var"] = rng.uniform(0.5, 1.5, cout).astype(np.float32)

    width = RESNET["width"]
    conv_bn("conv1", "bn1", width, 3, 7)
    cin = width
    for stage, blocks in enumerate(RESNET["blocks"]):
        wd = width << stage
        for block in range(blocks):
            n = f"layer{stage + 1}.{block}"
            conv_bn(f"{n}.conv1", f"{n}.bn1", wd, cin, 1)
            conv_bn(f"{n}.conv2", f"{n}.bn2", wd, wd, 3)
            conv_bn(f"{n}.conv3", f"{n}.bn3", 4 * wd, wd, 1)
            if block == 0:
                conv_bn(f"{n}.downsample.0", f"{n}.downsample.1", 4 * wd, cin, 1)
            cin = 4 * wd
    w["fc.weight"] = f(RESNET["classes"], cin)
    w["fc.bias"] = f(RESNET["classes"], s=0.1)
    return w


def conv2d(x, w, stride, pad):
    """Cross-correlation of x [b, cin, h, w] with an OIHW kernel, as torch's Conv2d."""
    k = w.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (x.shape[2] + 2 * pad - k) // stride + 1
    ow = (x.shape[3] + 2 * pad - k) // stride + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for u in range(k):
        for v in range(k):
            patch = xp[:, :, u:u + stride * (oh - 1) + 1:stride, v:v + stride * (ow - 1) + 1:stride]
            out += np.einsum("bchw,oc->bohw", patch, w[:, :, u, v])
    return out


def resnet_forward(w, images):
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def conv_bn(x, conv, bn, stride, relu):
        y = conv2d(x, w[f"{conv}.weight"], stride, w[f"{conv}.weight"].shape[2] // 2)
        c = lambda name: w[f"{bn}.{name}"][None, :, None, None]  # noqa: E731
        y = (y - c("running_mean")) / np.sqrt(c("running_var") + 1e-5) * c("weight") + c("bias")
        return np.maximum(y, 0.0) if relu else y

    x = conv_bn(images, "conv1", "bn1", 2, True)
    # Max pool 3x3, stride 2, padding 1 (the padding never wins).
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    oh, ow = (x.shape[2] - 1) // 2 + 1, (x.shape[3] - 1) // 2 + 1
    x = np.max([xp[:, :, u:u + 2 * (oh - 1) + 1:2, v:v + 2 * (ow - 1) + 1:2]
                for u in range(3) for v in range(3)], axis=0)
    for stage, blocks in enumerate(RESNET["blocks"]):
        for block in range(blocks):
            n = f"layer{stage + 1}.{block}"
            stride = 2 if stage > 0 and block == 0 else 1
            h = conv_bn(x, f"{n}.conv1", f"{n}.bn1", 1, True)
            h = conv_bn(h, f"{n}.conv2", f"{n}.bn2", stride, True)
            h = conv_bn(h, f"{n}.conv3", f"{n}.bn3", 1, False)
            if f"{n}.downsample.0.weight" in w:
                x = conv_bn(x, f"{n}.downsample.0", f"{n}.downsample.1", stride, False)
            x = np.maximum(h + x, 0.0)
    return x.mean(axis=(2, 3)) @ w["fc.weight"].T + w["fc.bias"]


def write(name, weights, inputs, outputs):
    save_file(weights, os.path.join(OUT, f"{name}_tiny.safetensors"))
    with open(os.path.join(OUT, f"{name}_tiny.json"), "w") as f:
        json.dump({"inputs": inputs.reshape(-1).tolist(), "logits": outputs.reshape(-1).tolist()}, f)
        f.write("\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(2026)
    w = gpt2_weights(rng)
    tokens = rng.integers(0, VOCAB, size=(2, 8))
    write("gpt2", w, tokens, gpt2_forward(w, tokens))
    rng = np.random.default_rng(2027)
    w = bert_weights(rng)
    tokens = rng.integers(0, BERT["vocab"], size=(2, 8))
    write("bert", w, tokens, bert_forward(w, tokens))
    rng = np.random.default_rng(2028)
    w = vit_weights(rng)
    images = rng.standard_normal((2, 3, VIT["image"], VIT["image"])).astype(np.float32)
    write("vit", w, images, vit_forward(w, images.astype(np.float64)))
    rng = np.random.default_rng(2029)
    w = resnet_weights(rng)
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    write("resnet", w, images, resnet_forward(w, images.astype(np.float64)))


if __name__ == "__main__":
    main()
