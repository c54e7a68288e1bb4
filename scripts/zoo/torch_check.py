#!/usr/bin/env python3
"""Checks the zoo's numpy references (tests/data/zoo, scripts/zoo/references.py)
against PyTorch: Hugging Face's GPT2LMHeadModel and BertForMaskedLM and torchvision's
VisionTransformer at the tiny configurations, loaded with the fixtures' weights (the
names as the checkpoints have them), in float64, eval mode, on the fixtures' inputs.
One line per model with the largest error relative to the logits' scale; exit 1 if
one exceeds 1e-6. (The tiny ResNet's width 4 is no torchvision configuration: numpy
alone checks it.)

    python3 scripts/zoo/torch_check.py     (needs torch, torchvision, transformers, safetensors)
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors.numpy import load_file

DIR = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "zoo")


def fixture(name):
    weights = {k: torch.from_numpy(v.astype(np.float64)) for k, v in
               load_file(os.path.join(DIR, f"{name}_tiny.safetensors")).items()}
    with open(os.path.join(DIR, f"{name}_tiny.json")) as f:
        ref = json.load(f)
    return weights, np.array(ref["inputs"]), np.array(ref["logits"])


def gpt2(weights, inputs):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=16, n_positions=12, n_embd=32, n_layer=2, n_head=2,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, layer_norm_epsilon=1e-5, attn_implementation="eager")
    m = GPT2LMHeadModel(cfg).double().eval()
    m.transformer.load_state_dict(weights, strict=False)
    tokens = torch.from_numpy(inputs.reshape(2, 8).astype(np.int64))
    return m(tokens).logits


def bert(weights, inputs):
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=12, type_vocab_size=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     hidden_act="gelu", layer_norm_eps=1e-12, attn_implementation="eager")
    m = BertForMaskedLM(cfg).double().eval()
    missing, _ = m.load_state_dict(weights, strict=False)
    assert all("decoder" in k or "position_ids" in k for k in missing), missing
    tokens = torch.from_numpy(inputs.reshape(2, 8).astype(np.int64))
    return m(tokens).logits


def vit(weights, inputs):
    from torchvision.models.vision_transformer import VisionTransformer
    m = VisionTransformer(image_size=8, patch_size=4, num_layers=2, num_heads=2,
                          hidden_dim=32, mlp_dim=64, num_classes=3).double().eval()
    m.load_state_dict(weights)
    return m(torch.from_numpy(inputs.reshape(2, 3, 8, 8)))


def main():
    worst = 0.0
    for name, run in (("gpt2", gpt2), ("bert", bert), ("vit", vit)):
        weights, inputs, want = fixture(name)
        with torch.no_grad():
            got = run(weights, inputs).numpy().reshape(-1)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        worst = max(worst, err)
        print(json.dumps({"model": name, "relative_error_vs_numpy": err}), flush=True)
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
