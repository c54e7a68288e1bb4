#!/usr/bin/env python3
"""PyTorch DistributedDataParallel peer of the multi-GPU bench (`bench --replicas N`):
torch_anchor.py's workloads (`mlp`, `transformer`, `convnet`: the same models, data,
loss, SGD-momentum optimizer, modes and GradScaler), and `gpt2` (Hugging Face's
GPT-2 124M, SDPA attention, batch 16 x 1024 random tokens, its own next-token loss,
fused AdamW lr 3e-4 and decay 0.01, as the bench's zoo GPT-2 and
../shared/bench/gpt2/torch_gpt2_train.py), trained data-parallel over N GPUs of one
host, timed as torch_anchor.py times a train step.

    torchrun --standalone --nproc-per-node N scripts/torch_ddp.py --workload transformer \
        --mode amp_fp16 --steps 30 --warmup 10 [--sync-bn] [--compile] [--out FILE]
    torchrun --standalone --nproc-per-node 1 scripts/torch_ddp.py ... --no-ddp

Weak scaling: every rank trains on the workload's own batch (N GPUs process N x batch a
step) of random tensors as torch_anchor.py makes them, seeded with the rank (rank 0's
data are torch_anchor.py's). The model is wrapped in DDP even with N = 1, so the 1-GPU
run is DDP's own baseline; `--no-ddp` (N = 1 only) times the plain model for reference.
DDP: default bucket_cap_mb (25), gradient_as_bucket_view=True, static_graph not set.
`--sync-bn` converts BatchNorm to SyncBatchNorm before DDP (convnet; no-op elsewhere).
`--compile` adds a run in mode "compile_fp16": torch.compile(model) wrapped by DDP (or,
with `--compile-outer`, torch.compile(DDP(model)), PyTorch's documented order, whose
DDPOptimizer splits the graph at the buckets); a failed compile is reported in the
JSON line, not raised.

Timing: `--warmup` steps, then `--steps` steps each between two CUDA events and
synchronised; each rank takes its median (torch_anchor.py's: the upper median), and
rank 0 reports the largest over the ranks (all_reduce MAX), the smallest min and the
largest max, examples/s = N * batch / median (sequences for the transformer, plus
tokens/s = N * batch * seq / median) and the largest peak of
torch.cuda.max_memory_allocated. Rank 0 prints one JSON line per run and appends it
to `--out FILE`.

Environment (enforced here, before torch is imported): NVLink multicast (NVLS) must
stay off on the GPU machines. The script refuses to run when NCCL_NVLS_ENABLE is set to
anything but "0", or TORCH_SYMM_MEM_DISABLE_MULTICAST / NVSHMEM_DISABLE_NVLS to
anything but "1"; where unset it sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1.

torch_anchor.py is imported from `--anchor-dir DIR` (default ../shared/bench beside
the repository), else from this script's folder (bundle/ holds a copy).
"""
import os
import sys

# --- NVLink multicast off: checked and set before torch (and torch.distributed) loads.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in MULTICAST_OFF.items():
    if _k in os.environ and os.environ[_k].strip() != _v:
        sys.exit(f"torch_ddp.py: refusing to run with {_k}={os.environ[_k]!r}: NVLink multicast "
                 f"must stay off on this machine (unset it or set {_k}={_v})")
    os.environ[_k] = _v
assert "torch" not in sys.modules, "torch was imported before the multicast variables were set"

import argparse
import json
from datetime import timedelta
from pathlib import Path

