"""The SGLang engine against a REAL SGLang 0.5.23 server on this CPU (tier ``sglang``).

One server of the tiny Qwen3-MoE (bf16, R3 on) serves the module; the last test kills it. The
references are recomputations by the trainer's own code (``token_logprobs`` over an HF model at
the engine's dtype), the trainer's R3 replay, and SGLang's source for the sampling filter.
Measured on an AMX Xeon (SGLang's AMX kernels; 2026-11-30, 800 tokens): SGLang bf16 vs an HF bf16
recompute, mean |Δ log-prob| 0.005 (max 0.18); vs the fp32 trainer, 0.004 (max 0.10); top-2
expert sets agree on 99.3 % of (token, layer) rows with the bf16 recompute. On an AVX-512 Xeon
without AMX (SGLang's torch-native layers; 2026-12-02, two runs of ~800 tokens): 0.0036 and 0.0042
(max 0.20) vs bf16, 0.0032 and 0.0039 (max 0.10) vs fp32. The tolerances below are several times
those and far below what a misaligned token or a wrong dtype gives (mean |Δ| of 1 or more).
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from cli_helpers import seeded_store
from sglang_real import MODEL, launch, metrics, probe, require_cpu_all_reduce, sat

from sat_cli.engines.base import EngineError, SamplingParams
from sat_cli.models.tiny_moe import load_model, save_hf
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer, token_logprobs
from sat_cli.trainers.step import topk_logprobs
from sat_cli.util.procs import cpu_seconds, live_group_members

# one xdist worker runs the real-server tier (its module-scoped servers are started once)
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang")]

MEAN_TOL = 0.02  # mean |Δ log-prob|, SGLang bf16 vs the trainer's bf16 recompute
MAX_TOL = 1.0


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from sat_cli.tasks.toy import ToyTask

    rows = ToyTask(digits=3, seed=0, heldout_size=64).sample_prompts(16, cursor=0)
    return [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = launch(log_dir=tmp_path_factory.mktemp("sglang-logs"), r3=True)
    yield eng
    eng.close()


def sampling(tokenizer, **kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 16)
    return SamplingParams(stop_token_ids=(tokenizer.eos_token_id,), **kw)


def recompute(model_dir, batch, dtype="bfloat16", replay=False) -> torch.Tensor:
    """The trainer's log-probs ``[B, S]`` of the batch under an HF model at ``dtype``."""
    from sat_cli.models.r3 import maybe_replay

    model = load_model(str(model_dir), dtype, torch.device("cpu")).eval()
    with torch.no_grad(), maybe_replay(model, batch.routed_experts, replay):
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
    return token_logprobs(logits, batch.input_ids, 1.0)[0]


def flat(groups):
    return [s for g in groups for s in g]


