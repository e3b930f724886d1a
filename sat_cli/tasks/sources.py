"""A user's task data: the rows of a JSONL file, a parquet file or a Hugging Face ``datasets``
folder (``save_to_disk``), local only, mapped to ``{id, problem, answer[, system], …}``.

* **Formats.** ``*.jsonl`` is read line by line (:func:`sat_cli.tasks.data.load_jsonl`'s checks:
  UTF-8, JSON, nesting, numbers); ``*.parquet`` with ``pyarrow.parquet``; a folder holding
  ``state.json`` (one split written by ``Dataset.save_to_disk``) through the Arrow IPC stream
  files that ``state.json`` lists, with ``pyarrow`` alone (the ``datasets`` package is not
  needed). A ``DatasetDict`` folder (``dataset_dict.json``) is refused naming its splits: point
  at one (``<folder>/train``).
* **Fields.** ``fields`` (``task.fields``) names the prompt and answer columns, and optionally a
  per-row system prompt and an id; every other column of the row goes with it (the reward
  receives the whole row). Without ``fields`` the known layouts of
  :func:`sat_cli.tasks.rows.normalize_row` apply (``{id, problem, answer}``, GSM8K, DAPO-Math…).
* **Damaged or hostile input** is a :class:`DataError` naming the file and the row: a missing
  column, a prompt or answer that is not text (or is empty), a column value that is not a JSON
  value (bytes, dates: drop the column), a row larger than :data:`MAX_ROW_BYTES`, non-UTF-8
  text, an unreadable parquet/Arrow file, duplicate ids, no rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.rows import as_text, check_unique, normalize_row

MAX_ROW_BYTES = 1 << 20  # one row of a user's file, all columns (a prompt is far smaller)
MAX_SIDE_BYTES = 1 << 20  # a datasets folder's state.json / dataset_dict.json (kilobytes)
FORMATS = "a .jsonl or .parquet file, or a Hugging Face datasets folder (save_to_disk)"


def _json_value(value: Any, column: str, where: str, depth: int = 0) -> Any:
    """``value`` if it is JSON data (what a reward receives); else a DataError naming the column."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: column {column!r} is {value}, not a usable value")
        return value
    if depth < 32 and isinstance(value, (list, tuple)):
        return [_json_value(v, column, where, depth + 1) for v in value]
    if depth < 32 and isinstance(value, Mapping):
        return {str(k): _json_value(v, column, where, depth + 1) for k, v in value.items()}
    raise DataError(
        f"{where}: column {column!r} holds {type(value).__name__}, not JSON data (text, numbers, "
        "lists, objects); drop or convert the column"
    )


def map_row(raw: Any, fields, *, where: str, default_id: str) -> dict[str, Any]:
    """One record mapped by ``fields`` (a ``task.fields`` object, or None: the known layouts)."""
    if fields is None or fields.prompt is None:
        return normalize_row(raw, where=where, default_id=default_id)
    if not isinstance(raw, Mapping):
        raise DataError(f"{where}: expected an object (a row of columns), got {type(raw).__name__}")
    wanted = {"prompt": fields.prompt, "answer": fields.answer}
    wanted.update({k: getattr(fields, k) for k in ("system", "id") if getattr(fields, k)})
    missing = [col for col in wanted.values() if col not in raw or raw[col] is None]
    if missing:
        raise DataError(
            f"{where}: missing column(s) {missing} (task.fields); the row has {sorted(raw)[:20]}"
        )
    row = {
        str(k): _json_value(v, str(k), where) for k, v in raw.items() if k not in wanted.values()
    }
    row["problem"] = as_text(raw[fields.prompt], fields.prompt, where)
    row["answer"] = as_text(raw[fields.answer], fields.answer, where)
    if fields.system:
        row["system"] = as_text(raw[fields.system], fields.system, where)
    row["id"] = as_text(raw[fields.id], fields.id, where) if fields.id else default_id
    return row


