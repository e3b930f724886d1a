"""Group-relative advantages (GRPO, ALGORITHMS.md §2).

``group_advantages(rewards, group_size)``: rewards ``[N]`` with each prompt's ``G`` responses
contiguous. ``A = (R - mean_G R) / (std_G R + 1e-6)``, or ``R - mean_G R`` with
``std_norm=False`` (Dr.GRPO). ``std_G`` is the unbiased (Bessel-corrected, ``torch.std``
default) group standard deviation **[choice]**, as in verl and TRL. A group whose rewards are all
equal (including ``G == 1``) gets exactly ``A = 0``, not float round-off of ``R - mean``.
Returns ``[N]`` advantages (one per sequence; ``policy_loss`` broadcasts them to tokens).
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-6


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)  # [N / G, G]


def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True):
    """Per-sequence GRPO advantages ``[N]`` (see module docstring)."""
    r = _grouped(rewards.detach(), group_size)  # [P, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [P, G]
    if std_norm:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        centred = centred / (std + ADV_EPS)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    return torch.where(constant, 0.0, centred).reshape(-1)


def zero_adv_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N]`` bool, True for every response of a group whose rewards are all equal
    (for ``algo.drop_zero_adv_groups``)."""
    r = _grouped(rewards.detach(), group_size)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return constant.expand_as(r).reshape(-1)
