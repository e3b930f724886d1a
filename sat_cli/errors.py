"""Errors that reach the user as a one-paragraph message and an exit code (no traceback).

``UserError`` (exit 2) and ``RunFailed`` (exit 1) with its ``TrainerError`` family; the rollout
engines' ``EngineError`` (exit 1) with ``EngineStartError`` (a model the engine could not load:
exit 2), ``WeightSyncError`` and ``WeightsMismatch`` (here, below the engines, the weight sync
and the loop that all raise or catch them; ``sat_cli.engines.base`` re-exports them). The CLI
catches them by type (``sat_cli.cli._guard``).
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


# --- the rollout engines' errors (exit 1; a model the engine could not load: exit 2) -----------
class EngineError(RuntimeError):
    """The rollout engine failed (process died, server unreachable, bad response): exit 1."""


class EngineStartError(EngineError):
    """The engine process started but reported that its model failed to load: the user's input
    (`sat train` / `sat eval` say "cannot load the model", exit 2)."""


class WeightSyncError(EngineError):
    """A weight sync that did not complete: an HTTP error or ``success: false`` from a server, a
    collective that did not finish in time, a group that did not form. The training loop sends
    that version again through the disk path once (``sat_cli.loop.weightsync``)."""


class WeightsMismatch(EngineError):
    """The weights an engine serves differ from what the trainer sent (``engine.verify_weights``):
    never a warning, the version is sent again from disk once, then the run fails."""


# errno values that mean "the disk refused the write" (a runtime fault, exit 1); every other
# OSError of a path is "this path cannot be used" (the user's input, exit 2)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
# errno values of a resource limit (memory, open files): a runtime fault too (exit 1)
RESOURCE_ERRNOS = frozenset({errno.ENOMEM, errno.EMFILE, errno.ENFILE})


def os_error(exc: OSError, what: str) -> Exception:
    """The user-facing form of an ``OSError``: ``RunFailed`` (exit 1) when the disk refused a
    write (full, quota, file too large, I/O error), else ``UserError`` (exit 2): a name too
    long, a file where a folder must be, no permission, a read-only file system."""
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    text = f"{what}: {exc.strerror or exc}{where}"
    if exc.errno in DISK_ERRNOS:
        return RunFailed(text + "; free some space (or fix the disk) and run the command again")
    if exc.errno in RESOURCE_ERRNOS:
        return RunFailed(text + "; " + _LIMITS)
    return UserError(text)


_LIMITS = (
    "the process ran out of memory or file handles: raise the limit (ulimit -v for memory, "
    "ulimit -n for open files) or free memory; checkpoints written so far are intact, continue "
    "a training run with resume=auto"
)
# what a library raises when the address space (ulimit -v) or the thread limit is exhausted
_RESOURCE_TEXT = re.compile(
    r"(cannot|can't|could not|failed to) allocate|failed to map segment|can't start new thread"
    r"|out of memory|bad_alloc",
    re.I,
)


def resource_error(exc: BaseException) -> RunFailed | None:
    """``exc`` as a one-line ``RunFailed`` (exit 1) if memory, address space (``ulimit -v``),
    threads or file handles ran out: ``MemoryError``, an ``OSError`` of :data:`RESOURCE_ERRNOS`,
    or what a library raises then (CUDA's "out of memory", "can't start new thread", a shared
    library that cannot be mapped); else None."""
    if isinstance(exc, MemoryError):
        return RunFailed(f"out of memory ({type(exc).__name__}); {_LIMITS}")
    if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
        return RunFailed(f"{exc.strerror or exc} ({type(exc).__name__}); {_LIMITS}")
    if isinstance(exc, RuntimeError | ImportError) and _RESOURCE_TEXT.search(str(exc)):
        first = str(exc).strip().splitlines()[0][:200]
        return RunFailed(f"out of memory ({type(exc).__name__}: {first}); {_LIMITS}")
    return None


def as_failure(exc: BaseException) -> Exception | None:
    """The user-facing form of an exception no layer below turned into a message: a resource
    error (:func:`resource_error`), an ``OSError`` (also one a library wrapped,
    :func:`as_os_error`: :func:`os_error`); None for anything else (a bug: its traceback is
    shown). A training run that ends this way is marked FAILED by its command, and its
    checkpoints stay as they were (they are written atomically)."""
    err = resource_error(exc)
    if err is not None:
        return err
    wrapped = as_os_error(exc)
    if wrapped is not None:
        what = "cannot use a file" if isinstance(exc, OSError) else "cannot write a file"
        return os_error(wrapped, f"{what} ({type(exc).__name__})")
    return None


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
