"""The one-call GPU checks of scripts/ as pytest tests (marker ``gpu``; skipped without CUDA).

``make test`` deselects them (``-m "not slow and not gpu"``); on a GPU machine run
``python -m pytest -m gpu tests/test_gpu_checks.py``. Each test runs its script as a real
subprocess and passes only if the script printed no FAIL row and exited 0: the tolerances are
the scripts' own (docs/megatron.md, docs/sglang.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")


def _run(cmd: list[str], env: dict | None = None, timeout: float = 900):
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    text = out.stdout + out.stderr
    return out.returncode, text


@needs_cuda
def test_gpu_check_megatron():
    pytest.importorskip("megatron.core")
    rc, text = _run([sys.executable, "scripts/gpu_check_megatron.py", "--device", "cuda"])
    assert rc == 0 and "FAIL" not in text, text[-4000:]
    assert "PASS" in text, text[-4000:]


@needs_cuda
def test_gpu_check_sglang(tmp_path):
    from sat_cli.engines.sglang.server import resolve_python
    from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf

    try:
        python = resolve_python("auto")
    except FileNotFoundError as exc:
        pytest.skip(f"no SGLang environment: {exc}")
    ckpt = save_hf(build_tiny_moe(seed=0), build_char_tokenizer(), tmp_path / "tiny")
    rc, text = _run(
        [python, "scripts/gpu_check_sglang.py", str(ckpt), "--python", python]
        + ["--log-dir", str(tmp_path / "logs")]
    )
    assert rc == 0 and "FAIL" not in text, text[-4000:]
    assert "PASS" in text, text[-4000:]
