"""Time of chunked log-probs against whole logits: forward + backward of the LM head and the
log-probs (``trainers/head_chunks.head_scores``) on one fp32 CPU batch.

``whole``: every position in one chunk, i.e. the plain autograd graph of ``head(hidden)`` and the
log-probs (today's arithmetic, ``[tokens, vocab]`` logits held through backward); ``chunk C``:
``C`` positions at a time, recomputed in backward. Rounds alternate the variants (order rotated
each round); the figure is the median over rounds of each variant's time divided by ``whole``'s
in the same round (wall clock, and this process's CPU time, less sensitive to other load). The
loss is a random weighting of the log-probs, as the policy loss's gradient would be.

Run:  .venv/bin/python bench/logprob_chunks.py [--tokens 2048 --hidden 512 --vocab 16384
      --chunks 128,512 --rounds 7]
      .venv/bin/python bench/logprob_chunks.py --step [--scale 4 --rounds 5]

``--step``: the ratio of a whole trainer step instead of the head alone: a Qwen3-0.6B-shaped
model (``sat_cli/assets/arch/qwen3_0_6b.json``, 28 layers, tied embeddings) with every width
and the vocabulary divided by ``--scale`` (so the LM head keeps its share of the FLOPs, about a
quarter), random fp32 weights; one step = forward, the head's log-probs, backward, AdamW, on
``--tokens`` positions in rows of 512. ``whole`` vs the default chunk
(``head_chunks.chunk_positions``).
Bar: ratio <= 1.25, goal <= 1.10. Results are recorded in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from sat_cli.trainers.head_chunks import head_scores


def one_run(hidden, head, ids, weights, chunk: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one forward + backward."""
    t0, c0 = time.perf_counter(), time.process_time()
    logp, _ = head_scores(hidden, head, ids, 1.0, chunk=chunk)
    (logp * weights).sum().backward()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    hidden.grad, head.weight.grad = None, None
    return dt, dc


def ratios(times: dict[str, list]) -> dict[str, dict]:
    """Per variant: the median wall time, and the medians of its time over ``whole``'s in the
    same round (wall and CPU)."""
    out = {}
    for name, got in times.items():
        wall = [t[0] / w[0] for t, w in zip(got, times["whole"], strict=True)]
        cpu = [t[1] / w[1] for t, w in zip(got, times["whole"], strict=True)]
        out[name] = {
            "median_wall_s": statistics.median(t[0] for t in got),
            "ratio_wall": statistics.median(wall),
            "ratio_cpu": statistics.median(cpu),
        }
    return out


def step_model(scale: int):
    """The Qwen3-0.6B-shaped model, every width and the vocabulary divided by ``scale``."""
    from pathlib import Path

    from transformers import Qwen3Config, Qwen3ForCausalLM

    arch = Path(__file__).resolve().parent.parent / "sat_cli/assets/arch/qwen3_0_6b.json"
    cfg = json.loads(arch.read_text())
    for key in ("hidden_size", "intermediate_size", "vocab_size", "head_dim"):
        cfg[key] //= scale
    cfg.update(torch_dtype="float32", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**cfg)).float()


def one_step(model, opt, ids, weights, chunk: int | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one trainer step with the head in chunks of ``chunk``."""
    t0, c0 = time.perf_counter(), time.process_time()
    hidden = model.model(input_ids=ids).last_hidden_state
    logp, _ = head_scores(hidden, model.lm_head, ids, 1.0, chunk=chunk)
    (logp * weights).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main_step(a) -> None:
    from sat_cli.trainers.head_chunks import chunk_positions

    model = step_model(a.scale)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = max(a.tokens // 512, 1)
    ids = torch.randint(0, vocab, (rows, a.tokens // rows), generator=g)
    weights = torch.randn(ids.shape, generator=g)
    variants = {"whole": ids.numel(), f"chunk {chunk_positions(vocab, None)}": None}
    for chunk in variants.values():
        one_step(model, opt, ids, weights, chunk)
    times: dict[str, list] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(one_step(model, opt, ids, weights, variants[name]))
    head = model.config.hidden_size * vocab  # tied: the head is the embedding, counted once
    params = sum(p.numel() for p in model.parameters())
    out = {
        "shape": {"tokens": ids.numel(), "scale": a.scale, "vocab": vocab, "params": params},
        "head_flops_share": head / params,  # of the forward's matmuls (attention scores aside)
        "threads": a.threads,
        "torch": torch.__version__,
    }
    out.update(ratios(times))
    print(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--chunks", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step", action="store_true", help="a whole trainer step (module docstring)")
    ap.add_argument("--scale", type=int, default=4, choices=range(1, 65), metavar="1..64")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.step:
        return main_step(a)
    g = torch.Generator().manual_seed(0)
    rows = a.tokens // 512 or 1
    hidden = torch.randn(rows, a.tokens // rows, a.hidden, generator=g).requires_grad_(True)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False)
    ids = torch.randint(0, a.vocab, hidden.shape[:2], generator=g)
    weights = torch.randn(hidden.shape[:2], generator=g)
    variants = {"whole": hidden.shape[0] * hidden.shape[1]}
    variants.update({f"chunk {c}": int(c) for c in a.chunks.split(",")})
    for chunk in variants.values():  # warm-up
        one_run(hidden, head, ids, weights, chunk)
    times: dict[str, list] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(one_run(hidden, head, ids, weights, variants[name]))
    out = {
        "shape": {
            "tokens": hidden.shape[0] * hidden.shape[1],
            "hidden": a.hidden,
            "vocab": a.vocab,
        },
        "threads": a.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    out.update(ratios(times))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
