#!/usr/bin/env python3
"""Build the small ONNX test models and bad-input fixtures under tests/data/onnx.

Each good model is written in the ONNX backend-test layout:

    tests/data/onnx/NAME/model.onnx
    tests/data/onnx/NAME/test_data_set_0/input_K.pb    (TensorProto)
    tests/data/onnx/NAME/test_data_set_0/output_K.pb   (TensorProto, from onnxruntime CPU)

The graphs are written by hand with onnx.helper but follow the shapes and
idioms that torch.onnx's TorchScript exporter (and tf2onnx) emit: weights as
initializers (not graph inputs), Constant nodes for small shape tensors, the
Shape/Gather/Unsqueeze/Concat/Reshape flatten, HardSwish as HardSigmoid*x at
opset 11, GELU as Div/Erf/Add/Mul/Mul, and so on.

Everything is deterministic: numpy is seeded per model, onnxruntime runs with
one thread and graph optimizations off. Running the script twice gives
byte-identical files.

Run it as a script, from any directory (a script's own directory, not the
cwd, heads sys.path, so the repo's onnx/ crate folder does not shadow the
`onnx` package; `python3 -c`/`-m` from the repo root would put it there):

    python3 scripts/onnx/make_models.py                # -> tests/data/onnx
    python3 scripts/onnx/make_models.py --out DIR      # elsewhere
"""

import argparse
import os
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "tests", "data", "onnx")

# IR version that exporters of the time wrote next to each opset.
IR_FOR_OPSET = {11: 6, 13: 7, 14: 7, 17: 8, 18: 8}
PRODUCER = "ampgraph-make_models"
PRODUCER_VERSION = "1"

F = TensorProto.FLOAT
I64 = TensorProto.INT64


# --------------------------------------------------------------------------
# Small graph-building helper
# --------------------------------------------------------------------------


class G:
    """Collects nodes and initializers; names tensors the way torch does
    ("/scope/Op_output_0"), so a model reads like a real export."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.nodes = []
        self.inits = []
        self.counts = {}

    def _name(self, scope, op):
        base = f"{scope}/{op}" if scope else f"/{op}"
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def op(self, op, inputs, scope="", n_out=1, outputs=None, domain=None, **attrs):
        name = self._name(scope, op)
        if outputs is None:
            outputs = [f"{name}_output_{i}" for i in range(n_out)]
        kw = {"domain": domain} if domain else {}
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, **attrs, **kw))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(self, value, scope="", dtype=None):
        """A Constant node, as torch emits for shape tensors and scalars."""
        arr = np.array(value, dtype=dtype) if dtype is not None else np.asarray(value)
        name = self._name(scope, "Constant")
        out = f"{name}_output_0"
        self.nodes.append(
            helper.make_node(
                "Constant", [], [out], name=name,
                value=numpy_helper.from_array(arr, name=""),
            )
        )
        return out

    def init(self, name, arr):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name=name))
        return name

    # random parameters -------------------------------------------------
    def weight(self, name, shape, fan_in, gain=2.0):
        w = self.rng.standard_normal(shape) * np.sqrt(gain / fan_in)
        return self.init(name, w.astype(np.float32))

    def bias(self, name, n, scale=0.1):
        return self.init(name, (self.rng.standard_normal(n) * scale).astype(np.float32))

    def conv(self, x, scope, cin, cout, k, stride=1, pad=0, group=1, bias=True, prefix=None,
             dilation=1):
        prefix = prefix or scope.strip("/").split("/")[-1]
        w = self.weight(f"{prefix}.weight", (cout, cin // group, k, k), (cin // group) * k * k)
        ins = [x, w]
        if bias:
            ins.append(self.bias(f"{prefix}.bias", cout))
        return self.op(
            "Conv", ins, scope,
            dilations=[dilation, dilation], group=group, kernel_shape=[k, k],
            pads=[pad, pad, pad, pad], strides=[stride, stride],
        )

    def batchnorm(self, x, scope, c, prefix):
        r = self.rng
        scale = self.init(f"{prefix}.weight", (1.0 + 0.1 * r.standard_normal(c)).astype(np.float32))
        b = self.init(f"{prefix}.bias", (0.1 * r.standard_normal(c)).astype(np.float32))
        mean = self.init(f"{prefix}.running_mean", (0.1 * r.standard_normal(c)).astype(np.float32))
        var = self.init(f"{prefix}.running_var", r.uniform(0.5, 1.5, c).astype(np.float32))
        return self.op(
            "BatchNormalization", [x, scale, b, mean, var], scope,
            epsilon=1e-5, momentum=0.9,
        )

    def gemm(self, x, scope, cin, cout, prefix):
        w = self.weight(f"{prefix}.weight", (cout, cin), cin, gain=1.0)
        b = self.bias(f"{prefix}.bias", cout)
        return self.op("Gemm", [x, w, b], scope, alpha=1.0, beta=1.0, transB=1)

    def model(self, name, inputs, outputs, opset, value_info=()):
        graph = helper.make_graph(
            self.nodes, name, inputs, outputs, initializer=self.inits, value_info=list(value_info)
        )
        m = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name=PRODUCER,
            producer_version=PRODUCER_VERSION,
        )
        m.ir_version = IR_FOR_OPSET[opset]
        return m


def vinfo(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def with_value_info(m):
    """Torch's exporter stores inferred shapes of intermediates in value_info."""
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    m.graph.value_info.extend(inferred.graph.value_info)
    return m


def torch_flatten(g, x, scope):
    """x.view(x.size(0), -1) / torch.flatten(x, 1) as the TorchScript exporter
    writes it: Shape -> Gather(0) -> Unsqueeze -> Concat([n, -1]) -> Reshape."""
    shape = g.op("Shape", [x], scope)
    idx = g.const(np.array(0, dtype=np.int64), scope)
    n = g.op("Gather", [shape, idx], scope, axis=0)
    axes = g.const(np.array([0], dtype=np.int64), scope)
    n1 = g.op("Unsqueeze", [n, axes], scope)  # opset 13: axes as an input
    minus1 = g.const(np.array([-1], dtype=np.int64), scope)
    shp = g.op("Concat", [n1, minus1], scope, axis=0)
    return g.op("Reshape", [x, shp], scope)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def resnet_tiny():
    """torchvision-style ResNet, 2 BasicBlocks, opset 13, dynamic batch."""
    g = G(seed=1001)
    x = "input"
    h = g.conv(x, "/conv1", 3, 8, 7, stride=2, pad=3, prefix="conv1")  # BN folded into bias
    h = g.op("Relu", [h], "/relu")
    h = g.op("MaxPool", [h], "/maxpool", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2],
             ceil_mode=0, dilations=[1, 1])

    # layer1.0: BatchNormalization kept (as with do_constant_folding=False / training export)
    s = "/layer1/layer1.0"
    idt = h
    y = g.conv(h, f"{s}/conv1", 8, 8, 3, pad=1, bias=False, prefix="layer1.0.conv1")
    y = g.batchnorm(y, f"{s}/bn1", 8, "layer1.0.bn1")
    y = g.op("Relu", [y], f"{s}/relu")
    y = g.conv(y, f"{s}/conv2", 8, 8, 3, pad=1, bias=False, prefix="layer1.0.conv2")
    y = g.batchnorm(y, f"{s}/bn2", 8, "layer1.0.bn2")
    y = g.op("Add", [y, idt], s)
    h = g.op("Relu", [y], f"{s}/relu_1")

    # layer2.0: stride 2, 1x1 strided downsample; BN folded into conv biases
    s = "/layer2/layer2.0"
    y = g.conv(h, f"{s}/conv1", 8, 16, 3, stride=2, pad=1, prefix="layer2.0.conv1")
    y = g.op("Relu", [y], f"{s}/relu")
    y = g.conv(y, f"{s}/conv2", 16, 16, 3, pad=1, prefix="layer2.0.conv2")
    ds = g.conv(h, f"{s}/downsample/downsample.0", 8, 16, 1, stride=2, prefix="layer2.0.downsample.0")
    y = g.op("Add", [y, ds], s)
    h = g.op("Relu", [y], f"{s}/relu_1")

    h = g.op("GlobalAveragePool", [h], "/avgpool")
    h = torch_flatten(g, h, "")
    g.op("Gemm", [h, g.weight("fc.weight", (10, 16), 16, 1.0), g.bias("fc.bias", 10)], "/fc",
         outputs=["output"], alpha=1.0, beta=1.0, transB=1)

    m = g.model(
        "main_graph",
        [vinfo("input", ["batch_size", 3, 32, 32])],
        [vinfo("output", ["batch_size", 10])],
        opset=13,
    )
    m = with_value_info(m)
    inputs = [g.rng.standard_normal((2, 3, 32, 32)).astype(np.float32)]
    return m, inputs


def hardswish_opset11(g, x, scope):
    """torch 1.x export of nn.Hardswish at opset < 14: x * HardSigmoid(x)."""
    hs = g.op("HardSigmoid", [x], scope, alpha=0.16666667, beta=0.5)
    return g.op("Mul", [x, hs], scope)


