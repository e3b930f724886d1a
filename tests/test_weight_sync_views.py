"""The local engine takes a broadcast version without a copy where its bytes arrive in the
model's own memory order (``engines/local/sync.bind_views``), in two sets of buffers so that a
failed receive never touches the served weights; elsewhere it copies, as before."""

from __future__ import annotations

import time

import pytest
import torch

from sat_cli.engines.base import SamplingParams, WeightSyncError
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.engines.local.sync import bind_views, served_state, targets
from sat_cli.loop.weightsync import GroupSpec
from sat_cli.models.tiny_moe import build_tiny_moe, load_model, save_hf
from sat_cli.models.warmstart import SHIPPED as MODEL
from sat_cli.weightsync import buckets as B
from sat_cli.weightsync.layouts import compare
from sat_cli.weightsync.sender import WeightSender

BIG = 512 * 2**20  # one bucket: every weight arrives whole, in the model's order


def _received(named: list, bucket_bytes: int):
    """What the worker holds after a receive: flat buckets and where each HF name lies."""
    plan = B.plan(named, bucket_bytes)
    tensors = iter(t for _, t in named)
    flats, located = [], {}
    for k, bucket in enumerate(plan):
        flats.append(B.flatten([next(tensors) for _ in bucket.metas]))
        off = 0
        for m in bucket.metas:
            located[m.name] = (k, off, m)
            off += m.nbytes
    return flats, located


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _within(model, flat) -> bool:
    """Every weight of ``model`` lies in ``flat``'s bytes."""
    for t in model.state_dict().values():
        lo = t.data_ptr() - flat.data_ptr()
        if not (0 <= lo and lo + t.numel() * t.element_size() <= flat.numel()):
            return False
    return True


def test_bound_weights_are_the_received_bytes_and_equal_a_copy():
    model, other = build_tiny_moe(0), build_tiny_moe(1)
    named = list(served_state(other).items())  # HF names, the model's order (the sender's)
    flats, located = _received(named, BIG)
    copied = build_tiny_moe(0)
    with torch.no_grad():
        dest = targets(copied)
        for name, t in named:
            dest[name].copy_(t)
        assert bind_views(model, flats, located, set())
    for key, t in model.state_dict().items():
        assert torch.equal(t, copied.state_dict()[key]), key
        assert torch.equal(t, other.state_dict()[key]), key
    assert _within(model, flats[0])
    flats[0][:4].fill_(7)  # the model's weights are the buffer: a change shows through
    first = next(iter(model.state_dict().values()))
    assert first.reshape(-1).view(torch.uint8)[:4].tolist() == [7, 7, 7, 7]
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        flats[0][:4] = B.flatten([next(iter(other.state_dict().values()))])[:4]
        assert torch.equal(model(ids).logits, other(ids).logits)
    # a second bind (into another set of buffers) from the bound state
    again = _received(list(served_state(copied).items()), BIG)
    own = {flats[0].untyped_storage().data_ptr()}
    with torch.no_grad():
        assert bind_views(model, *again, own)
    assert _within(model, again[0][0]) and not _within(model, flats[0])
    assert all(torch.equal(t, copied.state_dict()[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("case", ["reordered", "straddles", "other_dtype", "other_shape", "tied"])
def test_bytes_not_in_the_models_order_are_not_bound_and_nothing_changes(case):
    model, other = build_tiny_moe(0), build_tiny_moe(1)
    named = list(served_state(other).items())
    bucket = BIG
    if case == "reordered":  # the up rows of an expert before its gate rows
        i = next(i for i, (n, _) in enumerate(named) if n.endswith(".0.gate_proj.weight"))
        named[i], named[i + 1] = named[i + 1], named[i]
    elif case == "straddles":  # a fused expert weight cut between two buckets
        i = next(i for i, (n, _) in enumerate(named) if n.endswith(".1.up_proj.weight"))
        bucket = sum(t.numel() * 4 for _, t in named[:i])
    elif case == "other_dtype":
        named = [(n, t.to(torch.bfloat16)) for n, t in named]
    elif case == "other_shape":
        named = [(n, t.reshape(-1) if n == "lm_head.weight" else t) for n, t in named]
    else:
        model = build_tiny_moe(0, tie_word_embeddings=True)
        named = list(served_state(build_tiny_moe(1, tie_word_embeddings=True)).items())
    before = _state(model)
    flats, located = _received(named, bucket)
    if case == "straddles":  # expert 0's up rows and expert 1's in two buckets
        assert located[named[i - 1][0]][0] != located[named[i][0]][0]
    with torch.no_grad():
        assert not bind_views(model, flats, located, set())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow  # ~13 s; the engine receive: tests/test_weight_sync.py
def test_the_engine_binds_alternates_its_buffers_and_a_failed_receive_keeps_the_weights(
    tmp_path,
):
    """v1 and v2 by broadcast into the two sets (no copy); v2 then serves what a disk load of
    the same weights does, to the bit; a disk load, then v3 by broadcast; a receive that times
    out while the model views a set leaves the served weights as they were."""
    spec = GroupSpec(timeout_s=20.0)
    base = load_model(str(MODEL))
    versions = {}
    for v, scale in ((1, 0.9), (2, 0.8), (3, 0.7)):
        m = load_model(str(MODEL))
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)
        versions[v] = m
    folder = save_hf(versions[2], None, tmp_path / "v2")
    params = SamplingParams(max_new_tokens=8, seed=3)
    sender = WeightSender(source_dir=str(MODEL), bucket_bytes=BIG)
    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(MODEL))) as engine:
        for v in (1, 2):
            sender.capture(v, served_state(versions[v]))
            engine.sync_weights(sender, v, spec)
            assert engine.sync_zero_copy and engine.weight_version == v
            assert (
                compare(sender.checksums(v, "hf"), engine.served_checksums()["the local engine"])
                == []
            )
        by_wire = engine.generate([[5, 6, 7], [9, 10]], 4, params)
        served = engine.served_checksums()["the local engine"]
        engine.update_weights(str(folder), 2)
        by_disk = engine.generate([[5, 6, 7], [9, 10]], 4, params)
        assert engine.served_checksums()["the local engine"] == served
        for ga, gb in zip(by_wire, by_disk, strict=True):
            for x, y in zip(ga, gb, strict=True):
                assert x.response_ids == y.response_ids and x.rollout_logp == y.rollout_logp
        sender.capture(3, served_state(versions[3]))
        engine.sync_weights(sender, 3, spec)  # after a disk load: bound again
        assert engine.sync_zero_copy
        assert (
            compare(sender.checksums(3, "hf"), engine.served_checksums()["the local engine"]) == []
        )
        served = engine.served_checksums()["the local engine"]

        class Skipping(WeightSender):
            def send(self, version, index):
                self.last_send_s = self.last_flatten_s = 0.0
                return 0

        skipping = Skipping(source_dir=str(MODEL), bucket_bytes=BIG)
        skipping.capture(4, served_state(base))
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            engine.sync_weights(skipping, 4, GroupSpec(timeout_s=3.0))
        assert time.monotonic() - t0 < 30
        assert (
            engine.weight_version == 3 and engine.served_checksums()["the local engine"] == served
        )
    sender.close()
