"""SGLangEngine's distributed weight sync and verification against the stand-in (issue 28).

The stand-in runs as its own process and joins a real gloo group with the sender in this
process; its routes, answers and checksums are held to a real SGLang 0.5.23 server's in
tests/test_sglang_standin_fidelity.py (the real server itself: tests/test_sglang_real.py). Its
faults stand for what a real server can do wrong: report success and keep the old weights
(``stale``), damage what it received (``wrong_bytes``), never join the broadcast
(``skip_receive``), refuse (``fail``), lack the routes (``--standin-no-sync-routes``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from sglang_standin_sync import standin_process

from sat_cli.engines.base import WeightSyncError
from sat_cli.engines.local.sync import served_state
from sat_cli.engines.sglang import SGLangEngine
from sat_cli.engines.sglang.runtime import SGLangRuntime
from sat_cli.engines.sglang.settings import SGLangEngineSettings
from sat_cli.loop.weightsync import GroupSpec, SyncSettings, WeightSync, WeightSyncFailed
from sat_cli.models.tiny_moe import load_model
from sat_cli.weightsync.layouts import compare
from sat_cli.weightsync.sender import WeightSender

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sat_cli" / "assets" / "tiny_moe_warm"
SPEC = GroupSpec(timeout_s=10.0)


@pytest.fixture(scope="module")
def sender():
    model = load_model(str(MODEL))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    s = WeightSender(dtype="bfloat16", source_dir=str(MODEL), bucket_bytes=300_000)
    for v in (1, 2, 3):
        s.capture(v, served_state(model))
    yield s
    s.close()


def engine_on(url: str) -> SGLangEngine:
    settings = SGLangEngineSettings(urls=[url], request_timeout_s=60.0, deterministic=False)
    return SGLangEngine(settings, SGLangRuntime(str(MODEL)))


class _Trainer:
    def __init__(self, sender):
        self.weight_sender = sender


def weight_sync(engine, sender, tmp_path):
    settings = SyncSettings(mode="distributed", dtype="bfloat16", group=SPEC)
    return WeightSync(settings, engine, _Trainer(sender), tmp_path / "weights", log=lambda _: None)


def test_the_protocol_delivers_every_bucket_and_the_version(sender, tmp_path):
    with standin_process(MODEL, tmp_path / "s.log") as url:
        engine = engine_on(url)
        try:
            assert engine.distributed_sync_unsupported() is None
            timing = engine.sync_weights(sender, 1, SPEC)
            assert timing["bytes"] == sender.nbytes(1) and len(sender.plan(1)) > 1
            assert engine.served_versions() == [1]
            served = engine.served_checksums()[url]
            assert compare(sender.checksums(1, "sglang"), served) == []
            engine.sync_weights(sender, 2, SPEC)  # the same group, a new session
            assert engine.served_versions() == [2]
            calls = [c for c in engine.client.get_json("/standin/calls", url=url)]
            paths = [p for p, _ in calls if p != "/weights_checker"]
            updates = [b for p, b in calls if p == "/update_weights_from_distributed"]
        finally:
            engine.close()
    per_version = len(sender.plan(1))
    assert paths[1:] == [
        "/init_weights_update_group",
        "/begin_weight_update",
        *["/update_weights_from_distributed"] * per_version,
        "/end_weight_update",
        "/begin_weight_update",
        *["/update_weights_from_distributed"] * per_version,
        "/end_weight_update",
    ]
    assert paths[0] == "/destroy_weights_update_group"  # the capability probe
    # the version and the cache flush go with the last bucket only
    assert [u["weight_version"] for u in updates[:per_version]] == [None] * (per_version - 1) + [
        "1"
    ]
    assert [u["flush_cache"] for u in updates[:per_version]] == [False] * (per_version - 1) + [True]
    assert {u["load_format"] for u in updates} == {"flattened_bucket"}


@pytest.mark.parametrize(
    "fault",
    [
        # wrong_bytes keeps the class of a reported success that verification refutes
        pytest.param("stale", marks=pytest.mark.slow),
        "wrong_bytes",
        "fail",
        pytest.param("skip_receive", marks=pytest.mark.slow),
    ],
)
def test_a_faulty_server_gets_the_version_from_disk(sender, tmp_path, fault):
    """Success reported with the old weights kept, damaged weights, a refusal, or a receive
    that never happens (the broadcast times out): one fallback to the disk, which the stand-in
    loads, then the served weights are verified."""
    extra = ["--standin-sync-fault", fault, "--standin-skip-receive-s", "60"]
    with standin_process(MODEL, tmp_path / "s.log", *extra) as url:
        engine = engine_on(url)
        try:
            sync = weight_sync(engine, sender, tmp_path)
            t0 = time.monotonic()
            sync.load(1)
            assert time.monotonic() - t0 < 60  # the collective's deadline, never a hang
            assert sync.fallbacks == 1 and engine.served_versions() == [1]
            served = engine.served_checksums()[url]
            assert compare(sender.checksums(1, "sglang"), served) == []
        finally:
            engine.close()


def test_a_server_that_keeps_the_old_weights_on_both_paths_fails_the_run(sender, tmp_path):
    extra = ["--standin-sync-fault", "stale", "--standin-disk-stale"]
    with standin_process(MODEL, tmp_path / "s.log", *extra) as url:
        engine = engine_on(url)
        try:
            sync = weight_sync(engine, sender, tmp_path)
            with pytest.raises(WeightSyncFailed, match=r"v1 did not reach the engine: .*differ"):
                sync.load(1)
        finally:
            engine.close()


def test_a_server_without_the_routes_is_named(sender, tmp_path):
    with standin_process(MODEL, tmp_path / "s.log", "--standin-no-sync-routes") as url:
        engine = engine_on(url)
        try:
            reason = engine.distributed_sync_unsupported()
            assert reason and f"the server at {url} has no /destroy_weights_update_group" in reason
            with pytest.raises(WeightSyncError, match="HTTP 404"):
                engine.sync_weights(sender, 1, SPEC)
        finally:
            engine.close()
