#!/usr/bin/env python3
"""Run an ONNX model in onnxruntime (CPU) on a backend-test data set and
compare against the stored outputs.

    ort_run.py MODEL.onnx --data DIR [--rtol R] [--atol A]
    ort_run.py MODEL.onnx --data DIR --save-outputs DIR2

DIR holds input_K.pb (TensorProto), fed by the model's input order K=0,1,..,
and output_K.pb, compared with the model's K-th output. An output passes when
every element has |got - want| <= atol + rtol * |want| (both cast to float64;
NaN matches NaN, inf matches the same inf) and the shapes agree.

One line per output is printed. Exit status:
    0  every output within tolerance (or, with --save-outputs, outputs written)
    1  some output out of tolerance, or of the wrong shape, or missing
    2  onnxruntime refused to load or run the model, or the inputs could not
       be read (a one-line error is printed)
"""

import argparse
import glob
import os
import re
import sys

import numpy as np


def one_line(e):
    s = " ".join(str(e).split())
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


def numbered(d, prefix):
    """{K: path} for DIR/prefix_K.pb."""
    out = {}
    for p in glob.glob(os.path.join(d, f"{prefix}_*.pb")):
        m = re.fullmatch(prefix + r"_(\d+)\.pb", os.path.basename(p))
        if m:
            out[int(m.group(1))] = p
    return out


def read_tensor(path):
    from onnx import TensorProto, numpy_helper

    t = TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def write_tensor(path, arr, name):
    from onnx import numpy_helper

    with open(path, "wb") as f:
        f.write(numpy_helper.from_array(np.asarray(arr), name).SerializeToString())


def compare(got, want, rtol, atol):
    """(ok, max_abs, max_rel, note)"""
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if g.shape != w.shape:
        return False, float("nan"), float("nan"), f"shape {g.shape} != expected {w.shape}"
    if g.size == 0:
        return True, 0.0, 0.0, ""
    both_nan = np.isnan(g) & np.isnan(w)
    same_inf = np.isinf(g) & np.isinf(w) & (np.sign(g) == np.sign(w))
    matched = both_nan | same_inf
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(matched, 0.0, np.abs(g - w))  # nan where only one side is nan/inf
        rel = np.where(matched, 0.0, diff / np.maximum(np.abs(w), np.finfo(np.float64).tiny))
        bad = ~(diff <= atol + rtol * np.abs(w))  # nan compares false -> bad
    bad &= ~matched
    max_abs = float(np.nanmax(diff)) if not np.all(np.isnan(diff)) else float("nan")
    max_rel = float(np.nanmax(rel)) if not np.all(np.isnan(rel)) else float("nan")
    note = ""
    if np.isnan(diff).any():
        note = f"{int(np.isnan(diff).sum())} nan/inf mismatches"
    if bad.any() and not note:
        idx = np.unravel_index(int(np.argmax(np.where(bad, diff, -1.0))), g.shape)
        note = f"{int(bad.sum())}/{g.size} elements out of tolerance, worst at {tuple(int(i) for i in idx)}"
    return not bad.any(), max_abs, max_rel, note


def main():
    ap = argparse.ArgumentParser(description="Run MODEL in onnxruntime CPU and check it against DIR/output_K.pb.")
    ap.add_argument("model")
    ap.add_argument("--data", required=True, help="directory with input_K.pb (and output_K.pb)")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--save-outputs", metavar="DIR2", help="write ORT's outputs as DIR2/output_K.pb; no comparison")
    ap.add_argument("--optimize", action="store_true", help="leave ORT graph optimizations on (default: off)")
    args = ap.parse_args()

    try:
        import onnxruntime as ort

        ins = numbered(args.data, "input")
        so = ort.SessionOptions()
        # One thread, as make_models.py computed the stored outputs: a parallel
        # reduction's order (and so its rounding) depends on the thread count.
        so.intra_op_num_threads = 1
        if not args.optimize:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
        model_inputs = sess.get_inputs()
        if sorted(ins) != list(range(len(model_inputs))):
            raise ValueError(
                f"model has {len(model_inputs)} inputs but {args.data} has input files {sorted(ins)}"
            )
        feeds = {mi.name: read_tensor(ins[k]) for k, mi in enumerate(model_inputs)}
        model_outputs = sess.get_outputs()
        names = [o.name for o in model_outputs]
        results = sess.run(names, feeds)
    except Exception as e:  # noqa: BLE001 - any failure to produce outputs is exit 2
        print(f"error: {one_line(e)}")
        return 2

    if args.save_outputs:
        os.makedirs(args.save_outputs, exist_ok=True)
        for k, (n, arr) in enumerate(zip(names, results)):
            p = os.path.join(args.save_outputs, f"output_{k}.pb")
            write_tensor(p, arr, n)
            arr = np.asarray(arr)
            print(f"output {k} {n!r} dtype={arr.dtype} shape={list(arr.shape)} -> {p}")
        return 0

    outs = numbered(args.data, "output")
    all_ok = True
    for k, (n, arr) in enumerate(zip(names, results)):
        arr = np.asarray(arr)
        head = f"output {k} {n!r} dtype={arr.dtype} shape={list(arr.shape)}"
        if k not in outs:
            print(f"{head} FAIL: no output_{k}.pb in {args.data}")
            all_ok = False
            continue
        try:
            want = read_tensor(outs[k])
        except Exception as e:  # noqa: BLE001
            print(f"{head} FAIL: cannot read {outs[k]}: {one_line(e)}")
            all_ok = False
            continue
        ok, max_abs, max_rel, note = compare(arr, want, args.rtol, args.atol)
        all_ok &= ok
        line = f"{head} max_abs={max_abs:.3e} max_rel={max_rel:.3e} {'OK' if ok else 'FAIL'}"
        print(line + (f" ({note})" if note else ""))
    extra = sorted(set(outs) - set(range(len(names))))
    if extra:
        print(f"FAIL: {args.data} has output files {extra} beyond the model's {len(names)} outputs")
        all_ok = False
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
