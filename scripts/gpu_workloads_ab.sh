#!/bin/bash
# On the GPU machine, in bundle/: our three workloads (AMP f16, train and infer) timed
# by this commit's bench and by `bench_before` (an earlier commit's, built beside it),
# alternated twice, same call. Results in $OUT/workloads.txt.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
: > $OUT/workloads.txt
for round in 1 2; do
  for w in mlp transformer convnet; do
    for b in bench_before bench; do
      echo "## round $round $w $b" >> $OUT/workloads.txt
      timeout 90 ./$b --workload $w --modes amp_fp16 >> $OUT/workloads.txt 2>&1
      echo "exit $?" >> $OUT/workloads.txt
    done
  done
done
grep -E "^## |median|train|infer" $OUT/workloads.txt | head -80
