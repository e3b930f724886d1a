"""Pieces the `sat train` and `sat eval` commands share: loading models, the pids file and the
check that a CUDA device is there."""

from __future__ import annotations

import os
from pathlib import Path

from sat_cli.errors import TrainerError, UserError, resource_error


def loading(path: str, build):
    """Build a trainer/engine. A model the engine could not load (``EngineStartError``) or a
    library error while building in this process is the user's input: ``UserError`` "cannot load
    the model". A trainer or engine that failed otherwise (``TrainerError``, e.g. a Megatron
    worker that died at start-up, or ``EngineError``) is a runtime fault and passes through."""
    from sat_cli.engines.base import EngineError, EngineStartError

    try:
        return build()
    except EngineStartError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise UserError(f"cannot load the model at {path}: {lines[-1][:500]}") from None
    except (TrainerError, EngineError):
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        if resource_error(exc) is not None:  # memory ran out: not the model's fault (exit 1)
            raise resource_error(exc) from None
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        raise UserError(f"cannot load the model at {path}: {type(exc).__name__}: {first}") from None


def write_pids(logs: Path, engine) -> None:
    """``logs/pids.json``: this process and the engine's process (fault tests, soak runs)."""
    import json

    from sat_cli.util.fsio import atomic_write_text

    pids = {"orchestrator": os.getpid(), "engine": getattr(engine, "pid", None)}
    atomic_write_text(logs / "pids.json", json.dumps(pids))


def _node_plan(obj, trainer: bool):
    """The device plan of the processes this command starts on this machine."""
    from dataclasses import replace

    from sat_cli.config.devices import device_plan, specs
    from sat_cli.devices import DevicePlan, TrainerSpec, make_plan

    if type(obj.launcher).places:
        return DevicePlan(())  # Ray places the processes on its nodes
    if trainer:
        return device_plan(obj)
    return make_plan(replace(specs(obj)[0], colocate=False), TrainerSpec())  # the engine alone


def check_devices(obj, *, trainer: bool = True) -> None:
    """``engine.device=cuda`` / ``trainer.device=cuda`` of the local engine and trainer: a CUDA
    device must be visible now, with bf16 where a dtype asks for it; the device plan's node 0
    must fit this machine's GPUs (``sat_cli.devices``); an engine started here must be able to
    run on this CPU (its settings' ``check_host``); else ``UserError`` (one line, exit 2),
    raised before anything is written or started. ``trainer``: whether the
    command trains (``sat eval`` runs the engine only)."""
    if not type(obj.launcher).places:  # its processes start here: this CPU can run them
        obj.engine.check_host()
    wanted = []
    if type(obj.engine).TORCH_HERE and obj.engine.device == "cuda":
        wanted.append(("engine", obj.engine.dtype))
    if trainer and obj.trainer.on_gpu():
        wanted.append(("trainer", obj.trainer.dtype))
    plan = _node_plan(obj, trainer)
    if not wanted and not plan.needed():
        return
    import torch

    if torch.cuda.is_available():  # the machine's GPUs hold the plan's node 0 (exit 2 if not)
        count = torch.cuda.device_count()
        plan.check(count, f"torch sees {count} GPU(s) on this machine")
    if not wanted:
        return  # Megatron ranks take the CPU (gloo) where no GPU is visible
    keys = " and ".join(f"{who}.device=cuda" for who, _ in wanted)
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise UserError(
            f"{keys}: no CUDA GPU is visible to torch {torch.__version__} ({build}); run on a "
            "machine with a GPU or set the device to cpu"
        )
    try:
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # an older torch without the keyword
        bf16 = torch.cuda.is_bf16_supported()
    for who, dtype in wanted:
        if dtype == "bfloat16" and not bf16:
            raise UserError(
                f"{who}.dtype=bfloat16: the GPU {torch.cuda.get_device_name(0)} has no native "
                f"bf16; use {who}.dtype=float32"
            )
