#!/bin/bash
# Nsight Compute on the transformer's attention kernels (BF16 step, plain launches):
# where their time goes (tensor pipe, issue slots, occupancy), in bundle/
# (scripts/make_bundle.sh, then bundle_keep.sh --pack bench): `bash ncu_attention.sh`,
# the report in $OUT/ncu.txt.
set -u
tar xzf bins.tar.gz; [ -f kc.tar.gz ] && [ ! -d /tmp/kc ] && tar xzf kc.tar.gz -C /tmp; export AMPGRAPH_KERNEL_CACHE=/tmp/kc
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
timeout 400 $NCU --clock-control none -k regex:'^k_(fwd|dq|dkv)$' --launch-skip 3 --launch-count 3 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
  ./bench --workload transformer --modes amp_bf16 --phases train --iters 1 --warmup 1 > $OUT/ncu.txt 2>&1
echo "exit $?"
grep -E "k_fwd|k_dq|k_dkv|Duration|Compute \(SM\) Throughput|Memory Throughput|hmma|inst_issued|pipe_fma|pipe_xu|Achieved Occupancy|Registers Per|Stall|Issue Slot|Warp Cycles Per Issued" $OUT/ncu.txt | head -80
