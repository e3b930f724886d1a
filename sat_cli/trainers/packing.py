"""Sequence packing and token-budget micro-batches of a ``TrainBatch`` (the trainer's throughput).

**Packing** (``trainer.max_tokens_per_row``; the local trainer): the samples of a forward are
placed into rows of at most ``capacity`` tokens by deterministic first-fit-decreasing
(:func:`first_fit_decreasing`: longest first, ties by batch order, each into the first row with
room; a sample longer than ``capacity`` gets a row of its own, never cut). :class:`PackPlan`
holds, for every slot ``[r, j]`` of the packed ``[R, L]`` tensors, the batch token it holds
(``src``: flat index ``b * S + s``, -1 on the padding at a row's end), the position ids (they
restart at 0 for each sample, so rotary positions are the unpacked ones) and the segment of
each slot (the sample's number in its row, -1 on padding). :meth:`PackPlan.attention_mask`
is the block-diagonal causal mask ``[R, 1, L, L]``: a token sees the earlier tokens of its own
sample only (padding slots see the padding before them, so no softmax row is empty).
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
        for r, row in enumerate(rows):
            off = 0
            for j, b in enumerate(row):
                T = int(lengths[b])
                src[r, off : off + T] = b * width + torch.arange(T)
                pos[r, off : off + T] = torch.arange(T)
                seg[r, off : off + T] = j
                starts[r, off] = True
                off += T
            pos[r, off:] = torch.arange(L - off)  # padding: positions of its own
        return cls(rows, (len(lengths), width), src, pos, seg, starts)

    @property
    def real(self) -> torch.Tensor:
        """``[R, L]`` bool: slots that hold a sample's token."""
        return self.src >= 0

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

    def unpack_scored(self, p: torch.Tensor) -> torch.Tensor:
        """:meth:`unpack` of per-slot log-probs (or entropies, top-k log-probs) aligned to the
        token they score: each sample's first token, scored across the sample boundary, is 0."""
        keep = (~self.starts).to(p.device)
        keep = keep.reshape(*keep.shape, *([1] * (p.dim() - 2)))
        return self.unpack(torch.where(keep, p, torch.zeros_like(p)))

    def attention_mask(self, device=None) -> torch.Tensor:
        """``[R, 1, L, L]`` bool, True where query ``i`` may attend key ``j``: the same segment
        and ``j <= i`` (block-diagonal causal)."""
        seg = self.segments.to(device)
        L = seg.shape[1]
        causal = torch.ones((L, L), dtype=torch.bool, device=device).tril()
        return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


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
