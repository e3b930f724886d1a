"""HF checkpoint folders written the way transformers writes them, for the trainers (export,
published weight versions) and the weight sync (``weightsync/sender.py``: the disk fallback).

Writing (``save_sharded``): transformers' layout: tensors in name order, a new shard whenever
the next tensor would take the current one past ``max_shard_size`` bytes (a tensor larger than
the cap gets a shard of its own); one shard is written as ``model.safetensors`` without an
index, several as ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {"total_parameters": n, "total_size": bytes}, "weight_map": {name: file}}``,
as transformers 5 writes it).

``save_hf_checkpoint`` writes the weights and the config/tokenizer files of the source model
(``HF_SIDE_FILES``) into a folder that appears atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sat_cli.util.fsio import parse_size, staged_dir

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # transformers' default "5GB"

# Files copied next to exported weights so that transformers / SGLang can load the directory.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def save_hf_checkpoint(
    state: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the weights (``model.safetensors``, or shards of at most ``max_shard_size`` bytes
    plus ``model.safetensors.index.json``: ``save_sharded``) and the config/tokenizer
    files of ``source_dir``.

    The directory appears atomically: everything is written to a temporary sibling which is
    then renamed to ``out_dir`` (an existing ``out_dir`` is replaced).
    """
    out_dir = Path(out_dir)
    with staged_dir(out_dir, prefix=f".{out_dir.name}.") as tmp:
        save_sharded(state, tmp, max_shard_size)
        for name in HF_SIDE_FILES:
            src = Path(source_dir) / name
            if src.exists():
                shutil.copyfile(src, tmp / name)
    return out_dir


def save_sharded(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str
) -> list[str]:
    """Write ``tensors`` into ``folder`` in transformers' sharded layout (module doc); returns
    the file names written."""
    from safetensors.torch import save_file

    cap = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = params = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > cap:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
        params += t.numel()
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": weight_map,
    }
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX_NAME]
