"""`sat eval` as an object (``commands.eval.Evaluator``), in this process with a stand-in engine.

The MLflow run is open (RUNNING, params recorded) before the engine starts; an engine that
crashes mid-way leaves it FAILED, a Ctrl-C KILLED with the finished problems written and the
very KeyboardInterrupt raised again; ``eval.max_new_tokens`` above the model's context is
capped in what the engine is asked for, recorded as a param, and the config is left alone.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import seeded_store

from sat_cli.commands.eval import Evaluator
from sat_cli.config import load
from sat_cli.engines.base import Sample

mlflow = pytest.importorskip("mlflow")


class _Engine:
    """Answers every prompt with ``n`` samples; ``fail(call)`` may raise on a given call."""

    def __init__(self, fail, client):
        self.fail, self.client, self.calls, self.seen = fail, client, 0, []

    def generate(self, prompts, n, sampling):
        self.calls += 1
        (run,) = self.client.search_runs([self.client.get_experiment_by_name("eval").experiment_id])
        self.seen.append((run.info.status, sampling.max_new_tokens))
        self.fail(self.calls)
        return [
            [Sample(list(p), [5, 6], [-0.1, -0.2], "stop", 0) for _ in range(n)] for p in prompts
        ]

    def close(self):
        pass


def _run(tmp_path, monkeypatch, fail, *extra):
    runs = tmp_path / "runs"
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{seeded_store(runs / 'mlflow.db')}")
    engine = _Engine(fail, client)
    monkeypatch.setattr("sat_cli.build.components.build_engine", lambda *a, **k: engine)
    cfg, obj = load(
        ["eval=toy", "eval.n=2", "eval.limit=6", "eval.batch_size=2", f"run.dir={runs}", *extra],
        "eval",
    )
    ev = Evaluator(cfg, obj, log=lambda s: None)
    return ev, obj, engine, client


def _only_run(client):
    (run,) = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    return run


def test_an_engine_crash_mid_way_leaves_the_run_failed(tmp_path, monkeypatch):
    def crash(call):
        if call == 2:
            raise RuntimeError("engine process died")

    ev, _, engine, client = _run(tmp_path, monkeypatch, crash)
    with pytest.raises(RuntimeError, match="engine process died"):
        ev.run()
    assert [s for s, _ in engine.seen] == ["RUNNING", "RUNNING"]  # open before it evaluated
    run = _only_run(client)
    assert run.info.status == "FAILED"
    assert run.data.params["eval.model_path"] == ev.path
    assert run.data.tags["complete"] == "false"


def test_ctrl_c_mid_way_leaves_the_run_killed_and_is_raised_again(tmp_path, monkeypatch):
    stop = KeyboardInterrupt()

    def interrupt(call):
        if call == 2:
            raise stop

    ev, _, engine, client = _run(tmp_path, monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        ev.run()
    assert info.value is stop  # re-raised, not rebuilt from an error string
    run = _only_run(client)
    assert run.info.status == "KILLED" and run.data.tags["complete"] == "false"
    summary = json.loads((ev.out / "summary.json").read_text())
    assert summary["complete"] is False and summary["num_finished"] == 2  # the first batch
    assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert not run.data.metrics  # a partial score is never logged as the score


def test_a_complete_run_returns_its_result_with_the_cap(tmp_path, monkeypatch):
    ev, obj, engine, client = _run(
        tmp_path, monkeypatch, lambda call: None, "eval.max_new_tokens=100000"
    )
    res = ev.run()
    assert res.complete and res.num_finished == 6
    assert ev.max_new_tokens == 512 and {m for _, m in engine.seen} == {512}
    assert obj.eval.max_new_tokens == 100000  # returned, not written back into the config
    run = _only_run(client)
    assert run.info.status == "FINISHED" and run.data.tags["complete"] == "true"
    p = run.data.params
    assert p["eval.max_new_tokens"] == "100000" and p["eval.max_new_tokens_capped"] == "512"
    assert "eval/toy/avg_at_2" in run.data.metrics
