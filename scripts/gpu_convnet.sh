#!/bin/bash
# On the GPU machine, in bundle/: the convnet beside PyTorch in one call (outputs under
# $OUT): ours in every mode at the default size and AMP at width 60 (not a multiple of
# 8), torch_anchor.py's convnet rows and its model at width 60, kernel launches.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
timeout 120 ./bench --workload convnet > $OUT/convnet.txt 2>&1
timeout 60 ./bench --workload convnet --width 60 --modes amp_fp16 >> $OUT/convnet.txt 2>&1
modes=fp32,tf32,amp_fp16,amp_bf16,compile_fp16
timeout 150 python3 torch_anchor.py --only convnet --modes $modes > $OUT/torch_convnet.txt 2>&1
timeout 120 python3 torch_convnet_width.py 60 >> $OUT/torch_convnet.txt 2>&1
timeout 90 python3 torch_launches.py --only convnet --modes amp_fp16,compile_fp16 >> $OUT/torch_convnet.txt 2>&1
