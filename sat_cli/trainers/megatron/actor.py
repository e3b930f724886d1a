"""The megatron-core policy inside the worker: forward, loss, AdamW step, export, checkpoints.

``MegatronActor`` mirrors ``sat_cli.trainers.local.LocalTrainer`` step for step, so the two
backends give the same numbers from the same weights and batch (tests/test_megatron_trainer.py):

1. if the algorithm/correction needs ``pi_old`` (``registry.needs_old_logp``), recompute the
   batch's log-probs once without gradient (with R3 replay when on);
2. with ``kl_coef > 0``, the reference policy's log-probs (a second, frozen GPTModel with the
   initial weights);
3. ``num_minibatches`` contiguous row chunks; per chunk: forward (R3: ``RouterReplay`` with the
   recorded routes), ``logp = log_softmax(logits / temperature)`` of the sampled tokens,
   ``sat_cli.rl.registry.compute_loss`` (+ ``kl_coef * k3``), backward,
   ``clip_grad_norm_``, ``torch.optim.AdamW`` step (megatron's own optimizer allocates on CUDA;
   plain AdamW over the unwrapped model is what world size 1 needs). Chunks without response
   tokens are skipped.

Metrics have the local trainer's names and meaning. Log-probs use ``TrainBatch``'s alignment
(column 0 is 0). Padding keys are masked like HF's attention mask.

Checkpoints: ``export_hf(dir)`` writes an HF checkpoint (per-expert safetensors + config and
tokenizer files of the source model). ``save(dir)`` writes ``model/`` (HF), an
``optimizer.safetensors`` with the AdamW moments keyed by megatron parameter name
(``state/<name>/<key>``) and the torch RNG state, and ``trainer_state.json``; the layout matches
the local trainer's, but the optimizer tensors are keyed by megatron names, so a checkpoint
resumes only on the backend that wrote it (``"backend": "megatron"`` in the JSON).

Scope: world size 1 (TP = PP = EP = CP = 1; see docs/megatron.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sat_cli.rl import registry
from sat_cli.rl.losses import kl_k3_penalty
from sat_cli.trainers.batch import TrainBatch

from . import convert, runtime
from .model import build_gpt_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronActor:
    """megatron-core GPTModel + torch AdamW (the worker's state; world size 1)."""

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
        loss_kwargs: dict | None = None,
        dtype: str = "float32",
    ):
        if num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
        if temperature <= 0:
            raise ValueError(f"trainer temperature must be > 0, got {temperature}")
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
        registry.resolve(algo, correction, ratio_denominator)  # fail fast on bad names
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.hf_config = convert.read_hf_config(model_path)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = DTYPES[dtype]
        self.r3 = r3
        self.model = self._build(routing_replay=r3, clear_registry=True)
        self.model.train()
        self.ref_model = None
        if kl_coef > 0:
            # also replay-enabled under R3 (same routes); registered after the actor's routers
            self.ref_model = self._build(routing_replay=r3, clear_registry=False)
            self.ref_model.requires_grad_(False)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay
        )
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
        self.kl_coef = kl_coef
        self.temperature = temperature
        self.num_minibatches = num_minibatches
        self.step_count = 0

    def _build(self, *, routing_replay: bool, clear_registry: bool):
        model = build_gpt_model(
            self.hf_config,
            dtype=self.dtype,
            routing_replay=routing_replay,
            clear_replay_registry=clear_registry,
        )
        convert.load_hf_into_megatron(model, self.model_path)
        return model.to(self.device)

    # --- forward ---------------------------------------------------------------------------
    def _forward(self, model, batch: TrainBatch):
        dev = self.device
        if self.r3:
            if batch.routed_experts is None:
                raise runtime.R3Error(
                    "R3 is on but the batch has no routed experts (engine started without r3?)"
                )
            if tuple(batch.routed_experts.shape[:2]) != tuple(batch.input_ids.shape):
                raise runtime.R3Error(
                    f"routed experts {tuple(batch.routed_experts.shape)} do not match "
                    f"input_ids {tuple(batch.input_ids.shape)}"
                )
            runtime.set_replay_routes(batch.routed_experts, self.model.config, device=dev)
        try:
            return runtime.token_logprobs(
                model,
                batch.input_ids.to(dev),
                batch.position_ids.to(dev),
                batch.attention_mask.to(dev),
                self.temperature,
            )
        finally:
            if self.r3:
                # REPLAY_FORWARD reads the routes during the forward only (no recompute), so
                # they can go now; a backward never needs them again.
                runtime.clear_replay()

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Recomputed ``logp [B, S]`` (no grad), aligned like ``rollout_logp``."""
        return self._forward(self.model, batch)[0].float().cpu()

    # --- training step -----------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        dev = self.device
        extra: dict[str, float] = {}
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
                ref_logp = self._forward(self.ref_model, batch)[0].float().cpu()

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
                **self.loss_args,
            )
            total = loss
            if ref_logp is not None:
                kl = kl_k3_penalty(logp, ref_logp[rows].to(dev), mask, self.loss_args["agg"])
                total = total + self.kl_coef * kl
                metrics["loss/kl_ref"] = float(kl.detach())
            self.opt.zero_grad(set_to_none=True)
            total.backward()
            max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            self.opt.step()
            metrics["loss/grad_norm"] = float(grad_norm)
            metrics["loss/total"] = float(total.detach())
            metrics["loss/entropy"] = float(entropy[mask.bool()].double().mean())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n_steps += 1
        self.step_count += 1
        out = {k: v / n_steps for k, v in sums.items()} if n_steps else {}
        out.update(extra)
        out["perf/train_s"] = time.perf_counter() - t0
        out["perf/optimizer_steps"] = float(n_steps)
        return out

    # --- weights and checkpoints ---------------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        return convert.megatron_state_to_hf(self.model, self.hf_config)

    def export_hf(self, out_dir: str | os.PathLike) -> Path:
        """The current weights as an HF checkpoint at ``out_dir`` (atomic)."""
        return convert.save_hf_checkpoint(self.hf_state(), out_dir, self.model_path)

    def save(self, dir: str | os.PathLike) -> None:
        final = Path(dir)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            self.export_hf(tmp / "model")
            names = [n for n, _ in self.model.named_parameters()]
            tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
            sd = self.opt.state_dict()
            for idx, state in sd["state"].items():
                for key, value in state.items():
                    t = value if torch.is_tensor(value) else torch.tensor(value)
                    tensors[f"state/{names[idx]}/{key}"] = t.detach().cpu().contiguous()
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            meta: dict[str, Any] = {
                "backend": "megatron",
                "step_count": self.step_count,
                "param_groups": sd["param_groups"],
            }
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
        if meta.get("backend") != "megatron":
            raise ValueError(
                f"{d} was written by the {meta.get('backend', 'local')!r} trainer; the megatron "
                "trainer resumes only its own checkpoints (start from its model/ folder instead)"
            )
        tensors = load_file(str(d / "optimizer.safetensors"))
        convert.load_hf_into_megatron(self.model, d / "model")
        index = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        state: dict[int, dict] = {}
        for name, t in tensors.items():
            if name.startswith("state/"):
                pname, key = name[len("state/") :].rsplit("/", 1)
                state.setdefault(index[pname], {})[key] = t.to(self.device)
        groups = meta["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        self.opt.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng/torch"])
        self.step_count = int(meta["step_count"])
