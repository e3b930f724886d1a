"""The detached metrics of ``policy_loss`` (``sat_cli.rl.losses``) and its per-token diagnostics.

Metrics: ``loss/policy``; ``loss/clipfrac`` = fraction of active tokens whose PPO clip binds
(``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low`` on the level's ratio, i.e. gradient zeroed),
split by side into ``loss/clipfrac_low`` (``A < 0`` at the lower bound) and ``loss/clipfrac_high``;
``sat/clipfrac_sat_band`` = fraction clipped by SAT's interval but not by PPO's (0 without SAT:
the tokens whose gradient SAT actually removed), likewise split ``_low`` / ``_high``;
``staleness/abs_logratio_mean`` = mean ``|logp - denom_logp|`` on *token* ratios (also for
GSPO); ``loss/kl_k3`` = mean of ``exp(-log r) - 1 + log r`` on token ratios; with SAT also
``sat/q``, ``sat/gate_rate``, ``sat/eps_low_eff_mean``, ``sat/eps_high_eff_mean``, ``sat/c_min``
and ``sat/active``: 1.0 iff ``q < max(ln(1 + eps_high), -ln(1 - eps_low))``, the regime where
the paper's SAT can change a gradient with one optimizer step per batch (``sat_can_act``; for
``q`` between 0.182 and 0.223 at eps = 0.2 only the lower side can act: tokens with ``d < 0``,
``A < 0`` and ``q < |d| < 0.223``). Per side: ``sat/active_low``, ``sat/active_high``. The loop
averages ``sat/active`` into ``sat/active_frac``.

Everything here runs under ``torch.no_grad`` on the loss's own tensors (``losses.Ratios``:
``r.ratio``, ``r.token_lr``, ``r.abs_lr``), so the metrics describe exactly the interval used.
"""

from __future__ import annotations

import math

import torch

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig


def sequence_band(r, adv, sat, bounds, cfg: LossConfig) -> torch.Tensor:
    """``[2]`` (low, high) tokens clipped by SAT's per-response interval but not by PPO's:
    SAT's interval lies inside PPO's, so its extra clips are in gated responses."""
    lower, upper = bounds
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    g = sat.index
    r_g, a_g = r.ratio.detach()[g], adv[g]  # [G, T]
    up_g, lo_g = upper[g], lower[g]  # [G, 1]
    pos, neg = a_g > 0, a_g < 0
    band_hi = pos & (r_g > up_g) & ~(r_g > hi)
    band_lo = neg & (r_g < lo_g) & ~(r_g < lo)
    return torch.stack([band_lo.sum(), band_hi.sum()])


def clip_metrics(loss, r, counts, sat, n_active: int, blocks, cfg: LossConfig):
    """The detached metrics (module doc) in one host sync; ``counts`` = ``(n_clip, n_band)``
    per side ``[2]`` (low, high)."""
    n_clip, n_band = counts
    n = float(max(n_active, 1))
    ppo_clip = (n_clip - n_band).double() / n  # [2]: low, high
    band = n_band.double() / n
    vals = {
        M.LOSS_POLICY: loss.detach(),
        M.CLIPFRAC: ppo_clip.sum(),
        M.CLIPFRAC_LOW: ppo_clip[0],
        M.CLIPFRAC_HIGH: ppo_clip[1],
        M.SAT_BAND: band.sum(),
        M.SAT_BAND_LOW: band[0],
        M.SAT_BAND_HIGH: band[1],
        M.DPI: r.abs_lr.sum() / n,
        # k3 is exactly 0 where token_lr == 0, i.e. on every masked slot.
        M.KL_K3: torch.expm1(-r.token_lr.detach()).add_(r.token_lr.detach()).sum() / n,
    }
    if sat is not None:
        vals.update(sat.stats)  # M.SAT_Q, M.SAT_GATE_RATE, ...
    keys = list(vals)
    floats = torch.stack([vals[k].to(torch.float64) for k in keys]).tolist()
    metrics = dict(zip(keys, floats, strict=True))
    if sat is not None:
        metrics.update(_active_flags(sat, blocks, cfg.eps_low, cfg.eps_high))
    return metrics


