"""Where the loop's batches come from, one object per kind of run:

* :class:`LiveStream` — the engine generates them (the rollout buffer requests ahead);
* :class:`RecordingStream` — the same, and each batch is stored as generated and scored
  (``replay.record=true``; a ``sat_cli.replay.store.StreamWriter``);
* :class:`ReplayStream` — `sat replay`: the recorded batches with their rewards (a
  ``sat_cli.replay.store.Recording``); the engine only evaluates, no weights are published for
  generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sat_cli.loop import multiturn


@dataclass(frozen=True)
class Batch:
    """Batch ``t``: its groups of samples, prompt rows, timing (``gen_s``, ``update_s``), the
    wait for it, and its rewards per group when they came with it (a replay, an environment;
    None in a group: drop it), else None."""

    groups: list
    rows: list[dict]
    timing: dict[str, float]
    wait_s: float
    rewards: list | None = None


class Stream(Protocol):
    generates: bool  # the engine generates the batches (weights are published for them)

    def take(self, t: int, buf) -> Batch: ...

    def keep(self, t: int, batch: Batch, rewards: list) -> None: ...


class LiveStream:
    generates = True

    def take(self, t: int, buf) -> Batch:
        """Request ahead as far as the lag policy allows, then wait for batch ``t``."""
        buf.request_ahead(t)
        _, groups, timing, wait_s = buf.take(t)
        # multi-turn: the environment rewarded each trajectory
        rewards = multiturn.rewards(groups) if buf.env is not None else None
        return Batch(groups, buf.prompts_for(t), timing, wait_s, rewards)

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        pass


@dataclass(frozen=True)
class RecordingStream(LiveStream):
    writer: Any  # a replay.store.StreamWriter

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        self.writer.write(t, batch.groups, batch.rows, rewards)


@dataclass(frozen=True)
class ReplayStream:
    recording: Any  # a replay.store.Recording
    generates = False

    def take(self, t: int, buf) -> Batch:
        groups, rows, rewards = self.recording.batch(t)
        return Batch(groups, rows, {"gen_s": 0.0, "update_s": 0.0}, 0.0, rewards)

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        pass
