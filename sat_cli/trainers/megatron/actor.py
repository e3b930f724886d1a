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
   plain AdamW over the unwrapped model, with the gradient sums below for several ranks).
   Chunks without response tokens are skipped.

Metrics have the local trainer's names and meaning. Log-probs use ``TrainBatch``'s alignment
(column 0 is 0). Padding keys are masked like HF's attention mask.

Checkpoints: ``export_hf(dir)`` writes an HF checkpoint (per-expert safetensors + config and
tokenizer files of the source model). ``save(dir)`` writes ``model/`` (HF), an
``optimizer.safetensors`` with the AdamW moments keyed by megatron parameter name
(``state/<name>/<key>``) and the torch RNG state, and ``trainer_state.json``; the layout matches
the local trainer's, but the optimizer tensors are keyed by megatron names, so a checkpoint
resumes only on the backend that wrote it (``"backend": "megatron"`` in the JSON).

Parallelism: data parallel over all ranks with expert parallelism inside (``ep`` divides the
world size); TP = PP = CP = 1. Each minibatch's rows are split over the ranks; every rank runs
its shard forward, the per-token log-probs are all-gathered (``runtime.gather_rows``, gradient
to the own shard only) and every rank computes the *same* full-minibatch loss, so SAT's
order statistic and the loss normalisation are exactly those of a single process. Gradients are
then summed: dense parameters over the data-parallel group, expert parameters over the
expert-data-parallel group (the all-gather dispatcher already brings every EP-group token to
its expert). The clip norm adds the expert norms over the EP group. With world size 1 none of
this runs and the step is the local trainer's, operation for operation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
    """megatron-core GPTModel + torch AdamW (the state of one worker rank)."""

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
        r3_audit: bool = False,
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
        self.r3_audit = r3 and r3_audit
        self._audit = [0, 0]  # (token, layer) rows checked, rows whose experts differed
        self._init_parallel()
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

    def _init_parallel(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.ep = ps.get_expert_model_parallel_world_size() if self.world > 1 else 1
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.world > 1 else 0
        if self.world > 1:
            if ps.get_tensor_model_parallel_world_size() != 1 or (
                ps.get_pipeline_model_parallel_world_size() != 1
                or ps.get_context_parallel_world_size() != 1
            ):
                raise NotImplementedError("megatron trainer: TP, PP and CP must be 1")
            self.dp_group = ps.get_data_parallel_group()
            self.edp_group = ps.get_expert_data_parallel_group()
            self.ep_group = ps.get_expert_model_parallel_group()
            self.dp_rank = dist.get_rank(self.dp_group)
            self.dp = dist.get_world_size(self.dp_group)
        else:
            self.dp_group = self.edp_group = self.ep_group = None
            self.dp_rank, self.dp = 0, 1

    def _build(self, *, routing_replay: bool, clear_registry: bool):
        model = build_gpt_model(
            self.hf_config,
            dtype=self.dtype,
            ep=self.ep,
            routing_replay=routing_replay,
            clear_replay_registry=clear_registry,
        )
        convert.load_hf_into_megatron(model, self.model_path, ep_rank=self.ep_rank, ep_size=self.ep)
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
        audit = (
            runtime.RouteAudit(model, batch.routed_experts, batch.recorded_routes)
            if self.r3_audit and model is self.model
            else None
        )
        try:
            with audit or contextlib.nullcontext():
                out = runtime.token_logprobs(
                    model,
                    batch.input_ids.to(dev),
                    batch.position_ids.to(dev),
                    batch.attention_mask.to(dev),
                    self.temperature,
                )
            if audit is not None:
                self._audit[0] += audit.rows
                self._audit[1] += audit.mismatched
            return out
        finally:
            if self.r3:
                # REPLAY_FORWARD reads the routes during the forward only (no recompute), so
                # they can go now; a backward never needs them again.
                runtime.clear_replay()

    def _sharded_forward(self, model, batch: TrainBatch):
        """``(logp, entropy)`` ``[B, S]`` of the whole ``batch``, each rank running its rows."""
        if self.dp == 1:
            return self._forward(model, batch)
        rows, _ = runtime.shard_rows(batch.batch_size, self.dp, self.dp_rank)
        logp, entropy = self._forward(model, batch.select(rows))
        n = batch.batch_size
        logp = runtime.gather_rows(logp, self.dp_group, self.dp_rank, self.dp)[:n]
        with torch.no_grad():
            entropy = runtime.gather_rows(entropy, self.dp_group, self.dp_rank, self.dp)[:n]
        return logp, entropy

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Recomputed ``logp [B, S]`` (no grad), aligned like ``rollout_logp``."""
        return self._sharded_forward(self.model, batch)[0].float().cpu()

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
                ref_logp = self._sharded_forward(self.ref_model, batch)[0].float().cpu()

        chunks = torch.arange(batch.batch_size).chunk(self.num_minibatches)
        sums: dict[str, float] = {}
        n_steps = 0
        for rows in chunks:
            mb = batch.select(rows)
            mask = mb.loss_mask.to(dev)
            if int(mask.sum()) == 0:
                continue
            logp, entropy = self._sharded_forward(self.model, mb)  # [b, S]
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
            if self.world == 1:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            else:
                grad_norm = self._reduce_and_clip(max_norm)
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
        if self.r3_audit:
            audit = torch.tensor(self._audit, dtype=torch.float64)
            if self.dp_group is not None:  # each rank checked its own rows
                import torch.distributed as dist

                dist.all_reduce(audit, group=self.dp_group)
            out["r3/audit_rows"], out["r3/audit_mismatched_rows"] = map(float, audit.tolist())
        out["perf/train_s"] = time.perf_counter() - t0
        out["perf/optimizer_steps"] = float(n_steps)
        return out

    def set_clip_radii(self, eps_low: float, eps_high: float) -> None:
        """Change the clip radii for later steps (a clip schedule)."""
        self.loss_args["eps_low"], self.loss_args["eps_high"] = float(eps_low), float(eps_high)

    def skip_step(self) -> None:
        """Count a step that had no samples (keeps ``step_count`` equal to the loop's step)."""
        self.step_count += 1

    def _grouped_params(self):
        dense, expert = [], []
        for name, p in self.model.named_parameters():
            (expert if ".mlp.experts." in name else dense).append(p)
        return dense, expert

    def _reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """Sum gradients over the ranks (see module doc) and clip by the global norm."""
        import torch.distributed as dist

        dense, expert = self._grouped_params()
        for params, group in ((dense, self.dp_group), (expert, self.edp_group)):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        dense_sq = sum(p.grad.double().pow(2).sum() for p in dense)
        expert_sq = sum(p.grad.double().pow(2).sum() for p in expert).reshape(1)
        dist.all_reduce(expert_sq, group=self.ep_group)  # experts differ across EP ranks
        total = torch.sqrt(dense_sq + expert_sq[0]).float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in dense + expert:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total

    # --- weights and checkpoints ---------------------------------------------------------------
    def _full_megatron_state(self) -> dict[str, torch.Tensor]:
        """The model's state with every expert (gathered over the EP group), global indices."""
        import torch.distributed as dist

        state = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        if self.ep == 1:
            return state
        per_rank = self.hf_config["num_experts"] // self.ep
        out = {}
        for key in sorted(state):
            if ".mlp.experts.local_experts." not in key:
                out[key] = state[key]
                continue
            head, tail = key.split(".mlp.experts.local_experts.")
            local, rest = tail.split(".", 1)
            parts = [torch.empty_like(state[key]) for _ in range(self.ep)]
            dist.all_gather(parts, state[key].contiguous(), group=self.ep_group)
            for r, t in enumerate(parts):
                out[f"{head}.mlp.experts.local_experts.{r * per_rank + int(local)}.{rest}"] = t
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        """All weights in HF naming (a collective when EP > 1: every rank must call it)."""
        return convert.megatron_to_hf(self._full_megatron_state(), self.hf_config)

    def export_hf(self, out_dir: str | os.PathLike) -> Path:
        """The current weights as an HF checkpoint at ``out_dir`` (atomic; rank 0 writes)."""
        state = self.hf_state()
        if self.rank == 0:
            convert.save_hf_checkpoint(state, out_dir, self.model_path)
        self._barrier()
        return Path(out_dir)

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _optimizer_file(self) -> str:
        return (
            "optimizer.safetensors" if self.world == 1 else f"optimizer_rank{self.rank}.safetensors"
        )

    def save(self, dir: str | os.PathLike) -> None:
        """Checkpoint to ``dir`` (atomic: written to a temporary sibling, then renamed).

        With several ranks each writes ``optimizer_rank{r}.safetensors`` (expert moments are
        sharded); rank 0 writes the rest.
        """
        final = Path(dir)
        tmp = final.parent / f".{final.name}.tmp-save"
        if self.rank == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        try:
            self.export_hf(tmp / "model")
            names = [n for n, _ in self.model.named_parameters()]
            tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
            sd = self.opt.state_dict()
            for idx, state in sd["state"].items():
                for key, value in state.items():
                    t = value if torch.is_tensor(value) else torch.tensor(value)
                    tensors[f"state/{names[idx]}/{key}"] = t.detach().cpu().contiguous()
            save_file(tensors, str(tmp / self._optimizer_file()))
            self._barrier()
            if self.rank == 0:
                meta: dict[str, Any] = {
                    "backend": "megatron",
                    "world_size": self.world,
                    "ep": self.ep,
                    "step_count": self.step_count,
                    "param_groups": sd["param_groups"],
                }
                (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            self._barrier()
        except BaseException:
            if self.rank == 0:
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
        layout = (int(meta.get("world_size", 1)), int(meta.get("ep", 1)))
        if layout != (self.world, self.ep):
            raise ValueError(
                f"{d} was saved with world size {layout[0]} and ep {layout[1]}; this run has "
                f"{self.world} and {self.ep} (optimizer shards do not match)"
            )
        tensors = load_file(str(d / self._optimizer_file()))
        convert.load_hf_into_megatron(
            self.model, d / "model", ep_rank=self.ep_rank, ep_size=self.ep
        )
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
