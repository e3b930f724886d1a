"""What a :class:`~sat_cli.engines.local.engine.LocalEngine` is built with besides its settings
(``settings.LocalEngineSettings``): plain data, its own module so that the engine does not
import the settings module that builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalEngineRuntime:
    """What a :class:`~sat_cli.engines.local.engine.LocalEngine` is built with besides its
    settings: the model folder, the run's seed and R3, the torch device the device plan gave it
    (``cuda:K``; None: ``engine.device``), its log file (None: none), the version the loaded
    weights carry, and in-flight updates (``inflight_cache``: ``recompute`` or ``keep``,
    ``sat_cli.engines.local.inflight``) and, with LoRA, how many versions' adapters it holds at
    once (``sat_cli.engines.local.adapters``)."""

    model_path: str
    seed: int = 0
    r3: bool = False
    device: str | None = None
    log_file: str | None = None
    weight_version: int = 0
    inflight_updates: bool = False
    inflight_cache: str = "recompute"
    adapters_kept: int = 0  # trainer.lora: adapters held at once (0: every version)
