"""The protocols the run's objects are typed with (sat_cli/tasks/base.py) hold for what ships:
both task sources the registry builds (the toy generator and a user's file) and both tokenizers
(the tiny models' character tokenizer, an HF tokenizer loaded from the shipped checkpoint), and
what the loop calls on them gives the values it expects."""

from __future__ import annotations

import json
from pathlib import Path

from sat_cli.build.parts import build_task
from sat_cli.config import load
from sat_cli.tasks.base import Task, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _check_task(task, right: str) -> None:
    assert isinstance(task, Task)
    first = task.sample_prompts(3, 0)
    assert len(first) == 3 and all({"prompt", "answer"} <= set(p) for p in first)
    assert task.sample_prompts(3, 0) == first  # by cursor: the same rows again
    assert task.sample_prompts(2, 1) == first[1:3]
    held = task.heldout()
    assert held and held == task.heldout()
    answer = first[0]["answer"]
    assert task.reward(right.format(answer=answer), answer) == 1.0
    assert task.reward("no answer here", answer) == 0.0


def test_the_shipped_task_sources_are_tasks(tmp_path):
    _, obj = load([])
    _check_task(build_task(obj), "\\boxed{{{answer}}}")
    rows = [{"question": f"What is {i} + 1?", "gold": str(i + 1)} for i in range(20)]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, obj = load([f"task.path={data}", "task.fields.prompt=question", "task.fields.answer=gold"])
    _check_task(build_task(obj), "The answer is \\boxed{{{answer}}}.")


def test_the_shipped_tokenizers_are_tokenizers():
    from sat_cli.models.tiny_moe import build_char_tokenizer, load_tokenizer

    for tok in (build_char_tokenizer(), load_tokenizer(ROOT / "sat_cli/assets/tiny_moe_warm")):
        assert isinstance(tok, Tokenizer)
        ids = tok("12+34=")["input_ids"]
        assert tok.decode(ids) == "12+34="
        assert tok.batch_decode([ids, ids[:2]]) == ["12+34=", "12"]
        assert isinstance(tok.pad_token_id, int)
