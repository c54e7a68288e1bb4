#!/bin/bash
# Fetches NVIDIA's compiler wheels (NVRTC, ptxas, cuobjdump, nvdisasm, the runtime's
# headers; CUDA 13) into .cuda-tools/ (git-ignored) and builds nvrtc_ptx there: the CPU
# machine then compiles generated kernels to SASS (scripts/sass/count.sh). Needs pip
# and network; nothing else of CUDA.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=.cuda-tools
mkdir -p $T/wheels
pip download -q --no-deps -d $T/wheels nvidia-cuda-nvrtc nvidia-cuda-nvcc nvidia-cuda-cuobjdump \
  nvidia-cuda-nvdisasm nvidia-cuda-runtime nvidia-cuda-crt
for w in $T/wheels/*.whl; do unzip -o -q "$w" -d $T/x; done
C=$(ls -d $T/x/nvidia/cu* | head -1)
gcc -O1 -o $T/nvrtc_ptx scripts/sass/nvrtc_ptx.c -I$C/include -L$C/lib -l:libnvrtc.so.13 -Wl,-rpath,$(realpath $C/lib)
echo "tools in $T ($C)"
