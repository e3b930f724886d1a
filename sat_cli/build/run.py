"""What `sat train` runs: the checked inputs (:class:`RunInputs`, one dataclass for the run
command), the loop's settings, sampling, lag policy and evaluators, and the run's MLflow
tracker (its tags and params, ``env.*`` included)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sat_cli import __version__
from sat_cli.build.components import run_environment
from sat_cli.build.parts import build_evaluator, sat_inert_recompute


@dataclass
class RunInputs:
    """Everything `sat train` checked before its run folder was locked: the config (composed
    ``cfg`` and typed ``obj``), the run folder and checkpoint to resume, the model, tokenizer and
    task, the evaluation specs (in-training, final, overlong problems), the prompts dropped as
    too long, the log and the stream (``overrides``, a ``replay`` recording or None)."""

    cfg: Any
    obj: Any
    run_dir: Path
    ckpt: Path | None
    path: str
    tokenizer: Any
    task: Any
    specs: tuple
    dropped: int
    log: Callable[[str], None]
    stream: dict


def lag_policy(obj):
    """The loop's LagPolicy: ``lag.n``/``lag.mode``, or a profile drawn with the run's seed."""
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.lag_profile import parse_profile

    if obj.lag.profile is None:
        return LagPolicy(obj.lag.n, obj.lag.mode)
    profile = parse_profile(obj.lag.profile)  # checked when the config was composed
    cells = obj.task.prompts_per_step * obj.task.samples_per_prompt
    return LagPolicy(profile.max_lag, "fixed", profile=profile, seed=obj.seed, cells=cells)


def loop_settings(obj, run_dir: Path, tokenizer):
    """The loop's ``LoopSettings``: steps, batch, sampling, lag, clip schedule, periods."""
    from sat_cli.engines.base import SamplingParams
    from sat_cli.loop.train import ClipSchedule, LoopSettings

    t, a = obj.task, obj.algo
    sampling = SamplingParams(
        temperature=t.temperature,
        top_p=t.top_p,
        top_k=t.top_k,
        max_new_tokens=t.max_new_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        sampling_mask=a.replay_sampling_mask,  # the kept sets the trainer replays
        topk_logprobs=a.score_centering_topk,
    )
    return LoopSettings(
        max_steps=obj.max_steps,
        prompts_per_step=t.prompts_per_step,
        group_size=t.samples_per_prompt,
        sampling=sampling,
        lag=lag_policy(obj),
        run_dir=run_dir,
        seed=obj.seed,
        adv_std_norm=a.adv_std_norm,
        drop_zero_adv_groups=a.drop_zero_adv_groups,
        r3=obj.r3,
        clip=ClipSchedule(a.eps_low, a.eps_high, obj.clip.schedule, obj.clip.final_scale),
        eval_every=obj.eval.every,
        eval_at_start=obj.eval.at_start,
        checkpoint_every=obj.checkpoint.every,
        checkpoint_keep=obj.checkpoint.keep,
        histogram_every=obj.tracking.histogram_every,
        samples_every=obj.tracking.samples_every,
        inflight_updates=obj.lag.inflight_updates,
        weight_sync=sync_settings(obj.engine),
        max_reward_error_frac=obj.reward.max_error_frac,
        env=env_run(obj),
    )


def env_run(obj):
    """The loop's ``multiturn.EnvRun`` of the ``env`` section; None for ``env=none``."""
    e = obj.env
    if e.name == "none":
        return None
    from sat_cli.envs.base import EnvSettings
    from sat_cli.envs.trajectory import TrajectorySettings
    from sat_cli.loop.multiturn import EnvRun

    return EnvRun(
        e.name,
        EnvSettings(max_turns=e.max_turns, max_tokens=e.max_tokens, parser=e.parser),
        TrajectorySettings(max_turns=e.max_turns, max_tokens=e.max_tokens, partial=e.partial),
    )


def evaluators(run: RunInputs, engine, tracker) -> tuple:
    """(in-training, final) evaluators of the run's engine (their samples tables logged to
    ``tracker``); None where not configured."""
    spec, final_spec, overlong = run.specs
    args = (run.obj, engine, run.tokenizer, run.task)
    evaluator = final = None
    if spec is not None:
        evaluator = build_evaluator(
            *args, spec=spec, overlong=overlong.get("eval"), tracker=tracker
        )
    if run.obj.eval.final_n is not None:
        final = build_evaluator(
            *args, spec=final_spec, final=True, overlong=overlong.get("final"), tracker=tracker
        )
    return evaluator, final


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# tracking.tags keys that `sat sweep` sets, and the MLflow tags they become
TAG_NAMES = {
    "sweep_id": "sat.sweep_id",
    "override_hash": "sat.override_hash",
    "method": "sat.method",
    "parent_run_id": "mlflow.parentRunId",
}


def make_tracker(obj, cfg_container: dict, run_name: str, run_id: str | None, dropped: int = 0):
    from sat_cli.tracking import Tracker, TrackerSettings, flatten_config
    from sat_cli.tracking.final_status import apply_pending

    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    tags = {
        "sat.version": __version__,
        "git_commit": _git_commit(),
        "algo": obj.algo.name,
        "clip": obj.clip.name,
        "lag": obj.lag.n if obj.lag.profile is None else obj.lag.profile,
        "lag_mode": obj.lag.mode if obj.lag.profile is None else "profile",
        "r3": obj.r3,
        "seed": obj.seed,
        "correction": obj.algo.correction,
        "sat.inert_recompute": sat_inert_recompute(obj),
    }
    tags.update({TAG_NAMES.get(k, k): v for k, v in obj.tracking.tags.items()})
    if dropped:
        tags["data.overlong_dropped"] = dropped
    # tracking.tags are tags, not params: a resumed sweep run may get another parent run id
    params = {**flatten_config(cfg_container), **run_environment(obj)}
    params = {k: v for k, v in params.items() if k.split(".")[:2] != ["tracking", "tags"]}
    tracker = Tracker(
        TrackerSettings(uri, obj.run.experiment), run_name, run_id=run_id, tags=tags, params=params
    )
    apply_pending(Path(obj.run.dir), tracker)
    return tracker


def sync_settings(engine):
    """The loop's ``SyncSettings``: the weight path, verification and the group (gloo when the
    engine runs on the CPU, nccl on a GPU)."""
    from sat_cli.loop.weightsync import GroupSpec, SyncSettings

    group = GroupSpec(
        master_addr=engine.weight_sync_master_addr,
        port=engine.weight_sync_port,
        backend="nccl" if engine.device == "cuda" else "gloo",
        timeout_s=engine.weight_sync_timeout_s,
    )
    return SyncSettings(
        mode=engine.weight_sync, verify=engine.verify_weights, dtype=engine.dtype, group=group
    )
