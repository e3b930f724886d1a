"""Architecture numbers of the models `sat` knows without their files (torch-free, json only).

``TINY_MOE_CONFIG`` is the embedded tiny Qwen3-MoE (STACK.md; ``sat_cli.models.tiny_moe`` builds
it). ``KNOWN_HF_CONFIGS`` holds the Hugging Face ``config.json`` fields that parameter counts and
layout checks need (``sat_cli.config.layout``) for hub ids whose files are not on this machine;
the numbers are those of the published ``config.json`` of each model.
"""

from __future__ import annotations

import json
from pathlib import Path

# STACK.md's tiny Qwen3-MoE. vocab_size 128 leaves room above the 100 tokenizer ids.
TINY_MOE_CONFIG: dict = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    output_router_logits=False,
)

# Qwen/Qwen3-30B-A3B-Base (and the post-trained Qwen/Qwen3-30B-A3B, same shapes): ~30.5 B
# parameters, ~3.3 B active per token. Every layer is MoE (decoder_sparse_step 1, no
# mlp_only_layers), so intermediate_size is unused. Data: assets/arch/qwen3_30b_a3b.json.
QWEN3_30B_A3B: dict = json.loads(
    (Path(__file__).parent.parent / "assets" / "arch" / "qwen3_30b_a3b.json").read_text()
)

# Qwen/Qwen3-0.6B-Base (model=qwen3_0_6b; and Qwen/Qwen3-0.6B, same shapes): dense, tied
# embeddings, ~0.60 B parameters (0.44 B without the embedding). Data: assets/arch/qwen3_0_6b.json.
QWEN3_0_6B: dict = json.loads(
    (Path(__file__).parent.parent / "assets" / "arch" / "qwen3_0_6b.json").read_text()
)

KNOWN_HF_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-0.6B-Base": QWEN3_0_6B,
    "Qwen/Qwen3-0.6B": QWEN3_0_6B,
    "Qwen/Qwen3-30B-A3B-Base": QWEN3_30B_A3B,
    "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B,
}
