"""The policy update both trainers share: one ``step(batch)`` (ALGORITHMS.md §1, §3-§6).

``PolicyTrainer.step``:

1. if the algorithm/correction needs ``pi_old`` (``registry.LossSpec.needs_old_logp``),
   recompute the batch's log-probs once, without gradient (``logprobs``, with R3 replay when
   on) and report ``staleness/mismatch_abs_logratio_mean`` (mean ``|log pi_old - log mu|``);
2. with ``loss.kl_coef > 0``, the reference policy's log-probs (``_ref_logprobs``); with
   ``ledger_keep`` (``algo.ledger``) each token's under its own version (``trainers/ledger.py``,
   through the public ``forward_logp``);
3. split the batch into ``num_minibatches`` contiguous row chunks; per chunk: forward
   (``_model_forward``: token log-probs of ``logits / temperature`` and their entropy; with
   ``replay_sampling_mask`` renormalised on the engine's kept sets, with ``score_centering_topk``
   also at the sampler's top-k ids: ``LossInputs.policy_topk_logp``),
   ``registry.compute`` with the trainer's ``LossConfig`` (+ ``kl_coef * k3``), backward,
   gradient reduction and grad-norm clip (``_clip_gradients``), optimizer step. A chunk without
   response tokens is skipped (no optimizer step). A non-finite loss or gradient norm skips the
   update (no backward / no optimizer step, gradients dropped, so weights and optimizer state
   stay as they were) and sets ``loss/nonfinite_skipped`` = 1 for that chunk; the loop counts
   such steps. With ``max_tokens_per_micro_batch`` a chunk's forwards are split by the token
   budget while its loss stays one (``trainers/micro.py``); the no-grad forwards of steps 1-2
   are split the same way (``forward_nograd``).

Constructor keywords common to both trainers: ``loss`` (a ``LossConfig``; default
``LossConfig()``) and the ``StepSettings`` fields (``lr``, ``betas``, ``weight_decay``, ``grad_clip``,
``temperature``, ``r3``, ``num_minibatches``, ``seed``, ``r3_audit``); ``_init_step`` splits
and checks them.

A trainer subclass supplies its model only: ``model`` and ``ref_model``, ``_model_forward``
(log-probs and entropy of either), ``_clip_gradients`` (the local trainer clips; the Megatron
actor first sums gradients over its data-parallel ranks), ``_audit_totals`` and an ``opt``
(``_new_optimizer``: torch AdamW); ``_extra_inputs`` adds the inputs only some algorithms read.

Metrics are the loss library's (``loss/*``, ``sat/*``, ``staleness/*``) averaged over
minibatches, plus ``loss/grad_norm`` (before clipping), ``loss/entropy``, ``loss/total``,
``loss/kl_ref`` (with a reference), ``r3/audit_*`` (with the R3 audit), ``perf/train_s`` and
``perf/optimizer_steps`` (names: ``sat_cli.metric_names``).

``token_logprobs`` and ``topk_logprobs`` (the log-prob definition both backends use) live in
``trainers/logprobs.py`` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from sat_cli import metric_names as M
from sat_cli.rl import registry
from sat_cli.rl.config import LossConfig
from sat_cli.rl.loss_io import LossInputs
from sat_cli.rl.losses import kl_k3_penalty
from sat_cli.trainers import lr_schedule, micro
from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.ledger import VersionLedger, ledger_metrics
from sat_cli.trainers.logprobs import token_logprobs as token_logprobs
from sat_cli.trainers.logprobs import topk_logprobs as topk_logprobs
from sat_cli.trainers.packing import micro_batches, sample_lengths

NONFINITE_METRIC = M.NONFINITE_SKIPPED


@dataclass(frozen=True)
class StepSettings:
    """The optimizer and step settings both trainers take as keywords (besides ``loss``)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0  # log-probs of ``logits / temperature`` (the rollout's)
    r3: bool = False  # replay the recorded MoE routes in every forward
    num_minibatches: int = 1  # optimizer steps per rollout batch
    seed: int = 0
    r3_audit: bool = False  # count the (token, layer) rows whose experts differ from the routes
    # score every log-prob on the engine's kept set where the batch carries one (docs/algorithms)
    replay_sampling_mask: bool = False
    score_centering_topk: int = 0  # > 0: the policy's log-probs at the sampler's top-k ids
    ledger_keep: int = 0  # > 0: the three-log-prob ledger, holding this many versions' weights
    max_tokens_per_row: int = 0  # > 0: pack samples into rows of this many tokens (local only)
    max_tokens_per_micro_batch: int = 0  # > 0: forwards of at most this many tokens (packing.py)
    lr_schedule: str = "constant"  # warm-up and decay of lr over optimizer steps (lr_schedule.py)
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    # run.portable_numerics: AdamW's fused CPU kernel, whose sqrt is the processor's exact one;
    # the default path's torch.sqrt goes to MKL's vector math, whose branch on a CPU that MKL does
    # not take for Intel's (or under MKL_CBWR=COMPATIBLE) refines the approximate rsqrtps, and
    # that instruction's bits differ between Intel and AMD (sat_cli/numerics.py)
    portable_numerics: bool = False