def mobilenet_tiny():
    """MobileNet-ish, opset 11: depthwise/pointwise convs, HardSwish as
    HardSigmoid*x, ReLU6 as Clip(min, max inputs), SE blocks, residual."""
    g = G(seed=1002)
    x = "input.1"
    h = g.conv(x, "/features/features.0/features.0.0", 3, 8, 3, stride=2, pad=1, prefix="features.0.0")
    h = hardswish_opset11(g, h, "/features/features.0/features.0.2")  # [1,8,16,16]

    # block 1: dw 3x3 -> ReLU6 -> SE(conv) -> pw 1x1 -> + residual
    s = "/features/features.1/block"
    idt = h
    y = g.conv(h, f"{s}/block.0/block.0.0", 8, 8, 3, pad=1, group=8, prefix="features.1.block.0.0")
    lo = g.const(np.array(0.0, dtype=np.float32), f"{s}/block.0/block.0.2")
    hi = g.const(np.array(6.0, dtype=np.float32), f"{s}/block.0/block.0.2")
    y = g.op("Clip", [y, lo, hi], f"{s}/block.0/block.0.2")
    se = g.op("GlobalAveragePool", [y], f"{s}/block.1/avgpool")
    se = g.conv(se, f"{s}/block.1/fc1", 8, 4, 1, prefix="features.1.block.1.fc1")
    se = g.op("Relu", [se], f"{s}/block.1/activation")
    se = g.conv(se, f"{s}/block.1/fc2", 4, 8, 1, prefix="features.1.block.1.fc2")
    se = g.op("HardSigmoid", [se], f"{s}/block.1/scale_activation", alpha=0.16666667, beta=0.5)
    y = g.op("Mul", [y, se], f"{s}/block.1")  # [1,8,16,16] * [1,8,1,1]
    y = g.conv(y, f"{s}/block.2/block.2.0", 8, 8, 1, prefix="features.1.block.2.0")
    h = g.op("Add", [y, idt], "/features/features.1")

    # block 2: pw expand -> HardSwish -> dw 3x3 s2 -> HardSwish -> SE(fc, Squeeze/Unsqueeze) -> pw
    s = "/features/features.2/block"
    y = g.conv(h, f"{s}/block.0/block.0.0", 8, 16, 1, prefix="features.2.block.0.0")
    y = hardswish_opset11(g, y, f"{s}/block.0/block.0.2")
    y = g.conv(y, f"{s}/block.1/block.1.0", 16, 16, 3, stride=2, pad=1, group=16, prefix="features.2.block.1.0")
    y = hardswish_opset11(g, y, f"{s}/block.1/block.1.2")
    se = g.op("GlobalAveragePool", [y], f"{s}/block.2")
    se = g.op("Squeeze", [se], f"{s}/block.2", axes=[2, 3])  # opset 11: axes attribute
    se = g.gemm(se, f"{s}/block.2/fc1", 16, 8, "features.2.block.2.fc1")
    se = g.op("Relu", [se], f"{s}/block.2/relu")
    se = g.gemm(se, f"{s}/block.2/fc2", 8, 16, "features.2.block.2.fc2")
    se = g.op("HardSigmoid", [se], f"{s}/block.2/hsig", alpha=0.16666667, beta=0.5)
    se = g.op("Unsqueeze", [se], f"{s}/block.2", axes=[2, 3])
    y = g.op("Mul", [y, se], f"{s}/block.2")
    h = g.conv(y, f"{s}/block.3/block.3.0", 16, 12, 1, prefix="features.2.block.3.0")  # [1,12,8,8]

    h = g.op("GlobalAveragePool", [h], "/avgpool")
    h = g.op("Flatten", [h], "/Flatten", axis=1)
    w = g.weight("classifier.weight", (10, 12), 12, 1.0)
    b = g.bias("classifier.bias", 10)
    g.op("Gemm", [h, w, b], "/classifier", outputs=["output"], alpha=1.0, beta=1.0, transB=1)

    m = g.model("torch_jit", [vinfo("input.1", [1, 3, 32, 32])], [vinfo("output", [1, 10])], opset=11)
    inputs = [g.rng.standard_normal((1, 3, 32, 32)).astype(np.float32)]
    return m, inputs


def mobilenet_v3_style():
    """opset 14: native HardSwish, strided depthwise conv, AveragePool,
    Flatten, MatMul + Add classifier (tf2onnx-like)."""
    g = G(seed=1003)
    x = "x"
    h = g.conv(x, "/stem", 3, 8, 3, pad=1, prefix="stem")
    h = g.op("HardSwish", [h], "/stem_act")                      # [N,8,32,32]
    h = g.conv(h, "/b1/dw", 8, 8, 3, stride=2, pad=1, group=8, prefix="b1.dw")
    h = g.op("HardSwish", [h], "/b1/act1")                        # [N,8,16,16]
    h = g.conv(h, "/b1/pw", 8, 16, 1, prefix="b1.pw")
    h = g.op("HardSwish", [h], "/b1/act2")                        # [N,16,16,16]
    idt = h
    y = g.conv(h, "/b2/expand", 16, 24, 1, prefix="b2.expand")
    y = g.op("HardSwish", [y], "/b2/act1")
    y = g.conv(y, "/b2/dw", 24, 24, 3, pad=1, group=24, prefix="b2.dw")
    y = g.op("Relu", [y], "/b2/act2")
    y = g.conv(y, "/b2/project", 24, 16, 1, prefix="b2.project")
    h = g.op("Add", [y, idt], "/b2")
    h = g.op("AveragePool", [h], "/pool", kernel_shape=[2, 2], strides=[2, 2],
             pads=[0, 0, 0, 0], ceil_mode=0, count_include_pad=0)  # [N,16,8,8]
    h = g.op("Flatten", [h], "/flatten", axis=1)                  # [N,1024]
    w = g.weight("head.kernel", (1024, 10), 1024, 1.0)
    b = g.bias("head.bias", 10)
    h = g.op("MatMul", [h, w], "/head")
    g.op("Add", [h, b], "/head", outputs=["logits"])

    m = g.model("mobilenet_v3_style", [vinfo("x", ["N", 3, 32, 32])], [vinfo("logits", ["N", 10])], opset=14)
    inputs = [g.rng.standard_normal((2, 3, 32, 32)).astype(np.float32)]
    return m, inputs


def transformer_tiny():
    """One post-norm encoder layer shaped like torch.nn.TransformerEncoderLayer
    (batch_first=True, activation="gelu") exported at opset 17."""
    B, S, D, H, FF = 2, 8, 16, 2, 32
    DH = D // H
    g = G(seed=1004)
    x = "src"
    sa = "/self_attn"

    def head_split(t, scope, perm):
        # t.view(B, S, H, DH) with B, S taken from the tensor's shape at runtime
        shp = g.op("Shape", [t], scope)
        b = g.op("Gather", [shp, g.const(np.array(0, dtype=np.int64), scope)], scope, axis=0)
        s_ = g.op("Gather", [shp, g.const(np.array(1, dtype=np.int64), scope)], scope, axis=0)
        b = g.op("Unsqueeze", [b, g.const(np.array([0], dtype=np.int64), scope)], scope)
        s_ = g.op("Unsqueeze", [s_, g.const(np.array([0], dtype=np.int64), scope)], scope)
        shape = g.op("Concat", [b, s_, g.const(np.array([H], dtype=np.int64), scope),
                                g.const(np.array([DH], dtype=np.int64), scope)], scope, axis=0)
        t = g.op("Reshape", [t, shape], scope)
        return g.op("Transpose", [t], scope, perm=perm)

    # in-projection: [B,S,D] x [D,3D] + b, then Split into q, k, v
    w_in = g.weight("self_attn.in_proj_weight_t", (D, 3 * D), D, 1.0)
    b_in = g.bias("self_attn.in_proj_bias", 3 * D)
    qkv = g.op("MatMul", [x, w_in], sa)
    qkv = g.op("Add", [qkv, b_in], sa)
    split = g.const(np.array([D, D, D], dtype=np.int64), sa)
    q, k, v = g.op("Split", [qkv, split], sa, n_out=3, axis=-1)
    q = head_split(q, f"{sa}/q", [0, 2, 1, 3])        # [B,H,S,DH]
    kt = head_split(k, f"{sa}/k", [0, 2, 3, 1])       # [B,H,DH,S]
    v = head_split(v, f"{sa}/v", [0, 2, 1, 3])        # [B,H,S,DH]
    scores = g.op("MatMul", [q, kt], sa)              # [B,H,S,S]
    scores = g.op("Div", [scores, g.const(np.array(np.sqrt(DH), dtype=np.float32), sa)], sa)

    # src_key_padding_mask (True = pad): last 3 keys of batch 1 padded
    pad = np.zeros((B, S), dtype=bool)
    pad[1, S - 3:] = True
    mask = g.const(pad, f"{sa}/mask")
    mask_i = g.op("Cast", [mask], f"{sa}/mask", to=I64)
    is_pad = g.op("Equal", [mask_i, g.const(np.array(1, dtype=np.int64), f"{sa}/mask")], f"{sa}/mask")
    addmask = g.op("Where", [is_pad, g.const(np.array(-np.inf, dtype=np.float32), f"{sa}/mask"),
                             g.const(np.array(0.0, dtype=np.float32), f"{sa}/mask")], f"{sa}/mask")
    addmask = g.op("Unsqueeze", [addmask, g.const(np.array([1, 2], dtype=np.int64), f"{sa}/mask")],
                   f"{sa}/mask")                      # [B,1,1,S]
    scores = g.op("Add", [scores, addmask], sa)
    attn = g.op("Softmax", [scores], sa, axis=-1)
    ctx = g.op("MatMul", [attn, v], sa)               # [B,H,S,DH]
    ctx = g.op("Transpose", [ctx], sa, perm=[0, 2, 1, 3])  # [B,S,H,DH]
    shp = g.op("Shape", [x], sa)
    b_ = g.op("Unsqueeze", [g.op("Gather", [shp, g.const(np.array(0, dtype=np.int64), sa)], sa, axis=0),
                            g.const(np.array([0], dtype=np.int64), sa)], sa)
    s_ = g.op("Unsqueeze", [g.op("Gather", [shp, g.const(np.array(1, dtype=np.int64), sa)], sa, axis=0),
                            g.const(np.array([0], dtype=np.int64), sa)], sa)
    out_shape = g.op("Concat", [b_, s_, g.const(np.array([D], dtype=np.int64), sa)], sa, axis=0)
    ctx = g.op("Reshape", [ctx, out_shape], sa)       # [B,S,D]
    ctx = g.op("MatMul", [ctx, g.weight("self_attn.out_proj.weight_t", (D, D), D, 1.0)], f"{sa}/out_proj")
    ctx = g.op("Add", [ctx, g.bias("self_attn.out_proj.bias", D)], f"{sa}/out_proj")

    h = g.op("Add", [x, ctx], "")                     # residual
    ln1_s = g.init("norm1.weight", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
    ln1_b = g.bias("norm1.bias", D)
    h = g.op("LayerNormalization", [h, ln1_s, ln1_b], "/norm1", axis=-1, epsilon=1e-5)

    # feed-forward with exact GELU as exported: x * 0.5 * (1 + erf(x / sqrt(2)))
    f = g.op("MatMul", [h, g.weight("linear1.weight_t", (D, FF), D, 1.0)], "/linear1")
    f = g.op("Add", [f, g.bias("linear1.bias", FF)], "/linear1")
    a = g.op("Div", [f, g.const(np.array(1.4142135, dtype=np.float32), "/activation")], "/activation")
    a = g.op("Erf", [a], "/activation")
    a = g.op("Add", [a, g.const(np.array(1.0, dtype=np.float32), "/activation")], "/activation")
    a = g.op("Mul", [f, a], "/activation")
    a = g.op("Mul", [a, g.const(np.array(0.5, dtype=np.float32), "/activation")], "/activation")
    f = g.op("MatMul", [a, g.weight("linear2.weight_t", (FF, D), FF, 1.0)], "/linear2")
    f = g.op("Add", [f, g.bias("linear2.bias", D)], "/linear2")
    h = g.op("Add", [h, f], "")
    ln2_s = g.init("norm2.weight", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
    ln2_b = g.bias("norm2.bias", D)
    g.op("LayerNormalization", [h, ln2_s, ln2_b], "/norm2", outputs=["out"], axis=-1, epsilon=1e-5)
    g.op("ReduceMean", ["out"], "/pool", outputs=["pooled"], axes=[1], keepdims=0)  # opset < 18

    m = g.model(
        "main_graph",
        [vinfo("src", [B, S, D])],
        [vinfo("out", [B, S, D]), vinfo("pooled", [B, D])],
        opset=17,
    )
    m = with_value_info(m)
    inputs = [g.rng.standard_normal((B, S, D)).astype(np.float32)]
    return m, inputs


def opset_misc():
    """opset 11 grab-bag: Pad/Slice/Squeeze/Unsqueeze/Expand/Concat/reductions/
    elementwise/Transpose/Identity/Cast/ConstantOfShape, all on float data."""
    g = G(seed=1005)
    x = "x"  # [2,3,4,5]
    pads = g.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64))
    a = g.op("Pad", [x, pads, g.const(np.array(0.5, dtype=np.float32))], mode="constant")  # [2,3,6,7]
    b = g.op("Slice", [a,
                       g.const(np.array([1, 0], dtype=np.int64)),
                       g.const(np.array([6, 7], dtype=np.int64)),
                       g.const(np.array([2, 3], dtype=np.int64)),
                       g.const(np.array([2, 2], dtype=np.int64))])  # [2,3,3,4]
    # torch.flip's export: step -1 from -1 to INT64_MIN+1
    c = g.op("Slice", [b,
                       g.const(np.array([-1], dtype=np.int64)),
                       g.const(np.array([-9223372036854775807], dtype=np.int64)),
                       g.const(np.array([1], dtype=np.int64)),
                       g.const(np.array([-1], dtype=np.int64))])    # [2,3,3,4], channels reversed
    d = g.op("Sub", [b, c])
    e = g.op("Pow", [d, g.const(np.array(2.0, dtype=np.float32))])
    f = g.op("Sqrt", [g.op("Add", [e, g.const(np.array(1.0, dtype=np.float32))])])
    hexp = g.op("Exp", [g.op("Neg", [f])])
    lg = g.op("Log", [hexp])
    s1 = g.op("Sigmoid", [b])
    t1 = g.op("Tanh", [c])
    lr = g.op("LeakyRelu", [d], alpha=0.1)
    rsum = g.op("ReduceSum", [lr], axes=[3], keepdims=1)   # [2,3,3,1]
    rmax = g.op("ReduceMax", [s1], axes=[1], keepdims=0)   # [2,3,4]
    sq = g.op("Squeeze", [rsum], axes=[3])                 # [2,3,3]
    un = g.op("Unsqueeze", [rmax], axes=[1])               # [2,1,3,4]
    ex = g.op("Expand", [un, g.const(np.array([2, 3, 3, 4], dtype=np.int64))])  # [2,3,3,4]
    cat = g.op("Concat", [ex, t1, lg], axis=1)             # [2,9,3,4]
    tr = g.op("Transpose", [cat], perm=[0, 2, 3, 1])       # [2,3,4,9]
    g.op("Identity", [tr], outputs=["y"])
    cst = g.op("Cast", [g.const(np.array([1, 2, 3], dtype=np.int64))], to=F)          # [3]
    cos = g.op("ConstantOfShape", [g.const(np.array([2, 3, 1], dtype=np.int64))],
               value=numpy_helper.from_array(np.array([0.25], dtype=np.float32), name=""))
    z = g.op("Add", [sq, cst])
    g.op("Add", [z, cos], outputs=["z"])                   # [2,3,3]

    m = g.model("opset_misc", [vinfo("x", [2, 3, 4, 5])], [vinfo("y", [2, 3, 4, 9]), vinfo("z", [2, 3, 3])],
                opset=11)
    inputs = [g.rng.standard_normal((2, 3, 4, 5)).astype(np.float32)]
    return m, inputs


