#!/bin/bash
# A device call carries at most 64 MiB with the tracked tree (about 7 MiB), and
# bundle/ holds more: this keeps in bundle/ the binaries named (and every script and
# small data folder) and moves the other binaries to bundle.aside/ (git-ignored, not
# carried); `all` moves every one back. Presets: `tests` (the single-GPU test
# binaries), `zoo` (bench, examples, CLI). With `--pack` first, the binaries named
# travel gzipped in bundle/bins.tar.gz (about a third of their size: the test binaries
# and bench together fit) and the device call unpacks them: `cd bundle && tar xzf
# bins.tar.gz`.
#   bash scripts/bundle_keep.sh tests
#   bash scripts/bundle_keep.sh tests bench image_folder
#   bash scripts/bundle_keep.sh --pack tests bench
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bundle.aside
pack=0
[ "${1:-}" = --pack ] && { pack=1; shift; }
rm -f bundle/bins.tar.gz
# What make_bundle.sh wrote since is newer than what was set aside before it.
for f in bundle.aside/*; do
  [ -e "$f" ] || continue
  if [ -e "bundle/$(basename "$f")" ]; then rm -rf "$f"; else mv "$f" bundle/; fi
done
[ "${1:-all}" = all ] && { du -sh bundle; exit 0; }
keep=()
for k in "$@"; do
  case $k in
    tests) keep+=(cuda_ops cuda_fused cuda_executor cuda_pool cuda_session cuda_numerics cuda_stress) ;;
    zoo) keep+=(bench image_folder mnist gpt2_train ampgraph) ;;
    *) keep+=("$k") ;;
  esac
done
for f in bundle/*; do
  name=$(basename "$f")
  # Binaries only (ELF files); scripts and data stay. mnist_data, onnx_models' inputs
  # and the wheels are large too: kept only when named.
  if { [ -f "$f" ] && head -c 4 "$f" | grep -q ELF; } || [[ "$name" =~ ^(mnist_data|wheels|gpt2)$ ]]; then
    [[ " ${keep[*]} " == *" $name "* ]] || mv "$f" bundle.aside/
  fi
done
if [ $pack = 1 ]; then
  names=()
  for k in "${keep[@]}"; do [ -f "bundle/$k" ] && head -c 4 "bundle/$k" | grep -q ELF && names+=("$k"); done
  tar czf bundle/bins.tar.gz -C bundle "${names[@]}"
  for k in "${names[@]}"; do mv "bundle/$k" bundle.aside/; done
fi
du -sh bundle
