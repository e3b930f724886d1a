"""Mismatch corrections (sat_cli.rl.corrections) against their formulas, and the registry's
composition of algorithms and corrections (sat_cli.rl.registry) per ALGORITHMS.md §5."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import loss_of

from sat_cli.rl import corrections as C
from sat_cli.rl import registry as R
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss

F64 = torch.float64
LN = math.log


def test_tis_mis_icepop_hand_case():
    # k = pi_old / mu = [0.25, 0.6, 1.0, 2.0, 3.0, 6.0]
    k = torch.tensor([[0.25, 0.6, 1.0, 2.0, 3.0, 6.0]], dtype=F64)
    old, mu = torch.log(k), torch.zeros_like(k)
    # TIS: min(k, 2) = [0.25, 0.6, 1, 2, 2, 2]
    torch.testing.assert_close(
        C.tis_weights(old, mu), torch.tensor([[0.25, 0.6, 1, 2, 2, 2]], dtype=F64)
    )
    # MIS: k * 1[k <= 2] = [0.25, 0.6, 1, 2, 0, 0]  (k == C kept)
    torch.testing.assert_close(
        C.mis_weights(old, mu), torch.tensor([[0.25, 0.6, 1, 2, 0, 0]], dtype=F64)
    )
    # IcePop: k * 1[0.5 <= k <= 5] = [0, 0.6, 1, 2, 3, 0]
    torch.testing.assert_close(
        C.icepop_weights(old, mu), torch.tensor([[0, 0.6, 1, 2, 3, 0]], dtype=F64)
    )
    # decoupled PPO behaviour weights
    torch.testing.assert_close(C.behaviour_weights(old, mu), k)
    torch.testing.assert_close(
        C.behaviour_weights(old, mu, cap=2.5, mode="clip"),
        torch.tensor([[0.25, 0.6, 1, 2, 2.5, 2.5]], dtype=F64),
    )
    torch.testing.assert_close(
        C.behaviour_weights(old, mu, cap=2.5, mode="mask"),
        torch.tensor([[0.25, 0.6, 1, 2, 0, 0]], dtype=F64),
    )
    with pytest.raises(ValueError):
        C.behaviour_weights(old, mu, cap=2.0, mode="drop")


def test_corrections_random_against_elementwise_formula():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g, dtype=F64) * 4
    mu = old + torch.randn(6, 9, generator=g, dtype=F64)
    tis, mis, ice = (
        C.tis_weights(old, mu, cap=1.7),
        C.mis_weights(old, mu, cap=1.7),
        C.icepop_weights(old, mu, 0.6, 4.0),
    )
    for b in range(6):
        for t in range(9):
            k = math.exp(float(old[b, t]) - float(mu[b, t]))
            assert float(tis[b, t]) == pytest.approx(min(k, 1.7), rel=1e-14)
            assert float(mis[b, t]) == pytest.approx(k if k <= 1.7 else 0.0, rel=1e-14)
            assert float(ice[b, t]) == pytest.approx(k if 0.6 <= k <= 4.0 else 0.0, rel=1e-14)


def test_weights_are_detached():
    old = torch.zeros(1, 2, requires_grad=True)
    mu = torch.zeros(1, 2, requires_grad=True)
    for w in (
        C.tis_weights(old, mu),
        C.mis_weights(old, mu),
        C.icepop_weights(old, mu),
        C.behaviour_weights(old, mu),
    ):
        assert not w.requires_grad
    assert not C.dppo_tv_mask(old, mu, torch.ones(1)).requires_grad
    assert not C.m2po_mask(old, mu, torch.ones(1, 2)).requires_grad


def test_dppo_tv_hand_case():
    # probabilities pi = [0.5, 0.5, 0.5, 0.5, 0.2], mu = [0.4, 0.4, 0.4995, 0.6, 0.1]
    # A             = [ +1,  -1,   +1,  +1,  +1]
    # t0: A(r-1) = +1 * (1.25 - 1) > 0 and |0.5 - 0.4| = 0.1 > 1e-3   -> drop
    # t1: A(r-1) < 0 (pull-back)                                       -> keep
    # t2: outward but |0.5 - 0.4995| = 5e-4 <= 1e-3                    -> keep
    # t3: A(r-1) = (0.833 - 1) < 0                                     -> keep
    # t4: outward, |0.2 - 0.1| = 0.1                                   -> drop
    pi = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.2]], dtype=F64)
    mu = torch.tensor([[0.4, 0.4, 0.4995, 0.6, 0.1]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0]], dtype=F64)
    m = C.dppo_tv_mask(torch.log(pi), torch.log(mu), adv, delta=1e-3)
    torch.testing.assert_close(m, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64))
    # per-sequence A = +1 for every token: t1 becomes outward (r = 1.25, |diff| = 0.1) -> drop
    m1 = C.dppo_tv_mask(torch.log(pi), torch.log(mu), torch.tensor([1.0], dtype=F64))
    torch.testing.assert_close(m1, torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0]], dtype=F64))


def test_m2po_hand_case():
    # m = (old - mu)^2 on active tokens = [0.01, 0.09, 0.0, 0.25, 0.04]; pad slot huge.
    # ascending [0, .01, .04, .09, .25]: prefix means 0, .005, .01667, .035, .078
    # tau = 0.04: largest n with mean < tau is 4 -> drop only the 0.25 token.
    old = torch.tensor([[0.1, 0.3, 0.0], [0.5, 0.2, 9.0]], dtype=F64)
    mu = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep = C.m2po_mask(old, mu, mask, tau=0.04)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], dtype=F64))
    # tau = 0.035: the 4-token mean 0.035 is not < 0.035 -> also drop 0.09
    keep = C.m2po_mask(old, mu, mask, tau=0.035)
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=F64))
    # everything below tau: keep every active token, never padding
    keep = C.m2po_mask(old, mu, mask, tau=1.0)
    torch.testing.assert_close(keep, mask.to(F64))
    assert C.m2po_mask(old, mu, torch.zeros(2, 3)).sum() == 0


def test_m2po_random_against_loop():
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        old = torch.randn(5, 7, generator=g, dtype=F64) * 0.3
        mu = torch.randn(5, 7, generator=g, dtype=F64) * 0.1
        mask = torch.rand(5, 7, generator=g) > 0.3
        keep = C.m2po_mask(old, mu, mask, tau=0.04)
        vals = sorted(
            (float(old[b, t] - mu[b, t]) ** 2, (b, t))
            for b in range(5)
            for t in range(7)
            if mask[b, t]
        )
        n = 0
        while n < len(vals) and sum(v for v, _ in vals[: n + 1]) / (n + 1) < 0.04:
            n += 1
        expected = torch.zeros(5, 7, dtype=F64)
        for _, (b, t) in vals[:n]:
            expected[b, t] = 1.0
        torch.testing.assert_close(keep, expected)
        kept = [v for v, _ in vals[:n]]
        assert not kept or sum(kept) / len(kept) < 0.04


# ----------------------------------------------------------------------------- registry
def batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = mu + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g, dtype=F64)
    return dict(logp=logp, rollout_logp=mu, old_logp=old, advantages=adv, mask=mask)


def loss_and_grad(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return loss.detach(), g


def test_valid_names_and_unknown_names():
    names = R.valid_names()
    assert names["algorithms"] == sorted(
        [
            "ppo",
            "grpo",
            "gspo",
            "gspo_token",
            "dppo_tv",
            "decoupled_ppo",
            "m2po",
            "a3po",
            "vcpo",
        ]
    )
    assert names["corrections"] == sorted(["none", "tis", "mis", "icepop"])
    with pytest.raises(ValueError, match="valid: a3po, decoupled_ppo, dppo_tv, grpo"):
        loss_of(LossConfig("sat", "none"), **batch())
    with pytest.raises(ValueError, match="valid: icepop, mis, none, tis"):
        R.needs_old_logp("grpo", "is")
    with pytest.raises(ValueError, match="valid: rollout, recompute"):
        R.needs_old_logp("grpo", "none", ratio_denominator="old")


@pytest.mark.parametrize(
    "algo,corr,den,expected",
    [
        ("grpo", "none", "rollout", False),
        ("grpo", "none", "recompute", True),
        ("gspo", "tis", "rollout", True),
        ("gspo_token", "icepop", "rollout", True),
        ("ppo", "mis", "rollout", True),
        ("dppo_tv", "none", "rollout", False),
        ("decoupled_ppo", "none", "rollout", True),
        ("m2po", "none", "rollout", True),
        ("a3po", "none", "rollout", False),
        ("vcpo", "none", "recompute", False),
    ],
)
def test_needs_old_logp(algo, corr, den, expected):
    assert R.needs_old_logp(algo, corr, ratio_denominator=den) is expected


def test_grpo_plain_uses_rollout_denominator():
    b = batch()
    got = loss_and_grad(loss_of(LossConfig("grpo", "none"), **b)[0], b["logp"])
    ref = loss_and_grad(
        policy_loss(b["logp"], b["rollout_logp"], b["advantages"], b["mask"])[0], b["logp"]
    )
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    rec = loss_of(LossConfig("grpo", "none", ratio_denominator="recompute"), **b)[0]
    assert torch.equal(rec, policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"])[0])


@pytest.mark.parametrize(
    "algo,level", [("grpo", "token"), ("gspo", "sequence"), ("gspo_token", "sequence_token")]
)
@pytest.mark.parametrize("corr", ["tis", "mis", "icepop"])
def test_corrections_weight_the_old_ratio_term(algo, level, corr):
    # S = w * min(r A, clip(r) A), r = pi_theta / pi_old, w = f(pi_old / mu): check by hand
    b = batch(1)
    w = {"tis": C.tis_weights, "mis": C.mis_weights, "icepop": C.icepop_weights}[corr](
        b["old_logp"], b["rollout_logp"]
    )
    loss, m = loss_of(LossConfig(algo, corr, adaptive=True), **b)
    got = loss_and_grad(loss, b["logp"])
    ref_loss, _ = policy_loss(
        b["logp"],
        b["old_logp"],
        b["advantages"],
        b["mask"],
        LossConfig(adaptive=True),
        level=level,
        token_weights=w,
    )
    ref = loss_and_grad(ref_loss, b["logp"])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert m["loss/token_weight_mean"] == pytest.approx(float(w[b["mask"]].mean()))
    # d̄π against mu, whatever the ratio's denominator (here pi_old)
    d_mu = (b["logp"].detach() - b["rollout_logp"])[b["mask"]].abs().mean()
    assert m["staleness/abs_logratio_mean_mu"] == pytest.approx(float(d_mu), rel=1e-12)
    d_old = (b["logp"].detach() - b["old_logp"])[b["mask"]].abs().mean()
    assert m["staleness/abs_logratio_mean"] == pytest.approx(float(d_old), rel=1e-12)


def test_tis_grpo_against_scalar_formula():
    # token-mean of w * min(r A, clip(r, 0.8, 1.2) A) with r = exp(logp - old), w = min(exp(old - mu), 2)
    b = batch(2)
    loss, _ = loss_of(LossConfig("grpo", "tis"), **b)
    tot, n = 0.0, 0
    for i in range(4):
        for t in range(6):
            if b["mask"][i, t]:
                r = math.exp(float(b["logp"].detach()[i, t] - b["old_logp"][i, t]))
                w = min(math.exp(float(b["old_logp"][i, t] - b["rollout_logp"][i, t])), 2.0)
                a = float(b["advantages"][i])
                tot += w * min(r * a, min(max(r, 0.8), 1.2) * a)
                n += 1
    assert loss.item() == pytest.approx(-tot / n, rel=1e-12)


def test_dppo_tv_composition():
    b = batch(3)
    mask_tv = C.dppo_tv_mask(b["logp"], b["rollout_logp"], b["advantages"], delta=1e-2)
    loss, m = loss_of(LossConfig("dppo_tv", "none", dppo_delta=1e-2), **b)
    ref, _ = policy_loss(
        b["logp"], b["rollout_logp"], b["advantages"], b["mask"], token_weights=mask_tv
    )
    got, want = loss_and_grad(loss, b["logp"]), loss_and_grad(ref, b["logp"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < m["loss/token_weight_zero_frac"] < 1


def test_decoupled_ppo_composition():
    # S = sg[pi_old / mu] * min(r_prox A, clip(r_prox) A), r_prox = pi_theta / pi_old
    b = batch(4)
    loss, _ = loss_of(LossConfig("decoupled_ppo", "none", behav_cap=1.5, behav_mode="mask"), **b)
    w = C.behaviour_weights(b["old_logp"], b["rollout_logp"], cap=1.5, mode="mask")
    ref, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], token_weights=w)
    assert torch.equal(loss, ref)


def test_m2po_composition_is_unclipped_masked_ratio():
    # J = token-mean of M * (pi_theta / pi_old) * A, no clip
    b = batch(5)
    loss, m = loss_of(LossConfig("m2po", "none", m2po_tau=0.02), **b)
    keep = C.m2po_mask(b["old_logp"], b["rollout_logp"], b["mask"], tau=0.02)
    r = torch.exp(b["logp"].detach() - b["old_logp"])
    adv = b["advantages"][:, None].expand_as(r)
    act = b["mask"]
    expected = -(keep * r * adv)[act].sum() / act.sum()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-14)
    assert m["loss/clipfrac"] == 0.0 and m["loss/token_weight_zero_frac"] > 0


def test_invalid_combinations():
    b = batch()
    with pytest.raises(ValueError, match="mismatch treatment"):
        loss_of(LossConfig("dppo_tv", "tis"), **b)
    with pytest.raises(ValueError, match="no"):
        loss_of(LossConfig("m2po", "none", adaptive=True), **b)
    with pytest.raises(ValueError, match="needs old_logp"):
        loss_of(LossConfig("grpo", "tis"), **b | {"old_logp": None})


@pytest.mark.parametrize(
    "algo,corr,den,expected",
    [
        ("grpo", "none", "rollout", ("token", "rollout", False, True)),
        ("grpo", "none", "recompute", ("token", "old", True, True)),
        ("gspo", "tis", "rollout", ("sequence", "old", True, True)),
        ("gspo_token", "none", "rollout", ("sequence_token", "rollout", False, True)),
        ("dppo_tv", "none", "recompute", ("token", "rollout", False, True)),
        ("decoupled_ppo", "none", "rollout", ("token", "old", True, True)),
        ("m2po", "none", "rollout", ("token", "old", True, False)),
        ("a3po", "none", "rollout", ("token", "custom", False, True)),
        ("vcpo", "none", "rollout", ("token", "custom", False, False)),
    ],
)
def test_resolve_spec(algo, corr, den, expected):
    spec = R.resolve(algo, corr, den)
    assert (spec.level, spec.denominator, spec.needs_old_logp, spec.clip) == expected
    assert (spec.algo, spec.correction) == (algo, corr)
