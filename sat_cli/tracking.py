"""MLflow tracking for `sat`: one run per training job, batched metrics, histograms, resume.

``Tracker`` wraps ``mlflow.MlflowClient`` (never the fluent ``mlflow.start_run`` API, whose
global "active run" would clash between several trackers or threads) and takes plain values:

    with Tracker("sqlite:///runs/mlflow.db", "toy", "grpo-lag8", artifact_root=None,
                 tags={"algo": "grpo"}, params=flatten_config(cfg)) as tr:
        tr.log_metrics({"loss/policy": 0.1, "sat/q": 0.02}, step=0)
        tr.log_histogram("staleness/abs_logratio", absd, step=0, marks={"q": q})

What it does:

* **Stores.** ``sqlite:///…`` stores get an explicit artifact location (default
  ``<directory of the db>/mlartifacts``), so artifacts never land in ``./mlruns`` of the
  current directory. ``http(s)://`` servers keep their own artifact root unless one is given.
  The experiment is created when absent and reused otherwise, tagged
  ``mlflow.experimentKind=custom_model_development`` (:data:`EXPERIMENT_KIND`) when created and
  when an existing one has no kind or only an inferred one (a kind a user chose is kept), so the
  MLflow 3 UI treats it as model training rather than GenAI. ``uri=None`` / ``"none"`` or
  ``enabled=False`` gives a disabled tracker: every method is a no-op and ``run_id`` is None.
* **Metrics.** ``log_metrics`` sends one ``log_batch`` per step (chunks of ≤ 1000 points).
  NaN/±inf values are not logged (the sqlite store would keep NaN and clip inf to ±1.8e308,
  which wrecks charts); their number is logged as ``tracking/nonfinite_metrics`` at that step.
  Keys are passed through :func:`mlflow_key`: MLflow names only allow ``[A-Za-z0-9_\\-. :/]``,
  so ``eval/aime24/avg@8`` is logged as ``eval/aime24/avg_at_8``.
* **Histograms.** ``log_histogram`` logs a step-indexed image (``MlflowClient.log_image`` with
  ``key``/``step``; MLflow stores it as ``images/<key with / → ~>+step+<N>+timestamp+…png``
  plus a compressed ``.webp``, and the UI shows a step slider per key) and the numbers behind it
  as ``tables/<key>/step_<N>.json`` (``numpy.histogram`` edges and counts, summary stats, marks).
* **Resume.** ``run_id=…`` continues that run (status set back to RUNNING). Params already in
  the run are not re-logged (MLflow params are immutable; a changed value is warned about and
  listed in the tag ``sat.resume.changed_params``). Metric points at a step ≤ the last step the
  run already holds for that key (and histograms at a step ≤ the run's last step) are skipped
  and counted (``skipped_relogged``, tag ``sat.resume.skipped_relogged_points``), so a run
  resumed from an older checkpoint keeps each step exactly once (the first-logged values).
* **Failures.** If the store cannot be reached when the tracker starts, :class:`TrackingError`
  is raised with the URI (password masked) and the cause; the CLI turns it into exit code 2.
  If it becomes unreachable mid-run, training goes on: a warning is logged once, metric points
  are kept in a bounded buffer (``max_buffered_metrics``, oldest dropped first and counted in
  ``dropped_metrics``) and re-sent at the next ``log_metrics``/``end`` after ``retry_interval_s``;
  images, tables, artifacts and tags that fail are dropped and counted in ``dropped_artifacts``.
  On a successful reconnect the buffer is flushed; ``end`` logs the counters as metrics
  ``tracking/dropped_metrics`` / ``tracking/dropped_artifacts`` (at the last step) when non-zero.
  ``status_recorded`` says whether ``end`` reached the store; when it did not, the caller keeps
  the final status for later (``sat_cli.loop.final_status``). ``resumed_status`` is the status a
  resumed run had before.
  Invalid arguments (MLflow ``INVALID_PARAMETER_VALUE``) are programming errors and are raised
  (at start as :class:`TrackingError`: a bad experiment name or a deleted run is user input).
* **HTTP timeouts.** For server URIs the MLflow client reads ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
  ``…_MAX_RETRIES`` and ``…_BACKOFF_FACTOR`` from the environment at every request. The tracker
  sets the ones the user has not set (to ``http_timeout_s``/``http_max_retries``/1) while at least
  one http tracker is open, and removes them when the last one ends; values set by the user are
  never touched. The first open tracker's values win for all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sat_cli.signals import deferred

log = logging.getLogger(__name__)

MAX_PARAM_VALUE_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_LEN = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH
REDACTED = "***"
NONFINITE_KEY = "tracking/nonfinite_metrics"
_TRUNCATED = "...[truncated]"
_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow 3's experiment kind: the UI opens such experiments in the model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


class TrackingError(RuntimeError):
    """The tracking store cannot be used (unreachable, unknown run, deleted experiment)."""


# --------------------------------------------------------------------------- names and params

_INVALID_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(name: str) -> str:
    """The MLflow-legal form of a metric/param/tag name: ``@`` → ``_at_``, other bad chars → ``_``.

    MLflow accepts only alphanumerics, ``_ - . : /`` and spaces, and at most 250 characters.
    """
    key = _INVALID_KEY_CHARS.sub("_", name.replace("@", "_at_"))
    return key[:MAX_KEY_LEN]


# Words (split on non-alphanumerics and camelCase) that mark a config key as secret. "token" counts
# only as the last word and not after a tokenizer special-token word, so `hf_token` and
# `auth.token` are secret but `max_new_tokens`, `pad_token` and `eos_token_id` are not.
_SECRET_WORDS = frozenset(
    {"secret", "password", "passwd", "pwd", "apikey", "auth", "authorization", "credential"}
    | {"credentials", "passphrase", "bearer"}
)
_SPECIAL_TOKEN_WORDS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special"})
_SPECIAL_TOKEN_WORDS |= {"start", "end", "stop", "image", "audio", "video", "think"}
_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s]*):(?P<pw>[^@/?#\s]*)@")


def _key_words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """True if a config key names a credential (see the word rules above)."""
    words = _key_words(key)
    if any(w in _SECRET_WORDS for w in words):
        return True
    if any(a == "api" and b == "key" for a, b in zip(words, words[1:], strict=False)):
        return True
    if words and words[-1] == "token":
        return not (len(words) > 1 and words[-2] in _SPECIAL_TOKEN_WORDS)
    return False


def redact_uri(text: str) -> str:
    """Mask the password of every ``scheme://user:password@host`` inside ``text``."""
    return _URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)


