"""The loss's per-token diagnostics (``diag``), from which the loop draws its histograms: checked
against float64 hand computations of ALGORITHMS.md §4, against the pre-step recompute the
loop used before (bit for bit with one minibatch), and through ``log_histograms``."""

from __future__ import annotations

import math

import pytest
import torch

from sat_cli.engines.base import Sample
from sat_cli.loop.steps import Lags, log_histograms
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl import registry
from sat_cli.rl.config import LossConfig
from sat_cli.rl.loss_io import LossInputs
from sat_cli.rl.losses import policy_loss
from sat_cli.tracking.sink import NullSink
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer


def _inputs(seed=0, B=6, T=9, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -2.0 + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    denom = logp + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, denom, adv, mask


def _kth(x: torch.Tensor, quantile: float) -> float:
    """The lower order statistic k = ceil(quantile * n), by sorting (float64)."""
    xs = sorted(x.tolist())
    return xs[min(max(math.ceil(quantile * len(xs)), 1), len(xs)) - 1]


@pytest.mark.parametrize("quantile,exponent", [(0.9, 2.0), (0.75, 1.0)])
def test_token_level_diag_is_the_gate_and_contraction_of_the_paper(quantile, exponent):
    logp, denom, adv, mask = _inputs()
    diag: dict = {}
    _, metrics = policy_loss(
        logp,
        denom,
        adv,
        mask,
        LossConfig(adaptive=True, quantile=quantile, exponent=exponent),
        diag=diag,
    )
    d = (logp - denom)[mask]  # row-major active tokens
    q = _kth(d.abs(), quantile)
    assert diag["q"].tolist() == [pytest.approx(q, abs=0)]
    assert metrics["sat/q"] == pytest.approx(q, abs=0)
    assert diag["n_active"].tolist() == [int(mask.sum())]
    torch.testing.assert_close(diag["abs_d"], d.abs().float(), atol=0, rtol=0)
    gate = d.abs() > q
    assert torch.equal(diag["gate"], gate) and 0 < int(gate.sum()) < gate.numel()
    psi = 1.0 / (1.0 + (d.abs() / q) ** exponent)  # the contraction c on the gated side
    want = torch.where(gate, psi, torch.ones_like(psi))
    torch.testing.assert_close(diag["contraction"].double(), want, atol=1e-6, rtol=0)
    assert float(diag["contraction"].min()) == pytest.approx(metrics["sat/c_min"], abs=1e-6)


def test_sequence_level_diag_gates_whole_responses():
    logp, denom, adv, mask = _inputs(seed=3, B=16, scale=0.5)
    diag: dict = {}
    _, metrics = policy_loss(
        logp, denom, adv, mask, LossConfig(adaptive=True, quantile=0.6), level="sequence", diag=diag
    )
    lens = mask.sum(1)
    seq = torch.where(mask, logp - denom, 0.0).sum(1) / lens  # [B], log s_b
    # q: the token-weighted order statistic of |log s_b| (each response counts its tokens)
    per_token_seq = seq[:, None].expand_as(mask)[mask].abs()
    q = _kth(per_token_seq, 0.6)
    assert diag["q"].item() == pytest.approx(q, rel=1e-12)
    rows = seq.abs() > q
    assert torch.equal(diag["gate"], rows[:, None].expand_as(mask)[mask]) and rows.any()
    psi = 1.0 / (1.0 + (seq.abs() / q) ** 2)
    want = torch.where(rows, psi, torch.ones_like(psi))[:, None].expand_as(mask)[mask]
    torch.testing.assert_close(diag["contraction"].double(), want, atol=1e-6, rtol=0)
    # |d| stays per token (the token log-ratio), as staleness/abs_logratio_mean
    torch.testing.assert_close(
        diag["abs_d"].double(), (logp - denom)[mask].abs(), atol=1e-7, rtol=0
    )
    assert metrics["staleness/abs_logratio_mean"] == pytest.approx(
        float((logp - denom)[mask].abs().mean()), rel=1e-12
    )


def test_without_sat_nothing_is_gated():
    logp, denom, adv, mask = _inputs(seed=1)
    diag: dict = {}
    policy_loss(logp, denom, adv, mask, diag=diag)
    assert diag["q"].numel() == 0 and not diag["gate"].any()
    assert torch.equal(diag["contraction"], torch.ones(int(mask.sum())))


def test_recompute_denominator_keeps_both_ratios():
    """TIS: the loss's |d| is against pi_old, ``abs_d_mu`` against the behaviour policy."""
    logp, rollout, adv, mask = _inputs(seed=2)
    old = logp + 0.01 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    diag = registry.compute(
        LossConfig(correction="tis", adaptive=True),
        LossInputs(
            logp=logp,
            rollout_logp=rollout,
            old_logp=old,
            advantages=adv,
            mask=mask,
            diagnostics=True,
        ),
    ).diag
    torch.testing.assert_close(diag["abs_d"].double(), (logp - old)[mask].abs(), atol=1e-7, rtol=0)
    torch.testing.assert_close(
        diag["abs_d_mu"].double(), (logp - rollout)[mask].abs(), atol=1e-7, rtol=0
    )
    assert diag["q"].item() == pytest.approx(_kth((logp - old)[mask].abs(), 0.9), rel=1e-6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        p, r = (
            int(torch.randint(2, 6, (1,), generator=g)),
            int(torch.randint(3, 8, (1,), generator=g)),
        )
        ids = torch.randint(3, 60, (p + r,), generator=g).tolist()
        lp = (-4.0 + 0.3 * torch.randn(r, generator=g)).tolist()
        samples.append(Sample(ids[:p], ids[p:], lp, "stop", 0))
    return collate(samples, torch.randn(n, generator=g), pad_id=0)


def test_trainer_diag_equals_the_pre_step_recompute_bit_for_bit(ckpt):
    """One minibatch: the loss's forward is at the pre-step weights, so its |log pi - log mu| is
    exactly the no-grad recompute the loop's histograms used to take (one forward fewer)."""
    trainer = LocalTrainer(str(ckpt), loss=LossConfig(adaptive=True), lr=1e-2)
    batch = _batch()
    m = batch.loss_mask.bool()
    before = (trainer.logprobs(batch) - batch.rollout_logp)[m].abs()
    diag: dict = {}
    metrics = trainer.step(batch, diag)
    assert torch.equal(diag["abs_d_mu"], before) and torch.equal(diag["abs_d"], before)
    assert diag["q"].item() == metrics["sat/q"] == _kth(before.double(), 0.9)
    # the same step without diag: identical metrics (diagnostics do not touch the update)
    plain = LocalTrainer(str(ckpt), loss=LossConfig(adaptive=True), lr=1e-2)
    again = plain.step(batch)
    assert {k: v for k, v in again.items() if not k.startswith("perf/")} == {
        k: v for k, v in metrics.items() if not k.startswith("perf/")
    }
    for (name, p1), p2 in zip(
        trainer.model.named_parameters(), plain.model.parameters(), strict=True
    ):
        assert torch.equal(p1, p2), name


def test_minibatch_diagnostics_concatenate_in_row_order(ckpt):
    trainer = LocalTrainer(str(ckpt), loss=LossConfig(adaptive=True), lr=1e-2, num_minibatches=3)
    batch = _batch(seed=4)
    diag: dict = {}
    metrics = trainer.step(batch, diag)
    per_mb = [int(batch.loss_mask[rows].sum()) for rows in torch.arange(6).chunk(3)]
    assert diag["n_active"].tolist() == per_mb
    assert diag["abs_d"].numel() == sum(per_mb) == diag["gate"].numel()
    assert diag["q"].numel() == 3
    assert metrics["sat/q"] == pytest.approx(float(diag["q"].mean()), rel=1e-12)


class _Tracker(NullSink):
    def __init__(self):
        self.hist: dict[str, dict] = {}
        self.metrics: dict[str, float] = {}

    def log_histogram(self, key, values, step, **kw):
        self.hist[key] = {"values": list(values), "step": step, **kw}

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)


def test_log_histograms_uses_the_losss_own_numbers():
    logp, rollout, adv, mask = _inputs(seed=5)
    diag = registry.compute(
        LossConfig(adaptive=True),
        LossInputs(
            logp=logp,
            rollout_logp=rollout,
            advantages=adv,
            mask=mask,
            diagnostics=True,
        ),
    ).diag
    tr = _Tracker()
    log_histograms(tr, diag, Lags([0, 1, 1, 2], [0, 1, 2]), step=7)
    d = (logp - rollout)[mask].abs()
    assert tr.hist["staleness/abs_logratio"]["marks"] == {"q": pytest.approx(_kth(d, 0.9))}
    assert "sat/abs_logratio" not in tr.hist  # same ratio: one histogram
    gated = diag["contraction"][diag["gate"]]
    assert tr.hist["sat/contraction"]["values"] == pytest.approx(gated.tolist())
    assert tr.hist["staleness/version_lag"]["bins"] == 3
    for name, level in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert tr.metrics[f"staleness/abs_logratio_{name}"] == pytest.approx(
            _kth(d, level), abs=1e-7
        )
    # with a recomputed denominator the loss's own |d| gets its own histogram, marked with q
    diag2 = registry.compute(
        LossConfig(correction="tis", adaptive=True),
        LossInputs(
            logp=logp,
            rollout_logp=rollout,
            old_logp=logp + 0.02,
            advantages=adv,
            mask=mask,
            diagnostics=True,
        ),
    ).diag
    tr2 = _Tracker()
    log_histograms(tr2, diag2, Lags([0], [0]), step=1)
    assert tr2.hist["staleness/abs_logratio"]["marks"] is None
    assert tr2.hist["sat/abs_logratio"]["marks"]["q"] == pytest.approx(diag2["q"].item())
