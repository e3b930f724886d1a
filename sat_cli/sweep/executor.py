"""``sat sweep --executor local|slurm|ray``: the executor's settings and the checks before any
submission.

Settings come from the sweep file's optional ``slurm:`` / ``ray:`` sections, overridden by the
command line (``--slurm-partition``, ``--slurm-time``, ``--slurm-gpus``, ``--slurm-cpus``,
``--slurm-mem-gb``, ``--slurm-option KEY=VALUE``, ``--slurm-setup LINE``, ``--slurm-cluster``;
``--ray-address``, ``--ray-cpus``, ``--ray-gpus``, ``--ray-resource NAME=AMOUNT``).

A SLURM job asks for the CPUs and host memory its run's processes need
(``sat_cli.config.needs``; :func:`job_cpus_mem`) unless ``--slurm-cpus`` / ``--slurm-mem-gb``
say otherwise; the dry-run prints them beside the GPUs (:func:`resources_text`).

A cluster sweep's runs run on other machines, so before anything is submitted (exit 2):

- the tracking store must be a server every node reaches: ``sqlite:///`` or a local folder is
  refused, naming ``sat mlflow-server`` and ``tracking=mlflow_server tracking.uri=…``;
- ``run.dir`` must be shared: with Ray, every live node must read a marker file written here
  (a real check); with SLURM, a folder under a node-local temporary root (/tmp, /var/tmp,
  /dev/shm, /run, ``$TMPDIR``) or on a tmpfs/ramfs mount is refused.

``--slurm-cluster local`` runs the jobs through submitit's local executor on this machine (the
same submission, state and adoption code; no SLURM): both checks are skipped there, since every
job shares this machine's disk.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from sat_cli.errors import UserError

# each key of a sweep file's executor section and its shape (check_section): "text" a scalar,
# "number" an int or float, "lines" a list of strings, "pairs" a KEY: VALUE mapping or a list of
# 'KEY=VALUE' strings; the values themselves are checked by the settings readers below
SLURM_SHAPES = {
    "cluster": "text",
    "partition": "text",
    "time_min": "number",
    "gpus_per_node": "number",
    "cpus_per_task": "number",
    "mem_gb": "number",
    "setup": "lines",
    "additional": "pairs",
}
RAY_SHAPES = {"address": "text", "num_cpus": "number", "num_gpus": "number", "resources": "pairs"}
SHAPE_HINTS = {
    "text": "a single value",
    "number": "a number",
    "lines": "a list of strings, e.g. ['module load cuda']",
    "pairs": "a mapping KEY: VALUE or a list of 'KEY=VALUE' strings",
}
LOCAL_ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
LOCAL_FS = ("tmpfs", "ramfs", "devtmpfs")


@dataclass
class ExecutorOptions:
    """What the command line says (None: the sweep file's value or the default)."""

    name: str = "local"
    slurm_cluster: str | None = None
    slurm_partition: str | None = None
    slurm_time: int | None = None
    slurm_gpus: int | None = None
    slurm_cpus: int | None = None
    slurm_mem_gb: float | None = None
    slurm_options: list[str] = field(default_factory=list)
    slurm_setup: list[str] = field(default_factory=list)
    ray_address: str | None = None
    ray_cpus: float | None = None
    ray_gpus: float | None = None
    ray_resources: list[str] = field(default_factory=list)


def check_section(where: str, name: str, value, keys: dict[str, str] | tuple[str, ...]) -> dict:
    """A sweep file's executor section (``slurm:``, ``ray:``): a mapping with known keys, each
    value of its key's shape (``SLURM_SHAPES``), so a scalar where a list or a mapping belongs
    is refused when the file is read, not taken apart letter by letter. ``keys``: key -> shape,
    or (a plug-in's) key names alone, whose values its settings reader checks."""
    shapes = keys if isinstance(keys, dict) else dict.fromkeys(keys, "any")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where}: {name} must be a mapping with keys {', '.join(shapes)}")
    unknown = sorted(set(map(str, value)) - set(shapes))
    if unknown:
        raise UserError(
            f"{where}: {name}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(shapes)}"
        )
    for key, item in value.items():
        if item is not None and not _has_shape(item, shapes[str(key)]):
            raise UserError(
                f"{where}: {name}.{key} must be {SHAPE_HINTS[shapes[str(key)]]}, got {item!r}"
            )
    return dict(value)


