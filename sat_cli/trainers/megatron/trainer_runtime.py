"""What a :class:`~sat_cli.trainers.megatron.client.MegatronTrainer` is built with besides its
settings (``settings.MegatronTrainerSettings``): plain data, its own module so that the trainer
does not import the settings module that builds it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sat_cli.trainers.settings import step_keywords


@dataclass(frozen=True)
class MegatronRuntime:
    """What a :class:`~sat_cli.trainers.megatron.client.MegatronTrainer` is built with besides
    its settings: the model; ``work_dir`` (the worker's config, reply FIFO and batch files) and
    ``logs_dir`` (None: ``work_dir/logs``); the loss (``rl.config.LossConfig``; None: its
    defaults) and the step keywords from outside ``trainer.*`` (``options``: temperature, r3,
    minibatches, seed, ...: ``trainers.step.StepSettings`` fields); the dtype of exported
    weights (None: ``trainer.dtype``); rank 0's weight-sync sender (``{dtype, device,
    bucket_bytes}``; None: disk only); the launcher that places the nodes (None: this
    machine), node 0's extra environment, its interpreter (None: this one) and how long the
    workers may take to start."""

    model_path: str
    work_dir: Path
    logs_dir: Path | None = None
    loss: Any = None
    options: dict = field(default_factory=dict)
    export_dtype: str | None = None
    weight_sync: dict | None = None
    placer: Any = None
    env: dict | None = None
    python: str | None = None
    startup_timeout_s: float = 600.0

    def actor_keywords(self, s) -> dict:
        """The keywords of the worker's ``MegatronActor`` (``loss`` as a ``LossConfig``) with
        the settings ``s`` (``settings.MegatronTrainerSettings``)."""
        own = {k: getattr(s, k) for k in ("dtype", "recompute", "optimizer_offload")}
        own["export_dtype"] = self.export_dtype or s.dtype
        return {**step_keywords(s, self.loss, self.options), **own}
