"""`sat sweep` itself: the parent MLflow run, the launch loop (``--jobs`` children at once), the
warm start before parallel runs, and the summary.
"""

from __future__ import annotations

import json
import signal
import time
from collections import deque
from pathlib import Path

from sat_cli import metric_names as M
from sat_cli.errors import RunFailed, UserError
from sat_cli.registry import not_buildable
from sat_cli.sweep.children import Child, SweepInterrupted, on_sigterm, stop_children
from sat_cli.sweep.executor import ExecutorOptions, resources_text
from sat_cli.sweep.jobs import CHILD_LOG, adopt_jobs, finish_run, start_run, warm_start
from sat_cli.sweep.plan import Plan, conflict_message, format_plan, validate
from sat_cli.sweep.registry import EXECUTORS, LOCAL
from sat_cli.sweep.spec import load_sweep
from sat_cli.sweep.state import (
    checkpoint_status,
    read_state,
    run_status,
    state_lock,
    still_running,
    write_state,
)
from sat_cli.util.options import env

DEFAULT_GRACE_S = 30.0


# ----------------------------------------------------------------------------- parent run


def _open_parent(plan: Plan, state: dict, log):
    """The parent MLflow run of this sweep id (continued when the state names one)."""
    from sat_cli.tracking import Tracker, TrackerSettings, TrackingError

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
    store, name = TrackerSettings(plan.tracking_uri, s.name), f"sweep-{s.name}"
    try:
        tr = Tracker(store, name, run_id=prev, tags=tags, params=params)
    except TrackingError:
        if prev is None:
            raise
        log(f"parent run {prev} is gone from the store; starting a new one")
        tr = Tracker(store, name, tags=tags, params=params)
    from sat_cli.tracking.final_status import apply_pending

    apply_pending(Path(plan.run_dir), tr, log)
    tr.log_dict([r.record() for r in s.runs], M.ARTIFACT_SWEEP_RUNS)
    from sat_cli.errors import UserError
    from sat_cli.tracking.params import redact_text
    from sat_cli.util.readers import read_text
    from sat_cli.util.safe_yaml import MAX_FILE_BYTES

    # the sweep file as its lines are printed: masked (it was copied as it was), read with the
    # bound its YAML was read with
    text = read_text(s.file, what=str(s.file), error=UserError, max_bytes=MAX_FILE_BYTES)
    tr.log_text(redact_text(text), M.ARTIFACT_SWEEP_FILE.format(name=Path(s.file).name))
    return tr


# ----------------------------------------------------------------------------- main


def run_sweep(
    sweep_file: str,
    overrides: list[str],
    *,
    jobs: int | None,
    dry_run: bool,
    executor: ExecutorOptions | None = None,
) -> None:
    """`sat sweep`: expand, validate, then run (or list with ``dry_run``) the grid.
    ``executor``: where the runs go (``sat_cli.sweep.executor``; default local subprocesses)."""
    log = _printer()
    grace = env("SAT_SWEEP_GRACE_S", DEFAULT_GRACE_S)  # before anything is written
    opts = executor or ExecutorOptions()
    from sat_cli.config import ConfigError

    try:
        component = EXECUTORS.get(opts.name)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    if not dry_run and component.build is not_buildable:  # never the local executor instead
        raise UserError(
            f"--executor={opts.name!r} cannot start runs: its registry entry has no build "
            "(SweepExecutor(build=...), sat_cli/sweep/registry.py); nothing was written"
        )
    sweep = load_sweep(sweep_file, overrides)
    plan = validate(sweep, log=log)
    state = read_state(plan.root)
    statuses = {r.name: run_status(r, plan.run_dirs[r.name], state) for r in sweep.runs}
    # GPUs per job of a cluster executor: the runs' device plans, or checked against them
    section = sweep.executors.get(opts.name, {})
    gpus = component.gpus(plan, section, opts)
    asked = component.cpus_mem(plan, section, opts) if component.cpus_mem else None
    if dry_run:
        log(format_plan(plan, statuses))
        if component.cluster:
            log(resources_text(plan, opts.name, gpus, asked))
        return
    if sweep.clean_tree:  # a pre-registered study: committed code only
        from sat_cli.sweep.clean_tree import require_clean_tree

        log(f"clean_tree: the code is commit {require_clean_tree(sweep.file)}, with no changes")
    if jobs is None:  # local: one at a time; a cluster: every run submitted at once
        jobs = len(sweep.runs) if component.cluster else 1
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    settings = component.settings(section, opts, gpus, plan)
    component.require(settings)
    component.check(settings, plan)
    if component.cluster:
        log(resources_text(plan, opts.name, gpus, asked))
    from sat_cli.util.fsio import check_output_dir

    check_output_dir(plan.root, "sweep folder")
    conflicts = [r for r in sweep.runs if statuses[r.name] == "conflict"]
    if conflicts:
        raise UserError(conflict_message(plan, conflicts[0]))
    with state_lock(plan.root):
        ex = component.build(settings, plan)
        try:
            _run_locked(plan, read_state(plan.root), jobs, log, ex, grace)
        finally:
            ex.close()


