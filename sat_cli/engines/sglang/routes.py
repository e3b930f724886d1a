"""R3's routed experts as SGLang returns them (``meta_info.routed_experts``): the model facts
needed to decode them (``MoEDims``, read from the served model's config.json as SGLang's
capturer reads them) and the decoding of the base64 little-endian int32 block into
``[prompt_len + completion_len - 1, num_layers, top_k]``, refused (``EngineError``) on any size
or range mismatch."""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sat_cli.errors import EngineError


@dataclass(frozen=True)
class MoEDims:
    num_layers: int  # config.json num_hidden_layers
    top_k: int  # config.json num_experts_per_tok
    num_experts: int | None = None  # config.json num_experts (for a range check), if known


def read_moe_dims(model_path: str | os.PathLike) -> MoEDims:
    """Read ``num_hidden_layers``, ``num_experts_per_tok`` (and ``num_experts``) from config.json.

    SGLang's routed-experts capturer sizes its buffers from the same two keys of the HF config.
    """
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise EngineError(f"R3 needs the model's config.json, not found at {path}") from e
    missing = [k for k in ("num_hidden_layers", "num_experts_per_tok") if k not in config]
    if missing:
        raise EngineError(f"{path} lacks {missing}: routed experts need an MoE config")
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts; older: num_experts.
    num_experts = next(
        (
            config[k]
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if k in config
        ),
        None,
    )
    return MoEDims(
        num_layers=int(config["num_hidden_layers"]),
        top_k=int(config["num_experts_per_tok"]),
        num_experts=int(num_experts) if num_experts is not None else None,
    )


def decode_routed_experts(
    b64: str, *, num_tokens: int, num_layers: int, top_k: int, num_experts: int | None = None
) -> np.ndarray:
    """base64 little-endian int32 → int32 array ``[num_tokens, num_layers, top_k]``.

    ``num_tokens`` is ``prompt_len + completion_len - 1`` (the last sampled token is never fed
    through the model). Every size or range mismatch raises EngineError: R3 must not silently
    train on misaligned routing.
    """
    if not isinstance(b64, str):
        raise EngineError(f"routed_experts must be a base64 string, got {type(b64).__name__}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise EngineError(f"routed_experts is not valid base64: {e}") from e
    if len(raw) % 4:
        raise EngineError(f"routed_experts has {len(raw)} bytes, not a whole number of int32")
    flat = np.frombuffer(raw, dtype="<i4")
    per_token = num_layers * top_k
    if flat.size % per_token:
        raise EngineError(
            f"routed_experts has {flat.size} int32 values, not divisible by "
            f"num_layers*top_k = {num_layers}*{top_k}; does config.json match the served model?"
        )
    rows = flat.size // per_token
    if rows != num_tokens:
        raise EngineError(
            f"routed_experts covers {rows} tokens, expected prompt_len + completion_len - 1 = "
            f"{num_tokens}"
        )
    out = flat.astype(np.int32).reshape(rows, num_layers, top_k)
    if out.size and (out.min() < 0 or (num_experts is not None and out.max() >= num_experts)):
        raise EngineError(
            f"routed_experts has expert ids in [{out.min()}, {out.max()}], outside "
            f"[0, {num_experts})"
        )
    return out
