"""The :class:`Tracker` (one MLflow run): start and resume, failure handling, metrics, end;
its histogram/artifact/tag methods come from :mod:`sat_cli.tracking.artifacts`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from sat_cli.tracking.artifacts import _ArtifactLogging
from sat_cli.tracking.outage import METRICS_PER_BATCH, _OutageHandling
from sat_cli.tracking.params import (
    MAX_PARAM_VALUE_LEN,
    PARAMS_PER_BATCH,
    chunked,
    mlflow_key,
    redact_uri,
    truncate,
)
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

NONFINITE_KEY = "tracking/nonfinite_metrics"
_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow 3's experiment kind: the UI opens such experiments in the model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


# --------------------------------------------------------------------------- the tracker


class Tracker(_ArtifactLogging, _OutageHandling):
    """One MLflow run; see the docstring of :mod:`sat_cli.tracking`. Use as a context manager or call ``end``."""

    def __init__(
        self,
        uri: str | None,
        experiment: str,
        run_name: str,
        *,
        artifact_root: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        enabled: bool = True,
        http_timeout_s: float = 10.0,
        http_max_retries: int = 1,
        retry_interval_s: float = 30.0,
        max_buffered_metrics: int = 100_000,
    ) -> None:
        self.uri = None if is_disabled_uri(uri) else str(uri)
        self.enabled = bool(enabled) and self.uri is not None
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.artifact_root: str | None = None
        self.retry_interval_s = float(retry_interval_s)
        self.nonfinite_total = 0
        self.dropped_metrics = 0
        self.dropped_artifacts = 0
        self.skipped_relogged = 0
        self._buffer: deque = deque(maxlen=max(1, int(max_buffered_metrics)))
        self._down_since: float | None = None
        self._last_attempt = 0.0
        self._warned_down = False
        self._warned_nonfinite: set[str] = set()
        self._resume_last_step: dict[str, int] = {}
        self._resume_max_step = -1
        self._last_step = -1
        self._lock = threading.RLock()
        self._ended = False
        self.resumed_status: str | None = None  # the run's status before this resume
        self.status_recorded = False  # end() reached the store
        self._uses_http_env = False
        self._client = None
        if not self.enabled:
            return

        from mlflow import MlflowClient

        self._errors = store_errors()
        if is_http(self.uri):
            acquire_http_env(http_timeout_s, http_max_retries)
            self._uses_http_env = True
        self.artifact_root = artifact_root or default_artifact_root(self.uri)
        try:
            db = sqlite_db_path(self.uri)
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
            # Two processes creating a fresh sqlite store at once race in MLflow's schema
            # migration ("expected to match one row"): serialise start-up on a lock file.
            with store_lock(db), deferred():
                self._client = MlflowClient(tracking_uri=self.uri)
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

    def _experiment_id(self) -> str:
        client = self._client
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return client.create_experiment(
                    self.experiment,
                    artifact_location=self.artifact_root,
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
                )
            except self._errors as exc:
                # another process (e.g. a parallel sweep job) created it in the meantime
                if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = client.get_experiment_by_name(self.experiment)
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {self.experiment!r} (id {exp.experiment_id}) is deleted; "
                f"restore it (`mlflow experiments restore --experiment-id {exp.experiment_id}`) "
                "or choose another experiment name."
            )
        kind = exp.tags.get(EXPERIMENT_KIND_TAG)
        if kind is None or kind.endswith("_inferred") or kind == "no_inferred_type":
            try:
                client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            except self._errors as exc:  # e.g. a server that lets this user log runs only
                log.warning(
                    "could not tag MLflow experiment %r as model training: %s", exp.name, exc
                )
        return exp.experiment_id

    def _start(self, run_id: str | None, tags: dict[str, Any], params: dict[str, str]) -> None:
        from mlflow.entities import Param

        client = self._client
        existing: dict[str, str] = {}
        if run_id:
            try:
                run = client.get_run(run_id)
            except self._errors as exc:
                if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                    raise
                raise TrackingError(
                    f"cannot resume MLflow run {run_id}: it does not exist in {redact_uri(self.uri)}"
                ) from exc
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
            self.resumed_status = run.info.status
            existing = dict(run.data.params)
            latest = getattr(run.data, "_metric_objs", None)
            if latest is None:  # the latest point per key is a private field of RunData
                latest = [client.get_metric_history(self.run_id, k)[-1] for k in run.data.metrics]
            self._resume_last_step = {m.key: int(m.step) for m in latest}
            self._resume_max_step = max(self._resume_last_step.values(), default=-1)
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.experiment_id = self._experiment_id()
            run = client.create_run(self.experiment_id, run_name=self.run_name)
            self.run_id = run.info.run_id
        self.artifact_uri = run.info.artifact_uri

        params = {mlflow_key(k): truncate(str(v), MAX_PARAM_VALUE_LEN) for k, v in params.items()}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("resumed run %s: params changed since it started: %s", run_id, changed)
            tags["sat.resume.changed_params"] = ",".join(changed)
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for chunk in chunked(new, PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=list(chunk), synchronous=True)
        self._log_tags(tags)

    # ----------------------------------------------------------------- failure handling

    def _release(self) -> None:
        if self._uses_http_env:
            self._uses_http_env = False
            release_http_env()

    def _mark_down(self, what: str, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
        if not self._warned_down:
            self._warned_down = True
            kept = (
                f"kept on disk in {self._spool.path}"
                if self._spool is not None
                else f"buffered (up to {self._buffer.maxlen} points)"
            )
            log.warning(
                "MLflow store %s unreachable while logging %s (%s: %s); training continues, "
                "metrics are %s and retried every %.0f s, images/artifacts are dropped and counted",
                redact_uri(self.uri or ""),
                what,
                type(exc).__name__,
                redact_uri(str(exc))[:300],
                kept,
                self.retry_interval_s,
            )

    def _call(self, what: str, fn, *args, **kwargs) -> bool:
        """Run one client call; on a store failure mark the store down and return False."""
        with self._lock:
            if self._down_since is not None and not self._retry_due():
                return False
            self._last_attempt = time.monotonic()
            try:
                with deferred():  # a signal must not cut a store transaction in half
                    fn(*args, **kwargs)
            except self._errors as exc:
                if is_caller_error(exc):
                    raise
                self._mark_down(what, exc)
                return False
            if self._down_since is not None:
                log.warning("MLflow store %s reachable again", redact_uri(self.uri or ""))
                self._down_since = None
                self._warned_down = False
            return True

    def _retry_due(self) -> bool:
        return time.monotonic() - self._last_attempt >= self.retry_interval_s

    def _active(self) -> bool:
        return self.enabled and not self._ended and self._client is not None

    # ----------------------------------------------------------------- metrics

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log ``{name: value}`` at ``step`` with one ``log_batch`` (chunks of ≤ 1000 points).

        Non-finite values are skipped and counted in ``tracking/nonfinite_metrics``.
        """
        if not self._active():
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
        with self._lock:
            for key, v in points.items():
                if step <= self._resume_last_step.get(key, -(2**62)):
                    self.skipped_relogged += 1
                    continue
                if len(self._buffer) == self._buffer.maxlen:
                    self.dropped_metrics += 1
                self._buffer.append(Metric(key, v, ts, step))
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            if self._spool is not None and not self._send_spool():  # points on disk go first
                self._spill()
                return
            while self._buffer:
                n = min(METRICS_PER_BATCH, len(self._buffer))
                batch = [self._buffer[i] for i in range(n)]
                sent = None
                try:
                    sent = self._call("metrics", self._client.log_batch, self.run_id, metrics=batch)
                finally:
                    if sent is None:  # rejected as invalid (raised): drop it, or it blocks the rest
                        self.dropped_metrics += n
                        for _ in range(n):
                            self._buffer.popleft()
                if not sent:
                    break
                for _ in range(n):
                    self._buffer.popleft()
            if self._buffer and self._spool is not None:  # the store is down: keep them on disk
                self._spill()

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
        if not self._active():
            self._ended = True
            return
        from mlflow.entities import Metric

        with self._lock:
            self._last_attempt = 0.0  # one last try even inside the retry interval
            self._flush()
            if self._spool is not None and len(self._spool):
                log.warning("%d metric points wait in %s for the next sat command that reaches "
                            "the store", len(self._spool), self._spool.path)  # fmt: skip
            if self._buffer:
                self.dropped_metrics += len(self._buffer)
                log.warning(
                    "MLflow store unreachable at the end of run %s: %d metric points lost",
                    self.run_id,
                    len(self._buffer),
                )
                self._buffer.clear()
            counters = {
                "tracking/dropped_metrics": self.dropped_metrics,
                "tracking/dropped_artifacts": self.dropped_artifacts,
            }
            counters = {k: float(v) for k, v in counters.items() if v}
            if counters and self._down_since is None:
                ts = int(time.time() * 1000)
                step = max(self._last_step, 0)
                batch = [Metric(k, v, ts, step) for k, v in counters.items()]
                self._call("metrics", self._client.log_batch, self.run_id, metrics=batch)
            if self.skipped_relogged and self._down_since is None:
                self._log_tags({"sat.resume.skipped_relogged_points": self.skipped_relogged}, True)
            self.status_recorded = self._call(
                "end", self._client.set_terminated, self.run_id, status
            )
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
