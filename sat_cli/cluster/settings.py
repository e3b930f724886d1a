"""The ``launcher`` section (``conf/launcher/*.yaml``): where a run's processes go.

``local`` (the default, :class:`LauncherSettings`) starts the trainer and engine processes on this
machine, as always. ``ray`` (:class:`RayLauncherSettings`) connects to a running Ray cluster
(``launcher.address``; never started here) and places the processes that can live on another
node with one placement group: one bundle per trainer node and one per launched engine server
(what each component's ``resources`` asks for). Ray only places and supervises
(``sat_cli.cluster``); the processes, their argument lists and the torchrun/gloo/NCCL code are the
local launcher's. Torch- and Ray-free: the config composes without them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sat_cli.registry import Resources
from sat_cli.validate import ConfigError, check_choice, check_range

STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-:]{0,99}$")


def parse_address(key: str, address: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); ConfigError naming ``key`` otherwise."""
    m = _ADDRESS.match(address.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(
            f"{key}={address!r} is not HOST:PORT (e.g. 127.0.0.1:6379, the head node's "
            "`ray start --head --port=6379`)"
        )
    return m.group(1).strip("[]"), int(m.group(2))


@dataclass
class LauncherSettings:
    """``launcher=local``: the trainer and engine processes on this machine."""

    name: str = "local"

    places: ClassVar[bool] = False  # whether it places processes on other machines


@dataclass
class RayLauncherSettings(LauncherSettings):
    """``launcher=ray``: one placement group on a running Ray cluster."""

    name: str = "ray"
    address: str | None = None  # ray: HOST:PORT of the cluster's head (GCS), e.g. HEAD:6379
    namespace: str = "sat"  # ray: the namespace of sat's actors
    connect_timeout_s: float = 30.0  # ray: reaching the cluster
    placement_timeout_s: float = 300.0  # ray: the placement group's resources becoming free
    call_timeout_s: float = 120.0  # ray: one call to an actor (start or stop a process, ...)
    health_interval_s: float = 2.0  # ray: every actor is pinged this often
    # ray: an actor that has not answered a ping for this long counts as lost with its node
    # (Ray itself declares a node dead after its own health checks; whichever comes first)
    health_timeout_s: float = 20.0
    # placement group strategy over all bundles; null: PACK for one trainer node, SPREAD for
    # several (sat_cli/config/devices.py)
    strategy: str | None = None
    trainer_cpus: float | None = None  # CPUs per trainer-node bundle; null: nproc_per_node
    # GPUs per trainer-node / SGLang-server bundle; null: what the device plan needs
    # (nproc_per_node; tp × dp); trainer_gpus=0 runs the Megatron ranks on the CPU (gloo)
    trainer_gpus: float | None = None
    server_cpus: float = 1.0  # CPUs per SGLang-server bundle
    server_gpus: float | None = None
    # custom Ray resources added to every trainer / server bundle, e.g. {node_type_gpu: 1}
    trainer_resources: dict[str, float] = field(default_factory=dict)
    server_resources: dict[str, float] = field(default_factory=dict)

    places: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.strategy is not None:
            check_choice("launcher.strategy", self.strategy, STRATEGIES)
        for key in (
            "connect_timeout_s",
            "placement_timeout_s",
            "call_timeout_s",
            "health_interval_s",
            "health_timeout_s",
        ):
            value = getattr(self, key)
            if not math.isfinite(value):
                raise ConfigError(f"launcher.{key}={value} is not a finite number")
            check_range(f"launcher.{key}", value, 0, lo_open=True)
        if self.health_timeout_s < self.health_interval_s:
            raise ConfigError(
                f"launcher.health_timeout_s={self.health_timeout_s} is below "
                f"launcher.health_interval_s={self.health_interval_s}: a node would count as "
                "lost between two pings"
            )
        for key in ("trainer_cpus", "trainer_gpus", "server_cpus", "server_gpus"):
            value = getattr(self, key)
            if value is None:
                continue
            if not math.isfinite(value):
                raise ConfigError(f"launcher.{key}={value} is not a finite number")
            check_range(f"launcher.{key}", value, 0)
        for key in ("trainer_resources", "server_resources"):
            for name, amount in getattr(self, key).items():
                if not _RESOURCE.match(str(name)) or str(name) in ("CPU", "GPU", "memory"):
                    raise ConfigError(
                        f"launcher.{key}: {name!r} is not a custom resource name (CPU and GPU "
                        "have their own keys)"
                    )
                if not math.isfinite(amount) or amount <= 0:
                    raise ConfigError(f"launcher.{key}.{name}={amount} must be a number > 0")
        for side in ("trainer", "server"):
            cpus = getattr(self, f"{side}_cpus")
            if (
                cpus == 0
                and getattr(self, f"{side}_gpus") == 0
                and not getattr(self, f"{side}_resources")
            ):
                raise ConfigError(
                    f"launcher.{side}_cpus=0 with no {side}_gpus or {side}_resources: a Ray "
                    "bundle must ask for some resource"
                )
        if not self.address:
            raise ConfigError(
                "launcher=ray needs launcher.address=HOST:PORT, the head node of a running "
                "Ray cluster (`ray start --head --port=6379` there; sat never starts one)"
            )
        parse_address("launcher.address", self.address)
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", self.namespace):
            raise ConfigError(f"launcher.namespace={self.namespace!r}: letters, digits, _ . - only")


@dataclass(frozen=True)
class LauncherRuntime:
    """What a launcher is built with: what the run's trainer and engine ask of a cluster (the
    trainer's bundle has its CPUs per node, for a null ``launcher.trainer_cpus``), the GPUs per
    trainer-node and server bundle and the placement strategy (explicit or the device plan's:
    ``sat_cli.config.devices``), where it logs."""

    trainer: Resources
    engine: Resources
    gpus: tuple[float, float] = (0.0, 0.0)
    strategy: str = "PACK"
    log: Any = print
    log_path: Path | None = None


def bundles(s: RayLauncherSettings, rt: LauncherRuntime):
    """(trainer nodes, trainer bundle, servers, server bundle) that ``launcher=ray`` places."""
    asked = float((rt.trainer.bundle or {}).get("CPU", 1))
    cpus = s.trainer_cpus if s.trainer_cpus is not None else asked
    trainer_gpus, server_gpus = rt.gpus
    trainer = {"CPU": cpus, "GPU": trainer_gpus, **s.trainer_resources}
    server = {"CPU": s.server_cpus, "GPU": server_gpus, **s.server_resources}
    return (
        rt.trainer.count,
        {k: float(v) for k, v in trainer.items() if v},
        rt.engine.count,
        {k: float(v) for k, v in server.items() if v},
    )


def check(run) -> None:
    """launcher=ray must have something to place: trainer nodes or launched engine servers."""
    from sat_cli.engines.registry import ENGINES
    from sat_cli.trainers.registry import TRAINERS

    e, t = run.engine, run.trainer
    if TRAINERS.of(t).resources(t).count or ENGINES.of(e).resources(e).count:
        return
    urls = getattr(e, "urls", None)
    raise ConfigError(
        "launcher=ray places trainer=megatron nodes and engine=sglang servers on the cluster; "
        f"with trainer={t.name} and engine={e.name}"
        + (" (engine.urls: servers run elsewhere)" if urls else "")
        + " there is nothing to place: use launcher=local"
    )


def build(s: RayLauncherSettings, rt: LauncherRuntime):
    """A connected ``RayLauncher`` with its processes placed, or None when nothing is to be
    placed (``sat eval`` places engine servers only)."""
    from dataclasses import fields

    from sat_cli.cluster.launcher import RayLauncher, RaySettings

    nodes, trainer, servers, server = bundles(s, rt)
    if not nodes and not servers:
        return None
    # every setting but the two bundles is the launcher config's key of the same name
    placed = ("trainer_bundle", "server_bundle", "strategy")
    same = {f.name: getattr(s, f.name) for f in fields(RaySettings) if f.name not in placed}
    settings = RaySettings(
        **same, trainer_bundle=trainer, server_bundle=server, strategy=rt.strategy
    )
    return RayLauncher(
        settings, trainer_nodes=nodes, servers=servers, log=rt.log, log_path=rt.log_path
    ).start()


def placement_text(s: RayLauncherSettings, rt: LauncherRuntime) -> str:
    """One line for `sat plan`: what ``launcher=ray`` would ask the cluster for."""
    from sat_cli.cluster.launcher import bundle_text

    nodes, trainer, servers, server = bundles(s, rt)
    parts = []
    if nodes:
        parts.append(f"{nodes} trainer node bundle(s) [{bundle_text(trainer)}]")
    if servers:
        parts.append(f"{servers} SGLang server bundle(s) [{bundle_text(server)}]")
    return f"launcher: ray at {s.address}, one placement group ({rt.strategy}): " + " + ".join(
        parts
    )
