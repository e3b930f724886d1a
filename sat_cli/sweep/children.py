"""Children of a sweep: each run a ``sat train`` subprocess in its own process group, its
sweep tags as overrides, and stopping them (SIGINT, grace period, SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sat_cli.config.quoting import hydra_quote
from sat_cli.sweep.spec import SweepRun


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a sweep: children stopped, parent run KILLED, exit 130.
    ``hung_up``: SIGHUP (the terminal went away): a cluster sweep leaves its jobs running."""

    hung_up = False


# ----------------------------------------------------------------------------- children


@dataclass
class Child:
    """One run in flight: a local ``sat train`` subprocess (``proc``), or a cluster job
    (``job``, ``sat_cli.cluster.executors``: ``poll()``, ``stop(grace_s)``, ``job_id``)."""

    run: SweepRun
    proc: subprocess.Popen | None
    log: Any
    started: float
    job: Any = None
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.proc.poll() if self.job is None else self.job.poll()
        return self.returncode


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def tag_overrides(sweep_id: str, run: SweepRun, parent_run_id: str | None) -> list[str]:
    """The overrides that give a child its sweep tags (``tracking.tags``; see the schema)."""
    tags = {"sweep_id": sweep_id, "override_hash": run.hash, "method": run.method}
    if parent_run_id:
        tags["parent_run_id"] = parent_run_id
    return [f"++tracking.tags.{k}={hydra_quote(v)}" for k, v in tags.items()]


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


def _stop_jobs(children: list[Child], grace_s: float, log) -> None:
    """Cluster jobs: each job's own orderly stop (scancel, the actor's SIGINT), in parallel."""
    import threading

    threads = [threading.Thread(target=c.job.stop, args=(grace_s,)) for c in children]
    log(f"stopping {len(children)} cluster job(s) (an orderly stop, hard after {grace_s:.0f} s)")
    for t in threads:
        t.start()
    for t in threads:
        t.join(grace_s + 60)
    for c in children:
        c.poll()


def stop_children(children: list[Child], grace_s: float, log) -> None:
    """SIGINT to each child's process group, wait up to ``grace_s``, then SIGKILL the rest."""
    jobs = [c for c in children if c.job is not None and c.poll() is None]
    if jobs:
        _stop_jobs(jobs, grace_s, log)
    alive = [c for c in children if c.job is None and c.proc.poll() is None]
    if not alive:
        return
    log(f"stopping {len(alive)} run(s): SIGINT, then SIGKILL after {grace_s:.0f} s")
    for c in alive:
        signal_group(c.proc, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    try:
        while any(c.proc.poll() is None for c in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        log("second interrupt: killing now")
    for c in alive:
        if c.proc.poll() is None:
            signal_group(c.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=10)
        # the group may hold grandchildren (engine process) that outlived the child
        signal_group(c.proc, signal.SIGKILL)
        c.returncode = c.proc.returncode


def tail_text(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    | " + line for line in lines[-n:])


def on_sigterm(signum, frame):  # pragma: no cover - exercised through a subprocess
    exc = SweepInterrupted()
    if signum == signal.SIGHUP:  # the terminal is gone: do not let a write to it fail the stop
        from sat_cli.util.signals import detach_terminal

        detach_terminal()
        exc.hung_up = True
    raise exc
