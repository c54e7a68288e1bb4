#!/bin/bash
# One device call for FP8 work, in bundle/ (scripts/make_bundle.sh, then
# `bash scripts/bundle_keep.sh --pack tests bench`): unpacks the binaries, runs a round of
# the GPU test binaries (gpu_tests_round.sh, label $1, the kernel cache packed into
# $OUT), issue 44's bars (gpu_fp8.sh PART=bars) and the FP8 product against bf16 at the
# workloads' shapes (gemm_fp8_shapes.py, $OUT/gemm_fp8.txt).
set -u
[ -f bins.tar.gz ] && tar xzf bins.tar.gz
KC_OUT=1 bash gpu_tests_round.sh "${1:-round}" "${2:-400}" > /dev/null
PART=bars bash gpu_fp8.sh > /dev/null
timeout 60 python3 gemm_fp8_shapes.py > $OUT/gemm_fp8.txt 2>&1
cat $OUT/rounds.txt
grep -hE "^## |FP8 GEMMs|\"mode\"|exit|rror" $OUT/fp8.txt | cut -c1-220
cat $OUT/gemm_fp8.txt
