"""Clipped policy-gradient surrogates (PPO/GRPO, GSPO, GSPO-token) with optional SAT bounds.

``policy_loss`` is a pure tensor function (ALGORITHMS.md §3-§4): it takes the trainer's log-probs
``logp`` (with grad), the ratio denominator ``denom_logp``, detached advantages, the loss mask
and the settings (a ``LossConfig``), and returns ``(loss, metrics)`` where ``loss`` is the
negative aggregated surrogate and ``metrics`` are detached Python floats. Trainers do not call
it: ``registry.compute`` composes an algorithm and a correction into it. Its parts: the ratio
(``_ratios``), SAT's bounds (``_sat_bounds``, ``_interval``), the surrogate (``_surrogate``)
and the metrics (``clip_metrics``).

Levels:
- ``"token"``: ``r = exp(logp - denom_logp)`` per token (PPO / GRPO).
- ``"sequence"``: GSPO, ``s_b = exp(mean_{t in mask} log r)``, gradient through the mean;
  every active token of ``y_b`` carries ``S_b``.
- ``"sequence_token"``: GSPO-token, ``log s = sg[log s_b] + logp - sg[logp]`` (same value as
  GSPO, per-token gradient path; allows per-token advantages).
Both GSPO levels force ``agg = "seq-mean-token-mean"``.

Surrogate: ``S = r_eff * A`` where ``r_eff`` is the violated bound when the clip binds
(``A > 0, r > upper`` or ``A < 0, r < lower``; no gradient) and ``r`` otherwise. This equals
``min(r A, clip(r, lower, upper) A)`` bit for bit, with the same gradient (tested), but avoids
``torch.minimum``'s tie-splitting backward. Dual clip, then ``token_weights``, then the mask.

SAT (``adaptive=True``, ALGORITHMS.md §4) takes ``d = sg[log r]`` of the same level: token
level uses ``sat.sat_token_bounds`` and patches only the gated tokens of the clipped ratio
(sparse; at most ``1 - quantile`` of them); the GSPO levels use ``sat.sat_sequence_bounds`` on
the ``B`` sequence log-ratios, so every token of a response shares one ``c``. With ``q == 0``
or no active tokens the PPO code path runs unchanged: bit-identical to ``adaptive=False``.

Aggregation (``agg``): ``token-mean`` = sum over active tokens / their count;
``seq-mean-token-mean`` = mean over sequences of per-sequence token means;
``seq-mean-token-sum`` = mean over sequences of per-sequence token sums. "Sequences" are those
with at least one active token **[choice]**: an all-padding row does not dilute the mean.

Masking: every masked-out position is replaced with ``torch.where`` *before* ``exp`` and before
any product, so NaN/inf there reach neither the loss nor the gradients. An empty mask gives
``loss == 0`` that is still connected to ``logp`` (``backward`` yields zeros).

Metrics: ``sat_cli.rl.clip_metrics`` (clip fractions per side, SAT's band and stats, the
staleness ``d̄π``, ``k3``), computed from this loss's own tensors in one host sync.

SAT scope (``q_rows``): ``None`` (default) takes one order statistic over the whole batch the
loss sees (one optimizer minibatch); an int takes it per block of that many consecutive rows,
the paper's per-micro-batch-per-rank scope (slime computes the loss per micro-batch on each
rank). Then ``sat/q`` and the SAT means are active-token-weighted over blocks and
``sat/active*`` are the token-weighted fractions of blocks where SAT can act.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sat_cli import metric_names as M
from sat_cli.rl.clip_metrics import clip_metrics, sequence_band, token_diagnostics
from sat_cli.rl.config import LossConfig
from sat_cli.rl.names import LEVELS
from sat_cli.rl.names import LOSS_AGGS as AGGS
from sat_cli.rl.sat import merge_bounds, sat_sequence_bounds, sat_token_bounds


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} vs logp {tuple(like.shape)}")
        return advantages[:, None].expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} vs logp {tuple(like.shape)}")
    return advantages


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, n_active: int, agg: str) -> torch.Tensor:
    """Aggregate a per-token quantity that is already 0 on masked positions (see module doc)."""
    if agg == "token-mean":
        return per_token.sum() / max(n_active, 1)
    lens = mask.sum(-1)  # [B]
    n_seq = (lens > 0).sum().clamp(min=1)
    seq_sum = per_token.sum(-1)  # [B]
    if agg == "seq-mean-token-mean":
        return (seq_sum / lens.clamp(min=1)).sum() / n_seq
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGGS)}")


def _surrogate(ratio, adv, lower, upper, dual_clip_c, patch=None):
    """``S = r_eff * A`` with ``r_eff`` the bound where the clip binds (``A > 0, r > upper`` or
    ``A < 0, r < lower``: no gradient) and ``r`` elsewhere. Bit for bit the value of
    ``min(r A, clip(r, lower, upper) A)`` with the same gradient, without ``minimum``'s tie
    splitting in backward. Bounds are Python floats or tensors broadcastable to ``ratio``.

    ``patch = (index, bound, upper_side)`` (sparse SAT on a ``[B, T]`` token ratio) replaces
    the bound of those flat entries; only entries whose contracted endpoint is the one their
    advantage sign uses can change. Returns ``(S, n_clipped, n_band)``: tokens clipped by the
    interval actually used, and among them those clipped only because of the patch.
    """
    r = ratio.detach()
    clip_hi = (adv > 0) & (r > upper)  # [B, T]
    clip_lo = (adv < 0) & (r < lower)  # [B, T]
    r_eff = torch.where(clip_hi, upper, torch.where(clip_lo, lower, ratio))  # [B, T]
    # counts per side (A > 0 clips at the upper bound, A < 0 at the lower: disjoint)
    n_clip = torch.stack([clip_lo.sum(), clip_hi.sum()])  # [2]: low, high
    n_band = torch.zeros_like(n_clip)
    if patch is not None:
        idx, bound, side = patch
        a_g, r_g = adv.reshape(-1)[idx], r.reshape(-1)[idx]  # [G]
        hit = torch.where(side, (a_g > 0) & (r_g > bound), (a_g < 0) & (r_g < bound))
        was = torch.where(side, (a_g > 0) & (r_g > upper), (a_g < 0) & (r_g < lower))
        band = hit & ~was
        n_band = torch.stack([(band & ~side).sum(), (band & side).sum()])
        n_clip = n_clip + n_band
        cols = ratio.shape[-1]
        h = hit.nonzero().view(-1)
        idx, bound = idx[h], bound[h]
        # In place on where()'s fresh output (its backward does not need it): the patched
        # entries become constants, so their gradient is exactly 0.
        r_eff = r_eff.index_put_((idx // cols, idx % cols), bound)
    surr = r_eff * adv  # [B, T]
    if dual_clip_c is not None:
        surr = torch.where(adv < 0, torch.maximum(surr, dual_clip_c * adv), surr)
    return surr, n_clip, n_band


def clipped_surrogate(ratio, adv, lower, upper, dual_clip_c=None) -> torch.Tensor:
    """Per-token ``S = min(r A, clip(r, lower, upper) A)`` (bounds: Python floats or tensors
    broadcastable to ``ratio``), then ``S = max(S, c A)`` where ``A < 0`` if ``dual_clip_c``."""
    return _surrogate(ratio, adv, lower, upper, dual_clip_c)[0]


@dataclass
class Ratios:
    """The level's ratio and the log-ratios it is built from (``_ratios``)."""

    level: str
    token_lr: torch.Tensor  # [B, T] log r per token (with grad), 0 off-mask
    abs_lr: torch.Tensor  # [B, T] detached |token_lr|: SAT's token d and the staleness metric
    ratio: torch.Tensor  # [B, T] the level's ratio (with grad)
    seq_lr: torch.Tensor | None = None  # [B, 1] log s_b (GSPO levels)
    lens: torch.Tensor | None = None  # [B, 1] active tokens per response (GSPO levels)


