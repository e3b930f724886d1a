"""Sweep state: each run's status from its checkpoints and run record, ``sweep_state.json``
(atomic writes) and the lock that keeps two sweeps of one name apart.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.sweep.spec import SweepRun

STATE_FILE = "sweep_state.json"
RUN_RECORD = "sweep_run.json"


# ----------------------------------------------------------------------------- status


def checkpoint_status(run_dir: Path) -> tuple[bool, int | None]:
    """(finished, step of the latest complete checkpoint or None)."""
    from sat_cli.loop.state import CheckpointError, latest_checkpoint, read_loop_state

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return False, None
    try:
        st = read_loop_state(ckpt)
    except CheckpointError:
        return False, None
    return bool(st.get("finished")), int(st.get("step", 0))


def _recorded_hash(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_RECORD).read_text()).get("override_hash")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


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


def _still_running(name: str, rec: dict) -> int | None:
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
    path = root / STATE_FILE
    if path.is_dir():
        raise UserError(f"sweep state {path} is a folder; remove it (or pick another run.dir)")
    if not path.is_file():
        return {"runs": {}, "parents": {}, "invocations": 0}
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read sweep state {path}: {exc}; delete it to start over") from None
    state.setdefault("runs", {})
    state.setdefault("parents", {})
    state.setdefault("invocations", 0)
    return state


def _write_state(root: Path, state: dict) -> None:
    from sat_cli.fsio import atomic_write_json

    state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write_json(root / STATE_FILE, state)


@contextlib.contextmanager
def _lock(root: Path):
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
