"""What every trainer's settings have (``trainer.*`` of any option), the local trainer's own
settings (``trainer=local``: HF model + AdamW in this process) and the run-level values a trainer
is built with (:class:`TrainerRuntime`). Torch-free: the config composes without torch.

``trainer=megatron`` has its settings in ``trainers/megatron/settings.py``; both are registered in
``sat_cli/trainers/registry.py`` as the structured configs of ``conf/trainer/<name>.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sat_cli.validate import ConfigError, check_choice, check_range

# the local trainer's token budget per forward on a GPU when trainer.max_tokens_per_micro_batch
# is null (a sample longer than it is a micro-batch of its own): activations of ~8k tokens of a
# 0.6B model in bf16 are a few GB, where a 512 x 1.2k-token minibatch in one forward is not
GPU_MICRO_BATCH_TOKENS = 8192
MAX_LR_STEPS = 10_000_000  # trainer.lr_warmup_steps / lr_decay_steps: optimizer steps


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

    def not_yet(self) -> str | None:
        """Why it cannot run these settings yet (``sat train`` refuses them), or None."""
        return None

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
    minibatches, seed, the sampler replay, the ledger: ``trainers.step.TrainerSettings``), the
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
        """The keywords both trainers' constructors take (``trainers.step.TrainerSettings``)."""
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
    """A trainer's step keywords (``trainers.step.TrainerSettings``, ``loss``): the optimizer
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
        **rt.keywords(s),
    )
