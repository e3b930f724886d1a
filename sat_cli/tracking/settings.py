"""Where a :class:`~sat_cli.tracking.tracker.Tracker` logs and how it talks to the store: its
settings (``TrackerSettings``); the run it logs (name, run id to resume, tags, params) is given
to the tracker itself. Plain data, no MLflow import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrackerSettings:
    """``uri``: the store (``sqlite:///…``, ``http(s)://…``; None or ``"none"``: disabled);
    ``experiment``: its experiment (created when absent); ``artifact_root``: the artifact
    location of a new experiment (None: ``<db folder>/mlartifacts`` for sqlite, the server's own
    for http); ``enabled=False``: a disabled tracker whatever the URI; ``http_timeout_s`` /
    ``http_max_retries``: MLflow's HTTP request settings while an http tracker is open;
    ``retry_interval_s``: between attempts while the store is down; ``max_buffered_metrics``:
    metric points kept in memory during an outage (oldest dropped first)."""

    uri: str | None
    experiment: str
    artifact_root: str | None = None
    enabled: bool = True
    http_timeout_s: float = 10.0
    http_max_retries: int = 1
    retry_interval_s: float = 30.0
    max_buffered_metrics: int = 100_000
