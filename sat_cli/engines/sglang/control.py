"""Pause, continue, cache flush and health of the workers behind an :class:`SGLangEngine`.

The methods of :class:`sat_cli.engines.sglang.engine.SGLangEngine` that send one control call
to every worker (``/pause_generation``, ``/continue_generation``, ``/flush_cache``) or probe
them (``/health_generate``, ``/model_info``), as a mixin of the engine.
"""

from __future__ import annotations

from sat_cli.engines.base import EngineError
from sat_cli.engines.sglang.wire import _excerpt

PAUSE_MODES = ("abort", "retract", "in_place")


class _WorkerControl:
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

    def resume(self) -> None:
        self._check_usable()
        for url in self.worker_urls:
            self.client.post_json("/continue_generation", {}, url=url)
        self._paused = None

    def flush_cache(self) -> None:
        """``/flush_cache`` on every worker; SGLang answers 400 while requests run or wait."""
        self._check_usable()
        for url in self.worker_urls:
            status, body = self.client.request("POST", "/flush_cache", None, url=url)
            if status != 200:
                raise EngineError(f"{url}/flush_cache answered HTTP {status}: {_excerpt(body)}")

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
