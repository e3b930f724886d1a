"""Where the loop's batches come from, one object per kind of run:

* :class:`LiveStream` — the engine generates them (the rollout buffer requests ahead);
* :class:`RecordingStream` — the same, and each batch is stored as generated and scored
  (``replay.record=true``; a ``sat_cli.replay.store.StreamWriter``);
* :class:`ReplayStream` — `sat replay`: the recorded batches with their rewards (a
  ``sat_cli.replay.store.Recording``); the engine only evaluates, no weights are published for
  generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sat_cli.loop import multiturn

if TYPE_CHECKING:
    from sat_cli.replay.store import Recording, StreamWriter


@dataclass(frozen=True)
class Batch:
    """Batch ``t``: its groups of samples, prompt rows, timing (``gen_s``, ``update_s``), the
    wait for it, and its rewards per group when they came with it (a replay, an environment;
    None in a group: drop it), else None. ``version``: the weight version it was requested
    from (None: a replay); ``keep``: per group, whether dynamic sampling trains on it (None:
    every group; ``loop.dynamic``)."""

    groups: list
    rows: list[dict]
    timing: dict[str, float]
    wait_s: float
    rewards: list | None = None
    version: int | None = None
    keep: list[bool] | None = None


class Stream(Protocol):
    generates: bool  # the engine generates the batches (weights are published for them)

    def take(self, t: int, buf) -> Batch: ...

    def keep(self, t: int, batch: Batch, rewards: list) -> None: ...

    def refill(self, t: int, j: int, buf, version: int | None) -> Batch | None: ...


class LiveStream:
    generates = True

    def take(self, t: int, buf) -> Batch:
        """Request ahead as far as the lag policy allows, then wait for batch ``t``."""
        buf.request_ahead(t)
        version, groups, timing, wait_s = buf.take(t)
        # multi-turn: the environment rewarded each trajectory
        rewards = multiturn.rewards(groups) if buf.env is not None else None
        return Batch(groups, buf.prompts_for(t), timing, wait_s, rewards, version)

    def refill(self, t: int, j: int, buf, version: int | None) -> Batch | None:
        """Generation batch ``j >= 1`` of step ``t`` (dynamic sampling), from ``version``."""
        rows, fut = buf.refill(t, j, version)
        t0 = time.perf_counter()
        groups, timing = fut.result()
        rewards = multiturn.rewards(groups) if buf.env is not None else None
        return Batch(groups, rows, timing, time.perf_counter() - t0, rewards, version)

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        pass


@dataclass(frozen=True)
class RecordingStream(LiveStream):
    writer: StreamWriter

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        self.writer.write(t, batch.groups, batch.rows, rewards)


@dataclass(frozen=True)
class ReplayStream:
    recording: Recording
    generates = False

    def take(self, t: int, buf) -> Batch:
        """The recorded batch ``t``; of a dynamic-sampling recording, its first generation
        batch (:meth:`refill` gives the others, as recorded)."""
        return self._part(t, 0) or Batch([], [], {"gen_s": 0.0, "update_s": 0.0}, 0.0, [])

    def refill(self, t: int, j: int, buf, version: int | None) -> Batch | None:
        """Generation batch ``j`` of step ``t`` as the recorded run drew it (None: it drew
        fewer)."""
        return self._part(t, j)

    def _part(self, t: int, j: int) -> Batch | None:
        groups, rows, rewards = self.recording.batch(t)
        n = self.recording.prompts_per_step or len(groups)  # a generation batch's groups
        if j * n >= len(groups):
            return None
        cut = slice(j * n, (j + 1) * n)
        return Batch(groups[cut], rows[cut], {"gen_s": 0.0, "update_s": 0.0}, 0.0, rewards[cut])

    def keep(self, t: int, batch: Batch, rewards: list) -> None:
        pass
