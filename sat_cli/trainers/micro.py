"""Token-budget micro-batches of one minibatch, with the loss of the whole minibatch.

The policy losses are not sums of per-micro-batch terms: SAT's ``q`` is an order statistic over
the minibatch (or its ``q_rows`` blocks), ``seq-mean-token-mean`` divides by the number of
sequences, VCPO's step reads the minibatch's ESS. So the step splits only the *forwards*
(``PolicyTrainer.step`` with ``max_tokens_per_micro_batch``), never the loss:

1. :func:`leaves`: each micro-batch's forward without gradient, stitched into the minibatch's
   ``[B, S]`` log-probs (and entropy, top-k log-probs), which become leaves of the loss graph;
2. the loss of the whole minibatch is computed on them exactly as without a budget, and its
   ``backward`` leaves ``dL/dlogp`` on the leaves;
3. :class:`Replay`: each micro-batch's forward again, with gradient, and the backward of
   ``sum(logp_mb * dL/dlogp_mb)``: by the chain rule the weights' gradient is the unsplit one,
   summed over micro-batches (one extra forward per micro-batch buys the exact loss).

A micro-batch is the sub-batch of its samples cut to its longest (``TrainBatch.columns``);
with packing the backend packs it (``packing.PackPlan``). The R3 audit counts the first
forwards only (the replay runs under ``PolicyTrainer.audit_paused``), as an unsplit step counts
its one forward. The trainer's public ``model_forward`` is the forward of each micro-batch.
"""

from __future__ import annotations

import torch

from sat_cli.trainers.batch import TrainBatch


def _sub(batch: TrainBatch, idx: list[int]) -> tuple[TrainBatch, torch.Tensor, int]:
    """The micro-batch of rows ``idx`` cut to its longest sample: (sub-batch, rows, columns)."""
    rows = torch.tensor(idx, dtype=torch.long)
    sub = batch.select(rows)
    n = int(sub.attention_mask.long().sum(1).max())
    return sub.columns(n), rows, n


def stitched(trainer, model, batch: TrainBatch, groups: list[list[int]], topk: bool) -> tuple:
    """``(logp, entropy[, topk_logp])`` ``[B, S(, K)]`` of ``batch`` (no gradient), one forward
    per group; zeros past each sample's micro-batch width."""
    B, S = batch.input_ids.shape
    outs: list[torch.Tensor] | None = None
    for idx in groups:
        sub, rows, n = _sub(batch, idx)
        res = trainer.model_forward(model, sub, topk)
        if outs is None:
            outs = [r.new_zeros((B, S, *r.shape[2:])) for r in res]
        for out, r in zip(outs, res, strict=True):
            out[rows.to(out.device), :n] = r.detach()
    return tuple(outs)


def leaves(trainer, mb: TrainBatch, groups: list[list[int]], topk: bool) -> tuple:
    """Step 1: the policy's ``(logp, entropy[, topk_logp])`` of ``mb``; ``logp`` (and
    ``topk_logp``) as leaves that take the loss's gradient."""
    with torch.no_grad():
        res = stitched(trainer, trainer.model, mb, groups, topk)
    logp, entropy, *rest = res
    return (logp.requires_grad_(), entropy, *(t.requires_grad_() for t in rest))


class Replay:
    """Step 3: carry the leaves' gradients into the weights, micro-batch by micro-batch."""

    def __init__(self, trainer, mb: TrainBatch, groups: list[list[int]], leaves: list):
        self.trainer, self.mb, self.groups, self.leaves = trainer, mb, groups, leaves

    def __call__(self) -> None:
        t = self.trainer
        grads = [leaf.grad for leaf in self.leaves]
        topk = len(self.leaves) > 1
        with t.audit_paused():
            for idx in self.groups:
                sub, rows, n = _sub(self.mb, idx)
                outs = t.model_forward(t.model, sub, topk)
                outs = [outs[0], outs[2]] if topk else [outs[0]]  # logp (and topk_logp)
                surrogate = None
                for out, g in zip(outs, grads, strict=True):
                    if g is None:  # the loss does not read it
                        continue
                    term = (out * g[rows.to(g.device), :n].to(out.dtype)).sum()
                    surrogate = term if surrogate is None else surrogate + term
                if surrogate is not None:
                    surrogate.backward()
