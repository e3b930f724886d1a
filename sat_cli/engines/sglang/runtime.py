"""What the SGLang engine and its processes are built with besides their settings
(``settings.SGLangEngineSettings``): :class:`SGLangRuntime` (the engine), :class:`ServerRuntime`
(one server), :class:`ProcessLaunch` (how one SGLang process runs). Plain data, its own module
so that the engine does not import the settings module that builds it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ProcessLaunch:
    """How one SGLang process runs (``server.SGLangProcess``): its log file, the SGLang
    interpreter (or a launch prefix ending in one, which wins), the device (``cpu`` runs it
    through ``cpu_launch.py``), extra arguments, the port (None: a free one), extra environment
    and how long it may take to answer its health check."""

    log_path: Path
    python: str = "python"
    launch_prefix: tuple[str, ...] | list[str] = ()
    device: str = "cuda"
    extra_args: tuple[str, ...] | list[str] = ()
    port: int | None = None
    env: dict[str, str] | None = None
    startup_timeout_s: float = 120.0

    @classmethod
    def of(cls, s, log_path, python="python", env=None, port=None):
        """A server's: the launch prefix, device, extra arguments and timeout of its settings
        ``s`` (``settings.SGLangEngineSettings``)."""
        launch = (s.launch_prefix, s.device, s.extra_args)
        return cls(Path(log_path), python, *launch, port, env, s.startup_timeout_s)


@dataclass(frozen=True)
class ServerRuntime:
    """What one ``server.SGLangServer`` is launched with besides the settings: the model, its
    log file, the SGLang interpreter, its environment (``CUDA_VISIBLE_DEVICES``) and port (None:
    a free one), the version it reports at start (None: no ``--weight-version``), R3 and the
    memory fraction the device plan gives it (None: ``engine.mem_fraction_static``)."""

    model_path: str
    log_path: Path
    python: str = "python"
    env: dict[str, str] | None = None
    port: int | None = None
    weight_version: int | None = 0
    r3: bool = False
    mem_fraction_static: float | None = None
    lora_args: tuple[str, ...] = ()  # trainer.lora: the server's LoRA flags (lora.py)


@dataclass(frozen=True)
class SGLangRuntime:
    """What an ``engine.SGLangEngine`` is built with besides its settings: the model, R3 (and
    its MoE dims, ``routes.MoEDims``; None: read from config.json), the version the servers
    start at, in-flight updates (``inflight_cache``: recompute or keep); the servers to launch
    (``SGLangEngine.launch``: the SGLang interpreter, log folder, ``CUDA_VISIBLE_DEVICES`` per
    server, the planned memory fraction, the launcher that places them) or already built
    (``servers``, ``router``; else ``engine.urls``); the client's retries and the watchdog's
    period; the disk weight path (None: ``weights.DiskWeightSync``); with LoRA the servers'
    LoRA flags and how many versions' adapters they hold (``lora.py``)."""

    model_path: str
    r3: bool = False
    moe: Any = None
    initial_version: int = 0
    inflight_updates: bool = False
    inflight_cache: str = "recompute"
    python: str = "python"
    log_dir: Path = Path("logs")
    gpu_groups: tuple[str, ...] | None = None
    mem_fraction_static: float | None = None
    placer: Any = None
    servers: tuple = ()
    router: Any = None
    retries: int = 3
    backoff_s: float = 0.5
    watchdog_s: float = 0.5
    weight_sync: Any = None
    lora_args: tuple[str, ...] = ()
    adapters_kept: int = 0
