"""The edge of the device plan (``sat_cli.devices``): the composed config → plain specs → the
plan, its compose-time check (``SatConfig`` calls :func:`check_device_plan`) and the GPU
requests of ``launcher=ray`` checked against it."""

from __future__ import annotations

from sat_cli.validate import ConfigError


def specs(obj):
    """(EngineSpec, TrainerSpec) of a composed config (each option's ``gpu_layout``)."""
    from sat_cli.devices import EngineSpec, TrainerSpec

    e, t, la = obj.engine, obj.trainer, obj.launcher
    engine = EngineSpec(
        name=e.name,
        device=e.device,
        dtype=e.dtype,
        **e.gpu_layout(),
        colocate=e.colocate,
    )
    # Megatron's GPU ranks run on the CPU only when their Ray bundles explicitly ask for none
    cpu = la.places and getattr(la, "trainer_gpus", None) == 0
    trainer = TrainerSpec(name=t.name, **t.gpu_layout(cpu))
    return engine, trainer


def device_plan(obj):
    """The run's ``DevicePlan`` (``DevicePlanError``, exit 2, for an impossible one)."""
    from sat_cli.devices import make_plan

    return make_plan(*specs(obj), placed=type(obj.launcher).places)


def check_device_plan(cfg) -> None:
    """Compose time: the plan can be made, and explicit Ray GPU requests cover it."""
    from sat_cli.devices import DevicePlanError

    try:
        plan = device_plan(cfg)
    except DevicePlanError as exc:
        raise ConfigError(str(exc)) from None
    if plan.colocate and cfg.engine.weight_sync == "distributed":
        # the trainer's sender and the engine's first rank would be two ranks of one NCCL group
        # on one GPU: NCCL refuses that ("invalid usage"; scripts/gpu_check_nccl.py, measured on
        # an H200 with NCCL 2.28.9, bench/README.md)
        raise ConfigError(
            "engine.weight_sync=distributed with engine.colocate=true: the trainer and the engine "
            "share a GPU, and NCCL refuses two ranks of one group on one GPU; use "
            "engine.weight_sync=disk, or give the trainer GPUs of its own (drop engine.colocate)"
        )
    la = cfg.launcher
    if not la.places:
        return
    need = plan.bundle_gpus("engine")
    if la.server_gpus is not None and plan.of("engine") and la.server_gpus < need:
        raise ConfigError(
            f"launcher.server_gpus={la.server_gpus:g} but each SGLang server uses engine.tp × "
            f"engine.dp = {need} GPU(s) (engine.device=cuda): set launcher.server_gpus={need} or "
            "leave it unset (the device plan's count)"
        )
    need = plan.bundle_gpus("trainer")
    if la.trainer_gpus and la.trainer_gpus < need:
        raise ConfigError(
            f"launcher.trainer_gpus={la.trainer_gpus:g} but each trainer node runs "
            f"trainer.nproc_per_node = {need} ranks, one GPU each: set launcher.trainer_gpus="
            f"{need}, leave it unset, or 0 for ranks on the CPU (gloo)"
        )


def ray_gpus(obj) -> tuple[float, float]:
    """(GPUs per trainer-node bundle, GPUs per server bundle): explicit or the plan's."""
    plan, la = device_plan(obj), obj.launcher
    trainer = la.trainer_gpus if la.trainer_gpus is not None else plan.bundle_gpus("trainer")
    server = la.server_gpus if la.server_gpus is not None else plan.bundle_gpus("engine")
    return float(trainer), float(server)


def ray_strategy(obj) -> str:
    """``launcher.strategy``, or from the layout: one trainer node PACK, several SPREAD."""
    t = obj.trainer
    if obj.launcher.strategy is not None:
        return obj.launcher.strategy
    return "SPREAD" if t.gpu_layout()["nnodes"] > 1 else "PACK"
