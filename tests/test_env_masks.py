"""Multi-turn samples' environment masks (issue 43): ``collate`` puts ``Sample.loss_mask`` into
the batch's loss mask, and the losses and corrections then train on the model's tokens only.

Loss values and gradients of SAT-GRPO, GSPO, TIS, MIS and IcePop on collated multi-turn batches
are checked against the float64 loop reference of ``test_rl_losses`` over the model tokens (taken from the
samples themselves, not from the collated mask). The environment tokens are given log-ratios far
off every other token's, so counting any of them changes the loss, its gradient and SAT's
batch quantile.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_rl_losses import ref_policy_loss

from sat_cli import metric_names as M
from sat_cli.rl import registry
from sat_cli.rl.config import LossConfig
from sat_cli.rl.loss_io import LossInputs
from sat_cli.samples import Sample
from sat_cli.trainers.batch import collate

F64 = torch.float64


def multiturn_sample(g: torch.Generator, turns: int) -> Sample:
    """A trajectory of ``turns`` model turns with environment answers between them: random
    ids, behaviour log-probs on model tokens, 0.0 on environment tokens."""
    prompt = torch.randint(3, 50, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
    ids, logp, mask, turn_ids = [], [], [], []
    for k in range(turns):
        n = int(torch.randint(1, 5, (1,), generator=g))
        ids += torch.randint(3, 50, (n,), generator=g).tolist()
        logp += (-torch.rand(n, generator=g, dtype=F64) * 3).tolist()
        mask += [1] * n
        turn_ids += [k] * n
        if k < turns - 1:  # the environment's answer to turn k
            e = int(torch.randint(1, 4, (1,), generator=g))
            ids += torch.randint(3, 50, (e,), generator=g).tolist()
            logp += [0.0] * e
            mask += [0] * e
            turn_ids += [k] * e
    return Sample(
        prompt_ids=prompt.tolist(),
        response_ids=ids,
        rollout_logp=logp,
        finish_reason="stop",
        weight_version=0,
        loss_mask=mask,
        turn_ids=turn_ids,
    )


def multiturn_batch(seed: int, B: int = 6):
    """``(samples, batch, logp, old_logp, model_mask, advantages)``: the trainer's log-probs ``logp``
    (float64, with grad) are ``mu`` plus a heavy-tailed log-ratio on model tokens and ``-6``
    (``|d|`` = 6) on environment tokens; ``model_mask`` comes from the samples' own lists."""
    g = torch.Generator().manual_seed(seed)
    samples = [multiturn_sample(g, turns=1 + b % 3) for b in range(B)]
    adv = torch.randn(B, generator=g, dtype=F64)
    batch = collate(samples, adv, pad_id=0)
    mu = batch.rollout_logp.to(F64)
    model = torch.zeros(mu.shape, dtype=torch.bool)
    env = torch.zeros(mu.shape, dtype=torch.bool)
    for b, s in enumerate(samples):
        P = len(s.prompt_ids)
        for i, m in enumerate(s.loss_mask):
            (model if m else env)[b, P + i] = True
    z = torch.randn(3, *mu.shape, generator=g, dtype=F64)
    d = (0.1 * z[0] / torch.sqrt((z[1] ** 2 + z[2] ** 2) / 2)).clamp(-3, 3)
    logp = torch.where(env, torch.full_like(mu, -6.0), mu + d).requires_grad_()
    old = torch.where(env, torch.full_like(mu, -0.5), mu + 0.2 * torch.randn(mu.shape, generator=g))
    return samples, batch, logp, old, model, adv.float().to(F64)  # as collated (float32)


