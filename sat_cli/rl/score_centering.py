"""Score centering with the sampler's top-k head (docs/algorithms.md §5).

Source: "score centering", arXiv 2609.20807, Eq. 14, with the paper's top-k estimator, as NVIDIA
NeMo-RL documents it (``nemo_rl.algorithms.loss.score_centering.compute_score_centering_term``
and its "Score Centering" guide). At one generated position let ``H`` be the sampler's top-k
token ids, ``q_v`` the sampler's probabilities there (given by the engine) and ``p_v`` the
trainer policy's (normalised over the full vocabulary, or over the same support when the
sampling mask is replayed). The sampler's unseen tail is modelled as the trainer's tail rescaled:

    rho = (1 - sum_H q) / max(1 - sum_H p, 1e-6),     q_v ~ rho * p_v outside H

(``1 - sum_H q`` is clamped at 0). The centering mass ``m_v`` and the tail coefficient ``alpha``:

* no importance sampling: ``m_v = q_v``, ``alpha = rho``;
* token-level TIS ``w = clamp(p/q, lo, hi)``: ``m_v = clamp(p_v, lo q_v, hi q_v)``,
  ``alpha = clamp(1, lo rho, hi rho)`` (this project's ``tis`` is ``lo = 0, hi = tis_cap``).

Because ``sum_v p_v grad log p_v = 0`` over the whole vocabulary, the tail's ``alpha p_v`` moves
onto the head ids with a minus sign, so the coefficient is ``c_v = m_v - alpha p_v`` and the
per-token correction

    C = sum_{v in H} sg(c_v) * log p_v

has as gradient the sampler-expected score. The loss adds ``A * C`` per token, aggregated like
the base loss (``registry.compute``). Untruncated IS (``m = p``, ``alpha = 1``) makes every
``c_v`` zero; so does ``q == p`` without IS whatever ``H`` is (when ``H`` is the whole support,
``C``'s value may pick up ``alpha``'s float noise but its gradient is still exactly the zero
``sum_H p grad log p``).

``score_centering_term`` is a pure tensor function: coefficients in float64, detached; the
gradient flows only through ``policy_topk_logp``. Padded entries (``valid`` False) count
nowhere and never reach the gradient.
"""

from __future__ import annotations

import torch

F64 = torch.float64
TAIL_FLOOR = 1e-6  # the trainer tail mass is clamped at this (NeMo-RL's value)


def _masses(policy_topk_logp, sampler_topk_logp, valid):
    """``(p, q)`` ``[B, T, K]`` float64, detached, 0 on padded entries."""
    zero = torch.zeros((), dtype=F64, device=valid.device)
    p = torch.where(valid, policy_topk_logp.detach().to(F64), zero).exp()
    q = torch.where(valid, sampler_topk_logp.detach().to(F64), zero).exp()
    return torch.where(valid, p, zero), torch.where(valid, q, zero)


def centering_coefficients(
    policy_topk_logp: torch.Tensor,
    sampler_topk_logp: torch.Tensor,
    valid: torch.Tensor,
    is_bounds: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(c, stats)``: ``c`` ``[B, T, K]`` float64 (0 on padding) and, per position ``[B, T]``,
    ``stats["sampler_head"]`` = ``sum_H q``, ``["policy_head"]`` = ``sum_H p``, ``["rho"]``,
    ``["alpha"]``. ``is_bounds = (lo, hi)``: token-level TIS with ``0 <= lo <= hi < inf``;
    ``None``: no importance sampling."""
    valid = valid.bool()
    p, q = _masses(policy_topk_logp, sampler_topk_logp, valid)  # [B, T, K]
    head_q, head_p = q.sum(-1), p.sum(-1)  # [B, T]
    rho = (1.0 - head_q).clamp(min=0.0) / (1.0 - head_p).clamp(min=TAIL_FLOOR)  # [B, T]
    if is_bounds is None:
        mass, alpha = q, rho
    else:
        lo, hi = map(float, is_bounds)
        if not 0.0 <= lo <= hi < float("inf"):
            raise ValueError(f"score centering needs 0 <= lo <= hi < inf, got {is_bounds}")
        mass = torch.minimum(torch.maximum(p, lo * q), hi * q)  # clamp(p, lo q, hi q)
        alpha = torch.minimum(torch.clamp(lo * rho, min=1.0), hi * rho)  # clamp(1, lo rho, hi rho)
    c = torch.where(valid, mass - alpha[..., None] * p, 0.0)  # [B, T, K]
    stats = {"sampler_head": head_q, "policy_head": head_p, "rho": rho, "alpha": alpha}
    return c, stats


def score_centering_term(
    policy_topk_logp: torch.Tensor,
    sampler_topk_logp: torch.Tensor,
    valid: torch.Tensor,
    is_bounds: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``C = sum_H sg(c_v) log p_v`` ``[B, T]`` (``policy_topk_logp``'s dtype, with
    its gradient) and the detached ``stats`` of ``centering_coefficients``.

    Args:
        policy_topk_logp: ``[B, T, K]`` the trainer's log-probs at the sampler's top-k ids.
        sampler_topk_logp: ``[B, T, K]`` the sampler's log-probs there (detached).
        valid: ``[B, T, K]`` bool, False on padded entries.
        is_bounds: ``(lo, hi)`` of token-level TIS, or None (no importance sampling).
    """
    if not policy_topk_logp.shape == sampler_topk_logp.shape == valid.shape:
        raise ValueError(
            f"score centering: policy_topk_logp {tuple(policy_topk_logp.shape)}, sampler_topk_logp"
            f" {tuple(sampler_topk_logp.shape)} and topk_valid {tuple(valid.shape)} must agree"
        )
    valid = valid.bool()
    c, stats = centering_coefficients(policy_topk_logp, sampler_topk_logp, valid, is_bounds)
    log_p = torch.where(valid, policy_topk_logp, 0.0)  # [B, T, K], no NaN from padding
    term = (c.to(log_p.dtype) * log_p).sum(-1)  # [B, T]
    return term, stats
