"""`sat plan` (and `sat train … --dry-run`): the layout a run would start and, for
``trainer=megatron``, the per-GPU memory estimate of the trainer. Starts nothing, writes nothing.

The config is composed and validated exactly as `sat train` does, so an impossible layout has
already failed (exit 2, naming the key) before this runs. Numbers and rules:
``sat_cli.config.layout`` (torch-free: this command imports neither torch nor MLflow).

    sat plan experiment=paper_qwen3_30b_a3b
    sat plan experiment=paper_qwen3_30b_a3b trainer.gpu_memory_gb=141
"""

from __future__ import annotations

from sat_cli.config.layout import (
    NOT_YET,
    Layout,
    architecture,
    memory,
    sequence_tokens,
    unimplemented,
)


def _b(n: int) -> str:
    return f"{n:,} ({n / 1e9:.2f} B)" if n >= 1e8 else f"{n:,}"


def _engine_lines(obj, arch, plan) -> list[str]:
    e = obj.engine
    procs = plan.of("engine")
    where = "GPU" if any(p.gpus for p in procs) else "CPU"
    if e.name == "local":
        return [
            f"engines   local: one engine process on the {where} ({procs[0].device}, {e.dtype})"
        ]
    if e.urls:
        return [
            f"engines   sglang: {len(e.urls)} server(s) started elsewhere ({', '.join(e.urls)})"
        ]
    per_server = e.tp * e.dp
    line = (
        f"engines   sglang: {e.servers} server(s) × tp {e.tp} × dp {e.dp} (ep {e.ep}) = "
        f"{e.servers * per_server} {'GPUs' if where == 'GPU' else 'CPU processes'}, {e.dtype}"
        + (" behind sglang-router" if e.router else "")
    )
    lines = [line]
    if arch is not None:
        nbytes = 2 if e.dtype == "bfloat16" else 4
        lines.append(
            f"          weights ≈ {arch.total() * nbytes / e.tp / 1e9:.1f} GB per engine GPU "
            f"({e.dtype} ÷ tp {e.tp}); the rest of each GPU holds the KV cache"
        )
    return lines


def _trainer_lines(obj, lay: Layout, arch, plan) -> list[str]:
    t = obj.trainer
    if t.name == "local":
        p = plan.of("trainer")[0]
        where = "GPU" if p.gpus else "CPU"
        line = (
            f"trainer   local: in the orchestrator process on the {where} ({p.device}, {p.dtype})"
        )
        if arch is not None:  # fp32 weights + grads + AdamW m, v
            line += f"; fp32 weights, gradients, AdamW ≈ {arch.total() * 16 / 1e9:.1f} GB"
        return [line, _throughput_line(t)]
    return [
        f"trainer   megatron: {lay.nnodes} node(s) × {lay.nproc_per_node} processes = "
        f"{lay.world} ranks under torchrun; tp {lay.tp}, pp {lay.pp}, cp {lay.cp}, ep {lay.ep}, "
        f"etp {lay.etp} → dp {lay.dp}, expert dp {lay.edp}; {lay.dtype}",
        _throughput_line(t),
    ]


def _throughput_line(t) -> str:
    """How the trainer lays out its forwards: packing and the micro-batch token budget."""
    micro = (
        f"micro-batches of at most {t.max_tokens_per_micro_batch} tokens"
        if t.max_tokens_per_micro_batch
        else "one forward per minibatch"
    )
    if t.max_tokens_per_row:
        return f"          packed rows of at most {t.max_tokens_per_row} tokens; {micro}"
    why = " (megatron-core packs only with Transformer Engine)" if t.name == "megatron" else ""
    return f"          padded rows, no packing{why}; {micro}"


def _device_lines(obj, plan) -> list[str]:
    rollout, train = plan.total()
    if not rollout and not train:
        return ["devices   every process on the CPU", *plan.lines()]
    share = "shared (engine.colocate=true)" if plan.colocate else "disjoint (engine.colocate=false)"
    if plan.launcher == "ray":
        head = f"GPUs      {rollout} rollout + {train} training, in Ray bundles"
    else:
        need = ", ".join(f"node {n} needs {k}" for n, k in sorted(plan.needed().items()))
        head = f"GPUs      {rollout} rollout + {train} training, {share}: {need}"
    note = []
    if obj.trainer.name == "megatron" and train:
        note = ["          (a megatron rank runs on the CPU, gloo, where no GPU is visible)"]
    if plan.launcher == "local":  # what a `sat sweep --executor slurm|ray` job of it asks for
        needed = plan.needed()
        note.append(
            f"requests  a sweep job (--executor slurm|ray): 1 node, {needed.get(0, 0)} GPU(s)"
            if len(needed) <= 1
            else f"requests  {len(needed)} nodes: under SLURM through Ray, scripts/ray_in_slurm.sh"
        )
    return [head, *plan.lines(), *note]


