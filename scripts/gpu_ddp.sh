#!/bin/bash
# On a multi-GPU machine, in bundle/ (scripts/make_bundle.sh; device tool: carry
# ["bundle"], kind nvidia-h100-x2 / -x4 / -x8, command `cd bundle && bash
# ../scripts/gpu_ddp.sh [N]`): data-parallel training, PyTorch DDP (torch_ddp.py) beside
# ours (`bench --replicas`, threads, and under torchrun, one process per GPU), for
# transformer and convnet in AMP fp16 (GPT-2 in BF16), on 1 GPU and on N
# (default: every GPU of `nvidia-smi -L`). Outputs under $OUT: ddp.jsonl (PyTorch's JSON
# lines), torch_ddp.log (their stdout/stderr), ours_ddp.txt (the bench's), runs.txt (each
# command and its exit status; a failed run is recorded there and the script goes on),
# env_ddp.txt. WORKLOADS (default "transformer convnet"; "gpt2" too) picks the workloads, SYNC_BN=1
# adds the convnet with synchronized batch norm on both sides, NODES=1 two launcher
# invocations as two nodes (and one of them killed: nodes.txt), SAME_BITS=1 MNIST's
# checkpoints by threads and by processes compared (bits.txt). NVLink multicast stays off (exported below; torch_ddp.py refuses to run
# otherwise). Each run has a timeout (T_TORCH=90, T_OURS=120, T_TESTS=300 s; override in the
# environment).
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
# The data-parallel GPU tests first (NCCL, 2 GPUs); T_TESTS=0 leaves them out.
[ -x ./cuda_data_parallel ] && [ "${T_TESTS:-300}" != 0 ] &&
  run tests_ddp.txt ${T_TESTS:-300} ./cuda_data_parallel --test-threads 1 --nocapture
gpus="1"; [ "$N" != 1 ] && gpus="1 $N"
# QUICK=1 (a short device budget): PyTorch on N GPUs only, and no thread runs: the
# torchrun scaling against our plain step and PyTorch DDP's throughput.
quick=${QUICK:-0}
for w in ${WORKLOADS-transformer convnet}; do
  # GPT-2 trains in BF16, as the zoo and its peers do; the others in fp16 with loss scaling.
  mode=amp_fp16; [ $w = gpt2 ] && mode=amp_bf16
  for n in $gpus; do
    [ $quick = 1 ] && [ $n = 1 ] && continue
    run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node $n $py --workload $w --mode $mode \
      --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl
  done
  [ $quick = 1 ] || run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node 1 $py --workload $w \
    --mode $mode --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl --no-ddp
  run ours_ddp.txt $T_OURS ./bench --workload $w --modes $mode --phases train
  for n in $gpus; do
    [ $quick = 1 ] && continue
    run ours_ddp.txt $T_OURS ./bench --workload $w --modes $mode --phases train --replicas $n
  done
  # One process per GPU, as torchrun starts PyTorch's (issue 45): the same line.
  # BUCKETS="25 4": the gradient buckets' MiB (DDP's bucket_cap_mb), one run each.
  for b in ${BUCKETS:-25}; do
    [ "$N" != 1 ] && run ours_ddp.txt $T_OURS torchrun --standalone --nproc-per-node $N --no-python \
      ./bench --workload $w --modes $mode --phases train --replicas $N --bucket-mib $b
  done
done
# SYNC_BN=1: the convnet with synchronized batch norm on both sides.
if [ "${SYNC_BN:-0}" = 1 ]; then
  for n in $gpus; do
    run torch_ddp.log $T_TORCH torchrun --standalone --nproc-per-node $n $py --workload convnet --mode amp_fp16 \
      --steps 30 --warmup 10 --anchor-dir "$anchor" --out $OUT/ddp.jsonl --sync-bn
    run ours_ddp.txt $T_OURS ./bench --workload convnet --modes amp_fp16 --phases train --replicas $n --sync-batch-norm
  done
