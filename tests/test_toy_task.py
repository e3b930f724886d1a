"""The toy addition task: problems, splits, cursor determinism, reward."""

from __future__ import annotations

import pytest

from sat_cli.tasks.toy import ToyTask, boxed_answer


def test_problem_format_and_answers_are_exact():
    task = ToyTask(digits=3, seed=0)
    for item in task.sample_prompts(50, 0) + task.heldout()[:50]:
        a, b = item["problem"].rstrip("=").split("+")
        assert len(a) == len(b) == 3 and item["problem"].endswith("=")
        assert item["answer"] == str(int(a) + int(b))
        assert item["prompt"] == item["problem"]  # template "plain"
    assert ToyTask(digits=3).problem_text(7, 45) == "007+045="


def test_cursor_determinism_allows_exact_resume():
    task = ToyTask(digits=3, seed=1)
    run = task.sample_prompts(20, 0)
    assert ToyTask(digits=3, seed=1).sample_prompts(5, 10) == run[10:15]
    other = ToyTask(digits=3, seed=2).sample_prompts(20, 0)
    assert [x["problem"] for x in other] != [x["problem"] for x in run]


def test_train_and_heldout_are_disjoint():
    task = ToyTask(digits=3, seed=0, heldout_size=300)
    held = task.heldout()
    assert len(held) == 300 and len({h["problem"] for h in held}) == 300
    train = {x["problem"] for x in task.sample_prompts(5000, 0)}
    assert not train & {h["problem"] for h in held}
    assert all(task.is_heldout(h["problem"]) for h in held)
    # about 1/10 of all 2-digit problems are held out (hash split): 10000 problems
    small = ToyTask(digits=2)
    n_held = sum(small.is_heldout(small.problem_text(a, b)) for a in range(100) for b in range(100))
    assert 800 < n_held < 1200


def test_difficulty_knob():
    item = ToyTask(digits=5, seed=0).sample_prompts(1, 0)[0]
    a, b = item["problem"].rstrip("=").split("+")
    assert len(a) == len(b) == 5
    with pytest.raises(ValueError):
        ToyTask(digits=0)


@pytest.mark.parametrize(
    "response,answer,reward",
    [
        ("\\boxed{579}", "579", 1.0),
        ("\\boxed{0579}", "579", 1.0),  # leading zero tolerated
        ("\\boxed{ 579 }", "579", 1.0),
        ("\\boxed{578}", "579", 0.0),
        ("\\boxed{1}\\boxed{579}", "579", 1.0),  # the last box counts
        ("\\boxed{579}\\boxed{1}", "579", 0.0),
        ("579", "579", 0.0),  # no box
        ("\\boxed{57a}", "579", 0.0),
        ("\\boxed{}", "579", 0.0),
        ("\\boxed{1998", "1998", 0.0),  # unclosed
    ],
)
def test_reward_table(response, answer, reward):
    assert ToyTask.reward(response, answer) == reward


def test_target_is_rewarded():
    task = ToyTask(digits=3)
    for item in task.sample_prompts(20, 0):
        assert task.reward(task.target(item["answer"]), item["answer"]) == 1.0
    assert boxed_answer("x \\boxed{12} y") == "12"
