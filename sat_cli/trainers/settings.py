"""What every trainer's settings have (``trainer.*`` of any option), the local trainer's own
settings (``trainer=local``: HF model + AdamW in this process) and the run-level values a trainer
is built with (:class:`TrainerRuntime`). Torch-free: the config composes without torch.

``trainer=megatron`` has its settings in ``trainers/megatron/settings.py``; both are registered in
``sat_cli/trainers/registry.py`` as the structured configs of ``conf/trainer/<name>.yaml``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sat_cli.validate import ConfigError, check_choice, check_range

# the local trainer's token budget per forward on a GPU when trainer.max_tokens_per_micro_batch
# is null (a sample longer than it is a micro-batch of its own): activations of ~8k tokens of a
# 0.6B model in bf16 are a few GB, where a 512 x 1.2k-token minibatch in one forward is not
GPU_MICRO_BATCH_TOKENS = 8192
MAX_LR_STEPS = 10_000_000  # trainer.lr_warmup_steps / lr_decay_steps: optimizer steps
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the attention projections
LORA_MAX_RANK = 4096
LORA_SYNC = ("adapter", "merged")  # trainer.lora.sync


@dataclass
class LoraSettings:
    """``trainer.lora.*``: low-rank adapters (``W + (alpha / rank) B A`` on the linear layers
    named in ``target_modules``; ``sat_cli.models.lora``). ``rank`` null or 0: off (the whole
    model trains). On, the trainer trains the adapters only and publishes them alone
    (adapter-only weight sync, one adapter per weight version). ``sync``: ``adapter`` (the
    adapter alone, the engine holds one per version) or ``merged`` (full weights with the
    adapter merged in, ``W + (alpha / rank) B A``: for engines without adapter support)."""

    rank: int | None = None
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    sync: str = "adapter"

    def __post_init__(self) -> None:
        if self.rank is not None:
            check_range("trainer.lora.rank", self.rank, 0, LORA_MAX_RANK)
        check_range("trainer.lora.alpha", self.alpha, 0, 1e6, lo_open=True)
        check_range("trainer.lora.dropout", self.dropout, 0, 1, hi_open=True)
        check_choice("trainer.lora.sync", self.sync, LORA_SYNC)
        if not self.target_modules:
            raise ConfigError("trainer.lora.target_modules must name at least one module")
        for name in self.target_modules:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", str(name)):
                raise ConfigError(
                    f"trainer.lora.target_modules: {str(name)[:40]!r} is not a module name "
                    "(a linear layer's attribute name, e.g. q_proj)"
                )

    @property
    def on(self) -> bool:
        return bool(self.rank)

    def as_dict(self) -> dict:
        """The trainer's ``lora=`` keyword (None when off)."""
        return {
            "rank": int(self.rank or 0),
            "alpha": float(self.alpha),
            "dropout": float(self.dropout),
            "target_modules": [str(n) for n in self.target_modules],
            "sync": str(self.sync),
        }


