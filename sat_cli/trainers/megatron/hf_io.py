"""Lazy, per-rank reads and sharded writes of HF safetensors checkpoints.

Reading (``CheckpointReader``, ``rank_plan``): a checkpoint is one ``model.safetensors`` or
shards named by ``model.safetensors.index.json`` (any other ``*.safetensors`` set is read by
its headers). Only the headers are parsed up front; a tensor is read when asked for, with plain
file reads of exactly its bytes (a tensor-parallel rank's row block: only those rows), not
through a memory map (see ``CheckpointReader`` for why). ``rank_plan`` maps every megatron parameter name a rank
holds (global layer numbers, local expert numbers) to a thunk that reads exactly that rank's
part: its experts (``ep``), its TP shard (vocabulary rows of the embedding and output layer,
the rows of its KV groups in q/k/v, its heads' columns of ``o_proj``; in a dense model its
block of FFN rows of ``gate_proj`` and ``up_proj`` and columns of ``down_proj``); a pipeline stage then
keeps the thunks of its layers (``pipeline.select_stage`` works on any mapping), so no rank
materialises a tensor it does not own. The result equals ``split_tp(hf_to_megatron(full))``
bit for bit (tests/test_megatron_shard.py). The reader counts what it read (``read_log``).

Writing: ``sat_cli.models.hf_checkpoint`` (``save_sharded``, ``save_hf_checkpoint``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sat_cli.models.hf_checkpoint import INDEX_NAME

from .model import family, head_dim, hf_get

# per-layer tensors that are the same in both layouts: (megatron-core name, HF name), in the
# order both conversions write them; q/k norms only in families that have them (not Llama),
# the router only in MoE models
_QK_NORMS = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_ROUTER = (("mlp.router.weight", "mlp.gate.weight"),)


def same_tensors(hf_config: Any) -> tuple[tuple[str, str], ...]:
    fam = family(hf_config)
    return (
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        *(_QK_NORMS if fam.qk_norm else ()),
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        *(_ROUTER if fam.moe else ()),
    )


def hf_dims(hf_config: Any) -> tuple[int, int, int, int, int]:
    """``(heads, KV heads, head_dim, layers, experts)``; experts 0 for a dense model."""
    nh = hf_get(hf_config, "num_attention_heads")
    ng = hf_get(hf_config, "num_key_value_heads") or nh
    experts = hf_get(hf_config, "num_experts") if family(hf_config).moe else 0
    return nh, ng, head_dim(hf_config), hf_get(hf_config, "num_hidden_layers"), experts


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """``(offset of the data, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors
    file: an 8-byte little-endian header length, then the JSON header. A length past the file's
    end or safetensors' limit is a ``ValueError`` (read as asked, 2**60 was a ``MemoryError``)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path} is not a safetensors file (header length {n}, {size} bytes)")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return 8 + n, header


class CheckpointReader:
    """Lazy tensors of a HF checkpoint folder (module doc). ``read_log`` lists
    ``(name, elements kept)`` for every read, in order; ``bytes_read`` counts file bytes.

    Tensors are read with plain file reads into freshly allocated tensors, not through a
    memory map: pages of a mapped file count towards the process's resident set size as they
    are touched, so reading a whole file through ``safe_open``'s map costs its size in peak
    RSS on every rank even when the tensors are dropped right after (measured:
    docs/megatron.md). Row blocks (dimension 0) are read directly; other slices (the
    ``o_proj`` columns of a TP rank) read the tensor and keep a copy of the slice."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir}")
        self._meta: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            start, header = read_header(self.dir / f)
            for key, info in header.items():
                if info["dtype"] not in _DTYPES:
                    raise ValueError(f"{f}: {key} has dtype {info['dtype']}, not supported")
                self._meta[key] = (self.dir / f, start, info)
        self.read_log: list[tuple[str, int]] = []
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._meta)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def _info(self, key: str) -> tuple[Path, int, dict]:
        if key not in self._meta:
            raise KeyError(f"HF checkpoint lacks {key}")
        return self._meta[key]

    def shape(self, key: str) -> list[int]:
        return list(self._info(key)[2]["shape"])

    def _read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        path, start, info = self._info(key)
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        if rows is not None:
            lo, hi, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"{key}: only contiguous row blocks are read directly")
            row = (end - begin) // max(shape[0], 1)
            begin, shape[0] = begin + lo * row, max(hi - lo, 0)
        t = torch.empty(shape, dtype=_DTYPES[info["dtype"]])
        buf = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        with open(path, "rb", buffering=0) as f:
            f.seek(start + begin)
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise OSError(f"{path.name}: {key} is truncated")
                done += n
        self.bytes_read += len(buf)
        return t

    def get(self, key: str, index: Any = None) -> torch.Tensor:
        """Tensor ``key``, or only ``key[index]`` (slices, e.g. ``(slice(None), slice(a, b))``)."""
        if index is None:
            t = self._read(key)
        elif isinstance(index, slice):
            t = self._read(key, index)
        else:
            t = self._read(key)[index].clone()
        self.read_log.append((key, t.numel()))
        return t


def read_all(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (single file or shards)."""
    reader = CheckpointReader(model_dir)
    return {k: reader.get(k) for k in reader.keys()}


def _block(n: int, rank: int, size: int, what: str) -> slice:
    if n % size:
        raise ValueError(f"{what}: size {n} is not divisible by tp={size}")
    per = n // size
    return slice(rank * per, (rank + 1) * per)


def rank_plan(
    reader: CheckpointReader,
    cfg: dict,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, Callable[[], torch.Tensor]]:
    """``{megatron name: thunk}`` of this (ep, tp) rank's tensors (module doc); unknown
    checkpoint tensors raise ``KeyError`` as ``convert.hf_to_megatron`` does."""
    nh, ng, hd, n_layers, n_experts = hf_dims(cfg)
    if n_experts % ep_size:
        raise ValueError(f"num_experts={n_experts} is not divisible by ep_size={ep_size}")
    if ng % tp_size:
        raise ValueError(f"num_key_value_heads={ng} is not divisible by tp={tp_size}")
    per_rank = n_experts // ep_size
    get = reader.get
    known: set[str] = {"model.embed_tokens.weight", "model.norm.weight"}

    def rows(key: str) -> Callable[[], torch.Tensor]:
        if tp_size == 1:
            return lambda: get(key)
        block = _block(reader.shape(key)[0], tp_rank, tp_size, key)
        return lambda: get(key, block)

    plan: dict[str, Callable[[], torch.Tensor]] = {
        "embedding.word_embeddings.weight": rows("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": lambda: get("model.norm.weight"),
    }
    if not hf_get(cfg, "tie_word_embeddings", False):
        known.add("lm_head.weight")
        plan["output_layer.weight"] = rows("lm_head.weight")
    g = ng // tp_size  # KV groups of this TP rank
    groups = slice(tp_rank * g, (tp_rank + 1) * g)
    qh = nh // ng * hd  # query rows per group

    def qkv(h: str) -> torch.Tensor:
        q = get(h + "q_proj.weight", slice(groups.start * qh, groups.stop * qh))
        k = get(h + "k_proj.weight", slice(groups.start * hd, groups.stop * hd))
        v = get(h + "v_proj.weight", slice(groups.start * hd, groups.stop * hd))
        hidden = q.shape[1]
        parts = [q.view(g, qh, hidden), k.view(g, hd, hidden), v.view(g, hd, hidden)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    def expert(h: str, e: int) -> tuple[Callable, Callable]:
        fused = h + "mlp.experts.gate_up_proj"
        if fused in reader:  # [E, 2I, H] and [E, H, I]
            return (
                lambda: get(fused, slice(e, e + 1))[0],
                lambda: get(h + "mlp.experts.down_proj", slice(e, e + 1))[0],
            )
        x = f"{h}mlp.experts.{e}."
        return (
            lambda: torch.cat([get(x + "gate_proj.weight"), get(x + "up_proj.weight")], dim=0),
            lambda: get(x + "down_proj.weight"),
        )

    for layer in range(n_layers):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        a = h + "self_attn."
        known.update(a + f"{p}_proj.weight" for p in "qkv")
        plan[m + "self_attention.linear_qkv.weight"] = lambda a=a: qkv(a)
        for mg_name, hf_name in same_tensors(cfg):
            known.add(h + hf_name)
            if mg_name == "self_attention.linear_proj.weight" and tp_size > 1:
                cols = _block(nh * hd, tp_rank, tp_size, h + hf_name)
                plan[m + mg_name] = lambda k=h + hf_name, c=cols: get(k, (slice(None), c))
            else:
                plan[m + mg_name] = lambda k=h + hf_name: get(k)
        if not n_experts:  # dense MLP: [gate; up] rows and down columns of this TP rank
            gate, up, down = (f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
            known.update((gate, up, down))
            ffn = _block(reader.shape(gate)[0], tp_rank, tp_size, gate)
            plan[m + "mlp.linear_fc1.weight"] = lambda g=gate, u=up, f=ffn: torch.cat(
                [get(g, f), get(u, f)]
            )
            if tp_size == 1:
                plan[m + "mlp.linear_fc2.weight"] = lambda d=down: get(d)
            else:
                plan[m + "mlp.linear_fc2.weight"] = lambda d=down, f=ffn: get(d, (slice(None), f))
            continue
        known.update((h + "mlp.experts.gate_up_proj", h + "mlp.experts.down_proj"))
        for e in range(n_experts):
            known.update(f"{h}mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))
            if e // per_rank != ep_rank:
                continue
            fc1, fc2 = expert(h, e)
            local = f"{m}mlp.experts.local_experts.{e % per_rank}."
            plan[local + "linear_fc1.weight"] = fc1
            plan[local + "linear_fc2.weight"] = fc2
    unknown = sorted(set(reader.keys()) - known)
    if unknown:
        raise KeyError(f"HF checkpoint has tensors the converter does not map: {unknown[:5]}")
    return plan
