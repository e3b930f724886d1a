"""Weight sync without the disk (engine.weight_sync=distributed) and its verification (issue 28).

References: SGLang 0.5.23's own checksums of the tiny model (``/weights_checker`` of a real CPU
server, tests/data/sglang_captured/ws_checksum.json) for the layout and hash the trainer side
computes; the disk path for what a distributed sync must load (same samples, same log-probs,
same served checksums); real gloo groups and a real local engine worker, nothing mocked.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import pytest
import torch

from sat_cli.engines.base import SamplingParams, WeightSyncError
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.engines.local.sync import served_state
from sat_cli.loop.weightsync import GroupSpec, SyncSettings, WeightSync, WeightSyncFailed
from sat_cli.models.tiny_moe import load_model, save_hf
from sat_cli.trainers.megatron.hf_io import read_all
from sat_cli.weightsync import buckets as B
from sat_cli.weightsync.layouts import compare, expected_checksums
from sat_cli.weightsync.sender import WeightSender

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
CAPTURED = REPO / "tests" / "data" / "sglang_captured"
SPEC = GroupSpec(timeout_s=20.0)
BUCKET = 300_000  # bytes: several buckets for the tiny model
# the module's engine and changed weights are built once: its tests run on one xdist worker
pytestmark = pytest.mark.xdist_group("weight_sync")


def sglang_checksums() -> dict[str, str]:
    body = json.loads((CAPTURED / "ws_checksum.json").read_text())["body"]
    return body["ranks"][0]["checksums"]


def test_the_sglang_layout_and_hash_give_the_real_servers_checksums():
    """The trainer side's expected checksums of the model folder, in SGLang's fused layout and
    the server's dtype, are exactly what a real SGLang 0.5.23 server reported for it."""
    real = sglang_checksums()
    mine = expected_checksums(read_all(MODEL).items(), "sglang", "bfloat16")
    assert len(real) == 39 and "model.layers.0.mlp.experts.w13_weight" in real
    assert compare(mine, real) == []
    wrong = dict(mine, **{"lm_head.weight": "0" * 16})
    assert compare(wrong, real) == [
        f"lm_head.weight: served {real['lm_head.weight']}, sent {'0' * 16}"
    ]


def test_tensor_hash_is_sha256_of_the_bytes():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    digest = hashlib.sha256(t.numpy().tobytes()).digest()[:8]
    assert B.tensor_hash(t) == digest.hex()
    assert B.tensor_hash(t.t()) != B.tensor_hash(t)  # contiguous bytes of what is held


def test_buckets_cut_in_order_and_round_trip():
    named = [(f"t{i}", torch.randn(10, 10).to(torch.bfloat16)) for i in range(5)]  # 200 B each
    plan = B.plan(named, 450)
    assert [[m.name for m in b.metas] for b in plan] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [b.nbytes for b in plan] == [400, 400, 200]
    assert B.plan(named, 50)[0].nbytes == 200  # larger than a bucket: a bucket of its own
    flat = B.flatten([t for _, t in named[:2]])
    back = B.unflatten(flat, plan[0])
    assert all(torch.equal(a, t) for (_, a), (_, t) in zip(back, named[:2], strict=True))
    assert plan[0].request() == {
        "names": ["t0", "t1"],
        "dtypes": ["bfloat16"] * 2,
        "shapes": [[10, 10], [10, 10]],
    }


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        sender = WeightSender()
        with pytest.raises(WeightSyncError, match=rf"127.0.0.1:{port} .*port in use"):
            sender.listen("127.0.0.1", port, 2, 5.0)


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    """Weights that differ from the served base: every parameter scaled by 0.9, on disk too."""
    model = load_model(str(MODEL))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    folder = save_hf(model, None, tmp_path_factory.mktemp("w") / "v1")
    return served_state(model), folder


@pytest.fixture(scope="module")
def shared_engine():
    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(MODEL))) as engine:
        yield engine


