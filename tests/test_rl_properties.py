"""Property tests (hypothesis) for what the SAT paper proves (ALGORITHMS.md §4), checked on
random padded batches with heavy-tailed, tied and zero log-ratios, for both SAT anchors."""

from __future__ import annotations

import math
from decimal import Decimal

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import policy_loss_kw

from sat_cli import metric_names as M
from sat_cli.rl.losses import clipped_surrogate
from sat_cli.rl.sat import ANCHORS, sat_clip_bounds

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw):
    """(d, mask, adv, denom) float64 [B, T]; d heavy-tailed, optionally rounded to a grid so
    that ties and exact zeros are common."""
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.01, 0.05, 0.15, 0.5, 2.0]))
    z = torch.randn(3, B, T, generator=g, dtype=F64)
    d = scale * z[0] / torch.sqrt((z[1] ** 2 + z[2] ** 2) / 2)  # Student-t, df 2
    if draw(st.booleans()):
        d = torch.round(d / scale * 2) * scale / 2
    d = d.clamp(-30, 30)
    mask = torch.rand(B, T, generator=g) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    adv = torch.randn(B, T, generator=g, dtype=F64)
    denom = -3 * torch.rand(B, T, generator=g, dtype=F64)
    return d, mask, adv, denom


sat_params = st.fixed_dictionaries(
    {
        "eps_low": st.floats(0.0, 0.9),
        "eps_high": st.floats(0.0, 2.0),
        "quantile": st.floats(0.05, 1.0),
        "exponent": st.floats(0.5, 4.0),
        "anchor": st.sampled_from(ANCHORS),
    }
)


def gate_q(d, mask, q):
    return mask & (q > 0) & (d.abs() > q)


@SETTINGS
@given(batches(), sat_params)
def test_containment(batch, p):
    d, mask, _, _ = batch
    lower, upper, st_ = sat_clip_bounds(d, mask, **p)
    ppo_lo = torch.full_like(d, 1.0 - p["eps_low"])
    ppo_hi = torch.full_like(d, 1.0 + p["eps_high"])
    assert (lower >= ppo_lo).all() and (upper <= ppo_hi).all()
    assert (lower <= 1.0).all() and (upper >= 1.0).all()
    # only the endpoint on the side of sign(d) ever moves
    assert torch.equal(upper[d <= 0], ppo_hi[d <= 0]) and torch.equal(lower[d >= 0], ppo_lo[d >= 0])
    assert torch.equal(upper[~mask], ppo_hi[~mask]) and torch.equal(lower[~mask], ppo_lo[~mask])
    if p["anchor"] == "q":  # identical (bit for bit) wherever the gate is off
        off = ~gate_q(d, mask, st_[M.SAT_Q])
        assert torch.equal(upper[off], ppo_hi[off]) and torch.equal(lower[off], ppo_lo[off])
    assert 0.0 <= st_[M.SAT_C_MIN] <= 1.0


@SETTINGS
@given(batches(), sat_params, st.sampled_from([None, 1.5, 3.0]))
def test_pointwise_pessimism(batch, p, dual):
    d, mask, adv, _ = batch
    lower, upper, _ = sat_clip_bounds(d, mask, **p)
    r = torch.exp(d)
    s_sat = clipped_surrogate(r, adv, lower, upper, dual)
    s_ppo = clipped_surrogate(r, adv, 1.0 - p["eps_low"], 1.0 + p["eps_high"], dual)
    assert (s_sat <= s_ppo).all()
    # and a ratio that has drifted away from exp(d) (several optimizer steps per batch)
    r2 = torch.exp(d + 0.1 * torch.randn_like(d))
    s_sat2 = clipped_surrogate(r2, adv, lower, upper, dual)
    assert (
        s_sat2 <= clipped_surrogate(r2, adv, 1.0 - p["eps_low"], 1.0 + p["eps_high"], dual)
    ).all()


