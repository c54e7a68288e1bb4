#!/usr/bin/env python3
"""The table of scripts/gpu_engine.sh: per model and mode, ampgraph's step (device,
wall and host enqueue ms, medians), the sum of its kernels' times per step (from the
profiled steps), their ratios, peak memory, and PyTorch's times from real_models.py.

    python3 engine_table.py ENGINE.txt TORCH_REAL.txt
"""
import json
import re
import sys


def runs(path):
    """(model, mode, report or error text) per `## model mode` block."""
    text = open(path).read()
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        parts = head.split()
        model, mode = parts[0], " ".join(parts[1:]) or "graph"
        body = re.sub(r"^exit \d+\s*$", "", body, flags=re.M).strip()
        try:
            yield model, mode, json.loads(body)
        except ValueError:
            yield model, mode, body.splitlines()[-1] if body else "no output"


def kernels_ms(profile):
    """Device ms per step of every op, from the profile table's `all` row."""
    if not profile:
        return None
    steps = re.search(r"steps: (\d+)", profile)
    row = re.search(r"^\| all \| \d+ \| ([\d.]+) \|", profile, flags=re.M)
    if not steps or not row or int(steps.group(1)) == 0:
        return None
    return float(row.group(1)) / int(steps.group(1))


def torch_times(path):
    out = {}
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "fp32" in r or "amp_fp16" in r:
            out[r["model"]] = r
    return out


def main():
    engine, torch_path = sys.argv[1], sys.argv[2]
    torch = torch_times(torch_path)
    print("| model | mode | step ms (device) | wall ms | enqueue ms | kernels ms | step / kernels | enqueue / step | peak MiB | launch | torch amp / half / compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model, mode, r in runs(engine):
        if isinstance(r, str):
            print(f"| {model} | {mode} | error: {r[:120]} |")
            continue
        step = (r.get("device_ms") or {}).get("median")
        wall = r["wall_ms"]["median"]
        enq = (r.get("enqueue_ms") or {}).get("median")
        k = kernels_ms(r.get("profile"))
        t = torch.get(model, {})
        peers = " / ".join(f"{t[key]:.3f}" if key in t else "-" for key in ("amp_fp16", "half", "compile_amp_fp16"))
        fmt = lambda v: f"{v:.3f}" if v is not None else "-"
        ratio = lambda a, b: f"{a / b:.3f}" if a is not None and b else "-"
        peak = r.get("peak_mib")
        print(f"| {model} | {mode} | {fmt(step)} | {fmt(wall)} | {fmt(enq)} | {fmt(k)} | {ratio(step, k)} | "
              f"{ratio(enq, step)} | {fmt(peak)} | {r.get('launch', '-')} | {peers} |")


if __name__ == "__main__":
    main()
