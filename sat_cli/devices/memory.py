"""Peak memory of each process of a run, part by part: the memory model `sat plan` prints.
Torch-free, plain numbers in and out (``arch``: any object with ``sat_cli.models.arch.Arch``'s
fields and ``total()``); ``sat_cli.commands.plan`` feeds it the config. Every part's formula is
written once, here (docs/gpus.md "Memory per process" states them). Bytes; GB = 1e9 bytes.

**Local trainer** (``trainer=local``, HF model + torch AdamW, one process): weights 4 B/param
(fp32, also under bf16 autocast), the reference model 4 B/param when ``algo.kl_coef > 0``,
gradients 4 B/param, AdamW's m and v 8 B/param (the fp32 weights are the master copy), and on
CUDA the foreach AdamW's temporary sqrt(v) 4 B/param. Activations of one forward of ``T =
rows × S`` tokens (a micro-batch under the token budget, else the minibatch), the tensors
autograd saves, counted on transformers 5's Qwen3 / Qwen3-MoE layers with SDPA (flash or
memory-efficient kernels: no ``[heads, S, S]`` score matrix is formed):

- per token and layer, fp32: ``24h + 8 + (16d + 8)·nq + (16d + 4)·nkv + 16f`` bytes (dense
  MLP ``f``); an MoE layer replaces ``16f`` by ``k·(16f_moe + 8h + 36) + 4E`` (each routed
  copy: its input, gate, up, activation, product and weight; the router's probabilities);
- with a padding or packing mask (rows of unequal length) SDPA gets k and v repeated to nq heads
  (``+ 8d·(nq − nkv)``) and each layer holds the ``[rows, 1, S, S]`` mask (4 B);
- outside the layers: ``8h + 4d + 12`` bytes per token (final norm, RoPE tables, positions);
- bf16 autocast: ``26h + 8 + (10d + 8)·nq + (10d + 4)·nkv + 8f`` per token and layer plus one
  bf16 copy of each layer's weights (2 B/param), counted on the dense layer; an MoE layer's
  routed copies are taken at half their fp32 bytes, ``k·(8f_moe + 4h + 18) + 4E`` (not counted).

The log-prob chunk (``trainers/head_chunks.py``): ``C = trainer.logprob_chunk_tokens`` or
``2^25 // V`` positions. A forward of ``T ≤ C`` positions takes the plain graph: logits, their
``z = logits / T``, their log-softmax and the entropy's exp and product: ``20·T·V`` bytes (bf16
autocast: ``18·T·V``, the logits in bf16); more positions go chunk by chunk, ``20·C·V`` bytes
at a time, plus the hidden states' gradient (``4·T·h``). The backward starts at the LM head:
its gradient ``4·V·h`` is allocated while the activations are still held. Peak = weights +
reference + optimizer states + max(activations + log-prob chunk + LM-head gradient, gradients +
optimizer temporaries) + overhead (CUDA context, ``CUDA_GB``; 0 on the CPU, where
``bench/plan_memory.py`` subtracts the same process's peak with a model of a few kB). Measured
on the CPU within ±15 % on eight shapes (bench/README.md).

**Local engine** (HF ``generate`` in its own process): weights ``bytes·P``, the KV cache
``2 · L · nkv · d · bytes`` per token of the rollout's rows (at most ``MAX_BATCH`` per forward)
× S, the last position's logits ``4 copies × rows × V × 4 B`` (softmax, sorting of top-p), the
prefill's largest transient
(no graph: one layer's residual, normed input and three MLP-wide tensors, ``(2h + 3f)`` per
prompt token, ``f`` the dense FFN or ``k·f_moe``, and the ``[rows, 1, P, P]`` mask). Not
measured.

**SGLang server** (per GPU): weights ÷ tp (experts ÷ ep), the KV pool filling
``mem_fraction_static`` of the GPU (its token capacity printed), the rest of the GPU left for
its activations and CUDA graphs.

**Megatron rank** (megatron-core's local layer spec, ``parallel_output=False``): weights /
gradients / optimizer states as ``sat_cli.trainers.megatron.layout`` splits them (bf16 2 + 4 +
12/dp B/param, fp32 4 + 4 + 8/dp); activations per token and layer ``2h + (nq + 2nkv)·d +
nq·d + 2h + k·(h + 3f_moe)`` elements ÷ tp (sequence parallel), all layers or, with
``trainer.recompute``, each layer's input plus one layer in full; the attention-score matrix,
``b · nq/tp · S²`` scores per layer: each layer held for backward keeps the fp32 softmax and its
bf16 copy for the value product (6 B; fp32 4 B) — all layers, or with recompute the one being
recomputed — and the layer being computed adds its scores and their fp32 upcast and masked copy
(8 B); the MoE allgather dispatcher's buffers (tokens gathered over etp × ep ranks, ``2h``
each, and the local experts' share ``k/ep`` of them through ``2h + 3f_moe``); each rank's
vocabulary shard of the logits (``parallel_output=True``; the log-softmax taken across the
shards, ``trainers/megatron/runtime.vocab_parallel_logprobs``), ``18 B`` per logit of
``S × V/tp`` (bf16 logits, fp32 ``z/T``, the shifted exp, and the entropy's exp and product;
fp32 20 B); overhead ``MEGATRON_OVERHEAD_GB``. Peak =
weights + gradients + optimizer + activations + max(attention scores + MoE buffers, the scores
held for backward + logits) + overhead. Not measured (docs/megatron.md: the layer term is low).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
PROMPT_TOKENS = 1024  # prompt allowance of a sequence in the activation estimate
CUDA_GB = 1.0  # CUDA context and allocator slack of a single-GPU process
MEGATRON_OVERHEAD_GB = 4.0  # CUDA context, NCCL buffers, fragmentation
CHUNK_LOGIT_ELEMENTS = 2**25  # trainers/head_chunks.py's default bound (logits per chunk)
MAX_BATCH = 256  # the local engine's sequences per forward (engines/local/engine.py)
GPU_GB = 80.0  # the GPU a plan is checked against when the config names none


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class ProcMemory:
    """One process's parts and its peak (``peak_rule`` says how the parts combine)."""

    process: str
    parts: tuple[Part, ...]
    peak: float
    peak_rule: str
    host: float = 0.0  # bytes held in host memory instead (optimizer offload)

    def part(self, name: str) -> float:
        return next(p.bytes for p in self.parts if p.name == name)


