"""Entry points behind `sat train`, `sat pretrain` and `sat eval`: build objects, then call.

This is the edge of the program (STYLE.md §6): only here is the config read; the loop, engines,
trainers and losses receive plain values and objects.

Run directory: ``<run.dir>/<run.experiment>/<run.name>/`` with ``config.yaml`` (resolved),
``checkpoints/step_N/``, ``weights/vN/`` (published, pruned) and ``logs/``. The MLflow store
defaults to ``<run.dir>/mlflow.db``; the warm-start cache is ``<run.dir>/cache/``.
``logs/pids.json`` names this process and the engine's process (fault tests, soak runs).

Inputs (run name, resume target, the run folder's path, model folder — safetensors only,
every tensor checked against its config without loading —, tokenizer, task and evaluation data,
prompt lengths, the trainer layout) are checked before the run directory is created or any
process starts, so bad input exits 2 and writes nothing. Then the run folder is locked
(``sat_cli.loop.runlock``) and the checkpoint to resume from is verified
(``sat_cli.loop.manifest``) before ``config.yaml``, the MLflow run or anything else is touched.
SIGTERM and SIGHUP stop the run like Ctrl-C (``sat_cli.signals``: exit 143 / 129).
"""

from __future__ import annotations

import os
import subprocess
import time
import warnings
from pathlib import Path

from sat_cli import __version__
from sat_cli.errors import UserError
from sat_cli.models.weights_check import check_hf_dir
from sat_cli.signals import Terminated

__all__ = ["Terminated", "check_hf_dir"]  # imported from here by sat eval and the tests


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


def default_run_name(obj) -> str:
    r3 = "-r3" if obj.r3 else ""
    return (
        f"{obj.algo.name}-{obj.clip.name}-lag{obj.lag.n}{r3}-s{obj.seed}-"
        f"{time.strftime('%Y%m%d-%H%M%S')}"
    )


# ----------------------------------------------------------------------------- builders


def model_path(obj, log=print, *, use_shipped: bool = True) -> str:
    """The HF checkpoint the run starts from: the warm-started tiny model, or model.path (an HF
    directory, or a hub id such as ``Qwen/Qwen3-30B-A3B-Base``, which is not checked here)."""
    if obj.model.kind == "hf":
        p = obj.model.path
        hub_id = p.count("/") == 1 and not p.startswith((".", "/", "~")) and not Path(p).exists()
        if not hub_id:
            check_hf_dir(p, "model.path")
        return p
    if obj.model.path:
        check_hf_dir(obj.model.path, "model.path")
        return str(obj.model.path)
    if obj.task.kind != "toy":
        raise UserError(
            "model=tiny_moe warm-starts on the toy task only; set model.path for other tasks"
        )
    from sat_cli.models.warmstart import ensure_warm_start

    ws = obj.model.warm_start
    overrides = {}
    if obj.model.num_layers != 4:
        overrides["num_hidden_layers"] = obj.model.num_layers
    if obj.model.num_experts != 8:
        overrides["num_experts"] = obj.model.num_experts
    if obj.model.top_k != 2:
        overrides["num_experts_per_tok"] = obj.model.top_k
    if obj.model.hidden_size != 128:
        overrides["hidden_size"] = obj.model.hidden_size
    return str(
        ensure_warm_start(
            Path(obj.run.dir) / "cache",
            digits=obj.task.digits,
            task_seed=0,
            heldout_size=ws.eval_size,
            seed=0,
            batch_size=ws.batch_size,
            lr=ws.lr,
            eval_every=ws.eval_every,
            target_accuracy=ws.target_accuracy,
            max_steps=ws.max_steps,
            model_overrides=overrides,
            use_shipped=use_shipped,
            log=log,
        )
    )


def build_task(obj):
    """The training task: the toy generator, or a prompt set graded by the math grader."""
    if obj.task.kind == "toy":
        from sat_cli.tasks.toy import ToyTask

        return ToyTask(
            digits=obj.task.digits,
            seed=0,
            heldout_size=obj.task.heldout_size,
            template=obj.task.template,
        )
    from sat_cli.tasks.dataset import DatasetTask

    return DatasetTask.from_config(
        obj.task.kind,
        path=obj.task.path,
        data_dir=obj.data.dir,
        template=obj.task.template,
        seed=obj.seed,
    )


