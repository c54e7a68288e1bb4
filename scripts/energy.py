#!/usr/bin/env python3
"""Joules per training step, PyTorch's beside ours, over a long run (by default 300
steps after torch_anchor.py's 8 of warm-up): past its first 100 ms or so a dense
training loop runs at the GPU's power limit, where a step's energy sets its time.

PyTorch's step is torch_anchor.py's (same model, optimizer, GradScaler, autocast;
torch.compile for compile_fp16), timed the same way, with NVML's total-energy
counter read around the timed steps. Ours is `bench --iters N`, which reads the
same counter around its timed steps and prints "joules" and "watts".

    cd bundle && python3 energy.py [--workload mlp] [--modes amp_fp16,compile_fp16] [--steps 300]
"""
import argparse, ctypes, json, subprocess, time

import torch, torch.nn.functional as F
import torch_anchor as ta

nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()
handle = ctypes.c_void_p()
nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))


def millijoules():
    v = ctypes.c_ulonglong()
    if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(v)) != 0:
        raise SystemExit("NVML: no total-energy counter on this GPU")
    return v.value


def torch_run(workload, mode, steps):
    """torch_anchor.py's `run` for a train step, with the energy counter around the
    timed steps."""
    cfg = ta.WORKLOADS[workload]
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    m, x, y = ta.build(cfg, "cuda")
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    fwd = torch.compile(m) if mode == "compile_fp16" else m
    dtype = torch.float16 if mode in ("amp_fp16", "compile_fp16") else torch.bfloat16

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            out = fwd(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    times, e0, t0 = [], millijoules(), time.time()
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    mj, wall = millijoules() - e0, time.time() - t0
    times.sort()
    return dict(median_ms=round(times[len(times) // 2], 3), joules=round(mj / 1e3 / steps, 3),
                watts=round(mj / 1e3 / wall))


def ours_run(workload, mode, steps):
    cmd = ["./bench", "--workload", workload, "--modes", mode, "--phases", "train", "--iters", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rec = next(json.loads(l) for l in out.splitlines() if l.startswith("{"))
    return {k: rec.get(k) for k in ("median_ms", "joules", "watts")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--modes", default="amp_fp16")
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    for mode in a.modes.split(","):
        sides = [("pytorch", torch_run)] + ([] if mode == "compile_fp16" else [("ampgraph", ours_run)])
        for side, run in sides:
            time.sleep(3)  # each run starts from an idle GPU
            rec = dict(side=side, workload=a.workload, mode=mode, steps=a.steps, **run(a.workload, mode, a.steps))
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
