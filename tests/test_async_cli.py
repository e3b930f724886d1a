"""`sat train lag=N lag.mode=bounded lag.inflight_updates=true` end to end: real subprocesses, the
local engine taking weights mid-generation, a real MLflow store; SIGKILL with responses in flight
then `resume=auto` consumes every prompt exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_sat

BOUNDED = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=4",
    "task.samples_per_prompt=4",
    "eval.every=0",
    "lag=2",
    "lag.mode=bounded",
    "lag.inflight_updates=true",
    "tracking.histogram_every=1",
    "run.dir=runs",
]


def _client(run_dir: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def _runs(tmp_path: Path) -> dict:
    client = _client(tmp_path / "runs")
    exp = client.get_experiment_by_name("sat")
    return client, {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def _series(client, run, key) -> list[tuple[int, float]]:
    hist = client.get_metric_history(run.info.run_id, key)
    return [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)]


@pytest.mark.slow  # ~24 s; in process: tests/test_loop.py bounded in-flight
def test_bounded_inflight_run_logs_per_token_staleness(tmp_path):
    out = run_sat("train", *BOUNDED, "max_steps=4", "run.name=inflight", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client, runs = _runs(tmp_path)
    run = runs["inflight"]
    assert run.info.status == "FINISHED"
    assert run.data.params["lag.inflight_updates"] == "true"
    lag_max = [v for _, v in _series(client, run, "staleness/version_lag_max")]
    assert len(lag_max) == 4 and lag_max[0] == 0.0 and max(lag_max) <= 2.0
    mixed = _series(client, run, "staleness/mixed_version_frac")
    assert [s for s, _ in mixed] == [1, 2, 3, 4] and all(0.0 <= v <= 1.0 for _, v in mixed)
    assert _series(client, run, "rollout/stale_dropped")[-1][1] == 0.0
    # the per-sample and the per-token staleness histograms, each step, as images and tables
    local = Path(client.download_artifacts(run.info.run_id, "tables", str(tmp_path / "dl")))
    for name in ("version_lag", "token_version_lag"):
        tables = sorted((local / "staleness" / name).glob("step_*.json"))
        assert [t.name for t in tables] == [f"step_{s}.json" for s in (1, 2, 3, 4)], name
        last = json.loads(tables[-1].read_text())
        assert sum(last["counts"]) == last["n"] > 0 and last["max"] <= 2.0


@pytest.mark.slow
def test_sigkill_with_responses_in_flight_then_resume_consumes_every_prompt_once(tmp_path):
    """Checkpoint every 2 steps; SIGKILL after the step-4 checkpoint (later batches requested,
    being generated); resume=auto regenerates the recorded batches: each MLflow step is logged
    once and its prompts are those of an uninterrupted run (bounded mode is timing dependent,
    so the numbers differ; the prompts may not)."""
    base = [*BOUNDED, "max_steps=8", "checkpoint.every=2", "checkpoint.keep=3"]
    full = run_sat("train", *base, "run.name=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "train", *base, "run.name=cut"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ck = tmp_path / "runs/sat/cut/checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ck / "step_4").is_dir():
        time.sleep(0.1)
    assert (ck / "step_4").is_dir(), "no second checkpoint appeared"
    state = json.loads((ck / "step_4" / "loop_state.json").read_text())
    assert state["pending"], "nothing was in flight at the checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    resumed = run_sat("train", *base, "run.name=cut", "resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, runs = _runs(tmp_path)
    assert set(runs) == {"full", "cut"}
    cut = _series(client, runs["cut"], "rollout/prompt_digest")
    assert [s for s, _ in cut] == list(range(1, 9))  # every step exactly once
    assert cut == _series(client, runs["full"], "rollout/prompt_digest")
    assert all(v <= 2.0 for _, v in _series(client, runs["cut"], "staleness/version_lag_max"))