class PolicyTrainer:
    """The shared policy update; subclasses call ``_init_step`` first in their constructor."""

    opt: torch.optim.Optimizer
    device: torch.device

    def _init_step(self, loss: LossConfig | None, options: dict[str, Any]) -> None:
        """Check the constructor keywords (``StepSettings`` fields only; the loss settings come
        as one ``LossConfig``), validate them (fail fast: before any model is built) and seed
        torch's RNG."""
        names = {f.name for f in fields(StepSettings)}
        unknown = set(options) - names
        if unknown:
            raise TypeError(
                f"unknown trainer options {sorted(unknown)}; loss settings go in "
                "loss=LossConfig(...) (sat_cli.rl.config)"
            )
        settings = StepSettings(**options)
        loss = LossConfig() if loss is None else loss
        if settings.num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {settings.num_minibatches}")
        if settings.temperature <= 0:
            raise ValueError(f"trainer temperature must be > 0, got {settings.temperature}")
        for key in ("max_tokens_per_row", "max_tokens_per_micro_batch"):
            if getattr(settings, key) < 0:
                raise ValueError(f"{key} must be >= 0 (0: off), got {getattr(settings, key)}")
        if settings.score_centering_topk < 0:
            raise ValueError(
                f"score_centering_topk must be >= 0, got {settings.score_centering_topk}"
            )
        spec = registry.resolve(loss.algo, loss.correction, loss.ratio_denominator)
        self.settings = settings
        self.loss = loss
        self.needs_old = spec.needs_old_logp
        self.needs = spec.needs
        self.grad_clip = settings.grad_clip
        self.num_minibatches = settings.num_minibatches
        self.temperature = settings.temperature
        self.r3 = settings.r3
        self.r3_audit = settings.r3 and settings.r3_audit
        self.replay_sampling_mask = settings.replay_sampling_mask
        self.score_centering_topk = settings.score_centering_topk
        self.ledger = VersionLedger(settings.ledger_keep) if settings.ledger_keep > 0 else None
        self._audit = [0, 0]  # (token, layer) rows checked, rows whose experts differed
        self._audit_paused = False  # a micro-batch's gradient forward: audited already
        self.step_count = 0
        torch.manual_seed(settings.seed)

    def _new_optimizer(self, params) -> torch.optim.Optimizer:
        s = self.settings
        params = list(params)
        fused = s.portable_numerics and all(p.device.type == "cpu" for p in params)
        return torch.optim.AdamW(
            params, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay, fused=fused or None
        )

    # --- what a backend supplies ----------------------------------------------------------------
    model: torch.nn.Module
    ref_model: torch.nn.Module | None  # the frozen reference policy when loss.kl_coef > 0

    def _model_forward(self, model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, entropy)`` ``[B, S]`` of ``model`` (the policy or the reference) on
        ``self.device``; ``logp`` with gradient unless called under ``no_grad``. With
        ``replay_sampling_mask`` and a batch that carries ``sampling_mask``, on the kept sets
        (``token_logprobs``'s ``kept``)."""
        raise NotImplementedError

    def _model_forward_topk(self, model, batch: TrainBatch):
        """``(logp, entropy, topk_logp [B, S, K])``: ``_model_forward`` plus the log-probs at
        ``batch.topk_ids`` (``topk_logprobs``) from the same forward (score centering)."""
        raise NotImplementedError(f"{type(self).__name__} has no sampler top-k channel")

    def model_forward(self, model, batch: TrainBatch, topk: bool = False) -> tuple:
        """``(logp, entropy[, topk_logp])``: ``_model_forward`` (``topk``: ``_topk``)."""
        return tuple((self._model_forward_topk if topk else self._model_forward)(model, batch))

    @contextlib.contextmanager
    def audit_paused(self):
        """Forwards inside are not R3-audited (a micro-batch's replay: audited already)."""
        self._audit_paused = True
        try:
            yield
        finally:
            self._audit_paused = False

    def _kept(self, batch: TrainBatch) -> torch.Tensor | None:
        """The kept sets the log-probs are renormalised on (on the device), or None."""
        if not self.replay_sampling_mask or batch.sampling_mask is None:
            return None
        return batch.sampling_mask.to(self.device)

    @torch.no_grad()
    def forward_logp(self, model, batch: TrainBatch) -> torch.Tensor:
        """``logp [B, S]`` of ``model`` on ``batch`` (no grad, float32 on the CPU), aligned like
        ``rollout_logp``: the policy, the reference, or a held version (``trainers/ledger.py``)."""
        return self.forward_nograd(model, batch)[0].float().cpu()

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Recomputed ``logp [B, S]`` of the current weights (no grad, CPU)."""
        return self.forward_logp(self.model, batch)

    def _ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """The reference policy's ``logp [B, S]`` (CPU), or None without a reference."""
        return None if self.ref_model is None else self.forward_logp(self.ref_model, batch)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Reduce the gradients (if several ranks) and clip them; the norm before clipping."""
        raise NotImplementedError

    def _audit_totals(self) -> list[float]:
        """``[rows, mismatched]`` of the R3 audit over this step (all ranks)."""
        return [float(v) for v in self._audit]

    def _extra_inputs(self, mb: TrainBatch) -> dict:
        """Inputs only some algorithms read (``registry.LossSpec.needs``)."""
        return {}

    # --- the step ---------------------------------------------------------------------------
    def step(self, batch: TrainBatch, diag: dict | None = None) -> dict[str, float]:
        """One rollout batch's update (module docstring); ``diag``, if a dict, receives the
        loss's per-token diagnostics (``registry.compute``), minibatches concatenated in row
        order (``q`` and ``n_active``: one entry per minibatch)."""
        t0 = time.perf_counter()
        dev = self.device
        extra: dict[str, float] = {}
        self._audit = [0, 0]
        old_logp = None
        if self.needs_old:
            old_logp = self.logprobs(batch)  # [B, S]
            m = batch.loss_mask.bool()
            n = max(int(m.sum()), 1)
            extra[M.MISMATCH] = float((old_logp - batch.rollout_logp).abs()[m].double().sum() / n)
        ref_logp = self._ref_logprobs(batch)
        ledger = None if self.ledger is None else self.ledger.logprobs(self, batch)

        chunks = torch.arange(batch.batch_size).chunk(self.num_minibatches)
        sums: dict[str, float] = {}
        parts: list[dict] = []
        n_steps = 0
        for rows in chunks:
            mb = batch.select(rows)
            mask = mb.loss_mask.to(dev)
            if int(mask.sum()) == 0:
                continue
            topk, replay = None, None
            use_topk = self.score_centering_topk > 0 and mb.topk_ids is not None
            groups = self._micro_groups(mb)
            if groups is not None:  # token budget: the loss over the whole minibatch, as one
                logp, entropy, *topk_logp = micro.leaves(self, mb, groups, use_topk)
                replay = micro.Replay(self, mb, groups, [logp, *topk_logp])
                topk = self._topk_inputs(mb, topk_logp[0], mask) if use_topk else None
            else:  # [b, S] (and [b, S, K])
                logp, entropy, *topk_logp = self.model_forward(self.model, mb, use_topk)
                topk = self._topk_inputs(mb, topk_logp[0], mask) if use_topk else None
            part = None if diag is None else {}
            metrics = self._update(mb, rows, logp, mask, old_logp, ref_logp, part, topk, replay)
            if ledger is not None:
                metrics.update(ledger_metrics(ledger, rows, logp, mb, part))
            if part is not None:
                parts.append(part)
            metrics[M.ENTROPY] = float(entropy[mask.bool()].double().mean())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n_steps += 1
        self.step_count += 1
        out = {k: v / n_steps for k, v in sums.items()} if n_steps else {}
        out.update(extra)
        if self.r3_audit:
            n_rows, n_bad = map(float, self._audit_totals())
            out[M.R3_AUDIT_ROWS], out[M.R3_AUDIT_MISMATCHED_ROWS] = n_rows, n_bad
        out[M.PERF_TRAIN_S] = time.perf_counter() - t0
        out[M.PERF_OPTIMIZER_STEPS] = float(n_steps)
        if diag is not None and parts:
            diag.update({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
        return out

    def _micro_groups(self, mb: TrainBatch) -> list[list[int]] | None:
        """``mb``'s micro-batches under ``max_tokens_per_micro_batch`` (``packing.
        micro_batches``), or None when it is off or they are one."""
        s = self.settings
        if s.max_tokens_per_micro_batch <= 0:
            return None
        lengths = sample_lengths(mb.attention_mask)
        groups = micro_batches(lengths, s.max_tokens_per_micro_batch, s.max_tokens_per_row)
        return groups if len(groups) > 1 else None

    def forward_nograd(self, model, batch: TrainBatch, topk: bool = False) -> tuple:
        """``_model_forward`` (``topk``: ``_model_forward_topk``) of ``batch`` without gradient,
        micro-batch by micro-batch under the token budget; ``[B, S]`` results on the device."""
        with torch.no_grad():
            groups = self._micro_groups(batch)
            if groups is None:
                return self.model_forward(model, batch, topk)
            return micro.stitched(self, model, batch, groups, topk)

    def _topk_inputs(self, mb: TrainBatch, topk_logp: torch.Tensor, mask: torch.Tensor) -> dict:
        """Score centering's ``LossInputs`` fields: the policy's log-probs at the sampler's
        top-k (with grad), the sampler's own (detached) and which entries are real (an id on a
        response token)."""
        ids = mb.topk_ids.to(self.device)  # [b, S, K]
        return {
            "policy_topk_logp": topk_logp,
            "sampler_topk_logp": mb.topk_logp.to(self.device),
            "topk_valid": (ids >= 0) & mask.bool()[..., None],
        }

    def _update(
        self, mb, rows, logp, mask, old_logp, ref_logp, diag=None, topk=None, replay=None
    ) -> dict[str, float]:
        """Loss, backward, clip and optimizer step of one minibatch (or the non-finite skip);
        ``topk``: score centering's inputs (``_topk_inputs``) or None; ``replay``: a
        ``micro.Replay`` when the log-probs are leaves of micro-batch forwards (it carries
        their gradients into the weights)."""
        dev, cfg = self.device, self.loss
        inputs = LossInputs(
            logp=logp,
            rollout_logp=mb.rollout_logp.to(dev),
            old_logp=None if old_logp is None else old_logp[rows].to(dev),
            advantages=mb.advantages.to(dev),
            mask=mask,
            diagnostics=diag is not None,
            **self._extra_inputs(mb),
            **(topk or {}),
        )
        out = registry.compute(cfg, inputs)
        loss, metrics = out.loss, out.metrics
        if diag is not None:
            diag.update(out.diag)
        total = loss
        if ref_logp is not None:
            kl = kl_k3_penalty(logp, ref_logp[rows].to(dev), mask, cfg.agg)
            total = total + cfg.kl_coef * kl
            metrics[M.KL_REF] = float(kl.detach())
        self.opt.zero_grad(set_to_none=True)
        grad_norm = torch.tensor(float("nan"))
        if torch.isfinite(total):
            total.backward()
            if replay is not None:
                replay()
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            grad_norm = self._clip_gradients(max_norm)
        if torch.isfinite(grad_norm):
            self._opt_step(metrics.get(M.LR_SCALE))
        else:
            # a non-finite loss or gradient: no update, so the weights stay usable; the loop
            # counts the step (loss/nonfinite_steps) and goes on
            self.opt.zero_grad(set_to_none=True)
            metrics[NONFINITE_METRIC] = 1.0
        metrics[M.GRAD_NORM] = float(grad_norm)
        metrics[M.LOSS_TOTAL] = float(total.detach())
        return metrics

    def _opt_step(self, lr_scale: float | None) -> None:
        """``opt.step``; with ``lr_scale`` (VCPO's ESS-guided step) the learning rate of this
        step only is multiplied by it."""
        s = self.settings
        if lr_schedule.active(s.lr_schedule, s.lr_warmup_steps):  # this step's scheduled lr
            lr_schedule.apply(self.opt, s.lr, s.lr_schedule, s.lr_warmup_steps, s.lr_decay_steps)
        if lr_scale is None:
            self.opt.step()
            return
        base = [g["lr"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["lr"] = g["lr"] * float(lr_scale)
        try:
            self.opt.step()
        finally:
            for g, lr in zip(self.opt.param_groups, base, strict=True):
                g["lr"] = lr

    def set_clip_radii(self, eps_low: float, eps_high: float) -> None:
        """Change the clip radii for later steps (a clip schedule)."""
        self.loss = self.loss.replace(eps_low=float(eps_low), eps_high=float(eps_high))

    def skip_step(self) -> None:
        """Count a step that had no samples (keeps ``step_count`` equal to the loop's step)."""
        self.step_count += 1
