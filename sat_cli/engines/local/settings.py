"""``engine=local``: the settings of the local engine (a HF model in its own process) and how
they become a :class:`~sat_cli.engines.local.engine.LocalEngine` (torch imported only there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sat_cli.engines.local.runtime import LocalEngineRuntime
from sat_cli.engines.settings import EngineRuntime, EngineSettings
from sat_cli.validate import ConfigError, check_range


@dataclass
class LocalEngineSettings(EngineSettings):
    name: str = "local"
    num_threads: int = 1  # torch threads of the local engine process

    PINS_NUMERICS: ClassVar[bool] = True
    TORCH_HERE: ClassVar[bool] = True
    # trainer.lora: it holds one adapter per weight version (engines/local/adapters.py)
    LORA_ADAPTERS: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("engine.num_threads", self.num_threads, 1)

    def gpu_layout(self) -> dict:
        return {**super().gpu_layout(), "detail": "HF generate in its own process"}

    def plan_lines(self, procs, params: int | None) -> list[str]:
        where = "GPU" if any(p.gpus for p in procs) else "CPU"
        return [
            f"engines   local: one engine process on the {where} ({procs[0].device}, {self.dtype})"
        ]


def build(s: LocalEngineSettings, rt: EngineRuntime):
    from sat_cli.engines.local.engine import LocalEngine

    return LocalEngine(
        s,
        LocalEngineRuntime(
            rt.model_path,
            seed=rt.seed,
            r3=rt.r3,
            device=rt.devices.find("local engine").device,  # cuda:K of the device plan
            log_file=str(rt.logs / "engine.log"),
            adapters_kept=rt.adapters_kept,
            **rt.inflight(),
        ),
    )


def check(run) -> None:
    """The local engine's rules across sections (``run``: the typed config)."""
    if run.engine.weight_sync == "distributed" and run.lag.inflight_updates:
        raise ConfigError(
            "engine.weight_sync=distributed with lag.inflight_updates=true: the local engine "
            "takes in-flight updates (mid-generation) from disk only; use engine.weight_sync=disk"
        )
