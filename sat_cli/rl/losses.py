"""Clipped policy-gradient surrogates (PPO/GRPO, GSPO, GSPO-token) with optional SAT bounds.

``policy_loss`` is a pure tensor function (ALGORITHMS.md §3-§4): it takes the trainer's log-probs
``logp`` (with grad), the ratio denominator ``denom_logp``, detached advantages and the loss mask,
and returns ``(loss, metrics)`` where ``loss`` is the negative aggregated surrogate and
``metrics`` are detached Python floats.

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

Metrics: ``loss/policy``; ``loss/clipfrac`` = fraction of active tokens whose PPO clip binds
(``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low`` on the level's ratio, i.e. gradient zeroed),
split by side into ``loss/clipfrac_low`` (``A < 0`` at the lower bound) and ``loss/clipfrac_high``;
``sat/clipfrac_sat_band`` = fraction clipped by SAT's interval but not by PPO's (0 without SAT:
the tokens whose gradient SAT actually removed), likewise split ``_low`` / ``_high``;
``staleness/abs_logratio_mean`` = mean ``|logp - denom_logp|`` on *token* ratios (also for
GSPO); ``loss/kl_k3`` = mean of ``exp(-log r) - 1 + log r`` on token ratios; with SAT also
``sat/q``, ``sat/gate_rate``, ``sat/eps_low_eff_mean``, ``sat/eps_high_eff_mean``, ``sat/c_min``
and ``sat/active``: 1.0 iff ``q < max(ln(1 + eps_high), -ln(1 - eps_low))``, the regime where
the paper's SAT can change a gradient with one optimizer step per batch (``sat_can_act``; for
``q`` between 0.182 and 0.223 at eps = 0.2 only the lower side can act: tokens with ``d < 0``,
``A < 0`` and ``q < |d| < 0.223``). Per side: ``sat/active_low``, ``sat/active_high``. The loop
averages ``sat/active`` into ``sat/active_frac``.

SAT scope (``q_rows``): ``None`` (default) takes one order statistic over the whole batch the
loss sees (one optimizer minibatch); an int takes it per block of that many consecutive rows,
the paper's per-micro-batch-per-rank scope (slime computes the loss per micro-batch on each
rank). Then ``sat/q`` and the SAT means are active-token-weighted over blocks and
``sat/active*`` are the token-weighted fractions of blocks where SAT can act.
"""

from __future__ import annotations

import math

import torch

from sat_cli import metric_names as M
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


