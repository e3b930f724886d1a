"""The calculator environment and the environment settings/registry, hand cases."""

from __future__ import annotations

import pytest

from sat_cli.envs import registry
from sat_cli.envs.base import EnvSettings, is_heldout
from sat_cli.envs.calculator import CalcError, calculate, final_number, make_problem
from sat_cli.envs.calculator import rows as calculator_rows


def tool(expr: str) -> str:
    return (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
    )


def test_problem_generation_is_seeded_and_large():
    p = make_problem(0, digits=6)
    assert p == make_problem(0, digits=6) and p != make_problem(1, digits=6)
    assert len(str(p["a"])) == len(str(p["b"])) == 6
    assert p["answer"] == str(p["a"] * p["b"]) and p["question"] == f"What is {p['a']} * {p['b']}?"
    assert make_problem(3, digits=12, op="+")["answer"] == str(
        sum(make_problem(3, digits=12, op="+")[k] for k in "ab")
    )


def test_calculate_hand_cases():
    assert calculate("985440 * 503958") == 496620371520
    assert calculate(" -(7 + 5) // 5 % 7 ") == 4  # -12 // 5 = -3; -3 % 7 = 4
    assert calculate("2 ** 64") == 18446744073709551616
    for bad in [
        "__import__('os')",
        "1.5 * 2",
        "9 ** 999",
        "1 // 0",
        "x",
        "10**100 * 10**150",
        "1" * 300,
        "[1]",
        "2 *",
    ]:
        with pytest.raises(CalcError):
            calculate(bad)


def test_final_number():
    assert final_number("it is 1,234 or rather 496620371520.") == 496620371520
    assert final_number("-17") == -17 and final_number("no digits") is None


def test_tool_then_answer_earns_the_reward():
    env = registry.make("calculator", EnvSettings(max_turns=3))
    p = make_problem(0)
    msgs = env.reset(p)
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[1]["content"] == p["question"]
    obs, reward, done, info = env.step("I'll use the tool. " + tool(f"{p['a']} * {p['b']}"))
    assert obs == [{"role": "tool", "content": "496620371520"}] and (reward, done) == (0.0, False)
    assert info == {"turn": 1, "tool_calls": 1, "parse_errors": 0, "tool_errors": 0}
    obs, reward, done, info = env.step("496,620,371,520")
    assert (obs, reward, done, info["correct"], info["turn"]) == ([], 1.0, True, True, 2)
    with pytest.raises(RuntimeError, match="after the trajectory ended"):
        env.step("again")


def test_wrong_answer_bad_calls_and_the_turn_limit():
    env = registry.make("calculator", EnvSettings(max_turns=2))
    env.reset(make_problem(0))
    assert env.step("496620371521") == (
        [],
        0.0,
        True,
        {
            "turn": 1,
            "tool_calls": 0,
            "parse_errors": 0,
            "correct": False,
            "tool_calls_total": 0,
            "tool_errors_total": 0,
        },
    )
    env.reset(make_problem(0))
    text = tool("1 // 0") + '<tool_call>{"name": "shell", "arguments": {}}</tool_call><tool_call>{'
    obs, reward, done, info = env.step(text)
    assert [m["content"] for m in obs] == [
        "error: division by zero",
        "error: unknown tool 'shell'; the tool is calculator",
        "error: a <tool_call> tag is never closed",
    ]
    assert (reward, done, info["tool_errors"], info["parse_errors"]) == (0.0, False, 2, 1)
    obs, reward, done, info = env.step(tool("1 + 1"))  # the last turn still calls a tool
    assert (obs, reward, done, info["correct"]) == ([], 0.0, True, False)
    assert (info["tool_calls_total"], info["tool_errors_total"]) == (3, 2)  # this trajectory's
    assert env.stats.calls == 3 and env.stats.errors == {"bad_call": 2}
    env.reset(make_problem(0))
    info = env.step("1")[3]
    assert (info["tool_calls_total"], info["tool_errors_total"], env.stats.calls) == (0, 0, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_tokens": 2**21}, "max_tokens"),
        ({"max_turns": True}, "max_turns"),
        ({"parser": "xml"}, "tool-call parser"),
    ],
)
def test_settings_are_bounded(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnvSettings(**kwargs)


def test_registry_refuses_unknown_and_takes_user_envs():
    with pytest.raises(ValueError, match="unknown environment 'chess'; valid: calculator, guess"):
        registry.make("chess")

    @registry.register_env("echo")
    class Echo:
        def __init__(self, settings):
            self.settings = settings

    try:
        assert registry.make("echo", EnvSettings(max_turns=1)).settings.max_turns == 1
    finally:
        del registry.ENVIRONMENTS["echo"]


def test_compact_exchange_for_the_character_level_model():
    env = registry.make("calculator", EnvSettings(max_turns=2, parser="compact"))
    p = make_problem(7, digits=3)
    assert env.reset(p) == [{"role": "user", "content": f"{p['a']}*{p['b']}="}]
    obs, reward, done, info = env.step(f"[calc:{p['a']}*{p['b']}]")
    assert obs == [{"role": "tool", "content": f"{p['a'] * p['b']}="}] and not done
    obs, reward, done, info = env.step("\\boxed{" + p["answer"] + "}")
    assert (obs, reward, done, info["correct"]) == ([], 1.0, True, True)
    env.reset(p)
    obs, *_ = env.step("[calculator:1//0][shell:ls] [oops")  # errors: one short word each
    assert [m["content"] for m in obs] == ["error=", "error=", "error="]
    assert env.stats.errors == {"bad_call": 2}


def test_rows_split_by_seed():
    train, held = calculator_rows("train", 50), calculator_rows("heldout", 5)
    assert len({r["seed"] for r in train} & {r["seed"] for r in held}) == 0
    assert [r["seed"] for r in held] == [
        s for s in range(held[-1]["seed"] + 1) if is_heldout("calculator", s)
    ]
    assert held[0] == {**make_problem(held[0]["seed"], digits=3), "seed": held[0]["seed"]}
    assert calculator_rows("train", 3, start=train[10]["seed"]) == train[10:13]
    with pytest.raises(ValueError, match="split must be one of train, heldout"):
        calculator_rows("test", 1)


def test_a_toy_task_row_plays_a_calculator_problem():
    env = registry.make("calculator", EnvSettings(parser="compact"))
    msgs = env.reset({"id": "toy3-train-5", "prompt": "123+456=", "answer": "579"})
    assert env.row["compact"] == msgs[0]["content"] and env.row["answer"] != "579"
    assert not is_heldout("calculator", env.row["seed"])
