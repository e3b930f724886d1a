"""Supervised warm start: determinism for a seed, the config-hash cache, the accuracy band (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from sat_cli.models.tiny_moe import load_model
from sat_cli.models.warmstart import (
    WarmStartSettings,
    ensure_warm_start,
    sampled_accuracy,
    train_warm_start,
)
from sat_cli.tasks.toy import ToyTask

SHORT = dict(batch_size=32, eval_every=3, max_steps=3, heldout_size=40)


def test_short_warm_start_is_deterministic_for_a_seed():
    a, _, info_a = train_warm_start(
        WarmStartSettings(seed=1, target_accuracy=2.0, **SHORT), log=None
    )
    b, _, info_b = train_warm_start(
        WarmStartSettings(seed=1, target_accuracy=2.0, **SHORT), log=None
    )
    c, _, _ = train_warm_start(WarmStartSettings(seed=2, target_accuracy=2.0, **SHORT), log=None)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert info_a["steps"] == info_b["steps"] == 3 and info_a["loss"] == info_b["loss"]
    assert not info_a["reached"]
    # 3 steps at lr 3e-3 move the weights away from the seed's initialisation
    fresh, _, _ = train_warm_start(
        WarmStartSettings(seed=1, target_accuracy=2.0, **{**SHORT, "max_steps": 0}), log=None
    )
    assert not torch.equal(a.lm_head.weight, fresh.lm_head.weight)


def test_ensure_warm_start_caches_by_config_hash(tmp_path):
    logs: list[str] = []
    kw = dict(batch_size=16, eval_every=2, max_steps=2, heldout_size=20, target_accuracy=0.0)
    p1 = ensure_warm_start(
        tmp_path, WarmStartSettings(seed=0, **kw), use_shipped=False, log=logs.append
    )
    meta = json.loads((p1 / "warmstart.json").read_text())
    assert meta["steps"] == 2 and meta["reached"] and p1.name == f"tiny_moe_warm-{meta['key'][:12]}"
    p2 = ensure_warm_start(
        tmp_path, WarmStartSettings(seed=0, **kw), use_shipped=False, log=logs.append
    )
    assert p2 == p1 and logs[-1].startswith("warm start: cached")
    p3 = ensure_warm_start(tmp_path, WarmStartSettings(seed=1, **kw), use_shipped=False, log=None)
    assert p3 != p1  # another seed is another cache entry
    # the cached folder is a plain HF checkpoint
    assert load_model(p1).config.num_experts == 8


@pytest.mark.slow
def test_full_warm_start_lands_in_the_documented_band(tmp_path):
    path = ensure_warm_start(tmp_path, use_shipped=False, num_threads=1, log=print)
    meta = json.loads((path / "warmstart.json").read_text())
    assert meta["reached"] and 0.2 <= meta["accuracy"] < 0.5
    # re-measured on the saved checkpoint with another sampling seed: still in the band
    from sat_cli.models.tiny_moe import load_tokenizer

    acc = sampled_accuracy(
        load_model(path), load_tokenizer(path), ToyTask(heldout_size=200), seed=123
    )
    assert 0.1 <= acc < 0.5
