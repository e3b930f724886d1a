"""Where the runs of ``sat sweep --executor slurm|ray`` go (``--executor local`` is the sweep's own
subprocess launcher, ``sat_cli.sweep.children``).

Each executor submits one run (its ``sat train`` argument list, its log file) and hands back a
job with ``job_id``, ``poll()`` (the run's exit code once it ended, None while it is queued or
runs) and ``stop(grace_s)`` (an orderly stop, then a hard one); ``adopt(job_id)`` finds a job of
an earlier ``sat sweep`` that still runs (None when it is gone), so a re-run waits for it
instead of starting it twice.

- **slurm** — submitit's ``AutoExecutor`` (``cluster="slurm"``; ``"local"`` runs the same code
  path as processes of this machine, through submitit's own local executor) with the
  partition, time limit, GPUs, CPUs, memory and extra ``#SBATCH`` options of
  :class:`SlurmSettings`; the job runs :func:`sat_cli.cluster.jobs.run_job`. A job that SLURM
  cancelled, preempted or timed out ends "killed"; the run resumes from its checkpoint.
- **ray** — one detached, named actor per run (:class:`sat_cli.cluster.jobs.RunHost`, in
  namespace ``sat-sweep``, named ``<sweep id>/<run>``) with the run's resources
  (:class:`RaySweepSettings`); Ray places it, the actor runs ``sat train`` on its node.

Settings are plain dataclasses, built at the edge (``sat_cli.sweep.executor_settings``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli.cluster.ray_env import ClusterError
from sat_cli.errors import UserError

SUBMITIT_INSTALL = "pip install -e '.[slurm]'  (in a clone; or pip install 'sat-cli[slurm]')"
RAY_NAMESPACE = "sat-sweep"
# SLURM states of a job that ended without finishing its run: the run is resumed next time
KILLED_STATES = ("CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
ENDED_STATES = ("COMPLETED", "FAILED", "OUT_OF_MEMORY", *KILLED_STATES)
KILLED_CODE = 143  # what a run stopped by its scheduler reports here


@dataclass(frozen=True)
class SlurmSettings:
    cluster: str = "slurm"  # slurm | local (submitit's local executor: this machine)
    partition: str | None = None
    time_min: int = 24 * 60
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem_gb: float | None = None
    setup: tuple[str, ...] = ()  # shell lines run before each job (module load, venv, ...)
    additional: dict = field(default_factory=dict)  # extra #SBATCH options, e.g. {account: x}


@dataclass(frozen=True)
class RaySweepSettings:
    address: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)
    connect_timeout_s: float = 30.0
    call_timeout_s: float = 60.0


def import_submitit():
    try:
        import submitit
    except ImportError:
        raise UserError(
            f"--executor slurm needs submitit, which is not installed: {SUBMITIT_INSTALL}"
        ) from None
    return submitit


# ----------------------------------------------------------------------------- slurm


class SlurmJob:
    def __init__(self, job, executor: SlurmExecutor) -> None:
        self._job = job
        self._ex = executor
        self.job_id = str(job.job_id)
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        if self._ex.settings.cluster == "local":
            if not self._local_done():
                return None
        elif not self._job.paths.result_pickle.exists():  # no result yet: ask SLURM
            state = self._state().split(" ")[0]
            if state in KILLED_STATES:
                self._code = KILLED_CODE
                return self._code
            if state not in ENDED_STATES and self._queued(state):
                return None
        if not self._job.paths.result_pickle.exists():  # ended without a result: killed
            self._code = KILLED_CODE  # (result() would wait for one forever)
            return self._code
        try:
            self._code = int(self._job.result())
        except Exception:  # noqa: BLE001 - the job raised (killed mid-way): resume it later
            self._code = KILLED_CODE
        return self._code

    def _local_done(self) -> bool:
        if self._job._process is not None:  # submitted by this sweep
            return self._job._process.poll() is not None
        return not _pid_runs(int(self.job_id), b"submitit")  # adopted: its controller's pid

    def _state(self) -> str:
        try:
            return str(self._job.state).upper()
        except Exception:  # noqa: BLE001 - sacct unreachable: squeue decides (below)
            return "UNKNOWN"

    def _queued(self, state: str) -> bool:
        """Still queued or running? sacct's state when it knows one; without accounting
        (sacct answers nothing), whether ``squeue`` still lists the job."""
        if state not in ("UNKNOWN", ""):
            return True
        import subprocess

        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", self.job_id, "-o", "%T"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            return True  # cannot tell now: ask again later
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            return True
        return bool(out.stdout.strip())

    def stop(self, grace_s: float) -> None:
        """scancel (SIGTERM: the run stops in order), wait, then SIGKILL via scancel."""
        if self.poll() is not None:
            return
        if self._ex.settings.cluster == "local":
            # SIGTERM to submitit's controller, which passes it to the job, which passes it to
            # sat train; after the grace period the whole tree is killed
            pid = int(self.job_id)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.poll() is None:
                _kill_tree(pid, signal.SIGKILL)
            return
        self._job.cancel(check=False)
        deadline = time.monotonic() + grace_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)


def _pid_runs(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return marker in cmd and state not in ("Z", "X")


def _kill_tree(pid: int, sig: int) -> None:
    from sat_cli.cluster.guard import tree

    for p in tree(pid):
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


class SlurmExecutor:
    name = "slurm"

    def __init__(self, settings: SlurmSettings, folder: Path) -> None:
        self.settings = settings
        self.submitit = import_submitit()
        self.folder = Path(folder).resolve()
        if settings.cluster == "slurm":
            import shutil

            if shutil.which("sbatch") is None:
                raise UserError(
                    "--executor slurm: `sbatch` is not on PATH here; run `sat sweep` on a SLURM "
                    "login node, or use --slurm-cluster local to run the jobs on this machine "
                    "through submitit's local executor"
                )

    def _executor(self, run_name: str):
        s = self.settings
        ex = self.submitit.AutoExecutor(folder=str(self.folder / "%j"), cluster=s.cluster)
        params = dict(
            name=f"sat-{run_name}"[:120],
            timeout_min=int(s.time_min),
            gpus_per_node=int(s.gpus_per_node),
            cpus_per_task=int(s.cpus_per_task),
            nodes=1,
            tasks_per_node=1,
        )
        if s.mem_gb is not None:
            params["mem_gb"] = float(s.mem_gb)
        if s.cluster == "slurm":
            if s.partition:
                params["slurm_partition"] = s.partition
            if s.setup:
                params["slurm_setup"] = list(s.setup)
            if s.additional:
                params["slurm_additional_parameters"] = dict(s.additional)
        elif s.setup:
            params["local_setup"] = list(s.setup)
        ex.update_parameters(**params)
        return ex

    def submit(self, run_name: str, cmd: list[str], log_path: Path, env: dict, header: str):
        from sat_cli.cluster.jobs import run_job

        job = self._executor(run_name).submit(
            run_job, cmd, str(Path(log_path).resolve()), env, header, os.getcwd()
        )
        return SlurmJob(job, self)

    def adopt(self, job_id: str):
        """The job of an earlier sweep, when it still runs (or waits in the queue)."""
        s = self.settings
        if s.cluster == "local":
            if not str(job_id).isdigit() or not _pid_runs(int(job_id), b"submitit"):
                return None
            job = self.submitit.local.local.LocalJob(self.folder / str(job_id), str(job_id))
            return SlurmJob(job, self)
        job = self.submitit.SlurmJob(self.folder / str(job_id), str(job_id))
        wrapped = SlurmJob(job, self)
        return None if wrapped.poll() is not None else wrapped

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- ray


class RayJob:
    def __init__(self, actor, name: str, executor: RaySweepExecutor) -> None:
        self._actor = actor
        self.job_id = name
        self._ex = executor
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ray = self._ex.ray
        try:
            code = ray.get(self._actor.poll.remote(), timeout=self._ex.settings.call_timeout_s)
        except ray.exceptions.RayActorError:
            code = KILLED_CODE  # its node went away, or someone killed the actor
        except ray.exceptions.GetTimeoutError:
            return None
        if code is not None:
            self._code = int(code)
            self._ex.forget(self._actor)
        return self._code

    def stop(self, grace_s: float) -> None:
        ray = self._ex.ray
        try:
            code = ray.get(self._actor.stop.remote(grace_s), timeout=grace_s + 30)
            self._code = KILLED_CODE if code is None else int(code)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self._code = KILLED_CODE
        self._ex.forget(self._actor)


class RaySweepExecutor:
    name = "ray"

    def __init__(self, settings: RaySweepSettings) -> None:
        from sat_cli.cluster.ray_env import connect

        self.settings = settings
        self.ray = connect(
            settings.address, settings.connect_timeout_s, RAY_NAMESPACE, "--executor ray"
        )

    def check_shared(self, folder: Path) -> None:
        """Every live node sees ``folder`` (a marker written here is read there); UserError."""
        import uuid

        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self.ray
        folder = Path(folder).resolve()  # a task's working folder is not ours
        marker = folder / f".sat-shared-{uuid.uuid4().hex[:12]}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("sat")

        def seen(path: str) -> bool:
            return Path(path).is_file() and Path(path).read_text() == "sat"

        probe = ray.remote(num_cpus=0)(seen)
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            refs = {
                probe.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(str(marker)): n
                for n in nodes
            }
            blind = []
            for ref, node in refs.items():
                try:
                    ok = ray.get(ref, timeout=self.settings.call_timeout_s)
                except Exception:  # noqa: BLE001 - a node that cannot answer cannot be used
                    ok = False
                if not ok:
                    blind.append(f"{node.get('NodeManagerHostname')} ({node['NodeID'][:12]})")
        finally:
            marker.unlink(missing_ok=True)
        if blind:
            raise UserError(
                f"run.dir {folder} is not shared: Ray node(s) {', '.join(blind)} cannot read a "
                "file written there; use a folder on the cluster's shared filesystem "
                "(run.dir=/shared/runs)"
            )

    def submit(self, run_name: str, cmd: list[str], log_path: Path, env: dict, header: str):
        from sat_cli.cluster.jobs import RunHost

        s, ray = self.settings, self.ray
        name = f"{header.split(' ')[0]}/{run_name}"  # header starts with the sweep id
        actor = (
            ray.remote(RunHost)
            .options(
                name=name,
                namespace=RAY_NAMESPACE,
                lifetime="detached",
                max_restarts=0,
                max_concurrency=4,
                num_cpus=s.num_cpus,
                num_gpus=s.num_gpus,
                resources=dict(s.resources),
            )
            .remote()
        )
        try:
            ray.get(
                actor.start.remote(
                    list(cmd), str(Path(log_path).resolve()), dict(env), header, os.getcwd()
                ),
                timeout=s.call_timeout_s + 600,  # includes waiting for the run's resources
            )
        except Exception as exc:  # noqa: BLE001 - one message, the actor removed
            ray.kill(actor, no_restart=True)
            raise ClusterError(
                f"could not start run {run_name} on the Ray cluster: {exc}"
            ) from None
        return RayJob(actor, name, self)

    def adopt(self, job_id: str):
        ray = self.ray
        try:
            actor = ray.get_actor(str(job_id), namespace=RAY_NAMESPACE)
        except ValueError:
            return None  # gone: finished and removed, or lost with its node
        job = RayJob(actor, str(job_id), self)
        return None if job.poll() is not None else job

    def forget(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass

    def close(self) -> None:
        try:
            self.ray.shutdown()
        except Exception:  # noqa: BLE001, S110
            pass
