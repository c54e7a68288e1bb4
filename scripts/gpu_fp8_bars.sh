#!/bin/bash
# Issue 44's bars in bundle/ (after scripts/make_bundle.sh and bundle_keep.sh --pack
# tests bench wheels): a round of the GPU test binaries (label $1), then our mlp and
# transformer train steps in BF16 and FP8 (current, then delayed scaling), each pair
# twice in one process, interleaved, 50 timed steps (the BF16 step moves by 3% between
# calls and with the clocks), beside torch.compile bf16 and torchao's float8 training
# ($OUT/bars.txt).
# ROUND=0 leaves the round out (exec/ unchanged since the last one); WORKLOADS picks
# the workloads (default "mlp transformer").
set -u
[ -f bins.tar.gz ] && tar xzf bins.tar.gz
if [ "${ROUND:-1}" = 1 ]; then
  KC_OUT=1 bash gpu_tests_round.sh "${1:-round}" 400 > /dev/null
elif [ -f kc.tar.gz ] && [ ! -d /tmp/kc ]; then
  tar xzf kc.tar.gz -C /tmp
fi
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
out=$OUT/bars.txt
workloads=${WORKLOADS:-mlp transformer}
for w in $workloads; do
  for scaling in current delayed; do
    echo "## ours $w (FP8: $scaling scaling)" >> $out
    AMPGRAPH_AMP_FP8_SCALING=$scaling timeout 120 ./bench --workload $w --modes amp_bf16,amp_fp8,amp_bf16,amp_fp8 \
      --phases train --iters 50 >> $out 2>&1
    echo "exit $?" >> $out
  done
done
python3 -m pip install -q --no-index --no-deps --target /tmp/ao wheels/torchao-*.whl >> $out 2>&1
echo "## torch" >> $out
PYTHONPATH=/tmp/ao timeout 200 python3 torch_fp8_anchor.py --only "${workloads// /,}" >> $out 2>&1
echo "exit $?" >> $out
[ -f $OUT/rounds.txt ] && cat $OUT/rounds.txt
grep -hE "^## |\"mode\"|exit|rror" $out | cut -c1-160
