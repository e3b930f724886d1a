"""``sat sweep --executor slurm``: submitit's ``AutoExecutor`` on a SLURM cluster
(:class:`SlurmExecutor`) or, with ``--slurm-cluster local``, its local executor on this machine
(:class:`LocalSubmititExecutor`: the same submission, state and adoption code, no SLURM); the
module docstring of ``sat_cli.cluster.executors`` has the job protocol."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli.cluster.executors import KILLED_CODE
from sat_cli.errors import UserError

SUBMITIT_INSTALL = "pip install -e '.[slurm]'  (in a clone; or pip install 'sat-cli[slurm]')"
# SLURM states of a job that ended without finishing its run: the run is resumed next time
KILLED_STATES = ("CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
ENDED_STATES = ("COMPLETED", "FAILED", "OUT_OF_MEMORY", *KILLED_STATES)


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


def import_submitit():
    try:
        import submitit
    except ImportError:
        raise UserError(
            f"--executor slurm needs submitit, which is not installed: {SUBMITIT_INSTALL}"
        ) from None
    return submitit


class SlurmJob:
    """A job of SLURM: sacct (or squeue) says whether it still waits or runs."""

    def __init__(self, job, executor: SlurmExecutor) -> None:
        self._job = job
        self._ex = executor
        self.job_id = str(job.job_id)
        self._code: int | None = None

    def record(self) -> dict:
        return {}  # its record in sweep_state.json: the executor's name and job_id alone

    def poll(self) -> int | None:
        if self._code is None and not self._waiting():
            self._code = self._result()
        return self._code

    def _waiting(self) -> bool:
        """Still queued or running (no result yet, and SLURM does not say it ended)."""
        if self._job.paths.result_pickle.exists():
            return False
        state = self._state().split(" ")[0]
        if state in KILLED_STATES:
            return False  # no result: killed (below)
        return state not in ENDED_STATES and self._queued(state)

    def _result(self) -> int:
        if not self._job.paths.result_pickle.exists():  # ended without a result: killed
            return KILLED_CODE  # (result() would wait for one forever)
        try:
            return int(self._job.result())
        except Exception:  # noqa: BLE001 - the job raised (killed mid-way): resume it later
            return KILLED_CODE

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
        self._job.cancel(check=False)
        deadline = time.monotonic() + grace_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)


class LocalSubmititJob(SlurmJob):
    """A job of submitit's local executor: a controller process of this machine (``job_id`` is
    its pid)."""

    def _waiting(self) -> bool:
        if self._job._process is not None:  # submitted by this sweep
            return self._job._process.poll() is None
        return _pid_runs(int(self.job_id), b"submitit")  # adopted: its controller's pid

    def stop(self, grace_s: float) -> None:
        """SIGTERM to submitit's controller, which passes it to the job, which passes it to sat
        train; after the grace period the whole tree is killed."""
        if self.poll() is not None:
            return
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
    """``--executor slurm`` on a SLURM cluster (``--slurm-cluster slurm``): sbatch through
    submitit; the jobs run on other nodes, so run.dir and the tracking store must be shared
    (``SHARED_DISK``: False; checked in ``sat_cli.sweep.executor.check_slurm``)."""

    name = "slurm"
    cluster = "slurm"  # submitit's AutoExecutor(cluster=...)
    SHARED_DISK = False
    job_class = SlurmJob

    def __init__(self, settings: SlurmSettings, folder: Path) -> None:
        self.settings = settings
        self.submitit = import_submitit()
        self.folder = Path(folder).resolve()
        self.require()

    def require(self) -> None:
        import shutil

        if shutil.which("sbatch") is None:
            raise UserError(
                "--executor slurm: `sbatch` is not on PATH here; run `sat sweep` on a SLURM "
                "login node, or use --slurm-cluster local to run the jobs on this machine "
                "through submitit's local executor"
            )

    def options(self, s: SlurmSettings) -> dict:
        """The submitit parameters of this cluster (partition, setup, #SBATCH options)."""
        params = {}
        if s.partition:
            params["slurm_partition"] = s.partition
        if s.setup:
            params["slurm_setup"] = list(s.setup)
        if s.additional:
            params["slurm_additional_parameters"] = dict(s.additional)
        return params

    def _executor(self, run_name: str):
        s = self.settings
        ex = self.submitit.AutoExecutor(folder=str(self.folder / "%j"), cluster=self.cluster)
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
        ex.update_parameters(**params, **self.options(s))
        return ex

    def submit(self, run_name: str, cmd: list[str], log_path: Path, env: dict, header: str):
        from sat_cli.cluster.jobs import run_job

        job = self._executor(run_name).submit(
            run_job, cmd, str(Path(log_path).resolve()), env, header, os.getcwd()
        )
        return self.job_class(job, self)

    def adopt(self, job_id: str):
        """The job of an earlier sweep, when it still runs (or waits in the queue)."""
        job = self.submitit.SlurmJob(self.folder / str(job_id), str(job_id))
        wrapped = SlurmJob(job, self)
        return None if wrapped.poll() is not None else wrapped

    def close(self) -> None:
        pass


class LocalSubmititExecutor(SlurmExecutor):
    """``--slurm-cluster local``: the same submission, state and adoption code through
    submitit's local executor, as processes of this machine (every job shares its disk)."""

    cluster = "local"
    SHARED_DISK = True
    job_class = LocalSubmititJob

    def require(self) -> None:
        return None

    def options(self, s: SlurmSettings) -> dict:
        return {"local_setup": list(s.setup)} if s.setup else {}

    def adopt(self, job_id: str):
        if not str(job_id).isdigit() or not _pid_runs(int(job_id), b"submitit"):
            return None
        job = self.submitit.local.local.LocalJob(self.folder / str(job_id), str(job_id))
        return LocalSubmititJob(job, self)


# --slurm-cluster <name> (SlurmSettings.cluster) → the executor class that runs its jobs
SUBMITIT_CLUSTERS = {c.cluster: c for c in (SlurmExecutor, LocalSubmititExecutor)}