def size_text(x: float) -> str:
    """``x`` bytes as printed: ``12.34 GB``, ``5.67 MB`` or ``0.89 kB`` (1e9, 1e6, 1e3); 0: ``0``."""
    if not x:
        return "0"
    for unit, scale in (("GB", GB), ("MB", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x / 1e3:.2f} kB"


# --- the HF (transformers) model's activations -----------------------------------------------
def hf_layer_bytes(a, padded: bool, bf16: bool = False) -> float:
    """Bytes autograd saves per token in one decoder layer (module docstring)."""
    h, d, nq, nkv = a.hidden, a.head_dim, a.heads, a.kv_heads
    if bf16:
        attn = 26 * h + 8 + (10 * d + 8) * nq + (10 * d + 4) * nkv
        mlp = a.top_k * (8 * a.moe_ffn + 4 * h + 18) + 4 * a.experts if a.experts else 8 * a.ffn
    else:
        attn = 24 * h + 8 + (16 * d + 8) * nq + (16 * d + 4) * nkv
        mlp = a.top_k * (16 * a.moe_ffn + 8 * h + 36) + 4 * a.experts if a.experts else 16 * a.ffn
    repeat = (4 if bf16 else 8) * d * (nq - nkv) if padded else 0  # k, v repeated to nq heads
    return attn + mlp + repeat


def hf_outer_bytes(a) -> float:
    """Bytes saved per token outside the layers (final norm, RoPE tables, position ids)."""
    return 8 * a.hidden + 4 * a.head_dim + 12


def hf_activations(a, rows: int, seq: int, padded: bool, bf16: bool = False) -> Part:
    T = rows * seq
    b = T * (a.layers * hf_layer_bytes(a, padded, bf16) + hf_outer_bytes(a))
    formula = f"{rows} × {seq} tokens × {a.layers} layers (SDPA, no score matrix)"
    if padded:
        b += 4 * rows * seq * seq * a.layers
        formula += f" + the [{rows}, 1, {seq}, {seq}] mask per layer"
    if bf16:
        b += 2 * (a.total() - 2 * a.vocab * a.hidden)  # the layers' bf16 weight copies
        formula += " + bf16 weight copies"
    return Part("activations", b, formula)


def logprob_chunk(a, tokens: int, chunk: int | None, bf16: bool = False) -> Part:
    c = chunk if chunk else max(1, CHUNK_LOGIT_ELEMENTS // a.vocab)
    per = 18 if bf16 else 20  # logits, z = logits / T, log-softmax, the entropy's exp, product
    if tokens <= c:
        return Part("log-prob chunk", per * tokens * a.vocab, f"one chunk: {per} B × {tokens} × V")
    b = per * c * a.vocab + 4 * tokens * a.hidden
    return Part("log-prob chunk", b, f"chunks of {c}: {per} B × {c} × V + dL/dhidden")


# --- processes --------------------------------------------------------------------------------
def local_trainer(
    a,
    rows: int,
    seq: int,
    *,
    padded: bool = True,
    bf16: bool = False,
    chunk: int | None = None,
    kl: bool = False,
    cuda: bool = False,
    name: str = "local trainer",
) -> ProcMemory:
    """The local trainer's peak for forwards of ``rows × seq`` tokens (module docstring)."""
    P = a.total()
    acts = hf_activations(a, rows, seq, padded, bf16)
    head = logprob_chunk(a, rows * seq, chunk, bf16)
    parts = (
        Part("weights", 4 * P, "4 B/param (fp32)"),
        Part("reference weights", 4 * P if kl else 0.0, "4 B/param when algo.kl_coef > 0"),
        Part("gradients", 4 * P, "4 B/param"),
        Part("optimizer states", 8 * P, "AdamW m, v: 8 B/param"),
        Part("optimizer temporaries", 4 * P if cuda else 0.0, "foreach sqrt(v) on CUDA"),
        acts,
        head,
        Part("LM-head gradient", 4 * a.vocab * a.hidden, "4 B × V × h, first in backward"),
        Part("overhead", CUDA_GB * GB if cuda else 0.0, "CUDA context" if cuda else "-"),
    )
    p = {x.name: x.bytes for x in parts}
    fixed = p["weights"] + p["reference weights"] + p["optimizer states"] + p["overhead"]
    live = p["activations"] + p["log-prob chunk"] + p["LM-head gradient"]
    peak = fixed + max(live, p["gradients"] + p["optimizer temporaries"])
    rule = "weights + reference + optimizer + max(activations + log-prob chunk + LM-head "
    rule += "gradient, gradients + optimizer temporaries) + overhead"
    return ProcMemory(name, parts, peak, rule)


def local_engine(a, rows: int, prompt: int, seq: int, nbytes: int, cuda: bool, name="engine"):
    """The local engine's worker generating ``rows`` sequences (at most ``MAX_BATCH``) of
    ``prompt`` + new tokens up to ``seq``."""
    P = a.total()
    rows = min(rows, MAX_BATCH)
    kv = 2 * a.layers * a.kv_heads * a.head_dim * nbytes
    mlp = max(a.ffn, a.top_k * a.moe_ffn if a.experts else 0)
    layer = rows * prompt * (2 * a.hidden + 3 * mlp) * nbytes + rows * prompt * prompt * nbytes
    parts = (
        Part("weights", nbytes * P, f"{nbytes} B/param"),
        Part("KV cache", kv * rows * seq, f"2·L·nkv·d·{nbytes} B × {rows} rows × {seq}"),
        Part("logits", 16 * rows * a.vocab, f"4 copies × {rows} × V × 4 B"),
        Part("prefill transient", layer, f"(2h + 3f)·{nbytes} B × {rows} × {prompt} + mask"),
        Part("overhead", CUDA_GB * GB if cuda else 0.0, "CUDA context" if cuda else "-"),
    )
    return ProcMemory(name, parts, sum(x.bytes for x in parts), "sum of the parts")


def sglang_gpu(a, tp: int, ep: int, nbytes: int, fraction: float, gpu_gb: float, name: str):
    """One GPU of an SGLang server: its weights share and the KV pool filling the fraction."""
    experts = a.layers * a.experts * a.expert
    dense = a.total() - experts
    w = nbytes * (dense / tp + experts / max(ep, 1))
    pool = max(0.0, fraction * gpu_gb * GB - w)
    per_token = 2 * a.layers * max(1, a.kv_heads // tp) * a.head_dim * nbytes
    parts = (
        Part("weights", w, f"{nbytes} B/param, dense ÷ tp {tp}, experts ÷ ep {ep}"),
        Part(
            "KV pool",
            pool,
            f"the rest of {fraction:g} × {gpu_gb:g} GB: {pool // per_token:,.0f} tokens",
        ),
        Part(
            "workspace", (1 - fraction) * gpu_gb * GB, "outside the fraction: activations, graphs"
        ),
    )
    return ProcMemory(name, parts, sum(x.bytes for x in parts), "the whole GPU (SGLang sizes it)")


def megatron_rank(a, lay, params: tuple[int, int], rows: int, seq: int, name: str) -> ProcMemory:
    """One Megatron rank (the largest pipeline stage) for micro-batches of ``rows × seq``
    tokens; ``lay``: a ``trainers.megatron.layout.Layout``, ``params``: its (dense, expert)
    parameters on this rank (module docstring)."""
    bf16 = lay.dtype == "bfloat16"
    b = 2 if bf16 else 4
    dense, expert = params
    n = dense + expert
    w, g, o = (2, 4, 12) if bf16 else (4, 4, 8)
    opt = o * (dense / (lay.dp * lay.cp) + expert / lay.edp)
    h, d, L = a.hidden, a.head_dim, a.layers // lay.pp
    tokens = rows * seq / lay.cp
    per = 2 * h + (a.heads + 2 * a.kv_heads) * d + a.heads * d + 2 * h
    per += a.top_k * (h + 3 * a.moe_ffn) if a.experts else h + 3 * a.ffn
    layer = tokens * per * b / lay.tp
    kept = layer + tokens * h * b * L / lay.tp if lay.recompute else layer * L
    n_scores = rows * (a.heads // lay.tp) * (seq / lay.cp) * seq
    held = 6 if bf16 else 4  # the fp32 softmax kept for backward (+ its bf16 copy)
    layers_held = 1 if lay.recompute else L
    scores = n_scores * (held * layers_held + 8)  # + one layer's scores and fp32 upcast
    moe = 0.0
    if a.experts:
        gathered = tokens / lay.tp * lay.etp * lay.ep  # sequence-parallel shards, gathered
        local = gathered * a.top_k / lay.ep
        moe = (2 * gathered * h + local * (2 * h + 3 * a.moe_ffn)) * b + 4 * gathered * a.experts
    per_logit = 18 if bf16 else 20  # bf16 logits (fp32: kept), z, log-softmax, exp, product
    logits = per_logit * tokens * a.vocab / lay.tp  # each rank's vocabulary shard
    mode = "full recompute: layer inputs + one layer" if lay.recompute else f"all {L} layers"
    parts = (
        Part("weights", w * n, f"{w} B/param × {n:,} (dense {dense:,}, experts {expert:,})"),
        Part("gradients", g * n, f"{g} B/param"),
        Part(
            "optimizer states",
            0.0 if lay.optimizer_offload else opt,
            f"{o} B/param ÷ dp {lay.dp} (experts ÷ {lay.edp})"
            + ("; offloaded to host" if lay.optimizer_offload else ""),
        ),
        Part("activations", kept, f"{rows} × {seq} tokens ÷ tp {lay.tp}, {mode}"),
        Part(
            "attention scores",
            scores,
            f"[{rows}, {a.heads // lay.tp}, {seq}, {seq}] × ({held} B × {layers_held} "
            "layer(s) + 8 B)",
        ),
        Part("MoE dispatch", moe, "allgather dispatcher buffers, one layer" if moe else "-"),
        Part(
            "logits",
            logits,
            f"vocabulary shard: {per_logit} B × {int(tokens)} × {a.vocab} ÷ tp {lay.tp}",
        ),
        Part("overhead", MEGATRON_OVERHEAD_GB * GB, "CUDA context, NCCL buffers"),
    )
    p = {x.name: x.bytes for x in parts}
    fixed = p["weights"] + p["gradients"] + p["optimizer states"] + p["overhead"]
    saved = 0.0 if lay.recompute else n_scores * held * L  # what the logits' time still holds
    peak = fixed + kept + max(scores + moe, saved + logits)
    rule = "weights + gradients + optimizer + activations + max(attention scores + MoE "
    rule += "dispatch, the scores saved for backward + logits) + overhead"
    return ProcMemory(name, parts, peak, rule, host=opt if lay.optimizer_offload else 0.0)
