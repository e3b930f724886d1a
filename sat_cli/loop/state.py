"""The loop's state across steps and on disk: the state a run starts from (``initial_state``),
what is on disk before the first step (``start``), the checkpoints (``checkpoint``: the state
with the batches requested but not consumed, the trainer, the weights a resume needs) and the
stop when the tracking store has been unreachable too long (``checkpoint_or_stop``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sat_cli.checkpoints.state import CheckpointError, prune_checkpoints, save_checkpoint
from sat_cli.errors import RunFailed
from sat_cli.loop.publisher import WeightPublisher, min_needed

if TYPE_CHECKING:
    from sat_cli.loop.rollouts import RolloutBuffer, RolloutThread
    from sat_cli.loop.settings import LoopSettings


def initial_state() -> dict[str, Any]:
    return {
        "step": 0,  # next step to run; the trainer holds this weight version
        "pending": [],  # [[batch, version], ...] requested, not consumed (resume re-requests)
        "published": [0],
        "engine_version": 0,
        "eval": {"best": None, "best_step": None, "last": None, "last_step": None, "key": None},
        "counters": {
            "skipped_steps": 0,
            "dropped_groups": 0,
            "sat_active_steps": 0,
            "sat_steps": 0,
            "nonfinite_steps": 0,
            "stale_dropped": 0,
        },
        "finished": False,
    }


def start(
    s: LoopSettings, st: dict, pub: WeightPublisher, thread: RolloutThread, resumed: bool
) -> None:
    """Before the first step: v0 on disk; a resumed run's current version published; the
    rollout thread told the newest published version (bounded mode's late binding)."""
    if not (pub.weights_dir / "v0").is_dir():
        if st["step"] != 0:
            raise CheckpointError(f"{pub.weights_dir / 'v0'} is missing: cannot resume this run")
        pub.write(0)
    if resumed and st["step"] < s.max_steps:
        # a finished run extended with a larger max_steps: its last weights were never
        # published (no batch needed them then); the trainer holds exactly that version
        st["finished"] = False
        if s.lag.publish_after(st["step"], s.max_steps):
            pub.publish(st["step"])
    thread.newest = max((v for v in pub.published if v <= st["step"]), default=0)


def checkpoint(
    s: LoopSettings,
    st: dict,
    step_done: int,
    trainer,
    buf: RolloutBuffer,
    thread: RolloutThread,
    pub: WeightPublisher,
) -> None:
    ckpt_root = s.run_dir / "checkpoints"
    st["pending"] = buf.snapshot()
    st["engine_version"] = thread.engine_version
    st["min_needed"] = min_needed(s.lag, step_done, st["pending"])
    st["published"] = pub.published
    if pub.sync is not None:  # distributed: what a resume can ask for goes to disk now
        for v in pub.published:
            if v >= st["min_needed"]:
                pub.sync.to_disk(v)
        st["published"] = [v for v in pub.published if (pub.weights_dir / f"v{v}").is_dir()]
    save_checkpoint(ckpt_root, step_done, trainer, st)
    prune_checkpoints(ckpt_root, s.checkpoint_keep)


def checkpoint_or_stop(s: LoopSettings, st: dict, new_version: int, trainer, p, tracker) -> None:
    """A checkpoint every ``checkpoint_every`` steps; when the tracking store has been
    unreachable for ``tracking.outage_timeout_s``, one now and the run stops (``RunFailed``)."""
    outage = new_version < s.max_steps and tracker.outage_expired()
    if outage or (
        0 < new_version < s.max_steps
        and s.checkpoint_every > 0
        and (new_version % s.checkpoint_every == 0)
    ):
        checkpoint(s, st, new_version, trainer, p.buf, p.thread, p.pub)
    if outage:
        raise RunFailed(
            f"{tracker.outage_message()}. The run stopped after step {new_version} with "
            f"the checkpoint {s.run_dir / 'checkpoints' / f'step_{new_version}'}; once the store "
            f"answers, continue it with the same command and resume=auto ({s.run_dir})"
        )
