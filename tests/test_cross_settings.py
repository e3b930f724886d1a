"""Settings that contradict each other or that the chosen option ignores, refused at compose
time with one line naming both settings (issue 53, class 7): one column in two roles, the
held-out file that is the training file, a per-row system column without a chat template."""

from __future__ import annotations

import pytest
from cli_helpers import run_sat

from sat_cli.config import ConfigError, load

BASE = ["task.path=t.jsonl", "task.fields.prompt=q", "task.fields.answer=a", "model.path=m"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.fields.answer=q"],
            r"task.fields.answer and task.fields.prompt name the same column 'q'",
        ),
        (
            ["task.fields.id=a"],
            r"task.fields.id and task.fields.answer name the same column 'a'",
        ),
        (
            ["task.template=chat", "task.fields.system=q"],
            r"task.fields.system and task.fields.prompt name the same column 'q'",
        ),
        (
            ["task.fields.system=sys"],
            r"task.fields.system is the per-row system message of task.template=chat; "
            r"with task.template='plain' it would be ignored",
        ),
        (
            ["task.heldout_path=./sub/../t.jsonl"],
            r"task.heldout_path and task.path are the same data",
        ),
    ],
)
def test_contradicting_settings_are_refused_naming_both(tmp_path, monkeypatch, overrides, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "t.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    load(BASE)  # the base composes
    with pytest.raises(ConfigError, match=message):
        load(BASE + overrides)


def test_a_link_to_the_training_file_is_the_same_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    (tmp_path / "held.jsonl").symlink_to(tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match="are the same data"):
        load(BASE + ["task.heldout_path=held.jsonl"])
    (tmp_path / "other.jsonl").write_text('{"q": "2+2", "a": "4"}\n')
    load(BASE + ["task.heldout_path=other.jsonl"])  # another file: fine


def test_sat_config_refuses_them_in_one_line(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    r = run_sat("config", *BASE, "task.fields.answer=q", cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("sat: error:") == 1 and "Traceback" not in r.stderr
    assert "task.fields.answer and task.fields.prompt name the same column" in r.stderr


def test_a_chat_template_for_the_toy_evaluation_is_refused_like_the_tasks():
    """``eval.template=chat`` composed with the toy evaluation (``task.template=chat`` with
    the toy task was already refused) and failed only at start, on the tokenizer."""
    with pytest.raises(ConfigError, match="eval.template=chat with eval=toy"):
        load(["eval.template=chat"])
    with pytest.raises(ConfigError, match="task.template=chat is for data tasks"):
        load(["task.template=chat"])
    load(["eval.template=boxed"])  # a named template: fine
