"""Sequence packing and token-budget micro-batches of a ``TrainBatch`` (the trainer's throughput).

**Packing** (``trainer.max_tokens_per_row``; the local trainer): the samples of a forward are
placed into rows of at most ``capacity`` tokens by deterministic first-fit-decreasing
(:func:`first_fit_decreasing`: longest first, ties by batch order, each into the first row with
room; a sample longer than ``capacity`` gets a row of its own, never cut). :class:`PackPlan`
holds, for every slot ``[r, j]`` of the packed ``[R, L]`` tensors, the batch token it holds
(``src``: flat index ``b * S + s``, -1 on the padding at a row's end), the position ids (they
restart at 0 for each sample, so rotary positions are the unpacked ones) and the segment of
each slot (the sample's number in its row, -1 on padding) and ``spans``, each row's ``(start,
end)`` segments. Attention stays inside each sample: rows of at least :data:`SEGMENT_MIN_ROW`
tokens attend through :func:`segment_attention` (an HF attention implementation,
:func:`use_segment_attention`), causal SDPA on each segment on its own (varlen attention: the
cost is ``sum T_i^2``, not ``rows x L^2``); shorter rows through the block-diagonal causal mask
``[R, 1, L, L]`` of :meth:`PackPlan.attention_mask` in one SDPA call (there one call per short
sample costs more than the masked scores: bench/README.md). Padding at a row's end is a
segment of its own (it sees only padding, so no softmax row is empty), never read.
:meth:`PackPlan.pack` gathers any ``[B, S, ...]`` tensor of the batch into ``[R, L, ...]`` and
:meth:`PackPlan.unpack` puts per-slot results back to ``[B, S, ...]`` (differentiable; zeros
off the samples' tokens). A sample's first token sits after the previous sample's last in its
row, so its packed log-prob is scored by a foreign logit: :meth:`PackPlan.unpack_scored` zeroes
it, as column 0 is zero unpacked (it is a prompt token, never trained).

**Token-budget micro-batches** (``trainer.max_tokens_per_micro_batch``; both trainers):
:func:`micro_batches` splits a minibatch's samples into groups whose forward holds at most
``budget`` tokens — padded: ``count x longest`` (samples taken longest first, so each group
pads little); packed: the sum of the samples' lengths, taken row by row of the minibatch's
packing. A sample over the budget is a group of its own. The step computes the loss over the
whole minibatch whatever the split (``sat_cli.trainers.step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to at most ``capacity`` (a sample
    longer than ``capacity`` alone in its row). Deterministic: samples by decreasing length,
    ties in index order, each into the first row it fits; within a row, in placement order."""
    if capacity < 1:
        raise ValueError(f"packing capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(capacity - n)
    return rows


@dataclass
class PackPlan:
    """Where every sample of a ``[B, S]`` batch sits in the packed ``[R, L]`` rows."""

    rows: list[list[int]]
    shape: tuple[int, int]  # (B, S) of the unpacked batch
    src: torch.Tensor  # [R, L] long: b * S + s of the slot's token, -1 on padding
    position_ids: torch.Tensor  # [R, L] long, restarting at 0 for each sample
    segments: torch.Tensor  # [R, L] long: the sample's number in its row, -1 on padding
    starts: torch.Tensor  # [R, L] bool: the first token of a sample
    spans: list[list[tuple[int, int]]]  # per row, the (start, end) of each segment

    @classmethod
    def build(cls, lengths: Sequence[int], width: int, capacity: int) -> PackPlan:
        """The plan of a right-padded batch of ``len(lengths)`` rows of ``width`` columns."""
        rows = first_fit_decreasing(lengths, capacity)
        L = max(sum(int(lengths[b]) for b in row) for row in rows)
        R = len(rows)
        src = torch.full((R, L), -1, dtype=torch.long)
        pos = torch.zeros((R, L), dtype=torch.long)
        seg = torch.full((R, L), -1, dtype=torch.long)
        starts = torch.zeros((R, L), dtype=torch.bool)
        spans: list[list[tuple[int, int]]] = []
        for r, row in enumerate(rows):
            off = 0
            spans.append([])
            for j, b in enumerate(row):
                T = int(lengths[b])
                src[r, off : off + T] = b * width + torch.arange(T)
                pos[r, off : off + T] = torch.arange(T)
                seg[r, off : off + T] = j
                starts[r, off] = True
                spans[r].append((off, off + T))
                off += T
            pos[r, off:] = torch.arange(L - off)  # padding: positions of its own
            if off < L:
                spans[r].append((off, L))
        return cls(rows, (len(lengths), width), src, pos, seg, starts, spans)

    @property
    def real(self) -> torch.Tensor:
        """``[R, L]`` bool: slots that hold a sample's token."""
        return self.src >= 0

    def saves(self, padded_slots: int) -> bool:
        """Whether packing cuts the forward's token slots (``R x L``) below
        :data:`MIN_SAVING` of the padded batch's: otherwise the padded forward is as cheap and
        skips the gathers (the default run's samples are nearly all of one length)."""
        return self.src.numel() < MIN_SAVING * padded_slots

    def pack(self, t: torch.Tensor, fill=0) -> torch.Tensor:
        """``t [B, S, ...]`` gathered into ``[R, L, ...]``; padding slots get ``fill`` (a scalar
        or a tensor broadcast over the trailing dimensions)."""
        B, S = self.shape
        flat = t.reshape(B * S, *t.shape[2:])
        out = flat[self.src.clamp(min=0).to(t.device)]
        pad = ~self.real.to(t.device)
        if bool(pad.any()):
            out[pad] = torch.as_tensor(fill, dtype=t.dtype, device=t.device)
        return out

    def unpack(self, p: torch.Tensor) -> torch.Tensor:
        """``p [R, L, ...]`` (per slot) back to ``[B, S, ...]``, zeros off the samples' tokens;
        differentiable (an index gather)."""
        B, S = self.shape
        R, L = self.src.shape
        flat = torch.cat([p.reshape(R * L, *p.shape[2:]), p.new_zeros((1, *p.shape[2:]))])
        inv = torch.full((B * S,), R * L, dtype=torch.long)  # R * L: the zero row
        real = self.real.reshape(-1)
        inv[self.src.reshape(-1)[real]] = torch.arange(R * L)[real]
        return flat[inv.to(p.device)].reshape(B, S, *p.shape[2:])

    def attention_mask(self, device=None) -> torch.Tensor:
        """``[R, 1, L, L]`` bool, True where query ``i`` may attend key ``j``: the same segment
        and ``j <= i`` (block-diagonal causal)."""
        seg = self.segments.to(device)
        L = seg.shape[1]
        causal = torch.ones((L, L), dtype=torch.bool, device=device).tril()
        return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]

    def unpack_scored(self, p: torch.Tensor) -> torch.Tensor:
        """:meth:`unpack` of per-slot log-probs (or entropies, top-k log-probs) aligned to the
        token they score: each sample's first token, scored across the sample boundary, is 0."""
        keep = (~self.starts).to(p.device)
        keep = keep.reshape(*keep.shape, *([1] * (p.dim() - 2)))
        return self.unpack(torch.where(keep, p, torch.zeros_like(p)))


