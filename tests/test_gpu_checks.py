"""The one-call GPU checks of scripts/ as pytest tests (marker ``gpu``; skipped without CUDA),
and the CPU smoke of the single-GPU check (marker ``slow``: it runs here, about 2 minutes).

``make test`` deselects them (``-m "not slow and not gpu"``); on a GPU machine run
``python -m pytest -m gpu tests/test_gpu_checks.py``. Each test runs its script as a real
subprocess and passes only if the script printed no FAIL row and exited 0: the tolerances are
the scripts' own (docs/megatron.md, docs/sglang.md, scripts/gpu_check_local.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_megatron():
    pytest.importorskip("megatron.core")
    rc, text = _run([sys.executable, "scripts/gpu_check_megatron.py", "--device", "cuda"])
    assert rc == 0 and "FAIL" not in text, text[-4000:]
    assert "PASS" in text, text[-4000:]


@pytest.mark.gpu
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


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_local():
    rc, text = _run([sys.executable, "scripts/gpu_check_local.py", "--device", "cuda"])
    assert rc == 0 and "FAIL" not in text, text[-4000:]
    assert "| sat train | tiny | avg@8 step 50 - step 0 (points) |" in text, text[-4000:]


@pytest.mark.slow
def test_gpu_check_local_cpu_smoke():
    """The single-GPU check's own CPU smoke: every row of the local path (engine and trainer in
    fp32 and bf16, bf16 steps, `sat train` with both on the device) passes on the CPU."""
    rc, text = _run([sys.executable, "scripts/gpu_check_local.py", "--device", "cpu"])
    assert rc == 0 and "FAIL" not in text, text[-4000:]
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.endswith("|")]
    rows = {tuple(c.strip() for c in ln.strip("|").split("|")[:3]): ln for ln in table}
    assert ("check", "model", "metric") in rows  # the header: the table was printed
    for key in [
        ("parity fp32", "tiny", "max abs dlogp engine-trainer"),
        ("parity bf16", "tiny", "mean abs dlogp engine-trainer"),
        ("train bf16", "tiny", "non-finite loss or grad norm"),
        ("train bf16", "tiny", "max abs dweight"),
        ("train bf16", "tiny", "weights and Adam fp32 (1 = yes)"),
        ("sat train", "tiny", "exit code"),
        ("sat train", "tiny", "evals printed (steps 0, 2, 3)"),
    ]:
        assert key in rows and rows[key].endswith("| PASS |"), (key, text[-4000:])
    # fp32 engine and trainer on one device agree to float rounding (the CPU tests' 1e-5)
    fp32 = float(rows[("parity fp32", "tiny", "max abs dlogp engine-trainer")].split("|")[4])
    assert fp32 <= 1e-5
