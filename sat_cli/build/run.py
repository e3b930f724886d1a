"""What `sat train` runs: the loop's settings, sampling, lag policy and evaluators, and the
run's MLflow tracker (its tags and params, ``env.*`` included)."""

from __future__ import annotations

from pathlib import Path

from sat_cli import __version__
from sat_cli.build.components import run_environment
from sat_cli.build.parts import build_evaluator, loss_config, sampling_params


def lag_policy(obj):
    """The loop's LagPolicy: ``lag.n``/``lag.mode``, or a profile drawn with the run's seed."""
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.lag_profile import parse_profile

    if obj.lag.profile is None:
        return LagPolicy(obj.lag.n, obj.lag.mode)
    profile = parse_profile(obj.lag.profile)  # checked when the config was composed
    cells = obj.task.prompts_per_step * obj.task.samples_per_prompt
    env = getattr(obj, "env", None)  # an environment: one draw per turn's generation call
    turns = env.max_turns if env is not None and env.name != "none" else 1
    return LagPolicy(
        profile.max_lag, "fixed", profile=profile, seed=obj.seed, cells=cells, turns=turns
    )


def loop_settings(obj, run_dir: Path, tokenizer):
    """The loop's ``LoopSettings``: steps, batch, sampling, lag, clip schedule, periods."""
    from sat_cli.loop.schedule import Every
    from sat_cli.loop.train import ClipSchedule, LoopSettings

    t, a = obj.task, obj.algo
    replay = dict(sampling_mask=a.replay_sampling_mask, topk_logprobs=a.score_centering_topk)
    sampling = sampling_params(t, tokenizer, **replay)  # the kept sets the trainer replays
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
        eval=Every(obj.eval.every),
        eval_at_start=obj.eval.at_start,
        checkpoints=Every(obj.checkpoint.every),
        checkpoint_keep=obj.checkpoint.keep,
        histograms=Every(obj.tracking.histogram_every),
        samples=Every(obj.tracking.samples_every),
        inflight_updates=obj.lag.inflight_updates,
        weight_sync=sync_settings(obj.engine),
        max_reward_error_frac=obj.reward.max_error_frac,
        env=env_run(obj),
        dynamic=dynamic_sampling(a.dynamic_sampling),
    )


def dynamic_sampling(d):
    """The loop's ``dynamic.DynamicSampling`` of ``algo.dynamic_sampling`` (None: off)."""
    if not d.enabled:
        return None
    from sat_cli.loop.dynamic import DynamicSampling

    return DynamicSampling(d.std_tol, d.max_gen_batches)


def env_run(obj):
    """The loop's ``multiturn.EnvRun`` of the ``env`` section; None for ``env=none``."""
    e = obj.env
    if e.name == "none":
        return None
    from sat_cli.envs.base import EnvSettings
    from sat_cli.envs.trajectory import TrajectorySettings
    from sat_cli.loop.multiturn import EnvRun

    limits = dict(max_turns=e.max_turns, max_tokens=e.max_tokens)
    trajectory = TrajectorySettings(**limits, partial=e.partial)
    return EnvRun(e.name, EnvSettings(**limits, parser=e.parser, sandbox=e.sandbox), trajectory)


def evaluators(obj, specs, built: tuple, tracker):
    """The run's ``loop.parts.Evaluators`` (in training, final; None where not configured):
    ``specs`` the problems `sat train` checked (``commands.run.EvalSpecs``), ``built`` the
    ``(engine, tokenizer, task)`` they run on; their samples tables go to ``tracker``."""
    from sat_cli.loop.parts import Evaluators

    during = final = None
    if specs.during is not None:
        skip = specs.overlong_during
        during = build_evaluator(obj, *built, specs.during, overlong=skip, tracker=tracker)
    if obj.eval.final_n is not None:
        skip = specs.overlong_final
        final = build_evaluator(
            obj, *built, specs.final, final=True, overlong=skip, tracker=tracker
        )
    return Evaluators(during, final)


def make_tracker(obj, cfg_container: dict, run_name: str, run_id: str | None, dropped: int = 0):
    from sat_cli.rl.registry import sat_inert
    from sat_cli.tracking import Tracker, TrackerSettings, flatten_config
    from sat_cli.tracking.environment import git_commit
    from sat_cli.tracking.final_status import apply_pending
    from sat_cli.tracking.params import SWEEP_TAG_NAMES

    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    tags = {
        "sat.version": __version__,
        "git_commit": git_commit(),
        "algo": obj.algo.name,
        "clip": obj.clip.name,
        "lag": obj.lag.n if obj.lag.profile is None else obj.lag.profile,
        "lag_mode": obj.lag.mode if obj.lag.profile is None else "profile",
        "r3": obj.r3,
        "seed": obj.seed,
        "correction": obj.algo.correction,
        "sat.inert_recompute": sat_inert(loss_config(obj), obj.algo.num_minibatches),
    }
    tags.update({SWEEP_TAG_NAMES.get(k, k): v for k, v in obj.tracking.tags.items()})
    if dropped:
        tags["data.overlong_dropped"] = dropped
    # tracking.tags are tags, not params: a resumed sweep run may get another parent run id
    params = {**flatten_config(cfg_container), **run_environment(obj)}
    params = {k: v for k, v in params.items() if k.split(".")[:2] != ["tracking", "tags"]}
    store = TrackerSettings(uri, obj.run.experiment)
    tracker = Tracker(store, run_name, run_id=run_id, tags=tags, params=params)
    apply_pending(Path(obj.run.dir), tracker)
    return tracker


def sync_settings(engine):
    """The loop's ``SyncSettings``: the weight path, verification and the group (gloo when the
    engine runs on the CPU, nccl on a GPU)."""
    from sat_cli.loop.weightsync import GroupSpec, SyncSettings

    e, backend = engine, "nccl" if engine.device == "cuda" else "gloo"
    addr, port, timeout = e.weight_sync_master_addr, e.weight_sync_port, e.weight_sync_timeout_s
    group = GroupSpec(master_addr=addr, port=port, backend=backend, timeout_s=timeout)
    return SyncSettings(mode=e.weight_sync, verify=e.verify_weights, dtype=e.dtype, group=group)
