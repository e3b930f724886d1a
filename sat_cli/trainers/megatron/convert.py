"""Hugging Face Qwen3-MoE, Qwen3 and Llama ⇄ megatron-core GPTModel weight conversion (own converter).

Why not mbridge: mbridge 0.15.1 maps HF names onto Transformer-Engine parameter names
(``linear_qkv.layer_norm_weight`` …), while this backend uses megatron-core's *local* layer spec
(``input_layernorm.weight``, ``local_experts.N.linear_fc1.weight``) so that it runs on CPU.
The mapping is small and fully determined, so it lives here and is tested against HF logits
(tests/test_megatron_convert.py).

Mapping (``L`` = layer, ``e`` = expert; HF on-disk per-expert layout):

=================================================  ===============================================
megatron                                           HF
=================================================  ===============================================
embedding.word_embeddings.weight                   model.embed_tokens.weight
decoder.layers.L.input_layernorm.weight            model.layers.L.input_layernorm.weight
decoder.layers.L.self_attention.linear_qkv.weight  q_proj, k_proj, v_proj, interleaved per KV group
decoder.layers.L.self_attention.linear_proj.weight model.layers.L.self_attn.o_proj.weight
decoder.layers.L.self_attention.{q,k}_layernorm    model.layers.L.self_attn.{q,k}_norm.weight  (not Llama)
decoder.layers.L.pre_mlp_layernorm.weight          model.layers.L.post_attention_layernorm.weight
decoder.layers.L.mlp.router.weight                 model.layers.L.mlp.gate.weight
…mlp.experts.local_experts.e.linear_fc1.weight     cat(experts.e.gate_proj, experts.e.up_proj)
…mlp.experts.local_experts.e.linear_fc2.weight     experts.e.down_proj.weight
decoder.layers.L.mlp.linear_fc1.weight (dense)     cat(mlp.gate_proj, mlp.up_proj)
decoder.layers.L.mlp.linear_fc2.weight (dense)     model.layers.L.mlp.down_proj.weight
decoder.final_layernorm.weight                     model.norm.weight
output_layer.weight                                lm_head.weight (absent when tied)
=================================================  ===============================================

``linear_qkv`` rows are ordered per KV group ``g``: the ``nh/ng`` query heads of the group, then
its key head, then its value head (megatron's layout), each ``head_dim`` rows.

Tensor parallelism (``split_tp`` / ``gather_tp``; megatron-core's local-spec layout, experts not
split: ``expert_tensor_parallel_size = 1``): the vocabulary rows of ``embedding`` and
``output_layer`` and the rows of ``linear_qkv`` (whole KV groups, since groups are the outer
row blocks: rank ``r`` holds groups ``r*ng/tp …``, with their query heads) are split in
contiguous blocks, ``linear_proj`` by columns (the same heads); norms, router and experts are
whole on every tensor-parallel rank. A dense MLP is split like attention: ``linear_fc1`` by
FFN rows, but each rank holds ``[gate_r; up_r]`` (its block of gate rows, then the same block of
up rows: megatron-core's SwiGLU chunks the local output in two), ``linear_fc2`` by the same
FFN columns (``tp_shard`` / ``tp_merge``). Pipeline parallel size 1. Expert parallelism: ``hf_to_megatron`` takes the
slice of experts a rank owns (``ep_rank``/``ep_size``); export needs all experts on one rank
(``megatron_to_hf`` of a full state). HF checkpoints may store experts either per expert (the
on-disk layout of transformers 5 ``save_pretrained``) or fused (``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``); both load.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from . import hf_io
from .hf_io import hf_dims, same_tensors
from .model import hf_get


# --------------------------------------------------------------------------- HF checkpoints
def load_hf_state(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory (one file or shards), experts per-expert."""
    return unfuse_experts(hf_io.read_all(model_dir))


def unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors (transformers 5 in-memory layout) as per-expert keys."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", key)
        if m is None:
            out[key] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:  # [E, H, I]
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    with open(Path(model_dir) / "config.json") as f:
        cfg = json.load(f)
    # transformers 5 writes num_local_experts; older configs use num_experts
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    return cfg


