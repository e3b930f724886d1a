"""The held-out summary of an environment evaluation (sat_cli/evaluation/envs.py), hand cases."""

from __future__ import annotations

import json
import math

import pytest
from cli_helpers import seeded_store

from sat_cli.envs.guess import rows as guess_rows
from sat_cli.evaluation.envs import format_summary, metrics, succeeded, summarize
from sat_cli.samples import Sample


def traj(correct: bool | None, turns: int, finish: str = "stop", reward: float = 0.0) -> Sample:
    info = {} if correct is None else {"correct": correct}
    meta = {"reward": reward, "turns": turns, "info": info}
    return Sample([1], [2], [0.0], finish, 0, meta=meta)


def test_summary_of_two_rows_by_hand():
    groups = [
        [traj(True, 1), traj(True, 3), traj(False, 4, "length")],  # row 1: 2 of 3
        [traj(False, 4), traj(False, 2, "abort"), traj(True, 2)],  # row 2: 1 of 3
    ]
    s = summarize(groups, max_turns=4)
    assert s["success"] == pytest.approx(100 * (2 / 3 + 1 / 3) / 2)  # avg@3 = 50 %
    # pass@2 of a row with c of n=3 right: 1 - C(3-c, 2) / C(3, 2): c=2 -> 1, c=1 -> 2/3
    assert s["pass@k"][2] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert s["pass@k"][3] == 100.0 and s["pass@k"][1] == pytest.approx(50.0)
    assert s["turns_mean"] == pytest.approx((1 + 3 + 4 + 4 + 2 + 2) / 6)
    # successes at turns 1, 3, 2 of 6 trajectories
    assert s["success_within"] == pytest.approx({1: 100 / 6, 2: 200 / 6, 3: 50.0, 4: 50.0})
    assert s["finish"] == {"abort": 1, "length": 1, "stop": 4} and s["trajectories"] == 6
    m = metrics(s, "guess")
    assert m["eval/guess/success"] == pytest.approx(50.0)
    assert m["eval/guess/success_within_1"] == pytest.approx(100 / 6)
    assert (
        m["eval/guess/pass@3"] == 100.0
        and len(m) == 3 + 3 + 4
        and m["eval/guess/tool_error_frac"] == 0.0
    )
    text = format_summary("guess", 3, s)
    assert "success (avg@3) 50.00 %" in text and "<=1: 16.7" in text and "pass@3 100.0" in text


def test_success_is_the_last_steps_correct_else_a_positive_reward():
    assert succeeded(traj(True, 1, reward=0.0)) and not succeeded(traj(False, 1, reward=1.0))
    assert succeeded(traj(None, 1, reward=0.5)) and not succeeded(traj(None, 1, reward=0.0))


def test_an_empty_row_is_refused():
    with pytest.raises(ValueError, match="at least one trajectory per row"):
        summarize([[traj(True, 1)], []], max_turns=2)


def test_nan_metrics_are_left_out():
    s = summarize([[traj(True, 1)]], max_turns=1)
    s["turns_mean"] = math.nan
    assert "eval/x/turns_mean" not in metrics(s, "x")


def test_tool_error_frac_sums_the_last_steps_totals():
    a, b = traj(True, 2), traj(False, 3)
    a.meta["info"].update(tool_calls_total=1, tool_errors_total=0)
    b.meta["info"].update(tool_calls_total=3, tool_errors_total=2)
    s = summarize([[a, b], [traj(True, 1)]], max_turns=3)
    assert (s["tool_calls"], s["tool_error_frac"]) == (4, 0.5)


def test_sat_eval_guess_end_to_end(tmp_path, sat_cli):
    """`sat eval guess` on the shipped model: the summary's numbers are those of its own rows,
    and the MLflow run holds them."""
    seeded_store(tmp_path / "runs" / "mlflow.db")
    args = ["eval", "guess", "env.parser=compact", "env.max_tokens=128", "eval.limit=6", "eval.n=2"]
    out = sat_cli(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "guess: success (avg@2)" in out.stdout and "6 held-out rows" in out.stdout
    (folder,) = sorted((tmp_path / "runs" / "eval").glob("guess-*"))
    summary = json.loads((folder / "summary.json").read_text())
    rows = json.loads((folder / "rows.json").read_text())
    assert [r["seed"] for r in rows] == [r["seed"] for r in guess_rows("heldout", 6)]
    flags = [r["success"] for r in rows]
    assert summary["success"] == pytest.approx(100 * sum(sum(f) / 2 for f in flags) / 6)
    assert summary["complete"] and summary["trajectories"] == 12
    turns = [t for r in rows for t in r["turns"]]
    assert summary["turns_mean"] == pytest.approx(sum(turns) / 12) and max(turns) <= 4

    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    assert run.data.metrics["eval/guess/success"] == pytest.approx(summary["success"])
    assert run.data.params["eval.rows"] == "6" and run.info.status == "FINISHED"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["env=calculator"], "sat eval guess needs env=guess"),
        # the case above keeps the refusal of `sat eval guess`; these two messages:
        # test_multiturn_loop.py::test_env_section_refuses_bad_values
        pytest.param(["env.max_turns=0"], "env.max_turns", marks=pytest.mark.slow),
        pytest.param(["env.parser=xml"], "env.parser", marks=pytest.mark.slow),
    ],
)
def test_sat_eval_env_bad_input_is_one_line_and_exit_2(tmp_path, sat_cli, extra, message):
    out = sat_cli("eval", "guess", *extra, cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs" / "eval").exists()
