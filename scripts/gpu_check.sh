#!/usr/bin/env bash
# The one prepared GPU check (docs/gpus.md): every GPU path of sat in one call of at most 10
# minutes on one GPU machine (e.g. one H200, 16 cores) — local engine + trainer (random weights of
# Qwen3-0.6B's shape; generation and training tokens/s apart), a real SGLang server, Megatron bf16
# steps, the NCCL weight sync verified, and each process's GPUs checked with nvidia-smi against
# the device plan. Writes OUT/summary.json and OUT/logs/ (scripts/gpu_check.py).
#
#   scripts/gpu_check.sh OUT [--sglang-python PY]   # on the GPU machine
#   scripts/gpu_check.sh OUT --cpu-dry-run          # the CPU-only parts, anywhere (the tests)
#
# Dependencies as the per-part checks: scripts/gpu_check_local.sh --prepare and
# scripts/gpu_check_megatron.sh --prepare (wheels into .gpu_deps/, carried with the tree);
# SGLang in its own environment (--sglang-python, or $SAT_SGLANG_PYTHON).
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,13p' "$0"
  exit 2
fi
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [[ " $* " != *" --cpu-dry-run "* ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check.sh: no GPU here (nvidia-smi finds none): run it on a GPU machine; here," \
         "'scripts/gpu_check.sh OUT --cpu-dry-run' runs its CPU-only parts" >&2
    exit 2
  fi
  if ls .gpu_deps/wheels/*.whl >/dev/null 2>&1 && [[ ! -d .gpu_deps/site ]]; then
    "$PY" -m pip install --quiet --no-index --no-deps --target .gpu_deps/site .gpu_deps/wheels/*.whl
  fi
  if [[ -d .gpu_deps/site ]]; then
    export PYTHONPATH="$PWD/.gpu_deps/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 590 "$PY" scripts/gpu_check.py "$@"
