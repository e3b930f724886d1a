"""`sat plan` (and `sat train … --dry-run`): the layout a run would start and, for
``trainer=megatron``, the per-GPU memory estimate of the trainer. Starts nothing, writes nothing.

The config is composed and validated exactly as `sat train` does, so an impossible layout has
already failed (exit 2, naming the key) before this runs. Each chosen option prints its own lines
(``plan_lines`` / ``plan_notes`` of its settings class); numbers and rules:
``sat_cli.config.layout`` and ``sat_cli.trainers.megatron.layout`` (torch-free: this command
imports neither torch nor MLflow).

    sat plan experiment=paper_qwen3_30b_a3b
    sat plan experiment=paper_qwen3_30b_a3b trainer.gpu_memory_gb=141
"""

from __future__ import annotations

from sat_cli.config.dynamic import plan_line
from sat_cli.config.layout import architecture, sequence_tokens
from sat_cli.models.arch import params_text


def _throughput_line(t) -> str:
    """How the trainer lays out its forwards: packing and the micro-batch token budget."""
    from sat_cli.trainers.settings import micro_batch_tokens

    budget = micro_batch_tokens(t)
    default = " (the GPU default)" if budget and t.max_tokens_per_micro_batch is None else ""
    micro = (
        f"micro-batches of at most {budget} tokens{default}"
        if budget
        else "one forward per minibatch"
    )
    if t.max_tokens_per_row:
        return f"          packed rows of at most {t.max_tokens_per_row} tokens; {micro}"
    return f"          padded rows, no packing{t.PACKING_NOTE}; {micro}"


def _device_lines(obj, plan) -> list[str]:
    rollout, train = plan.total()
    if not rollout and not train:
        return ["devices   every process on the CPU", *plan.lines()]
    share = "shared (engine.colocate=true)" if plan.colocate else "disjoint (engine.colocate=false)"
    if plan.placed:
        head = f"GPUs      {rollout} rollout + {train} training, in Ray bundles"
    else:
        need = ", ".join(f"node {n} needs {k}" for n, k in sorted(plan.needed().items()))
        head = f"GPUs      {rollout} rollout + {train} training, {share}: {need}"
    note = [f"          {obj.trainer.GPU_NOTE}"] if obj.trainer.GPU_NOTE and train else []
    if not plan.placed:  # what a `sat sweep --executor slurm|ray` job of it asks for
        needed = plan.needed()
        note.append(
            f"requests  a sweep job (--executor slurm|ray): 1 node, {needed.get(0, 0)} GPU(s)"
            if len(needed) <= 1
            else f"requests  {len(needed)} nodes: under SLURM through Ray, scripts/ray_in_slurm.sh"
        )
    return [head, *plan.lines(), *note]


def plan_text(obj, gpus_per_node: int | None = None) -> str:
    """The plan as printed (one string); ``gpus_per_node`` (``--gpus-per-node``): the device
    plan is checked against nodes of that many GPUs (``DevicePlanError``, exit 2)."""
    from sat_cli.config.devices import device_plan

    plan = device_plan(obj)
    if gpus_per_node is not None:
        plan.check(gpus_per_node, "--gpus-per-node")
    arch, source = architecture(obj)
    params = arch.total() if arch is not None else None
    lines = []
    if arch is not None:
        moe = f", {arch.experts} experts top-{arch.top_k}" if arch.experts else ", dense"
        lines.append(
            f"model     {source}: {params_text(params)} parameters ({arch.layers} layers, "
            f"hidden {arch.hidden}, {arch.heads}/{arch.kv_heads} q/kv heads{moe})"
        )
    else:
        lines.append(f"model     {obj.model.path}: architecture unknown ({source})")
    dynamic = plan_line(obj.task, obj.algo.dynamic_sampling)  # algo.dynamic_sampling
    lines += [dynamic] if dynamic else []
    e, t = obj.engine, obj.trainer
    lines += e.plan_lines(plan.of("engine"), params)
    lines += [*t.plan_lines(plan.of("trainer"), params), _throughput_line(t)]
    lines += _device_lines(obj, plan)
    if type(obj.launcher).places:
        from sat_cli.build.components import launcher_runtime
        from sat_cli.cluster.settings import placement_text

        lines.append(placement_text(obj.launcher, launcher_runtime(obj)))
    lines += t.plan_notes(arch, obj.clip.micro_batch_size, sequence_tokens(obj))
    return "\n".join(lines) + "\n"


def check_implemented(obj) -> None:
    """Settings the chosen trainer cannot run yet (``trainer=megatron``'s layouts the worker
    does not implement) are refused (``UserError``)."""
    from sat_cli.errors import UserError

    why = obj.trainer.not_yet()
    if why:
        raise UserError(why)
