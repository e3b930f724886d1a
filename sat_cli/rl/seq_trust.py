"""STR: a sequence-level trust region that drops whole responses (docs/algorithms.md §5).

The sequence trust region of FlashREINFORCE, as this project defines it (the paper could not be
retrieved, so the definition below is the one the issue fixed, **[choice]**). Per active token
``t`` of response ``b``, with ``mu_t = exp(rollout_logp)`` the behaviour probability of the
sampled token and ``p_t = exp(logp)`` the current policy's (read, never differentiated), the
Bernoulli KL of "this token / any other token" under the two policies is

    KL(mu_t || p_t) = mu log(mu / p) + (1 - mu) log((1 - mu) / (1 - p)),

in the direction ``KL(behaviour || current)``, as TRPO's ``KL(old || new)``. The response's value
is the mean over its active tokens; it is kept iff that mean is ``<= delta`` (``LossConfig.
str_delta``), else every one of its tokens gets weight 0. The factor multiplies the clipped
surrogate of any clipped algorithm (``registry.compute``).

Numerics: computed in float64 from the log-probs; ``1 - mu`` and ``1 - p`` come from
``-expm1(logp)`` (exact near ``p = 1``), ``(1 - mu) log(1 - mu)`` is ``xlogy`` (0 at ``mu = 1``),
and ``1 - p`` is clamped to float64's smallest normal number so a policy that puts all its mass
on the token (``p = 1``, ``mu < 1``) gives a large finite KL, not ``inf``. Masked positions are
replaced before any ``exp``.
"""

from __future__ import annotations

import torch

from sat_cli import metric_names as M

F64 = torch.float64
_TINY = torch.finfo(F64).tiny


@torch.no_grad()
def bernoulli_kl(logp_mu: torch.Tensor, logp_pi: torch.Tensor) -> torch.Tensor:
    """Elementwise ``KL(Bern(mu) || Bern(p))`` in float64 from ``log mu`` and ``log p`` (both
    ``<= 0``); see the module docstring for the numerics."""
    lmu, lp = logp_mu.to(F64).clamp(max=0.0), logp_pi.to(F64).clamp(max=0.0)
    mu = torch.exp(lmu)
    one_m_mu = -torch.expm1(lmu)  # 1 - mu, exact near mu = 1
    one_m_p = (-torch.expm1(lp)).clamp(min=_TINY)  # 1 - p > 0
    return mu * (lmu - lp) + torch.xlogy(one_m_mu, one_m_mu) - one_m_mu * torch.log(one_m_p)


@torch.no_grad()
def str_keep(
    logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, delta: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(keep, metrics)``: ``keep`` ``[B, T]`` (``logp``'s dtype) is 1 on every position of a
    kept response and 0 on a dropped one; ``metrics``: ``loss/str_drop_frac`` (dropped share of
    the responses with an active token) and ``loss/str_seq_kl_mean`` (their mean sequence KL).
    A response without active tokens is kept and not counted."""
    if not delta >= 0:
        raise ValueError(f"str_delta must be >= 0, got {delta}")
    m = mask.bool()  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl = bernoulli_kl(
        torch.where(m, rollout_logp.detach(), zero), torch.where(m, logp.detach(), zero)
    )
    kl = torch.where(m, kl, 0.0)  # [B, T]
    lens = m.sum(-1)  # [B]
    seq_kl = kl.sum(-1) / lens.clamp(min=1)  # [B], float64
    has = lens > 0  # [B]
    drop = has & (seq_kl > delta)  # [B]
    keep = (~drop).to(logp.dtype)[:, None].expand_as(logp)  # [B, T]
    n_seq = max(int(has.sum()), 1)
    metrics = {
        M.STR_DROP_FRAC: float(drop.sum()) / n_seq,
        M.STR_SEQ_KL_MEAN: float(seq_kl[has].sum()) / n_seq,
    }
    return keep, metrics
