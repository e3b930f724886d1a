"""Adapter-only weight sync (``trainer.lora``): the real local engine holds one adapter per
weight version on its base, every request names its adapter, each adapter is checked on
arrival (a damaged one is refused and the run fails closed), and a lag-profile run gets every
sample from the version the profile drew without any full weight reload."""

from __future__ import annotations

import shutil

import pytest
import torch

from sat_cli.engines.base import SamplingParams
from sat_cli.errors import EngineError
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
PROMPT = [20, 21, 22, 14]


def _engine(path, keep: int):
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    return LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(path), adapters_kept=keep))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """One real local engine on the tiny base for the module, holding 2 adapters at most."""
    with _engine(tiny_dir, keep=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def published(tiny_dir, tmp_path_factory, engine):
    """A LoRA trainer's versions 0..3 as adapter folders (each step on samples of the version
    before, from the real engine), and the trainer at v3."""
    weights = tmp_path_factory.mktemp("lora") / "weights"
    trainer = LocalTrainer(str(tiny_dir), lr=1e-2, lora=LORA)
    trainer.publish_weights(weights, 0)
    for v in range(1, 4):
        engine.update_weights(str(weights / f"v{v - 1}"), v - 1)
        group = engine.generate([PROMPT], 4, SamplingParams(max_new_tokens=4, seed=v))[0]
        trainer.step(collate(group, [1.0, -1.0, 0.5, -0.5], pad_id=0))
        trainer.publish_weights(weights, v)
    return weights, trainer


def test_a_version_is_its_adapter_alone_and_the_engine_serves_it_exactly(
    tiny_dir, published, engine
):
    """v3 on disk is an adapter (no base tensor); the engine takes it without reloading the
    base, names it per request, serves the checksums the trainer wrote, and its sampled
    log-probs are the trainer's at v3 (the log-prob probe)."""
    from sat_cli.loop.transports import disk_checksums as _disk_sums
    from sat_cli.weightsync.adapters import ADAPTER_FILE, read_adapter
    from sat_cli.weightsync.layouts import compare

    weights, trainer = published
    files = sorted(p.name for p in (weights / "v3").iterdir())
    assert files == ["adapter_config.json", ADAPTER_FILE]
    config, tensors = read_adapter(weights / "v3", 3)
    assert config["version"] == 3 and len(tensors) == 4 * trainer.model.config.num_hidden_layers
    assert all(".lora_A." in n or ".lora_B." in n for n in tensors)
    engine.update_weights(str(weights / "v3"), 3)
    assert engine.adapter == 3 and engine.full_reloads == 0
    served = engine.served_checksums()["the local engine"]
    assert compare(_disk_sums(weights / "v3", "hf", "float32"), served) == []
    group = engine.generate([PROMPT, [40, 41]], 2, SamplingParams(max_new_tokens=5, seed=1))
    samples = [s for g in group for s in g]
    assert {s.weight_version for s in samples} == {3}
    batch = collate(samples, [0.0] * 4, pad_id=0)
    m = batch.loss_mask.bool()
    gap = (trainer.logprobs(batch) - batch.rollout_logp)[m].abs().max()
    assert float(gap) < 1e-5
    base_trainer = LocalTrainer(str(tiny_dir))
    base = base_trainer.logprobs(batch)  # the base alone is far from v3
    assert float((base - batch.rollout_logp)[m].abs().max()) > 1e-3
    # one request, an adapter per prompt: v3's rows score as the trainer at v3, v0's (the
    # base the engine started on) as the base
    sampling = SamplingParams(max_new_tokens=5, seed=2)
    mixed = engine.generate([PROMPT, [40, 41]], 2, sampling, adapters=[3, 0])
    assert [[s.weight_version for s in g] for g in mixed] == [[3, 3], [0, 0]]
    for group, scorer in zip(mixed, (trainer, base_trainer), strict=True):
        b = collate(group, [0.0, 0.0], pad_id=0)
        mask = b.loss_mask.bool()
        assert float((scorer.logprobs(b) - b.rollout_logp)[mask].abs().max()) < 1e-5


def test_the_engine_keeps_the_newest_versions_and_each_request_names_its_own(published, engine):
    weights, _ = published
    sampling = SamplingParams(max_new_tokens=4, seed=9)
    out = {}
    for v in (1, 2, 3):
        engine.update_weights(str(weights / f"v{v}"), v)
        out[v] = engine.generate([PROMPT], 2, sampling)[0]
        assert {s.weight_version for s in out[v]} == {v}
    assert engine._call("ping")["full_loads"] == 0 and engine.full_reloads == 0
    assert engine.adapters_held == [2, 3]  # keep 2: v1 dropped
    # asked again, v1 is read from disk again: the same adapter gives the same samples
    engine.update_weights(str(weights / "v1"), 1)
    assert engine.adapters_held == [1, 3]  # the oldest one not in use went
    again = engine.generate([PROMPT], 2, sampling)[0]
    assert [s.response_ids for s in again] == [s.response_ids for s in out[1]]
    assert [s.response_ids for s in out[3]] != [s.response_ids for s in out[1]]
    # a request naming an adapter the engine does not hold fails: no silent fallback
    engine.adapter = 2
    with pytest.raises(EngineError, match=r"names adapter v2, which the engine does not"):
        engine.generate([PROMPT], 1, sampling)
    assert engine.full_reloads == 0


def _damage(folder, version: int):
    from sat_cli.weightsync.adapters import ADAPTER_FILE

    f = folder / f"v{version}" / ADAPTER_FILE
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor's data
    f.write_bytes(bytes(data))


def test_a_damaged_adapter_is_refused_and_the_run_fails_closed(published, engine, tmp_path):
    """A bit flipped in v2's tensors: the engine refuses it on arrival and keeps serving v1;
    the loop's weight sync tries the disk once more, then fails the run (WeightSyncFailed,
    exit 1). An adapter that claims another version is refused the same way."""
    from sat_cli.loop.weightsync import SyncSettings, WeightSync, WeightSyncFailed

    weights, _ = published
    bad = tmp_path / "weights"
    shutil.copytree(weights, bad)
    _damage(bad, 2)
    shutil.rmtree(bad / "v3")
    shutil.copytree(bad / "v1", bad / "v3")  # v1's adapter under v3's name
    sampling = SamplingParams(max_new_tokens=4, seed=9)
    logs: list[str] = []
    for v in (0, 1):  # the engine (keep 2) holds v0 and v1 now: v2 and v3 arrive anew
        engine.update_weights(str(bad / f"v{v}"), v)
    assert engine.adapters_held == [0, 1]
    with pytest.raises(EngineError, match=r"adapter v2 at \S+ is damaged: 1 of 16 tensors"):
        engine.update_weights(str(bad / "v2"), 2)
    with pytest.raises(EngineError, match=r"is weight version 1, not v3"):
        engine.update_weights(str(bad / "v3"), 3)
    assert engine.adapter == 1 and engine.adapters_held == [0, 1]  # nothing changed
    assert {s.weight_version for s in engine.generate([PROMPT], 2, sampling)[0]} == {1}
    sync = WeightSync(SyncSettings(verify="every"), engine, None, bad, log=logs.append)
    sync.load(1)  # an intact adapter passes the served-checksum verification
    with pytest.raises(WeightSyncFailed, match=r"weights v2 did not reach the engine"):
        sync.load(2)
    assert sync.fallbacks == 1 and "loading them from disk again" in logs[0]
    assert engine.health() and engine.full_reloads == 0


def test_an_adapter_whose_served_logprobs_are_not_the_trainers_is_refused(
    published, engine, tmp_path
):
    """The log-prob probe: v1's tensors (with their own, valid checksums) published under v2's
    name and v2's probe pass the file checks, but the engine's log-probs of the probe sequence
    are not the trainer's at v2 (float32: max |difference| 1e-3 allowed): refused, the engine
    keeps what it had, and the loop fails closed as for a checksum mismatch."""
    import json

    from sat_cli.loop.weightsync import SyncSettings, WeightSync, WeightSyncFailed
    from sat_cli.weightsync.adapters import ADAPTER_CONFIG, read_adapter, write_adapter

    weights, _ = published
    bad = tmp_path / "weights"
    shutil.copytree(weights, bad)
    config, _ = read_adapter(weights / "v2", 2)
    _, previous = read_adapter(weights / "v1", 1)
    shutil.rmtree(bad / "v2")
    write_adapter(
        bad / "v2",
        previous,
        version=2,
        rank=4,
        alpha=8.0,
        targets=["q_proj", "v_proj"],
        probe=config["probe"],
    )
    assert read_adapter(bad / "v2", 2)[0]["probe"] == config["probe"]  # the files check out
    for v in (0, 1):
        engine.update_weights(str(bad / f"v{v}"), v)
    with pytest.raises(
        EngineError,
        match=r"local engine does not serve adapter v2 the trainer "
        r"wrote: its log-probs of the probe sequence differ by max \S+ > 0.001",
    ):
        engine.update_weights(str(bad / "v2"), 2)
    assert engine.adapter == 1 and engine.adapters_held == [0, 1]  # nothing changed
    sync = WeightSync(SyncSettings(verify="every"), engine, None, bad, log=[].append)
    with pytest.raises(WeightSyncFailed, match=r"weights v2 did not reach the engine"):
        sync.load(2)
    engine.update_weights(str(weights / "v2"), 2)  # the true v2 passes its probe
    probe = json.loads((weights / "v2" / ADAPTER_CONFIG).read_text())["probe"]
    assert len(probe["ids"]) == 16 and len(probe["logprobs"]) == 15


def test_merged_weights_serve_what_the_adapter_does(tiny_dir, published, engine, tmp_path):
    """trainer.lora.sync=merged: the trainer at v3 publishes full weights W + (alpha/r) B A (an
    HF checkpoint, no adapter); an engine loading them gives the same samples as the adapter
    engine serving v3 (same seeds), with log-probs equal within 1e-5 (float32; measured
    ~1e-6: the merged matmul rounds otherwise than base + low-rank)."""
    from sat_cli.weightsync.adapters import is_adapter

    weights, trainer = published
    trainer.lora["sync"] = "merged"
    try:
        merged = trainer.publish_weights(tmp_path / "weights", 3)
    finally:
        trainer.lora["sync"] = "adapter"
    assert not is_adapter(merged) and (merged / "model.safetensors").is_file()
    assert any(".lora_A" in n for n in trainer.model.state_dict())  # the adapters are back
    sampling = SamplingParams(max_new_tokens=6, seed=11)
    engine.update_weights(str(weights / "v3"), 3)
    by_adapter = [s for g in engine.generate([PROMPT, [40, 41]], 3, sampling) for s in g]
    with _engine(tiny_dir, keep=2) as plain:
        plain.update_weights(str(merged), 3)
        by_merged = [s for g in plain.generate([PROMPT, [40, 41]], 3, sampling) for s in g]
        assert plain.adapter is None and plain.full_reloads == 1
    assert [s.response_ids for s in by_merged] == [s.response_ids for s in by_adapter]
    gap = max(
        abs(a - b)
        for x, y in zip(by_merged, by_adapter, strict=True)
        for a, b in zip(x.rollout_logp, y.rollout_logp, strict=True)
    )
    assert gap < 1e-5
    # the adapter matters: the base alone (v0, the engine's start) serves other log-probs
    base = [s for g in engine.generate([PROMPT, [40, 41]], 3, sampling, adapters=[0, 0]) for s in g]
    first = [(s.response_ids[0], s.rollout_logp[0]) for s in base]
    assert max(abs(a[1] - b.rollout_logp[0]) for a, b in zip(first, by_adapter, strict=True)) > 1e-3


class _Recording(LocalTrainer):
    """The real local trainer, recording the weight version of every sample it trains on."""

    seen: list

    def step(self, batch, diag=None):
        self.seen.append(sorted(batch.versions.tolist()))
        return super().step(batch, diag)


def test_a_lag_profile_run_with_lora_samples_every_version_the_profile_drew(
    tiny_dir, engine, tmp_path
):
    """uniform:0-1 over 6 steps of 2 prompts x 4 samples, every adapter load verified: each
    batch's samples carry exactly the versions the profile drew (the engine's stamps, from the
    adapter each request named), with no full weight reload after the engine's start, and
    every published version is an adapter."""
    from test_loop import Recorder, SevensTask

    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.lag_profile import parse_profile
    from sat_cli.loop.schedule import Every
    from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
    from sat_cli.loop.weightsync import SyncSettings
    from sat_cli.rl.config import LossConfig
    from sat_cli.weightsync.adapters import is_adapter

    engine.update_weights(str(tiny_dir), 0)  # the base, as a fresh engine starts
    reloads = engine.full_reloads
    lag = LagPolicy(1, "fixed", profile=parse_profile("uniform:0-1"), seed=3, cells=8)
    trainer = _Recording(str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo="grpo"), lora=LORA)
    trainer.seen = []
    eos = trainer.tokenizer.eos_token_id
    s = LoopSettings(
        max_steps=6,
        prompts_per_step=2,
        group_size=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=2, stop_token_ids=(eos,)),
        lag=lag,
        run_dir=tmp_path / "run",
        seed=3,
        histograms=Every(0),
        weight_sync=SyncSettings(verify="every"),
    )
    parts = RunParts(engine, trainer, Recorder(), SevensTask(), trainer.tokenizer)
    requests = engine._call("ping")["requests"]
    st = TrainLoop(s, parts).run()
    drawn = [sorted(lag.sample_versions(k)) for k in range(6)]
    assert trainer.seen == drawn
    # one engine request per batch: a mixed batch names each sample's adapter
    assert engine._call("ping")["requests"] - requests == 6
    assert sum(len(set(d)) > 1 for d in drawn) >= 2  # mixed-version batches happened
    assert engine.full_reloads == reloads  # adapters only after the first load
    lags = [k - v for k, d in enumerate(drawn) for v in d]
    assert st.lag_profile_counts == [lags.count(0), lags.count(1)]
    kept = sorted((tmp_path / "run" / "weights").iterdir())
    assert kept and all(is_adapter(p) for p in kept)


