"""The guess environment: hand cases of its feedback, turns, rewards and rows."""

from __future__ import annotations

import pytest

from sat_cli.envs import registry
from sat_cli.envs.base import EnvSettings, is_heldout
from sat_cli.envs.guess import make_row, rows


def row(target, lo=0, hi=9):
    return {"target": target, "lo": lo, "hi": hi, "answer": str(target)}


def play(env, target, guesses):
    env.reset(row(target))
    return [env.step(g) for g in guesses]


def test_binary_search_with_feedback_finds_it_on_the_third_turn():
    env = registry.make("guess", EnvSettings(max_turns=4))
    msgs = env.reset(row(7))
    assert msgs == [
        {
            "role": "user",
            "content": "I picked an integer from 0 to 9. Guess it: reply with your guess as "
            "\\boxed{n}. If it is wrong I will say higher or lower, and you can guess again.",
        }
    ]
    steps = [env.step(t) for t in ("\\boxed{4}", "I guess 8", "7")]
    assert [s.observation for s in steps] == [
        [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "lower"}],
        [],
    ]
    assert [(s.reward, s.done) for s in steps] == [(0.0, False), (0.0, False), (1.0, True)]
    assert steps[-1].info == {"turn": 3, "guess": 7, "correct": True}
    with pytest.raises(RuntimeError, match="after the trajectory ended"):
        env.step("7")


def test_compact_style_and_the_turn_limit():
    env = registry.make("guess", EnvSettings(max_turns=2, parser="compact"))
    assert env.reset(row(0)) == [{"role": "user", "content": "0-9="}]
    steps = play(env, 0, ["\\boxed{}", "\\boxed{3}"])
    assert steps[0] == (
        [{"role": "user", "content": "a number="}],
        0.0,
        False,
        {"turn": 1, "guess": None, "correct": False},
    )
    assert steps[1] == ([], 0.0, True, {"turn": 2, "guess": 3, "correct": False})
    first = play(env, 0, ["\\boxed{0}"])
    assert first[0].reward == 1.0 and first[0].info["turn"] == 1


def test_rows_are_seeded_uniform_and_split():
    assert make_row(5) == make_row(5) and make_row(5, 10, 20)["target"] in range(10, 21)
    targets = [make_row(s)["target"] for s in range(2000)]
    assert all(160 <= targets.count(t) <= 240 for t in range(10))  # 200 ± 3 sd
    held = rows("heldout", 20)
    assert all(is_heldout("guess", r["seed"]) for r in held)
    assert not any(is_heldout("guess", r["seed"]) for r in rows("train", 20))
    assert rows("heldout", 2, lo=3, hi=4)[0]["target"] in (3, 4)


@pytest.mark.parametrize(
    "lo,hi,match",
    [(5, 5, "lo=5 must be below hi=5"), (-1, 3, "lo=-1"), (0, 10**7, "hi="), (0, True, "hi=True")],
)
def test_bad_ranges_are_refused(lo, hi, match):
    with pytest.raises(ValueError, match=match):
        make_row(0, lo, hi)


def test_a_task_row_plays_the_environments_own_training_row():
    """The training loop hands the run's task rows (the toy task's) to every environment."""
    from sat_cli.envs.guess import GuessEnv

    toy = [{"id": f"toy3-train-{i}", "prompt": "123+456=", "answer": "579"} for i in range(200)]
    own = [GuessEnv.own_row(r) for r in toy]
    assert own[0] == GuessEnv.own_row(dict(toy[0])) and own[0]["answer"] == str(own[0]["target"])
    assert not any(is_heldout("guess", r["seed"]) for r in own)
    assert len({r["seed"] for r in own}) == 200 and {r["target"] for r in own} == set(range(10))
    env = registry.make("guess", EnvSettings(parser="compact"))
    assert env.reset(toy[0]) == [{"role": "user", "content": "0-9="}] and env.row == own[0]
    kept = row(3)
    assert GuessEnv.own_row(kept) is kept  # a row of its own is kept as it is
