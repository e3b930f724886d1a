"""Signals that stop a command in an orderly way: SIGTERM and SIGHUP behave like Ctrl-C.

Inside ``orderly_stop()`` (the whole of `sat train`, `sat eval`, `sat sweep`):

* **SIGTERM** (a scheduler, ``kill``) raises :class:`Terminated` — exit code 143;
* **SIGHUP** (the terminal closed, an ssh connection dropped) raises :class:`HungUp` — exit code
  129. The terminal is usually gone by then and writing to it fails with ``EIO``, which would
  break the orderly stop half-way; so standard output and error that are terminals are pointed
  at ``/dev/null`` first (what ``nohup`` does up front). Output to files or pipes is kept.

A stop signal that arrives while the MLflow store is being written (:func:`deferred`) is held
back until that call returns, so no sqlite transaction is cut in half.

Both are ``KeyboardInterrupt`` subclasses, so every ``finally`` block and ``except
KeyboardInterrupt`` of the Ctrl-C path runs: engines and trainers are closed, checkpoints stay
complete and the MLflow run ends ``KILLED``. Child processes that the orchestrator supervises
(the local engine) ignore SIGHUP and end when their parent closes them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM: stop like Ctrl-C (checkpointed state kept, MLflow run KILLED), exit 143."""

    code = 143
    signame = "SIGTERM"


class HungUp(Terminated):
    """SIGHUP: the terminal went away; the same orderly stop, exit 129."""

    code = 129
    signame = "SIGHUP"


BY_NAME = {"Terminated": Terminated, "HungUp": HungUp, "KeyboardInterrupt": KeyboardInterrupt}


def detach_terminal() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                os.dup2(null, fd)
    os.close(null)


_state = {"depth": 0, "pending": None}


def _raise(exc: BaseException) -> None:
    if _state["depth"] > 0:  # inside deferred(): raised when the block ends
        _state["pending"] = _state["pending"] or exc
        return
    raise exc


def on_sigint(signum, frame):  # pragma: no cover - exercised by the fault tests
    _raise(KeyboardInterrupt())


def on_sigterm(signum, frame):  # pragma: no cover - exercised by the fault tests
    _raise(Terminated())


def on_sighup(signum, frame):  # pragma: no cover - exercised by the fault tests
    detach_terminal()
    _raise(HungUp())


@contextlib.contextmanager
def deferred():
    """Hold back a stop signal that arrives inside the block until it ends (main thread only).

    For calls that must not be cut in half: a write to the MLflow sqlite store interrupted in
    the middle of its transaction keeps the database locked, and the run could then not be
    marked KILLED. Elsewhere (other threads) the block does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["pending"] is not None:
            exc, _state["pending"] = _state["pending"], None
            raise exc


@contextlib.contextmanager
def orderly_stop():
    """SIGINT → ``KeyboardInterrupt``, SIGTERM → :class:`Terminated`, SIGHUP → :class:`HungUp`
    for the block (main thread), each held back inside :func:`deferred` blocks."""
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, on_sigint),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
        signal.SIGHUP: signal.signal(signal.SIGHUP, on_sighup),
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