def _printer():
    def log(msg: str = "") -> None:
        print(msg, flush=True)

    return log


def _submitted_elsewhere(recorded: str | None, name: str) -> bool:
    """A running record's job went to another cluster executor than ``name`` (the sweep's own
    subprocesses, ``cluster=False``, are found by their pid instead; a record without an
    executor is one of them); an executor that is not registered now counts as a cluster."""
    recorded = recorded or LOCAL
    entry = EXECUTORS.find(recorded)
    return recorded != name and (entry is None or entry.cluster)


def _run_locked(plan: Plan, state: dict, jobs: int, log, executor, grace=DEFAULT_GRACE_S):
    sweep = plan.sweep
    name = executor.name
    component = EXECUTORS.get(name)
    elsewhere = {
        n: rec
        for n, rec in state["runs"].items()
        if rec.get("status") == "running" and _submitted_elsewhere(rec.get("executor"), name)
    }
    if elsewhere:
        n, rec = next(iter(elsewhere.items()))
        raise UserError(
            f"run {n} was submitted with --executor {rec['executor']} (job {rec.get('job_id')}) "
            f"and may still run; re-run with --executor {rec['executor']}, which waits for it "
            "(or resumes it if it is gone)"
        )
    orphans = {n: pid for n, rec in state["runs"].items() if (pid := still_running(n, rec))}
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

    previous = {sig: signal.signal(sig, on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}
    parent = None
    children: dict[str, Child] = {}
    outcome = "KILLED"
    t0 = time.perf_counter()
    results: dict[str, str] = {}
    try:
        parent = _open_parent(plan, state, log)
        parent_id = parent.run_id if parent is not None else None
        if parent_id:
            state["parents"][sweep.id] = parent_id
        write_state(plan.root, state)
        # jobs of an earlier sweep that still run are waited for, not started again
        children.update(adopt_jobs(plan, state, todo, executor, log))
        todo = [
            r for r in todo if r.name in children or not checkpoint_status(plan.run_dirs[r.name])[0]
        ]
        if not todo:
            log(f"all {len(sweep.runs)} runs are finished; nothing to do")
        elif jobs > 1 and plan.needs_warm_start:
            warm_start(plan, log)
        queue = deque(r for r in todo if r.name not in children)
        done = 0
        while queue or children:
            while queue and len(children) < jobs:
                run = queue.popleft()
                children[run.name] = start_run(plan, state, run, parent_id, log, executor)
            time.sleep(component.poll_s)
            for name, child in list(children.items()):
                rc = child.poll()
                if rc is None:
                    continue
                del children[name]
                done += 1
                results[name] = finish_run(plan, state, child, rc, done, len(todo), log)
        failed = [n for n, v in results.items() if v != "finished"]
        outcome = "FAILED" if failed else "FINISHED"
        if parent is not None:
            finished_all = sum(checkpoint_status(plan.run_dirs[r.name])[0] for r in sweep.runs)
            parent.log_metrics(
                {
                    M.SWEEP_RUNS_FINISHED: finished_all,
                    M.SWEEP_RUNS_FAILED: len(failed),
                    M.SWEEP_WALL_S: time.perf_counter() - t0,
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
    except KeyboardInterrupt as exc:
        outcome = "KILLED"
        if component.cluster and getattr(exc, "hung_up", False):
            # the terminal went away: the cluster jobs run on; the next `sat sweep` adopts them
            log(f"hung up: {len(children)} job(s) keep running; re-run the sweep to adopt them")
            children.clear()
            raise SweepInterrupted() from None
        stop_children(list(children.values()), grace, log, component.stop)
        for child in children.values():
            finish_run(plan, state, child, child.poll(), 0, 0, log, interrupted=True)
        children.clear()
        raise SweepInterrupted() from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children.values():  # an unexpected error: do not leave orphans behind
            stop_children([child], 5.0, log, component.stop)
        if parent is not None:
            from sat_cli.tracking.final_status import end_run

            end_run(parent, outcome, Path(plan.run_dir), log)
        write_state(plan.root, state)


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