def test_sat_train_with_r3_on_the_server_logs_the_real_mismatch_and_replays_its_routes(
    engine, tmp_path
):
    """`sat train` end to end on this module's server (first, while it serves the base weights:
    ``engine.urls`` accepts only version 0), then the base weights are loaded again under version
    0 for the tests below. One SGLang start serves the CLI run and the engine tests; `sat train`
    launching its own servers is in tests/test_sglang_real_cli.py (slow) and, with the stand-in
    server, tests/test_ray_launcher.py; the commands it builds are checked against SGLang's own
    parsers in tests/test_sglang_cpu_launch.py."""
    url = engine.worker_urls[0]
    small = [
        "engine=sglang",
        "engine.device=cpu",
        f"engine.urls=[{url}]",
        "experiment=cpu_smoke",
        "task.prompts_per_step=8",
        "task.samples_per_prompt=4",
        "eval.every=3",
        "eval.limit=16",
        "eval.n=2",
        "run.dir=runs",
        "run.name=sg",
    ]
    log_path = engine.servers[0].log_path
    before = len(log_path.read_text())
    seeded_store(tmp_path / "runs" / "mlflow.db")
    try:
        out = sat("train", *small, "max_steps=3", "r3=true", "trainer.r3_audit=true", cwd=tmp_path)
    finally:  # the base weights again, under version 0, whatever the run left
        reset = {"model_path": str(MODEL), "weight_version": "0", "flush_cache": True}
        answer = engine.client.post_json("/update_weights_from_disk", reset, url=url)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert answer.get("success") is True, answer
    assert engine.served_versions() == [0]
    # the run drove this server: generations and weight loads (then our reset)
    log = log_path.read_text()[before:]
    assert log.count('"POST /generate HTTP/1.1" 200') >= 1
    assert log.count('"POST /update_weights_from_disk HTTP/1.1" 200') >= 2
    runs = tmp_path / "runs"
    dpi = metrics(runs, "staleness/abs_logratio_mean")
    lag = metrics(runs, "staleness/version_lag_max")
    assert sorted(dpi) == [1, 2, 3] and lag[1] == 0
    # a bf16 engine against the fp32 trainer: a real mismatch even at lag 0 (fp32 local
    # engines give ~1e-7), and no misalignment (that gives ~1)
    assert 1e-3 < dpi[1] < 0.1
    rows = metrics(runs, "r3/audit_rows")
    bad = metrics(runs, "r3/audit_mismatched_rows")
    assert sorted(rows) == [1, 2, 3] and min(rows.values()) > 0
    assert set(bad.values()) == {0.0}
    assert sorted(metrics(runs, "eval/toy/avg_at_2")) == [0, 3]


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes of a process group (Linux /proc)."""
    total = 0.0
    for pid in live_group_members(pgid):
        try:
            total += cpu_seconds(pid)
        except OSError:  # gone meanwhile
            continue
    return total


def test_an_idle_server_leaves_the_cpu_to_the_trainer(engine):
    """--sleep-on-idle (CPU servers): an idle scheduler used to poll without pause, a whole core
    (10 CPU-s in 10 s); now its group uses a few percent. Even on a loaded 2-core machine a
    spinning scheduler gets well over a third of a core, so 1 CPU-s in 3 s separates the two."""
    pgid = engine.servers[0].pgid
    before = _group_cpu_s(pgid)
    time.sleep(3.0)
    assert _group_cpu_s(pgid) - before < 1.0


def test_logprobs_equal_a_bf16_recompute_by_the_trainer(engine, prompts, tokenizer, capsys):
    samples = flat(engine.generate(prompts, 4, sampling(tokenizer)))
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    # the stop token is part of the response, as in the local engine
    assert all(
        s.response_ids[-1] == tokenizer.eos_token_id for s in samples if s.finish_reason == "stop"
    )
    batch = collate(samples, torch.zeros(len(samples)), tokenizer.pad_token_id)
    mask = batch.loss_mask.bool()
    d_bf16 = (recompute(MODEL, batch, "bfloat16") - batch.rollout_logp)[mask].abs()
    d_fp32 = (recompute(MODEL, batch, "float32") - batch.rollout_logp)[mask].abs()
    with capsys.disabled():
        print(
            f"\n[sglang] {int(mask.sum())} tokens: mean |d logp| vs bf16 recompute "
            f"{d_bf16.mean():.4f} (max {d_bf16.max():.3f}); vs the fp32 trainer "
            f"{d_fp32.mean():.4f} (max {d_fp32.max():.3f}) — the real engine/trainer mismatch"
        )
    assert d_bf16.mean() < MEAN_TOL and d_bf16.max() < MAX_TOL
    assert d_fp32.mean() < MEAN_TOL and d_fp32.max() < MAX_TOL
    # ... and a real mismatch, not an accidental fp32 engine (fp32 engines agree to ~1e-6)
    assert d_fp32.mean() > 1e-4


def test_routed_experts_decode_to_what_the_trainer_replays(engine, prompts, tokenizer):
    samples = flat(engine.generate(prompts[:8], 2, sampling(tokenizer)))
    cfg = json.loads((MODEL / "config.json").read_text())
    layers, k, experts = (
        cfg["num_hidden_layers"],
        cfg["num_experts_per_tok"],
        cfg["num_local_experts"],
    )
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, layers, k)
        assert s.routed_experts.min() >= 0 and s.routed_experts.max() < experts
        # a top-k set: k distinct experts per (token, layer)
        assert (
            np.sort(s.routed_experts, -1)[..., 1:] != np.sort(s.routed_experts, -1)[..., :-1]
        ).all()
    batch = collate(
        samples, torch.linspace(-1, 1, len(samples)), tokenizer.pad_token_id, need_routes=True
    )
    valid = batch.attention_mask.bool().clone()
    for b, s in enumerate(samples):
        valid[b, len(s.prompt_ids) + len(s.response_ids) - 1 :] = False  # the last token: no row

    # What the experts of the trainer receive under replay is SGLang's routing, every layer.
    trainer = LocalTrainer(str(MODEL), r3=True, lr=1e-3)
    seen = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].detach().clone()))
        for layer in trainer.model.model.layers
    ]
    metrics = trainer.step(batch)
    for h in hooks:
        h.remove()
    assert len(seen) == layers
    B, S = batch.input_ids.shape
    for layer, idx in enumerate(seen):
        used = idx.view(B, S, k).sort(-1).values[valid]
        recorded = batch.routed_experts[:, :, layer].sort(-1).values[valid]
        assert torch.equal(used, recorded), f"layer {layer}"
    assert np.isfinite(metrics["loss/policy"])
    # the router still learns under replay: the step changed its weights
    before = load_model(str(MODEL), "float32", torch.device("cpu")).model.layers[0].mlp.gate.weight
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.gate.weight.detach())

    # SGLang's routes are the bf16 engine's own: they mostly agree with the trainer's top-k.
    from sat_cli.models.r3 import RouteCapture

    model = load_model(str(MODEL), "bfloat16", torch.device("cpu")).eval()
    with RouteCapture(model) as cap, torch.no_grad():
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
    own = cap.last_call().view(B, S, layers, k).sort(-1).values
    agree = (own == batch.routed_experts.sort(-1).values).all(-1)[valid].float().mean()
    assert agree > 0.9


def _filtered_logp(logits: torch.Tensor, token: int, top_k: int, top_p: float) -> float:
    """SGLang 0.5.23's torch sampler (``top_k_top_p_min_p_sampling_from_probs_torch``): sort,
    drop ranks >= top_k, drop tokens whose preceding mass (of the full distribution) > top_p,
    renormalise; the behaviour log-prob of ``token``."""
    probs = torch.softmax(logits.double(), -1)
    srt, idx = probs.sort(descending=True)
    before = srt.cumsum(-1) - srt
    keep = (torch.arange(len(srt)) < top_k) & (before <= top_p)
    kept = torch.where(keep, srt, torch.zeros_like(srt))
    pos = (idx == token).nonzero().item()
    return float(torch.log(kept[pos] / kept.sum()))


@pytest.mark.slow  # ~40 s; the log-probs test above keeps the class
def test_top_k_top_p_logprobs_are_the_behaviour_policy(engine, prompts, tokenizer):
    # SGLang's output_token_logprobs are unfiltered; the engine asks for the sampling mask and
    # reports the log-prob under the renormalised top-k/top-p distribution actually sampled.
    top_k, top_p = 5, 0.9
    samples = flat(engine.generate(prompts[:8], 4, sampling(tokenizer, top_k=top_k, top_p=top_p)))
    batch = collate(samples, torch.zeros(len(samples)), tokenizer.pad_token_id)
    model = load_model(str(MODEL), "bfloat16", torch.device("cpu")).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits.float()
    ref, got, unfiltered = [], [], []
    full = token_logprobs(logits, batch.input_ids, 1.0)[0]
    for b, s in enumerate(samples):
        start = len(s.prompt_ids)
        for t, tok in enumerate(s.response_ids):
            ref.append(_filtered_logp(logits[b, start + t - 1], tok, top_k, top_p))
            got.append(s.rollout_logp[t])
            unfiltered.append(float(full[b, start + t]))
    ref, got, unfiltered = map(np.asarray, (ref, got, unfiltered))
    assert np.mean(np.abs(got - ref)) < MEAN_TOL
    # renormalising over a cut support raises log-probs (up to bf16 noise between the two
    # models), measurably: these are not the plain log-probs
    assert np.mean(got >= unfiltered - 0.05) > 0.95
    assert np.mean(got - unfiltered) > 1e-3


@pytest.mark.slow  # ~35 s; in the default suite test_mask_replay.py's captured real answer keeps
# the parse (test_the_captured_real_answer_parses_to_kept_sets) and test_local_engine.py keeps the
# replay end to end (test_sampling_mask_replay_reproduces_mu_and_the_sampler_top_k); make test-full
def test_kept_sets_and_top_k_parse_and_the_trainer_replays_them(engine, prompts, tokenizer):
    # the real server's output_token_sampling_mask / support-mode log-probs / top logprobs
    # (sat_cli/engines/sglang/masks.py): every sampled token lies in its kept set, the kept set
    # is SGLang's top-k/top-p cut of a bf16 recompute, the top-k is the most probable part of
    # it, and the trainer scoring on the kept sets (algo.replay_sampling_mask) closes the gap
    # that -log(kept mass) opens without it.
    top_k, top_p = 5, 0.9
    cut = sampling(tokenizer, top_k=top_k, top_p=top_p, sampling_mask=True, topk_logprobs=3)
    samples = flat(engine.generate(prompts[:4], 2, cut))
    batch = collate(
        samples, torch.zeros(len(samples)), tokenizer.pad_token_id, need_mask=True, need_topk=3
    )
    model = load_model(str(MODEL), "bfloat16", torch.device("cpu")).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits.float()
    same = []
    for b, s in enumerate(samples):
        start = len(s.prompt_ids)
        for t, (tok, kept) in enumerate(zip(s.response_ids, s.sampling_mask, strict=True)):
            assert tok in kept and 1 <= len(kept) <= top_k
            probs = torch.softmax(logits[b, start + t - 1].double(), -1)
            srt, idx = probs.sort(descending=True)
            keep = (torch.arange(len(srt)) < top_k) & (srt.cumsum(-1) - srt <= top_p)
            same.append(sorted(idx[keep].tolist()) == sorted(kept.tolist()))
            ids, lps = s.topk_ids[t], s.topk_logp[t]
            n = min(3, len(kept))
            assert ids[:n].tolist() == kept[:n].tolist() and (ids[n:] == -1).all()
            assert (np.diff(lps[:n]) <= 1e-6).all() and np.exp(lps[:n]).sum() <= 1 + 1e-4
            if tok in ids[:n]:  # the behaviour log-prob is the support's own entry
                assert lps[:n][ids[:n].tolist().index(tok)] == pytest.approx(s.rollout_logp[t])
    assert np.mean(same) > 0.9  # bf16 noise may move a boundary token
    m = batch.loss_mask.bool()
    on = token_logprobs(logits, batch.input_ids, 1.0, batch.sampling_mask)[0]
    off = token_logprobs(logits, batch.input_ids, 1.0)[0]
    d_on = (on - batch.rollout_logp)[m].abs().mean()
    d_off = (off - batch.rollout_logp)[m].abs().mean()
    assert d_on < MEAN_TOL and d_off > d_on + 1e-3
    # no filter: the top-k of log_softmax(logits / T) from top_logprobs_num
    plain = flat(engine.generate(prompts[:4], 1, sampling(tokenizer, topk_logprobs=3)))
    pb = collate(plain, torch.zeros(len(plain)), tokenizer.pad_token_id, need_topk=3)
    with torch.no_grad():
        pl = model(
            input_ids=pb.input_ids,
            attention_mask=pb.attention_mask,
            position_ids=pb.position_ids,
            use_cache=False,
        ).logits.float()
    ref = topk_logprobs(pl, pb.topk_ids, 1.0, None)
    valid = (pb.topk_ids >= 0) & pb.loss_mask.bool()[..., None]
    assert bool(valid[..., 0][pb.loss_mask.bool()].all())
    assert (ref - pb.topk_logp)[valid].abs().mean() < MEAN_TOL


def test_weight_update_changes_samples_and_version(engine, prompts, tokenizer, tmp_path):
    # v1: the base model with the row of "7" in lm_head pushed outward: "7" is sampled far
    # more often (measured: 2.5 % of tokens before, 25 % after).
    seven = tokenizer.convert_tokens_to_ids("7")
    model = load_model(str(MODEL), "float32", torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight[seven] += 8.0 * model.lm_head.weight[seven].sign()
    save_hf(model, tokenizer, tmp_path / "v1")
    base_version = engine.version
    before = flat(engine.generate(prompts[:8], 2, sampling(tokenizer)))
    engine.update_weights(str(tmp_path / "v1"), base_version + 1)
    after = flat(engine.generate(prompts[:8], 2, sampling(tokenizer)))
    assert engine.served_versions() == [base_version + 1]
    assert {s.weight_version for s in after} == {base_version + 1}
    share = lambda ss: np.mean([t == seven for s in ss for t in s.response_ids])  # noqa: E731
    assert share(after) > max(0.1, 3 * share(before))
    # the reported log-probs are the new weights' (bf16 recompute of v1), not the old ones'
    batch = collate(after, torch.zeros(len(after)), tokenizer.pad_token_id)
    mask = batch.loss_mask.bool()
    assert (recompute(tmp_path / "v1", batch) - batch.rollout_logp)[mask].abs().mean() < MEAN_TOL
    assert (recompute(MODEL, batch) - batch.rollout_logp)[mask].abs().mean() > 10 * MEAN_TOL
    engine.update_weights(str(MODEL), base_version + 2)  # back to the base weights


def test_an_update_paused_in_place_keeps_versions_consistent(engine, prompts, tokenizer):
    # SGLang refuses a cache flush while requests run, after loading the weights (captured): the
    # engine updates without one while paused in place and flushes before the next generate.
    base = engine.version
    future = engine.generate_async(prompts * 8, 8, sampling(tokenizer, max_new_tokens=24))
    time.sleep(2.0)
    engine.pause(mode="in_place")
    engine.update_weights(str(MODEL), base + 1)
    engine.resume()
    samples = flat(future.result(timeout=600))
    versions = {v for s in samples for v in (s.token_versions or [s.weight_version])}
    assert versions <= {base, base + 1}
    assert engine.served_versions() == [base + 1]
    after = flat(engine.generate(prompts[:2], 2, sampling(tokenizer)))
    assert {s.weight_version for s in after} == {base + 1}
    with pytest.raises(EngineError, match="retract"):
        engine.pause(mode="retract")  # R3 is on


@pytest.mark.slow  # ~15 s; tests/test_sglang_client.py keeps the class on the stand-in, whose
# answers to a busy flush are the captured real ones (test_sglang_standin_fidelity.py)
def test_an_update_whose_flush_is_refused_is_loaded_again_once_idle(
    engine, prompts, tokenizer, monkeypatch
):
    """The real server's refusal of a flush after loading (requests still running: here paused in
    place) is waited out by DiskWeightSync: /flush_cache retried until the requests finish, then
    the weights loaded again, and the tokenizer's stamp (GET /model_info) is the new version."""
    from sat_cli.engines.sglang import control
    from sat_cli.engines.sglang.weights import DiskWeightSync

    # this test's requests are long on purpose (200 tokens, paused 3 s): more than the 10 s that
    # a request not yet retired needs
    monkeypatch.setattr(control, "FLUSH_SETTLE_S", 300.0)
    base, url = engine.version, engine.worker_urls[0]
    log = engine.servers[0].log_path
    before = len(log.read_text())
    future = engine.generate_async(prompts * 4, 4, sampling(tokenizer, max_new_tokens=200))
    time.sleep(2.0)
    engine.pause(mode="in_place")
    engine._max_version = base + 1  # what update_weights does before pushing
    push = DiskWeightSync(timeout_s=120.0)
    pushed = engine._executor.submit(
        push.push, engine.client, [url], str(MODEL), base + 1, flush_cache=True
    )
    time.sleep(3.0)  # loaded and refused; the flush is being retried while requests run
    engine.resume()
    pushed.result(timeout=120)
    flat(future.result(timeout=600))
    engine._version = base + 1
    assert engine.served_versions() == [base + 1]
    text = log.read_text()[before:]
    assert text.count('"POST /update_weights_from_disk HTTP/1.1" 400') == 1
    assert text.count('"POST /update_weights_from_disk HTTP/1.1" 200') == 1  # loaded again
    assert text.count('"POST /flush_cache HTTP/1.1" 400') >= 1
    assert text.count('"POST /flush_cache HTTP/1.1" 200') == 1


