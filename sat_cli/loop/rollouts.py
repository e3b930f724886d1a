"""Rollout requests of the training loop: the rollout thread and the buffer of requested batches.

* :class:`RolloutThread` — one worker thread that sends the engine its weight updates and
  generation requests in program order, so the sequence of engine commands (hence every sample,
  for a seed) is deterministic while generation overlaps training. In ``bounded`` mode a request
  binds its version late: the newest published one when its generation starts (so realised
  staleness depends on timing, as in AReaL); with in-flight updates the training thread also
  hands every new version to the engine at once (:meth:`RolloutThread.published`), which takes
  it at the next token boundary of the running generation: responses then span versions
  (``Sample.token_versions``). Both bounded variants are not reproducible bit for bit.
* :class:`RolloutBuffer` — the batches requested but not consumed, each with the weight version
  it is generated from: ``request_ahead`` keeps the engine busy as far as the lag policy allows,
  ``take`` waits for one batch, ``snapshot`` is what a checkpoint records so that a resumed run
  requests exactly the same batches again (``restore``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from sat_cli.loop.settings import LoopSettings
from sat_cli.samples import SamplingParams


def request_seed(seed: int, *key: Any) -> int:
    """A stable 31-bit seed for one engine request (same run seed + key → same samples)."""
    h = hashlib.sha256(":".join(map(str, (seed, *key))).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


class RolloutThread:
    """The rollout thread: weight updates and generation requests, in program order."""

    def __init__(
        self, engine, weights_dir: Path, engine_version: int, inflight: bool = False, sync=None
    ):
        self.engine = engine
        self.sync = sync  # a loop.weightsync.WeightSync (the path, verification, fallback)
        self.weights_dir = weights_dir
        self.engine_version = engine_version  # guarded by _lock (two threads with in-flight)
        self.newest = engine_version  # the newest published version (late binding)
        self.inflight = inflight
        self._lock = threading.Lock()
        # the versions being loaded now, held against pruning (with ``newest``: :meth:`in_use`)
        self._loading: dict[int, int] = {}
        self._held = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sat-rollout")
        # in-flight: the hand-over runs on its own thread, so the trainer never waits for the
        # engine's token boundary; a version still queued when a newer one comes is skipped
        self._push = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="sat-push") if inflight else None
        )
        self._pushed: Future | None = None

    def _load(self, version: int | None) -> float:
        """:meth:`_ensure` of ``version`` (``None``: the newest published, bound now), held in
        :meth:`in_use` until it is loaded, so pruning cannot delete it under the engine."""
        with self._held:
            v = self.newest if version is None else version
            self._loading[v] = self._loading.get(v, 0) + 1
        try:
            return self._ensure(v)
        finally:
            with self._held:
                self._loading[v] -= 1
                if not self._loading[v]:
                    del self._loading[v]

    def in_use(self) -> set[int]:
        """Versions the engine may still load: the newest published (late binding and in-flight
        hand-overs bind it when they run) and those being loaded now. Pruning keeps them."""
        with self._held:
            return {self.newest, *self._loading}

    def _ensure(self, version: int) -> float:
        with self._lock:
            if version == self.engine_version or (self.inflight and version < self.engine_version):
                return 0.0  # in-flight: the engine already took a newer version
            t0 = time.perf_counter()
            if self.sync is not None:
                self.sync.load(version)
            else:
                self.engine.update_weights(str(self.weights_dir / f"v{version}"), version)
            self.engine_version = version
            return time.perf_counter() - t0

    def published(self, version: int) -> None:
        """The trainer published ``version`` (training thread). Late-bound requests take it
        when they start; with in-flight updates it is handed to the engine at once, which
        takes it at the next token boundary (the trainer goes on meanwhile). A failed
        hand-over is raised here, at the next publish, or by :meth:`drain`."""
        with self._held:
            self.newest = max(self.newest, version)
        if self._push is None:
            return
        if self._pushed is not None and self._pushed.done():
            self._pushed.result()
        self._pushed = self._push.submit(self._load, None)

    def drain(self) -> None:
        """Wait for the last in-flight hand-over (raises its error)."""
        if self._pushed is not None:
            self._pushed.result()

    def submit(
        self, version: int | None, prompts: list[list[int]], n: int, sampling: SamplingParams
    ):
        """Generate on the rollout thread from ``version`` (``None``: the newest published
        when the generation starts)."""

        return self.submit_job(version, lambda: self.engine.generate(prompts, n, sampling))

    def submit_job(self, version: int | None, generate: Callable[[], list]):
        """Run ``generate()`` (it returns the batch's groups) on the rollout thread from
        ``version`` (``None``: the newest published when it starts), timed like ``submit``."""

        def job():
            update_s = self._load(version)
            t0 = time.perf_counter()
            groups = generate()
            return groups, {"gen_s": time.perf_counter() - t0, "update_s": update_s}

        return self.pool.submit(job)

    def submit_mixed(
        self,
        versions: list[int],
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed_of: Callable[[int], int],
    ):
        """Generate sample ``j`` of prompt ``i`` from ``versions[i * n + j]`` (a lag profile):
        one request per version, oldest first, seeded by ``seed_of(version)``; the samples go
        back to their prompt's group in their place."""

        def job():
            groups: list[list[Any]] = [[None] * n for _ in prompts]
            timing = {"gen_s": 0.0, "update_s": 0.0}
            if self._adapters_per_sample(versions, timing):  # LoRA (trainer.lora)
                t0 = time.perf_counter()
                flat = [prompts[c // n] for c in range(len(versions))]
                out = self.engine.generate(flat, 1, sampling, adapters=list(versions))
                timing["gen_s"] += time.perf_counter() - t0
                for c, group in enumerate(out):
                    groups[c // n][c % n] = group[0]
                return groups, timing
            for v in sorted(set(versions)):
                cells = [c for c, cv in enumerate(versions) if cv == v]
                timing["update_s"] += self._load(v)
                t0 = time.perf_counter()
                out = self.engine.generate(
                    [prompts[c // n] for c in cells], 1, replace(sampling, seed=seed_of(v))
                )
                timing["gen_s"] += time.perf_counter() - t0
                for c, group in zip(cells, out, strict=True):
                    groups[c // n][c % n] = group[0]
            return groups, timing

        return self.pool.submit(job)

    def _adapters_per_sample(self, versions: list[int], timing: dict) -> bool:
        """LoRA: the engine holds one adapter per version (``adapters_held``), so a mixed batch
        is one request naming each sample's adapter; every version is loaded (held) first."""
        from sat_cli.weightsync.adapters import is_adapter

        if getattr(self.engine, "adapters_held", None) is None:
            return False  # an engine without adapter slots: one request per version
        if not is_adapter(self.weights_dir / f"v{max(versions)}"):
            return False  # full weights: one request per version, as before
        for v in sorted(set(versions)):
            timing["update_s"] += self._load(v)
        return True

    def load(self, version: int) -> float:
        """Put ``version``'s weights in the engine now (on the rollout thread, inside a job: a
        lag profile's generation call of a trajectory's turn); seconds taken."""
        return self._load(version)

    def call(self, version: int, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the rollout thread with the engine at ``version`` (evaluation)."""

        def job():
            self._load(version)
            return fn()

        return self.pool.submit(job)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._push is not None:
            self._push.shutdown(wait=False, cancel_futures=True)


class RolloutBuffer:
    """Batches requested from the engine and not yet consumed: ``{batch: (version, future)}``.

    Batch ``k`` holds the prompts ``task.sample_prompts(per_step, cursor=k * per_step)`` and is
    sampled with the seed ``request_seed(seed, "rollout", k)``; the version comes from the lag
    policy at request time, so replaying :meth:`snapshot` gives the same samples. In bounded
    mode the recorded version is the trainer's at request time, a lower bound of the version
    that generates it (late binding); a resumed run requests the same batches (same prompts,
    so every prompt is consumed exactly once) and generates them anew.
    """

    def __init__(self, s: LoopSettings, thread: RolloutThread, task, tokenizer):
        """``s``: the loop's settings (prompts per step, group size, sampling, seed, lag policy,
        steps); ``thread`` sends the requests; ``task`` gives the prompts, ``tokenizer`` their
        ids."""
        self.env = s.env  # a loop.multiturn.EnvRun: every rollout a trajectory (None: one turn)
        self.thread, self.task, self.tokenizer = thread, task, tokenizer
        self.per_step, self.group_size = s.prompts_per_step, s.group_size
        self.sampling, self.seed, self.lag, self.max_steps = s.sampling, s.seed, s.lag, s.max_steps
        self.pending: dict[int, tuple[int, Future]] = {}
        # how many batches ahead of the one being trained may be in flight
        self.ahead = 1 if (s.lag.mode != "bounded" or s.lag.n == 0) else s.lag.n

    def prompts_for(self, k: int) -> list[dict]:
        return self.task.sample_prompts(self.per_step, cursor=k * self.per_step)

    def submit(self, k: int, version: int) -> None:
        self.pending[k] = (version, self._request(self.prompts_for(k), ("rollout", k), version, k))

    def refill(self, t: int, j: int, version: int) -> tuple[list[dict], Future]:
        """Generation batch ``j >= 1`` of step ``t`` (``algo.dynamic_sampling``): its prompt
        rows and the future of its groups, generated now from ``version`` (batch ``t``'s, with a
        profile batch ``t``'s versions per sample), seeded by ``("refill", t, j)``; never
        pending, so a checkpoint does not record it (``loop.dynamic``)."""
        from sat_cli.loop.dynamic import refill_cursor

        rows = self.task.sample_prompts(self.per_step, cursor=refill_cursor(t, j, self.per_step))
        return rows, self._request(rows, ("refill", t, j), version, t)

    def _request(self, rows: list[dict], key: tuple, version: int, k: int) -> Future:
        """Generate ``rows`` from ``version`` (bounded mode: late-bound), seeded by ``key``; with
        a lag profile each sample from batch ``k``'s draw."""
        sampling = replace(self.sampling, seed=request_seed(self.seed, *key))
        late = self.lag.mode == "bounded" and self.lag.n > 0
        if self.env is not None:  # multi-turn: trajectories of the environment
            env, engine, tok, n = self.env, self.thread.engine, self.tokenizer, self.group_size
            calls = self._turn_versions(k)
            job = lambda: env.generate(engine, tok, rows, n, sampling, calls)  # noqa: E731
            return self.thread.submit_job(None if late else version, job)
        ids = [self.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        mixed = self.lag.sample_versions(k) if self.lag.profile is not None else []
        if len(set(mixed)) > 1:  # a profile: the samples of batch k come from several versions
            seed_of = lambda v: request_seed(self.seed, *key, "v", v)  # noqa: E731
            return self.thread.submit_mixed(mixed, ids, self.group_size, sampling, seed_of)
        # one version for the whole batch (a profile's single version: min = all)
        return self.thread.submit(None if late else version, ids, self.group_size, sampling)

    def _turn_versions(self, k: int):
        """A lag profile's version of every generation call of batch ``k``'s trajectories
        (turn ``j`` of trajectory ``i``: draw ``i`` of turn ``j``), or None without a profile."""
        if self.lag.profile is None:
            return None
        from sat_cli.envs.trajectory import TurnVersions

        table = [self.lag.sample_versions(k, j) for j in range(self.lag.turns)]
        return TurnVersions(lambda i, j: table[j][i], self.thread.load)

    def restore(self, snapshot: list) -> None:
        """Request again the batches a checkpoint recorded, with their versions."""
        for k, v in snapshot:
            self.submit(int(k), int(v))

    def request_ahead(self, t: int) -> None:
        """Batch ``t`` and up to ``ahead`` later ones the lag policy allows at trainer step ``t``."""
        for k in range(t, min(t + self.ahead, self.max_steps - 1) + 1):
            if k not in self.pending and (k == t or self.lag.can_submit(k, t)):
                self.submit(k, self.lag.version_for(k, t))

    def take(self, t: int) -> tuple[int, list, dict, float]:
        """Wait for batch ``t``: ``(version, groups, timing, wait seconds)``."""
        version, fut = self.pending[t]
        t0 = time.perf_counter()
        groups, timing = fut.result()
        wait_s = time.perf_counter() - t0
        del self.pending[t]
        return version, groups, timing, wait_s

    def versions(self) -> set[int]:
        """Every version a pending batch is (partly) generated from."""
        out = {v for v, _ in self.pending.values()}
        if self.lag.profile is not None:
            for k in self.pending:
                out |= self.lag.batch_versions(k, k)
        return out

    def snapshot(self) -> list[list[int]]:
        """``[[batch, version], ...]`` in batch order (what a checkpoint records)."""
        return [[k, v] for k, (v, _) in sorted(self.pending.items())]
