"""bf16 mixed precision for ``MegatronActor`` (``dtype="bfloat16"``), as the paper trains.

The model's parameters are bf16 (forward and backward run in bf16); an fp32 *main* copy of every
parameter is what the optimizer updates, with fp32 optimizer states; gradients are cast to fp32
before they are reduced over the ranks and clipped; after the step the main weights are copied
(rounded to nearest) back into the bf16 parameters. Two implementations:

- ``MainWeights`` (CPU, and the tested equivalent): an fp32 ``torch.nn.Parameter`` per model
  parameter, updated by the shared step's ``torch.optim.AdamW``; the actor's gradient sums
  (``parallel.ParallelMixin``) and clip run on the fp32 gradients of these copies.
- ``CoreOptimizer`` (selected when CUDA is available): megatron-core's own
  ``DistributedDataParallel`` (fp32 gradient buffers, ``grad_reduce_in_fp32``) and
  ``get_megatron_optimizer`` with ``OptimizerConfig(bf16=True, use_distributed_optimizer=True)``
  (fp32 main weights and Adam states sharded over the data-parallel ranks). Gradients are summed
  (``calculate_per_token_loss``: no 1/dp scaling, since every rank computes the full-minibatch
  loss, as in ``parallel.py``); ``finalize_model_grads`` adds the sequence-parallel norm/router
  gradient sums over the TP group. The shared step's clip and non-finite skip stay ours:
  ``clip`` copies the gradients to the main gradients and computes megatron's global norm,
  and only a finite norm leads to ``step`` (``step_with_ready_grads``: Adam, then main -> model
  weights); a skipped step zeroes the gradient buffers. Megatron's default parameter groups do
  not decay 1-D parameters (norms); with ``weight_decay=0`` (the default) that is moot.
  ``SAT_MEGATRON_CORE_OPTIMIZER=0`` selects ``MainWeights`` on a GPU as well (the GPU check
  compares the two). Not run on a GPU in the session that wrote it
  (scripts/gpu_check_megatron.py checks it).

**Optimizer offload** (``trainer.optimizer_offload``, ``offload=True``): the fp32 main weights
and Adam states live in host memory and the Adam step runs on the CPU. On a GPU this is
megatron-core's own recipe (``optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
use_precision_aware_optimizer=True``: its ``HybridDeviceOptimizer``, which copies the fp32
gradient shards to the host, steps there and copies the parameters back); the gradients then
sit in ``decoupled_grad``, which ``clip`` passes on to megatron's clip. ``MainWeights`` on a GPU
cannot offload (its gradient sums run on the main copies, which NCCL needs on the GPU), so
``SAT_MEGATRON_CORE_OPTIMIZER=0`` with offload is refused. On CPU every tensor already is in
host memory: the flag changes nothing there, which tests/test_megatron_recompute.py checks
(bit-identical steps with and without it).
"""

from __future__ import annotations

import os

import torch

CORE_ENV = "SAT_MEGATRON_CORE_OPTIMIZER"  # "0": the MainWeights path on a GPU too


def use_core_optimizer(device: torch.device, offload: bool = False) -> bool:
    """megatron-core's optimizer on CUDA (it allocates there), unless ``CORE_ENV=0``."""
    core = device.type == "cuda" and os.environ.get(CORE_ENV, "1") != "0"
    if offload and device.type == "cuda" and not core:
        raise ValueError(
            f"trainer.optimizer_offload=true on a GPU needs megatron-core's optimizer; unset "
            f"{CORE_ENV}=0"
        )
    return core


