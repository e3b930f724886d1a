"""Score centering with the sampler's top-k head (docs/algorithms.md §5, the derivation there).

Source: "score centering", arXiv 2609.20807, Eq. 14, with the paper's top-k estimator, as NVIDIA
NeMo-RL documents it (``nemo_rl.algorithms.loss.score_centering.compute_score_centering_term``
and its "Score Centering" guide). At one generated position let ``H`` be the sampler's top-k
token ids, ``q_v`` the sampler's probabilities there (given by the engine) and ``p_v`` the
trainer policy's (normalised over the full vocabulary, or over the same support when the
sampling mask is replayed). The sampler's unseen tail is modelled as the trainer's tail rescaled:

    rho = (1 - sum_H q) / max(1 - sum_H p, 1e-6),     q_v ~ rho * p_v outside H

(``1 - sum_H q`` is clamped at 0).

**The estimator for any token weight.** With a constant advantage ``A`` the loss's gradient at a
sampled token ``y ~ q`` is ``-A w(y) grad log p_y``, where ``w`` is the token's detached weight at
the gradient: the ratio's value times the correction's weight. Its expectation, the **drift**,
is ``-A sum_v q_v w_v grad log p_v``. The centering mass is ``m_v = q_v w_v``; outside ``H``,
with ``q_v = rho p_v``, it is ``alpha p_v``. Because ``sum_v p_v grad log p_v = 0`` over the whole
vocabulary, ``sum_v m_v grad log p_v = sum_H (m_v - alpha p_v) grad log p_v`` exactly when the
tail model holds, so ``c_v = m_v - alpha p_v`` and the per-token correction

    C = sum_{v in H} sg(c_v) * log p_v,      loss = L_base + A * C

cancels the drift. With one optimizer step per batch the ratio's value is ``p/mu`` for the
rollout denominator and 1 for the recompute one (``pi_old = pi_theta``), and the correction's
weight is a function of ``k = pi_old/mu = p/q``. Writing ``w(k)`` (``Weight``):

* ``ratio``: the ratio against ``mu`` with no correction, ``w = k`` (untruncated IS):
  ``m = p``, ``alpha = 1``, so ``c = 0`` exactly: that base is already drift-free;
* ``one``: the recompute denominator with no correction, ``w = 1``: ``m = q``, ``alpha = rho``;
* ``clamp`` (token-level TIS, ``w = clamp(k, lo, hi)``; this project's ``tis`` is ``lo = 0``,
  ``hi = tis_cap``): ``m = clamp(p, lo q, hi q)``, ``alpha = clamp(1, lo rho, hi rho)``;
* ``mask`` (MIS, ``w = k 1[k <= cap]``: ``lo = 0``; IcePop, ``w = k 1[lo <= k <= hi]``):
  ``m = p 1[lo q <= p <= hi q]``, ``alpha = 1[lo rho <= 1 <= hi rho]`` (the tail's ``k = 1/rho``).

``q == p`` makes every ``c_v`` zero for every weight (``rho = 1``); when ``H`` is the whole
support, ``C``'s value may pick up ``alpha``'s float noise but its gradient is still exactly
the zero ``sum_H p grad log p``. The sequence-level ratio against ``mu`` (GSPO) weighs a token by
its response's ratio, not by a function of its own ``k``: no estimator of this form exists
there (``weight_for`` refuses it).

``score_centering_term`` is a pure tensor function: coefficients in float64, detached; the
gradient flows only through ``policy_topk_logp``. Padded entries (``valid`` False) count
nowhere and never reach the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64
TAIL_FLOOR = 1e-6  # the trainer tail mass is clamped at this (NeMo-RL's value)


def _masses(policy_topk_logp, sampler_topk_logp, valid):
    """``(p, q)`` ``[B, T, K]`` float64, detached, 0 on padded entries."""
    zero = torch.zeros((), dtype=F64, device=valid.device)
    p = torch.where(valid, policy_topk_logp.detach().to(F64), zero).exp()
    q = torch.where(valid, sampler_topk_logp.detach().to(F64), zero).exp()
    return torch.where(valid, p, zero), torch.where(valid, q, zero)


@dataclass(frozen=True)
class Weight:
    """The token weight ``w(k)`` the centering cancels (module doc): ``kind`` one of ``ratio``,
    ``one``, ``clamp``, ``mask``, with the bounds ``0 <= lo <= hi < inf`` of the last two."""

    kind: str
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("ratio", "one", "clamp", "mask"):
            raise ValueError(f"unknown centering weight {self.kind!r}")
        if self.kind in ("clamp", "mask") and not 0.0 <= self.lo <= self.hi < math.inf:
            raise ValueError(f"score centering needs 0 <= lo <= hi < inf, got {self.lo, self.hi}")


NO_IS = Weight("one")


def weight_for(level: str, denominator: str, correction: str, cfg) -> Weight:
    """The weight of a loss (``LossSpec`` fields and a ``LossConfig``); ValueError where no
    estimator of this form exists (a sequence-level ratio against ``mu``, a custom denominator)."""
    if correction == "tis":
        return Weight("clamp", 0.0, cfg.tis_cap)
    if correction == "mis":
        return Weight("mask", 0.0, cfg.tis_cap)
    if correction == "icepop":
        return Weight("mask", cfg.icepop_low, cfg.icepop_high)
    if denominator == "old":
        return NO_IS
    if denominator == "rollout" and level == "token":
        return Weight("ratio")
    raise ValueError(
        f"score centering has no estimator for a {level}-level ratio against the "
        f"{'behaviour policy mu' if denominator == 'rollout' else denominator + ' denominator'}: "
        "its token weight is not a function of the token's own ratio; use "
        "ratio_denominator='recompute' or a correction (docs/algorithms.md §5)"
    )


def centering_coefficients(
    policy_topk_logp: torch.Tensor,
    sampler_topk_logp: torch.Tensor,
    valid: torch.Tensor,
    weight: Weight = NO_IS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(c, stats)``: ``c`` ``[B, T, K]`` float64 (0 on padding) and, per position ``[B, T]``,
    ``stats["sampler_head"]`` = ``sum_H q``, ``["policy_head"]`` = ``sum_H p``, ``["rho"]``,
    ``["alpha"]``, for the token weight ``weight`` (module doc)."""
    valid = valid.bool()
    p, q = _masses(policy_topk_logp, sampler_topk_logp, valid)  # [B, T, K]
    head_q, head_p = q.sum(-1), p.sum(-1)  # [B, T]
    rho = (1.0 - head_q).clamp(min=0.0) / (1.0 - head_p).clamp(min=TAIL_FLOOR)  # [B, T]
    lo, hi = weight.lo, weight.hi
    if weight.kind == "ratio":
        mass, alpha = p, torch.ones_like(rho)
    elif weight.kind == "one":
        mass, alpha = q, rho
    elif weight.kind == "clamp":
        mass = torch.minimum(torch.maximum(p, lo * q), hi * q)  # clamp(p, lo q, hi q)
        alpha = torch.minimum(torch.clamp(lo * rho, min=1.0), hi * rho)  # clamp(1, lo rho, hi rho)
    else:  # mask: keep p where lo <= p/q <= hi; the tail's k = 1/rho
        mass = torch.where((p >= lo * q) & (p <= hi * q), p, 0.0)
        alpha = ((lo * rho <= 1.0) & (hi * rho >= 1.0)).to(F64)
    c = torch.where(valid, mass - alpha[..., None] * p, 0.0)  # [B, T, K]
    stats = {"sampler_head": head_q, "policy_head": head_p, "rho": rho, "alpha": alpha}
    return c, stats


