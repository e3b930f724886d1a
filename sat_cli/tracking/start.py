"""The store's side of a Tracker's start: the MLflow run created, or found and set RUNNING
again for a resume (with the last step of each of its metrics, so that nothing is logged
twice), and the run's params logged once (a resume logs only new ones and tags the changed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sat_cli.tracking.params import (
    MAX_PARAM_VALUE_LEN,
    PARAMS_PER_BATCH,
    chunked,
    mlflow_key,
    redact_uri,
    truncate,
)
from sat_cli.tracking.store import TrackingError, experiment_id

log = logging.getLogger("sat_cli.tracking")


@dataclass(frozen=True)
class OpenedRun:
    run_id: str
    experiment_id: str
    artifact_uri: str
    resumed_status: str | None = None  # the run's status before this resume
    params: dict[str, str] | None = None  # the params it already has (a resume)
    last_steps: dict[str, int] | None = None  # the last step of each of its metrics (a resume)


def open_run(tracker, errors, run_id: str | None) -> OpenedRun:
    """Resume ``run_id`` (set RUNNING again), or create a run named ``tracker.run_name`` in
    ``tracker.experiment``, through ``tracker.client``; ``errors``: the store's exception
    types."""
    client, uri = tracker.client, tracker.uri
    if not run_id:
        exp = experiment_id(client, tracker.experiment, tracker.artifact_root, errors)
        run = client.create_run(exp, run_name=tracker.run_name)
        return OpenedRun(run.info.run_id, exp, run.info.artifact_uri, None, {}, {})
    try:
        run = client.get_run(run_id)
    except errors as exc:
        if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise TrackingError(
            f"cannot resume MLflow run {run_id}: it does not exist in {redact_uri(uri)}"
        ) from exc
    latest = getattr(run.data, "_metric_objs", None)
    if latest is None:  # the latest point per key is a private field of RunData
        latest = [client.get_metric_history(run.info.run_id, k)[-1] for k in run.data.metrics]
    client.update_run(run.info.run_id, status="RUNNING")
    return OpenedRun(
        run.info.run_id,
        run.info.experiment_id,
        run.info.artifact_uri,
        run.info.status,
        dict(run.data.params),
        {m.key: int(m.step) for m in latest},
    )


def log_new_params(client, run_id: str, params: dict[str, Any], existing, tags: dict) -> None:
    """Log the params ``existing`` does not hold; a changed one is warned about and named in
    the tag ``sat.resume.changed_params`` (added to ``tags``)."""
    from mlflow.entities import Param

    params = {
        mlflow_key(k): truncate(redact_uri(str(v)), MAX_PARAM_VALUE_LEN) for k, v in params.items()
    }
    changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
    if changed:
        log.warning("resumed run %s: params changed since it started: %s", run_id, changed)
        tags["sat.resume.changed_params"] = ",".join(changed)
    new = [Param(k, v) for k, v in params.items() if k not in existing]
    for chunk in chunked(new, PARAMS_PER_BATCH):
        client.log_batch(run_id, params=list(chunk), synchronous=True)
