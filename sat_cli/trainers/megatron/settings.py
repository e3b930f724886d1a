"""``trainer=megatron``: the settings of the megatron-core worker under torchrun (layout, model
parallel sizes, precision), their rules, and how they become a ``MegatronTrainer``. Torch-free;
``sat_cli/config/layout.py`` checks the layout against the model (``sat plan`` prints it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sat_cli.registry import Resources
from sat_cli.trainers.megatron.trainer_runtime import MegatronRuntime
from sat_cli.trainers.settings import TrainerRuntime, TrainerSettings
from sat_cli.util.fsio import parse_size
from sat_cli.validate import ConfigError, check_range

# why trainer=megatron does not pack (also printed by `sat plan`)
MEGATRON_PACKING = (
    "trainer.max_tokens_per_row (sequence packing) is the local trainer's: megatron-core packs "
    "sequences only through Transformer Engine attention (PackedSeqParams, thd format), which "
    "this build's local layer spec has not; trainer=megatron takes "
    "trainer.max_tokens_per_micro_batch (token-budget micro-batches, unpacked)"
)


@dataclass
class MegatronTrainerSettings(TrainerSettings):
    name: str = "megatron"
    # torchrun layout and model parallel sizes; rules, split and memory estimate in
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
    optimizer_offload: bool = False  # optimizer states in host memory
    recompute: bool = False  # full activation recompute, one layer at a time
    gpu_memory_gb: float = 80.0  # memory of one trainer GPU; layouts estimated above it fail
    # exported HF weights in safetensors shards of at most this size (+ index.json)
    max_shard_size: str = "5GB"

    PACKING_NOTE: ClassVar[str] = " (megatron-core packs only with Transformer Engine)"
    GPU_NOTE: ClassVar[str] = "(a megatron rank runs on the CPU, gloo, where no GPU is visible)"

    def __post_init__(self) -> None:
        super().__post_init__()
        for k in ("nnodes", "tp", "ep", "pp", "cp"):
            check_range(f"trainer.{k}", getattr(self, k), 1)
        if self.etp is not None:
            check_range("trainer.etp", self.etp, 1)
        if self.nproc_per_node is not None:
            check_range("trainer.nproc_per_node", self.nproc_per_node, 1)
        else:  # the fewest ranks the layout rules accept (sat_cli/config/layout.py), per node
            least = math.lcm(self.tp * self.pp * self.cp, (self.etp or 1) * self.ep * self.pp)
            self.nproc_per_node = math.lcm(least, self.nnodes) // self.nnodes
        try:
            parse_size(self.max_shard_size)
        except ValueError as exc:
            raise ConfigError(f"trainer.max_shard_size: {exc}") from None
        if self.max_tokens_per_row is not None:
            raise ConfigError(MEGATRON_PACKING)
        if self.lora.on:
            raise ConfigError(
                f"trainer.lora.rank={self.lora.rank}: trainer=megatron has no LoRA yet (its "
                "ranks train the full weights); use trainer=local for LoRA, or trainer.lora.rank=0"
            )
        check_range("trainer.gpu_memory_gb", self.gpu_memory_gb, 0, lo_open=True)
        if self.optimizer_offload and self.dtype != "bfloat16":
            raise ConfigError(
                "trainer.optimizer_offload=true offloads the fp32 main weights and Adam states "
                "of mixed precision: it needs trainer.dtype=bfloat16"
            )

    def gpu_layout(self, cpu: bool = False) -> dict:
        """GPU ranks unless their launcher's bundles explicitly ask for none (``cpu``)."""
        return {
            "device": "cpu" if cpu else "cuda",
            "dtype": self.dtype,
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node or 1,
            "torchrun": True,
            "label": "megatron node {node}",
        }

    def plan_lines(self, procs, params: int | None) -> list[str]:
        from sat_cli.trainers.megatron.layout import Layout
        from sat_cli.trainers.megatron.plan import layout_line

        return [layout_line(Layout.of(self))]

    def plan_notes(self, arch, micro_batch: int, seq: int) -> list[str]:
        from sat_cli.trainers.megatron.layout import Layout
        from sat_cli.trainers.megatron.plan import notes

        return notes(Layout.of(self), self.gpu_memory_gb, arch, micro_batch, seq)

    def not_yet(self, plan: bool = False) -> str | None:
        from sat_cli.trainers.megatron.layout import Layout, unimplemented
        from sat_cli.trainers.megatron.plan import not_yet_message

        missing = unimplemented(Layout.of(self))
        return not_yet_message(missing, plan=plan) if missing else None

    def checkpoint_kind(self) -> dict:
        world = self.nnodes * self.nproc_per_node
        return {
            "backend": self.name,
            "world_size": world,
            "tp": self.tp,
            "ep": self.ep,
            "pp": self.pp,
            "dtype": self.dtype,
        }


def build(s: MegatronTrainerSettings, rt: TrainerRuntime):
    from sat_cli.devices.apply import trainer_env
    from sat_cli.trainers.megatron.client import MegatronTrainer
    from sat_cli.weightsync.spec import sender_spec

    return MegatronTrainer(
        s,
        MegatronRuntime(
            rt.model_path,
            rt.run_dir / "megatron",
            logs_dir=rt.run_dir / "logs",
            loss=rt.loss,
            options=rt.options,
            export_dtype=rt.engine.dtype,
            weight_sync=sender_spec(rt.engine),  # engine.weight_sync=distributed: rank 0's
            placer=rt.placer,  # launcher=ray: the nodes run on the cluster
            env=trainer_env(rt.devices) if rt.placer is None else None,  # node 0's GPUs
        ),
    )


def resources(s: MegatronTrainerSettings) -> Resources:
    """One cluster bundle per node (``trainer.nnodes``) with a CPU per rank; every rank on a GPU
    (``sat plan``)."""
    ranks = s.nproc_per_node or 1
    return Resources(count=s.nnodes, bundle={"CPU": float(ranks)}, gpus=s.nnodes * ranks)


def check_model(s: MegatronTrainerSettings, path: str) -> None:
    """The model at ``path`` is one the Megatron worker can build (``UserError`` naming it; a
    hub id without files here: the worker reports it)."""
    from sat_cli.errors import UserError
    from sat_cli.models.hf_config import config_if_usable

    config = config_if_usable(path)
    if config is None:
        return  # a hub id: the worker reports it
    from sat_cli.trainers.megatron.model import check_supported, rope_theta

    try:
        check_supported(config)
        rope_theta(config)
    except (NotImplementedError, ValueError) as exc:
        raise UserError(f"trainer=megatron cannot train the model at {path}: {exc}") from None
