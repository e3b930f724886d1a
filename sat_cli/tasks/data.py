"""Benchmark and training-prompt loaders: every source becomes rows ``{id, problem, answer}``.

Sources, in the order tried by :func:`load_benchmark`:

* a benchmark name: ``aime24``, ``aime25``, ``math500``, ``gsm8k`` (``gsm8k_test.jsonl``),
  ``gsm8k_train``, ``deepmath`` (``deepmath_subset.jsonl``), found in the data directory or among
  the evaluation sets shipped in the package (:mod:`sat_cli.tasks.datafiles`; training sets are
  not shipped);
* any path to a ``.jsonl`` file;
* ``hf:<repo>[:<config>][@<split>]`` — a Hugging Face hub dataset through the ``datasets``
  package (imported lazily; the optional extra ``sat-cli[hub]``; needs the network or a warm HF
  cache).

Every row goes through one mapping, :func:`normalize_row`, that understands the layouts in use:
the project's own ``{id, problem, answer}``; AIME/MATH-500 hub copies (``problem``/``Problem``,
``answer``/``Answer``, ids from ``id``/``ID``/``unique_id``); GSM8K (``question`` and an
``answer`` holding the solution and ``#### 72``); DAPO-Math-17k (``prompt[0].content`` +
``reward_model.ground_truth``, or ``prompt`` + ``label``; the DAPO instruction wrapper is stripped
so the prompt template ``dapo`` can put it back). Numeric answers become strings.

Any malformed input raises :class:`DataError` naming ``file:line`` and the reason: bad JSON,
missing or non-string fields, an empty file, bytes that are not UTF-8, duplicate ids. Rows are
parsed defensively (:func:`parse_row`): nesting beyond ``MAX_DEPTH``, integers beyond Python's
digit limit, ``NaN``/``Infinity`` and lone UTF-16 surrogates are refused the same way.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sat_cli.tasks.datafiles import (
    BENCHMARK_FILES,
    DAPO_FILES,
    DATA_DIR_ENV,
    SHIPPED_DIR,
    STAND_INS,
    DataError,
    benchmark_file,
    dapo_missing,
    data_dir_from,
)

# Hub copies used when the name is given as `hf:` without a repo, or for DAPO training prompts.
HF_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "gsm8k_train": ("openai/gsm8k", "main", "train"),
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
}

_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'

__all__ = [
    "BENCHMARK_FILES",
    "DATA_DIR_ENV",
    "SHIPPED_DIR",
    "DataError",
    "benchmark_file",
    "data_dir_from",
    "load_benchmark",
    "load_jsonl",
    "load_training_prompts",
    "normalize_row",
]


# --------------------------------------------------------------------------------------------
# Row mapping
# --------------------------------------------------------------------------------------------


def _first(raw: Mapping[str, Any], *keys: str) -> tuple[str | None, Any]:
    for k in keys:
        if k in raw and raw[k] is not None:
            return k, raw[k]
    return None, None


def _as_text(value: Any, field: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: field {field!r} is {value}, not a usable value")
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: field {field!r} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone UTF-16 surrogate, e.g. "\ud800" in the JSON
        raise DataError(
            f"{where}: field {field!r} holds {text[err.start]!r} at character {err.start + 1}, "
            "a lone UTF-16 surrogate that is not valid Unicode text"
        ) from None
    return text


MAX_DEPTH = 32  # nesting levels of one row (the known layouts need 3)


def _depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_row(line: str, where: str) -> Any:
    """One JSON value of a JSONL line, parsed defensively: malformed JSON, nesting deeper than
    ``MAX_DEPTH`` (or than the parser's recursion limit), integers longer than Python's
    4300-digit conversion limit and the non-standard constants ``NaN`` / ``Infinity`` are all a
    ``DataError`` naming ``file:line``."""
    try:
        raw = json.loads(line, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None
    except ValueError as err:  # an integer beyond the digit limit, NaN / Infinity
        msg = str(err)
        if "digits" in msg:
            msg = f"an integer with more than {sys.get_int_max_str_digits()} digits"
        raise DataError(f"{where}: unusable JSON value ({msg[:120]})") from None
    if not _depth_ok(raw):
        raise DataError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep")
    return raw


def _strip_dapo_wrapper(text: str) -> str:
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX) :]
    if text.rstrip().endswith(_DAPO_SUFFIX):
        text = text.rstrip()[: -len(_DAPO_SUFFIX)]
    return text.strip()


def normalize_row(raw: Any, *, where: str, default_id: str) -> dict[str, str]:
    """Map one raw record of any known layout to ``{id, problem, answer}``.

    ``where`` (``file:line`` or ``hf:repo[row]``) prefixes every error message; ``default_id`` is
    used when the record has no id of its own.
    """
    if not isinstance(raw, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")

    # DAPO-Math-17k: chat-format prompt + reward_model.ground_truth, or prompt + label.
    prompt = raw.get("prompt")
    if prompt is not None and ("reward_model" in raw or "label" in raw):
        if isinstance(prompt, list):
            if not prompt or not isinstance(prompt[0], Mapping) or "content" not in prompt[0]:
                raise DataError(f"{where}: field 'prompt' must be a list of {{role, content}}")
            prompt = prompt[0]["content"]
        problem = _strip_dapo_wrapper(_as_text(prompt, "prompt", where))
        if "reward_model" in raw:
            rm = raw["reward_model"]
            if not isinstance(rm, Mapping) or "ground_truth" not in rm:
                raise DataError(f"{where}: field 'reward_model' lacks 'ground_truth'")
            answer = _as_text(rm["ground_truth"], "reward_model.ground_truth", where)
        else:
            answer = _as_text(raw["label"], "label", where)
        extra = raw.get("extra_info")
        rid = raw.get("id") or (extra.get("index") if isinstance(extra, Mapping) else None)
        return {
            "id": _as_text(rid, "id", where) if rid is not None else default_id,
            "problem": problem,
            "answer": answer,
        }

    pkey, problem = _first(raw, "problem", "Problem", "question", "Question")
    akey, answer = _first(raw, "answer", "Answer", "final_answer")
    missing = [name for name, key in (("problem", pkey), ("answer", akey)) if key is None]
    if missing:
        raise DataError(
            f"{where}: missing field(s) {missing} (have {sorted(raw)}); expected "
            "{id, problem, answer} or a known GSM8K/AIME/MATH-500/DAPO layout"
        )
    problem_text = _as_text(problem, pkey, where)
    answer_text = _as_text(answer, akey, where)
    if pkey in ("question", "Question") and "####" in answer_text:
        # GSM8K upstream: the answer field is the worked solution ending in "#### 72".
        answer_text = answer_text.rsplit("####", 1)[1].strip().replace(",", "")
        if not answer_text:
            raise DataError(f"{where}: nothing after '####' in the GSM8K answer")
    _, rid = _first(raw, "id", "ID", "unique_id", "idx")
    return {
        "id": _as_text(rid, "id", where) if rid is not None else default_id,
        "problem": problem_text,
        "answer": answer_text,
    }


def _check_unique(rows: list[dict[str, str]], wheres: list[str]) -> None:
    seen: dict[str, str] = {}
    for row, where in zip(rows, wheres, strict=True):
        if row["id"] in seen:
            raise DataError(f"{where}: duplicate id {row['id']!r} (first at {seen[row['id']]})")
        seen[row["id"]] = where


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def load_jsonl(path: str | os.PathLike, *, limit: int | None = None) -> list[dict[str, str]]:
    """Rows of a JSON Lines file (blank lines skipped), each mapped by :func:`normalize_row`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: " + ("a folder, not a JSONL file" if path.is_dir() else "no such file")
        )
    rows: list[dict[str, str]] = []
    wheres: list[str] = []
    with path.open("rb") as fh:
        for lineno, raw_line in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte {raw_line[err.start]:#04x} at column "
                    f"{err.start + 1})"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            raw = parse_row(line, where)
            rows.append(normalize_row(raw, where=where, default_id=f"{path.stem}-{lineno:05d}"))
            wheres.append(where)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise DataError(f"{path}: empty file (no JSON rows)")
    _check_unique(rows, wheres)
    return rows


def _resolve_local(name_or_path: str, data_dir: str | os.PathLike | None) -> Path | None:
    """A benchmark name (see :func:`benchmark_file`) or a JSONL path; None if neither."""
    if name_or_path in BENCHMARK_FILES:
        return benchmark_file(name_or_path, data_dir)
    candidate = Path(name_or_path)
    if candidate.suffix == ".jsonl" or candidate.is_file():
        return candidate
    return None


# --------------------------------------------------------------------------------------------
# Hugging Face hub (optional)
# --------------------------------------------------------------------------------------------


def _parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:<repo>[:<config>][@<split>]`` or ``hf:<known name>`` → (repo, config, split)."""
    body = spec.removeprefix("hf:")
    if body in HF_DATASETS:
        return HF_DATASETS[body]
    split = "train"
    if "@" in body:
        body, split = body.rsplit("@", 1)
    config = None
    if ":" in body:
        body, config = body.split(":", 1)
    if "/" not in body:
        raise DataError(
            f"{spec!r}: expected hf:<owner>/<dataset>[:<config>][@<split>] or one of "
            f"{sorted('hf:' + k for k in HF_DATASETS)}"
        )
    return body, config, split


def load_hf(spec: str, *, limit: int | None = None) -> list[dict[str, str]]:
    """Rows of a hub dataset through ``datasets`` (lazy import; clear error when missing)."""
    repo, config, split = _parse_hf_spec(spec)
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise DataError(
            f"{spec!r}: loading from the Hugging Face hub needs the 'datasets' package, which is "
            "not installed (pip install 'sat-cli[hub]', or pip install datasets), and the network "
            "or a warm HF cache; or put a JSONL copy in the data directory"
        ) from None
    ds = datasets.load_dataset(repo, config, split=split)
    rows: list[dict[str, str]] = []
    wheres: list[str] = []
    for i, raw in enumerate(ds):
        where = f"hf:{repo}[{split}][{i}]"
        rows.append(normalize_row(raw, where=where, default_id=f"{repo.split('/')[-1]}-{i:05d}"))
        wheres.append(where)
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"hf:{repo} split {split!r}: no rows")
    _check_unique(rows, wheres)
    return rows


# --------------------------------------------------------------------------------------------
# Public loaders
# --------------------------------------------------------------------------------------------


def load_benchmark(
    name_or_path: str | os.PathLike,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
) -> list[dict[str, str]]:
    """Evaluation rows ``{id, problem, answer}`` of a benchmark name, a JSONL path, or ``hf:…``.

    ``limit`` keeps the first ``limit`` rows (file order), e.g. for a quick smoke evaluation.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    spec = os.fspath(name_or_path)
    if spec.startswith("hf:"):
        return load_hf(spec, limit=limit)
    path = _resolve_local(spec, data_dir)
    if path is None:
        raise DataError(
            f"unknown benchmark {spec!r}: use one of {sorted(BENCHMARK_FILES)}, a path to a "
            ".jsonl file, or hf:<owner>/<dataset>[:<config>][@<split>]"
        )
    return load_jsonl(path, limit=limit)


def _dedupe_by_problem(rows: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    seen: set[str] = set()
    out = []
    for row in rows:
        if row["problem"] not in seen:
            seen.add(row["problem"])
            out.append(row)
    return out


def load_training_prompts(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    limit: int | None = None,
    seed: int | None = None,
    allow_hub: bool = True,
) -> list[dict[str, str]]:
    """Training rows for ``task=<name>``: ``dapo_math``, ``gsm8k``, ``deepmath`` or a JSONL path.

    ``dapo_math`` reads a DAPO-Math-17k copy from the data directory (one of
    ``dapo_math_17k.jsonl``, ``dapo-math-17k.jsonl``, ``dapo_math.jsonl``), else the hub when
    ``datasets`` is installed and ``allow_hub``; it is deduplicated by problem text (the hub parquet
    repeats each prompt many times). ``gsm8k`` is ``gsm8k_train.jsonl``. With ``seed`` the rows
    are shuffled deterministically (``random.Random(seed)``); ``limit`` is applied after that.
    """
    if name == "dapo_math":
        root = data_dir_from(data_dir)
        local = [root / f for f in DAPO_FILES if root is not None and (root / f).is_file()]
        if local:
            rows = _dedupe_by_problem(load_jsonl(local[0]))
        elif allow_hub:
            try:
                rows = _dedupe_by_problem(load_hf("hf:dapo_math"))
            except DataError as err:
                raise DataError(
                    f"task=dapo_math: {dapo_missing(root)} and the hub is not usable ({err}). "
                    f"Offline stand-ins (also external): {STAND_INS}"
                ) from None
        else:
            raise DataError(
                f"task=dapo_math: {dapo_missing(root)}; offline stand-ins (also external): "
                f"{STAND_INS}"
            )
    elif name == "gsm8k":
        rows = load_benchmark("gsm8k_train", data_dir)
    elif name in ("deepmath", "gsm8k_train"):
        rows = load_benchmark(name, data_dir)
    elif name.endswith(".jsonl") or Path(name).is_file():
        rows = load_jsonl(name)
    else:
        raise DataError(
            f"unknown training task {name!r}: use dapo_math, gsm8k, deepmath or a .jsonl path"
        )
    if seed is not None:
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    if limit is not None:
        rows = rows[:limit]
    return rows
