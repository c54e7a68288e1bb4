#!/usr/bin/env python3
"""Kernel launches per step of PyTorch eager (and torch.compile) on torch_anchor.py's
workloads, counted by torch.profiler (CUPTI): CUDA kernels, memsets and memcpys of one
step after warm-up. Run beside torch_anchor.py on the GPU machine:

    python3 torch_launches.py --only mlp,transformer,convnet --modes amp_fp16,compile_fp16

The convnet runs as torch_anchor.py runs it: cuDNN autotuned (`cudnn.benchmark`; the
warm-up steps take the tuning), TF32 in cuDNN too in the tf32 mode, channels-last
memory except in fp32.
"""
import argparse, collections, json
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
import torch_anchor as ta


def count(name, cfg, mode, infer, table):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.benchmark = True
    m, x, y = ta.build(cfg, "cuda")
    if cfg["kind"] == "convnet" and mode != "fp32":
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    amp = {"amp_fp16": torch.float16, "amp_bf16": torch.bfloat16, "compile_fp16": torch.float16}.get(mode)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    fwd = torch.compile(m) if mode == "compile_fp16" else m

    def step():
        if infer:
            with torch.inference_mode(), torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                return fwd(x)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
            out = fwd(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    if infer:
        m.eval()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name.lower()
            kinds["memcpy" if "memcpy" in n else "memset" if "memset" in n else "kernel"] += 1
    rec = dict(workload=name, mode=mode, phase="infer" if infer else "train", **kinds)
    print(json.dumps(rec), flush=True)
    if table:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="mlp,transformer,convnet")
    ap.add_argument("--modes", default="amp_fp16,compile_fp16")
    ap.add_argument("--table", action="store_true", help="also print where the step's GPU time goes")
    a = ap.parse_args()
    for name in a.only.split(","):
        for mode in a.modes.split(","):
            for infer in (False, True):
                count(name, ta.WORKLOADS[name], mode, infer, a.table)


if __name__ == "__main__":
    main()
