"""bf16 mixed precision in the megatron trainer (``trainer.dtype=bfloat16``), CPU path.

bf16 parameters for forward and backward, an fp32 main copy of every parameter updated by
torch AdamW with fp32 states, gradients cast to fp32 before they are reduced and clipped, main
weights copied back (rounded) into the bf16 parameters (``sat_cli/trainers/megatron/precision``).

Checked against values, in-process on one rank:
- a step against an explicit reference written here (fp32 main weights initialised from the
  checkpoint, loss from a bf16 forward, gradients widened to fp32, ``clip_grad_norm_``, fp32
  ``torch.optim.AdamW``): main weights equal to ≤ 1e-6 relative (the same operations in the same
  order: 0 seen), bf16 parameters = main weights rounded to bf16, bit-exactly;
- the same step against the fp32 trainer (the fp32-main-weights reference): within bf16
  tolerance (``BF16_*`` below, with the reasons);
- save → load → step resumes bit-exactly (the checkpoint's ``model/`` holds the fp32 main
  weights); published weights follow ``export_dtype`` (the engine's); a planted non-finite
  batch is skipped with main weights, optimizer state and bf16 parameters unchanged.
Plus tp = 2 on two ranks through torchrun against one rank (bf16 tolerance), and (slow) the
command line ``sat train trainer=megatron trainer.dtype=bfloat16 max_steps=2``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install '.[megatron]')"
)
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*"
)

from test_megatron_trainer import make_samples  # noqa: E402
from trainer_checks import (  # noqa: E402
    check_nonfinite_step_is_skipped,
    megatron_trainer,
    plant_nonfinite,
)

from sat_cli.rl import registry  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.rl.loss_io import LossInputs  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.megatron import convert, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402

LR = 1e-4
# SAT-GRPO, no pi_old recompute; the clip is active (gradient norm ~5 > 1)
KW = dict(lr=LR, loss=LossConfig(algo="grpo", adaptive=True), temperature=0.9, weight_decay=0.01)
BF16 = torch.bfloat16
# bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per operation); the tiny model's
# log-probs (~ -4.6, four layers, 128-wide) came out within 6.5e-3 of fp32 (mean 1.6e-3; tp = 2
# vs one rank: 4.5e-3): bounds 3e-2 and 8e-3, about 5x what was seen
BF16_LOGP_MAX, BF16_LOGP_MEAN = 3e-2, 8e-3
# the loss and the gradient norm average many tokens: 2e-3 and 8e-4 relative seen, bound 2e-2
BF16_REL = 2e-2
# Adam's first step is lr * g / (|g| + eps) = ±lr per element (+ weight decay), so bf16 and fp32
# gradients give the same update wherever the gradient's sign agrees; where a near-zero gradient
# flips sign the two differ by 2 lr. Bound: ≤ 2 lr + 1e-7 everywhere, equal (≤ 1e-7) on ≥ 90 %.
SIGN_AGREE = 0.9


@pytest.fixture(scope="session")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


def _batch(seed=0, n=8):
    return collate(*make_samples(n=n, seed=seed), 0)


def _main_hf(actor) -> dict[str, torch.Tensor]:
    return actor.hf_state(main=True)


def test_bf16_step_matches_explicit_fp32_main_reference(megatron_dist, tiny_dir):
    actor = MegatronActor(str(tiny_dir), dtype="bfloat16", **KW)
    assert not actor.needs_old and actor.main is not None
    names = actor.main.names
    params = dict(actor.model.named_parameters())
    assert all(p.dtype == BF16 for p in params.values())
    # main weights start from the checkpoint's fp32 values, not from the rounded bf16 ones
    init = dict(zip(names, [m.detach().clone() for m in actor.main.params], strict=True))
    assert all(init[n].dtype == torch.float32 for n in names)
    assert _main_hf(actor).keys() == convert.load_hf_state(tiny_dir).keys()
    src = convert.load_hf_state(tiny_dir)
    assert all(torch.equal(_main_hf(actor)[k], src[k]) for k in src)
    assert any(not torch.equal(init[n], params[n].float()) for n in names)  # bf16 rounds

    # the reference: a bf16 model for the forward/backward, fp32 main weights + fp32 AdamW
    ref = MegatronActor(str(tiny_dir), dtype="bfloat16", **KW)
    batch = _batch()
    mask = batch.loss_mask
    logp, _ = ref._model_forward(ref.model, batch)
    inputs = LossInputs(
        logp=logp, rollout_logp=batch.rollout_logp, advantages=batch.advantages, mask=mask
    )
    loss = registry.compute(ref.loss, inputs).loss
    loss.backward()
    main = [torch.nn.Parameter(init[n].clone()) for n in names]
    for m, (_, p) in zip(main, ref.model.named_parameters(), strict=True):
        m.grad = p.grad.float()
    ref_norm = torch.nn.utils.clip_grad_norm_(main, 1.0)
    opt = torch.optim.AdamW(main, lr=LR, betas=(0.9, 0.98), weight_decay=0.01)
    opt.step()

    metrics = actor.step(batch)
    assert metrics["loss/policy"] == float(loss.detach())
    assert metrics["loss/grad_norm"] == pytest.approx(float(ref_norm), rel=1e-6)
    assert metrics["loss/grad_norm"] > 1.0  # the clip was active
    worst = 0.0
    for n, m_ref, m in zip(names, main, actor.main.params, strict=True):
        assert m.dtype == torch.float32
        rel = ((m - m_ref).abs() / m_ref.abs().clamp_min(1e-12)).max().item()
        worst = max(worst, rel)
        assert rel <= 1e-6, n
        # the bf16 parameters are the main weights rounded to bf16, exactly
        assert torch.equal(params[n], m.detach().to(BF16)), n
        # Adam states are fp32
        assert all(v.dtype == torch.float32 for v in actor.opt.state[m].values() if v.dim())
    moved = max((m - init[n]).abs().max().item() for n, m in actor.main.named())
    assert moved >= 0.9 * LR
    print(f"bf16 step vs explicit reference: main weights rel {worst:.1e}, moved {moved:.1e}")


def test_bf16_step_tracks_the_fp32_trainer(megatron_dist, tiny_dir):
    fp32 = MegatronActor(str(tiny_dir), **KW)
    bf16 = MegatronActor(str(tiny_dir), dtype="bfloat16", **KW)
    batch = _batch(seed=1)
    real = batch.attention_mask.bool()
    lp = (bf16.logprobs(batch) - fp32.logprobs(batch))[real].abs()
    assert lp.max().item() <= BF16_LOGP_MAX and lp.mean().item() <= BF16_LOGP_MEAN
    m32, m16 = fp32.step(batch), bf16.step(batch)
    for key in ("loss/policy", "loss/grad_norm", "loss/entropy"):
        assert m16[key] == pytest.approx(m32[key], rel=BF16_REL), key
    init = convert.load_hf_state(tiny_dir)
    w32, w16 = fp32.hf_state(), _main_hf(bf16)
    diffs = torch.cat([(w16[k] - w32[k]).abs().reshape(-1) for k in init])
    assert diffs.max().item() <= 2 * LR + 1e-7
    agree = (diffs <= 1e-7).double().mean().item()
    assert agree >= SIGN_AGREE
    print(
        f"bf16 vs fp32: log-probs max {lp.max():.1e} mean {lp.mean():.1e}, loss "
        f"{m16['loss/policy']:.5f} vs {m32['loss/policy']:.5f}, grad norm "
        f"{m16['loss/grad_norm']:.4f} vs {m32['loss/grad_norm']:.4f}, weights max "
        f"{diffs.max():.1e}, equal updates {agree:.1%}"
    )


def test_bf16_save_load_resumes_exactly_and_exports_engine_dtype(megatron_dist, tiny_dir, tmp_path):
    actor = MegatronActor(str(tiny_dir), dtype="bfloat16", export_dtype="float32", **KW)
    actor.step(_batch(seed=2))
    actor.save(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert meta["dtype"] == "bfloat16"
    saved = convert.load_hf_state(tmp_path / "ckpt" / "model")
    main = _main_hf(actor)
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], main[k]) for k in main)
    b2 = _batch(seed=4)
    expect = actor.step(b2)
    expect_main = _main_hf(actor)
    expect_model = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    # published weights: the bf16 parameters, in the engine's dtype (float32 here)
    pub = convert.load_hf_state(actor.export_hf(tmp_path / "pub32"))
    model_hf = actor.hf_state()
    assert all(
        pub[k].dtype == torch.float32 and torch.equal(pub[k], model_hf[k].float()) for k in pub
    )

    again = MegatronActor(str(tiny_dir), dtype="bfloat16", **KW)  # export_dtype: bf16
    again.load(tmp_path / "ckpt")
    assert again.step_count == 1
    got = again.step(b2)
    assert got["loss/policy"] == expect["loss/policy"]
    got_main = _main_hf(again)
    assert all(torch.equal(got_main[k], expect_main[k]) for k in expect_main)
    assert all(torch.equal(p, expect_model[n]) for n, p in again.model.named_parameters())
    pub16 = convert.load_hf_state(again.export_hf(tmp_path / "pub16"))
    assert all(v.dtype == BF16 for v in pub16.values())
    assert all(torch.equal(pub16[k], pub[k].to(BF16)) for k in pub)
    # an fp32 trainer publishing for a bf16 engine; its checkpoints stay fp32
    fp32 = MegatronActor(str(tiny_dir), export_dtype="bfloat16", **KW)
    src = convert.load_hf_state(tiny_dir)
    pub = convert.load_hf_state(fp32.export_hf(tmp_path / "pub_fp32"))
    assert all(torch.equal(pub[k], src[k].to(BF16)) for k in src)
    fp32.save(tmp_path / "ckpt32")
    assert all(
        torch.equal(v, src[k]) for k, v in convert.load_hf_state(tmp_path / "ckpt32/model").items()
    )
    with pytest.raises(ValueError, match="saved with dtype bfloat16"):
        fp32.load(tmp_path / "ckpt")


def test_bf16_nonfinite_batch_is_skipped(megatron_dist, tiny_dir):
    actor = MegatronActor(str(tiny_dir), dtype="bfloat16", num_minibatches=2, **KW)
    clean = _batch(seed=6)
    actor.step(clean)
    main = _main_hf(actor)
    # main weights, Adam state, bf16 parameters bit-identical over a skipped step
    actor_state = [m.detach().clone() for m in actor.main.params]
    metrics = actor.step(plant_nonfinite(clean, "advantages"))
    assert metrics["loss/nonfinite_skipped"] == 1.0
    assert all(torch.equal(a, m) for a, m in zip(actor_state, actor.main.params, strict=True))
    assert all(m.grad is None for m in actor.main.params)
    assert all(torch.equal(v, main[k]) for k, v in _main_hf(actor).items())
    # and the shared check (weights, optimizer state, gradients, a clean step after)
    check_nonfinite_step_is_skipped(actor, clean, plant_nonfinite(clean, "rollout_logp"))


@pytest.mark.slow  # ~15 s; tp2 in fp32: tests/test_megatron_tp.py
def test_bf16_tp2_matches_one_rank(megatron_dist, tiny_dir, tmp_path):
    """tp = 2 through torchrun: fp32 gradient sums over the TP group (norms, router) and the
    clip norm over the shards, against one rank in bf16. The TP split changes bf16 rounding
    (each rank's matmuls are half as wide), so the bounds are the bf16 ones, not 1e-5."""
    kw = dict(KW, r3=True)  # one minibatch: one Adam step (the sign criterion above)
    batch = collate(*make_samples(n=7, seed=3), 0, need_routes=True)
    one = MegatronActor(str(tiny_dir), dtype="bfloat16", **kw)
    launch = dict(nproc_per_node=2, tp=2, dtype="bfloat16", export_dtype="bfloat16")
    with megatron_trainer(tiny_dir, tmp_path / "w", **launch, **kw) as tr:
        real = batch.attention_mask.bool()
        lp = (tr.logprobs(batch) - one.logprobs(batch))[real].abs()
        assert lp.max().item() <= BF16_LOGP_MAX
        two_m, one_m = tr.step(batch), one.step(batch)
        for key in ("loss/policy", "loss/grad_norm", "loss/entropy"):
            assert two_m[key] == pytest.approx(one_m[key], rel=BF16_REL), key
        pub = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 1))
        tr.save(tmp_path / "ckpt")
    assert all(v.dtype == BF16 for v in pub.values())
    main = convert.load_hf_state(tmp_path / "ckpt" / "model")
    ref = _main_hf(one)
    diffs = torch.cat([(main[k] - ref[k]).abs().reshape(-1) for k in ref])
    assert diffs.max().item() <= 2 * LR + 1e-7
    agree = (diffs <= 1e-7).double().mean().item()
    assert agree >= SIGN_AGREE
    print(
        f"bf16 tp2 vs one rank: log-probs {lp.max():.1e}, weights max {diffs.max():.1e}, "
        f"equal updates {agree:.1%}"
    )


