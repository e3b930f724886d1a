"""A model folder's internal consistency checked at start (issue 53, class 8), on damaged copies
of a real tiny model folder (``tiny_hf.make_model``): a token id past the model's vocabulary
(``len(tokenizer)`` within it), and chat templates that raise, do not compile, render nothing,
drop the prompt or refuse a system message. Each used to pass the start-up checks and fail (or
worse, generate from a wrong prompt) at the first generate."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import run_sat
from tiny_hf import make_model

from sat_cli.commands.preflight import check_chat_template, check_task_inputs, load_tokenizer
from sat_cli.errors import UserError


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3", chat=True)


def _copy(model: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(model, tmp_path / "copy"))


def _id_past_the_vocabulary(folder: Path) -> str:
    """Move the vocabulary's last token to id ``vocab_size + 50`` (the count stays the same)."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tj = json.loads((folder / "tokenizer.json").read_text())
    token = list(tj["model"]["vocab"])[-1]
    tj["model"]["vocab"][token] = vocab + 50
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    return token


def test_a_token_id_past_the_models_vocabulary_is_refused(model, tmp_path):
    assert len(load_tokenizer(str(model))) == 100  # the intact folder loads
    folder = _copy(model, tmp_path)
    token = _id_past_the_vocabulary(folder)
    with pytest.raises(UserError) as info:
        load_tokenizer(str(folder))
    assert str(info.value) == (
        f"the tokenizer of {folder} gives {token!r} the id 150, but the model's embedding has "
        "only 100 rows (config.json vocab_size; ids 0..99): they do not belong together"
    )


TEMPLATES = {
    "raises": ("{{ raise_exception('this template is broken') }}", "this template is broken"),
    "does not compile": ("{% for m in messages %}{{ m['content'] }}", "fails to render"),
    "renders nothing": ("{% for m in messages %}{% endfor %}   ", "renders a prompt as empty"),
    "drops the prompt": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}",
        "renders a prompt without its text",
    ),
    "not a template's value": ("{{ messages[5]['content'] }}", "fails to render"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_chat_template_that_cannot_render_a_prompt_is_refused(model, tmp_path, case):
    tok = load_tokenizer(str(model))
    check_chat_template({"task.template": "chat"}, tok, str(model))  # the intact one renders
    folder = _copy(model, tmp_path)
    template, message = TEMPLATES[case]
    (folder / "chat_template.jinja").write_text(template)
    with pytest.raises(UserError, match=message) as info:
        check_chat_template({"task.template": "chat"}, load_tokenizer(str(folder)), str(folder))
    assert str(info.value).startswith(f"task.template=chat: the chat template of {folder} ")
    check_chat_template({"task.template": "boxed"}, load_tokenizer(str(folder)), str(folder))


def test_a_template_that_refuses_a_system_message_is_refused_when_the_task_has_one(model, tmp_path):
    folder = _copy(model, tmp_path)
    no_system = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    (folder / "chat_template.jinja").write_text(no_system)
    tok = load_tokenizer(str(folder))

    def obj(system_prompt):
        task = SimpleNamespace(template="chat", system_prompt=system_prompt, fields=None)
        return SimpleNamespace(
            task=task,
            eval=SimpleNamespace(template="boxed"),
            engine=SimpleNamespace(name="local"),
            reward=SimpleNamespace(name="math"),
        )

    with pytest.raises(UserError, match="with a system message .*System role not supported"):
        check_task_inputs(obj("Be brief."), SimpleNamespace(), tok, str(folder))
    check_chat_template({"task.template": "chat"}, tok, str(folder))  # without one it renders


def test_sat_train_refuses_a_damaged_model_folder_before_anything_starts(model, tmp_path):
    """Through the command line: one ``sat: error:`` line, exit 2, no run folder."""
    rows = "".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(20))
    (tmp_path / "t.jsonl").write_text(rows)
    folder = _copy(model, tmp_path)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('broken on purpose') }}")
    out = run_sat(
        "train",
        "task.path=t.jsonl",
        "task.fields.prompt=q",
        "task.fields.answer=a",
        "task.template=chat",
        f"model.path={folder}",
        "run.dir=runs",
        "tracking.uri=none",
        "max_steps=1",
        cwd=tmp_path,
        timeout=180,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("sat: error:") == 1 and "Traceback" not in out.stderr
    assert "task.template=chat: the chat template of" in out.stderr
    assert "broken on purpose" in out.stderr
    assert not (tmp_path / "runs").exists()
