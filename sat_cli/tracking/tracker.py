"""The :class:`Tracker` (one MLflow run): start and resume (the store's side in
:mod:`~sat_cli.tracking.start`), failure handling, metrics, end. It is
composed of two parts it delegates to: :class:`~sat_cli.tracking.artifacts.ArtifactLog`
(histograms, artifacts, params, tags) and :class:`~sat_cli.tracking.outage.OutageGuard` (the
metrics spool and the outage limit); ``call``, ``client``, ``lock`` and ``flush`` are what the
parts use of it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from sat_cli import metric_names as M
from sat_cli.tracking.artifacts import ArtifactLog
from sat_cli.tracking.outage import METRICS_PER_BATCH, OutageGuard
from sat_cli.tracking.params import mlflow_key, redact_uri
from sat_cli.tracking.settings import TrackerSettings
from sat_cli.tracking.start import log_new_params, open_run
from sat_cli.tracking.store import (
    TrackingError,
    acquire_http_env,
    check_step,
    default_artifact_root,
    is_caller_error,
    is_disabled_uri,
    is_http,
    release_http_env,
    sqlite_db_path,
    store_errors,
    store_lock,
)
from sat_cli.util.signals import deferred

log = logging.getLogger("sat_cli.tracking")  # one logger for the package, as before the split

NONFINITE_KEY = M.TRACKING_NONFINITE
_STATUSES = ("FINISHED", "FAILED", "KILLED")


# --------------------------------------------------------------------------- the tracker


def _part(part: str, cls: type, name: str):
    """A Tracker method that is the method ``name`` of its part ``part`` (an instance of ``cls``)."""

    @functools.wraps(getattr(cls, name))
    def method(self, *args, **kwargs):
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return method


class Tracker:
    """One MLflow run; see the docstring of :mod:`sat_cli.tracking`. Use as a context manager or call ``end``."""

    def __init__(
        self,
        settings: TrackerSettings,
        run_name: str,
        *,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> None:
        """``settings``: the store and how to reach it; ``run_name`` names a new run,
        ``run_id`` resumes that one; ``tags`` and ``params`` are logged at the start."""
        s = settings
        self.uri = None if is_disabled_uri(s.uri) else str(s.uri)
        self.enabled = bool(s.enabled) and self.uri is not None
        self.experiment = s.experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.artifact_root: str | None = None
        self.retry_interval_s = float(s.retry_interval_s)
        self.nonfinite_total = 0
        self.dropped_metrics = 0
        self.skipped_relogged = 0
        self._buffer: deque = deque(maxlen=max(1, int(s.max_buffered_metrics)))
        self.buffer_limit = self._buffer.maxlen  # metric points kept in memory at most
        self._last_attempt = 0.0
        self._warned_nonfinite: set[str] = set()
        self._resume_last_step: dict[str, int] = {}
        self._resume_max_step = -1
        self._last_step = -1
        self.lock = threading.RLock()
        self._ended = False
        self.resumed_status: str | None = None  # the run's status before this resume
        self.status_recorded = False  # end() reached the store
        self._uses_http_env = False
        self.client = None
        self.artifacts = ArtifactLog(self)
        self.guard = OutageGuard(self)
        if not self.enabled:
            return

        from mlflow import MlflowClient

        self._errors = store_errors()
        if is_http(self.uri):
            acquire_http_env(s.http_timeout_s, s.http_max_retries)
            self._uses_http_env = True
        self.artifact_root = s.artifact_root or default_artifact_root(self.uri)
        try:
            db = sqlite_db_path(self.uri)
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
            # Two processes creating a fresh sqlite store at once race in MLflow's schema
            # migration ("expected to match one row"): serialise start-up on a lock file.
            with store_lock(db), deferred():
                self.client = MlflowClient(tracking_uri=self.uri)
                self._start(run_id, dict(tags or {}), dict(params or {}))
        except TrackingError:
            self._release()
            raise
        except KeyboardInterrupt:  # held back until the start was complete: end the run again
            if self.run_id is not None:
                self.end(self.resumed_status if self.resumed_status in _STATUSES else "KILLED")
            self._release()
            raise
        except self._errors as exc:
            self._release()
            if is_caller_error(exc):  # e.g. a bad experiment name, a deleted run: user input
                raise TrackingError(
                    f"MLflow rejected the run setup at {redact_uri(self.uri)}: {exc}"
                ) from exc
            raise TrackingError(
                f"cannot use the MLflow tracking store at {redact_uri(self.uri)}: "
                f"{type(exc).__name__}: {redact_uri(str(exc))[:500]}. "
                "Start the server (or `sat ui` for a local store), fix tracking.uri, "
                "or disable tracking with tracking.uri=none."
            ) from exc

    # ----------------------------------------------------------------- start / resume

    def _start(self, run_id: str | None, tags: dict[str, Any], params: dict[str, str]) -> None:
        run = open_run(self, self._errors, run_id)
        self.run_id, self.experiment_id = run.run_id, run.experiment_id
        self.artifact_uri, self.resumed_status = run.artifact_uri, run.resumed_status
        self._resume_last_step = run.last_steps
        self._resume_max_step = max(self._resume_last_step.values(), default=-1)
        log_new_params(self.client, self.run_id, params, run.params, tags)
        self.artifacts.log_tags(tags)

    # ----------------------------------------------------------------- failure handling

    def _release(self) -> None:
        if self._uses_http_env:
            self._uses_http_env = False
            release_http_env()

    def call(self, what: str, fn, *args, **kwargs) -> bool:
        """Run one client call; on a store failure mark the store down and return False."""
        with self.lock:
            if not self.store_answers():
                return False
            self._last_attempt = time.monotonic()
            try:
                with deferred():  # a signal must not cut a store transaction in half
                    fn(*args, **kwargs)
            except self._errors as exc:
                if is_caller_error(exc):
                    raise
                self.guard.mark_down(what, exc)
                return False
            self.guard.mark_up()
            return True

    def _retry_due(self) -> bool:
        return time.monotonic() - self._last_attempt >= self.retry_interval_s

    def store_answers(self) -> bool:
        """False while the store is down and its next retry is not due yet."""
        return self.guard.down_since is None or self._retry_due()

    def retry_now(self) -> None:
        """Let the next call try the store even inside the retry interval."""
        self._last_attempt = 0.0

    def relogged(self, step: int) -> bool:
        """True (and counted) for a step logged before the resume (histograms, images)."""
        if step <= self._resume_max_step:
            self.skipped_relogged += 1
            return True
        return False

    def skip_on_resume(self, points) -> None:
        """Never log again the steps of ``points`` (metrics sent from a spool at a resume)."""
        for m in points:
            self._resume_last_step[m.key] = max(self._resume_last_step.get(m.key, -1), m.step)
        self._resume_max_step = max(self._resume_max_step, *(m.step for m in points))

    def active(self) -> bool:
        return self.enabled and not self._ended and self.client is not None

    # ----------------------------------------------------------------- its parts

    log_histogram = _part("artifacts", ArtifactLog, "log_histogram")
    log_artifact = _part("artifacts", ArtifactLog, "log_artifact")
    log_dict = _part("artifacts", ArtifactLog, "log_dict")
    log_text = _part("artifacts", ArtifactLog, "log_text")
    log_params = _part("artifacts", ArtifactLog, "log_params")
    set_tags = _part("artifacts", ArtifactLog, "set_tags")
    keep_on_disk = _part("guard", OutageGuard, "keep_on_disk")
    outage_expired = _part("guard", OutageGuard, "expired")
    outage_message = _part("guard", OutageGuard, "message")
    outage_s = _part("guard", OutageGuard, "outage_s")

    @property
    def dropped_artifacts(self) -> int:
        return self.artifacts.dropped

    # ----------------------------------------------------------------- metrics

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log ``{name: value}`` at ``step`` with one ``log_batch`` (chunks of ≤ 1000 points).

        Non-finite values are skipped and counted in ``tracking/nonfinite_metrics``.
        """
        if not self.active():
            return
        from mlflow.entities import Metric

        step = check_step(step)
        self._last_step = max(self._last_step, step)
        ts = int(time.time() * 1000)
        points: dict[str, float] = {}
        nonfinite = 0
        for name, value in metrics.items():
            v = float(value)
            if not math.isfinite(v):
                nonfinite += 1
                if name not in self._warned_nonfinite:
                    self._warned_nonfinite.add(name)
                    log.warning("metric %s is %s at step %d; not logged (counted)", name, v, step)
                continue
            points[mlflow_key(name)] = v
        if nonfinite:
            self.nonfinite_total += nonfinite
            points[NONFINITE_KEY] = float(nonfinite)
        with self.lock:
            for key, v in points.items():
                if step <= self._resume_last_step.get(key, -(2**62)):
                    self.skipped_relogged += 1
                    continue
                if len(self._buffer) == self._buffer.maxlen:
                    self.dropped_metrics += 1
                self._buffer.append(Metric(key, v, ts, step))
            self.flush()

    def flush(self) -> None:
        with self.lock:
            if self.guard.spool is not None and not self.guard.send_spool():  # disk ones first
                self.guard.spill(self._buffer)
                return
            while self._buffer:
                n = min(METRICS_PER_BATCH, len(self._buffer))
                batch = [self._buffer[i] for i in range(n)]
                sent = None
                try:
                    sent = self.call("metrics", self.client.log_batch, self.run_id, metrics=batch)
                finally:
                    if sent is None:  # rejected as invalid (raised): drop it, or it blocks the rest
                        self.dropped_metrics += n
                        for _ in range(n):
                            self._buffer.popleft()
                if not sent:
                    break
                for _ in range(n):
                    self._buffer.popleft()
            if self._buffer and self.guard.spool is not None:  # the store is down: keep on disk
                self.guard.spill(self._buffer)

    @property
    def buffered_metrics(self) -> int:
        """Metric points waiting for the store (non-zero only while it is unreachable)."""
        return len(self._buffer)

    # ----------------------------------------------------------------- end

    def end(self, status: str = "FINISHED") -> None:
        """Flush, log the tracking counters and terminate the run; later calls do nothing."""
        status = status.upper()
        if status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, got {status!r}")
        if not self.active():
            self._ended = True
            return
        from mlflow.entities import Metric

        with self.lock:
            self.retry_now()  # one last try even inside the retry interval
            self.flush()
            spool = self.guard.spool
            if spool is not None and len(spool):
                log.warning(
                    "%d metric points wait in %s for the next sat command that reaches the store",
                    len(spool),
                    spool.path,
                )
            if self._buffer:
                self.dropped_metrics += len(self._buffer)
                log.warning(
                    "MLflow store unreachable at the end of run %s: %d metric points lost",
                    self.run_id,
                    len(self._buffer),
                )
                self._buffer.clear()
            counters = {
                M.TRACKING_DROPPED_METRICS: self.dropped_metrics,
                M.TRACKING_DROPPED_ARTIFACTS: self.dropped_artifacts,
            }
            counters = {k: float(v) for k, v in counters.items() if v}
            if counters and self.guard.down_since is None:
                ts = int(time.time() * 1000)
                step = max(self._last_step, 0)
                batch = [Metric(k, v, ts, step) for k, v in counters.items()]
                self.call("metrics", self.client.log_batch, self.run_id, metrics=batch)
            if self.skipped_relogged and self.guard.down_since is None:
                tags = {"sat.resume.skipped_relogged_points": self.skipped_relogged}
                self.artifacts.log_tags(tags, soft=True)
            self.status_recorded = self.call("end", self.client.set_terminated, self.run_id, status)
            self._ended = True
            self._release()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.end("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.end("KILLED")
        else:
            self.end("FAILED")
        return False