def _ratios(logp, denom_logp, mask, level) -> Ratios:
    """The ratio of ``level`` (module doc, "Levels"); ``mask`` is boolean."""
    token_lr = torch.where(mask, logp - denom_logp.detach(), 0.0)  # [B, T], 0 off-mask
    abs_lr = token_lr.detach().abs()  # [B, T]
    if level == "token":
        return Ratios(level, token_lr, abs_lr, torch.exp(token_lr))
    lens = mask.sum(-1, keepdim=True)  # [B, 1]
    seq_lr = token_lr.sum(-1, keepdim=True) / lens.clamp(min=1)  # [B, 1], log s_b
    if level == "sequence":
        ratio = torch.exp(seq_lr).expand_as(logp)  # [B, T], gradient through the mean
    else:
        logp_m = torch.where(mask, logp, 0.0)  # [B, T]
        ratio = torch.exp(seq_lr.detach() + (logp_m - logp_m.detach()))  # [B, T]
    return Ratios(level, token_lr, abs_lr, ratio, seq_lr, lens)


def _sat_bounds(r: Ratios, cfg: LossConfig, blocks, n_active: int):
    """SAT's bounds on ``d = sg[log r]`` of the level (token: sparse; GSPO: per response),
    one ``q`` per block of rows (``_row_blocks``)."""
    if r.level == "token":
        d = r.token_lr.detach()

        def part(r0, r1, n_c):
            return sat_token_bounds(d[r0:r1], n_c, cfg, abs_d=r.abs_lr[r0:r1])

        if len(blocks) == 1:
            return sat_token_bounds(d, n_active, cfg, abs_d=r.abs_lr)
        return _merge_blocks(blocks, part, r.token_lr.shape[-1])
    seq = r.seq_lr.detach()
    if len(blocks) == 1:
        return sat_sequence_bounds(seq, r.lens, n_active, cfg)
    return _merge_blocks(
        blocks, lambda r0, r1, n_c: sat_sequence_bounds(seq[r0:r1], r.lens[r0:r1], n_c, cfg), 1
    )


