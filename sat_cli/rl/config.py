"""``LossConfig``: every setting of the policy loss in one frozen value.

Built once at the edge (``sat_cli.build.parts.loss_config``), passed to the trainer, serialised as
JSON for the Megatron worker (``to_dict`` / ``from_dict``, exact round trip) and read by
``sat_cli.rl.registry.compute``, ``sat_cli.rl.losses.policy_loss`` and the shared training
step (``sat_cli.trainers.step``). Field names are the loss's names (``agg``, not the config's
``algo.loss_agg``).

Settings an algorithm or correction does not use are carried but never read (``tis_cap``
without ``tis``/``mis``, ``group_size`` without ``vcpo``, ...). ``q_rows`` is SAT's scope:
``None`` = one order statistic per optimizer minibatch, an int = per block of that many rows.

The trainers take it as ``loss=`` (the only way: the older keyword form is gone). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class LossConfig:
    algo: str = "grpo"
    correction: str = "none"
    # clip interval and SAT
    eps_low: float = 0.2
    eps_high: float = 0.2
    adaptive: bool = False
    quantile: float = 0.9
    exponent: float = 2.0
    anchor: str = "q"
    q_rows: int | None = None
    dual_clip_c: float | None = None
    # aggregation and ratio denominator
    agg: str = "token-mean"
    ratio_denominator: str = "rollout"
    # corrections and mismatch treatments
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    dppo_delta: float = 1e-3
    m2po_tau: float = 0.04
    behav_cap: float | None = None
    behav_mode: str = "clip"
    # vcpo
    group_size: int | None = None
    vcpo_is_cap: float = 8.0
    vcpo_ess_base: float = 1.0
    vcpo_opob: bool = True
    # reference-policy penalty: + kl_coef * k3 (0 = off, no reference model)
    kl_coef: float = 0.0
    # sequence trust region (rl/seq_trust.py): drop a response whose mean per-token Bernoulli
    # KL(mu || pi) exceeds str_delta (None = off); clipped algorithms only
    str_delta: float | None = None
    # score centering (rl/score_centering.py): + A * sum_H sg(c_v) log p_v per token; needs
    # LossInputs.policy_topk_logp / sampler_topk_logp / topk_valid; coefficients per token weight
    score_centering: bool = False

    def replace(self, **changes) -> LossConfig:
        """A copy with ``changes`` (e.g. new clip radii from a schedule)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready ``{field: value}`` (``from_dict`` gives back an equal value)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise TypeError(f"unknown loss settings {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**data)
