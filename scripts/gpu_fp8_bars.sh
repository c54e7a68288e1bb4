#!/bin/bash
# Issue 44's bars in bundle/ (after scripts/make_bundle.sh and bundle_keep.sh --pack
# tests bench wheels): a round of the GPU test binaries (label $1), then our mlp and
# transformer train steps in BF16 and FP8 (current, then delayed scaling), each mode in
# a process of its own, 300 timed steps after 50, BF16 then FP8 and then FP8 then BF16
# (the order cancels the GPU's warming: a BF16 step runs 4.01 ms for its first ~100 ms
# of load and 4.15-4.25 after, so a BF16 run that follows no other ran fast and an FP8
# run that follows a BF16 one slow), beside torch.compile bf16 and torchao's float8
# training ($OUT/bars.txt; each run's median, then the medians of its first 50 and
# last 200 steps).
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
# One process's median, and the medians of its first 50 and last 200 steps.
windows() {
  python3 -c 'import re, statistics as s, sys
v = [float(x) for x in re.search(r"step ms in order: (.*)", open(sys.argv[1]).read()).group(1).split()]
print("%s median %.3f first50 %.3f last200 %.3f" % (sys.argv[2], s.median(v), s.median(v[:50]), s.median(v[-200:])))' "$@"
}
for w in $workloads; do
  for scaling in current delayed; do
    echo "## ours $w (FP8: $scaling scaling)" >> $out
    for m in amp_bf16 amp_fp8 amp_fp8 amp_bf16; do
      AMPGRAPH_AMP_FP8_SCALING=$scaling timeout 120 ./bench --workload $w --modes $m \
        --phases train --iters 300 --warmup 50 --print-times > /tmp/run.txt 2>&1
      echo "exit $?" >> $out
      grep '"mode"' /tmp/run.txt >> $out
      windows /tmp/run.txt "$w $scaling $m" >> $out
    done
  done
done
python3 -m pip install -q --no-index --no-deps --target /tmp/ao wheels/torchao-*.whl >> $out 2>&1
echo "## torch" >> $out
PYTHONPATH=/tmp/ao timeout 200 python3 torch_fp8_anchor.py --only "${workloads// /,}" >> $out 2>&1
echo "exit $?" >> $out
[ -f $OUT/rounds.txt ] && cat $OUT/rounds.txt
grep -hE "^## | median |\"mode\": \"(compile|torchao)|rror" $out | cut -c1-160
