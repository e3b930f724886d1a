"""Staleness diagnostics on token log-ratios ``d = logp - denom_logp`` (ALGORITHMS.md §4).

``logratio_stats`` returns ``staleness/abs_logratio_mean`` (the paper's ``d̄π``) and the
``_p50``, ``_p90``, ``_p99`` percentiles of ``|d|`` over active tokens as Python floats. The
percentiles are lower order statistics (``kthvalue`` with ``k = ceil(p * N)``), the same
definition SAT uses for its batch reference ``q``, so ``_p90`` equals ``sat/q`` for token-level
SAT at ``quantile=0.9``. ``active_abs_logratio`` returns the 1-D ``|d|`` of active tokens for
histograms. Empty masks give zeros.
"""

from __future__ import annotations

import torch

from sat_cli import metric_names as M
from sat_cli.rl.sat import order_statistic_k

PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


@torch.no_grad()
def active_abs_logratio(
    logp: torch.Tensor, denom_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``|logp - denom_logp|`` of the active tokens, flattened ``[N]`` (row-major order)."""
    mask = mask.bool()
    return (logp.detach()[mask] - denom_logp.detach()[mask]).abs()


@torch.no_grad()
def logratio_stats(logp: torch.Tensor, denom_logp: torch.Tensor, mask: torch.Tensor):
    """Mean and order-statistic percentiles of ``|log r|`` over active tokens (floats)."""
    a = active_abs_logratio(logp, denom_logp, mask)
    n = a.numel()
    out = {M.DPI: float(a.double().mean()) if n else 0.0}
    for name, level in PERCENTILES:
        key = M.ABS_LOGRATIO_PCT.format(name)
        out[key] = float(a.kthvalue(order_statistic_k(level, n)).values) if n else 0.0
    return out
