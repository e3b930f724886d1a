"""``trainer.lr_schedule`` on the Megatron trainer (CPU, gloo, one rank): the fp32 and the
bf16 (fp32 main weights + torch AdamW) actors step with the learning rate of the hand formula
(``sat_cli.trainers.lr_schedule.factor``), and an actor saved after two steps and resumed gives
the uninterrupted actor's learning rates, losses and weights bit for bit. megatron-core's
distributed optimizer (bf16 on CUDA) refuses a schedule (a GPU path, not reachable here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (make install installs it)"
)

from test_megatron_trainer import make_samples  # noqa: E402

from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.lr_schedule import factor  # noqa: E402
from sat_cli.trainers.megatron import runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402

KW = dict(
    lr=1e-3,
    loss=LossConfig(algo="grpo", adaptive=True),
    temperature=0.9,
    weight_decay=0.01,
    lr_schedule="cosine",
    lr_warmup_steps=1,
    lr_decay_steps=4,
)


@pytest.fixture(scope="module")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


def _step(actor, batch) -> tuple[float, float]:
    metrics = actor.step(batch)
    return actor.opt.param_groups[0]["lr"], metrics["loss/total"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_steps_with_the_scheduled_lr_and_resumes_exactly(
    megatron_dist, tiny_dir, tmp_path, dtype
):
    batches = [collate(*make_samples(n=8, seed=s), 0) for s in range(4)]
    whole = MegatronActor(str(tiny_dir), dtype=dtype, **KW)
    seq = [_step(whole, b) for b in batches]
    # warm-up 1: k = 0 at lr; then cosine over k - 1 of 3: f = 0, 1/3, 2/3
    assert [lr for lr, _ in seq] == pytest.approx([1e-3, 1e-3, 0.75e-3, 0.25e-3], abs=1e-18)
    assert [lr for lr, _ in seq] == [1e-3 * factor("cosine", k, 1, 4) for k in range(4)]

    first = MegatronActor(str(tiny_dir), dtype=dtype, **KW)
    head = [_step(first, b) for b in batches[:2]]
    first.save(tmp_path / "ck")
    resumed = MegatronActor(str(tiny_dir), dtype=dtype, **KW)
    resumed.load(tmp_path / "ck")
    tail = [_step(resumed, b) for b in batches[2:]]
    assert head + tail == seq  # learning rates and losses, bit for bit
    for (n, p), q in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_the_core_optimizer_path_refuses_a_schedule(megatron_dist, tiny_dir, monkeypatch):
    """bf16 on CUDA takes megatron-core's distributed optimizer, whose step count sat does not
    read yet: a schedule there is refused before the optimizer is built, naming the ways out."""
    from sat_cli.trainers.megatron import precision

    monkeypatch.setattr(precision, "use_core_optimizer", lambda device, offload=False: True)
    with pytest.raises(ValueError, match="SAT_MEGATRON_CORE_OPTIMIZER=0"):
        MegatronActor(str(tiny_dir), dtype="bfloat16", **KW)
    constant = {**KW, "lr_schedule": "constant", "lr_warmup_steps": 0}
    with pytest.raises(Exception) as info:  # past the check: building the CUDA optimizer fails
        MegatronActor(str(tiny_dir), dtype="bfloat16", **constant)
    assert "SAT_MEGATRON_CORE_OPTIMIZER" not in str(info.value)
