#!/usr/bin/env python3
"""torch_anchor.py's transformer with causal attention, as `bench --workload
transformer --causal` builds it: an additive mask (-inf above the diagonal, in the
scores' dtype) added to the scaled scores before the explicit softmax. Timed exactly
as torch_anchor.py times its workloads (its `run`), one JSON record per line.

    cd bundle && python3 torch_causal.py [--modes amp_fp16,compile_fp16] [--sdpa]

With --sdpa the attention is PyTorch's fused `scaled_dot_product_attention(...,
is_causal=True)` instead (flash or cuDNN kernels): what a PyTorch user would write,
the peer of ampgraph's fused causal attention. With --padding a key padding mask
`[B, 1, 1, T]` is added too, as `bench --key-padding` adds it (batch element i pads
its last i * T / (2 B) keys with -inf); SDPA then takes both masks as one additive
`attn_mask`.
"""
import argparse

import torch
import torch.nn.functional as F
import torch_anchor as ta

masks = {}
padding = False


def padding_mask(b, t, dtype, device):
    kept = torch.tensor([t - i * t // (2 * b) for i in range(b)], device=device)
    pad = torch.arange(t, device=device)[None, :] >= kept[:, None]
    return torch.zeros(b, 1, 1, t, device=device).masked_fill(pad[:, None, None, :], float("-inf")).to(dtype)


def mask_of(b, t, dtype, device):
    """The additive mask of the scores: causal [t, t], plus the padding where asked."""
    key = (b, t, dtype)
    if key not in masks:
        m = torch.full((t, t), float("-inf"), device=device).triu(1).to(dtype)
        if padding:
            m = m + padding_mask(b, t, dtype, device)
        masks[key] = m
    return masks[key]


def causal_forward(self, x):
    b, t, d = x.shape
    h = self.ln1(x)
    q, k, v = self.qkv(h).split(d, dim=-1)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
    att = (att + mask_of(b, t, att.dtype, x.device)).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, d)
    x = x + self.proj(y)
    x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
    return x


def sdpa_forward(self, x):
    b, t, d = x.shape
    h = self.ln1(x)
    q, k, v = self.qkv(h).split(d, dim=-1)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    if padding:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(b, t, q.dtype, x.device))
    else:
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
    ap.add_argument("--padding", action="store_true")
    a = ap.parse_args()
    global padding
    padding = a.padding
    ta.Block.forward = sdpa_forward if a.sdpa else causal_forward
    form = "SDPA" if a.sdpa else "explicit, additive mask"
    if a.padding:
        form += ", key padding"
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}: causal transformer ({form})", flush=True)
    for mode in a.modes.split(","):
        for phase in a.phases.split(","):
            name = "transformer_causal" + ("_padded" if a.padding else "") + ("_sdpa" if a.sdpa else "")
            ta.run(name, ta.WORKLOADS["transformer"], mode, 30, 8, phase == "infer")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
