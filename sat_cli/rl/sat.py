"""SAT: the staleness-adaptive trust region (ALGORITHMS.md §4), as a pure tensor function.

``sat_clip_bounds(d, mask, eps_low=..., eps_high=...)`` turns a detached staleness proxy
``d[b, t]`` (the token log-ratio, or the sequence log-ratio broadcast to the tokens for SAT-GSPO)
into per-token clip bounds ``lower, upper`` that replace PPO's ``1 - eps_low, 1 + eps_high``:

1. ``q`` is the lower order statistic at level ``alpha = quantile`` of ``|d|`` over the active
   tokens: the ``k``-th smallest (``torch.kthvalue`` semantics) with ``k = ceil(alpha * N)``. ``alpha * N`` is computed
   exactly, reading ``alpha`` as the decimal it was written as (``Fraction("0.9") * 10 == 9``),
   so float noise (``0.9 * 10 == 9.000000000000002`` in binary) can never move ``k`` by one. No
   interpolation: ``q`` is always one of the ``|d|`` values.
2. Gate ``g = (q > 0) & (|d| > q)`` (strict), so at most ``1 - alpha`` of the tokens are gated.
3. Hill kernel ``psi(u) = 1 / (1 + (u / q)**p)``; ``psi(q) = 1/2``.
4. Sign-selected contraction: a gated token with ``d > 0`` gets ``upper = 1 + eps_high * psi``,
   one with ``d < 0`` gets ``lower = 1 - eps_low * psi``; the other endpoint and every ungated
   token keep PPO's value exactly (the same Python scalar PPO clips with, so ungated tokens and
   ``q == 0`` are bit-identical to PPO).

Cost: the kernel runs on the gated entries only (gathered by index); ``q`` comes from
``kth_smallest_abs``, an exact selection that first narrows the candidates with a strided
subsample. SAT-GSPO (``sat_sequence_bounds``) works on the ``B`` sequence values.

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

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.names import ANCHORS


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
    """Result of the SAT computation, sparse: only gated entries carry a contracted bound.

    ``index`` holds flat indices into ``d`` of the gated entries, ``bound`` their contracted
    bound and ``upper_side`` which endpoint it replaces (True: upper, ``d > 0``; False: lower).
    All three are ``None`` when nothing can be gated because ``q == 0``. ``stats`` are 0-dim
    tensors keyed by their metric names (``metric_names.SAT_Q``, ...), converted to floats by
    the caller in one host sync."""

    q: float
    stats: dict[str, torch.Tensor]
    index: torch.Tensor | None = None
    bound: torch.Tensor | None = None
    upper_side: torch.Tensor | None = None
    block_qs: list[tuple[float, int]] | None = None  # per-block (q, n_active) when merged

    def dense(self, like: torch.Tensor, eps_low: float, eps_high: float):
        """Full ``(lower, upper)`` tensors shaped like ``like``; PPO's values off the gate."""
        kw = dict(dtype=like.dtype, device=like.device)
        lower = torch.full(like.shape, 1.0 - eps_low, **kw)  # contiguous: flat indices apply
        upper = torch.full(like.shape, 1.0 + eps_high, **kw)
        if self.index is not None:
            side = self.upper_side
            upper.view(-1)[self.index[side]] = self.bound[side]
            lower.view(-1)[self.index[~side]] = self.bound[~side]
        return lower, upper


def kth_smallest_abs(d: torch.Tensor, k: int, abs_d: torch.Tensor | None = None):
    """Exact ``k``-th smallest (1-based) of ``|d|`` for a 1-D ``d`` (``abs_d``: its ``|d|``).

    Returns ``(value, idx, d[idx])``; ``idx`` is ``None`` or the indices of every element with
    ``|d| >= t`` for some ``t <= value`` (so it contains every element above the result). For
    large inputs whose top ``m = n - k + 1`` is small, a strided subsample gives a threshold
    ``t`` with a few percent more than ``m`` elements above it, and the selection runs on those
    only. If the subsample misjudged (fewer than ``m`` elements ``>= t``), it falls back to a
    full ``kthvalue``; the result is the same order statistic either way.
    """
    x = d.abs() if abs_d is None else abs_d
    n = x.numel()
    m = n - k + 1
    stride = 16
    if n >= 1 << 16 and m <= n // 4:
        sub = x[::stride]
        # ~m / stride sample points lie above q; 4 standard deviations of margin more.
        m_sub = min(sub.numel(), math.ceil(m / stride + 4 * math.sqrt(m / stride) + 8))
        t = sub.kthvalue(sub.numel() - m_sub + 1).values
        idx = (x >= t).nonzero().view(-1)
        if idx.numel() >= m:
            # at least m elements are >= t, so the m-th largest is >= t and lies in idx
            d_c = d[idx]
            cand = d_c.abs()
            j = idx.numel() - m + 1  # the result is the j-th smallest candidate; j is small
            if j <= cand.numel() // 4:
                return cand.topk(j, largest=False, sorted=False).values.max(), idx, d_c
            return cand.kthvalue(j).values, idx, d_c
    return x.kthvalue(k).values, None, None


