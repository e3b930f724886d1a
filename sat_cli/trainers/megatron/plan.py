"""``trainer=megatron`` in ``sat plan``: its layout line, the per-GPU memory table of
``sat_cli.trainers.megatron.layout`` and the note on layouts the worker cannot run yet.
Torch-free; called through the settings class (``MegatronTrainerSettings.plan_lines`` and
``plan_notes``)."""

from __future__ import annotations

from sat_cli.models.arch import params_text
from sat_cli.trainers.megatron.layout import NOT_YET, Layout, memory, unimplemented


def layout_line(lay: Layout) -> str:
    return (
        f"trainer   megatron: {lay.nnodes} node(s) × {lay.nproc_per_node} processes = "
        f"{lay.world} ranks under torchrun; tp {lay.tp}, pp {lay.pp}, cp {lay.cp}, ep {lay.ep}, "
        f"etp {lay.etp} → dp {lay.dp}, expert dp {lay.edp}; {lay.dtype}"
    )


def notes(lay: Layout, limit: float, arch, micro: int, seq: int) -> list[str]:
    """The memory table (or why there is none) and the not-yet note."""
    if arch is None:
        lines = ["no memory estimate: the model's architecture is not known here"]
    else:
        lines = memory_lines(lay, limit, arch, micro, seq)
    missing = unimplemented(lay)
    if missing:
        lines += ["", not_yet_message(missing, plan=True)]
    return lines


def memory_lines(lay: Layout, limit: float, arch, micro: int, seq: int) -> list[str]:
    mem = memory(arch, lay, micro, seq)
    dense, expert = mem.params
    w, g, o = (2, 4, 12) if lay.dtype == "bfloat16" else (4, 4, 8)
    experts = (
        f", experts {params_text(expert)}: {arch.experts // lay.ep} of {arch.experts} per layer"
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
        "optimizer states": f"{o} B/param ÷ dp {lay.dp}"
        + (f" (experts ÷ {lay.edp})" if arch.experts else "")
        + f"; {opt}",
        "activations": f"{micro} × {seq} tokens"
        + (", full recompute" if lay.recompute else ", no recompute"),
        "overhead": "CUDA context, NCCL buffers",
    }
    out = [
        "",
        "per trainer GPU (largest pipeline stage; estimate, GB = 1e9 bytes)",
        f"  {'parameters':<17} {params_text(dense + expert)}: dense {params_text(dense)}{experts}",
    ]
    out += [f"  {k:<17} {v:>6.1f} GB  {notes[k]}" for k, v in mem.rows]
    fits = "fits" if mem.total_gb <= limit else "OVER"
    out.append(
        f"  {'total':<17} {mem.total_gb:>6.1f} GB  of trainer.gpu_memory_gb={limit:g} ({fits})"
    )
    return out


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
