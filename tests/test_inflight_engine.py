"""In-flight weight updates of the local engine (issue 17): a response generated across an update
carries both versions, and every token's log-prob is the recompute under its own version."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from sat_cli.engines.base import EngineError, SamplingParams
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.models.r3 import RouteCapture
from sat_cli.models.tiny_moe import build_char_tokenizer, load_model, save_hf

# the module's two engines and perturbed weights are built once: its tests run on one xdist
# worker (split over two, each worker started its own engines)
pytestmark = pytest.mark.xdist_group("inflight_engine")

# mixed prompt lengths, so generation is left-padded
PROMPTS = [[20, 21, 22, 14, 23, 24, 25, 32], [40, 41, 14, 42, 32], [50, 32], list(range(3, 20))]
SWITCH_AT = 5  # tokens 0..4 from the old weights, 5.. from the new
TEMPERATURE = 0.8


def flat(groups):
    return [s for g in groups for s in g]


@pytest.fixture(scope="module")
def weights(tiny_dir, tmp_path_factory):
    """``{"v0": the tiny checkpoint, "v1": its deterministic perturbation}`` (HF folders)."""
    model = load_model(tiny_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=gen))
    v1 = save_hf(model, build_char_tokenizer(), tmp_path_factory.mktemp("v1") / "model")
    return {"v0": str(tiny_dir), "v1": str(v1)}


@pytest.fixture(scope="module")
def engine(weights):
    with LocalEngine(
        LocalEngineSettings(),
        LocalEngineRuntime(weights["v0"], r3=True, seed=5, inflight_updates=True),
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def plain(weights):
    with LocalEngine(
        LocalEngineSettings(), LocalEngineRuntime(weights["v0"], r3=True, seed=5)
    ) as eng:
        yield eng


_models: dict[str, torch.nn.Module] = {}


def model_at(path: str):
    if path not in _models:
        _models[path] = load_model(path)
    return _models[path]


def recompute(sample, path: str, temperature: float = TEMPERATURE):
    """Per-token log-probs ``[R]`` and routes ``[P + R - 1, L, K]`` of a plain forward of
    prompt + response under the weights at ``path`` (one unpadded sequence, fp32)."""
    model = model_at(path)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    P, R = len(sample.prompt_ids), sample.response_len
    with torch.no_grad(), RouteCapture(model) as cap:
        logits = model(input_ids=ids).logits[0].float()
        routes = cap.last_call()
    logp = torch.log_softmax(logits[P - 1 : P + R - 1] / temperature, -1)
    return logp.gather(-1, ids[0, P:, None]).squeeze(-1), routes[: P + R - 1].numpy()


def max_logp_error(samples, path_of: dict[int, str]) -> float:
    """Largest |rollout_logp[t] - recompute under token_versions[t]| over all tokens."""
    worst = 0.0
    for s in samples:
        versions = s.token_versions or [s.weight_version] * s.response_len
        got = torch.tensor(s.rollout_logp, dtype=torch.float32)
        for path in sorted({path_of[v] for v in versions}):  # one forward per weights folder
            ref, _ = recompute(s, path)
            on = torch.tensor([path_of[u] == path for u in versions])
            worst = max(worst, float((got - ref)[on].abs().max()))
    return worst


def to_version(engine, path: str) -> int:
    """Load ``path`` as the next version (versions only go up) and return it."""
    version = engine.weight_version + 1
    engine.update_weights(path, version)
    assert engine.weight_version == version
    return version


@pytest.mark.slow  # ~15 s; the scheduled switch keeps the class
def test_no_update_is_the_default_engine_bit_for_bit(engine, plain, weights):
    to_version(engine, weights["v0"])
    to_version(plain, weights["v0"])
    for sp in (
        SamplingParams(temperature=TEMPERATURE, max_new_tokens=14, seed=1),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=10, seed=2),
    ):
        a, b = flat(plain.generate(PROMPTS, 3, sp)), flat(engine.generate(PROMPTS, 3, sp))
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert [s.rollout_logp for s in a] == [s.rollout_logp for s in b]
        assert all((x.routed_experts == y.routed_experts).all() for x, y in zip(a, b, strict=True))
        assert {s.token_versions is None for s in b} == {True}
        assert {s.weight_version for s in a} == {s.weight_version for s in b} == {1}


def test_scheduled_update_switches_at_the_requested_token(engine, plain, weights):
    base = to_version(engine, weights["v0"])
    plain.update_weights(weights["v0"], plain.weight_version + 1)
    new = base + 1
    sp = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, seed=3)
    mixed = flat(engine.generate(PROMPTS, 2, sp, updates=[(SWITCH_AT, weights["v1"], new)]))
    assert engine.weight_version == new
    old_only = flat(plain.generate(PROMPTS, 2, sp))
    long = [s for s in mixed if s.response_len > SWITCH_AT]
    assert len(long) >= 6
    for s in mixed:
        assert s.weight_version == base
        if s.response_len > SWITCH_AT:
            assert s.token_versions == [base] * SWITCH_AT + [new] * (s.response_len - SWITCH_AT)
        else:
            assert s.token_versions is None
    # the tokens before the switch are exactly those of the old weights alone; after, they differ
    for s, o in zip(mixed, old_only, strict=True):
        assert s.response_ids[:SWITCH_AT] == o.response_ids[:SWITCH_AT]
        assert s.rollout_logp[:SWITCH_AT] == o.rollout_logp[:SWITCH_AT]
    pairs = list(zip(mixed, old_only, strict=True))
    assert any(s.rollout_logp[SWITCH_AT:] != o.rollout_logp[SWITCH_AT:] for s, o in pairs)
    # every token's log-prob is the recompute under the version that sampled it
    err = max_logp_error(mixed, {base: weights["v0"], new: weights["v1"]})
    assert err <= 1e-5
    # and not under the other version (the check can tell the versions apart)
    assert max_logp_error(long, {base: weights["v1"], new: weights["v1"]}) > 1e-2
    # R3: rows up to the switch are the old forwards' (bit-identical to the plain engine), the
    # rest the new weights' routing
    for s, o in [(s, o) for s, o in pairs if s.response_len > SWITCH_AT]:
        cut = len(s.prompt_ids) + SWITCH_AT - 1  # the last old-weights token is fed by the new
        assert s.routed_experts.shape == (len(s.prompt_ids) + s.response_len - 1, 4, 2)
        assert (s.routed_experts[:cut] == o.routed_experts[:cut]).all()
        _, new_routes = recompute(s, weights["v1"])
        assert (s.routed_experts[cut:] == new_routes[cut:]).all()


@pytest.mark.slow  # ~9 s
def test_update_before_the_first_token_and_after_the_end(engine, weights):
    base = to_version(engine, weights["v0"])
    sp = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=4)
    first = flat(engine.generate(PROMPTS, 1, sp, updates=[(0, weights["v1"], base + 1)]))
    assert {s.weight_version for s in first} == {base + 1}
    assert {s.token_versions is None for s in first} == {True}
    assert max_logp_error(first, {base + 1: weights["v1"]}) <= 1e-5
    # an update the request never reaches is loaded after it
    late = flat(engine.generate(PROMPTS, 1, sp, updates=[(99, weights["v0"], base + 2)]))
    assert {s.weight_version for s in late} == {base + 1} and engine.weight_version == base + 2
    assert max_logp_error(late, {base + 1: weights["v1"]}) <= 1e-5


def test_concurrent_updates_from_another_thread(engine, weights):
    """update_weights from another thread while a long request runs: each response's versions
    go up, and every token's log-prob matches its version's recompute."""
    base = to_version(engine, weights["v0"])
    path_of = {base: weights["v0"]}
    fut = engine.generate_async(
        PROMPTS, 8, SamplingParams(temperature=TEMPERATURE, max_new_tokens=96, seed=5)
    )

    def updater():
        v = base
        while not fut.done() and v < base + 12:
            v += 1
            path_of[v] = weights["v1"] if v % 2 else weights["v0"]
            engine.update_weights(path_of[v], v)
            time.sleep(0.02)

    t = threading.Thread(target=updater)
    t.start()
    samples = flat(fut.result(timeout=120))
    t.join(60)
    assert engine.weight_version == max(path_of) > base
    mixed = [s for s in samples if s.token_versions is not None]
    assert len(mixed) >= 4, [s.response_len for s in samples]
    for s in mixed:
        assert s.token_versions == sorted(s.token_versions)
        assert s.token_versions[0] == s.weight_version
        assert len(s.token_versions) == s.response_len
    assert max(len(set(s.token_versions)) for s in mixed) >= 2
    assert max_logp_error(samples, path_of) <= 1e-5


def test_idle_updates_newest_wins_and_versions_only_go_up(engine, weights):
    base = to_version(engine, weights["v0"])
    engine.update_weights(weights["v1"], base + 1)
    engine.update_weights(weights["v0"], base + 2)  # in quick succession: the newest wins
    with pytest.raises(ValueError, match="backwards"):
        engine.update_weights(weights["v1"], base + 1)
    sp = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=6)
    samples = flat(engine.generate(PROMPTS, 1, sp))
    assert {s.weight_version for s in samples} == {base + 2}
    assert max_logp_error(samples, {base + 2: weights["v0"]}) <= 1e-5
    # a scheduled update that goes backwards fails the request; the engine keeps serving
    with pytest.raises(EngineError, match="backwards"):
        engine.generate(PROMPTS, 1, sp, updates=[(2, weights["v1"], base)])
    assert engine.health() and engine.weight_version == base + 2
    # the answer to a call that stopped waiting (e.g. interrupted) is not taken for the next one
    engine._ctrl.send(("update_weights", {"path": weights["v1"], "version": base + 3, "id": -1}))
    with pytest.raises(EngineError, match="backwards"):
        engine.update_weights(weights["v0"], base + 2)  # the worker is at base + 3 by now
    engine.update_weights(weights["v0"], base + 4)
    assert engine.weight_version == base + 4


def test_bad_weights_mid_request_are_engine_errors_and_the_request_goes_on(
    engine, weights, tmp_path
):
    from safetensors.torch import load_file, save_file

    base = to_version(engine, weights["v0"])
    broken = tmp_path / "broken"
    shutil.copytree(weights["v1"], broken)
    sd = load_file(str(broken / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    fut = engine.generate_async(
        PROMPTS, 8, SamplingParams(temperature=TEMPERATURE, max_new_tokens=64, seed=7)
    )
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="does not exist"):
        engine.update_weights(str(tmp_path / "missing"), base + 1)
    with pytest.raises(EngineError, match=r"missing: 'lm_head\.weight'"):
        engine.update_weights(str(broken), base + 1)
    assert time.monotonic() - t0 < 30
    samples = flat(fut.result(timeout=120))
    assert {s.weight_version for s in samples} == {base} and engine.weight_version == base
    assert {s.token_versions is None for s in samples} == {True}
    assert max_logp_error(samples[:8], {base: weights["v0"]}) <= 1e-5
    # a scheduled update from a bad folder fails its request, naming the folder
    with pytest.raises(EngineError, match="missing"):
        engine.generate(
            PROMPTS,
            1,
            SamplingParams(max_new_tokens=4),
            updates=[(1, str(tmp_path / "missing"), base + 1)],
        )
    assert engine.health()
    engine.update_weights(weights["v1"], base + 1)  # and later updates still work
    assert engine.weight_version == base + 1


@pytest.mark.slow  # ~9 s
def test_keep_cache_mode(weights, engine):
    """``inflight_cache="keep"``: no re-prefill. Tokens before the switch are those of the
    recompute mode; after it the log-prob is the distribution sampled from (new weights over the
    old cache), which a single-version recompute does not reproduce."""
    base = to_version(engine, weights["v0"])
    sp = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, seed=3)
    upd = [(SWITCH_AT, weights["v1"], base + 1)]
    exact = flat(engine.generate(PROMPTS, 2, sp, updates=upd))
    with LocalEngine(
        LocalEngineSettings(),
        LocalEngineRuntime(
            weights["v0"], seed=5, inflight_updates=True, inflight_cache="keep", weight_version=base
        ),
    ) as keep:
        kept = flat(keep.generate(PROMPTS, 2, sp, updates=upd))
    for s, k in zip(exact, kept, strict=True):
        assert k.response_ids[:SWITCH_AT] == s.response_ids[:SWITCH_AT]
        assert k.rollout_logp[:SWITCH_AT] == s.rollout_logp[:SWITCH_AT]
        if k.response_len > SWITCH_AT:
            after = k.response_len - SWITCH_AT
            assert k.token_versions == [base] * SWITCH_AT + [base + 1] * after
    long = [(s, k) for s, k in zip(exact, kept, strict=True) if s.response_len > SWITCH_AT]
    diff = max(abs(s.rollout_logp[SWITCH_AT] - k.rollout_logp[SWITCH_AT]) for s, k in long)
    assert diff > 1e-3
    with pytest.raises(ValueError, match="inflight_cache"):
        LocalEngine(
            LocalEngineSettings(),
            LocalEngineRuntime(weights["v0"], inflight_updates=True, inflight_cache="stale"),
        )


def test_updates_need_the_inflight_flag(plain, weights):
    with pytest.raises(ValueError, match="inflight_updates=True"):
        plain.generate_async(PROMPTS, 1, SamplingParams(), updates=[(1, weights["v1"], 9)])
