"""What a training run is made of: :class:`RunParts`, the frozen value one assembly step builds
(``sat_cli.build.run.assemble``: engine, trainer, tracker, evaluators, task, scorer, stream,
progress) and ``TrainLoop`` (``sat_cli.loop.train``) runs; and :class:`EvalScores`, what an
evaluation returns: its metrics and, named explicitly, the headline score the loop keeps the
best and last of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sat_cli.loop.stream import LiveStream, Stream
from sat_cli.tracking.sink import MetricSink

if TYPE_CHECKING:
    from sat_cli.engines.base import RolloutEngine
    from sat_cli.loop.progress import Progress
    from sat_cli.rewards import Scorer
    from sat_cli.tasks.base import Task, Tokenizer
    from sat_cli.trainers.base import Trainer


@dataclass(frozen=True)
class EvalScores:
    """One evaluation: its metrics (``eval/<name>/…`` or ``final/<name>/…``), the one the run
    is judged by (``headline``, e.g. ``eval/toy/avg@8``; None: nothing to keep) and those the
    console line shows (``shown``, headline first)."""

    metrics: dict[str, float]
    headline: str | None = None
    shown: tuple[str, ...] = ()


Evaluator = Callable[[], EvalScores]  # evaluates the engine's current weights


@dataclass(frozen=True)
class Evaluators:
    """The run's evaluations: in training (``during``, scheduled by ``LoopSettings.eval``) and
    once on the final weights (``final``, logged as ``final/…`` at the last step)."""

    during: Evaluator | None = None
    final: Evaluator | None = None


@dataclass(frozen=True)
class RunParts:
    """The run's built parts. ``engine`` is None under ``sat replay`` without evaluations;
    ``scorer`` (a ``sat_cli.rewards.Scorer``) None: the task's own grader; ``stream``: where
    batches come from (``loop.stream``); ``progress``: the console progress (None: silent)."""

    engine: RolloutEngine | None
    trainer: Trainer
    tracker: MetricSink
    task: Task
    tokenizer: Tokenizer
    evaluators: Evaluators = Evaluators()
    scorer: Scorer | None = None
    stream: Stream = LiveStream()
    progress: Progress | None = None
