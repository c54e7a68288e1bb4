#!/bin/bash
# On the GPU machine, in bundle/: one round of the GPU test binaries side by side
# (gpu_final.sh tests), its results appended to $OUT/rounds.txt with the round's label
# ($1) and the binaries' logs packed into $OUT/logs_<label>.tar.gz (a call returns at
# most 8 files); the kernel cache /tmp/kc stays for the next round on the same machine.
# $2, where given, cuts each binary at that many seconds (a short round for a small
# device budget).
#
# The kernel cache (NVRTC's PTX, keyed by each kernel's source) travels between
# sessions: a bundle holding kc.tar.gz (scripts/make_bundle.sh copies
# .kernel-cache/kc.tar.gz, a cache a round returned) starts from it, and KC_OUT=1 packs
# the PTX this round compiled into $OUT/kc_new.tar.gz (the whole cache, 15 MB and
# more, came back "left out (size)"); merge it into the kept one: `d=$(mktemp -d); tar
# xzf .kernel-cache/kc.tar.gz -C $d; tar xzf <files_at>/kc_new.tar.gz -C $d; tar czf
# .kernel-cache/kc.tar.gz -C $d kc`. A cold round spends minutes in NVRTC (cuda_ops cut at 380 s on an
# H200); with the PTX cached, a fresh machine still spent 188 s in cuda_ops (likely the
# driver compiling the PTX at load) where the same machine's second run took 14 s, so
# KC_OUT=1 also returns the driver's cache ($OUT/nvjit.tar.gz: keep it beside kc.tar.gz).
label=${1:-round}
if [ -f kc.tar.gz ] && [ ! -d /tmp/kc ]; then tar xzf kc.tar.gz -C /tmp; fi
mkdir -p /tmp/kc && touch /tmp/kc_round_start && sleep 1
TEST_TIMEOUT=${2:-400} bash gpu_final.sh tests > /dev/null 2>&1
{ echo "## $label $(date -u +%H:%M:%S)"; for f in $OUT/t_*.txt; do grep -E "test result|exit|panicked" $f | head -4; done; } >> $OUT/rounds.txt
tar czf $OUT/logs_$label.tar.gz -C $OUT $(cd $OUT && ls t_*.txt) && rm -f $OUT/t_*.txt
[ "${KC_OUT:-0}" = 1 ] && (cd /tmp && find kc -type f -newer kc_round_start | tar czf $OUT/kc_new.tar.gz -T -)
# With it the driver's cache of those kernels for this GPU (gpu_final.sh), when small
# enough to travel (make_bundle.sh takes .kernel-cache/nvjit.tar.gz likewise).
[ "${KC_OUT:-0}" = 1 ] && [ -d /tmp/nvjit ] && tar czf $OUT/nvjit.tar.gz -C /tmp nvjit
cat $OUT/rounds.txt
