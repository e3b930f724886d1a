"""The MLflow run of a command always ends FINISHED, FAILED or KILLED — also after an outage.

``end_run(tracker, status, run_root)`` ends the tracker's run. When the store cannot be reached
at that moment (an outage that never recovered during the run), the final status is recorded in
``<run.dir>/.mlflow_pending/<run id>.json`` (run id, status, end time, a hash of the tracking
URI — never the URI itself, which may hold a password) and a warning says so. The next command
that opens the same store from the same ``run.dir`` (`sat train`, `sat eval`, `sat sweep`, also
``resume=auto`` of that run) applies every pending record for that store with
``set_terminated`` and removes it: the run no longer shows RUNNING forever.

Metric points an outage kept on disk (``<run.dir>/.mlflow_pending/<run id>.metrics.jsonl``,
``sat_cli.tracking.outage``) are sent by the same commands, before the statuses.

``keep_previous_status``: a resumed run that did not complete a single new step (it failed or
was interrupted while starting, or had nothing left to do) ends with the status it had before
the resume (FINISHED, FAILED or KILLED) — a refused or failed resume never flips a finished run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PENDING_DIR = ".mlflow_pending"
TERMINAL = ("FINISHED", "FAILED", "KILLED")


def _uri_key(uri: str) -> str:
    from sat_cli.tracking.outage import uri_key

    return uri_key(uri)


def keep_previous_status(tracker, status: str, steps_done: int) -> str:
    previous = getattr(tracker, "resumed_status", None)
    if steps_done == 0 and previous in TERMINAL and status != "FINISHED":
        return previous
    return status


def end_run(tracker, status: str, run_root: Path, log=print) -> None:
    """End the run; if the store did not take the status, keep it for later (see above)."""
    if tracker is None:
        return
    tracker.end(status)
    if not tracker.enabled or tracker.run_id is None or getattr(tracker, "status_recorded", True):
        return
    from sat_cli.util.fsio import atomic_write_json

    rec = {
        "run_id": tracker.run_id,
        "status": status,
        "end_time": int(time.time() * 1000),
        "uri_key": _uri_key(tracker.uri),
    }
    path = Path(run_root) / PENDING_DIR / f"{tracker.run_id}.json"
    try:
        atomic_write_json(path, rec)
    except OSError as exc:
        log(f"WARNING: the MLflow store is unreachable and {path} cannot be written ({exc})")
        return
    log(
        f"WARNING: the MLflow store is unreachable: run {tracker.run_id} ends {status}, which "
        f"is recorded in {path} and set in the store by the next sat command that reaches it"
    )


def apply_pending(run_root: Path, tracker, log=print) -> int:
    """Set the recorded final statuses of runs in the tracker's store; returns how many."""
    folder = Path(run_root) / PENDING_DIR
    if not tracker.enabled or tracker.uri is None or not folder.is_dir():
        return 0
    from sat_cli.tracking.outage import send_spools

    send_spools(folder, tracker, log)  # metrics an outage kept on disk, before the statuses
    key, done = _uri_key(tracker.uri), 0
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            if rec.get("uri_key") != key or rec.get("status") not in TERMINAL:
                continue
            if rec["run_id"] == tracker.run_id:  # resumed now: it ends with this command
                path.unlink()
                continue
            run = tracker.client.get_run(rec["run_id"])
            if run.info.status == "RUNNING":
                tracker.client.set_terminated(
                    rec["run_id"], rec["status"], end_time=rec.get("end_time")
                )
            path.unlink()
            done += 1
        except Exception as exc:  # a bad record or the store failing again: keep it for later
            log(f"WARNING: cannot apply the pending MLflow status {path.name}: {exc}")
    if done:
        log(f"applied {done} pending MLflow final status(es) from {folder}")
    return done
