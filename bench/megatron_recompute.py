"""Activation recompute in the megatron trainer: memory kept for the backward and step time,
with and without ``recompute=True``, side by side (docs/megatron.md "Memory").

    PYTHONPATH=. python bench/megatron_recompute.py [--rows 4] [--tokens 512] [--steps 3]

Each mode runs in a fresh process (so peak RSS is its own): a random Qwen3-MoE (hidden 512, 8
layers, 16 experts of 384, top-4, vocabulary 4000: 86 M parameters), ``MegatronActor`` on one
CPU rank (gloo), SAT-GRPO, one minibatch of ``rows`` sequences of ``tokens`` tokens. Reported:
the bytes autograd saves for the backward during one training forward
(``saved_tensors_hooks``), the process's peak RSS after the steps, and the median step time
over ``steps`` steps (after one warm-up step). Runs whichever ``sat_cli`` is on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=384,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4000,
    max_position_embeddings=4096,
)


def _batch(rows: int, tokens: int, vocab: int):
    import torch

    from sat_cli.engines.base import Sample
    from sat_cli.trainers.batch import collate

    g = torch.Generator().manual_seed(0)
    prompt = tokens // 4
    samples, adv = [], []
    for i in range(rows):
        ids = torch.randint(1, vocab, (tokens,), generator=g).tolist()
        resp = ids[prompt:]
        lp = (-torch.rand(len(resp), generator=g) * 3).tolist()
        samples.append(Sample(ids[:prompt], resp, lp, "length", 0))
        adv.append(1.0 if i % 2 else -1.0)
    return collate(samples, torch.tensor(adv), 0)


def run_one(model: Path, recompute: bool, rows: int, tokens: int, steps: int) -> dict:
    import torch

    from sat_cli.rl.config import LossConfig
    from sat_cli.trainers.megatron import runtime
    from sat_cli.trainers.megatron.actor import MegatronActor

    torch.set_num_threads(2)
    runtime.init_distributed(file_store=Path(tempfile.mkdtemp()) / "store")
    loss = LossConfig(algo="grpo", adaptive=True)
    actor = MegatronActor(str(model), loss=loss, lr=1e-5, recompute=recompute)
    batch = _batch(rows, tokens, CONFIG["vocab_size"])
    (logp, _), saved = runtime.saved_for_backward(lambda: actor._model_forward(actor.model, batch))
    logp.sum().backward()
    actor.model.zero_grad(set_to_none=True)
    actor.step(batch)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        actor.step(batch)
        times.append(time.perf_counter() - t0)
    return {
        "saved_mib": saved / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", choices=["plain", "recompute"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        out = run_one(Path(args.model), args.one == "recompute", args.rows, args.tokens, args.steps)
        print(json.dumps(out))
        return
    import torch
    from transformers import Qwen3MoeForCausalLM

    from sat_cli.models.tiny_moe import build_config

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(build_config(**CONFIG))
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(Path(tmp) / "m")
        del model
        res = {}
        for mode in ("plain", "recompute"):
            cmd = [
                sys.executable,
                __file__,
                "--one",
                mode,
                "--model",
                str(Path(tmp) / "m"),
                "--rows",
                str(args.rows),
                "--tokens",
                str(args.tokens),
                "--steps",
                str(args.steps),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{n / 1e6:.0f} M parameters, {args.rows} rows x {args.tokens} tokens, one CPU rank")
    print("| mode | saved for backward (MiB) | peak RSS (MiB) | step (s) |")
    print("|---|---|---|---|")
    for mode, r in res.items():
        print(f"| {mode} | {r['saved_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['step_s']:.2f} |")
    p, r = res["plain"], res["recompute"]
    print(
        f"recompute / plain: saved {r['saved_mib'] / p['saved_mib']:.3f}, peak RSS "
        f"{r['peak_rss_mib'] / p['peak_rss_mib']:.3f}, step time {r['step_s'] / p['step_s']:.3f}"
    )


if __name__ == "__main__":
    main()
