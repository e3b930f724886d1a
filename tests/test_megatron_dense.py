"""Dense models in the megatron trainer: Qwen3 (q/k RMSNorm) and Llama (none) against transformers.

References: ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` of random tiny configs
(``sat_cli.models.tiny_dense``), their logits and their checkpoint's tensors. Checked: HF →
Megatron → logits equal to HF's within 1e-5 (fp32; 5e-7 seen) at tp 1 in this process and at
tp 2 (sequence parallel) and pp 2 on two gloo ranks under torchrun
(tests/megatron_dense_ranks.py); Megatron → HF bit-exact at all three; the dense MLP's
tensor-parallel split (each rank ``[gate_r; up_r]``) and the lazy per-rank load against the
eager split; R3 refused on a dense model. Skipped without the ``megatron`` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install '.[megatron]')"
)
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*"
)

from test_megatron_trainer import assert_same_step, make_samples  # noqa: E402

from sat_cli.models import hf_checkpoint  # noqa: E402
from sat_cli.models.tiny_dense import build_tiny_dense  # noqa: E402
from sat_cli.models.tiny_moe import save_hf  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.local import LocalTrainer  # noqa: E402
from sat_cli.trainers.megatron import convert, hf_io, pipeline, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402
from sat_cli.trainers.megatron.model import ModelSettings, build_gpt_model  # noqa: E402

B, S = 3, 24
ATOL = 1e-5  # fp32 logits: different kernels and summation order (5e-7 seen)
VARIANTS = {  # name: (family, seed, overrides)
    "qwen3": ("qwen3", 1, {}),
    "qwen3_tied": ("qwen3", 2, {"tie_word_embeddings": True}),
    "llama": ("llama", 3, {}),
}


@pytest.fixture(scope="session")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for name, (family, seed, overrides) in VARIANTS.items():
        out[name] = save_hf(build_tiny_dense(family, seed=seed, **overrides), None, root / name)
    return out


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (B, S), generator=g), torch.arange(S).expand(B, S)


def _same_state(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dense_logits_match_hf_and_round_trip(megatron_dist, dense_dirs, tmp_path, name):
    model_dir = dense_dirs[name]
    cfg = convert.read_hf_config(model_dir)
    model = build_gpt_model(cfg, ModelSettings())
    convert.load_hf_into_megatron(model, model_dir)
    model.eval()
    has_qk_norm = name.startswith("qwen3")
    q_norm = model.decoder.layers[0].self_attention.q_layernorm
    assert (type(q_norm).__name__ == "RMSNorm") == has_qk_norm
    assert any(".q_layernorm." in k for k in model.state_dict()) == has_qk_norm
    hf = _hf(model_dir)
    ids, pos = _batch()
    with torch.no_grad():
        got, ref = runtime.forward_logits(model, ids, pos), hf(ids).logits
    assert ref.std() > 0.05  # a real signal, not a constant
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    src = convert.load_hf_state(model_dir)
    back = convert.megatron_state_to_hf(model, cfg)
    _same_state(back, src)
    assert ("lm_head.weight" in back) != cfg["tie_word_embeddings"]
    out = hf_checkpoint.save_hf_checkpoint(back, tmp_path / "export", model_dir)
    with torch.no_grad():
        assert torch.equal(_hf(out)(ids).logits, ref)


def test_dense_tp_split_interleaves_gate_and_up(dense_dirs):
    cfg = convert.read_hf_config(dense_dirs["qwen3"])
    src = convert.load_hf_state(dense_dirs["qwen3"])
    full = convert.hf_to_megatron(src, cfg)
    ffn = cfg["intermediate_size"]
    for r in range(2):
        shard = convert.split_tp(full, r, 2)
        rows = slice(r * ffn // 2, (r + 1) * ffn // 2)
        h = "model.layers.2.mlp."
        fc1 = shard["decoder.layers.2.mlp.linear_fc1.weight"]
        # rank r: its block of gate rows, then the same block of up rows (SwiGLU chunks locally)
        assert torch.equal(
            fc1, torch.cat([src[h + "gate_proj.weight"][rows], src[h + "up_proj.weight"][rows]])
        )
        fc2 = shard["decoder.layers.2.mlp.linear_fc2.weight"]
        assert torch.equal(fc2, src[h + "down_proj.weight"][:, rows])
    _same_state(
        convert.megatron_to_hf(
            convert.gather_tp([convert.split_tp(full, r, 2) for r in range(2)]), cfg
        ),
        src,
    )
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        convert.split_tp(full, 0, 3)


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_dense_lazy_rank_load_is_the_eager_split(dense_dirs, name):
    cfg = convert.read_hf_config(dense_dirs[name])
    full = convert.hf_to_megatron(convert.load_hf_state(dense_dirs[name]), cfg)
    for tp, stage in ((1, None), (2, None), (1, (range(2, 4), False, True))):
        for tp_rank in range(tp):
            reader = hf_io.CheckpointReader(dense_dirs[name])
            plan = hf_io.rank_plan(reader, cfg, tp_rank=tp_rank, tp_size=tp)
            ref = convert.split_tp(full, tp_rank, tp)
            if stage is not None:
                plan, ref = pipeline.select_stage(plan, *stage), pipeline.select_stage(ref, *stage)
            _same_state({k: f() for k, f in plan.items()}, ref)


def test_dense_refuses_routing_replay(dense_dirs):
    cfg = convert.read_hf_config(dense_dirs["qwen3"])
    with pytest.raises(NotImplementedError, match="R3.*needs an MoE model"):
        build_gpt_model(cfg, ModelSettings(routing_replay=True))


def test_dense_tp2_and_pp2_logits_match_hf(dense_dirs, tmp_path):
    """Two gloo ranks under torchrun, tp 2 (sequence parallel) then pp 2, both families: the
    workers' own load (lazy, per rank) and gather (``MegatronActor.hf_state``)."""
    names = ["qwen3", "llama"]  # untied: pp > 1 refuses tied embeddings
    script = Path(__file__).with_name("megatron_dense_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script), str(tmp_path)]
    cmd += [str(dense_dirs[n]) for n in names]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for n, name in enumerate(names):
        hf = _hf(dense_dirs[name])
        src = convert.load_hf_state(dense_dirs[name])
        for layout in ("tp2", "pp2"):
            got = torch.load(tmp_path / f"{layout}-{n}.pt")
            with torch.no_grad():
                ref = hf(got["ids"]).logits
            assert ref.std() > 0.05
            torch.testing.assert_close(got["logits"], ref, atol=ATOL, rtol=0)
            _same_state(got["state"], src)
        ids = torch.load(tmp_path / f"tp2-{n}.pt")["ids"]
        with torch.no_grad():
            ref = hf(ids).logits
        for rank in (0, 1):
            _check_vocab_parallel(torch.load(tmp_path / f"tp2-{n}-vp{rank}.pt"), ids, ref)


def _check_vocab_parallel(vp: dict, ids: torch.Tensor, ref_logits: torch.Tensor) -> None:
    """The training path at tp 2: a rank holds half the vocabulary (never ``[B, S, V]``), and
    its log-probs, entropy and shard gradient equal a float64 reference on HF's logits."""
    from megatron_dense_ranks import T, loss_weights

    vocab = ref_logits.shape[-1]
    lo, hi = vp["rank"] * vocab // 2, (vp["rank"] + 1) * vocab // 2
    assert vp["grad"].shape[-1] == vocab // 2  # the shard, not the vocabulary
    z = ref_logits.detach().double()[:, :-1] / T
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    torch.testing.assert_close(vp["logp"][:, 1:].double(), lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(vp["entropy"][:, 1:].double(), ent, atol=ATOL, rtol=0)
    assert (vp["logp"][:, 0] == 0).all() and (vp["entropy"][:, 0] == 0).all()
    # d sum(W * logp) / d logits[b, s-1, v] = W[b, s] * (1[v = y] - softmax_v) / T
    w = loss_weights().double()[:, 1:, None]
    onehot = torch.nn.functional.one_hot(ids[:, 1:], vocab).double()
    grad = w * (onehot - lsm.exp()) / T
    torch.testing.assert_close(vp["grad"][:, :-1].double(), grad[..., lo:hi], atol=1e-6, rtol=0)
    assert (vp["grad"][:, -1] == 0).all() and grad[..., lo:hi].abs().max() > 1e-3
    assert ((ids[:, 1:] >= lo) & (ids[:, 1:] < hi)).any()  # some targets in this rank's half


def test_compose_time_families_are_the_workers():
    from sat_cli.trainers.megatron.checks import MEGATRON_FAMILIES
    from sat_cli.trainers.megatron.model import FAMILIES

    assert tuple(FAMILIES) == MEGATRON_FAMILIES


@pytest.mark.parametrize("name", ["qwen3_tied", "llama"])
def test_dense_actor_step_matches_local_trainer(megatron_dist, dense_dirs, name):
    """One training step at tp 1 (SAT-GRPO, two minibatches, KL to the reference model): the
    same log-probs (≤ 1e-5), losses (≤ 2e-6), grad norm and entropy (rel 1e-5) and weights after
    the step (≤ 1e-5, while the step moves them by ≥ 1e-4) as the local trainer
    (transformers), with tied embeddings (Qwen3) and without (Llama)."""
    model_dir = str(dense_dirs[name])
    loss = LossConfig(algo="grpo", adaptive=True, kl_coef=0.1)
    kw = dict(lr=1e-4, loss=loss, num_minibatches=2, temperature=0.9)
    samples, adv = make_samples(seed=4)
    batch = collate(samples, adv, pad_id=0)
    local, actor = LocalTrainer(model_dir, **kw), MegatronActor(model_dir, **kw)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(
        actor.logprobs(batch)[real], local.logprobs(batch)[real], atol=1e-5, rtol=0
    )
    loc_m, meg_m = local.step(batch), actor.step(batch)
    assert loc_m["loss/kl_k3"] > 0  # the second minibatch sees a moved policy
    loc_w = dict(local.model.state_dict())
    if "lm_head.weight" not in actor.hf_state():  # tied: one tensor, saved once
        loc_w.pop("lm_head.weight", None)
    assert_same_step(loc_m, meg_m, loc_w, actor.hf_state(), convert.load_hf_state(model_dir))


DIGITS_REWARD = "def score(prompt, response, row):\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n"


@pytest.mark.slow  # two `sat train` runs, ~1 min each on 2 cores
def test_sat_train_megatron_dense_learns_syncs_and_matches_local(tmp_path):
    """`sat train trainer=megatron` on a random tiny dense Qwen3 with a dense reward (the fraction
    of digits in the response; ~0.09 for the random model): the reward rises (0.085 → 0.267 seen
    in 12 steps at lr 1e-2), every version goes by broadcast and is verified (no fallback), and
    step 1's losses equal a `trainer=local` run's (same samples: same seed, version 0)."""
    from cli_helpers import run_sat
    from test_weight_sync_cli import run_metrics
    from tiny_hf import make_model

    model = make_model(tmp_path / "qwen3", "qwen3")
    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    common = [
        "train",
        f"model.path={model}",
        "reward=python",
        "reward.fn=digits.py:score",
        "task.prompts_per_step=8",
        "task.samples_per_prompt=4",
        "task.max_new_tokens=8",
        "eval.every=0",
        "trainer.lr=1e-2",
        "run.dir=runs",
    ]
    meg = ["trainer=megatron", "engine.weight_sync=distributed", "engine.verify_weights=every"]
    out = run_sat(*common, *meg, "max_steps=12", "run.name=meg", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_sat(*common, "max_steps=1", "run.name=loc", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (s1, m), (s2, loc) = run_metrics(tmp_path, "meg"), run_metrics(tmp_path, "loc")
    assert s1 == s2 == "FINISHED"
    reward = [v for _, v in m["rollout/reward_mean"]]
    assert len(reward) == 12 and sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.05, reward
    assert {v for _, v in m["weights/sync_fallback"]} == {0.0}
    assert len(m["weights/verify_s"]) >= 8 and min(v for _, v in m["weights/verify_s"]) > 0
    for key in ("loss/policy", "loss/entropy", "loss/grad_norm"):
        assert m[key][0][0] == loc[key][0][0] == 1
        assert m[key][0][1] == pytest.approx(loc[key][0][1], rel=1e-5, abs=2e-6), key