def _noop(q_t, q, eps_low, eps_high) -> SatBounds:
    f64 = dict(dtype=torch.float64, device=q_t.device)
    stats = {
        M.SAT_Q: q_t,
        M.SAT_GATE_RATE: torch.zeros((), **f64),
        M.SAT_EPS_LOW_EFF: torch.tensor(eps_low, **f64),
        M.SAT_EPS_HIGH_EFF: torch.tensor(eps_high, **f64),
        M.SAT_C_MIN: torch.ones((), **f64),
    }
    return SatBounds(q, stats)


def _psi(u: torch.Tensor, scale: float, exponent: float) -> torch.Tensor:
    """Hill kernel ``1 / (1 + (u / scale)**p)`` (no grad)."""
    x = u / scale
    x = x.mul_(x) if exponent == 2.0 else x.pow_(exponent)
    return x.add_(1.0).reciprocal_()


def _contract(d, q_t, n_active, weight, cand, cfg: LossConfig):
    """Bounds and stats from ``q`` (``cfg``: ``eps_low``, ``eps_high``, ``exponent``, ``anchor``), computed on the gated entries only (at most ``1 - alpha``
    of the tokens for the paper's anchor). ``d`` is 0 on inactive entries; ``weight`` (``None``
    or the number of active tokens each entry stands for) makes the stats token-weighted;
    ``cand`` (``None`` or ``(idx, d[idx])`` for all entries with ``|d| >= t``, some ``t <= q``)
    saves a pass over ``d``."""
    eps_low, eps_high, exponent, anchor = cfg.eps_low, cfg.eps_high, cfg.exponent, cfg.anchor
    q = float(q_t)
    if not q > 0.0:  # also catches a NaN q (non-finite d on active tokens): no contraction
        return _noop(q_t, q, eps_low, eps_high)
    if anchor == "q":
        a_hi = a_lo = t_hi = t_lo = q
    else:  # "min_q_eps", see the module docstring
        ell_hi, ell_lo = math.log1p(eps_high), -math.log1p(-eps_low)
        a_hi, a_lo = min(q, ell_hi), min(q, ell_lo)
        t_hi = q if q < ell_hi else 0.0
        t_lo = q if q < ell_lo else 0.0
    hi, lo = 1.0 + eps_high, 1.0 - eps_low
    flat = d.reshape(-1)
    t_min = min(t_hi, t_lo)
    # Inactive entries have d == 0 and every threshold is >= 0: never gated (strict >).
    if cand is not None and t_min >= q:  # every gated entry is a candidate
        idx_c, d_c = cand
        keep = (d_c.abs() > t_min).nonzero().view(-1)
        idx, d_g = idx_c[keep], d_c[keep]  # [G]
    else:
        idx = (flat.abs() > t_min).nonzero().view(-1)
        d_g = flat[idx]  # [G]
    side = d_g > 0  # [G] True: the upper endpoint moves (d > 0); False: the lower one
    if t_hi != t_lo:  # min_q_eps with one side past its ell: gate each side on its own
        keep = torch.where(side, d_g > t_hi, d_g < -t_lo).nonzero().view(-1)
        idx, d_g, side = idx[keep], d_g[keep], side[keep]
    u = d_g.abs()
    psi = _psi(u, a_hi, exponent)  # [G]
    if a_lo != a_hi:
        psi = torch.where(side, psi, _psi(u, a_lo, exponent))
    # Off the gate the bound stays the very Python scalar PPO clips with (bit-identical); on
    # it, the clamp keeps the contracted bound inside PPO's even after float rounding.
    bound = torch.where(
        side,
        (psi * eps_high).add_(1.0).clamp_(max=hi),
        (psi * -eps_low).add_(1.0).clamp_(min=lo),
    )

    f64 = torch.float64
    w = psi.new_ones(psi.shape, dtype=f64) if weight is None else weight.reshape(-1)[idx].to(f64)
    w_hi, w_lo = w * side, w * ~side  # [G]
    psi64 = psi.to(f64)
    n = float(n_active)
    # c == 1 off the gate, so active-token means only need the gated sums of psi.
    stats = {
        M.SAT_Q: q_t,
        M.SAT_GATE_RATE: w.sum() / n,
        M.SAT_EPS_LOW_EFF: eps_low * (1.0 - (w_lo.sum() - (w_lo * psi64).sum()) / n),
        M.SAT_EPS_HIGH_EFF: eps_high * (1.0 - (w_hi.sum() - (w_hi * psi64).sum()) / n),
        M.SAT_C_MIN: torch.cat([psi64.new_ones(1), psi64]).min(),
    }
    return SatBounds(q, stats, idx, bound, side)


