"""``reward=python``: a user's function run in a pool of worker processes with a time limit.

``reward.fn`` is ``pkg.module:function`` (imported with the current folder on ``sys.path``, as
``python -m`` would) or ``path/to/file.py:function`` (loaded from that file). Each of the
``reward.workers`` processes (``spawn``: the parent holds torch and engine threads) loads it
once and then answers calls over a pipe. A call that takes longer than ``reward.timeout_s`` is
abandoned: its worker is killed (whatever the function does, even an endless loop in C) and a
fresh one started for the next call; a worker that dies answers its call with the exit code.
Neither stops the run: the sample gets ``reward.on_error`` (:class:`sat_cli.rewards.Scorer`).

Each worker is a contained process tree (``contain.py``): its own session, a subreaper of what
it starts, ``reward.memory_mb`` of address space; killing a worker kills its whole tree, on every
exit path (a timed-out call, ``close()`` in the run's ``finally`` after an error, Ctrl-C or
SIGTERM, ``atexit``), and a worker whose ``sat`` was killed kills its tree itself.

:func:`check` starts one worker at start-up and stops it, so a ``reward.fn`` that cannot be
loaded (no such file, module or function; an import that raises) is refused (exit 2) before
anything starts.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import multiprocessing
import numbers
import os
import re
import sys
import time
from collections import deque
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError
from sat_cli.rewards import ReportedError, Scorer, Scores, contain, error_text, require
from sat_cli.validate import ConfigError

START_TIMEOUT_S = 120.0  # a worker's start: interpreter, the user's module and its imports
MAX_ANSWER_BYTES = 16 << 20  # one answer of a worker


def _send(conn, msg: tuple) -> None:
    """A worker's answer as JSON: the parent never unpickles what the user's code made (a
    value of a class of the plug-in's module raised ``ModuleNotFoundError`` in ``sat``, and
    unpickling runs code the pickle names)."""
    conn.send_bytes(json.dumps(msg, allow_nan=True).encode())


def _receive(conn) -> tuple:
    """A worker's answer (``_send``); ``OSError`` when it is not one (over the size, not
    JSON, not ``[kind, index, payload]``)."""
    data = conn.recv_bytes(MAX_ANSWER_BYTES)
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise OSError(f"an unreadable answer ({type(exc).__name__})") from None
    if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[0], str)):
        raise OSError("an unreadable answer (not [kind, index, payload])")
    return tuple(msg)


def load_function(spec: str):
    """The callable ``reward.fn`` names; ``ValueError`` saying why it cannot be loaded."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"reward.fn={spec!r}: {path} is not a file")
        mod_name = f"sat_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"reward.fn={spec!r}: {path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r}: {target} has no function {name!r}")
    return fn


def _plain(value: Any) -> Any:
    """NumPy and other number types as Python floats, inside dicts and lists too."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)
    return value


def _serve(conn, spec: str, memory_mb: int | None = None) -> None:
    """A worker: contain itself (``contain.py``), load ``spec``, then answer ``(index, args)``
    with ``("ok"|"err", index, …)``; asked to stop, it kills what it started, then returns."""
    try:
        contain.contain_self(memory_mb)
        fn = load_function(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which refuses it
        _send(conn, ("load_error", -1, error_text(exc)))
        return
    _send(conn, ("ready", -1, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            contain.kill_tree(os.getpid(), include_self=False)
            return
        index, args = msg
        try:
            reply = ("ok", index, _plain(fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - any failure of the user's code is counted
            reply = ("err", index, error_text(exc))
        try:
            _send(conn, reply)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be sent back
            _send(conn, ("err", index, f"returned a value that cannot be sent back ({exc})"))


class _Worker:
    def __init__(self, spec: str, memory_mb: int | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec, memory_mb), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise ValueError(f"reward.fn={spec!r}: the worker did not start in {START_TIMEOUT_S}s")
        try:
            kind, _, text = _receive(self.conn)
        except (EOFError, OSError) as exc:
            self.kill()
            raise ValueError(
                f"reward.fn={spec!r}: the worker exited while loading it "
                f"(exit code {self.proc.exitcode}; {error_text(exc)})"
            ) from None
        if kind != "ready":
            self.kill()
            raise ValueError(f"reward.fn={spec!r} cannot be loaded: {text}")

    def kill(self) -> None:
        """The worker and everything it started (``contain.kill_tree``)."""
        if self.proc.pid is not None:
            contain.stop_worker_tree(self.proc.pid)
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(2)
        self.kill()


class WorkerPool:
    """``run(calls)``: each call's ``("ok", value)`` or ``("err", message)``, in order."""

    def __init__(self, spec: str, workers: int, timeout_s: float, memory_mb: int | None = None):
        self.spec, self.timeout_s, self.memory_mb = spec, timeout_s, memory_mb
        self.workers: list[_Worker | None] = []
        atexit.register(self.close)  # an exit path that skipped the run's finally
        try:
            for _ in range(workers):
                self.workers.append(_Worker(spec, memory_mb))
        except BaseException:
            self.close()
            raise

    def _get(self, i: int) -> _Worker:
        if self.workers[i] is None:
            self.workers[i] = _Worker(self.spec, self.memory_mb)
        return self.workers[i]

    def run(self, calls: list[tuple]) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        pending = deque(enumerate(calls))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call index, start time)
        while pending or busy:
            for i in range(len(self.workers)):
                if i in busy or not pending:
                    continue
                index, args = pending.popleft()
                try:
                    worker = self._get(i)
                    worker.conn.send((index, args))
                except (ValueError, OSError) as exc:
                    results[index] = ("err", str(exc))
                    self.workers[i] = None
                    continue
                busy[i] = (index, time.monotonic())
            if not busy:
                continue
            first = min(t for _, t in busy.values())
            left = max(0.0, first + self.timeout_s - time.monotonic())
            ready = wait([self.workers[i].conn for i in busy], timeout=left)
            for i in list(busy):
                worker, (index, started) = self.workers[i], busy[i]
                if worker.conn in ready:
                    try:
                        kind, _, payload = _receive(worker.conn)
                        results[index] = (kind, payload)
                    except (EOFError, OSError) as exc:
                        code = worker.proc.exitcode
                        why = f"died (exit code {code})"
                        if not isinstance(exc, EOFError):  # it is replaced, as a dead one
                            why = f"sent {exc}; it was stopped"
                        results[index] = ("err", f"the reward process {why}")
                        worker.kill()
                        self.workers[i] = None
                    del busy[i]
                elif time.monotonic() - started >= self.timeout_s:
                    results[index] = ("err", f"timed out after {self.timeout_s:g} s")
                    worker.kill()
                    self.workers[i] = None
                    del busy[i]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        atexit.unregister(self.close)
        for worker in self.workers:
            if worker is not None:
                worker.stop()
        self.workers = [None] * len(self.workers)


