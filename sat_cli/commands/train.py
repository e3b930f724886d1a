"""`sat train` and `sat pretrain`: check every input, build the objects (``sat_cli.build``),
then run the loop (``sat_cli.loop.train``).

Run directory: ``<run.dir>/<run.experiment>/<run.name>/`` with ``config.yaml`` (resolved),
``checkpoints/step_N/``, ``weights/vN/`` (published, pruned) and ``logs/``. The MLflow store
defaults to ``<run.dir>/mlflow.db``; the warm-start cache is ``<run.dir>/cache/``.
``logs/pids.json`` names this process and the engine's process (fault tests, soak runs).

Inputs (run name, resume target, the run folder's path, model folder — safetensors only,
every tensor checked against its config without loading —, tokenizer, task and evaluation data,
prompt lengths, the trainer layout) are checked before the run directory is created or any
process starts, so bad input exits 2 and writes nothing. Then the run folder is locked
(``sat_cli.commands.runlock``) and the checkpoint to resume from is verified
(``sat_cli.checkpoints.manifest``) before ``config.yaml``, the MLflow run or anything else is touched.
SIGTERM and SIGHUP stop the run like Ctrl-C (``sat_cli.util.signals``: exit 143 / 129).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from sat_cli.build.parts import build_task, eval_problems, loss_config, model_path
from sat_cli.build.run import loop_settings
from sat_cli.commands.common import check_devices
from sat_cli.commands.resume_check import config_yaml
from sat_cli.commands.run import EvalSpecs, RunInputs
from sat_cli.errors import UserError
from sat_cli.weightsync.spec import check_port


def default_run_name(obj) -> str:
    r3 = "-r3" if obj.r3 else ""
    lag = obj.lag.n if obj.lag.profile is None else obj.lag.profile.split(":")[0]
    return (
        f"{obj.algo.name}-{obj.clip.name}-lag{lag}{r3}-s{obj.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    )


# ----------------------------------------------------------------------------- run dirs


def resolve_run_dir(obj) -> tuple[Path, bool]:
    """(run dir, whether it is resumed). Refuses to overwrite a run silently. Reads only; the
    checkpoint to resume from is chosen and verified under the run's lock
    (:func:`sat_cli.checkpoints.manifest.resume_checkpoint`)."""
    from sat_cli.checkpoints.state import CheckpointError, latest_checkpoint, load_loop_state

    root = Path(obj.run.dir) / obj.run.experiment
    resume = obj.resume
    auto = resume in ("auto", "force")  # force: also with a changed config (resume_check)
    if resume is not None and not auto:
        run_dir = Path(resume)
        if latest_checkpoint(run_dir / "checkpoints") is None:
            raise UserError(
                f"resume={resume!r}: no complete checkpoint under {run_dir}/checkpoints"
            )
        return run_dir, True
    if auto and obj.run.name is None:

        def finished(ck: Path) -> bool:
            try:
                return load_loop_state(latest_checkpoint(ck)).finished
            except CheckpointError:
                return False  # damaged: resume=auto falls back to an older checkpoint

        cands = sorted(
            (p for p in root.glob("*/checkpoints") if latest_checkpoint(p)),
            key=lambda p: p.stat().st_mtime,
        )
        unfinished = [p.parent for p in cands if not finished(p)]
        if unfinished:
            return unfinished[-1], True
    name = obj.run.name or default_run_name(obj)
    run_dir = root / name
    if latest_checkpoint(run_dir / "checkpoints") is not None:
        if not auto:
            from sat_cli.commands.runlock import refuse_if_owned

            refuse_if_owned(run_dir)  # a live run of this folder: name it
            raise UserError(
                f"run {run_dir} already has checkpoints; continue it with resume=auto "
                "or choose another run.name"
            )
        return run_dir, True
    return run_dir, False


def _warn_recompute(obj, log) -> None:
    if (
        obj.algo.ratio_denominator == "recompute"
        and obj.lag.n > 0
        and obj.algo.correction == "none"
        and obj.algo.name != "decoupled_ppo"
    ):
        msg = (
            "WARNING: algo.ratio_denominator=recompute with lag > 0 and no correction "
            "(tis, mis, icepop or decoupled_ppo): the ratio's denominator is the trainer's own "
            "recompute, so the policy lag is silently IGNORED by the loss and SAT has nothing to act on."
        )
        warnings.warn(msg, stacklevel=2)
        log(msg)
    from sat_cli.rl.registry import sat_inert

    if sat_inert(loss_config(obj), obj.algo.num_minibatches):
        msg = (
            "WARNING: SAT IS INERT IN THIS RUN. clip=" + obj.clip.name + " with algo="
            f"{obj.algo.name}, correction={obj.algo.correction}, ratio_denominator="
            f"{obj.algo.ratio_denominator}: the loss ratio's denominator is the trainer's own "
            "recompute (pi_old), and with one optimizer step per batch (algo.num_minibatches=1) "
            "pi_theta == pi_old at the gradient, so d = 0 for every token, q = 0 and SAT changes "
            "nothing: this run is the base method. Use the rollout denominator (no correction) "
            "or algo.num_minibatches > 1 for SAT to act. `sat report` flags such runs."
        )
        warnings.warn(msg, stacklevel=2)
        log(msg)


# ----------------------------------------------------------------------------- commands


def train(cfg, obj, overrides, replay=None):
    """`sat train`: SIGTERM and SIGHUP stop it like Ctrl-C (``sat_cli.util.signals``).
    ``replay``: a verified ``replay.store.Recording`` (`sat replay`) replaces generation.
    Returns the run's final ``LoopState``."""
    from sat_cli.util.signals import orderly_stop

    with orderly_stop():
        return _run(_checked_inputs(cfg, obj, tuple(overrides), replay))