def _has_shape(value, shape: str) -> bool:
    def scalar(x) -> bool:
        return isinstance(x, str | int | float) and not isinstance(x, bool)

    if shape == "any":
        return True
    if shape == "text":
        return scalar(value)
    if shape == "number":
        return scalar(value) and not isinstance(value, str)
    if shape == "lines":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if isinstance(value, dict):  # pairs
        return all(scalar(k) and scalar(v) for k, v in value.items())
    return isinstance(value, list) and all(isinstance(x, str) and "=" in x for x in value)


def _pairs(items: list[str] | dict, what: str, number: bool) -> dict:
    if isinstance(items, dict):
        pairs = {str(k): v for k, v in items.items()}
    else:
        pairs = {}
        for item in items:
            key, sep, value = str(item).partition("=")
            if not sep or not key.strip():
                raise UserError(f"{what} {item!r}: expected KEY=VALUE")
            pairs[key.strip()] = value.strip()
    if number:
        out = {}
        for k, v in pairs.items():
            try:
                amount = float(v)
            except (TypeError, ValueError):
                raise UserError(f"{what} {k}={v!r}: the amount must be a number") from None
            if not math.isfinite(amount) or amount <= 0:
                raise UserError(f"{what} {k}={v!r}: the amount must be a number > 0")
            out[k] = amount
        return out
    return {k: str(v) for k, v in pairs.items()}


def _number(what: str, value, lo: float, integer: bool):
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or not math.isfinite(value) or value < lo:
        kind = "an integer" if integer else "a number"
        raise UserError(f"{what}={value!r}: must be {kind} >= {lo:g}")
    return int(value) if integer else float(value)


def job_gpus(plan, name: str, explicit, key: str) -> int:
    """GPUs each job of a cluster sweep asks for: ``explicit`` (``--slurm-gpus`` /
    ``--ray-gpus`` or the sweep file's), checked against every run's device plan, or the most
    any run needs. UserError (exit 2) for too few, a CUDA run with none, or a run over several
    nodes (a job is one node)."""
    need = max(plan.gpus.values(), default=0)
    for run, nodes in plan.nodes.items():
        if nodes > 1:
            raise UserError(
                f"--executor {name}: run {run!r} has trainer.nnodes={nodes}, and a sweep job is "
                "one node; run it with `sat train launcher=ray …` on a Ray cluster (inside a SLURM "
                "allocation: scripts/ray_in_slurm.sh, docs/gpus.md)"
            )
    if explicit is None:
        return need
    for run, gpus in plan.gpus.items():
        if explicit < gpus and (explicit > 0 or plan.cuda[run]):
            raise UserError(
                f"{key}={explicit:g} but run {run!r} needs {gpus} GPU(s) on its node (its device "
                f"plan: `sat plan` with its overrides); set {key}={gpus} or leave it unset"
            )
    return explicit


def resources_text(plan, name: str, gpus: int, asked: tuple[int, float] | None = None) -> str:
    """The lines ``--dry-run`` and each start print: what every job asks for (GPUs; ``asked``:
    the CPUs and host memory, for an executor that asks for them, :func:`job_cpus_mem`)."""
    per_run = sorted(set(plan.gpus.values()))
    text = (
        f"resources (--executor {name}): 1 node and {gpus:g} GPU(s) per job; the runs' device "
        f"plans need {', '.join(map(str, per_run)) or 0} GPU(s)"
        + (" (0: Megatron ranks on the CPU)" if gpus == 0 and any(plan.gpus.values()) else "")
    )
    if not plan.needs:
        return text
    run, need = max(plan.needs.items(), key=lambda kv: (kv[1].mem_gb, kv[1].cpus))
    if asked is not None:
        what = f"{asked[0]} CPUs and {asked[1]:g} GB host memory per job"
    else:  # Ray: the actor's --ray-cpus; Ray reserves no host memory for it
        what = "its own CPU request only (no host memory is reserved)"
    return (
        f"{text}\n  CPUs, memory (--executor {name}): {what}; the largest run's processes "
        f"({run!r}) need {need.text()}"
    )


