#!/usr/bin/env python3
"""Write an ONNX model (opset 19) casting float32 to FLOAT8E4M3FN and to FLOAT8E5M2
(saturating, ONNX's default) and back, with inputs that test the rounding (every
midpoint between neighbouring values of both formats, the values a float32 ulp
either side of each, values past the largest, infinities, NaN, signed zeros and
seeded random float32 bits) and onnxruntime's outputs:

    fp8_cast.py OUT_DIR    ->  OUT_DIR/model.onnx, OUT_DIR/test_data_set_0/*.pb
"""

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def fp8_values(e_bits, m_bits, bias, finite_max):
    """Every non-negative finite value of a format (no NaN codes)."""
    out = []
    for code in range(1 << (e_bits + m_bits)):
        e, m = code >> m_bits, code & ((1 << m_bits) - 1)
        v = (m / (1 << m_bits)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << m_bits)) * 2.0 ** (e - bias)
        if v <= finite_max:
            out.append(v)
    return sorted(set(out))


def inputs():
    xs = []
    for vals in (fp8_values(4, 3, 7, 448.0), fp8_values(5, 2, 15, 57344.0)):
        v = np.array(vals, dtype=np.float32)
        mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
        xs += [v, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))]
    xs.append(np.array([449.0, 464.0, 480.0, 1e6, 57344.0, 61440.0, 1e30, np.inf, np.nan, 0.0],
                       dtype=np.float32))
    rng = np.random.default_rng(8)
    bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    xs.append(bits.view(np.float32))
    x = np.concatenate(xs).astype(np.float32)
    return np.concatenate([x, -x])


def main():
    out = sys.argv[1]
    x = inputs()
    n = x.size
    nodes = [
        helper.make_node("Cast", ["x"], ["e4m3"], to=TensorProto.FLOAT8E4M3FN),
        helper.make_node("Cast", ["e4m3"], ["y_e4m3"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x"], ["e5m2"], to=TensorProto.FLOAT8E5M2),
        helper.make_node("Cast", ["e5m2"], ["y_e5m2"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "fp8_cast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [n]) for y in ("y_e4m3", "y_e5m2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    os.makedirs(os.path.join(out, "test_data_set_0"), exist_ok=True)
    onnx.save(model, os.path.join(out, "model.onnx"))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ys = sess.run(None, {"x": x})
    data = os.path.join(out, "test_data_set_0")
    with open(os.path.join(data, "input_0.pb"), "wb") as f:
        f.write(numpy_helper.from_array(x, "x").SerializeToString())
    for k, (name, y) in enumerate(zip(("y_e4m3", "y_e5m2"), ys)):
        with open(os.path.join(data, f"output_{k}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(y, name).SerializeToString())
    print(f"{n} values, onnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
