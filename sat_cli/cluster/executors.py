"""Where the runs of ``sat sweep --executor slurm|ray`` go (``--executor local`` is the sweep's own
subprocess launcher, ``sat_cli.sweep.children``).

Each executor submits one run (its ``sat train`` argument list, its log file) and hands back a
job with ``job_id``, ``poll()`` (the run's exit code once it ended, None while it is queued or
runs) and ``stop(grace_s)`` (an orderly stop, then a hard one); ``adopt(job_id)`` finds a job of
an earlier ``sat sweep`` that still runs (None when it is gone), so a re-run waits for it
instead of starting it twice.

- **slurm** (``sat_cli.cluster.slurm``) — submitit's ``AutoExecutor`` (``cluster="slurm"``: :class:`SlurmExecutor`;
  ``"local"``: :class:`LocalSubmititExecutor`, the same code path as processes of this machine,
  through submitit's own local executor; ``SUBMITIT_CLUSTERS``) with the
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
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli.cluster.ray_env import ClusterError
from sat_cli.errors import UserError

RAY_NAMESPACE = "sat-sweep"
KILLED_CODE = 143  # what a run stopped by its scheduler reports here


@dataclass(frozen=True)
class RaySweepSettings:
    address: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)
    connect_timeout_s: float = 30.0
    call_timeout_s: float = 60.0


# ----------------------------------------------------------------------------- ray


class RayJob:
    def __init__(self, actor, name: str, executor: RaySweepExecutor) -> None:
        self._actor = actor
        self.job_id = name
        self._ex = executor
        self._code: int | None = None

    def record(self) -> dict:
        return {}  # its record in sweep_state.json: the executor's name and job_id alone

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
        from sat_cli.cluster.ray_env import live_nodes, runtime_env, unmet

        s, ray = self.settings, self.ray
        name = f"{header.split(' ')[0]}/{run_name}"  # header starts with the sweep id
        asked = {"CPU": s.num_cpus, "GPU": s.num_gpus, **s.resources}
        why = unmet([{k: float(v) for k, v in asked.items() if v}], "PACK", live_nodes(ray))
        if why:  # nothing started: one line
            raise ClusterError(f"run {run_name} cannot be placed on the Ray cluster: {why}")
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
                runtime_env=runtime_env(),
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