def _truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    return value[: limit - len(_TRUNCATED)] + _TRUNCATED


def _scalar_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)  # YAML-like: null, true, 1e-06
    return str(value)


def _redact_nested(value: Any) -> Any:
    """Copy of a list/dict value with secret keys masked and URI passwords removed."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if is_secret_key(str(k)) else _redact_nested(v)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        # argument lists: mask the value after a secret-named flag (`--api-key SECRET`) and the
        # `--api-key=SECRET` form
        out: list[Any] = []
        for i, v in enumerate(value):
            prev = value[i - 1] if i else None
            if (
                isinstance(prev, str)
                and prev.startswith("-")
                and "=" not in prev
                and is_secret_key(prev.lstrip("-"))
            ):
                out.append(REDACTED)
            elif (
                isinstance(v, str)
                and v.startswith("-")
                and "=" in v
                and is_secret_key(v.split("=", 1)[0].lstrip("-"))
            ):
                out.append(v.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(_redact_nested(v))
        return out
    if isinstance(value, str):
        return redact_uri(value)
    return value


def flatten_config(d: Mapping[str, Any], sep: str = ".") -> dict[str, str]:
    """Flatten a nested config into MLflow params ``{"a.b.c": "value"}``.

    Values are strings: ``str`` as is, numbers/bools/None JSON-style (``1e-06``, ``true``,
    ``null``), lists as JSON. Secret keys (:func:`is_secret_key`) become ``"***"`` (a secret
    section is collapsed to one ``"***"`` entry); passwords inside URIs are masked everywhere.
    Values are truncated to MLflow's 6000-character limit and keys made MLflow-legal.
    Pass plain containers (e.g. ``OmegaConf.to_container(cfg, resolve=True)``).
    """
    out: dict[str, str] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{sep}{k}" if prefix else str(k)
            if is_secret_key(str(k)):
                out[mlflow_key(key)] = REDACTED
            elif isinstance(v, Mapping) and v:
                walk(v, key)
            else:
                if isinstance(v, Mapping):
                    text = "{}"
                elif isinstance(v, list | tuple):
                    text = json.dumps(_redact_nested(list(v)), default=str)
                else:
                    text = redact_uri(_scalar_str(v))
                out[mlflow_key(key)] = _truncate(text, MAX_PARAM_VALUE_LEN)

    walk(d, "")
    return out


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# --------------------------------------------------------------------------- store URIs


def _is_disabled_uri(uri: str | None) -> bool:
    return uri is None or str(uri).strip().lower() in ("", "none", "off", "disabled")


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///path`` URI (relative to the cwd), else None."""
    m = re.match(r"^sqlite:///(?P<path>.+)$", uri)
    if not m or m.group("path") == ":memory:":
        return None
    return Path(m.group("path").split("?", 1)[0])


