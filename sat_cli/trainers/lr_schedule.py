"""The learning rate over optimizer steps (``trainer.lr_schedule``, ``trainer.lr_warmup_steps``,
``trainer.lr_decay_steps``): a linear warm-up from ``lr / warmup`` to ``lr`` over the first
``warmup`` steps, then ``constant``, or ``linear`` / ``cosine`` decay from ``lr`` towards 0 at
step ``decay_steps``:

    factor(k) = (k + 1) / warmup                          k < warmup
    f = min((k - warmup) / (decay_steps - warmup), 1)     k >= warmup
    factor(k) = 1 | 1 - f | (1 + cos(pi f)) / 2           constant | linear | cosine

``k`` is the number of optimizer steps already taken, read off the optimizer's own state (Adam's
per-parameter ``step``), which every checkpoint holds: a resumed run continues the sequence
exactly, with nothing else to save. :func:`apply` sets it before each ``opt.step`` (the hook in
``sat_cli.trainers.step``); ``constant`` without warm-up is never applied (the default run's
arithmetic is untouched).
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def factor(schedule: str, k: int, warmup: int = 0, decay_steps: int = 0) -> float:
    """The multiplier of ``trainer.lr`` at optimizer step ``k`` (0-based; module docstring)."""
    if k < warmup:
        return (k + 1) / warmup
    if schedule == "constant":
        return 1.0
    f = min((k - warmup) / max(decay_steps - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - f
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * f))
    raise ValueError(f"unknown lr schedule {schedule!r}: choose {', '.join(LR_SCHEDULES)}")


def steps_taken(opt) -> int:
    """Optimizer steps already taken: the largest ``step`` in the optimizer's state (0 before
    the first)."""
    return max((int(float(s["step"])) for s in opt.state.values() if "step" in s), default=0)


def active(schedule: str, warmup: int) -> bool:
    return schedule != "constant" or warmup > 0


def apply(opt, lr: float, schedule: str, warmup: int, decay_steps: int) -> float:
    """Set every parameter group's learning rate for the coming step; returns it."""
    value = lr * factor(schedule, steps_taken(opt), warmup, decay_steps)
    for group in opt.param_groups:
        group["lr"] = value
    return value
