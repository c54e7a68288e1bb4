#!/bin/bash
# Builds what the GPU machine runs (it has no Rust) into bundle/ (git-excluded):
# the GPU test binaries, the ONNX tests and the CLI, the bench, the PyTorch scripts,
# the oracle graphs.
# Then, with the device tool: carry ["bundle"], command `cd bundle && ./gpu_final.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p ampgraph-exec --test cuda_ops --test cuda_fused --test cuda_executor --test cuda_pool
cargo build --release -p ampgraph --test cuda_session --test cuda_numerics --test onnx_models --test onnx_export --test cuda_data_parallel --test cuda_stress
cargo build --release --example bench --example mnist --example image_folder --example gpt2
mkdir -p bundle/oracle
for t in cuda_ops cuda_fused cuda_executor cuda_pool cuda_session cuda_numerics onnx_models onnx_export cuda_data_parallel cuda_stress; do
  cp "$(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1)" "bundle/$t"
done
cp target/release/examples/bench target/release/examples/mnist target/release/examples/image_folder bundle/
# bundle/gpt2/ holds GPT-2's peers: the example is gpt2_train there.
cp target/release/examples/gpt2 bundle/gpt2_train
cargo build --release --bin ampgraph && cp target/release/ampgraph bundle/
strip bundle/cuda_ops bundle/cuda_fused bundle/cuda_executor bundle/cuda_pool bundle/cuda_session bundle/cuda_numerics bundle/onnx_models bundle/onnx_export bundle/cuda_data_parallel bundle/ampgraph bundle/bench bundle/mnist bundle/image_folder bundle/gpt2_train
# cuda_stress keeps its symbols: a crash's stack (gpu_stress.sh WRAP=debug) names functions.
strip --strip-debug bundle/cuda_stress
cp ../shared/bench/torch_anchor.py scripts/torch_launches.py scripts/gemm_layouts.py scripts/gpu_final.sh scripts/energy.py scripts/torch_causal.py scripts/torch_convnet_width.py scripts/gpu_convnet.sh scripts/gpu_mnist_epoch.sh scripts/gpu_onnx.sh scripts/gpu_ddp.sh scripts/torch_ddp.py scripts/gpu_engine.sh scripts/real_models_six.py scripts/gpu_real_check.sh scripts/gpu_zoo.sh scripts/engine_table.py scripts/gpu_workloads_ab.sh scripts/gpu_tests_round.sh scripts/gpu_stress.sh scripts/gpu_gpt2.sh scripts/gpu_convergence.sh scripts/convergence_stats.py scripts/gpu_fp8.sh scripts/torch_fp8_anchor.py scripts/gemm_fp8_shapes.py scripts/gpu_fp8_round.sh scripts/gpu_fp8_bars.sh scripts/gpu_fp8_real.sh scripts/onnx_exports.py scripts/walk_tokens.py scripts/kernel_timer.cu scripts/attention_check.cu scripts/ncu_attention.sh ../shared/bench/real_models.py ../shared/bench/torch_mnist_epoch.py bundle/
mkdir -p bundle/trace && cp scripts/trace/* bundle/trace/
# The kernel cache a GPU round returned (gpu_tests_round.sh KC_OUT=1), where kept.
[ -f .kernel-cache/kc.tar.gz ] && cp .kernel-cache/kc.tar.gz bundle/
# The driver's compiled kernels for the H200 (gpu_final.sh), where kept and small
# enough to travel beside the binaries (a call carries 64 MiB).
[ -f .kernel-cache/nvjit.tar.gz ] && [ $(stat -c %s .kernel-cache/nvjit.tar.gz) -lt 16000000 ] &&
  cp .kernel-cache/nvjit.tar.gz bundle/
cp ../shared/oracle/public/*.json bundle/oracle/ 2>/dev/null || true
mkdir -p bundle/mnist_data && cp examples/data/mnist/*.gz bundle/mnist_data/
# GPT-2's peers (gpu_gpt2.sh): ../shared/bench/gpt2's scripts, and llm.c's source where a
# snapshot of karpathy/llm.c is on this machine (the search tool's fetch puts it under
# /work/.mirror), with the one change CUDA 13 needs (cudaMemAdvise takes a location).
mkdir -p bundle/gpt2 && cp ../shared/bench/gpt2/*.py ../shared/bench/gpt2/run_anchors.sh bundle/gpt2/
LLMC_REPO=${LLMC_REPO:-/work/.mirror/karpathy+llm.c/repo}
if [ -d "$LLMC_REPO" ] && [ ! -d bundle/gpt2/llm.c ]; then
  mkdir -p bundle/gpt2/llm.c
  git -C "$LLMC_REPO" archive HEAD train_gpt2.cu llmc Makefile LICENSE dev/unistd.h | tar x -C bundle/gpt2/llm.c
  sed -i 's/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
    bundle/gpt2/llm.c/llmc/cuda_utils.cuh
fi
# torchao (the FP8 peer, torch_fp8_anchor.py) for the GPU machine's torch 2.11: its
# wheel is pure Python.
pip download -q torchao==0.17.0 --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
  --only-binary=:all: -d bundle/wheels || echo "no torchao wheel: gpu_fp8.sh times our side only"
du -sh bundle
