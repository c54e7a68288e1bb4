#!/bin/bash
# A short GPU round for a small device budget: every GPU test binary side by side on a
# cold cache, each cut at $1 seconds (default 160); prints each binary's result lines.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
t=${1:-160}
run() { local name=$1; shift; timeout $t "$@" > $OUT/q_$name.txt 2>&1; echo "$name exit $?" >> $OUT/q_$name.txt; }
run ops ./cuda_ops --test-threads 8 &
AMPGRAPH_ORACLE_DIR=$PWD/oracle run session ./cuda_session --test-threads 4 &
run fused ./cuda_fused &
run executor ./cuda_executor &
run pool ./cuda_pool --test-threads 4 &
run numerics ./cuda_numerics &
wait
for f in $OUT/q_*.txt; do grep -E "test result|exit|panicked|FAILED" $f | head -5; done
grep -h " ok$" $OUT/q_ops.txt | wc -l
