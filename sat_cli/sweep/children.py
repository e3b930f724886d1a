"""Children of a sweep: each run in flight as the job its executor submitted (``sweep/local.py``:
a ``sat train`` subprocess in its own process group), its sweep tags as overrides, and stopping
them with their executor's ``stop`` (SIGINT, grace period, SIGKILL for the local one).
"""

from __future__ import annotations

import signal
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
    """One run in flight: the job its executor submitted (``sweep/registry.Job``: ``job_id``,
    ``poll()``, ``stop(grace_s)``; ``sweep/local.LocalJob`` for this machine's subprocesses)."""

    run: SweepRun
    job: Any
    started: float
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.job.poll()
        return self.returncode


def tag_overrides(sweep_id: str, run: SweepRun, parent_run_id: str | None) -> list[str]:
    """The overrides that give a child its sweep tags (``tracking.tags``; see the schema)."""
    tags = {"sweep_id": sweep_id, "override_hash": run.hash, "method": run.method}
    if parent_run_id:
        tags["parent_run_id"] = parent_run_id
    return [f"++tracking.tags.{k}={hydra_quote(v)}" for k, v in tags.items()]


def stop_children(children: list[Child], grace_s: float, log, stop) -> None:
    """Stop the children still running with their executor's ``stop(jobs, grace_s, log)``
    (``sweep/registry.SweepExecutor.stop``), and record their exit codes."""
    alive = [c for c in children if c.poll() is None]
    if alive:
        stop([c.job for c in alive], grace_s, log)
    for c in alive:
        c.poll()


def tail_text(path: Path, n: int = 8) -> str:
    """The last ``n`` lines of a child's log, for the sweep's terminal: another process's text
    (the child's plug-ins print there), so control characters escaped and secrets masked."""
    from sat_cli.tracking.params import redact_text
    from sat_cli.tracking.remote_text import escape_controls

    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    | " + escape_controls(redact_text(line)) for line in lines[-n:])


def on_sigterm(signum, frame):  # pragma: no cover - exercised through a subprocess
    exc = SweepInterrupted()
    if signum == signal.SIGHUP:  # the terminal is gone: do not let a write to it fail the stop
        from sat_cli.util.signals import detach_terminal

        detach_terminal()
        exc.hung_up = True
    raise exc
