"""File writes that never leave a half-written file under its final name.

``atomic_write_bytes(path, data)`` creates the parent folder, writes ``data`` to a temporary file
in the same folder (``.<name>.<random>.tmp``, mode 0600 as ``tempfile.mkstemp`` creates it),
flushes and fsyncs it, then renames it over ``path`` (``os.replace``); on any failure (also
``KeyboardInterrupt``) the temporary file is removed and the exception propagates, and ``path``
keeps its previous content. ``atomic_write_text`` writes ``text`` as UTF-8 without newline
translation; ``atomic_write_json`` writes ``json.dumps(obj, indent=1, sort_keys=True)``.

``staged_dir(final)`` is the same for a folder: the block fills a temporary sibling
(``.<name>.tmp-<random>``), which then replaces ``final`` (an existing ``final`` is removed
first); on any failure the temporary folder is removed and ``final`` is left as it was.

``write_text_fsync(path, text)`` is a plain (non-atomic) write followed by an fsync, for files
inside a temporary folder that is itself renamed into place (checkpoint manifests).

``check_regular(path)``, ``open_regular(path)`` and ``read_regular_bytes(path)``: files `sat` reads (model, tokenizer
and data files, state files) must be regular files. A FIFO named ``model.safetensors`` would
block the reader forever inside a library that never returns to Python (Ctrl-C does not stop
it); a device could be endless. They raise :class:`NotRegularFile` (an ``OSError``) for anything
else; the readers open with ``O_NONBLOCK`` and check the open descriptor, so a FIFO swapped in
after a check is still never waited on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError


class NotRegularFile(OSError):
    """A path that exists but is not a regular file (a FIFO, a device, a socket, a folder)."""

    def __init__(self, path: str | os.PathLike, mode: int):
        kind = {
            stat.S_IFIFO: "a FIFO",
            stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket",
            stat.S_IFDIR: "a folder",
        }.get(stat.S_IFMT(mode), "not a regular file")
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file", os.fspath(path))

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def check_regular(path: str | os.PathLike) -> None:
    """Raise :class:`NotRegularFile` if ``path`` (links followed) exists and is not a regular
    file; ``FileNotFoundError`` if it does not exist. Never opens it."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, mode)


def open_regular(path: str | os.PathLike):
    """``path`` opened for binary reading if it is a regular file (see the module docstring);
    never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        return os.fdopen(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of ``path``, a regular file (see the module docstring); never blocks on a FIFO."""
    with open_regular(path) as fh:
        return fh.read()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON (``indent=1``, sorted keys) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True))


def write_text_fsync(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` (not atomically) and fsync it before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike, prefix: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling folder of ``final`` that replaces ``final`` when the block
    ends normally, and is removed when it raises (see the module docstring)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"a size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"{size!r} is not a size such as 5GB, 500MB or 1000000 (bytes)")
    return parse_size(int(float(m.group(1)) * _UNITS[m.group(2)]))


def _lexists(p: Path) -> bool:
    try:
        os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """A folder a command will create or write into: every existing part of the path is a
    folder, each name fits the file system (``NAME_MAX``), the whole path fits ``PATH_MAX``, and
    the nearest existing folder is writable (``os.access``, which also sees read-only mounts);
    else ``UserError`` naming ``what``."""
    p = Path(os.path.abspath(path))
    if len(os.fsencode(p)) >= 4096:
        raise UserError(f"{what} {str(path)[:80]}…: the path is longer than the system allows")
    existing = Path(p.anchor)
    for part in p.parts[1:]:  # walk down while the parts exist (each name checked first)
        try:
            name_max = os.pathconf(existing, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        if len(os.fsencode(part)) > name_max:
            raise UserError(
                f"{what} {str(path)[:80]}…: the name {part[:40]!r}… has "
                f"{len(os.fsencode(part))} bytes; this file system allows {name_max}"
            )
        if not _lexists(existing / part):
            if (existing / part).is_symlink():
                raise UserError(f"{what} {path}: {existing / part} is a dangling symbolic link")
            break
        if not (existing / part).is_dir():
            if (existing / part).is_symlink() and not (existing / part).exists():
                raise UserError(f"{what} {path}: {existing / part} is a dangling symbolic link")
            raise UserError(f"{what} {path}: {existing / part} is a file, not a folder")
        existing = existing / part
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else "is not writable"
        raise UserError(f"{what} {path}: {existing} {why}")


def _read_only(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False