CASES = {
    "sat-grpo": dict(cfg=LossConfig("grpo", adaptive=True, quantile=0.8), level="token"),
    "sat-grpo-seqmean": dict(
        cfg=LossConfig("grpo", adaptive=True, agg="seq-mean-token-mean"), level="token"
    ),
    "gspo": dict(cfg=LossConfig("gspo"), level="sequence"),
    "sat-gspo": dict(cfg=LossConfig("gspo", adaptive=True, quantile=0.7), level="sequence"),
    "tis": dict(cfg=LossConfig("grpo", "tis"), level="token"),
    "sat-tis": dict(cfg=LossConfig("grpo", "tis", adaptive=True), level="token"),
    "gspo-tis": dict(cfg=LossConfig("gspo", "tis"), level="sequence"),
    "mis": dict(cfg=LossConfig("grpo", "mis", tis_cap=1.3), level="token"),
    "icepop": dict(
        cfg=LossConfig("grpo", "icepop", icepop_low=0.8, icepop_high=1.25), level="token"
    ),
}

# the corrections' weights of k = pi_old / mu, one model token at a time (ALGORITHMS.md §5)
WEIGHT = {
    "tis": lambda k, c: min(k, c.tis_cap),
    "mis": lambda k, c: k if k <= c.tis_cap else 0.0,
    "icepop": lambda k, c: k if c.icepop_low <= k <= c.icepop_high else 0.0,
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_env_masked_loss_and_gradient_match_float64_loop_reference(name, seed):
    samples, batch, logp, old, model, adv = multiturn_batch(seed)
    cfg, level = CASES[name]["cfg"], CASES[name]["level"]
    tis = cfg.correction != "none"  # a correction: the ratio is against pi_old
    out = registry.compute(
        cfg,
        LossInputs(
            logp=logp,
            rollout_logp=batch.rollout_logp.to(F64),
            advantages=batch.advantages.to(F64),
            mask=batch.loss_mask,
            old_logp=old if tis else None,
        ),
    )
    (grad,) = torch.autograd.grad(out.loss, logp)

    # the reference: a scalar loop over the model tokens of each sample (float64)
    mu = batch.rollout_logp.to(F64)
    weights = None
    if tis:
        weights = torch.zeros_like(mu)
        for b, t in model.nonzero().tolist():
            k = math.exp(float(old[b, t]) - float(mu[b, t]))
            weights[b, t] = WEIGHT[cfg.correction](k, cfg)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = ref_policy_loss(
        ref_logp,
        old if tis else mu,
        adv,
        model,
        level=level,
        adaptive=cfg.adaptive,
        quantile=cfg.quantile,
        agg=cfg.agg,
        token_weights=weights,
    )
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert not bool(grad[~model].any())  # no gradient reaches an environment token
    assert torch.equal(batch.loss_mask.bool(), model)  # the samples' mask, nothing else

    # d̄π against mu and SAT's tail quantile: model tokens only
    d_mu = (logp.detach() - mu)[model].abs()
    assert out.metrics[M.DPI_MU] == pytest.approx(float(d_mu.mean()), rel=1e-12)
    assert out.metrics[M.DPI_MU] < 1.0  # the environment tokens' |d| = 6 is not in it
    if cfg.adaptive and level == "token" and not tis:
        k = math.ceil(cfg.quantile * d_mu.numel())
        assert out.metrics[M.SAT_Q] == pytest.approx(float(d_mu.sort().values[k - 1]), rel=1e-12)


def test_turn_ids_and_versions_are_collated_per_token():
    g = torch.Generator().manual_seed(5)
    s = multiturn_sample(g, turns=3)
    s.token_versions = [2 if k == 0 else 3 for k in s.turn_ids]
    single = Sample([5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], "stop", 4)
    batch = collate([s, single], [1.0, -1.0], pad_id=0)
    P, T = len(s.prompt_ids), len(s.prompt_ids) + s.response_len
    assert batch.turn_ids[0, P:T].tolist() == s.turn_ids
    assert batch.token_versions[0, P:T].tolist() == s.token_versions
    assert batch.turn_ids[1].tolist() == [0] * batch.turn_ids.shape[1]  # single-turn: turn 0
    assert batch.token_versions[1, 2:5].tolist() == [4, 4, 4]
    assert batch.loss_mask[1].tolist()[:6] == [0, 0, 1, 1, 1, 0][: batch.loss_mask.shape[1]]
    # environment tokens: no log-prob, no loss
    env = [P + i for i, m in enumerate(s.loss_mask) if not m]
    assert env and batch.loss_mask[0, env].sum() == 0 and batch.rollout_logp[0, env].sum() == 0


def test_single_turn_samples_collate_as_before():
    a = Sample([5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], "stop", 0)
    b = Sample([5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], "stop", 0, loss_mask=[1, 1, 1])
    x, y = collate([a], [1.0], pad_id=0), collate([b], [1.0], pad_id=0)
    assert x.turn_ids is None and x.token_versions is None
    for name in ("input_ids", "loss_mask", "rollout_logp", "advantages", "position_ids"):
        assert torch.equal(getattr(x, name), getattr(y, name))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(loss_mask=[1, 0]), "one 0/1 entry per response token"),
        (dict(loss_mask=[1, 2, 1]), "one 0/1 entry per response token"),
        (dict(loss_mask=[1, 0, 1]), "log-prob on an environment token"),
        (dict(loss_mask=[1, 0, 1], rollout_logp=[-0.5, 0.0, -1.0], turn_ids=[0, 0]), "turn ids"),
    ],
)
def test_collate_refuses_a_malformed_multiturn_sample(change, match):
    fields = dict(
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        rollout_logp=[-0.5, -0.25, -1.0],
        finish_reason="stop",
        weight_version=0,
    )
    with pytest.raises(ValueError, match=match):
        collate([Sample(**{**fields, **change})], [1.0], pad_id=0)