def test_the_servers_400_reaches_the_user_with_its_message(engine):
    with pytest.raises(EngineError, match=r"HTTP 400: .*unknown field `bogus`"):
        engine.client.post_json(
            "/generate",
            {"input_ids": [[5, 6]], "sampling_params": {"bogus": 1}},
            url=engine.worker_urls[0],
        )
    with pytest.raises(EngineError, match=r"HTTP 400: .*floating point `5.0`, expected i64"):
        engine.client.post_json(
            "/generate",
            {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 5.0}},
            url=engine.worker_urls[0],
        )
    assert engine.health()  # the server is fine after refusing


@pytest.mark.slow  # starts a second server (40 s); `make test-full`
def test_sglang_stops_on_the_union_of_eos_ids_like_the_local_engine(
    engine, prompts, tokenizer, tmp_path
):
    # A model whose generation_config names a second EOS (a digit the model often samples):
    # SGLang stops at the first of either, as the local engine does (test_local_engine.py).
    from test_local_engine import first_stop_rule_holds, with_extra_eos

    counts: dict[int, int] = {}
    for s in flat(engine.generate(prompts, 2, sampling(tokenizer))):
        for tok in s.response_ids[:-1]:
            counts[tok] = counts.get(tok, 0) + 1
    extra = max(counts, key=counts.get)
    model = with_extra_eos(MODEL, tmp_path / "m", extra)
    eos = tokenizer.eos_token_id
    plain = SamplingParams(max_new_tokens=16)  # no stop ids in the request: the model's own
    with launch(model, log_dir=tmp_path / "logs", r3=False) as other:
        samples = flat(other.generate(prompts, 4, plain))
    first_stop_rule_holds(samples, {eos, extra})
    assert sum(s.response_ids[-1] == extra for s in samples) >= 3
    assert any(s.response_ids[-1] == eos for s in samples)


