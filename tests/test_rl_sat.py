"""SAT clip bounds (sat_cli.rl.sat) and staleness statistics: hand cases and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss
from sat_cli.rl.sat import kth_smallest_abs, order_statistic_k, sat_clip_bounds
from sat_cli.rl.staleness import active_abs_logratio, logratio_stats

F64 = torch.float64


def test_hand_case_gate_on():
    # active d = [0.05, -0.30, 0.40, 0.10]; the 5th slot is padding (NaN must be ignored).
    d = torch.tensor([[0.05, -0.30, 0.40, 0.10, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    lower, upper, st = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2, quantile=0.5)
    # N = 4, k = ceil(0.5 * 4) = 2; sorted |d| = [0.05, 0.10, 0.30, 0.40] -> q = 0.10.
    assert st[M.SAT_Q] == pytest.approx(0.10, abs=1e-15)
    # Gate |d| > 0.10: tokens 1 (d = -0.30) and 2 (d = 0.40); token 3 (|d| == q) is NOT gated.
    # token 1: psi = 1 / (1 + (0.30 / 0.10)^2) = 1/10 -> lower = 1 - 0.2 * 0.1 = 0.98
    # token 2: psi = 1 / (1 + (0.40 / 0.10)^2) = 1/17 -> upper = 1 + 0.2 / 17
    exp_lower = torch.tensor([[0.8, 0.98, 0.8, 0.8, 0.8]], dtype=F64)
    exp_upper = torch.tensor([[1.2, 1.2, 1 + 0.2 / 17, 1.2, 1.2]], dtype=F64)
    torch.testing.assert_close(lower, exp_lower, rtol=0, atol=1e-15)
    torch.testing.assert_close(upper, exp_upper, rtol=0, atol=1e-15)
    assert st[M.SAT_GATE_RATE] == 0.5  # 2 of 4 active tokens
    # eps_low * mean c_minus = 0.2 * (1 + 0.1 + 1 + 1) / 4 = 0.155
    assert st[M.SAT_EPS_LOW_EFF] == pytest.approx(0.155, abs=1e-12)
    # eps_high * mean c_plus = 0.2 * (3 + 1/17) / 4
    assert st[M.SAT_EPS_HIGH_EFF] == pytest.approx(0.2 * (3 + 1 / 17) / 4, abs=1e-12)
    assert st[M.SAT_C_MIN] == pytest.approx(1 / 17, abs=1e-12)


def test_hand_case_exponent_one_and_sign_selection():
    # d = [0.2, -0.2, 0.05], quantile 1/3 -> k = ceil(1) = 1 -> q = 0.05; p = 1.
    d = torch.tensor([[0.2, -0.2, 0.05]], dtype=F64)
    mask = torch.ones(1, 3)
    lower, upper, st = sat_clip_bounds(
        d, mask, eps_low=0.1, eps_high=0.3, quantile=1 / 3, exponent=1.0
    )
    # psi(0.2) = 1 / (1 + 0.2 / 0.05) = 1/5. Token 0 (d > 0): only the upper end moves:
    # upper = 1 + 0.3 / 5 = 1.06, lower stays 0.9. Token 1 (d < 0): lower = 1 - 0.1 / 5 = 0.98.
    torch.testing.assert_close(upper, torch.tensor([[1.06, 1.3, 1.3]], dtype=F64))
    torch.testing.assert_close(lower, torch.tensor([[0.9, 0.98, 0.9]], dtype=F64))
    assert st[M.SAT_GATE_RATE] == pytest.approx(2 / 3)


def test_gate_off_when_q_is_zero_bit_identical_bounds():
    # 3 of 4 active tokens have d = 0 -> q (k = ceil(0.75 * 4) = 3) = 0 -> no gate at all.
    d = torch.tensor([[0.0, 0.0, 0.0, 0.7]])
    lower, upper, st = sat_clip_bounds(
        d, torch.ones(1, 4), eps_low=0.2, eps_high=0.28, quantile=0.75
    )
    assert st[M.SAT_Q] == 0.0 and st[M.SAT_GATE_RATE] == 0.0 and st[M.SAT_C_MIN] == 1.0
    assert torch.equal(lower, torch.full_like(d, 1.0 - 0.2))
    assert torch.equal(upper, torch.full_like(d, 1.0 + 0.28))


def test_empty_mask():
    d = torch.tensor([[float("nan"), 3.0]])
    lower, upper, st = sat_clip_bounds(d, torch.zeros(1, 2), eps_low=0.2, eps_high=0.2)
    assert st == {
        M.SAT_Q: 0.0,
        M.SAT_GATE_RATE: 0.0,
        M.SAT_EPS_LOW_EFF: 0.2,
        M.SAT_EPS_HIGH_EFF: 0.2,
        M.SAT_C_MIN: 1.0,
    }
    assert torch.equal(upper, torch.full_like(d, 1.2))


def test_q_is_lower_order_statistic_not_interpolated():
    # |d| = [1, 2, 3, 4], alpha = 0.9: k = ceil(3.6) = 4 -> q = 4 (torch.quantile would give
    # the interpolated 1 + 0.9 * 3 = 3.7).
    d = torch.tensor([[-3.0, 1.0, 4.0, -2.0]])
    _, _, st = sat_clip_bounds(d, torch.ones(1, 4), eps_low=0.2, eps_high=0.2, quantile=0.9)
    assert st[M.SAT_Q] == 4.0
    assert float(torch.quantile(d.abs(), 0.9)) == pytest.approx(3.7)
    assert st[M.SAT_GATE_RATE] == 0.0  # strict gate: nothing exceeds the maximum


def test_k_is_exact_despite_float_noise():
    # 0.55 * 100 == 55.00000000000001 in binary floating point; naive ceil gives 56.
    assert math.ceil(0.55 * 100) == 56
    assert order_statistic_k(0.55, 100) == 55
    assert order_statistic_k(0.9, 10) == 9
    assert order_statistic_k(0.9, 1) == 1
    assert order_statistic_k(1.0, 7) == 7
    d = torch.arange(1, 101, dtype=F64).reshape(4, 25) / 100  # |d| = 0.01 .. 1.00
    _, _, st = sat_clip_bounds(d, torch.ones(4, 25), eps_low=0.2, eps_high=0.2, quantile=0.55)
    assert st[M.SAT_Q] == pytest.approx(0.55, abs=1e-15)  # 55th smallest, not 56th
    assert st[M.SAT_GATE_RATE] == pytest.approx(0.45)


def test_padding_ignored_by_q():
    # padding holds huge values; q must come from active tokens only.
    d = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, upper, st = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2, quantile=0.5)
    # active |d| = [0.1, 0.2, 0.3], k = ceil(1.5) = 2 -> q = 0.2; gated: 0.3 only.
    assert st[M.SAT_Q] == pytest.approx(0.2)
    assert st[M.SAT_GATE_RATE] == pytest.approx(1 / 3)
    assert float(upper[1, 0]) == pytest.approx(1 + 0.2 / (1 + 1.5**2))
    assert float(upper[0, 2]) == pytest.approx(1.2)  # padding keeps PPO's bound


def test_bounds_carry_no_gradient():
    d = torch.tensor([[0.05, -0.3, 0.4, 0.1]], requires_grad=True)
    lower, upper, _ = sat_clip_bounds(d, torch.ones(1, 4), eps_low=0.2, eps_high=0.2, quantile=0.5)
    assert not lower.requires_grad and not upper.requires_grad


def test_min_q_eps_equals_sat_when_q_below_ln1p_eps():
    torch.manual_seed(0)
    d = 0.03 * torch.randn(6, 9, dtype=F64)
    mask = torch.rand(6, 9) > 0.2
    a = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2)
    b = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2, anchor="min_q_eps")
    assert a[2][M.SAT_Q] < math.log1p(0.2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_min_q_eps_hand_case_whole_batch_stale():
    # d = [0.15, 0.5, 0.6, -0.7]; alpha = 0.5 -> k = 2 -> q = 0.5 >= ln(1.2) = 0.18232.
    d = torch.tensor([[0.15, 0.5, 0.6, -0.7]], dtype=F64)
    mask = torch.ones(1, 4)
    lo_q, up_q, st_q = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2, quantile=0.5)
    # plain SAT: gated 0.6 and -0.7 only; both already outside PPO's interval
    # (e^0.6 = 1.82 > 1.2, e^-0.7 = 0.50 < 0.8), so no gradient can change.
    assert st_q[M.SAT_GATE_RATE] == 0.5
    lo, up, st = sat_clip_bounds(
        d, mask, eps_low=0.2, eps_high=0.2, quantile=0.5, anchor="min_q_eps"
    )
    ell_hi, ell_lo = math.log(1.2), -math.log(0.8)
    # Every token is gated on its own side; scale a = ln(1.2) upper, -ln(0.8) lower.
    # token 0: psi = 1 / (1 + (0.15 / 0.18232)^2) = 0.59635 -> upper = 1.11927 < e^0.15 = 1.1618
    psi0 = 1 / (1 + (0.15 / ell_hi) ** 2)
    assert float(up[0, 0]) == pytest.approx(1 + 0.2 * psi0, abs=1e-12)
    assert float(up[0, 0]) < math.exp(0.15) < 1.2  # newly clipped: SAT now bites
    assert float(lo[0, 3]) == pytest.approx(1 - 0.2 / (1 + (0.7 / ell_lo) ** 2), abs=1e-12)
    assert float(lo[0, 0]) == 0.8 and float(up[0, 3]) == 1.2  # sign selection
    assert st[M.SAT_GATE_RATE] == 1.0 and st[M.SAT_Q] == st_q[M.SAT_Q]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(quantile=0.0),
        dict(quantile=1.5),
        dict(exponent=0.0),
        dict(anchor="median"),
        dict(eps_low=-0.1),
        dict(eps_low=1.0, anchor="min_q_eps"),
    ],
)
def test_invalid_arguments(kwargs):
    args = dict(eps_low=0.2, eps_high=0.2) | kwargs
    with pytest.raises(ValueError):
        sat_clip_bounds(torch.ones(1, 3), torch.ones(1, 3), **args)


def test_logratio_stats_hand_case():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, float("nan"), 0.0]])
    denom = torch.tensor([[-1.1, -1.8, -3.0, 5.0], [-0.1, -0.9, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # active |d| = [0.1, 0.2, 0.0, 0.4, 0.4] -> mean 1.1 / 5 = 0.22
    # sorted [0, .1, .2, .4, .4]: p50 k = ceil(2.5) = 3 -> 0.2; p90 k = ceil(4.5) = 5 -> 0.4
    st = logratio_stats(logp, denom, mask)
    assert st["staleness/abs_logratio_mean"] == pytest.approx(0.22, abs=1e-6)
    assert st["staleness/abs_logratio_p50"] == pytest.approx(0.2, abs=1e-6)
    assert st["staleness/abs_logratio_p90"] == pytest.approx(0.4, abs=1e-6)
    assert st["staleness/abs_logratio_p99"] == pytest.approx(0.4, abs=1e-6)
    torch.testing.assert_close(
        active_abs_logratio(logp, denom, mask), torch.tensor([0.1, 0.2, 0.0, 0.4, 0.4])
    )
    empty = logratio_stats(logp, denom, torch.zeros(2, 4))
    assert set(empty.values()) == {0.0}


def test_logratio_p90_matches_sat_q():
    torch.manual_seed(1)
    logp, denom = torch.randn(8, 16), torch.randn(8, 16)
    mask = torch.rand(8, 16) > 0.3
    _, _, st = sat_clip_bounds(logp - denom, mask, eps_low=0.2, eps_high=0.2, quantile=0.9)
    assert logratio_stats(logp, denom, mask)["staleness/abs_logratio_p90"] == st[M.SAT_Q]


@pytest.mark.parametrize("layout", ["random", "zeros", "ties", "adversarial"])
def test_kth_smallest_is_exact_on_large_inputs(layout):
    # n >= 2^16 takes the subsample-then-select path; "adversarial" puts every large value on
    # the subsample's stride so its threshold is too high and the full kthvalue fallback runs.
    g = torch.Generator().manual_seed(0)
    n = 80_000
    x = torch.randn(n, generator=g).abs()
    if layout == "zeros":
        x[: n // 2] = 0.0
    elif layout == "ties":
        x = torch.round(x * 4) / 4
    elif layout == "adversarial":
        x = torch.rand(n, generator=g) * 0.01
        x[::16] += 10.0
    for quantile in (0.5, 0.9, 0.99):
        k = order_statistic_k(quantile, n)
        signed = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
        value, idx, d_c = kth_smallest_abs(signed, k)
        assert float(value) == float(torch.sort(x).values[k - 1])
        if idx is not None:  # every element above the result is a candidate
            assert set((x > value).nonzero().view(-1).tolist()) <= set(idx.tolist())
            assert torch.equal(d_c, signed[idx])
    if layout == "adversarial":
        assert kth_smallest_abs(x, order_statistic_k(0.9, n))[1] is None


def test_large_batch_bounds_and_metrics_against_dense_computation():
    # 320 x 256 tokens (> 2^16): the sparse path (subsample selection, gathered kernel) must
    # give exactly the dense formulas of ALGORITHMS.md §4.
    g = torch.Generator().manual_seed(1)
    B, T = 320, 256
    d = 0.05 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B, 1), generator=g)
    lower, upper, st = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.28)
    a = d[mask].abs()
    k = order_statistic_k(0.9, a.numel())
    q = float(torch.sort(a).values[k - 1])
    gate = mask & (d.abs() > q)
    psi = 1 / (1 + (d.abs() / q) ** 2)
    exp_upper = torch.where(gate & (d > 0), 1 + 0.28 * psi, torch.tensor(1.28, dtype=F64))
    exp_lower = torch.where(gate & (d < 0), 1 - 0.2 * psi, torch.tensor(0.8, dtype=F64))
    assert st[M.SAT_Q] == q and st[M.SAT_GATE_RATE] == pytest.approx(float(gate.sum()) / a.numel())
    torch.testing.assert_close(upper, exp_upper, rtol=0, atol=1e-15)
    torch.testing.assert_close(lower, exp_lower, rtol=0, atol=1e-15)
    assert st[M.SAT_C_MIN] == pytest.approx(float(psi[gate].min()))
    c_hi = torch.where(gate & (d > 0), psi, torch.ones_like(psi))[mask]
    assert st[M.SAT_EPS_HIGH_EFF] == pytest.approx(0.28 * float(c_hi.mean()), rel=1e-12)
    # policy_loss metrics: PPO clip fraction and the SAT-only band, densely
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T)
    logp = d.clone().requires_grad_()
    _, m = policy_loss(
        logp,
        torch.zeros_like(d),
        adv[:, 0],
        mask,
        LossConfig(eps_low=0.2, eps_high=0.28, adaptive=True),
    )
    r = torch.exp(d)
    ppo = mask & (((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)))
    sat = mask & (((adv > 0) & (r > exp_upper)) | ((adv < 0) & (r < exp_lower)))
    n = a.numel()
    assert m["loss/clipfrac"] == pytest.approx(float(ppo.sum()) / n)
    assert m["sat/clipfrac_sat_band"] == pytest.approx(float((sat & ~ppo).sum()) / n)
    assert m["sat/clipfrac_sat_band"] > 0


def test_non_contiguous_inputs():
    # a transposed view: bounds come back contiguous and equal to those of a contiguous copy
    g = torch.Generator().manual_seed(3)
    d = (0.1 * torch.randn(12, 9, generator=g, dtype=F64)).t()
    mask = (torch.rand(12, 9, generator=g) > 0.2).t()
    assert not d.is_contiguous()
    a = sat_clip_bounds(d, mask, eps_low=0.2, eps_high=0.2, quantile=0.7)
    b = sat_clip_bounds(d.contiguous(), mask.contiguous(), eps_low=0.2, eps_high=0.2, quantile=0.7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert a[2][M.SAT_GATE_RATE] > 0
    logp = d.clone().t().contiguous().t().requires_grad_()  # non-contiguous leaf
    la, _ = policy_loss(
        logp, torch.zeros_like(d), torch.ones(9, dtype=F64), mask, LossConfig(adaptive=True)
    )
    lb, _ = policy_loss(
        d.contiguous(),
        torch.zeros(9, 12, dtype=F64),
        torch.ones(9, dtype=F64),
        mask.contiguous(),
        LossConfig(adaptive=True),
    )
    assert torch.equal(la.detach(), lb)
