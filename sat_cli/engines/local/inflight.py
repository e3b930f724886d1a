"""In-flight weight updates of the local engine (``LocalEngineRuntime(inflight_updates=True)``): the
worker's side, and the engine's end of the control pipe (:class:`InflightUpdates`).

The worker takes a new weight version *between decode steps* of a running request, so one
response can carry tokens from several versions:

* **Token boundary.** After token ``k`` of the running batch is sampled and before it is fed,
  the sampling loop asks :meth:`WeightSwitch.poll`. Updates that arrived on the control pipe
  (``LocalEngine.update_weights`` from any thread) and scheduled updates that are due
  (``generate(..., updates=[(after_tokens, path, version)])``) are loaded there; every later
  token is sampled from the new weights. The same poll runs before each batch's prefill, and
  the worker serves the control pipe whenever it is idle (between requests).
* **KV cache.** ``cache_mode="recompute"`` (default): prompt + tokens so far are re-prefilled
  under the new weights into a fresh cache, so every token's ``rollout_logp`` is the log-prob of
  the token under the weights recorded for it, given its whole prefix — exactly what a trainer
  forward under that version recomputes. ``"keep"``: the old cache is kept (cheaper, no
  re-prefill); ``rollout_logp`` is still the distribution actually sampled from, but for tokens
  after the switch it mixes old-weights KV with new-weights queries, so no single-version
  recompute reproduces it.
* **Versions.** ``token_versions[t]`` is the version that sampled token ``t``; versions only go
  up: an update older than the loaded version is refused (``ValueError``, an ``EngineError`` for
  the caller) and the engine keeps serving with its weights. A load that fails (missing folder,
  incomplete weights) is refused the same way; the running request goes on under the old weights.
* **R3.** Routes are those of the forward that sampled each token. A re-prefill routes the whole
  prefix again under the new weights; only its last row (the newest token, which the old
  weights never fed) is kept, the earlier rows stay as the old forwards routed them.
* The stop ids of a running request are those of its start; a new version's stop ids apply to
  later requests.
"""

from __future__ import annotations

import os
import traceback

from sat_cli.errors import EngineError

CACHE_MODES = ("recompute", "keep")


class WeightSwitch:
    """Weight updates at the token boundaries of one request (passed to ``sample_batch``).

    ``model`` / ``capture`` / ``version`` are the current ones; ``poll(tokens)`` applies what is
    due after ``tokens`` sampled tokens of the running batch and says whether the weights changed.
    Route capture (R3) follows the model: :meth:`capturing` holds a ``RouteCapture`` on the
    current model and moves it to a new model on a switch.
    """

    def __init__(self, worker, scheduled: list[dict], cache_mode: str, r3: bool):
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown in-flight cache mode {cache_mode!r}: use {CACHE_MODES}")
        self.worker = worker
        self.scheduled = sorted(scheduled, key=lambda u: int(u["after_tokens"]))
        self.cache_mode = cache_mode
        self.r3 = r3
        self.capture = None

    @property
    def model(self):
        return self.worker.model

    @property
    def version(self) -> int:
        return self.worker.version

    def poll(self, tokens: int) -> bool:
        changed = False
        while self.scheduled and int(self.scheduled[0]["after_tokens"]) <= tokens:
            u = self.scheduled.pop(0)
            self.worker.load_version(u["path"], int(u["version"]))
            changed = True
        changed = self.worker.serve_control() or changed
        if changed and self.capture is not None:
            self._release()
            self._attach()
        return changed

    def finish(self) -> None:
        """Apply the scheduled updates the request ended before reaching."""
        for u in self.scheduled:
            self.worker.load_version(u["path"], int(u["version"]))
        self.scheduled = []

    def _attach(self) -> None:
        from sat_cli.models.r3 import RouteCapture

        self.capture = RouteCapture(self.model).__enter__()

    def _release(self) -> None:
        self.capture.__exit__(None, None, None)
        self.capture = None

    def capturing(self):
        """A context holding route capture on the current model (nothing without R3)."""
        switch = self

        class _Ctx:
            def __enter__(self):
                if switch.r3:
                    switch._attach()
                return switch

            def __exit__(self, *exc):
                if switch.capture is not None:
                    switch._release()

        return _Ctx()


class ControlChannel:
    """The worker's end of the control pipe: weight updates that may arrive mid-request."""

    def __init__(self, conn):
        self.conn = conn

    def serve(self, load) -> bool:
        """Apply every update waiting on the pipe (``load(path, version)``), answering each with
        ``("ok", {"id", "weight_version", "error"})`` (``error``: the traceback of a refused
        update); True if weights were loaded. A closed pipe is dropped (the main pipe ends the
        worker)."""
        changed = False
        while self.conn is not None:
            try:
                if not self.conn.poll(0):
                    break
                cmd, payload = self.conn.recv()
            except (EOFError, OSError):
                self.conn = None
                break
            msg_id = payload.get("id") if isinstance(payload, dict) else None
            reply = {"id": msg_id, "weight_version": None, "error": None}
            try:
                if cmd != "update_weights":
                    raise ValueError(f"unknown control command {cmd!r}")
                load(payload["path"], int(payload["version"]))
                changed = True
                reply["weight_version"] = int(payload["version"])
            except Exception:
                reply["error"] = traceback.format_exc()
            try:
                self.conn.send(("ok", reply))
            except (BrokenPipeError, OSError):
                self.conn = None
        return changed


class InflightUpdates:
    """The engine's end of the control pipe (a mixin of ``LocalEngine``, which holds the pipe,
    the worker process and ``_recv``): one update at a time, in call order, answered by id."""

    def _update_inflight(self, path: str, version: int) -> None:
        with self._ctrl_lock:
            self._check_usable()
            if version < self.weight_version:
                raise ValueError(
                    f"weight version went backwards: {self.weight_version} -> {version}"
                )
            self._ctrl_seq += 1
            msg = {"path": path, "version": version, "id": self._ctrl_seq}
            try:
                self._ctrl.send(("update_weights", msg))
            except (BrokenPipeError, OSError) as e:
                self._dead = f"engine process {self._proc.pid} is gone"
                raise EngineError(self._dead) from e
            what = f"update_weights(v{version})"
            reply = self._recv(None, what=what, conn=self._ctrl)
            while reply["id"] != msg["id"]:  # the answer to a call that stopped waiting
                reply = self._recv(None, what=what, conn=self._ctrl)
            if reply["error"] is not None:
                raise EngineError(f"engine failed during {what}:\n{reply['error']}")
            self.weight_version = int(reply["weight_version"])
            self.model_path = path


def check_update(path: str, version: int, current: int) -> None:
    """Refuse an in-flight update before touching the model: versions only go up, and the
    weights folder must exist (a missing folder is not looked up on the hub)."""
    if version < current:
        raise ValueError(f"weight version went backwards: {current} -> {version}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"weights folder {path!r} does not exist (update to v{version})")
