"""The parts of a run built at the edge (``sat_cli.build``): the model folder it starts from
(``model.path`` or the warm start), the task, the loss settings and the evaluation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sat_cli.models import hub
from sat_cli.models.weights_check import check_hf_dir
from sat_cli.rewards.grading import logging_samples, plugin_grader
from sat_cli.tasks.registry import eval_source


def model_path(obj, log=print, *, use_shipped: bool = True) -> str:
    """The HF checkpoint folder the run starts from: the warm-started tiny model, or model.path
    (an HF directory, or a hub id such as ``Qwen/Qwen3-30B-A3B-Base`` resolved to its snapshot
    in the HF cache at ``model.revision``, downloaded if missing and the node is online:
    ``sat_cli.models.hub``; every process reads that folder)."""
    if obj.model.kind == "hf":
        p = obj.model.path
        if hub.is_hub_id(p):
            snap = hub.resolve(p, obj.model.revision, log)
            log(f"model {p}: revision {snap.revision} ({snap.path})")
            check_hf_dir(snap.path, "model.path")  # a published snapshot: structure only
            return snap.path
        check_hf_dir(p, "model.path", values=True)  # values: no NaN/inf weight either
        return p
    if obj.model.path:
        check_hf_dir(obj.model.path, "model.path", values=True)
        return str(obj.model.path)
    from sat_cli.models.arch import TINY_MOE_CONFIG
    from sat_cli.models.warmstart import WarmStartSettings, ensure_warm_start

    m, ws = obj.model, obj.model.warm_start
    hf = {"num_hidden_layers": m.num_layers, "num_experts": m.num_experts}
    hf.update(num_experts_per_tok=m.top_k, hidden_size=m.hidden_size)
    overrides = {k: v for k, v in hf.items() if v != TINY_MOE_CONFIG[k]}
    kw = {k: getattr(ws, k) for k in ("batch_size", "lr", "eval_every", "max_steps")}
    kw.update(target_accuracy=ws.target_accuracy, model_overrides=overrides)
    settings = WarmStartSettings(digits=obj.task.digits, heldout_size=ws.eval_size, **kw)
    cache = Path(obj.run.dir) / "cache"
    if obj.task.is_data:  # a user's file: the toy warm start, then SFT on its rows
        from sat_cli.build.task_warmstart import tiny_task_warm_start

        return str(tiny_task_warm_start(obj, cache, overrides, log=log))
    return str(ensure_warm_start(cache, settings, use_shipped=use_shipped, log=log))


def build_task(obj):
    """The training task: the toy generator, or a prompt set graded by the math grader (its
    ``task.kind``'s entry, ``tasks/registry.TASK_SOURCES``)."""
    from sat_cli.tasks.registry import TASK_SOURCES

    t = obj.task
    heldout = eval_source(obj.eval.benchmark).splits_task  # eval=heldout: its rows, split off
    return TASK_SOURCES.get(t.kind).build(t, obj.data.dir, obj.seed, heldout)


def loss_config(obj):
    """The run's ``LossConfig``: every loss setting of ``algo.*`` and ``clip.*`` (the loop owns
    ``algo.adv_std_norm``, ``algo.drop_zero_adv_groups``, ``algo.num_minibatches`` and the clip
    schedule), plus ``task.samples_per_prompt`` as VCPO's group size. SAT's scope
    ``clip.q_scope=micro_batch`` becomes ``q_rows = clip.micro_batch_size``. A setting named
    alike in ``LossConfig`` and the ``algo``/``clip`` section is passed as it is."""
    from dataclasses import fields

    from sat_cli.rl.config import LossConfig

    a, c = obj.algo, obj.clip
    own = {f.name for f in fields(LossConfig)}
    same = {f.name: getattr(s, f.name) for s in (a, c) for f in fields(s) if f.name in own}
    return LossConfig(
        algo=a.name,
        agg=a.loss_agg,
        q_rows=c.micro_batch_size if c.adaptive and c.q_scope == "micro_batch" else None,
        group_size=obj.task.samples_per_prompt,
        **same,
    )


def sampling_params(section, tokenizer, **extra):
    """``SamplingParams`` of ``task.*`` or ``eval.*`` (temperature, top-p, top-k, response
    length), stopping at the tokenizer's EOS; ``extra``: its other fields."""
    from sat_cli.engines.base import SamplingParams

    s, eos = section, (tokenizer.eos_token_id,)
    keys = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    return SamplingParams(**keys, max_new_tokens=s.max_new_tokens, stop_token_ids=eos, **extra)


_CONFIGURED = object()


def eval_problems(obj, task, limit=_CONFIGURED) -> tuple[list, object, str]:
    """(problems, grader, template) of the configured evaluation; raises ``DataError`` for a bad
    data file. Called before any process starts, so bad input fails fast and writes nothing.
    ``limit``: problems to keep (default ``eval.limit``; ``None``: all)."""
    e = obj.eval
    limit = e.limit if limit is _CONFIGURED else limit
    source = eval_source(e.benchmark)
    if source.own:  # the training task's own held-out problems
        problems = task.heldout()
        grader = lambda resp, gold: task.reward(resp, gold) > 0  # noqa: E731
        template = obj.task.template if source.task_template else e.template
    else:
        import functools

        from sat_cli.tasks.reward import grade
        from sat_cli.tasks.sources import benchmark_rows

        path = e.path if source.user_file else None
        problems = benchmark_rows(e.benchmark, path, obj.task.fields, obj.data.dir, limit)
        grader, template = functools.partial(grade, timeout_s=e.grader_timeout_s), e.template
    grader = plugin_grader(obj.reward, task, grader)  # a plugin decides what counts as correct
    if limit:
        problems = problems[:limit]
    return problems, grader, template


def eval_runner(
    obj, engine, tokenizer, task, spec=None, *, final=False, overlong=None, max_new_tokens=None
):
    """A call that evaluates the engine's current weights: ``() -> EvalResult``.

    ``spec``: the result of :func:`eval_problems` when already loaded. ``final``: the larger
    evaluation of the final weights (``eval.final_n`` samples per problem on ``eval.final_limit``
    problems, default all). ``max_new_tokens``: instead of ``eval.max_new_tokens`` (`sat eval`
    caps it at the model's context). ``overlong``: problems too long for the context."""
    from sat_cli.evaluation import evaluate

    e = obj.eval
    if spec is None:
        spec = eval_problems(obj, task, limit=e.final_limit) if final else eval_problems(obj, task)
    problems, grader, template = spec
    sampling = sampling_params(e, tokenizer, seed=obj.seed + 7919)
    if max_new_tokens is not None:
        sampling = replace(sampling, max_new_tokens=max_new_tokens)
    n, skip = (e.final_n if final else e.n), overlong or frozenset()
    kw = dict(template=template, grader=grader, batch_size=e.batch_size, name=e.name)
    return lambda: evaluate(
        engine, tokenizer, problems, n=n, sampling=sampling, overlong=skip, **kw
    )


def build_evaluator(
    obj, engine, tokenizer, task, spec=None, *, final=False, overlong=None, tracker=None
):
    """In-training evaluation on the held-out set (toy) or the configured benchmark: ``() ->``
    its ``loop.parts.EvalScores`` (metrics ``eval/<name>/…``, ``final/<name>/…`` with
    ``final``; the headline avg@n; :func:`eval_runner`). With ``tracker``, each evaluation's
    samples table goes to ``samples/eval_step_<version>``."""
    run = eval_runner(obj, engine, tokenizer, task, spec, final=final, overlong=overlong)
    run = logging_samples(run, tracker, final) if tracker is not None else run
    from sat_cli.evaluation.output import check_reward_errors

    def evaluate():
        res = run()
        check_reward_errors(res, obj.reward.max_error_frac)  # above it: the run ends FAILED
        return eval_scores(res, final)

    return evaluate


def eval_scores(result, final: bool = False):
    """An ``EvalResult`` as the loop takes it: its metrics, avg@n the headline, avg@n and
    pass@1 on the console."""
    from sat_cli import metric_names as M
    from sat_cli.evaluation import metrics
    from sat_cli.loop.parts import EvalScores

    m = metrics(result, final=final)
    head = M.avg_key(result.name, result.n, final)
    shown = (head, *(k for k in (M.pass_key(result.name, 1, final),) if k in m))
    return EvalScores(m, headline=head, shown=shown)
