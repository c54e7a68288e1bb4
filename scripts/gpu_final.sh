#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): the GPU tests (side by
# side), then, alone on the GPU, the bench beside torch_anchor.py; outputs under $OUT.
# `./gpu_final.sh tests` or `./gpu_final.sh bench` runs one half (each fits one
# 10-minute device call); no argument runs both.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
part=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date; } > $OUT/env.txt
run_test() { local name=$1; shift; timeout 400 "$@" > $OUT/t_$name.txt 2>&1; echo "$name exit $?" >> $OUT/t_$name.txt; }
if [ "$part" != bench ]; then
  run_test ops ./cuda_ops --test-threads 4 &
  AMPGRAPH_ORACLE_DIR=$PWD/oracle run_test session ./cuda_session --test-threads 4 &
  run_test fused ./cuda_fused &
  run_test executor ./cuda_executor &
  run_test pool ./cuda_pool --test-threads 4 &
  wait
fi
if [ "$part" != tests ]; then
  for w in mlp transformer; do timeout 120 ./bench --workload $w > $OUT/ours_$w.txt 2>&1; done
  timeout 180 python3 torch_anchor.py --only mlp,transformer --modes fp32,tf32,amp_fp16,amp_bf16,compile_fp16 > $OUT/torch.txt 2>&1
fi
