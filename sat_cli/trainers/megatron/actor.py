"""The megatron-core policy inside the worker: forward, loss, AdamW step, export, checkpoints.

``MegatronActor`` runs the same policy update as ``sat_cli.trainers.local.LocalTrainer``: both
inherit ``sat_cli.trainers.step.PolicyTrainer.step`` (minibatches, ``pi_old`` recompute,
reference log-probs, loss from the ``LossConfig``, backward, clip, non-finite skip, metrics), so
the two backends give the same numbers from the same weights and batch
(tests/test_megatron_trainer.py). This class supplies the megatron-core forward (R3:
``RouterReplay`` with the recorded routes; the reference policy is a second, frozen GPTModel with
the initial weights), the gradient reduction over data-parallel ranks with the clip, and
``torch.optim.AdamW`` (megatron's own optimizer allocates on CUDA; plain AdamW over the
unwrapped model, with the gradient sums below for several ranks).

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
this runs and the step is the local trainer's, operation for operation. The non-finite skip
is collective-safe: every rank computes the same loss and, after the reduction, the same global
norm, so all ranks skip (or step) together.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sat_cli.models.r3 import check_routes
from sat_cli.models.tiny_moe import torch_dtype
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.step import PolicyTrainer, load_optimizer_tensors, optimizer_tensors

from . import convert, runtime
from .model import build_gpt_model


class MegatronActor(PolicyTrainer):
    """megatron-core GPTModel + torch AdamW (the state of one worker rank)."""

    def __init__(
        self,
        model_path: str,
        *,
        loss: LossConfig | dict | None = None,
        dtype: str = "float32",
        **options,
    ):
        """``loss``: a ``LossConfig`` or its ``to_dict()`` (the worker's JSON); ``options``: as
        ``LocalTrainer``'s (``sat_cli.trainers.step.TrainerSettings`` and the keyword form of
        the loss settings)."""
        if isinstance(loss, dict):
            loss = LossConfig.from_dict(loss)
        torch_dtype(dtype)  # refuses an unknown name before anything is built
        self._init_step(loss, options)
        self.model_path = str(model_path)
        self.hf_config = convert.read_hf_config(model_path)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = torch_dtype(dtype)
        self._init_parallel()
        self.model = self._build(routing_replay=self.r3, clear_registry=True)
        self.model.train()
        self.ref_model = None
        if self.loss.kl_coef > 0:
            # also replay-enabled under R3 (same routes); registered after the actor's routers
            self.ref_model = self._build(routing_replay=self.r3, clear_registry=False)
            self.ref_model.requires_grad_(False)
        self.opt = self._new_optimizer(self.model.parameters())

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
    def _rank_forward(self, model, batch: TrainBatch):
        dev = self.device
        if self.r3:
            check_routes(batch.routed_experts, batch.input_ids)
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

    def _model_forward(self, model, batch: TrainBatch):
        """``(logp, entropy)`` ``[B, S]`` of the whole ``batch``, each rank running its rows."""
        if self.dp == 1:
            return self._rank_forward(model, batch)
        rows, _ = runtime.shard_rows(batch.batch_size, self.dp, self.dp_rank)
        logp, entropy = self._rank_forward(model, batch.select(rows))
        n = batch.batch_size
        logp = runtime.gather_rows(logp, self.dp_group, self.dp_rank, self.dp)[:n]
        with torch.no_grad():
            entropy = runtime.gather_rows(entropy, self.dp_group, self.dp_rank, self.dp)[:n]
        return logp, entropy

    # --- the backend's part of the training step (sat_cli.trainers.step) ---------------------
    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        if self.world == 1:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return self._reduce_and_clip(max_norm)

    def _audit_totals(self) -> list[float]:
        audit = torch.tensor(self._audit, dtype=torch.float64)
        if self.dp_group is not None:  # each rank checked its own rows
            import torch.distributed as dist

            dist.all_reduce(audit, group=self.dp_group)
        return audit.tolist()

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
            tensors, param_groups = optimizer_tensors(self.opt, names.__getitem__)
            save_file(tensors, str(tmp / self._optimizer_file()))
            self._barrier()
            if self.rank == 0:
                meta: dict[str, Any] = {
                    "backend": "megatron",
                    "world_size": self.world,
                    "ep": self.ep,
                    "step_count": self.step_count,
                    "param_groups": param_groups,
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
        load_optimizer_tensors(
            self.opt, tensors, meta["param_groups"], index.__getitem__, device=self.device
        )
        self.step_count = int(meta["step_count"])
