#!/usr/bin/env python3
"""A learnable token stream in llm.c's format for the GPT-2 convergence checks
(gpu_convergence.sh, gpu_fp8.sh): a random walk over 512 tokens, each the last plus one
of -3..=3 (the best loss is ln 7 = 1.95), written as DIR/train.bin (4M tokens) and
DIR/val.bin (200k). Usage: python3 walk_tokens.py [DIR] (default /tmp/walk)."""
import os
import sys

import numpy as np

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/walk"
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
for name, n in (("train", 4_000_000), ("val", 200_000)):
    header = np.zeros(256, np.int32)
    header[:3] = (20240520, 1, n)
    tokens = (np.cumsum(rng.integers(-3, 4, n)) % 512).astype(np.uint16)
    with open(os.path.join(out, f"{name}.bin"), "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
