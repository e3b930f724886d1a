"""A training run as objects: what `sat train` checked before it locked the run folder
(:class:`RunInputs`), the one assembly step that builds the run's parts from them
(:func:`assemble` → a frozen ``sat_cli.loop.parts.RunParts``) and the run's lifetime
(:class:`RunSession`: every part opened is closed at the end, each even if closing another one
fails, and the MLflow run ends with the run's status). `sat replay` and `sat calibrate-control`
run through the same path (``commands.train.train`` with a recording).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sat_cli.build.components import build_engine, build_launcher, build_trainer
from sat_cli.build.run import evaluators, make_tracker
from sat_cli.commands.common import loading, write_pids
from sat_cli.models.hub import source_tags
from sat_cli.tracking.environment import engine_params

if TYPE_CHECKING:
    from sat_cli.checkpoints.loop_state import LoopState
    from sat_cli.config.schema import SatConfig
    from sat_cli.loop.parts import RunParts
    from sat_cli.replay.store import Recording
    from sat_cli.tasks.base import Task, Tokenizer


@dataclass(frozen=True)
class EvalSpecs:
    """The evaluation problems the run checked: in training and final (each ``build.parts.
    eval_problems``' ``(problems, grader, template)``, or None when not configured) and, per
    evaluation, the problems too long for the context (scored as wrong, not sampled)."""

    during: tuple | None = None
    final: tuple | None = None
    overlong_during: frozenset | None = None
    overlong_final: frozenset | None = None


@dataclass(frozen=True)
class RunInputs:
    """Everything `sat train` checked before its run folder was locked: the typed config
    (``obj``), the composed one as plain values (``config``, resolved: the MLflow params, the
    resume check, a recording's header; ``config_yaml``, as composed: ``config.yaml``), the
    run folder and
    whether it is resumed, the model folder, tokenizer and task, the evaluation problems, the
    prompts dropped as too long, the log, the command's overrides (a recording's header) and
    the recording it replays (`sat replay`; None: the engine generates)."""

    obj: SatConfig
    config: dict[str, Any]  # plain JSON values: what MLflow and the resume check compare
    config_yaml: str
    run_dir: Path
    resuming: bool
    model: str
    tokenizer: Tokenizer
    task: Task
    evals: EvalSpecs
    dropped: int
    log: Callable[[str], None]
    overrides: tuple[str, ...] = ()
    replay: Recording | None = None


class RunSession:
    """The lifetime of a run's parts (a context manager). :meth:`open` registers a part to
    close; at the end they close newest first, each even if closing another one fails; the
    tracker's run ends ``FINISHED``, ``KILLED`` (Ctrl-C, SIGTERM, SIGHUP) or ``FAILED`` (the
    error also as the ``sat.error`` tag), or keeps its previous status when this process ran no
    step (``tracking.final_status.keep_previous_status``)."""

    def __init__(self, run_root: Path, log: Callable[[str], None]):
        self.run_root, self.log = run_root, log
        self.parts: list = []
        self.tracker = None
        self.loop = None  # the TrainLoop, once made (its steps_run)

    def open(self, part):
        if part is not None:
            self.parts.append(part)
        return part

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        from sat_cli.tracking.final_status import end_run, keep_previous_status

        status = "FINISHED" if kind is None else "FAILED"
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            status = "KILLED"
        elif isinstance(exc, Exception) and self.tracker is not None:
            # why the run FAILED, also in MLflow (e.g. a lost Ray node)
            self.tracker.set_tags({"sat.error": f"{type(exc).__name__}: {exc}"[:4000]})
        for part in reversed(self.parts):
            try:
                part.close()
            except Exception as err:  # noqa: BLE001 - reported, the others still close
                self.log(f"WARNING: closing {type(part).__name__} failed: {err}")
        steps = self.loop.steps_run if self.loop is not None else 0
        status = keep_previous_status(self.tracker, status, steps)
        end_run(self.tracker, status, self.run_root, self.log)


def assemble(run: RunInputs, resumed: LoopState | None, session: RunSession) -> RunParts:
    """The run's parts, each opened through ``session``: the launcher (``launcher=ray``:
    connected, processes placed), the tracker (``resumed``: the checkpoint's state, which names
    the MLflow run), the trainer, the engine (not for a replay without evaluations), the stream
    (replay, recording or the engine's), the evaluators, the reward's scorer and the progress."""
    from sat_cli.engines.verification import require_verification
    from sat_cli.loop.parts import RunParts
    from sat_cli.loop.progress import Progress
    from sat_cli.rewards import build_reward
    from sat_cli.rewards.grading import share_scorer
    from sat_cli.tracking.final_status import PENDING_DIR
    from sat_cli.weightsync.spec import check_support

    obj, log, logs, model = run.obj, run.log, run.run_dir / "logs", run.model
    run_id, start = (resumed.mlflow_run_id, resumed.step) if resumed else (None, 0)
    config = run.config
    launcher = session.open(build_launcher(obj, log, logs))
    tracker = session.tracker = make_tracker(obj, config, run.run_dir.name, run_id, run.dropped)
    tr = obj.tracking  # a store outage: the metrics wait on disk
    tracker.keep_on_disk(Path(obj.run.dir) / PENDING_DIR, tr.outage_timeout_s, tr.retry_interval_s)
    tracker.log_artifact(str(run.run_dir / "config.yaml"))
    trainer = loading(model, lambda: build_trainer(obj, model, run.run_dir, placer=launcher))
    session.open(trainer)
    engine = None
    if run.replay is None or run.evals.during is not None or run.evals.final is not None:
        engine = loading(model, lambda: build_engine(obj, model, logs, r3=obj.r3, placer=launcher))
        session.open(engine)
        check_support(obj.engine, engine)  # distributed: can this engine take it (exit 2)
        require_verification(engine, obj.engine.name, obj.engine.verify_weights, log)
    write_pids(logs, engine)
    # the engine worker's own numeric paths (sat_cli/tracking/environment.py)
    tracker.set_tags(engine_params(getattr(engine, "numerics", {})))
    tracker.set_tags(source_tags(model))  # a hub id's resolved commit (sat_cli/models/hub.py)
    stream = _stream(run, config, tracker.run_id)
    evals = evaluators(obj, run.evals, (engine, run.tokenizer, run.task), tracker)
    scorer = session.open(build_reward(obj.reward, run.task))
    for spec in (run.evals.during, run.evals.final):  # a reward plugin grades evaluations too
        if spec is not None:
            share_scorer(spec[1], scorer)
    progress = Progress(obj.max_steps, start=start)
    return RunParts(
        engine, trainer, tracker, run.task, run.tokenizer, evals, scorer, stream, progress
    )


def _stream(run: RunInputs, config: dict, run_id: str | None):
    """Where the batches come from: a replayed recording, the engine with a recording
    (``replay.record=true``; sat_cli/replay/store.py) or the engine."""
    from sat_cli.loop.stream import LiveStream, RecordingStream, ReplayStream

    if run.replay is not None:
        return ReplayStream(run.replay)
    if not run.obj.replay.record:
        return LiveStream()
    from sat_cli.replay.store import StreamWriter
    from sat_cli.tracking.params import redact_config, redact_text

    t = run.obj.task
    header = {  # no secret in a recording: `sat replay` asks for each masked value again
        "overrides": [redact_text(ov) for ov in run.overrides],
        "config": redact_config(config),
        "mlflow_run_id": run_id,
        "run": run.run_dir.name,
    }
    return RecordingStream(
        StreamWriter(run.run_dir / "replay", header, t.prompts_per_step, t.samples_per_prompt)
    )
