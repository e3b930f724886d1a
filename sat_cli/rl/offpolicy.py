"""Off-policy baselines beyond the SAT paper: VCPO and A-3PO, plus the Kish ESS they rely on.

Pure tensor functions; ``sat_cli.rl.registry`` composes them into ``algo=vcpo`` / ``algo=a3po``.

Sources, and what could be read of them (stated because the equation numbers could not be):
the papers' bodies were not readable from this project's tools (only their abstracts and
first pages); the exact rules below come from the authors' own public code and documentation,
which the abstracts point to. No equation number of either paper is cited for that reason.

**Kish effective sample size** (used by VCPO and logged for every run as ``staleness/ess``):
for weights ``w_1..w_B``, ``ESS = (sum w)^2 / sum w^2`` and the normalised ``ESS / B`` lies in
``(0, 1]`` (1: all weights equal; 1/B: one sample carries everything). The weights are the
sequence importance ratios ``w_b = pi(y_b) / mu(y_b) = exp(sum_t (log pi - log mu))`` over the
response tokens (a product over tokens, not GSPO's geometric mean), computed in float64 after
subtracting the largest log-weight (ESS is scale invariant).

**VCPO** (Huang, Zhang, Hu, Yang, Han, "Stable Asynchrony: Variance-Controlled Off-Policy RL
for LLMs", arXiv 2602.17616; code github.com/mit-han-lab/vcpo, README "Overview" formulas and
``recipe/fully_async_policy/staleness_utils.py``, ``verl/workers/actor/megatron_actor.py``):

1. *ESS-guided step scaling* (README: ``eta_eff ∝ sqrt(rho_ess)``, ``rho_ess = ESS / B``): the
   optimizer step uses ``lr * sqrt(min(1, rho_ess / rho_base))`` with ``rho_base = 1`` and the
   unclipped sequence weights (the released scripts: ``ess_scaling_scaling_rule=sqrt``,
   ``base_ess_ratio=1.0``, ``use_clipped=False``). ``vcpo_lr_scale`` returns that factor; the
   trainer applies it to the learning rate of this step only.
2. *Off-policy optimal baseline* (README: ``b* = sum_i w_i^2 ||grad log pi(tau_i)||^2 R_i /
   sum_i w_i^2 ||grad log pi(tau_i)||^2``), per group of responses to one prompt (released
   scripts: ``grad_baselining_scope=group``, IS weights on, unclipped, ``norm_by_std=True``:
   the advantage is ``(R_i - b*) / std_group``). With GRPO's ``A_i = (R_i - mean) / std`` this
   is exactly ``A_i - sum_g W A / sum_g W`` with ``W_i = w_i^2 ||grad log pi(tau_i)||^2``,
   which is how ``vcpo_opob_advantages`` computes it from the loop's advantages **[choice]**:
   the std is the run's GRPO std (+1e-6), as for every other algorithm here. The released code
   measures ``||grad||`` of the per-trajectory *loss*, which already carries the truncated
   weight, so its ``W`` has that weight squared once more; the README formula (used here) does
   not. ``||grad log pi(tau_i)||^2`` is the squared norm of the gradient of the response's summed
   token log-probs, over all trainable parameters (one backward per response, in the trainer).
3. *Loss* (released scripts): REINFORCE with the sequence-level truncated IS weight
   ``min(w_i, 8)`` (``rollout_is=sequence``, threshold 8), no PPO clip
   (``clip_ratio_low=1, clip_ratio_high=1e9``), ``seq-mean-token-mean`` aggregation:
   ``loss = -mean_i (1/L_i) sum_t min(w_i, 8) * A'_i * log pi(y_t)`` (gradient only; the value
   is ``-mean_i min(w_i, 8) A'_i``).

**A-3PO** (Li, Wu, Shen, "A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware
Proximal Policy Approximation", arXiv 2512.06547; the abstract points to its implementation in
AReaL, ``docs/algorithms/prox_approx.md`` and ``areal/trainer/ppo/actor.py``
``compute_prox_logp_approximations``; the objective as on the first author's blog post):
decoupled PPO ``S = sg[pi_prox / mu] * min(r A, clip(r, 1 - eps, 1 + eps) A)``,
``r = pi_theta / pi_prox``, with the proximal policy *interpolated* instead of recomputed
("loglinear", the recommended method): ``log pi_prox = log mu + alpha * (sg[log pi_theta] -
log mu)``, ``alpha = (v_prox - v_behav) / (v_theta - v_behav)`` clamped to ``[0, 1]``, 0 where
``v_theta == v_behav``, with ``v_theta`` the trainer's current version (the step it holds),
``v_prox = v_theta - 1`` and ``v_behav`` the version that generated the token. For staleness
``k = v_theta - v_behav >= 1`` this is ``alpha = (k - 1) / k``: a one-step-old token gets
``pi_prox = mu`` (A-3PO = PPO against mu), a very stale one ``pi_prox ≈ pi_theta``.
Consequences here: the behaviour weight is ``exp(alpha d)`` and the ratio ``exp((1 - alpha) d)``
in value (``d = log pi_theta - log mu``); at lag 1 in interval mode every sample has ``k = 1``,
so A-3PO is GRPO with a rollout denominator, bit for bit.

**ESTR** (Zhao et al., "Deconstructing Off-Policy Ratios: Entropy-Scaled Trust Regions for
Asynchronous Reinforcement Learning", arXiv 2607.22186) is *not* implemented: only its abstract
could be read ("scales each token's off-policy deviation by its local entropy"), which does not
fix the formula (which deviation, which entropy, how it enters the trust region), and no
implementation by its authors was found. Issue 18 allows it only if the exact formula can be
established from the paper's text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sat_cli import metric_names as M
from sat_cli.rl.config import LossConfig
from sat_cli.rl.corrections import behaviour_weights
from sat_cli.rl.loss_io import LossInputs


@torch.no_grad()
def sequence_log_weights(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):
    """``log w_b = sum_t (logp - rollout_logp)`` over active tokens, float64 ``[B]``."""
    m = mask.bool()
    return torch.where(m, logp.detach().double() - rollout_logp.detach().double(), 0.0).sum(-1)


@torch.no_grad()
def kish_ess(log_w: torch.Tensor) -> float:
    """Normalised Kish ESS ``(sum w)^2 / (B sum w^2)`` of weights given as logs ``[B]``
    (``nan`` for an empty input or non-finite logs)."""
    n = log_w.numel()
    if n == 0 or not bool(torch.isfinite(log_w).all()):
        return math.nan
    w = torch.exp(log_w.double() - log_w.max())  # largest weight 1: no overflow
    return float(w.sum() ** 2 / (w * w).sum() / n)


@torch.no_grad()
def sequence_ess(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised ESS of the sequence importance weights pi/mu over the rows that have active
    tokens (module docstring)."""
    rows = mask.bool().any(-1)
    return kish_ess(sequence_log_weights(logp, rollout_logp, mask)[rows])


