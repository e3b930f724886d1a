"""A user's own task: data files (JSONL, parquet, a `datasets` folder) with field mapping, the
held-out split of a data task, and the evaluation a data task gets by default."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import run_sat

from sat_cli.config import ConfigError, load
from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.dataset import DatasetTask, split_heldout
from sat_cli.tasks.sources import MAX_ROW_BYTES, read_rows

FIELDS = SimpleNamespace(prompt="question", answer="gold", system=None, id=None)


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + {i}?", "gold": 2 * i, "level": i % 3} for i in range(n)]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _datasets_folder(path: Path, rows: list[dict]) -> Path:
    """The layout `datasets`' Dataset.save_to_disk writes: Arrow IPC stream shards named by
    state.json's _data_files (datasets/arrow_dataset.py, save_to_disk)."""
    import pyarrow as pa

    path.mkdir()
    table = pa.Table.from_pylist(rows)
    halves = [table.slice(0, len(rows) // 2), table.slice(len(rows) // 2)]
    names = [f"data-{i:05d}-of-00002.arrow" for i in range(2)]
    for name, part in zip(names, halves, strict=True):
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x", "_split": None}
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text("{}")
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_each_format_maps_fields_and_keeps_extra_columns(tmp_path, fmt):
    rows = _rows(6)
    write = {"jsonl": _jsonl, "parquet": _parquet, "datasets": _datasets_folder}[fmt]
    src = write(tmp_path / f"data.{fmt}" if fmt != "datasets" else tmp_path / "ds", rows)
    got = read_rows(src, FIELDS)
    assert [r["problem"] for r in got] == [f"What is {i} + {i}?" for i in range(6)]
    assert [r["answer"] for r in got] == [str(2 * i) for i in range(6)]
    assert [r["level"] for r in got] == [i % 3 for i in range(6)]  # extra column, for the reward
    assert len({r["id"] for r in got}) == 6
    assert "question" not in got[0] and "gold" not in got[0]


def test_heldout_split_is_a_function_of_the_problems_not_the_order():
    rows = [{"id": str(i), "problem": f"p{i}", "answer": "1"} for i in range(40)]
    train, held = split_heldout(rows, 0.1, "x")
    # reference: the 4 problems with the lowest SHA-256
    want = sorted(rows, key=lambda r: hashlib.sha256(r["problem"].encode()).digest())[:4]
    assert [r["id"] for r in held] == sorted((r["id"] for r in want), key=int)
    assert len(train) == 36 and not {r["id"] for r in train} & {r["id"] for r in held}
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    assert {r["id"] for r in split_heldout(shuffled, 0.1, "x")[1]} == {r["id"] for r in held}
    assert len(split_heldout(rows[:3], 0.01, "x")[1]) == 1  # at least one
    with pytest.raises(DataError, match="at least 2"):
        split_heldout(rows[:1], 0.5, "x")


def test_data_task_defaults_to_its_own_heldout_split(tmp_path):
    data = _jsonl(tmp_path / "t.jsonl", _rows(20))
    cfg, obj = load(
        [
            f"task.path={data}",
            "task.fields.prompt=question",
            "task.fields.answer=gold",
            f"model.path={tmp_path}",
        ]
    )
    assert (obj.task.kind, obj.eval.benchmark, cfg.task.kind) == ("file", "heldout", "file")
    task = DatasetTask.from_config(obj.task, data_dir=None, seed=0, heldout=True)
    assert len(task.rows) == 18 and len(task.heldout()) == 2
    assert not {r["id"] for r in task.rows} & {r["id"] for r in task.heldout()}
    # the toy default keeps its own evaluation
    _, toy = load([])
    assert (toy.eval.benchmark, toy.eval.name) == ("toy", "toy")


def test_explicit_toy_eval_of_a_data_task_is_refused():
    with pytest.raises(ConfigError, match="eval=toy evaluates the toy task"):
        load(["task=gsm8k", "model=qwen3_0_6b", "eval=toy"])
    _, obj = load(["task=gsm8k", "model=qwen3_0_6b", "eval=gsm8k"])  # a benchmark: fine
    assert obj.eval.benchmark == "gsm8k"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.fields.prompt=question", "set together"),
        ("task.heldout_frac=1.0", "task.heldout_frac=1.0 is out of range"),
        ("task.heldout_frac=0", "task.heldout_frac=0"),
        ("task.path=''", "task.path is empty"),
        ("task.kind=jsonl", "needs task.path"),
    ],
)
def test_task_data_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load(["model.path=x", override])


