#!/usr/bin/env bash
# GPU check of the weight sync without the disk (docs/sglang.md "Weight sync"): a broadcast to an
# SGLang server equals a disk load of the same weights; with --paper QWEN3_30B_A3B_DIR also the
# paper model's seconds per version on one 8-GPU node (goal: <= 10 s).
#
#   scripts/gpu_check_weight_sync.sh TINY_CKPT SGLANG_PYTHON [--paper DIR] [--versions N]
#
# Runs with the sat environment's interpreter ($SAT_PYTHON, then .venv/bin/python). Bounded to
# 10 minutes (45 with --paper).
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,9p' "$0"
  exit 2
fi
CKPT="$1"
SGLANG_PY="$2"
shift 2
# paths relative to the caller's folder, not the project's (the cd below)
[[ "$CKPT" == /* ]] || CKPT="$PWD/$CKPT"
[[ "$SGLANG_PY" != */* || "$SGLANG_PY" == /* ]] || SGLANG_PY="$PWD/$SGLANG_PY"
cd "$(dirname "$0")/.."
PY="${SAT_PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
LIMIT=600
[[ " $* " == *" --paper "* ]] && LIMIT=2700
exec timeout "$LIMIT" "$PY" scripts/gpu_check_weight_sync.py "$CKPT" --sglang-python "$SGLANG_PY" "$@"
