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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--chunks", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
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
    for name in names:
        wall = [t[0] / w[0] for t, w in zip(times[name], times["whole"], strict=True)]
        cpu = [t[1] / w[1] for t, w in zip(times[name], times["whole"], strict=True)]
        out[name] = {
            "median_wall_s": statistics.median(t[0] for t in times[name]),
            "ratio_wall": statistics.median(wall),
            "ratio_cpu": statistics.median(cpu),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
