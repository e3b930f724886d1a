"""The tiny Qwen3-MoE and its char tokenizer: config, parameter count, HF round trip."""

from __future__ import annotations

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from sat_cli.models.tiny_moe import (
    build_char_tokenizer,
    build_tiny_moe,
    count_parameters,
    load_model,
    moe_gates,
    save_hf,
)


def test_parameter_count_matches_the_stack_config():
    model = build_tiny_moe(0)
    # embed 128*128 + lm_head 128*128 (untied) = 32768
    # per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128 + q/k norms 2*32  = 49216
    #            router 8*128 = 1024; experts 8*(2*64*128) + 8*(128*64) = 196608; 2 norms 256
    # 4 layers * 247104 = 988416; final norm 128 -> 32768 + 988416 + 128 = 1021312
    assert count_parameters(model) == 1021312
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (4, 8, 2)
    assert len(moe_gates(model)) == 4


def test_init_is_deterministic_in_the_seed():
    a, b, c = build_tiny_moe(5), build_tiny_moe(5), build_tiny_moe(6)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_char_tokenizer_hand_ids_and_round_trip(tmp_path):
    tok = build_char_tokenizer()
    # ids: <pad>=0, <eos>=1, <unk>=2, then chr(32 + i) -> 3 + i: '1' (49) -> 20, '+' (43) -> 14,
    # '=' (61) -> 32, '\\' (92) -> 63, '{' (123) -> 94, '}' (125) -> 96, '\n' -> 98
    assert tok("1+1=")["input_ids"] == [20, 14, 20, 32]
    assert tok("\\{}\n")["input_ids"] == [63, 94, 96, 98]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    text = "123+456=\\boxed{579}  x\n"
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok2(text)["input_ids"]
    assert ids == tok(text)["input_ids"] and len(ids) == len(text)
    assert tok2.decode(ids + [1, 0], skip_special_tokens=True) == text
    assert tok2("é")["input_ids"] == [2]  # outside printable ASCII: <unk>


def test_saved_checkpoint_loads_with_plain_transformers_with_identical_logits(tmp_path):
    model = build_tiny_moe(3)
    path = save_hf(model, build_char_tokenizer(), tmp_path / "ckpt")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    # the per-expert key layout that SGLang and mbridge read
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.3.mlp.gate.weight" in keys
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[20, 21, 22, 14, 23, 24, 25, 32], [30, 31, 32, 33, 34, 35, 36, 37]])
    with torch.no_grad():
        ref = model(ids).logits
        got = plain(ids).logits
        got2 = load_model(path)(ids).logits
    assert torch.equal(ref, got) and torch.equal(ref, got2)
    assert float(ref.std()) > 0  # not a degenerate all-equal output


def test_load_model_in_bfloat16(tmp_path):
    path = save_hf(build_tiny_moe(0), build_char_tokenizer(), tmp_path / "ckpt")
    m = load_model(path, "bfloat16")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ref = load_model(path, "float32").lm_head.weight
    assert torch.equal(m.lm_head.weight, ref.to(torch.bfloat16))
