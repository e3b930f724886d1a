"""The sweep executors ``sat sweep --executor <name>`` can choose: name → :class:`SweepExecutor`
(``sat_cli.registry.Registry``). An executor submits one run's ``sat train`` and hands back a
:class:`Job`; ``local`` (the default) runs it as a subprocess of this machine
(``sweep/local.py``). A new executor: its module with a settings reader and an executor class,
and one ``EXECUTORS.add`` line here (docs/ARCHITECTURE.md, "How to add")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sat_cli.registry import Registry, not_buildable


class Job(Protocol):
    """One submitted run: ``poll()`` is its exit code once it ended (None while queued or
    running); ``stop`` stops it in order, then hard after ``grace_s``."""

    job_id: str

    def poll(self) -> int | None: ...

    def record(self) -> dict:
        """What ``sweep_state.json`` records of the job besides the executor and ``job_id``."""
        ...

    def stop(self, grace_s: float) -> None: ...


class Executor(Protocol):
    """Where a sweep's runs go (``sweep/local.py``: this machine's subprocesses;
    ``sat_cli.cluster.executors`` has SLURM's and Ray's)."""

    name: str

    def submit(self, run_name: str, cmd: list[str], log_path: Path, env: dict, header: str) -> Job:
        """Start ``cmd`` (a run's ``sat train``) with its output in ``log_path``."""
        ...

    def adopt(self, job_id: str) -> Job | None:
        """The job of an earlier `sat sweep` that still runs, or None when it is gone."""
        ...

    def close(self) -> None: ...


def no_settings(section: dict, opts, gpus: int, plan=None) -> None:
    return None


def no_gpus(plan, section: dict, opts) -> int:
    return 0


def nothing(*args) -> None:
    return None


def stop_jobs(jobs: list, grace_s: float, log) -> None:
    """Cluster jobs: each job's own orderly stop (scancel, the actor's SIGINT), in parallel."""
    import threading

    threads = [threading.Thread(target=j.stop, args=(grace_s,)) for j in jobs]
    log(f"stopping {len(jobs)} cluster job(s) (an orderly stop, hard after {grace_s:.0f} s)")
    for t in threads:
        t.start()
    for t in threads:
        t.join(grace_s + 60)
    for j in jobs:
        j.poll()


@dataclass(frozen=True)
class SweepExecutor:
    """A registered executor: ``gpus(plan, section, opts)`` is the GPUs each job asks for (the
    runs' device plans, or the sweep file's / command line's checked against them);
    ``settings(section, opts, gpus)`` reads the sweep file's ``<name>:`` section (``keys``: each
    key's shape) and
    the command line (``ExecutorOptions``) into its settings (UserError, exit 2);
    ``require(settings)`` checks its library is there; ``check(settings, plan)`` refuses what its
    runs cannot use, before anything is submitted; ``build(settings, plan)`` connects it (an :class:`Executor`);
    ``stop(jobs, grace_s, log)`` stops its running jobs (Ctrl-C, SIGTERM); ``poll_s``: the wait
    between polls of its jobs. ``cluster``: its runs go to other machines (``--jobs`` defaults to
    every run; the resources per job are printed; its jobs run on when the terminal hangs up and
    a later sweep adopts them)."""

    settings: Callable[..., Any] = no_settings  # (section, opts, gpus, plan)
    build: Callable[[Any, Any], Executor] = not_buildable
    check: Callable[[Any, Any], None] = nothing
    require: Callable[[Any], None] = nothing
    # the sweep file's section: key -> shape (executor.SLURM_SHAPES), or key names alone
    keys: dict[str, str] | tuple[str, ...] = field(default_factory=dict)
    cluster: bool = True
    gpus: Callable[[Any, dict, Any], int] = no_gpus
    # (CPUs, host memory GB) each job asks for, (plan, section, opts); None: none asked
    cpus_mem: Callable[[Any, dict, Any], tuple[int, float]] | None = None
    stop: Callable[[list, float, Any], None] = stop_jobs
    poll_s: float = 1.0


def _executors() -> Registry:
    from sat_cli.sweep import executor as ex
    from sat_cli.sweep import local

    reg = Registry("--executor", "sweep executor")
    reg.add(
        "local",
        SweepExecutor(build=local.open_local, cluster=False, stop=local.stop_local, poll_s=0.2),
    )
    slurm = (ex.slurm_settings, ex.open_slurm, ex.check_slurm, ex.require_slurm, ex.SLURM_SHAPES)
    reg.add("slurm", SweepExecutor(*slurm, gpus=ex.slurm_gpus, cpus_mem=ex.job_cpus_mem))
    ray = (ex.ray_settings, ex.open_ray, ex.check_ray, ex.require_ray, ex.RAY_SHAPES)
    reg.add("ray", SweepExecutor(*ray, gpus=ex.ray_gpus))
    return reg


EXECUTORS = _executors()
# the executor of a run record written before records named theirs: a subprocess of this machine
LOCAL = "local"
