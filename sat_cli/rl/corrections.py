"""Train/rollout mismatch corrections as detached per-token weights and masks (ALGORITHMS.md §5).

Every function returns a detached ``[B, T]`` tensor meant for ``policy_loss(token_weights=...)``;
none of them looks at the loss mask except ``m2po_mask`` (whose statistic is a batch mean).
Masked-out positions may hold garbage: ``policy_loss`` zeroes weights off-mask with
``torch.where``, so NaN there never reaches the loss.

- ``tis_weights``:  ``w = min(k, C)`` with ``k = exp(old_logp - rollout_logp)``, ``C = 2``.
- ``mis_weights``:  ``w = k * 1[k <= C]`` (masked IS: zero instead of clipped).
- ``icepop_weights``: ``w = k * 1[low <= k <= high]``, ``(low, high) = (0.5, 5)``.
- ``behaviour_weights``: decoupled PPO's ``w = pi_old / mu``, optionally clipped at ``cap``
  (``mode="clip"``) or zeroed above it (``mode="mask"``).
- ``dppo_tv_mask``: keep a token iff ``A * (r - 1) <= 0`` or ``|pi_theta - mu| <= delta`` on
  probabilities, with ``r = pi_theta / mu``.
- ``m2po_mask``: with ``m = (old_logp - rollout_logp)**2``, drop the largest ``m`` until the mean
  of the kept active tokens is ``< tau``; returns 1 on kept active tokens, 0 elsewhere.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def _k(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(old_logp.detach() - rollout_logp.detach())  # [B, T], pi_old / mu


@torch.no_grad()
def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0):
    """Truncated IS weight ``min(pi_old / mu, cap)``."""
    return torch.clamp(_k(old_logp, rollout_logp), max=cap)


@torch.no_grad()
def mis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0):
    """Masked IS weight ``k * 1[k <= cap]`` with ``k = pi_old / mu``."""
    k = _k(old_logp, rollout_logp)
    return torch.where(k <= cap, k, 0.0)


@torch.no_grad()
def icepop_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float = 0.5, high: float = 5.0
):
    """IcePop weight ``k * 1[low <= k <= high]`` with ``k = pi_old / mu``."""
    k = _k(old_logp, rollout_logp)
    return torch.where((k >= low) & (k <= high), k, 0.0)


@torch.no_grad()
def behaviour_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cap: float | None = None,
    mode: str = "clip",
):
    """Decoupled-PPO behaviour weight ``pi_old / mu``; ``cap`` clips (``clip``) or zeroes (``mask``)."""
    if mode not in ("clip", "mask"):
        raise ValueError(f"unknown behaviour-weight mode {mode!r}; valid: clip, mask")
    k = _k(old_logp, rollout_logp)
    if cap is None:
        return k
    if mode == "clip":
        return torch.clamp(k, max=cap)
    return torch.where(k <= cap, k, 0.0)


@torch.no_grad()
def dppo_tv_mask(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    delta: float = 1e-3,
):
    """DPPO-TV keep-mask (1.0 keep, 0.0 drop) from the current ``logp`` (read, not differentiated)."""
    logp = logp.detach()
    rollout_logp = rollout_logp.detach()
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv[:, None]  # [B, 1]
    # sign(r - 1) == sign(logp - rollout_logp); comparing log-probs avoids exp overflow.
    pull_back = adv * (logp - rollout_logp) <= 0  # [B, T]
    close = (torch.exp(logp) - torch.exp(rollout_logp)).abs() <= delta  # [B, T]
    return (pull_back | close).to(logp.dtype)


@torch.no_grad()
def m2po_mask(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, tau: float = 0.04
):
    """M2PO second-moment mask: keep the ``n`` smallest ``m`` with ``n`` the largest count whose
    mean is ``< tau`` (exact ranks, ties broken by position, so the kept mean is always ``< tau``)."""
    mask = mask.bool()
    m = torch.where(mask, (old_logp.detach() - rollout_logp.detach()) ** 2, 0.0)  # [B, T]
    flat_m = m.reshape(-1)
    active_idx = mask.reshape(-1).nonzero().squeeze(-1)  # [N]
    keep = torch.zeros_like(flat_m, dtype=torch.bool)
    if active_idx.numel() > 0:
        vals = flat_m[active_idx].to(torch.float64)  # [N]
        order = torch.sort(vals, stable=True).indices  # [N], ascending
        sorted_vals = vals[order]
        counts = torch.arange(1, vals.numel() + 1, device=vals.device, dtype=torch.float64)
        prefix_mean = torch.cumsum(sorted_vals, 0) / counts  # [N], nondecreasing
        n_keep = int((prefix_mean < tau).sum())
        keep[active_idx[order[:n_keep]]] = True
    return keep.reshape(m.shape).to(old_logp.dtype)
