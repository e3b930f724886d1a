"""Local-engine throughput and engine/trainer mismatch on the tiny Qwen3-MoE.

Side by side, on one checkpoint and one batch (same threads):
  1. ``model.generate`` (HF, sampling, no log-probs)            - the reference
  2. ``sample_batch`` in-process, with log-probs                 - the engine's sampling loop
  3. ``sample_batch`` in-process, with log-probs + route capture - R3 capture overhead
  4. ``LocalEngine`` (own process, pipe), log-probs              - end to end
  5. ``LocalEngine`` with ``r3=True``                             - end to end with capture
Tokens/s counts generated response tokens. Each figure is the median of ``--repeats``
rounds; a round runs every path once (round-robin, so load spikes hit all paths alike).

Then the lag-0 mismatch ``d_pi = mean |rollout_logp - trainer recompute|`` over response tokens
of toy-task samples, with the engine in float32 and in bfloat16 (trainer always float32), and
for bfloat16 also with R3 replay in the trainer.

Run: ``python bench/engine_throughput.py`` (results recorded in bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from sat_cli.engines.base import SamplingParams
from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
from sat_cli.engines.local.worker import sample_batch
from sat_cli.models.r3 import RouteCapture
from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, load_model, save_hf
from sat_cli.models.warmstart import SHIPPED
from sat_cli.tasks.toy import ToyTask
from sat_cli.trainers.batch import collate
from sat_cli.trainers.local import LocalTrainer


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of this process, or of process ``pid`` (Linux /proc)."""
    from sat_cli.util.procs import cpu_seconds as process_cpu_seconds

    return time.process_time() if pid is None else process_cpu_seconds(pid)


def timed(fn, pid: int | None) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second) of one call of ``fn`` (which returns its
    token count); CPU time is that of the process doing the work (``pid``, or this one)."""
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    tokens = fn()
    dt, dc = time.perf_counter() - t0, cpu_seconds(pid) - c0
    return tokens / dt, tokens / max(dc, 1e-9)


def throughput(path: str, args) -> None:
    model = load_model(path)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 100, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 12, (args.batch,), generator=g)
    ]
    kw = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=args.new_tokens,
        stop_token_ids={1},
        pad_id=0,
    )

    def hf_generate():
        P = max(map(len, prompts))
        ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
        att = (
            torch.arange(P)[None, :] >= (P - torch.tensor([len(p) for p in prompts]))[:, None]
        ).long()
        torch.manual_seed(0)
        out = model.generate(
            input_ids=ids,
            attention_mask=att,
            do_sample=True,
            max_new_tokens=args.new_tokens,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            eos_token_id=1,
            pad_token_id=0,
        )
        resp = out[:, P:]
        # count up to and including the first EOS, as the engine does
        return sum(int((r == 1).nonzero()[0, 0]) + 1 if (r == 1).any() else len(r) for r in resp)

    def engine_loop(capture: bool):
        gen = torch.Generator().manual_seed(0)
        if capture:
            with RouteCapture(model) as cap:
                outs = sample_batch(model, prompts, generator=gen, capture=cap, **kw)
        else:
            outs = sample_batch(model, prompts, generator=gen, **kw)
        return sum(len(o["response_ids"]) for o in outs)

    rows = [("HF model.generate (no log-probs)", hf_generate, None)]
    rows.append(("sample_batch, log-probs", lambda: engine_loop(False), None))
    rows.append(("sample_batch, log-probs + R3 capture", lambda: engine_loop(True), None))
    sp = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    engines = {}
    for r3 in (False, True):
        eng = engines[r3] = LocalEngine(
            LocalEngineSettings(num_threads=args.threads), LocalEngineRuntime(path, r3=r3)
        )
        name = "LocalEngine (process), log-probs" + (" + R3 capture" if r3 else "")
        rows.append(
            (
                name,
                lambda e=eng: sum(s.response_len for g_ in e.generate(prompts, 1, sp) for s in g_),
                eng.pid,
            )
        )
    for _, fn, _ in rows:
        fn()  # warm-up
    # round-robin over the paths, so a load spike on a shared machine hits all of them alike
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in rows}
    for _ in range(args.repeats):
        for name, fn, pid in rows:
            runs[name].append(timed(fn, pid))
    res = {
        name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for name, v in runs.items()
    }
    for e in engines.values():
        e.close()
    base_w, base_c = res["HF model.generate (no log-probs)"]
    print(
        f"\nthroughput: batch {args.batch}, up to {args.new_tokens} new tokens, "
        f"{args.threads} thread(s), median of {args.repeats} rounds"
    )
    print(f"{'path':45s} {'tok/s wall':>10s} {'vs HF':>6s} {'tok/CPU-s':>10s} {'vs HF':>6s}")
    for name, (w, c) in res.items():
        print(f"{name:45s} {w:10.0f} {w / base_w:6.2f} {c:10.0f} {c / base_c:6.2f}")
    for kind, i in (("wall", 0), ("CPU", 1)):
        a = res["sample_batch, log-probs"][i] / res["sample_batch, log-probs + R3 capture"][i]
        b = res["LocalEngine (process), log-probs"][i]
        b /= res["LocalEngine (process), log-probs + R3 capture"][i]
        print(
            f"R3 capture overhead ({kind}): in-process {100 * (a - 1):.1f} %, engine {100 * (b - 1):.1f} %"
        )


def mismatch(path: str, args) -> None:
    task = ToyTask(digits=3)
    tok = build_char_tokenizer()
    prompts = [tok(it["prompt"])["input_ids"] for it in task.sample_prompts(args.mm_prompts, 0)]
    sp = SamplingParams(max_new_tokens=16, seed=1)
    print(
        f"\nlag-0 mismatch d_pi on {args.mm_prompts} toy prompts x {args.mm_n} samples (trainer fp32)"
    )
    for dtype in ("float32", "bfloat16"):
        with LocalEngine(
            LocalEngineSettings(dtype=dtype, num_threads=args.threads),
            LocalEngineRuntime(path, r3=True),
        ) as eng:
            samples = [s for g in eng.generate(prompts, args.mm_n, sp) for s in g]
        batch = collate(samples, [0.0] * len(samples), pad_id=0, need_routes=True)
        m = batch.loss_mask.bool()
        for r3 in (False, True):
            lp = LocalTrainer(path, r3=r3).logprobs(batch)
            d = (lp - batch.rollout_logp)[m].abs()
            print(
                f"engine {dtype:8s} trainer R3 replay {'on ' if r3 else 'off'}: d_pi = {d.mean():.3e}"
                f"  max {d.max():.3e}  ({int(m.sum())} tokens)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mm-prompts", type=int, default=64)
    ap.add_argument("--mm-n", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        rand = str(save_hf(build_tiny_moe(0), build_char_tokenizer(), os.path.join(tmp, "random")))
        print("throughput checkpoint: random-init tiny Qwen3-MoE (long responses)")
        throughput(rand, args)
    warm = str(SHIPPED) if (SHIPPED / "model.safetensors").is_file() else None
    if warm is None:
        print("no shipped warm-start checkpoint; mismatch measured on the random model")
        with tempfile.TemporaryDirectory() as tmp:
            mismatch(
                str(save_hf(build_tiny_moe(0), build_char_tokenizer(), os.path.join(tmp, "r"))),
                args,
            )
    else:
        print(f"\nmismatch checkpoint: shipped warm start ({SHIPPED.name})")
        mismatch(warm, args)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