class PoolScorer(Scorer):
    """The user's function over a :class:`WorkerPool` (one call per sample, or per chunk of
    the batch with ``reward.batched``)."""

    def __init__(self, settings):
        super().__init__(None, settings)
        try:
            self.pool = WorkerPool(
                settings.fn, settings.workers, settings.timeout_s, memory_of(settings)
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None

    def score(self, prompts: list[str], responses: list[str], rows: list[dict]) -> Scores:
        out = Scores([], [], [])
        n = len(prompts)
        if not self.settings.batched:
            calls = [(p, r, row) for p, r, row in zip(prompts, responses, rows, strict=True)]
            for kind, payload in self.pool.run(calls):
                self.add(out, _unwrap(kind, payload))
            return out
        size = -(-n // len(self.pool.workers)) if n else 1
        starts = range(0, n, size)
        calls = [
            (prompts[a : a + size], responses[a : a + size], rows[a : a + size]) for a in starts
        ]
        for a, (kind, payload) in zip(starts, self.pool.run(calls), strict=True):
            m = min(size, n - a)
            if kind == "ok" and not (isinstance(payload, list) and len(payload) == m):
                got = (
                    f"{len(payload)} values"
                    if isinstance(payload, list)
                    else type(payload).__name__
                )
                kind, payload = "err", f"the batched reward returned {got} for {m} samples"
            for j in range(m):
                self.add(out, _unwrap(kind, payload[j] if kind == "ok" else payload))
        return out

    def close(self) -> None:
        self.pool.close()


def _unwrap(kind: str, payload: Any):
    """A call for :meth:`Scorer.add`: the value, or the worker's error raised again."""

    def call():
        if kind != "ok":
            raise ReportedError(payload)
        return payload

    return call


def memory_of(settings) -> int | None:
    """``reward.memory_mb``: each worker's address-space limit (None: settings without it)."""
    return getattr(settings, "memory_mb", None)


def check(settings) -> None:
    """Load ``reward.fn`` in one worker process and stop it; ``UserError`` if it cannot load."""
    try:
        _Worker(settings.fn, memory_of(settings)).stop()
    except ValueError as exc:
        raise UserError(str(exc)) from None


def build(settings, runtime: dict) -> PoolScorer:
    return PoolScorer(settings)


def validate(settings) -> None:
    """``reward.fn`` is ``pkg.module:function`` or ``path/to/file.py:function``."""
    require(settings, "fn")
    if not re.fullmatch(r"[^:]+:[A-Za-z_][A-Za-z0-9_]*", settings.fn):
        raise ConfigError(
            f"reward.fn={settings.fn!r}: expected pkg.module:function or path/to/file.py:function"
        )


def label(settings) -> str:
    return f"reward.fn={settings.fn}" if getattr(settings, "fn", None) else ""


def processes(settings) -> int:
    return settings.workers  # reward.workers processes run the function
