"""Chunked log-probs from the hidden states and the LM head (``trainers/head_chunks.py``): a hand
case, values and gradients (hidden states, head weight and bias) equal to the whole-logits
arithmetic of ``trainers/logprobs.py`` in float64 with kept-set replay and the sampler's top-k,
the autocast of the forward restored in the backward's recompute, the local trainer's update
unchanged by the chunk size, and the allocator's peak in a trainer step growing with chunk x
vocabulary, not tokens x vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_hf import on_policy_samples

from sat_cli.models.tiny_moe import build_tiny_moe, save_hf
from sat_cli.trainers.batch import collate
from sat_cli.trainers.head_chunks import CHUNK_LOGIT_ELEMENTS, chunk_positions, head_scores
from sat_cli.trainers.local import LocalTrainer
from sat_cli.trainers.logprobs import token_logprobs, topk_logprobs


def test_hand_case():
    # H = 1, V = 3: h = ln 2, weight [0, 1, 1] -> logits z = [0, ln 2, ln 2], softmax [1, 2, 2] / 5
    head = torch.nn.Linear(1, 3, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [1.0], [1.0]]))
    hidden = torch.full((1, 2, 1), math.log(2.0), dtype=torch.float64)
    ids = torch.tensor([[0, 1]])  # position 1 scores id 1 from position 0's logits
    for chunk in (1, 2):
        lp, ent = head_scores(hidden, head, ids, 1.0, chunk=chunk)
        assert lp[0, 0] == 0 and ent[0, 0] == 0  # column 0 scores nothing
        assert lp[0, 1].item() == pytest.approx(math.log(0.4), abs=1e-12)
        h = -(0.2 * math.log(0.2) + 2 * 0.4 * math.log(0.4))  # 1.0549...
        assert ent[0, 1].item() == pytest.approx(h, abs=1e-12)
    # kept set {1, 2} at position 1: renormalised on it, p(1) = 1/2, entropy ln 2
    kept = torch.tensor([[[-1, -1], [1, 2]]])
    lp, ent = head_scores(hidden, head, ids, 1.0, kept=kept, chunk=1)
    assert lp[0, 1].item() == pytest.approx(math.log(0.5), abs=1e-12)
    assert ent[0, 1].item() == pytest.approx(math.log(2.0), abs=1e-12)


def _case(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    B, S, H, V, K = 3, 6, 5, 13, 3
    hidden = torch.randn(B, S, H, dtype=torch.float64, generator=g).requires_grad_(True)
    head = torch.nn.Linear(H, V, bias=bias).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, dtype=torch.float64, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, dtype=torch.float64, generator=g))
    ids = torch.randint(0, V, (B, S), generator=g)
    kept = torch.full((B, S, K), -1)
    kept[0, 2] = torch.tensor([int(ids[0, 2]), (int(ids[0, 2]) + 1) % V, -1])
    kept[1, 3, 0] = ids[1, 3]  # a one-token kept set: logp 0, entropy 0
    kept[2, 5] = torch.tensor([int(ids[2, 5]), 3, 7])
    topk = torch.randint(-1, V, (B, S, K), generator=g)
    return hidden, head, ids, kept, topk


def _grads(outs, hidden, head, seed: int):
    """Gradients of a random linear function of ``logp`` and ``topk_logp`` if any (``entropy``
    carries none) w.r.t. the hidden states, the head's weight and bias."""
    g = torch.Generator().manual_seed(seed)
    total = (outs[0] * torch.randn(outs[0].shape, dtype=torch.float64, generator=g)).sum()
    if len(outs) > 2:
        total = (
            total + (outs[2] * torch.randn(outs[2].shape, dtype=torch.float64, generator=g)).sum()
        )
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    return torch.autograd.grad(total, params)


