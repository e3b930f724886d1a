"""Tiny randomly initialised Hugging Face causal LMs for tests (no downloads).

:func:`make_model` writes a folder with ``save_pretrained`` for one of the architectures a user
may bring (``qwen2``, ``qwen3``, ``qwen3_moe``, ``llama``): two layers, hidden size 32, the
embedded char tokenizer (``sat_cli.models.tiny_moe.build_char_tokenizer``), optionally with a
chat template (:data:`CHAT_TEMPLATE`, markers ``<|im_start|>`` / ``<|im_end|>`` in plain
characters, so the char tokenizer covers them).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    tie_word_embeddings=False,
)


def _config(arch: str, vocab_size: int):
    import transformers as tf

    if arch == "qwen2":
        return tf.Qwen2Config(vocab_size=vocab_size, **_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(vocab_size=vocab_size, head_dim=8, **_COMMON)
    if arch == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return tf.Qwen3MoeConfig(vocab_size=vocab_size, head_dim=8, **moe, **_COMMON)
    if arch == "llama":
        return tf.LlamaConfig(vocab_size=vocab_size, head_dim=8, **_COMMON)
    raise ValueError(f"unknown architecture {arch!r}")


def on_policy_samples(model, prompts: list[list[int]], max_new_tokens: int, seed: int = 0):
    """Samples of ``model`` (the local engine's sampler, T=1, stop at id 1, pad 0), version 0:
    their ``rollout_logp`` are the model's own log-probs."""
    import torch

    from sat_cli.engines.base import Sample
    from sat_cli.engines.local.worker import sample_batch

    outs = sample_batch(
        model,
        prompts,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop_token_ids={1},
        pad_id=0,
        generator=torch.Generator().manual_seed(seed),
    )
    return [
        Sample(p, o["response_ids"], o["rollout_logp"], o["finish_reason"], 0)
        for p, o in zip(prompts, outs, strict=True)
    ]


def make_model(path: Path, arch: str = "qwen3", *, chat: bool = False, seed: int = 0) -> Path:
    """A tiny random ``arch`` model with the char tokenizer saved at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from sat_cli.models.tiny_moe import build_char_tokenizer, save_hf

    tok = build_char_tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(arch, len(tok)))
    return save_hf(model.eval(), tok, path)