fi
# NODES=1 (issue 45): two launcher invocations on this host as two nodes of one GPU each
# (`--nnodes 2 --node-rank 0/1`, node k seeing GPU k alone), then the same with node 1's
# process killed mid-run: node 0 must end in bounded time with an error naming rank 1.
# Logs: nodes.txt; each invocation's exit status and seconds in runs.txt.
if [ "${NODES:-0}" = 1 ] && [ "$N" -ge 2 ]; then
  # node K PORT ITERS SECONDS: one launcher invocation as node K.
  node() {
    CUDA_VISIBLE_DEVICES=$1 timeout $4 torchrun --nnodes 2 --node-rank $1 --nproc-per-node 1 \
      --master-addr 127.0.0.1 --master-port $2 --no-python ./bench --workload transformer \
      --modes amp_fp16 --phases train --replicas 2 --iters $3 > $OUT/node$1.log 2>&1
  }
  for case in plain killed; do
    # Killed: 45 s in; node 0's watcher sees rank 1's connection close and stops it at
    # once (the bench's collective timeout, 120 s, is the bound without it).
    iters=20 secs=$T_OURS; [ $case = killed ] && iters=20000 secs=300
    port=$((29500 + RANDOM % 400)); start=$(date +%s)
    node 0 $port $iters $secs & n0=$!
    node 1 $port $iters $secs & n1=$!
    if [ $case = killed ]; then
      sleep 45
      # The bench process of node 1 (torchrun's child reading GPU 1).
      victim=$(for p in $(pgrep -f 'bench --workload transformer'); do
        tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx 'CUDA_VISIBLE_DEVICES=1' &&
          tr '\0' ' ' < /proc/$p/cmdline | grep -q '^./bench' && echo $p; done | head -1)
      echo "## killed: node 1's bench, pid ${victim:-none}, at $(( $(date +%s) - start )) s" >> $OUT/nodes.txt
      [ -n "$victim" ] && kill -9 $victim
    fi
    wait $n0; rc0=$?; t0=$(( $(date +%s) - start ))
    wait $n1; rc1=$?
    echo "nodes $case: node 0 exit $rc0 after ${t0} s, node 1 exit $rc1" | tee -a $OUT/runs.txt
    { echo "## $case node 0"; tail -5 $OUT/node0.log; echo "## $case node 1"; tail -5 $OUT/node1.log; } >> $OUT/nodes.txt
    if [ $case = plain ]; then [ $rc0 = 0 ] && [ $rc1 = 0 ] || fails=$((fails + 1)); fi
    if [ $case = killed ]; then grep -qE "(rank|replica) 1" $OUT/node0.log && [ $rc0 != 0 ] || fails=$((fails + 1)); fi
  done
  rm -f $OUT/node0.log $OUT/node1.log
fi
# SAME_BITS=1 (issue 45): MNIST trained two epochs by N threads (`--replicas N`) and by N
# processes under torchrun, each writing its checkpoint once: the two files must be equal
# byte for byte (the same weights, loss scale and position). Needs bundle/mnist and
# bundle/mnist_data (bundle_keep.sh --pack ... mnist mnist_data).
if [ "${SAME_BITS:-0}" = 1 ] && [ "$N" -ge 2 ]; then
  rm -f /tmp/threads.ckpt /tmp/procs.ckpt
  run bits.txt $T_OURS ./mnist --data mnist_data --epochs 2 --replicas $N --checkpoint /tmp/threads.ckpt
  run bits.txt $T_OURS torchrun --standalone --nproc-per-node $N --no-python ./mnist --data mnist_data \
    --epochs 2 --checkpoint /tmp/procs.ckpt
  if cmp /tmp/threads.ckpt /tmp/procs.ckpt >> $OUT/bits.txt 2>&1; then
    echo "same bits: threads and processes wrote equal checkpoints ($(stat -c %s /tmp/threads.ckpt) bytes)" | tee -a $OUT/runs.txt
  else
    echo "same bits: the checkpoints differ" | tee -a $OUT/runs.txt; fails=$((fails + 1))
  fi
fi
echo "$fails failed run(s)" | tee -a $OUT/runs.txt
[ -e $OUT/ddp.jsonl ] && cat $OUT/ddp.jsonl
