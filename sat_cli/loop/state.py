"""The loop's moving parts and its state on disk: :class:`Rollouts` (the rollout thread, its
buffer of requested batches, the weight publisher and the weight path), what is on disk before
the first step (:func:`start`), the checkpoints (:func:`checkpoint`: the typed
``LoopState`` with the batches requested but not consumed, the trainer, the weights a resume
needs) and the stop when the tracking store has been unreachable too long
(:func:`checkpoint_or_stop`). The state itself: ``sat_cli.checkpoints.loop_state``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sat_cli.checkpoints.loop_state import LoopState
from sat_cli.checkpoints.state import CheckpointError, prune_checkpoints, save_checkpoint
from sat_cli.errors import RunFailed
from sat_cli.loop.publisher import WeightPublisher, min_needed
from sat_cli.loop.rollouts import RolloutBuffer, RolloutThread

if TYPE_CHECKING:
    from sat_cli.loop.parts import RunParts
    from sat_cli.loop.settings import LoopSettings
    from sat_cli.loop.weightsync import WeightSync


@dataclass
class Rollouts:
    """The rollout thread and its buffer of requested batches, the weight publisher and the
    weight path (``sync``; None: plain disk loads)."""

    thread: RolloutThread
    pub: WeightPublisher
    buf: RolloutBuffer
    sync: WeightSync | None

    @classmethod
    def open(cls, s: LoopSettings, st: LoopState, parts: RunParts) -> Rollouts:
        weights_dir = s.run_dir / "weights"
        sync = None  # the weight path, its verification and fallback (loop/weightsync.py)
        if s.weight_sync is not None:
            from sat_cli.loop.weightsync import WeightSync

            sync = WeightSync(s.weight_sync, parts.engine, parts.trainer, weights_dir)
        # a (re)started engine holds the initial weights: version 0, also kept on disk
        thread = RolloutThread(
            parts.engine, weights_dir, engine_version=0, inflight=s.inflight_updates, sync=sync
        )
        pub = WeightPublisher(
            s, parts.trainer, st.published, on_publish=thread.published, sync=sync
        )
        return cls(thread, pub, RolloutBuffer(s, thread, parts.task, parts.tokenizer), sync)


def start(s: LoopSettings, st: LoopState, r: Rollouts, resumed: bool) -> None:
    """Before the first step: v0 on disk; a resumed run's current version published; the
    rollout thread told the newest published version (bounded mode's late binding)."""
    pub = r.pub
    if not (pub.weights_dir / "v0").is_dir():
        if st.step != 0:
            raise CheckpointError(f"{pub.weights_dir / 'v0'} is missing: cannot resume this run")
        pub.write(0)
    if resumed and st.step < s.max_steps:
        # a finished run extended with a larger max_steps: its last weights were never
        # published (no batch needed them then); the trainer holds exactly that version
        st.finished = False
        if s.lag.publish_after(st.step, s.max_steps):
            pub.publish(st.step)
    r.thread.newest = max((v for v in pub.published if v <= st.step), default=0)


def checkpoint(s: LoopSettings, st: LoopState, step_done: int, trainer, r: Rollouts) -> None:
    ckpt_root = s.run_dir / "checkpoints"
    pub = r.pub
    st.pending = r.buf.snapshot()
    st.engine_version = r.thread.engine_version
    st.min_needed = min_needed(s.lag, step_done, st.pending)
    st.published = pub.published
    if pub.sync is not None:  # distributed: what a resume can ask for goes to disk now
        for v in pub.published:
            if v >= st.min_needed:
                pub.sync.to_disk(v)
        st.published = [v for v in pub.published if (pub.weights_dir / f"v{v}").is_dir()]
    save_checkpoint(ckpt_root, step_done, trainer, st.to_json())
    prune_checkpoints(ckpt_root, s.checkpoint_keep)


def checkpoint_or_stop(s: LoopSettings, st: LoopState, version: int, parts, r: Rollouts) -> None:
    """A checkpoint as ``s.checkpoints`` schedules it (the last step's is the loop's own); when
    the tracking store has been unreachable for ``tracking.outage_timeout_s``, one now and the
    run stops (``RunFailed``). ``parts``: the run's ``RunParts`` (trainer, tracker)."""
    tracker = parts.tracker
    outage = version < s.max_steps and tracker.outage_expired()
    if outage or (0 < version < s.max_steps and s.checkpoints.due(version)):
        checkpoint(s, st, version, parts.trainer, r)
    if outage:
        raise RunFailed(
            f"{tracker.outage_message()}. The run stopped after step {version} with "
            f"the checkpoint {s.run_dir / 'checkpoints' / f'step_{version}'}; once the store "
            f"answers, continue it with the same command and resume=auto ({s.run_dir})"
        )
