"""Ownership of a run folder: one live `sat train` per folder.

``RunLock(run_dir)`` is taken after every input has been checked and before anything in the
folder is written (``config.yaml``, checkpoints, weights, the MLflow status), and released on
every exit path (the ``with`` block; a killed process releases it through the kernel).

Mechanism: ``<run_dir>/.sat.lock`` holds a JSON record of the owner (pid, the start time of that
pid from ``/proc``, host, command line, time) and is held with an exclusive ``flock`` for the
run's lifetime. A second process that cannot take the ``flock`` reads the record and exits 2
naming the holder. A record left behind by a process that died without releasing (SIGKILL,
power loss) is stale: the ``flock`` is free and the recorded pid is gone (or now names another
program: the start time differs); it is replaced, and the takeover is reported. On file systems
without ``flock`` (some network mounts) the pid check alone decides. A clean release removes the
file, so a finished run leaves no lock behind.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from sat_cli.errors import UserError

LOCK_NAME = ".sat.lock"


class RunLocked(UserError):
    """Another live process owns the run folder (exit code 2)."""


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def holder_alive(rec: dict) -> bool:
    """True if the process named by a lock record still runs (same host, same start time)."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if rec.get("host") not in (None, socket.gethostname()):
        return True  # cannot tell for another machine: assume alive
    started = _start_time(pid)
    if started is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return rec.get("start") is None
    return rec.get("start") in (None, started)


def _describe(rec: dict) -> str:
    """The holder as messages name it: the record is another process's file (a folder may be
    shared), so its text is escaped and masked (``remote_text``, ``redact_text``)."""
    from sat_cli.tracking.params import redact_text
    from sat_cli.tracking.remote_text import escape_controls

    argv = rec.get("argv")
    cmd = " ".join(str(a) for a in argv)[:200] if isinstance(argv, list) else ""
    text = f"pid {rec.get('pid')} on {rec.get('host', '?')} since {rec.get('since', '?')}" + (
        f" ({cmd})" if cmd else ""
    )
    return escape_controls(redact_text(text))


def live_holder(run_dir: Path) -> dict | None:
    """The lock record of the live process that owns ``run_dir``, else None (reads only)."""
    import fcntl

    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = True
    except OSError:  # no flock here: the pid decides
        held = None
    else:
        held = False
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    try:
        rec = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        rec = {}
    if not isinstance(rec, dict):
        rec = {}
    if held or (held is None and holder_alive(rec)):
        return rec
    return None


def refuse_if_owned(run_dir: Path) -> None:
    """``RunLocked`` naming the owner if a live process owns ``run_dir``."""
    rec = live_holder(run_dir)
    if rec is not None:
        raise RunLocked(RunLock(run_dir)._message(rec))


class RunLock:
    """Exclusive ownership of ``run_dir`` (see the module docstring)."""

    def __init__(self, run_dir: Path, log=print):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.log = log
        self.fd: int | None = None

    def _read(self) -> dict:
        try:
            rec = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def acquire(self) -> RunLock:
        import fcntl

        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flock_ok = True
            except BlockingIOError:
                os.close(fd)
                raise RunLocked(self._message(self._read())) from None
            except OSError:  # no flock on this file system: the pid record decides
                flock_ok = False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (file removed) between our open and our flock: retry
                os.close(fd)
                continue
            rec = self._read()
            if rec.get("pid") and rec.get("pid") != os.getpid():
                if not flock_ok and holder_alive(rec):
                    os.close(fd)
                    raise RunLocked(self._message(rec))
                self.log(f"taking over the stale lock of {_describe(rec)}: that process is gone")
            self.fd = fd
            self._write()
            return self
        raise RunLocked(f"cannot take the lock {self.path}: it keeps changing")

    def _write(self) -> None:
        from sat_cli.tracking.params import redact_text

        rec = {
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "host": socket.gethostname(),
            "argv": ["sat", *(redact_text(a) for a in sys.argv[1:])],  # masked: on disk, 0644
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        data = json.dumps(rec).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def _message(self, rec: dict) -> str:
        who = _describe(rec) if rec else "another process"
        return (
            f"run folder {self.run_dir} is in use by {who}; two runs must not share a folder "
            "(they would overwrite each other's config, checkpoints and weights). Wait for it to "
            f"end, stop it, or choose another run.name. Lock: {self.path}"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl

        try:
            self.path.unlink(missing_ok=True)  # while still holding it: see acquire's retry
        except OSError:
            pass
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()
