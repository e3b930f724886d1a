"""The local engine: log-prob parity with the trainer, sampling semantics, weights, failures."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from sat_cli.engines.base import EngineError, RolloutEngine, SamplingParams
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.engines.local.worker import filtered_logprobs
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

# the module's engine and checkpoint are built once: its tests run on one xdist worker
pytestmark = pytest.mark.xdist_group("local_engine")

# mixed prompt lengths, so generation is left-padded
PROMPTS = [[20, 21, 22, 14, 23, 24, 25, 32], [40, 41, 14, 42, 32], [50, 32], list(range(3, 20))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(7), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "engine.log"
    eng = LocalEngine(
        LocalEngineSettings(), LocalEngineRuntime(str(ckpt), r3=True, seed=5, log_file=str(log))
    )
    yield eng
    eng.close()
    # the worker answered close and exited by itself (os._exit(0) after flushing its log), not
    # by the finalizer's SIGTERM (exit code -15)
    assert eng._proc.exitcode == 0


def flat(groups):
    return [s for g in groups for s in g]


def test_filtered_logprobs_hand_cases():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top_k=2: softmax over {2, 1}: log(e^2 / (e^2 + e)) = -log(1 + e^-1) = -0.31326
    lp = filtered_logprobs(logits, 1.0, 1.0, 2)
    assert lp[0, 0].item() == pytest.approx(-math.log1p(math.exp(-1)), abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(-1 - math.log1p(math.exp(-1)), abs=1e-6)
    assert torch.isinf(lp[0, 2:]).all()
    # top_p=0.7: probs 0.6439, 0.2369, 0.0871, 0.0321; mass before each: 0, .644, .881, .968
    # -> keep the first two (mass before < 0.7), same as top_k=2
    torch.testing.assert_close(filtered_logprobs(logits, 1.0, 0.7, -1), lp)
    # top_p=0.6: the first token alone reaches 0.6 -> a point mass
    assert filtered_logprobs(logits, 1.0, 0.6, -1)[0, 0].item() == 0.0
    # temperature 2, no filter: log_softmax([1, .5, 0, -.5])
    ref = torch.log_softmax(logits / 2, -1)
    torch.testing.assert_close(filtered_logprobs(logits, 2.0, 1.0, -1), ref)


def test_engine_implements_the_interface(engine):
    assert isinstance(engine, RolloutEngine) and engine.health()


@pytest.mark.parametrize("r3", [False, True])
def test_engine_logp_equals_trainer_recompute(engine, ckpt, r3):
    # stopping on 17 of the 128 ids gives mixed response lengths (right padding in training)
    sp = SamplingParams(
        temperature=1.0, max_new_tokens=14, seed=1, stop_token_ids=tuple(range(3, 20))
    )
    samples = flat(engine.generate(PROMPTS, 3, sp))
    assert len(samples) == 12 and len({s.response_len for s in samples}) >= 3
    batch = collate(samples, [1.0] * len(samples), pad_id=0, need_routes=r3)
    trainer = LocalTrainer(str(ckpt), r3=r3, temperature=1.0)
    lp = trainer.logprobs(batch)
    m = batch.loss_mask.bool()
    assert int(m.sum()) == sum(s.response_len for s in samples)
    assert (lp - batch.rollout_logp)[m].abs().max() <= 1e-5
    # the reported numbers are real log-probs of a 128-way distribution, not zeros
    assert batch.rollout_logp[m].mean() < -1.0


def test_temperature_and_top_k_logp_is_the_filtered_distribution(engine, ckpt):
    sp = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=10, seed=2)
    samples = flat(engine.generate(PROMPTS[:2], 2, sp))
    batch = collate(samples, [0.0] * len(samples), pad_id=0)
    trainer = LocalTrainer(str(ckpt))
    with torch.no_grad():
        logits = trainer.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits[:, :-1]
    z = logits / 0.7
    kth = z.topk(5, dim=-1).values[..., -1:]
    ref = torch.log_softmax(z.masked_fill(z < kth, -math.inf), -1)
    ref = ref.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    m = batch.loss_mask.bool()[:, 1:]
    assert (ref - batch.rollout_logp[:, 1:])[m].abs().max() <= 1e-5
    assert torch.isfinite(batch.rollout_logp[:, 1:][m]).all()


def test_sampling_mask_replay_reproduces_mu_and_the_sampler_top_k(engine, ckpt, monkeypatch):
    """Top-p and top-k sampling, fp32 engine and trainer on the same weights (lag 0): with
    ``replay_sampling_mask`` the trainer's log-probs equal ``rollout_logp``; without, they differ
    by the log of the kept mass. The step hands the loss the policy's log-probs at the
    sampler's top-k (with gradient), equal to the sampler's own (tests/test_mask_replay.py)."""
    from sat_cli.trainers import step as step_mod

    T = 0.8
    cases = {"top_p": dict(top_p=0.8), "top_k": dict(top_k=5)}
    batches = {
        name: collate(
            [
                s
                for g in engine.generate(
                    PROMPTS[:3],
                    2,
                    SamplingParams(
                        temperature=T,
                        max_new_tokens=8,
                        seed=4,
                        sampling_mask=True,
                        topk_logprobs=3,
                        **kw,
                    ),
                )
                for s in g
            ],
            [1.0, -1.0] * 3,
            pad_id=0,
            need_mask=True,
            need_topk=3,
        )
        for name, kw in cases.items()
    }
    # fp32 engine and trainer, the same weights (lag 0)
    tr = LocalTrainer(str(ckpt), temperature=T, replay_sampling_mask=True, score_centering_topk=3)
    for name, batch in batches.items():
        m = batch.loss_mask.bool()
        tr.replay_sampling_mask = True
        lp_on = tr.logprobs(batch)
        assert (lp_on - batch.rollout_logp)[m].abs().max() <= 1e-5, name
        tr.replay_sampling_mask = False
        lp_off = tr.logprobs(batch)
        # replay off: the trainer's full softmax differs from mu by log(kept mass)
        with torch.no_grad():
            logits = tr.model.get_output_embeddings()(tr._hidden(tr.model, batch))
            p = torch.softmax(logits[:, :-1].double() / T, -1)
        kept = batch.sampling_mask[:, 1:].long()
        mass = torch.where(kept >= 0, p.gather(-1, kept.clamp(min=0)), 0.0).sum(-1)
        gap = (lp_off - batch.rollout_logp)[:, 1:][m[:, 1:]].double()
        torch.testing.assert_close(gap, mass.log()[m[:, 1:]], atol=1e-5, rtol=0)
        assert gap.min() < -1e-2, name  # a real mismatch without the replay
    # the top-k channel in the step: with grad, equal to the sampler's at the same weights
    seen: dict = {}

    def spy(cfg, inputs, _real=step_mod.registry.compute):
        seen["x"] = inputs
        return _real(cfg, inputs)

    monkeypatch.setattr(step_mod.registry, "compute", spy)
    tr.replay_sampling_mask = True
    batch = batches["top_k"]
    tr.step(batch)
    x, m = seen["x"], batch.loss_mask.bool()
    assert x.policy_topk_logp.requires_grad and not x.sampler_topk_logp.requires_grad
    assert torch.equal(x.topk_valid, (batch.topk_ids >= 0) & m[..., None])
    diff = (x.policy_topk_logp.detach() - x.sampler_topk_logp)[x.topk_valid].abs().max()
    assert diff <= 1e-5


def test_seeded_sampling_and_stop_tokens(engine):
    sp = SamplingParams(max_new_tokens=12, seed=9)
    a, b = flat(engine.generate(PROMPTS, 2, sp)), flat(engine.generate(PROMPTS, 2, sp))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.rollout_logp for s in a] == [s.rollout_logp for s in b]
    c = flat(engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=12, seed=10)))
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    for s in a:
        assert s.finish_reason == ("stop" if s.response_ids[-1] == 1 else "length")
        assert s.finish_reason == "stop" or s.response_len == 12
        assert 1 not in s.response_ids[:-1]
    # every id is a stop token: each response is one token long and finishes with "stop"
    stop_all = SamplingParams(max_new_tokens=12, seed=9, stop_token_ids=tuple(range(128)))
    for s in flat(engine.generate(PROMPTS, 1, stop_all)):
        assert s.response_len == 1 and s.finish_reason == "stop"
        T = len(s.prompt_ids) + 1
        assert s.routed_experts.shape == (T - 1, 4, 2)
    # generate_async returns a future, groups come back in prompt order
    fut = engine.generate_async(PROMPTS, 2, sp)
    groups = fut.result(timeout=60)
    assert [g[0].prompt_ids for g in groups] == PROMPTS
    assert [s.response_ids for s in flat(groups)] == [s.response_ids for s in a]


def test_publish_and_update_weights_switches_the_engine_to_the_trainer_model(
    engine, ckpt, tmp_path
):
    sp = SamplingParams(max_new_tokens=10, seed=4)
    before = flat(engine.generate(PROMPTS, 2, sp))
    assert {s.weight_version for s in before} == {0}
    trainer = LocalTrainer(str(ckpt), lr=3e-2)
    batch = collate(before, [1.0, -1.0] * 4, pad_id=0)
    trainer.step(batch)
    path = trainer.publish_weights(tmp_path / "weights", version=1)
    assert path == tmp_path / "weights" / "v1"
    engine.update_weights(str(path), 1)
    after = flat(engine.generate(PROMPTS, 2, sp))
    assert {s.weight_version for s in after} == {1}
    assert [s.rollout_logp for s in after] != [s.rollout_logp for s in before]
    # the engine now samples from the trainer's model: its log-probs match the recompute
    b2 = collate(after, [0.0] * 8, pad_id=0)
    m = b2.loss_mask.bool()
    assert (trainer.logprobs(b2) - b2.rollout_logp)[m].abs().max() <= 1e-5
    # and switching back reproduces the first samples exactly (same seed, same weights)
    engine.update_weights(str(ckpt), 0)
    again = flat(engine.generate(PROMPTS, 2, sp))
    assert [s.response_ids for s in again] == [s.response_ids for s in before]
    assert [s.rollout_logp for s in again] == [s.rollout_logp for s in before]


def test_worker_exception_is_engine_error_and_engine_survives(engine):
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate([[]], 1, SamplingParams(max_new_tokens=2))
    assert engine.health()
    assert len(flat(engine.generate([[20]], 1, SamplingParams(max_new_tokens=2, seed=0)))) == 1


def test_bf16_engine_and_dead_engine_raises_promptly(ckpt):
    eng = LocalEngine(LocalEngineSettings(dtype="bfloat16"), LocalEngineRuntime(str(ckpt), seed=0))
    try:
        samples = flat(eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, seed=1)))
        batch = collate(samples, [0.0] * 8, pad_id=0)
        m = batch.loss_mask.bool()
        d = (LocalTrainer(str(ckpt)).logprobs(batch) - batch.rollout_logp)[m].abs()
        # bf16 numerics: a real but small mismatch against the fp32 trainer
        assert 1e-4 < d.mean() < 0.1
        # kill the worker in the middle of a long request: the future fails within seconds
        fut = eng.generate_async(PROMPTS * 16, 8, SamplingParams(max_new_tokens=200, seed=1))
        time.sleep(0.5)
        os.kill(eng.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="died"):
            fut.result(timeout=30)
        assert time.monotonic() - t0 < 5
        assert not eng.health()
        with pytest.raises(EngineError):
            eng.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
    finally:
        eng.close()


def test_startup_failure_is_engine_error(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="engine startup"):
        LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(tmp_path / "no_such_checkpoint")))
    assert time.monotonic() - t0 < 60


def with_extra_eos(src, dst, extra: int):
    """A copy of the checkpoint ``src`` whose generation_config names a second EOS id."""
    import json
    import shutil

    shutil.copytree(src, dst)
    gen_path = dst / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen["eos_token_id"] = [
        int(json.loads((dst / "config.json").read_text())["eos_token_id"]),
        extra,
    ]
    gen_path.write_text(json.dumps(gen))
    return dst


def first_stop_rule_holds(samples, stop_ids) -> None:
    """Each response ends at its first stop token (which it keeps) or runs to the length limit."""
    for s in samples:
        hits = [i for i, t in enumerate(s.response_ids) if t in stop_ids]
        if s.finish_reason == "stop":
            assert hits and hits[0] == len(s.response_ids) - 1, s.response_ids
        else:
            assert not hits, s.response_ids


def test_the_stop_rule_is_sglangs_union_of_eos_ids(engine, ckpt, tmp_path):
    # SGLang stops on config.json eos | generation_config.json eos | the tokenizer's eos | the
    # request's stop ids; the local engine does the same (sat_cli/models/stopping.py).
    from sat_cli.models.stopping import model_stop_ids

    # the module's engine serves ckpt (version 0) between tests; the seeded request picks a
    # token it samples often mid-response, with no second engine to start
    assert engine.weight_version == 0
    sampling = SamplingParams(max_new_tokens=12, seed=3)
    counts: dict[int, int] = {}
    for s in flat(engine.generate(PROMPTS, 8, sampling)):
        for t in s.response_ids[:-1]:
            counts[t] = counts.get(t, 0) + 1
    extra = max(counts, key=counts.get)  # a token the model samples often mid-response
    two = with_extra_eos(ckpt, tmp_path / "m2", extra)
    assert model_stop_ids(two) == {1, extra}
    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(two), seed=1)) as eng:
        samples = flat(eng.generate(PROMPTS, 8, sampling))
    first_stop_rule_holds(samples, {1, extra})
    assert sum(s.response_ids[-1] == extra for s in samples) >= 3


def test_update_weights_refuses_incomplete_weights_and_keeps_serving(engine, ckpt, tmp_path):
    """Weights loaded mid-run are checked like a model folder (issue 16): a published version
    without lm_head is refused (transformers would initialise it at random), naming the tensor;
    the engine keeps its weights and its version and goes on sampling the same samples."""
    import shutil

    from safetensors.torch import load_file, save_file

    sp = SamplingParams(max_new_tokens=6, seed=3)
    before = flat(engine.generate(PROMPTS, 1, sp))
    bad = tmp_path / "v9"
    shutil.copytree(ckpt, bad)
    sd = load_file(str(bad / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"missing: 'lm_head\.weight'"):
        engine.update_weights(str(bad), 9)
    after = flat(engine.generate(PROMPTS, 1, sp))
    assert {s.weight_version for s in after} == {0}
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
