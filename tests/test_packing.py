"""Sequence packing and token-budget micro-batches (trainers/packing.py, trainers/micro.py):
hand cases of the first-fit-decreasing rows, the pack/unpack maps, the block-diagonal mask and
the micro-batch groups; then the local trainer's packed and split steps against the padded,
unsplit one — log-probs, losses and gradients — in float64 (1e-10) and float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sat_cli.engines.base import Sample
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf
from sat_cli.rl.config import LossConfig
from sat_cli.trainers import packing
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer
from sat_cli.trainers.packing import PackPlan, first_fit_decreasing, micro_batches

LAYERS, EXPERTS, TOPK = 4, 8, 2  # the tiny model's


def test_first_fit_decreasing_hand_case():
    # longest first (ties in index order), each into the first row with room; 9 > 8: own row
    assert first_fit_decreasing([3, 5, 2, 9, 4, 3], 8) == [[3], [1, 0], [4, 5], [2]]
    assert first_fit_decreasing([2, 2, 2], 4) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([1], 0)


def test_pack_plan_maps_spans_and_mask_hand_case():
    # batch of 3 right-padded rows of width 4, lengths 2, 4, 1; capacity 4 -> rows [1], [0, 2]
    plan = PackPlan.build([2, 4, 1], 4, 4)
    assert plan.rows == [[1], [0, 2]]
    assert plan.src.tolist() == [[4, 5, 6, 7], [0, 1, 8, -1]]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert plan.segments.tolist() == [[0, 0, 0, 0], [0, 0, 1, -1]]
    t = torch.arange(12).reshape(3, 4)
    assert plan.pack(t, fill=-7).tolist() == [[4, 5, 6, 7], [0, 1, 8, -7]]
    back = plan.unpack(plan.pack(t))
    assert back.tolist() == [[0, 1, 0, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    # a sample's first token is scored across the boundary: zeroed
    assert plan.unpack_scored(plan.pack(t)).tolist() == [[0, 1, 0, 0], [0, 5, 6, 7], [0, 0, 0, 0]]
    assert plan.spans == [[(0, 4)], [(0, 2), (2, 3), (3, 4)]]  # the padding: a segment too
    m = plan.attention_mask()[:, 0].int().tolist()
    assert m[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert m[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_packing_only_where_it_saves_slots():
    assert PackPlan.build([4, 4, 4, 4], 4, 8).saves(16) is False  # 2 x 8 slots = 16: no gain
    assert PackPlan.build([4, 1, 1, 1], 4, 8).saves(16) is True  # one row of 7 < 0.9 x 16


def test_micro_batch_groups_hand_case():
    lengths = [3, 5, 2, 9, 4, 3]
    # padded: longest first, count x longest <= 10: [9], [5, 4] (2x5), [3, 3, 2] (3x3)
    assert micro_batches(lengths, 10) == [[3], [1, 4], [0, 5, 2]]
    # packed rows of 8 ([3], [1, 0], [4, 5], [2] as above), real tokens <= 10 per group
    assert micro_batches(lengths, 10, 8) == [[3], [1, 0], [4, 5, 2]]
    assert micro_batches(lengths, 100) == [[3, 1, 4, 0, 5, 2]]
    with pytest.raises(ValueError, match="budget"):
        micro_batches(lengths, 0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(build_tiny_moe(3), build_char_tokenizer(), tmp_path_factory.mktemp("m") / "v0")


def _sample(rng, P: int, R: int) -> Sample:
    """An off-policy sample: random tokens and log mu, routes, kept sets (the drawn token
    first) and the sampler's top-3 of each response token."""
    resp = rng.integers(3, 100, R).tolist()
    perm = np.argsort(rng.random((P + R - 1, LAYERS, EXPERTS)), axis=-1)
    kept = []
    for y in resp:
        others = rng.permutation([v for v in range(3, 100) if v != y])[:5]
        kept.append(np.concatenate([[y], others]).astype(np.int32))
    return Sample(
        rng.integers(3, 100, P).tolist(),
        resp,
        (-rng.random(R) * 3).tolist(),
        "stop",
        0,
        routed_experts=perm[..., :TOPK].astype(np.int32),
        sampling_mask=kept,
        topk_ids=np.stack([k[:3] for k in kept]),
        topk_logp=(-rng.random((R, 3))).astype(np.float32),
    )


