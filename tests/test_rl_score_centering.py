"""Score centering (``sat_cli.rl.score_centering``, ``LossConfig.score_centering``): hand values
of rho, the coefficients and C; the gradient of A * C against its closed form; the zero gradient
when sampler and trainer agree; a float64 loop over random top-k heads with padding; and the
composition in ``registry.compute`` (aggregation, the trust region, refusals)."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import loss_of

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import aggregate
from sat_cli.rl.score_centering import (
    NO_IS,
    Weight,
    centering_coefficients,
    score_centering_term,
)

F64 = torch.float64
LN = math.log


def _hand():
    # trainer: p = softmax(ln [4, 2, 1, 1]) = [.5, .25, .125, .125]; sampler head H = {0, 1}
    # with q_H = [.4, .3]. sum_H q = .7, sum_H p = .75, rho = (1 - .7) / (1 - .75) = 1.2
    z = torch.tensor([LN(4), LN(2), 0.0, 0.0], dtype=F64, requires_grad=True)
    ids = torch.tensor([0, 1])
    q = torch.tensor([0.4, 0.3], dtype=F64)
    return z, ids, q


@pytest.mark.parametrize(
    "weight,want_c,want_alpha",
    [
        # no IS: m = q = [.4, .3], alpha = rho = 1.2; c = m - alpha p = [.4 - .6, .3 - .3]
        (NO_IS, [-0.2, 0.0], 1.2),
        # TIS (.9, 1.1): m = clamp(p, .9q, 1.1q) = [clamp(.5, .36, .44), clamp(.25, .27, .33)]
        # = [.44, .27]; alpha = clamp(1, .9*1.2, 1.1*1.2) = clamp(1, 1.08, 1.32) = 1.08;
        # c = [.44 - 1.08*.5, .27 - 1.08*.25] = [-.1, 0]
        (Weight("clamp", 0.9, 1.1), [-0.1, 0.0], 1.08),
        # this project's tis (0, C = 1.1): m = min(p, 1.1 q) = [.44, .25]; alpha = min(1, 1.32)
        # = 1; c = [.44 - .5, .25 - .25] = [-.06, 0]
        (Weight("clamp", 0.0, 1.1), [-0.06, 0.0], 1.0),
        # untruncated IS (huge cap): m = p, alpha = 1, c = 0; the ratio against mu: the same
        (Weight("clamp", 0.0, 1e9), [0.0, 0.0], 1.0),
        (Weight("ratio"), [0.0, 0.0], 1.0),
        # MIS cap 1.1: k = p/q = [1.25, .833]: m = [0, .25]; tail k = 1/rho = .833 <= 1.1:
        # alpha = 1; c = [0 - .5, .25 - .25]
        (Weight("mask", 0.0, 1.1), [-0.5, 0.0], 1.0),
        # IcePop (.9, 1.3): m = [.5, 0] (.833 < .9); tail k = .833 outside: alpha = 0; c = m
        (Weight("mask", 0.9, 1.3), [0.5, 0.0], 0.0),
    ],
)
def test_hand_coefficients_term_and_gradient(weight, want_c, want_alpha):
    z, ids, q = _hand()
    logp = torch.log_softmax(z, -1)[ids].view(1, 1, 2)  # [B=1, T=1, K=2], with grad
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    c, stats = centering_coefficients(logp, q.log().view(1, 1, 2), valid, weight)
    torch.testing.assert_close(c.view(-1), torch.tensor(want_c, dtype=F64), rtol=0, atol=1e-15)
    assert float(stats["rho"]) == pytest.approx(1.2, rel=1e-14)
    assert float(stats["alpha"]) == pytest.approx(want_alpha, rel=1e-14)
    assert (float(stats["sampler_head"]), float(stats["policy_head"])) == pytest.approx((0.7, 0.75))
    term, _ = score_centering_term(logp, q.log().view(1, 1, 2), valid, weight)
    # C = sum_H c_v log p_v: e.g. no IS: -.2 ln .5 + 0 ln .25 = .2 ln 2
    want_term = want_c[0] * LN(0.5) + want_c[1] * LN(0.25)
    assert float(term.detach()) == pytest.approx(want_term, rel=1e-12, abs=1e-15)
    # gradient of A * C w.r.t. the logits: A * sum_H c_v (e_v - p), d log p_v / dz = e_v - p
    A = -1.7
    (A * term.sum()).backward()
    p = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=F64)
    by_hand = torch.zeros(4, dtype=F64)
    for v, cv in zip(ids.tolist(), want_c, strict=True):
        by_hand += A * cv * (torch.nn.functional.one_hot(torch.tensor(v), 4).to(F64) - p)
    torch.testing.assert_close(z.grad, by_hand, rtol=0, atol=1e-15)


WEIGHTS = [
    NO_IS,
    Weight("clamp", 0.0, 2.0),
    Weight("clamp", 0.5, 1.5),
    Weight("ratio"),
    Weight("mask", 0.0, 2.0),
    Weight("mask", 0.5, 5.0),
]


@pytest.mark.parametrize("weight", WEIGHTS)
def test_no_mismatch_gives_zero_gradient(weight):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 6, generator=g, dtype=F64, requires_grad=True)  # [B, T, V]
    full = torch.log_softmax(z, -1)  # H = the whole vocabulary, q == p exactly
    valid = torch.ones(3, 4, 6, dtype=torch.bool)
    term, _ = score_centering_term(full, full.detach(), valid, weight)
    (torch.randn(3, 4, generator=g, dtype=F64) * term).sum().backward()
    torch.testing.assert_close(z.grad, torch.zeros_like(z), rtol=0, atol=1e-15)
    # a partial head with q == p: rho = 1, so every coefficient is exactly 0
    z.grad = None
    head = torch.log_softmax(z, -1)[..., :3]
    c, stats = centering_coefficients(head, head.detach(), valid[..., :3], weight)
    assert torch.equal(c, torch.zeros_like(c))
    torch.testing.assert_close(stats["rho"], torch.ones(3, 4, dtype=F64))


def _ref_term(lp, lq, valid, weight):
    """Python-float loop: rho, m, alpha, c and C = sum c log p per position, from w(k) alone:
    m_v = q_v w(p_v/q_v) on the head, alpha = rho w(1/rho) (the tail's q = rho p)."""
    kind, lo, hi = weight.kind, weight.lo, weight.hi
    w = {
        "ratio": lambda k: k,
        "one": lambda k: 1.0,
        "clamp": lambda k: min(max(k, lo), hi),
        "mask": lambda k: k if lo <= k <= hi else 0.0,
    }[kind]
    B, T, K = lp.shape
    out = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            vs = [k for k in range(K) if valid[b, t, k]]
            p = {k: math.exp(float(lp[b, t, k])) for k in vs}
            q = {k: math.exp(float(lq[b, t, k])) for k in vs}
            rho = max(1 - sum(q.values()), 0.0) / max(1 - sum(p.values()), 1e-6)
            m = {k: q[k] * w(p[k] / q[k]) for k in vs}
            alpha = rho * w(1 / rho) if rho > 0 else float(kind == "ratio")
            out[b, t] = sum((m[k] - alpha * p[k]) * float(lp[b, t, k]) for k in vs)
    return out


def _random_head(seed, B=4, T=5, K=3, V=7):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=F64)
    zq = z + 0.4 * torch.randn(B, T, V, generator=g, dtype=F64)  # the sampler's own logits
    ids = torch.argsort(zq, -1, descending=True)[..., :K]  # the sampler's top-k
    lq = torch.log_softmax(zq, -1).gather(-1, ids)
    valid = torch.rand(B, T, K, generator=g) > 0.2
    valid[..., 0] = True
    z.requires_grad_(True)
    lp = torch.log_softmax(z, -1).gather(-1, ids)
    lp = torch.where(valid, lp, torch.full_like(lp, float("nan")))  # padding: garbage
    return z, lp, lq, valid


