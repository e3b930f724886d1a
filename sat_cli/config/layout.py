"""Trainer layouts: parallel sizes, the rules megatron-core imposes on them, parameter counts and a
per-GPU memory estimate. Torch-free (``json`` only): ``sat plan`` and compose-time checks use it.

**Architecture.** From the model's ``config.json`` (``model.path``, a local folder), the tiny
default (``sat_cli.models.arch.TINY_MOE_CONFIG`` with ``model.num_layers``/``hidden_size``/
``num_experts``/``top_k``), or, for a hub id whose files are not here, the table
``sat_cli.models.arch.KNOWN_HF_CONFIGS`` (``Qwen/Qwen3-30B-A3B-Base``).

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
one micro-batch of ``clip.micro_batch_size`` sequences of ``PROMPT_TOKENS +
task.max_new_tokens`` tokens with sequence parallelism (÷ tp) and context parallelism (÷ cp): per
token and layer 2h + (nq + 2·nkv)·d + nq·d (attention) + 2h + k·(h + 3·f) (MoE, k routed copies;
a dense MLP h + 3·ffn) elements; with
``trainer.recompute`` (full, one layer at a time) only the layer input h is kept per layer plus
one layer in full; pp > 1 keeps pp micro-batches of L/pp layers (all L); plus the logits
(activation dtype + their fp32 log-softmax) ÷ tp and ``OVERHEAD_GB`` (CUDA context, NCCL
buffers, fragmentation). An estimate, not a measurement: the order of magnitude decides layouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sat_cli.validate import ConfigError

# What the Megatron worker cannot run yet; `sat train` refuses these at compose time and `sat
# plan` prints them as a note. Remove a name here when the worker implements it.
#   cp: a size > 1; etp: an expert tensor parallel size other than 1 (the worker builds with
#   expert_tensor_parallel_size = 1). tp, pp, optimizer_offload and recompute run
#   (docs/megatron.md "Parallelism", "Memory: recompute and optimizer offload").
NOT_YET = frozenset({"cp", "etp"})

PROMPT_TOKENS = 1024  # prompt allowance of a sequence in the activation estimate
OVERHEAD_GB = 4.0
GB = 1e9


@dataclass(frozen=True)
class Arch:
    """The ``config.json`` fields that sizes and rules need."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP size (0 when every layer is MoE)
    experts: int  # 0: dense
    top_k: int
    moe_ffn: int
    tied: bool

    @classmethod
    def from_hf(cls, c: dict) -> Arch:
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        heads = int(c["num_attention_heads"])
        return cls(
            vocab=int(c["vocab_size"]),
            hidden=int(c["hidden_size"]),
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            ffn=0 if experts else int(c["intermediate_size"]),
            experts=experts,
            top_k=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(c.get("moe_intermediate_size") or 0) if experts else 0,
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    # parameters of one layer, by kind (the split rules apply per kind)
    @property
    def attention(self) -> int:  # q, k, v, o projections (no bias)
        d, h = self.head_dim, self.hidden
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h

    @property
    def replicated(self) -> int:  # two RMSNorms, q/k norms, the router
        return 2 * self.hidden + 2 * self.head_dim + self.experts * self.hidden

    @property
    def dense_mlp(self) -> int:  # gate, up, down
        return 3 * self.hidden * self.ffn

    @property
    def expert(self) -> int:  # one expert's gate, up, down
        return 3 * self.hidden * self.moe_ffn

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    def total(self) -> int:
        per_layer = self.attention + self.replicated + self.dense_mlp + self.experts * self.expert
        head = 0 if self.tied else self.embedding
        return self.layers * per_layer + self.embedding + head + self.hidden  # + final norm


def model_config(obj) -> tuple[dict | None, str]:
    """(the model's ``config.json`` fields, where they came from); (None, why) when they are
    not known here (a hub id missing from ``sat_cli.models.arch``)."""
    from sat_cli.models.arch import KNOWN_HF_CONFIGS, TINY_MOE_CONFIG

    m = obj.model
    if m.kind == "tiny" and not m.path:
        cfg = {
            **TINY_MOE_CONFIG,
            "num_hidden_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
        }
        return cfg, "the tiny model (model.*)"
    path = Path(str(m.path)).expanduser()
    if (path / "config.json").is_file():
        where = str(path / "config.json")
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            return None, f"{where} cannot be read ({type(exc).__name__}: {exc})"
        return (cfg, where) if isinstance(cfg, dict) else (None, f"{where} is not a JSON object")
    if m.path in KNOWN_HF_CONFIGS:
        return KNOWN_HF_CONFIGS[m.path], f"{m.path} (sat_cli/models/arch.py)"
    return None, (
        f"model.path={m.path!r} is neither a local folder with config.json nor a known hub id "
        "(sat_cli/models/arch.py)"
    )


def architecture(obj) -> tuple[Arch | None, str]:
    """(architecture, where it came from); (None, why) when it is not known here."""
    cfg, where = model_config(obj)
    if cfg is None:
        return None, where
    try:
        return Arch.from_hf(cfg), where
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{where} cannot be read ({type(exc).__name__}: {exc})"


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
            t.nnodes, t.nproc_per_node, t.tp, t.pp, t.cp, t.ep, t.etp or 1, t.dtype,
            t.optimizer_offload, t.recompute,
        )  # fmt: skip

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


def sequence_tokens(obj) -> int:
    return PROMPT_TOKENS + obj.task.max_new_tokens


def check_config(obj) -> None:
    """Compose-time check of a ``trainer=megatron`` config: the layout rules, then the memory
    estimate against ``trainer.gpu_memory_gb``. Models not known here get the rules that need
    no architecture (the worker checks the rest when it loads the model)."""
    lay = Layout.of(obj.trainer)
    arch, _ = architecture(obj)
    check(lay, arch)
    if arch is None:
        return
    mem = memory(arch, lay, obj.clip.micro_batch_size, sequence_tokens(obj))
    limit = obj.trainer.gpu_memory_gb
    if mem.total_gb > limit:
        raise ConfigError(
            f"trainer=megatron: the estimated peak of {mem.total_gb:.1f} GB per trainer GPU "
            f"is over trainer.gpu_memory_gb={limit:g} (see `sat plan`); use more GPUs "
            "(trainer.nproc_per_node, trainer.nnodes) or larger trainer.ep / trainer.tp, "
            "trainer.optimizer_offload=true, trainer.recompute=true, or a shorter "
            "task.max_new_tokens / clip.micro_batch_size"
        )
