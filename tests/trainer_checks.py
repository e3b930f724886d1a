"""Checks shared by the local and the Megatron trainer tests: the non-finite skip of the shared
training step (``sat_cli.trainers.step``)."""

from __future__ import annotations

import dataclasses

import torch

from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.step import NONFINITE_METRIC


def plant_nonfinite(batch: TrainBatch, field: str) -> TrainBatch:
    """A copy of ``batch`` whose ``field`` (``advantages`` or ``rollout_logp``) is NaN on the
    first response token of every row: the loss of any minibatch is NaN."""
    values = getattr(batch, field).clone()
    first = batch.loss_mask.bool().float().argmax(dim=1)  # [B], first response column
    values[torch.arange(batch.batch_size), first] = float("nan")
    return dataclasses.replace(batch, **{field: values})


def _state(trainer) -> tuple[dict, dict]:
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    opt = {
        (i, k): v.detach().clone() if torch.is_tensor(v) else v
        for i, st in trainer.opt.state_dict()["state"].items()
        for k, v in st.items()
    }
    return params, opt


def check_nonfinite_step_is_skipped(trainer, clean: TrainBatch, bad: TrainBatch) -> None:
    """A clean step first (the optimizer has state), then ``bad``: weights and optimizer state
    bit-identical to before it, gradients dropped, the skip reported, the step still counted."""
    first = trainer.step(clean)
    assert NONFINITE_METRIC not in first
    params, opt = _state(trainer)
    assert opt, "the clean step should have created optimizer state"
    count = trainer.step_count
    metrics = trainer.step(bad)
    assert metrics[NONFINITE_METRIC] == 1.0  # every minibatch skipped
    assert metrics["perf/optimizer_steps"] == float(trainer.num_minibatches)
    assert trainer.step_count == count + 1
    params_after, opt_after = _state(trainer)
    assert params_after.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(params_after[name], value), name
    assert opt_after.keys() == opt.keys()
    for key, value in opt.items():
        after = opt_after[key]
        assert torch.equal(after, value) if torch.is_tensor(value) else after == value, key
    assert all(p.grad is None for p in trainer.model.parameters())
    # and the trainer is still usable: a clean step after the skip updates again
    again = trainer.step(clean)
    assert NONFINITE_METRIC not in again
    assert any(not torch.equal(p.detach(), params[n]) for n, p in trainer.model.named_parameters())


def megatron_trainer(model_path, work_dir, **keys):
    """A ``MegatronTrainer`` from the keywords these tests share with ``LocalTrainer`` and
    ``MegatronActor`` (``lr``, ``loss``, ``r3``, ...) and the layout ones (``tp``, ...): each
    goes where the trainer takes it, its settings (``trainer.*``), its runtime (the folders,
    export dtype, sender, environment) or the runtime's step options; any other is refused
    (``TypeError``) by the trainer, as an unknown option."""
    from sat_cli.trainers.megatron.client import MegatronTrainer
    from sat_cli.trainers.megatron.settings import MegatronRuntime, MegatronTrainerSettings

    own = {f.name for f in dataclasses.fields(MegatronTrainerSettings)} - {"name"}
    rt = {f.name for f in dataclasses.fields(MegatronRuntime)} - {"options"}
    settings = MegatronTrainerSettings(**{k: v for k, v in keys.items() if k in own})
    runtime = {k: v for k, v in keys.items() if k in rt}
    options = {k: v for k, v in keys.items() if k not in own | rt}
    return MegatronTrainer(
        settings, MegatronRuntime(str(model_path), work_dir, **runtime, options=options)
    )
