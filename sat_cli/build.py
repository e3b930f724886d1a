"""The edge of the program: the typed config in, objects and plain values out.

``sat_cli.cli`` composes the config (``sat_cli.config``); the commands (``sat_cli.commands``)
call the builders here, and below this edge nothing reads the config: the loop, engines,
trainers and losses receive plain values and objects (a ``LossConfig`` for the loss).

* :func:`model_path` — the model folder a run starts from (``model.path``, or the warm start);
* :func:`build_task`, :func:`build_engine`, :func:`build_trainer` (with :func:`loss_config`),
  :func:`eval_problems` / :func:`build_evaluator`, and the MLflow tracker of a run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sat_cli import __version__
from sat_cli.errors import UserError
from sat_cli.models.weights_check import check_hf_dir
from sat_cli.rewards.grading import logging_samples, plugin_grader

__all__ = ["check_hf_dir"]


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


# ----------------------------------------------------------------------------- builders


def model_path(obj, log=print, *, use_shipped: bool = True) -> str:
    """The HF checkpoint the run starts from: the warm-started tiny model, or model.path (an HF
    directory, or a hub id such as ``Qwen/Qwen3-30B-A3B-Base``, which is not checked here)."""
    if obj.model.kind == "hf":
        p = obj.model.path
        hub_id = p.count("/") == 1 and not p.startswith((".", "/", "~")) and not Path(p).exists()
        if not hub_id:
            check_hf_dir(p, "model.path", values=True)  # values: no NaN/inf weight either
        return p
    if obj.model.path:
        check_hf_dir(obj.model.path, "model.path", values=True)
        return str(obj.model.path)
    if obj.task.kind != "toy":
        raise UserError(
            "model=tiny_moe warm-starts on the toy task only; set model.path for other tasks"
        )
    from sat_cli.models.warmstart import WarmStartSettings, ensure_warm_start

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
            WarmStartSettings(
                digits=obj.task.digits,
                task_seed=0,
                heldout_size=ws.eval_size,
                seed=0,
                model_overrides=overrides,
                **{k: getattr(ws, k) for k in ("batch_size", "lr", "eval_every", "max_steps")},
                target_accuracy=ws.target_accuracy,
            ),
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

    heldout = obj.eval.benchmark == "heldout"  # its own held-out rows, split off training
    return DatasetTask.from_config(obj.task, data_dir=obj.data.dir, seed=obj.seed, heldout=heldout)


def build_engine(obj, path: str, logs: Path, *, r3: bool, placer=None):
    from sat_cli.config.devices import device_plan
    from sat_cli.devices.apply import server_groups, server_mem_fraction

    e, plan = obj.engine, device_plan(obj)  # the GPUs each process gets (sat_cli/devices)
    inflight = (
        {"inflight_updates": True, "inflight_cache": obj.lag.inflight_cache}
        if obj.lag.inflight_updates
        else {}
    )
    if e.name == "local":
        from sat_cli.engines.local import LocalEngine

        return LocalEngine(
            path,
            dtype=e.dtype,
            device=plan.find("local engine").device,  # cuda:K of the device plan
            r3=r3,
            seed=obj.seed,
            num_threads=e.num_threads,
            log_file=str(logs / "engine.log"),
            **inflight,
        )
    from sat_cli.engines.sglang import SGLangEngine
    from sat_cli.engines.sglang.server import resolve_python

    moe = {}
    if r3:
        cfg = read_hf_config(path)
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
        server_ranks=e.tp,  # the weight-sync group's ranks per server
        **moe,
        **inflight,
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
        gpu_groups=server_groups(plan),  # CUDA_VISIBLE_DEVICES per server (None: CPU or Ray)
        use_router=e.router,
        device=e.device,
        dtype=e.dtype,
        tp=e.tp,
        dp=e.dp,
        ep=e.ep,
        mem_fraction_static=server_mem_fraction(plan, e.mem_fraction_static),
        max_total_tokens=e.max_total_tokens or (4096 if e.device == "cpu" else None),
        extra_args=list(e.extra_args),
        log_dir=logs,
        startup_timeout_s=e.startup_timeout_s,
        placer=placer,  # launcher=ray: the servers run on the cluster's nodes
        **common,
    )


def read_hf_config(path: str) -> dict:
    import json

    p = Path(path) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()


def build_trainer(obj, path: str, run_dir: Path, placer=None):
    from sat_cli.config.additions import ledger_versions

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
        replay_sampling_mask=obj.algo.replay_sampling_mask,
        score_centering_topk=obj.algo.score_centering_topk,
        ledger_keep=ledger_versions(obj.algo.ledger, obj.lag.n, obj.lag.profile),
        max_tokens_per_row=obj.trainer.max_tokens_per_row or 0,  # null: off
        max_tokens_per_micro_batch=obj.trainer.max_tokens_per_micro_batch or 0,
    )
    t = obj.trainer
    from sat_cli.commands.weight_sync import sender_spec, weight_sender  # weight_sync=distributed
    from sat_cli.config.devices import device_plan
    from sat_cli.devices.apply import trainer_env

    plan = device_plan(obj)  # the GPUs each process gets (sat_cli/devices)
    if t.name == "local":
        from sat_cli.trainers.local import LocalTrainer

        sender = weight_sender(obj, path)  # None with engine.weight_sync=disk
        device = plan.find("local trainer").device  # cuda:K of the device plan
        return LocalTrainer(path, device=device, dtype=t.dtype, weight_sender=sender, **kwargs)
    from sat_cli.trainers.megatron.client import MegatronTrainer

    rdzv = f"{t.master_addr}:{t.master_port}" if t.master_port else None
    return MegatronTrainer(
        path,
        work_dir=run_dir / "megatron",
        logs_dir=run_dir / "logs",
        rdzv_endpoint=rdzv,
        export_dtype=obj.engine.dtype,
        placer=placer,  # launcher=ray: the nodes run on the cluster
        env=trainer_env(plan) if placer is None else None,  # node 0's CUDA_VISIBLE_DEVICES
        weight_sync=sender_spec(obj),  # engine.weight_sync=distributed: rank 0's sender
        # the layout and precision keys have the schema's names
        **{k: getattr(t, k) for k in ("nproc_per_node", "nnodes", "tp", "pp", "ep", "cp")},
        **{k: getattr(t, k) for k in ("dtype", "max_shard_size", "recompute", "optimizer_offload")},
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
        agg=a.loss_agg,
        q_rows=c.micro_batch_size if c.adaptive and c.q_scope == "micro_batch" else None,
        group_size=obj.task.samples_per_prompt,
        **{k: getattr(c, k) for k in ("adaptive", "quantile", "exponent", "anchor")},
        **{k: getattr(a, k) for k in SAME_NAMED},
    )


# the algo.* settings LossConfig names alike
SAME_NAMED = ("correction", "eps_low", "eps_high", "dual_clip_c", "ratio_denominator", "tis_cap",
              "icepop_low", "icepop_high", "dppo_delta", "m2po_tau", "behav_cap", "behav_mode",
              "vcpo_is_cap", "vcpo_ess_base", "vcpo_opob", "kl_coef", "str_delta",
              "score_centering")  # fmt: skip


_CONFIGURED = object()


def eval_problems(obj, task, limit=_CONFIGURED) -> tuple[list, object, str]:
    """(problems, grader, template) of the configured evaluation; raises ``DataError`` for a bad
    data file. Called before any process starts, so bad input fails fast and writes nothing.
    ``limit``: problems to keep (default ``eval.limit``; ``None``: all)."""
    e = obj.eval
    limit = e.limit if limit is _CONFIGURED else limit
    if e.benchmark in ("toy", "heldout"):  # the training task's own held-out problems
        problems = task.heldout()
        grader = lambda resp, gold: task.reward(resp, gold) > 0  # noqa: E731
        template = obj.task.template if e.benchmark == "toy" else e.template
    else:
        import functools

        from sat_cli.tasks.reward import grade
        from sat_cli.tasks.sources import benchmark_rows

        problems = benchmark_rows(e.benchmark, e.path, obj.task.fields, obj.data.dir, limit)
        grader, template = functools.partial(grade, timeout_s=e.grader_timeout_s), e.template
    grader = plugin_grader(obj.reward, task, grader)  # a plugin decides what counts as correct
    if limit:
        problems = problems[:limit]
    return problems, grader, template


def eval_runner(
    obj,
    engine,
    tokenizer,
    task,
    spec=None,
    *,
    final: bool = False,
    overlong: frozenset[int] | None = None,
    max_new_tokens: int | None = None,
):
    """A call that evaluates the engine's current weights: ``() -> EvalResult``.

    ``spec``: the result of :func:`eval_problems` when already loaded. ``final``: the larger
    evaluation of the final weights (``eval.final_n`` samples per problem on ``eval.final_limit``
    problems, default all). ``max_new_tokens``: instead of ``eval.max_new_tokens`` (`sat eval`
    caps it at the model's context)."""
    from sat_cli.engines.base import SamplingParams
    from sat_cli.evaluation import evaluate

    e = obj.eval
    if spec is None:
        spec = eval_problems(obj, task, limit=e.final_limit) if final else eval_problems(obj, task)
    problems, grader, template = spec
    sampling = SamplingParams(
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
        max_new_tokens=e.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=obj.seed + 7919,
    )
    n, skip = (e.final_n if final else e.n), overlong or frozenset()
    return lambda: evaluate(
        engine, tokenizer, problems, n=n, sampling=sampling, template=template, grader=grader,
        batch_size=e.batch_size, name=e.name, overlong=skip,
    )  # fmt: skip


def build_evaluator(
    obj, engine, tokenizer, task, spec=None, *, final=False, overlong=None, tracker=None
):
    """In-training evaluation on the held-out set (toy) or the configured benchmark: ``() ->``
    its metrics (``eval/<name>/…``; ``final/<name>/…`` with ``final``; :func:`eval_runner`).
    With ``tracker``, each evaluation's samples table goes to ``samples/eval_step_<version>``."""
    from sat_cli.evaluation import metrics

    run = eval_runner(obj, engine, tokenizer, task, spec, final=final, overlong=overlong)
    run = logging_samples(run, tracker, engine, final) if tracker is not None else run
    return lambda: metrics(run(), final=final)


# tracking.tags keys that `sat sweep` sets, and the MLflow tags they become
TAG_NAMES = {
    "sweep_id": "sat.sweep_id",
    "override_hash": "sat.override_hash",
    "method": "sat.method",
    "parent_run_id": "mlflow.parentRunId",
}


def make_tracker(obj, cfg_container: dict, run_name: str, run_id: str | None, dropped: int = 0):
    from sat_cli.commands.common import run_environment
    from sat_cli.tracking import Tracker, flatten_config
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
    tracker = Tracker(
        uri,
        obj.run.experiment,
        run_name,
        run_id=run_id,
        tags=tags,
        # tracking.tags are tags, not params: a resumed sweep run may get another parent run id
        params={
            k: v
            for k, v in {**flatten_config(cfg_container), **run_environment(obj)}.items()
            if not k.startswith("tracking.tags.") and k != "tracking.tags"
        },
    )
    apply_pending(Path(obj.run.dir), tracker)
    return tracker


def sat_inert_recompute(obj) -> bool:
    """SAT with a recompute denominator (TIS, MIS, IcePop, decoupled PPO, M2PO or
    ``ratio_denominator=recompute``) at one optimizer step per batch: ``d == 0``, SAT inert."""
    from sat_cli.rl import registry

    if not obj.clip.adaptive or obj.algo.num_minibatches != 1:
        return False
    spec = registry.resolve(obj.algo.name, obj.algo.correction, obj.algo.ratio_denominator)
    return spec.denominator == "old"
