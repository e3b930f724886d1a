"""MLflow tracking for `sat`: one run per training job, batched metrics, histograms, resume.

``Tracker`` wraps ``mlflow.MlflowClient`` (never the fluent ``mlflow.start_run`` API, whose
global "active run" would clash between several trackers or threads) and takes plain values:

    store = TrackerSettings("sqlite:///runs/mlflow.db", "toy")
    with Tracker(store, "grpo-lag8", tags={"algo": "grpo"}, params=flatten_config(cfg)) as tr:
        tr.log_metrics({M.LOSS_POLICY: 0.1, M.SAT_Q: 0.02}, step=0)  # M: metric_names
        tr.log_histogram(M.HIST_ABS_LOGRATIO, absd, step=0, marks={"q": q})

What it does:

* **Stores.** ``sqlite:///…`` stores get an explicit artifact location (default
  ``<directory of the db>/mlartifacts``), so artifacts never land in ``./mlruns`` of the
  current directory. ``http(s)://`` servers keep their own artifact root unless one is given.
  The experiment is created when absent and reused otherwise, tagged
  ``mlflow.experimentKind=custom_model_development`` (:data:`EXPERIMENT_KIND`) when created and
  when an existing one has no kind or only an inferred one (a kind a user chose is kept), so the
  MLflow 3 UI treats it as model training rather than GenAI. ``uri=None`` / ``"none"`` or
  ``enabled=False`` (both :class:`TrackerSettings`) gives a disabled tracker: every method is a no-op and ``run_id`` is None.
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
  ``keep_on_disk(folder, outage_timeout_s, retry_interval_s)`` (what `sat train` turns on,
  :mod:`sat_cli.tracking.outage`) keeps the unsent points in a file instead — nothing is
  dropped, a later command or the resumed run sends them — and makes ``outage_expired()`` true
  once the store has been unreachable for ``outage_timeout_s`` (the loop then checkpoints and
  stops).
  ``status_recorded`` says whether ``end`` reached the store; when it did not, the caller keeps
  the final status for later (``sat_cli.tracking.final_status``). ``resumed_status`` is the status a
  resumed run had before.
  Invalid arguments (MLflow ``INVALID_PARAMETER_VALUE``) are programming errors and are raised
  (at start as :class:`TrackingError`: a bad experiment name or a deleted run is user input).
* **HTTP timeouts.** For server URIs the MLflow client reads ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
  ``…_MAX_RETRIES`` and ``…_BACKOFF_FACTOR`` from the environment at every request. The tracker
  sets the ones the user has not set (to ``http_timeout_s``/``http_max_retries``/1) while at least
  one http tracker is open, and removes them when the last one ends; values set by the user are
  never touched. The first open tracker's values win for all.
"""

from sat_cli.tracking.params import (
    MAX_KEY_LEN,
    MAX_PARAM_VALUE_LEN,
    MAX_TAG_VALUE_LEN,
    PARAMS_PER_BATCH,
    REDACTED,
    flatten_config,
    is_secret_key,
    mlflow_key,
    redact_uri,
)
from sat_cli.tracking.settings import TrackerSettings
from sat_cli.tracking.store import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    TrackingError,
    default_artifact_root,
    mlflow_executable,
    sqlite_db_path,
    ui_command,
)
from sat_cli.tracking.tracker import METRICS_PER_BATCH, NONFINITE_KEY, Tracker

__all__ = [
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "MAX_KEY_LEN",
    "MAX_PARAM_VALUE_LEN",
    "MAX_TAG_VALUE_LEN",
    "METRICS_PER_BATCH",
    "NONFINITE_KEY",
    "PARAMS_PER_BATCH",
    "REDACTED",
    "Tracker",
    "TrackerSettings",
    "TrackingError",
    "default_artifact_root",
    "flatten_config",
    "is_secret_key",
    "mlflow_executable",
    "mlflow_key",
    "redact_uri",
    "sqlite_db_path",
    "ui_command",
]
