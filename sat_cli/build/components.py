"""The registered components of a run, built from their own settings (``sat_cli.registry``):
the engine, the trainer, the launcher and their ``env.*`` params."""

from __future__ import annotations

from pathlib import Path

from sat_cli.cluster.registry import LAUNCHERS
from sat_cli.cluster.settings import LauncherRuntime
from sat_cli.engines.registry import ENGINES
from sat_cli.engines.settings import EngineRuntime
from sat_cli.trainers.registry import TRAINERS
from sat_cli.trainers.settings import TrainerRuntime


def build_engine(obj, path: str, logs: Path, *, r3: bool, placer=None):
    from sat_cli.config.devices import device_plan

    e, lag, plan = obj.engine, obj.lag, device_plan(obj)  # the GPUs each process gets
    inflight = (lag.inflight_updates, lag.inflight_cache)
    rt = EngineRuntime(path, logs, obj.seed, r3, *inflight, placer=placer, devices=plan)
    lora = obj.trainer.lora
    if lora.on and lora.sync == "adapter":  # one adapter per version a batch can sample from
        from dataclasses import replace

        from sat_cli.config.additions import ledger_versions

        kept = ledger_versions(True, lag.n, lag.profile) - 1
        rt = replace(rt, adapters_kept=kept, lora=lora.as_dict())
    return ENGINES.of(e).build(e, rt)


def build_trainer(obj, path: str, run_dir: Path, placer=None):
    from sat_cli.build.parts import loss_config
    from sat_cli.config.additions import ledger_versions

    a, own = obj.algo, ("num_minibatches", "replay_sampling_mask", "score_centering_topk")
    options = {k: getattr(a, k) for k in own}  # the step keywords from outside trainer.*
    ledger = ledger_versions(a.ledger, obj.lag.n, obj.lag.profile)
    options.update(temperature=obj.task.temperature, r3=obj.r3, seed=obj.seed, ledger_keep=ledger)
    options["portable_numerics"] = obj.run.portable_numerics
    from sat_cli.config.devices import device_plan

    loss, plan = loss_config(obj), device_plan(obj)  # the GPUs each process gets
    rt = TrainerRuntime(path, run_dir, loss, options, obj.engine, placer, devices=plan)
    return TRAINERS.of(obj.trainer).build(obj.trainer, rt)


def launcher_runtime(obj, log=print, logs=None, *, trainer_nodes: bool = True):
    """What the run asks of a cluster (``trainer_nodes=False``: the engine's servers only)."""
    t, e = obj.trainer, obj.engine
    asked = TRAINERS.of(t).resources(t)
    if not trainer_nodes:
        asked = type(asked)()
    log_path = None if logs is None else logs / "ray.log"
    gpus, strategy = (0.0, 0.0), "PACK"
    if type(obj.launcher).places:  # explicit, or what the device plan needs
        from sat_cli.config.devices import ray_gpus, ray_strategy

        gpus, strategy = ray_gpus(obj), ray_strategy(obj)
    return LauncherRuntime(asked, ENGINES.of(e).resources(e), gpus, strategy, log, log_path)


def build_launcher(obj, log=print, logs=None, *, trainer_nodes: bool = True):
    """A connected launcher that placed the run's processes (``launcher=ray``), or None when it
    has nothing to start (``launcher=local``; ``sat eval`` places engine servers only)."""
    rt = launcher_runtime(obj, log, logs, trainer_nodes=trainer_nodes)
    return LAUNCHERS.of(obj.launcher).build(obj.launcher, rt)


def run_environment(obj) -> dict[str, str]:
    """The run's ``env.*`` params: this process's hardware, libraries and numeric settings
    (``sat_cli.tracking.environment``) and the engine's own (SGLang's version)."""
    from sat_cli.tracking.environment import environment_params

    e = obj.engine
    return {**environment_params(), **ENGINES.of(e).environment(e)}
