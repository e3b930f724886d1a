"""The tensors an engine serves, named and fused as the engine holds them, for verification.

``engine.verify_weights`` compares the engine's own per-tensor checksums with the checksums of
what the trainer sent, computed here on the trainer's side from the sent ``(HF name, tensor)``
list, in the engine's dtype:

- ``"hf"`` (the local engine): HF checkpoint names, unchanged (the worker hashes its model's
  state in the same names: fused experts are split back, ``engines.local.sync.served_state``).
- ``"sglang"`` (SGLang 0.5.23, one rank per server; read in ``srt/models/qwen3_moe.py``'s
  ``load_weights`` and checked against ``/weights_checker`` of a real server):
  ``q_proj``/``k_proj``/``v_proj`` → ``qkv_proj`` (rows concatenated in that order, weight and
  bias), dense ``gate_proj``/``up_proj`` → ``gate_up_proj``, the experts
  ``experts.E.{gate,up,down}_proj.weight`` → ``experts.w13_weight`` ``[E, 2I, H]`` (gate rows,
  then up rows, per expert) and ``experts.w2_weight`` ``[E, H, I]``; everything else keeps its
  name; ``lm_head.weight`` is not served when the embeddings are tied.

Concatenating along the first dimension (or stacking) contiguous tensors concatenates their
bytes, so a fused tensor's hash is the hash of its parts' bytes in order: nothing is built.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

LAYOUTS = ("hf", "sglang")
_QKV = re.compile(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)")
_DENSE = re.compile(r"(.*\.mlp)\.(gate|up)_proj\.weight")
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _hash_parts(parts: list) -> str:
    import torch

    h = hashlib.sha256()
    for t in parts:
        t = t.detach().cpu().contiguous()
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"{int.from_bytes(h.digest()[:8], 'big'):016x}"


def served_parts(
    named: Iterable[tuple[str, object]], layout: str, tied: bool = False
) -> dict[str, list]:
    """``{served name: [the sent tensors whose bytes it holds, in order]}``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; known: {LAYOUTS}")
    named = dict(named)
    if layout == "hf":
        return {k: [v] for k, v in named.items()}
    out: dict[str, list] = {}
    qkv: dict[str, dict[str, object]] = {}
    dense: dict[str, dict[str, object]] = {}
    experts: dict[str, dict[tuple[int, str], object]] = {}
    for name, t in named.items():
        if tied and name == "lm_head.weight":
            continue
        if m := _QKV.fullmatch(name):
            qkv.setdefault(f"{m[1]}.qkv_proj.{m[3]}", {})[m[2]] = t
        elif m := _EXPERT.fullmatch(name):
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        elif m := _DENSE.fullmatch(name):
            dense.setdefault(f"{m[1]}.gate_up_proj.weight", {})[m[2]] = t
        else:
            out[name] = [t]
    for key, parts in qkv.items():
        out[key] = [_need(parts, p, key) for p in "qkv"]
    for key, parts in dense.items():
        out[key] = [_need(parts, p, key) for p in ("gate", "up")]
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.w13_weight"] = [
            _need(parts, (e, p), prefix) for e in range(n) for p in ("gate", "up")
        ]
        out[f"{prefix}.w2_weight"] = [_need(parts, (e, "down"), prefix) for e in range(n)]
    return out


def _need(parts: dict, key, where: str):
    if key not in parts:
        raise KeyError(f"{where}: the sent weights lack part {key!r} of a fused tensor")
    return parts[key]


def expected_checksums(
    named: Iterable[tuple[str, object]], layout: str, dtype: str | None = None, tied: bool = False
) -> dict[str, str]:
    """The checksums an engine of ``layout`` must report after loading ``named`` (cast to
    ``dtype`` first when given: the engine's dtype)."""
    import torch

    cast = getattr(torch, dtype) if dtype else None

    def as_served(t):
        return t if cast is None or t.dtype == cast else t.to(cast)

    return {
        name: _hash_parts([as_served(t) for t in parts])
        for name, parts in served_parts(named, layout, tied).items()
    }


def compare(expected: dict[str, str], served: dict[str, str]) -> list[str]:
    """What differs, one line per tensor (empty: the engine serves exactly what was sent)."""
    problems = [f"{n}: not served" for n in sorted(set(expected) - set(served))]
    problems += [f"{n}: served but never sent" for n in sorted(set(served) - set(expected))]
    problems += [
        f"{n}: served {served[n]}, sent {expected[n]}"
        for n in sorted(set(expected) & set(served))
        if served[n] != expected[n]
    ]
    return problems
