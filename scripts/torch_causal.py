#!/usr/bin/env python3
"""torch_anchor.py's transformer with causal attention, as `bench --workload
transformer --causal` builds it: an additive mask (-inf above the diagonal, in the
scores' dtype) added to the scaled scores before the explicit softmax. Timed exactly
as torch_anchor.py times its workloads (its `run`), one JSON record per line.

    cd bundle && python3 torch_causal.py [--modes amp_fp16,compile_fp16] [--sdpa]

With --sdpa the attention is PyTorch's fused `scaled_dot_product_attention(...,
is_causal=True)` instead (flash or cuDNN kernels): what a PyTorch user would write,
the peer of ampgraph's fused causal attention.
"""
import argparse

import torch
import torch.nn.functional as F
import torch_anchor as ta

masks = {}


def causal_forward(self, x):
    b, t, d = x.shape
    h = self.ln1(x)
    q, k, v = self.qkv(h).split(d, dim=-1)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
    key = (t, att.dtype)
    if key not in masks:
        masks[key] = torch.full((t, t), float("-inf"), device=x.device).triu(1).to(att.dtype)
    att = (att + masks[key]).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, d)
    x = x + self.proj(y)
    x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
    return x


def sdpa_forward(self, x):
    b, t, d = x.shape
    h = self.ln1(x)
    q, k, v = self.qkv(h).split(d, dim=-1)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(b, t, d)
    x = x + self.proj(y)
    x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="amp_fp16,compile_fp16")
    ap.add_argument("--phases", default="train,infer")
    ap.add_argument("--sdpa", action="store_true")
    a = ap.parse_args()
    ta.Block.forward = sdpa_forward if a.sdpa else causal_forward
    form = "SDPA is_causal" if a.sdpa else "explicit, additive mask"
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}: causal transformer ({form})", flush=True)
    for mode in a.modes.split(","):
        for phase in a.phases.split(","):
            name = "transformer_causal_sdpa" if a.sdpa else "transformer_causal"
            ta.run(name, ta.WORKLOADS["transformer"], mode, 30, 8, phase == "infer")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