def build_engine(obj, path: str, logs: Path, *, r3: bool):
    e = obj.engine
    if e.name == "local":
        from sat_cli.engines.local import LocalEngine

        return LocalEngine(
            path,
            dtype=e.dtype,
            r3=r3,
            seed=obj.seed,
            num_threads=e.num_threads,
            log_file=str(logs / "engine.log"),
        )
    from sat_cli.engines.sglang import SGLangEngine
    from sat_cli.engines.sglang.server import resolve_python

    moe = {}
    if r3:
        cfg = _hf_config(path)
        moe = {
            "num_layers": cfg.get("num_hidden_layers"),
            "top_k": cfg.get("num_experts_per_tok"),
            "num_experts": cfg.get("num_experts") or cfg.get("num_local_experts"),
        }
    common = dict(
        r3=r3,
        deterministic=e.seeded,
        max_batch_size=e.max_batch_size,
        concurrency=e.concurrency,
        request_timeout_s=e.request_timeout_s,
        restart_on_failure=e.restart_on_failure,
        **moe,
    )
    if e.urls:
        return SGLangEngine(path, urls=list(e.urls), **common)
    try:
        python = "python" if e.launch_prefix else resolve_python(e.python)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    return SGLangEngine.launch(
        path,
        python=python,
        launch_prefix=list(e.launch_prefix) or None,
        num_servers=e.servers,
        gpu_groups=list(e.gpu_groups) or None,
        use_router=e.router,
        device=e.device,
        dtype=e.dtype,
        tp=e.tp,
        dp=e.dp,
        ep=e.ep,
        mem_fraction_static=e.mem_fraction_static,
        max_total_tokens=e.max_total_tokens or (4096 if e.device == "cpu" else None),
        extra_args=list(e.extra_args),
        log_dir=logs,
        startup_timeout_s=e.startup_timeout_s,
        **common,
    )


def _hf_config(path: str) -> dict:
    import json

    p = Path(path) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()


def build_trainer(obj, path: str, run_dir: Path):
    kwargs = dict(
        loss=loss_config(obj),
        lr=obj.trainer.lr,
        betas=tuple(obj.trainer.betas),
        weight_decay=obj.trainer.weight_decay,
        grad_clip=obj.trainer.grad_clip,
        temperature=obj.task.temperature,
        r3=obj.r3,
        num_minibatches=obj.algo.num_minibatches,
        seed=obj.seed,
        r3_audit=obj.trainer.r3_audit,
    )
    t = obj.trainer
    if t.name == "local":
        from sat_cli.trainers.local import LocalTrainer

        return LocalTrainer(path, **kwargs)
    from sat_cli.trainers.megatron.client import MegatronTrainer

    rdzv = f"{t.master_addr}:{t.master_port}" if t.master_port else None
    return MegatronTrainer(
        path,
        work_dir=run_dir / "megatron",
        logs_dir=run_dir / "logs",
        nproc_per_node=t.nproc_per_node,
        nnodes=t.nnodes,
        rdzv_endpoint=rdzv,
        tp=t.tp,
        pp=t.pp,
        ep=t.ep,
        cp=t.cp,
        **kwargs,
    )


def loss_config(obj):
    """The run's ``LossConfig``: every loss setting of ``algo.*`` and ``clip.*`` (the loop owns
    ``algo.adv_std_norm``, ``algo.drop_zero_adv_groups``, ``algo.num_minibatches`` and the clip
    schedule), plus ``task.samples_per_prompt`` as VCPO's group size. SAT's scope
    ``clip.q_scope=micro_batch`` becomes ``q_rows = clip.micro_batch_size``."""
    from sat_cli.rl.config import LossConfig

    a, c = obj.algo, obj.clip
    return LossConfig(
        algo=a.name,
        correction=a.correction,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        adaptive=c.adaptive,
        quantile=c.quantile,
        exponent=c.exponent,
        anchor=c.anchor,
        q_rows=c.micro_batch_size if c.adaptive and c.q_scope == "micro_batch" else None,
        dual_clip_c=a.dual_clip_c,
        agg=a.loss_agg,
        ratio_denominator=a.ratio_denominator,
        tis_cap=a.tis_cap,
        icepop_low=a.icepop_low,
        icepop_high=a.icepop_high,
        dppo_delta=a.dppo_delta,
        m2po_tau=a.m2po_tau,
        behav_cap=a.behav_cap,
        behav_mode=a.behav_mode,
        group_size=obj.task.samples_per_prompt,
        vcpo_is_cap=a.vcpo_is_cap,
        vcpo_ess_base=a.vcpo_ess_base,
        vcpo_opob=a.vcpo_opob,
        kl_coef=a.kl_coef,
    )


_CONFIGURED = object()


