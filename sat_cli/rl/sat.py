"""SAT: the staleness-adaptive trust region (ALGORITHMS.md §4), as a pure tensor function.

``sat_clip_bounds(d, mask, eps_low=..., eps_high=...)`` turns a detached staleness proxy
``d[b, t]`` (the token log-ratio, or the sequence log-ratio broadcast to the tokens for SAT-GSPO)
into per-token clip bounds ``lower, upper`` that replace PPO's ``1 - eps_low, 1 + eps_high``:

1. ``q`` is the lower order statistic at level ``alpha = quantile`` of ``|d|`` over the active
   tokens: ``torch.kthvalue(|d|, k)`` with ``k = ceil(alpha * N)``. ``alpha * N`` is computed
   exactly, reading ``alpha`` as the decimal it was written as (``Fraction("0.9") * 10 == 9``),
   so float noise (``0.9 * 10 == 9.000000000000002`` in binary) can never move ``k`` by one. No
   interpolation: ``q`` is always one of the ``|d|`` values.
2. Gate ``g = (q > 0) & (|d| > q)`` (strict), so at most ``1 - alpha`` of the tokens are gated.
3. Hill kernel ``psi(u) = 1 / (1 + (u / q)**p)``; ``psi(q) = 1/2``.
4. Sign-selected contraction: a gated token with ``d > 0`` gets ``upper = 1 + eps_high * psi``,
   one with ``d < 0`` gets ``lower = 1 - eps_low * psi``; the other endpoint and every ungated
   token keep PPO's value exactly (``torch.where`` with the same Python scalar PPO clamps with,
   so ungated tokens and ``q == 0`` are bit-identical to PPO).

Nothing here carries gradient: ``d`` is detached on entry and all outputs are constants.

Beyond the paper: ``anchor="min_q_eps"``. With one optimizer step per batch ``r = exp(d)``;
if ``q >= ln(1 + eps_high)`` every gated token already lies outside PPO's interval, so SAT
changes no gradient at all (ALGORITHMS.md §4 "When SAT is inert"). That holds for *any* gate of
the form ``|d| > t`` with ``t >= ln(1 + eps_high)``, so merely shrinking the kernel scale cannot
help; the gate threshold has to move inside the interval too. The variant, per side (``ell_hi =
ln(1 + eps_high)``, ``ell_lo = -ln(1 - eps_low)``):

- kernel scale ``a_side = min(q, ell_side)``;
- gate threshold ``t_side = q`` if ``q < ell_side`` (identical to SAT: the paper's regime),
  else ``0``: once the batch reference itself is outside the trust region, every token on that
  side (``d > 0`` for the upper endpoint, ``d < 0`` for the lower) is contracted by
  ``psi(|d| / ell_side)``, which is ~1 for fresh tokens and 1/2 at PPO's edge. For
  ``eps = 0.2`` tokens with roughly ``0.13 < d < 0.18`` are then clipped where PPO would not be.
- gate still requires ``q > 0``; ``q == 0`` is still bit-identical to PPO.

The variant keeps containment and pessimism (``0 < c <= 1``) but NOT the ``gate rate <= 1 -
alpha`` bound (that bound is exactly what makes plain SAT inert on a uniformly stale batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

ANCHORS = ("q", "min_q_eps")


def order_statistic_k(quantile: float, n: int) -> int:
    """``k = ceil(quantile * n)`` computed exactly (decimal reading of ``quantile``), in [1, n]."""
    k = math.ceil(Fraction(repr(float(quantile))) * n)
    return min(max(k, 1), n)


def _validate(eps_low, eps_high, quantile, exponent, anchor):
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if not exponent > 0.0:
        raise ValueError(f"exponent must be > 0, got {exponent}")
    if eps_low < 0.0 or eps_high < 0.0:
        raise ValueError(f"clip radii must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if anchor not in ANCHORS:
        raise ValueError(f"unknown SAT anchor {anchor!r}; valid: {', '.join(ANCHORS)}")
    if anchor == "min_q_eps" and not eps_low < 1.0:
        raise ValueError(
            f"anchor='min_q_eps' needs eps_low < 1 (uses -ln(1 - eps_low)), got {eps_low}"
        )


@dataclass
class SatBounds:
    """Result of the SAT computation. ``lower``/``upper`` are ``None`` when nothing is gated
    because ``q == 0`` (the caller then clips with PPO's Python scalars, bit for bit); ``stats``
    are 0-dim tensors (converted to floats by the caller in one host sync)."""

    lower: torch.Tensor | None
    upper: torch.Tensor | None
    q: float
    stats: dict[str, torch.Tensor]


def _psi(u: torch.Tensor, scale: float, exponent: float) -> torch.Tensor:
    """Hill kernel ``1 / (1 + (u / scale)**p)`` (no grad; in-place on a fresh tensor)."""
    x = u / scale
    x = x.mul_(x) if exponent == 2.0 else x.pow_(exponent)
    return x.add_(1.0).reciprocal_()


def _contract(d, q_t, q, n_active, weight, eps_low, eps_high, exponent, anchor) -> SatBounds:
    """Bounds and stats from ``q``. ``d`` is 0 on inactive entries; ``weight`` (``None`` or the
    number of active tokens each entry stands for) makes the stats token-weighted."""
    abs_d = d.abs()
    if not q > 0.0:  # also catches a NaN q (non-finite d on active tokens): no contraction
        stats = {
            "q": q_t,
            "gate_rate": abs_d.new_zeros((), dtype=torch.float64),
            "eps_low_eff_mean": abs_d.new_tensor(eps_low, dtype=torch.float64),
            "eps_high_eff_mean": abs_d.new_tensor(eps_high, dtype=torch.float64),
            "c_min": abs_d.new_ones((), dtype=torch.float64),
        }
        return SatBounds(None, None, q, stats)
    if anchor == "q":
        a_hi = a_lo = t_hi = t_lo = q
    else:  # "min_q_eps", see the module docstring
        ell_hi, ell_lo = math.log1p(eps_high), -math.log1p(-eps_low)
        a_hi, a_lo = min(q, ell_hi), min(q, ell_lo)
        t_hi = q if q < ell_hi else 0.0
        t_lo = q if q < ell_lo else 0.0
    hi, lo = 1.0 + eps_high, 1.0 - eps_low
    # Inactive entries have d == 0 and every threshold is >= 0, so they are never gated;
    # gating with t == 0 (min_q_eps) needs d != 0, hence strictly > / <.
    g_hi = d > t_hi  # gated, upper side (t >= 0 implies d > 0)
    g_lo = d < -t_lo  # gated, lower side
    psi_hi = _psi(abs_d, a_hi, exponent)
    psi_lo = psi_hi if a_lo == a_hi else _psi(abs_d, a_lo, exponent)
    # Off the gate the bound is the very Python scalar PPO clips with (bit-identical); on it,
    # the clamp keeps the contracted bound inside PPO's even after float rounding.
    upper = torch.where(g_hi, (psi_hi * eps_high).add_(1.0).clamp_(max=hi), hi)
    lower = torch.where(g_lo, (psi_lo * -eps_low).add_(1.0).clamp_(min=lo), lo)

    def wsum(x):
        return (x if weight is None else x * weight).sum(dtype=torch.float64)

    n = float(n_active)
    # c == 1 off the gate, so active-token means only need the gated sums of psi.
    cnt_hi, cnt_lo = wsum(g_hi), wsum(g_lo)
    sum_hi = wsum(torch.where(g_hi, psi_hi, 0.0))
    sum_lo = wsum(torch.where(g_lo, psi_lo, 0.0))
    # psi decreases in |d|: the smallest c on a side belongs to that side's most extreme d.
    d_max, d_min = d.max().double(), d.min().double()
    c_hi_min = torch.where(d_max > t_hi, 1.0 / (1.0 + (d_max / a_hi) ** exponent), 1.0)
    c_lo_min = torch.where(-d_min > t_lo, 1.0 / (1.0 + (-d_min / a_lo) ** exponent), 1.0)
    stats = {
        "q": q_t,
        "gate_rate": (cnt_hi + cnt_lo) / n,
        "eps_low_eff_mean": eps_low * (1.0 - (cnt_lo - sum_lo) / n),
        "eps_high_eff_mean": eps_high * (1.0 - (cnt_hi - sum_hi) / n),
        "c_min": torch.minimum(c_hi_min, c_lo_min),
    }
    return SatBounds(lower, upper, q, stats)


def sat_token_bounds(
    d: torch.Tensor,
    n_active: int,
    *,
    eps_low: float,
    eps_high: float,
    quantile: float = 0.9,
    exponent: float = 2.0,
    anchor: str = "q",
) -> SatBounds:
    """SAT on token-level ``d`` ``[B, T]`` that is already 0 on every inactive slot.

    ``q`` = k-th smallest active ``|d|``: the inactive zeros sort below or tie with every
    active value, so it is the ``(k + n_inactive)``-th smallest of the whole tensor.
    """
    _validate(eps_low, eps_high, quantile, exponent, anchor)
    d = d.detach()
    if n_active == 0:
        q_t = d.new_zeros(())
    else:
        k = order_statistic_k(quantile, n_active) + (d.numel() - n_active)
        q_t = d.abs().reshape(-1).kthvalue(k).values
    return _contract(d, q_t, float(q_t), n_active, None, eps_low, eps_high, exponent, anchor)


def sat_sequence_bounds(
    d_seq: torch.Tensor,
    lens: torch.Tensor,
    n_active: int,
    *,
    eps_low: float,
    eps_high: float,
    quantile: float = 0.9,
    exponent: float = 2.0,
    anchor: str = "q",
) -> SatBounds:
    """SAT-GSPO: ``d_seq`` ``[B, 1]`` sequence log-ratios (0 for empty rows), ``lens`` ``[B, 1]``
    active tokens per row. ``q`` is the same token-level order statistic as for the broadcast
    ``d`` (each ``|d_b|`` counted ``lens_b`` times), found by sorting the ``B`` values; bounds
    come back as ``[B, 1]``: one ``c`` per response."""
    _validate(eps_low, eps_high, quantile, exponent, anchor)
    d_seq = d_seq.detach()
    if n_active == 0:
        q_t = d_seq.new_zeros(())
    else:
        k = order_statistic_k(quantile, n_active)
        vals, order = torch.sort(d_seq.abs().reshape(-1))
        cum = torch.cumsum(lens.reshape(-1)[order], 0)  # [B], active tokens at or below vals
        q_t = vals[torch.searchsorted(cum, cum.new_tensor([k]))[0]]
    return _contract(d_seq, q_t, float(q_t), n_active, lens, eps_low, eps_high, exponent, anchor)


def sat_clip_bounds(
    d: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    quantile: float = 0.9,
    exponent: float = 2.0,
    anchor: str = "q",
):
    """Per-token SAT clip bounds.

    Args:
        d: staleness proxy ``[B, T]`` (detached here; token or broadcast sequence log-ratio).
        mask: ``[B, T]``, nonzero on active tokens.
        eps_low, eps_high: PPO clip radii.
        quantile: order-statistic level ``alpha`` for ``q``.
        exponent: Hill exponent ``p``.
        anchor: ``"q"`` (the paper) or ``"min_q_eps"`` (beyond the paper, module docstring).

    Returns:
        ``(lower, upper, stats)``: bounds ``[B, T]`` (no grad) and Python floats ``q``,
        ``gate_rate``, ``eps_low_eff_mean``, ``eps_high_eff_mean``, ``c_min`` (means and min
        over active tokens; fractions of active tokens).
    """
    mask = mask.bool()
    res = sat_token_bounds(
        torch.where(mask, d.detach(), 0.0),
        int(mask.sum()),
        eps_low=eps_low,
        eps_high=eps_high,
        quantile=quantile,
        exponent=exponent,
        anchor=anchor,
    )
    lower, upper = res.lower, res.upper
    if lower is None:
        lower = torch.full_like(d, 1.0 - eps_low, requires_grad=False)
        upper = torch.full_like(d, 1.0 + eps_high, requires_grad=False)
    keys = list(res.stats)
    values = torch.stack([res.stats[k].to(torch.float64) for k in keys]).tolist()
    return lower, upper, dict(zip(keys, values, strict=True))
