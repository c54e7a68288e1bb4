#!/bin/bash
# On the GPU machine, in bundle/: torchvision's ResNet-50, MobileNetV3-Large,
# EfficientNet-B0 and ViT-B/16 (its zero-initialised head drawn at random, so the
# logits are not all 0) and HF's BERT-base (the last hidden state) (random weights,
# batch 2; BERT at sequence 128) exported, rewritten with AMP f16
# (`rewrite --amp`), then run on the GPU (the CUDA pipeline: NHWC, pointwise
# convolutions as products, fusions) and on the CPU (the graph as AMP wrote it): the
# largest difference of the logits relative to their largest value, per model.
# Results under $OUT/real_check.txt.
mkdir -p /tmp/rc
timeout 120 python3 - <<'PY' > $OUT/real_check.txt 2>&1
import torch, torchvision.models as tvm
from onnx_exports import LastHidden, export
for name in ["resnet50", "mobilenet_v3_large", "efficientnet_b0"]:
    torch.manual_seed(0)
    export(getattr(tvm, name)(), torch.randn(2, 3, 224, 224), f"/tmp/rc/{name}.onnx")
torch.manual_seed(0)
m = tvm.vit_b_16()
torch.nn.init.normal_(m.heads.head.weight, std=0.02)
export(m, torch.randn(2, 3, 224, 224), "/tmp/rc/vit_b_16.onnx")
from transformers import BertConfig, BertModel
torch.manual_seed(0)
export(LastHidden(BertModel(BertConfig(attn_implementation="eager"))), torch.randint(0, 30000, (2, 128)), "/tmp/rc/bert_base.onnx")
PY
for m in resnet50 mobilenet_v3_large efficientnet_b0 vit_b_16 bert_base; do
  ./ampgraph rewrite /tmp/rc/$m.onnx --amp -o /tmp/rc/$m.bin >> $OUT/real_check.txt 2>&1
  for d in cpu cuda; do
    timeout 120 ./ampgraph run /tmp/rc/$m.bin --device $d --json > /tmp/rc/$m.$d.json 2>> $OUT/real_check.txt
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
