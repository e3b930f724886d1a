"""``trainer.lr_schedule`` / ``lr_warmup_steps`` / ``lr_decay_steps`` (sat_cli/trainers/
lr_schedule.py): the factor against the hand formula, the learning rate a real LocalTrainer
steps with, and a run stopped and resumed from its checkpoint giving the uninterrupted run's
learning rates, losses and weights exactly. The default (constant, no warm-up) never touches the
optimizer's learning rate."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_hf import on_policy_samples

from sat_cli.config import ConfigError, load
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer
from sat_cli.trainers.lr_schedule import factor


def test_factor_hand_values():
    # cosine, warm-up 2, decay at step 6: k = 0, 1 warm up; then f = (k - 2) / 4
    c = [factor("cosine", k, 2, 6) for k in range(8)]
    want = [
        0.5,
        1.0,
        1.0,
        0.5 * (1 + math.cos(math.pi / 4)),
        0.5,
        0.5 * (1 - math.cos(math.pi / 4)),
    ]
    assert c == pytest.approx([*want, 0.0, 0.0], abs=1e-15)
    assert [factor("linear", k, 0, 4) for k in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [factor("constant", k, 3, 0) for k in range(5)] == [1 / 3, 2 / 3, 1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path_factory.mktemp("lr") / "v0")


def _batches():
    prompts = [[20, 21, 22, 14, 23, 24, 25, 32], [40, 41, 14, 42, 32], [50, 32], [60, 61, 62]]
    samples = on_policy_samples(build_tiny_moe(2), prompts, max_new_tokens=8)
    advs = (
        [1.0, -1.0, 0.5, -0.5],
        [-1.0, 1.0, 0.0, 2.0],
        [0.5, 0.5, -1.0, 1.0],
        [2.0, -1.0, 0.0, -1.0],
    )
    return [collate(samples, a, pad_id=0) for a in advs]


SCHED = dict(lr=1e-2, lr_schedule="cosine", lr_warmup_steps=1, lr_decay_steps=4)


def _step(trainer, batch) -> tuple[float, float]:
    metrics = trainer.step(batch)
    return trainer.opt.param_groups[0]["lr"], metrics["loss/total"]


def test_trainer_steps_with_the_scheduled_lr_and_resumes_exactly(ckpt, tmp_path):
    batches = _batches()
    whole = LocalTrainer(str(ckpt), **SCHED)
    seq = [_step(whole, b) for b in batches]
    assert [lr for lr, _ in seq] == pytest.approx(
        [1e-2 * factor("cosine", k, 1, 4) for k in range(4)], rel=1e-15
    )
    # k = 2, 3: f = 1/3, 2/3; (1 + cos(pi/3)) / 2 = 0.75, (1 + cos(2 pi/3)) / 2 = 0.25
    assert [lr for lr, _ in seq] == pytest.approx([1e-2, 1e-2, 0.75e-2, 0.25e-2], abs=1e-17)

    first = LocalTrainer(str(ckpt), **SCHED)
    head = [_step(first, b) for b in batches[:2]]
    first.save(tmp_path / "ck")
    resumed = LocalTrainer(str(ckpt), **SCHED)
    resumed.load(tmp_path / "ck")
    tail = [_step(resumed, b) for b in batches[2:]]
    assert head + tail == seq  # learning rates and losses, bit for bit
    for (n, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_constant_default_leaves_the_optimizers_lr_alone(ckpt):
    tr = LocalTrainer(str(ckpt), lr=1e-2)
    for b in _batches()[:2]:
        assert _step(tr, b)[0] == 1e-2


def test_config_bounds_and_the_derived_decay_horizon():
    cfg, obj = load(["trainer.lr_schedule=linear", "max_steps=7", "algo.num_minibatches=2"])
    assert obj.trainer.lr_decay_steps == 14 == cfg.trainer.lr_decay_steps  # 7 steps x 2
    _, obj = load([])
    assert (obj.trainer.lr_schedule, obj.trainer.lr_warmup_steps) == ("constant", 0)
    for bad, msg in (
        ("trainer.lr_schedule=step", "trainer.lr_schedule"),
        ("trainer.lr_warmup_steps=-1", "trainer.lr_warmup_steps"),
        ("trainer.lr_decay_steps=0", "trainer.lr_decay_steps"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load([bad])
    _, obj = load(["trainer=megatron", "trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=2"])
    assert (obj.trainer.lr_schedule, obj.trainer.lr_warmup_steps) == ("cosine", 2)