def default_artifact_root(uri: str) -> str | None:
    """``<directory of the db>/mlartifacts`` (absolute) for a sqlite URI, else None."""
    db = sqlite_db_path(uri)
    return str((db.parent / "mlartifacts").resolve()) if db is not None else None


def mlflow_executable() -> list[str]:
    """Command prefix that runs the ``mlflow`` CLI of this environment."""
    exe = Path(sys.executable).with_name("mlflow")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mlflow")
    return [found] if found else [sys.executable, "-m", "mlflow"]


def ui_command(store_uri: str, host: str = "127.0.0.1", port: int = 5000) -> list[str]:
    """Argument list that serves the MLflow UI for a local sqlite store on ``host:port``.

    Runs ``mlflow server`` (the venv's executable beside ``sys.executable``, else
    ``python -m mlflow``) with one worker, artifacts served from ``<db dir>/mlartifacts``.
    Runs logged straight into the sqlite store keep their absolute artifact paths, which the
    server reads directly; experiments created through the server store under the same folder.
    """
    db = sqlite_db_path(store_uri)
    if db is None:
        raise ValueError(
            f"`sat ui` serves a local sqlite store (sqlite:///path/mlflow.db); got {redact_uri(store_uri)!r}"
        )
    return mlflow_executable() + [
        "server",
        "--backend-store-uri",
        f"sqlite:///{db.resolve()}",
        "--artifacts-destination",
        str(default_artifact_root(store_uri)),
        "--host",
        host,
        "--port",
        str(int(port)),
        "--workers",
        "1",
    ]


# --------------------------------------------------------------------------- HTTP timeout env

_ENV_LOCK = threading.Lock()
_ENV_USERS = 0
_ENV_SET_BY_US: list[str] = []


def _acquire_http_env(timeout_s: float, max_retries: int) -> None:
    global _ENV_USERS
    wanted = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(math.ceil(timeout_s)))),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(int(max_retries)),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    with _ENV_LOCK:
        if _ENV_USERS == 0:
            for name, value in wanted.items():
                if name not in os.environ:
                    os.environ[name] = value
                    _ENV_SET_BY_US.append(name)
        _ENV_USERS += 1


def _release_http_env() -> None:
    global _ENV_USERS
    with _ENV_LOCK:
        _ENV_USERS -= 1
        if _ENV_USERS == 0:
            for name in _ENV_SET_BY_US:
                os.environ.pop(name, None)
            _ENV_SET_BY_US.clear()


def _store_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the store failed", as opposed to a bug in the caller."""
    from mlflow.exceptions import MlflowException

    errors: tuple[type[BaseException], ...] = (MlflowException, OSError)
    try:
        from sqlalchemy.exc import SQLAlchemyError

        errors += (SQLAlchemyError,)
    except ImportError:  # mlflow-skinny has no sqlalchemy; sqlite stores need the full package
        pass
    return errors


def _check_step(step: Any) -> int:
    """MLflow steps are int64; a bad one would be rejected by the store at every retry."""
    value = int(step)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"MLflow step must fit in int64, got {step!r}")
    return value


