"""The local trainer: log-prob alignment, one update against a hand-built reference, minibatches,
R3 errors, publish and checkpoint round trips (safetensors + JSON only)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_hf import on_policy_samples
from transformers import AutoModelForCausalLM

from sat_cli.engines.base import Sample
from sat_cli.models.r3 import R3Error
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl.config import LossConfig
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer, token_logprobs

PROMPTS = [[20, 21, 22, 14, 23, 24, 25, 32], [40, 41, 14, 42, 32], [50, 32], [60, 61, 62]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(2), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


@pytest.fixture(scope="module")
def samples(ckpt):
    """On-policy samples of the checkpoint (rollout_logp = the model's own log-probs)."""
    return on_policy_samples(build_tiny_moe(2), PROMPTS, max_new_tokens=8)


def test_collate_alignment_hand_case():
    s1 = Sample([5, 6], [7, 1], [-0.5, -0.25], "stop", 3)
    s2 = Sample([8], [9, 10, 11], [-1.0, -2.0, -3.0], "length", 2, token_versions=[2, 2, 3])
    b = collate([s1, s2], [2.0, -1.0], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 1], [8, 9, 10, 11]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    b = collate([s1, Sample([8], [9], [-1.0], "length", 2)], [2.0, -1.0], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 1], [8, 9, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    # rollout_logp[b, s] scores input_ids[b, s]
    assert b.rollout_logp.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, 0, 0]]
    assert b.advantages.tolist() == [[0, 0, 2.0, 2.0], [0, -1.0, 0, 0]]
    assert b.versions.tolist() == [3, 2] and b.token_versions is None and b.routed_experts is None
    b = collate([s1, s2], [2.0, -1.0], pad_id=0)
    assert b.token_versions.tolist() == [[0, 0, 3, 3], [0, 2, 2, 3]]


def test_token_logprobs_against_a_float64_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp, ent = token_logprobs(logits, ids, temperature=0.8)
    for b in range(2):
        assert lp[b, 0] == 0 and ent[b, 0] == 0
        for s in range(1, 5):
            z = logits[b, s - 1].double() / 0.8
            p = torch.softmax(z, -1)
            assert lp[b, s].item() == pytest.approx(float(torch.log(p[ids[b, s]])), abs=1e-6)
            assert ent[b, s].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


def test_on_policy_recompute_matches_rollout_logp(ckpt, samples):
    batch = collate(samples, [1.0, 0.0, -1.0, 0.5], pad_id=0)
    lp = LocalTrainer(str(ckpt)).logprobs(batch)
    m = batch.loss_mask.bool()
    assert (lp - batch.rollout_logp)[m].abs().max() <= 1e-5


def _reference_logprobs(batch):
    """An independent batched forward of the checkpoint's model: ``(model, logp [B, S])``."""
    ref = build_tiny_moe(2).train()
    out = ref(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    )
    return ref, token_logprobs(out.logits, batch.input_ids, 1.0)[0]