def job_cpus_mem(plan, section: dict, opts: ExecutorOptions) -> tuple[int, float]:
    """CPUs and host memory (GB) per SLURM job: ``--slurm-cpus`` / ``--slurm-mem-gb`` (or the
    sweep file's) when given, else the most any run's processes need
    (``sat_cli.config.needs``: engine, trainer and reward processes, offloaded optimizer)."""
    cpus = pick_value(section, "cpus_per_task", opts.slurm_cpus)
    mem = pick_value(section, "mem_gb", opts.slurm_mem_gb)
    cpus = (
        _number("slurm.cpus_per_task", cpus, 1, True)
        if cpus is not None
        else max((n.cpus for n in plan.needs.values()), default=2)
    )
    mem = (
        _number("slurm.mem_gb", mem, 0, False)
        if mem is not None
        else max((n.mem_gb for n in plan.needs.values()), default=0)
    )
    return cpus, mem


def slurm_gpus(plan, section: dict, opts: ExecutorOptions) -> int:
    """GPUs per job of ``--executor slurm`` (:func:`job_gpus`)."""
    value = pick_value(section, "gpus_per_node", opts.slurm_gpus)
    if value is not None:
        value = _number("--slurm-gpus", value, 0, True)
    return job_gpus(plan, "slurm", value, "--slurm-gpus")


def ray_gpus(plan, section: dict, opts: ExecutorOptions) -> int:
    """GPUs per job of ``--executor ray`` (:func:`job_gpus`)."""
    value = pick_value(section, "num_gpus", opts.ray_gpus)
    if value is not None:
        value = _number("--ray-gpus", value, 0, False)
    return job_gpus(plan, "ray", value, "--ray-gpus")


def pick_value(section: dict, key: str, cli):
    return cli if cli is not None else section.get(key)


def slurm_settings(section: dict, opts: ExecutorOptions, gpus: int = 0, plan=None):
    """``--executor slurm``'s settings; with the sweep's ``plan``, CPUs and host memory per job
    default to what its runs need (:func:`job_cpus_mem`)."""
    from sat_cli.cluster.slurm import SUBMITIT_CLUSTERS, SlurmSettings

    def pick(key, cli):
        return pick_value(section, key, cli)

    cluster = pick("cluster", opts.slurm_cluster) or "slurm"
    if cluster not in SUBMITIT_CLUSTERS:
        raise UserError(f"--slurm-cluster {cluster!r}: choose {' or '.join(SUBMITIT_CLUSTERS)}")
    out = {"cluster": cluster}
    if (partition := pick("partition", opts.slurm_partition)) is not None:
        out["partition"] = str(partition)
    for key, cli, lo, integer in (
        ("time_min", opts.slurm_time, 1, True),
        ("cpus_per_task", opts.slurm_cpus, 1, True),
        ("mem_gb", opts.slurm_mem_gb, 0, False),
    ):
        value = pick(key, cli)
        if value is not None:
            out[key] = _number(f"slurm.{key}", value, lo, integer)
    if plan is not None and plan.needs:
        out["cpus_per_task"], out["mem_gb"] = job_cpus_mem(plan, section, opts)
    setup = list(section.get("setup") or []) + list(opts.slurm_setup)
    if not all(isinstance(line, str) for line in setup):
        raise UserError("slurm.setup: a list of shell lines, e.g. ['module load cuda']")
    out["setup"], out["gpus_per_node"] = tuple(setup), gpus
    extra = {**_pairs(section.get("additional") or {}, "slurm.additional", False)}
    extra.update(_pairs(opts.slurm_options, "--slurm-option", False))
    out["additional"] = extra
    return SlurmSettings(**out)


