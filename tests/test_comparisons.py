"""Comparisons that cannot mislead (issue 45): a resumed run is the experiment it started, and
`sat report` never pools runs of different models, tasks or evaluations into one cell, nor
computes statistics when no run decided an outcome.

The resume check runs on configs composed as `sat train` composes them and a ``config.yaml``
written as `sat train` writes it; the report's cells on a real MLflow sqlite store holding runs
of two models (``sat_cli.report.run.build_report``, what `sat report` calls)."""

from __future__ import annotations

import pytest
from cli_helpers import seeded_store
from omegaconf import OmegaConf

from sat_cli.commands.resume_check import check_same_config, differences
from sat_cli.config import load
from sat_cli.errors import UserError


def _run_dir(tmp_path, overrides):
    cfg, _ = load(overrides, "train")
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # as `sat train` writes it
    return tmp_path


def _new(overrides):
    cfg, _ = load(overrides, "train")
    return OmegaConf.to_container(cfg, resolve=True)


def test_resume_with_a_changed_config_is_refused_naming_the_keys(tmp_path):
    run = _run_dir(tmp_path, ["experiment=cpu_smoke"])
    new = _new(["experiment=cpu_smoke", "seed=7", "lag.n=4", "resume=auto"])
    with pytest.raises(UserError) as info:
        check_same_config(run, new, "auto")
    msg = str(info.value)
    assert "in 2 key(s): lag.n: 1 -> 4; seed: 0 -> 7." in msg, msg
    assert "resume=force" in msg and "\n" not in msg
    check_same_config(run, new, "force")  # told: continues


def test_resume_may_change_length_threads_checkpoints_and_tracking(tmp_path):
    run = _run_dir(tmp_path, ["experiment=cpu_smoke"])
    same = ["experiment=cpu_smoke", "max_steps=500", "trainer.num_threads=2", "resume=auto"]
    check_same_config(
        run, _new([*same, "checkpoint.every=5", "tracking.histogram_every=3"]), "auto"
    )
    assert differences({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == ["a.c: '<absent>' -> 2"]


def test_a_damaged_config_yaml_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: [" * 200)
    with pytest.raises(UserError, match="nested more than 100 levels"):
        check_same_config(tmp_path, {"seed": 0}, "auto")


# ----------------------------------------------------------------------------- sat report
def _store(tmp_path, runs, extra=None):
    """A real MLflow sqlite store with one finished run per ``(model, seed, evals)``; ``extra``:
    more params per run (``extra[i]`` for run ``i``)."""
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}"  # an empty store, not created here
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mixed")
    for i, (model, seed, evals) in enumerate(runs):
        run = client.create_run(exp, run_name=f"{model}-s{seed}-{i}")
        params = {
            "algo.name": "grpo",
            "clip.name": "ppo",
            "lag.n": "1",
            "seed": str(seed),
            "model.name": model,
            "task.name": "toy_add",
            "eval.name": "toy",
            "run.name": f"r{i}",  # names and places a run: never splits a cell
            "tracking.uri": f"sqlite:///{i}.db",
            "machine.cpu.count": str(i),  # the recorded machine: warned about, not split
            **(extra[i] if extra else {}),
        }
        for k, v in params.items():
            client.log_param(run.info.run_id, k, v)
        for step, value in evals:
            client.log_metric(run.info.run_id, "eval/toy/avg_at_8", value, step=step)
        client.set_terminated(run.info.run_id, "FINISHED")
    mlflow.set_tracking_uri(uri)
    return client


def test_report_splits_a_cell_holding_runs_of_two_models(tmp_path):
    from sat_cli.report.run import build_report

    client = _store(
        tmp_path,
        [
            ("tiny_moe", 0, [(0, 10.0), (5, 20.0)]),
            ("tiny_moe", 1, [(0, 11.0), (5, 21.0)]),
            ("qwen3_0_6b", 0, [(0, 50.0), (5, 60.0)]),
        ],
    )
    rep = build_report(client, "mixed")
    rows = rep["rows"]
    assert sorted(rows) == ["GRPO · model=qwen3_0_6b", "GRPO · model=tiny_moe"]
    sizes = {row: len(rep["cells"][(row, "1")].runs) for row in rows}
    assert sizes == {"GRPO · model=tiny_moe": 2, "GRPO · model=qwen3_0_6b": 1}  # never n = 3
    note = next(n for n in rep["selection"].notes if "differ in model" in n)
    assert "qwen3_0_6b, tiny_moe" in note


def test_report_splits_a_cell_on_every_differing_parameter_but_the_seed(tmp_path):
    """Runs of one method and lag that differ in the learning rate or the batch size are never
    one cell (issue 55: "n = 2" of two learning rates); the seed, names and the recorded
    machine do not split."""
    from sat_cli.report.run import build_report

    ev = [(0, 10.0), (5, 20.0)]
    lrs = [{"trainer.lr": "0.0003"}, {"trainer.lr": "0.0003"}, {"trainer.lr": "0.001"}]
    client = _store(tmp_path, [("tiny_moe", s, ev) for s in (0, 1, 0)], lrs)
    rep = build_report(client, "mixed")
    sizes = {row: len(rep["cells"][(row, "1")].runs) for row in rep["rows"]}
    assert sizes == {"GRPO · trainer.lr=0.0003": 2, "GRPO · trainer.lr=0.001": 1}
    assert any("differ in trainer.lr" in n for n in rep["selection"].notes)
    both = [{"trainer.lr": "1", "task.prompts_per_step": "8"}, {"trainer.lr": "2"}]
    client = _store(tmp_path / "b", [("tiny_moe", s, ev) for s in (0, 1)], both)
    rows = build_report(client, "mixed")["rows"]
    want = [
        "GRPO · task.prompts_per_step=8 · trainer.lr=1",
        "GRPO · task.prompts_per_step=? · trainer.lr=2",
    ]
    assert rows == want


def test_report_refuses_two_runs_of_one_seed_in_a_cell(tmp_path):
    from sat_cli.report.run import build_report

    ev = [(0, 10.0), (5, 20.0)]
    client = _store(tmp_path, [("tiny_moe", 0, ev), ("tiny_moe", 1, ev), ("tiny_moe", 0, ev)])
    with pytest.raises(UserError) as err:
        build_report(client, "mixed")
    msg = str(err.value)
    assert "the cell 'GRPO' at lag 1 holds 2 runs of seed=0 (tiny_moe-s0-0, tiny_moe-s0-2)" in msg
    assert "which differ in machine.cpu.count, run.name, tracking.uri: a seed counts once" in msg


def test_report_refuses_to_compute_statistics_when_no_run_has_an_outcome(tmp_path):
    from sat_cli.report.run import build_report

    client = _store(tmp_path, [("tiny_moe", 0, []), ("tiny_moe", 1, [])])
    with pytest.raises(UserError, match="cannot decide an outcome"):
        build_report(client, "mixed")
