#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): the GPU tests, then the
# bench beside torch_anchor.py, each output under $OUT.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date; } > $OUT/env.txt
AMPGRAPH_ORACLE_DIR=$PWD/oracle timeout 170 ./cuda_session > $OUT/t_session.txt 2>&1; echo "cuda_session exit $?" >> $OUT/t_session.txt
timeout 40 ./cuda_fused > $OUT/t_fused.txt 2>&1; echo "cuda_fused exit $?" >> $OUT/t_fused.txt
timeout 60 ./cuda_executor > $OUT/t_executor.txt 2>&1; echo "cuda_executor exit $?" >> $OUT/t_executor.txt
for w in mlp transformer; do timeout 90 ./bench --workload $w > $OUT/ours_$w.txt 2>&1; done
timeout 150 python3 torch_anchor.py --only mlp,transformer --modes fp32,tf32,amp_fp16,amp_bf16,compile_fp16 > $OUT/torch.txt 2>&1
timeout 260 ./cuda_ops > $OUT/t_ops.txt 2>&1; echo "cuda_ops exit $?" >> $OUT/t_ops.txt