def _bad(tmp_path: Path, case: str) -> tuple[Path, str]:
    p = tmp_path / "bad.jsonl"
    if case == "missing column":
        _jsonl(p, [{"question": "a", "gold": 1}, {"question": "b"}])
        return p, r"bad.jsonl:2: missing column\(s\) \['gold'\]"
    if case == "wrong type":
        _jsonl(p, [{"question": ["a"], "gold": 1}])
        return p, "bad.jsonl:1: field 'question' must be a string, got list"
    if case == "not utf-8":
        p.write_bytes(b'{"question": "a", "gold": 1}\n{"question": "\xff", "gold": 1}\n')
        return p, "bad.jsonl:2: not valid UTF-8"
    if case == "huge row":
        _jsonl(p, [{"question": "a", "gold": 1}, {"question": "x" * MAX_ROW_BYTES, "gold": 1}])
        return p, f"bad.jsonl:2: the line is longer than {MAX_ROW_BYTES} bytes"
    if case == "huge parquet row":
        p = _parquet(tmp_path / "bad.parquet", [{"question": "x" * MAX_ROW_BYTES, "gold": 1}])
        return p, "bad.parquet: row 0: the row is"
    if case == "bytes column":
        p = _parquet(tmp_path / "bad.parquet", [{"question": "a", "gold": 1, "blob": b"\x00"}])
        return p, "bad.parquet: row 0: column 'blob' holds bytes"
    if case == "damaged parquet":
        p = tmp_path / "bad.parquet"
        p.write_bytes(b"PAR1 not really")
        return p, "bad.parquet: not a readable parquet file"
    if case == "datasets dict":
        d = tmp_path / "dd"
        d.mkdir()
        (d / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
        return d, r"a DatasetDict folder \(splits \['train', 'test'\]\)"
    if case == "shard outside":
        d = tmp_path / "ds"
        d.mkdir()
        (d / "state.json").write_text('{"_data_files": [{"filename": "../x.arrow"}]}')
        return d, "is not a file of the folder"
    if case == "duplicate ids":
        _jsonl(p, [{"question": "a", "gold": 1, "k": "1"}, {"question": "b", "gold": 1, "k": "1"}])
        return p, "bad.jsonl:2: duplicate id '1'"
    raise AssertionError(case)


BAD = [
    "missing column",
    "wrong type",
    "not utf-8",
    "huge row",
    "huge parquet row",
    "bytes column",
    "damaged parquet",
    "datasets dict",
    "shard outside",
    "duplicate ids",
]


@pytest.mark.parametrize("case", BAD)
def test_damaged_files_are_refused_naming_file_and_row(tmp_path, case):
    path, message = _bad(tmp_path, case)
    fields = SimpleNamespace(**{**vars(FIELDS), "id": "k" if case == "duplicate ids" else None})
    with pytest.raises(DataError, match=message):
        read_rows(path, fields)


def test_bad_file_exits_2_before_anything_starts(tmp_path):
    path, _ = _bad(tmp_path, "not utf-8")
    out = run_sat(
        "train",
        f"task.path={path}",
        "task.fields.prompt=question",
        "task.fields.answer=gold",
        f"model.path={tmp_path}",
        "run.dir=runs",
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "bad.jsonl:2: not valid UTF-8" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_advertised_gsm8k_command_trains_on_its_own_heldout_split(tmp_path):
    """`sat train model=qwen3_0_6b task=gsm8k data.dir=<dir>` (conf/task/gsm8k.yaml) with a tiny
    local Qwen3 and a GSM8K-format file: it evaluates its held-out rows, exit 0."""
    from mlflow import MlflowClient
    from tiny_hf import make_model

    model = make_model(tmp_path / "qwen3", "qwen3")
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(
        data / "gsm8k_train.jsonl",
        [
            {
                "question": f"Tom has {i} apples and buys 2 more. How many?",
                "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}",
            }
            for i in range(20)
        ],
    )
    out = run_sat(
        "train",
        "model=qwen3_0_6b",
        "task=gsm8k",
        f"data.dir={data}",
        f"model.path={model}",
        "max_steps=2",
        "task.prompts_per_step=2",
        "task.samples_per_prompt=2",
        "task.max_new_tokens=4",
        "eval.n=1",
        "eval.every=1",
        "run.dir=runs",
        "run.name=g",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sat").experiment_id])
    assert run.data.params["eval.benchmark"] == "heldout"
    evals = client.get_metric_history(run.info.run_id, "eval/heldout/avg_at_1")
    assert sorted(m.step for m in evals) == [0, 1, 2]
