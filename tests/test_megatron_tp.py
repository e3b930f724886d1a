"""Tensor and pipeline parallelism in the megatron trainer (gloo ranks) against one rank.

References are the single-rank results: ``MegatronActor`` in this process (world size 1, which
tests/test_megatron_trainer.py checks against ``LocalTrainer``) and, for the command line, a
``trainer.tp=1`` run. Checked for tp = 2 and pp = 2 on two ranks (and, in the slow set,
tp 2 x ep 2 x dp 2, tp 2 x pp 2 and pp 2 x ep 2 x dp 2 on four): the HF ⇄ Megatron
tensor-parallel split and pipeline-stage selection (bit-exact, also through the real load and
export), log-probs (≤ 1e-5), one training step's metrics and weights (≤ 1e-5; with the
grad-norm clip active, so the clip norm must count every parameter once), with and without R3
(routes split over the sequence-parallel ranks and the stages' layers), the KL reference model,
a checkpoint save → load that resumes bit-exactly, and a non-finite loss that every rank skips
together; tp = 2 (and, slow, pp = 2) also with activation recompute in the workers
(``trainer.recompute``: R3's routes replayed by the backward's rerun of each layer).

Weights after a step: Adam turns float-level gradient differences of near-zero gradients into
weight differences of a fraction of ``lr`` (see tests/test_megatron_trainer.py); with
``lr = 5e-5`` the largest difference seen is 7e-7 against an update of ~5e-5.
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
from trainer_checks import megatron_trainer, plant_nonfinite  # noqa: E402

from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.megatron import convert, pipeline, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402
from sat_cli.trainers.megatron.worker import check_layout  # noqa: E402
from sat_cli.trainers.step import NONFINITE_METRIC  # noqa: E402

LR = 5e-5


@pytest.fixture(scope="session")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


def test_tp_split_and_gather_are_bit_exact(tiny_dir):
    cfg = convert.read_hf_config(tiny_dir)
    src = convert.load_hf_state(tiny_dir)
    full = convert.hf_to_megatron(src, cfg)
    shards = [convert.split_tp(full, r, 2) for r in range(2)]
    hd, groups = cfg["head_dim"], cfg["num_key_value_heads"]
    q_per_group = cfg["num_attention_heads"] // groups
    for r, shard in enumerate(shards):
        # rank r holds KV group r whole: its query heads, then its key and value head
        h = "model.layers.1.self_attn."
        q = src[h + "q_proj.weight"].view(groups, q_per_group * hd, -1)[r]
        k = src[h + "k_proj.weight"].view(groups, hd, -1)[r]
        v = src[h + "v_proj.weight"].view(groups, hd, -1)[r]
        qkv = shard["decoder.layers.1.self_attention.linear_qkv.weight"]
        assert torch.equal(qkv, torch.cat([q, k, v]))
        # ... and the o_proj input columns of those query heads
        cols = slice(r * q_per_group * hd, (r + 1) * q_per_group * hd)
        proj = shard["decoder.layers.1.self_attention.linear_proj.weight"]
        assert torch.equal(proj, src[h + "o_proj.weight"][:, cols])
        rows = slice(r * cfg["vocab_size"] // 2, (r + 1) * cfg["vocab_size"] // 2)
        assert torch.equal(shard["output_layer.weight"], src["lm_head.weight"][rows])
        assert torch.equal(
            shard["embedding.word_embeddings.weight"], src["model.embed_tokens.weight"][rows]
        )
        # norms, router and experts are whole on every rank
        for key in ("decoder.layers.1.mlp.router.weight", "decoder.final_layernorm.weight"):
            assert shard[key] is full[key]
    back = convert.megatron_to_hf(convert.gather_tp(shards), cfg)
    assert set(back) == set(src)
    for key in src:
        assert torch.equal(back[key], src[key]), key
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        convert.split_tp(full, 0, 3)


def test_pipeline_stages_select_and_renumber_layers(tiny_dir):
    cfg = convert.read_hf_config(tiny_dir)
    full = convert.hf_to_megatron(convert.load_hf_state(tiny_dir), cfg)
    first = pipeline.select_stage(full, range(0, 2), first=True, last=False)
    last = pipeline.select_stage(full, range(2, 4), first=False, last=True)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert "output_layer.weight" not in first and "decoder.final_layernorm.weight" not in first
    assert not any(".layers.2." in k or ".layers.3." in k for k in first | last)
    key = "decoder.layers.{}.mlp.experts.local_experts.5.linear_fc2.weight"
    assert last[key.format(1)] is full[key.format(3)]
    merged = {**first, **{pipeline._renumber(k, 2): v for k, v in last.items()}}
    assert merged.keys() == full.keys() and all(merged[k] is full[k] for k in full)


def test_worker_refuses_layouts_it_cannot_run():
    check_layout(4, tp=2, pp=1, ep=2, cp=1)  # dp 2 x tp 2, experts over 2 ranks
    check_layout(4, tp=2, pp=2, ep=1, cp=1)
    with pytest.raises(NotImplementedError, match="cp must be 1.*cp=2"):
        check_layout(2, tp=1, pp=1, ep=1, cp=2)
    with pytest.raises(ValueError, match="tp=2 x pp=1 does not divide the world size 1"):
        check_layout(1, tp=2, pp=1, ep=1, cp=1)
    with pytest.raises(ValueError, match="ep=2 does not divide the ranks of a pipeline stage"):
        check_layout(2, tp=1, pp=2, ep=2, cp=1)


def _assert_same_step(one, two, w_one, w_two, init):
    for key, value in one.items():
        if not key.startswith("perf/train"):
            assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(w_two) == set(w_one)
    worst = max((w_two[k] - w_one[k]).abs().max().item() for k in w_one)
    moved = max((w_one[k] - init[k]).abs().max().item() for k in w_one)
    assert moved >= 0.8 * LR  # the step really moved the weights
    assert worst <= 1e-5, worst
    return worst


# SAT-GRPO + R3 with the audit (seed 3: 17 columns, padded to 18 for the sequence-parallel split)
SAT_R3 = (
    dict(loss=LossConfig(algo="grpo", adaptive=True), num_minibatches=2, r3=True, r3_audit=True),
    3,
)
# GSPO + TIS (pi_old recompute) + KL to the reference model (also split), no R3
GSPO_KL = (dict(loss=LossConfig(algo="gspo", correction="tis", kl_coef=0.1), num_minibatches=2), 2)
CASES = {  # name: (options and samples seed, ranks, tp, pp, ep)
    "tp2_sat_r3": (SAT_R3, 2, 2, 1, 1),
    "pp2_sat_r3": (SAT_R3, 2, 1, 2, 1),
    "tp2_gspo_kl": (GSPO_KL, 2, 2, 1, 1),
    "pp2_gspo_kl": (GSPO_KL, 2, 1, 2, 1),
    # four ranks: dp 2 x tp 2 with experts over ep 2 (7 rows: padded data-parallel shards)
    "tp2_ep2_dp2_sat_r3": (SAT_R3, 4, 2, 1, 2),
    "tp2_pp2_sat_r3": (SAT_R3, 4, 2, 2, 1),
    "pp2_ep2_dp2_sat_r3": (SAT_R3, 4, 1, 2, 2),
    # the workers with activation recompute (trainer.recompute) against one rank without
    "tp2_recompute_sat_r3": (SAT_R3, 2, 2, 1, 1),
    "pp2_recompute_gspo_kl": (GSPO_KL, 2, 1, 2, 1),
}
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [
        "tp2_sat_r3",
        pytest.param("pp2_sat_r3", marks=SLOW),
        pytest.param("tp2_gspo_kl", marks=SLOW),
        pytest.param("pp2_gspo_kl", marks=SLOW),
        pytest.param("tp2_ep2_dp2_sat_r3", marks=SLOW),
        pytest.param("tp2_pp2_sat_r3", marks=SLOW),
        pytest.param("pp2_ep2_dp2_sat_r3", marks=SLOW),
        pytest.param("tp2_recompute_sat_r3", marks=SLOW),
        pytest.param("pp2_recompute_gspo_kl", marks=SLOW),
    ],
)
def test_model_parallel_matches_one_rank(megatron_dist, tiny_dir, tmp_path, name):
    (options, seed), ranks, tp, pp, ep = CASES[name]
    kw = dict(lr=LR, temperature=0.9, **options)
    r3 = kw.get("r3", False)
    batch = collate(*make_samples(n=7, seed=seed), 0, need_routes=r3)
    b2 = collate(*make_samples(n=5, seed=seed + 10), 0, need_routes=r3)
    one = MegatronActor(str(tiny_dir), **kw)
    launch = dict(nproc_per_node=ranks, tp=tp, pp=pp, ep=ep, recompute="recompute" in name)
    with megatron_trainer(tiny_dir, tmp_path / "w", **launch, **kw) as tr:
        assert len(tr.worker_pids) == ranks
        recompute = "full" if "recompute" in name else "none"
        assert f"float32, recompute={recompute}, optimizer on host)" in tr.log_path.read_text()
        # HF -> Megatron (TP shards, stages) -> HF through the real load and export: bit-exact
        exported = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 0))
        src = convert.load_hf_state(tiny_dir)
        assert set(exported) == set(src)
        assert all(torch.equal(exported[k], src[k]) for k in src)
        real = batch.attention_mask.bool()
        diff_lp = (tr.logprobs(batch) - one.logprobs(batch))[real].abs().max().item()
        assert diff_lp <= 1e-5
        two_m, one_m = tr.step(batch), one.step(batch)
        assert two_m["loss/grad_norm"] > kw.get("grad_clip", 1.0)  # the clip is active
        w_two = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 1))
        worst = _assert_same_step(one_m, two_m, one.hf_state(), w_two, src)
        if r3:
            assert two_m["r3/audit_rows"] > 0 and two_m["r3/audit_mismatched_rows"] == 0
        # checkpoint: per-rank optimizer shards; a loaded checkpoint resumes bit-exactly
        tr.save(tmp_path / "ckpt")
        expect = tr.step(b2)
        expect_w = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 2))
        tr.load(tmp_path / "ckpt")
        assert tr.step_count == 1
        got = tr.step(b2)
        got_w = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 3))
        # a non-finite loss: every rank skips the backward together (no send waits forever)
        skipped = tr.step(plant_nonfinite(b2, "advantages"))
        assert skipped[NONFINITE_METRIC] == 1.0
        same_w = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 4))
        assert all(torch.equal(same_w[k], got_w[k]) for k in got_w)
    assert got["loss/policy"] == expect["loss/policy"]
    assert all(torch.equal(got_w[k], expect_w[k]) for k in expect_w)
    meta = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert (meta["world_size"], meta["tp"], meta["pp"], meta["ep"]) == (ranks, tp, pp, ep)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("optimizer*")) == [
        f"optimizer_rank{r}.safetensors" for r in range(ranks)
    ]
    print(f"{name} vs one rank: log-probs {diff_lp:.1e}, weights {worst:.1e}")


def _run_history(root, name: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sat")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow
def test_sat_train_tp2_and_pp2_match_tp1(tmp_path):
    """`sat train trainer=megatron trainer.tp=2 max_steps=3` end to end (two ranks: the default
    trainer.nproc_per_node is tp x pp), and the same with trainer.pp=2, against the run with tp=1: the same losses, entropies
    and gradient norms at every
    step and the same final weights (≤ 5e-5, 1.7e-5 seen, after three steps at lr 3e-4 of which
    the last has a gradient; it moves the weights by 1.9e-4)."""
    from cli_helpers import MEGATRON_SMOKE, run_sat

    common = ["train", *MEGATRON_SMOKE, "max_steps=3"]
    # two ranks each: trainer.nproc_per_node defaults to tp x pp
    layouts = {"tp1": [], "tp2": ["trainer.tp=2"], "pp2": ["trainer.pp=2"]}
    for name, extra in layouts.items():
        out = run_sat(*common, f"run.name={name}", *extra, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "runs/sat/tp2/logs/megatron_trainer.log").read_text()
    assert "peak RSS after model load" in log and "(tp=2, pp=1, ep=1, world=2;" in log
    assert (
        "(tp=1, pp=2, ep=1, world=2;"
        in (tmp_path / "runs/sat/pp2/logs/megatron_trainer.log").read_text()
    )
    assert max(v for _, v in _run_history(tmp_path, "tp1", "loss/grad_norm")) > 0

    def weights(name, step):
        return convert.load_hf_state(tmp_path / f"runs/sat/{name}/checkpoints/{step}/trainer/model")

    one, before = weights("tp1", "step_3"), weights("tp1", "step_2")
    assert max((one[k] - before[k]).abs().max().item() for k in one) > 1e-4
    for other in ("tp2", "pp2"):
        for key in ("loss/policy", "loss/grad_norm", "loss/entropy"):
            ref, got = _run_history(tmp_path, "tp1", key), _run_history(tmp_path, other, key)
            assert [s for s, _ in got] == [s for s, _ in ref] == [1, 2, 3], key
            for (_, a), (_, b) in zip(ref, got, strict=True):
                assert b == pytest.approx(a, rel=1e-5, abs=1e-6), (other, key)
        two = weights(other, "step_3")
        assert max((one[k] - two[k]).abs().max().item() for k in one) <= 5e-5, other