@pytest.mark.slow
def test_sat_train_megatron_bf16(tmp_path):
    """`sat train trainer=megatron trainer.dtype=bfloat16 max_steps=2` end to end, with a bf16
    engine: published weights are bf16, the checkpoint's model/ the fp32 main weights."""
    from cli_helpers import MEGATRON_SMOKE, run_sat

    out = run_sat(
        "train",
        *MEGATRON_SMOKE,
        "run.name=bf16",
        "trainer.dtype=bfloat16",
        "engine.dtype=bfloat16",
        "max_steps=2",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = tmp_path / "runs/sat/bf16/checkpoints/step_2/trainer"
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["step_count"] == 2
    assert all(v.dtype == torch.float32 for v in convert.load_hf_state(ckpt / "model").values())
    published = sorted((tmp_path / "runs/sat/bf16").glob("**/weights/v*/config.json"))
    assert published, "no published weights left to inspect"
    for folder in (p.parent for p in published):
        assert all(v.dtype == torch.bfloat16 for v in convert.load_hf_state(folder).values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_portable_numerics_steps_megatron_with_the_fused_adamw(megatron_dist, tiny_dir, dtype):
    """run.portable_numerics reaches the Megatron actor too (trainers/step.py): its AdamW over
    the model's (fp32) or the main (bf16) weights is the fused CPU kernel, and a step gives the
    default AdamW's weights up to the square root's last bit: within 1e-8, 1e-4 of the step."""
    portable = MegatronActor(str(tiny_dir), dtype=dtype, portable_numerics=True, **KW)
    plain = MegatronActor(str(tiny_dir), dtype=dtype, **KW)
    assert portable.opt.param_groups[0]["fused"] is True
    assert plain.opt.param_groups[0]["fused"] is None
    batch = _batch()
    a, b = portable.step(batch), plain.step(batch)
    assert a["loss/policy"] == b["loss/policy"]  # the same forward, before either update
    moved = 0.0
    for (n, p), (_, q) in zip(
        portable.hf_state(main=True).items(), plain.hf_state(main=True).items(), strict=True
    ):
        assert (p - q).abs().max().item() <= 1e-8, n  # a few ulps of the weights
        moved = max(moved, (p - convert.load_hf_state(tiny_dir)[n]).abs().max().item())
    assert moved >= 0.9 * LR
