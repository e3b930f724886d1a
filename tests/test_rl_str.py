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
    """KL(Bern(mu) || Bern(p)) in Python floats from the definition (1 - x as -expm1(log x))."""
    mu, one_m_mu, one_m_p = math.exp(lmu), -math.expm1(lmu), -math.expm1(lp)
    out = mu * (lmu - lp)
    if one_m_mu > 0.0:
        out += one_m_mu * (math.log(one_m_mu) - math.log(one_m_p))
    return out


def test_bernoulli_kl_hand_cases():
    lmu = torch.tensor([LN(0.5), 0.0, LN(0.9), LN(0.25)], dtype=F64)
    lp = torch.tensor([LN(0.25), LN(0.5), LN(0.9), LN(0.5)], dtype=F64)
    # mu=.5, p=.25: .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln(4/3)
    # mu=1,  p=.5:  1 ln(1/.5) + 0 = ln 2             (0 log 0 = 0)
    # mu=p=.9:      0
    # mu=.25, p=.5: .25 ln(.5) + .75 ln(.75/.5) = .75 ln 3 - ln 2
    want = torch.tensor([0.5 * LN(4 / 3), LN(2), 0.0, 0.75 * LN(3) - LN(2)], dtype=F64)
    torch.testing.assert_close(bernoulli_kl(lmu, lp), want, rtol=1e-14, atol=1e-15)
    # p = 1 with mu < 1 would be +inf: 1 - p is clamped, so the KL is large and finite
    big = bernoulli_kl(torch.tensor([LN(0.5)], dtype=F64), torch.tensor([0.0], dtype=F64))
    assert torch.isfinite(big).all() and float(big) > 100
    # near p = 1, 1 - p must not be 1 - exp(lp) (which loses ~4 digits at lp = -1e-12):
    # KL = .5 (ln .5 + 1e-12) + .5 (ln .5 - ln(1e-12 - 5e-25)) = ln .5 + 6 ln 10 + O(1e-12)
    near = bernoulli_kl(torch.tensor([LN(0.5)], dtype=F64), torch.tensor([-1e-12], dtype=F64))
    torch.testing.assert_close(
        near, torch.tensor([LN(0.5) + 6 * LN(10)], dtype=F64), rtol=1e-12, atol=0
    )


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
            logp=lp, rollout_logp=mu, advantages=adv, mask=mask, old_logp=lp,
        )  # fmt: skip


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
    from sat_cli.build import loss_config
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
