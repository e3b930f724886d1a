"""CPU shims that let megatron-core 0.16.1 run forward and backward without CUDA.

megatron-core assumes a GPU in a few places that the CPU path (gloo, world size 1, the local
layer spec) still reaches. ``apply_cpu_shims()`` patches exactly these, and only when CUDA is
absent (on a GPU machine it does nothing):

1. ``torch.cuda.current_device`` is called while building layers (``device=`` arguments); on CPU
   it returns the string ``"cpu"`` so those tensors land on the CPU.
2. ``fused_softmax.get_default_causal_mask`` builds its mask with ``device="cuda"``; replaced by
   the same upper-triangular bool mask on CPU. (The worker also passes an explicit causal mask,
   so this is only a safety net.)
3. ``moe_utils.te_general_gemm`` is referenced but not defined when Transformer Engine is absent
   (a 0.16.1 bug in the router GEMM); defined as ``None`` so the plain matmul path runs. This
   one is about Transformer Engine, not CUDA: ``apply_te_absent_fix()`` applies it alone, and
   ``apply_cpu_shims()`` calls it on every machine (it only fills a missing name).
4. The RNG tracker calls ``torch.cuda`` RNG functions; ``initialize_rng_tracker(
   inference_rng_tracker=True, force_reset=True)`` installs the inference tracker, whose
   ``fork()`` does not touch CUDA state (no dropout is used here: all dropouts are 0).
5. Activation recompute (``trainer.recompute``: ``tensor_parallel.checkpoint``) saves and
   restores the CPU *and* CUDA RNG states around each recomputed layer; on CPU the CUDA half
   (``random._get_cuda_rng_state`` / ``_set_cuda_rng_state``) becomes a no-op returning
   ``None``, the CPU state is still saved and restored by megatron's own code.

The shims are idempotent. ``apply_cpu_shims()`` must run before the model is built.

Tensor and pipeline parallelism need no further shim: torch 2.13's gloo backend has every
collective megatron-core's sequence-parallel layers, the all-gather dispatcher and the pipeline
use (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
``send``/``recv``). Sequence parallelism needs a norm that accepts it: ``model.RMSNorm``.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int, skv: int) -> torch.Tensor:
    # True = masked (future positions), as in megatron's get_default_causal_mask.
    return torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=1)


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _set_no_cuda_rng_state(new_state, *args, **kwargs) -> None:
    if new_state is not None:  # only ever None here: nothing on CPU saved a CUDA state
        raise RuntimeError("a CUDA RNG state on a machine without CUDA")


def apply_te_absent_fix() -> None:
    """Define ``moe_utils.te_general_gemm = None`` when Transformer Engine is not installed."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU execution if CUDA is absent. Returns True if patched.

    With CUDA present only the Transformer-Engine fix (3) is applied.
    """
    global _APPLIED
    apply_te_absent_fix()
    if cuda_available():
        return False
    if _APPLIED:
        return True

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    mp_random._get_cuda_rng_state = _no_cuda_rng_state
    mp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    _APPLIED = True
    return True
