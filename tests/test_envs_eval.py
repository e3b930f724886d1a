"""The held-out summary of an environment evaluation (sat_cli/evaluation/envs.py), hand cases."""

from __future__ import annotations

import math

import pytest

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