def _batch(seed: int = 0, n: int = 12):
    """A batch of ``n`` samples of long-tailed lengths (Pareto responses, 2..40 tokens)."""
    rng = np.random.default_rng(seed)
    lens = [(int(rng.integers(1, 6)), int(min(2 + rng.pareto(1.2) * 3, 40))) for _ in range(n)]
    samples = [_sample(rng, P, R) for P, R in lens]
    adv = rng.normal(size=n).tolist()
    return collate(samples, adv, pad_id=0, need_routes=True, need_mask=True, need_topk=3)


LOSSES = {
    # token-mean, TIS (pi_old recomputed: split no-grad forwards), score centering (top-k channel)
    "grpo": LossConfig(algo="grpo", correction="tis", score_centering=True),
    # SAT's q over blocks of 5 rows, seq-mean-token-mean
    "sat": LossConfig(algo="gspo_token", adaptive=True, q_rows=5, agg="seq-mean-token-mean"),
}


def _run(ckpt, loss, dtype, **opts):
    """(log-probs before the step, step metrics, per-token diagnostics, gradients)."""
    t = LocalTrainer(
        str(ckpt),
        loss=loss,
        lr=1e-3,
        grad_clip=0.0,
        r3=True,
        r3_audit=True,
        replay_sampling_mask=True,
        score_centering_topk=3,
        ledger_keep=2,
        **opts,
    )
    t.model.to(dtype)
    if dtype == torch.float64:  # grouped_mm (the default experts kernel) has no float64
        t.model.set_experts_implementation("eager")
    batch = _batch()
    logp = t.forward_nograd(t.model, batch)[0]
    diag: dict = {}
    metrics = t.step(batch, diag)
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    return batch, logp, metrics, diag, grads


def _compare(ref, got, tol):
    batch, logp0, m0, d0, g0 = ref
    _, logp1, m1, d1, g1 = got
    mask = batch.loss_mask.bool()
    assert float((logp0 - logp1)[batch.attention_mask.bool()].abs().max()) <= tol
    assert set(m0) == set(m1)
    for k in m0:
        if k != "perf/train_s":
            assert m1[k] == pytest.approx(m0[k], abs=tol, rel=tol), k
    for k in d0:
        a, b = d0[k], d1[k]
        if a.shape == mask.shape:
            a, b = a[mask], b[mask]
        assert a.shape == b.shape, k
        assert a.numel() == 0 or float((a.double() - b.double()).abs().max()) <= tol, k
    assert set(g0) == set(g1) and g0
    for n in g0:
        scale = max(float(g0[n].abs().max()), 1.0)
        assert float((g0[n] - g1[n]).abs().max()) <= tol * scale, n


