"""The edge of ``launcher=ray``: the config's ``launcher`` section → a started ``RayLauncher``.

``launcher=local`` (the default) gives None: the trainer and the engine start their processes
on this machine as always. With ``launcher=ray`` the trainer nodes (``trainer=megatron``, one
bundle per node of ``trainer.nnodes``) and the SGLang servers (``engine=sglang`` without
``engine.urls``, one bundle per server) are placed on the cluster (``sat_cli.cluster.launcher``).
"""

from __future__ import annotations


def bundles(obj) -> tuple[int, dict[str, float], int, dict[str, float]]:
    """(trainer nodes, trainer bundle, servers, server bundle) that ``launcher=ray`` places; GPU
    counts are the launcher's or, unset, the device plan's (``sat_cli.config.devices``)."""
    from sat_cli.config.devices import ray_gpus

    la, t, e = obj.launcher, obj.trainer, obj.engine
    trainer_gpus, server_gpus = ray_gpus(obj)
    nodes = t.nnodes if t.name == "megatron" else 0
    servers = e.num_servers if e.name == "sglang" and not e.urls else 0
    cpus = la.trainer_cpus if la.trainer_cpus is not None else float(t.nproc_per_node or 1)
    trainer = {"CPU": cpus, "GPU": trainer_gpus, **la.trainer_resources}
    server = {"CPU": la.server_cpus, "GPU": server_gpus, **la.server_resources}
    return (
        nodes,
        {k: float(v) for k, v in trainer.items() if v},
        servers,
        {k: float(v) for k, v in server.items() if v},
    )


def placement_text(obj) -> str:
    """One line for `sat plan`: what ``launcher=ray`` would ask the cluster for."""
    from sat_cli.cluster.launcher import bundle_text
    from sat_cli.config.devices import ray_strategy

    nodes, trainer, servers, server = bundles(obj)
    parts = []
    if nodes:
        parts.append(f"{nodes} trainer node bundle(s) [{bundle_text(trainer)}]")
    if servers:
        parts.append(f"{servers} SGLang server bundle(s) [{bundle_text(server)}]")
    return (
        f"launcher: ray at {obj.launcher.address}, one placement group ({ray_strategy(obj)}): "
        + " + ".join(parts)
    )


def build_launcher(obj, log=print, logs=None, *, trainer_nodes: bool = True):
    """A connected, placed ``RayLauncher`` for ``launcher=ray``; None for ``launcher=local`` (or
    when nothing is to be placed: ``sat eval`` places SGLang servers only,
    ``trainer_nodes=False``)."""
    if obj.launcher.name != "ray":
        return None
    from dataclasses import fields

    from sat_cli.cluster.launcher import RayLauncher, RaySettings
    from sat_cli.config.devices import ray_strategy

    la = obj.launcher
    nodes, trainer, servers, server = bundles(obj)
    nodes = nodes if trainer_nodes else 0
    if not nodes and not servers:
        return None
    # every setting but the two bundles is the launcher config's key of the same name
    placed = ("trainer_bundle", "server_bundle", "strategy")
    same = {f.name: getattr(la, f.name) for f in fields(RaySettings) if f.name not in placed}
    settings = RaySettings(
        **same, trainer_bundle=trainer, server_bundle=server, strategy=ray_strategy(obj)
    )
    log_path = None if logs is None else logs / "ray.log"
    return RayLauncher(
        settings, trainer_nodes=nodes, servers=servers, log=log, log_path=log_path
    ).start()
