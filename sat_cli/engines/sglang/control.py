"""Pause, continue, cache flush and health of the workers behind an :class:`SGLangEngine`.

The methods of :class:`sat_cli.engines.sglang.engine.SGLangEngine` that send one control call
to every worker (``/pause_generation``, ``/continue_generation``, ``/flush_cache``) or probe
them (``/health_generate``, ``/model_info``), as a mixin of the engine.

In-flight updates (``SGLangRuntime(inflight_updates=True)``) pause the workers around every weight
update, in the mode that gives the engine's ``inflight_cache`` (the local engine's names,
``sat_cli.engines.local.inflight``); SGLang 0.5.23's modes, from its scheduler:

* ``in_place`` (``"keep"``): running requests stay in the batch with their KV cache, computed by
  the old weights, and decode on under the new ones (per-token versions in the
  ``weight_versions`` spans). A cache flush is refused while they run, so the update goes without
  one and the engine flushes before the next ``generate`` that finds none running. ``mu`` is the
  distribution sampled from, but not a recompute under one version; R3 routes stay those of the
  forwards that sampled.
* ``retract`` (``"recompute"``): running requests are retracted (KV freed, back to the waiting
  queue, generated tokens and their log-probs kept); a flush is allowed while paused, so the
  update flushes, and on resume prompt + generated tokens are prefilled again under the new
  weights: later tokens' ``mu`` is the new version's, given the whole prefix. But
  ``Req.reset_for_retract`` drops the routed experts and the re-prefill routes every earlier
  token again under the new weights, so it is refused with R3.
* ``abort``: running requests end with finish_reason ``abort`` (partial output); no response
  mixes versions, so it is not an in-flight mode.
"""

from __future__ import annotations

import contextlib
import time

from sat_cli.engines.sglang.wire import wire_excerpt
from sat_cli.errors import EngineError

# A request whose answer this client has read can still sit in the scheduler's running batch
# until its next loop turn, which on a loaded CPU can come after the next call arrives; SGLang
# then refuses a flush (HTTP 400). Callers flush only when none of their requests runs, so a
# refusal is retried for this long before it counts.
FLUSH_SETTLE_S = 10.0


def flush_settled(client, url: str, within_s: float | None = None) -> None:
    """``POST /flush_cache`` on ``url``, retried with backoff while SGLang answers 400 (requests
    still running or queued), for at most ``within_s`` (:data:`FLUSH_SETTLE_S`); EngineError
    quoting the last answer."""
    within_s = FLUSH_SETTLE_S if within_s is None else within_s
    deadline, pause = time.monotonic() + within_s, 0.02
    while True:
        status, body = client.request("POST", "/flush_cache", None, url=url)
        if status == 200:
            return
        if status != 400 or time.monotonic() + pause > deadline:
            text = wire_excerpt(body.decode("utf-8", errors="replace"))
            raise EngineError(f"{url}/flush_cache answered HTTP {status}: {text}")
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


PAUSE_MODES = ("abort", "retract", "in_place")
INFLIGHT_PAUSE = {"keep": "in_place", "recompute": "retract"}  # inflight_cache -> pause mode


def inflight_pause_mode(inflight_cache: str, r3: bool) -> str:
    """The pause mode of in-flight updates for ``inflight_cache``; ``recompute`` with R3 is
    refused (a retracted request's routes are recomputed under the new weights)."""
    if inflight_cache not in INFLIGHT_PAUSE:
        raise ValueError(f"inflight_cache={inflight_cache!r}: use one of {tuple(INFLIGHT_PAUSE)}")
    if inflight_cache == "recompute" and r3:
        raise ValueError(
            "inflight_cache='recompute' pauses SGLang with mode 'retract', whose re-prefill "
            "replaces the routed experts of tokens sampled before an update (R3); use "
            "inflight_cache='keep' (pause in_place) with r3"
        )
    return INFLIGHT_PAUSE[inflight_cache]


class WorkerControl:
    """Worker control of :class:`sat_cli.engines.sglang.engine.SGLangEngine` (a mixin)."""

    def pause(self, mode: str = "in_place") -> None:
        """``/pause_generation`` on every worker.

        ``in_place`` keeps running requests where they are (their KV cache too) and continues
        them on :meth:`resume`; ``abort`` ends them (finish_reason abort); ``retract`` frees
        their KV and recomputes prompt + generated tokens on resume, which replaces the routed
        experts recorded for tokens sampled before a weight update, so it is refused with R3.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "retract" and self.moe is not None:
            raise EngineError(
                "pause(mode='retract') with R3: SGLang recomputes a retracted request's prompt "
                "and generated tokens on resume, so the routed experts of tokens sampled before "
                "a weight update would be replaced by routes of the new weights; use in_place"
            )
        self._check_usable()
        for url in self.worker_urls:
            self.client.post_json("/pause_generation", {"mode": mode}, url=url)
        self._paused = mode

    @contextlib.contextmanager
    def _paused_for_update(self):
        """In-flight updates: pause the workers (unless already paused) around an update."""
        mode = self._inflight_pause
        if mode is None or self._paused is not None:
            yield
            return
        self.pause(mode=mode)
        try:
            yield
        finally:
            self.resume()

    def resume(self) -> None:
        self._check_usable()
        for url in self.worker_urls:
            self.client.post_json("/continue_generation", {}, url=url)
        self._paused = None

    def flush_cache(self) -> None:
        """``/flush_cache`` on every worker (:func:`flush_settled`: SGLang answers 400 while
        requests run or wait, also for a moment after the last one was answered)."""
        self._check_usable()
        for url in self.worker_urls:
            flush_settled(self.client, url)

    def health(self) -> bool:
        """All processes alive and every worker healthy: ``GET /health_generate`` answers 200.
        While paused that route blocks for 20 s and then answers 503 (its probe request cannot
        run), so a paused worker counts as healthy when ``GET /model_info`` answers."""
        if self._closed.is_set() or self.supervisor.failure() is not None:
            return False
        path = "/model_info" if self._paused else "/health_generate"
        for url in self.worker_urls:
            try:
                status, _ = self.client.request("GET", path, url=url, timeout_s=30.0, retries=0)
            except EngineError:
                return False
            if status != 200:
                return False
        return True