def exporter_constants():
    """Nodes exporters write over constants and input shapes only, which import computes:
    HF BERT's GatherElements (position and token-type ids from a buffer), T5's integer
    Min/Max (relative-position buckets), Swin's ScatterND (the shifted-window mask)."""
    g = G(seed=1007)
    x = "x"  # [2,6,8]
    n = g.op("Gather", [g.op("Shape", [x]), g.const(np.array(1, dtype=np.int64))])  # 6
    # BERT: ids gathered from a registered buffer along axis 1, then an embedding lookup.
    buffer = g.init("position_ids", np.arange(6, dtype=np.int64)[None, :] * 2 % 6)
    order = g.const(np.array([[5, 4, 3, 2, 1, 0]], dtype=np.int64))
    ids = g.op("GatherElements", [buffer, order], axis=1)                     # [1,6] int64
    table = g.init("position_embeddings", g.rng.standard_normal((6, 8)).astype(np.float32))
    pos = g.op("Gather", [table, ids], axis=0)                                # [1,6,8]
    # a float GatherElements of a weight, negative indices included
    picks = g.rng.integers(-6, 6, (6, 8)).astype(np.int64)
    w = g.op("GatherElements", [g.init("w", g.rng.standard_normal((6, 8)).astype(np.float32)),
                                g.const(picks)], axis=0)                       # [6,8]
    g.op("Add", [g.op("Mul", [x, w]), pos], outputs=["y"])
    # T5: relative positions from Range over the sequence length, clamped with integer Min/Max
    r = g.op("Range", [g.const(np.array(0, dtype=np.int64)), n, g.const(np.array(1, dtype=np.int64))])
    rel = g.op("Sub", [g.op("Unsqueeze", [r, g.const(np.array([0], dtype=np.int64))]),
                       g.op("Unsqueeze", [r, g.const(np.array([1], dtype=np.int64))])])  # [6,6]
    clamped = g.op("Min", [g.op("Max", [rel, g.const(np.array(-2, dtype=np.int64))]),
                           g.const(np.array(3, dtype=np.int64))])
    bias = g.op("Cast", [clamped], to=F)
    # Swin: a window mask written slice by slice, as `img_mask[:, h, w, :] = cnt` exports
    mask0 = g.init("mask", np.zeros((6, 6), dtype=np.float32))
    rows = g.const(np.array([[0], [2], [5]], dtype=np.int64))
    mask = g.op("ScatterND", [mask0, rows, g.const(np.full((3, 6), -100.0, dtype=np.float32))])
    cells = g.const(np.array([[1, 1], [3, 4], [1, 1]], dtype=np.int64))
    mask = g.op("ScatterND", [mask, cells, g.const(np.array([2.0, 3.0, 4.0], dtype=np.float32))],
                reduction="add")
    scores = g.op("MatMul", [x, g.op("Transpose", [x], perm=[0, 2, 1])])      # [2,6,6]
    g.op("Softmax", [g.op("Add", [g.op("Add", [scores, bias]), mask])], axis=-1, outputs=["z"])
    m = g.model("exporter_constants", [vinfo("x", [2, 6, 8])],
                [vinfo("y", [2, 6, 8]), vinfo("z", [2, 6, 6])], opset=18)
    inputs = [g.rng.standard_normal((2, 6, 8)).astype(np.float32)]
    return m, inputs


def einsum_cases():
    """Einsum as exporters write it (MaxViT's and torch's attention and relative-position
    einsums) and NumPy's other forms: batched contractions, an ellipsis that broadcasts,
    sums, transposes, outer products, an implicit output and three operands."""
    g = G(seed=1008)
    x, p = "x", "p"  # [2,3,4,5], [4,6]
    w = g.init("w", g.rng.standard_normal((5, 7)).astype(np.float32))
    rel = g.init("rel", g.rng.standard_normal((4, 4, 5)).astype(np.float32))
    q = g.op("Einsum", [x, x], equation="bhid,bhjd->bhij")                       # [2,3,4,4]
    g.op("Einsum", [q, x], equation="bhij,bhjd->bhid", outputs=["attn"])           # [2,3,4,5]
    g.op("Einsum", [x, rel], equation="bhid,ijd->bhij", outputs=["relpos"])        # [2,3,4,4]
    g.op("Einsum", [x, w], equation="...d,de->...e", outputs=["proj"])             # [2,3,4,7]
    g.op("Einsum", [x], equation="bhid->bdi", outputs=["summed"])                  # [2,5,4]
    g.op("Einsum", [p, p], equation="ij,kj", outputs=["implicit"])                 # [4,4]
    a = g.op("Einsum", [p], equation="ij->j")                                      # [6]
    g.op("Einsum", [a, a], equation="i,j->ij", outputs=["outer"])                  # [6,6]
    b = g.init("b", g.rng.standard_normal((1, 3, 5, 2)).astype(np.float32))
    g.op("Einsum", [x, b], equation="...ij,...jk->...ik", outputs=["broadcast"])   # [2,3,4,2]
    c = g.init("c", g.rng.standard_normal((6, 3)).astype(np.float32))
    g.op("Einsum", [p, c, c], equation="ij,jk,jl->ikl", outputs=["three"])         # [4,3,3]
    outs = [("attn", [2, 3, 4, 5]), ("relpos", [2, 3, 4, 4]), ("proj", [2, 3, 4, 7]),
            ("summed", [2, 5, 4]), ("implicit", [4, 4]), ("outer", [6, 6]),
            ("broadcast", [2, 3, 4, 2]), ("three", [4, 3, 3])]
    m = g.model("einsum_cases", [vinfo("x", [2, 3, 4, 5]), vinfo("p", [4, 6])],
                [vinfo(n, s) for n, s in outs], opset=13)
    inputs = [g.rng.standard_normal((2, 3, 4, 5)).astype(np.float32),
              g.rng.standard_normal((4, 6)).astype(np.float32)]
    return m, inputs


