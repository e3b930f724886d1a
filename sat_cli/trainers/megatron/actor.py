"""The megatron-core policy inside the worker: forward, loss, AdamW step, export, checkpoints.

``MegatronActor`` runs the same policy update as ``sat_cli.trainers.local.LocalTrainer``: both
inherit ``sat_cli.trainers.step.PolicyTrainer.step`` (minibatches, ``pi_old`` recompute,
reference log-probs, loss from the ``LossConfig``, backward, clip, non-finite skip, metrics), so
the two backends give the same numbers from the same weights and batch
(tests/test_megatron_trainer.py). This class supplies the megatron-core forward (R3:
``RouterReplay`` with the recorded routes; the reference policy is a second, frozen GPTModel with
the initial weights), the gradient reduction over data-parallel ranks with the clip, and
``torch.optim.AdamW`` (megatron's own optimizer allocates on CUDA; plain AdamW over the
unwrapped model, with the gradient sums below for several ranks). ``dtype="bfloat16"``: mixed
precision (``precision.py``: fp32 main weights and states, fp32 gradient sums; megatron-core's
distributed optimizer on CUDA).

Metrics have the local trainer's names and meaning. Log-probs use ``TrainBatch``'s alignment
(column 0 is 0). Padding keys are masked like HF's attention mask.

Checkpoints: ``export_hf(dir)`` writes an HF checkpoint (per-expert safetensors + config and
tokenizer files of the source model); ``save(dir)`` / ``load(dir)`` are
``checkpoint.CheckpointMixin``'s.

Parallelism (the collective parts live in ``parallel.ParallelMixin``): ``world = dp x tp x pp``
with expert parallelism inside (``ep`` divides a stage's ranks; experts are whole per rank, not
TP-split); CP = 1. Pipeline stages run one after the other (``pipeline.Stage``: point-to-point
sends, the backward inside ``loss.backward()``), and every stage ends with the same log-probs.
Tensor parallelism is megatron-core's
own (column/row-parallel layers, vocabulary-parallel embedding and output layer) with sequence
parallelism, which megatron-core requires for MoE with TP > 1: the sequence is padded to a
multiple of tp (``runtime.pad_columns``), each TP rank's routers see its block of positions
(R3 replays that block), and each TP rank keeps its vocabulary shard of the logits, the
log-softmax taken across the shards (``runtime.vocab_parallel_logprobs``), so all ranks of a
TP group compute the same log-probs and loss without forming full-vocabulary logits. Each minibatch's rows are split
over the data-parallel ranks; every rank runs
its shard forward, the per-token log-probs are all-gathered (``runtime.gather_rows``, gradient
to the own shard only) and every rank computes the *same* full-minibatch loss, so SAT's
order statistic and the loss normalisation are exactly those of a single process. Gradients are
then summed: dense parameters over the data-parallel group, and those every TP rank holds whole
(norms, router) also over the TP group; expert parameters over the expert-data-parallel group
(the all-gather dispatcher already brings every EP-group token to its expert). The clip norm
counts every parameter once (``_reduce_and_clip``). With world size 1 none of
this runs and the step is the local trainer's, operation for operation. The non-finite skip
is collective-safe: every rank computes the same loss and, after the reduction, the same global
norm, so all ranks skip (or step) together.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

import torch

from sat_cli.models.hf_checkpoint import DEFAULT_MAX_SHARD_SIZE, save_hf_checkpoint
from sat_cli.models.r3 import check_routes
from sat_cli.models.tiny_moe import torch_dtype
from sat_cli.rl.config import LossConfig
from sat_cli.trainers import lr_schedule
from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.step import PolicyTrainer

from . import convert, precision, runtime
from .checkpoint import CheckpointMixin
from .model import ModelSettings, build_gpt_model
from .parallel import ParallelMixin


class MegatronActor(CheckpointMixin, ParallelMixin, PolicyTrainer):
    """megatron-core GPTModel + torch AdamW (the state of one worker rank)."""

    def __init__(
        self,
        model_path: str,
        *,
        loss: LossConfig | dict | None = None,
        dtype: str = "float32",
        export_dtype: str | None = None,
        recompute: bool = False,
        optimizer_offload: bool = False,
        **options,
    ):
        """``loss``: a ``LossConfig`` or its ``to_dict()`` (the worker's JSON; default
        ``LossConfig()``); ``options``: as ``LocalTrainer``'s (the
        ``sat_cli.trainers.step.StepSettings`` fields only). ``dtype``: the parameters'
        (``bfloat16``: mixed precision with fp32 main weights, ``precision.py``);
        ``export_dtype``: published weights' (the engine's; default ``dtype``); ``recompute``:
        full activation recompute of the trained model, one layer at a time;
        ``optimizer_offload``: the fp32 main weights and Adam states in host memory
        (``precision.py``)."""
        if isinstance(loss, dict):
            loss = LossConfig.from_dict(loss)
        torch_dtype(dtype)  # refuses an unknown name before anything is built
        self.export_dtype = torch_dtype(export_dtype or dtype)
        self._init_step(loss, options)
        if self.settings.max_tokens_per_row:
            raise ValueError("sequence packing needs Transformer Engine attention (not here)")
        self.model_path = str(model_path)
        self.hf_config = convert.read_hf_config(model_path)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = torch_dtype(dtype)
        self.recompute = bool(recompute)
        self.optimizer_offload = bool(optimizer_offload)
        self._init_parallel()
        self.model = self._build(
            routing_replay=self.r3, clear_registry=True, recompute=self.recompute
        )
        self.model.train()
        self.ref_model = None
        if self.loss.kl_coef > 0:
            # also replay-enabled under R3 (same routes); registered after the actor's routers
            self.ref_model = self._build(routing_replay=self.r3, clear_registry=False)
            self.ref_model.requires_grad_(False)
        self.main: precision.MainWeights | None = None
        self.core: precision.CoreOptimizer | None = None
        if self.dtype == torch.float32:
            if self.optimizer_offload:
                raise ValueError(
                    "optimizer_offload moves the fp32 main weights and Adam states of mixed "
                    "precision to the host: it needs dtype bfloat16"
                )
            self.opt = self._new_optimizer(self.model.parameters())
        elif self.dtype != torch.bfloat16:
            raise ValueError(f"megatron trainer: dtype float32 or bfloat16, got {dtype}")
        elif precision.use_core_optimizer(self.device, self.optimizer_offload):
            if lr_schedule.active(self.settings.lr_schedule, self.settings.lr_warmup_steps):
                raise ValueError(
                    "trainer.lr_schedule / trainer.lr_warmup_steps: megatron-core's distributed "
                    "optimizer (bf16 on CUDA) has no learning-rate schedule in sat yet; use a "
                    f"constant trainer.lr, trainer.dtype=float32, or {precision.CORE_ENV}=0 (torch "
                    "AdamW on fp32 main weights)"
                )
            self.core = precision.CoreOptimizer(
                self.model, self.settings, self.grad_clip, offload=self.optimizer_offload
            )
            self.opt = self.core
        else:
            self.main = precision.MainWeights(self.model, self._hf_main_state(self.model_path))
            self.opt = self._new_optimizer(self.main.params)

    def memory_options(self) -> str:
        """What the worker's start-up line reports, e.g. ``bfloat16, recompute=full, optimizer
        on host`` (the granularity is read back from the built model's megatron config)."""
        where = "host" if self.optimizer_offload or self.device.type == "cpu" else "gpu"
        granularity = self.model.config.recompute_granularity or "none"
        return f"{str(self.dtype).removeprefix('torch.')}, recompute={granularity}, optimizer on {where}"

    def _build(self, *, routing_replay: bool, clear_registry: bool, recompute: bool = False):
        st = ModelSettings(self.dtype, self.tp, self.pp, self.ep)  # dtype and parallel sizes
        st = replace(st, routing_replay=routing_replay, recompute=recompute)
        model = build_gpt_model(self.hf_config, st, clear_replay_registry=clear_registry)
        self._load_weights(model, self.model_path)
        return model.to(self.device)

    def _load_weights(self, model, model_dir) -> None:
        convert.load_hf_into_megatron(
            model,
            model_dir,
            ep_rank=self.ep_rank,
            ep_size=self.ep,
            tp_rank=self.tp_rank,
            tp_size=self.tp,
            select=None if self.stage is None else self._stage_weights,
        )

    def _hf_main_state(self, model_dir) -> dict[str, torch.Tensor]:
        """This rank's parameters from an HF checkpoint as stored (fp32 main weights)."""
        state = {
            k: torch.empty(v.shape, dtype=torch.float32)
            for k, v in self.model.state_dict().items()
            if not k.endswith("_extra_state")
        }
        holder = type("StateHolder", (), {"state_dict": lambda _self: state})()
        self._load_weights(holder, model_dir)  # copies (shape-checked) into ``state``
        return {n: state[n] for n, _ in self.model.named_parameters()}

    def _stage_weights(self, mg_state: dict) -> dict:
        return self.stage.select(mg_state, self.hf_config["num_hidden_layers"])

    def _stage_layers(self) -> slice:
        """The decoder layers of this pipeline stage (all without pipeline parallelism)."""
        if self.stage is None:
            return slice(None)
        layers = self.stage.layers(self.hf_config["num_hidden_layers"])
        return slice(layers.start, layers.stop)

    # --- forward ---------------------------------------------------------------------------
    def _rank_forward(self, model, batch: TrainBatch, real_rows: int | None = None):
        """This rank's forward of ``batch``; rows from ``real_rows`` on are data-parallel
        padding (``runtime.shard_rows``), left out of the R3 audit."""
        dev = self.device
        n_cols = batch.input_ids.shape[1]
        # sequence parallelism splits the sequence over the TP ranks: pad it to a multiple of
        # tp (right padding, masked keys: real tokens see nothing new); cut again below
        if self.r3:
            check_routes(batch.routed_experts, batch.input_ids)
        batch = runtime.pad_columns(batch, self.tp)
        routes = batch.routed_experts
        if self.r3:
            runtime.set_replay_routes(
                routes,
                self.model.config,
                device=dev,
                seq_shard=(self.tp_rank, self.tp),
                layers=self._stage_layers(),
            )
        audit = None
        if self.r3_audit and model is self.model and not self._audit_paused:
            # each TP rank's routers see its own block of positions, each stage its layers
            cols = runtime.seq_block(batch.input_ids.shape[1], self.tp_rank, self.tp)
            valid = batch.recorded_routes[:, cols].clone()
            if real_rows is not None:
                valid[real_rows:] = False
            audit = runtime.RouteAudit(model, routes[:, cols, self._stage_layers()], valid)
        try:
            with audit or contextlib.nullcontext():
                forward = (
                    runtime.token_logprobs if self.stage is None else self.stage.token_logprobs
                )
                logp, entropy = forward(
                    model,
                    batch.input_ids.to(dev),
                    batch.position_ids.to(dev),
                    batch.attention_mask.to(dev),
                    self.temperature,
                )
            if audit is not None:
                self._audit[0] += audit.rows
                self._audit[1] += audit.mismatched
            return logp[:, :n_cols], entropy[:, :n_cols]
        finally:
            if self.r3 and not (self.recompute and torch.is_grad_enabled()):
                # REPLAY_FORWARD reads the routes during the forward only, so they can go now.
                # With recompute the backward reruns each layer's forward, routers included:
                # the routes stay until the backward is done (``_clip_gradients``).
                runtime.clear_replay()

    def _model_forward(self, model, batch: TrainBatch):
        """``(logp, entropy)`` ``[B, S]`` of the whole ``batch``, each rank running its rows."""
        if self.dp == 1:
            return self._rank_forward(model, batch)
        n = batch.batch_size
        rows, per = runtime.shard_rows(n, self.dp, self.dp_rank)
        real = min(per, max(0, n - self.dp_rank * per))
        logp, entropy = self._rank_forward(model, batch.select(rows), real_rows=real)
        logp = runtime.gather_rows(logp, self.dp_group, self.dp_rank, self.dp)[:n]
        with torch.no_grad():
            entropy = runtime.gather_rows(entropy, self.dp_group, self.dp_rank, self.dp)[:n]
        return logp, entropy

    # --- the backend's part of the training step (sat_cli.trainers.step) ---------------------
    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        if self.r3 and self.recompute:
            runtime.clear_replay()  # the backward has rerun the forwards (``_rank_forward``)
        if self.core is not None:
            return self.core.clip(max_norm)
        if self.main is not None:
            self.main.take_grads()  # bf16 -> fp32 before any reduction
        if self.world == 1:
            return torch.nn.utils.clip_grad_norm_([p for _, p in self._trained()], max_norm)
        return self._reduce_and_clip(max_norm)

    def _opt_step(self, lr_scale: float | None) -> None:
        super()._opt_step(lr_scale)
        if self.main is not None:
            self.main.copy_to_model()

    def hf_state(self, main: bool = False) -> dict[str, torch.Tensor]:
        """All weights in HF naming (a collective when EP > 1: every rank must call it);
        ``main``: the fp32 main weights of a bf16 model (CPU path) instead of the model's."""
        source = self.main.state() if main and self.main is not None else None
        return convert.megatron_to_hf(self._full_megatron_state(source), self.hf_config)

    def export_hf(self, out_dir: str | os.PathLike, *, main: bool = False) -> Path:
        """The current weights as an HF checkpoint at ``out_dir`` (atomic; rank 0 writes), in
        ``export_dtype``, or with ``main`` the fp32 main weights (checkpoints)."""
        state = self.hf_state(main)
        if main:  # a checkpoint: what resumes exactly
            dtype = torch.float32 if self.main is not None else self.dtype
        else:
            dtype = self.export_dtype
        state = {k: v.to(dtype) for k, v in state.items()}
        if self.rank == 0:
            shard = getattr(self, "max_shard_size", DEFAULT_MAX_SHARD_SIZE)
            save_hf_checkpoint(state, out_dir, self.model_path, shard)
        self._barrier()
        return Path(out_dir)
