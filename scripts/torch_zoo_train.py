#!/usr/bin/env python3
"""PyTorch's training step on the zoo's models, beside `bench --workload W` (issue 43's
anchors, the same sizes and random data): torchvision's ResNet-50 (AMP fp16,
channels_last, cudnn.benchmark, SGD momentum) and ViT-B/16 (AMP fp16, AdamW), Hugging
Face's BERT-base masked LM (bf16 autocast, fused AdamW) and GPT-2 124M (bf16, fused
AdamW; ../shared/bench/gpt2/torch_gpt2_train.py's step), each eager and
torch.compile'd. One JSON line per model and mode: median ms of 20 steps after 6,
examples or tokens per second, peak MiB.

    python3 scripts/torch_zoo_train.py [--only resnet50,vit_b_16,bert_base,gpt2] [--no-compile]
        [--dropout P [--attention-dropout Q]]

Without --dropout, BERT and GPT-2 keep Hugging Face's configs (dropout 0.1 on the
embeddings, each sublayer's output and attention's probabilities: the issue's anchors);
with it, the embeddings and sublayers drop P and attention's probabilities Q (default
0), as `bench --workload gpt2|bert_base --dropout P --attention-dropout Q` builds them.
"""
import argparse
import json

import torch


def models(dropout, attention_dropout):
    import torchvision.models as tvm
    # Hugging Face's defaults unless a rate is given.
    gpt2_drop = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout,
                                                attn_pdrop=attention_dropout)
    bert_drop = {} if dropout is None else dict(hidden_dropout_prob=dropout,
                                                attention_probs_dropout_prob=attention_dropout)
    out = {}
    img = lambda b: (torch.randn(b, 3, 224, 224), torch.randint(0, 1000, (b,)))  # noqa: E731
    out["resnet50"] = (lambda: tvm.resnet50(), img, 256, torch.float16, "sgd", True)
    out["vit_b_16"] = (lambda: tvm.vit_b_16(), img, 32, torch.float16, "adamw", False)

    def bert():
        from transformers import BertConfig, BertForMaskedLM
        return BertForMaskedLM(BertConfig(attn_implementation="sdpa", **bert_drop))

    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(use_cache=False, attn_implementation="sdpa",
                                          **gpt2_drop))

    tokens = lambda vocab, t: lambda b: (torch.randint(0, vocab, (b, t)),) * 2  # noqa: E731
    out["bert_base"] = (bert, tokens(30522, 128), 32, torch.bfloat16, "adamw", False)
    out["gpt2"] = (gpt2, tokens(50257, 1024), 16, torch.bfloat16, "adamw", False)
    return out


def time_steps(step, warm=6, iters=20):
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], float(loss)


def profile(step, steps, title):
    """Per-kernel CUDA time per step (torch.profiler), the 40 costliest."""
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"# profile: {title}, us per step")
    rows = [(e.device_time_total / steps, e.count / steps, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(reverse=True)
    print(f"# total {sum(r[0] for r in rows) / 1000:.3f} ms")
    for us, n, key in rows[:40]:
        print(f"{us:10.1f} {n:6.1f}  {key[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--dropout", type=float)
    ap.add_argument("--attention-dropout", type=float, default=0.0)
    ap.add_argument("--profile", type=int, metavar="STEPS",
                    help="after timing, print the CUDA kernels' times over STEPS steps")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    for name, (make, data, batch, dtype, opt_name, channels_last) in models(a.dropout, a.attention_dropout).items():
        if a.only and name not in a.only.split(","):
            continue
        for mode in ["eager"] + ([] if a.no_compile else ["compile"]):
            torch.manual_seed(0)
            m = make().cuda().train()
            inputs = [t.cuda() for t in data(batch)]
            if channels_last:
                m = m.to(memory_format=torch.channels_last)
                inputs[0] = inputs[0].contiguous(memory_format=torch.channels_last)
            if opt_name == "sgd":
                opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
            scaler = torch.amp.GradScaler(enabled=dtype == torch.float16)
            f = torch.compile(m) if mode == "compile" else m

            def step():
                with torch.autocast("cuda", dtype):
                    if name in ("bert_base", "gpt2"):
                        loss = f(inputs[0], labels=inputs[1]).loss
                    else:
                        loss = torch.nn.functional.cross_entropy(f(inputs[0]), inputs[1])
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                return loss

            try:
                ms, loss = time_steps(step)
                per = batch * (inputs[0].shape[1] if name in ("bert_base", "gpt2") else 1)
                print(json.dumps({
                    "peer": f"torch {mode}", "model": name, "batch": batch, "dtype": str(dtype),
                    "dropout": a.dropout, "attention_dropout": a.attention_dropout,
                    "ms": round(ms, 2), "per_s": round(per / ms * 1000),
                    "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20), "loss": loss,
                }), flush=True)
                if a.profile:
                    profile(step, a.profile, f"torch {mode} {name}")
            except Exception as e:  # one model's failure is a line, not the end
                print(json.dumps({"peer": f"torch {mode}", "model": name,
                                  "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
            del m, opt, f
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