def test_one_grpo_step_equals_a_hand_built_adamw_update(ckpt, samples):
    adv = [1.0, -0.5, 2.0, -1.0]
    batch = collate(samples, adv, pad_id=0)
    lr = 1e-3
    trainer = LocalTrainer(
        str(ckpt), lr=lr, grad_clip=0.0, weight_decay=0.0, loss=LossConfig(algo="grpo")
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(batch)

    # reference: at lag 0 with the rollout denominator r = 1, the clip is inactive and the
    # token-mean loss is -sum(A * logp) / N with gradient -sum(A * grad logp) / N
    ref, lp = _reference_logprobs(batch)
    m = batch.loss_mask.bool()
    loss = -(batch.advantages[m] * lp[m]).sum() / m.sum()
    loss.backward()
    assert metrics["loss/policy"] == pytest.approx(
        -(batch.advantages[m]).sum().item() / m.sum().item(), abs=1e-5
    )
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters()))
    assert metrics["loss/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    # first AdamW step: m_hat = g, v_hat = g^2 -> delta = -lr * g / (|g| + eps)
    for n, p in ref.named_parameters():
        g = p.grad
        expected = -lr * g / (g.abs() + 1e-8)
        delta = dict(trainer.model.named_parameters())[n].detach() - before[n]
        big = g.abs() > 1e-5  # where |g| >> eps the update is -lr * sign(g)
        torch.testing.assert_close(delta[big], expected[big], atol=2e-6, rtol=1e-3)
    assert metrics["perf/optimizer_steps"] == 1.0
    assert metrics["staleness/abs_logratio_mean"] < 1e-5
    assert metrics["loss/entropy"] > 0


def test_minibatches_tis_and_kl(ckpt, samples):
    batch = collate(samples, [1.0, -0.5, 2.0, -1.0], pad_id=0)
    tr = LocalTrainer(
        str(ckpt),
        lr=1e-2,
        num_minibatches=2,
        loss=LossConfig(algo="grpo", correction="tis", kl_coef=0.1),
    )
    assert tr.needs_old
    metrics = tr.step(batch)
    assert metrics["perf/optimizer_steps"] == 2.0
    # pi_old is recomputed once at the start, at the rollout weights: no mismatch
    assert metrics["staleness/mismatch_abs_logratio_mean"] < 1e-5
    # the first minibatch's KL to the (identical) reference is 0, the second's is positive
    assert 0 < metrics["loss/kl_ref"] < 1.0
    with pytest.raises(ValueError, match="unknown algorithm"):
        LocalTrainer(str(ckpt), loss=LossConfig(algo="nope"))


def test_clip_radii_schedule_hook_changes_the_clip(ckpt, samples):
    # advantages > 0 and a rollout_logp lowered by log(1.5) on every token: r = 1.5 > 1 + eps_high,
    # so every token is clipped at eps 0.2 and none at eps 0.6
    batch = collate(samples, [1.0] * 4, pad_id=0)
    m = batch.loss_mask.bool()
    batch.rollout_logp = LocalTrainer(str(ckpt)).logprobs(batch) - math.log(1.5) * m
    tr = LocalTrainer(str(ckpt), lr=0.0, loss=LossConfig(eps_high=0.2))
    assert tr.step(batch)["loss/clipfrac"] == 1.0
    tr.set_clip_radii(0.2, 0.6)
    assert tr.step(batch)["loss/clipfrac"] == 0.0
    tr.skip_step()
    assert tr.step_count == 3


def test_r3_trainer_needs_routes(ckpt, samples):
    batch = collate(samples, [1.0] * 4, pad_id=0)
    tr = LocalTrainer(str(ckpt), r3=True)
    with pytest.raises(R3Error, match="no routed experts"):
        tr.step(batch)
    batch.routed_experts = torch.zeros(4, batch.input_ids.shape[1] - 1, 4, 2, dtype=torch.long)
    with pytest.raises(R3Error, match="do not match"):
        tr.logprobs(batch)


def test_publish_weights_is_a_loadable_hf_checkpoint(ckpt, samples, tmp_path):
    tr = LocalTrainer(str(ckpt), lr=1e-2)
    tr.step(collate(samples, [1.0, -1.0, 1.0, -1.0], pad_id=0))
    path = tr.publish_weights(tmp_path, 7)
    assert path == tmp_path / "v7" and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, tr.model.eval()(ids).logits)


def test_save_load_resumes_bit_identically(ckpt, samples, tmp_path):
    b1 = collate(samples, [1.0, -1.0, 0.5, -0.5], pad_id=0)
    b2 = collate(samples, [-1.0, 1.0, 0.0, 2.0], pad_id=0)
    a = LocalTrainer(str(ckpt), lr=1e-2, weight_decay=0.01)
    a.step(b1)
    a.save(tmp_path / "ck")
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["model", "optimizer.safetensors", "trainer_state.json"]
    assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["step_count"] == 1
    a.step(b2)
    b = LocalTrainer(str(ckpt), lr=1e-2, weight_decay=0.01)
    b.load(tmp_path / "ck")
    assert b.step_count == 1
    b.step(b2)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert b.step_count == 2


