"""Build a megatron-core ``GPTModel`` from a Hugging Face Qwen3-MoE, Qwen3 (dense) or Llama config.

Families (``FAMILIES``, by ``model_type``): ``qwen3_moe`` (every layer MoE, q/k RMSNorm),
``qwen3`` (dense SwiGLU MLP, q/k RMSNorm) and ``llama`` (dense SwiGLU MLP, no q/k norm); all
with grouped-query attention, RMSNorm, RoPE and no biases, tied embeddings where the config
ties them. The model uses megatron-core's local (non-Transformer-Engine) layer spec,
``get_gpt_layer_local_spec(num_experts=E or None, moe_grouped_gemm=False,
qk_layernorm=<family>, normalization="RMSNorm")``, so it runs on CPU (with ``cpu_shims``) and on
GPU alike. The ``TransformerConfig`` reproduces the HF models exactly (the dense families: the
same without the MoE part; the dense MLP is ``linear_fc1 = [gate; up]``, SiLU-gated, and
``linear_fc2 = down``, split over tensor-parallel ranks like attention):

- RMSNorm (eps = ``rms_norm_eps``), SwiGLU experts (``gated_linear_unit=True``, SiLU), no
  biases, per-head q/k RMSNorm, RoPE with ``rope_theta`` (no rope fusion);
- router: softmax score function applied *after* top-k (``moe_router_pre_softmax=False``),
  which equals HF's "softmax over all experts, take top-k, renormalise" when
  ``norm_topk_prob=True``; with ``norm_topk_prob=False`` the softmax is taken first
  (``moe_router_pre_softmax=True``) and not renormalised, as in HF;
- no auxiliary load-balancing loss in the training objective (``moe_router_load_balancing_type
  ="none"``, the RL setting), no token dropping, ``moe_token_dispatcher_type="allgather"``;
- dropouts 0, fp32 by default (``ModelSettings(dtype=torch.bfloat16)`` for GPU runs);
- every norm is ``RMSNorm`` below (``torch.nn.RMSNorm``'s computation; unlike the local spec's
  ``WrappedTorchNorm`` it accepts sequence parallelism, which megatron-core requires for MoE
  with tp > 1: ``sequence_parallel = tp > 1``); experts are not tensor-parallel
  (``expert_tensor_parallel_size = 1``); the output layer keeps each rank's vocabulary shard of
  the logits (``parallel_output=True``): no rank forms ``[tokens, vocab]`` under tensor
  parallelism.

Only Qwen3-MoE models whose every layer is an MoE layer are supported
(``decoder_sparse_step == 1`` and empty ``mlp_only_layers``); other configs (biases, sliding
windows, RoPE scaling, an activation other than SiLU) fail loudly.
``routing_replay=True`` (MoE only: a dense model has no routes to replay) enables megatron-core's ``RouterReplay`` (R3); build only the trained
actor with it, because RouterReplay registers every router instance in a global list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def hf_get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def rope_theta(hf_config: Any) -> float:
    """RoPE base: ``rope_parameters["rope_theta"]`` in transformers 5, ``rope_theta`` before."""
    params = hf_get(hf_config, "rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type not in (None, "default"):
            raise NotImplementedError(f"RoPE scaling {rope_type!r} is not supported")
        return float(params["rope_theta"])
    theta = hf_get(hf_config, "rope_theta")
    if theta is None:
        raise ValueError("HF config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


@dataclass(frozen=True)
class Family:
    """What a HF ``model_type`` builds: MoE layers (else a dense MLP), per-head q/k RMSNorm."""

    moe: bool
    qk_norm: bool


FAMILIES = {
    "qwen3_moe": Family(moe=True, qk_norm=True),
    "qwen3": Family(moe=False, qk_norm=True),
    "llama": Family(moe=False, qk_norm=False),
}


def family(hf_config: Any) -> Family:
    model_type = hf_get(hf_config, "model_type")
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"megatron trainer supports {', '.join(FAMILIES)} models, got {model_type!r}"
        )
    return FAMILIES[model_type]


def head_dim(hf_config: Any) -> int:
    """``head_dim``, or ``hidden_size / num_attention_heads`` where the config has none."""
    d = hf_get(hf_config, "head_dim")
    return (
        int(d)
        if d
        else hf_get(hf_config, "hidden_size") // hf_get(hf_config, "num_attention_heads")
    )


def check_supported(hf_config: Any) -> None:
    fam = family(hf_config)
    moe_dense = hf_get(hf_config, "decoder_sparse_step", 1) != 1 or hf_get(
        hf_config, "mlp_only_layers"
    )
    if fam.moe and moe_dense:
        raise NotImplementedError("dense (non-MoE) layers in a Qwen3-MoE model are not supported")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf_get(hf_config, key, False):
            raise NotImplementedError(f"{key}=true is not supported")
    act = hf_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported (SiLU only)")
    if hf_get(hf_config, "rope_scaling"):
        raise NotImplementedError("rope_scaling is not supported")


@dataclass(frozen=True)
class ModelSettings:
    """How a megatron model is built from its HF config: parameter ``dtype``, the parallel
    sizes (``tp``, ``pp``, ``ep``, ``cp``), R3 ``routing_replay`` and ``recompute`` (full
    activation recompute, one layer at a time: only each layer's input is kept)."""

    dtype: torch.dtype = torch.float32
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    routing_replay: bool = False
    recompute: bool = False


def transformer_config(hf_config: Any, settings: ModelSettings | None = None):
    """The ``TransformerConfig`` equivalent of a HF config built with ``settings``."""
    st = settings or ModelSettings()
    dtype, tp, pp, ep, cp = st.dtype, st.tp, st.pp, st.ep, st.cp
    routing_replay, recompute = st.routing_replay, st.recompute
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    moe = family(hf_config).moe
    if routing_replay and not moe:
        raise NotImplementedError(
            "R3 (routing replay) needs an MoE model: a dense one has no routes"
        )
    return TransformerConfig(
        num_layers=hf_get(hf_config, "num_hidden_layers"),
        hidden_size=hf_get(hf_config, "hidden_size"),
        num_attention_heads=hf_get(hf_config, "num_attention_heads"),
        num_query_groups=hf_get(hf_config, "num_key_value_heads"),
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_get(hf_config, "intermediate_size"),
        layernorm_epsilon=hf_get(hf_config, "rms_norm_eps"),
        normalization="RMSNorm",
        qk_layernorm=family(hf_config).qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **(_moe_fields(hf_config, routing_replay) if moe else {}),
        # parallelism
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # experts are whole on every tensor-parallel rank (split over ``ep`` only)
        expert_tensor_parallel_size=1,
        context_parallel_size=cp,
        sequence_parallel=tp > 1,
        # activation recompute (trainer.recompute): the backward reruns each layer's forward
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        # numerics / kernels: nothing fused, so the CPU path and the GPU path compute the same
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights always come from the HF checkpoint
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def _moe_fields(hf_config: Any, routing_replay: bool) -> dict:
    return dict(
        num_moe_experts=hf_get(hf_config, "num_experts"),
        moe_ffn_hidden_size=hf_get(hf_config, "moe_intermediate_size"),
        moe_router_topk=hf_get(hf_config, "num_experts_per_tok"),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not hf_get(hf_config, "norm_topk_prob", True),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=routing_replay,
    )


def build_gpt_model(
    hf_config: Any, settings: ModelSettings | None = None, *, clear_replay_registry: bool = True
):
    """A megatron-core ``GPTModel`` (uninitialised weights) shaped like the HF model.

    ``parallel_state.initialize_model_parallel`` must have been called with the same sizes, and
    on CPU ``cpu_shims.apply_cpu_shims()`` before this. With ``settings.routing_replay`` the global
    RouterReplay registry is emptied first unless ``clear_replay_registry=False`` (used for a
    second replay-enabled model, the KL reference, whose routers then follow the actor's).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    st = settings or ModelSettings()
    config = transformer_config(hf_config, st)
    if st.routing_replay and clear_replay_registry:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # RouterReplay keeps every router it ever saw in a class-level list; a model built
        # earlier in this process (a test, a rebuilt actor) would otherwise stay registered.
        RouterReplay.clear_global_router_replay_instances()
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    block = _with_rms_norm(spec, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=hf_get(hf_config, "vocab_size"),
        max_sequence_length=hf_get(hf_config, "max_position_embeddings"),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
        # each tensor-parallel rank keeps its vocabulary shard of the logits; the log-softmax
        # is taken across the shards (runtime.vocab_parallel_logprobs)
        parallel_output=True,
    )
    return model.to(st.dtype)


class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` (same ``F.rms_norm`` call, same ``weight``) that also accepts
    sequence parallelism, which megatron-core's ``WrappedTorchNorm`` refuses.

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the
    sequence, so the weight's gradient is a partial sum: the weight is marked
    ``sequence_parallel`` and the actor sums its gradient over the tensor-parallel group (as
    megatron's ``finalize_model_grads`` does for such parameters).
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        if normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise NotImplementedError("only plain RMSNorm is supported")
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device="cpu")
        )
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def _with_rms_norm(layer_spec, config):
    """The block spec: ``layer_spec`` with every norm (and the final norm) as ``RMSNorm``."""
    import dataclasses

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec.submodules
    attention = layer.self_attention.submodules
    if config.qk_layernorm:
        attention = dataclasses.replace(attention, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
    layer = dataclasses.replace(
        layer,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=dataclasses.replace(layer.self_attention, submodules=attention),
    )
    spec = dataclasses.replace(layer_spec, submodules=layer)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm
    )
