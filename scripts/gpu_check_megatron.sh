#!/usr/bin/env bash
# GPU check of the megatron trainer (docs/megatron.md): megatron-core vs HF logits in fp32 and
# bf16 (with and without replayed routes), a few training steps against the local trainer (tp = 1,
# tiny and ~0.4 B-parameter MoE), bf16 steps with megatron-core's own (distributed) optimizer
# against the tested fp32-main-weights path, the same with activation recompute and optimizer
# offload (megatron-core's HybridDeviceOptimizer), one step through torchrun; prints a table. One GPU,
# bounded to 470 s (one call of at most 8 minutes).
#
#   scripts/gpu_check_megatron.sh --prepare [PYVER]   # here (registry access): fetch wheels
#   scripts/gpu_check_megatron.sh [args for gpu_check_megatron.py]   # on the GPU machine
#
# The GPU machine has torch (CUDA) but no package registry. `--prepare` downloads the wheels of
# megatron-core 0.16.1 and einops for Python PYVER (default: this interpreter's; the
# megatron-core wheel is per Python version) into .gpu_deps/wheels/ (~3 MB; the bf16 rows need
# nothing more: without Transformer Engine / Apex megatron-core's optimizer uses torch AdamW). Carry that folder
# to the GPU machine with the working tree (it is untracked). There they are installed with
# `pip install --no-index --no-deps --target .gpu_deps/site` and put on PYTHONPATH; nothing is
# installed into the machine's environment. transformers, tokenizers and safetensors must be
# present there already (they are in an SGLang environment); add their wheels the same way
# otherwise (GPU_CHECK_EXTRA_WHEELS="transformers==5.24.0 tokenizers safetensors ...").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_python.sh  # $PYTHON, the project's .venv, python3/python with torch
PY="$(find_python)"
echo "$(basename "$0"): Python $PY" >&2
DEPS=.gpu_deps
if [[ "${1:-}" == "--prepare" ]]; then
  PYVER="${2:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
  mkdir -p "$DEPS/wheels"
  # shellcheck disable=SC2086
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEPS/wheels" megatron-core==0.16.1 einops==0.8.2 ${GPU_CHECK_EXTRA_WHEELS:-}
  ls -la "$DEPS/wheels"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import megatron.core, einops" 2>/dev/null; then
  if ! ls "$DEPS"/wheels/*.whl >/dev/null 2>&1; then
    echo "megatron-core is not installed and $DEPS/wheels/ is empty: run" \
         "'scripts/gpu_check_megatron.sh --prepare PYVER' where a registry is reachable" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS/site" "$DEPS"/wheels/*.whl
  export PYTHONPATH="$PWD/$DEPS/site:$PYTHONPATH"
fi
"$PY" -c "import megatron.core, torch, transformers; assert torch.cuda.is_available(), 'no CUDA';
print('megatron-core', megatron.core.__version__, 'torch', torch.__version__,
      'transformers', transformers.__version__, torch.cuda.get_device_name())"
exec timeout 470 "$PY" scripts/gpu_check_megatron.py "$@"
