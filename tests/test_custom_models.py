"""Models from a user's Hugging Face folder (``model.path``): tiny random Qwen2, Qwen3, Qwen3-MoE
and Llama built by the test (tests/tiny_hf.py). For each, the local engine's sampler and the
local trainer load it the way `sat train` does; the trainer's log-probs equal the sampler's and an
independent Hugging Face forward's, and one GRPO step moves the weights. The Megatron trainer
refuses the dense ones at compose time, naming the architecture."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import make_model, on_policy_samples
from transformers import AutoModelForCausalLM

from sat_cli.config import ConfigError, load
from sat_cli.models.tiny_moe import load_model
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer, token_logprobs

ARCHS = ["qwen2", "qwen3", "qwen3_moe", "llama"]
PROMPTS = [[20, 21, 22, 14, 23], [40, 41, 14, 42, 32, 33], [50, 32]]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_sampler_and_trainer_agree_on_each_architecture(tmp_path, arch):
    path = make_model(tmp_path / arch, arch)
    model = load_model(str(path))  # what the local engine's worker serves
    samples = on_policy_samples(model, PROMPTS, max_new_tokens=6)
    batch = collate(samples, [1.0, -1.0, 0.5], pad_id=0)
    trainer = LocalTrainer(str(path), lr=1e-2, seed=0)
    lp = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    assert (lp - batch.rollout_logp)[mask].abs().max() <= 1e-5
    # an independent forward of the saved folder through transformers
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits
    ref_lp = token_logprobs(logits, batch.input_ids, 1.0)[0]
    assert (lp - ref_lp)[mask].abs().max() <= 1e-5
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("loss"))
    moved = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and "model.embed_tokens.weight" in moved
    trainer.close()


@pytest.mark.parametrize(("arch", "kind"), [("qwen2", "qwen2")])  # llama: built (dense)
def test_megatron_refuses_other_architectures_naming_them(tmp_path, arch, kind):
    path = make_model(tmp_path / arch, arch)
    with pytest.raises(ConfigError, match=f"this one is '{kind}'"):
        load([f"model.path={path}", "model.kind=hf", "trainer=megatron", "task=gsm8k"])


def _sglang_stand_in(tmp_path):
    """An interpreter whose `sglang` is a stand-in holding two model modules written the way
    SGLang's own are (sglang/srt/models/qwen3.py: `EntryClass = Qwen3ForCausalLM`; llama.py:
    `EntryClass = [LlamaForCausalLM, Phi3ForCausalLM, InternLM3ForCausalLM]`)."""
    import os
    import sys

    models = tmp_path / "site" / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("raise ImportError('not imported')\n")
    (models / "qwen3.py").write_text(
        "class Qwen3ForCausalLM: ...\n\nEntryClass = Qwen3ForCausalLM\n"
    )
    (models / "llama.py").write_text(
        "EntryClass = [\n    LlamaForCausalLM,\n    Phi3ForCausalLM,\n    InternLM3ForCausalLM,\n]\n"
    )
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    assert os.access(py, os.X_OK)
    return py, models


def test_sglang_refuses_an_architecture_it_has_no_model_class_for(tmp_path):
    from types import SimpleNamespace

    from sat_cli.commands.preflight import check_engine_architecture
    from sat_cli.engines.sglang.models import architectures_in
    from sat_cli.errors import UserError

    py, models = _sglang_stand_in(tmp_path)
    assert architectures_in(models) == {
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
        "Phi3ForCausalLM",
        "InternLM3ForCausalLM",
    }
    engine = SimpleNamespace(name="sglang", urls=[], launch_prefix=[], python=str(py))
    for arch in ("qwen3", "llama"):  # served: no refusal
        check_engine_architecture(engine, str(make_model(tmp_path / arch, arch)))
    qwen2 = make_model(tmp_path / "qwen2", "qwen2")
    with pytest.raises(
        UserError,
        match=r"engine=sglang cannot serve the model at .*qwen2: SGLang "
        r"\(.*site/sglang\) has no model class for Qwen2ForCausalLM",
    ):
        check_engine_architecture(engine, str(qwen2))
    check_engine_architecture(SimpleNamespace(**{**vars(engine), "name": "local"}), str(qwen2))
