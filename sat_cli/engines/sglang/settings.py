"""``engine=sglang``: the settings of SGLang servers launched as subprocesses (or reached at
``engine.urls``), their rules, and how they become an
:class:`~sat_cli.engines.sglang.engine.SGLangEngine`. Torch-free; the engine is imported in
:func:`build` only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import ClassVar

from sat_cli.engines.settings import EngineRuntime, EngineSettings
from sat_cli.engines.sglang.runtime import SGLangRuntime
from sat_cli.registry import Resources
from sat_cli.validate import ConfigError, check_range

# the instruction sets of x86-64-v4, which SGLang's CPU kernel is compiled for (its
# CMakeLists: -march=x86-64-v4 plus AVX512-BF16, VNNI and AMX, used only where present)
X86_64_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass
class SGLangEngineSettings(EngineSettings):
    # trainer.lora: one adapter per version through /load_lora_adapter (lora.py)
    LORA_ADAPTERS: ClassVar[bool] = True
    LORA_EVAL: ClassVar[bool] = False  # sat eval's servers start without the LoRA flags
    name: str = "sglang"
    dtype: str = "bfloat16"
    device: str = "cuda"
    # the interpreter of the SGLang environment; auto = $SAT_SGLANG_PYTHON, else
    # .venv-sglang/bin/python of the current folder or of the sat checkout (`make sglang-cpu`)
    python: str = "auto"
    launch_prefix: list[str] = field(default_factory=list)  # full launch command prefix
    num_servers: int = 1  # servers launched (one per gpu_groups entry when given)
    urls: list[str] = field(default_factory=list)  # servers started elsewhere (no launch)
    tp: int = 1
    dp: int = 1
    ep: int = 1
    gpu_groups: list[str] = field(default_factory=list)  # one server per group: ["0,1", "2,3"]
    use_router: bool | None = None  # sglang-router in front; null = when num_servers > 1
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None  # KV pool size in tokens (cpu: 4096 when null)
    # --enable-deterministic-inference, so sampling seeds are honoured; null = on for cuda, off
    # for cpu (SGLang's deterministic mode needs a GPU attention backend)
    deterministic: bool | None = None
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    concurrency: int = 64
    max_batch_size: int = 64  # prompts x samples per /generate request
    request_timeout_s: float = 600.0
    restart_on_failure: bool = False

    def lora_refusal(self) -> str | None:
        """Why ``trainer.lora`` cannot run on these servers (None: it can): the adapters are
        loaded into one server sat launches (a router's forwarding of per-entry ``lora_path``
        and a restarted server's lost adapters are not handled)."""
        if self.urls:
            return "engine.urls (servers started elsewhere would need --enable-lora)"
        if self.servers > 1 or self.dp > 1:
            return f"engine.num_servers={self.servers}, engine.dp={self.dp} (one server, dp 1)"
        if self.restart_on_failure:
            return "engine.restart_on_failure=true (a restarted server has lost its adapters)"
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        for k in ("tp", "dp", "ep", "num_servers", "concurrency", "max_batch_size"):
            check_range(f"engine.{k}", getattr(self, k), 1)
        if self.mem_fraction_static is not None:
            check_range("engine.mem_fraction_static", self.mem_fraction_static, 0, 1, lo_open=True)
        if self.max_total_tokens is not None:
            check_range("engine.max_total_tokens", self.max_total_tokens, 1)
        check_range("engine.startup_timeout_s", self.startup_timeout_s, 0, lo_open=True)
        if self.device == "cpu":
            self.check_cpu()
        if self.gpu_groups and self.num_servers not in (1, len(self.gpu_groups)):
            raise ConfigError(
                f"engine.num_servers={self.num_servers} but engine.gpu_groups has "
                f"{len(self.gpu_groups)} groups (one server per group)"
            )
        self.check_weight_sync()
        if self.urls:
            if self.num_servers != 1 or self.gpu_groups or self.use_router:
                raise ConfigError(
                    "engine.urls names servers started elsewhere: leave engine.num_servers, "
                    "engine.gpu_groups and engine.use_router unset"
                )
            for url in self.urls:
                if not re.fullmatch(r"http://[A-Za-z0-9.\-\[\]:]+:\d{1,5}", url):
                    raise ConfigError(f"engine.urls: {url!r} is not http://host:port")

    def check_cpu(self) -> None:
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

    def check_host(self) -> None:
        """``engine.device=cpu`` with servers launched here: SGLang's CPU kernel is compiled for
        x86-64-v4 and dies of SIGILL (exit -4, before ready) on a CPU without AVX-512
        (docs/sglang.md, "Minimum ISA"); refused naming what the CPU lacks. A CPU whose flags
        cannot be read (not Linux) is not refused."""
        if self.device != "cpu" or self.urls or self.launch_prefix:
            return
        from sat_cli.errors import UserError
        from sat_cli.numerics import cpu_info

        cpu = cpu_info()
        missing = [f for f in X86_64_V4 if f not in cpu["flags"]]
        if cpu["flags"] and missing:
            raise UserError(
                f"engine=sglang engine.device=cpu needs AVX-512 (x86-64-v4): SGLang's CPU kernel "
                f"would die of SIGILL on this CPU ({cpu['model']}), which lacks "
                f"{', '.join(missing)}; use engine=local (the embedded engine, any CPU), or run "
                "SGLang on an AVX-512 CPU or a GPU (engine.device=cuda, or engine.urls=<servers "
                "started there>)"
            )

    def check_weight_sync(self) -> None:
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

    def gpu_layout(self) -> dict:
        return {
            "servers": self.servers,
            "tp": self.tp,
            "dp": self.dp,
            "ep": self.ep,
            "gpu_groups": tuple(self.gpu_groups),
            "mem_fraction": self.mem_fraction_static,
            "label": "sglang server {i}",
            "detail": f"tp {self.tp} × dp {self.dp}, ep {self.ep}",
            "placed": True,  # launcher=ray: one bundle per server
            "own_visible": True,  # CUDA_VISIBLE_DEVICES per server
        }

    def plan_lines(self, procs, params: int | None) -> list[str]:
        if self.urls:
            return [
                f"engines   sglang: {len(self.urls)} server(s) started elsewhere "
                f"({', '.join(self.urls)})"
            ]
        gpus = "GPUs" if any(p.gpus for p in procs) else "CPU processes"
        lines = [
            f"engines   sglang: {self.servers} server(s) × tp {self.tp} × dp {self.dp} (ep "
            f"{self.ep}) = {self.servers * self.tp * self.dp} {gpus}, {self.dtype}"
            + (" behind sglang-router" if self.router else "")
        ]
        if params is not None:
            nbytes = 2 if self.dtype == "bfloat16" else 4
            lines.append(
                f"          weights ≈ {params * nbytes / self.tp / 1e9:.1f} GB per engine GPU "
                f"({self.dtype} ÷ tp {self.tp}); the rest of each GPU holds the KV cache"
            )
        return lines

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


def build(s: SGLangEngineSettings, rt: EngineRuntime):
    from sat_cli.devices.apply import server_groups, server_mem_fraction
    from sat_cli.engines.sglang.engine import SGLangEngine
    from sat_cli.engines.sglang.routes import MoEDims
    from sat_cli.engines.sglang.server import resolve_python
    from sat_cli.errors import UserError

    moe = None
    if rt.r3:
        from sat_cli.models.hf_config import read_hf_config

        cfg = read_hf_config(rt.model_path)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if cfg.get("num_hidden_layers") is not None and cfg.get("num_experts_per_tok") is not None:
            moe = MoEDims(cfg["num_hidden_layers"], cfg["num_experts_per_tok"], experts)
    own = SGLangRuntime(rt.model_path, rt.r3, moe, **rt.inflight())
    if rt.lora is not None:  # one adapter per version (lora.py); the base takes a batch slot
        from sat_cli.engines.sglang.lora import server_lora_args

        lora_args = server_lora_args(rt.lora, rt.adapters_kept + 1, s.device)
        own = replace(own, lora_args=tuple(lora_args), adapters_kept=rt.adapters_kept)
    if s.urls:
        return SGLangEngine(s, own)
    try:
        python = "python" if s.launch_prefix else resolve_python(s.python)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    groups = server_groups(rt.devices)  # CUDA_VISIBLE_DEVICES per server (None: CPU, Ray)
    mem = server_mem_fraction(rt.devices, s.mem_fraction_static)
    # launcher=ray: the servers run on the cluster's nodes
    launch = dict(python=python, log_dir=rt.logs, mem_fraction_static=mem, placer=rt.placer)
    return SGLangEngine.launch(s, replace(own, gpu_groups=groups, **launch))


def resources(s: SGLangEngineSettings) -> Resources:
    """Launched servers are placed by a cluster launcher (one bundle each); GPUs on this
    machine: every launched server's tp x dp on cuda (``sat plan``)."""
    gpus = s.servers * s.tp * s.dp if s.device == "cuda" else 0
    return Resources(count=s.servers, gpus=gpus)


def environment(s: SGLangEngineSettings) -> dict[str, str]:
    """``machine.sglang.version``: what the servers' interpreter has (unknown for servers started
    elsewhere)."""
    from sat_cli.tracking.environment import UNKNOWN, sglang_version

    version = f"{UNKNOWN} (servers started elsewhere)"
    if not (s.urls or s.launch_prefix):
        from sat_cli.engines.sglang.server import resolve_python

        try:
            version = sglang_version(resolve_python(s.python))
        except FileNotFoundError:
            version = UNKNOWN
    return {"machine.sglang.version": version}


def check_model(s: SGLangEngineSettings, path: str) -> None:
    """Servers launched here serve the architecture of the model folder at ``path``
    (``sat_cli.engines.sglang.models``); ``UserError`` naming it."""
    if s.urls or s.launch_prefix:
        return
    import json
    from pathlib import Path

    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
        from sat_cli.engines.sglang.server import resolve_python

        python = resolve_python(s.python)
    except (OSError, ValueError, AttributeError):
        return  # a hub id, no SGLang interpreter: the engine's start says so
    from sat_cli.engines.sglang.models import unsupported
    from sat_cli.errors import UserError

    why = unsupported([str(a) for a in archs], python)
    if why:
        raise UserError(f"engine=sglang cannot serve the model at {path}: {why}; use engine=local")


def check(run) -> None:
    """SGLang's rules across sections (``run``: the typed config)."""
    lag, s = run.lag, run.engine
    if lag.inflight_updates and run.r3 and lag.inflight_cache == "recompute":
        raise ConfigError(
            "engine=sglang with lag.inflight_updates=true and lag.inflight_cache=recompute "
            "re-prefills running requests, which replaces the routes R3 recorded (r3=true); "
            "use lag.inflight_cache=keep with r3"
        )
    if s.gpu_groups and s.servers and type(run.launcher).places:
        raise ConfigError(
            "engine.gpu_groups pins servers to this machine's GPUs; with launcher=ray each server "
            "gets launcher.server_gpus GPUs from its bundle: drop engine.gpu_groups"
        )