def score_centering_term(
    policy_topk_logp: torch.Tensor,
    sampler_topk_logp: torch.Tensor,
    valid: torch.Tensor,
    weight: Weight = NO_IS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``C = sum_H sg(c_v) log p_v`` ``[B, T]`` (``policy_topk_logp``'s dtype, with
    its gradient) and the detached ``stats`` of ``centering_coefficients``.

    Args:
        policy_topk_logp: ``[B, T, K]`` the trainer's log-probs at the sampler's top-k ids.
        sampler_topk_logp: ``[B, T, K]`` the sampler's log-probs there (detached).
        valid: ``[B, T, K]`` bool, False on padded entries.
        weight: the loss's token weight (``Weight``, ``weight_for``).
    """
    if not policy_topk_logp.shape == sampler_topk_logp.shape == valid.shape:
        raise ValueError(
            f"score centering: policy_topk_logp {tuple(policy_topk_logp.shape)}, sampler_topk_logp"
            f" {tuple(sampler_topk_logp.shape)} and topk_valid {tuple(valid.shape)} must agree"
        )
    valid = valid.bool()
    c, stats = centering_coefficients(policy_topk_logp, sampler_topk_logp, valid, weight)
    log_p = torch.where(valid, policy_topk_logp, 0.0)  # [B, T, K], no NaN from padding
    term = (c.to(log_p.dtype) * log_p).sum(-1)  # [B, T]
    return term, stats