def _checked_inputs(cfg, obj, overrides: tuple[str, ...], replay) -> RunInputs:
    """Every input checked before the run folder is created or written, or a process starts."""
    from sat_cli.commands import preflight

    preflight.check_address_space("train")  # ulimit -v too low: one clear line, nothing written
    check_devices(obj)
    run_dir, resuming = resolve_run_dir(obj)
    from sat_cli.tracking.params import masked_print

    log = masked_print  # the run's lines through the secret policy
    preflight.check_run_folder(run_dir)
    if obj.tracking.uri:  # a store sqlite cannot open: refused before anything is written
        from sat_cli.tracking.store import check_sqlite_path

        check_sqlite_path(obj.tracking.uri)
    # the weight-sync address and port where the trainer's sender listens here (config only):
    # before the data and model
    check_port(obj.engine, type(obj.trainer).SENDER_IN_PROCESS)
    task = build_task(obj)  # the data first (cheap: no model read), then the model
    spec = eval_problems(obj, task) if obj.eval.every > 0 else None
    final_spec = eval_problems(obj, task, limit=obj.eval.final_limit) if obj.eval.final_n else None
    path = model_path(obj, log=log)
    tokenizer = preflight.load_tokenizer(path)
    preflight.check_task_inputs(obj, task, tokenizer, path)  # chat template, SGLang, reward.fn
    dropped = preflight.check_prompt_lengths(task, tokenizer, path, log)
    budget = obj.trainer.token_budget()  # the trainer's: its rows and micro-batches
    preflight.check_token_budget(task, tokenizer, budget, obj.task.max_new_tokens)
    preflight.check_env_context(getattr(obj, "env", None), path, budget)  # trajectories fit

    def overlong(s):  # evaluation problems too long for the context: scored wrong, not sampled
        return None if s is None else preflight.check_eval_lengths(s[0], s[2], tokenizer, path, log)

    evals = EvalSpecs(spec, final_spec, overlong(spec), overlong(final_spec))
    preflight.check_trainer_layout(obj.trainer, path)
    from omegaconf import OmegaConf

    config, text = OmegaConf.to_container(cfg, resolve=True), config_yaml(cfg)  # secrets masked
    return RunInputs(
        obj,
        config,
        text,
        run_dir,
        resuming,
        path,
        tokenizer,
        task,
        evals,
        dropped,
        log,
        overrides,
        replay,
    )