# --------------------------------------------------------------------------- conversion
def hf_to_megatron(
    hf_state: dict[str, torch.Tensor],
    hf_config: Any,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Megatron state dict (local spec, TP=PP=1) for the experts owned by ``ep_rank``."""
    nh, ng, hd, n_layers, n_experts = hf_dims(hf_config)
    if n_experts % ep_size:
        raise ValueError(f"num_experts={n_experts} is not divisible by ep_size={ep_size}")
    per_rank = n_experts // ep_size
    hf = dict(hf_state)
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise KeyError(f"HF checkpoint lacks {key}")
        used.add(key)
        return hf[key]

    mg: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    if not hf_get(hf_config, "tie_word_embeddings", False):
        mg["output_layer.weight"] = take("lm_head.weight")
    for layer in range(n_layers):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        q = take(h + "self_attn.q_proj.weight")  # [nh*hd, H]
        k = take(h + "self_attn.k_proj.weight")  # [ng*hd, H]
        v = take(h + "self_attn.v_proj.weight")  # [ng*hd, H]
        hidden = q.shape[1]
        qkv = torch.cat(
            [q.view(ng, nh // ng * hd, hidden), k.view(ng, hd, hidden), v.view(ng, hd, hidden)],
            dim=1,
        )  # [ng, (nh/ng + 2)*hd, H]
        mg[m + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, hidden)
        for mg_name, hf_name in same_tensors(hf_config):
            mg[m + mg_name] = take(h + hf_name)
        if not n_experts:  # dense SwiGLU MLP
            gate, up = take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")
            mg[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)  # [2F, H]
            mg[m + "mlp.linear_fc2.weight"] = take(h + "mlp.down_proj.weight")  # [H, F]
        for e in range(n_experts):
            gate = take(h + f"mlp.experts.{e}.gate_proj.weight")  # [I, H]
            up = take(h + f"mlp.experts.{e}.up_proj.weight")  # [I, H]
            down = take(h + f"mlp.experts.{e}.down_proj.weight")  # [H, I]
            if e // per_rank != ep_rank:
                continue
            local = f"{m}mlp.experts.local_experts.{e % per_rank}."
            mg[local + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)  # [2I, H]
            mg[local + "linear_fc2.weight"] = down
    unused = sorted(set(hf) - used)
    if unused:
        raise KeyError(f"HF checkpoint has tensors the converter does not map: {unused[:5]}")
    return mg


def tp_split_dim(name: str) -> int | None:
    """The dimension along which megatron-core splits ``name`` over tensor-parallel ranks
    (column-parallel: rows, row-parallel: columns), or None for a tensor every rank holds whole."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0  # VocabParallelEmbedding / ColumnParallelLinear: vocabulary rows
    if name.endswith("self_attention.linear_qkv.weight"):
        return 0  # ColumnParallelLinear: rows, whole KV groups per rank
    if name.endswith(".mlp.linear_fc1.weight"):
        return 0  # dense MLP, ColumnParallelLinear: FFN rows (of gate and of up, see tp_shard)
    if name.endswith("self_attention.linear_proj.weight") or name.endswith(
        ".mlp.linear_fc2.weight"
    ):
        return 1  # RowParallelLinear: the input columns of the rank's heads / FFN rows
    return None  # norms, router, experts (expert_tensor_parallel_size = 1)


def _gated(name: str) -> bool:
    """A dense gated MLP's ``linear_fc1`` (``[gate; up]``): each TP rank holds the same block
    of gate rows and of up rows, ``[gate_r; up_r]`` (megatron-core's SwiGLU chunks its local
    output in two), not a contiguous block of the whole."""
    return name.endswith(".mlp.linear_fc1.weight")


def tp_shard(name: str, t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the full tensor ``name`` (``t`` itself when not split)."""
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return t
    if t.shape[dim] % (2 * tp_size if _gated(name) else tp_size):
        raise ValueError(f"{name}: size {t.shape[dim]} is not divisible by tp={tp_size}")
    if _gated(name):
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return t.chunk(tp_size, dim=dim)[tp_rank]


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor ``name`` from every TP rank's part, in rank order (``tp_shard``'s inverse)."""
    dim = tp_split_dim(name)
    if dim is None:
        return parts[0]
    if _gated(name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves])
    return torch.cat(parts, dim=dim)


def split_tp(mg_state: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict:
    """Tensor-parallel rank ``tp_rank``'s shard of a full megatron state (views, except a dense
    MLP's ``linear_fc1``)."""
    return {key: tp_shard(key, t, tp_rank, tp_size) for key, t in mg_state.items()}


def gather_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full megatron state from every tensor-parallel rank's shard (in rank order)."""
    return {key: tp_merge(key, [s[key] for s in shards]) for key in shards[0]}


def megatron_to_hf(
    mg_state: dict[str, torch.Tensor],
    hf_config: Any,
    *,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """HF per-expert state from a megatron state dict (``_extra_state`` entries are ignored).

    ``expert_offset`` is the global index of local expert 0 (``ep_rank * E / ep_size``); for a
    full (world size 1 or gathered) state it is 0.
    """
    nh, ng, hd, n_layers, n_experts = hf_dims(hf_config)
    mg = {k: v for k, v in mg_state.items() if not k.endswith("_extra_state")}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return mg[key].detach()

    hf: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": take("embedding.word_embeddings.weight"),
        "model.norm.weight": take("decoder.final_layernorm.weight"),
    }
    if "output_layer.weight" in mg and not hf_get(hf_config, "tie_word_embeddings", False):
        hf["lm_head.weight"] = take("output_layer.weight")
    expert_re = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")
    for layer in range(n_layers):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        qkv = take(m + "self_attention.linear_qkv.weight")
        hidden = qkv.shape[1]
        qkv = qkv.view(ng, (nh // ng + 2) * hd, hidden)
        q, k, v = qkv.split([nh // ng * hd, hd, hd], dim=1)
        hf[h + "self_attn.q_proj.weight"] = q.reshape(nh * hd, hidden)
        hf[h + "self_attn.k_proj.weight"] = k.reshape(ng * hd, hidden)
        hf[h + "self_attn.v_proj.weight"] = v.reshape(ng * hd, hidden)
        for mg_name, hf_name in same_tensors(hf_config):
            hf[h + hf_name] = take(m + mg_name)
        if not n_experts:
            gate, up = take(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
            hf[h + "mlp.gate_proj.weight"] = gate
            hf[h + "mlp.up_proj.weight"] = up
            hf[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    for key in list(mg):
        match = expert_re.match(key)
        if match is None or not key.endswith("linear_fc1.weight"):
            continue
        layer, local = int(match.group(1)), int(match.group(2))
        e = expert_offset + local
        h = f"model.layers.{layer}.mlp.experts.{e}."
        gate, up = take(key).chunk(2, dim=0)
        hf[h + "gate_proj.weight"] = gate
        hf[h + "up_proj.weight"] = up
        hf[h + "down_proj.weight"] = take(key.replace("linear_fc1", "linear_fc2"))
    unused = sorted(set(mg) - used)
    if unused:
        raise KeyError(f"megatron state has tensors the converter does not map: {unused[:5]}")
    return {k: v.contiguous() for k, v in hf.items()}


def load_hf_into_megatron(
    model: torch.nn.Module,
    model_dir: str | os.PathLike,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    select=None,
) -> None:
    """Copy a HF checkpoint into a megatron GPTModel built by ``model.build_gpt_model`` (this
    rank's experts and tensor-parallel shard; ``select(state)``: its pipeline stage's part).

    Lazy (``hf_io.rank_plan``): only the tensors, rows and columns this rank holds are read,
    one at a time, each copied into its parameter before the next is read. ``select`` is
    applied to the mapping of names to readers, so it must only pick and rename keys."""
    cfg = read_hf_config(model_dir)
    reader = hf_io.CheckpointReader(model_dir)
    plan = hf_io.rank_plan(
        reader, cfg, ep_rank=ep_rank, ep_size=ep_size, tp_rank=tp_rank, tp_size=tp_size
    )
    if select is not None:
        plan = select(plan)
    params = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(params) - set(plan))
    extra = sorted(set(plan) - set(params))
    if missing or extra:
        raise KeyError(f"conversion mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for k, p in params.items():
            t = plan[k]()
            if p.shape != t.shape:
                raise ValueError(f"{k}: model {tuple(p.shape)} vs converted {tuple(t.shape)}")
            p.copy_(t.to(p.dtype))
            del t


def megatron_state_to_hf(model: torch.nn.Module, hf_config: Any) -> dict[str, torch.Tensor]:
    """HF state of a world-size-1 (or expert-complete) megatron model."""
    return megatron_to_hf(model.state_dict(), hf_config)