def eval_problems(obj, task, limit=_CONFIGURED) -> tuple[list, object, str]:
    """(problems, grader, template) of the configured evaluation; raises ``DataError`` for a bad
    data file. Called before any process starts, so bad input fails fast and writes nothing.
    ``limit``: problems to keep (default ``eval.limit``; ``None``: all)."""
    e = obj.eval
    limit = e.limit if limit is _CONFIGURED else limit
    if e.benchmark == "toy":
        problems = task.heldout()
        grader = lambda resp, gold: task.reward(resp, gold) > 0  # noqa: E731
        template = obj.task.template
    else:
        import functools

        from sat_cli.tasks.data import load_benchmark
        from sat_cli.tasks.reward import grade

        problems = load_benchmark(
            e.path if e.benchmark == "jsonl" else e.benchmark, data_dir=obj.data.dir, limit=limit
        )
        grader, template = functools.partial(grade, timeout_s=e.grader_timeout_s), e.template
    if limit:
        problems = problems[:limit]
    return problems, grader, template


def build_evaluator(
    obj,
    engine,
    tokenizer,
    task,
    keep: dict | None = None,
    spec=None,
    *,
    final: bool = False,
    overlong: frozenset[int] | None = None,
):
    """In-training evaluation on the held-out set (toy) or the configured benchmark.

    ``spec``: the result of :func:`eval_problems` when already loaded. ``final``: the larger
    evaluation of the final weights (``eval.final_n`` samples per problem on ``eval.final_limit``
    problems, default all), with metrics under ``final/<name>/``."""
    from sat_cli.engines.base import SamplingParams
    from sat_cli.evaluation import evaluate, metrics

    e = obj.eval
    if spec is None:
        spec = eval_problems(obj, task, limit=e.final_limit) if final else eval_problems(obj, task)
    problems, grader, template = spec
    n, prefix = (e.final_n, f"final/{e.name}/") if final else (e.n, f"eval/{e.name}/")
    sampling = SamplingParams(
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
        max_new_tokens=e.max_new_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=obj.seed + 7919,
    )

    def run() -> dict[str, float]:
        res = evaluate(
            engine,
            tokenizer,
            problems,
            n=n,
            sampling=sampling,
            template=template,
            grader=grader,
            batch_size=e.batch_size,
            name=e.name,
            overlong=overlong or frozenset(),
        )
        if keep is not None:
            keep["result"] = res
        return metrics(res, prefix=prefix)

    return run


# tracking.tags keys that `sat sweep` sets, and the MLflow tags they become
TAG_NAMES = {
    "sweep_id": "sat.sweep_id",
    "override_hash": "sat.override_hash",
    "method": "sat.method",
    "parent_run_id": "mlflow.parentRunId",
}


def _tracker(obj, cfg_container: dict, run_name: str, run_id: str | None, dropped: int = 0):
    from sat_cli.loop.final_status import apply_pending
    from sat_cli.tracking import Tracker, flatten_config

    uri = obj.tracking.uri if obj.tracking.backend == "mlflow" else None
    tags = {
        "sat.version": __version__,
        "git_commit": _git_commit(),
        "algo": obj.algo.name,
        "clip": obj.clip.name,
        "lag": obj.lag.n,
        "lag_mode": obj.lag.mode,
        "r3": obj.r3,
        "seed": obj.seed,
        "correction": obj.algo.correction,
        "sat.inert_recompute": sat_inert_recompute(obj),
    }
    tags.update({TAG_NAMES.get(k, k): v for k, v in obj.tracking.tags.items()})
    if dropped:
        tags["data.overlong_dropped"] = dropped
    tracker = Tracker(
        uri,
        obj.run.experiment,
        run_name,
        run_id=run_id,
        tags=tags,
        # tracking.tags are tags, not params: a resumed sweep run may get another parent run id
        params={
            k: v
            for k, v in flatten_config(cfg_container).items()
            if not k.startswith("tracking.tags.") and k != "tracking.tags"
        },
    )
    apply_pending(Path(obj.run.dir), tracker)
    return tracker


# ----------------------------------------------------------------------------- run dirs


def resolve_run_dir(obj) -> tuple[Path, bool]:
    """(run dir, whether it is resumed). Refuses to overwrite a run silently. Reads only; the
    checkpoint to resume from is chosen and verified under the run's lock
    (:func:`sat_cli.loop.manifest.resume_checkpoint`)."""
    from sat_cli.loop.state import CheckpointError, latest_checkpoint, read_loop_state

    root = Path(obj.run.dir) / obj.run.experiment
    resume = obj.resume
    if resume not in (None, "auto"):
        run_dir = Path(resume)
        if latest_checkpoint(run_dir / "checkpoints") is None:
            raise UserError(
                f"resume={resume!r}: no complete checkpoint under {run_dir}/checkpoints"
            )
        return run_dir, True
    if resume == "auto" and obj.run.name is None:

        def finished(ck: Path) -> bool:
            try:
                return bool(read_loop_state(latest_checkpoint(ck)).get("finished"))
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
        if resume != "auto":
            from sat_cli.loop.runlock import refuse_if_owned

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
    if sat_inert_recompute(obj):
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