def vcpo_lr_scale(ess: float, base: float = 1.0) -> float:
    """VCPO's step scale ``sqrt(min(1, ess / base))`` (``ess`` normalised; 0 if not finite)."""
    if not math.isfinite(ess) or ess <= 0.0:
        return 0.0
    return math.sqrt(min(1.0, ess / base))


@torch.no_grad()
def vcpo_opob_advantages(
    adv: torch.Tensor, log_w: torch.Tensor, score_sqnorm: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    """``A'_i = A_i - sum_{j in g(i)} W_j A_j / sum_{j in g(i)} W_j`` with
    ``W_j = w_j^2 ||grad log pi(tau_j)||^2`` (float64 ``[B]``; a group with ``sum W = 0`` keeps
    its advantages). ``adv``, ``log_w``, ``score_sqnorm``, ``groups``: ``[B]``."""
    adv = adv.double()
    out = adv.clone()
    for g in torch.unique(groups):
        idx = (groups == g).nonzero().view(-1)
        lw = log_w[idx].double()
        if not bool(torch.isfinite(lw).all()):
            continue
        W = torch.exp(2.0 * (lw - lw.max())) * score_sqnorm[idx].double()  # scale-free per group
        tot = W.sum()
        if float(tot) > 0.0:
            out[idx] = adv[idx] - (W * adv[idx]).sum() / tot
    return out


@torch.no_grad()
def a3po_alpha(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """A-3PO's interpolation weight per token (or per sample): ``(v_theta - 1 - v) / (v_theta - v)``
    clamped to ``[0, 1]``, 0 where ``v_theta <= v`` (float64, the shape of ``versions``)."""
    v = versions.double()
    diff = float(current_version) - v
    alpha = torch.where(diff > 0, (diff - 1.0) / diff.clamp(min=1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


@torch.no_grad()
def a3po_prox_logp(
    logp: torch.Tensor, rollout_logp: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """``log pi_prox = log mu + alpha (sg[log pi_theta] - log mu)``; exactly ``log mu`` where
    ``alpha == 0`` (``alpha`` broadcastable to ``logp``)."""
    mu = rollout_logp.detach()
    a = alpha.to(logp.dtype).expand_as(logp)
    return torch.where(a > 0, mu + a * (logp.detach() - mu), mu)


# ----------------------------------------------------------------------------- registry glue


@dataclass
class Prep:
    """What a custom algorithm substitutes before ``policy_loss``."""

    denom_logp: torch.Tensor  # [B, T] ratio denominator (detached)
    advantages: torch.Tensor | None = None  # replaced advantages, or None: the caller's
    metrics: dict[str, float] | None = None
    agg: str | None = None  # forced aggregation, or None: the configured one
    factor: torch.Tensor | None = None  # detached [B, T] weight on the surrogate


def a3po_prepare(x: LossInputs, cfg: LossConfig) -> Prep:
    logp, rollout_logp, mask, versions = x.logp, x.rollout_logp, x.mask, x.versions
    current_version = x.current_version
    if versions is None or current_version is None:
        raise ValueError("algo 'a3po' needs the samples' weight versions and the current version")
    v = versions if versions.dim() == 2 else versions[:, None]  # [B, T] or [B, 1]
    alpha = a3po_alpha(v.to(logp.device), int(current_version))
    prox = a3po_prox_logp(logp, rollout_logp, alpha)  # [B, T], pi_prox
    w = behaviour_weights(prox, rollout_logp, cap=cfg.behav_cap, mode=cfg.behav_mode)
    a_tok = alpha.expand_as(logp)[mask.bool()]
    alpha_mean = float(a_tok.mean()) if a_tok.numel() else 0.0
    return Prep(prox, metrics={M.A3PO_ALPHA_MEAN: alpha_mean}, factor=w)


def _vcpo_seq_adv(advantages, mask):
    if advantages.dim() == 1:
        return advantages.double()
    m = mask.bool()
    a = torch.where(m, advantages.detach().double(), 0.0).sum(-1)
    return a / m.sum(-1).clamp(min=1)  # [B]; the loop gives one value per response


def vcpo_prepare(x: LossInputs, cfg: LossConfig) -> Prep:
    logp, rollout_logp, mask, seq_score_sqnorm = x.logp, x.rollout_logp, x.mask, x.seq_score_sqnorm
    log_w = sequence_log_weights(logp, rollout_logp, mask)  # [B], unclipped
    rows = mask.bool().any(-1)
    ess = kish_ess(log_w[rows])
    adv = _vcpo_seq_adv(x.advantages, mask)
    metrics = {M.VCPO_ESS: ess, M.LR_SCALE: vcpo_lr_scale(ess, cfg.vcpo_ess_base)}
    if cfg.vcpo_opob:
        if seq_score_sqnorm is None:
            raise ValueError("algo 'vcpo' with its optimal baseline needs seq_score_sqnorm")
        G = int(cfg.group_size or adv.numel())
        groups = torch.arange(adv.numel(), device=adv.device) // G
        new = vcpo_opob_advantages(adv, log_w, seq_score_sqnorm.to(adv.device), groups)
        metrics[M.VCPO_BASELINE_SHIFT] = float((new - adv)[rows].abs().mean())
        adv = new
    w = torch.exp(log_w).clamp(max=cfg.vcpo_is_cap)  # [B], truncated sequence weight
    factor = w.to(logp.dtype)[:, None].expand_as(logp)
    # denominator sg[log pi]: r == 1 in value, gradient of log pi (the score function)
    return Prep(logp.detach(), adv.to(logp.dtype), metrics, "seq-mean-token-mean", factor)
