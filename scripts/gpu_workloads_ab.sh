#!/bin/bash
# On the GPU machine, in bundle/: workloads timed by this commit's bench and by
# `bench_before` (an earlier commit's, built beside it), alternated twice, same call.
# WORKLOADS (default "mlp transformer convnet"), MODES (default amp_fp16), ARGS (more
# bench arguments, e.g. "--phases train") and TIMEOUT (seconds a run, default 90) pick
# what runs; the environment passes through (AMPGRAPH_AMP_FP8_SCALING=delayed for FP8's
# delayed scaling). Results in $OUT/workloads.txt.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
: > $OUT/workloads.txt
for round in 1 2; do
  for w in ${WORKLOADS:-mlp transformer convnet}; do
    for b in bench_before bench; do
      echo "## round $round $w $b" >> $OUT/workloads.txt
      timeout ${TIMEOUT:-90} ./$b --workload $w --modes ${MODES:-amp_fp16} ${ARGS:-} >> $OUT/workloads.txt 2>&1
      echo "exit $?" >> $OUT/workloads.txt
    done
  done
done
grep -E "^## |median|train|infer|exit" $OUT/workloads.txt | head -120