def sat_inert_recompute(obj) -> bool:
    """SAT with a recompute denominator (TIS, MIS, IcePop, decoupled PPO, M2PO or
    ``ratio_denominator=recompute``) at one optimizer step per batch: ``d == 0``, SAT inert."""
    from sat_cli.rl import registry

    if not obj.clip.adaptive or obj.algo.num_minibatches != 1:
        return False
    spec = registry.resolve(obj.algo.name, obj.algo.correction, obj.algo.ratio_denominator)
    return spec.denominator == "old"


# ----------------------------------------------------------------------------- commands


def train(cfg, obj, overrides) -> dict:
    """`sat train`: SIGTERM and SIGHUP stop it like Ctrl-C (``sat_cli.signals``)."""
    from sat_cli.signals import orderly_stop

    if obj.lag.inflight_updates:
        raise UserError(
            "lag.inflight_updates=true is not supported yet: the local engine "
            "generates each request with one weight version"
        )
    with orderly_stop():
        return _train(cfg, obj)


def _train(cfg, obj) -> dict:
    from sat_cli.loop import preflight
    from sat_cli.loop.manifest import resume_checkpoint
    from sat_cli.loop.runlock import RunLock
    from sat_cli.loop.state import read_loop_state

    # every input is checked before the run folder is created or written, or a process starts
    run_dir, resuming = resolve_run_dir(obj)
    log = print
    preflight.check_run_folder(run_dir)
    path = model_path(obj, log=log)
    tokenizer = preflight.load_tokenizer(path)
    task = build_task(obj)
    dropped = preflight.check_prompt_lengths(obj, task, tokenizer, path, log)
    spec = eval_problems(obj, task) if obj.eval.every > 0 else None
    final_spec = eval_problems(obj, task, limit=obj.eval.final_limit) if obj.eval.final_n else None
    overlong = {  # evaluation problems too long for the context: scored as wrong, not sampled
        key: preflight.check_eval_lengths(s[0], s[2], tokenizer, path, log)
        for key, s in (("eval", spec), ("final", final_spec))
        if s is not None
    }
    preflight.check_trainer_layout(obj, path)
    with RunLock(run_dir, log):  # nothing in the run folder is written before this point
        ckpt = resume_checkpoint(run_dir, resuming, path, log)
        done = read_loop_state(ckpt).get("step", 0) if ckpt else 0
        if done > obj.max_steps:
            raise UserError(
                f"max_steps={obj.max_steps} is below the step {done} of the checkpoint "
                f"{ckpt}; resume with max_steps >= {done}"
            )
        return _run(
            cfg,
            obj,
            run_dir,
            ckpt,
            path,
            tokenizer,
            task,
            (spec, final_spec, overlong),
            dropped,
            log,
        )