@dataclass
class TrainerSettings:
    name: str = "local"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # the paper's Adam betas
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_threads: int = 1  # torch threads of this process (the orchestrator)
    # megatron: parameter dtype (bfloat16 on GPUs); local: bfloat16 = bf16 autocast of the
    # forward, fp32 weights and AdamW states; null: bfloat16 where its weights live on a GPU
    # (on_gpu: the local trainer on cuda), else float32 (resolved at compose time)
    dtype: str | None = None
    # R3: count, every step, the (token, layer) rows where the experts the trainer's forward
    # used differ from the engine's recorded routes (r3/audit_rows, r3/audit_mismatched_rows)
    r3_audit: bool = False
    # throughput (sat_cli/trainers/packing.py): null = off. local: pack samples into rows of at
    # most this many tokens (block-diagonal attention, positions restarting per sample)
    max_tokens_per_row: int | None = None
    # both trainers: each forward of a minibatch holds at most this many tokens (padded: rows x
    # longest; packed: the samples' tokens); the loss stays the whole minibatch's
    max_tokens_per_micro_batch: int | None = None
    # LoRA (trainer=local only): the adapters train, the base weights stay as loaded
    lora: LoraSettings = field(default_factory=LoraSettings)
    # the learning rate over optimizer steps (sat_cli/trainers/lr_schedule.py): constant, or
    # linear / cosine decay towards 0 at lr_decay_steps (null: max_steps x algo.num_minibatches),
    # after a linear warm-up over lr_warmup_steps (0: none); checkpointed with the optimizer
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None

    # the weight-sync sender of engine.weight_sync=distributed listens in this process (its
    # port is checked before the run starts); False: inside the trainer's own workers
    SENDER_IN_PROCESS: ClassVar[bool] = False
    # `sat plan`: why its rows are padded (after "padded rows, no packing"), and a note under
    # the GPU table of a run that trains on GPUs
    PACKING_NOTE: ClassVar[str] = ""
    GPU_NOTE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_range("trainer.lr", self.lr, 0, lo_open=True)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("trainer.betas must be two numbers in [0, 1)")
        check_range("trainer.weight_decay", self.weight_decay, 0)
        check_range("trainer.grad_clip", self.grad_clip, 0)
        check_range("trainer.num_threads", self.num_threads, 1)
        if self.dtype is None:
            self.dtype = "bfloat16" if self.on_gpu() else "float32"
        check_choice("trainer.dtype", self.dtype, ("float32", "bfloat16"))
        for key in ("max_tokens_per_row", "max_tokens_per_micro_batch"):
            if getattr(self, key) is not None:
                check_range(f"trainer.{key}", getattr(self, key), 1)
        from sat_cli.trainers.lr_schedule import LR_SCHEDULES

        check_choice("trainer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_range("trainer.lr_warmup_steps", self.lr_warmup_steps, 0, MAX_LR_STEPS)
        if self.lr_decay_steps is not None:
            check_range("trainer.lr_decay_steps", self.lr_decay_steps, 1, MAX_LR_STEPS)
        row, micro = self.max_tokens_per_row, self.max_tokens_per_micro_batch
        if row is not None and micro is not None and micro < row:
            raise ConfigError(
                f"trainer.max_tokens_per_micro_batch={micro} is below trainer.max_tokens_per_row="
                f"{row}: a packed row would not fit a micro-batch"
            )

    def on_gpu(self) -> bool:
        """Whether this process's trainer weights live on a GPU (weight sync over NCCL)."""
        return False

    def plan_lines(self, procs, params: int | None) -> list[str]:
        """Its lines of ``sat plan`` (``procs``: its processes of the device plan, ``params``:
        the model's parameter count when known)."""
        devices = ", ".join(p.device for p in procs)
        return [f"trainer   {self.name}: {len(procs)} process(es) ({devices}, {self.dtype})"]

    def plan_notes(self, arch, micro_batch: int, seq: int) -> list[str]:
        """The end of ``sat plan``: its memory estimate per GPU (``arch``: the model's
        ``sat_cli.models.arch.Arch`` or None; ``seq``: tokens of one sequence)."""
        return ["(the per-GPU memory table is for trainer=megatron)"]

    def not_yet(self, plan: bool = False) -> str | None:
        """Why it cannot run these settings yet (``sat train`` refuses them; ``plan``: worded
        for `sat plan`), or None."""
        return None

    def token_budget(self) -> int | None:
        """The most tokens one sample may have in its forwards (the smaller of
        ``max_tokens_per_row`` and ``max_tokens_per_micro_batch``; None: no budget); the
        training prompts are checked against it before a run starts
        (``commands/preflight.check_token_budget``)."""
        budgets = (self.max_tokens_per_row, self.max_tokens_per_micro_batch)
        return min((b for b in budgets if b), default=None)

    def checkpoint_kind(self) -> dict:
        """What a checkpoint's trainer state must say for this trainer to resume it."""
        return {"backend": self.name}

    def gpu_layout(self, cpu: bool = False) -> dict:
        """Its processes for the device plan (``sat_cli.devices.TrainerSpec``): one process in
        this one (``cpu``: a launcher asked for no GPUs)."""
        return {
            "device": "cpu",
            "dtype": self.dtype,
            "nnodes": 1,
            "nproc_per_node": 1,
            "label": f"{self.name} trainer",
        }


@dataclass
class LocalTrainerSettings(TrainerSettings):
    name: str = "local"
    device: str = "cpu"  # torch device (cuda: one GPU)
    # positions whose full-vocabulary logits the log-probs hold at once (the LM head applied
    # chunk by chunk, recomputed in backward: trainers/head_chunks.py); null: as many as keep
    # one fp32 copy of them within 128 MiB (2^25 / vocabulary size)
    logprob_chunk_tokens: int | None = None

    SENDER_IN_PROCESS: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("trainer.device", self.device, ("cpu", "cuda"))
        if self.logprob_chunk_tokens is not None:
            check_range("trainer.logprob_chunk_tokens", self.logprob_chunk_tokens, 1, 1 << 24)

    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def plan_lines(self, procs, params: int | None) -> list[str]:
        p = procs[0]
        where = "GPU" if p.gpus else "CPU"
        line = (
            f"trainer   local: in the orchestrator process on the {where} ({p.device}, {p.dtype})"
        )
        if self.lora.on:  # frozen fp32 weights; the adapters' gradients and AdamW are small
            targets = ",".join(self.lora.target_modules)
            if params is not None:
                line += f"; fp32 weights (frozen) ≈ {params * 4 / 1e9:.1f} GB"
            return [
                line,
                f"          LoRA rank {self.lora.rank} on {targets}: the adapters "
                "alone train and sync, one per weight version",
            ]
        if params is not None:  # fp32 weights + grads + AdamW m, v
            line += f"; fp32 weights, gradients, AdamW ≈ {params * 16 / 1e9:.1f} GB"
        return [line]

    def gpu_layout(self, cpu: bool = False) -> dict:
        autocast = "bfloat16 autocast (fp32 weights, AdamW)"  # the weights stay fp32
        dtype = autocast if self.dtype == "bfloat16" else self.dtype
        return {**super().gpu_layout(cpu), "device": self.device, "dtype": dtype}


def check_token_budgets(trainer: TrainerSettings, max_new_tokens: int) -> None:
    """A token budget below the longest sample is refused: every sample holds one prompt token
    at least and up to ``task.max_new_tokens`` response tokens (the prompts themselves are
    checked against it before the run starts: ``commands/preflight.check_token_budget``)."""
    for key in ("max_tokens_per_row", "max_tokens_per_micro_batch"):
        budget = getattr(trainer, key)
        if budget is not None and budget < max_new_tokens + 1:
            raise ConfigError(
                f"trainer.{key}={budget} is below the longest sample: a prompt token and "
                f"task.max_new_tokens={max_new_tokens} response tokens need {max_new_tokens + 1}"
            )


@dataclass(frozen=True)
class TrainerRuntime:
    """What a trainer is built with besides its settings: the model, the run folder, the loss
    (``rl.config.LossConfig``), the step keywords from outside ``trainer.*`` (temperature, r3,
    minibatches, seed, the sampler replay, the ledger: ``trainers.step.StepSettings``), the
    engine's settings (the weight sync's dtype, device and buckets), the launcher and the run's
    device plan (``sat_cli.devices.DevicePlan``)."""

    model_path: str
    run_dir: Path
    loss: Any
    options: dict
    engine: Any
    placer: Any = None
    devices: Any = None

    def keywords(self, s: TrainerSettings) -> dict:
        """The keywords both trainers' constructors take (``trainers.step.StepSettings``)."""
        return step_keywords(s, self.loss, self.options)


def micro_batch_tokens(s: TrainerSettings) -> int:
    """The trainer's token budget per forward (0: one forward per minibatch):
    ``trainer.max_tokens_per_micro_batch`` when set, else on a GPU (``on_gpu``: the local
    trainer on cuda) ``GPU_MICRO_BATCH_TOKENS`` (at least one packed row), else off (CPU)."""
    if s.max_tokens_per_micro_batch is not None:
        return s.max_tokens_per_micro_batch
    if not s.on_gpu():
        return 0
    return max(GPU_MICRO_BATCH_TOKENS, s.max_tokens_per_row or 0)


def step_keywords(s: TrainerSettings, loss, options: dict) -> dict:
    """A trainer's step keywords (``trainers.step.StepSettings``, ``loss``): the optimizer
    and token budgets of ``trainer.*``, and ``options``, the ones from outside it."""
    return dict(
        loss=loss,
        lr=s.lr,
        betas=tuple(s.betas),
        weight_decay=s.weight_decay,
        grad_clip=s.grad_clip,
        r3_audit=s.r3_audit,
        max_tokens_per_row=s.max_tokens_per_row or 0,  # null: off
        max_tokens_per_micro_batch=micro_batch_tokens(s),
        lr_schedule=s.lr_schedule,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps or 0,
        **options,
    )


def build_local(s: LocalTrainerSettings, rt: TrainerRuntime):
    from sat_cli.trainers.local import LocalTrainer
    from sat_cli.weightsync.spec import weight_sender

    device = rt.devices.find("local trainer").device  # cuda:K of the device plan
    sender = weight_sender(rt.engine, device, rt.model_path)  # None with weight_sync=disk
    return LocalTrainer(
        rt.model_path,
        device=device,
        dtype=s.dtype,
        weight_sender=sender,
        logprob_chunk_tokens=s.logprob_chunk_tokens,
        lora=s.lora.as_dict() if s.lora.on else None,
        **rt.keywords(s),
    )


def check_local(run) -> None:
    """``trainer=local``'s rules across sections (``run``: the typed config): LoRA publishes
    adapters, which the local engine loads from disk, one per weight version."""
    lora = run.trainer.lora
    if not lora.on:
        return
    merged = lora.sync == "merged"  # full weights: any engine loads them
    if not merged and not getattr(type(run.engine), "LORA_ADAPTERS", False):
        raise ConfigError(
            f"trainer.lora.rank={lora.rank} with engine={run.engine.name}: adapter-only weight "
            "sync is wired into engine=local and engine=sglang only; use one of them, "
            "trainer.lora.sync=merged, or trainer.lora.rank=0"
        )
    has = hasattr(run.engine, "lora_refusal")
    why = run.engine.lora_refusal() if has and not merged else None
    if why is not None:
        raise ConfigError(f"trainer.lora.rank={lora.rank} with engine={run.engine.name}: not {why}")
    if run.engine.weight_sync != "disk":
        raise ConfigError(
            f"trainer.lora.rank={lora.rank} with engine.weight_sync={run.engine.weight_sync}: "
            "LoRA versions reach the engine from disk (adapters: a few MB per version); use "
            "engine.weight_sync=disk"
        )
    if run.lag.inflight_updates:
        raise ConfigError(
            f"trainer.lora.rank={lora.rank} with lag.inflight_updates=true: the engine switches "
            "adapters between requests, not inside one; use lag.inflight_updates=false"
        )
    if run.algo.ledger:
        raise ConfigError(
            f"trainer.lora.rank={lora.rank} with algo.ledger=true: the ledger's weight snapshots "
            "are whole-model copies, not adapters; use algo.ledger=false"
        )
