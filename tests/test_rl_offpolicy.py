"""VCPO, A-3PO and the Kish ESS (sat_cli.rl.offpolicy through sat_cli.rl.registry): hand cases
worked out below and float64 per-element loop references (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import loss_of

from sat_cli.rl import offpolicy as off
from sat_cli.rl.config import LossConfig

F64 = torch.float64


# ----------------------------------------------------------------------------- ESS
def test_kish_ess_hand_cases():
    # equal weights -> 1; one weight carries all -> 1/B; w = [1, 2, 3]: 36 / (3 * 14) = 6/7
    assert off.kish_ess(torch.zeros(4, dtype=F64)) == pytest.approx(1.0)
    assert off.kish_ess(torch.tensor([0.0, -1e4, -1e4, -1e4])) == pytest.approx(0.25)
    lw = torch.log(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    assert off.kish_ess(lw) == pytest.approx(6 / 7)
    # scale invariant, and no overflow for huge log-weights
    assert off.kish_ess(lw + 800.0) == pytest.approx(6 / 7)
    assert math.isnan(off.kish_ess(torch.zeros(0)))
    assert math.isnan(off.kish_ess(torch.tensor([0.0, math.nan])))


def test_sequence_ess_uses_the_product_over_response_tokens():
    # row 0: d = [0.1, 0.3] -> log w = 0.4; row 1: d = [-0.2, pad] -> -0.2; row 2: all padding
    logp = torch.tensor([[0.1, 0.3], [-0.2, 9.0], [5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    w = [math.exp(0.4), math.exp(-0.2)]
    expected = sum(w) ** 2 / (2 * sum(x * x for x in w))
    assert off.sequence_ess(logp, torch.zeros_like(logp), mask) == pytest.approx(expected)
    _, m = loss_of(
        LossConfig("grpo", "none"),
        logp=logp.requires_grad_(),
        rollout_logp=torch.zeros_like(logp),
        advantages=torch.ones(3, dtype=F64),
        mask=mask,
    )
    assert m["staleness/ess"] == pytest.approx(expected)


# ----------------------------------------------------------------------------- A-3PO
def test_a3po_alpha_hand_case():
    # v_theta = 5: staleness k = 0, 1, 2, 4 -> alpha = 0, 0, 1/2, 3/4; a future version -> 0
    alpha = off.a3po_alpha(torch.tensor([5, 4, 3, 1, 7]), 5)
    torch.testing.assert_close(alpha, torch.tensor([0.0, 0.0, 0.5, 0.75, 0.0], dtype=F64))


def test_a3po_hand_case():
    # current version 4. Row 0: version 4 (k = 0, alpha = 0), d = [0.25, 0.0], A = -1:
    #   pi_prox = mu, w = 1, r = [e^0.25, 1]; A < 0 with r = 1.284 > 1.2 pulls back: S = -r.
    # Row 1: version 1 (k = 3, alpha = 2/3), d = [0.3, -0.15], A = +1:
    #   log pi_prox = mu + 2/3 d, w = e^{2d/3} = [e^0.2, e^-0.1], r = e^{d/3} = [e^0.1, e^-0.05]
    #   (inside [0.8, 1.2]): S = w r = [e^0.3, e^-0.15].
    # token-mean: loss = -(e^0.3 + e^-0.15 - e^0.25 - 1) / 4;
    # d loss / d logp = -(1/4) w r A = [[e^0.25, 1] / 4, -[e^0.3, e^-0.15] / 4]
    mu = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=F64)
    d = torch.tensor([[0.25, 0.0], [0.3, -0.15]], dtype=F64)
    logp = (mu + d).requires_grad_()
    loss, m = loss_of(
        LossConfig("a3po"),
        logp=logp,
        rollout_logp=mu,
        advantages=torch.tensor([-1.0, 1.0], dtype=F64),
        mask=torch.ones(2, 2),
        versions=torch.tensor([4, 1]),
        current_version=4,
    )
    e = math.exp
    assert loss.item() == pytest.approx(-(e(0.3) + e(-0.15) - e(0.25) - 1) / 4, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[e(0.25), 1.0], [-e(0.3), -e(-0.15)]], dtype=F64) / 4
    torch.testing.assert_close(logp.grad, expected)
    assert m["a3po/alpha_mean"] == pytest.approx((0 + 0 + 2 / 3 + 2 / 3) / 4)
    assert m["staleness/abs_logratio_mean_mu"] == pytest.approx((0.25 + 0.3 + 0.15) / 4)
    # the ratio's own log-ratio is (1 - alpha) d
    assert m["staleness/abs_logratio_mean"] == pytest.approx((0.25 + 0.1 + 0.05) / 4)


def test_a3po_at_staleness_one_is_grpo_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    mu = -torch.rand(6, 5, generator=g)
    logp = (mu + 0.2 * torch.randn(6, 5, generator=g)).requires_grad_()
    adv = torch.randn(6, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.2
    kw = dict(logp=logp, rollout_logp=mu, advantages=adv, mask=mask)
    a3po = LossConfig("a3po", adaptive=True)
    la, _ = loss_of(a3po, versions=torch.full((6,), 9), current_version=10, **kw)
    lg, _ = loss_of(LossConfig("grpo", adaptive=True), **kw)
    ga = torch.autograd.grad(la, logp)[0]
    gg = torch.autograd.grad(lg, logp)[0]
    assert torch.equal(la, lg) and torch.equal(ga, gg)


def _ref_a3po(logp, mu, adv, mask, versions, current, eps=0.2, cap=None, mode="clip"):
    """Per-element float64 reference of the A-3PO loss (module docstring of offpolicy)."""
    B, T = logp.shape
    terms = []
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            v = int(versions[b, t]) if versions.dim() == 2 else int(versions[b])
            k = current - v
            alpha = min(max((k - 1) / k, 0.0), 1.0) if k > 0 else 0.0
            x = float(logp[b, t].detach())
            prox = float(mu[b, t]) + alpha * (x - float(mu[b, t]))
            w = math.exp(prox - float(mu[b, t]))
            if cap is not None and w > cap:
                w = cap if mode == "clip" else 0.0
            r = torch.exp(logp[b, t] - prox)
            a = float(adv[b])
            terms.append(w * torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a))
    return -sum(terms) / len(terms)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap,mode", [(None, "clip"), (1.1, "clip"), (1.1, "mask")])
def test_a3po_against_loop_reference(seed, cap, mode):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 2
    logp = (mu + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    versions = torch.randint(0, 9, (B, T), generator=g)  # per-token versions (in-flight updates)
    loss, _ = loss_of(
        LossConfig("a3po", behav_cap=cap, behav_mode=mode),
        logp=logp,
        rollout_logp=mu,
        advantages=adv,
        mask=mask,
        versions=versions,
        current_version=8,
    )
    grad = torch.autograd.grad(loss, logp)[0]
    lr = logp.detach().clone().requires_grad_()
    ref = _ref_a3po(lr, mu, adv, mask, versions, 8, cap=cap, mode=mode)
    ref_grad = torch.autograd.grad(ref, lr)[0]
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)


def test_a3po_needs_versions():
    b = dict(logp=torch.zeros(1, 1, requires_grad=True), rollout_logp=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="versions"):
        loss_of(LossConfig("a3po"), advantages=torch.ones(1), mask=torch.ones(1, 1), **b)


# ----------------------------------------------------------------------------- VCPO
VC_D = [[0.1, 0.1], [0.0, 0.0], [-0.5, 0.0], [0.2, 0.3]]  # log w = 0.2, 0, -0.5, 0.5


def _vcpo_hand_numbers(cap):
    """The hand case worked out step by step (groups {0, 1} and {2, 3}, G = 2)."""
    e = math.exp
    A = [1.0, -1.0, 1.0, -1.0]
    sq = [1.0, 4.0, 2.0, 1.0]
    logw = [0.2, 0.0, -0.5, 0.5]
    W = [e(2 * lw) * s for lw, s in zip(logw, sq, strict=True)]  # w^2 ||grad||^2
    shift0 = (W[0] * A[0] + W[1] * A[1]) / (W[0] + W[1])  # (1.4918 - 4) / 5.4918 = -0.45672
    shift1 = (W[2] * A[2] + W[3] * A[3]) / (W[2] + W[3])  # (0.7358 - 2.7183) / 3.4540
    Ap = [A[0] - shift0, A[1] - shift0, A[2] - shift1, A[3] - shift1]
    wt = [min(e(lw), cap) for lw in logw]
    w = [e(lw) for lw in logw]
    ess = sum(w) ** 2 / (4 * sum(x * x for x in w))
    return Ap, wt, ess, (shift0, shift1)


def test_vcpo_hand_case():
    mu = torch.full((4, 2), -1.0, dtype=F64)
    logp = (mu + torch.tensor(VC_D, dtype=F64)).requires_grad_()
    loss, m = loss_of(
        LossConfig("vcpo", group_size=2, vcpo_is_cap=1.5),
        logp=logp,
        rollout_logp=mu,
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64),
        mask=torch.ones(4, 2),
        seq_score_sqnorm=torch.tensor([1.0, 4.0, 2.0, 1.0], dtype=F64),
    )
    Ap, wt, ess, shifts = _vcpo_hand_numbers(1.5)
    assert shifts[0] == pytest.approx(-0.45672, abs=1e-5)
    assert shifts[1] == pytest.approx(-0.57397, abs=1e-5)
    # seq-mean-token-mean of the constant per-response term min(w, C) * A'
    assert loss.item() == pytest.approx(-sum(a * w for a, w in zip(Ap, wt, strict=True)) / 4)
    loss.backward()
    # gradient of log pi per token: -(1/4) (1/2) min(w, C) A'
    expected = torch.tensor([[-a * w / 8] * 2 for a, w in zip(Ap, wt, strict=True)], dtype=F64)
    torch.testing.assert_close(logp.grad, expected)
    assert m["vcpo/ess"] == pytest.approx(ess)
    assert m["opt/lr_scale"] == pytest.approx(math.sqrt(ess))  # ess < 1 = rho_base
    assert m["loss/clipfrac"] == 0.0  # no PPO clip
    assert m["staleness/abs_logratio_mean_mu"] == pytest.approx((0.2 + 0.5 + 0.5) / 8)


def test_vcpo_without_opob_keeps_the_group_advantages():
    mu = torch.zeros(2, 1, dtype=F64)
    logp = torch.tensor([[0.3], [-0.3]], dtype=F64, requires_grad=True)
    loss, m = loss_of(
        LossConfig("vcpo", vcpo_opob=False),
        logp=logp,
        rollout_logp=mu,
        advantages=torch.tensor([1.0, -1.0], dtype=F64),
        mask=torch.ones(2, 1),
    )
    # -(e^0.3 * 1 + e^-0.3 * -1) / 2
    assert loss.item() == pytest.approx(-(math.exp(0.3) - math.exp(-0.3)) / 2)
    assert "vcpo/baseline_shift_abs_mean" not in m
    with pytest.raises(ValueError, match="seq_score_sqnorm"):
        loss_of(
            LossConfig("vcpo"),
            logp=logp,
            rollout_logp=mu,
            advantages=torch.ones(2),
            mask=torch.ones(2, 1),
        )


def test_vcpo_lr_scale():
    assert off.vcpo_lr_scale(0.25) == 0.5
    assert off.vcpo_lr_scale(0.25, base=0.5) == pytest.approx(math.sqrt(0.5))
    assert off.vcpo_lr_scale(0.9, base=0.5) == 1.0
    assert off.vcpo_lr_scale(math.nan) == 0.0


def _ref_vcpo(logp, mu, adv, mask, sq, G, cap):
    """Per-element float64 reference: OPOB per group, truncated sequence weight, seq-mean."""
    B, T = logp.shape
    logw = [
        sum(float(logp[b, t].detach()) - float(mu[b, t]) for t in range(T) if mask[b, t])
        for b in range(B)
    ]
    A = [float(adv[b]) for b in range(B)]
    Ap = []
    for b in range(B):
        grp = [j for j in range(B) if j // G == b // G]
        W = [math.exp(2 * logw[j]) * float(sq[j]) for j in grp]
        Ap.append(A[b] - sum(wj * A[j] for wj, j in zip(W, grp, strict=True)) / sum(W))
    per_seq = []
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        wt = min(math.exp(logw[b]), cap)
        terms = [wt * Ap[b] * torch.exp(logp[b, t] - float(logp[b, t].detach())) for t in toks]
        per_seq.append(sum(terms) / len(toks))
    return -sum(per_seq) / B


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vcpo_against_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, G = 8, 5, 4
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 2
    logp = (mu + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    sq = torch.rand(B, generator=g, dtype=F64) * 10
    loss, m = loss_of(
        LossConfig("vcpo", group_size=G, vcpo_is_cap=1.2),
        logp=logp,
        rollout_logp=mu,
        advantages=adv,
        mask=mask,
        seq_score_sqnorm=sq,
    )
    grad = torch.autograd.grad(loss, logp)[0]
    lr = logp.detach().clone().requires_grad_()
    ref = _ref_vcpo(lr, mu, adv, mask, sq, G, 1.2)
    ref_grad = torch.autograd.grad(ref, lr)[0]
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    logw = off.sequence_log_weights(logp, mu, mask)
    w = torch.exp(logw)
    assert m["vcpo/ess"] == pytest.approx(float(w.sum() ** 2 / (w * w).sum() / B))


def test_vcpo_rejects_sat_and_corrections():
    b = dict(
        logp=torch.zeros(2, 1, requires_grad=True),
        rollout_logp=torch.zeros(2, 1),
        advantages=torch.ones(2),
        mask=torch.ones(2, 1),
        seq_score_sqnorm=torch.ones(2),
    )
    with pytest.raises(ValueError, match="clip interval"):
        loss_of(LossConfig("vcpo", adaptive=True), **b)
    with pytest.raises(ValueError, match="mismatch treatment"):
        loss_of(LossConfig("vcpo", "tis"), old_logp=torch.zeros(2, 1), **b)
    # the score-function ratio is 1 in value: exactly -mean(min(w, C) A')
    loss, _ = loss_of(LossConfig("vcpo", vcpo_opob=False), **b)
    assert loss.item() == -1.0
