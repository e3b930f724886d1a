"""Data loaders: the shipped evaluation sets (provenance hashes, row counts, content), where
benchmark names are looked up (data directory, ``$SAT_DATA_DIR``, shipped fallback), the layouts
rows map from, and clear errors naming ``file:line`` for every kind of malformed input."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from sat_cli.tasks.data import (
    BENCHMARK_FILES,
    SHIPPED_DIR,
    DataError,
    benchmark_file,
    load_benchmark,
    load_jsonl,
    normalize_row,
)
from sat_cli.tasks.prompts import render
from sat_cli.tasks.registry import load_training_prompts

# From the data README: AIME 2024 answers, I-1..I-15 then II-1..II-15.
AIME24_ANSWERS = (
    "204 25 809 116 104 294 540 197 480 113 371 385 110 104 721 "
    "73 236 45 33 80 55 699 127 902 468 601 23 321 211 315"
).split()

SHIPPED_ROWS = {"aime24": 30, "aime25": 30, "math500": 500, "gsm8k": 1319, "gsm8k_test": 1319}
TRAINING_ROWS = {"gsm8k_train": 7473, "deepmath": 4990}


def _write(path: Path, lines: list[str] | bytes) -> Path:
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _row(i: int, answer: str = "1") -> str:
    return json.dumps({"id": f"p{i}", "problem": f"What is {i}?", "answer": answer})


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)


# --------------------------------------------------------------------------------------------
# Shipped evaluation sets
# --------------------------------------------------------------------------------------------


def test_provenance_matches_the_shipped_files(benchmark_data) -> None:
    """provenance.json lists every shipped JSONL file with its row count, size and SHA-256 (so a
    file changed by accident fails here), its source, revision and licence, and the licence
    texts it names exist."""
    prov = json.loads((benchmark_data / "provenance.json").read_text("utf-8"))
    sets = prov["sets"]
    assert benchmark_data == SHIPPED_DIR
    assert sorted(e["file"] for e in sets.values()) == sorted(
        p.name for p in benchmark_data.glob("*.jsonl")
    )
    assert sorted(sets) == ["aime24", "aime25", "gsm8k", "math500"]
    for name, e in sets.items():
        data = (benchmark_data / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"], f"{e['file']} changed"
        assert len(data) == e["bytes"]
        assert sum(1 for line in data.split(b"\n") if line.strip()) == e["rows"]
        assert e["rows"] == SHIPPED_ROWS[name]
        assert BENCHMARK_FILES[name] == e["file"]
        for field in ("source", "revision", "licence", "what"):
            assert isinstance(e[field], str) and len(e[field]) >= 3, (name, field)
        assert e["licence_files"]
        for lic in e["licence_files"]:
            text = (benchmark_data / lic).read_text("utf-8")
            assert "Permission is hereby granted" in text or "Apache License" in text


@pytest.mark.parametrize(("name", "count"), sorted(SHIPPED_ROWS.items()))
def test_shipped_benchmarks_load_without_a_data_dir(no_env, name: str, count: int) -> None:
    assert benchmark_file(name) == SHIPPED_DIR / BENCHMARK_FILES[name]
    rows = load_benchmark(name)
    assert len(rows) == count
    assert len({r["id"] for r in rows}) == count
    assert all(set(r) == {"id", "problem", "answer"} for r in rows)
    assert all(r["problem"] and r["answer"] for r in rows)


def test_aime24_content(no_env, benchmark_data) -> None:
    rows = load_benchmark("aime24")
    assert [r["answer"] for r in rows] == AIME24_ANSWERS
    assert rows[0]["id"] == "aime2024-I-01" and rows[-1]["id"] == "aime2024-II-15"
    assert load_benchmark("aime24", limit=3) == rows[:3]
    # a path works too, and gives the same rows
    assert load_benchmark(benchmark_data / "aime24.jsonl") == rows


def test_math500_keeps_latex_answers(no_env) -> None:
    rows = {r["id"]: r for r in load_benchmark("math500")}
    answers = {r["answer"] for r in rows.values()}
    assert "\\text{Evelyn}" in answers
    assert "\\left( 3, \\frac{\\pi}{2} \\right)" in answers
    assert rows["test/precalculus/807.json"]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


# --------------------------------------------------------------------------------------------
# Name resolution: data directory, $SAT_DATA_DIR, shipped fallback
# --------------------------------------------------------------------------------------------


def test_data_dir_and_env_override_the_shipped_copy(no_env, monkeypatch, tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    _write(mine / "aime24.jsonl", [_row(1, "7"), _row(2, "8")])
    env = tmp_path / "env"
    env.mkdir()
    _write(env / "aime24.jsonl", [_row(3, "9")])
    shipped = load_benchmark("aime24")
    # data_dir (data.dir) wins over everything
    assert [r["answer"] for r in load_benchmark("aime24", data_dir=mine)] == ["7", "8"]
    monkeypatch.setenv("SAT_DATA_DIR", str(env))
    assert [r["answer"] for r in load_benchmark("aime24")] == ["9"]
    assert [r["answer"] for r in load_benchmark("aime24", data_dir=mine)] == ["7", "8"]
    # a data directory without the file: the shipped copy
    assert load_benchmark("aime25", data_dir=mine) == load_benchmark("aime25")
    assert benchmark_file("aime25", mine) == SHIPPED_DIR / "aime25.jsonl"
    monkeypatch.setenv("SAT_DATA_DIR", "")  # empty means unset
    assert load_benchmark("aime24") == shipped


def test_missing_data_dir_is_an_error_not_a_silent_fallback(no_env, monkeypatch, tmp_path):
    with pytest.raises(DataError, match=r"data directory .*nope \(data.dir\) does not exist"):
        load_benchmark("aime24", data_dir=tmp_path / "nope")
    monkeypatch.setenv("SAT_DATA_DIR", str(tmp_path / "typo"))
    with pytest.raises(DataError, match=r"typo \(\$SAT_DATA_DIR\) does not exist"):
        load_benchmark("aime24")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is not a folder"):
        load_benchmark("math500", data_dir=tmp_path / "file")


@pytest.mark.parametrize("name", ["gsm8k_train", "deepmath"])
def test_training_sets_are_not_shipped(no_env, tmp_path, name: str) -> None:
    fname = BENCHMARK_FILES[name]
    with pytest.raises(DataError, match=f"{fname} is a training set, not shipped.*SAT_DATA_DIR"):
        load_benchmark(name)
    with pytest.raises(DataError, match=f"not in data directory {tmp_path}"):
        load_benchmark(name, data_dir=tmp_path)
    task = "gsm8k" if name == "gsm8k_train" else name
    with pytest.raises(DataError, match="not shipped with sat"):
        load_training_prompts(task)


def test_training_prompts_gsm8k_and_seeded_shuffle(tmp_path) -> None:
    """task=gsm8k reads gsm8k_train.jsonl from the data directory, in the upstream layout
    (question + worked answer ending in '#### N'); seeded shuffles are reproducible."""
    upstream = [
        json.dumps(
            {
                "question": f"Tom has {i} apples and buys {i + 1}.",
                "answer": f"... #### {2 * i + 1:,}",
            }
        )
        for i in range(200, 300)
    ]
    _write(tmp_path / "gsm8k_train.jsonl", upstream)
    rows = load_training_prompts("gsm8k", data_dir=tmp_path)
    assert len(rows) == 100 and rows[0]["answer"] == "401" and rows[-1]["answer"] == "599"
    assert rows[0]["id"] == "gsm8k_train-00001"
    a = load_training_prompts("gsm8k", data_dir=tmp_path, seed=3, limit=50)
    b = load_training_prompts("gsm8k", data_dir=tmp_path, seed=3, limit=50)
    c = load_training_prompts("gsm8k", data_dir=tmp_path, seed=4, limit=50)
    assert a == b and a != c and len(a) == 50
    assert {r["id"] for r in a} <= {r["id"] for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "count"), sorted(TRAINING_ROWS.items()))
def test_external_training_sets_load(training_data, name: str, count: int) -> None:
    rows = load_benchmark(name, data_dir=training_data)
    assert len(rows) == count and len({r["id"] for r in rows}) == count
    assert all(set(r) == {"id", "problem", "answer"} for r in rows)
    if name == "gsm8k_train":
        assert rows[0]["answer"] == "72"
        assert load_training_prompts("gsm8k", data_dir=training_data) == rows


def test_unknown_name(no_env, tmp_path) -> None:
    with pytest.raises(DataError, match="unknown benchmark 'aime23'.*aime24"):
        load_benchmark("aime23")
    with pytest.raises(DataError, match="no such file"):
        load_benchmark(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("aime24", data_dir=tmp_path, limit=0)


def test_hub_needs_datasets(no_env, tmp_path) -> None:
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("'datasets' is installed here; the missing-package message cannot be checked")
    with pytest.raises(DataError, match=r"needs the 'datasets' package.*sat-cli\[hub\]"):
        load_benchmark("hf:HuggingFaceH4/MATH-500@test")
    with pytest.raises(DataError, match="expected hf:<owner>/<dataset>"):
        load_benchmark("hf:nonsense")
    # task=dapo_math with no local copy: the error says it is not shipped and names the stand-ins
    with pytest.raises(
        DataError, match="task=dapo_math: DAPO-Math-17k is a training set.*gsm8k.*deepmath"
    ):
        load_training_prompts("dapo_math", data_dir=tmp_path)
    with pytest.raises(DataError, match="task=dapo_math.*no data directory is set.*stand-ins"):
        load_training_prompts("dapo_math", allow_hub=False)


# --------------------------------------------------------------------------------------------
# Malformed input
# --------------------------------------------------------------------------------------------


def test_malformed_json_names_file_and_line(tmp_path) -> None:
    path = _write(tmp_path / "bad.jsonl", [_row(1), '{"id": "p2", "problem": "x", ', _row(3)])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON") as info:
        load_jsonl(path)
    assert str(path) + ":2" in str(info.value)


def test_missing_field_names_file_line_and_field(tmp_path) -> None:
    path = _write(
        tmp_path / "m.jsonl", [_row(1), _row(2), json.dumps({"id": "p3", "problem": "q"})]
    )
    with pytest.raises(DataError, match=r"m\.jsonl:3: missing field\(s\) \['answer'\]"):
        load_jsonl(path)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"id": "a", "problem": "q", "answer": ["1"]}, "field 'answer' must be a string, got list"),
        ({"id": "a", "problem": "q", "answer": True}, "field 'answer' must be a string, got bool"),
        ({"id": "a", "problem": "  ", "answer": "1"}, "field 'problem' is empty"),
        (["not", "an", "object"], "expected a JSON object, got list"),
    ],
)
def test_wrong_field_types(tmp_path, record, reason: str) -> None:
    path = _write(tmp_path / "t.jsonl", [json.dumps(record)])
    with pytest.raises(DataError, match=r"t\.jsonl:1: " + reason.replace("(", r"\(")):
        load_jsonl(path)


def test_empty_and_blank_files(tmp_path) -> None:
    with pytest.raises(DataError, match=r"e\.jsonl: empty file"):
        load_jsonl(_write(tmp_path / "e.jsonl", b""))
    with pytest.raises(DataError, match=r"b\.jsonl: empty file"):
        load_jsonl(_write(tmp_path / "b.jsonl", ["", "   ", ""]))
    # blank lines between rows are skipped; line numbers still count them
    rows = load_jsonl(_write(tmp_path / "ok.jsonl", [_row(1), "", _row(2)]))
    assert [r["id"] for r in rows] == ["p1", "p2"]


def test_non_utf8_names_file_and_line(tmp_path) -> None:
    data = (_row(1) + "\n").encode() + b'{"id": "p2", "problem": "caf\xe9", "answer": "1"}\n'
    with pytest.raises(DataError, match=r"l\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        load_jsonl(_write(tmp_path / "l.jsonl", data))


def test_bom_and_duplicate_ids(tmp_path) -> None:
    rows = load_jsonl(_write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + _row(1).encode() + b"\n"))
    assert rows == [{"id": "p1", "problem": "What is 1?", "answer": "1"}]
    with pytest.raises(DataError, match=r"d\.jsonl:3: duplicate id 'p1' \(first at .*d\.jsonl:1\)"):
        load_jsonl(_write(tmp_path / "d.jsonl", [_row(1), _row(2), _row(1)]))


def test_unicode_line_separator_inside_strings_is_not_a_line_break(tmp_path) -> None:
    # U+2028 is legal inside a JSON string; splitting on it would break the row in two.
    rec = {"id": "u", "problem": "a\u2028b", "answer": "1"}
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_jsonl(path) == [rec]


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------

DAPO_CONTENT = render("dapo", "Find $x$ if $x+1=3$.")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # GSM8K upstream: the answer holds the worked solution and "#### <number>"
        (
            {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,007"},
            {"id": "dflt", "problem": "How many?", "answer": "1007"},
        ),
        # AIME hub copies: capitalised fields, integer answers
        (
            {"ID": "2024-I-1", "Problem": "Every morning...", "Answer": 204},
            {"id": "2024-I-1", "problem": "Every morning...", "answer": "204"},
        ),
        # MATH-500 hub: unique_id
        (
            {"problem": "P", "solution": "S", "answer": "\\frac12", "unique_id": "test/x/1.json"},
            {"id": "test/x/1.json", "problem": "P", "answer": "\\frac12"},
        ),
        # DAPO-Math-17k (hub parquet): chat prompt + reward_model.ground_truth
        (
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": DAPO_CONTENT}],
                "reward_model": {"ground_truth": "2", "style": "rule-lm"},
                "extra_info": {"index": "a1b2"},
            },
            {"id": "a1b2", "problem": "Find $x$ if $x+1=3$.", "answer": "2"},
        ),
        # DAPO deduplicated copies: prompt + label
        (
            {"prompt": DAPO_CONTENT, "label": "2"},
            {"id": "dflt", "problem": "Find $x$ if $x+1=3$.", "answer": "2"},
        ),
    ],
)
def test_layouts_map_to_rows(raw, expected) -> None:
    assert normalize_row(raw, where="f:1", default_id="dflt") == expected


def test_dapo_wrapper_round_trips_through_template() -> None:
    row = normalize_row({"prompt": DAPO_CONTENT, "label": "2"}, where="f:1", default_id="d")
    assert render("dapo", row["problem"]) == DAPO_CONTENT


def test_dapo_local_copy_is_deduplicated(tmp_path) -> None:
    recs = [
        {"prompt": [{"role": "user", "content": render("dapo", f"Q{i % 3}")}], "label": str(i % 3)}
        for i in range(7)
    ]
    _write(tmp_path / "dapo_math_17k.jsonl", [json.dumps(r) for r in recs])
    rows = load_training_prompts("dapo_math", data_dir=tmp_path)
    assert [(r["problem"], r["answer"]) for r in rows] == [("Q0", "0"), ("Q1", "1"), ("Q2", "2")]
    assert [r["id"] for r in rows] == [
        "dapo_math_17k-00001",
        "dapo_math_17k-00002",
        "dapo_math_17k-00003",
    ]


def test_bad_dapo_records(tmp_path) -> None:
    with pytest.raises(DataError, match="f:9: field 'reward_model' lacks 'ground_truth'"):
        normalize_row({"prompt": "x", "reward_model": {}}, where="f:9", default_id="d")
    with pytest.raises(DataError, match="f:9: field 'prompt' must be a list"):
        normalize_row({"prompt": [], "label": "1"}, where="f:9", default_id="d")
