"""`sat sweep` itself: the parent MLflow run, the launch loop (``--jobs`` children at once), the
warm start before parallel runs, and the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from sat_cli.errors import RunFailed, UserError
from sat_cli.sweep.children import (
    SweepInterrupted,
    _Child,
    _child_env,
    _launch,
    _on_sigterm,
    _signal_group,
    _tail,
    stop_children,
    tag_overrides,
)
from sat_cli.sweep.plan import Plan, _conflict_message, format_plan, validate
from sat_cli.sweep.spec import SweepRun, load_sweep
from sat_cli.sweep.state import (
    RUN_RECORD,
    _lock,
    _still_running,
    _write_state,
    checkpoint_status,
    read_state,
    run_status,
)

CHILD_LOG = "sweep_child.log"
DEFAULT_GRACE_S = 30.0


# ----------------------------------------------------------------------------- parent run


def _open_parent(plan: Plan, state: dict, log):
    """The parent MLflow run of this sweep id (continued when the state names one)."""
    from sat_cli.tracking import Tracker, TrackingError

    s = plan.sweep
    if plan.tracking_uri is None:
        return None
    tags = {
        "sat.sweep_id": s.id,
        "sat.sweep_name": s.name,
        "sat.sweep_role": "parent",
        "sat.sweep_methods": json.dumps(list(s.methods)),
        "sat.sweep_axes": json.dumps(list(s.axes)),
        "sat.sweep_seeds": json.dumps(s.seeds),
        "sat.sweep_file": s.file,
    }
    params = {
        "sweep.file": s.file,
        "sweep.runs": str(len(s.runs)),
        "sweep.base": json.dumps(s.base),
        "sweep.cli_overrides": json.dumps(s.cli_overrides),
        "sweep.axes": json.dumps(s.axes),
        "sweep.seeds": json.dumps(s.seeds),
    }
    prev = state["parents"].get(s.id)
    try:
        tr = Tracker(
            plan.tracking_uri, s.name, f"sweep-{s.name}", run_id=prev, tags=tags, params=params
        )
    except TrackingError:
        if prev is None:
            raise
        log(f"parent run {prev} is gone from the store; starting a new one")
        tr = Tracker(plan.tracking_uri, s.name, f"sweep-{s.name}", tags=tags, params=params)
    from sat_cli.loop.final_status import apply_pending

    apply_pending(Path(plan.run_dir), tr, log)
    tr.log_dict([r.record() for r in s.runs], "sweep/runs.json")
    tr.log_artifact(s.file, "sweep")
    return tr


# ----------------------------------------------------------------------------- main


def run_sweep(sweep_file: str, overrides: list[str], *, jobs: int, dry_run: bool) -> None:
    """`sat sweep`: expand, validate, then run (or list with ``dry_run``) the grid."""
    log = _printer()
    sweep = load_sweep(sweep_file, overrides)
    plan = validate(sweep, log=log)
    state = read_state(plan.root)
    statuses = {r.name: run_status(r, plan.run_dirs[r.name], state) for r in sweep.runs}
    if dry_run:
        log(format_plan(plan, statuses))
        return
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    from sat_cli.loop.preflight import check_output_dir

    check_output_dir(plan.root, "sweep folder")
    conflicts = [r for r in sweep.runs if statuses[r.name] == "conflict"]
    if conflicts:
        raise UserError(_conflict_message(plan, conflicts[0]))
    with _lock(plan.root):
        _run_locked(plan, read_state(plan.root), jobs, log)


def _printer():
    def log(msg: str = "") -> None:
        print(msg, flush=True)

    return log


def _run_locked(plan: Plan, state: dict, jobs: int, log) -> None:
    sweep = plan.sweep
    orphans = {n: pid for n, rec in state["runs"].items() if (pid := _still_running(n, rec))}
    if orphans:
        raise UserError(
            "runs of an earlier `sat sweep` of this name are still running: "
            + ", ".join(f"{n} (pid {pid})" for n, pid in orphans.items())
            + "; wait for them or stop them (kill -INT -<pid> stops a run and its engine)"
        )
    state.update(sweep_id=sweep.id, name=sweep.name, file=sweep.file)
    state["invocations"] = int(state.get("invocations", 0)) + 1
    statuses = {r.name: run_status(r, plan.run_dirs[r.name], state) for r in sweep.runs}
    todo = [r for r in sweep.runs if statuses[r.name] != "finished"]
    log(format_plan(plan, statuses))
    grace = float(os.environ.get("SAT_SWEEP_GRACE_S", DEFAULT_GRACE_S))

    previous = {sig: signal.signal(sig, _on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
    parent = None
    children: dict[str, _Child] = {}
    outcome = "KILLED"
    t0 = time.perf_counter()
    results: dict[str, str] = {}
    try:
        parent = _open_parent(plan, state, log)
        parent_id = parent.run_id if parent is not None else None
        if parent_id:
            state["parents"][sweep.id] = parent_id
        _write_state(plan.root, state)
        if not todo:
            log(f"all {len(sweep.runs)} runs are finished; nothing to do")
        elif jobs > 1 and plan.needs_warm_start:
            _warm_start(plan, log)
        queue = deque(todo)
        done = 0
        while queue or children:
            while queue and len(children) < jobs:
                run = queue.popleft()
                children[run.name] = _start_child(plan, state, run, parent_id, log)
            time.sleep(0.2)
            for name, child in list(children.items()):
                rc = child.proc.poll()
                if rc is None:
                    continue
                del children[name]
                if rc != 0:  # a crashed child may leave its engine process behind in its group
                    _signal_group(child.proc, signal.SIGKILL)
                done += 1
                results[name] = _finish_child(plan, state, child, rc, done, len(todo), log)
        failed = [n for n, v in results.items() if v != "finished"]
        outcome = "FAILED" if failed else "FINISHED"
        if parent is not None:
            finished_all = sum(checkpoint_status(plan.run_dirs[r.name])[0] for r in sweep.runs)
            parent.log_metrics(
                {
                    "sweep/runs_finished": finished_all,
                    "sweep/runs_failed": len(failed),
                    "sweep/wall_s": time.perf_counter() - t0,
                },
                step=state["invocations"],
            )
        _summary(plan, results, time.perf_counter() - t0, log)
        if failed:
            raise RunFailed(
                f"{len(failed)} of {len(todo)} run(s) did not finish: "
                f"{', '.join(f'{n} ({results[n]})' for n in failed)}; logs: "
                f"<run>/logs/{CHILD_LOG} under {plan.root}. Re-run the same command to retry "
                "them (finished runs are skipped)."
            )
    except KeyboardInterrupt:
        outcome = "KILLED"
        stop_children(list(children.values()), grace, log)
        for child in children.values():
            _finish_child(plan, state, child, child.proc.returncode, 0, 0, log, interrupted=True)
        children.clear()
        raise SweepInterrupted() from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children.values():  # an unexpected error: do not leave orphans behind
            stop_children([child], 5.0, log)
        if parent is not None:
            from sat_cli.loop.final_status import end_run

            end_run(parent, outcome, Path(plan.run_dir), log)
        _write_state(plan.root, state)


def _warm_start(plan: Plan, log) -> None:
    """Build the warm-start cache once before parallel runs would race to build it."""
    for run in plan.needs_warm_start:
        train_only = [o for o in run.overrides if o != "resume=auto"]
        # --use-shipped: the same warm start `sat train` (and so --jobs 1) uses — the shipped
        # checkpoint when its key matches — not `sat pretrain`'s rebuild from scratch
        cmd = [sys.executable, "-m", "sat_cli.cli", "pretrain", "--use-shipped", *train_only]
        log_path = plan.root / "logs" / "pretrain.log"
        log(f"warm start (once, before parallel runs): log {log_path}")
        proc, f = _launch(cmd, log_path, dict(os.environ), "sat pretrain")
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            _signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            _signal_group(proc, signal.SIGKILL)
            raise
        finally:
            f.close()
        if rc != 0:
            raise RunFailed(f"warm start failed (exit {rc}); see {log_path}\n{_tail(log_path)}")


def _start_child(plan: Plan, state: dict, run: SweepRun, parent_id: str | None, log) -> _Child:
    from sat_cli.fsio import atomic_write_json

    run_dir = plan.run_dirs[run.name]
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / RUN_RECORD, {**run.record(), "sweep_id": plan.sweep.id})
    tags = tag_overrides(plan.sweep.id, run, parent_id)
    cmd = [sys.executable, "-m", "sat_cli.cli", "train", *run.overrides, *tags]
    log_path = run_dir / "logs" / CHILD_LOG
    rec = state["runs"].setdefault(run.name, {})
    rec.update(
        run.record(),
        status="running",
        attempts=int(rec.get("attempts", 0)) + 1,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        log=str(log_path),
    )
    proc, f = _launch(cmd, log_path, _child_env(), f"sweep attempt {rec['attempts']}")
    rec["pid"] = proc.pid
    _write_state(plan.root, state)
    log(f"start  {run.name}  ({run.method}; pid {proc.pid}; log {log_path})")
    return _Child(run, proc, f, time.perf_counter())


def _finish_child(
    plan: Plan, state: dict, child: _Child, rc, done: int, total: int, log, *, interrupted=False
) -> str:
    child.log.close()
    finished, step = checkpoint_status(plan.run_dirs[child.run.name])
    wall = time.perf_counter() - child.started
    if finished and rc == 0:
        status = "finished"
    elif interrupted or rc in (130, 143, -signal.SIGINT, -signal.SIGKILL, -signal.SIGTERM):
        status = "killed"
    else:
        status = "failed"
    rec = state["runs"].setdefault(child.run.name, {})
    rec.update(
        status=status,
        returncode=rc,
        ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_s=round(wall, 1),
        checkpoint_step=step,
    )
    rec.pop("pid", None)
    _write_state(plan.root, state)
    where = f"[{done}/{total}] " if total else ""
    if status == "finished":
        log(f"{where}done   {child.run.name}  in {wall:.0f} s")
    else:
        log(
            f"{where}{status.upper()} {child.run.name}  (exit {rc}) after {wall:.0f} s; "
            f"last checkpoint: {step if step is not None else 'none'}; log "
            f"{plan.run_dirs[child.run.name] / 'logs' / CHILD_LOG}"
        )
        if status == "failed":
            log(_tail(plan.run_dirs[child.run.name] / "logs" / CHILD_LOG))
    return status


def _summary(plan: Plan, results: dict[str, str], wall: float, log) -> None:
    s = plan.sweep
    n_done = sum(checkpoint_status(plan.run_dirs[r.name])[0] for r in s.runs)
    log("")
    log(
        f"sweep {s.id}: {n_done}/{len(s.runs)} runs finished ({len(results)} ran now, {wall:.0f} s)"
    )
    uri = f" --tracking-uri {plan.tracking_uri}" if plan.tracking_uri else ""
    if plan.tracking_uri:
        log(f"table and plots: sat report {s.id}{uri}")
