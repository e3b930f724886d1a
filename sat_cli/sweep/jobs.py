"""Runs of a sweep in flight: the warm start before parallel runs, jobs of an earlier sweep
adopted (cluster executors), a run started (a local subprocess or a cluster job) and a run's
end recorded in ``sweep_state.json`` with its status (finished, killed, failed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from sat_cli.errors import RunFailed
from sat_cli.sweep.children import Child, tag_overrides, tail_text
from sat_cli.sweep.local import launch_child, signal_group
from sat_cli.sweep.plan import Plan
from sat_cli.sweep.spec import SweepRun
from sat_cli.sweep.state import RUN_RECORD, checkpoint_status, write_state

CHILD_LOG = "sweep_child.log"


def warm_start(plan: Plan, log) -> None:
    """Build the warm-start cache once before parallel runs would race to build it."""
    for run in plan.needs_warm_start:
        train_only = [o for o in run.overrides if o != "resume=auto"]
        # --use-shipped: the same warm start `sat train` (and so --jobs 1) uses — the shipped
        # checkpoint when its key matches — not `sat pretrain`'s rebuild from scratch
        cmd = [sys.executable, "-m", "sat_cli.cli", "pretrain", "--use-shipped", *train_only]
        log_path = plan.root / "logs" / "pretrain.log"
        log(f"warm start (once, before parallel runs): log {log_path}")
        proc, f = launch_child(cmd, log_path, dict(os.environ), "sat pretrain")
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            signal_group(proc, signal.SIGKILL)
            raise
        finally:
            f.close()
        if rc != 0:
            raise RunFailed(f"warm start failed (exit {rc}); see {log_path}\n{tail_text(log_path)}")


def adopt_jobs(plan: Plan, state: dict, todo: list[SweepRun], executor, log) -> dict[str, Child]:
    """Jobs of an earlier sweep (this executor) that still run: waited for, not resubmitted (the
    local executor adopts none: a run it left running is found by its pid instead)."""
    adopted: dict[str, Child] = {}
    for run in todo:
        rec = state["runs"].get(run.name, {})
        if rec.get("status") != "running" or rec.get("executor") != executor.name:
            continue
        job = executor.adopt(rec.get("job_id"))
        if job is None:  # ended meanwhile: finished, or gone (resumed from its checkpoint)
            rec["status"] = (
                "finished" if checkpoint_status(plan.run_dirs[run.name])[0] else "killed"
            )
            continue
        log(f"adopt  {run.name}  (job {job.job_id} of an earlier sweep still runs)")
        adopted[run.name] = Child(run, job, time.perf_counter())
    return adopted


def start_run(
    plan: Plan, state: dict, run: SweepRun, parent_id: str | None, log, executor
) -> Child:
    from sat_cli.util.fsio import atomic_write_json

    run_dir = plan.run_dirs[run.name]
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / RUN_RECORD, {**run.record(), "sweep_id": plan.sweep.id})
    tags = tag_overrides(plan.sweep.id, run, parent_id)
    what = ["replay", plan.sweep.replay] if plan.sweep.replay else ["train"]
    cmd = [sys.executable, "-m", "sat_cli.cli", *what, *run.overrides, *tags]
    log_path = run_dir / "logs" / CHILD_LOG
    rec = state["runs"].setdefault(run.name, {})
    rec.update(
        run.record(),
        status="running",
        attempts=int(rec.get("attempts", 0)) + 1,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        log=str(log_path),
    )
    header = f"sweep attempt {rec['attempts']}"
    job = executor.submit(
        run.name, cmd, log_path, {"PYTHONUNBUFFERED": "1"}, f"{plan.sweep.id} {header}"
    )
    rec.pop("pid", None)
    rec.update(executor=executor.name, job_id=job.job_id, **job.record())
    write_state(plan.root, state)
    log(f"submit {run.name}  ({run.method}; {executor.name} job {job.job_id}; log {log_path})")
    return Child(run, job, time.perf_counter())


def finish_run(
    plan: Plan, state: dict, child: Child, rc, done: int, total: int, log, *, interrupted=False
) -> str:
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
    write_state(plan.root, state)
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
            log(tail_text(plan.run_dirs[child.run.name] / "logs" / CHILD_LOG))
    return status
