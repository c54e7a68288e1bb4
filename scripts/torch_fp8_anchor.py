#!/usr/bin/env python3
"""The FP8 peers of issue 44 on torch_anchor.py's workloads (train steps, timed as
torch_anchor.py times them): torch.compile in bf16 autocast, and torchao's float8
training (`convert_to_float8_training`, its default tensorwise scaling, every Linear
whose dims are multiples of 16) under torch.compile. One JSON line per workload and
mode. On the GPU machine, from bundle/ (make_bundle.sh puts torchao's wheel there;
gpu_fp8.sh installs it into /tmp/ao):

    PYTHONPATH=/tmp/ao python3 torch_fp8_anchor.py --only mlp,transformer
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_anchor as anchor


def run(name, cfg, mode, steps, warm):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    m, x, y = anchor.build(cfg, "cuda")
    if mode == "torchao_fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def eligible(module, _name):
            return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

        convert_to_float8_training(m, config=Float8LinearConfig(), module_filter_fn=eligible)
    fwd = torch.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

    def loss_of():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(x)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)

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
    flops = anchor.flops_train(cfg, m)
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
                run(name, anchor.WORKLOADS[name], mode, a.steps, 8)
            except Exception as e:  # keep the other rows
                print(json.dumps(dict(workload=name, mode=mode, error=str(e)[:300])), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
