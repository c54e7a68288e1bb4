#!/usr/bin/env python3
"""The FP8 peers of issue 44 on torch_anchor.py's workloads and GPT-2 124M (train
steps, timed as torch_anchor.py times them): torch.compile in bf16 autocast, and
torchao's float8 training (`convert_to_float8_training`, its default tensorwise scaling,
every Linear whose dims are multiples of 16) under torch.compile. One JSON line per
workload and mode. On the GPU machine, from bundle/ (make_bundle.sh puts torchao's wheel
there; gpu_fp8.sh installs it into /tmp/ao):

    PYTHONPATH=/tmp/ao python3 torch_fp8_anchor.py --only mlp,transformer,gpt2

GPT-2 is scripts/torch_zoo_train.py's (Hugging Face's, b16 s1024, no dropout as `bench
--workload gpt2`, fused AdamW) with its Conv1D layers made the nn.Linear they compute,
so that torchao converts them; its tied head (50257 columns) stays bf16.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_anchor as anchor

# torch_zoo_train.py: beside this file in scripts/, or in ../scripts from bundle/.
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, "..", "scripts")]


def as_linears(module):
    """Hugging Face's Conv1D (`x @ W + b`, W stored [in, out]) replaced by the
    nn.Linear computing the same (its weight W^T), recursively."""
    from transformers.pytorch_utils import Conv1D
    for name, child in module.named_children():
        if isinstance(child, Conv1D):
            n_in, n_out = child.weight.shape
            lin = nn.Linear(n_in, n_out, device=child.weight.device)
            with torch.no_grad():
                lin.weight.copy_(child.weight.t())
                lin.bias.copy_(child.bias)
            setattr(module, name, lin)
        else:
            as_linears(child)
    return module


def build_gpt2():
    """GPT-2 124M (torch_zoo_train.py's, no dropout) and its step's loss: `(model,
    loss_of(fwd), optimizer, flops)`."""
    import torch_zoo_train as zoo
    make, data, batch, _dtype, _opt, _cl = zoo.models(0.0, 0.0)["gpt2"]
    m = as_linears(make().cuda().train())
    tokens, labels = [t.cuda() for t in data(batch)]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)

    def loss_of(fwd):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fwd(tokens, labels=labels).loss

    # bench --workload gpt2's count: 6 x (the layers' matrices and the head) per token,
    # and attention's products.
    (b, t), (layers, d, vocab) = tokens.shape, (12, 768, 50257)
    flops = 6 * (layers * 12 * d * d + d * vocab) * b * t + 3 * 4 * b * t * t * d * layers
    return m, loss_of, opt, flops


def build_anchor(cfg):
    """A torch_anchor.py workload: `(model, loss_of(fwd), optimizer, flops)`."""
    m, x, y = anchor.build(cfg, "cuda")
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

    def loss_of(fwd):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(x)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)

    return m, loss_of, opt, anchor.flops_train(cfg, m)


def run(name, mode, steps, warm):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    m, loss_fn, opt, flops = build_gpt2() if name == "gpt2" else build_anchor(anchor.WORKLOADS[name])
    if mode == "torchao_fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def eligible(module, _name):
            return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

        convert_to_float8_training(m, config=Float8LinearConfig(), module_filter_fn=eligible)
    fwd = torch.compile(m)

    def loss_of():
        return loss_fn(fwd)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        opt.step()

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    med = times[len(times) // 2]
    rec = dict(workload=name, mode=mode, phase="train", median_ms=round(med, 3),
               min_ms=round(times[0], 3), peak_mem_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1),
               tflops=round(flops / med / 1e9, 1) if flops else None, loss=round(float(loss_of().item()), 4))
    print(json.dumps(rec), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="mlp,transformer")
    ap.add_argument("--modes", default="compile_bf16,torchao_fp8")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for name in a.only.split(","):
        for mode in a.modes.split(","):
            try:
                run(name, mode, a.steps, 8)
            except Exception as e:  # keep the other rows
                print(json.dumps(dict(workload=name, mode=mode, error=str(e)[:300])), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
