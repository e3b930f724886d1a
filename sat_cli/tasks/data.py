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

import os
from collections.abc import Iterable, Iterator
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
from sat_cli.tasks.rows import MAX_DEPTH, check_unique, normalize_row, parse_row  # noqa: F401

# Hub copies used when the name is given as `hf:` without a repo, or for DAPO training prompts.
HF_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "gsm8k_train": ("openai/gsm8k", "main", "train"),
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
}


__all__ = [
    "BENCHMARK_FILES",
    "DATA_DIR_ENV",
    "SHIPPED_DIR",
    "DataError",
    "benchmark_file",
    "data_dir_from",
    "load_benchmark",
    "load_jsonl",
    "load_dapo_math",
    "normalize_row",
]


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _checked(rows: list[dict[str, str]], wheres: list[str], empty: str) -> list[dict[str, str]]:
    """``rows`` if there are any and their ids are unique; else :class:`DataError`."""
    if not rows:
        raise DataError(empty)
    check_unique(rows, wheres)
    return rows


def jsonl_records(
    path: str | os.PathLike, *, max_line_bytes: int | None = None
) -> Iterator[tuple[str, Any]]:
    """``(file:line, value)`` of each non-blank line of a JSON Lines file, parsed defensively
    (:func:`parse_row`); a line longer than ``max_line_bytes`` is refused unread."""
    from sat_cli.util.fsio import NotRegularFile, open_regular

    path = Path(path)
    try:
        fh = open_regular(path)  # never waits on a FIFO
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except NotRegularFile as exc:
        what = "a folder, not a JSONL file" if path.is_dir() else exc.strerror
        raise DataError(f"{path}: {what}") from None
    with fh:
        lineno = 0
        while True:
            raw_line = fh.readline() if max_line_bytes is None else fh.readline(max_line_bytes + 1)
            if not raw_line:
                return
            lineno += 1
            where = f"{path}:{lineno}"
            if max_line_bytes is not None and len(raw_line.rstrip(b"\r\n")) > max_line_bytes:
                raise DataError(f"{where}: the line is longer than {max_line_bytes} bytes")
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte {raw_line[err.start]:#04x} at column "
                    f"{err.start + 1})"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if line.strip():
                yield where, parse_row(line, where)


def load_jsonl(path: str | os.PathLike, *, limit: int | None = None) -> list[dict[str, str]]:
    """Rows of a JSON Lines file (blank lines skipped), each mapped by :func:`normalize_row`."""
    path = Path(path)
    rows: list[dict[str, str]] = []
    wheres: list[str] = []
    for where, raw in jsonl_records(path):
        lineno = int(where.rsplit(":", 1)[1])
        rows.append(normalize_row(raw, where=where, default_id=f"{path.stem}-{lineno:05d}"))
        wheres.append(where)
        if limit is not None and len(rows) >= limit:
            break
    return _checked(rows, wheres, f"{path}: empty file (no JSON rows)")


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
    return _checked(rows, wheres, f"hf:{repo} split {split!r}: no rows")


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


def dedupe_by_problem(rows: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """The first row of each problem text (the DAPO-Math hub parquet repeats each prompt)."""
    seen: set[str] = set()
    out = []
    for row in rows:
        if row["problem"] not in seen:
            seen.add(row["problem"])
            out.append(row)
    return out


def load_dapo_math(data_dir: str | os.PathLike | None = None, allow_hub: bool = True):
    """DAPO-Math-17k's rows, deduplicated by problem text: a copy in the data directory, else
    the hub (``allow_hub``, with ``datasets`` installed); ``DataError`` naming the stand-ins."""
    root = data_dir_from(data_dir)
    local = [root / f for f in DAPO_FILES if root is not None and (root / f).is_file()]
    if local:
        return dedupe_by_problem(load_jsonl(local[0]))
    if not allow_hub:
        raise DataError(
            f"task=dapo_math: {dapo_missing(root)}; offline stand-ins (also external): {STAND_INS}"
        )
    try:
        return dedupe_by_problem(load_hf("hf:dapo_math"))
    except DataError as err:
        raise DataError(
            f"task=dapo_math: {dapo_missing(root)} and the hub is not usable ({err}). "
            f"Offline stand-ins (also external): {STAND_INS}"
        ) from None
