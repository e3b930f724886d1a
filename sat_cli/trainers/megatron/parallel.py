"""The distributed part of ``MegatronActor``: process groups, gradient sums, the clip norm, and
the full (HF-convertible) state gathered from the data-, tensor-, expert- and pipeline-parallel
shards.

Layout: ``world = dp x tp x pp`` (megatron-core's ``tp-cp-ep-dp-pp`` order), experts split over
``ep`` inside and whole on every tensor-parallel rank (``expert_tensor_parallel_size = 1``).

Gradient sums (``_reduce_and_clip``), as megatron-core's ``finalize_model_grads`` does them:

- dense parameters over the data-parallel group;
- dense parameters every TP rank holds whole (norms, q/k norms, router) also over the TP group:
  under sequence parallelism each TP rank saw only its block of positions (q/k norms: its
  heads), so each has a partial gradient;
- experts over the expert-data-parallel group (which includes the TP ranks, since experts are
  not TP-split, and the EP-group tokens the all-gather dispatcher brought to them).

The clip norm counts every parameter once: squares of TP-sharded parameters are summed over the
TP group, experts over the EP group, and each pipeline stage's total over the PP group;
replicated parameters (identical after the sums) are counted on each rank once.
"""

from __future__ import annotations

import torch

from . import convert, pipeline


class ParallelMixin:
    """Process groups and the collective parts of the actor (``self.model``, ``self.hf_config``
    and ``self._audit`` come from ``MegatronActor``)."""

    def _init_parallel(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        multi = self.world > 1
        self.ep = ps.get_expert_model_parallel_world_size() if multi else 1
        self.ep_rank = ps.get_expert_model_parallel_rank() if multi else 0
        self.tp = ps.get_tensor_model_parallel_world_size() if multi else 1
        self.tp_rank = ps.get_tensor_model_parallel_rank() if multi else 0
        self.pp = ps.get_pipeline_model_parallel_world_size() if multi else 1
        self.pp_rank = ps.get_pipeline_model_parallel_rank() if multi else 0
        self.dp_group = self.edp_group = self.ep_group = self.tp_group = self.pp_group = None
        self.dp_rank, self.dp = 0, 1
        self.stage: pipeline.Stage | None = None
        if not multi:
            return
        if ps.get_context_parallel_world_size() != 1:
            raise NotImplementedError("megatron trainer: CP must be 1")
        if ps.get_expert_tensor_parallel_world_size() != 1:
            raise NotImplementedError("megatron trainer: experts are not tensor-parallel")
        if self.pp > 1 and self.hf_config.get("tie_word_embeddings", False):
            raise NotImplementedError("megatron trainer: pp > 1 with tied embeddings")
        self.dp_group = ps.get_data_parallel_group()
        self.edp_group = ps.get_expert_data_parallel_group()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_rank = dist.get_rank(self.dp_group)
        self.dp = dist.get_world_size(self.dp_group)
        self.stage = pipeline.Stage.current() if self.pp > 1 else None

    # --- the backend's part of the training step (sat_cli.trainers.step) ---------------------
    def _trained(self):
        """``(name, tensor)`` of what the optimizer updates: the model's parameters, or with
        bf16 on CPU their fp32 main copies (``precision.MainWeights``), whose fp32 gradients
        are the ones reduced and clipped."""
        main = getattr(self, "main", None)
        return main.named() if main is not None else self.model.named_parameters()

    def _audit_totals(self) -> list[float]:
        audit = torch.tensor(self._audit, dtype=torch.float64)
        if self.world > 1:  # each rank checked its rows (DP), positions (TP) and layers (PP)
            import torch.distributed as dist

            dist.all_reduce(audit)
        return audit.tolist()

    def _grouped_params(self):
        """``(sharded, replicated, expert)``: dense parameters split over the TP ranks, dense
        parameters every TP rank holds whole (norms, router), expert parameters."""
        sharded, replicated, expert = [], [], []
        for name, p in self._trained():
            if ".mlp.experts." in name:
                expert.append(p)
            elif convert.tp_split_dim(name) is not None:
                sharded.append(p)
            else:
                replicated.append(p)
        return sharded, replicated, expert

    @staticmethod
    def _sum_grads(params, group) -> None:
        """All-reduce (sum) the gradients of ``params`` over ``group`` (one flat buffer)."""
        import torch.distributed as dist

        if not params or dist.get_world_size(group) == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def _reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """Sum gradients over the ranks and clip by the global norm (module doc)."""
        import torch.distributed as dist

        sharded, replicated, expert = self._grouped_params()
        for p in sharded + replicated + expert:
            if p.grad is None:  # as after a reduction: every rank steps every parameter
                p.grad = torch.zeros_like(p)
        self._sum_grads(sharded + replicated, self.dp_group)
        self._sum_grads(replicated, self.tp_group)
        self._sum_grads(expert, self.edp_group)

        def sq(params):
            zero = torch.zeros(1, dtype=torch.float64)
            return sum(p.grad.double().pow(2).sum() for p in params) + zero

        sharded_sq, expert_sq = sq(sharded), sq(expert)
        if self.tp > 1:
            dist.all_reduce(sharded_sq, group=self.tp_group)
        if self.ep > 1:
            dist.all_reduce(expert_sq, group=self.ep_group)  # experts differ across EP ranks
        total_sq = sharded_sq + sq(replicated) + expert_sq
        if self.pp > 1:
            dist.all_reduce(total_sq, group=self.pp_group)  # each stage has its own layers
        total = torch.sqrt(total_sq)[0].float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in sharded + replicated + expert:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total

    # --- the full state ------------------------------------------------------------------------
    def _full_megatron_state(self, params: dict | None = None) -> dict[str, torch.Tensor]:
        """The whole model's state (every TP shard, expert and pipeline stage gathered; global
        layer and expert indices), on every rank: a collective over all of them; ``params``
        replaces the model's parameters by name (the fp32 main weights)."""
        state = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        state.update(params or {})
        if self.tp > 1:
            state = self._gather_tp(state)
        if self.ep > 1:
            state = self._gather_ep(state)
        if self.pp > 1:
            state = self.stage.gather(state, self.hf_config["num_hidden_layers"])
        return state

    def _gather_tp(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensor-parallel shards of ``state`` gathered over the TP group."""
        import torch.distributed as dist

        out = {}
        for key in sorted(state):
            dim = convert.tp_split_dim(key)
            if dim is None:
                out[key] = state[key]
                continue
            parts = [torch.empty_like(state[key]) for _ in range(self.tp)]
            dist.all_gather(parts, state[key].contiguous(), group=self.tp_group)
            out[key] = convert.tp_merge(key, parts)
        return out

    def _gather_ep(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every expert (gathered over the EP group), with global expert indices."""
        import torch.distributed as dist

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