def _check_size(raw: Any, where: str) -> None:
    size = len(json.dumps(raw, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
    if size > MAX_ROW_BYTES:
        raise DataError(f"{where}: the row is {size} bytes; at most {MAX_ROW_BYTES} are accepted")


def _arrow_records(table, path: Path) -> Iterator[tuple[str, Any]]:
    for start in range(0, table.num_rows, 1024):
        chunk = table.slice(start, 1024).to_pylist()
        for i, raw in enumerate(chunk, start=start):
            where = f"{path}: row {i}"
            _check_size(raw, where)
            yield where, raw


def _parquet_table(path: Path):
    from sat_cli.tasks.arrow_bounds import parquet_table

    return parquet_table(path)


def _side_file(path: Path) -> object:
    """A ``datasets`` folder's JSON side file (``state.json``, ``dataset_dict.json``) through
    the bounded reader (a regular file of at most :data:`MAX_SIDE_BYTES`)."""
    from sat_cli.util.readers import read_json

    return read_json(path, what=str(path), error=DataError, max_bytes=MAX_SIDE_BYTES, max_depth=8)


def _arrow_folder_table(path: Path):
    """The table of one split saved by ``datasets``' ``save_to_disk``."""
    import pyarrow as pa

    from sat_cli.tasks.arrow_bounds import check_table, expanded_nbytes, ipc_stream_table

    if os.path.lexists(path / "dataset_dict.json"):
        try:
            splits = _side_file(path / "dataset_dict.json")["splits"]  # type: ignore[index]
        except (DataError, KeyError, TypeError):
            splits = "?"
        raise DataError(
            f"{path}: a DatasetDict folder (splits {str(splits)[:200]}); give one split's "
            f"folder, e.g. {path / 'train'}"
        )
    if not os.path.lexists(path / "state.json"):
        raise DataError(f"{path}: a folder without state.json; expected {FORMATS}")
    state = _side_file(path / "state.json")
    try:
        names = [d["filename"] for d in state["_data_files"]]  # type: ignore[index]
    except (KeyError, TypeError):
        raise DataError(f"{path}/state.json: not a datasets state file (_data_files)") from None
    tables = []
    for name in names:
        file = path / str(name)
        if Path(str(name)).name != str(name) or not file.is_file():
            raise DataError(f"{path}/state.json: data file {name!r} is not a file of the folder")
        tables.append(ipc_stream_table(file, sum(expanded_nbytes(t) for t in tables)))
    if not tables:
        raise DataError(f"{path}/state.json: lists no data files")
    try:
        table = pa.concat_tables(tables)
    except (pa.ArrowException, ValueError) as exc:
        raise DataError(f"{path}: the data files' columns differ ({str(exc)[:200]})") from None
    return check_table(table, str(path))  # the files together


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    from sat_cli.tasks.data import jsonl_records

    yield from jsonl_records(path, max_line_bytes=MAX_ROW_BYTES)


def benchmark_rows(benchmark: str, path: str | None, fields, data_dir, limit: int | None):
    """The rows of ``eval=<benchmark>``: a user's file at ``path`` (``eval=jsonl``: with
    ``task.fields``; a .jsonl file without fields as :func:`load_benchmark` does); without a
    path, a shipped benchmark by name (:func:`sat_cli.tasks.data.load_benchmark`)."""
    from sat_cli.tasks.data import load_benchmark

    if path is not None and (fields.prompt or not str(path).endswith(".jsonl")):
        rows = read_rows(path, fields)
        return rows[:limit] if limit else rows
    return load_benchmark(path if path is not None else benchmark, data_dir, limit)


def read_rows(path: str | os.PathLike, fields=None) -> list[dict[str, Any]]:
    """The rows of a user's data file or folder (module docstring), in file order."""
    path = Path(path)
    if path.is_dir():
        records = _arrow_records(_arrow_folder_table(path), path)
    elif path.suffix == ".parquet":
        records = _arrow_records(_parquet_table(path), path)
    elif path.suffix == ".jsonl" or path.is_file():
        records = _jsonl_records(path)
    else:
        raise DataError(f"{path}: no such file or folder; expected {FORMATS}")
    rows: list[dict[str, Any]] = []
    wheres: list[str] = []
    for n, (where, raw) in enumerate(records):
        rows.append(map_row(raw, fields, where=where, default_id=f"{path.stem}-{n:05d}"))
        wheres.append(where)
    if not rows:
        raise DataError(f"{path}: no rows")
    check_unique(rows, wheres)
    return rows
