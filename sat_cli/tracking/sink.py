"""What the training loop needs of a tracker: :class:`MetricSink`, and :class:`NullSink`, the
sink that keeps nothing.

The loop (``sat_cli.loop``) logs through these five methods only. :class:`~sat_cli.tracking.Tracker`
is the MLflow implementation; tests and benchmarks that keep metrics in memory subclass
:class:`NullSink` and override what they record, so the loop never has to probe its sink with
``hasattr``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricSink(Protocol):
    run_id: str | None  # the tracked run's id (None: nothing is stored); checkpoints keep it

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_histogram(self, key: str, values: Any, step: int, **kw: Any) -> None: ...

    def log_dict(self, obj: Mapping[str, Any] | list, artifact_file: str) -> None: ...

    def outage_expired(self) -> bool:
        """True once the store has been unreachable for longer than the run allows."""
        ...

    def outage_message(self) -> str:
        """Why the run stops when :meth:`outage_expired` is true."""
        ...


class NullSink:
    """A :class:`MetricSink` that keeps nothing and never has an outage."""

    run_id: str | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_histogram(self, key: str, values: Any, step: int, **kw: Any) -> None:
        pass

    def log_dict(self, obj: Mapping[str, Any] | list, artifact_file: str) -> None:
        pass

    def outage_expired(self) -> bool:
        return False

    def outage_message(self) -> str:
        return ""
