"""LoRA on a REAL SGLang 0.5.23 server on this CPU (tier ``sglang``): adapter-only sync through
``/load_lora_adapter`` / ``/unload_lora_adapter``, one adapter per version, per-request
``lora_path`` (``sat_cli/engines/sglang/lora.py``), with ``cpu_launch.py``'s ``lora_pin`` patch.

The reference is the local trainer's own LoRA model (``sat_cli.models.lora``) at each version,
recomputing the server's samples at bf16 (the server's dtype). Tolerance: mean |Δ log-prob|
per version below ``MEAN_TOL`` (0.02, as tests/test_sglang_real.py for the base: bf16 rounding,
no route replay; ~100 response tokens per version), while the other versions' models are
farther than twice that (``APART``): a request served by the wrong adapter fails. Measured on
an AVX-512 Xeon without AMX (2026-12-05, 9 samples of up to 12 tokens per version, B drawn
with std 0.2): own version 0.0045 to 0.007, the other versions 0.10 to 0.63; the arrival
probes (mean |Δ| over the 15 probe tokens, bound 0.5 at bf16) 0.030 and 0.032.
"""

from __future__ import annotations

import copy

import pytest
import torch
from sglang_real import MODEL, sglang_python

from sat_cli.engines.base import EngineError, SamplingParams
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer, token_logprobs

pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang")]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": TARGETS}
MEAN_TOL = 0.02
APART = 2 * MEAN_TOL


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Versions 0..3 of a LoRA trainer as adapter folders: v0 the fresh adapter (the base),
    then three distinct adapters (B drawn at random, seeded), and the trainer's model of each."""
    weights = tmp_path_factory.mktemp("sglang-lora") / "weights"
    trainer = LocalTrainer(str(MODEL), lora=LORA)
    models = {}
    gen = torch.Generator().manual_seed(0)
    for v in range(4):
        if v:
            with torch.no_grad():
                for name, p in trainer.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        trainer.publish_weights(weights, v)
        models[v] = copy.deepcopy(trainer.model).to(torch.bfloat16).eval()
    return weights, models


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from sat_cli.engines.sglang import SGLangEngine
    from sat_cli.engines.sglang.lora import server_lora_args
    from sat_cli.engines.sglang.runtime import SGLangRuntime
    from sat_cli.engines.sglang.settings import SGLangEngineSettings

    settings = SGLangEngineSettings(device="cpu", max_total_tokens=4096, startup_timeout_s=600)
    runtime = SGLangRuntime(
        str(MODEL),
        python=sglang_python(),
        log_dir=tmp_path_factory.mktemp("sglang-lora-logs"),
        lora_args=tuple(server_lora_args(LORA, 3, "cpu")),
        adapters_kept=2,
    )
    with SGLangEngine.launch(settings, runtime) as eng:
        yield eng


def _scored(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
    return token_logprobs(logits.float(), batch.input_ids, 1.0)[0]


def test_two_adapter_versions_served_at_once_give_each_versions_logprobs(published, engine, capsys):
    """v1 and v2 held at once; one /generate naming v1, v2 and the base per entry: each
    entry's log-probs are its own version's (the trainer's LoRA model, bf16), not the other's;
    then v3 arrives, v1 is unloaded (keep 2) and a request naming it fails."""
    from transformers import AutoTokenizer

    from sat_cli.tasks.toy import ToyTask

    weights, models = published
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    rows = ToyTask(digits=3, seed=0, heldout_size=64).sample_prompts(9, cursor=0)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    for v in (1, 2):
        engine.update_weights(str(weights / f"v{v}"), v)  # checksums, then the probe
    assert engine.adapters_held == [1, 2] and engine.served_versions() == [0]
    assert max(engine.probe_gaps.values()) < 0.5, engine.probe_gaps
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id,))
    versions = [1, 2, 0] * 3
    groups = engine.generate(prompts, 3, sampling, adapters=versions)
    gaps = {}
    for v in (1, 2, 0):
        samples = [s for g, gv in zip(groups, versions, strict=True) if gv == v for s in g]
        assert {s.weight_version for s in samples} == {v}
        batch = collate(samples, torch.zeros(len(samples)), tok.pad_token_id)
        m = batch.loss_mask.bool()
        for w in (1, 2, 0):
            gaps[v, w] = float((_scored(models[w], batch) - batch.rollout_logp)[m].abs().mean())
    with capsys.disabled():
        print(f"\n[sglang lora] mean |d logp| (served version, scored by version): {gaps}")
        print(f"[sglang lora] arrival probes, mean |d logp|: {engine.probe_gaps}")
    for v in (1, 2, 0):
        assert gaps[v, v] < MEAN_TOL, gaps
        assert min(gaps[v, w] for w in (1, 2, 0) if w != v) > APART, gaps
    engine.update_weights(str(weights / "v3"), 3)
    assert engine.adapters_held == [2, 3]
    with pytest.raises(EngineError, match=r"names adapter v1, which the servers do not hold"):
        engine.generate(prompts[:1], 1, sampling, adapters=[1])
    out = engine.generate(prompts[:1], 1, sampling)  # default: the last loaded version
    assert out[0][0].weight_version == 3


def test_an_adapter_the_server_serves_wrongly_is_refused_by_the_probe(published, engine, tmp_path):
    """The trainer's v4 (here: the same adapter as v3, so its probe is v3's) published with the
    previous version's tensors (v2's, their checksums valid): the files pass sat's checks, the
    server's log-probs of the probe are v2's, not the trainer's v4: refused (mean |Δ| > 0.5 at
    bf16), unloaded again, the held adapters unchanged."""
    from sat_cli.weightsync.adapters import read_adapter, write_adapter

    weights, _ = published
    before = list(engine.adapters_held)
    config, _ = read_adapter(weights / "v3", 3)
    _, older = read_adapter(weights / "v2", 2)
    write_adapter(
        tmp_path / "v4",
        older,
        version=4,
        rank=4,
        alpha=8.0,
        targets=TARGETS,
        probe=config["probe"],
    )
    with pytest.raises(EngineError, match=r"does not serve adapter v4 the trainer wrote") as exc:
        engine.update_weights(str(tmp_path / "v4"), 4)
    print(f"\n[sglang lora] refused: {exc.value}")
    assert engine.adapters_held == before


@pytest.mark.slow  # a second server and a 5-step run (~60 s); the tests above keep the class
def test_sat_train_with_lora_and_a_lag_profile_on_sglang(tmp_path):
    """`sat train engine=sglang trainer.lora.rank=4 lag.profile=uniform:0-2`: every version
    reaches the server as an adapter (/load_lora_adapter, older ones unloaded), mixed batches
    name older versions again, and the base is never reloaded (/update_weights_from_disk)."""
    import re

    from sglang_real import sat

    sglang_python()
    out = sat(
        "train",
        "engine=sglang",
        "engine.device=cpu",
        "experiment=cpu_smoke",
        "task.prompts_per_step=8",
        "task.samples_per_prompt=4",
        "eval.every=0",
        "run.dir=runs",
        "max_steps=5",
        "tracking=none",
        "trainer.lora.rank=4",
        "trainer.lr=1e-2",
        "lag.profile=uniform:0-2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (log,) = (tmp_path / "runs").glob("sat/*/logs/sglang_0.log")
    text = log.read_text()
    loads = re.findall(r'POST /load_lora_adapter HTTP/1.1" 200', text)
    unloads = re.findall(r'POST /unload_lora_adapter HTTP/1.1" 200', text)
    assert len(loads) >= 4 and len(unloads) >= 1, (len(loads), len(unloads))
    assert "/update_weights_from_disk" not in text