def test_a_broadcast_serves_what_a_disk_load_of_the_same_weights_does(engine, tmp_path):
    """engine.weight_sync=distributed against the real server (gloo, this process the sender):
    SGLang 0.5.23's /weights_checker reports exactly the checksums the trainer side computes
    for what it sent, and the log-probs of a fixed sequence equal those after a disk load of
    the same weights (measured: 0.0 on the AVX-512 Xeon, 2026-12-02)."""
    from sat_cli.engines.local.sync import served_state
    from sat_cli.loop.weightsync import GroupSpec
    from sat_cli.weightsync.layouts import compare, expected_checksums
    from sat_cli.weightsync.sender import WeightSender

    url = engine.worker_urls[0]
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 20, 21, 22, 23]

    def scored() -> list[float]:
        body = {
            "input_ids": seq,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer = engine.client.post_json("/generate", body, url=url)
        return [lp for lp, _, _ in answer["meta_info"]["input_token_logprobs"][1:]]

    base, v = scored(), engine.version
    model = load_model(str(MODEL), "float32", torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    sender = WeightSender(dtype="bfloat16", source_dir=str(MODEL), bucket_bytes=1 << 20)
    sender.capture(v + 1, served_state(model))
    engine.sync_weights(sender, v + 1, GroupSpec(timeout_s=120.0))
    assert engine.served_versions() == [v + 1] and len(sender.plan(v + 1)) > 1
    served = engine.served_checksums()[url]
    assert compare(sender.checksums(v + 1, "sglang"), served) == []
    # one element of one AMX-packed tensor (an expert's down_proj) other than what was sent:
    # exactly that tensor differs
    named = dict(served_state(model))
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    named[down] = named[down].clone()
    named[down][0, 0] += 0.5
    claimed = expected_checksums(named, "sglang", "bfloat16", sender.tied)
    assert [p.split(":")[0] for p in compare(claimed, served)] == [
        "model.layers.0.mlp.experts.w2_weight"
    ]
    by_wire = scored()
    save_hf(model, None, tmp_path / "v")
    engine.update_weights(str(tmp_path / "v"), v + 2)
    by_disk = scored()
    assert max(abs(a - b) for a, b in zip(by_wire, by_disk, strict=True)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(by_wire, base, strict=True)) > 0.1  # it did change
    engine.update_weights(str(MODEL), v + 3)  # back to the base weights
    sender.close()


def test_a_served_weight_changed_in_place_is_caught(engine):
    """On AMX CPUs /weights_checker reports, for an AMX-packed weight, the hash it was loaded
    with (cpu_launch.py's checksum_loaded) only while the weight holds exactly the bytes packed
    from it: SGLang's own ``reset_tensors`` overwrites every weight in place with random values,
    and then every tensor, the packed ones included, differs from the loaded weights; a load
    from disk packs them again and all match."""
    from sat_cli.engines.local.sync import served_state
    from sat_cli.weightsync.layouts import compare, expected_checksums

    url = engine.worker_urls[0]
    model = load_model(str(MODEL), "float32", torch.device("cpu"))
    loaded = expected_checksums(served_state(model), "sglang", "bfloat16")
    v = engine.version
    engine.update_weights(str(MODEL), v + 1)  # the base weights, packed after an update
    assert compare(loaded, engine.served_checksums()[url]) == []
    answer = engine.client.post_json("/weights_checker", {"action": "reset_tensors"}, url=url)
    assert answer.get("success") is True, answer
    problems = compare(loaded, engine.served_checksums()[url])
    assert sorted(p.split(":")[0] for p in problems) == sorted(loaded)
    engine.update_weights(str(MODEL), v + 2)  # back to the base weights
    assert compare(loaded, engine.served_checksums()[url]) == []


def test_the_cpu_all_reduce_segments_carry_our_tag(engine):
    # SGLang's shared-memory all-reduce (for tp > 1; AMX or arm64 only) maps its segments in
    # /dev/shm (259 MB each, i.e. RAM) even at tp 1; they carry this server's tag, so that
    # stopping it can remove them (next test)
    require_cpu_all_reduce()
    segments = engine.servers[0].shm_segments()
    assert segments and all(s.stat().st_size > 100e6 for s in segments)


def test_server_kill_is_detected_and_leaves_no_process(engine, prompts, tokenizer):
    # (last in the module: it kills the shared server)
    server = engine.servers[0]
    pgid = server.pgid
    assert len(live_group_members(pgid)) >= 3  # launcher, scheduler, detokenizer
    # the all-reduce's /dev/shm segments exist exactly where SGLang has that all-reduce
    segments = server.shm_segments()
    assert bool(segments) == probe().all_reduce
    future = engine.generate_async(prompts * 8, 8, sampling(tokenizer, max_new_tokens=32))
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(server.pid, signal.SIGKILL)
    with pytest.raises(EngineError) as err:
        future.result(timeout=60)
    assert time.monotonic() - t0 < 10.0
    assert "died" in str(err.value) and str(server.log_path) in str(err.value)
    assert not engine.health()
    engine.close()
    assert live_group_members(pgid) == []  # SGLang's scheduler and detokenizer went too
    assert not any(s.exists() for s in segments)  # and their /dev/shm segments (killed: not
    # even a clean exit of SGLang removes them)
