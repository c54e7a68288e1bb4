#!/bin/bash
# On a multi-GPU machine, in bundle/ (scripts/make_bundle.sh; device tool: carry
# ["bundle"], kind nvidia-h100-x2 / -x4 / -x8, command `cd bundle && bash
# ../scripts/gpu_ddp.sh [N]`): data-parallel training, PyTorch DDP (torch_ddp.py) beside
# ours (`bench --replicas`, threads, and under torchrun, one process per GPU), for
# transformer and convnet in AMP fp16, on 1 GPU and on N
# (default: every GPU of `nvidia-smi -L`). Outputs under $OUT: ddp.jsonl (PyTorch's JSON
# lines), torch_ddp.log (their stdout/stderr), ours_ddp.txt (the bench's), runs.txt (each
# command and its exit status; a failed run is recorded there and the script goes on),
# env_ddp.txt. WORKLOADS (default "transformer convnet") picks the workloads, SYNC_BN=1
# adds the convnet with synchronized batch norm on both sides. NVLink multicast stays off (exported below; torch_ddp.py refuses to run
# otherwise). Each run has a timeout (T_TORCH=90, T_OURS=120 s; override in the environment).
set -u
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${1:-$(nvidia-smi -L | wc -l)}
T_TORCH=${T_TORCH:-90} T_OURS=${T_OURS:-120}
here=$(cd "$(dirname "$0")" && pwd)
py=torch_ddp.py; [ -e "$py" ] || py=$here/torch_ddp.py
anchor=$PWD; [ -e torch_anchor.py ] || anchor=$here/../../shared/bench
# The NCCL of the pip package nvidia-nccl-cu13 (nvidia/nccl/lib, also for CUDA 13), for
# a Rust program that loads libnccl.so.2 at run time.
nccl_lib=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null) || nccl_lib=
if [ -n "$nccl_lib" ] && [ -d "$nccl_lib" ]; then
  # cudarc opens libnccl.so; the wheel ships only libnccl.so.2.
  mkdir -p /tmp/nccl_link && ln -sf "$nccl_lib/libnccl.so.2" /tmp/nccl_link/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl_link:$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  echo "nvidia-nccl-cu13 not found: libnccl.so.2 from the default library path"; nccl_lib=
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date; echo "N=$N py=$py anchor=$anchor"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; env | grep -E 'NVLS|MULTICAST'
  [ -n "$nccl_lib" ] && ls -l "$nccl_lib"; } 2>&1 | tee $OUT/env_ddp.txt

fails=0
# run LOG SECONDS COMMAND...: appends to $OUT/LOG, records the exit status in runs.txt
run() {
  local log=$1 secs=$2; shift 2
  echo "## $*" >> $OUT/$log
  timeout $secs "$@" >> $OUT/$log 2>&1; local rc=$?
  echo "exit $rc: $*" | tee -a $OUT/runs.txt
  [ $rc = 0 ] || fails=$((fails + 1))
}
# The data-parallel GPU tests first (NCCL, 2 GPUs).
[ -x ./cuda_data_parallel ] && run tests_ddp.txt 300 ./cuda_data_parallel --test-threads 1 --nocapture
gpus="1"; [ "$N" != 1 ] && gpus="1 $N"
for w in ${WORKLOADS-transformer convnet}; do
  for n in $gpus; do
    run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node $n $py --workload $w --mode amp_fp16 \
      --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl
  done
  run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node 1 $py --workload $w --mode amp_fp16 \
    --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl --no-ddp
  run ours_ddp.txt $T_OURS ./bench --workload $w --modes amp_fp16 --phases train
  for n in $gpus; do
    run ours_ddp.txt $T_OURS ./bench --workload $w --modes amp_fp16 --phases train --replicas $n
  done
  # One process per GPU, as torchrun starts PyTorch's (issue 45): the same line.
  [ "$N" != 1 ] && run ours_ddp.txt $T_OURS torchrun --standalone --nproc-per-node $N --no-python \
    ./bench --workload $w --modes amp_fp16 --phases train --replicas $N
done
# SYNC_BN=1: the convnet with synchronized batch norm on both sides.
if [ "${SYNC_BN:-0}" = 1 ]; then
  for n in $gpus; do
    run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node $n $py --workload convnet --mode amp_fp16 \
      --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl --sync-bn
    run ours_ddp.txt $T_OURS ./bench --workload convnet --modes amp_fp16 --phases train --replicas $n --sync-batch-norm
  done
fi
echo "$fails failed run(s)" | tee -a $OUT/runs.txt
[ -e $OUT/ddp.jsonl ] && cat $OUT/ddp.jsonl
