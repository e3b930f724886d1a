"""The rollout buffer and the weight publisher of the training loop, on their own.

The buffer runs on a real rollout thread; the engine is a recorder of the commands it gets
(``update_weights`` / ``generate`` in order), which is exactly what these tests assert on: which
batch is requested from which weight version, in which order, and what a checkpoint replays.
The publisher writes and prunes real folders.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sat_cli.engines.base import Sample, SamplingParams
from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.publisher import WeightPublisher, future_versions, min_needed
from sat_cli.loop.rollouts import RolloutBuffer, RolloutThread, request_seed
from sat_cli.loop.settings import LoopSettings


class Recorder:
    """An engine that records its commands and answers with one-token samples."""

    def __init__(self):
        self.log: list[tuple] = []
        self.version = 0

    def update_weights(self, path: str, version: int) -> None:
        self.log.append(("update", Path(path).name, version))
        self.version = version

    def generate(self, prompts, n, sampling):
        self.log.append(("generate", len(prompts), sampling.seed, self.version))
        return [[Sample(p, [1], [-0.1], "stop", self.version) for _ in range(n)] for p in prompts]


class Task:
    def sample_prompts(self, n: int, cursor: int) -> list[dict]:
        return [{"prompt": f"p{cursor + i}", "answer": "1"} for i in range(n)]


def tokenizer(text, add_special_tokens=False):
    return {"input_ids": [ord(c) for c in text]}


def _settings(lag: LagPolicy, run_dir: Path = Path("run"), max_steps: int = 10) -> LoopSettings:
    """The loop's settings of these tests: 2 prompts a step, groups of 3, seed 5."""
    return LoopSettings(max_steps, 2, 3, SamplingParams(), lag, run_dir, seed=5)


def _buffer(lag: LagPolicy, max_steps: int = 10):
    eng = Recorder()
    thread = RolloutThread(eng, Path("w"), engine_version=0)
    buf = RolloutBuffer(_settings(lag, max_steps=max_steps), thread, Task(), tokenizer)
    return eng, thread, buf


@pytest.mark.parametrize(
    "lag, versions",
    [
        # interval lag 2: batch k >= 1 from version 2 * floor((k - 1) / 2); batch 0 fresh
        (LagPolicy(2, "interval"), {0: 0, 1: 0, 2: 0, 3: 2, 4: 2, 5: 4}),
        (LagPolicy(2, "fixed"), {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 3}),
        (LagPolicy(0), {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5}),
    ],
)
def test_buffer_requests_each_batch_from_the_lag_policys_version(lag, versions):
    eng, thread, buf = _buffer(lag)
    try:
        got = {}
        for t in range(6):
            buf.request_ahead(t)
            version, groups, timing, _ = buf.take(t)
            got[t] = version
            assert [g[0].weight_version for g in groups] == [version, version]
            assert len(groups) == 2 and all(len(g) == 3 for g in groups)
            assert set(timing) == {"gen_s", "update_s"}
            # the engine holds t + 1 only once the trainer made it: emulate publishing
        assert got == versions
        # at step 5 batch 6 is already in flight when its version exists (lag > 0), not at lag 0
        ahead = [6] if lag.n else []
        assert sorted(buf.pending) == ahead
        for k in ahead:
            buf.take(k)
        # the engine got every generation request with its batch's seed, in batch order
        seeds = [e[2] for e in eng.log if e[0] == "generate"]
        assert seeds == [request_seed(5, "rollout", k) for k in [*range(6), *ahead]]
    finally:
        thread.close()


def test_buffer_requests_ahead_within_the_lag_and_replays_its_snapshot():
    lag = LagPolicy(2, "interval")
    eng, thread, buf = _buffer(lag)
    try:
        buf.request_ahead(0)  # batch 0 and batch 1 (version 0 exists at step 0)
        assert sorted(buf.pending) == [0, 1]
        buf.take(0)
        buf.request_ahead(1)  # batch 2 also from version 0: requested now
        snap = buf.snapshot()
        assert snap == [[1, 0], [2, 0]] and buf.versions() == {0}
        buf.take(1)
        buf.request_ahead(2)  # batch 3 needs version 2: not before step 2 (can_submit)
        assert sorted(buf.pending) == [2, 3] and buf.pending[3][0] == 2
    finally:
        thread.close()
    # a resumed run requests exactly the recorded batches again: same prompts, seeds, versions
    eng2, thread2, buf2 = _buffer(lag)
    try:
        buf2.restore(snap)
        assert buf2.snapshot() == snap
        for k in (1, 2):
            version, groups, _, _ = buf2.take(k)
            assert version == 0 and groups[0][0].prompt_ids == tokenizer(f"p{2 * k}")["input_ids"]
        first = [e for e in eng.log if e[0] == "generate"][1:3]
        assert [e for e in eng2.log if e[0] == "generate"] == first
    finally:
        thread2.close()


