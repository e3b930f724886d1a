"""Registry of policy-loss algorithms and mismatch corrections, composed per ALGORITHMS.md §5.

The one way into the loss: ``compute(cfg, inputs) -> LossOutputs`` with the trainer's
``LossConfig`` (``sat_cli.rl.config``: every setting) and a ``LossInputs`` (``rl.loss_io``: the
tensors of one minibatch). Each algorithm is registered with ``@register_algorithm`` together
with its ratio level, its denominator and a function ``(inputs, cfg)`` returning its extra
per-token mask/weight; each correction with ``@register_correction``. ``valid_names()`` lists
both for config validation, and unknown names raise ``ValueError`` listing the valid ones.

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

Two additions compose with the clipped algorithms without a behaviour weight of their own
(``names.TRUST_ALGOS``: ppo, grpo, gspo, gspo_token, dppo_tv): the sequence trust region
(``str_delta``, ``rl.seq_trust``) multiplies the per-token factor by 0 on every token of a
response whose mean Bernoulli ``KL(mu || pi)`` exceeds ``str_delta``; score centering
(``score_centering``, ``rl.score_centering``; coefficients for the loss's token weight; not on
``dppo_tv``, whose keep-mask it cannot cancel: ``names.CENTERING_ALGOS``) adds
``A * sum_H sg(c_v) log p_v`` per token, aggregated like the policy loss, from the
``LossInputs`` top-k fields (a response the trust region drops carries no centering either).

``compute``'s metrics are ``policy_loss``'s, whose ``staleness/abs_logratio_mean`` uses
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
from sat_cli.rl.loss_io import LossInputs, LossOutputs
from sat_cli.rl.losses import aggregate, policy_loss
from sat_cli.rl.names import CENTERING_ALGOS, DENOMINATORS, TRUST_ALGOS
from sat_cli.rl.score_centering import score_centering_term, weight_for
from sat_cli.rl.seq_trust import str_keep

__all__ = ["LossInputs", "LossOutputs", "compute", "resolve", "valid_names"]

# (inputs, settings) -> a detached [B, T] factor on the per-token surrogate, or None
Factor = Callable[[LossInputs, LossConfig], torch.Tensor | None]


@dataclass(frozen=True)
class AlgoSpec:
    name: str
    level: str  # "token" | "sequence" | "sequence_token"
    denominator: str  # "config" (follows ratio_denominator) | "rollout" | "old" | "custom"
    clip: bool  # False: unclipped surrogate r * A
    accepts_correction: bool
    token_factor: Factor  # extra detached [B, T] weight or None
    # "custom" algorithms: fn(inputs, cfg) -> Prep (denominator, advantages, metrics)
    prepare: Callable[[LossInputs, LossConfig], off.Prep] | None = None
    needs: tuple[str, ...] = ()  # extra LossInputs fields the trainer must fill

    @property
    def always_needs_old_logp(self) -> bool:
        return self.denominator == "old"


@dataclass(frozen=True)
class CorrectionSpec:
    name: str
    needs_old_logp: bool
    weights: Factor  # detached [B, T] weight or None


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


def _none(x: LossInputs, cfg: LossConfig):
    return None


for _name, _level in (
    ("ppo", "token"),
    ("grpo", "token"),
    ("gspo", "sequence"),
    ("gspo_token", "sequence_token"),
):
    register_algorithm(_name, level=_level, denominator="config")(_none)


@register_algorithm("dppo_tv", level="token", denominator="rollout", accepts_correction=False)
def _dppo_tv(x: LossInputs, cfg: LossConfig):
    return corr.dppo_tv_mask(x.logp, x.rollout_logp, x.advantages, delta=cfg.dppo_delta)


@register_algorithm("decoupled_ppo", level="token", denominator="old", accepts_correction=False)
def _decoupled(x: LossInputs, cfg: LossConfig):
    return corr.behaviour_weights(
        x.old_logp, x.rollout_logp, cap=cfg.behav_cap, mode=cfg.behav_mode
    )


@register_algorithm("m2po", level="token", denominator="old", clip=False, accepts_correction=False)
def _m2po(x: LossInputs, cfg: LossConfig):
    return corr.m2po_mask(x.old_logp, x.rollout_logp, x.mask, tau=cfg.m2po_tau)


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
def _tis(x: LossInputs, cfg: LossConfig):
    return corr.tis_weights(x.old_logp, x.rollout_logp, cap=cfg.tis_cap)


@register_correction("mis", needs_old_logp=True)
def _mis(x: LossInputs, cfg: LossConfig):
    return corr.mis_weights(x.old_logp, x.rollout_logp, cap=cfg.tis_cap)


@register_correction("icepop", needs_old_logp=True)
def _icepop(x: LossInputs, cfg: LossConfig):
    return corr.icepop_weights(x.old_logp, x.rollout_logp, low=cfg.icepop_low, high=cfg.icepop_high)


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


def compute(cfg: LossConfig, inputs: LossInputs) -> LossOutputs:
    """The one way into the policy loss: ``cfg``'s algorithm and correction composed into
    ``policy_loss`` on ``inputs`` (extra metrics: module docstring). ``cfg.kl_coef`` is the
    trainer's business (``trainers.step``)."""
    x = inputs
    spec = resolve(cfg.algo, cfg.correction, cfg.ratio_denominator)
    a, c = ALGORITHMS[spec.algo], CORRECTIONS[spec.correction]
    if spec.needs_old_logp and x.old_logp is None:
        raise ValueError(
            f"{cfg.algo!r} with correction {cfg.correction!r} needs old_logp (recompute pass)"
        )
    if cfg.adaptive and not a.clip:
        raise ValueError(f"SAT contracts a clip interval; {cfg.algo!r} has none")
    denom_logp = x.old_logp if spec.denominator == "old" else x.rollout_logp
    _check_additions(cfg)
    advantages, extra = x.advantages, {}
    factors = [a.token_factor(x, cfg), c.weights(x, cfg)]
    keep = None  # the sequence trust region's [B, T] keep factor (cfg.str_delta)
    if cfg.str_delta is not None:
        keep, str_metrics = str_keep(x.logp, x.rollout_logp, x.mask, cfg.str_delta)
        factors.append(keep)
        extra.update(str_metrics)
    settings = cfg if a.clip else cfg.replace(eps_low=math.inf, eps_high=math.inf)
    if a.prepare is not None:
        prep = a.prepare(x, cfg)
        denom_logp = prep.denom_logp
        advantages = advantages if prep.advantages is None else prep.advantages
        settings = settings.replace(agg=prep.agg) if prep.agg else settings
        extra.update(prep.metrics or {})
        factors.append(prep.factor)
    weight = None
    for factor in factors:
        if factor is not None:
            weight = factor if weight is None else weight * factor
    diag = {} if x.diagnostics else None
    loss, metrics = policy_loss(
        x.logp,
        denom_logp,
        advantages,
        x.mask,
        settings,
        level=a.level,
        token_weights=weight,
        diag=diag,
    )
    if cfg.score_centering:
        agg = settings.agg if a.level == "token" else "seq-mean-token-mean"  # as policy_loss
        token_weight = weight_for(spec.level, spec.denominator, spec.correction, cfg)
        term, centering_metrics = _centering(x, token_weight, advantages, keep, agg)
        loss = loss + term
        extra.update(centering_metrics)
    metrics.update(extra)
    _mu_metrics(x, spec.denominator, metrics, diag)
    metrics[M.ESS] = off.sequence_ess(x.logp, x.rollout_logp, x.mask)
    if weight is not None:
        metrics.update(_weight_metrics(weight, x.mask))
    return LossOutputs(loss, metrics, diag)


