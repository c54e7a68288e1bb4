#!/bin/bash
# On the GPU machine, in bundle/: torchvision's ResNet-50, MobileNetV3-Large and
# EfficientNet-B0 (random weights, batch 2) exported, rewritten with AMP f16
# (`rewrite --amp`), then run on the GPU (the CUDA pipeline: NHWC, pointwise
# convolutions as products, fusions) and on the CPU (the graph as AMP wrote it): the
# largest difference of the logits relative to their largest value, per model.
# Results under $OUT/real_check.txt.
mkdir -p /tmp/rc
timeout 120 python3 - <<'PY' > $OUT/real_check.txt 2>&1
import torch, torchvision.models as tvm
for name in ["resnet50", "mobilenet_v3_large", "efficientnet_b0"]:
    torch.manual_seed(0)
    m = getattr(tvm, name)().eval()
    torch.onnx.export(m, (torch.randn(2, 3, 224, 224),), f"/tmp/rc/{name}.onnx", opset_version=17, dynamo=False, input_names=["x"], output_names=["y"])
PY
for m in resnet50 mobilenet_v3_large efficientnet_b0; do
  ./ampgraph rewrite /tmp/rc/$m.onnx --amp -o /tmp/rc/$m.json >> $OUT/real_check.txt 2>&1
  for d in cpu cuda; do
    timeout 120 ./ampgraph run /tmp/rc/$m.json --device $d --json > /tmp/rc/$m.$d.json 2>> $OUT/real_check.txt
  done
  python3 - "$m" <<'PY' >> $OUT/real_check.txt 2>&1
import json, sys
import numpy as np
m = sys.argv[1]
def values(d):
    out = json.load(open(f"/tmp/rc/{m}.{d}.json"))["outputs"][0]["values"]
    return np.array(out, dtype=np.float64).ravel()
a, b = values("cpu"), values("cuda")
print(f"{m}: {a.size} logits, |cpu| max {np.abs(a).max():.3e}, max |cuda - cpu| / max |cpu| = {np.abs(a - b).max() / np.abs(a).max():.3e}")
PY
done
cat $OUT/real_check.txt | grep -v "^\[\|Warning\|warn"
