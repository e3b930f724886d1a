"""Helpers for the ``sglang`` test tier: a real SGLang 0.5.23 server on this machine's CPU.

The tier needs the environment ``make sglang-cpu`` builds (``.venv-sglang``) and a CPU that
SGLang's CPU backend runs on. Which CPUs those are is not guessed from ``/proc/cpuinfo``: once per
test session (per xdist worker; the tier runs on one) :func:`probe` asks the SGLang interpreter
itself, in a subprocess with a timeout, and the tier skips only with that probe's own error.
``.ci/run`` builds the environment first, so CI runs the tier wherever the probe passes.

The probe checks the environment and the CPU, not sat's code (sat's launch, patches and server
start are what the tier tests, and their failures must fail, not skip): torch and SGLang's CPU
kernel (``sgl_kernel``) import, and it reads what SGLang 0.5.23 decides from this CPU
(``sglang/srt/utils/common.py``: ``cpu_has_amx_support`` = AMX tiles and the kernel's AMX ops).
With AMX SGLang runs its matmuls, MoE and norms in the kernel and opens its shared-memory
all-reduce; the probe then runs one kernel op, so a wheel built for instructions this CPU lacks
skips with the signal. Without AMX (e.g. AVX-512 CPUs without AMX) SGLang uses its torch-native
layers and no all-reduce: the server runs, only tp > 1 cannot (:func:`require_cpu_all_reduce`).
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
PROBE_TIMEOUT_S = 300
ALL_REDUCE_REASON = "needs AMX for SGLang's CPU all-reduce (tp > 1)"

PROBE = r"""
import json, platform
from importlib.metadata import version
import torch
import sgl_kernel  # SGLang does not start on the CPU without its kernel
amx = torch.cpu._is_amx_tile_supported() and hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
if amx:  # SGLang will run the kernel's ops: one must run on this CPU (SIGILL otherwise)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    torch.ops.sgl_kernel.rmsnorm_cpu(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
print("PROBE " + json.dumps({
    "sglang": version("sglang"), "torch": torch.__version__,
    "capability": torch.backends.cpu.get_cpu_capability(), "amx": bool(amx),
    "all_reduce": bool(amx) or platform.machine() in ("aarch64", "arm64"),
}))
"""


@dataclass(frozen=True)
class Probe:
    python: str
    sglang: str
    torch: str
    capability: str  # torch's CPU kernel ISA: AVX512, AVX2, ...
    amx: bool  # SGLang uses its AMX kernels
    all_reduce: bool  # SGLang's shared-memory all-reduce (tp > 1) works here


def _reason(python: str, out: subprocess.CompletedProcess) -> str:
    """The skip reason for a failed probe: its own last error line, or the signal it died of."""
    lines = [ln for ln in (out.stderr or "").strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "(no output)"
    if out.returncode < 0:
        sig = signal.Signals(-out.returncode).name
        why = " (an instruction this CPU lacks)" if sig == "SIGILL" else ""
        return f"SGLang's CPU kernel died of {sig}{why} in {python}: {last}"
    return f"SGLang cannot run in {python} (exit {out.returncode}): {last}"


def run_probe(python: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe | str:
    """Run the probe in ``python``: what it found, or the reason it failed (a string)."""
    try:
        out = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"the SGLang probe in {python} did not finish in {timeout_s:g} s"
    found = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    if out.returncode != 0 or not found:
        return _reason(python, out)
    return Probe(python=python, **json.loads(found[-1][len("PROBE ") :]))


@functools.cache
def probe() -> Probe | str:
    """What the SGLang environment says of this CPU, or why it cannot serve (once per process)."""
    from sat_cli.engines.sglang.server import resolve_python

    try:
        python = resolve_python("auto")
    except FileNotFoundError as exc:
        return f"no SGLang CPU environment: {exc}"
    return run_probe(python)


def sglang_python() -> str:
    """The SGLang interpreter, or skip the test with the probe's reason."""
    found = probe()
    if isinstance(found, str):
        pytest.skip(found)
    return found.python


def require_cpu_all_reduce() -> None:
    """Skip a test that needs SGLang's CPU all-reduce (tp > 1, its /dev/shm segments) where
    SGLang disables it: without AMX on x86-64."""
    sglang_python()
    if not probe().all_reduce:
        pytest.skip(ALL_REDUCE_REASON)


def launch(model=MODEL, *, log_dir, r3=True):
    """A real SGLang engine on the CPU (bf16), started and healthy."""
    from sat_cli.engines.sglang import SGLangEngine
    from sat_cli.engines.sglang.runtime import SGLangRuntime
    from sat_cli.engines.sglang.settings import SGLangEngineSettings

    settings = SGLangEngineSettings(device="cpu", max_total_tokens=4096, startup_timeout_s=600)
    runtime = SGLangRuntime(str(model), r3, python=sglang_python(), log_dir=Path(log_dir))
    return SGLangEngine.launch(settings, runtime)


def sat(*args: str, cwd, timeout: float = 900):
    """``sat`` in a subprocess (:func:`cli_helpers.run_sat`, with the longer real-server timeout)."""
    from cli_helpers import run_sat

    return run_sat(*args, cwd=cwd, timeout=timeout)


def metrics(run_dir, name: str) -> dict[int, float]:
    """``{step: value}`` of one metric of the only run of experiment ``sat`` in ``run_dir``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    assert run.info.status == "FINISHED"
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
