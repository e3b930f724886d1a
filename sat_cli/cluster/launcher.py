"""``launcher=ray``: place a run's trainer nodes and SGLang servers on a running Ray cluster.

:class:`RayLauncher` (one per ``sat train``):

1. **connects** to ``launcher.address`` (``sat_cli.cluster.ray_env.connect``: never starts a
   cluster; a deadline on the TCP probe and on ``ray.init``);
2. **places**: one placement group (``launcher.strategy``; unset: PACK for one trainer node,
   SPREAD for several) with one bundle per trainer node (``trainer=megatron``) and one per SGLang server, waited for at most
   ``launcher.placement_timeout_s``; an infeasible or busy cluster fails naming what was asked
   and what the cluster has free;
3. **starts one actor per bundle** (:class:`~sat_cli.cluster.hosts.NodeHost`, ``max_restarts=0``:
   ``resume=auto`` is the recovery path, never a silent restart). The actor of trainer node 0
   runs today's torchrun command through its channel, the others today's ``sat worker --join``
   with node 0's address; a server actor runs today's SGLang launch and hands back its URL;
4. **supervises**: a monitor thread pings every actor each ``launcher.health_interval_s``; an
   actor that dies (Ray reports it) or does not answer for ``launcher.health_timeout_s`` makes
   its node *lost*, and a joined trainer node whose process exits counts as failed.
   :meth:`failure` names the node and what ran there; ``MegatronTrainer`` checks it while it
   waits for a reply and a lost server reads as a dead server to the engine's supervisor, so
   the run stops within seconds and ends FAILED;
5. **closes**: every actor killed, the placement group removed, the driver disconnected.

Every Ray call has a deadline (:meth:`call`). Settings come as a plain :class:`RaySettings`
(built at the edge by ``launcher=ray``'s component, ``sat_cli.cluster.settings``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sat_cli.cluster.ray_env import ClusterError

__all__ = ["ClusterError", "RayLauncher", "RaySettings"]


@dataclass(frozen=True)
class RaySettings:
    address: str
    namespace: str = "sat"
    connect_timeout_s: float = 30.0
    placement_timeout_s: float = 300.0
    call_timeout_s: float = 120.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 20.0
    strategy: str = "STRICT_SPREAD"
    trainer_bundle: dict = field(default_factory=lambda: {"CPU": 1.0})
    server_bundle: dict = field(default_factory=lambda: {"CPU": 1.0})


@dataclass
class Placed:
    """One actor in one bundle, and what the health monitor last heard from it."""

    role: str  # "trainer node 0", "trainer node 1", "SGLang server 0", ...
    actor: object
    bundle: int
    node: dict = field(default_factory=dict)
    exit_code: int | None = None
    last_ok: float = field(default_factory=time.monotonic)
    lost: str | None = None  # why the node counts as lost

    def where(self) -> str:
        n = self.node
        if not n:
            return f"{self.role} (bundle {self.bundle})"
        return (
            f"{self.role} on Ray node {n.get('hostname')} ({n.get('ip')}, node id "
            f"{str(n.get('node_id'))[:12]})"
        )


def bundle_text(bundle: dict) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items()))


class RayLauncher:
    """See the module docstring."""

    def __init__(
        self,
        settings: RaySettings,
        *,
        trainer_nodes: int,
        servers: int,
        log=print,
        log_path=None,
    ):
        self.settings = settings
        self.log_path = log_path  # the cluster's error messages (not the console)
        self.trainer_nodes = trainer_nodes
        self.servers = servers
        self.log = log
        self._pg = None
        self._trainers: list[Placed] = []
        self._server_hosts: list[Placed] = []
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._stopping_joins = False
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> RayLauncher:
        from sat_cli.cluster.ray_env import connect

        s = self.settings
        self.ray = connect(s.address, s.connect_timeout_s, s.namespace, log_path=self.log_path)
        try:
            self._check_fits()
            self._place()
            self._start_actors()
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, name="ray-monitor", daemon=True)
        self._monitor.start()
        return self

    def _bundles(self) -> list[dict]:
        s = self.settings
        return [dict(s.trainer_bundle)] * self.trainer_nodes + [dict(s.server_bundle)] * (
            self.servers
        )

    def _check_fits(self) -> None:
        """Refuse, before anything is placed, bundles no live node set can hold."""
        from sat_cli.cluster.ray_env import live_nodes, unmet

        s = self.settings
        why = unmet(self._bundles(), s.strategy, live_nodes(self.ray))
        if why:
            raise ClusterError(
                f"the Ray cluster at {s.address} cannot hold this run's placement: {why}; ask for "
                "less (launcher.trainer_cpus/trainer_gpus/server_cpus/server_gpus, "
                "launcher.strategy) or add nodes"
            )

    def _place(self) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group

        ray, s = self.ray, self.settings
        bundles = self._bundles()
        self._pg = placement_group(bundles, strategy=s.strategy)
        try:
            ray.get(self._pg.ready(), timeout=s.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            self._pg = None
            raise ClusterError(self._infeasible(bundles)) from None
        self.log(
            f"ray: placement group of {len(bundles)} bundle(s) ({s.strategy}) ready on {s.address}"
        )

    def _infeasible(self, bundles: list[dict]) -> str:
        ray, s = self.ray, self.settings
        try:
            total = ray.cluster_resources()
            free = ray.available_resources()
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception as exc:  # noqa: BLE001 - only for the message
            total, free, nodes = {}, {}, []
            extra = f" (cluster state unreadable: {exc})"
        else:
            extra = ""

        def show(res: dict) -> str:
            keys = sorted(k for k in res if not k.startswith(("node:", "object_store", "memory")))
            return ", ".join(f"{k}: {res[k]:g}" for k in keys) or "nothing"

        asked = "; ".join(f"[{bundle_text(b)}]" for b in bundles)
        return (
            f"the Ray cluster at {s.address} could not place this run within "
            f"launcher.placement_timeout_s={s.placement_timeout_s:g} s: it needs {len(bundles)} "
            f"bundle(s) {asked} ({s.strategy}: "
            + ("each on its own node" if s.strategy == "STRICT_SPREAD" else "as the strategy says")
            + f"); the cluster has {len(nodes)} live node(s) with {show(total)} in all and "
            f"{show(free)} free{extra}. Add nodes or resources, wait for other jobs, or ask for "
            "less (launcher.trainer_cpus/trainer_gpus/server_cpus/server_gpus, "
            "launcher.strategy)"
        )

    def _start_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from sat_cli.cluster.hosts import NodeHost
        from sat_cli.cluster.ray_env import runtime_env

        ray = self.ray
        remote = ray.remote(NodeHost)
        env = runtime_env(self.log, "trainer and server actors")
        roles = [f"trainer node {k}" for k in range(self.trainer_nodes)]
        roles += [f"SGLang server {i}" for i in range(self.servers)]
        for i, (role, bundle) in enumerate(zip(roles, self._bundles(), strict=True)):
            opts = dict(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=8,  # a ping never waits behind a long recv or wait_ready
                runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
            )
            placed = Placed(role, remote.options(**opts).remote(role), i)
            (self._trainers if role.startswith("trainer") else self._server_hosts).append(placed)
        for placed in self._trainers + self._server_hosts:
            placed.node = self.call(placed, placed.actor.node.remote(), "start-up")
            self.log(f"ray: {placed.where()}")

    # -- calls ----------------------------------------------------------------------------------
    def call(self, placed: Placed, ref, what: str, timeout: float | None = None, error=None):
        """``ray.get(ref)`` within ``timeout`` (default ``launcher.call_timeout_s``). A dead
        actor marks its node lost and raises :class:`ClusterError` naming it; an exception
        raised inside the actor is re-raised as itself, or as ``error`` with its message."""
        ray = self.ray
        timeout = self.settings.call_timeout_s if timeout is None else timeout
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"{placed.where()} did not answer ({what}) within {timeout:.0f} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            reason = self._mark_lost(placed, f"its actor died ({type(exc).__name__})")
            raise ClusterError(reason) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else None
            if error is not None:
                raise error(str(cause) if cause else str(exc)) from None
            if cause is not None:
                raise cause from None
            raise ClusterError(f"{placed.where()} failed ({what}): {exc}") from None

    def _mark_lost(self, placed: Placed, why: str) -> str:
        with self._lock:
            if placed.lost is None:
                placed.lost = f"{placed.where()} was lost: {why}"
            if self._failure is None:
                self._failure = placed.lost
            return placed.lost

    def lost(self, placed: Placed) -> str | None:
        with self._lock:
            return placed.lost

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the run cannot go on (a lost node, a joined trainer node that exited), or None.
        ``wait_s``: give the health monitor that long to find one (a collective that failed
        because a peer vanished is the symptom; the lost node is the cause to report)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self._failure is not None or time.monotonic() >= deadline:
                    return self._failure
            time.sleep(0.1)

    @property
    def settle_s(self) -> float:
        """How long a failed process waits for the monitor to name a lost node."""
        return self.settings.health_timeout_s + self.settings.health_interval_s

    # -- supervision ----------------------------------------------------------------------------
    def _watch(self) -> None:
        ray, s = self.ray, self.settings
        while not self._stop.wait(s.health_interval_s):
            placed_all = [p for p in self._trainers + self._server_hosts if p.lost is None]
            refs = {p.actor.ping.remote(): p for p in placed_all}
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=s.health_interval_s)
            now = time.monotonic()
            for ref in ready:
                p = refs[ref]
                try:
                    p.exit_code = ray.get(ref, timeout=0)["exit"]
                    p.last_ok = now
                except ray.exceptions.RayActorError as exc:
                    self._mark_lost(p, f"its actor died ({type(exc).__name__})")
                except Exception as exc:  # noqa: BLE001 - a ping that failed counts as missed
                    self.log(f"ray: ping of {p.role} failed: {exc}")
            for p in placed_all:
                if p.lost is None and now - p.last_ok > s.health_timeout_s:
                    self._mark_lost(
                        p,
                        f"no answer to health pings for {now - p.last_ok:.0f} s (its node "
                        "may be down or cut off)",
                    )
                joined = p.role.startswith("trainer node") and p.role != "trainer node 0"
                if joined and p.exit_code is not None and not self._stopping_joins:
                    with self._lock:
                        if self._failure is None:
                            self._failure = (
                                f"{p.where()}: `sat worker --join` exited with code "
                                f"{p.exit_code} (log: its megatron_node log in the run's logs/)"
                            )

    # -- trainer nodes (MegatronTrainer's placer interface) -------------------------------------
    def trainer_python(self) -> str:
        return self._trainers[0].node["python"]

    def trainer_endpoint(self, requested: str | None, nnodes: int = 1) -> str:
        """node 0's address and a port: ``trainer.master_port`` when set; on one node 0 (the OS
        picks it at torchrun's bind: a port picked beforehand can be taken before the bind);
        else a port free there now (the other nodes need it before node 0 binds it)."""
        node0 = self._trainers[0]
        ip = node0.node["ip"]
        port = requested.rpartition(":")[2] if requested else None
        if not port:
            port = (
                0
                if nnodes == 1
                else self.call(node0, node0.actor.free_port.remote(ip), "a free port")
            )
        return f"{ip}:{port}"

    def trainer_channel(self, command, env, **channel_args):
        from sat_cli.cluster.remote import RemoteChannel

        args = {k: (str(v) if k in ("log_path", "fifo") else v) for k, v in channel_args.items()}
        args["cleanup"] = [str(p) for p in args.get("cleanup", [])]
        return RemoteChannel(self, self._trainers[0], list(command), dict(env), **args)

    def join_trainer_nodes(self, endpoint: str, config_path, wait_s: float) -> None:
        """Start ``sat worker --join`` on trainer nodes 1.. (each waits for the rendezvous)."""
        from pathlib import Path

        logs = Path(config_path).resolve().parent.parent / "logs"
        for k, placed in enumerate(self._trainers[1:], start=1):
            command = [placed.node["python"], "-m", "sat_cli.cli", "worker", "--join", endpoint]
            command += ["--config", str(config_path), "--node-rank", str(k)]
            command += ["--wait", f"{wait_s:g}"]
            log_path = str(logs / f"megatron_node{k}.log")
            self.call(placed, placed.actor.start_join.remote(command, log_path), "start the join")

    def stop_trainer_nodes(self) -> None:
        """End the joined nodes: they end with node 0 (a grace of 30 s), at once after a failure."""
        self._stopping_joins = True
        grace = 0.0 if self.failure() is not None else 30.0
        for placed in self._trainers[1:]:
            if placed.lost is None:
                try:
                    self.call(placed, placed.actor.stop_join.remote(grace), "stop the join", 60.0)
                except ClusterError:
                    pass

    # -- SGLang servers -------------------------------------------------------------------------
    def place_servers(self, servers) -> list:
        from sat_cli.cluster.remote import RemoteServer

        if len(servers) != len(self._server_hosts):
            raise ValueError(f"{len(servers)} servers for {len(self._server_hosts)} bundles")
        for server in servers:  # an actor's working folder is not ours: absolute paths only
            server.absolute_paths()
        return [
            RemoteServer(self, placed, server)
            for placed, server in zip(self._server_hosts, servers, strict=True)
        ]

    # -- end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every actor (their guards end the processes), remove the placement group."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.settings.health_interval_s + 5)
        ray = getattr(self, "ray", None)
        if ray is None:
            return
        for placed in self._trainers + self._server_hosts:
            try:
                ray.kill(placed.actor, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001, S110 - the cluster may be gone
                pass
            self._pg = None
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001, S110
            pass
