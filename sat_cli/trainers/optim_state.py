"""The optimizer's state as safetensors tensors plus JSON param groups (checkpoints of both
trainers; no pickle): ``optimizer_tensors`` writes, ``load_optimizer_tensors`` restores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# how the optimizer computes, not what: kept from the live optimizer when a checkpoint is loaded
# (run.portable_numerics picks the fused AdamW; a checkpoint of the other path resumes with it)
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_tensors(
    opt: torch.optim.Optimizer, name_of: Callable[[int], Any] = str
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``({"rng/torch": ..., "state/<name>/<key>": ...}, param_groups)`` of ``opt`` for a
    safetensors file plus JSON; ``name_of(index)`` names a parameter (index or model name)."""
    tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
    sd = opt.state_dict()
    for idx, state in sd["state"].items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state/{name_of(idx)}/{key}"] = t.detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def load_optimizer_tensors(
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    index_of: Callable[[str], int] = int,
    device: torch.device | None = None,
) -> None:
    """Restore what ``optimizer_tensors`` wrote (moments on ``device`` if given) and the torch
    RNG state."""
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith("state/"):
            pname, key = name[len("state/") :].rsplit("/", 1)
            state.setdefault(index_of(pname), {})[key] = t if device is None else t.to(device)
    for g, live in zip(param_groups, opt.param_groups, strict=False):
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        for key in IMPLEMENTATION_KEYS:  # this process's choice, not the checkpoint's
            if key in live:
                g[key] = live[key]
    opt.load_state_dict({"state": state, "param_groups": param_groups})
    torch.set_rng_state(tensors["rng/torch"])
