"""Sampling-mask replay (``algo.replay_sampling_mask``) and the sampler top-k channel of score
centering (``algo.score_centering_topk``): the masked log-prob against float64 loops, the kept
sets and top-k the engines record, their path through collate and the replay store, and SGLang's
wire format. End to end with the local engine (fp32, same weights: with the replay the trainer
reproduces ``mu``) is in ``tests/test_local_engine.py``, on that module's engine; against a real
SGLang server in ``tests/test_sglang_real.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sat_cli.engines.base import EngineError, Sample, SamplingParams
from sat_cli.engines.sglang.masks import Extras, parse_extras
from sat_cli.models.sampling import filtered_logprobs, support_and_topk
from sat_cli.trainers.batch import collate
from sat_cli.trainers.step import token_logprobs, topk_logprobs

CAPTURED = Path(__file__).parent / "data" / "sglang_captured"


# --- the masked log-prob ---------------------------------------------------------------------
def test_masked_logprob_hand_case():
    # one position scored (s = 1), vocab 4, z = [2, 1, 0, -1] at T = 1, kept {0, 1}, y = 1:
    # log p = 1 - log(e^2 + e^1) = -log(1 + e) = -1.31326; full softmax: 1 - log(sum e^z)
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]])
    ids = torch.tensor([[3, 1]])
    kept = torch.tensor([[[-1, -1], [0, 1]]])
    lp, ent = token_logprobs(logits, ids, 1.0, kept)
    assert lp[0, 1].item() == pytest.approx(-math.log1p(math.e), abs=1e-6)
    full = 1 - math.log(sum(math.exp(v) for v in (2, 1, 0, -1)))
    assert token_logprobs(logits, ids, 1.0)[0][0, 1].item() == pytest.approx(full, abs=1e-6)
    # entropy of (e^2, e) / (e^2 + e) = (0.7311, 0.2689): 0.5822
    p = math.e**2 / (math.e**2 + math.e)
    assert ent[0, 1].item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), 1e-5)
    # temperature 2 on the same kept set: z = [1, .5]: .5 - log(e + e^.5) = -0.97408
    lp2, _ = token_logprobs(logits, ids, 2.0, kept)
    assert lp2[0, 1].item() == pytest.approx(0.5 - math.log(math.e + math.exp(0.5)), abs=1e-6)


def _reference(logits, ids, kept, topk, T):
    """float64 loops: per scored position, (log p(y), entropy, log p at the top-k ids) of the
    softmax of logits/T, renormalised on the kept ids when there are any."""
    B, S, _ = logits.shape
    lp = torch.zeros(B, S, dtype=torch.float64)
    ent = torch.zeros(B, S, dtype=torch.float64)
    tk = torch.zeros(B, S, topk.shape[-1], dtype=torch.float64)
    for b in range(B):
        for s in range(1, S):
            z = logits[b, s - 1].double() / T
            keep = [int(i) for i in kept[b, s] if i >= 0]
            support = keep if keep else list(range(len(z)))
            lse = torch.logsumexp(z[support], 0)
            lp[b, s] = z[ids[b, s]] - lse
            lps = z[support] - lse
            ent[b, s] = -(lps.exp() * lps).sum()
            for j, i in enumerate(topk[b, s].tolist()):
                if i >= 0:
                    tk[b, s, j] = z[i] - lse
    return lp, ent, tk


def test_masked_logprobs_match_a_float64_loop_with_gradients():
    g = torch.Generator().manual_seed(0)
    B, S, V, K, T = 3, 6, 11, 5, 0.7
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    kept = torch.full((B, S, K), -1, dtype=torch.int32)
    ids = torch.randint(0, V, (B, S), generator=g)
    topk = torch.full((B, S, 3), -1, dtype=torch.int32)
    for b in range(B):
        for s in range(2, S):  # columns 0-1: no kept set (prompt): the full softmax there
            if (b, s) == (1, 4):
                continue  # a response token without a kept set: also the full softmax
            n = int(torch.randint(1, K + 1, (1,), generator=g))
            row = torch.randperm(V, generator=g)[:n]
            kept[b, s, :n] = row.int()
            ids[b, s] = row[0]  # the sampled token is in its kept set
            topk[b, s, : min(n, 3)] = row[: min(n, 3)].int()
    ref_lp, ref_ent, ref_tk = _reference(logits, ids, kept, topk, T)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, ids, T, kept)
    tk = topk_logprobs(x, topk, T, kept)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(tk.double(), ref_tk, atol=1e-5, rtol=0)
    # gradients: the same weighted sums through the float64 reference (autograd on the loops)
    w, wk = torch.randn(B, S, generator=g), torch.randn(B, S, 3, generator=g)
    (lp * w).sum().backward(retain_graph=True)
    got = x.grad.clone()
    x.grad = None
    (tk * wk).sum().backward()
    got_k = x.grad.clone()
    y = logits.clone().requires_grad_(True)
    r_lp, _, r_tk = _reference(y, ids, kept, topk, T)
    ((r_lp * w.double()).sum()).backward(retain_graph=True)
    torch.testing.assert_close(got.double(), y.grad, atol=1e-5, rtol=0)
    y.grad = None
    ((r_tk * wk.double()).sum()).backward()
    torch.testing.assert_close(got_k.double(), y.grad, atol=1e-5, rtol=0)
    assert torch.isfinite(got).all() and torch.isfinite(got_k).all()


def test_without_kept_sets_the_logprobs_are_bit_identical():
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 5, 9, generator=g), torch.randint(0, 9, (2, 5), generator=g)
    plain = token_logprobs(logits, ids, 0.8)
    none_kept = token_logprobs(logits, ids, 0.8, torch.full((2, 5, 3), -1, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(plain, none_kept, strict=True))


# --- what the local engine records ------------------------------------------------------------
@pytest.mark.parametrize("T,top_p,top_k", [(1.0, 0.8, -1), (0.7, 1.0, 5), (1.3, 0.9, 6)])
def test_kept_sets_are_the_finite_support_of_filtered_logprobs(T, top_p, top_k):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 40, generator=g) * 3
    logp = filtered_logprobs(logits, T, top_p, top_k)
    kept, ids, vals = support_and_topk(logp, True, 8)
    for b in range(4):
        assert sorted(kept[b].tolist()) == torch.isfinite(logp[b]).nonzero().flatten().tolist()
        assert kept[b].dtype == np.int32
        order = logp[b, torch.as_tensor(kept[b], dtype=torch.long)]
        assert (order[:-1] >= order[1:]).all()  # most probable first
        # the top-k channel against a float64 recompute of the filtered distribution
        z = logits[b].double() / T
        support = torch.as_tensor(kept[b], dtype=torch.long)
        ref = z[support] - torch.logsumexp(z[support], 0)  # [n], most probable first
        n = min(8, len(support))
        assert ids[b, :n].tolist() == kept[b][:n].tolist()
        np.testing.assert_allclose(vals[b, :n], ref[:n].numpy(), atol=1e-5)
        assert (ids[b, n:] == -1).all() and (vals[b, n:] == 0).all()
    if top_k > 0:
        assert max(len(k) for k in kept) <= top_k


# --- collate and the replay store ---------------------------------------------------------------
def _sample(prompt, resp, kept=None, topk=None):
    return Sample(
        prompt_ids=prompt,
        response_ids=resp,
        rollout_logp=[-0.5] * len(resp),
        finish_reason="stop",
        weight_version=0,
        sampling_mask=None if kept is None else [np.array(k, np.int32) for k in kept],
        topk_ids=None if topk is None else np.array(topk[0], np.int32),
        topk_logp=None if topk is None else np.array(topk[1], np.float32),
    )


def test_collate_aligns_kept_sets_and_topk_with_the_tokens_they_score():
    a = _sample(
        [1, 2], [5, 6], kept=[[5, 7, 8], [6]], topk=([[5, 7], [6, -1]], [[-0.1, -2], [0, 0]])
    )
    b = _sample([3], [9], kept=[[9, 4]], topk=([[9, 4]], [[-0.3, -1.4]]))
    batch = collate([a, b], [1.0, -1.0], pad_id=0, need_mask=True, need_topk=2)
    assert batch.sampling_mask.dtype == torch.int32 and batch.sampling_mask.shape == (2, 4, 3)
    assert batch.sampling_mask[0].tolist() == [[-1] * 3, [-1] * 3, [5, 7, 8], [6, -1, -1]]
    assert batch.sampling_mask[1].tolist() == [[-1] * 3, [9, 4, -1], [-1] * 3, [-1] * 3]
    assert batch.topk_ids[0, 2:].tolist() == [[5, 7], [6, -1]]
    assert batch.topk_logp[1, 1].tolist() == pytest.approx([-0.3, -1.4])
    # a replay asking fewer than recorded keeps the most probable ones
    assert collate([a, b], [0, 0], 0, need_topk=1).topk_ids[0, 2:].tolist() == [[5], [6]]
    # minibatch rows carry them
    assert batch.select([1]).sampling_mask.tolist() == batch.sampling_mask[1:].tolist()
    with pytest.raises(ValueError, match="no sampling mask.*replay_sampling_mask"):
        collate([a, _sample([3], [9])], [0, 0], 0, need_mask=True)
    with pytest.raises(ValueError, match="no sampler top-k"):
        collate([a, _sample([3], [9])], [0, 0], 0, need_topk=2)
    plain = collate([a, _sample([3], [9])], [0, 0], 0)  # not needed: dropped
    assert plain.sampling_mask is None and plain.topk_ids is None


def test_the_replay_store_round_trips_kept_sets_and_topk():
    from sat_cli.replay.store import decode_step, encode_step

    a = _sample(
        [1, 2], [5, 6], kept=[[5, 7, 8], [6]], topk=([[5, 7], [6, -1]], [[-0.1, -2], [0, 0]])
    )
    b = _sample([3], [9], kept=[[9, 4]], topk=([[9, 4]], [[-0.3, -1.4]]))
    groups, _, _ = decode_step(encode_step(0, [[a, b]], [{"i": 0}], [[1.0, 0.0]]), "x")
    for got, want in zip(groups[0], (a, b), strict=True):
        assert [k.tolist() for k in got.sampling_mask] == [k.tolist() for k in want.sampling_mask]
        assert np.array_equal(got.topk_ids, want.topk_ids)
        assert np.array_equal(got.topk_logp, want.topk_logp)
    plain = _sample([1], [2])
    data = encode_step(0, [[plain]], [{"i": 0}], [[1.0]])
    (got,), _, _ = decode_step(data, "x")
    assert got[0].sampling_mask is None and got[0].topk_ids is None


# --- SGLang's wire format -----------------------------------------------------------------------
def test_the_captured_real_answer_parses_to_kept_sets():
    real = json.loads((CAPTURED / "generate_sampling_mask.json").read_text())
    for item in real["body"]:
        meta, ids = item["meta_info"], item["output_ids"]
        out = parse_extras(meta, ids, Extras(filtering=True, keep_mask=True))
        assert [k.tolist() for k in out["sampling_mask"]] == meta["output_token_sampling_mask"]
        assert out["rollout_logp"] == meta["output_token_sampling_logprobs"]
        assert all(t in k for t, k in zip(ids, out["sampling_mask"], strict=True))


def test_support_mode_and_top_logprobs_parse_to_the_sampled_distributions_top_k():
    # support mode: the kept set's log-probs; the behaviour log-prob is the sampled token's
    meta = {
        "output_token_sampling_mask": [[4, 9, 2], [7]],
        "output_token_sampling_logprobs": [[-0.2, -1.9, -3.0], [0.0]],
    }
    ex = Extras(filtering=True, keep_mask=True, topk=2)
    assert ex.payload_fields() == {
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }
    out = parse_extras(meta, [9, 7], ex)
    assert out["rollout_logp"] == [-1.9, 0.0]
    assert out["topk_ids"].tolist() == [[4, 9], [7, -1]]
    np.testing.assert_allclose(out["topk_logp"], [[-0.2, -1.9], [0.0, 0.0]], atol=1e-7)
    # no filter: top_logprobs_num's [[logprob, id, null], ...]
    ex = Extras(topk=2)
    assert ex.payload_fields() == {"top_logprobs_num": 2}
    top = {"output_top_logprobs": [[[-0.3, 5, None], [-1.5, 8, None]]]}
    out = parse_extras(top, [5], ex)
    assert out["topk_ids"].tolist() == [[5, 8]] and "rollout_logp" not in out
    assert Extras.of(SamplingParams(top_k=3, sampling_mask=True)) == Extras(True, True, 0)
    assert Extras.of(SamplingParams(sampling_mask=True)).payload_fields() == {}
    with pytest.raises(EngineError, match="not in its own kept set"):
        parse_extras(
            {"output_token_sampling_mask": [[1]], "output_token_sampling_logprobs": [0.0]},
            [3],
            Extras(True, True),
        )
    with pytest.raises(EngineError, match="output_top_logprobs has 0 entries for 1"):
        parse_extras({"output_top_logprobs": []}, [3], Extras(topk=2))


# --- the settings ---------------------------------------------------------------------------------
def test_settings_compose_reach_the_trainer_and_megatron_refuses_them(tmp_path):
    from sat_cli.build.components import build_trainer
    from sat_cli.config import ConfigError, load
    from sat_cli.config.schema import AlgoConfig

    _, obj = load(
        ["algo.replay_sampling_mask=true", "algo.score_centering_topk=4", "task.top_p=0.9"]
    )
    assert obj.algo.replay_sampling_mask and obj.algo.score_centering_topk == 4
    assert not AlgoConfig().replay_sampling_mask and AlgoConfig().score_centering_topk == 0
    with pytest.raises(ConfigError, match="score_centering_topk"):
        AlgoConfig(score_centering_topk=-1)
    both = "algo.replay_sampling_mask and algo.score_centering_topk need trainer=local"
    with pytest.raises(ConfigError, match=both):
        load(["trainer=megatron", "algo.replay_sampling_mask=true", "algo.score_centering_topk=2"])
    from trainer_checks import megatron_trainer

    with pytest.raises(ValueError, match="local trainer only"):
        megatron_trainer("unused", "unused", replay_sampling_mask=True)
    # the trainer gets both settings from the config (the engine's go in SamplingParams)
    model = Path(__file__).resolve().parents[1] / "sat_cli" / "assets" / "tiny_moe_warm"
    tr = build_trainer(obj, str(model), tmp_path)
    assert tr.replay_sampling_mask is True and tr.score_centering_topk == 4


def test_a_replay_refuses_records_the_recording_lacks():
    from sat_cli.commands.replay import check_match
    from sat_cli.errors import UserError

    rec = {
        "algo": {"replay_sampling_mask": False, "score_centering_topk": 2},
        "task": {"top_p": 0.9, "top_k": -1},
    }

    def composed(**algo):
        return {"algo": {**rec["algo"], **algo}, "task": rec["task"]}

    check_match(rec, composed(score_centering_topk=1), 1, 1)  # fewer: the most probable
    with pytest.raises(UserError, match="replay_sampling_mask=true needs each token's kept set"):
        check_match(rec, composed(replay_sampling_mask=True), 1, 1)
    with pytest.raises(UserError, match="score_centering_topk=3 needs the sampler's top-3"):
        check_match(rec, composed(score_centering_topk=3), 1, 1)
    no_filter = {"algo": {"replay_sampling_mask": True}, "task": {"top_p": 1.0, "top_k": -1}}
    check_match(rec | {"task": no_filter["task"]}, no_filter, 1, 1)  # a no-op: nothing needed
