"""Collate engine samples into the training tensors of one batch.

Layout: each row is ``prompt_ids + response_ids``, **right-padded** to ``S = max(prompt_len +
response_len)`` with ``pad_id``; ``position_ids`` are ``0 .. len-1`` on real tokens (0 on padding),
so positions match the engine's left-padded generation exactly.

Alignment convention (every per-token tensor is indexed by the token it scores):
``rollout_logp[b, s]`` is ``log mu(input_ids[b, s] | input_ids[b, :s])``; ``loss_mask[b, s] = 1``
iff ``input_ids[b, s]`` is a response token. The trainer's recomputed log-probs use the same
convention (``logits[:, s-1]`` scores ``input_ids[:, s]``), so ``logp``, ``rollout_logp``,
``advantages`` and ``loss_mask`` line up elementwise. Column 0 is never a response token.

``routed_experts[b, s]`` is the routing recorded when ``input_ids[b, s]`` was fed to the engine
(SGLang's row ``s``); a sample of length ``T`` brings ``T - 1`` rows (its last token was never
fed). The last token's row and padding rows are filled with experts ``0 .. K-1``: the MoE output at
those positions does not reach any scored logit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from sat_cli.engines.base import Sample
from sat_cli.models.r3 import R3Error


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


def collate(
    samples: list[Sample],
    advantages: list[float] | torch.Tensor,
    pad_id: int,
    *,
    need_routes: bool = False,
) -> TrainBatch:
    """Stack ``samples`` (with one advantage each) into a ``TrainBatch``.

    ``need_routes=True`` makes a sample without ``routed_experts``, or with routes of the wrong
    length, an ``R3Error`` (R3 must not silently fall back). Without it, routes are collated when
    every sample has them and dropped otherwise.
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
        loss_mask[b, P:T] = 1.0
        rollout_logp[b, P:T] = torch.tensor(s.rollout_logp, dtype=torch.float32)
        adv_tok[b, P:T] = adv[b]
        if token_versions is not None:
            tv = s.token_versions if s.token_versions is not None else [s.weight_version] * R
            token_versions[b, P:T] = torch.tensor(tv, dtype=torch.long)
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
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        loss_mask=loss_mask,
        rollout_logp=rollout_logp,
        advantages=adv_tok,
        versions=versions,
        token_versions=token_versions,
        routed_experts=routes,
    )
