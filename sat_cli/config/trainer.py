"""The ``trainer`` section of the config (``conf/trainer/*.yaml``): the local trainer and the
Megatron worker's layout (``sat_cli/config/layout.py`` checks it against the model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sat_cli.config.checks import ConfigError, check_choice, check_range
from sat_cli.util.fsio import parse_size

TRAINERS = ("local", "megatron")
# why trainer=megatron does not pack (also printed by `sat plan`)
MEGATRON_PACKING = (
    "trainer.max_tokens_per_row (sequence packing) is the local trainer's: megatron-core packs "
    "sequences only through Transformer Engine attention (PackedSeqParams, thd format), which "
    "this build's local layer spec has not; trainer=megatron takes "
    "trainer.max_tokens_per_micro_batch (token-budget micro-batches, unpacked)"
)


def check_token_budgets(trainer: TrainerConfig, max_new_tokens: int) -> None:
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


@dataclass
class TrainerConfig:
    name: str = "local"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # the paper's Adam betas
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_threads: int = 1
    device: str = "cpu"  # local: torch device (cuda: one GPU); megatron takes CUDA when present
    # megatron: torchrun layout and model parallel sizes; rules, split and memory estimate in
    # sat_cli/config/layout.py (`sat plan` prints them). nnodes > 1: torchrun's rendezvous is
    # master_addr:master_port; other nodes join with `sat worker --join` (docs/megatron.md)
    # null: the fewest ranks the layout needs, lcm(tp·pp·cp, etp·ep·pp), spread over the nodes
    nproc_per_node: int | None = None
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: the OS picks it at the bind (one node), else a free port now
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    etp: int | None = None  # expert tensor parallel size; null = 1 (experts whole on each TP rank)
    # megatron: parameter dtype (bfloat16 on GPUs); local: bfloat16 = bf16 autocast of the
    # forward, fp32 weights and AdamW states
    dtype: str = "float32"
    optimizer_offload: bool = False  # megatron: optimizer states in host memory
    recompute: bool = False  # megatron: full activation recompute, one layer at a time
    gpu_memory_gb: float = 80.0  # memory of one trainer GPU; layouts estimated above it fail
    # R3: count, every step, the (token, layer) rows where the experts the trainer's forward
    # used differ from the engine's recorded routes (r3/audit_rows, r3/audit_mismatched_rows)
    r3_audit: bool = False
    # megatron: exported HF weights in safetensors shards of at most this size (+ index.json)
    max_shard_size: str = "5GB"
    # throughput (sat_cli/trainers/packing.py): null = off. local: pack samples into rows of at
    # most this many tokens (block-diagonal attention, positions restarting per sample)
    max_tokens_per_row: int | None = None
    # both trainers: each forward of a minibatch holds at most this many tokens (padded: rows x
    # longest; packed: the samples' tokens); the loss stays the whole minibatch's
    max_tokens_per_micro_batch: int | None = None

    def __post_init__(self) -> None:
        check_choice("trainer.name", self.name, TRAINERS)
        check_range("trainer.lr", self.lr, 0, lo_open=True)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("trainer.betas must be two numbers in [0, 1)")
        check_range("trainer.weight_decay", self.weight_decay, 0)
        check_range("trainer.grad_clip", self.grad_clip, 0)
        for k in ("num_threads", "nnodes", "tp", "ep", "pp", "cp"):
            check_range(f"trainer.{k}", getattr(self, k), 1)
        if self.etp is not None:
            check_range("trainer.etp", self.etp, 1)
        if self.nproc_per_node is not None:
            check_range("trainer.nproc_per_node", self.nproc_per_node, 1)
        else:  # the fewest ranks the layout rules accept (sat_cli/config/layout.py), per node
            least = math.lcm(self.tp * self.pp * self.cp, (self.etp or 1) * self.ep * self.pp)
            self.nproc_per_node = math.lcm(least, self.nnodes) // self.nnodes
        check_choice("trainer.dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("trainer.device", self.device, ("cpu", "cuda"))
        if self.name == "megatron" and self.device != "cpu":
            raise ConfigError(
                "trainer.device is the local trainer's; trainer=megatron takes CUDA when present"
            )
        try:
            parse_size(self.max_shard_size)
        except ValueError as exc:
            raise ConfigError(f"trainer.max_shard_size: {exc}") from None
        for key in ("max_tokens_per_row", "max_tokens_per_micro_batch"):
            if getattr(self, key) is not None:
                check_range(f"trainer.{key}", getattr(self, key), 1)
        if self.name == "megatron" and self.max_tokens_per_row is not None:
            raise ConfigError(MEGATRON_PACKING)
        row, micro = self.max_tokens_per_row, self.max_tokens_per_micro_batch
        if row is not None and micro is not None and micro < row:
            raise ConfigError(
                f"trainer.max_tokens_per_micro_batch={micro} is below trainer.max_tokens_per_row="
                f"{row}: a packed row would not fit a micro-batch"
            )
        check_range("trainer.gpu_memory_gb", self.gpu_memory_gb, 0, lo_open=True)
        for key in ("optimizer_offload", "recompute"):
            if self.name == "local" and getattr(self, key):
                raise ConfigError(f"trainer.{key}=true needs trainer=megatron")
        if self.optimizer_offload and self.dtype != "bfloat16":
            raise ConfigError(
                "trainer.optimizer_offload=true offloads the fp32 main weights and Adam states "
                "of mixed precision: it needs trainer.dtype=bfloat16"
            )