def control_flow():
    """If nodes whose conditions import computes from shapes (as torchvision's detection
    models and HF's exports check sizes): the taken branch reads outer values and its own
    initializer, one branch holds a nested If, the other branch would fail if taken."""
    g = G(seed=1009)
    x = "x"  # [2,3]
    rows = g.op("Gather", [g.op("Shape", [x]), g.const(np.array(0, dtype=np.int64))])
    two = g.op("Equal", [rows, g.const(np.array(2, dtype=np.int64))])           # true
    many = g.op("Greater", [rows, g.const(np.array(100, dtype=np.int64))])      # false
    scale = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], dtype=np.float32), "branch_scale")
    inner = helper.make_graph(
        [helper.make_node("Sigmoid", [x], ["inner_y"], name="inner_sigmoid")],
        "inner_then", [], [vinfo("inner_y", [2, 3])])
    inner_else = helper.make_graph(
        [helper.make_node("Neg", [x], ["inner_n"], name="inner_neg")],
        "inner_else", [], [vinfo("inner_n", [2, 3])])
    then_branch = helper.make_graph(
        [helper.make_node("Mul", [x, "branch_scale"], ["scaled"], name="then_mul"),
         helper.make_node("If", [two], ["nested"], name="nested_if",
                          then_branch=inner, else_branch=inner_else),
         helper.make_node("Add", ["scaled", "nested"], ["then_y"], name="then_add")],
        "then", [], [vinfo("then_y", [2, 3])], initializer=[scale])
    else_branch = helper.make_graph(
        # [2,3] reshaped to [4,5] would fail: import must not look at this branch.
        [helper.make_node("Reshape", [x, "bad_shape"], ["else_y"], name="else_reshape")],
        "else", [], [vinfo("else_y", [4, 5])],
        initializer=[numpy_helper.from_array(np.array([4, 5], dtype=np.int64), "bad_shape")])
    g.nodes.append(helper.make_node("If", [two], ["y"], name="size_check",
                                    then_branch=then_branch, else_branch=else_branch))
    relu = helper.make_graph([helper.make_node("Relu", [x], ["r"], name="else_relu")],
                             "small", [], [vinfo("r", [2, 3])])
    empty = helper.make_graph([helper.make_node("Identity", [x], ["e"], name="then_id")],
                              "large", [], [vinfo("e", [2, 3])])
    g.nodes.append(helper.make_node("If", [many], ["z"], name="large_input",
                                    then_branch=empty, else_branch=relu))
    m = g.model("control_flow", [vinfo("x", [2, 3])], [vinfo("y", [2, 3]), vinfo("z", [2, 3])],
                opset=13)
    inputs = [g.rng.standard_normal((2, 3)).astype(np.float32)]
    return m, inputs


def gelu_forms():
    """GELU as exporters write it out: HF GPT-2's gelu_new (tanh, with Pow) after a
    Linear layer, and torch's exact GELU (Div/Erf/Add/Mul/Mul); import makes each one
    Gelu again."""
    g = G(seed=1010)
    x = "x"  # [3,16]
    h = g.op("Add", [g.op("MatMul", [x, g.weight("fc.weight", (16, 32), 16)]), g.bias("fc.bias", 32)])
    cube = g.op("Pow", [h, g.const(np.array(3.0, dtype=np.float32))])
    inner = g.op("Add", [h, g.op("Mul", [g.const(np.array(0.044715, dtype=np.float32)), cube])])
    th = g.op("Tanh", [g.op("Mul", [g.const(np.array(0.7978845608028654, dtype=np.float32)), inner])])
    new = g.op("Mul", [g.op("Mul", [g.const(np.array(0.5, dtype=np.float32)), h]),
                       g.op("Add", [g.const(np.array(1.0, dtype=np.float32)), th])])
    g.op("Identity", [new], outputs=["y"])
    e = g.op("Erf", [g.op("Div", [h, g.const(np.array(1.4142135381698608, dtype=np.float32))])])
    exact = g.op("Mul", [g.op("Mul", [h, g.op("Add", [e, g.const(np.array(1.0, dtype=np.float32))])]),
                         g.const(np.array(0.5, dtype=np.float32))])
    g.op("Identity", [exact], outputs=["z"])
    m = g.model("gelu_forms", [vinfo("x", [3, 16])], [vinfo("y", [3, 32]), vinfo("z", [3, 32])],
                opset=13)
    inputs = [(2.0 * g.rng.standard_normal((3, 16))).astype(np.float32)]
    return m, inputs


