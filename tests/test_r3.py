"""R3: capture in the engine's sampling loop, replay in a training forward (ALGORITHMS.md §6)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from sat_cli.engines.base import Sample
from sat_cli.engines.local.worker import sample_batch
from sat_cli.models.r3 import R3Error, RouteCapture, RouteReplay
from sat_cli.models.tiny_moe import build_tiny_moe, moe_gates
from sat_cli.trainers.batch import collate

PROMPTS = [[20, 21, 22, 14, 23, 24, 25, 32], [40, 41, 14, 42, 32], [50, 32]]


@pytest.fixture(scope="module")
def rollout():
    """Samples with captured routes from a seeded tiny model, collated for training."""
    torch.manual_seed(0)
    model = build_tiny_moe(11)
    with RouteCapture(model) as cap:
        outs = sample_batch(
            model,
            PROMPTS,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=9,
            stop_token_ids={1},
            pad_id=0,
            generator=torch.Generator().manual_seed(3),
            capture=cap,
        )
    samples = [
        Sample(p, o["response_ids"], o["rollout_logp"], o["finish_reason"], 0, o["routed_experts"])
        for p, o in zip(PROMPTS, outs, strict=True)
    ]
    batch = collate(samples, [1.0, -1.0, 0.5], pad_id=0, need_routes=True)
    return model, samples, batch


def perturbed(model, scale=3.0, seed=1):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in moe_gates(m):
            gate.weight.add_(
                scale * gate.weight.std() * torch.randn(gate.weight.shape, generator=g)
            )
    return m


def expert_calls(model):
    """Forward pre-hooks on ``mlp.experts`` recording (indices, weights) per layer."""
    calls, handles = [], []
    for layer in model.model.layers:

        def pre(module, args, store=calls):
            store.append((args[1].detach().clone(), args[2].detach().clone()))

        handles.append(layer.mlp.experts.register_forward_pre_hook(pre))
    return calls, handles


def forward(model, batch):
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits


def test_captured_layout_is_sglang_and_matches_a_full_forward(rollout):
    model, samples, batch = rollout
    for s in samples:
        T = len(s.prompt_ids) + len(s.response_ids)
        assert s.routed_experts.shape == (T - 1, 4, 2) and s.routed_experts.dtype == np.int32
    # a full (non-incremental) forward of the same weights routes every fed token identically
    with RouteCapture(model) as cap, torch.no_grad():
        forward(model, batch)
    full = cap.last_call().view(batch.batch_size, -1, 4, 2)
    for b, s in enumerate(samples):
        T = len(s.prompt_ids) + len(s.response_ids)
        got = np.sort(full[b, : T - 1].numpy(), axis=-1)
        assert np.array_equal(got, np.sort(s.routed_experts, axis=-1))


def test_replay_forces_recorded_experts_with_softmax_over_the_set(rollout):
    model, samples, batch = rollout
    trainer_model = perturbed(model)
    routes = batch.routed_experts
    # without replay the perturbed routers choose different experts
    with RouteCapture(trainer_model) as cap, torch.no_grad():
        forward(trainer_model, batch)
    own = cap.last_call().view(*routes.shape)
    real = batch.attention_mask.bool()
    differs = (own.sort(-1).values != routes.int().sort(-1).values).any(-1)  # [B, S, L]
    assert differs[real].float().mean() > 0.2

    # with replay the experts receive exactly the recorded ids, with weights
    # softmax(z restricted to the set) of the *current* router logits z
    router_inputs = []
    hs = [
        g.register_forward_pre_hook(lambda m, a: router_inputs.append(a[0]))
        for g in moe_gates(trainer_model)
    ]
    calls, handles = expert_calls(trainer_model)
    with RouteReplay(trainer_model, routes), torch.no_grad():
        forward(trainer_model, batch)
    for h in hs + handles:
        h.remove()
    for layer, ((idx, w), x, gate) in enumerate(
        zip(calls, router_inputs, moe_gates(trainer_model), strict=True)
    ):
        forced = routes[:, :, layer, :].reshape(-1, 2)
        assert torch.equal(idx, forced)
        z = x.double().reshape(-1, 128) @ gate.weight.double().T  # [N, 8]
        zs = z.gather(1, forced)
        ref = torch.exp(zs) / torch.exp(zs).sum(-1, keepdim=True)
        torch.testing.assert_close(w.double(), ref, atol=1e-6, rtol=1e-5)


class ForcedMoE(torch.nn.Module):
    """Reference MoE block forced to given experts: a per-token float64 loop over the set."""

    def __init__(self, block, forced):
        super().__init__()
        self.block, self.forced = block, forced  # forced [B*S, K]

    def forward(self, h):
        B, S, H = h.shape
        x = h.reshape(-1, H).double()
        gate, experts = self.block.gate, self.block.experts
        z = x @ gate.weight.double().T  # [N, E]
        out = torch.zeros_like(x)
        for n in range(x.shape[0]):
            ids = self.forced[n]
            w = torch.softmax(z[n, ids], dim=-1)
            for j, e in enumerate(ids.tolist()):
                gu = experts.gate_up_proj[e].double() @ x[n]
                g, u = gu.chunk(2)
                y = experts.down_proj[e].double() @ (torch.nn.functional.silu(g) * u)
                out[n] += w[j] * y
        return out.to(h.dtype).reshape(B, S, H)


def test_replayed_logits_equal_a_model_forced_to_the_recorded_experts(rollout):
    model, samples, batch = rollout
    trainer_model = perturbed(model)
    with RouteReplay(trainer_model, batch.routed_experts), torch.no_grad():
        got = forward(trainer_model, batch)
    ref_model = copy.deepcopy(trainer_model)
    for layer_idx, layer in enumerate(ref_model.model.layers):
        forced = batch.routed_experts[:, :, layer_idx, :].reshape(-1, 2)
        layer.mlp = ForcedMoE(layer.mlp, forced)
    with torch.no_grad():
        ref = forward(ref_model, batch)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=1e-4)
    # and they differ from the perturbed model's own routing
    with torch.no_grad():
        free = forward(trainer_model, batch)
    assert (free[real] - got[real]).abs().max() > 1e-2


def test_router_gets_gradients_under_replay(rollout):
    model, samples, batch = rollout
    trainer_model = perturbed(model).train()
    with RouteReplay(trainer_model, batch.routed_experts):
        logits = forward(trainer_model, batch)
    logits.float().logsumexp(-1)[batch.loss_mask.bool()].sum().backward()
    for gate in moe_gates(trainer_model):
        assert gate.weight.grad is not None and gate.weight.grad.abs().max() > 1e-6


def test_replay_of_own_routes_is_bit_identical_to_no_replay(rollout):
    model, samples, batch = rollout
    with RouteCapture(model) as cap, torch.no_grad():
        free = forward(model, batch)
    own = cap.last_call().view(batch.batch_size, -1, 4, 2)
    with RouteReplay(model, own), torch.no_grad():
        replayed = forward(model, batch)
    assert torch.equal(free, replayed)


def test_missing_or_misshaped_routes_fail_loudly(rollout):
    model, samples, batch = rollout
    with pytest.raises(R3Error, match="no routed experts"):
        RouteReplay(model, None)
    with pytest.raises(R3Error, match="expected"):
        RouteReplay(model, batch.routed_experts[:, :, :3])  # 3 layers instead of 4
    with pytest.raises(R3Error, match="out of range"):
        RouteReplay(model, batch.routed_experts + 8)
    short = batch.routed_experts[:, :-1]  # one position short of input_ids
    with pytest.raises(R3Error, match="router saw"):
        with RouteReplay(model, short), torch.no_grad():
            forward(model, batch)
    # collate: a sample without routes, or with the wrong number of rows
    bare = Sample(
        samples[0].prompt_ids, samples[0].response_ids, samples[0].rollout_logp, "stop", 0
    )
    with pytest.raises(R3Error, match="no routed experts"):
        collate([samples[1], bare], [1.0, 1.0], 0, need_routes=True)
    cut = Sample(
        bare.prompt_ids,
        bare.response_ids,
        bare.rollout_logp,
        "stop",
        0,
        samples[0].routed_experts[:-1],
    )
    with pytest.raises(R3Error, match="expected"):
        collate([cut], [1.0], 0, need_routes=True)
