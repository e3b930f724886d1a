"""The stop rule both rollout engines use: the one SGLang 0.5.23 applies.

A response ends at the first token in the union of: the request's ``stop_token_ids``; the EOS
ids of ``config.json`` and ``generation_config.json`` (SGLang ``ModelConfig._get_hf_eos_token_id``);
the tokenizer's EOS; and the tokenizer's added tokens among a few turn-final markers that some
checkpoints ship without EOS metadata (SGLang ``attach_additional_stop_token_ids``:
``<|eom_id|>``, ``<|content_model_end_sampling|>``, ``<|ifm|im_end|>``). The stop token is part of
the response and has a log-prob. ``ignore_eos`` is not used by sat.
"""

from __future__ import annotations

import json
from pathlib import Path

ADDITIONAL_STOP_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def model_stop_ids(model_dir: str | Path, tokenizer=None) -> frozenset[int]:
    """The model's own stop ids (everything but the request's), read from ``model_dir``."""
    root = Path(model_dir)
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = root / name
        if f.is_file():
            out |= _ids(json.loads(f.read_text()).get("eos_token_id"))
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(root))
    out |= _ids(tokenizer.eos_token_id)
    added = tokenizer.get_added_vocab()
    out |= {int(added[t]) for t in ADDITIONAL_STOP_TEXTS if t in added}
    return frozenset(out)