@pytest.mark.parametrize(
    "weight", [*WEIGHTS, Weight("clamp", 0.8, 1.25), Weight("mask", 0.8, 1.25)]
)
def test_term_against_float64_loop(weight):
    z, lp, lq, valid = _random_head(1)
    term, _ = score_centering_term(lp, lq, valid, weight)
    ref = _ref_term(lp.detach(), lq, valid, weight)
    torch.testing.assert_close(term, ref, rtol=1e-12, atol=1e-15)
    term.sum().backward()
    assert torch.isfinite(z.grad).all()  # NaN padding never reaches the gradient


def _inputs(seed=2, B=4, T=5):
    z, lp, lq, valid = _random_head(seed, B, T)
    g = torch.Generator().manual_seed(seed + 100)
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 2
    logp = (mu + 0.1 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_(True)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=F64)
    return dict(
        logp=logp,
        rollout_logp=mu,
        advantages=adv,
        mask=mask,
        old_logp=mu + 0.02,
        policy_topk_logp=lp,
        sampler_topk_logp=lq,
        topk_valid=valid,
    ), z


@pytest.mark.parametrize(
    "algo,correction,denom,agg,weight",
    [
        ("grpo", "none", "recompute", "token-mean", NO_IS),
        ("grpo", "none", "rollout", "token-mean", Weight("ratio")),  # c = 0: a no-op there
        ("grpo", "tis", "rollout", "seq-mean-token-sum", Weight("clamp", 0.0, 1.5)),
        ("ppo", "mis", "rollout", "seq-mean-token-mean", Weight("mask", 0.0, 1.5)),
        ("grpo", "icepop", "rollout", "token-mean", Weight("mask", 0.9, 1.1)),
        # GSPO aggregates seq-mean-token-mean whatever agg says
        ("gspo", "none", "recompute", "token-mean", NO_IS),
    ],
)
def test_loss_is_base_plus_aggregated_a_times_c(algo, correction, denom, agg, weight):
    x, _ = _inputs()
    cfg = LossConfig(
        algo=algo,
        correction=correction,
        agg=agg,
        tis_cap=1.5,
        ratio_denominator=denom,
        icepop_low=0.9,
        icepop_high=1.1,
    )
    loss, metrics = loss_of(cfg.replace(score_centering=True), **x)
    base, _ = loss_of(cfg, **{k: v for k, v in x.items() if "topk" not in k})
    m = x["mask"]
    valid = x["topk_valid"] & m[..., None]
    ref = _ref_term(x["policy_topk_logp"].detach(), x["sampler_topk_logp"], valid, weight)
    per_token = torch.where(m, x["advantages"][:, None] * ref, 0.0)
    eff = agg if algo != "gspo" else "seq-mean-token-mean"
    extra = float(aggregate(per_token, m, int(m.sum()), eff))
    assert (metrics[M.CENTERING_TERM] == 0.0) == (weight.kind == "ratio")  # exactly, c = p - p
    assert float(loss.detach()) == pytest.approx(float(base.detach()) + extra, rel=1e-12)
    assert metrics[M.CENTERING_TERM] == pytest.approx(extra, rel=1e-12, abs=1e-15)
    assert metrics[M.LOSS_POLICY] == pytest.approx(float(base.detach()), rel=0)
    assert 0 < metrics[M.CENTERING_SAMPLER_HEAD] < 1 and 0 < metrics[M.CENTERING_POLICY_HEAD] < 1


