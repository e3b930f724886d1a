"""What every engine's settings have (``engine.*`` of any option), and the run-level values an
engine is built with (:class:`EngineRuntime`). Torch-free: the config composes without torch.

Each engine option has its own subclass in its package (``engines/local/settings.py``,
``engines/sglang/settings.py``), registered as the structured config of ``conf/engine/<name>.yaml``
(``sat_cli/engines/registry.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sat_cli.validate import check_choice, check_range

ENGINE_DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
WEIGHT_SYNC = ("disk", "distributed")  # how a weight version reaches the engine (issue 28)
VERIFY_WEIGHTS = ("first", "every", "off")


@dataclass
class EngineSettings:
    name: str = "local"
    # null: bfloat16 on cuda, float32 on the CPU (resolved at compose time); bfloat16 on the CPU
    # reproduces the engine/trainer numeric mismatch of real stacks
    dtype: str | None = None
    device: str = "cpu"  # local: torch device (cuda: one GPU); sglang: cuda or cpu (sglang.md)
    # the engine shares its GPUs with the trainer (docs/gpus.md); SGLang then takes
    # mem_fraction_static of each (sat_cli.devices.COLOCATE_MEM_FRACTION when null)
    colocate: bool = False
    # weight versions: through the disk (an HF folder per version) or broadcast from the trainer
    # (gloo on CPU, nccl on GPU); the served weights' checksums are checked against what was
    # sent after the first load of each path (first), every load (every) or never (off)
    weight_sync: str = "disk"
    weight_sync_bucket_mb: int = 512  # bytes per broadcast (SGLang's flattened bucket)
    weight_sync_timeout_s: float = 120.0  # every collective wait of a sync (then: from disk)
    weight_sync_port: int = 0  # the group's port on the trainer's side; 0 = a free one
    weight_sync_master_addr: str = "127.0.0.1"  # the trainer's address as the engine reaches it
    verify_weights: str = "first"

    PINS_NUMERICS: ClassVar[bool] = False  # run.portable_numerics pins its CPU code paths
    TORCH_HERE: ClassVar[bool] = False  # its model runs under this machine's torch (device check)

    def __post_init__(self) -> None:
        if self.dtype is None:  # the GPU default a GPU user expects; the CPU run's unchanged
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        check_choice("engine.dtype", self.dtype, DTYPES)
        check_choice("engine.device", self.device, ENGINE_DEVICES)
        check_choice("engine.weight_sync", self.weight_sync, WEIGHT_SYNC)
        check_choice("engine.verify_weights", self.verify_weights, VERIFY_WEIGHTS)
        check_range("engine.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 1)
        check_range("engine.weight_sync_timeout_s", self.weight_sync_timeout_s, 0, lo_open=True)
        check_range("engine.weight_sync_port", self.weight_sync_port, 0, 65535)

    def check_host(self) -> None:
        """Refuse (``UserError``) when this machine cannot run the processes it would start
        here (called before anything is written or started; not when a launcher places them on
        other machines). Default: no rule."""

    def plan_lines(self, procs, params: int | None) -> list[str]:
        """Its lines of ``sat plan`` (``procs``: its processes of the device plan, ``params``:
        the model's parameter count when known)."""
        where = "GPU" if any(p.gpus for p in procs) else "CPU"
        return [f"engines   {self.name}: {len(procs)} process(es) on the {where}, {self.dtype}"]

    def gpu_layout(self) -> dict:
        """Its processes for the device plan (``sat_cli.devices.EngineSpec``): one, on this
        machine, named ``<name> engine``."""
        return {
            "servers": 1,
            "tp": 1,
            "dp": 1,
            "ep": 1,
            "gpu_groups": (),
            "mem_fraction": None,
            "label": f"{self.name} engine",
            "detail": "in its own process",
        }


@dataclass(frozen=True)
class EngineRuntime:
    """What an engine is built with besides its settings: the model, the run, the lag policy's
    in-flight updates, the launcher that places its processes (None: this machine) and the
    run's device plan (``sat_cli.devices.DevicePlan``: the GPUs each process gets)."""

    model_path: str
    logs: Path
    seed: int
    r3: bool = False
    inflight_updates: bool = False
    inflight_cache: str = "recompute"
    placer: Any = None
    devices: Any = None
    adapters_kept: int = 0  # trainer.lora: the versions a run can still sample from (0: off)
    lora: dict | None = None  # trainer.lora: {rank, alpha, dropout, target_modules} (None: off)

    def inflight(self) -> dict:
        """The engines' in-flight keywords (none when updates wait for the request's end)."""
        if not self.inflight_updates:
            return {}
        return {"inflight_updates": True, "inflight_cache": self.inflight_cache}
