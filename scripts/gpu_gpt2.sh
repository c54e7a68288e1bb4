#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): issue 43's GPT-2 124M bars in
# one call: llm.c (built here from bundle/gpt2/llm.c into /tmp/llmc, run as
# ../shared/bench/gpt2/run_anchors.sh runs it), `bench --workload gpt2` without and with
# dropout 0.1, and scripts/torch_zoo_train.py on the same models (Hugging Face's GPT-2
# with the same dropouts, none on attention), B=16, T=1024, bf16, AdamW. Results under
# $OUT: gpt2_llmc.txt, gpt2_ours_d*.txt, gpt2_torch_d*.txt; a summary on stdout.
export AMPGRAPH_KERNEL_CACHE=${AMPGRAPH_KERNEL_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
if [ ! -d gpt2/llm.c ]; then
  echo "no bundle/gpt2/llm.c: run scripts/make_bundle.sh where karpathy/llm.c is fetched" >&2
  exit 2
fi
rm -rf /tmp/llmc && cp -r gpt2/llm.c /tmp/llmc
(cd /tmp/llmc && timeout 240 make train_gpt2cu NO_MULTI_GPU=1 USE_CUDNN=0 GPU_COMPUTE_CAPABILITY=90 \
  > $OUT/gpt2_llmc_build.txt 2>&1) || { tail -5 $OUT/gpt2_llmc_build.txt; exit 1; }
(cd gpt2 && python3 mkdata.py > /dev/null)
(cd /tmp/llmc && timeout 120 ./train_gpt2cu -i /tmp/d/train.bin -j /tmp/d/val.bin -e d12 -b 16 \
  -t 1024 -x 40 -v 10000 -s 100000 -h 0 > $OUT/gpt2_llmc.txt 2>&1)
grep -E 'step +40/|device memory' $OUT/gpt2_llmc.txt
for d in 0 0.1; do
  timeout 120 ./bench --workload gpt2 --modes amp_bf16 --phases train --iters 20 --warmup 6 \
    --dropout $d > $OUT/gpt2_ours_d$d.txt 2>&1
  echo "ours dropout $d: $(grep -E '^\| gpt2' $OUT/gpt2_ours_d$d.txt)"
done
for d in 0 0.1; do
  timeout 200 python3 ../scripts/torch_zoo_train.py --only gpt2 --dropout $d > $OUT/gpt2_torch_d$d.txt 2>&1
  grep '{' $OUT/gpt2_torch_d$d.txt
done
