#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): the GPU tests (side by
# side), then, alone on the GPU, the bench beside torch_anchor.py; outputs under $OUT
# (7 files: the device returns few, so the benches of every workload go to ours.txt and
# PyTorch's to torch.txt). `./gpu_final.sh tests` or `./gpu_final.sh bench` runs one
# half (each fits one 10-minute device call: the bench half's timeouts add up to 600 s
# at most); no argument runs both.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
# The driver's cache of the PTX it compiled for this GPU (a fresh machine otherwise
# compiles every cached kernel's PTX again at load: likely most of a round's cuda_ops
# time); nvjit.tar.gz is one a round returned (gpu_tests_round.sh KC_OUT=1).
export CUDA_CACHE_PATH=/tmp/nvjit CUDA_CACHE_MAXSIZE=4294967296
if [ -f nvjit.tar.gz ] && [ ! -d /tmp/nvjit ]; then tar xzf nvjit.tar.gz -C /tmp; fi
part=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date; } > $OUT/env.txt
# Each test binary is cut at TEST_TIMEOUT seconds (default 400).
run_test() { local name=$1; shift; timeout ${TEST_TIMEOUT:-400} "$@" > $OUT/t_$name.txt 2>&1; echo "$name exit $?" >> $OUT/t_$name.txt; }
if [ "$part" != bench ]; then
  run_test ops ./cuda_ops --test-threads 4 &
  AMPGRAPH_ORACLE_DIR=$PWD/oracle run_test session ./cuda_session --test-threads 4 &
  run_test fused ./cuda_fused &
  run_test executor ./cuda_executor &
  run_test pool ./cuda_pool --test-threads 4 &
  run_test numerics ./cuda_numerics &
  run_test stress ./cuda_stress &
  wait
fi
if [ "$part" != tests ]; then
  # run_bench WORKLOAD SECONDS
  run_bench() { timeout $2 ./bench --workload $1 >> $OUT/ours.txt 2>&1; echo "bench $1 exit $?" >> $OUT/ours.txt; }
  : > $OUT/ours.txt
  run_bench mlp 120; run_bench transformer 120; run_bench convnet 60
  modes=fp32,tf32,amp_fp16,amp_bf16,compile_fp16
  timeout 180 python3 torch_anchor.py --only mlp,transformer --modes $modes > $OUT/torch.txt 2>&1
  timeout 120 python3 torch_anchor.py --only convnet --modes $modes >> $OUT/torch.txt 2>&1
fi
