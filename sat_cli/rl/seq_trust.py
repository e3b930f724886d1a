"""STR: a sequence-level trust region that drops whole responses (docs/algorithms.md §5).

The sequence trust region ("trust gate") of FlashREINFORCE, as its public reference
implementation computes it (``flashreinforce.loss.flashreinforce_loss`` of the authors'
repository; read for issue 44). Per active token ``t`` of response ``b``, with ``mu_t`` the
behaviour probability of the sampled token and ``p_t`` the current policy's (read, never
differentiated), both **clamped to [1e-6, 1 - 1e-6]** as the reference does, the Bernoulli KL of
"this token / any other token" under the two policies is

    KL(mu_t || p_t) = mu log(mu / p) + (1 - mu) log((1 - mu) / (1 - p)),

in the direction ``KL(behaviour || current)``. The response's value is the mean over its active
tokens, clamped at 0; it is kept iff that mean is ``<= delta`` (``LossConfig.str_delta``; the
reference's default is ``3e-3``), else every one of its tokens gets weight 0. The factor
multiplies the clipped surrogate of any clipped algorithm (``registry.compute``).

Differences from the reference, deliberate: float64 throughout (the reference uses float32 for
float32 and bf16 inputs); the keep factor multiplies this project's clipped surrogates instead
of the reference's unclipped detached-ratio REINFORCE loss; a response without active tokens is
kept (the reference refuses it). The first version of this module clamped nothing (``1 - p``
only at float64's smallest normal number), so a near-certain token whose ``1 - p`` fell below
1e-6 got a KL several times the reference's (up to ``(1 - mu) * 708`` instead of
``(1 - mu) * 13.8``).
"""

from __future__ import annotations

import torch

from sat_cli import metric_names as M

F64 = torch.float64
PROB_FLOOR = 1e-6  # probabilities clamped to [1e-6, 1 - 1e-6], as the reference does
REFERENCE_DELTA = 3e-3  # the reference's default delta


@torch.no_grad()
def bernoulli_kl(logp_mu: torch.Tensor, logp_pi: torch.Tensor) -> torch.Tensor:
    """Elementwise ``KL(Bern(mu) || Bern(p))`` in float64 from ``log mu`` and ``log p``, with
    both probabilities clamped to ``[PROB_FLOOR, 1 - PROB_FLOOR]`` (the reference's gate)."""
    mu = torch.exp(logp_mu.to(F64)).clamp(PROB_FLOOR, 1.0 - PROB_FLOOR)
    p = torch.exp(logp_pi.to(F64)).clamp(PROB_FLOOR, 1.0 - PROB_FLOOR)
    return mu * (mu.log() - p.log()) + (1.0 - mu) * (torch.log1p(-mu) - torch.log1p(-p))


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
    seq_kl = (kl.sum(-1) / lens.clamp(min=1)).clamp(min=0.0)  # [B], float64, as the reference
    has = lens > 0  # [B]
    drop = has & (seq_kl > delta)  # [B]
    keep = (~drop).to(logp.dtype)[:, None].expand_as(logp)  # [B, T]
    n_seq = max(int(has.sum()), 1)
    metrics = {
        M.STR_DROP_FRAC: float(drop.sum()) / n_seq,
        M.STR_SEQ_KL_MEAN: float(seq_kl[has].sum()) / n_seq,
    }
    return keep, metrics
