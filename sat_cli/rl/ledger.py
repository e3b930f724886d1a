"""The three-log-prob ledger: where the gap between trainer and engine comes from (§1, §5).

Per active token, three log-probs of the sampled token: ``log mu`` (the engine's, as sampled:
``rollout_logp``), ``log pi_old`` (the trainer's own forward under the weights of the version
that generated the token; ``sat_cli.trainers.ledger`` computes it) and ``log pi`` (the current
policy, the loss's ``logp``). The realised divergence splits exactly:

    delta = log pi - log mu = m + s,   m = log pi_old - log mu   (engine mismatch),
                                       s = log pi - log pi_old   (staleness)

``d̄pi = mean |delta|`` over the tokens splits into two parts that sum to it exactly,

    mean |delta| = mean(sign(delta) * m) + mean(sign(delta) * s),

since ``|delta| = sign(delta) * (m + s)``. Each part is that source's component along the
realised divergence of the token: a part is negative when that source pulls the token back
toward ``mu`` (e.g. the trainer moved back across the engine's value). The magnitudes
``mean |m|`` and ``mean |s|`` are logged beside them (``mean|m| + mean|s| >= mean|delta|``).

Computed in float64 (the inputs are float32, so ``m + s`` reproduces ``delta`` to about 1e-16);
pure tensor math, no gradient.
"""

from __future__ import annotations

import torch

from sat_cli import metric_names as M

F64 = torch.float64


@torch.no_grad()
def decompose(
    logp: torch.Tensor, gen_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``(metrics, diag)`` of the ledger over the tokens where ``mask`` is nonzero.

    Args:
        logp: ``[B, T]`` log pi (current; read, not differentiated).
        gen_logp: ``[B, T]`` log pi_old under the generating version's weights.
        rollout_logp: ``[B, T]`` log mu.
        mask: ``[B, T]``: the tokens to count (active and with a held version).

    Returns:
        ``metrics``: ``staleness/ledger_abs_logratio_mean`` (``mean |delta|``), ``..._mismatch_part``,
        ``..._staleness_part`` (they sum to it), ``..._mismatch_abs_mean``,
        ``..._staleness_abs_mean``; all 0 without tokens. ``diag``: ``ledger_m`` and
        ``ledger_s``, ``[N]`` float32 on the CPU, the counted tokens in row-major order.
    """
    m_ = mask.bool()
    lp, g, mu = (t.detach()[m_].to(F64) for t in (logp, gen_logp, rollout_logp))  # [N]
    delta, mis, stale = lp - mu, g - mu, lp - g  # [N]
    sign = torch.sign(delta)  # [N]
    n = max(int(m_.sum()), 1)
    metrics = {
        M.LEDGER_DPI: float(delta.abs().sum()) / n,
        M.LEDGER_MISMATCH_PART: float((sign * mis).sum()) / n,
        M.LEDGER_STALENESS_PART: float((sign * stale).sum()) / n,
        M.LEDGER_MISMATCH_ABS: float(mis.abs().sum()) / n,
        M.LEDGER_STALENESS_ABS: float(stale.abs().sum()) / n,
    }
    diag = {"ledger_m": mis.float().cpu(), "ledger_s": stale.float().cpu()}
    return metrics, diag