@pytest.fixture
def engine(shared_engine):
    """The module's local engine, back on the base weights (version 0) for each test."""
    shared_engine.update_weights(str(MODEL), 0)
    return shared_engine


def _samples(engine):
    return engine.generate([[5, 6, 7], [9, 10]], 4, SamplingParams(max_new_tokens=8, seed=3))


def _served(engine) -> dict[str, str]:
    return engine.served_checksums()["the local engine"]


def test_a_distributed_sync_serves_what_a_disk_sync_does(engine, changed):
    """Same samples, the same log-probs to the bit and the same served checksums as the disk
    path with the same weights; the sync is verified against what the sender holds; a second
    version goes over the same group."""
    state, folder = changed
    sender = WeightSender(dtype="float32", source_dir=str(MODEL), bucket_bytes=BUCKET)
    assert sender.capture(1, state) == sum(t.numel() * 4 for t in state.values())
    base = _samples(engine)
    timing = engine.sync_weights(sender, 1, SPEC)
    assert engine.weight_version == 1 and timing["bytes"] == sender.nbytes(1)
    assert len(sender.plan(1)) > 1
    by_wire, served = _samples(engine), _served(engine)
    assert compare(sender.checksums(1, "hf"), served) == []
    engine.update_weights(str(MODEL), 0)
    engine.update_weights(str(folder), 1)
    by_disk = _samples(engine)
    for ga, gb in zip(by_wire, by_disk, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.response_ids == y.response_ids and x.rollout_logp == y.rollout_logp
    assert [s.rollout_logp for g in by_wire for s in g] != [s.rollout_logp for g in base for s in g]
    assert _served(engine) == served
    sender.capture(2, served_state(load_model(str(MODEL))))
    engine.sync_weights(sender, 2, SPEC)
    assert compare(sender.checksums(2, "hf"), _served(engine)) == []
    sender.close()


class _SkippingSender(WeightSender):
    """A sender that never broadcasts (the engine's receive then times out)."""

    def send(self, version, index):
        self.last_send_s = self.last_flatten_s = 0.0
        return 0


def test_a_receive_that_times_out_fails_in_time_and_keeps_the_weights(engine, changed):
    state, _ = changed
    sender = _SkippingSender(source_dir=str(MODEL), bucket_bytes=BUCKET)
    sender.capture(1, state)
    before = _served(engine)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="distributed sync of weights v1 failed"):
        engine.sync_weights(sender, 1, GroupSpec(timeout_s=3.0))
    assert time.monotonic() - t0 < 30  # the group's timeout, not a hang
    assert engine.weight_version == 0 and _served(engine) == before
    good = WeightSender(source_dir=str(MODEL), bucket_bytes=BUCKET)
    good.capture(1, state)
    engine.sync_weights(good, 1, SPEC)  # a new group works
    assert compare(good.checksums(1, "hf"), _served(engine)) == []


class _WrongBytes(WeightSender):
    """A sender whose bytes are damaged on the wire (``disk``: in what it writes too)."""

    disk = False

    def _on_wire(self, flat):
        return flat + 1  # a copy: what the sender holds stays right

    def write_hf(self, version, folder):
        if not self.disk:
            return super().write_hf(version, folder)
        from sat_cli.models.hf_checkpoint import save_hf_checkpoint

        damaged = {k: v + 1 for k, v in self._get(version)}
        return save_hf_checkpoint(damaged, folder, self.source_dir)


class _Trainer:
    def __init__(self, sender):
        self.weight_sender = sender

    def capture_weights(self, version):
        raise AssertionError("captured by the test")


def _sync(engine, sender, tmp_path, verify="first"):
    settings = SyncSettings(mode="distributed", verify=verify, group=SPEC)
    logged: list[str] = []
    return WeightSync(
        settings, engine, _Trainer(sender), tmp_path / "weights", log=logged.append
    ), logged