def dynamic_axes():
    """A model exported with dynamic axes (batch and seq), as torch.onnx.export
    writes one: shapes computed at run time from Shape, a class token expanded to
    the batch, ConstantOfShape, Reshapes to [batch, seq + 1, ...] and to [-1, D] and
    back, a Slice to the end, a Resize by scales and a flatten. Imported at one
    batch and sequence length, rewritten and exported, it must run at others."""
    D = 16
    g = G(seed=1011)

    def dims(t, scope, *axes):
        shp = g.op("Shape", [t], scope)
        return [g.op("Unsqueeze", [g.op("Gather", [shp, g.const(np.array(a, dtype=np.int64), scope)],
                                        scope, axis=0),
                                   g.const(np.array([0], dtype=np.int64), scope)], scope)
                for a in axes]

    def i64s(*v):
        return g.const(np.array(v, dtype=np.int64))

    x = "tokens"                                                   # [B,S,D]
    ones = g.op("ConstantOfShape", [g.op("Concat", dims(x, "/mask", 0, 1), "/mask", axis=0)],
                "/mask", value=numpy_helper.from_array(np.array([1.0], dtype=np.float32)))
    x = g.op("Mul", [x, g.op("Unsqueeze", [ones, i64s(2)], "/mask")], "/mask")
    cls = g.init("cls_token", (0.1 * g.rng.standard_normal((1, 1, D))).astype(np.float32))
    cls = g.op("Expand", [cls, g.op("Concat", dims(x, "/cls", 0) + [i64s(1, 1)], "/cls", axis=0)], "/cls")
    h = g.op("Concat", [cls, x], "/cat", axis=1)                  # [B,S+1,D]
    qkv = g.op("MatMul", [h, g.weight("attn.qkv.weight", (D, 3 * D), D, 1.0)], "/attn")
    qkv = g.op("Add", [qkv, g.bias("attn.qkv.bias", 3 * D)], "/attn")
    shape = g.op("Concat", dims(h, "/attn", 0, 1) + [i64s(3, 2, D // 2)], "/attn", axis=0)
    qkv = g.op("Transpose", [g.op("Reshape", [qkv, shape], "/attn")], "/attn", perm=[2, 0, 3, 1, 4])
    q, k, v = (g.op("Gather", [qkv, g.const(np.array(i, dtype=np.int64), "/attn")], "/attn", axis=0)
               for i in range(3))                                  # [B,2,S+1,D/2]
    s_ = g.op("MatMul", [q, g.op("Transpose", [k], "/attn", perm=[0, 1, 3, 2])], "/attn")
    s_ = g.op("Div", [s_, g.const(np.array(np.sqrt(D // 2), dtype=np.float32), "/attn")], "/attn")
    ctx = g.op("MatMul", [g.op("Softmax", [s_], "/attn", axis=-1), v], "/attn")
    ctx = g.op("Transpose", [ctx], "/attn", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.op("Concat", dims(h, "/attn/out", 0, 1) + [i64s(D)], "/attn/out",
                                     axis=0)], "/attn/out")
    h = g.op("Add", [h, ctx], "/attn/residual")                   # [B,S+1,D]
    # the MLP on rows: view(-1, D), then back to view(B, S+1, D)
    rows = g.op("Reshape", [h, i64s(-1, D)], "/mlp")
    rows = g.op("Relu", [g.op("Gemm", [rows, g.weight("mlp.weight", (D, D), D), g.bias("mlp.bias", D)],
                              "/mlp", transB=1)], "/mlp")
    back = g.op("Concat", dims(h, "/mlp", 0, 1) + [i64s(D)], "/mlp", axis=0)
    h = g.op("Add", [h, g.op("Reshape", [rows, back], "/mlp")], "/mlp")
    starts, ends, axes = i64s(1), i64s(np.iinfo(np.int64).max), i64s(1)
    g.op("Slice", [h, starts, ends, axes], "/patches", outputs=["patch_tokens"])  # [B,S,D]
    cls_out = g.op("Gather", [h, g.const(np.array(0, dtype=np.int64))], "/pool", axis=1)  # [B,D]

    img = g.op("Resize", ["image", "", g.const(np.array([1, 1, 2, 2], dtype=np.float32))], "/up",
               mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    img = g.op("Relu", [g.conv(img, "/conv", 3, 4, 3, pad=1, prefix="conv")], "/conv")
    img = torch_flatten(g, g.op("GlobalAveragePool", [img], "/gap"), "/flatten")  # [B,4]
    feats = g.op("Concat", [cls_out, img], "/head", axis=1)
    g.op("Gemm", [feats, g.weight("head.weight", (10, D + 4), D + 4, 1.0), g.bias("head.bias", 10)],
         "/head", outputs=["logits"], transB=1)
    m = g.model(
        "dynamic_axes",
        [vinfo("tokens", ["batch", "seq", D]), vinfo("image", ["batch", 3, 8, 8])],
        [vinfo("patch_tokens", ["batch", "seq", D]), vinfo("logits", ["batch", 10])],
        opset=17,
    )
    inputs = [g.rng.standard_normal((2, 5, D)).astype(np.float32),
              g.rng.standard_normal((2, 3, 8, 8)).astype(np.float32)]
    return m, inputs


def positions():
    """Token and position embeddings as GPT-2's export writes them: the positions
    are Range(0, seq) of the input's shape. Import computes that Range, so the
    rewritten model's sequence length stays the one imported (and says so) while
    its batch stays symbolic."""
    g = G(seed=1012)
    seq = g.op("Gather", [g.op("Shape", ["ids"], "/pos"), g.const(np.array(1, dtype=np.int64), "/pos")],
               "/pos", axis=0)
    pos = g.op("Range", [g.const(np.array(0, dtype=np.int64), "/pos"), seq,
                         g.const(np.array(1, dtype=np.int64), "/pos")], "/pos")
    wpe = g.init("wpe.weight", (0.1 * g.rng.standard_normal((16, 8))).astype(np.float32))
    wte = g.init("wte.weight", (0.1 * g.rng.standard_normal((32, 8))).astype(np.float32))
    h = g.op("Add", [g.op("Gather", [wte, "ids"], "/wte", axis=0),
                     g.op("Gather", [wpe, pos], "/wpe", axis=0)], "/embed")
    g.op("MatMul", [h, g.weight("proj.weight", (8, 4), 8, 1.0)], "/proj", outputs=["y"])
    m = g.model("positions", [vinfo("ids", ["batch", "seq"], I64)], [vinfo("y", ["batch", "seq", 4])],
                opset=17)
    return m, [g.rng.integers(0, 32, size=(2, 6)).astype(np.int64)]


def runtime_positions():
    """Position ids computed from the input's values, as RoBERTa's export writes them
    (Hugging Face's create_position_ids_from_input_ids: a CumSum of the non-padding
    mask, integer Mul and Add), token types gathered at them (GatherElements of
    indices computed at run time), a GatherElements of negative indices, an integer
    Sub, and an integer CumSum exclusive and reversed: integer arithmetic and scans at
    run time."""
    g = G(seed=1013)
    seq, pad = 6, 1
    i64 = lambda v: g.const(np.array(v, dtype=np.int64), "/pos")
    keep = g.op("Not", [g.op("Equal", ["ids", i64(pad)], "/pos")], "/pos")
    mask = g.op("Cast", [keep], "/pos", to=TensorProto.INT32)
    run = g.op("CumSum", [mask, g.const(np.array(1, dtype=np.int64), "/pos")], "/pos")
    pos = g.op("Add", [g.op("Cast", [g.op("Mul", [run, mask], "/pos")], "/pos", to=TensorProto.INT64),
                       i64(pad)], "/pos")
    wpe = g.init("wpe.weight", (0.1 * g.rng.standard_normal((seq + 2, 8))).astype(np.float32))
    wte = g.init("wte.weight", (0.1 * g.rng.standard_normal((32, 8))).astype(np.float32))
    wtt = g.init("wtt.weight", (0.1 * g.rng.standard_normal((3, 8))).astype(np.float32))
    types = g.init("types", g.rng.integers(0, 3, size=(2, seq + 2)).astype(np.int64))
    tt = g.op("GatherElements", [types, pos], "/types", axis=1)
    h = g.op("Add", [g.op("Gather", [wte, "ids"], "/wte", axis=0),
                     g.op("Gather", [wpe, pos], "/wpe", axis=0)], "/embed")
    h = g.op("Add", [h, g.op("Gather", [wtt, tt], "/wtt", axis=0)], "/embed")
    # Negative indices count from the axis' end: pos - (seq + 2) is in [-(seq + 1), -1].
    gains = g.init("gains", (1.0 + 0.1 * g.rng.standard_normal((2, seq + 2))).astype(np.float32))
    back = g.op("Sub", [pos, i64(seq + 2)], "/gain")
    gain = g.op("GatherElements", [gains, back], "/gain", axis=1)
    h = g.op("Mul", [h, g.op("Unsqueeze", [gain, i64([2])], "/gain")], "/gain")
    # The non-padding tokens after each one: an exclusive, reversed CumSum.
    after = g.op("CumSum", [g.op("Cast", [keep], "/after", to=TensorProto.INT64),
                            g.const(np.array(1, dtype=np.int64), "/after")], "/after",
                 exclusive=1, reverse=1)
    after = g.op("Cast", [after], "/after", to=TensorProto.FLOAT)
    h = g.op("Add", [h, g.op("Unsqueeze", [g.op("Mul", [after, g.const(np.float32(0.01), "/after")],
                                                    "/after"), i64([2])], "/after")], "/after")
    g.op("MatMul", [h, g.weight("proj.weight", (8, 4), 8, 1.0)], "/proj", outputs=["y"])
    m = g.model("runtime_positions", [vinfo("ids", [2, seq], I64)], [vinfo("y", [2, seq, 4])],
                opset=17)
    ids = g.rng.integers(2, 32, size=(2, seq)).astype(np.int64)
    ids[0, 4:] = pad  # right padding
    ids[1, 0] = pad  # and a padding token first
    return m, [ids]


def cubic_positions():
    """Position embeddings resized to another patch grid by a cubic Resize, as DINOv2's
    and YOLOS's exports interpolate theirs (PyTorch's bicubic: half_pixel, a = -0.75,
    the output's sizes given): a 4x4 grid of 8 channels up to 6x6, and down to 3x3 by
    scales with a = -0.5 and exclude_outside; each added to an input. The Resizes read
    initializers only, so import computes them."""
    g = G(seed=1014)
    i64 = lambda v, s: g.const(np.array(v, dtype=np.int64), s)
    pos = g.init("pos_embed", (0.5 * g.rng.standard_normal((1, 16, 8))).astype(np.float32))
    grid = g.op("Transpose", [g.op("Reshape", [pos, i64([1, 4, 4, 8], "/grid")], "/grid")],
                "/grid", perm=[0, 3, 1, 2])
    up = g.op("Resize", [grid, "", "", i64([1, 8, 6, 6], "/up")], "/up", mode="cubic",
              coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75,
              nearest_mode="floor")
    up = g.op("Reshape", [g.op("Transpose", [up], "/up", perm=[0, 2, 3, 1]), i64([1, 36, 8], "/up")],
              "/up")
    g.op("Add", ["x", up], "/up", outputs=["y"])
    scales = g.const(np.array([1.0, 1.0, 0.75, 0.75], dtype=np.float32), "/down")
    down = g.op("Resize", [grid, "", scales], "/down", mode="cubic",
                coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.5, exclude_outside=1)
    down = g.op("Reshape", [g.op("Transpose", [down], "/down", perm=[0, 2, 3, 1]),
                            i64([1, 9, 8], "/down")], "/down")
    g.op("Add", ["w", down], "/down", outputs=["z"])
    m = g.model("cubic_positions", [vinfo("x", [2, 36, 8]), vinfo("w", [2, 9, 8])],
                [vinfo("y", [2, 36, 8]), vinfo("z", [2, 9, 8])], opset=13)
    return m, [g.rng.standard_normal((2, 36, 8)).astype(np.float32),
               g.rng.standard_normal((2, 9, 8)).astype(np.float32)]


def fourier_mixing():
    """FNet's token mixing as torch.onnx's dynamo exporter writes `torch.fft.fftn(x).real`
    (a signal made complex by a Concat with zeros Expanded to its Shape, a DFT along the hidden axis, then
    along the sequence, the real part gathered) added to the input; a one-sided
    transform of the real signal with its `dft_length`; an inverse transform of the
    complex signal along the sequence. Import makes each a pair of products with the
    transform's cosines and sines."""
    g = G(seed=1015)
    i64 = lambda v, s: g.const(np.array(v, dtype=np.int64), s)
    re = g.op("Unsqueeze", ["x", i64([-1], "/complex")], "/complex")
    zero = g.const(np.array(0.0, dtype=np.float32), "/complex")
    zeros = g.op("Expand", [zero, g.op("Shape", [re], "/complex")], "/complex")
    signal = g.op("Concat", [re, zeros], "/complex", axis=-1)
    f = g.op("DFT", [signal], "/fft", axis=2)
    f = g.op("DFT", [f], "/fft", axis=1)
    real = g.op("Gather", [f, i64(0, "/real")], "/real", axis=-1)
    g.op("Add", ["x", real], "/mix", outputs=["y"])
    g.op("DFT", [re, i64(6, "/rfft")], "/rfft", axis=2, onesided=1, outputs=["z"])
    g.op("DFT", [signal], "/ifft", axis=1, inverse=1, outputs=["w"])
    m = g.model("fourier_mixing", [vinfo("x", [2, 8, 6])],
                [vinfo("y", [2, 8, 6]), vinfo("z", [2, 8, 4, 2]), vinfo("w", [2, 8, 6, 2])],
                opset=17)
    return m, [g.rng.standard_normal((2, 8, 6)).astype(np.float32)]


def col2im_blocks():
    """MobileViTV2's fold of its unfolded patches: Col2Im with strides equal to the
    block (no overlap), 2x2 blocks of 3 channels into a 6x8 image, and 3x2 blocks of 2
    channels into a 6x4 one (pads and dilations given, as their defaults). Import makes
    each a Reshape, a Transpose and a Reshape."""
    g = G(seed=1016)
    i64 = lambda v, s: g.const(np.array(v, dtype=np.int64), s)
    g.op("Col2Im", ["x", i64([6, 8], "/fold"), i64([2, 2], "/fold")], "/fold", strides=[2, 2],
         outputs=["y"])
    g.op("Col2Im", ["v", i64([6, 4], "/fold_1"), i64([3, 2], "/fold_1")], "/fold_1",
         strides=[3, 2], pads=[0, 0, 0, 0], dilations=[1, 1], outputs=["z"])
    m = g.model("col2im_blocks", [vinfo("x", [2, 12, 12]), vinfo("v", [1, 12, 4])],
                [vinfo("y", [2, 3, 6, 8]), vinfo("z", [1, 2, 6, 4])], opset=18)
    return m, [g.rng.standard_normal((2, 12, 12)).astype(np.float32),
               g.rng.standard_normal((1, 12, 4)).astype(np.float32)]


def recurrent_cells():
    """LSTM and GRU as torch.nn.LSTM and nn.GRU export them and beyond: an LSTM from
    initial states given as inputs, with its last hidden and cell states as outputs; a
    reverse LSTM without biases; a bidirectional
    GRU applying its reset gate before the recurrent product (linear_before_reset 0,
    ONNX's default) with its last states; a GRU after it (PyTorch's form, 1) given
    every sequence's full length. Import unrolls each over the sequence."""
    g = G(seed=1017)
    w = lambda name, shape: g.init(name, (0.5 * g.rng.standard_normal(shape)).astype(np.float32))
    i64 = lambda v, s: g.const(np.array(v, dtype=np.int64), s)
    xs = g.op("Transpose", ["x"], "/seq", perm=[1, 0, 2])
    g.op("LSTM", [xs, w("a.W", (1, 24, 4)), w("a.R", (1, 24, 6)), w("a.B", (1, 48)), "",
                  "h0", "c0"], "/a", outputs=["ya", "ha", "ca"], hidden_size=6)
    g.op("LSTM", [xs, w("b.W", (1, 24, 4)), w("b.R", (1, 24, 6))], "/b", outputs=["yb"],
         hidden_size=6, direction="reverse")
    yc, hc = g.op("GRU", [xs, w("c.W", (2, 9, 4)), w("c.R", (2, 9, 3)), w("c.B", (2, 18))], "/c",
                  n_out=2, hidden_size=3, direction="bidirectional")
    g.op("Identity", [hc], "/c", outputs=["hc"])
    g.op("Identity", [yc], "/c", outputs=["yc"])
    seq = g.op("Reshape", [g.op("Transpose", [yc], "/d", perm=[0, 2, 1, 3]), i64([5, 2, 6], "/d")], "/d")
    g.op("GRU", [seq, w("d.W", (1, 9, 6)), w("d.R", (1, 9, 3)), w("d.B", (1, 18)),
                 g.const(np.array([5, 5], dtype=np.int32), "/d")], "/d", outputs=["yd"],
         hidden_size=3, linear_before_reset=1)
    m = g.model("recurrent_cells",
                [vinfo("x", [2, 5, 4]), vinfo("h0", [1, 2, 6]), vinfo("c0", [1, 2, 6])],
                [vinfo("ya", [5, 1, 2, 6]), vinfo("ha", [1, 2, 6]), vinfo("ca", [1, 2, 6]),
                 vinfo("yb", [5, 1, 2, 6]), vinfo("hc", [2, 2, 3]), vinfo("yc", [5, 2, 2, 3]),
                 vinfo("yd", [5, 1, 2, 3])], opset=14)
    return m, [g.rng.standard_normal((2, 5, 4)).astype(np.float32),
               (0.5 * g.rng.standard_normal((1, 2, 6))).astype(np.float32),
               (0.5 * g.rng.standard_normal((1, 2, 6))).astype(np.float32)]


def tubelet_embedding():
    """A video transformer's tubelet embedding (VideoMAE's): a 3-D Conv whose windows
    tile the clip (kernel = strides [2, 4, 4], a bias), flattened to tokens and
    transposed as the model then does. Import makes the Conv the product it is."""
    g = G(seed=1018)
    i64 = lambda v, s: g.const(np.array(v, dtype=np.int64), s)
    w = g.weight("proj.weight", (16, 3, 2, 4, 4), 3 * 2 * 4 * 4)
    y = g.op("Conv", ["x", w, g.bias("proj.bias", 16)], "/proj", kernel_shape=[2, 4, 4],
             strides=[2, 4, 4])
    tokens = g.op("Reshape", [y, i64([2, 16, -1], "/tokens")], "/tokens")
    g.op("Transpose", [tokens], "/tokens", perm=[0, 2, 1], outputs=["y"])
    m = g.model("tubelet_embedding", [vinfo("x", [2, 3, 4, 8, 12])], [vinfo("y", [2, 12, 16])],
                opset=13)
    return m, [g.rng.standard_normal((2, 3, 4, 8, 12)).astype(np.float32)]


# --------------------------------------------------------------------------
# Writing, reference outputs
# --------------------------------------------------------------------------


def ort_outputs(model_path, inputs):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model_path, so, providers=["CPUExecutionProvider"])
    feeds = {i.name: arr for i, arr in zip(sess.get_inputs(), inputs)}
    names = [o.name for o in sess.get_outputs()]
    return names, sess.run(names, feeds)


def write_tensor(path, arr, name):
    with open(path, "wb") as f:
        f.write(numpy_helper.from_array(arr, name).SerializeToString())


def write_case(out, name, m, inputs, **save_kw):
    d = os.path.join(out, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(os.path.join(d, "test_data_set_0"))
    path = os.path.join(d, "model.onnx")
    onnx.save_model(m, path, **save_kw)
    onnx.checker.check_model(path, full_check=True)
    in_names = [i.name for i in m.graph.input]
    for k, (n, arr) in enumerate(zip(in_names, inputs)):
        write_tensor(os.path.join(d, "test_data_set_0", f"input_{k}.pb"), arr, n)
    out_names, outs = ort_outputs(path, inputs)
    for k, (n, arr) in enumerate(zip(out_names, outs)):
        assert np.all(np.isfinite(arr)), f"{name}: non-finite output {n}"
        write_tensor(os.path.join(d, "test_data_set_0", f"output_{k}.pb"), arr, n)
    return path


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------


def small_valid_model():
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(nodes, "small", [vinfo("x", [2, 3])], [vinfo("y", [2, 4])], initializer=[w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    return m


def external_tensor(name, dims, location, length):
    t = TensorProto()
    t.name = name
    t.data_type = F
    t.dims.extend(dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def single_init_model(tensor, out_shape):
    """y = x + tensor (tensor is the only initializer)."""
    nodes = [helper.make_node("Add", ["x", tensor.name], ["y"], name="add")]
    graph = helper.make_graph(nodes, "bad", [vinfo("x", out_shape)], [vinfo("y", out_shape)],
                              initializer=[tensor])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    return m


def write_bad(out):
    d = os.path.join(out, "bad")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)

    def save(name, m_or_bytes):
        data = m_or_bytes if isinstance(m_or_bytes, bytes) else m_or_bytes.SerializeToString()
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

    # empty: no bytes at all (protobuf decodes them as an empty model)
    save("empty.onnx", b"")

    # truncated: a valid model cut inside the graph message (inside the initializer's bytes)
    full = small_valid_model().SerializeToString()
    cut = len(full) // 2
    save("truncated.onnx", full[:cut])

    # not_protobuf: text; 'n' (0x6e) is field 13 with wire type 6, which does not exist
    save("not_protobuf.onnx",
         b"not an onnx model\n" + bytes(np.random.default_rng(7).integers(0, 256, 48, dtype=np.uint8)))

    # unknown_domain
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("FancyOp", ["h"], ["y"], name="fancy", domain="com.example.custom", alpha=2.0),
    ]
    graph = helper.make_graph(nodes, "unknown_domain", [vinfo("x", [2, 3])], [vinfo("y", [2, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                helper.make_opsetid("com.example.custom", 1)],
                          producer_name=PRODUCER)
    m.ir_version = 7
    save("unknown_domain.onnx", m)

    # missing_external: weights in a file that is not there
    save("missing_external.onnx",
         single_init_model(external_tensor("w", [2, 3], "missing_weights.bin", 24), [2, 3]))

    # external_escape: external data location that climbs out of the model directory
    save("external_escape.onnx",
         single_init_model(external_tensor("w", [2, 2], "../../etc/passwd", 16), [2, 2]))

    # size_mismatch: dims say 4x4 floats (64 bytes) but raw_data holds 8
    t = TensorProto()
    t.name, t.data_type = "w", F
    t.dims.extend([4, 4])
    t.raw_data = np.array([1.0, 2.0], dtype=np.float32).tobytes()
    save("size_mismatch.onnx", single_init_model(t, [4, 4]))

    # huge_dims: [2^40, 2^40] floats (element count 2^80 overflows u64) with 16 bytes of data
    t = TensorProto()
    t.name, t.data_type = "w", F
    t.dims.extend([1 << 40, 1 << 40])
    t.raw_data = np.zeros(4, dtype=np.float32).tobytes()
    save("huge_dims.onnx", single_init_model(t, [2, 2]))

    # cycle: a -> b -> a
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="node_a"),
        helper.make_node("Relu", ["a"], ["b"], name="node_b"),
    ]
    graph = helper.make_graph(nodes, "cycle", [vinfo("x", [2, 3])], [vinfo("a", [2, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    save("cycle.onnx", m)

    # dangling: "nowhere" is produced by nothing
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("Add", ["h", "nowhere"], ["y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "dangling", [vinfo("x", [2, 3])], [vinfo("y", [2, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    save("dangling.onnx", m)

    # if_on_data: an If whose condition depends on the input's values
    pos = helper.make_node("ReduceSum", ["x"], ["total"], name="total", keepdims=0)
    cond = helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive")
    branch = lambda op, out: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["x"], [out], name=f"{out}_op")], out, [], [vinfo(out, [2, 3])])
    iff = helper.make_node("If", ["positive"], ["y"], name="data_check",
                           then_branch=branch("Relu", "relu_y"), else_branch=branch("Neg", "neg_y"))
    graph = helper.make_graph(
        [pos, cond, iff], "if_on_data", [vinfo("x", [2, 3])], [vinfo("y", [2, 3])],
        initializer=[numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    onnx.checker.check_model(m, full_check=True)
    save("if_on_data.onnx", m)

    # constant_of_shape_huge: 80 bytes asking for an f32 [2^20, 2^20] (4 TiB), refused
    # before anything is allocated
    node = helper.make_node("ConstantOfShape", ["s"], ["y"])
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [1 << 20, 1 << 20])
    graph = helper.make_graph([node], "g", [], [vinfo("y", [1 << 20, 1 << 20])], initializer=[shape])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 14
    save("constant_of_shape_huge.onnx", m)

    # cubic_on_input: a cubic Resize of the model's input (import computes cubic
    # Resizes of values it knows, as position embeddings; this one needs run time)
    sizes = numpy_helper.from_array(np.array([1, 2, 6, 6], dtype=np.int64), "sizes")
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="upsample", mode="cubic")
    graph = helper.make_graph([node], "cubic_on_input", [vinfo("x", [1, 2, 4, 4])],
                              [vinfo("y", [1, 2, 6, 6])], initializer=[sizes])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    onnx.checker.check_model(m, full_check=True)
    save("cubic_on_input.onnx", m)

    # unknown_attribute: a Relu with an attribute Relu does not have (would be ignored)
    node = helper.make_node("Relu", ["x"], ["y"], name="act", alpha=0.1)
    graph = helper.make_graph([node], "unknown_attribute", [vinfo("x", [2, 3])], [vinfo("y", [2, 3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    save("unknown_attribute.onnx", m)

    # declared_shape: the output is declared [2, 4] but the Relu computes [2, 3]
    node = helper.make_node("Relu", ["x"], ["y"], name="act")
    graph = helper.make_graph([node], "declared_shape", [vinfo("x", [2, 3])], [vinfo("y", [2, 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=PRODUCER)
    m.ir_version = 7
    save("declared_shape.onnx", m)

    # unsupported_ops: a valid model (passes the checker, runs in onnxruntime) with
    # Hardmax x2, TopK x1, NonZero x1 among ordinary ops
    w = numpy_helper.from_array(np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5), "w")
    kk = numpy_helper.from_array(np.array([2], dtype=np.int64), "k")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["e1"], name="matmul_0"),                      # [3,5]
        helper.make_node("Hardmax", ["e1"], ["t"], name="hardmax_0"),                         # [3,5]
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
        helper.make_node("Hardmax", ["r"], ["r2"], name="hardmax_1", axis=0),                 # [3,5]
        helper.make_node("Transpose", ["r2"], ["e2"], name="transpose_0", perm=[1, 0]),       # [5,3]
        helper.make_node("Add", ["e2", "e2"], ["a"], name="add"),
        helper.make_node("TopK", ["a", "k"], ["vals", "idx"], name="topk", axis=-1),           # [5,2]
        helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),                            # [2,?]
        helper.make_node("MatMul", ["vals", "vals_t"], ["y"], name="matmul"),
        helper.make_node("Transpose", ["vals"], ["vals_t"], name="transpose", perm=[1, 0]),
    ]
    graph = helper.make_graph(
        nodes, "unsupported_ops", [vinfo("x", [3, 4])],
        [vinfo("y", [5, 5]), vinfo("idx", [5, 2], I64), vinfo("nz", [2, None], I64)],
        initializer=[w, kk],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], producer_name=PRODUCER)
    m.ir_version = 7
    # keep nodes topologically sorted (Transpose before the MatMul that uses it)
    order = ["matmul_0", "hardmax_0", "relu", "hardmax_1", "transpose_0", "add", "topk", "nonzero",
             "transpose", "matmul"]
    by = {n.name: n for n in m.graph.node}
    del m.graph.node[:]
    m.graph.node.extend(by[n] for n in order)
    onnx.checker.check_model(m, full_check=True)
    save("unsupported_ops.onnx", m)


def unet_tiny():
    """opset 13: a small U-Net as torch exports one: strided convs down, then
    Resize (nearest with scales, as nn.Upsample(scale_factor=2); linear with
    align_corners through sizes) and ConvTranspose up, skips joined by Concat."""
    g = G(seed=1006)
    x = "image"
    e1 = g.op("Relu", [g.conv(x, "/enc1", 3, 8, 3, pad=1, prefix="enc1")], "/enc1")           # [N,8,16,16]
    e2 = g.op("Relu", [g.conv(e1, "/enc2", 8, 16, 3, stride=2, pad=1, prefix="enc2")], "/enc2")  # [N,16,8,8]
    e3 = g.op("Relu", [g.conv(e2, "/enc3", 16, 16, 3, stride=2, pad=1, prefix="enc3")], "/enc3")  # [N,16,4,4]
    empty = g.const(np.array([], dtype=np.float32), "/up1")
    scales = g.const(np.array([1, 1, 2, 2], dtype=np.float32), "/up1")
    u1 = g.op("Resize", [e3, empty, scales], "/up1", mode="nearest",
              coordinate_transformation_mode="asymmetric", nearest_mode="floor")      # [N,16,8,8]
    d1 = g.op("Concat", [u1, e2], "/dec1", axis=1)                                   # [N,32,8,8]
    d1 = g.op("Relu", [g.conv(d1, "/dec1", 32, 8, 3, pad=1, prefix="dec1")], "/dec1")  # [N,8,8,8]
    sizes = g.const(np.array([2, 8, 16, 16], dtype=np.int64), "/up2")
    u2 = g.op("Resize", [d1, "", "", sizes], "/up2", mode="linear",
              coordinate_transformation_mode="align_corners")                       # [N,8,16,16]
    w = g.weight("up3.weight", (8, 4, 2, 2), 8 * 4)
    b = g.bias("up3.bias", 4)
    u3 = g.op("ConvTranspose", [d1, w, b], "/up3", kernel_shape=[2, 2], strides=[2, 2],
              pads=[0, 0, 0, 0], dilations=[1, 1], group=1)                         # [N,4,16,16]
    d2 = g.op("Concat", [u2, u3, e1], "/dec2", axis=1)                               # [N,20,16,16]
    h = g.conv(d2, "/head", 20, 2, 1, prefix="head")
    up = g.op("Resize", [h, "", g.const(np.array([1, 1, 2, 2], dtype=np.float32), "/out")], "/out",
              mode="linear", coordinate_transformation_mode="pytorch_half_pixel",
              outputs=["mask"])                                                      # [N,2,32,32]
    m = g.model("unet_tiny", [vinfo("image", [2, 3, 16, 16])], [vinfo("mask", [2, 2, 32, 32])], opset=13)
    inputs = [g.rng.standard_normal((2, 3, 16, 16)).astype(np.float32)]
    return m, inputs


def deeplab_tiny():
    """opset 13: DeepLabV3 as torchvision exports it, small: a backbone whose last
    stage trades stride for dilation (replace_stride_with_dilation: 3x3 convs with
    dilation 2, padding 2, one depthwise), ASPP (a 1x1 branch, atrous 3x3 branches at
    rates 2 and 3 (padding = rate), an image-pooling branch upsampled by Resize to the
    feature map's size), the 1x1 projection, the head, and a bilinear Resize back to
    the input; plus an uneven-rate atrous conv padded asymmetrically and a dilated
    ConvTranspose, which torch exports for nn.ConvTranspose2d(dilation=2)."""
    g = G(seed=1008)
    x = "input"                                                                        # [2,3,24,24]
    h = g.op("Relu", [g.conv(x, "/backbone/conv1", 3, 8, 3, stride=2, pad=1, prefix="backbone.conv1")],
             "/backbone/relu")                                                         # [2,8,12,12]
    h = g.op("Relu", [g.conv(h, "/backbone/layer2", 8, 16, 3, stride=2, pad=1, prefix="backbone.layer2")],
             "/backbone/layer2/relu")                                                  # [2,16,6,6]
    # layer3/4 keep 6x6: dilation instead of stride.
    y = g.op("Relu", [g.conv(h, "/backbone/layer3/conv2", 16, 16, 3, pad=2, dilation=2,
                             prefix="backbone.layer3.conv2")], "/backbone/layer3/relu")
    y = g.conv(y, "/backbone/layer3/dw", 16, 16, 3, pad=2, dilation=2, group=16,
               prefix="backbone.layer3.dw")
    h = g.op("Relu", [g.op("Add", [y, h], "/backbone/layer3")], "/backbone/layer3/relu_1")  # [2,16,6,6]
    s = "/classifier/classifier.0"
    b0 = g.op("Relu", [g.conv(h, f"{s}/convs.0", 16, 8, 1, bias=False, prefix="aspp.0")], f"{s}/convs.0/relu")
    b1 = g.op("Relu", [g.conv(h, f"{s}/convs.1", 16, 8, 3, pad=2, dilation=2, bias=False,
                              prefix="aspp.1")], f"{s}/convs.1/relu")
    b2 = g.op("Relu", [g.conv(h, f"{s}/convs.2", 16, 8, 3, pad=3, dilation=3, bias=False,
                              prefix="aspp.2")], f"{s}/convs.2/relu")
    pool = g.op("GlobalAveragePool", [h], f"{s}/convs.3/pool")
    pool = g.op("Relu", [g.conv(pool, f"{s}/convs.3/conv", 16, 8, 1, bias=False, prefix="aspp.3")],
                f"{s}/convs.3/relu")
    sizes = g.const(np.array([2, 8, 6, 6], dtype=np.int64), f"{s}/convs.3")
    b3 = g.op("Resize", [pool, "", "", sizes], f"{s}/convs.3", mode="linear",
              coordinate_transformation_mode="pytorch_half_pixel")                      # [2,8,6,6]
    cat = g.op("Concat", [b0, b1, b2, b3], f"{s}/cat", axis=1)                          # [2,32,6,6]
    y = g.op("Relu", [g.conv(cat, f"{s}/project", 32, 8, 1, bias=False, prefix="aspp.project")],
             f"{s}/project/relu")
    # Uneven rates, padded as SAME over the dilated span (5 rows: 2 and 2; 4 columns: 1
    # and 2) in pads (onnxruntime refuses auto_pad SAME with dilations).
    w = g.weight("atrous_same.weight", (8, 8, 3, 2), 8 * 6)
    y = g.op("Relu", [g.op("Conv", [y, w], "/classifier/same", pads=[2, 1, 2, 2],
                           dilations=[2, 3], kernel_shape=[3, 2])], "/classifier/same/relu")
    w = g.weight("up.weight", (8, 4, 3, 3), 8 * 9)
    up = g.op("ConvTranspose", [y, w, g.bias("up.bias", 4)], "/classifier/up", kernel_shape=[3, 3],
              strides=[2, 2], pads=[2, 2, 1, 1], dilations=[2, 2], output_padding=[1, 1])  # [2,4,14,14]
    h = g.conv(up, "/classifier/classifier.4", 4, 3, 1, prefix="classifier.4")
    out_sizes = g.const(np.array([2, 3, 24, 24], dtype=np.int64), "/Resize")
    g.op("Resize", [h, "", "", out_sizes], "/Resize", mode="linear",
         coordinate_transformation_mode="pytorch_half_pixel", outputs=["out"])          # [2,3,24,24]
    m = g.model("deeplab_tiny", [vinfo("input", [2, 3, 24, 24])], [vinfo("out", [2, 3, 24, 24])],
                opset=13)
    inputs = [g.rng.standard_normal((2, 3, 24, 24)).astype(np.float32)]
    return m, inputs


def attention_forms():
    """opset 17: attention as three exporters write it, heads 2 x 16 wide on [2, 8, 32]
    tokens, each fed by its own Linear projections:
    - HF BERT eager: q @ k.transpose(-1, -2) on [B, H, S, D] heads, / sqrt(16), plus
      the extended padding mask [B, 1, 1, S], Softmax, @ v;
    - torch's SDPA decomposition (nn.MultiheadAttention, ViT): q * sqrt(scale) and
      Transpose(k, [0, 1, 3, 2]) * sqrt(scale), MatMul, Softmax, MatMul;
    - nn.TransformerEncoderLayer at opset 17 without SDPA: k viewed [B, S, H, D] and
      transposed straight to [B, H, D, S] ([0, 2, 3, 1]), scores * 0.25;
    - GPT-2 eager (transformers 4.4x): scores / 4, then Where(the causal buffer sliced
      to [1, 1, S, S], scores, finfo(float32).min);
    - HF eager with a 4-D causal mask (newer transformers): scores / 4 plus a
      [B, 1, S, S] float mask of finfo.min above the diagonal;
    - HF BERT eager (transformers 5): the padding mask expanded over the queries to a
      [B, 1, S, S] constant, every row of a matrix alike."""
    B, S, D, H = 2, 8, 32, 2
    DH = D // H
    g = G(seed=1013)
    x = "tokens"

    def heads(t, scope, perm=(0, 2, 1, 3)):
        t = g.op("Reshape", [t, g.const(np.array([B, S, H, DH], dtype=np.int64), scope)], scope)
        return g.op("Transpose", [t], scope, perm=list(perm))

    def linear(t, scope, name):
        t = g.op("MatMul", [t, g.weight(f"{name}.weight_t", (D, D), D, 1.0)], scope)
        return g.op("Add", [t, g.bias(f"{name}.bias", D)], scope)

    def merge(ctx, scope):
        ctx = g.op("Transpose", [ctx], scope, perm=[0, 2, 1, 3])
        return g.op("Reshape", [ctx, g.const(np.array([B, S, D], dtype=np.int64), scope)], scope)

    # HF BERT eager.
    s = "/bert"
    q, k, v = (heads(linear(x, f"{s}/{n}", f"bert.{n}"), f"{s}/{n}") for n in "qkv")
    kt = g.op("Transpose", [k], f"{s}/kt", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, kt], s)
    scores = g.op("Div", [scores, g.const(np.array(4.0, dtype=np.float32), s)], s)
    pad = np.zeros((B, 1, 1, S), dtype=np.float32)
    pad[1, ..., S - 3:] = np.finfo(np.float32).min
    scores = g.op("Add", [scores, g.const(pad, f"{s}/mask")], s)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], s, axis=-1), v], s)
    h = merge(ctx, s)

    # SDPA's decomposition.
    s = "/sdpa"
    q, k, v = (heads(linear(h, f"{s}/{n}", f"sdpa.{n}"), f"{s}/{n}") for n in "qkv")
    root = g.const(np.array(np.sqrt(1 / np.sqrt(DH)), dtype=np.float32), s)
    qs = g.op("Mul", [q, root], s)
    ks = g.op("Mul", [g.op("Transpose", [k], f"{s}/kt", perm=[0, 1, 3, 2]), root], s)
    ctx = g.op("MatMul", [g.op("Softmax", [g.op("MatMul", [qs, ks], s)], s, axis=-1), v], s)
    h = merge(ctx, s)

    # nn.TransformerEncoderLayer without SDPA.
    s = "/encoder"
    q = heads(linear(h, f"{s}/q", "encoder.q"), f"{s}/q")
    kt = heads(linear(h, f"{s}/k", "encoder.k"), f"{s}/k", perm=(0, 2, 3, 1))
    v = heads(linear(h, f"{s}/v", "encoder.v"), f"{s}/v")
    scores = g.op("Mul", [g.op("MatMul", [q, kt], s), g.const(np.array(0.25, dtype=np.float32), s)], s)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], s, axis=-1), v], s)
    h = merge(ctx, s)

    def scaled_scores(s):
        q, k, v = (heads(linear(h, f"{s}/{n}", f"{s[1:]}.{n}"), f"{s}/{n}") for n in "qkv")
        kt = g.op("Transpose", [k], f"{s}/kt", perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [q, kt], s)
        return g.op("Div", [scores, g.const(np.array(4.0, dtype=np.float32), s)], s), v

    # GPT-2 eager: the causal buffer (max positions 16) sliced to the sequence.
    s = "/gpt2"
    scores, v = scaled_scores(s)
    buffer = g.init("gpt2.bias", np.tril(np.ones((16, 16), dtype=bool))[None, None])
    i64 = lambda *v: g.const(np.array(v, dtype=np.int64), s)  # noqa: E731
    keep = g.op("Slice", [buffer, i64(0, 0), i64(S, S), i64(2, 3)], s)
    fill = g.const(np.array(np.finfo(np.float32).min, dtype=np.float32), s)
    scores = g.op("Where", [keep, scores, fill], s)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], s, axis=-1), v], s)
    h = merge(ctx, s)

    # HF BERT eager (transformers 5): the padding mask expanded over the queries.
    s = "/padded4d"
    scores, v = scaled_scores(s)
    pad = np.zeros((B, 1, S, S), dtype=np.float32)
    pad[1, ..., S - 3:] = np.finfo(np.float32).min
    scores = g.op("Add", [scores, g.const(pad, f"{s}/mask")], s)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], s, axis=-1), v], s)
    h = merge(ctx, s)

    # HF eager with a 4-D causal mask.
    s = "/causal4d"
    scores, v = scaled_scores(s)
    mask = np.where(np.tril(np.ones((S, S), dtype=bool)), 0.0, np.finfo(np.float32).min)
    mask = np.broadcast_to(mask.astype(np.float32), (B, 1, S, S)).copy()
    scores = g.op("Add", [scores, g.const(mask, f"{s}/mask")], s)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], s, axis=-1), v], s)
    g.op("Identity", [merge(ctx, s)], "/out", outputs=["out"])
    m = g.model("attention_forms", [vinfo("tokens", [B, S, D])], [vinfo("out", [B, S, D])], opset=17)
    return m, [g.rng.standard_normal((B, S, D)).astype(np.float32)]