def _interval(r: Ratios, sat, cfg: LossConfig):
    """``(lower, upper, patch)`` for ``_surrogate``: PPO's radii, with SAT's gated tokens
    patched (token level) or one bound pair per response (GSPO levels)."""
    lower, upper = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    if sat is None or sat.index is None:
        return lower, upper, None
    if r.level == "token":  # sparse: patch the gated tokens only
        return lower, upper, (sat.index, sat.bound, sat.upper_side)
    lower, upper = sat.dense(r.seq_lr.detach(), cfg.eps_low, cfg.eps_high)  # [B, 1]
    return lower, upper, None


def _check(logp, denom_logp, mask, level: str, cfg: LossConfig) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown ratio level {level!r}; valid: {', '.join(LEVELS)}")
    if cfg.agg not in AGGS:
        raise ValueError(f"unknown loss aggregation {cfg.agg!r}; valid: {', '.join(AGGS)}")
    if cfg.dual_clip_c is not None and not cfg.dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {cfg.dual_clip_c}")
    if logp.shape != denom_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, denom_logp {tuple(denom_logp.shape)},"
            f" mask {tuple(mask.shape)}"
        )
    if cfg.q_rows is not None and cfg.q_rows < 1:
        raise ValueError(f"q_rows must be >= 1, got {cfg.q_rows}")


DEFAULT = LossConfig()