# ----------------------------------------------------------------------------- exact expectation


def _categorical():
    """A 6-token categorical: trainer logits z (with grad), the sampler's head H = {0, 1, 2}
    with its own probabilities, and its tail exactly rho * p (the estimator's tail model)."""
    z = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4, 0.0], dtype=F64, requires_grad=True)
    p = torch.softmax(z.detach(), -1)
    head = torch.tensor([0, 1, 2])
    q_head = torch.tensor([0.36, 0.05, 0.29], dtype=F64)  # sum .7; p's head: about .58
    rho = (1 - q_head.sum()) / (1 - p[head].sum())
    q = p * rho
    q[head] = q_head
    return z, head, q


def _expected_gradient(cfg: LossConfig, z, head, q):
    """``sum_y q(y) grad_z loss(y)``: every token of the vocabulary as a one-token response
    with advantage 1, weighted by its probability under the sampler: no sampling."""
    total = torch.zeros_like(z)
    for y in range(z.numel()):
        z.grad = None
        logp_all = torch.log_softmax(z, -1)
        x = dict(
            logp=logp_all[y].view(1, 1),
            rollout_logp=q[y].log().view(1, 1),
            old_logp=logp_all[y].detach().view(1, 1),  # one optimizer step per batch
            advantages=torch.ones(1, dtype=F64),
            mask=torch.ones(1, 1, dtype=torch.bool),
            policy_topk_logp=logp_all[head].view(1, 1, -1),
            sampler_topk_logp=q[head].log().view(1, 1, -1),
            topk_valid=torch.ones(1, 1, head.numel(), dtype=torch.bool),
        )
        loss, _ = loss_of(cfg, **x)
        loss.backward()
        total += q[y] * z.grad
    return total


