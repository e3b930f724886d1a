"""``sat sweep --executor local`` (the default): each run a ``sat train`` subprocess of this
machine in its own process group, as an executor object like SLURM's and Ray's
(``sweep/registry.Executor``): ``submit`` starts it, its :class:`LocalJob` polls and stops it.
Its runs are not adopted by a later sweep (a run left running is found by its pid,
``sweep/state.still_running``); a group's members (the run's engine) are killed when a run
fails, and a stop is SIGINT to every group at once, a grace period, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def launch_child(cmd: list[str], log_path: Path, env: dict[str, str], header: str) -> tuple:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed when the child ends
    f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n$ {' '.join(cmd)}\n")
    f.flush()
    proc = subprocess.Popen(
        cmd,
        stdout=f,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # own process group: Ctrl-C reaches it only through us
    )
    return proc, f


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalJob:
    """One run as a subprocess: ``job_id`` is its pid, ``record()`` adds the pid to its record in
    ``sweep_state.json``; once it ended its log is closed and, after a failure, its group killed
    (its engine may be left in it)."""

    def __init__(self, proc: subprocess.Popen, log: Any = None) -> None:
        self.proc, self.log = proc, log
        self.job_id = str(proc.pid)
        self._ended = False

    def record(self) -> dict:
        return {"pid": self.proc.pid}

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and not self._ended:
            self._ended = True
            if rc != 0:
                signal_group(self.proc, signal.SIGKILL)
            if self.log is not None:
                self.log.close()
        return rc

    def stop(self, grace_s: float) -> None:
        stop_local([self], grace_s, lambda msg: None)


class LocalExecutor:
    name = "local"

    def submit(self, run_name: str, cmd: list[str], log_path: Path, env: dict, header: str):
        proc, f = launch_child(cmd, log_path, {**os.environ, **env}, header)
        return LocalJob(proc, f)

    def adopt(self, job_id: str) -> None:
        return None  # its runs are found by their pid (still_running), never adopted

    def close(self) -> None:
        return None


def open_local(settings, plan) -> LocalExecutor:
    return LocalExecutor()


def stop_local(jobs: list[LocalJob], grace_s: float, log) -> None:
    """SIGINT to each job's process group, wait up to ``grace_s``, then SIGKILL the rest."""
    alive = [j for j in jobs if j.proc.poll() is None]
    if not alive:
        return
    log(f"stopping {len(alive)} run(s): SIGINT, then SIGKILL after {grace_s:.0f} s")
    for j in alive:
        signal_group(j.proc, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    try:
        while any(j.proc.poll() is None for j in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        log("second interrupt: killing now")
    for j in alive:
        if j.proc.poll() is None:
            signal_group(j.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            j.proc.wait(timeout=10)
        # the group may hold grandchildren (engine process) that outlived the child
        signal_group(j.proc, signal.SIGKILL)
