#!/usr/bin/env python3
"""Times the FP8 product against the bf16 one with PyTorch's cuBLASLt at the reference
workloads' GEMM shapes (issue 44): how much faster FP8 can make each product before any
cast is paid, which bounds what FP8 training can gain on a workload. `a` is [m, k] and
`b` [n, k] (K-major, as Hopper's FP8 products read both); FP8 is E4M3 x E4M3 with
per-tensor scales and a bf16 result, in fast accumulation (the forward products) and
not (the gradients' E5M2 x E4M3 products run like the latter). Prints ms per product
(CUDA events around 20 back-to-back runs, median of 15) and TFLOP/s.

    python3 gemm_fp8_shapes.py
"""
import torch

import gemm_layouts  # beside this script (in bundle/ too)

# (workload, product, m, k, n)
SHAPES = [
    ("mlp", "hidden layer", 8192, 4096, 4096),
    ("transformer", "qkv", 8192, 768, 2304),
    ("transformer", "attention out", 8192, 768, 768),
    ("transformer", "ffn up", 8192, 768, 3072),
    ("transformer", "ffn down", 8192, 3072, 768),
    ("transformer", "weight gradient", 768, 8192, 3072),
    ("gpt2", "qkv", 16384, 768, 2304),
    ("gpt2", "attention out", 16384, 768, 768),
    ("gpt2", "ffn up", 16384, 768, 3072),
    ("gpt2", "ffn down", 16384, 3072, 768),
    ("gpt2", "weight gradient", 768, 16384, 3072),
]


def ms(f):
    return gemm_layouts.ms(f, reps=20, samples=15, warmup=3)


def main():
    print("| workload | product | m x k x n | bf16 ms | fp8 ms | fp8 fast ms | bf16 TFLOP/s | fp8 fast TFLOP/s | bf16 / fp8 fast |")
    print("|---|---|---|---|---|---|---|---|---|")
    one = torch.ones((), device="cuda")
    for workload, what, m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        half = ms(lambda: a @ b.t())
        fp8 = ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16))
        fast = ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True))
        flop = 2.0 * m * k * n
        print(f"| {workload} | {what} | {m} x {k} x {n} | {half:.4f} | {fp8:.4f} | {fast:.4f} | "
              f"{flop / half / 1e9:.0f} | {flop / fast / 1e9:.0f} | {half / fast:.2f} |")


if __name__ == "__main__":
    main()
