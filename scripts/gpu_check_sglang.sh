#!/usr/bin/env bash
# GPU check of the SGLang engine (docs/sglang.md): serve a checkpoint with SGLang on one GPU,
# compare its token log-probs and routed experts with a transformers recompute, update weights
# from disk, print a table. Needs SGLang installed in the interpreter given (its own env).
#
#   scripts/gpu_check_sglang.sh CKPT_DIR [SGLANG_PYTHON] [extra args for gpu_check_sglang.py]
#
# SGLANG_PYTHON defaults to $SGLANG_PYTHON, then `python`. Bounded to 5 minutes.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,8p' "$0"
  exit 2
fi
CKPT="$1"
PY="${2:-${SGLANG_PYTHON:-python}}"
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA'; print('sglang', sglang.__version__, 'torch', torch.__version__)"
exec timeout 300 "$PY" scripts/gpu_check_sglang.py "$CKPT" --python "$PY" "$@"
