"""Schedules over steps: a small object the loop asks ``due(step)`` (evaluations, checkpoints,
histograms, samples tables)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """Due at every ``n``-th step; ``n = 0``: never. ``last``: also due at that step (the
    run's last, for evaluations), when the schedule is on at all."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"Every(n): n must be >= 0, got {self.n}")

    def due(self, step: int, last: int | None = None) -> bool:
        return self.n > 0 and (step % self.n == 0 or step == last)