def policy_loss(
    logp: torch.Tensor,
    denom_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig = DEFAULT,
    *,
    level: str = "token",
    token_weights: torch.Tensor | None = None,
    diag: dict | None = None,
):
    """Negative clipped surrogate and detached metrics.

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens, with grad.
        denom_logp: ``[B, T]`` ratio denominator (rollout or recomputed old log-probs); detached.
        advantages: ``[B]`` (per sequence) or ``[B, T]``; detached.
        mask: ``[B, T]``, nonzero on tokens that count in the loss.
        cfg: the settings read here: ``eps_low``, ``eps_high`` (clip radii; ``math.inf``
            disables the clip), ``adaptive`` (SAT bounds; ``quantile``, ``exponent``,
            ``anchor`` as in ``sat``), ``q_rows`` (SAT's scope: ``None`` = one ``q`` over the
            whole (mini)batch, an int = one per block of that many rows), ``agg`` and
            ``dual_clip_c`` (if set, > 1: ``S = max(S, c * A)`` where ``A < 0``).
        level: ``"token"`` | ``"sequence"`` (GSPO) | ``"sequence_token"`` (GSPO-token).
        token_weights: ``[B, T]`` detached factors (IS weights, masks) on the per-token surrogate.
        diag: if a dict, filled with the detached per-token quantities this loss used
            (``token_diagnostics``): the step's histograms come from these, not from a second
            SAT computation.

    Returns:
        ``(loss, metrics)``; ``loss`` is a 0-dim tensor, ``metrics`` a dict of Python floats.
    """
    _check(logp, denom_logp, mask, level, cfg)
    agg = cfg.agg if level == "token" else "seq-mean-token-mean"
    mask = mask.bool()  # [B, T]
    n_active = int(mask.sum())  # one host sync; needed for the order statistic anyway
    adv = _broadcast_advantages(advantages.detach().to(logp.dtype), logp)
    adv = torch.where(mask, adv, 0.0)  # [B, T]
    r = _ratios(logp, denom_logp, mask, level)
    blocks = _row_blocks(mask, cfg.q_rows)  # [(r0, r1, n_active)], one block = the whole batch
    sat = _sat_bounds(r, cfg, blocks, n_active) if cfg.adaptive else None
    lower, upper, patch = _interval(r, sat, cfg)
    surr, n_clip, n_band = _surrogate(r.ratio, adv, lower, upper, cfg.dual_clip_c, patch)
    if token_weights is not None:
        surr = surr * torch.where(mask, token_weights.detach(), 0.0)
    # surr is exactly 0 off-mask: A (and any weight) is 0 there and the ratio is finite
    # (exp(0) = 1 per token; s_b of the row for GSPO), so no final masking pass is needed.
    loss = -aggregate(surr, mask, n_active, agg)

    with torch.no_grad():
        # masked slots have A == 0 and are never clipped
        if sat is not None and sat.index is not None and level != "token":
            n_band = sequence_band(r, adv, sat, (lower, upper), cfg)
        metrics = clip_metrics(loss, r, (n_clip, n_band), sat, n_active, blocks, cfg)
        if sat is None and n_active and math.isfinite(cfg.eps_low + cfg.eps_high):
            # the q SAT would compute on this batch: a pre-treatment quantity of a run without SAT
            shadow = _sat_bounds(r, cfg.replace(adaptive=True), blocks, n_active)
            metrics[M.SAT_Q_SHADOW] = float(shadow.stats[M.SAT_Q])
        if diag is not None:
            diag.update(
                token_diagnostics(
                    r.abs_lr, mask, sat, level, lower, upper, cfg.eps_low, cfg.eps_high
                )
            )
    return loss, metrics


def _row_blocks(mask: torch.Tensor, q_rows: int | None) -> list[tuple[int, int, int]]:
    """``(r0, r1, n_active)`` per block of ``q_rows`` consecutive rows (blocks without active
    tokens are left out); one block spanning all rows when ``q_rows`` is None or >= B."""
    B = mask.shape[0]
    if q_rows is None or q_rows >= B:
        return [(0, B, -1)]
    per_row = mask.sum(-1).tolist()
    out = []
    for r0 in range(0, B, q_rows):
        r1 = min(r0 + q_rows, B)
        n_c = int(sum(per_row[r0:r1]))
        if n_c:
            out.append((r0, r1, n_c))
    return out or [(0, B, -1)]


def _merge_blocks(blocks, compute, cols: int):
    """SAT per block of rows, merged (``sat.merge_bounds``); flat indices offset by ``r0 * cols``.
    The merged bounds carry ``block_qs`` = ``[(q, n_active)]`` for the active flags."""
    parts = []
    for r0, r1, n_c in blocks:
        b = compute(r0, r1, n_c)
        if b.index is not None:
            b.index = b.index + r0 * cols
        parts.append((b, n_c))
    merged = merge_bounds(parts)
    merged.block_qs = [(b.q, n_c) for b, n_c in parts]
    return merged


def kl_k3_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean"
) -> torch.Tensor:
    """``low_var_kl`` (k3) of pi_theta against a reference policy, with gradient (ALGORITHMS §5).

    ``k3 = exp(ref - logp) - 1 + (logp - ref)`` per token, aggregated like the policy loss.
    """
    mask = mask.bool()
    lr = torch.where(mask, logp - ref_logp.detach(), 0.0)  # [B, T]
    k3 = torch.expm1(-lr) + lr  # [B, T], 0 off-mask
    return aggregate(k3, mask, int(mask.sum()), agg)
