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
        # probe (issue 53 v5): reward settings the chosen reward does not read composed
        (
            ["reward.batched=true"],
            r"reward.batched is a setting of reward=python or reward=http; "
            r"with reward=math it would be ignored",
        ),
        (
            ["reward=python", "reward.fn=r.py:f", "reward.url=http://127.0.0.1:1/"],
            r"reward.url is a setting of reward=http; with reward=python it would be ignored",
        ),
        (
            ["reward=http", "reward.url=http://127.0.0.1:1/", "reward.memory_mb=512"],
            r"reward.memory_mb is a setting of reward=python; with reward=http it would be ignored",
        ),
        (
            ["env.sandbox=unsafe_local"],
            r"env.sandbox is a setting of a multi-turn environment \(env=calculator or "
            r"env=guess\); with env=none it would be ignored",
        ),
        (["env.max_turns=5"], r"env.max_turns is a setting of a multi-turn environment"),
        (
            ["reward=exact", "+reward.weights.a=1"],
            r"reward.weights is a setting of reward=python or reward=http; "
            r"with reward=exact it would be ignored",
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


def test_reward_settings_of_the_chosen_reward_compose(tmp_path, monkeypatch):
    """The settings each reward reads still compose with it (the check above is per reward)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"q": "1+1", "a": "2"}\n')
    load(BASE + ["reward=python", "reward.fn=r.py:f", "reward.batched=true", "reward.workers=3"])
    load(BASE + ["reward=http", "reward.url=http://127.0.0.1:1/", "reward.deadline_s=90"])
    load(BASE + ["reward=regex", "reward.pattern=x", "reward.on_error=-1"])


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


PAPER = "experiment=paper_qwen3_30b_a3b"


@pytest.mark.parametrize(
    ("refused", "accepted", "message"),
    [
        (  # the tiny model has 512 positions (sat_cli/models/arch.py)
            ["task.max_new_tokens=512"],
            ["task.max_new_tokens=511"],
            r"task.max_new_tokens=512 does not fit the model's max_position_embeddings=512 "
            r"\(the tiny model",
        ),
        (  # Qwen3-0.6B has 32768 positions, task=dapo_math asks for 32768 new tokens
            ["model=qwen3_0_6b", "task=dapo_math"],
            ["model=qwen3_0_6b", "task=dapo_math", "task.max_new_tokens=32767"],
            r"task.max_new_tokens=32768 does not fit the model's max_position_embeddings=32768",
        ),
        (  # 4 turns x 128 new tokens after a prompt token: 513 > 512
            ["env=calculator", "task.max_new_tokens=128"],
            ["env=calculator", "task.max_new_tokens=128", "env.max_tokens=512"],
            r"env.max_turns=4 × task.max_new_tokens=128 = 512 tokens of the model's turns can "
            r"run past the model's max_position_embeddings=512 .* env.max_tokens=4096",
        ),
        (
            ["engine=sglang", "engine.max_total_tokens=16", "task.max_new_tokens=16"],
            ["engine=sglang", "engine.max_total_tokens=17", "task.max_new_tokens=16"],
            r"engine.max_total_tokens=16 \(the KV pool\) cannot hold one sample of "
            r"task.max_new_tokens=16",
        ),
        (  # SGLang keeps 0.4 of each shared GPU; the trainer's peak is 60.4 of 80 GB (0.75)
            [PAPER, "engine.colocate=true"],
            [PAPER, "engine.colocate=true", "engine.mem_fraction_static=0.2"],
            r"engine.colocate=true: the engine's share 0.4 of each shared GPU \(the default\) "
            r"and the Megatron trainer's estimated peak of 60.4 GB of trainer.gpu_memory_gb=80 "
            r"\(0.75\) add up to 1.15",
        ),
    ],
)
def test_budgets_that_cannot_fit_are_refused_naming_both(refused, accepted, message):
    """Token and memory budgets across sections (config/budgets.py), each at its boundary."""
    load(accepted)
    with pytest.raises(ConfigError, match=message):
        load(refused)


def test_sat_plan_refuses_a_budget_in_one_line(tmp_path):
    r = run_sat("plan", "env=calculator", "task.max_new_tokens=200", cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("sat: error:") == 1 and "Traceback" not in r.stderr
    assert "env.max_turns=4 × task.max_new_tokens=200 = 800 tokens" in r.stderr
