#!/bin/bash
# Issue 44's bars in one call, in bundle/: our mlp and transformer train steps in BF16
# and FP8 AMP (bench --modes amp_bf16,amp_fp8: FP8 where the cost model says it pays;
# the summary's FP8 line says how many products), beside torch.compile bf16 and
# torchao's float8 training with torch.compile. Results in $OUT/fp8.txt.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
: > $OUT/fp8.txt
for w in mlp transformer; do
  echo "## ours $w (FP8: current scaling)" >> $OUT/fp8.txt
  timeout 150 ./bench --workload $w --modes amp_bf16,amp_fp8 --phases train >> $OUT/fp8.txt 2>&1
  echo "exit $?" >> $OUT/fp8.txt
  echo "## ours $w (FP8: delayed scaling)" >> $OUT/fp8.txt
  AMPGRAPH_AMP_FP8_SCALING=delayed timeout 150 ./bench --workload $w --modes amp_fp8 --phases train >> $OUT/fp8.txt 2>&1
  echo "exit $?" >> $OUT/fp8.txt
done
echo "## torch" >> $OUT/fp8.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/ao wheels/torchao-*.whl >> $OUT/fp8.txt 2>&1
PYTHONPATH=/tmp/ao timeout 300 python3 torch_fp8_anchor.py --only mlp,transformer >> $OUT/fp8.txt 2>&1
echo "exit $?" >> $OUT/fp8.txt
grep -E "^## |FP8 GEMMs|median|\"mode\"|exit|rror" $OUT/fp8.txt | head -60
