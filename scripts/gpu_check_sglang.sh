#!/usr/bin/env bash
# GPU check of the SGLang engine (docs/sglang.md): serve a checkpoint with SGLang on one GPU,
# compare its token log-probs and routed experts with a transformers recompute, update weights
# from disk, print a table. Needs SGLang installed in the interpreter given (its own env).
#
#   scripts/gpu_check_sglang.sh CKPT_DIR [SGLANG_PYTHON] [extra args for gpu_check_sglang.py]
#
# SGLANG_PYTHON defaults to $SGLANG_PYTHON, then the project's .venv-sglang. Bounded to 5 minutes.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,8p' "$0"
  exit 2
fi
CKPT="$1"
PY="${2:-${SGLANG_PYTHON:-}}"
shift $(( $# >= 2 ? 2 : 1 ))
# paths relative to the caller's folder, not the project's (the cd below)
[[ "$CKPT" == /* ]] || CKPT="$PWD/$CKPT"
[[ -z "$PY" || "$PY" != */* || "$PY" == /* ]] || PY="$PWD/$PY"
cd "$(dirname "$0")/.."
if [[ -z "$PY" ]]; then  # never whatever `python` is first on PATH: the project's SGLang env
  PY="$PWD/.venv-sglang/bin/python"
  [[ -x "$PY" ]] || { echo "gpu_check_sglang.sh: give SGLANG_PYTHON (no .venv-sglang here)" >&2; exit 2; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA'; print('sglang', sglang.__version__, 'torch', torch.__version__)"
exec timeout 300 "$PY" scripts/gpu_check_sglang.py "$CKPT" --python "$PY" "$@"
