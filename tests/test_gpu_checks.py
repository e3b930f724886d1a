"""The one-call GPU checks of scripts/ as pytest tests (marker ``gpu``; skipped without CUDA),
the CPU smoke of the single-GPU check (marker ``slow``: it runs here, about 2 minutes), and the
CPU-only parts of ``scripts/gpu_check.sh`` (``--cpu-dry-run``, its no-GPU refusal, the
placement step's process-tree mapping).

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


def _gpu_check(out, *args, env=None):
    env = {"PYTHON": sys.executable, **(env or {})}
    return _run(["bash", "scripts/gpu_check.sh", str(out), *args], env=env, timeout=300)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One ``scripts/gpu_check.sh --cpu-dry-run`` for the two read-only tests below (~7 s each
    time): started as from a plain shell, with no PYTHON and a PATH that lacks the venv, so the
    check finds the project's Python itself (PYTHON= is taken in
    test_gpu_check_without_a_gpu_exits_2). Its output folder and the finished process."""
    out_dir = tmp_path_factory.mktemp("gpu-check") / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out_dir), "--cpu-dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    return out_dir, out


@pytest.mark.xdist_group("gpu_dry_run")  # one worker runs ``dry_run`` once for both
def test_gpu_check_cpu_dry_run_writes_the_summary(dry_run):
    """scripts/gpu_check.sh --cpu-dry-run: the device plans of the GPU layouts (the paper preset's
    0-3 / 4-7 split), the nvidia-smi parser, every GPU step recorded as skipped."""
    import json

    out_dir, out = dry_run
    rc, text = out.returncode, out.stdout + out.stderr
    assert rc == 0, text[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["status"] == "PASS" and summary["cpu_dry_run"] is True
    paper = steps["plan"]["layouts"]["paper 1x8"]
    assert paper["procs"] == {
        "sglang server 0": [0, [0, 1, 2, 3]],
        "megatron node 0": [0, [4, 5, 6, 7]],
    }
    two = steps["plan"]["layouts"]["paper 2x8"]
    assert two["needed"] == {"0": 8, "1": 4}
    shared = steps["plan"]["layouts"]["sglang+local 1 GPU"]["procs"]
    assert shared == {"sglang server 0": [0, [0]], "local trainer": [0, [0]]}
    assert steps["nvidia_smi_parser"]["status"] == "PASS"
    for name in ("losses", "nccl", "local", "megatron", "placement", "sglang", "weight_sync"):
        assert steps[name]["status"] == "SKIPPED", name


@pytest.mark.xdist_group("gpu_dry_run")
def test_gpu_check_finds_the_projects_python_without_the_venv_on_path(dry_run):
    """With no PYTHON and a PATH that lacks the venv (a plain shell, a bare GPU image), the
    check finds a Python that imports torch itself (the project's .venv here) and runs."""
    import json

    out_dir, out = dry_run
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "gpu_check.sh: Python " in out.stderr
    assert json.loads((out_dir / "summary.json").read_text())["status"] == "PASS"


def test_gpu_check_losses_on_the_cpu_match_float64():
    """scripts/gpu_check_losses.py --device cpu: the GPU check's loss rows, here on the CPU:
    every loss (GRPO, SAT-GRPO, GSPO, SAT-GSPO) in float32 within 1e-5 (relative) of the float64
    reference, gradients within 1e-4; the all-bf16 GSPO rows are far off (its radii are below
    bf16's spacing at 1), which is why they are reported and not gated."""
    rc, text = _run([sys.executable, "scripts/gpu_check_losses.py", "--device", "cpu"])
    assert rc == 0, text[-3000:]
    rows = {}
    for ln in text.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if ln.startswith("| loss") and len(cells) == 6:
            rows[(cells[0], cells[1], cells[2])] = (float(cells[3]), cells[5])
    for algo in ("grpo", "sat-grpo", "gspo", "sat-gspo"):
        loss, verdict = rows[("loss fp32", algo, "rel abs dloss vs float64")]
        assert verdict == "PASS" and loss <= 1e-5, algo
        grad, verdict = rows[("loss fp32", algo, "rel max abs dgrad")]
        assert verdict == "PASS" and grad <= 1e-4, algo
    assert rows[("loss bf16", "gspo", "rel abs dloss vs float64")][0] > 1e-2


def test_gpu_check_without_a_gpu_exits_2(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    rc, text = _gpu_check(tmp_path / "out", env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert rc == 2, text
    assert "gpu_check.sh: no GPU here (nvidia-smi finds none)" in text and "--cpu-dry-run" in text
    assert not (tmp_path / "out").exists()


def test_processes_are_mapped_to_their_role_through_the_process_tree():
    """The placement step's mapping: a GPU process (here a grandchild, as SGLang's scheduler is
    of the server) counts for the nearest ancestor named in pids.json (real /proc)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check import gpu_of_pids, roles_on_gpus

    code = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code + "; time.sleep(30)"], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        child = int(parent.stdout.readline())
        seen = gpu_of_pids(f"{child}, GPU-b\n{os.getpid()}, GPU-a\n", "0, GPU-a\n1, GPU-b\n")
        roles = roles_on_gpus({"orchestrator": os.getpid(), "engine": parent.pid}, seen)
        assert roles == {"orchestrator": [0], "engine": [1]}
    finally:
        if child is not None:
            os.kill(child, 9)
        parent.kill()
        parent.wait(timeout=10)