def _lora_run(tiny_dir, engine, run_dir, steps: int, resume=None):
    """``steps`` steps of a LoRA run (lag 1, adapter dropout 0.1, checkpoints every 2) on the
    module's engine, started on the base as a fresh engine is."""
    from test_loop import Recorder, SevensTask

    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.schedule import Every
    from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
    from sat_cli.rl.config import LossConfig

    engine.update_weights(str(tiny_dir), 0)
    lora = {**LORA, "dropout": 0.1}
    trainer = LocalTrainer(str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo="grpo"), lora=lora)
    eos, rec = trainer.tokenizer.eos_token_id, Recorder()
    s = LoopSettings(
        max_steps=steps,
        prompts_per_step=2,
        group_size=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=2, stop_token_ids=(eos,)),
        lag=LagPolicy(1, "fixed"),
        run_dir=run_dir,
        seed=3,
        histograms=Every(0),
        checkpoints=Every(2),
        checkpoint_keep=5,
    )
    TrainLoop(s, RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer)).run(resume)
    return rec, trainer


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_dir, engine, tmp_path):
    """A run cut after step 3 and resumed from its step-2 checkpoint (the adapter, AdamW's
    moments and the RNG of the adapter's dropout) ends with the uninterrupted run's losses and
    adapter, bit for bit; the checkpoint holds the adapter, not the model."""
    from sat_cli.checkpoints.manifest import verify_checkpoint
    from sat_cli.checkpoints.state import latest_checkpoint
    from sat_cli.models.lora import adapter_tensors

    reloads = engine.full_reloads
    full, tr_full = _lora_run(tiny_dir, engine, tmp_path / "full", 5)
    _lora_run(tiny_dir, engine, tmp_path / "cut", 3)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_3")
    ck = latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ck.name == "step_2" and verify_checkpoint(ck) is None
    files = sorted(p.name for p in (ck / "trainer").iterdir())
    assert files == ["adapter", "optimizer.safetensors", "trainer_state.json"]
    resumed, tr_res = _lora_run(tiny_dir, engine, tmp_path / "cut", 5, resume=ck)
    assert sorted(resumed.metrics) == [3, 4, 5]
    for t in (3, 4, 5):
        assert resumed.metrics[t]["loss/policy"] == full.metrics[t]["loss/policy"], t
    a, b = adapter_tensors(tr_full.model), adapter_tensors(tr_res.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(t.abs().max()) > 0 for k, t in a.items() if "lora_B" in k)  # it trained
    assert engine.full_reloads == reloads + 3  # the three starts on the base, nothing else
    f = ck / "trainer" / "adapter" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    assert "does not match its SHA-256" in verify_checkpoint(ck)


