"""The local trainer: an HF causal LM (fp32) trained with torch AdamW on the policy losses.

Device and precision: ``device`` is any torch device (``cpu``, ``cuda``: one GPU); ``dtype=
"bfloat16"`` runs the forward under bf16 autocast (matmuls in bf16, log-probs in fp32) while the
weights, gradients and AdamW states stay fp32 (mixed precision); ``"float32"`` (the default) is
plain fp32 with no autocast at all.

The policy update (minibatches, ``pi_old`` recompute, reference log-probs, loss, backward,
grad-norm clip, non-finite skip, metrics) is ``sat_cli.trainers.step.PolicyTrainer``; this class
supplies the HF forward (R3 replay of the recorded routes when ``r3``), plain
``clip_grad_norm_`` and the AdamW optimizer. Loss settings arrive as one
``sat_cli.rl.config.LossConfig`` (``loss=``).

Log-probs follow ``TrainBatch``'s alignment: ``logp[b, s] = log_softmax(logits[b, s-1] / T)
[input_ids[b, s]]``, column 0 is 0. This is what the local engine reports for ``top_p = 1,
top_k = -1``. With top-p/top-k filtering at rollout the behaviour policy ``mu`` is the truncated,
renormalised distribution: by default the trainer still scores the unfiltered distribution at
temperature ``T`` (the usual convention), so each token's log-ratio carries ``-log`` of its kept
mass as a built-in mismatch. ``replay_sampling_mask=True`` removes it: where the batch carries
the engine's kept sets (``TrainBatch.sampling_mask``), the policy, ``pi_old`` and reference
log-probs are ``z[y] - logsumexp(z[kept])`` with ``z = logits / T`` (``step.token_logprobs``).
``score_centering_topk > 0``: the step also gets the policy's log-probs at the sampler's top-k
ids, from the same forward (``step.topk_logprobs``).

Memory: the forward runs the decoder only; the LM head and the log-probs are applied a chunk of
positions at a time (``trainers/head_chunks.py``, ``logprob_chunk_tokens``; by default 128 MiB
of fp32 logits), recomputed in backward, so ``[tokens, vocab]`` logits are never held for a
whole minibatch. A minibatch that fits one chunk (the CPU default) is scored exactly as before.

Checkpoints: ``publish_weights(dir, version)`` writes ``dir/v{version}`` in HF format (atomic
rename); ``save(dir)`` writes ``dir/model`` (HF), ``dir/optimizer.safetensors`` (the AdamW moment
tensors and the torch RNG state) and ``dir/trainer_state.json`` (param groups, step counter),
then renames the folder into place. No pickles.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sat_cli.models.r3 import R3Error as R3Error
from sat_cli.models.r3 import RouteAudit, check_routes, maybe_replay
from sat_cli.models.tiny_moe import load_model, save_hf
from sat_cli.rl.config import LossConfig
from sat_cli.trainers import lora_io, packing
from sat_cli.trainers.batch import TrainBatch
from sat_cli.trainers.head_chunks import head_scores
from sat_cli.trainers.optim_state import load_optimizer_tensors, optimizer_tensors
from sat_cli.trainers.packing import PackPlan, sample_lengths
from sat_cli.trainers.step import PolicyTrainer
from sat_cli.trainers.step import token_logprobs as token_logprobs
from sat_cli.util.fsio import staged_dir


class LocalTrainer(PolicyTrainer):
    """HF model + torch AdamW trainer (implements ``sat_cli.trainers.base.Trainer``)."""

    def __init__(
        self,
        model_path: str,
        *,
        loss: LossConfig | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        weight_sender=None,
        logprob_chunk_tokens: int | None = None,
        **options,
    ):
        """``options``: ``sat_cli.trainers.step.StepSettings`` (``lr``, ``grad_clip``, ...);
        ``loss``: every loss setting (default ``LossConfig()``).
        ``dtype``: ``float32`` or ``bfloat16`` (autocast; module docstring).
        ``logprob_chunk_tokens``: positions whose full-vocabulary logits are held at once
        (``head_chunks.head_scores``; None: its default bound).
        ``options["lora"]``: ``{rank, alpha, dropout, target_modules}``
        (``settings.LoraSettings``): train adapters only, publish them alone
        (``sat_cli.trainers.lora_io``); absent or None: full weights."""
        lora = options.pop("lora", None)
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={dtype!r}: use float32 or bfloat16")
        self._init_step(loss, options)
        self.model_path = str(model_path)
        self.weight_sender = weight_sender  # engine.weight_sync=distributed: a WeightSender
        self.device = torch.device(device)
        self.dtype = dtype
        if logprob_chunk_tokens is not None and logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be >= 1, got {logprob_chunk_tokens}")
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.model = load_model(model_path, "float32", self.device).train()
        self.tokenizer = self._load_tokenizer(model_path)
        if self.r3 and not hasattr(self.model.config, "num_experts"):
            raise R3Error(f"R3 needs an MoE model; {type(self.model).__name__} has no experts")
        self.lora = lora_io.attach(self.model, lora)  # None: the full weights train
        self.opt = self._new_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.ref_model = None
        if self.loss.kl_coef > 0:
            self.ref_model = load_model(model_path, "float32", self.device)
            self.ref_model.requires_grad_(False)

    @staticmethod
    def _load_tokenizer(model_path):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(model_path))
        except (OSError, ValueError):
            return None  # a checkpoint without tokenizer files: publish weights only

    # --- forward ---------------------------------------------------------------------------
    def _model_forward(self, model, batch: TrainBatch):
        return self._scored(model, batch, topk=False)

    def _model_forward_topk(self, model, batch: TrainBatch):
        return self._scored(model, batch, topk=True)

    def _scored(self, model, batch: TrainBatch, topk: bool) -> tuple:
        """``(logp, entropy[, topk_logp])`` ``[B, S]`` of ``model`` on ``batch``; with
        ``max_tokens_per_row`` from one forward of its packed rows (``packing.PackPlan``)."""
        cap = self.settings.max_tokens_per_row
        dev, kept, plan = self.device, self._kept(batch), None
        if cap > 0:
            lengths = sample_lengths(batch.attention_mask)
            plan = PackPlan.build(lengths, batch.input_ids.shape[1], cap)
            if not plan.saves(batch.input_ids.numel()):
                plan = None  # rows of nearly equal length: the padded forward, as cheap
        if plan is None:
            hidden = self._hidden(model, batch)
            ids, topk_ids = batch.input_ids.to(dev), batch.topk_ids
        else:
            ids = plan.pack(batch.input_ids)
            hidden = self._hidden(model, batch, (ids, plan.position_ids, None), plan)
            ids = ids.to(dev)
            kept = None if kept is None else plan.pack(kept, -1)
            topk_ids = None if batch.topk_ids is None else plan.pack(batch.topk_ids, -1)
        topk_ids = topk_ids.to(dev) if topk else None
        with self._autocast():  # the LM head as in the model's own forward
            out = head_scores(
                hidden,
                model.get_output_embeddings(),
                ids,
                self.temperature,
                kept,
                topk_ids,
                self.logprob_chunk_tokens,
            )
        return tuple(out) if plan is None else tuple(plan.unpack_scored(t) for t in out)

    def _autocast(self):
        """bf16 autocast of the forward with ``dtype="bfloat16"``, else nothing."""
        if self.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _hidden(self, model, batch: TrainBatch, inputs=None, plan=None) -> torch.Tensor:
        """The decoder's last hidden states ``[rows, S, H]`` of ``model`` on the given (packed
        or padded) inputs of ``batch`` (the LM head is applied in chunks by ``head_scores``):
        R3 replay, the route audit (the routes packed like the tokens), bf16 autocast. Packed
        rows attend within each sample: short rows through the block-diagonal mask, long ones
        segment by segment (``packing.segment_attention``), or with a flash kernel varlen from
        the restarting position ids (its own packed-sequence path). ``inputs``: ``(input_ids,
        position_ids, attention_mask)`` of the packed rows; default the batch's padded ones."""
        if inputs is None:
            inputs = (batch.input_ids, batch.position_ids, batch.attention_mask)
        input_ids, position_ids, attention_mask = inputs
        routes, recorded = batch.routed_experts, None
        if plan is not None and routes is not None:
            k = routes.shape[-1]
            routes = plan.pack(routes, torch.arange(k, dtype=routes.dtype))
        if self.r3:
            check_routes(routes, input_ids)
        dev = self.device
        auditing = self.r3_audit and model is self.model and not self._audit_paused
        if auditing:
            recorded = batch.recorded_routes
            recorded = recorded if plan is None else plan.pack(recorded, False)
        audit = RouteAudit(model, routes, recorded) if auditing else contextlib.nullcontext()
        extra, attend = {}, contextlib.nullcontext()
        impl = str(getattr(model.config, "_attn_implementation", "sdpa"))
        if plan is None or impl.startswith("flash"):
            pass  # padded; or packed rows the flash kernel takes varlen from the position ids
        elif impl == "sdpa" and input_ids.shape[1] < packing.SEGMENT_MIN_ROW:
            attention_mask = plan.attention_mask()  # short rows: one masked call
        else:
            extra, attend = {"sat_spans": plan.spans}, packing.use_segment_attention(model)
        with (
            maybe_replay(model, None if routes is None else routes.to(dev), self.r3),
            audit,
            self._autocast(),
            attend,
        ):
            out = model.get_decoder()(
                input_ids=input_ids.to(dev),
                attention_mask=None if attention_mask is None else attention_mask.to(dev),
                position_ids=position_ids.to(dev),
                use_cache=False,
                **extra,
            )
        if isinstance(audit, RouteAudit):
            self._audit[0] += audit.rows
            self._audit[1] += audit.mismatched
        return out.last_hidden_state

    # --- the backend's part of the training step (sat_cli.trainers.step) ---------------------
    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def _extra_inputs(self, mb: TrainBatch) -> dict:
        """Inputs only some algorithms read (``registry.LossSpec.needs``): the samples' weight
        versions and the version this trainer holds (A-3PO), per-response squared norms of
        ``grad sum_t log pi`` (VCPO's optimal baseline)."""
        out: dict = {}
        if "versions" in self.needs:
            v = mb.token_versions if mb.token_versions is not None else mb.versions
            out["versions"], out["current_version"] = v.to(self.device), self.step_count
        if "seq_score_sqnorm" in self.needs and self.loss.vcpo_opob:
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
            logp, _ = self._model_forward(self.model, row)
            grads = torch.autograd.grad(logp[m].sum(), params, allow_unused=True)
            out[b] = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
        return out

    # --- weights and checkpoints ---------------------------------------------------------------
    def publish_weights(self, dir: str | os.PathLike, version: int) -> Path:
        """Write the current weights as an HF checkpoint ``dir/v{version}`` (atomically); return it.
        With LoRA: the adapter alone (``weightsync.adapters``), or with
        ``trainer.lora.sync=merged`` the merged full weights (``lora_io.publish_merged``)."""
        path = Path(dir) / f"v{int(version)}"
        if self.lora is not None and self.lora["sync"] == "merged":
            return lora_io.publish_merged(self.model, self.tokenizer, path)
        if self.lora is not None:
            return lora_io.publish(self.model, self.lora, path, version)
        return save_hf(self.model, self.tokenizer, path)

    def capture_weights(self, version: int) -> int:
        """Hold the current weights as ``version`` in the weight sender (distributed sync): the
        HF checkpoint names and tensors ``publish_weights`` would write, without the write."""
        from sat_cli.trainers.megatron.convert import unfuse_experts

        return self.weight_sender.capture(version, unfuse_experts(dict(self.model.state_dict())))

    def save(self, dir: str | os.PathLike) -> None:
        """``model/`` (HF) and the optimizer; with LoRA ``adapter/`` (the adapter alone, as a
        version is published) in place of ``model/``, and the adapter's tensor names in the
        optimizer's order (``lora_params``)."""
        with staged_dir(Path(dir)) as tmp:
            meta: dict = {"step_count": self.step_count}
            if self.lora is not None:
                lora_io.publish(self.model, self.lora, tmp / "adapter", self.step_count)
                meta["lora_params"] = lora_io.param_names(self.model)
            else:
                save_hf(self.model, self.tokenizer, tmp / "model")
            tensors, param_groups = optimizer_tensors(self.opt)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            meta["param_groups"] = param_groups
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))

    def load(self, dir: str | os.PathLike) -> None:
        d = Path(dir)
        meta = json.loads((d / "trainer_state.json").read_text())
        tensors = load_file(str(d / "optimizer.safetensors"))
        if self.lora is not None:
            lora_io.load(self.model, d / "adapter", int(meta["step_count"]))
        else:
            loaded = load_model(d / "model", "float32", self.device)
            self.model.load_state_dict(loaded.state_dict())
            del loaded
        load_optimizer_tensors(self.opt, tensors, meta["param_groups"])
        self.step_count = int(meta["step_count"])

    def close(self) -> None:
        self.ref_model = None
        if self.weight_sender is not None:
            self.weight_sender.close()
