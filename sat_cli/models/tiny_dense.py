"""Tiny dense models in Hugging Face format: ``Qwen3ForCausalLM`` and ``LlamaForCausalLM`` with the
tiny Qwen3-MoE's attention shapes (4 layers, hidden 128, 4 query heads in 2 KV groups of
``head_dim`` 32, vocabulary 128) and a dense SwiGLU MLP of ``intermediate_size`` 256.

Used to check the Megatron trainer's dense families against transformers
(tests/test_megatron_dense.py); ``sat_cli.models.tiny_moe.save_hf`` writes them. Torch-free to
import (``TINY_DENSE_CONFIG`` is read by config tests).
"""

from __future__ import annotations

from sat_cli.models.arch import TINY_MOE_CONFIG

DENSE_FAMILIES = ("qwen3", "llama")
_SHARED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
)
TINY_DENSE_CONFIG: dict = {k: TINY_MOE_CONFIG[k] for k in _SHARED}


def build_tiny_dense(family: str = "qwen3", seed: int = 0, **overrides):
    """A freshly initialised tiny dense model of ``family`` (``"qwen3"``: q/k RMSNorm;
    ``"llama"``: none), fp32, eval mode, deterministic in ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if family not in classes:
        raise ValueError(f"unknown dense family {family!r}: use one of {DENSE_FAMILIES}")
    config_cls, model_cls = classes[family]
    kwargs = {**TINY_DENSE_CONFIG, "rms_norm_eps": 1e-6, **overrides}
    cfg = config_cls(**kwargs, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    return model.eval()
