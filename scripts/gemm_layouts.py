#!/usr/bin/env python3
"""Times the mlp workload's GEMMs in both weight layouts with PyTorch's cuBLAS, to tell
a layout effect from an executor one: ampgraph keeps weights [in, out] (TensorFlow's
convention), PyTorch [out, in]. Prints ms per product (CUDA events, median of 50).

    python3 gemm_layouts.py
"""
import torch


def ms(f, reps=1, samples=50, warmup=5):
    """Median ms of one `f()` (CUDA events around `reps` back-to-back runs, `samples`
    times, after `warmup` runs); gemm_fp8_shapes.py times with it too."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(samples):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            f()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    return sorted(times)[len(times) // 2]


def main():
    m, k, n = 8192, 4096, 4096
    for dtype, tf32 in [(torch.float16, False), (torch.float32, True)]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        w_in_out = torch.randn(k, n, device="cuda", dtype=dtype)
        w_out_in = w_in_out.t().contiguous()
        name = "tf32" if tf32 else str(dtype).split(".")[1]
        rows = {
            "forward x@W, W[in,out] (ours)": lambda: x @ w_in_out,
            "forward x@W^T, W[out,in] (torch)": lambda: x @ w_out_in.t(),
            "dgrad dy@W^T, W[in,out] (ours)": lambda: dy @ w_in_out.t(),
            "dgrad dy@W, W[out,in] (torch)": lambda: dy @ w_out_in,
            "wgrad x^T@dy -> [in,out] (ours)": lambda: x.t() @ dy,
            "wgrad dy^T@x -> [out,in] (torch)": lambda: dy.t() @ x,
        }
        for what, f in rows.items():
            print(f"{name:8} {what:36} {ms(f):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
