"""The HF ``config.json`` of a model folder, or of a hub id through transformers."""

from __future__ import annotations

import json
from pathlib import Path


def read_hf_config(path: str) -> dict:
    p = Path(path) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()
