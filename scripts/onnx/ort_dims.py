#!/usr/bin/env python3
"""Run a model and its rewritten export in onnxruntime (CPU) at other values of
the model's symbolic dims, on the same random inputs, and compare the outputs.

    ort_dims.py ORIGINAL.onnx EXPORTED.onnx --dims batch=3,seq=7 [--tol T]

Each input of ORIGINAL gets its declared dims with the symbolic ones from
--dims (a symbolic dim --dims does not name is an error); float inputs are
standard normal, integer inputs in [0, 8), seeded. An output passes when
max|got - want| <= T * max|want| (T = 1e-2 by default: the fp16 bound).

One line per output is printed. Exit status:
    0  every output within tolerance and of the original's shape
    1  some output out of tolerance or of another shape
    2  onnxruntime refused to load or run a model, or the arguments were bad
"""

import argparse
import sys

import numpy as np

from ort_run import one_line  # this script's folder heads sys.path


def session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def feeds_for(sess, dims, rng):
    feeds = {}
    for i in sess.get_inputs():
        shape = []
        for d in i.shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in dims:
                shape.append(dims[d])
            else:
                raise ValueError(f"input '{i.name}': --dims does not give its dim '{d}'")
        if "float" in i.type:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            feeds[i.name] = rng.integers(0, 8, size=shape).astype(np.int64)
    return feeds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("original")
    ap.add_argument("exported")
    ap.add_argument("--dims", required=True, help="NAME=VALUE,... for the symbolic dims")
    ap.add_argument("--tol", type=float, default=1e-2)
    args = ap.parse_args()
    try:
        dims = {k: int(v) for k, v in (p.split("=") for p in args.dims.split(","))}
        ours, theirs = session(args.exported), session(args.original)
        feeds = feeds_for(theirs, dims, np.random.default_rng(0))
        want = theirs.run(None, feeds)
        got = ours.run(None, {i.name: feeds[i.name] for i in ours.get_inputs()})
    except Exception as e:  # noqa: BLE001 - one line for whatever refused
        print(f"error: {one_line(e)}")
        return 2
    ok = True
    for o, g, w in zip(theirs.get_outputs(), got, want):
        if g.shape != w.shape:
            print(f"{o.name}: shape {list(g.shape)}, want {list(w.shape)}")
            ok = False
            continue
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        err = np.max(np.abs(g64 - w64)) / max(np.max(np.abs(w64)), 1e-30) if w.size else 0.0
        good = err <= args.tol
        ok &= bool(good)
        print(f"{o.name}: shape {list(g.shape)}, relative error {err:.2e}{'' if good else ' FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
