"""The trainer interface shared by the local (HF + torch) and Megatron trainers.

A trainer owns the policy being trained. ``step`` runs the optimizer steps of one rollout batch
(a ``TrainBatch`` from ``sat_cli.trainers.batch.collate``) and returns namespaced float metrics
(``loss/*``, ``sat/*``, ``staleness/*``, ``perf/*``); given a ``diag`` dict it also fills it with
the loss's detached per-token diagnostics (``sat_cli.trainers.step.PolicyTrainer.step``), from
which the loop draws its histograms. ``logprobs`` recomputes the per-token
log-probs of a batch without gradient, aligned like ``TrainBatch.rollout_logp``.
``publish_weights`` writes an HF checkpoint the rollout engines can load and returns its path;
``save`` / ``load`` checkpoint the full training state (weights, optimizer, RNG, step counter)
for resume, in safetensors + JSON (no pickles). ``set_clip_radii`` changes the clip radii of
later steps (the loop's clip schedule); ``skip_step`` counts a step that had no samples, so
``step_count`` stays the loop's step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from sat_cli.trainers.batch import TrainBatch


@runtime_checkable
class Trainer(Protocol):
    step_count: int

    def step(self, batch: TrainBatch, diag: dict | None = None) -> dict[str, float]: ...

    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...

    def publish_weights(self, dir: str | Path, version: int) -> Path: ...

    def save(self, dir: str | Path) -> None: ...

    def load(self, dir: str | Path) -> None: ...

    def set_clip_radii(self, eps_low: float, eps_high: float) -> None: ...

    def skip_step(self) -> None: ...

    def close(self) -> None: ...
