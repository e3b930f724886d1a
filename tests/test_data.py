"""Data loaders: the shared benchmark files, the layouts they map from, and clear errors naming
``file:line`` for every kind of malformed input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sat_cli.tasks.data import (
    DataError,
    load_benchmark,
    load_jsonl,
    load_training_prompts,
    normalize_row,
)
from sat_cli.tasks.prompts import render

# From the data README: AIME 2024 answers, I-1..I-15 then II-1..II-15.
AIME24_ANSWERS = (
    "204 25 809 116 104 294 540 197 480 113 371 385 110 104 721 "
    "73 236 45 33 80 55 699 127 902 468 601 23 321 211 315"
).split()

EXPECTED_ROWS = {
    "aime24": 30,
    "aime25": 30,
    "math500": 500,
    "gsm8k": 1319,
    "gsm8k_train": 7473,
    "deepmath": 4990,
}


def _write(path: Path, lines: list[str] | bytes) -> Path:
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _row(i: int, answer: str = "1") -> str:
    return json.dumps({"id": f"p{i}", "problem": f"What is {i}?", "answer": answer})


# --------------------------------------------------------------------------------------------
# Shared data files
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "count"), sorted(EXPECTED_ROWS.items()))
def test_benchmarks_load_from_data_dir(shared_data, name: str, count: int) -> None:
    rows = load_benchmark(name, data_dir=shared_data)
    assert len(rows) == count
    assert len({r["id"] for r in rows}) == count
    assert all(set(r) == {"id", "problem", "answer"} for r in rows)
    assert all(r["problem"] and r["answer"] for r in rows)


def test_aime24_content_and_env_fallback(shared_data, monkeypatch) -> None:
    monkeypatch.setenv("SAT_DATA_DIR", str(shared_data))
    rows = load_benchmark("aime24")
    assert [r["answer"] for r in rows] == AIME24_ANSWERS
    assert rows[0]["id"] == "aime2024-I-01" and rows[-1]["id"] == "aime2024-II-15"
    assert load_benchmark("aime24", limit=3) == rows[:3]
    # a path works too, and gives the same rows
    assert load_benchmark(shared_data / "aime24.jsonl") == rows


def test_math500_keeps_latex_answers(shared_data) -> None:
    rows = {r["id"]: r for r in load_benchmark("math500", data_dir=shared_data)}
    answers = {r["answer"] for r in rows.values()}
    assert "\\text{Evelyn}" in answers
    assert "\\left( 3, \\frac{\\pi}{2} \\right)" in answers


def test_training_prompts_gsm8k_and_seeded_shuffle(shared_data) -> None:
    rows = load_training_prompts("gsm8k", data_dir=shared_data)
    assert len(rows) == 7473 and rows[0]["answer"] == "72"
    a = load_training_prompts("gsm8k", data_dir=shared_data, seed=3, limit=50)
    b = load_training_prompts("gsm8k", data_dir=shared_data, seed=3, limit=50)
    c = load_training_prompts("gsm8k", data_dir=shared_data, seed=4, limit=50)
    assert a == b and a != c and len(a) == 50
    ids = {r["id"] for r in rows}
    assert {r["id"] for r in a} <= ids


# --------------------------------------------------------------------------------------------
# Name resolution
# --------------------------------------------------------------------------------------------


def test_unknown_name_and_missing_data_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("SAT_DATA_DIR", raising=False)
    with pytest.raises(DataError, match="unknown benchmark 'aime23'.*aime24"):
        load_benchmark("aime23")
    with pytest.raises(DataError, match="no data directory.*SAT_DATA_DIR"):
        load_benchmark("aime24")
    with pytest.raises(DataError, match="aime24.jsonl not found"):
        load_benchmark("aime24", data_dir=tmp_path)
    with pytest.raises(DataError, match="no such file"):
        load_benchmark(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_benchmark("aime24", data_dir=tmp_path, limit=0)


def test_hub_needs_datasets(tmp_path) -> None:
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("'datasets' is installed here; the missing-package message cannot be checked")
    with pytest.raises(DataError, match="needs the 'datasets' package"):
        load_benchmark("hf:HuggingFaceH4/MATH-500@test")
    with pytest.raises(DataError, match="expected hf:<owner>/<dataset>"):
        load_benchmark("hf:nonsense")
    # task=dapo_math with no local copy: the error names the offline stand-ins
    with pytest.raises(DataError, match="task=dapo_math.*gsm8k.*deepmath"):
        load_training_prompts("dapo_math", data_dir=tmp_path)
    with pytest.raises(DataError, match="task=dapo_math.*stand-ins"):
        load_training_prompts("dapo_math", data_dir=tmp_path, allow_hub=False)


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