def merge_bounds(parts: list[tuple[SatBounds, int]]) -> SatBounds:
    """One ``SatBounds`` from several computed on disjoint parts (the per-micro-batch scope).

    ``parts``: ``(bounds, n_active)`` with each ``bounds.index`` already offset into the whole
    tensor. ``q`` and the means are weighted by active tokens (so one part is returned as is);
    ``c_min`` is the minimum. The merged ``q`` is that token-weighted mean: a summary, the
    contraction used each part's own ``q``.
    """
    if len(parts) == 1:
        return parts[0][0]
    n = float(max(sum(n_c for _, n_c in parts), 1))
    f64 = torch.float64
    stats = {}
    for key in (M.SAT_Q, M.SAT_GATE_RATE, M.SAT_EPS_LOW_EFF, M.SAT_EPS_HIGH_EFF):
        stats[key] = sum(b.stats[key].to(f64) * (n_c / n) for b, n_c in parts)
    stats[M.SAT_C_MIN] = torch.stack([b.stats[M.SAT_C_MIN].to(f64) for b, _ in parts]).min()
    on = [b for b, _ in parts if b.index is not None]
    q = float(stats[M.SAT_Q])
    if not on:
        return SatBounds(q, stats)
    return SatBounds(
        q,
        stats,
        torch.cat([b.index for b in on]),
        torch.cat([b.bound for b in on]),
        torch.cat([b.upper_side for b in on]),
    )


def sat_token_bounds(
    d: torch.Tensor, n_active: int, cfg: LossConfig, abs_d: torch.Tensor | None = None
) -> SatBounds:
    """SAT on token-level ``d`` ``[B, T]`` that is already 0 on every inactive slot
    (``abs_d = d.abs()`` may be passed in when the caller has it); ``cfg``'s ``eps_low``,
    ``eps_high``, ``quantile``, ``exponent`` and ``anchor``.

    ``q`` = k-th smallest active ``|d|``: the inactive zeros sort below or tie with every
    active value, so it is the ``(k + n_inactive)``-th smallest of the whole tensor.
    """
    _validate(cfg.eps_low, cfg.eps_high, cfg.quantile, cfg.exponent, cfg.anchor)
    d = d.detach()
    cand = None
    if n_active == 0:
        q_t = d.new_zeros(())
    else:
        k = order_statistic_k(cfg.quantile, n_active) + (d.numel() - n_active)
        abs_flat = None if abs_d is None else abs_d.detach().reshape(-1)
        q_t, idx_c, d_c = kth_smallest_abs(d.reshape(-1), k, abs_flat)
        cand = None if idx_c is None else (idx_c, d_c)
    return _contract(d, q_t, n_active, None, cand, cfg)


def sat_sequence_bounds(
    d_seq: torch.Tensor, lens: torch.Tensor, n_active: int, cfg: LossConfig
) -> SatBounds:
    """SAT-GSPO: ``d_seq`` ``[B, 1]`` sequence log-ratios (0 for empty rows), ``lens`` ``[B, 1]``
    active tokens per row. ``q`` is the same token-level order statistic as for the broadcast
    ``d`` (each ``|d_b|`` counted ``lens_b`` times), found by sorting the ``B`` values; bounds
    come back (via ``SatBounds.dense``) as ``[B, 1]``: one ``c`` per response; ``index``
    holds row numbers."""
    _validate(cfg.eps_low, cfg.eps_high, cfg.quantile, cfg.exponent, cfg.anchor)
    d_seq = d_seq.detach()
    if n_active == 0:
        q_t = d_seq.new_zeros(())
    else:
        k = order_statistic_k(cfg.quantile, n_active)
        vals, order = torch.sort(d_seq.abs().reshape(-1))
        cum = torch.cumsum(lens.reshape(-1)[order], 0)  # [B], active tokens at or below vals
        q_t = vals[torch.searchsorted(cum, cum.new_tensor([k]))[0]]
    return _contract(d_seq, q_t, n_active, lens, None, cfg)


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
        ``(lower, upper, stats)``: bounds ``[B, T]`` (no grad) and Python floats keyed
        ``M.SAT_Q``, ``M.SAT_GATE_RATE``, ``M.SAT_EPS_LOW_EFF``, ``M.SAT_EPS_HIGH_EFF``,
        ``M.SAT_C_MIN`` (means and min
        over active tokens; fractions of active tokens).
    """
    mask = mask.bool()
    cfg = LossConfig(
        eps_low=eps_low, eps_high=eps_high, quantile=quantile, exponent=exponent, anchor=anchor
    )
    res = sat_token_bounds(torch.where(mask, d.detach(), 0.0), int(mask.sum()), cfg)
    lower, upper = res.dense(d.detach(), eps_low, eps_high)
    keys = list(res.stats)
    values = torch.stack([res.stats[k].to(torch.float64) for k in keys]).tolist()
    return lower, upper, dict(zip(keys, values, strict=True))
