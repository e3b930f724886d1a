"""How the device plan reaches each process: ``CUDA_VISIBLE_DEVICES`` for the processes started
here (SGLang servers, torchrun), a ``cuda:K`` device for the local engine and trainer, SGLang's
memory fraction on a shared GPU. Torch-free."""

from __future__ import annotations

import os

from sat_cli.devices.plan import DevicePlan, DevicePlanError


def visible_devices(gpus: tuple[int, ...], parent: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that uses the plan's ``gpus``: the ids mapped
    through the parent's own ``CUDA_VISIBLE_DEVICES`` (``parent``; default: this process's),
    since a child's value names physical GPUs while the plan's ids index what this process sees;
    empty when this process sees none (``CUDA_VISIBLE_DEVICES=""``: a CPU run stays one)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    if parent is None:
        return ",".join(map(str, gpus))
    seen = [x.strip() for x in parent.split(",") if x.strip()]
    if not seen:  # this process sees no GPU (CUDA_VISIBLE_DEVICES=""): neither does the child
        return ""
    if max(gpus) >= len(seen):
        raise DevicePlanError(
            f"the device plan gives GPU {max(gpus)} but CUDA_VISIBLE_DEVICES={parent} shows "
            f"{len(seen)} GPU(s) to this process"
        )
    return ",".join(seen[g] for g in gpus)


def server_groups(plan: DevicePlan) -> list[str] | None:
    """The SGLang servers' ``CUDA_VISIBLE_DEVICES``, one per server (``build_servers``'s
    ``gpu_groups``); None when they run on the CPU or Ray assigns their GPUs."""
    servers = [p for p in plan.of("engine") if p.own_visible]
    if not servers or not all(p.gpus and p.node is not None for p in servers):
        return None
    return [visible_devices(p.gpus) for p in servers]


def server_mem_fraction(plan: DevicePlan, configured: float | None) -> float | None:
    """``--mem-fraction-static`` of the SGLang servers: the plan's on a shared GPU."""
    fractions = {p.mem_fraction for p in plan.of("engine") if p.own_visible}
    return fractions.pop() if len(fractions) == 1 and None not in fractions else configured


def trainer_env(plan: DevicePlan) -> dict[str, str]:
    """torchrun's environment on node 0 (launcher=local): its GPUs, ranks in LOCAL_RANK order."""
    nodes = [p for p in plan.of("trainer") if p.own_visible and p.node == 0 and p.gpus]
    return {"CUDA_VISIBLE_DEVICES": visible_devices(nodes[0].gpus)} if nodes else {}