def test_model_token_helpers_leave_environment_tokens_out():
    s = Sample(
        [1],
        [10, 11, 12, 13, 14, 15],
        [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
        "stop",
        weight_version=3,
        token_versions=[3, 3, 1, 1, 4, 4],  # environment tokens with a version older than any
        loss_mask=[1, 1, 0, 0, 1, 1],
        turn_ids=[0, 0, 0, 0, 1, 1],
    )
    assert s.model_positions() == [0, 1, 4, 5]
    assert s.model_token_versions() == [3, 3, 4, 4]
    assert s.model_turns() == [0, 0, 1, 1]
    assert s.oldest_version() == 3  # not 1: the environment tokens' versions do not count
    plain = Sample([1], [10, 11], [-0.1, -0.2], "stop", weight_version=2)
    assert plain.model_token_versions() == [2, 2] and plain.model_turns() == [0, 0]
    assert plain.oldest_version() == 2


def test_replay_recording_keeps_masks_turns_and_versions():
    """``sat replay``'s store (format sat-replay v1) records multi-turn samples with their
    masks, turns and per-token versions; a single-turn sample beside them stays single-turn."""
    from sat_cli.replay.store import RecordingError, decode_step, encode_step

    s = multiturn_sample(torch.Generator().manual_seed(7), turns=3)
    s.token_versions = [4 if k == 0 else 5 for k in s.turn_ids]
    single = Sample([5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], "stop", 4)
    data = encode_step(3, [[s, single]], [{"prompt": "p"}], [[1.0, 0.0]])
    (back,), rows, rewards = decode_step(data, "step_000003")
    assert rows == [{"prompt": "p"}] and rewards == [[1.0, 0.0]]
    assert back[0].loss_mask == s.loss_mask and back[0].turn_ids == s.turn_ids
    assert back[0].token_versions == s.token_versions
    assert back[1].loss_mask is None and back[1].turn_ids is None
    a = collate([s, single], [1.0, -1.0], pad_id=0)
    b = collate(back, [1.0, -1.0], pad_id=0)
    for name in ("input_ids", "loss_mask", "rollout_logp", "token_versions", "turn_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    s.loss_mask = s.loss_mask[:-1]  # one entry short: the recording does not line up
    with pytest.raises(RecordingError, match="loss_mask"):
        decode_step(encode_step(3, [[s, single]], [{"prompt": "p"}], [[1.0, 0.0]]), "step")
