"""Every column of a study CSV read back (``sat report <file>.csv``: ``collapse.read_rows``,
``collapse_curves.read_curves``) checked before a report is derived from it.

A column is one of the kinds below; :func:`checked_rows` walks the rows of a
:class:`csv.DictReader` and raises :class:`ValueError` ``line N, column C: …`` (the caller adds
the file) for a value its kind refuses, a row with more fields than the header (unknown keys)
or fewer (a missing column). Numbers are written by ``sat report`` as ``f"{x:.6g}"`` /
``f"{x:.9g}"`` and integers as decimal digits: anything else (``nan``, ``inf``, ``1_000``,
`` 5``, ``0x10``) is not one of its files' values and is refused, as is text with control
characters (a terminal sequence in a method's name would reach the printed tables).
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterator

NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
INTEGER = re.compile(r"-?\d+")
MAX_TEXT = 256  # characters of a text column (a run name, a method, a commit)
MAX_INTEGER = 10**12  # steps, counts
STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")  # MLflow's run statuses


def number(text: str) -> str:
    """A finite decimal number."""
    if not NUMBER.fullmatch(text) or not math.isfinite(float(text)):
        raise ValueError(f"{text[:40]!r}, want a finite number")
    return text


def optional_number(text: str) -> str:
    """A finite decimal number or empty (not logged)."""
    return text if text == "" else number(text)


def integer(lo: int, hi: int = MAX_INTEGER) -> Callable[[str], str]:
    def check(text: str) -> str:
        if not INTEGER.fullmatch(text) or not lo <= int(text) <= hi:
            raise ValueError(f"{text[:40]!r}, want an integer in [{lo}, {hi}]")
        return text

    return check


def optional_integer(lo: int) -> Callable[[str], str]:
    whole = integer(lo)
    return lambda text: text if text == "" else whole(text)


def one_of(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{text[:40]!r}, want one of {', '.join(map(repr, allowed))}")
        return text

    return check


def text(value: str) -> str:
    """At most :data:`MAX_TEXT` printable characters (no control characters)."""
    if len(value) > MAX_TEXT or not value.isprintable():
        raise ValueError(
            f"{value[:40]!r}, want at most {MAX_TEXT} printable characters (no control characters)"
        )
    return value


def checked_rows(
    reader: csv.DictReader, kinds: dict[str, Callable[[str], str]]
) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, row)`` of each row of ``reader`` whose every column passed its kind in
    ``kinds``; ``ValueError`` naming the line and the column otherwise."""
    fields = reader.fieldnames or []
    for d in reader:
        line = reader.line_num
        if None in d:  # DictReader's restkey: fields past the header
            raise ValueError(
                f"line {line}: {len(d[None])} field(s) past the header's {len(fields)}"
            )
        for column in fields:
            value = d[column]
            if value is None:  # DictReader's restval: the row ended early
                raise ValueError(f"line {line}, column {column}: missing (the row ended early)")
            check = kinds.get(column)
            if check is None:
                raise ValueError(f"line {line}, column {column}: not a column of this file")
            try:
                check(value)
            except ValueError as exc:
                raise ValueError(f"line {line}, column {column}: {exc}") from None
        yield line, d
