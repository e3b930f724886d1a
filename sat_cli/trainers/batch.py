"""Collate engine samples into the training tensors of one batch.

Layout: each row is ``prompt_ids + response_ids``, **right-padded** to ``S = max(prompt_len +
response_len)`` with ``pad_id``; ``position_ids`` are ``0 .. len-1`` on real tokens (0 on padding),
so positions match the engine's left-padded generation exactly.

Alignment convention (every per-token tensor is indexed by the token it scores):
``rollout_logp[b, s]`` is ``log mu(input_ids[b, s] | input_ids[b, :s])``; ``loss_mask[b, s] = 1``
iff ``input_ids[b, s]`` is a response token the model generated (a multi-turn sample's
environment tokens, ``Sample.loss_mask`` 0, are 0 like the prompt: no loss, no correction, no
statistic reads them; their ``rollout_logp`` is 0). The trainer's recomputed log-probs use the same
convention (``logits[:, s-1]`` scores ``input_ids[:, s]``), so ``logp``, ``rollout_logp``,
``advantages`` and ``loss_mask`` line up elementwise. Column 0 is never a response token.

``routed_experts[b, s]`` is the routing recorded when ``input_ids[b, s]`` was fed to the engine
(SGLang's row ``s``); a sample of length ``T`` brings ``T - 1`` rows (its last token was never
fed). The last token's row and padding rows are filled with experts ``0 .. K-1``: the MoE output at
those positions does not reach any scored logit.

``sampling_mask[b, s]`` (int32 ``[B, S, K]``, K the widest kept set of the batch, -1 padding) is
the kept set of top-p/top-k sampling the engine drew ``input_ids[b, s]`` from (-1 everywhere off
response tokens); ``topk_ids`` / ``topk_logp`` (``[B, S, K]``) the top-k ids and log-probs of that
distribution. Each is collated when every sample has it (an error when asked for and missing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from sat_cli.models.r3 import R3Error
from sat_cli.samples import Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, S] long, right-padded
    attention_mask: torch.Tensor  # [B, S] long, 1 on real tokens
    position_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] float, 1 on response tokens
    rollout_logp: torch.Tensor  # [B, S] float32, aligned to the token it scores, 0 elsewhere
    advantages: torch.Tensor  # [B, S] float32, the sample's advantage on its response tokens
    versions: torch.Tensor  # [B] long, weight version of each sample
    token_versions: torch.Tensor | None = (
        None  # [B, S] long on response tokens, if any sample has them
    )
    routed_experts: torch.Tensor | None = None  # [B, S, L, K] long, or None
    sampling_mask: torch.Tensor | None = None  # [B, S, K] int32 kept ids, -1 padding
    topk_ids: torch.Tensor | None = None  # [B, S, K] int32 sampler's top-k ids, -1 padding
    topk_logp: torch.Tensor | None = None  # [B, S, K] float32 their log mu, 0 padding
    turn_ids: torch.Tensor | None = None  # [B, S] long model turn of each response token

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def recorded_routes(self) -> torch.Tensor:
        """``[B, S]`` bool: positions whose ``routed_experts`` row the engine recorded (real
        tokens but the last of each row, which was never fed to the engine)."""
        mask = self.attention_mask.bool()
        last = mask.long().sum(1) - 1  # right padding: index of the last real token
        cols = torch.arange(mask.shape[1])
        return mask & (cols[None, :] != last[:, None])

    def select(self, rows: torch.Tensor | list[int] | slice) -> TrainBatch:
        """The sub-batch of the given rows (for minibatches)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = None if value is None else value[rows]
        return TrainBatch(**out)

    def columns(self, n: int) -> TrainBatch:
        """The first ``n`` columns of every per-token tensor (a micro-batch cut to its longest
        sample: right padding only, so no real token is lost)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value if value is None or value.dim() < 2 else value[:, :n]
        return TrainBatch(**out)


def collate(
    samples: list[Sample],
    advantages: list[float] | torch.Tensor,
    pad_id: int,
    *,
    need_routes: bool = False,
    need_mask: bool = False,
    need_topk: int = 0,
) -> TrainBatch:
    """Stack ``samples`` (with one advantage each) into a ``TrainBatch``.

    ``need_routes=True`` makes a sample without ``routed_experts``, or with routes of the wrong
    length, an ``R3Error`` (R3 must not silently fall back). Without it, routes are collated when
    every sample has them and dropped otherwise. ``need_mask`` / ``need_topk`` do the same for
    the kept sets and the sampler's top-k (``ValueError``); ``need_topk = K`` also keeps only
    the first K entries (the K most probable: a replay may ask fewer than were recorded).
    """
    if len(samples) == 0:
        raise ValueError("collate: no samples")
    adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if adv.shape[0] != len(samples):
        raise ValueError(f"collate: {len(samples)} samples but {adv.shape[0]} advantages")
    B = len(samples)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    S = max(lengths)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    position_ids = torch.zeros((B, S), dtype=torch.long)
    loss_mask = torch.zeros((B, S), dtype=torch.float32)
    rollout_logp = torch.zeros((B, S), dtype=torch.float32)
    adv_tok = torch.zeros((B, S), dtype=torch.float32)
    versions = torch.tensor([s.weight_version for s in samples], dtype=torch.long)
    any_tok_versions = any(s.token_versions is not None for s in samples)
    token_versions = torch.zeros((B, S), dtype=torch.long) if any_tok_versions else None
    any_turns = any(s.turn_ids is not None for s in samples)
    turn_ids = torch.zeros((B, S), dtype=torch.long) if any_turns else None

    have_routes = [s.routed_experts is not None for s in samples]
    use_routes = need_routes or all(have_routes)
    routes = None
    if use_routes:
        first = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
        if first is None:
            raise R3Error("R3 is on but no sample carries routed experts")
        L, K = first.shape[1], first.shape[2]
        routes = torch.arange(K, dtype=torch.long).expand(B, S, L, K).clone()

    for b, s in enumerate(samples):
        P, R, T = len(s.prompt_ids), len(s.response_ids), lengths[b]
        if P == 0:
            raise ValueError(f"collate: sample {b} has an empty prompt")
        if len(s.rollout_logp) != R:
            raise ValueError(
                f"collate: sample {b} has {R} response tokens but {len(s.rollout_logp)} log-probs"
            )
        input_ids[b, :T] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[b, :T] = 1
        position_ids[b, :T] = torch.arange(T)
        if s.loss_mask is None:
            loss_mask[b, P:T] = 1.0
        else:
            loss_mask[b, P:T] = _model_mask(s, b)
        rollout_logp[b, P:T] = torch.tensor(s.rollout_logp, dtype=torch.float32)
        adv_tok[b, P:T] = adv[b]
        if token_versions is not None:
            tv = s.token_versions if s.token_versions is not None else [s.weight_version] * R
            token_versions[b, P:T] = torch.tensor(tv, dtype=torch.long)
        if turn_ids is not None and s.turn_ids is not None:
            if len(s.turn_ids) != R:
                raise ValueError(
                    f"collate: sample {b} has {len(s.turn_ids)} turn ids for {R} tokens"
                )
            turn_ids[b, P:T] = torch.tensor(s.turn_ids, dtype=torch.long)
        if routes is not None:
            rec = s.routed_experts
            if rec is None:
                raise R3Error(f"R3 is on but sample {b} has no routed experts")
            rec = np.asarray(rec)
            if rec.ndim != 3 or rec.shape != (T - 1, routes.shape[2], routes.shape[3]):
                raise R3Error(
                    f"sample {b}: routed experts have shape {rec.shape}; expected "
                    f"({T - 1}, {routes.shape[2]}, {routes.shape[3]}) = [prompt_len + "
                    "response_len - 1, layers, top_k]"
                )
            routes[b, : T - 1] = torch.from_numpy(rec.astype(np.int64))
    kept, topk_ids, topk_logp = _collate_sampler(samples, lengths, S, need_mask, need_topk)
    return TrainBatch(
        sampling_mask=kept,
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        loss_mask=loss_mask,
        rollout_logp=rollout_logp,
        advantages=adv_tok,
        versions=versions,
        token_versions=token_versions,
        routed_experts=routes,
        turn_ids=turn_ids,
    )


def _model_mask(s: Sample, b: int) -> torch.Tensor:
    """A multi-turn sample's ``loss_mask`` as float ``[R]`` (1 model token, 0 environment
    token), checked: one 0/1 entry per response token, log-prob 0.0 on environment tokens."""
    mask = torch.tensor(s.loss_mask, dtype=torch.float32)
    if mask.shape != (s.response_len,) or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"collate: sample {b}'s loss_mask must hold one 0/1 entry per response token "
            f"({s.response_len})"
        )
    env_logp = torch.tensor(s.rollout_logp, dtype=torch.float64)[mask == 0]
    if bool((env_logp != 0).any()):
        raise ValueError(
            f"collate: sample {b} has a log-prob on an environment token (loss_mask 0); "
            "environment tokens carry rollout_logp 0.0"
        )
    return mask


def _collate_sampler(samples: list[Sample], lengths: list[int], S: int, need_mask, need_topk):
    """``(sampling_mask, topk_ids, topk_logp)`` ``[B, S, K]`` of the batch, each None unless
    every sample has it; missing where needed is a ``ValueError``."""
    B = len(samples)
    kept = topk_ids = topk_logp = None
    have = [s.sampling_mask is not None for s in samples]
    if need_mask and not all(have):
        raise ValueError(
            f"sample {have.index(False)} has no sampling mask although algo.replay_sampling_mask "
            "is on and top-p/top-k filter (an engine or a recording without kept sets)"
        )
    if all(have):
        width = max((len(ids) for s in samples for ids in s.sampling_mask), default=1)
        kept = torch.full((B, S, width), -1, dtype=torch.int32)
        for b, s in enumerate(samples):
            P = lengths[b] - s.response_len
            if len(s.sampling_mask) != s.response_len:
                raise ValueError(
                    f"sample {b}: {len(s.sampling_mask)} kept sets for "
                    f"{s.response_len} response tokens"
                )
            lens = np.array([len(ids) for ids in s.sampling_mask], dtype=np.int64)
            if lens.size:
                rows = np.repeat(np.arange(lens.size), lens)  # token of each kept id
                cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
                flat = np.concatenate([np.asarray(ids, np.int32) for ids in s.sampling_mask])
                kept[b, P + rows, cols] = torch.from_numpy(flat)
    have = [s.topk_ids is not None and s.topk_logp is not None for s in samples]
    if need_topk and not all(have):
        raise ValueError(
            f"sample {have.index(False)} has no sampler top-k although "
            "algo.score_centering_topk > 0 (an engine or a recording without it)"
        )
    if all(have):
        K = max(np.asarray(s.topk_ids).shape[1] for s in samples)
        K = min(K, need_topk) if need_topk else K
        topk_ids = torch.full((B, S, K), -1, dtype=torch.int32)
        topk_logp = torch.zeros((B, S, K), dtype=torch.float32)
        for b, s in enumerate(samples):
            ids, lp = np.asarray(s.topk_ids, np.int32), np.asarray(s.topk_logp, np.float32)
            if ids.shape != lp.shape or ids.ndim != 2 or ids.shape[0] != s.response_len:
                raise ValueError(
                    f"sample {b}: top-k of shape {ids.shape} / {lp.shape} for "
                    f"{s.response_len} response tokens"
                )
            ids, lp = ids[:, :K], lp[:, :K]
            P = lengths[b] - s.response_len
            topk_ids[b, P : lengths[b], : ids.shape[1]] = torch.from_numpy(ids)
            topk_logp[b, P : lengths[b], : ids.shape[1]] = torch.from_numpy(lp)
    return kept, topk_ids, topk_logp
