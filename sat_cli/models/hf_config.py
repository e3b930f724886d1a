"""The HF ``config.json`` of a model folder, read once through one bounded, checked reader, or
of a hub id through transformers.

A model folder's ``config.json`` is a user file (``model.path``, ``ckpt=``, a checkpoint's
``trainer/model``): :func:`read_config_json` reads it as every user file is read
(:mod:`sat_cli.util.readers`: a regular file, at most ``MAX_BYTES``, strict UTF-8 JSON without
``NaN`` or overflowing numbers, nested at most ``MAX_DEPTH`` levels) and checks the fields a
loader builds from: the sizes of :data:`SIZE_BOUNDS` are integers within bounds (a
``num_hidden_layers`` of 100 000 made the meta-device model that the weights check builds run
for minutes), ``architectures`` a list of names, ``model_type`` a name. Anything else is
``ModelConfigError``: one line, exit 2.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError

MAX_BYTES = 4 << 20  # real ones are a few kilobytes
MAX_DEPTH = 16
# size -> (least, most): above the largest published models' (hidden 16 384, 128 layers,
# 256 experts, a vocabulary of 256 000, contexts of 10 M) by a margin
SIZE_BOUNDS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 18),
    "intermediate_size": (0, 1 << 20),
    "moe_intermediate_size": (0, 1 << 20),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 1 << 16),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 30),
    "num_experts": (0, 4096),
    "num_local_experts": (0, 4096),
    "n_routed_experts": (0, 4096),
    "num_experts_per_tok": (0, 4096),
}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
MAX_EXPERT_LAYERS = 1 << 15  # DeepSeek-V3: 61 × 256; Qwen3-235B-A22B: 94 × 128


class ModelConfigError(UserError):
    """A model folder's ``config.json`` that cannot describe a model (exit code 2)."""


def check_config(cfg: Any, where: str) -> dict:
    """``cfg`` if it is a JSON object whose sizes, ``architectures`` and ``model_type`` are
    what a loader can build from (module docstring); ``ModelConfigError`` naming the field."""
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{where} is not a JSON object")
    sections = [("", cfg)] + [
        (f"{k}.", v) for k, v in cfg.items() if k.endswith("_config") and isinstance(v, dict)
    ]
    for prefix, section in sections:
        for key, (lo, hi) in SIZE_BOUNDS.items():
            v = section.get(key)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi
            ):
                raise ModelConfigError(
                    f"{where}: {prefix}{key} must be an integer in [{lo}, {hi}], got {v!r:.60}"
                )
        experts = max(section.get(k) or 0 for k in EXPERT_KEYS)
        if (section.get("num_hidden_layers") or 1) * max(experts, 1) > MAX_EXPERT_LAYERS:
            raise ModelConfigError(
                f"{where}: {prefix}num_hidden_layers × experts = {section['num_hidden_layers']} × "
                f"{experts} is more than {MAX_EXPERT_LAYERS} expert layers (each is a module a "
                "loader builds and names)"
            )
    archs = cfg.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        raise ModelConfigError(f"{where}: architectures must be a list of names, got {archs!r:.60}")
    kind = cfg.get("model_type")
    if kind is not None and not (isinstance(kind, str) and re.fullmatch(r"\w[\w-]{0,99}", kind)):
        raise ModelConfigError(f"{where}: model_type must be a name, got {kind!r:.60}")
    return cfg


def read_config_json(folder: str | os.PathLike, what: str = "model.path") -> dict:
    """The checked ``config.json`` of the model folder ``folder`` (module docstring)."""
    from sat_cli.util.readers import parse_json, read_text

    where = f"{what}={str(folder)!r}: config.json"
    text = read_text(
        Path(folder) / "config.json", what=where, error=ModelConfigError, max_bytes=MAX_BYTES
    )
    cfg = parse_json(text, what=where, error=ModelConfigError, max_depth=MAX_DEPTH)
    return check_config(cfg, where)


def config_if_usable(folder: str | os.PathLike, what: str = "model.path") -> dict | None:
    """:func:`read_config_json`, or None when ``folder`` has no usable ``config.json`` (a hub
    id, a trainer without an HF model folder: whoever loads the model reports it)."""
    try:
        return read_config_json(folder, what)
    except ModelConfigError:
        return None


def read_hf_config(path: str | os.PathLike, what: str = "model.path") -> dict:
    """The checked ``config.json`` of a local folder, else the config of hub id ``path``."""
    if Path(path).is_dir() or os.path.lexists(Path(path) / "config.json"):
        return read_config_json(path, what)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path)).to_dict()
