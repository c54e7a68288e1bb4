#!/usr/bin/env python3
"""Reference for fp16 conversion: what onnxconverter-common does to each test model.

For every model directory under tests/data/onnx (bad/ excluded) this runs

    onnxconverter_common.float16.convert_float_to_float16(model, keep_io_types=True)

counts the Cast nodes in the result, loads and runs the converted model in
onnxruntime (CPU) on test_data_set_0's inputs, and compares with the stored
fp32 outputs. It prints a Markdown table; --json FILE also writes the rows.

Error columns, per output and then the worst over outputs:
    max_abs  = max |fp16 - fp32|
    rel      = max |fp16 - fp32| / max |fp32|   (normwise; no blow-up near zero)

    python3 scripts/onnx/convert_reference.py [--dir DIR] [--json out.json]
"""

import argparse
import glob
import json
import os
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxconverter_common import float16

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(REPO, "tests", "data", "onnx")


def one_line(e):
    s = " ".join(str(e).split())
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


def read_tensor(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def numbered(d, prefix):
    n = 0
    out = []
    while os.path.exists(os.path.join(d, f"{prefix}_{n}.pb")):
        out.append(read_tensor(os.path.join(d, f"{prefix}_{n}.pb")))
        n += 1
    return out


def count_op(model, op):
    def walk(g):
        c = 0
        for node in g.node:
            c += node.op_type == op
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    c += walk(a.g)
                for sg in a.graphs:
                    c += walk(sg)
        return c

    return walk(model.graph)


def convert_one(model_dir):
    name = os.path.basename(model_dir.rstrip("/"))
    row = {"model": name, "casts_before": None, "casts": None, "nodes": None,
           "loads": False, "max_abs": None, "rel": None, "per_output": [], "error": None}
    data = os.path.join(model_dir, "test_data_set_0")
    try:
        m = onnx.load(os.path.join(model_dir, "model.onnx"))  # pulls in external data
        row["casts_before"] = count_op(m, "Cast")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m16 = float16.convert_float_to_float16(m, keep_io_types=True)
        row["casts"] = count_op(m16, "Cast")
        row["nodes"] = len(m16.graph.node)
    except Exception as e:  # noqa: BLE001
        row["error"] = "convert: " + one_line(e)
        return row
    try:
        sess = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"])
        row["loads"] = True
        inputs = numbered(data, "input")
        feeds = {i.name: a for i, a in zip(sess.get_inputs(), inputs)}
        names = [o.name for o in sess.get_outputs()]
        got = sess.run(names, feeds)
    except Exception as e:  # noqa: BLE001
        row["error"] = "ort: " + one_line(e)
        return row
    want = numbered(data, "output")
    worst_abs, worst_rel = 0.0, 0.0
    for n, g, w in zip(names, got, want):
        g64 = np.asarray(g).astype(np.float64)
        w64 = np.asarray(w).astype(np.float64)
        if g64.shape != w64.shape:
            row["error"] = f"output {n!r}: shape {g64.shape} != {w64.shape}"
            return row
        ma = float(np.max(np.abs(g64 - w64))) if g64.size else 0.0
        scale = float(np.max(np.abs(w64))) if w64.size else 0.0
        rel = ma / scale if scale > 0 else ma
        row["per_output"].append({"name": n, "dtype": str(np.asarray(g).dtype), "max_abs": ma, "rel": rel})
        worst_abs, worst_rel = max(worst_abs, ma), max(worst_rel, rel)
    row["max_abs"], row["rel"] = worst_abs, worst_rel
    return row


def table(rows):
    lines = [
        "| model | casts (before → after) | nodes after | loads in ORT? | max rel error (max abs) / error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        casts = "—" if r["casts"] is None else f"{r['casts_before']} → {r['casts']}"
        nodes = "—" if r["nodes"] is None else str(r["nodes"])
        loads = "yes" if r["loads"] else "no"
        if r["error"]:
            res = r["error"].replace("|", "\\|")
        else:
            res = f"{r['rel']:.2e} ({r['max_abs']:.2e})"
        lines.append(f"| {r['model']} | {casts} | {nodes} | {loads} | {res} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="fp16-convert every test model with onnxconverter-common and check it in ORT")
    ap.add_argument("--dir", default=DEFAULT_DIR, help="models directory (default: tests/data/onnx)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()

    dirs = sorted(
        d for d in glob.glob(os.path.join(args.dir, "*"))
        if os.path.isdir(d) and os.path.basename(d) != "bad" and os.path.exists(os.path.join(d, "model.onnx"))
    )
    rows = [convert_one(d) for d in dirs]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
