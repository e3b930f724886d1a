"""Errors that reach the user as a one-paragraph message and an exit code (no traceback).

``UserError`` (exit 2) and ``RunFailed`` (exit 1) with its ``TrainerError`` family here; the
engines' ``EngineError`` (exit 1) and ``EngineStartError`` (a model the engine could not load:
exit 2) live in ``sat_cli.engines.base``. The CLI catches them by type (``sat_cli.cli._guard``).
"""

import errno
import re


class UserError(Exception):
    """A problem with the user's input (config, files, paths, run names): exit code 2."""

    code = 2

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class RunFailed(Exception):
    """A run stopped on a runtime fault (a dead process, a non-recoverable I/O error): exit 1."""

    code = 1


class TrainerError(RunFailed, RuntimeError):
    """Every trainer failure derives from this: a Megatron worker that died, failed to start or
    failed a command (``MegatronWorkerError``), R3 routes that do not fit (``R3Error``). The CLI
    prints its message (the worker's log tail, tracebacks cut to their exception line) and exits
    1; it is never reported as a model that cannot be loaded."""


# errno values that mean "the disk refused the write" (a runtime fault, exit 1); every other
# OSError of a path is "this path cannot be used" (the user's input, exit 2)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def os_error(exc: OSError, what: str) -> Exception:
    """The user-facing form of an ``OSError``: ``RunFailed`` (exit 1) when the disk refused a
    write (full, quota, file too large, I/O error), else ``UserError`` (exit 2): a name too
    long, a file where a folder must be, no permission, a read-only file system."""
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    text = f"{what}: {exc.strerror or exc}{where}"
    if exc.errno in DISK_ERRNOS:
        return RunFailed(text + "; free some space (or fix the disk) and run the command again")
    return UserError(text)


def as_os_error(exc: BaseException) -> OSError | None:
    """``exc`` as an ``OSError`` if it is one, or an I/O failure that a library wrapped in its
    own type (safetensors raises ``SafetensorError: … I/O error: No space left on device (os
    error 28)`` when the disk is full); else None."""
    if isinstance(exc, OSError):
        return exc
    if type(exc).__name__ == "SafetensorError":
        import os
        import re

        m = re.search(r"os error (\d+)", str(exc))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
    return None


def without_tracebacks(message: str) -> str:
    """A worker's error message (with its log tail) with every traceback cut to its exception
    line: the frames of ``Traceback (most recent call last):`` blocks are dropped, also when a
    launcher prefixes each line (``[rank0]: ``)."""
    out, in_tb = [], False
    for line in message.splitlines():
        body = re.sub(r"^\[[^\]]*\]:? ?", "", line)
        if "Traceback (most recent call last):" in body:
            in_tb = True
            continue
        if in_tb and (not body.strip() or body[:1].isspace() or set(body.strip()) <= set("^~")):
            continue
        in_tb = False
        out.append(line)
    return "\n".join(out)