def _run(cfg, obj, run_dir, ckpt, path, tokenizer, task, specs, dropped, log) -> dict:
    import torch
    from omegaconf import OmegaConf

    from sat_cli.engines.base import SamplingParams
    from sat_cli.loop.final_status import end_run, keep_previous_status
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.progress import Progress
    from sat_cli.loop.state import atomic_write_text, read_loop_state
    from sat_cli.loop.train import ClipSchedule, LoopSettings, train_loop

    spec, final_spec, overlong = specs  # in-training and final evaluation problems (or None)
    state0 = read_loop_state(ckpt) if ckpt else {}
    log(f"run {run_dir}" + (f" (resuming from {ckpt.name})" if ckpt else ""))
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    _warn_recompute(obj, log)
    torch.set_num_threads(obj.trainer.num_threads)
    cfg_container = OmegaConf.to_container(cfg, resolve=True)
    engine = trainer = tracker = None
    status, steps_done = "FAILED", []
    try:
        tracker = _tracker(obj, cfg_container, run_dir.name, state0.get("mlflow_run_id"), dropped)
        tracker.log_artifact(str(run_dir / "config.yaml"))
        trainer = _loading(path, lambda: build_trainer(obj, path, run_dir))
        engine = _loading(path, lambda: build_engine(obj, path, logs, r3=obj.r3))
        write_pids(logs, engine)
        evaluator = (
            build_evaluator(obj, engine, tokenizer, task, spec=spec, overlong=overlong.get("eval"))
            if spec is not None
            else None
        )
        final_evaluator = None
        if obj.eval.final_n is not None:
            final_evaluator = build_evaluator(
                obj,
                engine,
                tokenizer,
                task,
                spec=final_spec,
                final=True,
                overlong=overlong.get("final"),
            )
        sampling = SamplingParams(
            temperature=obj.task.temperature,
            top_p=obj.task.top_p,
            top_k=obj.task.top_k,
            max_new_tokens=obj.task.max_new_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
        )
        settings = LoopSettings(
            max_steps=obj.max_steps,
            prompts_per_step=obj.task.prompts_per_step,
            group_size=obj.task.samples_per_prompt,
            sampling=sampling,
            lag=LagPolicy(obj.lag.n, obj.lag.mode),
            run_dir=run_dir,
            seed=obj.seed,
            adv_std_norm=obj.algo.adv_std_norm,
            drop_zero_adv_groups=obj.algo.drop_zero_adv_groups,
            r3=obj.r3,
            clip=ClipSchedule(
                obj.algo.eps_low, obj.algo.eps_high, obj.clip.schedule, obj.clip.final_scale
            ),
            sat_probe={
                "adaptive": obj.clip.adaptive,
                "quantile": obj.clip.quantile,
                "exponent": obj.clip.exponent,
                "anchor": obj.clip.anchor,
                "level": "sequence" if obj.algo.name == "gspo" else "token",
            },
            eval_every=obj.eval.every,
            eval_at_start=obj.eval.at_start,
            checkpoint_every=obj.checkpoint.every,
            checkpoint_keep=obj.checkpoint.keep,
            histogram_every=obj.tracking.histogram_every,
        )
        progress = Progress(obj.max_steps, start=state0.get("step", 0))
        t0 = time.perf_counter()
        try:
            st = train_loop(
                settings,
                task=task,
                tokenizer=tokenizer,
                engine=engine,
                trainer=trainer,
                tracker=tracker,
                evaluator=evaluator,
                progress=progress,
                resume_from=ckpt,
                meta={"mlflow_run_id": tracker.run_id},
                on_state=lambda _: steps_done.append(1),
                final_evaluator=final_evaluator,
            )
        finally:
            progress.close()
        wall = time.perf_counter() - t0
        status = "FINISHED"
        _summary(obj, run_dir, st, tracker, wall, log)
        return st
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:  # each part is closed even if closing another one fails
        for part in (engine, trainer):
            try:
                if part is not None:
                    part.close()
            except Exception as exc:  # noqa: BLE001 - reported, the others still close
                log(f"WARNING: closing {type(part).__name__} failed: {exc}")
        status = keep_previous_status(tracker, status, len(steps_done))
        end_run(tracker, status, Path(obj.run.dir), log)


def _loading(path: str, build):
    """Build a trainer/engine; a model that fails to load is the user's input: ``UserError``."""
    from sat_cli.engines.base import EngineError

    try:
        return build()
    except EngineError as exc:
        msg = str(exc)
        if "failed during engine startup" not in msg:  # died, timed out: a runtime fault
            raise
        lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        raise UserError(f"cannot load the model at {path}: {lines[-1][:500]}") from None
    except (OSError, ValueError, RuntimeError) as exc:
        if type(exc).__name__ in ("TrainerError", "EngineError"):
            raise
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        raise UserError(f"cannot load the model at {path}: {type(exc).__name__}: {first}") from None


def write_pids(logs: Path, engine) -> None:
    """``logs/pids.json``: this process and the engine's process (fault tests, soak runs)."""
    import json

    from sat_cli.loop.state import atomic_write_text

    pids = {"orchestrator": os.getpid(), "engine": getattr(engine, "pid", None)}
    atomic_write_text(logs / "pids.json", json.dumps(pids))


def _summary(obj, run_dir: Path, st: dict, tracker, wall: float, log) -> None:
    ev = st["eval"]
    log("")
    log(f"done: {obj.max_steps} steps in {wall:.1f} s  ({run_dir})")
    if ev["best"] is not None:
        log(
            f"eval {ev['key']}: best {ev['best']:.2f} (step {ev['best_step']}), "
            f"last {ev['last']:.2f} (step {ev['last_step']})"
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
    from sat_cli.loop.preflight import check_output_dir

    check_output_dir(Path(obj.run.dir) / "cache", "warm-start cache")
    path = model_path(obj, use_shipped=use_shipped)
    print(f"warm-start checkpoint: {path}")


def evaluate(cfg, obj) -> None:
    from sat_cli.loop.eval_cmd import run_eval_command

    run_eval_command(cfg, obj)
