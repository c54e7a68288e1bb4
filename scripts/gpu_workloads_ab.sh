#!/bin/bash
# On the GPU machine, in bundle/: workloads timed by this commit's bench and by
# `bench_before` (an earlier commit's, built beside it), alternated twice, same call.
# WORKLOADS (default "mlp transformer convnet"), MODES (default amp_fp16), ARGS (more
# bench arguments, e.g. "--phases train") and TIMEOUT (seconds a run, default 90) pick
# what runs; the environment passes through (AMPGRAPH_AMP_FP8_SCALING=delayed for FP8's
# delayed scaling). Results in $OUT/workloads.txt.
# The modes of MODES run in one process, in order: fair between the two builds, not
# between the modes (a BF16 step runs fast for its first ~100 ms of load, and a mode
# after another runs on a warmer GPU); SEPARATE=1 runs each mode in a process of its
# own, the second round in the reverse order.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
: > $OUT/workloads.txt
for round in 1 2; do
  for w in ${WORKLOADS:-mlp transformer convnet}; do
    modes=${MODES:-amp_fp16}
    if [ "${SEPARATE:-0}" = 1 ]; then
      modes=$(echo "$modes" | tr ',' '\n')
      [ $round = 2 ] && modes=$(echo "$modes" | tac)
    fi
    for b in bench_before bench; do
      echo "## round $round $w $b" >> $OUT/workloads.txt
      for m in $modes; do
        timeout ${TIMEOUT:-90} ./$b --workload $w --modes $m ${ARGS:-} >> $OUT/workloads.txt 2>&1
        echo "exit $?" >> $OUT/workloads.txt
      done
    done
  done
done
grep -E "^## |median|train|infer|exit" $OUT/workloads.txt | head -120
