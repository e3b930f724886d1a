"""Sweep state: each run's status from its checkpoints and run record, ``sweep_state.json``
(atomic writes) and the lock that keeps two sweeps of one name apart.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.sweep.spec import SweepRun

STATE_FILE = "sweep_state.json"
RUN_RECORD = "sweep_run.json"


# ----------------------------------------------------------------------------- status


def checkpoint_status(run_dir: Path) -> tuple[bool, int | None]:
    """(finished, step of the latest complete checkpoint or None)."""
    from sat_cli.checkpoints.state import CheckpointError, latest_checkpoint, read_loop_state

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return False, None
    try:
        st = read_loop_state(ckpt)
    except CheckpointError:
        return False, None
    return bool(st.get("finished")), int(st.get("step", 0))


def _recorded_hash(run_dir: Path) -> str | None:
    """The override hash a run folder was started with (``sweep_run.json``); None when there is
    no record. A record that exists but is damaged is refused (``UserError``): guessing would
    resume a run with a config it was not started with."""
    from sat_cli.records import SWEEP_RUN, RecordError, read_json

    path = run_dir / RUN_RECORD
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        return read_json(path, SWEEP_RUN).get("override_hash")
    except RecordError as exc:
        raise UserError(
            f"cannot use the run record {path}: {exc}; delete it if the run folder holds no "
            "run you want to keep (the sweep then starts or resumes that run as listed)"
        ) from None


def run_status(run: SweepRun, run_dir: Path, state: dict) -> str:
    """``finished`` | ``resume (step N)`` | ``conflict`` | ``rerun (failed|killed)`` | ``pending``."""
    finished, step = checkpoint_status(run_dir)
    rec = _recorded_hash(run_dir)
    if step is not None and rec is not None and rec != run.hash:
        return "conflict"
    if finished:
        return "finished"
    if step is not None:
        return f"resume (step {step})"
    prev = state.get("runs", {}).get(run.name, {}).get("status")
    if prev in ("failed", "killed", "running"):
        return f"rerun ({'interrupted' if prev == 'running' else prev})"
    return "pending"


def still_running(name: str, rec: dict) -> int | None:
    """The pid of a child left running by an earlier sweep that died (its command names the run)."""
    pid = rec.get("pid")
    if rec.get("status") != "running" or not isinstance(pid, int):
        return None
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if f"run.name={name}".encode() in cmd else None


def read_state(root: Path) -> dict:
    """``sweep_state.json``, checked against its schema (``sat_cli.records``): a damaged one
    (not an object, a run record of the wrong shape, a FIFO) is refused with exit 2 naming the
    field, before the sweep writes anything."""
    from sat_cli.records import SWEEP_STATE, RecordError, read_json

    path = root / STATE_FILE
    if path.is_dir():
        raise UserError(f"sweep state {path} is a folder; remove it (or pick another run.dir)")
    if not (path.exists() or path.is_symlink()):
        return {"runs": {}, "parents": {}, "invocations": 0}
    try:
        state = read_json(path, SWEEP_STATE)
    except RecordError as exc:
        raise UserError(
            f"cannot use sweep state {path}: {exc}; delete it to start over (finished runs "
            "are still skipped: their checkpoints say so)"
        ) from None
    state.setdefault("runs", {})
    state.setdefault("parents", {})
    state.setdefault("invocations", 0)
    return state


def write_state(root: Path, state: dict) -> None:
    from sat_cli.util.fsio import atomic_write_json

    state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write_json(root / STATE_FILE, state)


@contextlib.contextmanager
def state_lock(root: Path):
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".sweep.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"another `sat sweep` is running in {root} (lock {root / '.sweep.lock'})"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