def _wide(algo: str, correction: str, denom: str) -> LossConfig:
    """Radii wide enough that no token is clipped; TIS, MIS and IcePop bounds that bite on some
    tokens of ``_categorical`` (p/q from .57 to 2.5; the tail 1.4)."""
    wide = dict(eps_low=0.9, eps_high=5.0, tis_cap=1.2, icepop_low=0.8, icepop_high=1.6)
    return LossConfig(algo=algo, correction=correction, ratio_denominator=denom, **wide)


@pytest.mark.parametrize(
    "algo,correction,denom",
    [
        ("grpo", "none", "rollout"),  # the default: the ratio against mu is already drift-free
        ("grpo", "none", "recompute"),
        ("grpo", "tis", "rollout"),
        ("grpo", "mis", "rollout"),
        ("grpo", "icepop", "rollout"),
        ("gspo", "none", "recompute"),
        ("gspo_token", "tis", "rollout"),
    ],
)
def test_centred_loss_has_zero_expected_gradient_under_the_sampler(algo, correction, denom):
    """With a constant advantage, the expected gradient over tokens drawn from the sampler
    (the drift) of base + A * C is zero, computed exactly over a small categorical; the base
    alone has a drift wherever its token weight is not the ratio against mu (so the test is
    not vacuous). The radii are wide enough that no token is clipped; the TIS, MIS and IcePop
    bounds bite on some tokens (p/q from .57 to 2.5; the tail 1.4)."""
    z, head, q = _categorical()
    p = torch.softmax(z.detach(), -1)
    assert float((p / q).min()) < 0.6 and float((p / q).max()) > 1.8
    cfg = _wide(algo, correction, denom).replace(dppo_delta=1.0)
    drift = _expected_gradient(cfg, z, head, q)
    centred = _expected_gradient(cfg.replace(score_centering=True), z, head, q)
    torch.testing.assert_close(centred, torch.zeros_like(centred), rtol=0, atol=1e-14)
    untouched = correction == "none" and denom == "rollout" and algo != "gspo"
    assert (float(drift.abs().max()) < 1e-14) == untouched, drift


def test_centering_refuses_a_sequence_ratio_against_mu():
    x, _ = _inputs()
    for algo in ("gspo", "gspo_token"):
        with pytest.raises(ValueError, match="no estimator for a sequence"):
            loss_of(LossConfig(algo=algo, score_centering=True), **x)


def test_trust_region_drops_the_centering_of_a_dropped_response():
    x, z = _inputs()
    x["logp"] = x["logp"].detach().clone()
    x["logp"][1] -= 3.0  # response 1 far from mu: its mean Bernoulli KL is large
    cfg = LossConfig(str_delta=0.05, score_centering=True, ratio_denominator="recompute")
    loss, metrics = loss_of(cfg, **x)
    assert metrics[M.STR_DROP_FRAC] == 0.25
    loss.backward()
    assert torch.equal(z.grad[1], torch.zeros_like(z.grad[1]))  # no centering gradient there
    assert z.grad[0].abs().sum() > 0


def test_refusals():
    x, _ = _inputs()
    with pytest.raises(ValueError, match="score_centering compose with the algorithms"):
        loss_of(LossConfig(algo="decoupled_ppo", score_centering=True), **x)
    bare = {k: v for k, v in x.items() if k != "sampler_topk_logp"}
    with pytest.raises(ValueError, match="needs policy_topk_logp, sampler_topk_logp"):
        loss_of(LossConfig(score_centering=True), **bare)
    _, metrics = loss_of(LossConfig(), **x)  # off by default: the top-k fields are not read
    assert M.CENTERING_TERM not in metrics


