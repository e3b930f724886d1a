"""The shared training step (``sat_cli.trainers.step``) on the local trainer: a planted
non-finite batch leaves weights and optimizer state untouched and is reported; the Megatron
actor runs the same check in tests/test_megatron_trainer.py."""

from __future__ import annotations

import pytest
import torch
from trainer_checks import check_nonfinite_step_is_skipped, plant_nonfinite

from sat_cli.engines.base import Sample
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer
from sat_cli.trainers.optim_state import load_optimizer_tensors, optimizer_tensors
from sat_cli.trainers.step import PolicyTrainer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


def _batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        p, r = (
            int(torch.randint(2, 6, (1,), generator=g)),
            int(torch.randint(2, 6, (1,), generator=g)),
        )
        ids = torch.randint(3, 60, (p + r,), generator=g).tolist()
        lp = (-4.0 + 0.3 * torch.randn(r, generator=g)).tolist()
        samples.append(Sample(ids[:p], ids[p:], lp, "stop", 0))
    return collate(samples, torch.randn(n, generator=g), pad_id=0)


@pytest.mark.parametrize("field", ["advantages", "rollout_logp"])
@pytest.mark.parametrize(
    "loss", [LossConfig(), LossConfig(algo="gspo", correction="tis", adaptive=True, kl_coef=0.1)]
)
def test_local_trainer_skips_a_nonfinite_update(ckpt, field, loss):
    trainer = LocalTrainer(str(ckpt), loss=loss, lr=1e-2)
    assert isinstance(trainer, PolicyTrainer)
    clean = _batch()
    check_nonfinite_step_is_skipped(trainer, clean, plant_nonfinite(clean, field))


def test_one_bad_minibatch_skips_only_itself(ckpt):
    trainer = LocalTrainer(str(ckpt), lr=1e-2, num_minibatches=2)
    clean = _batch(n=4)
    bad = plant_nonfinite(clean, "advantages")
    bad.advantages[2:] = clean.advantages[2:]  # rows 2-3 (the second minibatch) stay clean
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(bad)
    assert metrics["loss/nonfinite_skipped"] == 0.5  # one of two minibatches (averaged)
    assert metrics["perf/optimizer_steps"] == 2.0
    moved = [not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters()]
    assert any(moved)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_equal_loss_configs_give_the_same_trainer_step(ckpt):
    # one with every setting written out, one with the algorithm left at its default
    full = LossConfig(algo="grpo", eps_high=0.28, adaptive=True, agg="seq-mean-token-mean")
    a = LocalTrainer(str(ckpt), lr=1e-2, loss=full)
    b = LocalTrainer(
        str(ckpt), lr=1e-2, loss=LossConfig(eps_high=0.28, adaptive=True, agg="seq-mean-token-mean")
    )
    assert a.loss == b.loss
    batch = _batch(seed=1)
    ma, mb = a.step(batch), b.step(batch)
    assert {k: v for k, v in ma.items() if k != "perf/train_s"} == {
        k: v for k, v in mb.items() if k != "perf/train_s"
    }
    for (n, pa), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), n
    with pytest.raises(TypeError, match="unknown trainer options"):
        LocalTrainer(str(ckpt), learning_rate=1.0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        LocalTrainer(str(ckpt), loss=LossConfig(algo="nope"))


def test_clip_radii_schedule_replaces_the_frozen_config(ckpt):
    tr = LocalTrainer(str(ckpt), loss=LossConfig(eps_low=0.2, eps_high=0.2, quantile=0.8))
    tr.set_clip_radii(0.1, 0.3)
    assert tr.loss == LossConfig(eps_low=0.1, eps_high=0.3, quantile=0.8)


def test_optimizer_tensors_round_trip(ckpt):
    tr = LocalTrainer(str(ckpt), lr=1e-2)
    tr.step(_batch())
    tensors, groups = optimizer_tensors(tr.opt)
    assert "rng/torch" in tensors and any(k.startswith("state/0/") for k in tensors)
    other = LocalTrainer(str(ckpt), lr=1e-2)
    load_optimizer_tensors(other.opt, tensors, [dict(g) for g in groups])
    back, _ = optimizer_tensors(other.opt)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