def layer_norm_forms():
    """opset 14 (no LayerNormalization yet): layer norms written out as exporters do,
    between Linear layers: torch's nn.LayerNorm (ReduceMean, Sub, Pow 2, ReduceMean,
    Add eps, Sqrt, Div, Mul gamma, Add beta); the Keras-like form (d * d, Reciprocal
    of the Sqrt, Mul); and one without its affine part."""
    B, S, D = 2, 5, 16
    g = G(seed=1014)

    def linear(t, name):
        t = g.op("MatMul", [t, g.weight(f"{name}.weight_t", (D, D), D, 1.0)], f"/{name}")
        return g.op("Add", [t, g.bias(f"{name}.bias", D)], f"/{name}")

    def stats(t, s):
        mean = g.op("ReduceMean", [t], s, axes=[-1], keepdims=1)
        return g.op("Sub", [t, mean], s)

    def eps(s, v):
        return g.const(np.array(v, dtype=np.float32), s)

    h = linear("x", "fc1")
    s = "/ln_torch"
    d = stats(h, s)
    var = g.op("ReduceMean", [g.op("Pow", [d, g.const(np.array(2.0, dtype=np.float32), s)], s)], s,
               axes=[-1], keepdims=1)
    y = g.op("Div", [d, g.op("Sqrt", [g.op("Add", [var, eps(s, 1e-5)], s)], s)], s)
    w = g.init("ln_torch.weight", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
    y = g.op("Add", [g.op("Mul", [y, w], s), g.bias("ln_torch.bias", D)], s)
    h = linear(y, "fc2")
    s = "/ln_keras"
    d = stats(h, s)
    var = g.op("ReduceMean", [g.op("Mul", [d, d], s)], s, axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, eps(s, 1e-3)], s)], s)], s)
    w = g.init("ln_keras.weight", (1.0 + 0.1 * g.rng.standard_normal(D)).astype(np.float32))
    y = g.op("Add", [g.op("Mul", [w, g.op("Mul", [inv, d], s)], s), g.bias("ln_keras.bias", D)], s)
    h = linear(y, "fc3")
    s = "/ln_plain"
    d = stats(h, s)
    var = g.op("ReduceMean", [g.op("Pow", [d, g.const(np.array(2.0, dtype=np.float32), s)], s)], s,
               axes=[-1], keepdims=1)
    g.op("Div", [d, g.op("Sqrt", [g.op("Add", [var, eps(s, 1e-6)], s)], s)], s, outputs=["y"])
    m = g.model("layer_norm_forms", [vinfo("x", [B, S, D])], [vinfo("y", [B, S, D])], opset=14)
    return m, [(3.0 * g.rng.standard_normal((B, S, D)) + 1.0).astype(np.float32)]