@pytest.mark.parametrize("segments", [False, True], ids=["mask", "segments"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_packed_and_split_steps_equal_the_padded_one_in_float64(ckpt, name, segments, monkeypatch):
    # rows of 45 tokens: the block-diagonal mask; or, with the threshold at 0, segment attention
    monkeypatch.setattr(packing, "SEGMENT_MIN_ROW", 0 if segments else 256)
    lengths = _batch().attention_mask.sum(1).tolist()
    assert PackPlan.build(lengths, max(lengths), 45).saves(len(lengths) * max(lengths))
    budget = 60
    assert len(micro_batches(lengths, budget)) >= 3  # the batch really splits
    assert len(micro_batches(lengths, budget, 45)) >= 3
    ref = _run(ckpt, LOSSES[name], torch.float64)
    assert ref[2]["r3/audit_rows"] > 0
    for opts in (
        {"max_tokens_per_row": 45},
        {"max_tokens_per_micro_batch": budget},
        {"max_tokens_per_row": 45, "max_tokens_per_micro_batch": budget},
    ):
        _compare(ref, _run(ckpt, LOSSES[name], torch.float64, **opts), 1e-10)


def test_packed_step_in_float32_within_tolerance(ckpt):
    ref = _run(ckpt, LOSSES["sat"], torch.float32)
    got = _run(
        ckpt, LOSSES["sat"], torch.float32, max_tokens_per_row=45, max_tokens_per_micro_batch=60
    )
    _compare(ref, got, 2e-5)


BAD_BUDGETS = {
    "zero row": (
        ["trainer.max_tokens_per_row=0"],
        r"trainer\.max_tokens_per_row=0 is out of range",
    ),
    "negative micro": (
        ["trainer.max_tokens_per_micro_batch=-5"],
        r"trainer\.max_tokens_per_micro_batch=-5 is out of range",
    ),
    # the default task.max_new_tokens=16: a sample may have 17 tokens
    "row below a sample": (["trainer.max_tokens_per_row=16"], "below the longest sample"),
    "micro below a sample": (["trainer.max_tokens_per_micro_batch=10"], "below the longest"),
    "micro below a row": (
        ["trainer.max_tokens_per_row=64", "trainer.max_tokens_per_micro_batch=40"],
        "a packed row would not fit a micro-batch",
    ),
    "megatron packing": (
        ["trainer=megatron", "trainer.max_tokens_per_row=64"],
        "Transformer Engine",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_BUDGETS))
def test_bad_token_budgets_are_refused_at_compose_time(name):
    from sat_cli.config import load
    from sat_cli.validate import ConfigError

    overrides, needle = BAD_BUDGETS[name]
    with pytest.raises(ConfigError, match=needle):
        load(overrides)
    _, obj = load(["trainer.max_tokens_per_row=17", "trainer.max_tokens_per_micro_batch=17"])
    assert (obj.trainer.max_tokens_per_row, obj.trainer.max_tokens_per_micro_batch) == (17, 17)


def test_the_trainers_token_budget_is_the_smaller_of_its_two():
    """``TrainerSettings.token_budget()``: what `sat train` checks the training prompts
    against (both trainers: their rows and micro-batches)."""
    from sat_cli.config import load

    cases = {
        (): None,
        ("trainer.max_tokens_per_row=64",): 64,
        ("trainer.max_tokens_per_row=64", "trainer.max_tokens_per_micro_batch=80"): 64,
        ("trainer.max_tokens_per_micro_batch=80",): 80,
        ("trainer=megatron", "trainer.max_tokens_per_micro_batch=96"): 96,
    }
    assert {k: load(list(k))[1].trainer.token_budget() for k in cases} == cases


def test_budget_below_a_sample_exits_2_and_writes_nothing(tmp_path):
    from cli_helpers import run_sat

    out = run_sat("train", "trainer.max_tokens_per_row=8", "run.dir=runs", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "trainer.max_tokens_per_row=8 is below the longest sample" in out.stderr
    assert "Traceback" not in out.stderr and not list(tmp_path.iterdir())


def test_prompts_longer_than_the_budget_are_refused_before_the_run(tmp_path):
    from sat_cli.commands.preflight import check_token_budget
    from sat_cli.errors import UserError
    from sat_cli.tasks.toy import ToyTask

    task, tok = ToyTask(digits=3, seed=0, heldout_size=4), build_char_tokenizer()
    n = len(tok(task.sample_prompts(1, 0)[0]["prompt"], add_special_tokens=False)["input_ids"])
    check_token_budget(task, tok, n + 16, 16)  # the longest sample fits exactly
    with pytest.raises(UserError, match=f"more than {n - 1} tokens"):
        check_token_budget(task, tok, n + 15, 16)
