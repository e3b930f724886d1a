"""The sequence trust region (``sat_cli.rl.seq_trust``, ``LossConfig.str_delta``): the Bernoulli
KL against its formula by hand and in a float64 loop, the keep/drop decision at the boundary,
and its composition with every clipped algorithm in ``registry.compute``."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import loss_of

from sat_cli import metric_names as M
from sat_cli.rl import corrections as C
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss
from sat_cli.rl.seq_trust import bernoulli_kl, str_keep

F64 = torch.float64
LN = math.log


def _kl_ref(lmu: float, lp: float) -> float:
    """The reference's gate (FlashREINFORCE ``flashreinforce_loss``) in Python floats: both
    probabilities clamped to [1e-6, 1 - 1e-6], then KL(Bern(mu) || Bern(p))."""
    mu = min(max(math.exp(lmu), 1e-6), 1 - 1e-6)
    p = min(max(math.exp(lp), 1e-6), 1 - 1e-6)
    return mu * (math.log(mu) - math.log(p)) + (1 - mu) * (math.log1p(-mu) - math.log1p(-p))


def test_bernoulli_kl_hand_cases():
    lmu = torch.tensor([LN(0.5), LN(0.9), LN(0.25)], dtype=F64)
    lp = torch.tensor([LN(0.25), LN(0.9), LN(0.5)], dtype=F64)
    # mu=.5, p=.25: .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln(4/3)
    # mu=p=.9:      0
    # mu=.25, p=.5: .25 ln(.5) + .75 ln(.75/.5) = .75 ln 3 - ln 2
    want = torch.tensor([0.5 * LN(4 / 3), 0.0, 0.75 * LN(3) - LN(2)], dtype=F64)
    torch.testing.assert_close(bernoulli_kl(lmu, lp), want, rtol=1e-14, atol=1e-15)
    # near-certain tokens: both probabilities clamp to 1 - 1e-6, as the reference's gate does.
    # mu = .5, p = 1 (or 1 - 1e-12): .5 ln(.5 / (1 - 1e-6)) + .5 ln(.5 / 1e-6), about 6.21
    clamp_case = 0.5 * LN(0.5 / (1 - 1e-6)) + 0.5 * LN(0.5 / 1e-6)
    for lp1 in (0.0, -1e-12):
        got = bernoulli_kl(torch.tensor([LN(0.5)], dtype=F64), torch.tensor([lp1], dtype=F64))
        assert float(got) == pytest.approx(clamp_case, rel=1e-9)  # 1 - (1 - 1e-6) rounds
        assert float(got) == pytest.approx(_kl_ref(LN(0.5), lp1), rel=1e-12)
    # mu = 1 and p = 1 - 1e-9: both clamp to 1 - 1e-6, KL 0 (unclamped it would be ~2e-8);
    # mu = 1 - 1e-3, p = 1 - 1e-9: unclamped (1 - mu) ln((1 - mu)/(1 - p)) = 1e-3 ln 1e6 = .0138
    # plus mu ln(mu/p) = -.0010: .0128; clamped, (1 - p) = 1e-6 gives 1e-3 ln 1e3 - .0010 = .0059
    both = bernoulli_kl(
        torch.tensor([0.0, math.log1p(-1e-3)], dtype=F64),
        torch.tensor([math.log1p(-1e-9), math.log1p(-1e-9)], dtype=F64),
    )
    assert float(both[0]) == pytest.approx(0.0, abs=1e-18)
    want1 = _kl_ref(math.log1p(-1e-3), math.log1p(-1e-9))
    assert float(both[1]) == pytest.approx(want1, rel=1e-12)
    assert want1 == pytest.approx(1e-3 * LN(1e3) - 1e-3 + 5e-7, rel=1e-3)


def test_str_follows_the_reference_gate_with_its_delta():
    """A response of near-certain tokens, where the clamp decides: the reference's gate keeps it
    at its default delta 3e-3; the unclamped KL of the first version dropped it."""
    from sat_cli.rl.seq_trust import REFERENCE_DELTA

    assert REFERENCE_DELTA == 3e-3
    lmu = torch.tensor([[math.log1p(-1e-3), LN(0.6), LN(0.3)]], dtype=F64)
    lp = torch.tensor([[math.log1p(-1e-10), LN(0.6), LN(0.3)]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    ref = sum(_kl_ref(float(a), float(b)) for a, b in zip(lmu[0], lp[0], strict=True)) / 3
    # unclamped: (1 - mu) ln((1 - mu)/(1 - p)) + mu ln(mu/p) = 1e-3 ln 1e7 - 1e-3 (to 1e-9)
    unclamped = (1e-3 * LN(1e7) - 1e-3) / 3
    assert ref < REFERENCE_DELTA < unclamped  # about 1.97e-3 against 5.04e-3
    keep, metrics = str_keep(lp, lmu, mask, REFERENCE_DELTA)
    assert keep.tolist() == [[1.0, 1.0, 1.0]]
    assert metrics[M.STR_SEQ_KL_MEAN] == pytest.approx(ref, rel=1e-9)


def _random(seed, B=5, T=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 3  # log mu in (-3, 0]
    lp = (mu + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-6)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False  # a row without active tokens: kept, not counted
    adv = torch.randn(B, generator=g, dtype=F64)
    return lp, mu, mask, adv


def _ref_keep(lp, mu, mask, delta):
    """The float64 loop: mean token KL per response, keep iff <= delta."""
    B, T = lp.shape
    keep, kls = [], []
    for b in range(B):
        vals = [_kl_ref(float(mu[b, t]), float(lp[b, t])) for t in range(T) if mask[b, t]]
        seq = sum(vals) / len(vals) if vals else 0.0
        keep.append(1.0 if (not vals or seq <= delta) else 0.0)
        if vals:
            kls.append(seq)
    return keep, kls


def _mid_delta(lp, mu, mask):
    """A delta halfway between the two middle sequence KLs (the exact boundary, where float
    rounding decides, is the hand case's business)."""
    kls = sorted(_ref_keep(lp, mu, mask, math.inf)[1])
    return (kls[len(kls) // 2 - 1] + kls[len(kls) // 2]) / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_str_keep_against_float64_loop(seed):
    lp, mu, mask, _ = _random(seed)
    delta = _mid_delta(lp, mu, mask)
    keep, metrics = str_keep(lp, mu, mask, delta)
    ref_keep, ref_kls = _ref_keep(lp, mu, mask, delta)
    assert keep.shape == lp.shape
    assert keep[:, 0].tolist() == ref_keep and torch.equal(keep, keep[:, :1].expand_as(keep))
    dropped = ref_keep.count(0.0)
    assert 0 < dropped < len(ref_kls)
    assert metrics[M.STR_DROP_FRAC] == pytest.approx(dropped / len(ref_kls), abs=0)
    assert metrics[M.STR_SEQ_KL_MEAN] == pytest.approx(sum(ref_kls) / len(ref_kls), rel=1e-12)


def test_boundary_hand_case():
    # one response of two tokens: (mu, p) = (.5, .25) and (.25, .5)
    # mean KL = (.5 ln(4/3) + .75 ln 3 - ln 2) / 2 = (0.143841 + 0.130812) / 2 = 0.137327
    lmu = torch.tensor([[LN(0.5), LN(0.25)]], dtype=F64)
    lp = torch.tensor([[LN(0.25), LN(0.5)]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    seq = (0.5 * LN(4 / 3) + 0.75 * LN(3) - LN(2)) / 2
    assert seq == pytest.approx(0.1373265, abs=1e-7)
    value = float(bernoulli_kl(lmu, lp).mean())  # the module's own float64 value
    assert value == pytest.approx(seq, rel=1e-14)
    keep, m = str_keep(lp, lmu, mask, value)  # == delta: kept (<=)
    assert keep.tolist() == [[1.0, 1.0]] and m[M.STR_DROP_FRAC] == 0.0
    keep, m = str_keep(lp, lmu, mask, math.nextafter(value, 0.0))  # just above delta: dropped
    assert keep.tolist() == [[0.0, 0.0]] and m[M.STR_DROP_FRAC] == 1.0
    assert m[M.STR_SEQ_KL_MEAN] == pytest.approx(seq, rel=1e-14)


def _ref_ppo_loss(lp, mu, adv, mask, keep, eps=0.2):
    """Token-mean PPO clip with the keep factor, float64 loop (registry's default algorithm)."""
    total, n = 0.0, 0
    B, T = lp.shape
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            r = math.exp(float(lp[b, t] - mu[b, t]))
            a = float(adv[b])
            s = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            total += s * keep[b]
            n += 1
    return -total / max(n, 1)


@pytest.mark.parametrize("seed", [0, 3])
def test_grpo_with_str_against_float64_loop_and_gradient(seed):
    lp, mu, mask, adv = _random(seed, spread=0.3)
    delta = _mid_delta(lp, mu, mask)
    keep, _ = _ref_keep(lp, mu, mask, delta)
    logp = lp.clone().requires_grad_(True)
    cfg = LossConfig(str_delta=delta)
    loss, metrics = loss_of(cfg, logp=logp, rollout_logp=mu, advantages=adv, mask=mask)
    assert float(loss.detach()) == pytest.approx(_ref_ppo_loss(lp, mu, adv, mask, keep), rel=1e-12)
    loss.backward()
    # dropped responses get no gradient; kept ones exactly the plain GRPO gradient
    base = lp.clone().requires_grad_(True)
    loss_of(LossConfig(), logp=base, rollout_logp=mu, advantages=adv, mask=mask)[0].backward()
    for b, k in enumerate(keep):
        want = base.grad[b] if k else torch.zeros_like(base.grad[b])
        torch.testing.assert_close(logp.grad[b], want, rtol=0, atol=0)
    assert metrics[M.TOKEN_WEIGHT_ZERO_FRAC] > 0  # the keep factor is a per-token factor


@pytest.mark.parametrize(
    "algo,correction,level",
    [
        ("grpo", "tis", "token"),
        ("gspo", "none", "sequence"),
        ("gspo_token", "none", "sequence_token"),
        ("dppo_tv", "none", "token"),
        ("ppo", "none", "token"),
    ],
)
def test_str_composes_with_every_clipped_algorithm(algo, correction, level):
    lp, mu, mask, adv = _random(4, spread=0.3)
    old = lp + 0.05
    delta = _mid_delta(lp, mu, mask)
    keep = torch.tensor(_ref_keep(lp, mu, mask, delta)[0], dtype=F64)[:, None].expand_as(lp)
    cfg = LossConfig(algo=algo, correction=correction, str_delta=delta, adaptive=True)
    tensors = dict(logp=lp, rollout_logp=mu, advantages=adv, mask=mask, old_logp=old)
    loss, metrics = loss_of(cfg, **tensors)
    factor = keep
    denom = mu
    if correction == "tis":
        factor, denom = C.tis_weights(old, mu) * keep, old
    if algo == "dppo_tv":
        factor = C.dppo_tv_mask(lp, mu, adv) * keep
    base = cfg.replace(str_delta=None)
    want, _ = policy_loss(lp, denom, adv, mask, base, level=level, token_weights=factor)
    assert float(loss) == float(want)
    assert metrics[M.STR_DROP_FRAC] == pytest.approx(float((keep[:, 0] == 0).sum()) / 4, abs=0)


@pytest.mark.parametrize("algo", ["m2po", "vcpo", "decoupled_ppo", "a3po"])
def test_str_refused_without_a_plain_clip(algo):
    lp, mu, mask, adv = _random(0)
    with pytest.raises(ValueError, match="str_delta compose with the algorithms"):
        loss_of(
            LossConfig(algo=algo, str_delta=0.1),
            logp=lp,
            rollout_logp=mu,
            advantages=adv,
            mask=mask,
            old_logp=lp,
        )


def test_off_by_default_and_empty_mask():
    lp, mu, mask, adv = _random(0)
    _, metrics = loss_of(LossConfig(), logp=lp, rollout_logp=mu, advantages=adv, mask=mask)
    assert M.STR_DROP_FRAC not in metrics and M.TOKEN_WEIGHT_MEAN not in metrics
    empty = torch.zeros_like(mask)
    logp = lp.clone().requires_grad_(True)
    loss, metrics = loss_of(
        LossConfig(str_delta=0.01), logp=logp, rollout_logp=mu, advantages=adv, mask=empty
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and metrics[M.STR_DROP_FRAC] == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(lp))


def test_config_settings_and_refusals():
    from sat_cli.build.parts import loss_config
    from sat_cli.config import ConfigError, load

    _, obj = load(["algo=gspo", "algo.str_delta=0.1"])
    assert loss_config(obj).str_delta == 0.1
    assert loss_config(load([])[1]).str_delta is None  # off by default
    with pytest.raises(ConfigError, match="algo.str_delta compose with algo="):
        load(["algo=m2po", "clip=ppo", "algo.str_delta=0.1"])
    with pytest.raises(ConfigError, match="algo.str_delta"):
        load(["algo.str_delta=0"])
    with pytest.raises(ConfigError, match="score_centering_topk"):
        load(["algo.score_centering=true"])
    with pytest.raises(ConfigError, match="no estimator for algo=gspo"):
        load(["algo=gspo", "algo.score_centering=true", "algo.score_centering_topk=4"])
    _, obj = load(["algo.score_centering=true", "algo.score_centering_topk=4"])
    assert loss_config(obj).score_centering