@SETTINGS
@given(batches(), sat_params)
def test_gradient_changes_only_on_newly_clipped_outward_bands(batch, p):
    d, mask, adv, denom = batch
    logp = (denom + d).requires_grad_()
    kw = dict(eps_low=p["eps_low"], eps_high=p["eps_high"], quantile=p["quantile"])
    kw |= dict(exponent=p["exponent"], anchor=p["anchor"])
    (g_sat,) = torch.autograd.grad(
        policy_loss_kw(logp, denom, adv, mask, adaptive=True, **kw)[0], logp
    )
    (g_ppo,) = torch.autograd.grad(policy_loss_kw(logp, denom, adv, mask, **kw)[0], logp)
    d_eff = torch.where(mask, logp.detach() - denom, 0.0)  # what the loss sees
    lower, upper, _ = sat_clip_bounds(d_eff, mask, **p)
    r = torch.exp(d_eff)
    hi, lo = 1.0 + p["eps_high"], 1.0 - p["eps_low"]
    band = mask & (((adv > 0) & (upper < r) & (r <= hi)) | ((adv < 0) & (lo <= r) & (r < lower)))
    assert (g_sat[band] == 0).all() and (g_ppo[band] != 0).all()
    assert torch.equal(g_sat[~band], g_ppo[~band])  # pull-back tokens keep their gradient


@SETTINGS
@given(batches(), sat_params)
def test_gate_rate_bound_and_order_statistic(batch, p):
    d, mask, _, _ = batch
    p = p | {"anchor": "q"}
    _, _, st_ = sat_clip_bounds(d, mask, **p)
    a = d[mask].abs()
    n = a.numel()
    if n == 0:
        assert st_[M.SAT_Q] == 0.0 and st_[M.SAT_GATE_RATE] == 0.0
        return
    k = max(1, min(n, math.ceil(Decimal(repr(p["quantile"])) * n)))
    q = st_[M.SAT_Q]
    assert q in a.tolist()  # an order statistic, never interpolated
    assert int((a <= q).sum()) >= k and int((a < q).sum()) < k
    assert q == float(torch.sort(a).values[k - 1])
    assert st_[M.SAT_GATE_RATE] <= 1.0 - p["quantile"] + 1e-12
    assert st_[M.SAT_GATE_RATE] == float(gate_q(d, mask, q).sum()) / n


@SETTINGS
@given(batches(), sat_params, st.sampled_from(["token", "sequence", "sequence_token"]))
def test_q_zero_is_bit_identical_to_ppo(batch, p, level):
    d, mask, adv, denom = batch
    n = int(mask.sum())
    k = max(1, min(n, math.ceil(Decimal(repr(p["quantile"])) * n)))
    d = d.clone()
    if level == "token":
        idx = mask.reshape(-1).nonzero().squeeze(-1)[:k]
        d.view(-1)[idx] = 0.0  # k active tokens with d == 0 -> q == 0
    else:  # zero whole responses until they cover k active tokens
        covered = 0
        for b in range(d.shape[0]):
            if covered >= k:
                break
            d[b] = 0.0
            covered += int(mask[b].sum())
    logp = torch.where(d == 0, denom, denom + d).requires_grad_()
    kw = dict(level=level, eps_low=p["eps_low"], eps_high=p["eps_high"], quantile=p["quantile"])
    la, ma = policy_loss_kw(logp, denom, adv, mask, **kw)
    lb, mb = policy_loss_kw(logp, denom, adv, mask, adaptive=True, anchor=p["anchor"], **kw)
    (ga,) = torch.autograd.grad(la, logp)
    (gb,) = torch.autograd.grad(lb, logp)
    assert mb["sat/q"] == 0.0 and mb["sat/gate_rate"] == 0.0
    assert torch.equal(la, lb) and torch.equal(ga, gb)
    # without SAT the loss also logs the q SAT would compute: here SAT's own q, 0
    assert ma.pop("staleness/q_shadow", 0.0) == mb["sat/q"] == 0.0  # absent: no active token
    assert all(ma[key] == mb[key] for key in ma)


