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
from fractions import Fraction

import torch

ANCHORS = ("q", "min_q_eps")


def order_statistic_k(quantile: float, n: int) -> int:
    """``k = ceil(quantile * n)`` computed exactly (decimal reading of ``quantile``), in [1, n]."""
    k = math.ceil(Fraction(repr(float(quantile))) * n)
    return min(max(k, 1), n)


def batch_reference(abs_d: torch.Tensor, mask: torch.Tensor, n_active: int, quantile: float):
    """``q``: the k-th smallest ``|d|`` over active tokens (0-dim tensor; 0 when none active)."""
    if n_active == 0:
        return abs_d.new_zeros(())
    k = order_statistic_k(quantile, n_active)
    # Inactive slots are pushed below every |d| (which is >= 0) so the k-th smallest active
    # value is the (k + n_inactive)-th smallest overall; avoids a boolean-index copy.
    n_inactive = mask.numel() - n_active
    if n_inactive == 0:
        return abs_d.reshape(-1).kthvalue(k).values
    flat = torch.where(mask, abs_d, -1.0).reshape(-1)
    return flat.kthvalue(k + n_inactive).values


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


def sat_bounds_tensors(
    d: torch.Tensor,
    mask: torch.Tensor,
    n_active: int,
    *,
    eps_low: float,
    eps_high: float,
    quantile: float = 0.9,
    exponent: float = 2.0,
    anchor: str = "q",
):
    """Core of ``sat_clip_bounds`` with statistics left as 0-dim tensors (one host sync fewer).

    ``mask`` must be boolean and ``n_active == mask.sum()``. Returns ``(lower, upper, q, stats)``
    where ``lower``/``upper`` are ``None`` when ``q == 0`` (the caller then uses PPO's scalars);
    ``q`` is a Python float.
    """
    _validate(eps_low, eps_high, quantile, exponent, anchor)
    d = d.detach()
    abs_d = d.abs()  # [B, T]
    q_t = batch_reference(abs_d, mask, n_active, quantile)
    q = float(q_t)
    one = abs_d.new_ones(())
    if not q > 0.0:  # also catches NaN q (non-finite d on active tokens): no contraction
        zero = abs_d.new_zeros(())
        stats = {
            "q": q_t,
            "gate_rate": zero,
            "eps_low_eff_mean": abs_d.new_tensor(eps_low, dtype=torch.float64),
            "eps_high_eff_mean": abs_d.new_tensor(eps_high, dtype=torch.float64),
            "c_min": one,
        }
        return None, None, q, stats

    ell_hi = math.log1p(eps_high)
    ell_lo = -math.log1p(-eps_low) if eps_low < 1.0 else math.inf
    if anchor == "q":
        a_hi = a_lo = q
        t_hi = t_lo = q
    else:  # "min_q_eps": see the module docstring
        a_hi, a_lo = min(q, ell_hi), min(q, ell_lo)
        t_hi = q if q < ell_hi else 0.0
        t_lo = q if q < ell_lo else 0.0

    g_hi = mask & (d > t_hi)  # [B, T] gated, upper side (d > t >= 0 implies d > 0)
    g_lo = mask & (d < -t_lo)  # [B, T] gated, lower side
    if a_hi == a_lo:
        psi = torch.reciprocal(1.0 + (abs_d / a_hi).pow(exponent))  # [B, T]
        psi_hi = psi_lo = psi
    else:
        psi_hi = torch.reciprocal(1.0 + (abs_d / a_hi).pow(exponent))
        psi_lo = torch.reciprocal(1.0 + (abs_d / a_lo).pow(exponent))
    c_hi = torch.where(g_hi, psi_hi, 1.0)  # [B, T]
    c_lo = torch.where(g_lo, psi_lo, 1.0)  # [B, T]
    # Ungated tokens get PPO's bound through the very same Python scalar PPO clamps with.
    upper = torch.where(g_hi, 1.0 + eps_high * psi_hi, 1.0 + eps_high)  # [B, T]
    lower = torch.where(g_lo, 1.0 - eps_low * psi_lo, 1.0 - eps_low)  # [B, T]

    n = float(n_active)
    f64 = torch.float64
    # c == 1 off the gate, so the active-token sums only need the gated deficits (1 - c).
    stats = {
        "q": q_t,
        "gate_rate": (g_hi | g_lo).sum(dtype=f64) / n,
        "eps_low_eff_mean": eps_low * (1.0 - (1.0 - c_lo).sum(dtype=f64) / n),
        "eps_high_eff_mean": eps_high * (1.0 - (1.0 - c_hi).sum(dtype=f64) / n),
        "c_min": torch.minimum(c_hi.min(), c_lo.min()),
    }
    return lower, upper, q, stats


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
    mask_b = mask.bool()
    n_active = int(mask_b.sum())
    lower, upper, _, stats = sat_bounds_tensors(
        d,
        mask_b,
        n_active,
        eps_low=eps_low,
        eps_high=eps_high,
        quantile=quantile,
        exponent=exponent,
        anchor=anchor,
    )
    if lower is None:
        d = d.detach()
        lower = torch.full_like(d, 1.0 - eps_low)
        upper = torch.full_like(d, 1.0 + eps_high)
    keys = list(stats)
    values = torch.stack([stats[k].to(torch.float64) for k in keys]).tolist()
    return lower, upper, dict(zip(keys, values, strict=True))
