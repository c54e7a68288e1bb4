#!/bin/bash
# On the GPU machine, in bundle/ (ampgraph, kc.tar.gz): FP8 inference on exports nobody
# here wrote. torchvision's ViT-B/16 (its zero-initialised head drawn at random), HF's
# BERT-base and GPT-2 124M (their last hidden states; random weights, eager attention)
# exported with a symbolic batch, then per model:
# - accuracy at batch 2 on the GPU: the outputs of BF16 AMP, FP8 by the cost model and
#   FP8 on every product (`--fp8-everywhere`) against the f32 graph's, as the largest
#   difference and the RMS difference relative to the f32 outputs' largest value;
# - speed at a serving batch: `bench --amp bf16`, `--amp fp8` (the cost model's
#   choice, current scaling) and the `--fp8-everywhere` rewrite, with the FP8 products
#   each chose;
# - static scaling: amaxes calibrated at batch 2 on seed 0 (`--calibrate seed:1
#   --save-fp8-amaxes`), its accuracy on seed 1 (fp8s), and at the serving batch the
#   cost model's choice and every product with those amaxes (`--fp8-amaxes`).
# Results in $OUT/fp8_real.txt.
set -u
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
if [ -f kc.tar.gz ] && [ ! -d /tmp/kc ]; then tar xzf kc.tar.gz -C /tmp; fi
out=$OUT/fp8_real.txt
d=/tmp/fp8real && mkdir -p $d
timeout 200 python3 - <<'PY' >> $out 2>&1
import torch, torchvision.models as tvm
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
from onnx_exports import LastHidden, export
d = "/tmp/fp8real"
torch.manual_seed(0)
vit = tvm.vit_b_16()
torch.nn.init.normal_(vit.heads.head.weight, std=0.02)
export(vit, torch.randn(2, 3, 224, 224), f"{d}/vit_b_16.onnx", batch_axis=True)
torch.manual_seed(0)
export(LastHidden(BertModel(BertConfig(attn_implementation="eager"))), torch.randint(0, 30000, (2, 128)), f"{d}/bert_base.onnx", batch_axis=True)
torch.manual_seed(0)
export(LastHidden(GPT2Model(GPT2Config(attn_implementation="eager"))), torch.randint(0, 50000, (2, 512)), f"{d}/gpt2.onnx", batch_axis=True)
print("exported")
PY
# model, its input's shape after the batch, the serving batch
for spec in "vit_b_16 3x224x224 64" "bert_base 128 32" "gpt2 512 16"; do
  set -- $spec
  m=$1 rest=$2 batch=$3
  small="x=2x$rest" big="x=${batch}x$rest"
  echo "## $m (accuracy at batch 2; speed at batch $batch)" >> $out
  ./ampgraph rewrite $d/$m.onnx --input $small --amp --dtype bf16 -o $d/$m.bf16.bin >> $out 2>&1
  ./ampgraph rewrite $d/$m.onnx --input $small --amp --dtype fp8 -o $d/$m.fp8.bin >> $out 2>&1
  ./ampgraph rewrite $d/$m.onnx --input $small --amp --dtype fp8 --fp8-everywhere -o $d/$m.fp8e.bin >> $out 2>&1
  timeout 300 ./ampgraph rewrite $d/$m.onnx --input $small --amp --dtype fp8 --fp8-everywhere --fp8-scaling static \
    --calibrate seed:1 --save-fp8-amaxes $d/$m.amax.json -o $d/$m.fp8s.bin >> $out 2>&1
  timeout 120 ./ampgraph run $d/$m.onnx --input $small --device cuda --seed 1 --json > $d/$m.f32.json 2>> $out
  for v in bf16 fp8 fp8e fp8s; do
    timeout 120 ./ampgraph run $d/$m.$v.bin --device cuda --seed 1 --json > $d/$m.$v.json 2>> $out
  done
  python3 - "$m" <<'PY' >> $out 2>&1
import json, sys
import numpy as np
m = sys.argv[1]
def values(v):
    try:
        out = json.load(open(f"/tmp/fp8real/{m}.{v}.json"))["outputs"][0]["values"]
    except (OSError, ValueError, KeyError, IndexError):
        return None  # the run failed: its error is above
    return np.array(out, dtype=np.float64).ravel()
ref = values("f32")
top = np.abs(ref).max()
for v in ["bf16", "fp8", "fp8e", "fp8s"]:
    x = values(v)
    if x is None:
        print(f"{m} {v}: no outputs")
        continue
    print(f"{m} {v}: {ref.size} values, max |x - f32| / max |f32| = {np.abs(x - ref).max() / top:.3e}, rms {np.sqrt(np.mean((x - ref) ** 2)) / top:.3e}")
PY
  for v in "fp8" "fp8 --fp8-everywhere"; do
    echo "rewrite --dtype $v at batch $batch:" >> $out
    ./ampgraph rewrite $d/$m.onnx --input $big --amp --dtype $v --report -o $d/$m.big.bin 2>&1 | grep "FP8 GEMMs" >> $out
  done
  for a in bf16 fp8; do
    echo "bench --amp $a:" >> $out
    timeout 150 ./ampgraph bench $d/$m.onnx --input $big --amp $a --device cuda --iterations 30 --warmup 5 --json 2>&1 | grep -A1 -E '"wall_ms"|"device_ms"|"enqueue_ms"|error' | grep -v -e '--' | tr -d '\n ' >> $out
    echo >> $out
  done
  echo "bench of the --fp8-everywhere rewrite:" >> $out
  timeout 150 ./ampgraph bench $d/$m.big.bin --device cuda --iterations 30 --warmup 5 --json 2>&1 | grep -A1 -E '"wall_ms"|"device_ms"|"enqueue_ms"|error' | grep -v -e '--' | tr -d '\n ' >> $out
  echo >> $out
  for v in "" "--fp8-everywhere"; do
    echo "static scaling $v at batch $batch:" >> $out
    ./ampgraph rewrite $d/$m.onnx --input $big --amp --dtype fp8 --fp8-scaling static --fp8-amaxes $d/$m.amax.json $v \
      --report -o $d/$m.static.bin 2>&1 | grep -E "FP8 GEMMs|error" >> $out
    timeout 150 ./ampgraph bench $d/$m.static.bin --device cuda --iterations 30 --warmup 5 --json 2>&1 | grep -A1 -E '"wall_ms"|"device_ms"|"enqueue_ms"|error' | grep -v -e '--' | tr -d '\n ' >> $out
    echo >> $out
  done
done
cat $out | grep -v "^\[\|Warning\|warn"