def triangles():
    """opset 14: Trilu on a run-time tensor (upper from diagonal 1, lower from -1, and
    the default upper triangle), and CumSum as HF exports write position ids (a mask
    of ones summed along the sequence, minus one) and with exclusive and reverse sums."""
    g = G(seed=1015)
    x = "x"                                                               # [2, 5, 5]
    k = lambda v: g.const(np.array(v, dtype=np.int64), "/k")  # noqa: E731
    up = g.op("Trilu", [x, k(1)], "/upper", upper=1)
    low = g.op("Trilu", [x, k(-1)], "/lower", upper=0)
    plain = g.op("Trilu", [x], "/plain")
    a = g.op("Add", [g.op("Add", [up, low], "/sum"), plain], "/sum")
    ones = g.const(np.ones((2, 5), dtype=np.int64), "/mask")
    pos = g.op("Sub", [g.op("CumSum", [ones, k(1)], "/pos"), k(1)], "/pos")  # 0..4 per row
    wpe = g.init("wpe", (0.5 * g.rng.standard_normal((5, 5))).astype(np.float32))
    emb = g.op("Gather", [wpe, pos], "/wpe", axis=0)                      # [2, 5, 5]
    floats = g.const(np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32), "/f")
    rev = g.op("CumSum", [floats, k(0)], "/rev", exclusive=1, reverse=1)  # [14, 12, 9, 5, 0]
    g.op("Mul", [g.op("Add", [a, emb], "/y"), rev], "/y", outputs=["y"])
    m = g.model("triangles", [vinfo("x", [2, 5, 5])], [vinfo("y", [2, 5, 5])], opset=14)
    return m, [g.rng.standard_normal((2, 5, 5)).astype(np.float32)]