def test_config_refuses_centering_without_an_estimator():
    import subprocess
    import sys

    from sat_cli.config import ConfigError, load

    sc = ["algo.score_centering=true", "algo.score_centering_topk=4"]
    for algo in ("gspo", "gspo_token"):
        with pytest.raises(ConfigError, match=f"no estimator for algo={algo}"):
            load([f"algo={algo}", *sc])
        _, obj = load([f"algo={algo}", "algo.ratio_denominator=recompute", *sc])
        assert obj.algo.score_centering
    with pytest.raises(ConfigError, match="not drift-free on algo=dppo_tv"):
        load(["algo=dppo_tv", *sc])  # its keep-mask: no drift-free centering (issue 55)
    for correction in ("mis", "icepop"):  # defined now (docs/algorithms.md §5)
        assert load([f"algo.correction={correction}", *sc])[1].algo.correction == correction
    r = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "config", "algo=gspo", *sc],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no estimator for algo=gspo" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("denom", ["rollout", "recompute"])
@pytest.mark.parametrize("correction", ["none", "tis", "mis", "icepop"])
@pytest.mark.parametrize(
    "algo",
    ["ppo", "grpo", "gspo", "gspo_token", "dppo_tv", "decoupled_ppo", "m2po", "a3po", "vcpo"],
)
def test_centering_is_drift_free_on_every_base_it_accepts(algo, correction, denom):
    """Every algorithm x correction x ratio denominator that is a base (the loss takes it
    without centering): the config (``check_loss_additions``) and the loss refuse score
    centering alike, or the centred loss has zero expected gradient
    under the sampler (the exact 6-token expectation above) with each setting at its default
    (``dppo_delta`` 1e-3, where DPPO-TV's keep-mask bites; radii wide, so no clip does)."""
    from types import SimpleNamespace

    from sat_cli.config.additions import check_loss_additions
    from sat_cli.rl.names import ALGOS, CORRECTIONS, DENOMINATORS
    from sat_cli.validate import ConfigError

    assert algo in ALGOS and correction in CORRECTIONS and denom in DENOMINATORS  # every base
    assert len(ALGOS) * len(CORRECTIONS) * len(DENOMINATORS) == 72  # ... and no other
    z, head, q = _categorical()
    cfg = _wide(algo, correction, denom)
    algo_cfg = SimpleNamespace(
        name=algo,
        correction=correction,
        ratio_denominator=denom,
        str_delta=None,
        score_centering=True,
        score_centering_topk=3,
    )
    try:
        _expected_gradient(cfg, z, head, q)
    except ValueError:  # not a base with these inputs (no correction allowed, other inputs)
        with pytest.raises(ValueError):
            _expected_gradient(cfg.replace(score_centering=True), z, head, q)
        return
    try:
        check_loss_additions(algo_cfg)
    except ConfigError:
        with pytest.raises(ValueError, match="score.centering|no estimator"):
            _expected_gradient(cfg.replace(score_centering=True), z, head, q)
        return
    centred = _expected_gradient(cfg.replace(score_centering=True), z, head, q)
    torch.testing.assert_close(centred, torch.zeros_like(centred), rtol=0, atol=1e-14)


def test_dppo_tv_keeps_a_drift_that_centering_cannot_cancel():
    """Why score centering refuses DPPO-TV: against mu its token weight is k = p/q on the kept
    tokens, so the centering term is exactly 0 (c = p - p), and the keep-mask, which drops
    tokens by |p - q| > delta, leaves the base's drift in place."""
    z, head, q = _categorical()
    cfg = LossConfig(algo="dppo_tv", eps_low=0.9, eps_high=5.0)  # dppo_delta: its default 1e-3
    drift = _expected_gradient(cfg, z, head, q)
    assert float(drift.abs().max()) == pytest.approx(0.1363, abs=1e-4)
    with pytest.raises(ValueError, match="not drift-free on 'dppo_tv'"):
        _expected_gradient(cfg.replace(score_centering=True), z, head, q)
