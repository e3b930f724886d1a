"""Activation recompute (``trainer.recompute``) and optimizer offload (``trainer.optimizer_offload``)
in the megatron trainer, CPU path, in-process on one rank.

Recompute is megatron-core's full recompute, one layer at a time (``recompute_granularity="full"``,
``recompute_method="uniform"``, ``recompute_num_layers=1``): the forward keeps each layer's input
only and the backward reruns the layer. It must change memory, not numbers:
- log-probs, metrics and weights after a step are bit-identical to the run without it, with the
  KL reference, with R3 (the backward's rerun of each router must replay the recorded routes:
  the actor keeps them until the backward is done) and its audit;
- the check can fail: clearing the routes right after the forward (what the actor does without
  recompute) makes the rerun route freely, and the step's weights differ;
- the tensors autograd keeps for the backward (``saved_tensors_hooks``) shrink.
Optimizer offload on CPU: everything already is in host memory (``precision.py``), so a bf16
step with recompute and offload equals the plain bf16 step bit for bit; offload without bf16 is
refused. tp = 2 and pp = 2 with recompute through torchrun: tests/test_megatron_tp.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install '.[megatron]')"
)
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*"
)

from test_megatron_trainer import make_samples  # noqa: E402

from sat_cli.rl.config import LossConfig  # noqa: E402
from sat_cli.trainers.batch import collate  # noqa: E402
from sat_cli.trainers.megatron import convert, runtime  # noqa: E402
from sat_cli.trainers.megatron.actor import MegatronActor  # noqa: E402

LR = 5e-5
SAT_R3_KL = dict(
    loss=LossConfig(algo="grpo", adaptive=True, kl_coef=0.1),
    num_minibatches=2,
    r3=True,
    r3_audit=True,
    lr=LR,
    temperature=0.9,
)


@pytest.fixture(scope="session")
def megatron_dist(tmp_path_factory):
    runtime.init_distributed(file_store=tmp_path_factory.mktemp("dist") / "store")


def _run(tiny_dir, batch, after_build=None, **kw):
    """log-probs, step metrics and HF weights of a fresh actor. Actors are built and run one
    after the other: R3's router registry is global, the newest replay-enabled actor owns it."""
    actor = MegatronActor(str(tiny_dir), **kw)
    if after_build is not None:
        after_build(actor)
    logp = actor.logprobs(batch)
    metrics = actor.step(batch)
    return logp, metrics, actor.hf_state(), actor


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("r3", [True, False], ids=["sat_r3_kl", "sat_kl"])
def test_recompute_step_is_bit_identical(megatron_dist, tiny_dir, r3):
    kw = {**SAT_R3_KL, "r3": r3, "r3_audit": r3}
    batch = collate(*make_samples(n=7, seed=3), 0, need_routes=r3)
    lp0, m0, w0, a0 = _run(tiny_dir, batch, **kw)
    lp1, m1, w1, a1 = _run(tiny_dir, batch, recompute=True, **kw)
    assert a1.model.config.recompute_granularity == "full"
    assert a0.model.config.recompute_granularity is None
    assert torch.equal(lp0, lp1)
    for key, value in m0.items():
        if not key.startswith("perf/"):
            assert m1[key] == value, key
    assert _max_diff(w0, w1) == 0.0
    assert _max_diff(w0, convert.load_hf_state(tiny_dir)) >= 0.8 * LR  # the step moved them
    if r3:
        assert m1["r3/audit_rows"] > 0 and m1["r3/audit_mismatched_rows"] == 0
        # routes dropped after the forward: the backward's rerun routes by itself -> other grads
        lp2, m2, w2, _ = _run(
            tiny_dir,
            batch,
            after_build=lambda a: setattr(a, "recompute", False),
            recompute=True,
            **kw,
        )
        assert torch.equal(lp2, lp0)  # the forward itself still replays
        assert _max_diff(w0, w2) > 1e-5
        assert m2["loss/grad_norm"] != m0["loss/grad_norm"]


def _saved_bytes(actor, batch) -> int:
    """Bytes of the tensors autograd keeps for the backward during one training forward."""
    (logp, _), total = runtime.saved_for_backward(lambda: actor._model_forward(actor.model, batch))
    logp.sum().backward()  # frees them (and checks the backward runs)
    actor.model.zero_grad(set_to_none=True)
    return total


def test_recompute_keeps_fewer_activations(megatron_dist, tiny_dir):
    """Long rows, so the decoder layers' activations dominate the saved tensors."""
    batch = collate(*make_samples(n=4, seed=5, max_prompt=60, max_resp=60), 0)
    kw = dict(loss=LossConfig(algo="grpo"), lr=LR)
    full = _saved_bytes(MegatronActor(str(tiny_dir), **kw), batch)
    kept = _saved_bytes(MegatronActor(str(tiny_dir), recompute=True, **kw), batch)
    print(
        f"saved for backward: {full / 2**20:.2f} MiB without recompute, {kept / 2**20:.2f} MiB with"
    )
    assert kept < 0.35 * full


def test_bf16_recompute_and_offload_equal_plain_bf16(megatron_dist, tiny_dir):
    kw = {**SAT_R3_KL, "dtype": "bfloat16"}
    batch = collate(*make_samples(n=6, seed=4), 0, need_routes=True)
    _, m0, w0, a0 = _run(tiny_dir, batch, **kw)
    _, m1, w1, a1 = _run(tiny_dir, batch, recompute=True, optimizer_offload=True, **kw)
    assert a1.optimizer_offload and a1.main is not None  # CPU: fp32 main weights on the host
    assert all(p.device.type == "cpu" for p in a1.main.params)
    assert all(m1[k] == v for k, v in m0.items() if not k.startswith("perf/"))
    assert _max_diff(w0, w1) == 0.0
    assert _max_diff(a0.main.state(), a1.main.state()) == 0.0
    with pytest.raises(ValueError, match="optimizer_offload .* needs dtype bfloat16"):
        MegatronActor(str(tiny_dir), loss=LossConfig(algo="grpo"), optimizer_offload=True)
