"""Megatron's trainer layouts: parallel sizes, the rules megatron-core imposes on them, parameter
counts and a per-GPU memory estimate. Torch-free: ``sat plan`` and compose-time checks
(``sat_cli.config.layout``, the config's side) use it.

**Layout rules** (megatron-core 0.16.1 ``parallel_state.initialize_model_parallel`` and the
attention/MoE layers; ``check`` raises ``ConfigError`` naming the key):
world = ``trainer.nnodes × trainer.nproc_per_node`` must be divisible by ``tp × pp × cp`` (dense
data parallel dp = world / (tp·pp·cp)) and by ``etp × ep × pp`` (expert data parallel edp =
world / (etp·ep·pp); etp = ``trainer.etp``, default 1: the worker keeps experts whole on
every tensor-parallel rank, megatron-core's own default would be tp); ``tp`` must divide the
attention heads and the key/value heads (megatron splits query groups, it does not replicate
them) and the dense FFN size; ``etp`` the MoE FFN size; ``ep`` the experts; ``pp`` the layers.

**Split rules** (parameters held by one GPU): attention q/k/v/o and a dense MLP ÷ tp; word
embeddings and the output layer ÷ tp (vocab-parallel), on the first / last pipeline stage;
experts: E/ep whole experts per GPU, each ÷ etp; layer norms, q/k norms and the router are
replicated; layers ÷ pp (the table shows the largest stage).

**Memory per trainer GPU** (GB = 1e9 bytes), megatron's mixed-precision distributed optimizer:
bfloat16: weights 2 B/param, gradients 4 B (fp32 main grads), optimizer 12 B (fp32 main weights +
Adam m, v) ÷ dp·cp (dense) or ÷ edp (experts); float32: 4 + 4 + 8/dp. ``trainer.optimizer_offload``
moves the optimizer states to host memory (shown as a separate host row). Activations, rough, for
one micro-batch of ``clip.micro_batch_size`` sequences of ``config.layout.PROMPT_TOKENS +
task.max_new_tokens`` tokens with sequence parallelism (÷ tp) and context parallelism (÷ cp): per
token and layer 2h + (nq + 2·nkv)·d + nq·d (attention) + 2h + k·(h + 3·f) (MoE, k routed copies;
a dense MLP h + 3·ffn) elements; with
``trainer.recompute`` (full, one layer at a time) only the layer input h is kept per layer plus
one layer in full; pp > 1 keeps pp micro-batches of L/pp layers (all L); plus the logits
(activation dtype + their fp32 log-softmax) ÷ tp and ``OVERHEAD_GB`` (CUDA context, NCCL
buffers, fragmentation). An estimate, not a measurement: the order of magnitude decides layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from sat_cli.models.arch import Arch
from sat_cli.validate import ConfigError

# What the Megatron worker cannot run yet; `sat train` refuses these at compose time and `sat
# plan` prints them as a note. Remove a name here when the worker implements it.
#   cp: a size > 1; etp: an expert tensor parallel size other than 1 (the worker builds with
#   expert_tensor_parallel_size = 1). tp, pp, optimizer_offload and recompute run
#   (docs/megatron.md "Parallelism", "Memory: recompute and optimizer offload").
NOT_YET = frozenset({"cp", "etp"})

OVERHEAD_GB = 4.0
GB = 1e9


@dataclass(frozen=True)
class Layout:
    nnodes: int
    nproc_per_node: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dtype: str
    optimizer_offload: bool
    recompute: bool

    @classmethod
    def of(cls, t) -> Layout:
        return cls(
            t.nnodes,
            t.nproc_per_node,
            t.tp,
            t.pp,
            t.cp,
            t.ep,
            t.etp or 1,
            t.dtype,
            t.optimizer_offload,
            t.recompute,
        )

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)


def unimplemented(lay: Layout) -> list[str]:
    """The parts of ``lay`` the current Megatron worker cannot run (``NOT_YET``), as
    ``key=value`` strings; empty when it can run it."""
    found = {
        "tp": lay.tp > 1,
        "pp": lay.pp > 1,
        "cp": lay.cp > 1,
        "etp": lay.etp != 1,
        "optimizer_offload": lay.optimizer_offload,
        "recompute": lay.recompute,
    }
    return [f"trainer.{k}={_show(getattr(lay, k))}" for k in sorted(NOT_YET) if found.get(k)]


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check(lay: Layout, arch: Arch | None) -> None:
    """Raise ``ConfigError`` (naming the key) for a layout megatron-core cannot build."""
    w = lay.world
    ranks = f"trainer.nproc_per_node × trainer.nnodes = {w}"
    if w % (lay.tp * lay.pp * lay.cp):
        raise ConfigError(
            f"trainer=megatron: trainer.tp × trainer.pp × trainer.cp = {lay.tp} × {lay.pp} × "
            f"{lay.cp} must divide the number of ranks ({ranks})"
        )
    if w % (lay.etp * lay.ep * lay.pp):
        raise ConfigError(
            f"trainer=megatron: trainer.ep={lay.ep} must divide the number of ranks per expert "
            f"tensor × pipeline group: trainer.etp × trainer.ep × trainer.pp = {lay.etp} × "
            f"{lay.ep} × {lay.pp} does not divide {ranks}"
        )
    if arch is None:
        return
    if not arch.experts and lay.ep > 1:
        raise ConfigError(f"trainer=megatron: trainer.ep={lay.ep} needs a Mixture-of-Experts model")
    for key, n, what in (
        ("tp", arch.heads, "attention heads"),
        ("tp", arch.kv_heads, "key/value heads (megatron splits them, it does not replicate)"),
        ("tp", arch.ffn, "dense FFN size (intermediate_size)"),
        ("etp", arch.moe_ffn, "MoE FFN size (moe_intermediate_size)"),
        ("ep", arch.experts, "experts"),
        ("pp", arch.layers, "layers"),
    ):
        size = getattr(lay, key)
        if n and n % size:
            raise ConfigError(
                f"trainer=megatron: trainer.{key}={size} must divide the model's {n} {what}"
            )


def params_per_gpu(arch: Arch, lay: Layout) -> tuple[int, int]:
    """(dense, expert) parameters on the most loaded GPU (split rules: module docstring)."""
    layers = arch.layers // lay.pp
    per_layer = (arch.attention + arch.dense_mlp) // lay.tp + arch.replicated
    ends = arch.embedding // lay.tp * (1 if arch.tied or lay.pp > 1 else 2)
    dense = layers * per_layer + ends + arch.hidden
    expert = layers * (arch.experts // lay.ep) * (arch.expert // lay.etp)
    return dense, expert


def activation_bytes(arch: Arch, lay: Layout, micro_batch: int, seq: int) -> float:
    """Rough activation memory of one micro-batch on one GPU (module docstring)."""
    b = 2 if lay.dtype == "bfloat16" else 4
    h, d = arch.hidden, arch.head_dim
    attn = 2 * h + (arch.heads + 2 * arch.kv_heads) * d + arch.heads * d
    mlp = 2 * h + (arch.top_k * (h + 3 * arch.moe_ffn) if arch.experts else h + 3 * arch.ffn)
    tokens = micro_batch * seq / lay.cp  # context parallel splits the sequence
    per_layer = tokens * (attn + mlp) * b / lay.tp
    layers = per_layer if lay.recompute else per_layer * arch.layers
    if lay.recompute:
        layers += tokens * h * b * arch.layers / lay.tp
    logits = tokens * arch.vocab / lay.tp * (b + 4)
    return layers + logits


@dataclass(frozen=True)
class Memory:
    """Per-GPU estimate in GB (``rows`` in print order) and the host memory per GPU."""

    rows: tuple[tuple[str, float], ...]
    host_gb: float
    params: tuple[int, int]

    @property
    def total_gb(self) -> float:
        return sum(v for _, v in self.rows)


def memory(arch: Arch, lay: Layout, micro_batch: int, seq: int) -> Memory:
    dense, expert = params_per_gpu(arch, lay)
    n = dense + expert
    w, g, o = (2, 4, 12) if lay.dtype == "bfloat16" else (4, 4, 8)
    opt = o * (dense / (lay.dp * lay.cp) + expert / lay.edp) / GB  # sharded over dp × cp
    rows = (
        ("weights", w * n / GB),
        ("gradients", g * n / GB),
        ("optimizer states", 0.0 if lay.optimizer_offload else opt),
        ("activations", activation_bytes(arch, lay, micro_batch, seq) / GB),
        ("overhead", OVERHEAD_GB),
    )
    return Memory(rows, opt if lay.optimizer_offload else 0.0, (dense, expert))