def _is_caller_error(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE"


# --------------------------------------------------------------------------- the tracker


class _store_lock:
    """An exclusive ``flock`` on ``<db>.lock`` beside a sqlite store (no-op for other stores)."""

    def __init__(self, db: Path | None):
        self.path = None if db is None else db.with_name(db.name + ".lock")
        self.fd = None

    def __enter__(self):
        if self.path is not None:
            import fcntl

            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class Tracker:
    """One MLflow run; see the module docstring. Use as a context manager or call ``end``."""

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
        self.uri = None if _is_disabled_uri(uri) else str(uri)
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

        self._errors = _store_errors()
        if _is_http(self.uri):
            _acquire_http_env(http_timeout_s, http_max_retries)
            self._uses_http_env = True
        self.artifact_root = artifact_root or default_artifact_root(self.uri)
        try:
            db = sqlite_db_path(self.uri)
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
            # Two processes creating a fresh sqlite store at once race in MLflow's schema
            # migration ("expected to match one row"): serialise start-up on a lock file.
            with _store_lock(db), deferred():
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
            if _is_caller_error(exc):  # e.g. a bad experiment name, a deleted run: user input
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

        params = {mlflow_key(k): _truncate(str(v), MAX_PARAM_VALUE_LEN) for k, v in params.items()}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("resumed run %s: params changed since it started: %s", run_id, changed)
            tags["sat.resume.changed_params"] = ",".join(changed)
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for chunk in _chunks(new, PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=list(chunk), synchronous=True)
        self._log_tags(tags)

    # ----------------------------------------------------------------- failure handling

    def _release(self) -> None:
        if self._uses_http_env:
            self._uses_http_env = False
            _release_http_env()

    def _mark_down(self, what: str, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
        if not self._warned_down:
            self._warned_down = True
            log.warning(
                "MLflow store %s unreachable while logging %s (%s: %s); training continues, "
                "metrics are buffered (up to %d points) and retried every %.0f s, "
                "images/artifacts are dropped and counted",
                redact_uri(self.uri or ""),
                what,
                type(exc).__name__,
                redact_uri(str(exc))[:300],
                self._buffer.maxlen,
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
                if _is_caller_error(exc):
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

        step = _check_step(step)
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
                    return
                for _ in range(n):
                    self._buffer.popleft()

    @property
    def buffered_metrics(self) -> int:
        """Metric points waiting for the store (non-zero only while it is unreachable)."""
        return len(self._buffer)

    # ----------------------------------------------------------------- images and artifacts

    def log_histogram(
        self,
        key: str,
        values: Any,
        step: int,
        *,
        marks: Mapping[str, float] | None = None,
        bins: int | Sequence[float] | str = 50,
        xlabel: str | None = None,
        logy: bool = False,
    ) -> dict[str, Any] | None:
        """Log a histogram of ``values`` as a step-indexed image plus its JSON table.

        The image goes to MLflow's image-per-step storage under ``key`` (vertical dashed lines
        at ``marks``, e.g. ``{"q": 0.05}``); the table goes to ``tables/<key>/step_<N>.json``
        with ``edges``, ``counts`` (``numpy.histogram`` of the finite values), ``n``,
        ``nonfinite``, mean/std/min/max/p50/p90/p99, ``marks``, ``key`` and ``step``.
        Returns that table (None when disabled).
        """
        if not self._active():
            return None
        from sat_cli.plots import histogram_image, histogram_stats

        step = _check_step(step)
        if step <= self._resume_max_step:  # already logged before the resume
            self.skipped_relogged += 1
            return None
        key = mlflow_key(key)
        table = histogram_stats(values, bins)
        clean_marks = {k: float(v) for k, v in (marks or {}).items()}
        table.update(key=key, step=step, marks=clean_marks)
        image = histogram_image(
            None,
            title=f"{key}  (step {step})",
            marks=clean_marks,
            xlabel=xlabel if xlabel is not None else key.rsplit("/", 1)[-1],
            logy=logy,
            stats=table,
        )
        log_image = self._client.log_image
        self._artifact_call(
            "image", log_image, self.run_id, image, key=key, step=step, synchronous=True
        )
        self._artifact_call(
            "table", self._client.log_dict, self.run_id, table, f"tables/{key}/step_{step}.json"
        )
        return table

    def _artifact_call(self, what: str, fn, *args, **kwargs) -> bool:
        if not self._active():
            return False
        ok = self._call(what, fn, *args, **kwargs)
        if not ok:
            self.dropped_artifacts += 1
        return ok

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a local file (or directory) into the run's artifacts under ``artifact_path``."""
        if not self._active():
            return
        p = Path(path)
        if not p.exists():  # a caller bug, not a store failure: do not count it as an outage
            raise FileNotFoundError(f"artifact to log does not exist: {p}")
        fn = self._client.log_artifacts if p.is_dir() else self._client.log_artifact
        self._artifact_call("artifact", fn, self.run_id, str(p), artifact_path)

    def log_dict(self, obj: Mapping[str, Any] | list, artifact_file: str) -> None:
        """Store ``obj`` as JSON (``.json``) or YAML (``.yaml``/``.yml``) at ``artifact_file``."""
        if self._active():
            self._artifact_call("dict", self._client.log_dict, self.run_id, obj, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` at ``artifact_file`` (e.g. ``config.yaml``)."""
        if self._active():
            self._artifact_call("text", self._client.log_text, self.run_id, text, artifact_file)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values stringified, URI passwords masked, secret keys redacted)."""
        if self._active():
            self._log_tags(dict(tags), soft=True)

    def _log_tags(self, tags: Mapping[str, Any], soft: bool = False) -> None:
        from mlflow.entities import RunTag

        items = [
            RunTag(
                mlflow_key(str(k)),
                REDACTED
                if is_secret_key(str(k))
                else _truncate(redact_uri(_scalar_str(v)), MAX_TAG_VALUE_LEN),
            )
            for k, v in tags.items()
        ]
        for chunk in _chunks(items, PARAMS_PER_BATCH):
            if soft:
                self._artifact_call("tags", self._client.log_batch, self.run_id, tags=list(chunk))
            else:
                self._client.log_batch(self.run_id, tags=list(chunk), synchronous=True)

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
