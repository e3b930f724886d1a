"""One bounded reader per kind of user file: JSON documents, text (CSV, YAML) and safetensors
headers. Every file a user can hand `sat` (a lag profile, a replay manifest and its step files, a
worker config, a collapse-study CSV, a state file) is read through here, so the same rules hold
for each:

* a **regular file** only (a FIFO, a device or a folder is named, never opened for reading:
  :func:`sat_cli.util.fsio.open_regular`); a symbolic link is followed to what it names;
* at most ``max_bytes`` (checked on the open descriptor before reading: bounded memory);
* UTF-8 text; JSON without ``NaN``/``Infinity``, without numbers that overflow to infinity or
  integers of more than 4300 digits, nested at most ``max_depth`` levels;
* **every** parser error (``ValueError``, ``RecursionError``, ``UnicodeDecodeError``,
  ``OSError``, safetensors' own errors) becomes ``error(message)``: the caller's user-error
  class, so the command line prints one ``sat: error:`` line and exits 2.

``what`` names the file in the message (``"lag.profile=empirical:x.json: x.json"``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from sat_cli.util.fsio import open_regular

MAX_BYTES = 64 << 20  # a JSON or CSV file `sat` reads back is kilobytes; 64 MiB is generous
MAX_DEPTH = 64


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "does not exist"
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    if isinstance(exc, RecursionError):
        return f"nested more than {MAX_DEPTH} levels"
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def read_bytes(
    path: str | os.PathLike,
    *,
    what: str,
    error: Callable[[str], Exception],
    max_bytes: int = MAX_BYTES,
) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them."""
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                raise error(f"{what} is {size} bytes, more than the {max_bytes} allowed")
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{what} {_reason(exc)}") from None
    if len(data) > max_bytes:  # grew while being read
        raise error(f"{what} is more than the {max_bytes} bytes allowed")
    return data


def read_text(path: str | os.PathLike, *, what: str, error, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path`` (see :func:`read_bytes`)."""
    data = read_bytes(path, what=what, error=error, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a 64-bit float")
    return value


def depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: str | bytes, *, what: str, error, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` parsed as strict JSON (module docstring) or ``error(message)``."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({_reason(exc)})") from None
    if depth(value) > max_depth:
        raise error(f"{what} is nested more than {max_depth} levels")
    return value


def read_json(
    path: str | os.PathLike,
    *,
    what: str,
    error,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """The JSON value of the regular file ``path``, bounded (module docstring); a value of a
    given shape: ``sat_cli.records.read_checked``."""
    data = read_bytes(path, what=what, error=error, max_bytes=max_bytes)
    return parse_json(data, what=what, error=error, max_depth=max_depth)


def safetensors_header(data: bytes, *, what: str, error) -> dict:
    """The JSON header of a safetensors file held in ``data`` (checked: length, JSON object)."""
    if len(data) < 8:
        raise error(f"{what} is not a safetensors file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > MAX_BYTES:
        raise error(f"{what} is not a safetensors file (its header length {n} is past its end)")
    header = parse_json(data[8 : 8 + n], what=what, error=error, max_depth=8)
    if not isinstance(header, dict):
        raise error(f"{what} is not a safetensors file (its header is not a JSON object)")
    return header