def fp16_trap():
    """opset 13: an MLP on raw (unnormalised, 0..255) features whose first Gemm's
    products exceed fp16's 65504 on some elements before a Div brings them back;
    ordinary layers follow. Correct in f32; a naive fp16 conversion overflows there
    and ends in inf/NaN (what `ampgraph bisect` repairs: tests/numerics_bisect.rs)."""
    g = G(seed=1007)
    x = "features"                                                  # [4,32] in 0..255
    w = (g.rng.standard_normal((48, 32)) * 48.0).astype(np.float32)  # unnormalised weights
    h = g.op("Gemm", [x, g.init("fc1.weight", w), g.bias("fc1.bias", 48)], "/fc1",
             alpha=1.0, beta=1.0, transB=1)                        # |h| up to ~2e5
    h = g.op("Div", [h, g.const(np.array(1e4, dtype=np.float32), "/scale")], "/scale")
    h = g.op("Relu", [h], "/act1")
    h = g.op("Tanh", [g.gemm(h, "/fc2", 48, 32, "fc2")], "/act2")
    h = g.op("Relu", [g.gemm(h, "/fc3", 32, 32, "fc3")], "/act3")
    h = g.op("Gemm", [h, g.weight("head.weight", (10, 32), 32, 1.0), g.bias("head.bias", 10)],
             "/head", alpha=1.0, beta=1.0, transB=1, outputs=["logits"])
    m = g.model("fp16_trap", [vinfo("features", [4, 32])], [vinfo("logits", [4, 10])], opset=13)
    inputs = [g.rng.uniform(0, 255, (4, 32)).astype(np.float32)]
    return m, inputs


# Models that break a naive fp16 conversion on purpose, under tests/data/onnx/numerics
# (the model tests, which hold every model within the fp16 bound, skip that folder).
NUMERICS_MODELS = {
    "fp16_trap": fp16_trap,
}


# --------------------------------------------------------------------------

MODELS = {
    "resnet_tiny": resnet_tiny,
    "mobilenet_tiny": mobilenet_tiny,
    "mobilenet_v3_style": mobilenet_v3_style,
    "transformer_tiny": transformer_tiny,
    "opset_misc": opset_misc,
    "unet_tiny": unet_tiny,
    "deeplab_tiny": deeplab_tiny,
    "exporter_constants": exporter_constants,
    "einsum_cases": einsum_cases,
    "control_flow": control_flow,
    "gelu_forms": gelu_forms,
    "dynamic_axes": dynamic_axes,
    "positions": positions,
    "attention_forms": attention_forms,
    "layer_norm_forms": layer_norm_forms,
    "triangles": triangles,
    "runtime_positions": runtime_positions,
    "cubic_positions": cubic_positions,
    "fourier_mixing": fourier_mixing,
    "col2im_blocks": col2im_blocks,
    "recurrent_cells": recurrent_cells,
    "tubelet_embedding": tubelet_embedding,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: tests/data/onnx)")
    ap.add_argument("--only", help="write only this model (one of MODELS, or bad)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.only == "bad":
        write_bad(args.out)
        return
    if args.only:
        m, inputs = MODELS[args.only]()
        write_case(args.out, args.only, m, inputs)
        print(f"wrote {args.only}", file=sys.stderr)
        return

    for name, build in MODELS.items():
        m, inputs = build()
        write_case(args.out, name, m, inputs)
        if name == "resnet_tiny":
            ext = onnx.ModelProto()
            ext.CopyFrom(m)
            write_case(args.out, "external_data", ext, inputs,
                       save_as_external_data=True, all_tensors_to_one_file=True,
                       location="weights.bin", size_threshold=0)
        print(f"wrote {name}", file=sys.stderr)
    print("wrote external_data", file=sys.stderr)
    numerics = os.path.join(args.out, "numerics")
    os.makedirs(numerics, exist_ok=True)
    for name, build in NUMERICS_MODELS.items():
        m, inputs = build()
        write_case(numerics, name, m, inputs)
        print(f"wrote numerics/{name}", file=sys.stderr)
    write_bad(args.out)
    print("wrote bad/", file=sys.stderr)


if __name__ == "__main__":
    main()
