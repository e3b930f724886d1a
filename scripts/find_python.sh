# Sourced by the GPU-check wrappers after they `cd` to the project (issue 53, class 10): the
# interpreter is chosen, never whatever `python` comes first on PATH: $PYTHON; else the
# project's .venv if it imports torch; else the first of python3, python that imports torch.
# The wrapper prints which one it uses.
find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
    return
  fi
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo .venv/bin/python
    return
  fi
  local py
  for py in python3 python; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import torch' 2>/dev/null; then
      command -v "$py"
      return
    fi
  done
  echo "$(basename "$0"): no Python with torch found (\$PYTHON, .venv/bin/python, python3, python):" \
       "set PYTHON=/path/to/python" >&2
  exit 2
}