def _check_additions(cfg: LossConfig) -> None:
    """The sequence trust region and score centering compose with ``TRUST_ALGOS`` only (clipped,
    no behaviour weight of their own), score centering with ``CENTERING_ALGOS`` only (drift-free
    there); score centering's own refusals: ``weight_for``."""
    on = [
        k
        for k, v in (
            ("str_delta", cfg.str_delta is not None),
            ("score_centering", cfg.score_centering),
        )
        if v
    ]
    if on and cfg.algo not in TRUST_ALGOS:
        raise ValueError(
            f"{' and '.join(on)} compose with the algorithms {', '.join(TRUST_ALGOS)} only; "
            f"got {cfg.algo!r}"
        )
    if cfg.score_centering and cfg.algo not in CENTERING_ALGOS:
        raise ValueError(
            f"score_centering is not drift-free on {cfg.algo!r} (its keep-mask is not a function "
            f"of the token's ratio); it composes with {', '.join(CENTERING_ALGOS)} only"
        )


def _centering(x: LossInputs, token_weight, advantages, keep, agg: str):
    """``(A * C aggregated like the policy loss, metrics)`` (``rl.score_centering``): per active
    token of a kept response (``keep``: the trust region's factor or None), ``A`` its advantage,
    the coefficients those of the loss's token weight ``token_weight``."""
    tk = (x.policy_topk_logp, x.sampler_topk_logp, x.topk_valid)
    if any(t is None for t in tk):
        raise ValueError(
            "score_centering needs policy_topk_logp, sampler_topk_logp and topk_valid "
            "(the sampler's top-k log-probs, algo.score_centering_topk > 0)"
        )
    m = x.mask.bool()  # [B, T]
    valid = tk[2].bool() & m[..., None]  # [B, T, K]: nothing at masked positions
    term, stats = score_centering_term(tk[0], tk[1], valid, token_weight)  # [B, T]
    adv = advantages.detach().to(term.dtype)
    adv = adv[:, None].expand_as(term) if adv.dim() == 1 else adv  # [B, T]
    weight = adv if keep is None else adv * keep
    per_token = torch.where(m, weight * term, 0.0)  # [B, T]
    n = int(m.sum())
    out = aggregate(per_token, m, n, agg)
    with torch.no_grad():
        d = max(n, 1)
        metrics = {M.CENTERING_TERM: float(out.detach())}
        for name, key in (
            (M.CENTERING_SAMPLER_HEAD, "sampler_head"),
            (M.CENTERING_POLICY_HEAD, "policy_head"),
            (M.CENTERING_ALPHA_MEAN, "alpha"),
        ):
            metrics[name] = float(stats[key][m].sum()) / d
    return out, metrics


