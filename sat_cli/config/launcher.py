"""The ``launcher`` section of the config (``conf/launcher/*.yaml``): where a run's processes go.

``local`` (the default) starts the trainer and engine processes on this machine, as always.
``ray`` connects to a running Ray cluster (``launcher.address``; never started here) and places
the processes that can live on another node with one placement group: one bundle per trainer
node (``trainer=megatron``: node 0 runs torchrun, nodes 1.. join it) and one per SGLang server
(``engine=sglang``). Ray only places and supervises (``sat_cli.cluster``); the processes, their
argument lists and the torchrun/gloo/NCCL code are the local launcher's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sat_cli.config.checks import ConfigError, check_choice, check_range

LAUNCHERS = ("local", "ray")
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
class LauncherConfig:
    name: str = "local"  # local: this machine's subprocesses; ray: a running Ray cluster
    address: str | None = None  # ray: HOST:PORT of the cluster's head (GCS), e.g. HEAD:6379
    namespace: str = "sat"  # ray: the namespace of sat's actors
    connect_timeout_s: float = 30.0  # ray: reaching the cluster
    placement_timeout_s: float = 300.0  # ray: the placement group's resources becoming free
    call_timeout_s: float = 120.0  # ray: one call to an actor (start or stop a process, ...)
    health_interval_s: float = 2.0  # ray: every actor is pinged this often
    # ray: an actor that has not answered a ping for this long counts as lost with its node
    # (Ray itself declares a node dead after its own health checks; whichever comes first)
    health_timeout_s: float = 20.0
    # ray: placement group strategy over all bundles; null: PACK for one trainer node, SPREAD
    # for several (sat_cli/config/devices.py)
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

    def __post_init__(self) -> None:
        check_choice("launcher.name", self.name, LAUNCHERS)
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
        if self.name == "ray":
            if not self.address:
                raise ConfigError(
                    "launcher=ray needs launcher.address=HOST:PORT, the head node of a running "
                    "Ray cluster (`ray start --head --port=6379` there; sat never starts one)"
                )
            parse_address("launcher.address", self.address)
            if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", self.namespace):
                raise ConfigError(
                    f"launcher.namespace={self.namespace!r}: letters, digits, _ . - only"
                )


def check_placement(launcher: LauncherConfig, trainer_name: str, engine) -> None:
    """launcher=ray must have something to place: Megatron trainer nodes or SGLang servers."""
    if launcher.name != "ray":
        return
    servers = engine.name == "sglang" and not engine.urls  # launched here, so placed
    if trainer_name != "megatron" and not servers:
        raise ConfigError(
            "launcher=ray places trainer=megatron nodes and engine=sglang servers on the cluster; "
            f"with trainer={trainer_name} and engine={engine.name}"
            + (" (engine.urls: servers run elsewhere)" if engine.urls else "")
            + " there is nothing to place: use launcher=local"
        )
    if engine.name == "sglang" and engine.gpu_groups and servers:
        raise ConfigError(
            "engine.gpu_groups pins servers to this machine's GPUs; with launcher=ray each server "
            "gets launcher.server_gpus GPUs from its bundle: drop engine.gpu_groups"
        )