class Writer:
    def __init__(self):
        self.written: list[int] = []

    def publish_weights(self, root: Path, version: int) -> None:
        (root / f"v{version}").mkdir(parents=True)
        (root / f"v{version}" / "model.safetensors").write_bytes(b"x")
        self.written.append(version)


def test_publisher_publishes_once_and_keeps_what_a_resume_needs(tmp_path):
    lag = LagPolicy(2, "interval")
    tr = Writer()
    pub = WeightPublisher(_settings(lag, tmp_path), tr, published=[])
    pub.write(0)
    pub.published.append(0)
    for v in (2, 2, 4):
        pub.publish(v)
    assert tr.written == [0, 2, 4] and pub.published == [0, 2, 4]
    # trainer at version 4: batch 4 comes from version 2, batch 5 from 4 — both kept
    assert future_versions(lag, 4) == {2, 4}
    assert pub.prune(4, set(), since=4) == [0, 2, 4]
    # at version 5 batches 5 and 6 both come from version 4: version 2 goes
    assert future_versions(lag, 5) == {4, 5}
    assert pub.prune(5, set(), since=5) == [0, 4]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v0", "v4"]
    # a checkpoint at version 6 whose pending batch 7 comes from version 6: batch 6 (from
    # version 4) is re-requested on resume too, so the checkpoint needs versions >= 4
    pub.publish(6)
    assert min_needed(lag, 6, [[7, 6]]) == 4
    assert pub.prune(6, {6}, since=4) == [0, 4, 6]
    pub.publish(8)  # at version 8, batch 8 comes from 6: version 4 goes
    assert pub.prune(8, set(), since=8) == [0, 6, 8]
    # an old pending batch keeps its version; so does the last checkpoint's min_needed
    pub.published[:] = [0, 2, 6, 8]
    assert pub.keep(8, {2}, since=8) == {0, 2, 6, 8}
    assert pub.keep(8, set(), since=2) == {0, 2, 6, 8}
    assert pub.keep(8, set(), since=3) == {0, 6, 8}


# --------------------------------------------------------------------- bounded mode, in flight
def test_bounded_requests_bind_their_version_when_generation_starts():
    """Bounded mode: a batch is generated from the newest version published when its
    generation starts (not the one at request time); the buffer records the request-time
    version as a lower bound (what a checkpoint and the pruning need)."""
    import threading

    eng, thread, buf = _buffer(LagPolicy(2, "bounded"))
    gate = threading.Event()
    try:
        thread.pool.submit(gate.wait)  # hold the rollout thread
        buf.request_ahead(0)  # batches 0, 1, 2 at trainer version 0
        assert buf.snapshot() == [[0, 0], [1, 0], [2, 0]]
        thread.published(1)
        thread.published(2)  # not in flight: nothing reaches the engine yet
        assert eng.log == []
        gate.set()
        versions = [buf.take(k)[1][0][0].weight_version for k in range(3)]
        assert versions == [2, 2, 2]  # the newest at start, loaded once
        assert [e for e in eng.log if e[0] == "update"] == [("update", "v2", 2)]
    finally:
        gate.set()
        thread.close()


def test_inflight_updates_reach_the_engine_from_the_training_thread():
    import threading

    eng = Recorder()
    thread = RolloutThread(eng, Path("w"), engine_version=0, inflight=True)
    gate = threading.Event()
    try:
        thread.pool.submit(gate.wait)  # the rollout thread is busy (a generation running)
        thread.published(1)  # handed over at once, not queued behind the generation
        thread.drain()  # (on its own thread: the trainer does not wait for it)
        assert eng.log == [("update", "v1", 1)] and thread.engine_version == 1
        assert thread._ensure(0) == 0.0 and eng.version == 1  # never backwards in flight
        gate.set()
    finally:
        gate.set()
        thread.close()


def test_a_failed_inflight_hand_over_is_raised_not_lost():
    from sat_cli.engines.base import EngineError

    class Broken(Recorder):
        def update_weights(self, path, version):
            raise EngineError(f"cannot load {path}")

    thread = RolloutThread(Broken(), Path("w"), engine_version=0, inflight=True)
    try:
        thread.published(1)
        with pytest.raises(EngineError, match="cannot load w/v1"):
            thread.drain()
        with pytest.raises(EngineError, match="cannot load"):
            thread.published(2)  # the previous failure surfaces at the next publish too
    finally:
        thread.close()