def ray_settings(section: dict, opts: ExecutorOptions, gpus: float = 0.0, plan=None):
    from sat_cli.cluster.executors import RaySweepSettings
    from sat_cli.cluster.settings import parse_address

    address = opts.ray_address or section.get("address")
    if not address:
        raise UserError(
            "--executor ray needs the cluster's address: --ray-address HOST:PORT (or ray.address "
            "in the sweep file), the head node of a running cluster (`ray start --head`)"
        )
    from sat_cli.config import ConfigError

    try:
        parse_address("--ray-address", str(address))
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    out = {"address": str(address)}
    out["num_gpus"] = float(gpus)
    if (value := pick_value(section, "num_cpus", opts.ray_cpus)) is not None:
        out["num_cpus"] = _number("ray.num_cpus", value, 0, False)
    resources = _pairs(section.get("resources") or {}, "ray.resources", True)
    resources.update(_pairs(opts.ray_resources, "--ray-resource", True))
    out["resources"] = resources
    return RaySweepSettings(**out)


def _mount_fstype(path: Path) -> str | None:
    """The file-system type of the mount that holds ``path`` (longest /proc/mounts prefix)."""
    best, fstype = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return None
    return fstype


def node_local_reason(folder: Path) -> str | None:
    """Why ``folder`` is only on this node (a temporary root or a memory file system), or None."""
    folder = Path(folder).resolve()
    roots = list(LOCAL_ROOTS) + ([os.environ["TMPDIR"]] if os.environ.get("TMPDIR") else [])
    for root in roots:
        r = str(Path(root).resolve())
        if str(folder) == r or str(folder).startswith(r.rstrip("/") + "/"):
            return f"it is under {root}, a node-local temporary folder"
    fstype = _mount_fstype(folder)
    if fstype in LOCAL_FS:
        return f"it is on a {fstype} mount (memory of this node only)"
    return None


def check_shared_store(name: str, plan) -> None:
    """A cluster sweep's runs share one tracking store: not a file of this machine (module
    docstring); nothing is submitted yet."""
    uri = plan.tracking_uri
    if uri is not None and (uri.startswith(("sqlite:", "file:")) or "://" not in uri):
        raise UserError(
            f"--executor {name}: the tracking store {uri!r} lives on this "
            "machine's disk, which the cluster's runs cannot share; start one server for all "
            "nodes with `sat mlflow-server --backend-store-uri postgresql://… "
            "--artifacts-destination /shared/mlartifacts` and pass tracking=mlflow_server "
            "tracking.uri=http://HOST:5000 (or tracking=none)"
        )


def check_ray(settings, plan) -> None:
    check_shared_store("ray", plan)


def check_slurm(settings, plan) -> None:
    """SLURM's runs share the store and ``run.dir`` (skipped for ``--slurm-cluster local``:
    every job shares this machine's disk)."""
    from sat_cli.cluster.slurm import SUBMITIT_CLUSTERS

    if SUBMITIT_CLUSTERS[settings.cluster].SHARED_DISK:
        return
    check_shared_store("slurm", plan)
    why = node_local_reason(Path(plan.run_dir))
    if why:
        raise UserError(
            f"--executor slurm: run.dir={plan.run_dir} is not shared ({why}); the jobs run "
            "on other nodes: use a folder on the cluster's shared filesystem "
            "(run.dir=/shared/runs)"
        )


def require_slurm(settings) -> None:
    """Exit 2 naming the pip line when submitit is missing (nothing submitted)."""
    from sat_cli.cluster.slurm import import_submitit

    import_submitit()


def require_ray(settings) -> None:
    """Exit 2 naming the pip line when Ray is missing (nothing submitted)."""
    from sat_cli.cluster.ray_env import import_ray, is_loopback, split_address

    import_ray(is_loopback(split_address(settings.address)[0]), "--executor ray")


def open_slurm(settings, plan):
    from sat_cli.cluster.slurm import SUBMITIT_CLUSTERS

    return SUBMITIT_CLUSTERS[settings.cluster](settings, Path(plan.root) / "submitit")


def open_ray(settings, plan):
    """The Ray executor, connected and checked: every node reads run.dir."""
    from sat_cli.cluster.executors import RaySweepExecutor

    executor = RaySweepExecutor(settings)
    try:
        executor.check_shared(Path(plan.run_dir))
    except BaseException:
        executor.close()
        raise
    return executor
