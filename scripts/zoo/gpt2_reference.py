#!/usr/bin/env python3
"""Writes tests/data/zoo/gpt2_tiny.safetensors (a tiny GPT-2's seeded weights under the
names Hugging Face's `gpt2` checkpoint uses: no `transformer.` prefix, Conv1D weights
[in, out], the attention's causal-mask buffer `h.N.attn.bias` beside them) and
tests/data/zoo/gpt2_tiny.json (token ids and the logits of GPT-2's forward pass,
computed here in float64 numpy, independently of ampgraph).

    python3 scripts/zoo/gpt2_reference.py     (needs numpy and safetensors)

Config: vocab 16, positions 12, 2 layers, 2 heads, width 32 (tests/models_zoo.rs's
TINY_GPT2); tokens [2, 8].
"""

import json
import os

import numpy as np
from safetensors.numpy import save_file

VOCAB, POSITIONS, LAYERS, HEADS, WIDTH = 16, 12, 2, 2, 32
OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "zoo")


def weights(rng):
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


def layer_norm(x, g, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * g + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(w, tokens):
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


def main():
    rng = np.random.default_rng(2026)
    w = weights(rng)
    tokens = rng.integers(0, VOCAB, size=(2, 8))
    logits = forward(w, tokens)
    os.makedirs(OUT, exist_ok=True)
    save_file(w, os.path.join(OUT, "gpt2_tiny.safetensors"))
    with open(os.path.join(OUT, "gpt2_tiny.json"), "w") as f:
        json.dump({"tokens": tokens.tolist(), "logits": logits.reshape(-1).tolist()}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
