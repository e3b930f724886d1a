#!/usr/bin/env bash
# The one prepared GPU check (docs/gpus.md): every GPU path of sat in one call of at most 10
# minutes on one GPU machine (e.g. one H200, 16 cores) — local engine + trainer (random weights of
# Qwen3-0.6B's shape; generation and training tokens/s apart), the SAT/GSPO losses on the device
# against a float64 reference, Megatron bf16 steps, a real SGLang server and the NCCL weight sync
# to it (where an SGLang environment exists), `sat train` on the GPU with its weights broadcast
# and verified, and each process's GPUs checked with nvidia-smi against the device plan. Writes
# OUT/summary.json and OUT/logs/ (scripts/gpu_check.py).
#
#   scripts/gpu_check.sh OUT [--sglang-python PY]   # on the GPU machine
#   scripts/gpu_check.sh OUT --cpu-dry-run          # the CPU-only parts, anywhere (the tests)
#   make gpu-bundle                                 # here: .gpu_deps/wheels for a bare GPU node
#
# Its Python, in this order: $PYTHON; the project's .venv; else the first of python3, python on
# PATH that imports torch (a bare GPU image's own). What that Python lacks comes from the wheels
# of `make gpu-bundle` (.gpu_deps/wheels, carried with the tree), installed offline with
# --no-deps into .gpu_deps/site and put on PYTHONPATH; nothing is installed into the machine's
# environment. SGLang runs in its own environment (--sglang-python, or $SAT_SGLANG_PYTHON).
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,19p' "$0"
  exit 2
fi
OUT="$1"  # relative to the caller's folder, not the project's (the cd below)
shift
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"
cd "$(dirname "$0")/.."
source scripts/find_python.sh  # find_python: $PYTHON, the project's .venv, python3/python with torch
PY="$(find_python)"
echo "gpu_check.sh: Python $PY" >&2
if [[ " $* " != *" --cpu-dry-run "* ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check.sh: no GPU here (nvidia-smi finds none): run it on a GPU machine; here," \
         "'scripts/gpu_check.sh OUT --cpu-dry-run' runs its CPU-only parts" >&2
    exit 2
  fi
  if ls .gpu_deps/wheels/*.whl >/dev/null 2>&1 && [[ ! -d .gpu_deps/site ]]; then
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target .gpu_deps/site \
      .gpu_deps/wheels/*.whl
  fi
  if [[ -d .gpu_deps/site ]]; then
    export PYTHONPATH="$PWD/.gpu_deps/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 590 "$PY" scripts/gpu_check.py "$OUT" "$@"
