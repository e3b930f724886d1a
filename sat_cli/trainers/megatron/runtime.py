"""Process setup and forward helpers shared by the megatron worker and the in-process tests.

- ``init_distributed``: ``torch.distributed`` (gloo on CPU, NCCL on GPU) plus megatron's
  ``parallel_state.initialize_model_parallel`` and, without CUDA, the CPU shims. Under
  ``torchrun`` it reads the usual environment (``env://``); in a plain process (tests) it uses a
  ``FileStore`` at a given path with world size 1.
- ``token_logprobs``: per-token log-probs of ``input_ids[:, 1:]`` under a megatron ``GPTModel``
  with logits divided by the sampling temperature (the ``labels=`` cross-entropy path of
  ``GPTModel.forward`` cannot take a temperature, so logits are taken and the log-softmax is
  computed here, in fp32); under tensor parallelism from each rank's vocabulary shard, the
  softmax's sums taken across the ranks (``vocab_parallel_logprobs``).
- ``set_replay_routes`` / ``clear_replay``: R3 through megatron-core's ``RouterReplay``. Routes
  arrive batch-major ``[B, S, L, K]`` (HF / SGLang order); megatron flattens tokens
  sequence-major, so layer ``l`` gets ``routes[:, :, l].transpose(0, 1).reshape(S*B, K)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sat_cli.models.r3 import R3Error as R3Error  # one class; importable from here too
from sat_cli.models.r3 import RouteAudit as HFRouteAudit
from sat_cli.trainers.logprobs import token_logprobs as logits_to_logprobs
from sat_cli.trainers.logprobs import upcast

from .cpu_shims import apply_cpu_shims


def init_distributed(
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    file_store: str | os.PathLike | None = None,
) -> None:
    """Initialise torch.distributed and megatron's parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    apply_cpu_shims()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if file_store is not None:
            store = dist.FileStore(str(Path(file_store)), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,  # experts are not split by tensor parallelism
            context_parallel_size=cp,
        )
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            # megatron's CUDA RNG tracker (dropout is 0 here, but layers fork the tracker)
            model_parallel_cuda_manual_seed(0)


