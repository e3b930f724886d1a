"""policy_loss (sat_cli.rl.losses): hand cases, float64 loop reference (values and gradients),
mask edge cases and non-finite padding."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from loss_helpers import policy_loss_kw

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import kl_k3_penalty, policy_loss

F64 = torch.float64


# ----------------------------------------------------------------------------- loop reference
def ref_policy_loss(
    logp,
    denom,
    adv,
    mask,
    *,
    level="token",
    eps_low=0.2,
    eps_high=0.2,
    adaptive=False,
    quantile=0.9,
    exponent=2.0,
    agg="token-mean",
    dual_clip_c=None,
    token_weights=None,
    anchor="q",
):
    """Slow per-element float64 reference of ALGORITHMS.md §3-§4 (scalar autograd graph);
    ``anchor="min_q_eps"`` as documented in sat_cli/rl/sat.py."""
    B, T = logp.shape
    if level != "token":
        agg = "seq-mean-token-mean"
    act = [[bool(mask[b, t]) for t in range(T)] for b in range(B)]

    def A(b, t):
        return float(adv[b]) if adv.dim() == 1 else float(adv[b, t])

    x = {}  # (b, t) -> scalar log-ratio tensor of the chosen level
    for b in range(B):
        toks = [t for t in range(T) if act[b][t]]
        lr = {t: logp[b, t] - float(denom[b, t]) for t in toks}
        if level == "token":
            x.update({(b, t): lr[t] for t in toks})
        elif toks:
            seq = sum(lr.values()) / len(toks)
            for t in toks:
                if level == "sequence":
                    x[(b, t)] = seq
                else:  # sequence_token: sg[log s_b] + logp - sg[logp]
                    # (the bracket keeps the value exactly seq: (seq + a) - a may round)
                    x[(b, t)] = seq.detach() + (logp[b, t] - logp[b, t].detach())
    q = 0.0
    if adaptive and x:
        absd = sorted(abs(float(v.detach())) for v in x.values())
        k = min(max(math.ceil(Fraction(str(quantile)) * len(absd)), 1), len(absd))
        q = absd[k - 1]
    S = {}
    for (b, t), v in x.items():
        r = torch.exp(v)
        lo, hi = 1 - eps_low, 1 + eps_high
        dv = float(v.detach())
        ell = math.log(1 + eps_high) if dv > 0 else -math.log(1 - eps_low)
        scale, gate = q, q  # the paper: kernel scale and gate threshold are both q
        if anchor == "min_q_eps":
            scale, gate = min(q, ell), (q if q < ell else 0.0)
        if adaptive and q > 0 and abs(dv) > gate:
            psi = 1 / (1 + (abs(dv) / scale) ** exponent)
            if dv > 0:
                hi = 1 + eps_high * psi
            else:
                lo = 1 - eps_low * psi
        s = min(r * A(b, t), min(max(r, lo), hi) * A(b, t))
        if dual_clip_c is not None and A(b, t) < 0:
            s = max(s, dual_clip_c * A(b, t))
        if token_weights is not None:
            s = s * float(token_weights[b, t])
        S[(b, t)] = s
    zero = logp.sum() * 0.0
    if agg == "token-mean":
        return -(sum(S.values(), zero) / max(len(S), 1))
    per_seq = []
    for b in range(B):
        vals = [S[(b, t)] for t in range(T) if act[b][t]]
        if vals:
            tot = sum(vals, zero)
            per_seq.append(tot / len(vals) if agg == "seq-mean-token-mean" else tot)
    return -(sum(per_seq, zero) / max(len(per_seq), 1))


def make_batch(seed, B=5, T=8, scale=0.08, heavy=True, dtype=F64, adv_per_token=False):
    g = torch.Generator().manual_seed(seed)
    denom = -torch.rand(B, T, generator=g, dtype=dtype) * 3.0
    if heavy:  # Student-t (df 2) log-ratios: mostly small, a few large
        z = torch.randn(3, B, T, generator=g, dtype=dtype)
        d = (scale * z[0] / torch.sqrt((z[1] ** 2 + z[2] ** 2) / 2)).clamp(-20, 20)
    else:
        d = scale * torch.randn(B, T, generator=g, dtype=dtype)
    logp = (denom + d).requires_grad_()
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]  # right padding
    if adv_per_token:
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:
        adv = torch.randn(B, generator=g, dtype=dtype)  # both signs
    return logp, denom, adv, mask


def both(logp, denom, adv, mask, **kw):
    loss, metrics = policy_loss_kw(logp, denom, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_()
    ref = ref_policy_loss(logp_ref, denom, adv, mask, **kw)
    (ref_grad,) = torch.autograd.grad(ref, logp_ref)
    return loss, grad, ref.detach(), ref_grad, metrics


# ----------------------------------------------------------------------------- hand cases
def test_ppo_hand_case():
    # r = [1.5, 0.9, 1.0, 0.7], A = [1, 1, -1, -1], eps = 0.2:
    #   t0: min(1.5*1, 1.2*1) = 1.2          (clipped, no grad)
    #   t1: min(0.9, 0.9)     = 0.9          (grad A*r = 0.9)
    #   t2: min(-1.0, -1.0)   = -1.0         (grad A*r = -1.0)
    #   t3: min(-0.7, -0.8)   = -0.8         (clipped, no grad)
    # sum = 0.3 -> token-mean loss = -0.3 / 4 = -0.075; grad = -[0, 0.9, -1, 0] / 4
    r = torch.tensor([[1.5, 0.9, 1.0, 0.7]], dtype=F64)
    logp = torch.log(r).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    loss, m = policy_loss(logp, torch.zeros_like(r), adv, torch.ones(1, 4))
    loss.backward()
    assert loss.item() == pytest.approx(-0.075, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.225, 0.25, 0.0]], dtype=F64))
    assert m["loss/clipfrac"] == 0.5 and m["sat/clipfrac_sat_band"] == 0.0
    assert m["loss/policy"] == pytest.approx(-0.075, abs=1e-12)
    # |log r| mean = (ln 1.5 + |ln 0.9| + 0 + |ln 0.7|) / 4
    d = [math.log(v) for v in (1.5, 0.9, 1.0, 0.7)]
    assert m["staleness/abs_logratio_mean"] == pytest.approx(sum(map(abs, d)) / 4)
    # k3 = 1/r - 1 + ln r = [0.072132, 0.005750, 0, 0.071896] -> mean 0.037445
    assert m["loss/kl_k3"] == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 4)
    assert m["loss/kl_k3"] == pytest.approx(0.037445, abs=1e-6)
    # t0 clips on the high side (A > 0), t3 on the low side (A < 0)
    assert m["loss/clipfrac_high"] == 0.25 and m["loss/clipfrac_low"] == 0.25
    band = {"sat/clipfrac_sat_band", "sat/clipfrac_sat_band_low", "sat/clipfrac_sat_band_high"}
    assert not any(k.startswith("sat/") and k not in band for k in m)
    assert all(m[k] == 0.0 for k in band)


def test_dual_clip_hand_case():
    # r = 3, A = -1: PPO min(-3, -1.2) = -3; dual clip c = 2: max(-3, -2) = -2 -> loss 2, no grad.
    logp = torch.tensor([[math.log(3.0)]], dtype=F64, requires_grad=True)
    loss, _ = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=F64),
        -torch.ones(1),
        torch.ones(1, 1),
        LossConfig(dual_clip_c=2.0),
    )
    loss.backward()
    assert loss.item() == pytest.approx(2.0) and float(logp.grad) == 0.0
    # without dual clip: loss 3, grad -A*r = 3 (times -1 for the loss) -> d loss / d logp = 3
    logp.grad = None
    loss, _ = policy_loss(logp, torch.zeros(1, 1, dtype=F64), -torch.ones(1), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(3.0) and float(logp.grad) == pytest.approx(3.0)


def test_gspo_hand_case():
    # seq 0: log r = [0.3, -0.1, 0.1] (+1 pad) -> mean 0.1 -> s0 = e^0.1 = 1.105171, A0 = 1:
    #        S0 = min(1.105171, 1.2) = 1.105171 (unclipped)
    # seq 1: log r = [0.6, 0.3] -> mean 0.45 -> s1 = e^0.45 = 1.568312 > 1.2, A1 = 2:
    #        S1 = min(3.136624, 2.4) = 2.4 (clipped, no grad)
    # seq-mean-token-mean: loss = -(1.105171 + 2.4) / 2 = -1.752585
    # grad on each token of seq 0 = -(1/2) * (1/3) * s0 * A0 = -0.184195; seq 1: 0
    d = torch.tensor([[0.3, -0.1, 0.1, 0.0], [0.6, 0.3, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([1.0, 2.0], dtype=F64)
    for level in ("sequence", "sequence_token"):
        logp = d.clone().requires_grad_()
        loss, m = policy_loss(
            logp, torch.zeros_like(d), adv, mask, LossConfig(agg="token-mean"), level=level
        )
        loss.backward()
        s0 = math.exp(0.1)
        assert loss.item() == pytest.approx(-(s0 + 2.4) / 2, abs=1e-12)
        g0 = -s0 / 6
        exp_grad = torch.tensor([[g0, g0, g0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
        torch.testing.assert_close(logp.grad, exp_grad)
        # clipfrac on the sequence ratio broadcast to tokens: seq 1's 2 of 5 active tokens
        assert m["loss/clipfrac"] == pytest.approx(2 / 5)
        # staleness is on TOKEN ratios: (0.3 + 0.1 + 0.1 + 0.6 + 0.3) / 5 = 0.28
        assert m["staleness/abs_logratio_mean"] == pytest.approx(0.28)


def test_gspo_token_per_token_advantages_hand_case():
    # one sequence, log r = [0.2, 0.0] -> s = e^0.1 = 1.105171 (same for both tokens);
    # A = [1, -1]: S = [min(s, 1.2), min(-s, -s)] = [s, -s] -> mean 0 -> loss 0;
    # grad per token = -(1/2) * s * A_t = [-0.552585, +0.552585]
    logp = torch.tensor([[0.2, 0.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    loss, _ = policy_loss(
        logp, torch.zeros(1, 2, dtype=F64), adv, torch.ones(1, 2), level="sequence_token"
    )
    loss.backward()
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(0.0, abs=1e-15)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, s / 2]], dtype=F64))


def test_sat_hand_case_gate_on():
    # log r = d = [0.02, 0.05, 0.15, -0.16], A = [-1, -1, 1, 1], quantile 0.5:
    #   sorted |d| = [0.02, 0.05, 0.15, 0.16], k = 2 -> q = 0.05; gated: t2, t3.
    #   t2: psi = 1/(1 + 3^2) = 0.1 -> upper = 1.02 < r = e^0.15 = 1.161834 -> S = 1.02, grad 0
    #       (PPO: r < 1.2 -> S = 1.161834 with grad r): the newly clipped outward band.
    #   t3: psi = 1/(1 + 3.2^2) -> lower = 0.982206; r = e^-0.16 = 0.852144, A > 0 is a pull-back
    #       token: S = min(r, clip(r)) = r for both, gradient kept.
    #   t0, t1: -e^0.02 = -1.020201, -e^0.05 = -1.051271 (ungated).
    # SAT sum = -1.020201 - 1.051271 + 1.02 + 0.852144 = -0.199328 -> loss 0.049832
    # PPO sum = -1.020201 - 1.051271 + 1.161834 + 0.852144 = -0.057494 -> loss 0.014374
    d = torch.tensor([[0.02, 0.05, 0.15, -0.16]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 4)
    e = [math.exp(v) for v in (0.02, 0.05, 0.15, -0.16)]
    out = {}
    for adaptive in (False, True):
        logp = d.clone().requires_grad_()
        loss, m = policy_loss(
            logp, torch.zeros_like(d), adv, mask, LossConfig(adaptive=adaptive, quantile=0.5)
        )
        loss.backward()
        out[adaptive] = (loss.item(), logp.grad.clone(), m)
    assert out[True][0] == pytest.approx(-(-e[0] - e[1] + 1.02 + e[3]) / 4, abs=1e-12)
    assert out[True][0] == pytest.approx(0.049832, abs=1e-6)
    assert out[False][0] == pytest.approx(-(-e[0] - e[1] + e[2] + e[3]) / 4, abs=1e-12)
    torch.testing.assert_close(
        out[True][1], -torch.tensor([[-e[0], -e[1], 0.0, e[3]]], dtype=F64) / 4
    )
    torch.testing.assert_close(
        out[False][1], -torch.tensor([[-e[0], -e[1], e[2], e[3]]], dtype=F64) / 4
    )
    m = out[True][2]
    assert m["sat/q"] == pytest.approx(0.05) and m["sat/gate_rate"] == 0.5
    assert m["sat/clipfrac_sat_band"] == 0.25 and m["loss/clipfrac"] == 0.0
    assert m["sat/active"] == 1.0  # q = 0.05 < ln 1.2
    assert m["sat/c_min"] == pytest.approx(1 / (1 + 3.2**2))
    assert m["sat/eps_high_eff_mean"] == pytest.approx(0.2 * (3 + 0.1) / 4)


def test_sat_active_is_two_sided_at_q_0_2():
    # eps = 0.2: ln(1.2) = 0.1823 < q = 0.2 < -ln(0.8) = 0.2231. Five tokens, quantile 0.8:
    # sorted |d| = [0.2, 0.2, 0.2, 0.2, 0.22] -> k = 4 -> q = 0.2; gated: the |d| = 0.22 token.
    # d = -0.22 with A < 0: r = e^-0.22 = 0.8025 lies inside PPO's [0.8, 1.2] (grad kept by PPO);
    # SAT's lower bound 1 - 0.2 * psi(0.22), psi = 1 / (1 + 1.1^2) = 0.452489 -> 0.909502 > r:
    # newly clipped on the LOW side. SAT acts although q >= ln(1 + eps_high).
    d = torch.tensor([[0.2, -0.2, 0.2, -0.2, -0.22]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0]], dtype=F64)
    logp = d.clone().requires_grad_()
    loss, m = policy_loss(
        logp, torch.zeros_like(d), adv, torch.ones(1, 5), LossConfig(adaptive=True, quantile=0.8)
    )
    assert m["sat/q"] == pytest.approx(0.2)
    assert m["sat/active"] == 1.0
    assert m["sat/active_low"] == 1.0 and m["sat/active_high"] == 0.0
    assert m["sat/clipfrac_sat_band"] == pytest.approx(0.2)
    assert m["sat/clipfrac_sat_band_low"] == pytest.approx(0.2)
    assert m["sat/clipfrac_sat_band_high"] == 0.0
    loss.backward()
    assert float(logp.grad[0, 4]) == 0.0  # SAT removed this gradient; PPO would keep it
    ppo = d.clone().requires_grad_()
    policy_loss(ppo, torch.zeros_like(d), adv, torch.ones(1, 5))[0].backward()
    assert float(ppo.grad[0, 4]) == pytest.approx(math.exp(-0.22) / 5)
    # q above both thresholds: inert on both sides
    _, m = policy_loss(
        (d * 2).requires_grad_(),
        torch.zeros_like(d),
        adv,
        torch.ones(1, 5),
        LossConfig(adaptive=True),
    )
    assert m["sat/q"] == pytest.approx(0.44)
    assert (m["sat/active"], m["sat/active_low"], m["sat/active_high"]) == (0.0, 0.0, 0.0)


def test_sat_can_act_thresholds():
    from sat_cli.rl.clip_metrics import sat_can_act

    assert sat_can_act(0.18, 0.2, 0.2) == (True, True)
    assert sat_can_act(0.2, 0.2, 0.2) == (True, False)
    assert sat_can_act(0.23, 0.2, 0.2) == (False, False)
    assert sat_can_act(0.3, 0.28, 0.2) == (True, False)  # -ln(0.72) = 0.3285
    assert sat_can_act(5.0, 1.0, 0.2) == (True, False)  # eps_low = 1: the low side never binds


def test_clipfrac_split_by_side_hand_case():
    # r = [1.5, 1.3, 0.7, 0.5, 1.0], A = [1, -1, -1, 1, 1]: high-side clips: t0 (A>0, r>1.2);
    # low-side clips: t2 (A<0, r<0.8). t1 (A<0, r>1.2) and t3 (A>0, r<0.8) pull back: kept.
    r = torch.tensor([[1.5, 1.3, 0.7, 0.5, 1.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]], dtype=F64)
    _, m = policy_loss(torch.log(r).requires_grad_(), torch.zeros_like(r), adv, torch.ones(1, 5))
    assert m["loss/clipfrac_high"] == pytest.approx(0.2)
    assert m["loss/clipfrac_low"] == pytest.approx(0.2)
    assert m["loss/clipfrac"] == pytest.approx(0.4)


def test_sat_gate_off_is_bit_identical_to_ppo():
    # Same batch, quantile 1.0 -> q = max |d| = 0.16 -> strict gate never fires.
    d = torch.tensor([[0.02, 0.05, 0.15, -0.16]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    res = []
    for adaptive in (False, True):
        logp = d.clone().requires_grad_()
        loss, m = policy_loss(
            logp,
            torch.zeros_like(d),
            adv,
            torch.ones(1, 4),
            LossConfig(adaptive=adaptive, quantile=1.0),
        )
        loss.backward()
        res.append((loss.detach(), logp.grad, m))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert res[1][2]["sat/gate_rate"] == 0.0 and res[1][2]["sat/active"] == 1.0


def test_sat_inactive_flag_when_q_large():
    # All |d| = 0.5 > ln(1.2): q = 0.5, sat/active = 0.
    d = torch.tensor([[0.5, -0.5, 0.5]])
    _, m = policy_loss(
        d.clone().requires_grad_(),
        torch.zeros(1, 3),
        torch.ones(1),
        torch.ones(1, 3),
        LossConfig(adaptive=True),
    )
    assert m["sat/q"] == 0.5 and m["sat/active"] == 0.0


def test_seq_mean_excludes_all_padding_rows_hand_case():
    # rows: [r=1 (A=1), r=1 (A=1)], [pad, pad], [r=1 (A=3)]; all unclipped, S = A.
    # seq-mean-token-mean = -(1 + 3) / 2 = -2 (the all-padding row does not count)
    # seq-mean-token-sum  = -(2 + 3) / 2 = -2.5;  token-mean = -(1 + 1 + 3) / 3
    logp = torch.zeros(3, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    adv = torch.tensor([1.0, 7.0, 3.0])
    vals = {
        agg: policy_loss(logp, torch.zeros(3, 2), adv, mask, LossConfig(agg=agg))[0].item()
        for agg in ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean")
    }
    assert vals == pytest.approx(
        {"seq-mean-token-mean": -2.0, "seq-mean-token-sum": -2.5, "token-mean": -5 / 3}
    )


# ----------------------------------------------------------------------------- loop reference
CASES = [
    dict(level="token", agg="token-mean"),
    dict(level="token", agg="seq-mean-token-mean"),
    dict(level="token", agg="seq-mean-token-sum"),
    dict(level="token", agg="token-mean", dual_clip_c=3.0),
    dict(level="sequence"),
    dict(level="sequence_token"),
]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_loop_reference(case, adaptive, seed):
    logp, denom, adv, mask = make_batch(seed, adv_per_token=seed == 2)
    kw = dict(
        case, adaptive=adaptive, quantile=0.8 if seed == 1 else 0.9, exponent=2.0 if seed else 1.5
    )
    loss, grad, ref, ref_grad, m = both(logp, denom, adv, mask, **kw)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    if adaptive and case["level"] == "token":
        assert m["sat/gate_rate"] > 0  # the heavy tail gates something


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("scale", [0.03, 0.4])  # q below / above ln(1 + eps)
def test_min_q_eps_against_reference(level, scale):
    logp, denom, adv, mask = make_batch(13, scale=scale, adv_per_token=True)
    kw = dict(level=level, adaptive=True, anchor="min_q_eps", eps_low=0.15, eps_high=0.25)
    loss, grad, ref, ref_grad, m = both(logp, denom, adv, mask, **kw)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    if level == "token":
        assert (m["sat/active"] == 1.0) == (scale == 0.03)


def test_token_weights_and_asymmetric_eps_against_reference():
    logp, denom, adv, mask = make_batch(7, scale=0.15)
    w = torch.rand(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(3)) * 2
    w[0, 0] = 0.0
    for adaptive in (False, True):
        kw = dict(eps_low=0.1, eps_high=0.28, token_weights=w, adaptive=adaptive)
        loss, grad, ref, ref_grad, _ = both(logp, denom, adv, mask, **kw)
        torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_float32_matches_float64_reference():
    logp, denom, adv, mask = make_batch(11, B=16, T=32)
    for level in ("token", "sequence"):
        lp32 = logp.detach().float().requires_grad_()
        loss, _ = policy_loss(
            lp32, denom.float(), adv.float(), mask, LossConfig(adaptive=True), level=level
        )
        (g,) = torch.autograd.grad(loss, lp32)
        ref = ref_policy_loss(logp, denom, adv, mask, level=level, adaptive=True)
        (rg,) = torch.autograd.grad(ref, logp)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.double(), rg, rtol=1e-4, atol=1e-7)


def test_per_sequence_and_broadcast_advantages_agree():
    logp, denom, adv, mask = make_batch(5)
    for level in ("token", "sequence", "sequence_token"):
        a, _ = policy_loss(logp, denom, adv, mask, LossConfig(adaptive=True), level=level)
        b, _ = policy_loss(
            logp,
            denom,
            adv[:, None].expand(mask.shape),
            mask,
            LossConfig(adaptive=True),
            level=level,
        )
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_mask_gives_zero_loss_and_zero_grads(level, adaptive, agg):
    logp = torch.tensor([[float("nan"), -1.0], [-float("inf"), -2.0]], requires_grad=True)
    denom = torch.tensor([[0.0, float("nan")], [-float("inf"), 1.0]])
    loss, m = policy_loss(
        logp,
        denom,
        torch.tensor([float("nan"), 1.0]),
        torch.zeros(2, 2),
        LossConfig(adaptive=adaptive, agg=agg),
        level=level,
    )
    assert loss.grad_fn is not None and loss.item() == 0.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 2))
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_non_finite_padding_does_not_poison(level, adaptive):
    logp, denom, adv, mask = make_batch(3, adv_per_token=True)
    w = torch.rand(mask.shape, dtype=F64)
    clean = policy_loss(
        logp, denom, adv, mask, LossConfig(adaptive=adaptive), level=level, token_weights=w
    )[0]
    (g_clean,) = torch.autograd.grad(clean, logp)
    pad = ~mask
    bad_logp = torch.where(pad, torch.tensor(float("nan"), dtype=F64), logp.detach())
    bad_logp[pad & (torch.arange(mask.shape[1]) % 2 == 0)] = -float("inf")
    bad_logp.requires_grad_()
    bad_denom = torch.where(pad, torch.tensor(float("inf"), dtype=F64), denom)
    bad_adv = torch.where(pad, torch.tensor(float("nan"), dtype=F64), adv)
    bad_w = torch.where(pad, torch.tensor(float("nan"), dtype=F64), w)
    loss, m = policy_loss(
        bad_logp,
        bad_denom,
        bad_adv,
        mask,
        LossConfig(adaptive=adaptive),
        level=level,
        token_weights=bad_w,
    )
    (g,) = torch.autograd.grad(loss, bad_logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.equal(loss, clean) and torch.equal(g, g_clean)
    assert torch.equal(g[pad], torch.zeros_like(g[pad]))
    assert all(math.isfinite(v) for v in m.values())


def test_all_clipped_gives_zero_grad():
    # every token outward beyond the PPO interval: r = 2 with A > 0, r = 0.5 with A < 0
    logp = torch.log(torch.tensor([[2.0, 2.0, 0.5]])).requires_grad_()
    loss, m = policy_loss(
        logp, torch.zeros(1, 3), torch.tensor([[1.0, 2.0, -1.0]]), torch.ones(1, 3)
    )
    loss.backward()
    # S = [1.2, 2.4, -0.8] -> loss = -2.8 / 3
    assert loss.item() == pytest.approx(-2.8 / 3) and m["loss/clipfrac"] == 1.0
    assert torch.equal(logp.grad, torch.zeros(1, 3))


@pytest.mark.parametrize(
    "kw",
    [dict(level="seq"), dict(agg="mean"), dict(dual_clip_c=1.0), dict(adaptive=True, anchor="x")],
)
def test_invalid_arguments(kw):
    with pytest.raises(ValueError):
        policy_loss_kw(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **kw)


def test_kl_k3_penalty_hand_case():
    # log r = [0.5, -0.5] (pad 3rd): k3 = e^-0.5 - 1 + 0.5 = 0.106531, e^0.5 - 1 - 0.5 = 0.148721
    # mean = 0.127626; d/dlogp k3 = 1 - e^-lr -> [0.393469, -0.648721] / 2
    logp = torch.tensor([[0.5, -0.5, float("nan")]], dtype=F64, requires_grad=True)
    kl = kl_k3_penalty(logp, torch.zeros(1, 3, dtype=F64), torch.tensor([[1, 1, 0]]))
    kl.backward()
    assert kl.item() == pytest.approx((math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5) / 2)
    exp_g = torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0]], dtype=F64) / 2
    torch.testing.assert_close(logp.grad, exp_g)


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_sat_gspo_metrics_against_dense_computation(level):
    from sat_cli.rl.sat import sat_clip_bounds

    g = torch.Generator().manual_seed(2)
    B, T = 40, 12
    d = 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B, 1), generator=g)
    adv = torch.randn(B, generator=g, dtype=F64)
    _, m = policy_loss(
        d.clone().requires_grad_(),
        torch.zeros_like(d),
        adv,
        mask,
        LossConfig(adaptive=True, quantile=0.7),
        level=level,
    )
    seq = (torch.where(mask, d, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand(
        B, T
    )
    lower, upper, st = sat_clip_bounds(seq, mask, eps_low=0.2, eps_high=0.2, quantile=0.7)
    for key in (M.SAT_Q, M.SAT_GATE_RATE, M.SAT_C_MIN, M.SAT_EPS_LOW_EFF, M.SAT_EPS_HIGH_EFF):
        assert m[key] == pytest.approx(st[key], rel=1e-12, abs=1e-15)
    r, a = torch.exp(seq), adv[:, None].expand(B, T)
    ppo = mask & (((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))
    sat = mask & (((a > 0) & (r > upper)) | ((a < 0) & (r < lower)))
    n = int(mask.sum())
    assert m["loss/clipfrac"] == pytest.approx(float(ppo.sum()) / n)
    assert m["sat/clipfrac_sat_band"] == pytest.approx(float((sat & ~ppo).sum()) / n)


def test_min_q_eps_bites_where_plain_sat_is_inert():
    # Whole batch stale: log r = [0.15, 0.5, 0.6, -0.7] (A = +1 each), quantile 0.5 -> q = 0.5
    # >= ln 1.2. Plain SAT gates only 0.6 and -0.7, both already outside PPO's interval: every
    # gradient equals PPO's. min_q_eps contracts token 0 to upper = 1 + 0.2 * 0.59635 = 1.11927
    # < e^0.15 = 1.16183 -> its gradient becomes 0 (and its value 1.11927 instead of 1.16183).
    d = torch.tensor([[0.15, 0.5, 0.6, -0.7]], dtype=F64)
    grads = {}
    for name, kw in (
        ("ppo", {}),
        ("q", dict(adaptive=True)),
        ("mqe", dict(adaptive=True, anchor="min_q_eps")),
    ):
        logp = d.clone().requires_grad_()
        loss, m = policy_loss(
            logp,
            torch.zeros_like(d),
            torch.ones(1),
            torch.ones(1, 4),
            LossConfig(quantile=0.5, **kw),
        )
        loss.backward()
        grads[name] = (logp.grad, loss.item(), m)
    assert torch.equal(grads["q"][0], grads["ppo"][0])
    assert grads["q"][2]["sat/active"] == 0.0 and grads["q"][2]["sat/clipfrac_sat_band"] == 0.0
    g = grads["mqe"][0]
    assert float(g[0, 0]) == 0.0 and float(grads["ppo"][0][0, 0]) == pytest.approx(
        -math.exp(0.15) / 4
    )
    assert torch.equal(g[0, 1:], grads["ppo"][0][0, 1:])
    # values: the three d > 0 tokens now sit at their contracted upper bounds
    # 1 + 0.2 psi(d / ln 1.2) instead of e^0.15, 1.2, 1.2 (token 3 has A > 0: lower irrelevant)
    ell = math.log(1.2)
    up = [1 + 0.2 / (1 + (x / ell) ** 2) for x in (0.15, 0.5, 0.6)]
    diff = (math.exp(0.15) - up[0]) + (1.2 - up[1]) + (1.2 - up[2])
    assert grads["mqe"][1] - grads["ppo"][1] == pytest.approx(diff / 4, rel=1e-12)
    assert grads["mqe"][2]["sat/clipfrac_sat_band"] == 0.25


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("q_rows", [1, 2, 3])
def test_per_micro_batch_scope_equals_blockwise_losses(level, q_rows):
    """``q_rows``: each block of rows gets its own q, so the loss is the token- (or sequence-)
    weighted combination of the losses of the blocks computed alone, value and gradient."""
    logp, denom, adv, mask = make_batch(7, B=7, T=6, scale=0.1)
    kw = dict(level=level, adaptive=True, quantile=0.75)
    loss, m = policy_loss_kw(logp, denom, adv, mask, q_rows=q_rows, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    seq_level = level != "token"
    total = int(mask.any(-1).sum()) if seq_level else int(mask.sum())
    ref = logp.sum() * 0.0
    gates, qs = 0.0, []
    for r0 in range(0, 7, q_rows):
        sl = slice(r0, r0 + q_rows)
        n_c = int(mask[sl].any(-1).sum()) if seq_level else int(mask[sl].sum())
        if n_c == 0:
            continue
        lb, mb = policy_loss_kw(logp[sl], denom[sl], adv[sl], mask[sl], **kw)
        ref = ref + lb * (n_c / total)
        n_tok = int(mask[sl].sum())
        gates += mb["sat/gate_rate"] * n_tok
        qs.append((mb["sat/q"], n_tok))
    (ref_grad,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(grad, ref_grad)
    n_tok = int(mask.sum())
    assert m["sat/gate_rate"] == pytest.approx(gates / n_tok)
    assert m["sat/q"] == pytest.approx(sum(q * n for q, n in qs) / n_tok)
    # one block = the default global scope, bit for bit
    l1, _ = policy_loss_kw(logp, denom, adv, mask, q_rows=7, **kw)
    l0, _ = policy_loss_kw(logp, denom, adv, mask, **kw)
    assert torch.equal(l0, l1)


def test_per_micro_batch_active_fraction_hand_case():
    # block 0 (row 0): |d| = 0.5 everywhere -> q = 0.5, inert; block 1 (row 1): q = 0.01.
    d = torch.tensor([[0.5, -0.5], [0.01, -0.01]], dtype=F64)
    _, m = policy_loss(
        d.clone().requires_grad_(),
        torch.zeros_like(d),
        torch.ones(2, dtype=F64),
        torch.ones(2, 2),
        LossConfig(adaptive=True, q_rows=1),
    )
    assert m["sat/active"] == 0.5 and m["sat/active_high"] == 0.5
    assert m["sat/q"] == pytest.approx((0.5 + 0.01) / 2)
    with pytest.raises(ValueError, match="q_rows"):
        policy_loss(d, torch.zeros_like(d), torch.ones(2), torch.ones(2, 2), LossConfig(q_rows=0))