def _mu_metrics(x: LossInputs, denominator: str, metrics: dict, diag: dict | None) -> None:
    """``staleness/abs_logratio_mean_mu`` (and ``diag["abs_d_mu"]``): the mismatch against the
    behaviour policy ``mu``, whatever the ratio's denominator."""
    if denominator == "rollout":
        metrics[M.DPI_MU] = metrics[M.DPI]
        if diag is not None:
            diag["abs_d_mu"] = diag["abs_d"]
        return
    with torch.no_grad():
        m = x.mask.bool()
        d_mu = torch.where(m, x.logp.detach() - x.rollout_logp.detach(), 0.0)
        metrics[M.DPI_MU] = float(d_mu.abs().sum()) / max(int(m.sum()), 1)
        if diag is not None:
            diag["abs_d_mu"] = d_mu.abs()[m].float().cpu()


def _weight_metrics(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and zero fraction of the per-token factor over active tokens."""
    with torch.no_grad():
        w = weight[mask.bool()].double()
        n = max(w.numel(), 1)
        return {
            M.TOKEN_WEIGHT_MEAN: float(w.sum()) / n,
            M.TOKEN_WEIGHT_ZERO_FRAC: float((w == 0).sum()) / n,
        }


def sat_inert(loss, num_minibatches: int) -> bool:
    """SAT (``loss.adaptive``) with a recompute denominator (TIS, MIS, IcePop, decoupled PPO,
    M2PO or ``ratio_denominator=recompute``) at one optimizer step per batch: the ratio's
    denominator is the current policy, ``d == 0``, SAT inert. ``loss``: a ``LossConfig``."""
    if not loss.adaptive or num_minibatches != 1:
        return False
    return resolve(loss.algo, loss.correction, loss.ratio_denominator).denominator == "old"
