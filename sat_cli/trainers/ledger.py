"""The trainer's half of the three-log-prob ledger (``algo.ledger``; the math: ``rl/ledger.py``).

The ledger needs, per token, ``log pi_old``: the trainer's own log-prob of the token under the
weights of the version that generated it (``TrainBatch.token_versions``, else the sample's
``versions``). ``VersionLedger`` keeps those weights: at the start of every step
(``PolicyTrainer.step``) it snapshots the weights the trainer holds, which are version
``step_count`` (the version the loop publishes as ``v<step_count>``), as a ``state_dict`` copy
on the CPU in a ring of at most ``keep`` versions (``build`` sets ``keep = max lag + 2``; the
oldest goes first). For a batch it then runs one no-grad forward per distinct version among the active
tokens, on the rows holding that version, in a shadow copy of the model into which the snapshot
is loaded (the trained model, its optimizer and its R3 audit are untouched; R3 replay applies
as in every trainer forward).

Tokens whose version is not held (a step skipped with no samples, or the versions before a
resume: the ring is not checkpointed) are left out of the ledger and counted in
``staleness/ledger_held_frac``. Cost with the ledger on: one model copy, ``keep`` weight copies
and one forward per distinct version per step; nothing when it is off. Local trainer only: the
Megatron trainer refuses it (its weights are sharded over ranks; ``config.compat``).
"""

from __future__ import annotations

import copy

import torch

from sat_cli import metric_names as M
from sat_cli.rl.ledger import decompose
from sat_cli.trainers.batch import TrainBatch


class VersionLedger:
    """Weights of the last ``keep`` versions and the log-probs of a batch under them."""

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"the ledger keeps at least one version, got keep={keep}")
        self.keep = int(keep)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._shadow: torch.nn.Module | None = None
        self._loaded: int | None = None  # the version in the shadow model

    def record(self, version: int, model: torch.nn.Module) -> None:
        """Hold ``model``'s weights as ``version`` (once per version) and drop the oldest beyond
        ``keep``."""
        if version not in self.snapshots:
            # on the CPU: lag + 2 copies of the weights need not fit next to the model's
            self.snapshots[version] = {
                k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
            }
        for old in sorted(self.snapshots)[: -self.keep]:
            del self.snapshots[old]

    def _model(self, version: int, like: torch.nn.Module) -> torch.nn.Module:
        if self._shadow is None:
            self._shadow = copy.deepcopy(like).requires_grad_(False)
        if self._loaded != version:
            self._shadow.load_state_dict(self.snapshots[version])
            self._loaded = version
        return self._shadow

    @torch.no_grad()
    def logprobs(self, trainer, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gen_logp, held)`` ``[B, S]`` on the CPU: each active token's log-prob under its
        generating version (float32, 0 elsewhere) and whether that version was held. Records
        the trainer's current weights as version ``trainer.step_count`` first (call it before
        the step's first update)."""
        self.record(trainer.step_count, trainer.model)
        active = batch.loss_mask.bool()  # [B, S]
        tv = batch.token_versions
        if tv is None:
            tv = batch.versions[:, None].expand_as(active)  # [B, S]
        gen = torch.zeros(active.shape, dtype=torch.float32)
        held = torch.zeros_like(active)
        for v in sorted(torch.unique(tv[active]).tolist()):
            if v not in self.snapshots:
                continue
            at = active & (tv == v)  # [B, S]
            rows = at.any(1).nonzero().view(-1)
            model = self._model(v, trainer.model)
            lp = trainer.forward_logp(model, batch.select(rows))  # [r, S]
            gen[rows] = torch.where(at[rows], lp, gen[rows])
            held |= at
        return gen, held


def ledger_metrics(ledger_out, rows, logp: torch.Tensor, mb: TrainBatch, diag: dict | None):
    """The ledger's metrics of one minibatch (``rows`` of the batch ``ledger_out`` was computed
    for; ``logp`` the loss's log-probs) and, with ``diag``, its per-token ``ledger_m`` /
    ``ledger_s``."""
    gen, held = ledger_out
    active = mb.loss_mask.bool()
    mask = active & held[rows]
    metrics, per_token = decompose(logp.detach().float().cpu(), gen[rows], mb.rollout_logp, mask)
    metrics[M.LEDGER_HELD_FRAC] = float(mask.sum()) / max(int(active.sum()), 1)
    if diag is not None:
        diag.update(per_token)
    return metrics
