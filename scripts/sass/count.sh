#!/bin/bash
# count.sh KERNEL.cu [FUNCTION] [TOP]: the SASS (sm_90) of a generated kernel, compiled
# on the CPU as the executor compiles it (scripts/sass/setup.sh first): registers and
# shared memory, then FUNCTION's (default k) instruction count and its TOP (default 12)
# opcodes. The instructions of a kernel bound by issue are its time: dump the kernels
# with `AMPGRAPH_DUMP_KERNELS=DIR cargo test --release -p ampgraph-exec --lib --
# dump_kernels`, then count one before and after a change. The SASS lands in
# /tmp/count.sass (a loop's body: between its branch labels).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
T=$root/.cuda-tools
C=$(ls -d $T/x/nvidia/cu* | head -1)
fn=${2:-k}
$T/nvrtc_ptx "$1" /tmp/count.ptx "$C/include"
$C/bin/ptxas -arch=sm_90 -O3 -v /tmp/count.ptx -o /tmp/count.cubin 2>&1 | grep -E "registers|spill" | sed 's/^ptxas info *: //'
PATH=$C/bin:$PATH $C/bin/cuobjdump -sass /tmp/count.cubin > /tmp/count.sass
awk -v f="$fn" '$0 ~ "Function : " f "$" {on=1; next} /Function :/ {on=0} on' /tmp/count.sass |
  grep -E '^\s+/\*[0-9a-f]{4}\*/' | sed -E 's/^\s+\/\*[0-9a-f]+\*\/\s+//; s/\s*;.*//' > /tmp/count.txt
echo "$fn: $(wc -l < /tmp/count.txt) instructions"
awk '{op=$1; if (op ~ /^@/) op=$2; split(op, a, "."); n[a[1]]++} END {for (k in n) print n[k], k}' /tmp/count.txt |
  sort -rn | head -${3:-12} | tr '\n' ' '
echo
