#!/bin/bash
# On the GPU machine, in bundle/: one round of the GPU test binaries side by side
# (gpu_final.sh tests), its results appended to $OUT/rounds.txt with the round's label
# ($1); the kernel cache /tmp/kc stays for the next round on the same machine. $2, where
# given, cuts each binary at that many seconds (a short round for a small device budget).
label=${1:-round}
TEST_TIMEOUT=${2:-400} bash gpu_final.sh tests > /dev/null 2>&1
{ echo "## $label $(date -u +%H:%M:%S)"; for f in $OUT/t_*.txt; do grep -E "test result|exit|panicked" $f | head -4; done; } >> $OUT/rounds.txt
cat $OUT/rounds.txt
