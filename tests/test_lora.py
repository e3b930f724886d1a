"""LoRA on the local trainer (``trainer.lora``): one step against a float64 hand reference
(``W + (alpha / r) B A``, AdamW's first step), only the adapters train, the settings' bounds and
the trainers that refuse it."""

from __future__ import annotations

import pytest
import test_local_trainer as full_weights
import torch

from sat_cli.models.lora import LoraLinear, lora_layers, merged_weight
from sat_cli.models.tiny_moe import build_tiny_moe
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer, token_logprobs

RANK, ALPHA = 4, 8.0
ckpt, samples = full_weights.ckpt, full_weights.samples  # the tiny model and its samples
LORA = {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def _float64_weight_grads(batch) -> dict[str, torch.Tensor]:
    """dL/dW of every weight of the checkpoint's model, in float64: at lag 0 the GRPO loss is
    ``-sum(A * logp) / N`` (ratio 1, no clip), an independent forward of the model."""
    ref = build_tiny_moe(2)
    ref.set_experts_implementation("eager")  # the grouped-mm kernel has no float64
    ref = ref.double().train()
    out = ref(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    )
    lp = token_logprobs(out.logits, batch.input_ids, 1.0)[0]
    m = batch.loss_mask.bool()
    (-(batch.advantages[m].double() * lp[m]).sum() / m.sum()).backward()
    return {n.removesuffix(".weight"): p.grad for n, p in ref.named_parameters()}


def test_one_lora_step_equals_a_float64_hand_reference(ckpt, samples):
    batch = collate(samples, [1.0, -0.5, 2.0, -1.0], pad_id=0)
    lr, scaling = 1e-3, ALPHA / RANK
    tr = LocalTrainer(str(ckpt), lr=lr, grad_clip=0.0, loss=LossConfig(algo="grpo"), lora=LORA)
    layers = lora_layers(tr.model)
    # q_proj and v_proj of every layer, nothing else
    assert sorted({p.rsplit(".", 1)[-1] for p in layers}) == ["q_proj", "v_proj"]
    assert len(layers) == 2 * tr.model.config.num_hidden_layers
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert sum(len(g["params"]) for g in tr.opt.param_groups) == 2 * len(layers)
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    a0 = {p: m.lora_A.detach().double().clone() for p, m in layers.items()}
    assert all(
        float(m.lora_B.detach().abs().max()) == 0 for m in layers.values()
    )  # starts as the base

    metrics = tr.step(batch)
    grads = _float64_weight_grads(batch)
    assert metrics["staleness/abs_logratio_mean"] < 1e-5  # lag 0: the rollout's own weights
    for path, m in layers.items():
        g_w = grads[path]
        # dL/dB = s * dL/dW * A^T; dL/dA = s * B^T * dL/dW = 0 while B = 0
        g_b = scaling * g_w @ a0[path].t()
        tol = 1e-4 * float(g_b.abs().max())  # float32 backward vs float64
        torch.testing.assert_close(m.lora_B.grad.double(), g_b, rtol=1e-3, atol=tol)
        assert float(m.lora_A.grad.abs().max()) == 0.0
        # AdamW's first step: m_hat = g, v_hat = g^2 -> B1 = -lr * g / (|g| + eps); A unchanged
        b1 = -lr * g_b / (g_b.abs() + 1e-8)
        big = g_b.abs() > 1e-5
        torch.testing.assert_close(m.lora_B.detach().double()[big], b1[big], atol=2e-6, rtol=1e-3)
        assert torch.equal(m.lora_A.detach().double(), a0[path])
        # the layer's weight is now W + (alpha / r) B1 A0
        w = m.base.weight.detach().double()
        ref = w + scaling * b1 @ a0[path]
        assert float((merged_weight(m) - ref)[big.any(1)].abs().max()) < 1e-7
        assert float((merged_weight(m) - w).abs().max()) > 0  # it moved
    for n, p in tr.model.named_parameters():  # the base weights did not move at all
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), n


def test_lora_off_by_default_and_the_adapter_starts_as_the_base(ckpt, samples):
    batch = collate(samples, [1.0, -0.5, 2.0, -1.0], pad_id=0)
    plain = LocalTrainer(str(ckpt), lora={"rank": 0})
    assert plain.lora is None and not lora_layers(plain.model)
    lora = LocalTrainer(str(ckpt), lora=LORA)
    assert isinstance(lora.model.model.layers[0].self_attn.q_proj, LoraLinear)
    assert torch.equal(plain.logprobs(batch), lora.logprobs(batch))


