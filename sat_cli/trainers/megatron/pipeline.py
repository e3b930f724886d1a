"""Pipeline parallelism for the shared training step: a stage-by-stage forward with gloo/NCCL
point-to-point sends, and a backward that runs inside the ordinary ``loss.backward()``.

The shared step (``sat_cli.trainers.step``) computes one loss from the gathered per-token
log-probs of the whole minibatch on every rank, so instead of megatron-core's microbatch
schedules (whose loss function runs on the last stage only) the pipeline here is one
microbatch deep:

- forward: the first stage embeds and runs its layers; each stage sends its hidden states
  ``[S/tp, B, H]`` to the next (``dist.send``), which sets them as the GPTModel's input
  tensor (``set_input_tensor``); the last stage computes the log-probs and entropies and
  broadcasts them over the pipeline group, so every stage returns the same ``(logp, entropy)``;
- backward: on a non-last stage the broadcast log-probs come out of ``_SendHidden``, whose
  backward receives the gradient of the hidden states from the next stage; on a non-first
  stage the received input is a leaf with a gradient hook that sends its gradient to the
  previous stage. Every rank calls ``loss.backward()`` on the same loss, so the sends and
  receives pair up, last stage first.

The stages are megatron-core's: ``num_layers / pp`` consecutive layers each (``pp`` must divide
the number of layers), embedding on the first, final norm and output layer on the last (tied
embeddings are refused with pp > 1). Weights: ``select`` takes a stage's layers of a full
megatron state and renumbers them from 0; ``gather`` puts the stages together again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .runtime import token_logprobs as _token_logprobs

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Stage:
    rank: int
    size: int
    prev: int  # global rank of the previous stage (or -1)
    next: int  # global rank of the next stage (or -1)
    last: int  # global rank of the last stage
    group: object

    @classmethod
    def current(cls) -> Stage:
        from megatron.core import parallel_state as ps

        rank, size = (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        return cls(
            rank=rank,
            size=size,
            prev=ps.get_pipeline_model_parallel_prev_rank() if rank > 0 else -1,
            next=ps.get_pipeline_model_parallel_next_rank() if rank < size - 1 else -1,
            last=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, n_layers: int) -> range:
        if n_layers % self.size:
            raise ValueError(f"pp={self.size} does not divide the {n_layers} layers")
        per = n_layers // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    # --- weights -------------------------------------------------------------------------------
    def select(self, mg_state: dict[str, torch.Tensor], n_layers: int) -> dict:
        """This stage's part of a full megatron state, layers renumbered from 0."""
        return select_stage(mg_state, self.layers(n_layers), self.is_first, self.is_last)

    def gather(self, state: dict[str, torch.Tensor], n_layers: int) -> dict:
        """The full state from every stage's ``state`` (a collective over the stage group)."""
        import torch.distributed as dist

        offset = self.layers(n_layers).start
        named = {_renumber(k, offset): v.detach().cpu() for k, v in state.items()}
        parts: list = [None] * self.size
        dist.all_gather_object(parts, named, group=self.group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    # --- forward -------------------------------------------------------------------------------
    def token_logprobs(self, model, input_ids, position_ids, attention_mask, temperature):
        """``(logp, entropy)`` ``[B, S]`` of the whole pipeline, on every stage (module doc)."""
        import torch.distributed as dist

        b, s = input_ids.shape
        cfg = model.config
        seq = s // cfg.tensor_model_parallel_size if cfg.sequence_parallel else s
        hidden_shape = (seq, b, cfg.hidden_size)
        if not self.is_first:
            hidden = torch.empty(hidden_shape, dtype=cfg.params_dtype, device=input_ids.device)
            dist.recv(hidden, src=self.prev)
            if torch.is_grad_enabled():
                hidden.requires_grad_(True)
                prev = self.prev
                hidden.register_hook(lambda g: dist.send(g.contiguous(), dst=prev))
            model.set_input_tensor(hidden)
        if self.is_last:
            logp, entropy = _token_logprobs(
                model, input_ids, position_ids, attention_mask, temperature
            )
            both = torch.stack([logp.detach().float(), entropy.detach().float()])
            dist.broadcast(both, src=self.last, group=self.group)
            return logp, entropy
        from .runtime import causal_mask

        out = model(input_ids, position_ids, causal_mask(b, s, input_ids.device, attention_mask))
        return _SendHidden.apply(out, (b, s), self.next, self.last, self.group)


class _SendHidden(torch.autograd.Function):
    """A non-last stage: send ``hidden`` on, receive the last stage's ``(logp, entropy)``;
    backward: receive the gradient of ``hidden`` from the next stage."""

    @staticmethod
    def forward(ctx, hidden, shape, next_rank, last_rank, group):
        import torch.distributed as dist

        dist.send(hidden.detach().contiguous(), dst=next_rank)
        both = torch.empty((2, *shape), dtype=torch.float32, device=hidden.device)
        dist.broadcast(both, src=last_rank, group=group)
        ctx.next_rank, ctx.hidden_shape, ctx.hidden_dtype = next_rank, hidden.shape, hidden.dtype
        entropy = both[1].clone()
        ctx.mark_non_differentiable(entropy)
        return both[0].clone(), entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        import torch.distributed as dist

        grad = torch.empty(ctx.hidden_shape, dtype=ctx.hidden_dtype, device=grad_logp.device)
        dist.recv(grad, src=ctx.next_rank)
        return grad, None, None, None, None


def _renumber(key: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", key, count=1)


def select_stage(
    mg_state: dict[str, torch.Tensor], layers: range, first: bool, last: bool
) -> dict[str, torch.Tensor]:
    """The tensors of a stage holding ``layers`` (renumbered from 0), the embedding if
    ``first``, the final norm and output layer if ``last``."""
    out = {}
    for key, t in mg_state.items():
        m = _LAYER.match(key)
        if m is not None:
            if int(m.group(1)) in layers:
                out[_renumber(key, -layers.start)] = t
        elif key.startswith("embedding."):
            if first:
                out[key] = t
        elif last:  # decoder.final_layernorm, output_layer
            out[key] = t
    return out
