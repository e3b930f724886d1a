"""The three-log-prob ledger (``algo.ledger``): the decomposition by hand in float64
(``sat_cli.rl.ledger``), pi_old at each token's version against a fresh forward of that
version's published checkpoint, the parts summing to the divergence in real trainer steps
(``sat_cli.trainers.ledger``), and where the config turns it on or refuses it."""

from __future__ import annotations

import pytest
import torch

from sat_cli import metric_names as M
from sat_cli.config import ConfigError, load
from sat_cli.config.additions import ledger_versions
from sat_cli.engines.base import Sample
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl.ledger import decompose
from sat_cli.tracking.sink import NullSink
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

F64 = torch.float64


def test_decomposition_hand_case():
    # token  log mu  log pi_old  log pi   delta = m + s        sign  mismatch  staleness
    #   1    -1.0    -0.75       -0.5     0.5  = 0.25 + 0.25    +1    0.25      0.25
    #   2    -1.0    -1.25       -0.875   0.125 = -0.25 + 0.375 +1   -0.25      0.375
    #   3    -2.0    -1.5        -2.25   -0.25 = 0.5 - 0.75     -1   -0.5       0.75
    #   4    (masked: garbage)
    mu = torch.tensor([[-1.0, -1.0, -2.0, 7.0]], dtype=F64)
    old = torch.tensor([[-0.75, -1.25, -1.5, float("nan")]], dtype=F64)
    pi = torch.tensor([[-0.5, -0.875, -2.25, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    metrics, diag = decompose(pi, old, mu, mask)
    # mean |delta| = (.5 + .125 + .25) / 3 = .875 / 3
    # mismatch part = (.25 - .25 - .5) / 3 = -.5 / 3 (engine mismatch pulls back toward mu)
    # staleness part = (.25 + .375 + .75) / 3 = 1.375 / 3; the parts sum to .875 / 3
    assert metrics[M.LEDGER_DPI] == 0.875 / 3
    assert metrics[M.LEDGER_MISMATCH_PART] == -0.5 / 3
    assert metrics[M.LEDGER_STALENESS_PART] == 1.375 / 3
    assert metrics[M.LEDGER_MISMATCH_ABS] == 1.0 / 3  # (.25 + .25 + .5) / 3
    assert metrics[M.LEDGER_STALENESS_ABS] == 1.375 / 3
    assert diag["ledger_m"].tolist() == [0.25, -0.25, 0.5]
    assert diag["ledger_s"].tolist() == [0.25, 0.375, -0.75]
    empty, _ = decompose(pi, old, mu, torch.zeros_like(mask))
    assert set(empty.values()) == {0.0}


def test_parts_sum_on_random_float32_inputs():
    g = torch.Generator().manual_seed(0)
    mu = -3 * torch.rand(6, 9, generator=g)
    old = mu + 0.05 * torch.randn(6, 9, generator=g)
    pi = old + 0.2 * torch.randn(6, 9, generator=g)
    metrics, _ = decompose(pi, old, mu, torch.rand(6, 9, generator=g) > 0.3)
    total = metrics[M.LEDGER_MISMATCH_PART] + metrics[M.LEDGER_STALENESS_PART]
    assert total == pytest.approx(metrics[M.LEDGER_DPI], abs=1e-12)
    assert metrics[M.LEDGER_MISMATCH_ABS] + metrics[M.LEDGER_STALENESS_ABS] >= total


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


def _batch(seed, versions, token_versions=None):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for b, v in enumerate(versions):
        ids = torch.randint(3, 60, (8,), generator=g).tolist()
        lp = (-4.0 + 0.3 * torch.randn(4, generator=g)).tolist()
        tv = None if token_versions is None else token_versions[b]
        samples.append(Sample(ids[:4], ids[4:], lp, "stop", v, token_versions=tv))
    return collate(samples, torch.randn(len(versions), generator=g), pad_id=0)


def _token_versions(batch):
    if batch.token_versions is not None:
        return batch.token_versions
    return batch.versions[:, None].expand_as(batch.loss_mask)


def test_pi_old_of_a_version_is_a_fresh_forward_of_its_published_checkpoint(ckpt, tmp_path):
    trainer = LocalTrainer(str(ckpt), lr=5e-2, ledger_keep=4)
    pub = tmp_path / "published"
    for v in range(3):  # v0, then the weights after each step (what the loop publishes)
        trainer.publish_weights(pub, v)
        if v < 2:
            trainer.step(_batch(v, [v] * 4))
    assert trainer.step_count == 2
    # versions 0, 1, 2 and a response whose tokens span 1 and 2 (an in-flight switch)
    batch = _batch(9, [0, 1, 2, 1], [[0] * 4, [1] * 4, [2] * 4, [1, 1, 2, 2]])
    gen, held = trainer.ledger.logprobs(trainer, batch)
    active = batch.loss_mask.bool()
    assert torch.equal(held, active) and sorted(trainer.ledger.snapshots) == [0, 1, 2]
    tv = _token_versions(batch)
    refs = {v: LocalTrainer(str(pub / f"v{v}")).logprobs(batch) for v in range(3)}
    for v, ref in refs.items():
        at = active & (tv == v)
        torch.testing.assert_close(gen[at], ref[at], rtol=0, atol=1e-6)
    assert not torch.allclose(refs[0][active], refs[2][active])  # the versions differ


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_parts_sum_to_the_divergence_in_trainer_steps(ckpt, num_minibatches):
    trainer = LocalTrainer(str(ckpt), lr=5e-2, ledger_keep=2, num_minibatches=num_minibatches)
    trainer.step(_batch(0, [0] * 4))
    trainer.step(_batch(1, [0, 0, 1, 1]))
    diag: dict = {}
    # at step 2 the ring holds versions 1 and 2: version 0's tokens are left out
    batch = _batch(2, [0, 1, 2, 2])
    metrics = trainer.step(batch, diag)
    parts = metrics[M.LEDGER_MISMATCH_PART] + metrics[M.LEDGER_STALENESS_PART]
    assert parts == pytest.approx(metrics[M.LEDGER_DPI], abs=1e-6)
    assert metrics[M.LEDGER_MISMATCH_ABS] > 0 and metrics[M.LEDGER_STALENESS_ABS] > 0
    assert metrics[M.LEDGER_HELD_FRAC] == pytest.approx(0.75)
    assert diag["ledger_m"].numel() == diag["ledger_s"].numel() == 12  # 3 held rows x 4 tokens
    if num_minibatches == 1:
        # one update: the current version's tokens have s = pi - pi_old = 0 (same weights; up
        # to the last bit of a forward over other rows), so their m is the whole divergence
        s = diag["ledger_s"].view(3, 4)
        torch.testing.assert_close(s[1:], torch.zeros_like(s[1:]), rtol=0, atol=1e-6)
        assert s[0].abs().min() > 1e-4  # version 1 is one update old


def test_the_step_histograms_carry_m_and_s(ckpt):
    from sat_cli.loop.steps import Lags, log_histograms

    class Tracker(NullSink):
        def __init__(self):
            self.hist = {}

        def log_histogram(self, key, values, step, **kw):
            self.hist[key] = list(values)

        def log_metrics(self, metrics, step):
            pass

    trainer = LocalTrainer(str(ckpt), lr=5e-2, ledger_keep=3)
    trainer.step(_batch(0, [0] * 4))
    diag: dict = {}
    trainer.step(_batch(1, [0, 0, 1, 1]), diag)
    tr = Tracker()
    log_histograms(tr, diag, Lags([1, 1, 0, 0], [1, 0]), step=1)
    assert tr.hist[M.HIST_LEDGER_MISMATCH] == diag["ledger_m"].tolist()
    assert tr.hist[M.HIST_LEDGER_STALENESS] == diag["ledger_s"].tolist()
    assert len(tr.hist[M.HIST_LEDGER_STALENESS]) == 16


def test_off_by_default_and_where_the_config_turns_it_on(ckpt, tmp_path):
    trainer = LocalTrainer(str(ckpt))
    assert trainer.ledger is None
    assert M.LEDGER_DPI not in trainer.step(_batch(0, [0] * 4))
    _, obj = load(["algo.ledger=true", "lag=4"])
    assert ledger_versions(obj.algo.ledger, obj.lag.n, obj.lag.profile) == 6
    _, obj = load(["algo.ledger=true", "lag.profile=geometric:0.5,max=3"])
    assert ledger_versions(obj.algo.ledger, obj.lag.n, obj.lag.profile) == 5
    _, obj = load([])
    assert ledger_versions(obj.algo.ledger, obj.lag.n, obj.lag.profile) == 0
    with pytest.raises(ConfigError, match="algo.ledger=true needs trainer=local"):
        load(["algo.ledger=true", "trainer=megatron"])
    from trainer_checks import megatron_trainer

    with pytest.raises(ValueError, match="ledger"):
        megatron_trainer(str(ckpt), tmp_path / "mg", ledger_keep=3)