def test_pruning_keeps_what_an_inflight_hand_over_is_still_loading(tmp_path):
    """The trainer publishes v1 and v2 while the engine is still taking v1 (it waits for a token
    boundary), then ends its run without publishing v3: the prune after that last step must keep
    v1 (being loaded) and v2 (the queued hand-over binds the newest), and every hand-over finds
    its folder. (The end of a bounded in-flight run once deleted v2 under its queued hand-over.)"""
    import threading

    loading, release = threading.Event(), threading.Event()

    class Slow(Recorder):
        def update_weights(self, path, version):
            if version == 1:
                loading.set()
                assert release.wait(10)
            assert Path(path).is_dir(), f"{path} was pruned under the engine"
            super().update_weights(path, version)

    eng = Slow()
    weights = tmp_path / "weights"
    lag = LagPolicy(2, "bounded")
    thread = RolloutThread(eng, weights, engine_version=0, inflight=True)
    pub = WeightPublisher(_settings(lag, tmp_path), Writer(), [], on_publish=thread.published)
    try:
        pub.write(0)
        pub.published.append(0)
        pub.publish(1)
        assert loading.wait(10)
        pub.publish(2)  # queued behind the hand-over of v1
        assert thread.in_use() == {1, 2}
        # trainer at version 3 (not published: the last step), no batch pending
        assert pub.keep(3, set(), since=3) == {0, 3}  # what the pending batches alone keep
        assert pub.prune(3, thread.in_use(), since=3) == [0, 1, 2]
        release.set()
        thread.drain()
        assert [e for e in eng.log if e[0] == "update"] == [
            ("update", "v1", 1),
            ("update", "v2", 2),
        ]
        assert thread.in_use() == {2}
    finally:
        release.set()
        thread.close()


def test_publisher_tells_the_rollout_thread_and_keeps_versions_since_the_oldest_request(tmp_path):
    seen = []
    lag = LagPolicy(2, "bounded")
    pub = WeightPublisher(_settings(lag, tmp_path), Writer(), [], on_publish=seen.append)
    for v in range(5):
        pub.publish(v)
        pub.publish(v)  # idempotent: told once
    assert seen == [0, 1, 2, 3, 4]
    # a batch requested at version 1 may start from 1, 2, 3 or 4: all kept (late binding)
    assert pub.prune(4, {1}, since=4) == [0, 1, 2, 3, 4]
    assert pub.prune(4, {3}, since=4) == [0, 3, 4]


class _Tok:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["1" * len(s) for s in seqs]


def test_admission_and_staleness_use_every_tokens_version():
    """Batch at step 5, lag.n = 2: a group whose oldest token is version 2 (3 behind) is
    dropped and counted; per-sample lag is the oldest token's, per-token lags are each
    token's, and a response whose tokens span versions counts as mixed."""
    from types import SimpleNamespace

    from sat_cli.loop.steps import score_batch, task_scorer
    from sat_cli.loop.stream import Batch

    s = SimpleNamespace(
        lag=LagPolicy(2, "bounded"), group_size=2, adv_std_norm=False, drop_zero_adv_groups=False
    )

    def smp(versions, reward_len):
        toks = [1] * reward_len
        return Sample(
            [9],
            toks,
            [-0.1] * reward_len,
            "stop",
            versions[0],
            token_versions=versions if len(set(versions)) > 1 else None,
        )

    groups = [
        [smp([3, 3, 4], 3), smp([4, 4, 4], 3)],  # oldest 3: lag 2, kept
        [smp([2, 3, 3], 3), smp([4, 4, 4], 3)],  # oldest 2: lag 3 > 2, dropped
    ]
    task = SimpleNamespace(reward=lambda text, answer: float(len(text)))
    batch = Batch(groups, [{"prompt": "a", "answer": "1"}] * 2, {"gen_s": 1.0}, 0.0)
    scored = score_batch(s, 5, batch, _Tok(), task_scorer(task))
    samples, lags, m = scored.samples, scored.lags, scored.metrics
    # the stale group is also one of the dropped groups (as the v4 loop counted it)
    assert len(samples) == 2 and scored.stale_dropped == 1 and scored.dropped_groups == 1
    assert scored.rewards == [[3.0, 3.0], [3.0, 3.0]]  # per group as it came (before admission)
    assert lags.sample == [2, 1] and lags.token == [2, 2, 1, 1, 1, 1]
    assert m["staleness/version_lag_max"] == 2.0 and m["staleness/version_lag_mean"] == 1.5
    assert m["staleness/token_version_lag_mean"] == pytest.approx(8 / 6)
    assert m["staleness/mixed_version_frac"] == 0.5
