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
from sat_cli.config.layout import PROMPT_TOKENS, architecture, sequence_tokens
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
        from sat_cli.config.needs import job_needs

        needed = plan.needed()
        note.append(
            f"requests  a sweep job (--executor slurm|ray): 1 node, {needed.get(0, 0)} GPU(s), "
            f"{job_needs(obj, plan).text()}"
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
    lines += memory_lines(obj, arch, plan)
    from sat_cli.tracking.params import redact_text

    return redact_text("\n".join(lines) + "\n")  # a URL's password, a key in a path: masked


SGLANG_FRACTION = 0.85  # what the plan assumes when engine.mem_fraction_static is unset


def _nbytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def _trainer_forward(obj, seq: int) -> tuple[int, int]:
    """(rows, width) of the local trainer's largest forward with gradient."""
    from math import ceil

    from sat_cli.trainers.settings import micro_batch_tokens

    t, task = obj.trainer, obj.task
    rows = max(1, task.prompts_per_step * task.samples_per_prompt // obj.algo.num_minibatches)
    budget, row = micro_batch_tokens(t), t.max_tokens_per_row
    width = row or seq
    if budget:
        return max(1, budget // width), width
    return (ceil(rows * seq / row) if row else rows), width


def _sglang(obj, arch, procs) -> list[tuple]:
    """One GPU of the SGLang servers (they are alike)."""
    from sat_cli.devices import memory as mm

    e, p = obj.engine, procs[0]
    frac = e.mem_fraction_static or p.mem_fraction or SGLANG_FRACTION
    gpu = getattr(obj.trainer, "gpu_memory_gb", mm.GPU_GB)
    name = f"sglang server GPU, each of {sum(len(q.gpus) for q in procs)}"
    return [(mm.sglang_gpu(arch, e.tp, e.ep, _nbytes(e.dtype), frac, gpu, name), bool(p.gpus))]


def _local_engine(obj, arch, procs) -> list[tuple]:
    from sat_cli.devices.memory import local_engine

    rows, seq = obj.task.prompts_per_step * obj.task.samples_per_prompt, sequence_tokens(obj)
    nbytes = _nbytes(obj.engine.dtype)
    return [
        (local_engine(arch, rows, PROMPT_TOKENS, seq, nbytes, bool(p.gpus), p.name), bool(p.gpus))
        for p in procs
    ]


def _megatron(obj, arch, procs) -> list[tuple]:
    """One Megatron rank (the ranks are alike; the largest pipeline stage)."""
    from sat_cli.devices.memory import megatron_rank
    from sat_cli.trainers.megatron.layout import Layout, params_per_gpu

    lay = Layout.of(obj.trainer)
    name = f"megatron rank, each of {lay.world} (largest pipeline stage)"
    rows, seq = obj.clip.micro_batch_size, sequence_tokens(obj)
    rank = megatron_rank(arch, lay, params_per_gpu(arch, lay), rows, seq, name)
    return [(rank, any(p.gpus for p in procs))]


def _local_trainer(obj, arch, procs) -> list[tuple]:
    from sat_cli.devices.memory import local_trainer

    t, p = obj.trainer, procs[0]
    rows, width = _trainer_forward(obj, sequence_tokens(obj))
    mem = local_trainer(
        arch,
        rows,
        width,
        bf16=t.dtype == "bfloat16",
        chunk=t.logprob_chunk_tokens,
        kl=obj.algo.kl_coef > 0,
        cuda=bool(p.gpus),
        name=p.name,
    )
    return [(mem, bool(p.gpus))]


def _models() -> dict:
    """The memory model of each engine and trainer settings class."""
    from sat_cli.engines.local.settings import LocalEngineSettings
    from sat_cli.engines.sglang.settings import SGLangEngineSettings
    from sat_cli.trainers.megatron.settings import MegatronTrainerSettings
    from sat_cli.trainers.settings import LocalTrainerSettings

    return {
        SGLangEngineSettings: _sglang,
        LocalEngineSettings: _local_engine,
        MegatronTrainerSettings: _megatron,
        LocalTrainerSettings: _local_trainer,
    }


def process_memory(obj, arch, plan) -> list[tuple]:
    """``(ProcMemory, on a GPU)`` of each kind of process of this config (engine, trainer; the
    SGLang servers' GPUs and the Megatron ranks alike: one entry each)."""
    models, out = _models(), []
    for role, settings in (("engine", obj.engine), ("trainer", obj.trainer)):
        procs = plan.of(role)
        model = models.get(type(settings))
        if model is not None and procs:
            out += model(obj, arch, procs)
    return out


def memory_lines(obj, arch, plan) -> list[str]:
    """The per-process memory section of `sat plan` (and the Megatron not-yet note)."""
    from sat_cli.devices.memory import GB, GPU_GB, size_text

    t = obj.trainer
    lines = [""]
    if arch is None:
        lines.append("memory    no estimate: the model's architecture is not known here")
    else:
        lines.append(
            f"memory    peak per process, by part (estimate; rows of {PROMPT_TOKENS} prompt + "
            f"{obj.task.max_new_tokens} new tokens; GB = 1e9 B; docs/gpus.md, Memory per process)"
        )
        gpu = getattr(t, "gpu_memory_gb", GPU_GB)
        for m, on_gpu in process_memory(obj, arch, plan):
            where = "GPU" if on_gpu else "CPU"
            fits = ""
            if on_gpu:
                fits = f" of {gpu:g} GB ({'fits' if m.peak <= gpu * GB else 'OVER'})"
            lines.append(f"  {m.process} ({where}): peak {size_text(m.peak)}{fits}")
            lines += [f"    {x.name:<22} {size_text(x.bytes):>11}  {x.formula}" for x in m.parts]
            lines.append(f"    peak = {m.peak_rule}")
            if m.host:
                lines.append(f"    host memory: {size_text(m.host)} per GPU (offloaded)")
        models = _models()
        for role, settings in (("engine", obj.engine), ("trainer", obj.trainer)):
            if type(settings) not in models:
                lines.append(f"  {role} {settings.name}: no memory model for this option")
    if why := t.not_yet(plan=True):  # settings the chosen trainer cannot run yet
        lines += ["", why]
    return lines


def check_implemented(obj) -> None:
    """Settings the chosen trainer cannot run yet (``trainer=megatron``'s layouts the worker
    does not implement) are refused (``UserError``)."""
    from sat_cli.errors import UserError

    why = obj.trainer.not_yet()
    if why:
        raise UserError(why)
