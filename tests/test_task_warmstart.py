"""The warm start on a user's file task (`sat pretrain task.path=…`): the supervised example of
one row (hand case), the character-set refusal, the cache key's dependence on the data, the
shipped toy warm start's key, and a CPU smoke of `sat pretrain` on a tiny file task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run_sat
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_cli.build.task_warmstart import TaskSft, sft_split, task_config, task_key
from sat_cli.config import load
from sat_cli.config.task import FieldsConfig, TaskConfig
from sat_cli.models.tiny_moe import CHARS, build_char_tokenizer, load_model
from sat_cli.models.warmstart import SHIPPED, pad_batch, toy_warm_start_key
from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.sft_data import check_charset, sft_example

REPO = Path(__file__).resolve().parents[1]
TOK = build_char_tokenizer()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _mul_rows(pairs) -> list[dict]:
    return [{"q": f"{a}*{b}=", "p": str(a * b)} for a, b in pairs]


def test_sft_example_of_one_row_hand_case():
    # the char tokenizer: <pad> 0, <eos> 1, <unk> 2, then chr(32)..chr(126) as 3..97: id = ord - 29
    ids, labels = sft_example(TOK, "12*3=", "36")
    prompt = [20, 21, 13, 22, 32]  # '1' 49, '2' 50, '*' 42, '3' 51, '=' 61
    # '\' 92, 'b' 98, 'o' 111, 'x' 120, 'e' 101, 'd' 100, '{' 123, '3' 51, '6' 54, '}' 125, <eos>
    target = [63, 69, 82, 91, 72, 71, 94, 22, 25, 96, 1]
    assert ids == prompt + target
    assert labels == [-100] * 5 + target  # the loss is on the target and EOS only
    # a batch of two rows: right-padded with <pad>, labels -100 and attention 0 on the padding
    short = sft_example(TOK, "2*3=", "6")
    ids_b, att, lab = pad_batch([(ids, labels), short], TOK.pad_token_id)
    n = len(short[0])  # 4 + len("\boxed{6}") + 1 = 14, against 16
    assert n == 14 and ids_b.shape == lab.shape == att.shape == (2, 16)
    assert ids_b[1].tolist() == short[0] + [0, 0] and lab[1].tolist() == short[1] + [-100, -100]
    assert att[1].tolist() == [1] * 14 + [0, 0] and att[0].tolist() == [1] * 16
    assert torch.equal(lab[0], torch.tensor(labels))


def test_a_character_outside_the_tiny_tokenizer_is_refused_naming_it_and_the_row():
    rows = [
        {"id": "r0", "problem": "2*3=", "answer": "6"},
        {"id": "r1", "problem": "2×3=", "answer": "6"},
    ]
    with pytest.raises(DataError, match=r"^d\.jsonl: row 'r1': its prompt holds '×' \(U\+00D7\)"):
        check_charset(TOK, rows, lambda r: r["problem"], "d.jsonl")
    rows = [{"id": "r0", "problem": "1/2=", "answer": "½"}]
    with pytest.raises(DataError, match=r"row 'r0': its answer holds '½' \(U\+00BD\)"):
        check_charset(TOK, rows, lambda r: r["problem"], "d.jsonl")
    # the rendered prompt is what is checked: a template can bring a character of its own
    with pytest.raises(DataError, match=r"its prompt holds '→'"):
        check_charset(TOK, rows, lambda r: "→" + r["problem"], "d.jsonl")


@settings(max_examples=25, deadline=None)
@given(st.text(max_size=12), st.text(max_size=6))
def test_charset_refuses_exactly_the_characters_the_tokenizer_lacks(problem, answer):
    rows = [{"id": "x", "problem": problem, "answer": answer}]
    bad = [c for c in problem + "\\boxed{" + answer + "}" if c not in CHARS]
    if not bad:
        check_charset(TOK, rows, lambda r: r["problem"], "f")
        return
    with pytest.raises(DataError) as info:
        check_charset(TOK, rows, lambda r: r["problem"], "f")
    assert f"holds {bad[0]!r} (U+{ord(bad[0]):04X})" in str(info.value)


def test_sat_pretrain_refuses_the_task_before_training(tmp_path):
    rows = _mul_rows([(12, 3), (45, 6), (7, 8)])
    rows[2]["q"] = "7·8="
    _write(tmp_path / "d.jsonl", rows)
    out = run_sat(
        "pretrain",
        "task.path=d.jsonl",
        "task.fields.prompt=q",
        "task.fields.answer=p",
        "run.dir=runs",
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "d.jsonl: row 'd-00002': its prompt holds '·' (U+00B7)" in out.stderr
    assert not list((tmp_path / "runs").rglob("*_task-*"))  # nothing trained or cached


def _task(path: Path, **kw) -> TaskConfig:
    return TaskConfig(path=str(path), fields=FieldsConfig(prompt="q", answer="p"), **kw)


def test_the_cache_key_changes_with_the_file_the_columns_and_the_template(tmp_path):
    data = _write(tmp_path / "d.jsonl", _mul_rows([(12, 3), (45, 6)]))
    sft = TaskSft(8, 3e-3, 5, 0.2, 100, 20, 16)

    def key(t: TaskConfig, s: TaskSft = sft, base: str = "b") -> str:
        return task_key({"warm_start": base}, task_config(t), s, "2.13.0")

    k0 = key(_task(data))
    assert key(_task(data)) == k0  # the same inputs: the same key
    _write(data, _mul_rows([(12, 3), (45, 7)]))  # one answer changes
    k1 = key(_task(data))
    assert k1 != k0
    _write(data, _mul_rows([(12, 3), (45, 6)]))  # back: the cached warm start applies again
    assert key(_task(data)) == k0
    swapped = TaskConfig(path=str(data), fields=FieldsConfig(prompt="p", answer="q"))
    assert key(swapped) != k0  # the columns' roles
    assert key(_task(data, template="Q: {problem}")) != k0
    held = _write(tmp_path / "h.jsonl", _mul_rows([(99, 9)]))
    assert key(_task(data, heldout_path=str(held))) != k0  # which rows are trained on
    assert key(_task(data), base="other") != k0
    assert key(_task(data), TaskSft(8, 1e-3, 5, 0.2, 100, 20, 16)) != k0


def test_the_shipped_toy_warm_start_keeps_its_key(tmp_path, monkeypatch):
    """The default run still starts from the shipped checkpoint: its key is unchanged."""
    from sat_cli.build.parts import model_path
    from sat_cli.models import warmstart

    shipped = json.loads((SHIPPED / "warmstart.json").read_text())["key"]
    assert shipped == "a9ff1bf251b2215abb441a873525fd9413a8eb6b1fa2b3b1336d92e7679c9a0d"
    assert toy_warm_start_key() == shipped

    def no_training(*a, **k):
        raise AssertionError("the default config would train a warm start")

    monkeypatch.setattr(warmstart, "train_warm_start", no_training)
    _, obj = load([f"run.dir={tmp_path}"])
    assert Path(model_path(obj, log=lambda m: None)) == SHIPPED


def test_validation_and_heldout_rows_are_not_trained_on(tmp_path, monkeypatch):
    pairs = [(a, b) for a in range(10, 30) for b in range(2, 6)]  # 80 rows
    _write(tmp_path / "t.jsonl", _mul_rows(pairs[:60]))
    _write(tmp_path / "h.jsonl", _mul_rows(pairs[60:]))
    args = ["task.path=t.jsonl", "task.heldout_path=h.jsonl", "task.fields.prompt=q"]
    _, obj = load([*args, "task.fields.answer=p", "model.warm_start.eval_size=4"])
    monkeypatch.chdir(tmp_path)
    task, rows, val = sft_split(obj, TOK)
    train = {r["problem"] for r in rows}
    assert len(task.rows) == 60 and len(rows) == 54  # 6 of the 60 held for validation
    assert len(val) == 4  # of which model.warm_start.eval_size are sampled
    assert not train & {r["problem"] for r in val}
    assert not train & {r["problem"] for r in task.heldout()}  # the held-out file: never


def test_sat_pretrain_on_a_file_task_smoke(tmp_path, monkeypatch):
    """A few SFT steps from the shipped toy warm start; `sat train`'s model resolves to it."""
    from sat_cli.build.parts import model_path

    _write(tmp_path / "d.jsonl", _mul_rows([(a, 3) for a in range(10, 30)]))
    args = ["task.path=d.jsonl", "task.fields.prompt=q", "task.fields.answer=p", "run.dir=runs"]
    ws = [
        "model.warm_start.batch_size=4",
        "model.warm_start.max_steps=3",
        "model.warm_start.eval_every=3",
        "model.warm_start.target_accuracy=0.0",
    ]
    out = run_sat("pretrain", *args, *ws, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (folder,) = (tmp_path / "runs" / "cache").glob("tiny_moe_task-*")
    meta = json.loads((folder / "warmstart.json").read_text())
    assert meta["steps"] == 3 and meta["reached"] and folder.name.endswith(meta["key"][:12])
    assert (meta["train_rows"], meta["validation_rows"]) == (16, 2)  # 20 rows: 2 held, 2 validate
    assert f"warm-start checkpoint: runs/cache/{folder.name}" in out.stdout
    tuned, base = load_model(folder), load_model(SHIPPED)
    assert not torch.equal(tuned.lm_head.weight, base.lm_head.weight)  # it trained
    # `sat train` (and a second `sat pretrain`) finds it in the cache: nothing trains again
    _, obj = load([*args, *ws])
    logs: list[str] = []
    monkeypatch.chdir(tmp_path)
    assert model_path(obj, log=logs.append) == f"runs/cache/{folder.name}"
    assert logs[-1] == f"task warm start: cached runs/cache/{folder.name}"


def test_a_row_longer_than_the_context_is_refused_before_training(tmp_path, monkeypatch):
    from sat_cli.build.task_warmstart import train_on_task

    rows = _mul_rows([(a, 3) for a in range(10, 30)])
    rows[5]["q"] = "1" * 600 + "*3="  # 603 + len("\boxed{...}") + EOS > the tiny model's 512
    _write(tmp_path / "d.jsonl", rows)
    _, obj = load(["task.path=d.jsonl", "task.fields.prompt=q", "task.fields.answer=p"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        DataError, match=r"row 'd-00005': its prompt and answer are \d+ tokens, over"
    ):
        train_on_task(SHIPPED, obj, TaskSft(4, 3e-3, 1, 0.0, 1, 4, 16), log=lambda m: None)


@pytest.mark.slow
def test_sat_pretrain_of_a_model_path_on_a_file_task_with_its_chat_template(tmp_path):
    """`sat pretrain model.path=<HF folder>`: SFT from that model (prompts through its chat
    template), written to the cache and printed; the base folder is left as it was."""
    from tiny_hf import make_model

    base = make_model(tmp_path / "m", "qwen3", chat=True)
    _write(tmp_path / "d.jsonl", _mul_rows([(a, 4) for a in range(10, 30)]))
    out = run_sat(
        "pretrain",
        "model=qwen3_0_6b",
        f"model.path={base}",
        "task.path=d.jsonl",
        "task.fields.prompt=q",
        "task.fields.answer=p",
        "task.template=chat",
        "run.dir=runs",
        "model.warm_start.batch_size=4",
        "model.warm_start.max_steps=2",
        "model.warm_start.eval_every=2",
        "model.warm_start.target_accuracy=0.0",
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (folder,) = (tmp_path / "runs" / "cache").glob("qwen3_0_6b_task-*")
    assert f"warm-start checkpoint: runs/cache/{folder.name}" in out.stdout
    assert json.loads((folder / "warmstart.json").read_text())["steps"] == 2
    tuned, untouched = load_model(folder), load_model(base)
    assert not torch.equal(tuned.lm_head.weight, untouched.lm_head.weight)
    assert untouched.config.model_type == tuned.config.model_type == "qwen3"
