"""cuDNN's SDPA (bf16 and FP8, forward and backward, full or causal, BSHD) at the transformer's and
GPT-2's attention shapes, timed with CUDA events, to compare with our attention kernels
(the fifty-fourth session: docs/benchmark-history.md). Needs cudnn-frontend's wheel, which
the GPU machine lacks: `pip download --no-deps nvidia-cudnn-frontend --python-version 3.12
--platform manylinux_2_28_x86_64 --only-binary=:all: -d DIR` here, carried; there
`pip install --no-index --no-deps --target /tmp/fe DIR/*.whl`, then with torch's cuDNN on
LD_LIBRARY_PATH (site-packages/nvidia/cudnn/lib) `PYTHONPATH=/tmp/fe python3 cudnn_sdpa_probe.py`."""
import math
import torch
import cudnn

print("cudnn backend", cudnn.backend_version(), "frontend", getattr(cudnn, "__version__", "?"))
dev = "cuda"
F32 = cudnn.data_type.FLOAT


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(3):
        a.record()
        for _ in range(reps):
            fn()
        b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1000)
    return best


def build(graph):
    graph.validate(); graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support(); graph.build_plans()
    return torch.empty(graph.get_workspace_size(), device=dev, dtype=torch.uint8)


def probe(b, s, h, d, fp8, causal):
    shape, stride = (b, h, s, d), (s * h * d, d, h * d, 1)
    io = cudnn.data_type.FP8_E4M3 if fp8 else cudnn.data_type.BFLOAT16
    tdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    mk = lambda: torch.randn(b, s, h, d, device=dev).mul(0.5).to(tdt).as_strided(shape, stride)
    q, k, v, o, do = mk(), mk(), mk(), mk(), mk()
    stats = torch.empty(b, h, s, 1, device=dev, dtype=torch.float32)
    scale = 1 / math.sqrt(d)
    one = torch.ones(1, 1, 1, 1, device=dev, dtype=torch.float32)
    amax = [torch.empty(1, 1, 1, 1, device=dev, dtype=torch.float32) for _ in range(4)]
    # forward
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=F32, compute_data_type=F32)
    tq, tk, tv = (g.tensor(name=n, dim=shape, stride=stride, data_type=io) for n in "qkv")
    sc = lambda n: g.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=F32)
    pack = {tq: q, tk: k, tv: v}
    if fp8:
        names = ["dq", "dk", "dv", "ds", "ss", "so"]
        ts = [sc(n) for n in names]
        to, tst, tas, tao = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=ts[0], descale_k=ts[1], descale_v=ts[2],
                                       descale_s=ts[3], scale_s=ts[4], scale_o=ts[5], is_inference=False,
                                       attn_scale=scale, use_causal_mask=causal)
        for t in ts: pack[t] = one
        for t, a in zip((tas, tao), amax): t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(F32); pack[t] = a
    else:
        to, tst = g.sdpa(q=tq, k=tk, v=tv, is_inference=False, attn_scale=scale, use_causal_mask=causal)
    to.set_output(True).set_dim(shape).set_stride(stride).set_data_type(io)
    tst.set_output(True).set_dim((b, h, s, 1)).set_stride((h * s, s, 1, 1)).set_data_type(F32)
    pack[to], pack[tst] = o, stats
    ws = build(g)
    fwd = timed(lambda: g.execute(pack, ws))
    # backward
    g2 = cudnn.pygraph(io_data_type=io, intermediate_data_type=F32, compute_data_type=F32)
    t = {n: g2.tensor(name=n, dim=shape, stride=stride, data_type=io) for n in ("q", "k", "v", "o", "dO")}
    tst2 = g2.tensor(name="stats", dim=(b, h, s, 1), stride=(h * s, s, 1, 1), data_type=F32)
    pack2 = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o, t["dO"]: do, tst2: stats}
    grads = [torch.empty_strided(shape, stride, device=dev, dtype=tdt) for _ in range(3)]
    if fp8:
        sc2 = lambda n: g2.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=F32)
        names = ["descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                 "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"]
        ts = {n: sc2(n) for n in names}
        outs = g2.sdpa_fp8_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=tst2,
                                    **ts, attn_scale=scale, use_causal_mask=causal)
        for x in ts.values(): pack2[x] = one
        am = [torch.empty(1, 1, 1, 1, device=dev, dtype=torch.float32) for _ in range(4)]
        for x, a in zip(outs[3:], am): x.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(F32); pack2[x] = a
        dq, dk, dv = outs[:3]
    else:
        dq, dk, dv = g2.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=tst2,
                                      attn_scale=scale, use_causal_mask=causal)
    for x, y in zip((dq, dk, dv), grads):
        x.set_output(True).set_dim(shape).set_stride(stride).set_data_type(io); pack2[x] = y
    ws2 = build(g2)
    bwd = timed(lambda: g2.execute(pack2, ws2))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    print(f"b{b} s{s} h{h} d{d} {'causal' if causal else 'full'} {'fp8 ' if fp8 else 'bf16'}: forward {fwd:.1f} us ({flops/fwd/1e6:.0f} TFLOP/s), "
          f"backward {bwd:.1f} us ({2.5*flops/bwd/1e6:.0f} TFLOP/s)", flush=True)


# The transformer's attention (full) and GPT-2's (causal), heads of 64 in bf16; FP8 takes
# heads of 128 only on Hopper, so it is timed with the heads zero-padded to 128 (the
# same bytes as bf16 heads of 64).
for (b, s, causal) in [(16, 512, False), (16, 1024, True)]:
    for (d, fp8) in ((64, False), (64, True), (128, True), (128, False)):
        try:
            probe(b, s, 12, d, fp8, causal)
        except Exception as e:
            print(f"b{b} s{s} d{d} fp8={fp8}: {type(e).__name__}: {str(e)[:300]}", flush=True)