class _DiskFlipsABit(LocalTrainer):
    """The real trainer on a disk that damages the published v2 after it is written."""

    def publish_weights(self, dir, version):
        path = super().publish_weights(dir, version)
        if version == 2:
            _damage(path.parent, 2)
        return path


def test_a_run_whose_adapter_is_damaged_on_disk_fails_closed(tiny_dir, engine, tmp_path):
    """lag 0, 4 steps: v2 is damaged between publish and load; the engine refuses it, the loop
    tries the disk once more and the run stops with WeightSyncFailed (exit 1) before training
    on anything v2 would have sampled; steps 1 and 2 were trained from v0 and v1."""
    from test_loop import Recorder, SevensTask

    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.schedule import Every
    from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
    from sat_cli.loop.weightsync import SyncSettings, WeightSyncFailed
    from sat_cli.rl.config import LossConfig

    engine.update_weights(str(tiny_dir), 0)
    trainer = _DiskFlipsABit(
        str(tiny_dir), lr=1e-2, seed=0, loss=LossConfig(algo="grpo"), lora=LORA
    )
    eos, rec = trainer.tokenizer.eos_token_id, Recorder()
    s = LoopSettings(
        max_steps=4,
        prompts_per_step=2,
        group_size=4,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=2, stop_token_ids=(eos,)),
        lag=LagPolicy(0, "fixed"),
        run_dir=tmp_path / "run",
        seed=3,
        histograms=Every(0),
        weight_sync=SyncSettings(),
    )
    says = r"(?s)weights v2 did not reach the engine: .*v2 at \S+ is damaged: 1 of 16 tensors"
    with pytest.raises(WeightSyncFailed, match=says):
        TrainLoop(s, RunParts(engine, trainer, rec, SevensTask(), trainer.tokenizer)).run()
    assert sorted(rec.metrics) == [1, 2] and trainer.step_count == 2
    assert engine.adapter == 1 and engine.health()
