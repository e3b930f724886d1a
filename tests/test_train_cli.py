"""`sat train` end to end through real subprocesses and a real MLflow sqlite store."""

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

SMOKE = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=4",
    "task.samples_per_prompt=4",
    "eval.n=1",
    "eval.every=2",
]


def sat(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_sat(*args, cwd=cwd, timeout=timeout)


def _client(run_dir: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def _all_artifacts(client, run_id: str, path: str = "") -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(_all_artifacts(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def test_short_run_lands_in_mlflow(tmp_path):
    out = sat(
        "train",
        *SMOKE,
        "run.dir=runs",
        "run.name=smoke",
        # histograms of batch 0 only (logged at step 1: all that is checked below); every step's
        # histograms drew 12 images instead of 4
        "tracking.histogram_every=3",
        # the in-training evaluations (steps 0, 2, 3) on 32 of the 256 held-out problems
        "eval.limit=32",
        "eval.final_n=2",
        "eval.final_limit=5",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "best" in out.stdout and "sat ui" in out.stdout
    client = _client(tmp_path / "runs")
    exp = client.get_experiment_by_name("sat")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "smoke"
    p = run.data.params
    assert p["algo.name"] == "grpo" and p["clip.name"] == "sat" and p["lag.n"] == "1"
    assert p["task.prompts_per_step"] == "4"
    t = run.data.tags
    assert (t["algo"], t["clip"], t["lag"], t["r3"], t["seed"]) == (
        "grpo",
        "sat",
        "1",
        "false",
        "0",
    )
    hist = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in hist) == [1, 2, 3]
    lag = {
        m.step: m.value
        for m in client.get_metric_history(run.info.run_id, "staleness/version_lag_max")
    }
    assert lag == {1: 0.0, 2: 1.0, 3: 1.0}  # interval lag 1: batch 0 fresh, then one step off
    evals = client.get_metric_history(run.info.run_id, "eval/toy/avg_at_1")
    assert sorted(m.step for m in evals) == [0, 2, 3]
    for m in evals:
        assert 0.0 <= m.value <= 100.0
    # the final evaluation: once, at the last step, 5 problems x 2 samples (10 graded samples:
    # its avg@2 is a multiple of 10 %)
    (final,) = client.get_metric_history(run.info.run_id, "final/toy/avg_at_2")
    assert final.step == 3 and 0.0 <= final.value <= 100.0 and final.value % 10 == 0
    # new per-step diagnostics: ESS of pi/mu, clip fraction per side, two-sided SAT flags
    for key in ("staleness/ess", "loss/clipfrac_low", "loss/clipfrac_high", "sat/active_low_frac"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 3, key
    ess = client.get_metric_history(run.info.run_id, "staleness/ess")
    assert all(0.0 < m.value <= 1.0 for m in ess)
    arts = _all_artifacts(client, run.info.run_id)
    assert "config.yaml" in arts
    assert any(a.startswith("images/staleness~abs_logratio+step+1") for a in arts), arts
    assert any(a.startswith("images/staleness~version_lag+step+") for a in arts)
    table_path = "tables/staleness/abs_logratio/step_1.json"
    assert table_path in arts
    local = client.download_artifacts(run.info.run_id, table_path, str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert sum(table["counts"]) == table["n"] > 0 and "q" in table["marks"]
    # the resolved config in the run dir equals the artifact
    assert (tmp_path / "runs/sat/smoke/config.yaml").read_text().startswith("model:")


@pytest.mark.slow  # ~18 s; the run-folder cases of tests/test_bad_input.py stay
def test_existing_run_is_not_overwritten(tmp_path):
    args = [
        *SMOKE,
        "max_steps=2",
        "checkpoint.every=1",
        "eval.every=0",
        "run.dir=runs",
        "run.name=twice",
        "tracking=none",
    ]
    assert sat("train", *args, cwd=tmp_path).returncode == 0
    again = sat("train", *args, cwd=tmp_path)
    assert again.returncode == 2
    assert "already has checkpoints" in again.stderr and "resume=auto" in again.stderr


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    """Fixed lag 2, checkpoint every 2 steps: SIGKILL after two checkpoints, resume=auto; the
    MLflow history has every step once, the prompts per step equal an uninterrupted run's, and
    the final weights are identical."""
    from safetensors.torch import load_file

    base = [
        *SMOKE,
        "max_steps=8",
        "checkpoint.every=2",
        "checkpoint.keep=3",
        "lag=2",
        "lag.mode=fixed",
        "eval.every=0",
        "run.dir=runs",
    ]
    full = sat("train", *base, "run.name=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sat_cli.cli", "train", *base, "run.name=cut"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ck = tmp_path / "runs/sat/cut/checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ck / "step_4").is_dir():
        time.sleep(0.2)
    assert (ck / "step_4").is_dir(), "no second checkpoint appeared"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    resumed = sat("train", *base, "run.name=cut", "resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step_" in resumed.stdout

    client = _client(tmp_path / "runs")
    exp = client.get_experiment_by_name("sat")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"full", "cut"}  # the resumed run continued in the same MLflow run

    def series(name, key):
        return [
            (m.step, m.value)
            for m in sorted(
                client.get_metric_history(runs[name].info.run_id, key), key=lambda m: m.step
            )
        ]

    cut_digest = series("cut", "rollout/prompt_digest")
    assert [s for s, _ in cut_digest] == list(range(1, 9))  # every step exactly once
    assert cut_digest == series("full", "rollout/prompt_digest")
    assert series("cut", "staleness/version_lag_max") == series("full", "staleness/version_lag_max")
    w_full = load_file(
        str(tmp_path / "runs/sat/full/checkpoints/step_8/trainer/model/model.safetensors")
    )
    w_cut = load_file(
        str(tmp_path / "runs/sat/cut/checkpoints/step_8/trainer/model/model.safetensors")
    )
    assert w_full.keys() == w_cut.keys()
    for k in w_full:
        assert (w_full[k] == w_cut[k]).all(), k


@pytest.mark.parametrize(
    "overrides,inert",
    [
        (["algo.correction=tis"], True),  # default clip=sat
        (["algo.ratio_denominator=recompute"], True),
        (["algo=decoupled_ppo"], True),
        (["algo.correction=icepop", "algo.num_minibatches=2"], False),  # pi_theta moves: d != 0
        (["algo.correction=tis", "clip=ppo"], False),  # no SAT
        ([], False),  # rollout denominator: d = log pi - log mu
    ],
)
def test_sat_with_a_recompute_denominator_warns_loudly(overrides, inert):
    from sat_cli.build.parts import loss_config
    from sat_cli.commands.train import _warn_recompute
    from sat_cli.config import load
    from sat_cli.rl.registry import sat_inert

    _, obj = load(overrides)
    assert sat_inert(loss_config(obj), obj.algo.num_minibatches) is inert
    lines: list[str] = []
    if inert:
        with pytest.warns(UserWarning, match="SAT IS INERT IN THIS RUN"):
            _warn_recompute(obj, lines.append)
        assert any("d = 0 for every token, q = 0" in x for x in lines)
    else:
        _warn_recompute(obj, lines.append)
        assert not any("INERT" in x for x in lines)
