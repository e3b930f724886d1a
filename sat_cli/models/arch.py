"""Architecture numbers of the models `sat` knows without their files (torch-free, json only).

``TINY_MOE_CONFIG`` is the embedded tiny Qwen3-MoE (STACK.md; ``sat_cli.models.tiny_moe`` builds
it). ``KNOWN_HF_CONFIGS`` holds the Hugging Face ``config.json`` fields that parameter counts and
layout checks need (``sat_cli.config.layout``) for hub ids whose files are not on this machine;
the numbers are those of the published ``config.json`` of each model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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

# Qwen/Qwen3-8B-Base (model=qwen3_8b; and Qwen/Qwen3-8B, same shapes): dense, untied embeddings,
# ~8.19 B parameters, 36 layers, 32/8 q/kv heads. Data: assets/arch/qwen3_8b.json.
QWEN3_8B: dict = json.loads(
    (Path(__file__).parent.parent / "assets" / "arch" / "qwen3_8b.json").read_text()
)

KNOWN_HF_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-8B-Base": QWEN3_8B,
    "Qwen/Qwen3-8B": QWEN3_8B,
    "Qwen/Qwen3-0.6B-Base": QWEN3_0_6B,
    "Qwen/Qwen3-0.6B": QWEN3_0_6B,
    "Qwen/Qwen3-30B-A3B-Base": QWEN3_30B_A3B,
    "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B,
}


@dataclass(frozen=True)
class Arch:
    """The ``config.json`` fields that sizes and rules need."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP size (0 when every layer is MoE)
    experts: int  # 0: dense
    top_k: int
    moe_ffn: int
    tied: bool
    qk_norm: bool = True  # per-head q/k RMSNorm (Qwen3); Llama has none

    @classmethod
    def from_hf(cls, c: dict) -> Arch:
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        heads = int(c["num_attention_heads"])
        return cls(
            vocab=int(c["vocab_size"]),
            hidden=int(c["hidden_size"]),
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            ffn=0 if experts else int(c["intermediate_size"]),
            experts=experts,
            top_k=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(c.get("moe_intermediate_size") or 0) if experts else 0,
            tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=c.get("model_type") != "llama",
        )

    # parameters of one layer, by kind (the split rules apply per kind)
    @property
    def attention(self) -> int:  # q, k, v, o projections (no bias)
        d, h = self.head_dim, self.hidden
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h

    @property
    def replicated(self) -> int:  # two RMSNorms, q/k norms (not Llama's), the router
        return 2 * self.hidden + 2 * self.head_dim * self.qk_norm + self.experts * self.hidden

    @property
    def dense_mlp(self) -> int:  # gate, up, down
        return 3 * self.hidden * self.ffn

    @property
    def expert(self) -> int:  # one expert's gate, up, down
        return 3 * self.hidden * self.moe_ffn

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    def total(self) -> int:
        per_layer = self.attention + self.replicated + self.dense_mlp + self.experts * self.expert
        head = 0 if self.tied else self.embedding
        return self.layers * per_layer + self.embedding + head + self.hidden  # + final norm


def params_text(n: int) -> str:
    """A parameter count as ``sat plan`` prints it: ``30,532,122,624 (30.53 B)`` from 1e8 up."""
    return f"{n:,} ({n / 1e9:.2f} B)" if n >= 1e8 else f"{n:,}"
