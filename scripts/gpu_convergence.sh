#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): issue 43's convergence checks
# in one call, AMP against f32 after the same steps from the same start. GPT-2 124M on a
# learnable stream (a random walk over 512 tokens, each the last plus one of -3..=3: the
# best loss is ln 7 = 1.95; ../shared/bench/gpt2/mkdata.py's walk over 4096 tokens keeps
# reaching tokens not seen yet in 400 steps, its loss jumping with the windows), bf16
# and fp32, AdamW 3e-4 with 40 steps of warmup and a cosine, gradients clipped to norm 1;
# ResNet-50 on the image-folder example's synthetic folder (32x32 digits in colour, 10
# classes, 1000 a class and 250 a class held out), AMP f16 and fp32, twelve seeds (one
# run's loss moves with its seed far more than with the precision: the comparison is of
# each seed's AMP run with its f32 run, over the seeds, with standard errors), momentum
# SGD 0.02 with 60 steps of warmup and a cosine to a tenth over 6 epochs (468 steps);
# convergence_stats.py compares the last epoch's held-out losses.
# Results under $OUT: convergence.txt. GPT2_PRECISIONS= or RESNET_SEEDS= (empty) skips a part;
# CONTROL=1 adds a second f32 run per seed (below).
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
STEPS=${STEPS:-400}
python3 walk_tokens.py /tmp/walk
out=$OUT/convergence.txt
: > $out
for p in ${GPT2_PRECISIONS-bf16 fp32}; do
  echo "## gpt2 $p" >> $out
  timeout 200 ./gpt2_train --data /tmp/walk/train.bin --val /tmp/walk/val.bin --steps $STEPS --batch 8 \
    --seq 512 --warmup 40 --precision $p --print-every 50 --val-every 100 --val-batches 16 >> $out 2>&1
  echo "exit $?" >> $out
done
RESNET_ARGS=${RESNET_ARGS:---synthetic-per-class 1000 --epochs 6 --batch 128 --lr 0.02 --warmup 60}
# CONTROL=1 runs each seed's f32 twice (`fp32-again`): GPU f32 is not bit-reproducible
# (cuDNN's algorithms, atomics), and the second run's distance from the first is the
# floor under any AMP - f32 difference.
for seed in ${RESNET_SEEDS-1 2 3 4 5 6 7 8 9 10 11 12}; do
  for mode in amp fp32 ${CONTROL:+fp32-again}; do
    flag=; [ $mode != amp ] && flag=--fp32
    echo "## resnet50 seed $seed $mode" >> $out
    timeout 90 ./image_folder --model resnet50 $RESNET_ARGS --seed $seed $flag >> $out 2>&1
    echo "exit $?" >> $out
  done
done
grep -E "^##|val loss|exit" $out
python3 convergence_stats.py $out | tee -a $out
