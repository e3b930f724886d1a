"""Packed vs padded training steps, side by side in one process (issue #46).

Two local trainers are built from the default config exactly as `sat train` builds them
(`sat_cli.build.components.build_trainer`: the shipped warm-started tiny Qwen3-MoE, the default GRPO + SAT
loss, `trainer.num_threads` torch threads): one padded (the default), one with
`trainer.max_tokens_per_row`. They take turns on the same batches (padded step, packed step,
next batch), so a load change on the machine hits both alike; the figure is their ratio.

Length distributions:

* **default** — the default run's own samples: toy prompts of the default task, responses
  sampled by the warm-started model with the default settings (32 prompts x 8, at most 16 new
  tokens, temperature 1), through the local engine's sampler;
* **long-tailed** — prompts are real problems (GSM8K test and MATH-500 rendered with the
  default template) and each response length is drawn from the lengths, in the run's tokens, of
  real math texts (the problem statements of `math500.jsonl`, `gsm8k_test.jsonl` and
  `deepmath_subset.jsonl`; the data holds no model responses), capped at `--cap` tokens; the
  response tokens themselves are random (their values do not change the work). The data folder
  is `--data` or `$SAT_DATA_DIR`; nothing is copied.

The packed trainer attends segment by segment on rows of at least 256 tokens (varlen) and
through a block-diagonal mask on shorter ones, and keeps the padded forward where packing would
not cut the token slots by 10 % (``trainers/packing.py``). Per variant it reports trained response tokens per second (loss tokens / step wall time, the
trainer's own ``perf/train_s``), all tokens per second, the token slots of its forward (padded:
``B x longest``; packed: ``rows x widest row``) and its activation memory (the bytes of the
tensors autograd saves for the backward during the step: exact, unlike a resident-size sample
on a loaded machine).

Run: .venv/bin/python bench/packing.py --data DIR [--steps 3] [--row 1100] [--default-row 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


class SavedBytes:
    """Bytes of the tensors autograd saves for the backward during a block (the activation
    memory of a step: exact and load-independent, unlike the process's resident size)."""

    def __init__(self):
        self.total = 0

    def _pack(self, t):
        self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def default_batches(obj, path, tok, n: int, seed: int = 0) -> list[list]:
    """``n`` batches of the default run's own samples (toy prompts, the warm model's responses)."""
    import torch

    from sat_cli.build.parts import build_task
    from sat_cli.engines.base import Sample
    from sat_cli.models.sampling import sample_batch
    from sat_cli.models.tiny_moe import load_model

    model, task = load_model(path, "float32", torch.device("cpu")), build_task(obj)
    t = obj.task
    out = []
    for i in range(n):
        rows = task.sample_prompts(t.prompts_per_step, i * t.prompts_per_step)
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        prompts = [p for p in prompts for _ in range(t.samples_per_prompt)]
        res = sample_batch(
            model,
            prompts,
            temperature=t.temperature,
            top_p=t.top_p,
            top_k=t.top_k,
            max_new_tokens=t.max_new_tokens,
            stop_token_ids={tok.eos_token_id},
            pad_id=tok.pad_token_id,
            generator=torch.Generator().manual_seed(seed + i),
        )
        out.append(
            [
                Sample(p, r["response_ids"], r["rollout_logp"], r["finish_reason"], 0)
                for p, r in zip(prompts, res, strict=True)
            ]
        )
    return out


def long_tailed_batches(data: Path, tok, template: str, n: int, size: int, cap: int, seed=0):
    """``n`` batches of ``size`` samples: real problems as prompts, response lengths drawn from
    the token lengths of real math texts (module docstring)."""
    from sat_cli.engines.base import Sample
    from sat_cli.tasks.prompts import render

    def rows(name):
        with open(data / name) as f:
            return [json.loads(line) for line in f if line.strip()]

    texts = [
        r["problem"]
        for f in ("math500.jsonl", "gsm8k_test.jsonl", "deepmath_subset.jsonl")
        for r in rows(f)
    ]
    lengths = np.array([len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts])
    problems = [r["problem"] for f in ("gsm8k_test.jsonl", "math500.jsonl") for r in rows(f)]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = []
        for _ in range(size):
            prompt = render(template, problems[int(rng.integers(len(problems)))])
            p = tok(prompt, add_special_tokens=False)["input_ids"][:256]
            R = int(min(max(lengths[int(rng.integers(len(lengths)))], 1), cap))
            resp = rng.integers(3, 99, R).tolist()
            batch.append(Sample(p, resp, (-rng.random(R)).tolist(), "stop", 0))
        out.append(batch)
    return out


def build(overrides: list[str], run_dir: Path):
    from sat_cli.build.components import build_trainer
    from sat_cli.build.parts import model_path
    from sat_cli.config import load

    _, obj = load(["tracking=none", f"run.dir={run_dir}", *overrides])
    path = model_path(obj, log=lambda *_: None)
    return obj, path, build_trainer(obj, path, run_dir)


def slots(batch, row: int) -> int:
    """Token slots of the forward: padded ``B x S``; packed ``rows x widest row``."""
    from sat_cli.trainers.packing import PackPlan, sample_lengths

    if row <= 0:
        return int(batch.input_ids.numel())
    plan = PackPlan.build(sample_lengths(batch.attention_mask), batch.input_ids.shape[1], row)
    padded = int(batch.input_ids.numel())
    return int(plan.src.numel()) if plan.saves(padded) else padded  # the trainer's choice


def compare(name: str, batches, trainers: dict, rows: dict, pad_id: int) -> dict:
    """Alternate the trainers over ``batches``; per variant the medians of the steps."""
    from sat_cli.trainers.batch import collate

    res = {k: {"tok": [], "all": [], "s": [], "mem": [], "slots": []} for k in trainers}
    rng = np.random.default_rng(1)
    for i, samples in enumerate(batches):
        batch = collate(samples, rng.normal(size=len(samples)).tolist(), pad_id)
        loss_tokens = float(batch.loss_mask.sum())
        all_tokens = float(batch.attention_mask.sum())
        for k, tr in trainers.items():
            with SavedBytes() as mem:
                t0 = time.perf_counter()
                tr.step(batch)
                s = time.perf_counter() - t0
            if i == 0:
                continue  # warm-up
            r = res[k]
            r["s"].append(s)
            r["tok"].append(loss_tokens / s)
            r["all"].append(all_tokens / s)
            r["mem"].append(mem.total / 2**20)
            r["slots"].append(slots(batch, rows[k]))
    out = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    base = out["padded"]["tok"]
    for k, r in out.items():
        print(
            f"{name:>11} {k:>7}: {r['tok']:8.0f} trained tok/s ({r['all']:8.0f} all tok/s), "
            f"step {r['s']:.3f}s, {r['slots']:.0f} token slots, activations {r['mem']:.0f} MiB, "
            f"x{r['tok'] / base:.3f} vs padded",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--data",
        default=os.environ.get("SAT_DATA_DIR"),
        help="folder with math500/gsm8k_test/deepmath_subset.jsonl ($SAT_DATA_DIR)",
    )
    ap.add_argument("--steps", type=int, default=3, help="measured steps per case (+1 warm-up)")
    ap.add_argument("--size", type=int, default=32, help="samples per long-tailed batch")
    ap.add_argument("--cap", type=int, default=1024, help="longest long-tailed response")
    ap.add_argument("--row", type=int, default=1300, help="long-tailed max_tokens_per_row")
    ap.add_argument("--default-row", type=int, default=64, help="default max_tokens_per_row")
    ap.add_argument("--cases", default="default,long-tailed")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if "long-tailed" in cases and not args.data:
        ap.error("the long-tailed case needs --data DIR (or $SAT_DATA_DIR)")

    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        (run_dir / "logs").mkdir()
        if "default" in cases:
            run_case(
                "default",
                [],
                args.default_row,
                run_dir,
                lambda obj, path, tok: default_batches(obj, path, tok, args.steps + 1),
            )
        if "long-tailed" in cases:
            run_case(
                "long-tailed",
                [f"task.max_new_tokens={args.cap}"],
                args.row,
                run_dir,
                lambda obj, path, tok: long_tailed_batches(
                    Path(args.data), tok, obj.task.template, args.steps + 1, args.size, args.cap
                ),
            )


def run_case(name: str, overrides: list[str], row: int, run_dir: Path, make_batches) -> dict:
    """Build the padded and the packed trainer of ``overrides`` and compare them on the batches
    ``make_batches(obj, path, tokenizer)`` makes."""
    import torch

    obj, path, padded = build(overrides, run_dir)
    torch.set_num_threads(obj.trainer.num_threads)
    tok = padded.tokenizer
    batches = make_batches(obj, path, tok)
    _, _, packed = build([*overrides, f"trainer.max_tokens_per_row={row}"], run_dir)
    trainers = {"padded": padded, "packed": packed}
    return compare(name, batches, trainers, {"padded": 0, "packed": row}, tok.pad_token_id)


if __name__ == "__main__":
    main()
