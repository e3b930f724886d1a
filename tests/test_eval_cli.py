"""`sat eval aime24` out of the box: no data directory, no model flag, a fresh working folder.

The shipped AIME 2024 file is used, the tiny default model is evaluated (and scores 0: it only
knows 3-digit addition), ``eval.max_new_tokens`` (32768 in the benchmark config) is capped at the
model's 512 positions, and the MLflow ``eval`` run records the data file and the cap. With
``ckpt=`` (a checkpoint folder holding a copy of the shipped model, in the ``trainer/model``
layout a training run writes) or ``model.path=`` that model is evaluated instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import seeded_store

from sat_cli.tasks.data import SHIPPED_DIR

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "sat_cli" / "assets" / "tiny_moe_warm"


def _summary(root: Path) -> tuple[Path, dict]:
    (out,) = sorted((root / "runs" / "eval").glob("aime24-*"))
    return out, json.loads((out / "summary.json").read_text())


def test_sat_eval_aime24_with_no_flags(tmp_path, sat_cli, monkeypatch):
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)
    seeded_store(tmp_path / "runs" / "mlflow.db")
    out = sat_cli("eval", "aime24", "eval.n=2", "eval.limit=6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "avg@2" in out.stdout and "6/6" in out.stdout
    assert f"data {SHIPPED_DIR / 'aime24.jsonl'}" in out.stdout
    assert f"model {TINY}" in out.stdout
    assert "eval.max_new_tokens=32768 exceeds the model's context" in out.stdout
    folder, summary = _summary(tmp_path)
    assert summary["complete"] and summary["num_problems"] == 6 and summary["n"] == 2
    assert summary["meta"]["sampling"]["max_new_tokens"] == 512
    assert summary["avg@2"] == 0.0  # the addition model gets no AIME problem right
    rows = json.loads((folder / "per_problem.json").read_text())
    assert [r["id"] for r in rows] == [f"aime2024-I-0{i}" for i in range(1, 7)]
    assert all(max(r["response_tokens"]) <= 512 for r in rows)

    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eval")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["eval.data_file"] == str(SHIPPED_DIR / "aime24.jsonl")
    assert run.data.params["eval.max_new_tokens_capped"] == "512"
    assert run.data.metrics["eval/aime24/avg_at_2"] == 0.0


@pytest.mark.slow  # 2 x 13 s; `make test-full` (CI keeps the no-flags run)
@pytest.mark.parametrize("flag", ["ckpt", "model.path"])
def test_sat_eval_aime24_of_a_checkpoint_or_model_dir(tmp_path, sat_cli, monkeypatch, flag):
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)
    model = tmp_path / "ck" / "step_3" / "trainer" / "model"
    shutil.copytree(TINY, model)
    target = model.parents[1] if flag == "ckpt" else model
    out = sat_cli("eval", "aime24", "eval.n=1", "eval.limit=2", f"{flag}={target}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"model {model}" in out.stdout and "avg@1" in out.stdout
    _, summary = _summary(tmp_path)
    assert summary["complete"] and summary["num_problems"] == 2