def token_diagnostics(abs_lr, mask, sat, level, lower, upper, eps_low, eps_high) -> dict:
    """What the loss used, per active token (row-major order), detached on the CPU:

    * ``abs_d`` ``[N]`` float32: ``|log r|`` of the token ratio against the loss's denominator;
    * ``gate`` ``[N]`` bool: SAT contracted this token's interval (for the GSPO levels: its
      response's);
    * ``contraction`` ``[N]`` float32: ``c`` of the contracted endpoint (1 off the gate): the
      upper side ``(u - 1) / eps_high``, the lower ``(1 - l) / eps_low``;
    * ``q`` ``[1]`` float64 (SAT's batch reference; ``[0]`` without SAT) and ``n_active`` ``[1]``.
    """
    m = mask.bool()
    n = int(m.sum())
    gate = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    c = torch.ones(m.shape, dtype=torch.float32, device=m.device)
    if sat is not None and sat.index is not None:
        if level == "token":
            side, bound = sat.upper_side, sat.bound.float()
            c_g = torch.where(
                side,
                (bound - 1.0) / (eps_high if eps_high > 0 else 1.0),
                (1.0 - bound) / (eps_low if eps_low > 0 else 1.0),
            )
            gate.view(-1)[sat.index] = True
            c.view(-1)[sat.index] = c_g
        else:  # one interval per response: rows sat.index
            c_hi = (upper.float() - 1.0) / (eps_high if eps_high > 0 else 1.0)  # [B, 1]
            c_lo = (1.0 - lower.float()) / (eps_low if eps_low > 0 else 1.0)  # [B, 1]
            rows = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
            rows[sat.index] = True
            gate = rows[:, None] & m
            c = torch.where(gate, torch.minimum(c_hi, c_lo).expand_as(c), c)
    q = [float(sat.q)] if sat is not None else []
    return {
        "abs_d": abs_lr[m].float().cpu(),
        "gate": gate[m].cpu(),
        "contraction": c[m].cpu(),
        "q": torch.tensor(q, dtype=torch.float64),
        "n_active": torch.tensor([n], dtype=torch.int64),
    }


def sat_can_act(q: float, eps_low: float, eps_high: float) -> tuple[bool, bool]:
    """``(low, high)``: whether SAT can change a gradient on that side at batch reference ``q``
    with one optimizer step per batch (``r = exp(d)``): only tokens with ``q < |d| < ell_side``
    can be newly clipped, ``ell_high = ln(1 + eps_high)``, ``ell_low = -ln(1 - eps_low)``
    (ALGORITHMS.md §4 "When SAT is inert"; 0.182 and 0.223 at eps = 0.2)."""
    ell_hi = math.log1p(eps_high)
    ell_lo = -math.log1p(-eps_low) if eps_low < 1.0 else math.inf
    return q < ell_lo, q < ell_hi


def _active_flags(sat, blocks, eps_low, eps_high) -> dict[str, float]:
    """``sat/active`` (either side), ``sat/active_low``, ``sat/active_high``: 1.0/0.0 for one
    ``q``; with several blocks the active-token-weighted fraction of blocks."""
    qs = getattr(sat, "block_qs", None) or [(sat.q, 1)]
    n = float(max(sum(n_c for _, n_c in qs), 1))
    out = {M.SAT_ACTIVE: 0.0, M.SAT_ACTIVE_LOW: 0.0, M.SAT_ACTIVE_HIGH: 0.0}
    for q, n_c in qs:
        low, high = sat_can_act(q, eps_low, eps_high)
        w = n_c / n if len(qs) > 1 else 1.0
        out[M.SAT_ACTIVE] += w * (low or high)
        out[M.SAT_ACTIVE_LOW] += w * low
        out[M.SAT_ACTIVE_HIGH] += w * high
    return out