MODES = ("fp32", "tf32", "amp_fp16", "amp_bf16", "compile_fp16")


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="transformer", help="mlp, transformer, convnet, gpt2 (comma list)")
    ap.add_argument("--mode", default="amp_fp16", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (before DDP)")
    ap.add_argument("--no-ddp", action="store_true", help="the plain model, no DDP (world 1 only)")
    ap.add_argument("--compile", action="store_true", help="also run compile_fp16")
    ap.add_argument("--compile-outer", action="store_true",
                    help="compile_fp16 as torch.compile(DDP(model)) instead of DDP(torch.compile(model))")
    ap.add_argument("--out", help="append the JSON lines to this file (rank 0)")
    ap.add_argument("--anchor-dir", help="folder of torch_anchor.py")
    ap.add_argument("--timeout-s", type=int, default=300, help="process group timeout")
    a = ap.parse_args()
    modes = [m for m in a.mode.split(",") if m]
    if a.compile and "compile_fp16" not in modes:
        modes.append("compile_fp16")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {MODES}")
    a.modes = modes
    a.workloads = [w for w in a.workload.split(",") if w]
    return a


def import_anchor(anchor_dir):
    here = Path(__file__).resolve()
    default = here.parents[2] / "shared" / "bench"
    candidates = [Path(anchor_dir) if anchor_dir else default, here.parent]
    for d in candidates:
        if (d / "torch_anchor.py").is_file():
            sys.path.insert(0, str(d))
            import torch_anchor
            return torch_anchor
    sys.exit(f"torch_ddp.py: torch_anchor.py not found in {[str(d) for d in candidates]}")


args = parse()
ta = import_anchor(args.anchor_dir)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# torchrun sets these; a plain `python3 torch_ddp.py` runs as a world of one.
for _k, _v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
               ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
    os.environ.setdefault(_k, _v)


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


# GPT-2 124M as the bench's `--workload gpt2` trains it (batch and sequence per GPU).
GPT2 = dict(kind="gpt2", batch=16, seq=1024)


def workload(name):
    """The workload's config: torch_anchor.py's, or GPT2 (None if unknown)."""
    return GPT2 if name == "gpt2" else ta.WORKLOADS.get(name)


def build_gpt2(dev):
    """Hugging Face's GPT-2 124M with random tokens: (model, tokens, None)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(use_cache=False, attn_implementation="sdpa")).to(dev)
    x = torch.randint(0, m.config.vocab_size, (GPT2["batch"], GPT2["seq"]), device=dev)
    return m, x, None


def run(name, mode, rank, world, dev):
    """One timed run on this rank: its local stats (raises on failure)."""
    cfg = workload(name)
    compiled = mode == "compile_fp16"
    torch.manual_seed(rank)  # per-rank data; DDP broadcasts rank 0's weights
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.benchmark = True
    gpt2 = cfg["kind"] == "gpt2"
    m, x, y = build_gpt2(dev) if gpt2 else ta.build(cfg, dev)
    if cfg["kind"] == "convnet" and mode != "fp32":
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    raw = m
    if args.sync_bn:
        m = torch.nn.SyncBatchNorm.convert_sync_batchnorm(m)
    if gpt2:
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    amp_dtype = {"amp_fp16": torch.float16, "amp_bf16": torch.bfloat16, "compile_fp16": torch.float16}.get(mode)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    if compiled and not args.compile_outer:
        m = torch.compile(m)
    if not args.no_ddp:
        m = DDP(m, device_ids=[dev.index], output_device=dev.index, gradient_as_bucket_view=True)
    ddp = m
    if compiled and args.compile_outer:
        m = torch.compile(m)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            if gpt2:
                loss = m(x, labels=x).loss
            else:
                out = m(x)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); loss = step(); b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    # GPT-2: 6 FLOPs per parameter and token (the attention's left out).
    fl = (6 * sum(p.numel() for p in raw.parameters()) * cfg["batch"] * cfg["seq"]
          if gpt2 else ta.flops_train(cfg, raw))
    cap = getattr(ddp, "bucket_bytes_cap", None)
    return dict(median=times[len(times) // 2], min=times[0], max=times[-1],
                peak=torch.cuda.max_memory_allocated() / 2**20, loss=float(loss.item()),
                flops=fl, bucket_cap_mb=round(cap / 2**20, 3) if cap else None)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s), device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.no_ddp and world != 1:
        if rank == 0:
            print("torch_ddp.py: --no-ddp is the one-GPU reference: run it with --nproc-per-node 1",
                  file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    if rank == 0:
        print(f"# torch {torch.__version__} on {world} x {torch.cuda.get_device_name()}, "
              f"NCCL {nccl_version()}, anchor {ta.__file__}", flush=True)
    failed = 0
    for name in args.workloads:
        for mode in args.modes:
            cfg, st, err = workload(name), None, None
            try:
                if cfg is None:
                    raise ValueError(f"unknown workload {name!r}; known: {list(ta.WORKLOADS) + ['gpt2']}")
                st = run(name, mode, rank, world, dev)
            except Exception as e:  # a failed run (compile above all) goes into its JSON line
                err = f"{type(e).__name__}: {e}"[:600]
            # which ranks failed, agreed on before any collective over the stats
            bad = torch.zeros(world, device=dev)
            bad[rank] = float(err is not None)
            dist.all_reduce(bad)
            rec = dict(peer="pytorch_ddp", workload=name, mode=mode, world=world,
                       per_gpu_batch=cfg["batch"] if cfg else None)
            if bad.any():
                failed += 1
                rec["error"] = err or f"failed on rank(s) {bad.nonzero().flatten().tolist()}"
            else:
                v = torch.tensor([st["median"], -st["min"], st["max"], st["peak"]], device=dev, dtype=torch.float64)
                dist.all_reduce(v, op=dist.ReduceOp.MAX)
                each = torch.zeros(world, 2, device=dev, dtype=torch.float64)  # per-rank median, loss
                each[rank] = torch.tensor([st["median"], st["loss"]], dtype=torch.float64)
                dist.all_reduce(each)
                med = v[0].item()
                rec.update(median_ms=round(med, 3), min_ms=round(-v[1].item(), 3), max_ms=round(v[2].item(), 3),
                           examples_per_s=round(world * cfg["batch"] / (med / 1000), 1))
                if cfg["kind"] in ("transformer", "gpt2"):
                    rec["tokens_per_s"] = round(world * cfg["batch"] * cfg["seq"] / (med / 1000), 1)
                rec.update(peak_mib=round(v[3].item(), 1),
                           rank_median_ms=[round(t, 3) for t in each[:, 0].tolist()],
                           tflops_per_gpu=round(st["flops"] / med / 1e9, 1) if st["flops"] else None,
                           loss=round(each[:, 1].mean().item(), 4))
            ddp = not args.no_ddp
            rec.update(sync_bn=args.sync_bn, ddp=ddp,
                       bucket_cap_mb=((st or {}).get("bucket_cap_mb") or 25) if ddp else None,
                       gradient_as_bucket_view=ddp, static_graph=False if ddp else None,
                       steps=args.steps, warmup=args.warmup)
            if mode == "compile_fp16":
                rec["compile_wrap"] = ("torch.compile(DDP(model))" if args.compile_outer else
                                       "DDP(torch.compile(model))") if ddp else "torch.compile(model)"
            rec.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       nccl=nccl_version(),
                       multicast_env={k: os.environ[k] for k in MULTICAST_OFF})
            if rank == 0:
                line = json.dumps(rec)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
            del st
            if mode == "compile_fp16":
                from torch import _dynamo
                _dynamo.reset()
            torch.cuda.empty_cache()
            dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