def test_load_refuses_a_checkpoint_with_missing_or_integer_tensors(tmp_path):
    """LocalTrainer.load (resume) checks the checkpoint's weights completely (issue 16):
    a missing expert or an integer tensor is refused instead of being filled in or cast."""
    import torch
    from safetensors.torch import load_file, save_file

    from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
    from sat_cli.models.weights_check import WeightsError
    from sat_cli.trainers.local import LocalTrainer

    path = save_hf(build_tiny_moe(1), build_char_tokenizer(), tmp_path / "m")
    tr = LocalTrainer(str(path))
    tr.save(tmp_path / "ck")
    st = tmp_path / "ck" / "model" / "model.safetensors"
    sd = load_file(str(st))
    del sd["model.layers.1.mlp.experts.2.gate_proj.weight"]
    save_file(sd, str(st), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"missing: 'model\.layers\.1\.mlp\.experts\.2\.gate"):
        tr.load(tmp_path / "ck")
    sd = load_file(str(path / "model.safetensors"))
    sd["model.layers.1.mlp.experts.2.gate_proj.weight"] = torch.ones(64, 128, dtype=torch.int64)
    save_file(sd, str(st), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"is stored as I64 but the model needs float32"):
        tr.load(tmp_path / "ck")


def _perturbed(samples, shift):
    """The same samples with rollout log-probs shifted (a stale behaviour policy)."""
    return [
        Sample(
            s.prompt_ids,
            s.response_ids,
            [x + shift for x in s.rollout_logp],
            s.finish_reason,
            s.weight_version,
        )
        for s in samples
    ]


def test_a3po_step_at_staleness_one_equals_grpo(ckpt, samples):
    # the trainer holds version step_count = 0 ... samples of version -1 would be k = 1;
    # use step_count = 3 and samples of version 2: alpha = 0, pi_prox = mu -> GRPO exactly
    stale = [
        Sample(s.prompt_ids, s.response_ids, [x - 0.1 for x in s.rollout_logp], s.finish_reason, 2)
        for s in samples
    ]
    batch = collate(stale, [1.0, -0.5, 2.0, -1.0], pad_id=0)
    out = {}
    for algo in ("a3po", "grpo"):
        tr = LocalTrainer(str(ckpt), lr=1e-2, loss=LossConfig(algo=algo))
        tr.step_count = 3
        m = tr.step(batch)
        out[algo] = ({n: p.detach().clone() for n, p in tr.model.named_parameters()}, m)
    for n, p in out["grpo"][0].items():
        assert torch.equal(p, out["a3po"][0][n]), n
    assert out["a3po"][1]["a3po/alpha_mean"] == 0.0
    # staleness 4 (version 2 at step 6): alpha = 3/4, the update differs from GRPO's
    tr = LocalTrainer(str(ckpt), lr=1e-2, loss=LossConfig(algo="a3po"))
    tr.step_count = 6
    assert tr.step(batch)["a3po/alpha_mean"] == pytest.approx(0.75)


def test_vcpo_score_norms_and_scaled_step(ckpt, samples):
    batch = collate(_perturbed(samples, -0.3), [1.0, -1.0, 0.5, -0.5], pad_id=0)
    vcpo = LossConfig(algo="vcpo", agg="seq-mean-token-mean", group_size=2)
    kw = dict(lr=1e-3, grad_clip=0.0)
    tr = LocalTrainer(str(ckpt), loss=vcpo, **kw)
    # ||grad sum_t log pi||^2 per response, from an independent batched forward
    sq = tr._score_sqnorms(batch)
    ref, lp = _reference_logprobs(batch)
    m = batch.loss_mask.bool()
    for b in range(4):
        grads = torch.autograd.grad(lp[b][m[b]].sum(), list(ref.parameters()), retain_graph=True)
        expected = sum(float(g.double().pow(2).sum()) for g in grads)
        assert float(sq[b]) == pytest.approx(expected, rel=1e-4)
    # the step: learning rate lr * sqrt(ESS/B); rollout logp shifted by -0.3 per token, so the
    # sequence weights differ by response length and ESS < 1
    metrics = tr.step(batch)
    scale = metrics["opt/lr_scale"]
    assert 0 < scale < 1 and scale == pytest.approx(math.sqrt(metrics["vcpo/ess"]))
    assert metrics["staleness/ess"] == pytest.approx(metrics["vcpo/ess"])
    assert tr.opt.param_groups[0]["lr"] == 1e-3  # restored after the step
    # the same step with lr * scale and no ESS scaling (base ~ 0 -> factor 1) is identical
    tr2 = LocalTrainer(
        str(ckpt),
        loss=vcpo.replace(vcpo_ess_base=1e-12),
        **(kw | {"lr": 1e-3 * scale}),
    )
    assert tr2.step(batch)["opt/lr_scale"] == 1.0
    for (n, p), (_, p2) in zip(
        tr.model.named_parameters(), tr2.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, p2), n
