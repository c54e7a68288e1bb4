#!/usr/bin/env python3
"""torch_anchor.py's convnet at another width (and batch), for the bench's `--width`
(`bench --workload convnet --width 60` beside `python3 torch_convnet_width.py 60`):
the same model, modes and timing as torch_anchor.py, one JSON line per run."""
import sys
import torch
import torch_anchor as ta

width = int(sys.argv[1]) if len(sys.argv) > 1 else 60
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["amp_fp16", "compile_fp16"]
cfg = dict(ta.WORKLOADS["convnet"], width=width)
for mode in modes:
    for infer in (False, True):
        ta.run(f"convnet-w{width}", cfg, mode, 30, 8, infer)
        torch.cuda.empty_cache()
