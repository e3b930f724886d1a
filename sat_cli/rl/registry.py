"""Registry of policy-loss algorithms and mismatch corrections, composed per ALGORITHMS.md §5.

A trainer calls ``compute(cfg, logp=..., rollout_logp=..., old_logp=..., advantages=...,
mask=...)`` with its ``LossConfig`` (``sat_cli.rl.config``); ``compute_loss(algo, correction,
..., <settings as keywords>)`` is the same with the settings spelled out. Each algorithm is
registered with ``@register_algorithm`` together with its ratio level, its denominator and a
function returning its extra per-token mask/weight; each correction with
``@register_correction``. ``valid_names()`` lists both for config validation, and unknown names
raise ``ValueError`` listing the valid ones.

Which denominator each uses (``old`` = the recomputed ``pi_old``, ``rollout`` = ``mu``):

| algo           | level          | denominator                          | extra per-token factor        |
|----------------|----------------|--------------------------------------|-------------------------------|
| ppo, grpo      | token          | ``ratio_denominator`` (default rollout) | —                          |
| gspo           | sequence       | ``ratio_denominator``                | —                             |
| gspo_token     | sequence_token | ``ratio_denominator``                | —                             |
| dppo_tv        | token          | rollout (always)                     | TV keep-mask vs ``mu``        |
| decoupled_ppo  | token          | old (always)                         | ``pi_old / mu`` (cap/mode)    |
| m2po           | token, no clip | old (always)                         | M2 keep-mask of ``(old-mu)^2``|
| a3po           | token          | interpolated ``pi_prox`` (no recompute) | ``pi_prox / mu`` (cap/mode) |
| vcpo           | token, no clip | ``sg[pi_theta]`` (score function)    | ``min(w_seq, C)``; OPOB adv.  |

``a3po`` and ``vcpo`` (``sat_cli.rl.offpolicy``, sources there) need extra inputs: ``a3po`` the
tokens' weight ``versions`` and the trainer's ``current_version``; ``vcpo`` the per-response
``seq_score_sqnorm`` (``||grad sum_t log pi||^2``, from the trainer) and ``groups`` (derived from
``group_size``). ``vcpo`` also asks the trainer for a learning-rate factor for this step through
the metric ``opt/lr_scale`` (ESS-guided step scaling).

Corrections ``tis``, ``mis``, ``icepop`` apply to ppo/grpo/gspo/gspo_token only. They force the
denominator to ``old`` whatever ``ratio_denominator`` says (the weight multiplies the PPO term
whose ratio is ``pi_theta / pi_old``; ``mu`` enters only through the weight ``pi_old / mu``).
``dppo_tv``, ``decoupled_ppo`` and ``m2po`` are mismatch treatments themselves and accept only
``correction="none"``. ``ppo`` and ``grpo`` compute the same loss; they differ in how the caller
builds advantages. ``dppo_tv`` multiplies the (SAT-able) clipped surrogate with ratio
``pi_theta / mu`` by its keep-mask. ``m2po`` has no ratio clip (AReaL's M2PO objective
``M * pi_theta / pi_old * A``), so SAT is rejected for it. ``resolve()`` returns the validated
combination as a ``LossSpec``.

``compute_loss`` returns ``policy_loss``'s metrics, whose ``staleness/abs_logratio_mean`` uses
the ratio's own denominator, plus ``staleness/abs_logratio_mean_mu`` = mean ``|logp -
rollout_logp|`` over active tokens (the paper's ``d̄π`` against the behaviour policy, comparable
across algorithms), ``staleness/ess`` = the normalised Kish ESS of the sequence importance
weights ``pi/mu`` (``offpolicy.sequence_ess``), and ``loss/token_weight_mean``,
``loss/token_weight_zero_frac`` when a per-token factor is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sat_cli import metric_names as M
from sat_cli.rl import corrections as corr
from sat_cli.rl import offpolicy as off
from sat_cli.rl.config import LossConfig
from sat_cli.rl.losses import policy_loss
from sat_cli.rl.names import DENOMINATORS


@dataclass(frozen=True)
class AlgoSpec:
    name: str
    level: str  # "token" | "sequence" | "sequence_token"
    denominator: str  # "config" (follows ratio_denominator) | "rollout" | "old" | "custom"
    clip: bool  # False: unclipped surrogate r * A
    accepts_correction: bool
    token_factor: Callable[..., torch.Tensor | None]  # extra detached [B, T] weight or None
    # "custom" algorithms: fn(**ctx) -> Prep (denominator, advantages, metrics)
    prepare: Callable[..., off.Prep] | None = None
    needs: tuple[str, ...] = ()  # extra compute_loss inputs the trainer must pass

    @property
    def always_needs_old_logp(self) -> bool:
        return self.denominator == "old"


@dataclass(frozen=True)
class CorrectionSpec:
    name: str
    needs_old_logp: bool
    weights: Callable[..., torch.Tensor | None]  # detached [B, T] weight or None


ALGORITHMS: dict[str, AlgoSpec] = {}
CORRECTIONS: dict[str, CorrectionSpec] = {}


def register_algorithm(
    name, *, level, denominator, clip=True, accepts_correction=True, prepare=None, needs=()
):
    def deco(fn):
        ALGORITHMS[name] = AlgoSpec(
            name, level, denominator, clip, accepts_correction, fn, prepare, tuple(needs)
        )
        return fn

    return deco


def register_correction(name, *, needs_old_logp):
    def deco(fn):
        CORRECTIONS[name] = CorrectionSpec(name, needs_old_logp, fn)
        return fn

    return deco


def _none(**_):
    return None


for _name, _level in (
    ("ppo", "token"),
    ("grpo", "token"),
    ("gspo", "sequence"),
    ("gspo_token", "sequence_token"),
):
    register_algorithm(_name, level=_level, denominator="config")(_none)


@register_algorithm("dppo_tv", level="token", denominator="rollout", accepts_correction=False)
def _dppo_tv(*, logp, rollout_logp, advantages, p, **_):
    return corr.dppo_tv_mask(logp, rollout_logp, advantages, delta=p["dppo_delta"])


@register_algorithm("decoupled_ppo", level="token", denominator="old", accepts_correction=False)
def _decoupled(*, old_logp, rollout_logp, p, **_):
    return corr.behaviour_weights(old_logp, rollout_logp, cap=p["behav_cap"], mode=p["behav_mode"])


@register_algorithm("m2po", level="token", denominator="old", clip=False, accepts_correction=False)
def _m2po(*, old_logp, rollout_logp, mask, p, **_):
    return corr.m2po_mask(old_logp, rollout_logp, mask, tau=p["m2po_tau"])


register_algorithm(
    "a3po",
    level="token",
    denominator="custom",
    accepts_correction=False,
    prepare=off.a3po_prepare,
    needs=("versions", "current_version"),
)(_none)


register_algorithm(
    "vcpo",
    level="token",
    denominator="custom",
    clip=False,
    accepts_correction=False,
    prepare=off.vcpo_prepare,
    needs=("seq_score_sqnorm",),
)(_none)


register_correction("none", needs_old_logp=False)(_none)


@register_correction("tis", needs_old_logp=True)
def _tis(*, old_logp, rollout_logp, p, **_):
    return corr.tis_weights(old_logp, rollout_logp, cap=p["tis_cap"])


@register_correction("mis", needs_old_logp=True)
def _mis(*, old_logp, rollout_logp, p, **_):
    return corr.mis_weights(old_logp, rollout_logp, cap=p["tis_cap"])


@register_correction("icepop", needs_old_logp=True)
def _icepop(*, old_logp, rollout_logp, p, **_):
    return corr.icepop_weights(old_logp, rollout_logp, low=p["icepop_low"], high=p["icepop_high"])


def valid_names() -> dict[str, list[str]]:
    """``{"algorithms": [...], "corrections": [...]}`` (sorted), for config validation."""
    return {"algorithms": sorted(ALGORITHMS), "corrections": sorted(CORRECTIONS)}


def get_algorithm(name: str) -> AlgoSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def get_correction(name: str) -> CorrectionSpec:
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; valid: {', '.join(sorted(CORRECTIONS))}")
    return CORRECTIONS[name]


@dataclass(frozen=True)
class LossSpec:
    """A validated (algorithm, correction) combination, as a trainer needs to know it."""

    algo: str
    correction: str
    level: str  # "token" | "sequence" | "sequence_token"
    denominator: str  # "rollout" (mu) | "old" (recomputed pi_old) | "custom" (a3po, vcpo)
    needs_old_logp: bool  # the trainer must run the recompute pass
    clip: bool  # False: unclipped surrogate (m2po, vcpo); SAT not allowed
    needs: tuple[str, ...] = ()  # extra inputs: "versions", "current_version", "seq_score_sqnorm"


def resolve(algo: str, correction: str = "none", ratio_denominator: str = "rollout") -> LossSpec:
    """Validate a combination and say which denominator it uses (table in the module doc)."""
    a, c = get_algorithm(algo), get_correction(correction)
    if ratio_denominator not in DENOMINATORS:
        raise ValueError(
            f"unknown ratio_denominator {ratio_denominator!r}; valid: {', '.join(DENOMINATORS)}"
        )
    if c.name != "none" and not a.accepts_correction:
        raise ValueError(
            f"algorithm {algo!r} is itself a mismatch treatment; use correction='none'"
        )
    if a.denominator != "config":
        denom = a.denominator
    elif c.name != "none" or ratio_denominator == "recompute":
        denom = "old"
    else:
        denom = "rollout"
    needs_old = denom == "old" or c.needs_old_logp
    return LossSpec(a.name, c.name, a.level, denom, needs_old, a.clip, a.needs)


def needs_old_logp(algo: str, correction: str = "none", ratio_denominator: str = "rollout"):
    """Whether the trainer must run the recompute pass (``old_logp``) for this combination."""
    return resolve(algo, correction, ratio_denominator).needs_old_logp


_INPUTS = (
    "logp",
    "rollout_logp",
    "advantages",
    "mask",
    "old_logp",
    "versions",
    "current_version",
    "seq_score_sqnorm",
)


def compute_loss(algo_name: str, correction_name: str = "none", **kwargs):
    """``compute`` with the settings as keywords beside the tensors (``LossConfig``'s field
    names and defaults: ``eps_low``, ``eps_high``, ``adaptive``, ``quantile``, ``exponent``,
    ``anchor``, ``q_rows``, ``agg``, ``dual_clip_c``, ``ratio_denominator``, ``tis_cap``,
    ``icepop_low``, ``icepop_high``, ``dppo_delta``, ``m2po_tau``, ``behav_cap``,
    ``behav_mode``, ``group_size``, ``vcpo_is_cap``, ``vcpo_ess_base``, ``vcpo_opob``)."""
    inputs = {k: kwargs.pop(k) for k in _INPUTS if k in kwargs}
    try:
        cfg = LossConfig(algo=algo_name, correction=correction_name, **kwargs)
    except TypeError as exc:
        raise TypeError(f"compute_loss: {exc}") from None
    return compute(cfg, **inputs)


def compute(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
    seq_score_sqnorm: torch.Tensor | None = None,
    diag: dict | None = None,
):
    """Compose ``cfg``'s algorithm and correction into ``policy_loss``; returns ``(loss, metrics)``
    (extra metrics: module docstring). ``versions`` (``[B]`` or ``[B, T]``), ``current_version``
    and ``seq_score_sqnorm`` (``[B]``) are read only by the algorithms that need them
    (``AlgoSpec.needs``). ``cfg.kl_coef`` is the trainer's business (``trainers.step``).
    ``diag``: a dict to fill with ``policy_loss``'s per-token diagnostics plus ``abs_d_mu``
    (``[N]`` float32, ``|logp - rollout_logp|`` of the active tokens: the mismatch against the
    behaviour policy, whatever the denominator)."""
    algo_name, correction_name = cfg.algo, cfg.correction
    eps_low, eps_high, agg = cfg.eps_low, cfg.eps_high, cfg.agg
    ratio_denominator, adaptive = cfg.ratio_denominator, cfg.adaptive
    spec = resolve(algo_name, correction_name, ratio_denominator)
    a, c, denom = ALGORITHMS[spec.algo], CORRECTIONS[spec.correction], spec.denominator
    if spec.needs_old_logp and old_logp is None:
        raise ValueError(
            f"{algo_name!r} with correction {correction_name!r} needs old_logp (recompute pass)"
        )
    if adaptive and not a.clip:
        raise ValueError(f"SAT contracts a clip interval; {algo_name!r} has none")
    p = {
        "tis_cap": cfg.tis_cap,
        "icepop_low": cfg.icepop_low,
        "icepop_high": cfg.icepop_high,
        "dppo_delta": cfg.dppo_delta,
        "m2po_tau": cfg.m2po_tau,
        "behav_cap": cfg.behav_cap,
        "behav_mode": cfg.behav_mode,
        "group_size": cfg.group_size,
        "vcpo_is_cap": cfg.vcpo_is_cap,
        "vcpo_ess_base": cfg.vcpo_ess_base,
        "vcpo_opob": cfg.vcpo_opob,
    }
    ctx = dict(
        logp=logp,
        rollout_logp=rollout_logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        p=p,
        versions=versions,
        current_version=current_version,
        seq_score_sqnorm=seq_score_sqnorm,
    )
    denom_logp = old_logp if denom == "old" else rollout_logp
    extra: dict[str, float] = {}
    factors = [a.token_factor(**ctx), c.weights(**ctx)]
    if a.prepare is not None:
        prep = a.prepare(**ctx)
        denom_logp = prep.denom_logp
        advantages = advantages if prep.advantages is None else prep.advantages
        agg = prep.agg or agg
        extra.update(prep.metrics or {})
        factors.append(prep.factor)
    weight = None
    for factor in factors:
        if factor is not None:
            weight = factor if weight is None else weight * factor
    if not a.clip:
        eps_low = eps_high = math.inf
    loss, metrics = policy_loss(
        logp,
        denom_logp,
        advantages,
        mask,
        level=a.level,
        eps_low=eps_low,
        eps_high=eps_high,
        adaptive=adaptive,
        quantile=cfg.quantile,
        exponent=cfg.exponent,
        agg=agg,
        dual_clip_c=cfg.dual_clip_c,
        token_weights=weight,
        anchor=cfg.anchor,
        q_rows=cfg.q_rows,
        diag=diag,
    )
    metrics.update(extra)
    if denom == "rollout":
        metrics[M.DPI_MU] = metrics[M.DPI]
        if diag is not None:
            diag["abs_d_mu"] = diag["abs_d"]
    else:
        with torch.no_grad():
            m = mask.bool()
            d_mu = torch.where(m, logp.detach() - rollout_logp.detach(), 0.0)
            metrics[M.DPI_MU] = float(d_mu.abs().sum()) / max(int(m.sum()), 1)
            if diag is not None:
                diag["abs_d_mu"] = d_mu.abs()[m].float().cpu()
    metrics[M.ESS] = off.sequence_ess(logp, rollout_logp, mask)
    if weight is not None:
        with torch.no_grad():
            m = mask.bool()
            w = weight[m].double()
            n = max(w.numel(), 1)
            metrics[M.TOKEN_WEIGHT_MEAN] = float(w.sum()) / n
            metrics[M.TOKEN_WEIGHT_ZERO_FRAC] = float((w == 0).sum()) / n
    return loss, metrics