def policy_loss(
    logp: torch.Tensor,
    denom_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    adaptive: bool = False,
    quantile: float = 0.9,
    exponent: float = 2.0,
    agg: str = "token-mean",
    dual_clip_c: float | None = None,
    token_weights: torch.Tensor | None = None,
    anchor: str = "q",
    q_rows: int | None = None,
    diag: dict | None = None,
):
    """Negative clipped surrogate and detached metrics.

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens, with grad.
        denom_logp: ``[B, T]`` ratio denominator (rollout or recomputed old log-probs); detached.
        advantages: ``[B]`` (per sequence) or ``[B, T]``; detached.
        mask: ``[B, T]``, nonzero on tokens that count in the loss.
        level: ``"token"`` | ``"sequence"`` (GSPO) | ``"sequence_token"`` (GSPO-token).
        eps_low, eps_high: clip radii (``math.inf`` disables the clip).
        adaptive: use SAT bounds; ``quantile``, ``exponent``, ``anchor`` as in ``sat``.
        agg: ``token-mean`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum``.
        dual_clip_c: if set (> 1), ``S = max(S, c * A)`` where ``A < 0``.
        token_weights: ``[B, T]`` detached factors (IS weights, masks) on the per-token surrogate.
        q_rows: SAT's scope: ``None`` = one ``q`` over the whole (mini)batch; an int = one ``q``
            per block of that many consecutive rows (the paper's per-micro-batch scope).
        diag: if a dict, filled with the detached per-token quantities this loss used
            (``token_diagnostics``): the step's histograms come from these, not from a second
            SAT computation.

    Returns:
        ``(loss, metrics)``; ``loss`` is a 0-dim tensor, ``metrics`` a dict of Python floats.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown ratio level {level!r}; valid: {', '.join(LEVELS)}")
    if agg not in AGGS:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGGS)}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if logp.shape != denom_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, denom_logp {tuple(denom_logp.shape)},"
            f" mask {tuple(mask.shape)}"
        )
    if level != "token":
        agg = "seq-mean-token-mean"
    sat_kw = dict(
        eps_low=eps_low, eps_high=eps_high, quantile=quantile, exponent=exponent, anchor=anchor
    )

    mask = mask.bool()  # [B, T]
    n_active = int(mask.sum())  # one host sync; needed for the order statistic anyway
    adv = _broadcast_advantages(advantages.detach().to(logp.dtype), logp)
    adv = torch.where(mask, adv, 0.0)  # [B, T]
    token_lr = torch.where(mask, logp - denom_logp.detach(), 0.0)  # [B, T], 0 off-mask

    if q_rows is not None and q_rows < 1:
        raise ValueError(f"q_rows must be >= 1, got {q_rows}")
    blocks = _row_blocks(mask, q_rows)  # [(r0, r1, n_active)], one block = the whole batch

    sat = None
    abs_lr = token_lr.detach().abs()  # [B, T], also the staleness metric
    if level == "token":
        ratio = torch.exp(token_lr)  # [B, T]
        if adaptive and len(blocks) == 1:
            sat = sat_token_bounds(token_lr.detach(), n_active, abs_d=abs_lr, **sat_kw)
        elif adaptive:
            cols = logp.shape[-1]
            sat = _merge_blocks(
                blocks,
                lambda r0, r1, n_c: sat_token_bounds(
                    token_lr.detach()[r0:r1], n_c, abs_d=abs_lr[r0:r1], **sat_kw
                ),
                cols,
            )
    else:
        lens = mask.sum(-1, keepdim=True)  # [B, 1]
        seq_lr = token_lr.sum(-1, keepdim=True) / lens.clamp(min=1)  # [B, 1], log s_b
        if level == "sequence":
            ratio = torch.exp(seq_lr).expand_as(logp)  # [B, T], gradient through the mean
        else:
            logp_m = torch.where(mask, logp, 0.0)  # [B, T]
            ratio = torch.exp(seq_lr.detach() + (logp_m - logp_m.detach()))  # [B, T]
        if adaptive and len(blocks) == 1:
            sat = sat_sequence_bounds(seq_lr.detach(), lens, n_active, **sat_kw)
        elif adaptive:
            sat = _merge_blocks(
                blocks,
                lambda r0, r1, n_c: sat_sequence_bounds(
                    seq_lr.detach()[r0:r1], lens[r0:r1], n_c, **sat_kw
                ),
                1,
            )

    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    lower, upper, patch = lo, hi, None
    sat_on = sat is not None and sat.index is not None
    if sat_on and level == "token":  # sparse: patch the gated tokens only
        patch = (sat.index, sat.bound, sat.upper_side)
    elif sat_on:  # one bound pair per response
        lower, upper = sat.dense(seq_lr.detach(), eps_low, eps_high)  # [B, 1]
    surr, n_clip, n_band = _surrogate(ratio, adv, lower, upper, dual_clip_c, patch)  # [B, T]
    if token_weights is not None:
        surr = surr * torch.where(mask, token_weights.detach(), 0.0)
    # surr is exactly 0 off-mask: A (and any weight) is 0 there and the ratio is finite
    # (exp(0) = 1 per token; s_b of the row for GSPO), so no final masking pass is needed.
    loss = -aggregate(surr, mask, n_active, agg)

    with torch.no_grad():
        n = float(max(n_active, 1))
        # masked slots have A == 0 and are never clipped
        if sat_on and level != "token":
            # SAT's interval lies inside PPO's: its extra clips are in gated responses.
            g = sat.index
            r_g, a_g = ratio.detach()[g], adv[g]  # [G, T]
            up_g, lo_g = upper[g], lower[g]  # [G, 1]
            pos, neg = a_g > 0, a_g < 0
            band_hi = pos & (r_g > up_g) & ~(r_g > hi)
            band_lo = neg & (r_g < lo_g) & ~(r_g < lo)
            n_band = torch.stack([band_lo.sum(), band_hi.sum()])
        ppo_clip = (n_clip - n_band).double() / n  # [2]: low, high
        band = n_band.double() / n
        vals = {
            M.LOSS_POLICY: loss.detach(),
            M.CLIPFRAC: ppo_clip.sum(),
            M.CLIPFRAC_LOW: ppo_clip[0],
            M.CLIPFRAC_HIGH: ppo_clip[1],
            M.SAT_BAND: band.sum(),
            M.SAT_BAND_LOW: band[0],
            M.SAT_BAND_HIGH: band[1],
            M.DPI: abs_lr.sum() / n,
            # k3 is exactly 0 where token_lr == 0, i.e. on every masked slot.
            M.KL_K3: torch.expm1(-token_lr.detach()).add_(token_lr.detach()).sum() / n,
        }
        if sat is not None:
            vals.update({f"sat/{k}": v for k, v in sat.stats.items()})  # M.SAT_Q, …
        keys = list(vals)
        floats = torch.stack([vals[k].to(torch.float64) for k in keys]).tolist()
        metrics = dict(zip(keys, floats, strict=True))
        if sat is not None:
            metrics.update(_active_flags(sat, blocks, eps_low, eps_high))
        if diag is not None:
            diag.update(
                token_diagnostics(abs_lr, mask, sat, level, lower, upper, eps_low, eps_high)
            )
    return loss, metrics


def token_diagnostics(abs_lr, mask, sat, level, lower, upper, eps_low, eps_high) -> dict:
    """What the loss used, per active token (row-major order), detached on the CPU:

    * ``abs_d`` ``[N]`` float32: ``|log r|`` of the token ratio against the loss's denominator;
    * ``gate`` ``[N]`` bool: SAT contracted this token's interval (for the GSPO levels: its
      response's);
    * ``contraction`` ``[N]`` float32: ``c`` of the contracted endpoint (1 off the gate): the
      upper side ``(u - 1) / eps_high``, the lower ``(1 - l) / eps_low``;
    * ``q`` ``[1]`` float64 (SAT's batch reference; ``[0]`` without SAT) and ``n_active`` ``[1]``.
    """
    m = mask.bool()
    n = int(m.sum())
    gate = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    c = torch.ones(m.shape, dtype=torch.float32, device=m.device)
    if sat is not None and sat.index is not None:
        if level == "token":
            side, bound = sat.upper_side, sat.bound.float()
            c_g = torch.where(
                side,
                (bound - 1.0) / (eps_high if eps_high > 0 else 1.0),
                (1.0 - bound) / (eps_low if eps_low > 0 else 1.0),
            )
            gate.view(-1)[sat.index] = True
            c.view(-1)[sat.index] = c_g
        else:  # one interval per response: rows sat.index
            c_hi = (upper.float() - 1.0) / (eps_high if eps_high > 0 else 1.0)  # [B, 1]
            c_lo = (1.0 - lower.float()) / (eps_low if eps_low > 0 else 1.0)  # [B, 1]
            rows = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
            rows[sat.index] = True
            gate = rows[:, None] & m
            c = torch.where(gate, torch.minimum(c_hi, c_lo).expand_as(c), c)
    q = [float(sat.q)] if sat is not None else []
    return {
        "abs_d": abs_lr[m].float().cpu(),
        "gate": gate[m].cpu(),
        "contraction": c[m].cpu(),
        "q": torch.tensor(q, dtype=torch.float64),
        "n_active": torch.tensor([n], dtype=torch.int64),
    }


def sat_can_act(q: float, eps_low: float, eps_high: float) -> tuple[bool, bool]:
    """``(low, high)``: whether SAT can change a gradient on that side at batch reference ``q``
    with one optimizer step per batch (``r = exp(d)``): only tokens with ``q < |d| < ell_side``
    can be newly clipped, ``ell_high = ln(1 + eps_high)``, ``ell_low = -ln(1 - eps_low)``
    (ALGORITHMS.md §4 "When SAT is inert"; 0.182 and 0.223 at eps = 0.2)."""
    ell_hi = math.log1p(eps_high)
    ell_lo = -math.log1p(-eps_low) if eps_low < 1.0 else math.inf
    return q < ell_lo, q < ell_hi


def _active_flags(sat, blocks, eps_low, eps_high) -> dict[str, float]:
    """``sat/active`` (either side), ``sat/active_low``, ``sat/active_high``: 1.0/0.0 for one
    ``q``; with several blocks the active-token-weighted fraction of blocks."""
    qs = getattr(sat, "block_qs", None) or [(sat.q, 1)]
    n = float(max(sum(n_c for _, n_c in qs), 1))
    out = {M.SAT_ACTIVE: 0.0, M.SAT_ACTIVE_LOW: 0.0, M.SAT_ACTIVE_HIGH: 0.0}
    for q, n_c in qs:
        low, high = sat_can_act(q, eps_low, eps_high)
        w = n_c / n if len(qs) > 1 else 1.0
        out[M.SAT_ACTIVE] += w * (low or high)
        out[M.SAT_ACTIVE_LOW] += w * low
        out[M.SAT_ACTIVE_HIGH] += w * high
    return out


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
