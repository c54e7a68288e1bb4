#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): issue 43's training anchors
# in one call: `bench --workload W` (ours, AMP: fp16 for the images, bf16 for the
# language models) and scripts/torch_zoo_train.py (PyTorch eager and torch.compile on
# the same models and sizes), and scripts/zoo/torch_check.py (the zoo's numpy
# references against PyTorch's models). Results under $OUT: zoo_ours.txt,
# zoo_torch.txt, zoo_reference.txt. DROPOUT=P builds GPT-2 and BERT with that dropout
# after the embeddings and each sublayer on both sides (unset: ours none, PyTorch
# Hugging Face's configs).
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
MODELS=${MODELS:-resnet50,vit_b_16,bert_base,gpt2}
compile=
[ "${NO_COMPILE:-0}" = 1 ] && compile=--no-compile
dropout=
[ -n "${DROPOUT:-}" ] && dropout="--dropout $DROPOUT"
: > $OUT/zoo_ours.txt
for m in ${MODELS//,/ }; do
  mode=amp_fp16
  case $m in bert_base|gpt2) mode=amp_bf16 ;; esac
  timeout ${OURS_SECONDS:-150} ./bench --workload $m --modes $mode --phases train,infer \
    --iters 20 --warmup 6 $dropout >> $OUT/zoo_ours.txt 2>&1
  echo "$m exit $?" >> $OUT/zoo_ours.txt
done
timeout ${TORCH_SECONDS:-300} python3 ../scripts/torch_zoo_train.py --only $MODELS $compile $dropout \
  > $OUT/zoo_torch.txt 2>&1
echo "torch exit $?" >> $OUT/zoo_torch.txt
# The zoo's numpy references against PyTorch's models on the same weights.
timeout 120 python3 ../scripts/zoo/torch_check.py > $OUT/zoo_reference.txt 2>&1
echo "torch_check exit $?" >> $OUT/zoo_reference.txt
grep -E "^\||exit|error" $OUT/zoo_ours.txt | tail -20; tail -12 $OUT/zoo_torch.txt; cat $OUT/zoo_reference.txt
