"""Helpers for the ``sglang`` test tier: a real SGLang 0.5.23 server on this machine's CPU.

The tier needs the environment ``make sglang-cpu`` builds (``.venv-sglang``) and a CPU with
AMX (SGLang's CPU backend); without either, its tests skip with the reason. ``.ci/run`` builds
the environment first, so CI always runs the tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sat_cli" / "assets" / "tiny_moe_warm"


def sglang_python() -> str:
    """The SGLang interpreter, or skip the test with the reason."""
    from sat_cli.engines.sglang.server import resolve_python

    try:
        python = resolve_python("auto")
    except FileNotFoundError as exc:
        pytest.skip(f"no SGLang CPU environment: {exc}")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "amx_bf16" not in cpuinfo.read_text():
        pytest.skip("this CPU lacks AMX (amx_bf16), which SGLang's CPU backend needs")
    return python


def launch(model=MODEL, *, log_dir, r3=True, **kw):
    """A real SGLang engine on the CPU (bf16), started and healthy."""
    from sat_cli.engines.sglang import SGLangEngine

    return SGLangEngine.launch(
        str(model),
        python=sglang_python(),
        device="cpu",
        dtype="bfloat16",
        max_total_tokens=4096,
        r3=r3,
        log_dir=log_dir,
        startup_timeout_s=600,
        **kw,
    )


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
