"""The ``engine`` section of the config (``conf/engine/*.yaml``): the local engine and SGLang."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sat_cli.config.checks import ConfigError, check_choice, check_range

ENGINES = ("local", "sglang")
ENGINE_DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
WEIGHT_SYNC = ("disk", "distributed")  # how a weight version reaches the engine (issue 28)
VERIFY_WEIGHTS = ("first", "every", "off")


@dataclass
class EngineConfig:
    name: str = "local"
    dtype: str = "float32"  # bfloat16 reproduces engine/trainer numeric mismatch on CPU
    device: str = "cpu"  # local: torch device (cuda: one GPU); sglang: cuda or cpu (sglang.md)
    num_threads: int = 1  # torch threads of the local engine process
    # sglang: the interpreter of the SGLang environment; auto = $SAT_SGLANG_PYTHON, else
    # .venv-sglang/bin/python of the current folder or of the sat checkout (`make sglang-cpu`)
    python: str = "auto"
    launch_prefix: list[str] = field(default_factory=list)  # sglang: full launch command prefix
    num_servers: int = 1  # sglang: servers launched (one per gpu_groups entry when given)
    urls: list[str] = field(default_factory=list)  # sglang: servers started elsewhere (no launch)
    tp: int = 1
    dp: int = 1
    ep: int = 1
    gpu_groups: list[str] = field(
        default_factory=list
    )  # sglang: one server per group, e.g. ["0,1", "2,3"]
    use_router: bool | None = None  # sglang: sglang-router in front; null = when num_servers > 1
    mem_fraction_static: float | None = None
    # the engine shares its GPUs with the trainer (docs/gpus.md); SGLang then takes
    # mem_fraction_static of each (sat_cli.devices.COLOCATE_MEM_FRACTION when null)
    colocate: bool = False
    max_total_tokens: int | None = None  # sglang: KV pool size in tokens (cpu: 4096 when null)
    # sglang: --enable-deterministic-inference, so sampling seeds are honoured; null = on for
    # cuda, off for cpu (SGLang's deterministic mode needs a GPU attention backend)
    deterministic: bool | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    concurrency: int = 64
    max_batch_size: int = 64  # sglang: prompts x samples per /generate request
    request_timeout_s: float = 600.0
    restart_on_failure: bool = False
    # weight versions: through the disk (an HF folder per version) or broadcast from the trainer
    # (gloo on CPU, nccl on GPU); the served weights' checksums are checked against what was
    # sent after the first load of each path (first), every load (every) or never (off)
    weight_sync: str = "disk"
    weight_sync_bucket_mb: int = 512  # bytes per broadcast (SGLang's flattened bucket)
    weight_sync_timeout_s: float = 120.0  # every collective wait of a sync (then: from disk)
    weight_sync_port: int = 0  # the group's port on the trainer's side; 0 = a free one
    weight_sync_master_addr: str = "127.0.0.1"  # the trainer's address as the engine reaches it
    verify_weights: str = "first"

    def __post_init__(self) -> None:
        check_choice("engine.name", self.name, ENGINES)
        check_choice("engine.dtype", self.dtype, DTYPES)
        check_choice("engine.device", self.device, ENGINE_DEVICES)
        for k in ("num_threads", "tp", "dp", "ep", "num_servers", "concurrency", "max_batch_size"):
            check_range(f"engine.{k}", getattr(self, k), 1)
        if self.mem_fraction_static is not None:
            check_range("engine.mem_fraction_static", self.mem_fraction_static, 0, 1, lo_open=True)
        if self.max_total_tokens is not None:
            check_range("engine.max_total_tokens", self.max_total_tokens, 1)
        check_range("engine.startup_timeout_s", self.startup_timeout_s, 0, lo_open=True)
        check_choice("engine.weight_sync", self.weight_sync, WEIGHT_SYNC)
        check_choice("engine.verify_weights", self.verify_weights, VERIFY_WEIGHTS)
        check_range("engine.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 1)
        check_range("engine.weight_sync_timeout_s", self.weight_sync_timeout_s, 0, lo_open=True)
        check_range("engine.weight_sync_port", self.weight_sync_port, 0, 65535)
        if self.name == "sglang":
            self._check_sglang()

    def _check_sglang(self) -> None:
        if self.device == "cpu":
            if self.dtype != "bfloat16":
                raise ConfigError(
                    f"engine=sglang engine.device=cpu needs engine.dtype=bfloat16, got "
                    f"{self.dtype}: SGLang's CPU kernels have no float32 RMSNorm (the server "
                    "dies in warm-up)"
                )
            if self.deterministic:
                raise ConfigError(
                    "engine.deterministic=true is not possible with engine.device=cpu: SGLang's "
                    "deterministic inference needs a GPU attention backend (flashinfer, fa3, "
                    "triton); leave it null (samples are then not reproducible, see "
                    "docs/sglang.md)"
                )
            if self.gpu_groups:
                raise ConfigError("engine.gpu_groups needs engine.device=cuda")
        if self.gpu_groups and self.num_servers not in (1, len(self.gpu_groups)):
            raise ConfigError(
                f"engine.num_servers={self.num_servers} but engine.gpu_groups has "
                f"{len(self.gpu_groups)} groups (one server per group)"
            )
        self._check_weight_sync()
        if self.urls:
            if self.num_servers != 1 or self.gpu_groups or self.use_router:
                raise ConfigError(
                    "engine.urls names servers started elsewhere: leave engine.num_servers, "
                    "engine.gpu_groups and engine.use_router unset"
                )
            for url in self.urls:
                if not re.fullmatch(r"http://[A-Za-z0-9.\-\[\]:]+:\d{1,5}", url):
                    raise ConfigError(f"engine.urls: {url!r} is not http://host:port")

    def _check_weight_sync(self) -> None:
        """SGLang: ``/init_weights_update_group`` refuses data-parallel servers; checksums are
        compared per tensor of one-rank servers (a tp/ep server reports its rank shards)."""
        if self.weight_sync == "distributed" and self.dp > 1:
            raise ConfigError(
                f"engine.weight_sync=distributed with engine.dp={self.dp}: SGLang 0.5.23 "
                "updates weights from a process group only without data-parallel replicas "
                "(launch one server per replica instead: engine.num_servers)"
            )
        if self.verify_weights != "off" and self.tp * self.ep > 1:
            raise ConfigError(
                f"engine.verify_weights={self.verify_weights} with engine.tp={self.tp} "
                f"engine.ep={self.ep}: SGLang reports a checksum per rank shard, and sat "
                "compares whole tensors of one-rank servers; set engine.verify_weights=off "
                '(docs/sglang.md "Weight sync")'
            )

    @property
    def servers(self) -> int:
        """SGLang servers to launch (0 with engine.urls)."""
        return 0 if self.urls else max(self.num_servers, len(self.gpu_groups))

    @property
    def router(self) -> bool:
        return self.servers > 1 if self.use_router is None else bool(self.use_router)

    @property
    def seeded(self) -> bool:
        """Whether SGLang honours sampling seeds (deterministic inference on)."""
        return self.device == "cuda" if self.deterministic is None else bool(self.deterministic)


def check_weight_sync(cfg) -> None:
    """Rules of ``engine.weight_sync`` across sections (``SatConfig`` calls it)."""
    e, t = cfg.engine, cfg.trainer
    if e.weight_sync != "distributed":
        return
    if e.name == "local" and cfg.lag.inflight_updates:
        raise ConfigError(
            "engine.weight_sync=distributed with lag.inflight_updates=true: the local engine "
            "takes in-flight updates (mid-generation) from disk only; use engine.weight_sync=disk"
        )
    if e.device == "cuda" and t.name == "local" and t.device != "cuda":
        raise ConfigError(
            "engine.weight_sync=distributed with engine.device=cuda broadcasts over NCCL, which "
            f"needs the trainer's weights on a GPU: trainer.device={t.device}; set "
            "trainer.device=cuda or engine.weight_sync=disk"
        )
