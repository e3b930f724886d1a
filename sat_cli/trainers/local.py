"""The local trainer: an HF causal LM (fp32) trained with torch AdamW on the policy losses.

One ``step(batch)`` (ALGORITHMS.md §1, §3-§6):

1. if the algorithm/correction needs ``pi_old`` (``registry.needs_old_logp``), recompute the
   batch's log-probs once, without gradient (with R3 replay when on);
2. with ``kl_coef > 0``, the reference policy's log-probs (the initial weights, frozen);
3. split the batch into ``num_minibatches`` contiguous row chunks; per chunk: forward (R3 replay
   of the recorded routes when ``r3``), token log-probs of ``logits / temperature``,
   ``sat_cli.rl.registry.compute_loss`` (+ ``kl_coef * k3``), backward, grad-norm clip, AdamW step.
   A chunk without response tokens is skipped (no optimizer step).

Log-probs follow ``TrainBatch``'s alignment: ``logp[b, s] = log_softmax(logits[b, s-1] / T)
[input_ids[b, s]]``, column 0 is 0. This is what the local engine reports for ``top_p = 1,
top_k = -1``; with top-p/top-k filtering at rollout the trainer still scores the unfiltered
distribution at temperature ``T`` (the usual convention), so the filtering shows up as mismatch.

Metrics are the loss library's (``loss/*``, ``sat/*``, ``staleness/*``) averaged over minibatches,
plus ``loss/grad_norm`` (before clipping), ``loss/entropy`` (mean token entropy of the
temperature-scaled distribution), ``loss/total`` and ``perf/train_s``; with the recompute pass
also ``staleness/mismatch_abs_logratio_mean`` (mean ``|log pi_old - log mu|``).

Checkpoints: ``publish_weights(dir, version)`` writes ``dir/v{version}`` in HF format (atomic
rename); ``save(dir)`` writes ``dir/model`` (HF), ``dir/optimizer.safetensors`` (the AdamW moment
tensors and the torch RNG state) and ``dir/trainer_state.json`` (param groups, step counter),
then renames the folder into place. No pickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sat_cli.models.r3 import R3Error, RouteAudit, maybe_replay
from sat_cli.models.tiny_moe import load_model, save_hf
from sat_cli.rl import registry
from sat_cli.rl.losses import kl_k3_penalty
from sat_cli.trainers.batch import TrainBatch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float):
    """``logp [B, S]`` aligned to the token it scores and ``entropy [B, S]`` of the same
    distribution (column 0: 0). ``logits``: ``[B, S, V]``."""
    z = logits[:, :-1].float() / temperature  # [B, S-1, V]
    logsm = torch.log_softmax(z, dim=-1)  # [B, S-1, V]
    lp = logsm.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, S-1]
    with torch.no_grad():
        ent = -(logsm.exp() * logsm).sum(-1)  # [B, S-1]
    zero = lp.new_zeros((lp.shape[0], 1))
    return torch.cat([zero, lp], dim=1), torch.cat([zero.detach(), ent], dim=1)


def _atomic_dir(final: Path):
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


class LocalTrainer:
    """HF model + torch AdamW trainer (implements ``sat_cli.trainers.base.Trainer``)."""

    def __init__(
        self,
        model_path: str,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.98),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        algo: str = "grpo",
        correction: str = "none",
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        adaptive: bool = False,
        quantile: float = 0.9,
        exponent: float = 2.0,
        anchor: str = "q",
        loss_agg: str = "token-mean",
        ratio_denominator: str = "rollout",
        kl_coef: float = 0.0,
        temperature: float = 1.0,
        r3: bool = False,
        num_minibatches: int = 1,
        seed: int = 0,
        device: str = "cpu",
        loss_kwargs: dict | None = None,
        r3_audit: bool = False,
    ):
        if num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
        if temperature <= 0:
            raise ValueError(f"trainer temperature must be > 0, got {temperature}")
        registry.resolve(algo, correction, ratio_denominator)  # fail fast on bad names
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_model(model_path, "float32", self.device).train()
        self.tokenizer = self._load_tokenizer(model_path)
        if r3 and not hasattr(self.model.config, "num_experts"):
            raise R3Error(f"R3 needs an MoE model; {type(self.model).__name__} has no experts")
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay
        )
        self.ref_model = None
        if kl_coef > 0:
            self.ref_model = load_model(model_path, "float32", self.device)
            self.ref_model.requires_grad_(False)
        self.grad_clip = grad_clip
        self.algo, self.correction = algo, correction
        self.loss_args = dict(
            eps_low=eps_low,
            eps_high=eps_high,
            adaptive=adaptive,
            quantile=quantile,
            exponent=exponent,
            anchor=anchor,
            agg=loss_agg,
            ratio_denominator=ratio_denominator,
            **(loss_kwargs or {}),
        )
        self.needs_old = registry.needs_old_logp(algo, correction, ratio_denominator)
        self.needs = registry.resolve(algo, correction, ratio_denominator).needs
        self.kl_coef = kl_coef
        self.temperature = temperature
        self.r3 = r3
        self.r3_audit = r3 and r3_audit
        self._audit = [0, 0]  # (token, layer) rows checked, rows whose experts differed
        self.num_minibatches = num_minibatches
        self.step_count = 0

    @staticmethod
    def _load_tokenizer(model_path):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(model_path))
        except (OSError, ValueError):
            return None  # a checkpoint without tokenizer files: publish weights only

    # --- forward ---------------------------------------------------------------------------
    def _check_routes(self, batch: TrainBatch) -> None:
        if not self.r3:
            return
        r = batch.routed_experts
        if r is None:
            raise R3Error(
                "R3 is on but the batch has no routed experts (engine started without r3?)"
            )
        if tuple(r.shape[:2]) != tuple(batch.input_ids.shape):
            raise R3Error(
                f"routed experts {tuple(r.shape)} do not match input_ids {tuple(batch.input_ids.shape)}"
            )

    def _forward(self, model, batch: TrainBatch):
        self._check_routes(batch)
        dev = self.device
        audit = (
            RouteAudit(model, batch.routed_experts, batch.recorded_routes)
            if self.r3_audit and model is self.model
            else contextlib.nullcontext()
        )
        with (
            maybe_replay(
                model,
                None if batch.routed_experts is None else batch.routed_experts.to(dev),
                self.r3,
            ),
            audit,
        ):
            out = model(
                input_ids=batch.input_ids.to(dev),
                attention_mask=batch.attention_mask.to(dev),
                position_ids=batch.position_ids.to(dev),
                use_cache=False,
            )
        if isinstance(audit, RouteAudit):
            self._audit[0] += audit.rows
            self._audit[1] += audit.mismatched
        return token_logprobs(out.logits, batch.input_ids.to(dev), self.temperature)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Recomputed ``logp [B, S]`` of the current weights (no grad), aligned like ``rollout_logp``."""
        return self._forward(self.model, batch)[0].cpu()

    # --- training step -----------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        dev = self.device
        extra: dict[str, float] = {}
        self._audit = [0, 0]
        old_logp = None
        if self.needs_old:
            old_logp = self.logprobs(batch)  # [B, S]
            m = batch.loss_mask.bool()
            n = max(int(m.sum()), 1)
            extra["staleness/mismatch_abs_logratio_mean"] = float(
                (old_logp - batch.rollout_logp).abs()[m].double().sum() / n
            )
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp = self._forward(self.ref_model, batch)[0].cpu()

        chunks = torch.arange(batch.batch_size).chunk(self.num_minibatches)
        sums: dict[str, float] = {}
        n_steps = 0
        for rows in chunks:
            mb = batch.select(rows)
            mask = mb.loss_mask.to(dev)
            if int(mask.sum()) == 0:
                continue
            logp, entropy = self._forward(self.model, mb)  # [b, S]
            loss, metrics = registry.compute_loss(
                self.algo,
                self.correction,
                logp=logp,
                rollout_logp=mb.rollout_logp.to(dev),
                old_logp=None if old_logp is None else old_logp[rows].to(dev),
                advantages=mb.advantages.to(dev),
                mask=mask,
                **self._extra_inputs(mb),
                **self.loss_args,
            )
            total = loss
            if ref_logp is not None:
                kl = kl_k3_penalty(logp, ref_logp[rows].to(dev), mask, self.loss_args["agg"])
                total = total + self.kl_coef * kl
                metrics["loss/kl_ref"] = float(kl.detach())
            self.opt.zero_grad(set_to_none=True)
            grad_norm = torch.tensor(float("nan"))
            if torch.isfinite(total):
                total.backward()
                max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if torch.isfinite(grad_norm):
                self._opt_step(metrics.get("opt/lr_scale"))
            else:
                # a non-finite loss or gradient: no update, so the weights stay usable; the loop
                # counts the step (loss/nonfinite_steps) and goes on
                self.opt.zero_grad(set_to_none=True)
                metrics["loss/nonfinite_skipped"] = 1.0
            metrics["loss/grad_norm"] = float(grad_norm)
            metrics["loss/total"] = float(total.detach())
            mb_mask = mask.bool()
            metrics["loss/entropy"] = float(entropy[mb_mask].double().mean())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n_steps += 1
        self.step_count += 1
        out = {k: v / n_steps for k, v in sums.items()} if n_steps else {}
        out.update(extra)
        if self.r3_audit:
            out["r3/audit_rows"], out["r3/audit_mismatched_rows"] = map(float, self._audit)
        out["perf/train_s"] = time.perf_counter() - t0
        out["perf/optimizer_steps"] = float(n_steps)
        return out

    def _extra_inputs(self, mb: TrainBatch) -> dict:
        """Inputs only some algorithms read (``registry.LossSpec.needs``): the samples' weight
        versions and the version this trainer holds (A-3PO), per-response squared norms of
        ``grad sum_t log pi`` (VCPO's optimal baseline)."""
        out: dict = {}
        if "versions" in self.needs:
            v = mb.token_versions if mb.token_versions is not None else mb.versions
            out["versions"], out["current_version"] = v.to(self.device), self.step_count
        if "seq_score_sqnorm" in self.needs and self.loss_args.get("vcpo_opob", True):
            out["seq_score_sqnorm"] = self._score_sqnorms(mb)
        return out

    def _score_sqnorms(self, mb: TrainBatch) -> torch.Tensor:
        """``||grad_theta sum_t log pi(y_t)||^2`` per response (float64 ``[b]``): one forward and
        backward per row, gradients taken with ``autograd.grad`` (``.grad`` is untouched)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        out = torch.zeros(mb.batch_size, dtype=torch.float64)
        for b in range(mb.batch_size):
            row = mb.select(slice(b, b + 1))
            m = row.loss_mask.to(self.device).bool()
            if not bool(m.any()):
                continue
            logp, _ = self._forward(self.model, row)
            grads = torch.autograd.grad(logp[m].sum(), params, allow_unused=True)
            out[b] = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
        return out

    def _opt_step(self, lr_scale: float | None) -> None:
        """``AdamW.step``; with ``lr_scale`` (VCPO's ESS-guided step) the learning rate of this
        step only is multiplied by it."""
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
        self.loss_args["eps_low"], self.loss_args["eps_high"] = float(eps_low), float(eps_high)

    def skip_step(self) -> None:
        """Count a step that had no samples (keeps ``step_count`` equal to the loop's step)."""
        self.step_count += 1

    # --- weights and checkpoints ---------------------------------------------------------------
    def publish_weights(self, dir: str | os.PathLike, version: int) -> Path:
        """Write the current weights as an HF checkpoint ``dir/v{version}`` (atomically); return it."""
        return save_hf(self.model, self.tokenizer, Path(dir) / f"v{int(version)}")

    def save(self, dir: str | os.PathLike) -> None:
        final = Path(dir)
        tmp = _atomic_dir(final)
        try:
            save_hf(self.model, self.tokenizer, tmp / "model")
            tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
            sd = self.opt.state_dict()
            for idx, state in sd["state"].items():
                for key, value in state.items():
                    t = value if torch.is_tensor(value) else torch.tensor(value)
                    tensors[f"state/{idx}/{key}"] = t.detach().cpu().contiguous()
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            meta = {"step_count": self.step_count, "param_groups": sd["param_groups"]}
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(self, dir: str | os.PathLike) -> None:
        d = Path(dir)
        meta = json.loads((d / "trainer_state.json").read_text())
        tensors = load_file(str(d / "optimizer.safetensors"))
        loaded = load_model(d / "model", "float32", self.device)
        self.model.load_state_dict(loaded.state_dict())
        del loaded
        state: dict[int, dict] = {}
        for name, t in tensors.items():
            if name.startswith("state/"):
                _, idx, key = name.split("/", 2)
                state.setdefault(int(idx), {})[key] = t
        groups = meta["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        self.opt.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng/torch"])
        self.step_count = int(meta["step_count"])

    def close(self) -> None:
        self.ref_model = None
