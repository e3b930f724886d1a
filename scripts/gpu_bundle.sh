#!/usr/bin/env bash
# `make gpu-bundle`: the wheels a bare, air-gapped GPU image lacks for scripts/gpu_check.sh, into
# .gpu_deps/wheels/ (untracked: carry it with the working tree). Such an image (e.g. torch 2.11,
# transformers 5.17, numpy, scipy, typer, rich, sympy, safetensors, tokenizers) has none of
# hydra-core, omegaconf, math-verify, megatron-core; these are pure Python except megatron-core,
# which is built per Python version (GPU_PYVER, default 3.12). gpu_check.sh installs them offline
# with --no-deps into .gpu_deps/site. Refused (exit 2) if the bundle is over GPU_BUNDLE_MAX_MIB
# (64: what one call of the GPU machine carries beside the checkout).
#
#   scripts/gpu_bundle.sh [PYVER]      # where a package registry is reachable
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-${GPU_PYVER:-3.12}}"
MAX_MIB="${GPU_BUNDLE_MAX_MIB:-64}"
if ! [[ "$PYVER" =~ ^3\.[0-9]{1,2}$ ]]; then
  echo "gpu_bundle.sh: GPU_PYVER must look like 3.12, got '$PYVER'" >&2
  exit 2
fi
if ! [[ "$MAX_MIB" =~ ^[0-9]{1,4}$ ]] || (( MAX_MIB < 1 )); then
  echo "gpu_bundle.sh: GPU_BUNDLE_MAX_MIB must be an integer in [1, 9999], got '$MAX_MIB'" >&2
  exit 2
fi
PY="${PYTHON:-python3}"
out=.gpu_deps/wheels
rm -rf .gpu_deps
mkdir -p "$out"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --platform any --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux2014_x86_64 -d "$out" \
  hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  megatron-core==0.16.1 einops==0.8.2
# antlr4-python3-runtime 4.9.3 (hydra's parser) ships as source only: build its pure-Python wheel
"$PY" -m pip wheel --quiet --no-deps -w "$out" antlr4-python3-runtime==4.9.3
kib=$(du -sk "$out" | cut -f1)
ls -la "$out"
echo "gpu_bundle.sh: $(ls "$out" | wc -l) wheels, $((kib / 1024)) MiB in $out (Python $PYVER)"
if (( kib > MAX_MIB * 1024 )); then
  echo "gpu_bundle.sh: the bundle is over $MAX_MIB MiB" >&2
  exit 2
fi
