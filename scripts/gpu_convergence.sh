#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): issue 43's convergence checks
# in one call, AMP against f32 after the same steps from the same start. GPT-2 124M on a
# learnable stream (a random walk over 512 tokens, each the last plus one of -3..=3: the
# best loss is ln 7 = 1.95; ../shared/bench/gpt2/mkdata.py's walk over 4096 tokens keeps
# reaching tokens not seen yet in 400 steps, its loss jumping with the windows), bf16
# and fp32, AdamW 3e-4 with 40 steps of warmup and a cosine, gradients clipped to norm 1;
# ResNet-50 on the image-folder example's synthetic folder (32x32 digits in colour, 10
# classes, 400 a class), AMP f16 and fp32, eight seeds (the seeds move one run's loss far
# more than the precision does: the comparison is of the means over seeds, with their
# standard errors), momentum SGD 0.02 with 60 steps of warmup and a cosine to a tenth over
# 30 epochs (930 steps); each run's loss is the mean of its last three epochs'.
# Results under $OUT: convergence.txt. GPT2_PRECISIONS= or RESNET_SEEDS= (empty) skips a part.
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
RESNET_ARGS=${RESNET_ARGS:---synthetic-per-class 400 --epochs 30 --batch 128 --lr 0.02 --warmup 60}
for seed in ${RESNET_SEEDS-1 2 3 4 5 6 7 8}; do
  for mode in "" --fp32; do
    echo "## resnet50 seed $seed ${mode:-amp}" >> $out
    timeout 90 ./image_folder --model resnet50 $RESNET_ARGS --seed $seed $mode >> $out 2>&1
    echo "exit $?" >> $out
  done
done
grep -E "^##|val loss|exit" $out
# Per run the mean loss of its last three epochs; per precision their mean and its
# standard error over the seeds.
awk '/^## resnet50/ { if (run) done(); run = $5; n = 0; next }
     /^epoch [0-9]+: loss/ { l[n % 3] = $4 + 0; n++ }
     function done() { if (n >= 3) { v = (l[0] + l[1] + l[2]) / 3; s[run] += v; q[run] += v * v; c[run]++ } }
     END { if (run) done(); for (m in c) { mean = s[m] / c[m]; var = (q[m] / c[m] - mean * mean) * c[m] / (c[m] - 1 + (c[m] == 1));
           printf "resnet50 %s: %d runs, loss of the last three epochs %.4f +- %.4f (standard error)\n", m, c[m], mean, sqrt(var > 0 ? var : 0) / sqrt(c[m]) } }' $out | tee -a $out
