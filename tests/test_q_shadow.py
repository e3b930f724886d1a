"""``sat/q_shadow``: in a run without SAT, the ``q`` SAT would have computed on the same batch
(a pre-treatment quantity: the collapse study's "SAT can act" check reads it from base runs)."""

import math

import pytest
import torch

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    denom = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, denom, adv, mask


def _kth(values: list[float], quantile: float) -> float:
    k = math.ceil(round(quantile * len(values), 9))  # exact for these decimals
    return sorted(values)[k - 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_shadow_is_the_order_statistic_sat_would_use(seed):
    logp, denom, adv, mask = _batch(seed)
    cfg = LossConfig(quantile=0.9)
    _, plain = policy_loss(logp, denom, adv, mask, cfg)
    _, with_sat = policy_loss(logp, denom, adv, mask, cfg.replace(adaptive=True))
    flat = zip(logp.flatten(), denom.flatten(), mask.flatten(), strict=True)
    d = [abs(float(a - b)) for a, b, m in flat if m]
    assert plain[M.SAT_Q_SHADOW] == pytest.approx(_kth(d, 0.9), abs=1e-12)
    assert plain[M.SAT_Q_SHADOW] == with_sat[M.SAT_Q]
    assert M.SAT_Q_SHADOW not in with_sat and M.SAT_Q not in plain
    # the loss itself does not change: the shadow computation is a diagnostic only
    _, again = policy_loss(logp, denom, adv, mask, cfg)
    assert again[M.LOSS_POLICY] == plain[M.LOSS_POLICY]


def test_q_shadow_sequence_level_uses_the_sequence_log_ratios():
    logp, denom, adv, mask = _batch(3)
    _, plain = policy_loss(logp, denom, adv, mask, LossConfig(), level="sequence")
    seq = []
    for b in range(logp.shape[0]):
        ds = [float(logp[b, t] - denom[b, t]) for t in range(logp.shape[1]) if mask[b, t]]
        if ds:
            seq.append(abs(sum(ds) / len(ds)))
    assert plain[M.SAT_Q_SHADOW] == pytest.approx(_kth(seq, 0.9), abs=1e-12)


def test_no_q_shadow_without_a_clip():
    logp, denom, adv, mask = _batch(4)
    _, m = policy_loss(logp, denom, adv, mask, LossConfig(eps_low=math.inf, eps_high=math.inf))
    assert M.SAT_Q_SHADOW not in m