def test_wrong_bytes_on_the_wire_fall_back_to_the_disk_once(engine, changed, tmp_path):
    state, _ = changed
    sender = _WrongBytes(source_dir=str(MODEL), bucket_bytes=BUCKET)
    sender.capture(1, state)
    sync, logged = _sync(engine, sender, tmp_path)
    sync.load(1)
    assert sync.fallbacks == 1 and "sending them from disk instead" in logged[0]
    assert "tensors differ" in logged[0]
    assert (tmp_path / "weights" / "v1").is_dir()  # written from the sender's copy
    assert compare(sender.checksums(1, "hf"), engine.served_checksums()["the local engine"]) == []
    m = sync.metrics()
    assert m["weights/sync_fallback"] == 1.0 and m["weights/verify_s"] > 0


def test_wrong_bytes_on_both_paths_fail_the_run(engine, changed, tmp_path):
    state, _ = changed
    sender = _WrongBytes(source_dir=str(MODEL), bucket_bytes=BUCKET)
    sender.disk = True
    sender.capture(1, state)
    sync, _ = _sync(engine, sender, tmp_path)
    expected = r"v1 did not reach the engine: .*then from disk: .*differ.*continue with resume=auto"
    with pytest.raises(WeightSyncFailed, match=expected):
        sync.load(1)


def test_verify_first_checks_the_first_load_of_each_path_every_checks_all(
    engine, changed, tmp_path
):
    state, _ = changed
    sender = WeightSender(source_dir=str(MODEL), bucket_bytes=BUCKET)
    for v in (1, 2, 3):
        sender.capture(v, state)
    sync, _ = _sync(engine, sender, tmp_path)
    sync.load(1)
    assert sync.metrics()["weights/verify_s"] > 0
    sync.load(2)
    assert sync.metrics()["weights/verify_s"] == 0.0
    every, _ = _sync(engine, sender, tmp_path, verify="every")
    every.load(2)
    every.load(3)
    assert every.metrics()["weights/verify_s"] > 0 and every.verified == {"distributed"}


def test_a_served_mismatch_is_an_error_never_a_warning(engine, changed, monkeypatch):
    """Disk path: a load that reports success and keeps the old weights (the engine serves
    other weights than the published folder) → mismatch, one more disk load, then the run
    fails."""
    state, folder = changed
    monkeypatch.setattr(engine, "update_weights", lambda path, version: None)
    settings = SyncSettings(mode="disk", verify="first")
    sync = WeightSync(settings, engine, _Trainer(None), folder.parent, log=lambda _: None)
    with pytest.raises(WeightSyncFailed, match=r"v1 did not reach the engine: .*differ"):
        sync.load(1)


@pytest.mark.slow  # starts the Megatron worker under torchrun (~20 s)
def test_the_megatron_sender_sends_what_its_disk_export_writes(engine, tmp_path):
    """trainer=megatron: every rank gathers, rank 0 holds the HF tensors (the disk export's
    conversion) and broadcasts them from its own process; the engine then serves exactly the
    weights ``publish_weights`` writes, and rank 0 writes the same files for the fallback."""
    from trainer_checks import megatron_trainer

    from sat_cli.trainers.megatron import convert

    spec = {"dtype": "float32", "device": "cpu", "bucket_bytes": BUCKET}
    work = tmp_path / "m"
    with megatron_trainer(MODEL, work, weight_sync=spec, export_dtype="float32") as trainer:
        assert trainer.capture_weights(1) == 4085248
        published = trainer.publish_weights(tmp_path / "w", 1)
        sender = trainer.weight_sender
        assert sender.has(1) and len(sender.plan(1)) > 1
        engine.sync_weights(sender, 1, SPEC)
        disk = convert.load_hf_state(published)
        assert compare(expected_checksums(disk.items(), "hf"), _served(engine)) == []
        assert compare(sender.checksums(1, "hf"), _served(engine)) == []
        written = convert.load_hf_state(sender.write_hf(1, tmp_path / "fallback" / "v1"))
        assert sorted(written) == sorted(disk)
        assert all(torch.equal(written[k], disk[k]) for k in disk)
