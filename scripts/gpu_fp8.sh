#!/bin/bash
# Issue 44's bars, in bundle/ (scripts/make_bundle.sh): our mlp and transformer train
# steps in BF16 and FP8 AMP (bench --modes amp_bf16,amp_fp8: FP8 where the cost model
# says it pays), current and delayed scaling, beside torch.compile bf16 and torchao's
# float8 training with torch.compile (fp8.txt); GPT-2 124M's and the mlp's steps with
# every product the GPU takes in FP8 (--fp8-everywhere: what the cost model keeps)
# (fp8.txt); GPT-2 124M's row: BF16 and FP8 under delayed scaling, interleaved twice in
# one process, then torch.compile bf16 and torchao float8 on Hugging Face's GPT-2
# (fp8.txt); GPT-2 trained 1500 steps on a learnable walk (gpu_convergence.sh's) in
# BF16 and in FP8 everywhere, the validation loss every 250 (fp8_gpt2.txt). PART=bars,
# gpt2, everywhere or convergence runs one part (default: all; about 9 minutes in all).
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
part=${PART:-all}
out=$OUT/fp8.txt
# run LABEL SECONDS COMMAND...: appends to fp8.txt with its exit status.
run() { local label=$1 secs=$2; shift 2; echo "## $label" >> $out; timeout $secs "$@" >> $out 2>&1; echo "exit $?" >> $out; }
if [ "$part" = all ] || [ "$part" = bars ]; then
  for w in mlp transformer; do
    run "ours $w (FP8: current scaling)" 100 ./bench --workload $w --modes amp_bf16,amp_fp8 --phases train
    AMPGRAPH_AMP_FP8_SCALING=delayed run "ours $w (FP8: delayed scaling)" 70 ./bench --workload $w --modes amp_fp8 --phases train
  done
  python3 -m pip install -q --no-index --no-deps --target /tmp/ao wheels/torchao-*.whl >> $out 2>&1
  PYTHONPATH=/tmp/ao run torch 200 python3 torch_fp8_anchor.py --only mlp,transformer
fi
if [ "$part" = all ] || [ "$part" = gpt2 ]; then
  AMPGRAPH_AMP_FP8_SCALING=delayed run "ours gpt2 (FP8: delayed scaling)" 150 ./bench --workload gpt2 \
    --modes amp_bf16,amp_fp8,amp_bf16,amp_fp8 --phases train
  python3 -m pip install -q --no-index --no-deps --target /tmp/ao wheels/torchao-*.whl >> $out 2>&1
  PYTHONPATH=/tmp/ao run "torch gpt2" 240 python3 torch_fp8_anchor.py --only gpt2
fi
if [ "$part" = all ] || [ "$part" = everywhere ]; then
  run "gpt2" 90 ./bench --workload gpt2 --modes amp_bf16,amp_fp8 --phases train
  run "gpt2 everywhere" 70 ./bench --workload gpt2 --modes amp_fp8 --phases train --fp8-everywhere
  run "mlp everywhere" 40 ./bench --workload mlp --modes amp_fp8 --phases train --fp8-everywhere
  AMPGRAPH_AMP_FP8_SCALING=delayed run "mlp everywhere delayed" 40 ./bench --workload mlp --modes amp_fp8 --phases train --fp8-everywhere
fi
if [ "$part" = all ] || [ "$part" = convergence ]; then
  python3 walk_tokens.py /tmp/walk
  for p in "bf16" "fp8 --fp8-everywhere"; do
    echo "## gpt2 $p" >> $OUT/fp8_gpt2.txt
    timeout 150 ./gpt2_train --data /tmp/walk/train.bin --val /tmp/walk/val.bin --steps 1500 --batch 8 \
      --seq 512 --warmup 40 --precision $p --print-every 250 --val-every 250 --val-batches 16 >> $OUT/fp8_gpt2.txt 2>&1
    echo "exit $?" >> $OUT/fp8_gpt2.txt
  done
fi
grep -hE "^## |FP8 GEMMs|\"mode\"|val loss|exit|rror" $out $OUT/fp8_gpt2.txt 2>/dev/null | cut -c1-160