def test_unknown_target_modules_are_one_line(ckpt):
    from sat_cli.errors import UserError

    with pytest.raises(UserError, match=r"names no linear layer of the model; its linear"):
        LocalTrainer(str(ckpt), lora={**LORA, "target_modules": ["nope_proj"]})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=-1"], r"trainer\.lora\.rank=-1 is out of range"),
        (["trainer.lora.rank=5000"], r"trainer\.lora\.rank=5000 is out of range"),
        (["trainer.lora.alpha=0"], r"trainer\.lora\.alpha=0.0 is out of range"),
        (["trainer.lora.dropout=1"], r"trainer\.lora\.dropout=1.0 is out of range"),
        (["trainer.lora.target_modules=[]"], "must name at least one module"),
        (["trainer.lora.target_modules=[a.b]"], "is not a module name"),
        (["trainer.lora.sync=both"], r"trainer\.lora\.sync"),
        (
            ["trainer=megatron", "trainer.lora.rank=8"],
            r"trainer=megatron has no LoRA yet .* use trainer=local",
        ),
        (
            ["trainer.lora.rank=8", "engine=sglang", "engine.num_servers=2"],
            r"with engine=sglang: not engine\.num_servers=2, engine\.dp=1 \(one server",
        ),
        (
            ["trainer.lora.rank=8", "engine=sglang", "engine.restart_on_failure=true"],
            r"not engine\.restart_on_failure=true \(a restarted server has lost its adapters",
        ),
        (
            ["trainer.lora.rank=8", "engine=sglang", "engine.urls=[http://127.0.0.1:1]"],
            r"not engine\.urls \(servers started elsewhere",
        ),
        (
            ["trainer.lora.rank=8", "engine.weight_sync=distributed"],
            "use engine.weight_sync=disk",
        ),
        (["trainer.lora.rank=8", "algo.ledger=true"], "use algo.ledger=false"),
    ],
)
def test_lora_settings_are_checked_at_compose_time(overrides, message):
    from sat_cli.config import ConfigError, load

    with pytest.raises(ConfigError, match=message):
        load(overrides)


def test_lora_settings_compose():
    from sat_cli.config import load

    t = load(["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj]"])[1].trainer
    assert t.lora.on and t.lora.as_dict() == {
        "rank": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target_modules": ["q_proj"],
        "sync": "adapter",
    }
    assert not load([])[1].trainer.lora.on  # off by default
    merged = load(
        ["trainer.lora.rank=8", "trainer.lora.sync=merged", "engine.num_servers=2", "engine=sglang"]
    )[1]  # full weights: no adapter rule applies
    assert merged.trainer.lora.sync == "merged"


def test_sglang_with_lora_composes_and_its_servers_get_the_lora_flags():
    """engine=sglang takes trainer.lora: its servers start with SGLang's LoRA flags (names as
    in sglang/srt/arg_groups/fields/lora.py), one batch slot per held version plus the base."""
    from sat_cli.config import load
    from sat_cli.engines.sglang.lora import server_lora_args

    run = load(["trainer.lora.rank=8", "engine=sglang", "lag.n=2"])[1]
    assert run.trainer.lora.on and run.engine.lora_refusal() is None
    lora = run.trainer.lora.as_dict() | {"target_modules": ["q_proj", "v_proj"]}
    assert server_lora_args(lora, 4, "cpu") == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "--max-loras-per-batch",
        "4",
        "--max-loaded-loras",
        "4",
        "--lora-backend",
        "torch_native",
    ]
    assert server_lora_args(lora, 4, "cuda")[-2:] == ["--max-loaded-loras", "4"]


def test_sat_plan_says_what_lora_trains():
    from types import SimpleNamespace

    from sat_cli.config import load

    proc = SimpleNamespace(device="cpu", dtype="float32", gpus=())
    lines = load(["trainer.lora.rank=8"])[1].trainer.plan_lines([proc], 596_000_000)
    assert lines[0].endswith("fp32 weights (frozen) ≈ 2.4 GB")
    assert "LoRA rank 8 on q_proj,k_proj,v_proj,o_proj: the adapters alone train" in lines[1]
    plain = load([])[1].trainer.plan_lines([proc], 596_000_000)
    assert plain[0].endswith("fp32 weights, gradients, AdamW ≈ 9.5 GB") and len(plain) == 1