class MainWeights:
    """fp32 main copies of a bf16 model's parameters (the CPU path; module doc)."""

    def __init__(self, model: torch.nn.Module, initial: dict[str, torch.Tensor] | None = None):
        """``initial``: fp32 values by parameter name (default: the bf16 parameters, widened)."""
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        self.params = [
            torch.nn.Parameter(
                (p.detach() if initial is None else initial[n]).to(p.device, torch.float32).clone()
            )
            for n, p in named
        ]

    def named(self):
        return zip(self.names, self.params, strict=True)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in self.named()}

    def take_grads(self) -> None:
        """Move the bf16 gradients of the model to the main copies, as fp32."""
        for p, m in zip(self.model_params, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in zip(self.model_params, self.params, strict=True):
            p.copy_(m)

    @torch.no_grad()
    def load(self, values: dict[str, torch.Tensor]) -> None:
        for n, m in self.named():
            m.copy_(values[n])
        self.copy_to_model()


class CoreOptimizer:
    """megatron-core's DDP + distributed optimizer behind the interface the shared step uses
    (``zero_grad``, ``param_groups``, ``step``); ``clip`` is the actor's ``_clip_gradients``."""

    def __init__(self, model, settings, grad_clip: float, offload: bool = False):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        model.config.calculate_per_token_loss = True  # sum gradients over DP, no 1/dp
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=True,
            check_for_nan_in_grad=False,  # the shared step skips a non-finite update itself
            average_in_collective=False,
        )
        self.ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        config = OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.betas[0],
            adam_beta2=settings.betas[1],
            adam_eps=1e-8,  # torch AdamW's
            clip_grad=grad_clip if grad_clip > 0 else 0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            # offload: fp32 main weights and Adam states on the host, the step on the CPU
            optimizer_cpu_offload=offload,
            optimizer_offload_fraction=1.0 if offload else 0.0,
            use_precision_aware_optimizer=offload,
            overlap_cpu_optimizer_d2h_h2d=False,
        )
        self.decoupled = bool(config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.opt = get_megatron_optimizer(config, [self.ddp])
        self.subs = list(getattr(self.opt, "chained_optimizers", [self.opt]))

    @property
    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """Reduce (fp32), copy to the main gradients, global norm; clip if finite."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        finalize_model_grads([self.ddp])
        self.opt.prepare_grads()  # model grads -> main grads (no loss scaler with bf16)
        norm = float(self.opt.get_grad_norm())
        if torch.isfinite(torch.tensor(norm)) and max_norm != float("inf"):
            for sub in self.subs:
                params = sub.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm, norm, self.decoupled)
        return torch.tensor(norm)

    def step(self) -> None:
        self.opt.step_with_ready_grads()  # Adam on the fp32 shards, then main -> bf16 weights

    # --- checkpoints: this rank's shards of main weights and Adam states ---------------------
    def _owner(self, param):
        for sub in self.subs:
            if param in getattr(sub, "model_param_group_index_map", {}):
                return sub
        return None

    def state_tensors(self, named_params) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in named_params:
            sub = self._owner(p)
            if sub is None:  # not in this rank's shard
                continue
            for key, value in sub._get_main_param_and_optimizer_states(p).items():
                t = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"main/{name}/{key}"] = t.detach().cpu().contiguous()
        return out

    @torch.no_grad()
    def load_state_tensors(self, named_params, tensors: dict[str, torch.Tensor]) -> None:
        for sub in self.subs:
            sub._init_optimizer_states_with_dummy_values()  # states exist before the copy
        for name, p in named_params:
            sub = self._owner(p)
            if sub is None:
                continue
            prefix = f"main/{name}/"
            values = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            dev = {k: v.to(p.device) for k, v in values.items()}
            sub._set_main_param_and_optimizer_states(p, dev)
        for sub in self.subs:
            inner = getattr(sub, "optimizer", None)
            if hasattr(inner, "_sync_hdo_state_to_sub_optimizers"):
                # offload: the states were set on the HybridDeviceOptimizer; hand them to its CPU
                # Adam (moved to the host) and refresh its fp32 copies from ``master_param``
                inner._sync_hdo_state_to_sub_optimizers()
            sub._copy_main_params_to_model_params()
