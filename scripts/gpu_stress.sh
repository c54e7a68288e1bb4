#!/bin/bash
# On the GPU machine, in bundle/: cuda_executor (its convolution tests: algorithm
# searches, per-convolution and whole-step captures in several threads) again and
# again, each on a fresh kernel cache, while the other GPU test binaries load the GPU
# from other processes, for $1 seconds (default 150). Prints how many runs passed and
# failed; the first failures' outputs go to $OUT/stress_fail_N.txt.
cd "$(dirname "$0")"
seconds=${1:-150}
export AMPGRAPH_KERNEL_CACHE=/tmp/kc_load; rm -rf /tmp/kc_load
start=$(date +%s)
( while :; do ./cuda_ops --test-threads 4 >/dev/null 2>&1; done ) &
( while :; do ./cuda_session --test-threads 4 >/dev/null 2>&1; ./cuda_pool --test-threads 4 >/dev/null 2>&1; done ) &
( while :; do ./cuda_numerics >/dev/null 2>&1; ./cuda_fused >/dev/null 2>&1; done ) &
passed=0; failed=0
while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
  d=$(mktemp -d)
  if AMPGRAPH_KERNEL_CACHE=$d timeout 120 ./cuda_executor --test-threads 8 > /tmp/stress_run.txt 2>&1; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    [ $failed -le 3 ] && cp /tmp/stress_run.txt "$OUT/stress_fail_$failed.txt"
  fi
  rm -rf "$d"
done
kill $(jobs -p) 2>/dev/null; pkill -f 'cuda_(ops|session|pool|numerics|fused)' 2>/dev/null
echo "stress: cuda_executor cold under load for ${seconds}s: $passed passed, $failed failed"
