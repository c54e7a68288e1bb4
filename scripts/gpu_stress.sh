#!/bin/bash
# On the GPU machine, in bundle/: for $1 seconds (default 150), at once,
# - cuda_stress's sessions_in_several_threads_at_once in 4 processes: sessions of a
#   ResNet (AMP), an MLP and a GPT-2 (AMP) made, stepped and dropped over and over in 6
#   threads each, every step's loss against the CPU's (outputs:
#   $OUT/stress_sessions_N.txt); each under $WRAP where set (`WRAP=debug` runs them in
#   cuda-gdb, which prints every thread's stack if one crashes);
# - cuda_executor (its convolution tests: algorithm searches, per-convolution and
#   whole-step captures in several threads) again and again, each on a fresh kernel
#   cache;
# - the other GPU test binaries in loops, loading the GPU from other processes.
# Prints how many cuda_executor runs passed and failed and each session process's
# result; the first failing cuda_executor output goes to $OUT/stress_fail.txt.
cd "$(dirname "$0")"
seconds=${1:-150}
wrap=()
[ "${WRAP:-}" = debug ] && wrap=(cuda-gdb -q -batch -ex run -ex bt -ex "thread apply all bt 16" --args)
export AMPGRAPH_KERNEL_CACHE=/tmp/kc_load; rm -rf /tmp/kc_load
start=$(date +%s)
# Binaries run in turn, again and again (a loop whose binaries are not all here runs none).
load() { for b; do [ -x "./$b" ] || return; done; while :; do for b; do ./$b --test-threads 4 >/dev/null 2>&1; done; done; }
load cuda_ops & load cuda_session cuda_pool & load cuda_numerics cuda_fused &
loads=$(jobs -p)
sessions=()
for n in 1 2 3 4; do
  ( AMPGRAPH_STRESS_SECONDS=$seconds AMPGRAPH_KERNEL_CACHE=/tmp/kc_sessions RUST_BACKTRACE=1 \
      timeout $((seconds + 240)) "${wrap[@]}" ./cuda_stress --exact sessions_in_several_threads_at_once \
      --nocapture > "$OUT/stress_sessions_$n.txt" 2>&1
    echo "exit $?" >> "$OUT/stress_sessions_$n.txt" ) &
  sessions+=($!)
done
passed=0; failed=0
while [ $(( $(date +%s) - start )) -lt "$seconds" ]; do
  d=$(mktemp -d)
  if AMPGRAPH_KERNEL_CACHE=$d timeout 120 ./cuda_executor --test-threads 8 > /tmp/stress_run.txt 2>&1; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    [ $failed -eq 1 ] && cp /tmp/stress_run.txt "$OUT/stress_fail.txt"
  fi
  rm -rf "$d"
done
# The loops' shells, then their binaries (by their own names: a pattern matching any
# command line would match this call's too).
kill $loads 2>/dev/null; pkill -x 'cuda_(ops|session|pool|numerics|fused)' 2>/dev/null
wait "${sessions[@]}"
echo "stress: cuda_executor cold under load for ${seconds}s: $passed passed, $failed failed"
for n in 1 2 3 4; do
  echo "sessions $n: $(grep -hE 'matched the CPU|replayed their|panicked|SIGSEGV|signal|^exit' "$OUT/stress_sessions_$n.txt" | head -6 | tr '\n' ' ')"
done
