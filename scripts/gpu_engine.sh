#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh): torchvision's ResNet-50
# (b32), MobileNetV3-Large (b64) and ViT-B/16 (b32) exported by real_models.py, which
# times PyTorch on them (eager fp32, AMP, .half(); torch.compile unless NO_COMPILE=1),
# then `ampgraph bench` on each export, AMP f16: the step replayed as a CUDA graph,
# with the weights as Variables, and op by op; each with a 5-step profile (the sum of
# the kernels' times). Results under $OUT: torch_real.txt, engine.txt (JSON lines).
# MODELS may name any of real_models_six.py's (issue 42's six: resnet50,
# mobilenet_v3_large,efficientnet_b0,vit_b_16,bert_base,gpt2); MODES="graph" times the
# replayed step only; NO_COMPILE=0 times torch.compile too.
export AMPGRAPH_KERNEL_CACHE=/tmp/kc
MODELS=${MODELS:-resnet50,mobilenet_v3_large,vit_b_16}
compile=--no-compile
[ "${NO_COMPILE:-1}" = 0 ] && compile=
timeout ${TORCH_SECONDS:-240} python3 real_models_six.py /tmp/rm --only $MODELS $compile > $OUT/torch_real.txt 2>&1
echo "real_models exit $?" >> $OUT/torch_real.txt
: > $OUT/engine.txt
for m in ${MODELS//,/ }; do
  for mode in ${MODES:-graph --weights-as-variables --op-by-op}; do
    [ "$mode" = graph ] && mode=
    echo "## $m $mode" >> $OUT/engine.txt
    timeout 120 ./ampgraph bench /tmp/rm/$m.onnx --amp f16 --device cuda --iterations 50 --warmup 10 \
      --profile 5 --json $mode >> $OUT/engine.txt 2>&1
    echo "exit $?" >> $OUT/engine.txt
  done
done
python3 engine_table.py $OUT/engine.txt $OUT/torch_real.txt | tee $OUT/engine_table.txt
