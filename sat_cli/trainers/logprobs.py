"""The log-prob definition both trainers use (``TrainBatch``'s alignment: ``logp[b, s]`` scores
``input_ids[b, s]`` from ``logits[b, s-1]``, column 0 is 0): :func:`token_logprobs` (with the
engine's kept sets when ``algo.replay_sampling_mask``) and :func:`topk_logprobs` (score
centering's log-probs at the sampler's top-k ids). Both are the shift plus a per-position rule
(:func:`scores_at`, :func:`topk_at`) that ``trainers/head_chunks.py`` applies chunk by chunk of
positions, so chunked and whole log-probs are the same arithmetic row for row."""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 arithmetic for the log-probs, float64 kept (the exactness tests run in it)."""
    return x if x.dtype == torch.float64 else x.float()


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    kept: torch.Tensor | None = None,
):
    """``logp [B, S]`` aligned to the token it scores and ``entropy [B, S]`` of the same
    distribution (column 0: 0). ``logits``: ``[B, S, V]``.

    ``kept`` (``[B, S, K]`` int, -1 padding, aligned like ``logp``: the engine's kept set for
    the token at ``s``; ``algo.replay_sampling_mask``): at positions with a kept set the
    distribution is renormalised on it, ``logp = z[y] - logsumexp(z[kept])`` with ``z = logits /
    T``, and the entropy is that distribution's; elsewhere (prompt, padding) the full softmax.
    Without ``kept`` the arithmetic is exactly the plain one."""
    z = upcast(logits[:, :-1]) / temperature  # [B, S-1, V]
    lp, ent = scores_at(z, input_ids[:, 1:], None if kept is None else kept[:, 1:])
    zero = lp.new_zeros((lp.shape[0], 1))
    return torch.cat([zero, lp], dim=1), torch.cat([zero.detach(), ent], dim=1)


def scores_at(z: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor | None):
    """``(logp [...], entropy [...])`` of ``targets [...]`` under ``z [..., V]`` (logits / T,
    upcast), renormalised on ``kept [..., K]`` (-1 padding) where a position has a kept set
    (:func:`token_logprobs`); the entropy without gradient."""
    logsm = torch.log_softmax(z, dim=-1)  # [..., V]
    lp = logsm.gather(-1, targets[..., None]).squeeze(-1)  # [...]
    with torch.no_grad():
        ent = -(logsm.exp() * logsm).sum(-1)  # [...]
    if kept is not None:
        lse, has, zk = _kept_logsumexp(z, kept)  # [...], [...], [..., K]
        zy = z.gather(-1, targets[..., None]).squeeze(-1)  # [...]
        lp = torch.where(has, zy - lse, lp)
        with torch.no_grad():
            lpk = zk - lse[..., None]  # [..., K], -inf on padding
            ent_k = -(lpk.exp() * lpk.masked_fill(torch.isinf(lpk), 0.0)).sum(-1)
            ent = torch.where(has, ent_k, ent)
    return lp, ent


def _kept_logsumexp(z: torch.Tensor, kept: torch.Tensor):
    """``(logsumexp(z[kept]) [...], has [...], z[kept] [..., K] with -inf padding)`` for
    ``z [..., V]`` and ``kept [..., K]`` (-1 padding); a position without kept ids (``has``
    False) gets the finite ``z[..., 0]`` as its logsumexp, so no NaN reaches a gradient."""
    valid = kept >= 0  # [..., K]
    has = valid.any(-1)  # [...]
    zk = z.gather(-1, kept.long().clamp(min=0)).masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(torch.where(has[..., None], zk, z[..., :1]), dim=-1)  # [...]
    return lse, has, zk


def topk_logprobs(
    logits: torch.Tensor, topk_ids: torch.Tensor, temperature: float, kept: torch.Tensor | None
) -> torch.Tensor:
    """The trainer's log-probs ``[B, S, K]`` at the sampler's top-k ids (``topk_ids [B, S, K]``,
    -1 padding, aligned like ``logp``; column 0 and padding: 0), with gradient: of
    ``log_softmax(logits / T)``, or with ``kept`` of the distribution renormalised on it
    (``z[id] - logsumexp(z[kept])``, as :func:`token_logprobs`; the sampler's top-k ids lie in
    its kept set). Score centering's policy side."""
    z = upcast(logits[:, :-1]) / temperature  # [B, S-1, V]
    lp = topk_at(z, topk_ids[:, 1:], None if kept is None else kept[:, 1:])  # [B, S-1, K]
    return torch.cat([lp.new_zeros((lp.shape[0], 1, lp.shape[2])), lp], dim=1)


def topk_at(z: torch.Tensor, topk_ids: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """``[..., K]``: :func:`topk_logprobs`' rule at each position of ``z [..., V]`` (logits /
    T, upcast) for ``topk_ids [..., K]`` (-1 padding: 0)."""
    ids = topk_ids.long()  # [..., K]
    valid = ids >= 0
    zi = z.gather(-1, ids.clamp(min=0))  # [..., K]
    lp = zi - torch.logsumexp(z, dim=-1, keepdim=True)
    if kept is not None:
        lse, has, _ = _kept_logsumexp(z, kept)
        lp = torch.where(has[..., None], zi - lse[..., None], lp)
    return torch.where(valid, lp, torch.zeros_like(lp))
