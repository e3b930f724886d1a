"""Images, artifacts, dicts, text, params and tags of a tracker run: :class:`ArtifactLog`, the
part of :class:`sat_cli.tracking.Tracker` that logs them (the tracker delegates to it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sat_cli.tracking.params import (
    MAX_PARAM_VALUE_LEN,
    MAX_TAG_VALUE_LEN,
    PARAMS_PER_BATCH,
    REDACTED,
    chunked,
    is_secret_key,
    mlflow_key,
    redact_uri,
    scalar_str,
    truncate,
)
from sat_cli.tracking.store import check_step


class ArtifactLog:
    """Histograms, artifacts, params and tags of one :class:`sat_cli.tracking.tracker.Tracker`'s
    run, through the tracker's ``call`` (a store failure drops the artifact and counts it in
    ``dropped``)."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.dropped = 0  # artifacts the store did not take

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
        if not self.tracker.active():
            return None
        from sat_cli.tracking.histograms import histogram_image, histogram_stats

        step = check_step(step)
        if self.tracker.relogged(step):  # already logged before the resume
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
        log_image = self.tracker.client.log_image
        self._artifact_call(
            "image", log_image, self.tracker.run_id, image, key=key, step=step, synchronous=True
        )
        self._artifact_call(
            "table",
            self.tracker.client.log_dict,
            self.tracker.run_id,
            table,
            f"tables/{key}/step_{step}.json",
        )
        return table

    def _artifact_call(self, what: str, fn, *args, **kwargs) -> bool:
        if not self.tracker.active():
            return False
        ok = self.tracker.call(what, fn, *args, **kwargs)
        if not ok:
            self.dropped += 1
        return ok

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a local file (or directory) into the run's artifacts under ``artifact_path``."""
        if not self.tracker.active():
            return
        p = Path(path)
        if not p.exists():  # a caller bug, not a store failure: do not count it as an outage
            raise FileNotFoundError(f"artifact to log does not exist: {p}")
        fn = self.tracker.client.log_artifacts if p.is_dir() else self.tracker.client.log_artifact
        self._artifact_call("artifact", fn, self.tracker.run_id, str(p), artifact_path)

    def log_dict(self, obj: Mapping[str, Any] | list, artifact_file: str) -> None:
        """Store ``obj`` as JSON (``.json``) or YAML (``.yaml``/``.yml``) at ``artifact_file``."""
        if self.tracker.active():
            self._artifact_call(
                "dict", self.tracker.client.log_dict, self.tracker.run_id, obj, artifact_file
            )

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` at ``artifact_file`` (e.g. ``config.yaml``)."""
        if self.tracker.active():
            self._artifact_call(
                "text", self.tracker.client.log_text, self.tracker.run_id, text, artifact_file
            )

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values stringified, URI passwords masked, secret keys redacted)."""
        if self.tracker.active():
            self.log_tags(dict(tags), soft=True)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Add params after the start (what is known only later, e.g. the engine worker's
        numeric paths); values stringified like the start's params."""
        if not self.tracker.active():
            return
        from mlflow.entities import Param

        items = [
            Param(mlflow_key(str(k)), truncate(redact_uri(str(v)), MAX_PARAM_VALUE_LEN))
            for k, v in params.items()
        ]
        for chunk in chunked(items, PARAMS_PER_BATCH):
            self._artifact_call(
                "params", self.tracker.client.log_batch, self.tracker.run_id, params=list(chunk)
            )

    def log_tags(self, tags: Mapping[str, Any], soft: bool = False) -> None:
        from mlflow.entities import RunTag

        items = [
            RunTag(
                mlflow_key(str(k)),
                REDACTED
                if is_secret_key(str(k))
                else truncate(redact_uri(scalar_str(v)), MAX_TAG_VALUE_LEN),
            )
            for k, v in tags.items()
        ]
        for chunk in chunked(items, PARAMS_PER_BATCH):
            if soft:
                self._artifact_call(
                    "tags", self.tracker.client.log_batch, self.tracker.run_id, tags=list(chunk)
                )
            else:
                self.tracker.client.log_batch(
                    self.tracker.run_id, tags=list(chunk), synchronous=True
                )