@SETTINGS
@given(batches(), sat_params, st.sampled_from(["sequence", "sequence_token"]))
def test_sat_gspo_one_c_per_response(batch, p, level):
    d, mask, adv, denom = batch
    logp = (denom + d).requires_grad_()
    kw = dict(eps_low=p["eps_low"], eps_high=p["eps_high"], quantile=p["quantile"])
    kw |= dict(exponent=p["exponent"], anchor=p["anchor"])
    loss, _ = policy_loss_kw(logp, denom, adv, mask, level=level, adaptive=True, **kw)
    lens = mask.sum(-1, keepdim=True)
    seq_lr = torch.where(mask, logp.detach() - denom, 0.0).sum(-1, keepdim=True) / lens.clamp(min=1)
    lower, upper, _ = sat_clip_bounds(seq_lr.expand_as(d), mask, **kw)
    expected, n_seq = 0.0, 0
    for b in range(d.shape[0]):
        if not mask[b].any():
            continue
        lo_b, hi_b = lower[b][mask[b]], upper[b][mask[b]]
        assert (lo_b == lo_b[0]).all() and (hi_b == hi_b[0]).all()  # one c per response
        s = torch.exp(seq_lr[b, 0])
        a = adv[b][mask[b]]
        per_tok = torch.minimum(s * a, torch.clamp(s, lo_b[0], hi_b[0]) * a)
        expected += float(per_tok.mean())
        n_seq += 1
    assert abs(loss.item() - (-expected / max(n_seq, 1))) <= 1e-12 * (1 + abs(expected))


@SETTINGS
@given(batches(), sat_params)
def test_no_gradient_through_d_q_or_bounds(batch, p):
    # The SAT gradient equals that of the surrogate with the bounds frozen as constants.
    d, mask, adv, denom = batch
    logp = (denom + d).requires_grad_()
    loss, _ = policy_loss_kw(logp, denom, adv, mask, adaptive=True, **p)
    (g,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    lr = torch.where(mask, logp2 - denom, 0.0)
    lower, upper, _ = sat_clip_bounds(lr, mask, **p)
    assert not lower.requires_grad and not upper.requires_grad
    surr = torch.where(mask, clipped_surrogate(torch.exp(lr), adv, lower, upper), 0.0)
    (g2,) = torch.autograd.grad(-surr.sum() / max(int(mask.sum()), 1), logp2)
    assert torch.equal(g, g2)


@SETTINGS
@given(batches(), st.floats(0.0, 0.9), st.floats(0.0, 2.0), st.sampled_from([None, 2.0]))
def test_where_form_equals_min_form_bit_for_bit(batch, eps_low, eps_high, dual):
    # policy_loss's S = r_eff * A must equal min(r A, clamp(r, lo, hi) A) in value and gradient.
    d, mask, adv, _ = batch
    lower = torch.where(
        d < 0, 1 - eps_low * torch.rand_like(d), torch.tensor(1 - eps_low, dtype=F64)
    )
    upper = torch.where(
        d > 0, 1 + eps_high * torch.rand_like(d), torch.tensor(1 + eps_high, dtype=F64)
    )
    for lo, hi in ((1 - eps_low, 1 + eps_high), (lower, upper)):
        r1 = torch.exp(d).requires_grad_()
        r2 = r1.detach().clone().requires_grad_()
        s1 = clipped_surrogate(r1, adv, lo, hi, dual)
        s2 = torch.minimum(r2 * adv, torch.clamp(r2, lo, hi) * adv)
        if dual is not None:
            s2 = torch.where(adv < 0, torch.maximum(s2, dual * adv), s2)
        assert torch.equal(s1, s2)
        (g1,) = torch.autograd.grad(s1.sum(), r1)
        (g2,) = torch.autograd.grad(s2.sum(), r2)
        exact_bound = (r2 == torch.as_tensor(hi, dtype=F64)) | (
            r2 == torch.as_tensor(lo, dtype=F64)
        )
        # on an exact tie at a bound min() splits the gradient in halves that sum to the same
        assert torch.equal(g1[~exact_bound], g2[~exact_bound])
