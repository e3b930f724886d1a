#!/usr/bin/env bash
# GPU check of the single-GPU path (engine=local, trainer=local on CUDA; no SGLang, no Megatron):
# engine/trainer log-prob parity in fp32 and bf16, bf16 training steps (fp32 weights and Adam) on
# the tiny model and a random model of Qwen3-0.6B's shape, `sat train` end to end on the GPU, and
# with --model-path a real checkpoint (e.g. Qwen3-0.6B-Base in a local folder); prints a table.
# One GPU, bounded to 470 s (one call of at most 8 minutes).
#
#   scripts/gpu_check_local.sh --prepare [PYVER]   # here (registry access): fetch wheels
#   scripts/gpu_check_local.sh [--model-path DIR]  # on the GPU machine
#   python scripts/gpu_check_local.py --device cpu # CPU smoke of the script (tests/test_gpu_checks.py)
#
# The GPU machine needs torch (CUDA), transformers, tokenizers, safetensors, sympy and typer;
# the `sat train` rows also need hydra-core, omegaconf and math-verify (they run with
# tracking=none: no MLflow). `--prepare` fetches those, latex2sympy2_extended and
# antlr4-python3-runtime 4.9.3 as pure-Python wheels (the versions of sat's .venv) into
# .gpu_deps/wheels/ (untracked; carry it with the working tree); there they are installed with
# `pip install --no-index --no-deps --target .gpu_deps/site` and put on PYTHONPATH, nothing is
# installed into the machine's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find_python.sh  # $PYTHON, the project's .venv, python3/python with torch
PY="$(find_python)"
echo "$(basename "$0"): Python $PY" >&2
DEPS=.gpu_deps
if [[ "${1:-}" == "--prepare" ]]; then
  PYVER="${2:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
  mkdir -p "$DEPS/wheels"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
    --platform any -d "$DEPS/wheels" hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 \
    latex2sympy2_extended==1.11.0
  # antlr4-python3-runtime 4.9.3 (hydra's parser) ships as source only: build its pure-Python wheel
  "$PY" -m pip wheel --no-deps -w "$DEPS/wheels" antlr4-python3-runtime==4.9.3
  ls -la "$DEPS/wheels"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import hydra, omegaconf, math_verify" 2>/dev/null; then
  if ! ls "$DEPS"/wheels/*.whl >/dev/null 2>&1; then
    echo "hydra-core/omegaconf/math-verify are missing and $DEPS/wheels/ is empty: run" \
         "'scripts/gpu_check_local.sh --prepare PYVER' where a registry is reachable" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --target "$DEPS/site" "$DEPS"/wheels/*.whl
  export PYTHONPATH="$PWD/$DEPS/site:$PYTHONPATH"
fi
"$PY" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA';
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
exec timeout 470 "$PY" scripts/gpu_check_local.py "$@"