@pytest.mark.parametrize("chunk", [1, 4, 7, 18, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("extras", ["plain", "kept", "topk", "kept+topk"])
def test_values_and_gradients_equal_the_whole_logits_in_float64(chunk, bias, extras):
    """``plain``: the backward's closed form ``g (onehot - softmax) / T``; with a kept set or
    top-k ids: autograd through the recomputed chunk. 18 = every position (the plain graph)."""
    hidden, head, ids, kept, topk = _case(chunk, bias)
    kept = kept if "kept" in extras else None
    topk = topk if "topk" in extras else None
    logits = head(hidden)  # [B, S, V]: today's whole-logits arithmetic
    ref = token_logprobs(logits, ids, 0.7, kept)
    if topk is not None:
        ref = (*ref, topk_logprobs(logits, topk, 0.7, kept))
    got = head_scores(hidden, head, ids, 0.7, kept, topk, chunk)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(_grads(got, hidden, head, 1), _grads(ref, hidden, head, 1), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not got[1].requires_grad  # the entropy is a metric


def test_values_against_a_float64_loop():
    hidden, head, ids, _, _ = _case(3, True)
    lp, ent = head_scores(hidden, head, ids, 0.7, chunk=5)
    for b in range(ids.shape[0]):
        for s in range(1, ids.shape[1]):
            z = (head.weight @ hidden[b, s - 1] + head.bias).detach() / 0.7
            p = torch.softmax(z, -1)
            assert lp[b, s].item() == pytest.approx(float(p[ids[b, s]].log()), abs=1e-12)
            assert ent[b, s].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-12)


def test_gradcheck_of_the_recomputing_function():
    hidden, head, ids, kept, topk = _case(5, True)

    def f(h, w, b):
        head2 = torch.nn.Linear(h.shape[-1], w.shape[0]).double()
        del head2.weight, head2.bias  # plain tensors: gradcheck's inputs, not new leaves
        head2.weight, head2.bias = w, b
        lp, _, tk = head_scores(h, head2, ids, 0.9, kept, topk, chunk=4)
        return lp, tk

    w = head.weight.detach().clone().requires_grad_(True)
    b = head.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (hidden, w, b))


def test_backward_recomputes_under_the_forwards_autocast():
    """bf16 autocast: the gradient w.r.t. the hidden states is the whole-logits graph's (bf16
    matmuls, row by row); a recompute in fp32 would differ by bf16's rounding (~1e-2). The
    head's gradient sums chunks in fp32 where the whole graph sums all rows in one bf16
    matmul: equal to bf16's precision."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 40, bias=False)
    ids = torch.randint(0, 40, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_c, _ = head_scores(hidden, head, ids, 1.0, chunk=4)
        lp_w, _ = token_logprobs(head(hidden), ids, 1.0)
    torch.testing.assert_close(lp_c, lp_w, rtol=0, atol=1e-6)
    g_c = torch.autograd.grad(lp_c.sum(), [hidden, head.weight])
    g_w = torch.autograd.grad(lp_w.sum(), [hidden, head.weight])
    torch.testing.assert_close(g_c[0], g_w[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_c[1], g_w[1], rtol=0, atol=2e-2)


def test_default_chunk_bounds_the_logits():
    assert chunk_positions(128) == CHUNK_LOGIT_ELEMENTS // 128  # the CPU default: one chunk
    assert chunk_positions(151_936) == 220  # Qwen3's vocabulary: 128 MiB of fp32 logits
    assert chunk_positions(151_936, 64) == 64
    with pytest.raises(TypeError, match="nn.Linear"):
        head_scores(torch.zeros(1, 2, 3), torch.nn.Identity(), torch.zeros(1, 2).long(), 1.0)


PROMPTS = [[20 + i, 21, 22, 14, 23] for i in range(12)]


@pytest.fixture(scope="module")
def moe_batches(tmp_path_factory):
    """A one-layer tiny MoE at two vocabulary sizes, each with on-policy samples: ``{V: (path,
    batch)}``."""
    out = {}
    for vocab in (512, 2048):
        model = build_tiny_moe(0, vocab_size=vocab, num_hidden_layers=1)
        path = save_hf(model, None, tmp_path_factory.mktemp("m") / f"v{vocab}")
        samples = on_policy_samples(model, PROMPTS, max_new_tokens=20)
        adv = [1.0 - (i % 3) for i in range(len(samples))]
        out[vocab] = (path, collate(samples, adv, pad_id=0))
    return out


def test_trainer_logprobs_and_gradients_do_not_depend_on_the_chunk(moe_batches):
    """The local trainer's forward (decoder, then the head in chunks): log-probs, entropy and
    every parameter's gradient of a weighted log-prob sum equal to one chunk's (fp32; the head's
    gradient summed over chunks in another order), and the step's metrics too."""
    path, batch = moe_batches[512]
    got = []
    for chunk in (7, None):  # 7: many chunks with recompute; None: one chunk, plain graph
        tr = LocalTrainer(str(path), logprob_chunk_tokens=chunk)
        logp, ent = tr.model_forward(tr.model, batch)
        w = batch.advantages * batch.loss_mask
        params = list(tr.model.parameters())
        grads = torch.autograd.grad((logp * w).sum(), params, allow_unused=True)
        got.append((logp.detach(), ent, grads, tr.step(batch)))
    (lp_c, ent_c, g_c, m_c), (lp_w, ent_w, g_w, m_w) = got
    torch.testing.assert_close(lp_c, lp_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_c, ent_w, rtol=0, atol=1e-6)
    assert sum(g is not None for g in g_w) > 10
    for a, b in zip(g_c, g_w, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)
    for key in ("loss/entropy", "loss/grad_norm", "loss/total"):
        assert m_c[key] == pytest.approx(m_w[key], rel=1e-5)


def _step_peak(trainer, batch) -> int:
    """The allocator's peak (bytes above the start) during ``trainer.step(batch)``, from torch
    profiler's memory events: each op's own allocations and frees, in order of start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(batch)
    cur = best = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        best = max(best, cur)
    return best


def test_step_peak_grows_with_chunk_times_vocab_not_tokens_times_vocab(moe_batches):
    chunk, hidden = 16, 128
    peaks = {}
    for vocab, (path, batch) in moe_batches.items():
        for name, size in (("chunked", chunk), ("whole", 1 << 20)):
            tr = LocalTrainer(str(path), logprob_chunk_tokens=size)
            tr.step(batch)  # AdamW's states exist before the measured step
            peaks[name, vocab] = _step_peak(tr, batch)
    tokens = moe_batches[512][1].input_ids.numel()
    dv = (2048 - 512) * 4  # bytes of one fp32 logit column more
    grads = 2 * hidden * dv  # the embedding's and the head's gradients grow too
    chunked = peaks["chunked", 2048] - peaks["chunked", 512]
    whole = peaks["whole", 2048] - peaks["whole", 512]
    assert tokens > 10 * chunk
    assert chunked <= grads + 8 * chunk * dv, (chunked, grads, tokens * dv)
    assert whole >= grads + 2 * tokens * dv  # the measure sees whole logits when they are made


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.logprob_chunk_tokens=0"], r"trainer\.logprob_chunk_tokens=0 is out of range"),
        (["trainer.logprob_chunk_tokens=99999999"], "is out of range"),
    ],
)
def test_chunk_setting_is_checked_at_compose_time(overrides, needle):
    from sat_cli.config import load
    from sat_cli.validate import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load(overrides)
    _, obj = load(["trainer.logprob_chunk_tokens=256"])
    assert obj.trainer.logprob_chunk_tokens == 256
    assert load([])[1].trainer.logprob_chunk_tokens is None


def test_gpu_trainer_gets_a_token_budget_per_micro_batch_by_default():
    from sat_cli.config import load
    from sat_cli.trainers.settings import GPU_MICRO_BATCH_TOKENS, micro_batch_tokens

    cases = {  # overrides -> the step's max_tokens_per_micro_batch (0: one forward)
        (): 0,  # the CPU default: unchanged
        ("trainer.device=cuda",): GPU_MICRO_BATCH_TOKENS,
        ("trainer.device=cuda", "trainer.max_tokens_per_micro_batch=300"): 300,
        ("trainer.device=cuda", "trainer.max_tokens_per_row=9000"): 9000,  # one packed row
        ("trainer.max_tokens_per_micro_batch=300",): 300,
    }
    for overrides, want in cases.items():
        assert micro_batch_tokens(load(list(overrides))[1].trainer) == want, overrides