def _resume_point(run: RunInputs):
    """``(checkpoint, its LoopState)`` to resume from, verified under the run's lock, or
    ``(None, None)``."""
    from sat_cli.checkpoints.manifest import resume_checkpoint
    from sat_cli.checkpoints.state import load_loop_state

    obj = run.obj
    ckpt = resume_checkpoint(
        run.run_dir, run.resuming, run.model, run.log, obj.trainer.checkpoint_kind()
    )
    if not ckpt:
        return None, None
    from sat_cli.commands.resume_check import check_same_config

    check_same_config(run.run_dir, run.config, obj.resume)  # the same experiment, or force
    state = load_loop_state(ckpt)
    if state.step > obj.max_steps:
        raise UserError(
            f"max_steps={obj.max_steps} is below the step {state.step} of the checkpoint "
            f"{ckpt}; resume with max_steps >= {state.step}"
        )
    return ckpt, state


def _run(run: RunInputs):
    """Lock the run folder → assemble the run's parts → run the loop → end the run."""
    from sat_cli.commands.run import RunSession, assemble
    from sat_cli.commands.runlock import RunLock
    from sat_cli.loop.train import TrainLoop

    obj, log = run.obj, run.log
    from sat_cli.tracking.secret_logs import scrub_logs

    with RunLock(run.run_dir, log):  # nothing in the run folder is written before this point
        scrub_logs(run.run_dir / "logs")  # what a killed run's processes left unmasked
        try:
            ckpt, resumed = _resume_point(run)
            _prepare_folder(run, ckpt)
            with RunSession(Path(obj.run.dir), log) as session:
                parts = assemble(run, resumed, session)
                settings = loop_settings(obj, run.run_dir, run.tokenizer)
                loop = session.loop = TrainLoop(settings, parts)
                t0 = time.perf_counter()
                try:
                    state = loop.run(ckpt)
                finally:
                    parts.progress.close()
                _summary(obj, run.run_dir, state, parts.tracker, time.perf_counter() - t0, log)
                return state
        finally:  # the processes are closed: their logs through the secret policy
            scrub_logs(run.run_dir / "logs")


def _prepare_folder(run: RunInputs, ckpt) -> None:
    """``logs/``, ``config.yaml``, the loss warnings, the trainer's threads."""
    import torch

    from sat_cli.util.fsio import atomic_write_text

    obj = run.obj
    run.log(f"run {run.run_dir}" + (f" (resuming from {ckpt.name})" if ckpt else ""))
    (run.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.run_dir / "config.yaml", run.config_yaml)
    _warn_recompute(obj, run.log)
    torch.set_num_threads(obj.trainer.num_threads)


def _summary(obj, run_dir: Path, st, tracker, wall: float, log) -> None:
    ev = st.eval
    log("")
    log(f"done: {obj.max_steps} steps in {wall:.1f} s  ({run_dir})")
    if ev.best is not None:
        log(
            f"eval {ev.key}: best {ev.best:.2f} (step {ev.best_step}), "
            f"last {ev.last:.2f} (step {ev.last_step})"
        )
    if tracker.run_id:
        log(
            f"MLflow run {tracker.run_id} in experiment '{obj.run.experiment}' — open it with: "
            f"sat ui --run-dir {obj.run.dir}"
        )


def pretrain(obj, use_shipped: bool = False) -> None:
    """Train the warm start from scratch (cached under <run.dir>/cache), even when the shipped
    checkpoint has the same key: this is how the shipped one is reproduced. ``use_shipped``:
    resolve it exactly as `sat train` does (`sat sweep --jobs N` prepares runs this way)."""
    from sat_cli.util.fsio import check_output_dir

    check_output_dir(Path(obj.run.dir) / "cache", "warm-start cache")
    path = model_path(obj, use_shipped=use_shipped)
    if obj.model.path and obj.task.path:  # model.path's own SFT on the file task
        from sat_cli.build.task_warmstart import ensure_task_warm_start

        path = ensure_task_warm_start(obj, path, Path(obj.run.dir) / "cache")
    print(f"warm-start checkpoint: {path}")
