#!/bin/bash
# On the GPU machine, in bundle/ (scripts/make_bundle.sh; carry [".whl", "bundle"] for
# onnxconverter-common's wheel): exports torchvision's resnet18 and mobilenet_v3_small
# and a TransformerEncoder (scripts/onnx/torchvision_models.py), then runs the ONNX
# tests over them beside the checked-in models: import on the CPU and the GPU against
# onnxruntime, export round trips, AMP exports against onnxconverter-common's fp16
# conversion (tables under $OUT). The zoo of models users bring (torchvision_models.py
# --zoo, imported on the CPU: docs/onnx.md's coverage table) runs on the CPU machine,
# with torch, torchvision and transformers installed there: its exports take longer
# than a device call.
#
# TINY=1 runs instead the checked-in models and the small configurations of the zoo's
# Hugging Face architectures (`torchvision_models.py --tiny --out bundle/tiny`, exported
# on the CPU machine with their onnxruntime outputs, carried in the bundle) on the GPU
# in f32 and AMP: $OUT/onnx_tiny.txt.
set -u
# The test binaries find tests/data and scripts/ under the path they were built in.
mkdir -p /work && [ -e /work/main ] || ln -s "$(cd .. && pwd)" /work/main
if [ "${TINY:-0}" = 1 ]; then
  AMPGRAPH_ONNX_MODELS=$PWD/tiny AMPGRAPH_KERNEL_CACHE=/tmp/kc timeout ${TIMEOUT:-400} ./onnx_models \
    models_run_on_the_gpu --nocapture > $OUT/onnx_tiny.txt 2>&1
  echo "onnx_models exit $?" >> $OUT/onnx_tiny.txt
  grep -E "exit|relative|panicked|CPU" $OUT/onnx_tiny.txt | tail -80
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site
timeout 240 python3 ../scripts/onnx/torchvision_models.py --out /tmp/tv > $OUT/onnx_torchvision.txt 2>&1
echo "export exit $?" >> $OUT/onnx_torchvision.txt
export AMPGRAPH_ONNX_MODELS=/tmp/tv AMPGRAPH_KERNEL_CACHE=/tmp/kc
timeout 300 ./onnx_models --nocapture --test-threads 1 > $OUT/onnx_models.txt 2>&1; echo "onnx_models exit $?" >> $OUT/onnx_models.txt
timeout 240 ./onnx_export --nocapture --test-threads 1 > $OUT/onnx_export.txt 2>&1; echo "onnx_export exit $?" >> $OUT/onnx_export.txt
timeout 120 python3 ../scripts/onnx/convert_reference.py --dir /tmp/tv > $OUT/onnx_converter.txt 2>&1
for m in /tmp/tv/*/; do ls -la $m; done >> $OUT/onnx_torchvision.txt
grep -E "exit|error|relative|failed" $OUT/onnx_*.txt | tail -40
