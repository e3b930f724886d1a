"""What the training loop takes of the run's settings: ``LoopSettings`` (built at the edge,
``sat_cli/build/run.py``), the clip radii's schedule over steps (``ClipSchedule``) and the
schedules of evaluations, checkpoints, histograms and samples tables (``Every``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sat_cli.loop.lag import LagPolicy
from sat_cli.loop.schedule import Every
from sat_cli.samples import SamplingParams

if TYPE_CHECKING:
    from sat_cli.loop.dynamic import DynamicSampling
    from sat_cli.loop.multiturn import EnvRun
    from sat_cli.loop.weightsync import SyncSettings


@dataclass(frozen=True)
class ClipSchedule:
    """Nominal PPO radii over steps: constant, or decayed to ``final_scale`` × eps (linear/cosine)."""

    eps_low: float
    eps_high: float
    schedule: str = "constant"
    final_scale: float = 1.0

    def scale(self, step: int, max_steps: int) -> float:
        if self.schedule == "constant" or max_steps <= 1:
            return 1.0
        frac = min(max(step / (max_steps - 1), 0.0), 1.0)
        if self.schedule == "linear":
            return 1.0 + (self.final_scale - 1.0) * frac
        if self.schedule == "cosine":
            return self.final_scale + (1.0 - self.final_scale) * 0.5 * (
                1 + math.cos(math.pi * frac)
            )
        raise ValueError(f"unknown clip schedule {self.schedule!r}")

    def radii(self, step: int, max_steps: int) -> tuple[float, float]:
        s = self.scale(step, max_steps)
        return self.eps_low * s, self.eps_high * s


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs of the run's settings, built at the edge (``build/run.py``)."""

    max_steps: int
    prompts_per_step: int
    group_size: int
    sampling: SamplingParams
    lag: LagPolicy
    run_dir: Path
    seed: int = 0
    adv_std_norm: bool = True
    drop_zero_adv_groups: bool = False
    r3: bool = False
    clip: ClipSchedule = field(default_factory=lambda: ClipSchedule(0.2, 0.2))
    eval: Every = Every(0)  # in-training evaluations (and at the last step)
    eval_at_start: bool = False
    checkpoints: Every = Every(0)  # checkpoints before the last step (that one is always written)
    checkpoint_keep: int = 2
    histograms: Every = Every(10)  # asked with the step's index t (before its update)
    inflight_updates: bool = False  # bounded mode: the engine takes new weights mid-generation
    weight_sync: SyncSettings | None = None  # None: plain disk loads, no checks
    samples: Every = Every(0)  # the samples table of a step
    max_reward_error_frac: float = 1.0  # a step with more failed rewards ends the run FAILED
    env: EnvRun | None = None  # multi-turn rollouts (None: single-turn)
    dynamic: DynamicSampling | None = None  # None: algo.dynamic_sampling off

    def __post_init__(self) -> None:
        turns = self.env.trajectory.max_turns if self.env is not None else 1
        if self.lag.profile is not None and self.lag.turns != turns:
            raise ValueError(
                f"a lag profile with {self.lag.turns} draws per sample for {turns} turns per "
                "trajectory (LagPolicy.turns must be the environment's max_turns)"
            )