SEGMENT_ATTENTION = "sat_segments"  # the name it is registered under in transformers
SEGMENT_MIN_ROW = 256  # packed rows at least this wide attend segment by segment
MIN_SAVING = 0.9  # pack only when the packed slots are below this fraction of the padded ones


def segment_attention(module, query, key, value, attention_mask, sat_spans=None, **kwargs):
    """HF attention over packed rows: causal SDPA on each ``(start, end)`` of ``sat_spans``
    (per row) on its own, so no token sees another sample (``attention_mask`` is None: the
    spans are the mask). ``query`` ``[R, H, L, D]``; returns ``([R, L, H, D], None)`` like
    transformers' ``sdpa_attention_forward``, which runs each segment."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for r, segs in enumerate(sat_spans):
        parts = [
            sdpa_attention_forward(
                module,
                query[r : r + 1, :, s:e],
                key[r : r + 1, :, s:e],
                value[r : r + 1, :, s:e],
                None,
                **kwargs,
            )[0]
            for s, e in segs
        ]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


class use_segment_attention:
    """Within the block, ``model`` attends with :func:`segment_attention` (registered once)."""

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
        self.before = self.config._attn_implementation
        self.config._attn_implementation = SEGMENT_ATTENTION
        return self

    def __exit__(self, *exc):
        self.config._attn_implementation = self.before


def sample_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens of each row of a right-padded batch."""
    return [int(n) for n in attention_mask.long().sum(1)]


def micro_batches(lengths: Sequence[int], budget: int, capacity: int = 0) -> list[list[int]]:
    """Groups of sample indices whose forward holds at most ``budget`` tokens (module
    docstring); ``capacity > 0``: packed rows of that capacity, else padded rows. One group
    when everything fits. Every index appears once."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    if capacity > 0:
        rows = first_fit_decreasing(lengths, capacity)
        units = [(row, sum(int(lengths[b]) for b in row)) for row in rows]
    else:
        order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
        units = [([b], int(lengths[b])) for b in order]
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for members, n in units:
        cost = used + n if capacity > 0 else (len(cur) + 1) * max(used, n)
        if cur and cost > budget:
            groups.append(cur)
            cur, used = [], 0
        cur = cur + members
        used = used + n if capacity > 0 else max(used, n)
    if cur:
        groups.append(cur)
    return groups