def causal_mask(
    batch: int, seq: int, device, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool mask ``[B, 1, S, S]``, True = masked: future positions, and padding keys when
    ``key_valid [B, S]`` (1 on real tokens) is given, which matches HF's padding mask."""
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
    mask = mask.view(1, 1, seq, seq).expand(batch, 1, seq, seq)
    if key_valid is not None:
        mask = mask | ~key_valid.bool().to(device)[:, None, None, :]
    return mask


def forward_logits_shard(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This tensor-parallel rank's logits ``[B, S, V / tp]``: its slice of the vocabulary (the
    model is built with ``parallel_output=True``; the whole vocabulary at tp = 1).

    ``attention_mask [B, S]`` (1 = real token) masks padding keys, as HF does; with right
    padding it changes only the (unscored) padding positions, since causal attention never lets
    a real token see a later pad. Every query keeps at least one key (position 0 is real).
    """
    b, s = input_ids.shape
    return model(input_ids, position_ids, causal_mask(b, s, input_ids.device, attention_mask))


def forward_logits(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S, V]`` on every rank (the shards gathered): for checks
    against HF. Training never forms them (:func:`token_logprobs`)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    shard = forward_logits_shard(model, input_ids, position_ids, attention_mask)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return shard
    return gather_from_tensor_model_parallel_region(shard)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, both ``[B, S]`` aligned like ``TrainBatch.rollout_logp``.

    ``logp[b, s] = log_softmax(logits[b, s-1] / T)[input_ids[b, s]]``; ``entropy`` is the
    (detached) entropy of that distribution; column 0 is 0 in both: the local trainer's
    definition, ``sat_cli.trainers.step.token_logprobs``, applied to megatron's logits. Under
    tensor parallelism each rank holds only its vocabulary shard and the softmax is taken across
    the shards (:func:`vocab_parallel_logprobs`); no rank forms ``[B, S, V]``.
    """
    from megatron.core import parallel_state

    logits = forward_logits_shard(model, input_ids, position_ids, attention_mask)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits_to_logprobs(logits, input_ids, temperature)
    return vocab_parallel_logprobs(logits, input_ids, temperature)


def vocab_parallel_logprobs(
    shard: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` from this rank's vocabulary shard ``[B, S, V / tp]`` (ids
    ``[rank * V / tp, (rank + 1) * V / tp)``), the softmax taken across the tensor-parallel group:
    ``lse = m + log sum_ranks sum_v exp(z - m)`` with ``m`` the global maximum, and the target's
    ``z`` from the rank that holds it. The sums cross ranks through megatron's
    ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), so
    every rank's loss is the same and each rank's gradient reaches its own shard only, as in
    megatron's ``vocab_parallel_cross_entropy``; the entropy is detached."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    part = shard.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    z = upcast(shard[:, :-1]) / temperature  # [B, S-1, V/tp]
    with torch.no_grad():
        m = z.max(dim=-1).values  # [B, S-1]
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    total = reduce_from_tensor_model_parallel_region(torch.exp(z - m[..., None]).sum(-1))
    lse = m + torch.log(total)  # [B, S-1]
    local = input_ids[:, 1:] - start
    mine = (local >= 0) & (local < part)
    zy = z.gather(-1, local.clamp(0, part - 1)[..., None]).squeeze(-1)
    zy = reduce_from_tensor_model_parallel_region(torch.where(mine, zy, torch.zeros_like(zy)))
    lp = zy - lse
    with torch.no_grad():
        pz = (torch.exp(z - lse[..., None]) * z).sum(-1)
        dist.all_reduce(pz, group=group)
        ent = lse - pz
    zero = lp.new_zeros((lp.shape[0], 1))
    return torch.cat([zero, lp], dim=1), torch.cat([zero, ent.detach()], dim=1)


# ----------------------------------------------------------------------------- R3
def replay_tensors(routes: torch.Tensor, num_layers: int, top_k: int, num_experts: int):
    """Per-layer ``[S*B, K]`` int64 tensors in megatron token order from ``[B, S, L, K]``."""
    if routes is None:
        raise R3Error("R3 is on but the batch carries no routed experts")
    if routes.dim() != 4 or routes.shape[2] != num_layers or routes.shape[3] != top_k:
        raise R3Error(
            f"routed experts have shape {tuple(routes.shape)}; expected [B, S, {num_layers}, {top_k}]"
        )
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise R3Error(f"routed expert ids out of range [0, {num_experts})")
    b, s = routes.shape[:2]
    routes = routes.long()
    # Megatron's hidden states are [S, B, H]; the router flattens them to [S*B, E].
    return [
        routes[:, :, layer].transpose(0, 1).reshape(s * b, top_k) for layer in range(num_layers)
    ]


def set_replay_routes(
    routes: torch.Tensor,
    config,
    device=None,
    seq_shard: tuple[int, int] = (0, 1),
    layers: slice = slice(None),
) -> None:
    """Force every MoE router of the (single, replay-enabled) model to ``routes [B, S, L, K]``.

    ``seq_shard = (rank, size)``: under sequence parallelism a tensor-parallel rank's routers
    see only its contiguous ``S / size`` positions (tokens ``[s, b]``, so a contiguous block of
    rows): they get that block of each layer's routes. ``layers``: the decoder layers this
    (pipeline stage's) model holds; ``config.num_layers`` counts all of them.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    per_layer = replay_tensors(
        routes, config.num_layers, config.moe_router_topk, config.num_moe_experts
    )[layers]
    rank, size = seq_shard
    if size > 1:
        per = per_layer[0].shape[0] // size
        per_layer = [t[rank * per : (rank + 1) * per] for t in per_layer]
    if device is not None:
        per_layer = [t.to(device) for t in per_layer]
    n_inst = len(RouterReplay.global_router_replay_instances)
    if n_inst == 0 or n_inst % len(per_layer):
        raise R3Error(
            f"{n_inst} RouterReplay instances for {len(per_layer)} layers: build the actor "
            "(and at most the KL reference after it) with routing_replay=True"
        )
    RouterReplay.clear_global_indices()
    # one copy per replay-enabled model (actor, then the KL reference), in registration order
    RouterReplay.set_replay_data(per_layer * (n_inst // len(per_layer)))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


class RouteAudit(HFRouteAudit):
    """:class:`sat_cli.models.r3.RouteAudit` for megatron-core: a forward hook on every
    ``TopKRouter`` reads its ``routing_map [S*B, E]`` (megatron's sequence-major order)."""

    def _attach(self, on_layer) -> list:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        return [
            r.register_forward_hook(lambda m, a, o, i=i: on_layer(i, a, o))
            for i, r in enumerate(routers)
        ]

    def _used(self, args, output) -> torch.Tensor:
        b, s = self.valid.shape
        return output[1].detach().cpu().view(s, b, -1).transpose(0, 1)  # [B, S, E]


def clear_replay() -> None:
    """Drop recorded/target routes and the replay action (call after every step)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()


# ----------------------------------------------------------------------------- data parallel
def shard_rows(n: int, world: int, rank: int) -> tuple[list[int], int]:
    """Rows ``0..n-1`` split into ``world`` equal contiguous shards; returns this rank's rows.

    Shards are padded with row 0 to a common size ``ceil(n / world)`` (every rank must run the
    forward: the MoE dispatcher is collective); the padding rows are dropped after the gather.
    """
    per = -(-n // world)
    padded = list(range(n)) + [0] * (per * world - n)
    return padded[rank * per : (rank + 1) * per], per


class _GatherRows(torch.autograd.Function):
    """All-gather of row shards ``[per, ...]`` to ``[world * per, ...]`` over ``group``.

    Every rank then computes the *same* loss from the gathered tensor, so the gradient with
    respect to the gathered tensor is identical on all ranks and the backward only takes this
    rank's slice (no communication, no scaling).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, world: int):
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.per = rank, local.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.per
        return grad[start : start + ctx.per], None, None, None


def gather_rows(local: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
    if world == 1:
        return local
    return _GatherRows.apply(local, group, rank, world)


# ----------------------------------------------------------------------------- tensor parallel
def pad_columns(batch, multiple: int):
    """``batch`` with its sequence right-padded to a multiple of ``multiple`` (sequence
    parallelism splits the sequence into equal blocks). Padding columns are masked tokens
    (id 0, attention mask 0, no loss) and, with routes, route to experts ``0..K-1``; causal
    attention with masked keys keeps them out of every real token's forward."""
    import dataclasses

    s = batch.input_ids.shape[1]
    extra = -s % multiple
    if extra == 0:
        return batch
    out = {}
    for f in dataclasses.fields(batch):
        t = getattr(batch, f.name)
        if t is None or t.dim() < 2:
            out[f.name] = t
        elif f.name == "routed_experts":
            b, _, layers, k = t.shape
            fill = torch.arange(k, dtype=t.dtype).expand(b, extra, layers, k)
            out[f.name] = torch.cat([t, fill], dim=1)
        else:
            out[f.name] = torch.cat([t, t.new_zeros((t.shape[0], extra, *t.shape[2:]))], dim=1)
    return type(batch)(**out)


def seq_block(seq: int, rank: int, size: int) -> slice:
    """The positions a tensor-parallel rank holds under sequence parallelism."""
    per = seq // size
    return slice(rank * per, (rank + 1) * per)


def saved_for_backward(fn):
    """``(fn(), bytes)``: the bytes of the tensors autograd saves for the backward while ``fn``
    runs (``saved_tensors_hooks``), the activation memory a training forward keeps; what
    ``trainer.recompute`` cuts (tests/test_megatron_recompute.py, bench/megatron_recompute.py)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total
