"""What runs where a cluster executor puts one run of a sweep: ``sat train`` as a child process.

- :func:`run_job` is the function ``sat sweep --executor slurm`` hands to submitit: it runs the
  run's ``sat train`` argument list with its output appended to the run's log and returns the
  exit code (a failed run is a result, not an exception). SIGTERM, SIGINT and SIGUSR2 (what
  SLURM sends on ``scancel``, preemption or the time limit, and what submitit's local executor
  sends on cancel) are passed on to ``sat train``, which stops in order (its last complete
  checkpoint stays; exit 143 / 130) and the next ``sat sweep`` resumes it. The child also gets
  SIGTERM if the job process itself is killed (``PR_SET_PDEATHSIG``), so no run outlives its job.
- :class:`RunHost` is the Ray actor of ``--executor ray`` (detached and named, so a run
  outlives the ``sat sweep`` that started it and the next one adopts it): the same child, in a
  session of its own with a guard (``sat_cli.cluster.guard``), polled and stopped by the sweep.

Standard library only at import time; submitit and Ray import this module on the job's node.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _start_logged(
    cmd: list[str], log_path: str, header: str, env: dict[str, str], cwd: str | None, **popen
) -> subprocess.Popen:
    """Start ``cmd`` (no stdin, ``env`` over this environment) with its output appended to
    ``log_path`` after a dated header line naming this node and the command."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", buffering=1) as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"\n===== {stamp} {header} on {os.uname().nodename}\n$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            **popen,
        )


def run_job(
    cmd: list[str], log_path: str, env: dict[str, str], header: str = "", cwd: str | None = None
) -> int:
    """Run ``cmd`` to its end inside a cluster job; returns its exit code (module docstring).
    ``cwd``: the folder ``sat sweep`` ran in (relative paths of the run mean the same there)."""
    proc = _start_logged(cmd, log_path, header, env, cwd, preexec_fn=_die_with_parent)

    def forward(signum, frame):  # SIGINT/SIGUSR2 become SIGTERM: sat train's orderly stop
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM if signum != signal.SIGINT else signal.SIGINT)

    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED:
            signal.signal(sig, forward)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # pragma: no cover - a handler above runs instead
            forward(signal.SIGINT, None)


class RunHost:
    """One run of a sweep on a Ray node (``--executor ray``; see the module docstring)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None

    def start(
        self, cmd: list[str], log_path: str, env: dict[str, str], header: str, cwd: str
    ) -> dict:
        self._proc = _start_logged(cmd, log_path, header, env, cwd, start_new_session=True)
        owners = f"{os.getpid()},{os.getppid()}"  # this actor and its raylet
        self._guard = subprocess.Popen(
            [sys.executable, "-m", "sat_cli.cluster.guard", owners, str(self._proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return {"pid": self._proc.pid, "node": os.uname().nodename}

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGINT to the run's process group (its orderly stop), SIGKILL after ``grace_s``."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # what the run left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode
