"""The local rollout engine: an HF transformers model sampling in its own process.

``LocalEngine`` starts ``sat_cli.engines.local.worker.worker_main`` in a separate process
(multiprocessing ``spawn``), so generation overlaps training in the parent. Requests and replies
travel over a pipe as plain data (lists, numbers, numpy arrays); nothing is written to disk. One
background thread sends the requests in order, so ``generate_async`` returns a
``concurrent.futures.Future`` at once and ``update_weights`` takes effect between requests.

While waiting for a reply the client polls the worker's liveness: a worker that dies (crash, OOM
kill) turns every pending and later call into ``EngineError`` within about a second instead of a
hang. An exception inside the worker comes back as ``EngineError`` with the worker's traceback,
and the worker keeps serving.

Sampling semantics (temperature / top-p / top-k, the reported ``rollout_logp``, left padding,
R3 route capture, the kept sets and top-k a request may ask for) are documented in
``sat_cli.models.sampling``. Without a per-request ``seed`` the worker
derives one from the engine ``seed`` and a request counter, so a fresh engine replays the same
samples for the same sequence of requests.

In-flight updates (``LocalEngineRuntime(inflight_updates=True)``, off by default; the default path is unchanged):
``update_weights`` may be called from any thread while ``generate_async`` requests run. It goes
over a second (control) pipe, and the worker loads the new weights at the next token boundary of
the running batch (at once if idle); it returns when they are loaded. ``generate_async(...,
updates=[(after_tokens, path, version)])`` schedules updates at a fixed token boundary of that
request instead (deterministic). Samples then carry ``token_versions`` when their tokens come
from more than one version; ``weight_version`` is the version of the first token. Cache handling
(``inflight_cache``), versions and R3 are described in ``sat_cli.engines.local.inflight``.

Example::

    rt = LocalEngineRuntime("path/to/hf_dir", r3=True)
    with LocalEngine(LocalEngineSettings(), rt) as engine:
        groups = engine.generate([[20, 21, 22]], n=4, sampling=SamplingParams(max_new_tokens=16))
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import ClassVar

import numpy as np

from sat_cli.engines.base import RolloutEngine
from sat_cli.engines.local.inflight import InflightUpdates
from sat_cli.engines.local.runtime import LocalEngineRuntime
from sat_cli.engines.local.sync import LocalSync
from sat_cli.engines.local.worker import worker_main
from sat_cli.errors import EngineError, EngineStartError
from sat_cli.samples import Sample, SamplingParams

_POLL_S = 0.1


def _shutdown(proc, conn, ctrl=None) -> None:
    for c in (conn, ctrl):
        try:
            if c is not None:
                c.close()
        except OSError:
            pass
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


class LocalEngine(InflightUpdates, LocalSync, RolloutEngine):
    """HF-transformers rollout engine in its own process (implements ``RolloutEngine``)."""

    MAX_BATCH_SIZE: ClassVar[int] = 256  # sequences per forward of the worker
    STARTUP_TIMEOUT_S: ClassVar[float] = 300.0  # until the worker has loaded the model

    def __init__(self, settings, runtime: LocalEngineRuntime):
        """``settings``: ``engine.*`` of ``engine=local`` (``settings.LocalEngineSettings``:
        dtype, torch threads, device);
        ``runtime``: the model folder, seed, R3, the planned device, log file, the loaded
        weights' version and in-flight updates."""
        from sat_cli.engines.local.inflight import CACHE_MODES

        s, rt = settings, runtime
        if rt.inflight_cache not in CACHE_MODES:
            raise ValueError(f"inflight_cache={rt.inflight_cache!r}: use one of {CACHE_MODES}")
        self.model_path = str(rt.model_path)
        self.inflight_updates = bool(rt.inflight_updates)
        self.dtype, self.r3, self.seed = s.dtype, rt.r3, rt.seed
        self.weight_version = rt.weight_version
        self.adapter: int | None = None  # the version's adapter later requests name (LoRA)
        self.full_reloads = 0  # full weight loads after the start (LoRA: none)
        self.adapters_held: list[int] = []  # the versions whose adapters the worker holds
        cfg = dict(
            model_path=self.model_path,
            dtype=s.dtype,
            r3=rt.r3,
            seed=rt.seed,
            num_threads=s.num_threads,
            device=rt.device or s.device,
            log_file=str(rt.log_file) if rt.log_file else None,
            max_batch_size=self.MAX_BATCH_SIZE,
            version=rt.weight_version,
            adapters_kept=rt.adapters_kept,
        )
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        args = (child, cfg)
        self._ctrl = ctrl_child = None
        if self.inflight_updates:
            cfg.update(inflight=True, inflight_cache=rt.inflight_cache)
            self._ctrl, ctrl_child = ctx.Pipe(duplex=True)
            args = (child, cfg, ctrl_child)
        self._proc = ctx.Process(target=worker_main, args=args, daemon=True, name="sat-engine")
        self._proc.start()
        child.close()
        if ctrl_child is not None:
            ctrl_child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._conn, self._ctrl)
        self._lock = threading.Lock()
        self._ctrl_lock = threading.Lock()  # one in-flight update at a time, in call order
        self._ctrl_seq = 0
        self.sync_channel = SyncChannel(self)  # engines/local/sync.py talks through it
        self._closed = False
        self._dead: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sat-engine")
        self.pid = self._proc.pid
        try:
            ready = self._recv(timeout=self.STARTUP_TIMEOUT_S, what="engine startup")
        except EngineError:
            self._closed = True
            self._executor.shutdown(wait=False)
            self._finalizer()
            raise
        # the worker's own view: ATen CPU capability, torch threads, MKL branch (strings)
        self.numerics: dict[str, str] = dict(ready.get("numerics") or {})

    # --- transport -------------------------------------------------------------------------
    def _recv(self, timeout: float | None, what: str, conn=None):
        conn = self._conn if conn is None else conn
        deadline = None if timeout is None else time.monotonic() + timeout
        while not conn.poll(_POLL_S):
            if not self._proc.is_alive():
                # the reply may have landed just before the exit
                if conn.poll(0):
                    break
                self._dead = (
                    f"engine process {self._proc.pid} died (exit code {self._proc.exitcode})"
                )
                raise EngineError(f"{self._dead} during {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"engine did not answer {what} within {timeout:.0f} s")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as e:
            self._proc.join(2)
            self._dead = f"engine process {self._proc.pid} died (pipe closed, exit code {self._proc.exitcode})"
            raise EngineError(f"{self._dead} during {what}") from e
        if status != "ok":
            error = EngineStartError if what == "engine startup" else EngineError
            raise error(f"engine failed during {what}:\n{payload}")
        return payload

    def _call(self, cmd: str, payload=None, timeout: float | None = None):
        with self._lock:
            self._check_usable()
            try:
                self._conn.send((cmd, payload))
            except (BrokenPipeError, OSError) as e:
                self._dead = f"engine process {self._proc.pid} is gone"
                raise EngineError(self._dead) from e
            return self._recv(timeout, what=cmd)

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        if self._dead:
            raise EngineError(self._dead)
        if not self._proc.is_alive():
            self._dead = f"engine process {self._proc.pid} died (exit code {self._proc.exitcode})"
            raise EngineError(self._dead)

    # --- RolloutEngine ---------------------------------------------------------------------
    def generate_async(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        *,
        updates: list[tuple[int, str, int]] | None = None,
        adapters: list[int] | None = None,
    ) -> Future[list[list[Sample]]]:
        """``updates`` (in-flight mode only): ``(after_tokens, path, version)`` entries, each
        loaded at the token boundary where the running batch has sampled ``after_tokens`` tokens
        (tokens ``0..after_tokens-1`` from the old weights, the rest from the new; ``0``: before
        the prefill), counted in the first batch of ``MAX_BATCH_SIZE`` entries that reaches it;
        one the request ends before reaching is loaded after it. A failed load fails the request.
        ``adapters`` (LoRA): the weight version of each prompt, whose adapter the engine holds
        (``update_weights`` of each first); every sample is stamped with its prompt's.
        """
        self._check_usable()
        request = {
            "prompts": [list(map(int, p)) for p in prompts],
            "n": int(n),
            "sampling": asdict(sampling),
        }
        if adapters is not None:  # LoRA: prompt i from the adapter of version adapters[i]
            request["adapters"] = [int(v) for v in adapters]
        elif self.adapter is not None:  # LoRA: the request names its version's adapter
            request["adapter"] = self.adapter
        if updates:
            if not self.inflight_updates:
                raise ValueError("updates= needs LocalEngineRuntime(inflight_updates=True)")
            request["updates"] = [
                {"after_tokens": int(k), "path": str(path), "version": int(v)}
                for k, path, v in updates
            ]
        return self._executor.submit(self._generate, request, len(prompts), int(n))

    def _generate(self, request: dict, num_prompts: int, n: int) -> list[list[Sample]]:
        reply = self._call("generate", request)
        version = int(reply["weight_version"])
        groups: list[list[Sample]] = []
        flat = reply["samples"]
        for i in range(num_prompts):
            group = []
            for j in range(n):
                r = flat[i * n + j]
                routes = r["routed_experts"]
                tv = r.get("token_versions")
                group.append(
                    Sample(
                        prompt_ids=request["prompts"][i],
                        response_ids=r["response_ids"],
                        rollout_logp=r["rollout_logp"],
                        finish_reason=r["finish_reason"],
                        weight_version=int(r.get("weight_version", version)),
                        routed_experts=None if routes is None else np.asarray(routes, np.int32),
                        token_versions=list(tv) if tv and len(set(tv)) > 1 else None,
                        meta={"gen_s": reply["gen_s"]},
                        sampling_mask=r.get("sampling_mask"),
                        topk_ids=r.get("topk_ids"),
                        topk_logp=r.get("topk_logp"),
                    )
                )
            groups.append(group)
        if self.inflight_updates:  # scheduled updates move the worker's version
            with self._ctrl_lock:
                self.weight_version = max(self.weight_version, version)
        return groups

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        *,
        updates: list[tuple[int, str, int]] | None = None,
        adapters: list[int] | None = None,
    ) -> list[list[Sample]]:
        return self.generate_async(
            prompts, n, sampling, updates=updates, adapters=adapters
        ).result()

    def update_weights(self, path: str, version: int) -> None:
        """Load the HF checkpoint at ``path`` after the requests already queued; tag later samples
        with ``version``. Blocks until the worker has loaded it.

        In-flight mode: loaded at the next token boundary of the running request (at once when
        idle), from any thread; calls are applied one at a time in call order. ``version`` must
        not be below the loaded one (``ValueError``); a folder that is missing or does not load
        is ``EngineError`` and the engine keeps its weights, its version and its running request.
        """
        if self.inflight_updates:
            return self._update_inflight(str(path), int(version))
        self._check_usable()
        reply = self._executor.submit(
            self._call, "update_weights", {"path": str(path), "version": int(version)}
        ).result()
        self.weight_version = int(reply["weight_version"])
        self.full_reloads = int(reply.get("full_loads", self.full_reloads))
        if reply.get("adapter"):  # an adapter folder: the base stays, the adapter is named
            self.adapter = self.weight_version
            self.adapters_held = list(reply["adapters"])
            return
        self.adapter = None
        self.model_path = str(path)

    def health(self) -> bool:
        return not self._closed and self._dead is None and self._proc.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        if self._proc.is_alive() and self._dead is None:
            try:
                self._executor.submit(self._call, "close", None, 10.0).result(timeout=30)
            except (EngineError, TimeoutError):
                pass  # shutting down regardless; the finalizer terminates the process
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._proc.join(5)
        self._finalizer()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SyncChannel:
    """The part of a ``LocalEngine`` its distributed weight sync (``engines/local/sync.py``)
    uses: one message to the worker and its reply on the request pipe (the caller holds the
    engine's request lock), why the worker is gone (``dead``), the weight-sync group it joined
    (``group``) and what a completed sync leaves on the engine (``took``)."""

    def __init__(self, engine: LocalEngine):
        self._engine = engine
        self.group: str | None = None  # the weight-sync group the worker joined

    def send(self, cmd: str, payload) -> None:
        e = self._engine
        try:
            e._conn.send((cmd, payload))
        except (BrokenPipeError, OSError) as exc:
            e._dead = f"engine process {e._proc.pid} is gone"
            raise EngineError(e._dead) from exc

    def reply(self, what: str, timeout: float):
        return self._engine._recv(timeout, what=what)

    @property
    def dead(self) -> str | None:
        return self._engine._dead

    def took(self, version: int, zero_copy: bool) -> None:
        """The worker serves ``version`` (``zero_copy``: it took the received buffers as its
        weights)."""
        self._engine.weight_version = int(version)
        self._engine.sync_zero_copy = bool(zero_copy)
