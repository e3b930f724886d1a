"""megatron trainer vs the local trainer: same log-probs, same loss, same weights after a step.

``MegatronActor`` (the worker's state) is compared in-process with ``LocalTrainer`` (CPU, gloo,
world size 1); ``MegatronTrainer`` is then driven as the real torchrun subprocess over its
protocol, including a worker killed mid-step. Skipped without the ``megatron`` extra.

Tolerances: log-probs and losses agree to ~5e-7 (fp32, different kernels and summation order).
Weights after a step agree to ~2e-8 x (lr / 1e-6): Adam divides each gradient by its own
magnitude, so a float-level difference in a near-zero gradient moves that weight by a fraction
of ``lr``. With ``lr = 1e-4`` the largest difference is ~2e-6 while the update is 2e-4, so
``<= 1e-5`` is a real check (the test also asserts that the weights moved by >= 1e-4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install '.[megatron]')"
)
# megatron-core's own deprecation / "Apex is not installed" notices, hundreds per run
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*"
)

from trainer_checks import megatron_trainer  # noqa: E402

from sat_cli.engines.base import Sample  # noqa: E402
from sat_cli.models.r3 import R3Error  # noqa: E402
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf  # noqa: E402
from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.local import LocalTrainer  # noqa: E402
from sat_cli.trainers.megatron import convert, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402
from sat_cli.trainers.megatron.client import MegatronWorkerError  # noqa: E402
from sat_cli.util.procs import pid_alive as _pid_alive  # noqa: E402

SEED = 3
LAYERS, EXPERTS, TOP_K = 4, 8, 2


@pytest.fixture(scope="session")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    save_hf(build_tiny_moe(seed=SEED), build_char_tokenizer(), path)
    return path


def make_samples(n=8, seed=0, max_prompt=8, max_resp=12):
    """Right-padded variable lengths, stale-looking rollout log-probs, random valid routes."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        p = int(torch.randint(3, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(2, max_resp + 1, (1,), generator=g))
        ids = torch.randint(3, 100, (p + r,), generator=g).tolist()
        routes = torch.rand(p + r - 1, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
        samples.append(
            Sample(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                # near the tiny model's ~log(1/100): ratios spread around 1, some clipped
                rollout_logp=(-4.6 + 0.3 * torch.randn(r, generator=g)).tolist(),
                finish_reason="stop",
                weight_version=0,
                routed_experts=routes.numpy().astype(np.int32),
            )
        )
    adv = torch.randn(n, generator=g)
    return samples, adv


def hf_weights_of_local(trainer: LocalTrainer) -> dict[str, torch.Tensor]:
    return convert.unfuse_experts(dict(trainer.model.state_dict()))


def initial_weights(tiny_dir) -> dict[str, torch.Tensor]:
    return convert.load_hf_state(tiny_dir)


def assert_same_step(loc_metrics, meg_metrics, loc_w, meg_w, init_w):
    for key in ("loss/policy", "loss/total", "loss/kl_k3", "staleness/abs_logratio_mean"):
        assert meg_metrics[key] == pytest.approx(loc_metrics[key], abs=2e-6), key
    for key in ("loss/clipfrac", "loss/grad_norm", "loss/entropy", "perf/optimizer_steps"):
        assert meg_metrics[key] == pytest.approx(loc_metrics[key], rel=1e-5), key
    assert set(meg_w) == set(loc_w)
    worst = max((meg_w[k] - loc_w[k]).abs().max().item() for k in loc_w)
    moved = max((loc_w[k] - init_w[k]).abs().max().item() for k in loc_w)
    assert moved >= 1e-4  # the step really changed the weights
    assert worst <= 1e-5, worst


CONFIGS = {
    # SAT-GRPO, two optimizer steps per batch
    "sat_grpo": dict(
        loss=LossConfig(algo="grpo", adaptive=True), num_minibatches=2, temperature=0.9
    ),
    # SAT-GRPO with R3 (RouterReplay in megatron vs forward hooks in HF)
    "sat_grpo_r3": dict(
        loss=LossConfig(algo="grpo", adaptive=True),
        num_minibatches=2,
        temperature=0.9,
        r3=True,
        r3_audit=True,
    ),
    # the same with token-budget micro-batches (each minibatch's forwards split, one loss)
    "sat_grpo_r3_micro": dict(
        loss=LossConfig(algo="grpo", adaptive=True),
        num_minibatches=2,
        temperature=0.9,
        r3=True,
        r3_audit=True,
        max_tokens_per_micro_batch=40,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_actor_matches_local_trainer(megatron_dist, tiny_dir, name):
    kw = dict(lr=1e-4, **CONFIGS[name])
    samples, adv = make_samples()
    batch = collate(samples, adv, pad_id=0, need_routes=kw.get("r3", False))
    local, actor = LocalTrainer(str(tiny_dir), **kw), MegatronActor(str(tiny_dir), **kw)
    real = batch.attention_mask.bool()  # padding positions are never scored
    lp_l, lp_m = local.logprobs(batch), actor.logprobs(batch)
    torch.testing.assert_close(lp_m[real], lp_l[real], atol=1e-5, rtol=0)
    loc_metrics, meg_metrics = local.step(batch), actor.step(batch)
    assert_same_step(
        loc_metrics,
        meg_metrics,
        hf_weights_of_local(local),
        actor.hf_state(),
        initial_weights(tiny_dir),
    )
    assert actor.step_count == local.step_count == 1
    if kw.get("r3_audit"):
        # every replayed (token, layer) row used exactly the recorded experts, in both trainers
        rows = int(batch.recorded_routes.sum()) * actor.hf_config["num_hidden_layers"]
        for m in (loc_metrics, meg_metrics):
            assert m["r3/audit_rows"] == rows  # two minibatch forwards cover the batch once
            assert m["r3/audit_mismatched_rows"] == 0


@pytest.mark.parametrize("field", ["advantages", "rollout_logp"])
def test_actor_skips_a_nonfinite_update_like_the_local_trainer(megatron_dist, tiny_dir, field):
    # the actor gets its loss settings as the worker does: LossConfig -> JSON -> dict
    from trainer_checks import check_nonfinite_step_is_skipped, plant_nonfinite

    loss = LossConfig(algo="grpo", adaptive=True, kl_coef=0.1)
    actor = MegatronActor(str(tiny_dir), loss=json.loads(json.dumps(loss.to_dict())), lr=1e-4)
    assert actor.loss == loss
    samples, adv = make_samples(seed=6)
    clean = collate(samples, adv, pad_id=0)
    check_nonfinite_step_is_skipped(actor, clean, plant_nonfinite(clean, field))


def test_route_audits_see_routes_that_were_not_replayed(megatron_dist, tiny_dir):
    # The audits can fail: a forward WITHOUT replay against routes the routers did not choose.
    from sat_cli.models.r3 import RouteAudit as HFRouteAudit
    from sat_cli.trainers.megatron import runtime

    samples, adv = make_samples()
    batch = collate(samples, adv, pad_id=0, need_routes=True)
    wrong = batch.routed_experts  # random routes: the routers choose otherwise (27 in 28 rows)
    local, actor = LocalTrainer(str(tiny_dir)), MegatronActor(str(tiny_dir))
    args = (batch.input_ids, batch.attention_mask, batch.position_ids)
    with HFRouteAudit(local.model, wrong, batch.recorded_routes) as hf_audit, torch.no_grad():
        local.model(input_ids=args[0], attention_mask=args[1], position_ids=args[2])
    with runtime.RouteAudit(actor.model, wrong, batch.recorded_routes) as mg_audit:
        with torch.no_grad():
            runtime.token_logprobs(actor.model, args[0], args[2], args[1], 1.0)
    for audit in (hf_audit, mg_audit):
        assert audit.rows == int(batch.recorded_routes.sum()) * LAYERS
        assert audit.mismatched > 0.8 * audit.rows
    # ... and pass on the routes the model chose itself
    from sat_cli.models.r3 import RouteCapture

    with RouteCapture(local.model) as cap, torch.no_grad():
        local.model(input_ids=args[0], attention_mask=args[1], position_ids=args[2])
    own = cap.last_call().view(*batch.input_ids.shape, LAYERS, TOP_K)
    with HFRouteAudit(local.model, own, batch.recorded_routes) as hf_audit, torch.no_grad():
        local.model(input_ids=args[0], attention_mask=args[1], position_ids=args[2])
    assert hf_audit.rows > 0 and hf_audit.mismatched == 0


@pytest.mark.parametrize(
    "kw",
    [
        # GSPO with TIS (recompute pass), KL to a reference model, seq-mean-token-mean
        dict(loss=LossConfig(algo="gspo", correction="tis", kl_coef=0.1), num_minibatches=2),
        # the same with R3: the KL reference model replays the same routes
        dict(
            loss=LossConfig(algo="gspo", correction="tis", kl_coef=0.1), num_minibatches=2, r3=True
        ),
        # DPPO-TV, weight decay, three minibatches
        dict(
            loss=LossConfig(algo="dppo_tv", agg="seq-mean-token-sum"),
            weight_decay=0.1,
            num_minibatches=3,
        ),
    ],
    ids=["gspo_tis_kl", "gspo_tis_kl_r3", "dppo_tv_wd"],
)
def test_actor_matches_local_trainer_more_losses(megatron_dist, tiny_dir, kw):
    kw = dict(lr=1e-4, **kw)
    samples, adv = make_samples(n=9, seed=1)
    batch = collate(samples, adv, pad_id=0, need_routes=kw.get("r3", False))
    local, actor = LocalTrainer(str(tiny_dir), **kw), MegatronActor(str(tiny_dir), **kw)
    loc_metrics, meg_metrics = local.step(batch), actor.step(batch)
    for key in loc_metrics:
        if not key.startswith("perf/train"):
            assert meg_metrics[key] == pytest.approx(loc_metrics[key], rel=1e-4, abs=2e-6), key
    loc_w, meg_w = hf_weights_of_local(local), actor.hf_state()
    assert max((meg_w[k] - loc_w[k]).abs().max().item() for k in loc_w) <= 1e-5


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and _pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def test_trainer_subprocess_matches_local_and_dies_cleanly(tiny_dir, tmp_path):
    kw = dict(lr=1e-4, loss=LossConfig(algo="grpo", adaptive=True), num_minibatches=2, r3=True)
    samples, adv = make_samples(seed=2)
    batch = collate(samples, adv, pad_id=0, need_routes=True)
    work = tmp_path / "megatron"
    trainer = megatron_trainer(tiny_dir, work, logs_dir=tmp_path / "logs", **kw)
    try:
        # one node: torchrun's store binds a port the OS picks. A port picked before torchrun
        # binds it could be taken meanwhile; torchrun then waited on the stranger as a client
        # (seen: 5+ minutes, a gloo listener of another test process on the picked port)
        endpoint = trainer.command[trainer.command.index("--rdzv-endpoint") + 1]
        assert endpoint == "127.0.0.1:0"
        local = LocalTrainer(str(tiny_dir), **kw)
        real = batch.attention_mask.bool()
        torch.testing.assert_close(
            trainer.logprobs(batch)[real], local.logprobs(batch)[real], atol=1e-5, rtol=0
        )
        meg_metrics, loc_metrics = trainer.step(batch), local.step(batch)
        assert trainer.step_count == 1
        published = trainer.publish_weights(tmp_path / "weights", version=1)
        assert published == (tmp_path / "weights" / "v1").resolve()
        meg_w = convert.load_hf_state(published)
        assert_same_step(
            loc_metrics, meg_metrics, hf_weights_of_local(local), meg_w, initial_weights(tiny_dir)
        )
        # the published folder is a complete HF checkpoint
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32)
        assert AutoTokenizer.from_pretrained(published).eos_token == "<eos>"
        assert torch.equal(hf.lm_head.weight, meg_w["lm_head.weight"])
        # loop hooks: a skipped step counts, a new clip radius changes the next loss
        trainer.skip_step()
        local.skip_step()
        assert trainer.step_count == local.step_count == 2
        trainer.set_clip_radii(0.05, 0.1)
        local.set_clip_radii(0.05, 0.1)
        meg_diag, loc_diag = {}, {}
        meg2, loc2 = trainer.step(batch, meg_diag), local.step(batch, loc_diag)
        # the loss's per-token diagnostics come back over the protocol (two minibatches)
        assert sorted(meg_diag) == sorted(loc_diag)
        assert meg_diag["n_active"].tolist() == loc_diag["n_active"].tolist()
        assert torch.equal(meg_diag["gate"], loc_diag["gate"]) and meg_diag["gate"].any()
        for key in ("abs_d", "abs_d_mu", "contraction", "q"):
            torch.testing.assert_close(meg_diag[key], loc_diag[key], atol=1e-5, rtol=0)
        assert meg2["loss/clipfrac"] == pytest.approx(loc2["loss/clipfrac"], rel=1e-5)
        assert meg2["loss/policy"] == pytest.approx(loc2["loss/policy"], abs=2e-6)
        assert meg2["loss/clipfrac"] > meg_metrics["loss/clipfrac"]  # tighter radii clip more
        # an error inside a command is reported and the worker keeps serving
        no_routes = collate(samples, adv, pad_id=0)
        no_routes.routed_experts = None
        with pytest.raises(R3Error, match="no routed experts"):
            trainer.step(no_routes)
        # kill the worker in the middle of a step: clear error within seconds. The worker is
        # stopped (SIGSTOP) before the step is sent, so it cannot answer before the kill lands
        # however fast the machine (a timer alone raced a step that finished within it)
        (worker,), launcher = trainer.worker_pids, trainer.launcher_pid
        os.kill(worker, signal.SIGSTOP)
        killer = threading.Timer(0.5, os.kill, (worker, signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        with pytest.raises(MegatronWorkerError, match="died during step"):
            trainer.step(batch)
        assert time.monotonic() - t0 < 10.0
        assert not _pid_alive(worker) and not _pid_alive(launcher)
        assert _processes_mentioning(str(work)) == []  # no orphan torchrun or worker
        with pytest.raises(MegatronWorkerError, match="closed"):
            trainer.logprobs(batch)
    finally:
        trainer.close()


@pytest.mark.slow
def test_trainer_save_load_resumes_exactly(tiny_dir, tmp_path):
    kw = dict(lr=1e-3, loss=LossConfig(algo="grpo"), num_minibatches=2)
    b1 = collate(*make_samples(seed=4), 0)
    b2 = collate(*make_samples(seed=5), 0)
    with megatron_trainer(tiny_dir, tmp_path / "a", **kw) as a:
        a.step(b1)
        a.save(tmp_path / "ckpt")
        expect = a.step(b2)
        expect_w = convert.load_hf_state(a.publish_weights(tmp_path / "wa", 2))
    with megatron_trainer(tiny_dir, tmp_path / "b", **kw) as b:
        b.load(tmp_path / "ckpt")
        assert b.step_count == 1
        got = b.step(b2)
        got_w = convert.load_hf_state(b.publish_weights(tmp_path / "wb", 2))
    assert got["loss/policy"] == expect["loss/policy"]
    for k in expect_w:
        assert torch.equal(got_w[k], expect_w[k]), k


@pytest.mark.slow
def test_trainer_rejects_parallel_sizes_it_cannot_run(tiny_dir, tmp_path):
    with pytest.raises(MegatronWorkerError, match="cp must be 1"):
        megatron_trainer(tiny_dir, tmp_path / "w", cp=2)
    assert _processes_mentioning(str(tmp_path / "w")) == []


def test_trainer_rejects_unknown_options(tiny_dir, tmp_path):
    with pytest.raises(TypeError, match="unknown trainer options"):
        megatron_trainer(tiny_dir, tmp_path / "w", learning_rate=1.0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        megatron_trainer(tiny_dir, tmp_path / "w", loss=LossConfig(algo="nope"))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "dp2_ep2"])
def test_two_ranks_match_local_trainer(tiny_dir, tmp_path, ep):
    # world size 2 on CPU (gloo): rows split over the ranks, experts split when ep=2; an odd
    # batch (7 rows, minibatches of 4 and 3) exercises the padded shards
    loss = LossConfig(algo="grpo", adaptive=True)
    kw = dict(lr=1e-4, loss=loss, num_minibatches=2, r3=True, r3_audit=True)
    batch = collate(*make_samples(n=7, seed=2), 0, need_routes=True)
    local = LocalTrainer(str(tiny_dir), **kw)
    with megatron_trainer(tiny_dir, tmp_path / "w", nproc_per_node=2, ep=ep, **kw) as tr:
        assert len(tr.worker_pids) == 2
        real = batch.attention_mask.bool()
        torch.testing.assert_close(
            tr.logprobs(batch)[real], local.logprobs(batch)[real], atol=1e-5, rtol=0
        )
        meg_metrics, loc_metrics = tr.step(batch), local.step(batch)
        meg_w = convert.load_hf_state(tr.publish_weights(tmp_path / "weights", 1))
        tr.save(tmp_path / "ckpt")
        tr.load(tmp_path / "ckpt")
        assert tr.step_count == 1
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "model",
        "optimizer_rank0.safetensors",
        "optimizer_rank1.safetensors",
        "trainer_state.json",
    ]
    assert_same_step(
        loc_metrics, meg_metrics, hf_weights_of_local(local), meg_w, initial_weights(tiny_dir)
    )
    assert meg_metrics["r3/audit_rows"] == loc_metrics["r3/audit_rows"] > 0  # summed over ranks
    assert meg_metrics["r3/audit_mismatched_rows"] == 0


@pytest.mark.slow
def test_killed_orchestrator_leaves_no_worker(tiny_dir, tmp_path):
    # The orchestrator dies without close(): the worker sees EOF on stdin and exits, and
    # torchrun follows; nothing is left running.
    work = tmp_path / "w"
    code = (
        "import json, sys, time\n"
        "from sat_cli.trainers.megatron.client import MegatronTrainer\n"
        "from sat_cli.trainers.megatron.settings import MegatronRuntime as R\n"
        "from sat_cli.trainers.megatron.settings import MegatronTrainerSettings as S\n"
        f"t = MegatronTrainer(S(), R({str(tiny_dir)!r}, {str(work)!r}))\n"
        "print(json.dumps([t.launcher_pid] + t.worker_pids), flush=True)\n"
        "time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    orchestrator = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, cwd=str(root)
    )
    try:
        pids = json.loads(orchestrator.stdout.readline())
        assert all(_pid_alive(p) for p in pids)
        orchestrator.kill()
        orchestrator.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _processes_mentioning(str(work)):
            time.sleep(0.2)
        assert _processes_mentioning(str(work)) == []
        assert not any(_pid_alive(p) for p in pids)
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