def _memory_lines(obj, arch, lay: Layout) -> list[str]:
    micro, seq = obj.clip.micro_batch_size, sequence_tokens(obj)
    mem = memory(arch, lay, micro, seq)
    dense, expert = mem.params
    w, g, o = (2, 4, 12) if lay.dtype == "bfloat16" else (4, 4, 8)
    experts = (
        f", experts {_b(expert)}: {arch.experts // lay.ep} of {arch.experts} per layer"
        f" ÷ etp {lay.etp}"
        if arch.experts
        else ""
    )
    opt = (
        f"offloaded: {mem.host_gb:.1f} GB host memory per GPU"
        if lay.optimizer_offload
        else "distributed optimizer"
    )
    notes = {
        "weights": f"{lay.dtype}, {w} B/param",
        "gradients": f"fp32 main grads, {g} B/param" if w == 2 else f"{g} B/param",
        "optimizer states": f"{o} B/param ÷ dp {lay.dp} (experts ÷ {lay.edp}); {opt}",
        "activations": f"{micro} × {seq} tokens"
        + (", full recompute" if lay.recompute else ", no recompute"),
        "overhead": "CUDA context, NCCL buffers",
    }
    limit = obj.trainer.gpu_memory_gb
    out = [
        "",
        "per trainer GPU (largest pipeline stage; estimate, GB = 1e9 bytes)",
        f"  {'parameters':<17} {_b(dense + expert)}: dense {_b(dense)}{experts}",
    ]
    out += [f"  {k:<17} {v:>6.1f} GB  {notes[k]}" for k, v in mem.rows]
    fits = "fits" if mem.total_gb <= limit else "OVER"
    out.append(
        f"  {'total':<17} {mem.total_gb:>6.1f} GB  of trainer.gpu_memory_gb={limit:g} ({fits})"
    )
    return out


def plan_text(obj, gpus_per_node: int | None = None) -> str:
    """The plan as printed (one string); ``gpus_per_node`` (``--gpus-per-node``): the device
    plan is checked against nodes of that many GPUs (``DevicePlanError``, exit 2)."""
    from sat_cli.config.devices import device_plan

    plan = device_plan(obj)
    if gpus_per_node is not None:
        plan.check(gpus_per_node, "--gpus-per-node")
    lay = Layout.of(obj.trainer) if obj.trainer.name == "megatron" else None
    arch, source = architecture(obj)
    lines = []
    if arch is not None:
        moe = f", {arch.experts} experts top-{arch.top_k}" if arch.experts else ", dense"
        lines.append(
            f"model     {source}: {_b(arch.total())} parameters ({arch.layers} layers, "
            f"hidden {arch.hidden}, {arch.heads}/{arch.kv_heads} q/kv heads{moe})"
        )
    else:
        lines.append(f"model     {obj.model.path}: architecture unknown ({source})")
    lines += _engine_lines(obj, arch, plan) + _trainer_lines(obj, lay, arch, plan)
    lines += _device_lines(obj, plan)
    if type(obj.launcher).places:
        from sat_cli.build.components import launcher_runtime
        from sat_cli.cluster.settings import placement_text

        lines.append(placement_text(obj.launcher, launcher_runtime(obj)))
    if obj.trainer.name != "megatron":
        lines.append("(the per-GPU memory table is for trainer=megatron)")
    elif arch is None:
        lines.append("no memory estimate: the model's architecture is not known here")
    else:
        lines += _memory_lines(obj, arch, lay)
    missing = unimplemented(lay) if obj.trainer.name == "megatron" else []
    if missing:
        lines += ["", not_yet_message(missing, plan=True)]
    return "\n".join(lines) + "\n"


def check_implemented(obj) -> None:
    """``trainer=megatron``: a layout the worker cannot run yet is refused (``UserError``)."""
    from sat_cli.errors import UserError

    if obj.trainer.name == "megatron":
        missing = unimplemented(Layout.of(obj.trainer))
        if missing:
            raise UserError(not_yet_message(missing))


def not_yet_message(missing: list[str], plan: bool = False) -> str:
    what = ", ".join(missing)
    head = "note: " if plan else ""
    tail = (
        "`sat train` refuses this layout until it does"
        if plan
        else "`sat plan` prints the layout and its memory estimate"
    )
    return (
        f"{head}trainer=megatron cannot run {what} yet: the Megatron worker does not implement "
        f"it ({tail}; not yet implemented: {', '.join(sorted(NOT_YET))}; docs/megatron.md)"
    )
