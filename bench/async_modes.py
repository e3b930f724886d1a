"""Asynchronous modes side by side under one wall-clock budget (issue #17).

For each mode it composes the embedded default config (`sat train` with no overrides: the shipped
warm-started tiny Qwen3-MoE, toy task, GRPO + SAT) with the mode's overrides, builds the engine,
trainer and task exactly as `sat train` does (`sat_cli.build`) and runs the training loop until
the budget is spent (the step running at the deadline finishes). Then it evaluates the trainer's
weights on the held-out toy set (avg@8, a fresh engine) and reports:

* tokens trained per second = response tokens of the consumed batches / loop wall time;
* the physical limit of overlapping generation and training, from the synchronous run's mean
  phase times: ``(T_gen + T_train) / max(T_gen, T_train)``, and each mode's throughput relative
  to lag 0 as a fraction of that limit (goal for bounded: >= 0.95, and above interval lag 1);
* held-out avg@8 after the budget; realised staleness (mean per-token lag, mixed responses).

Modes: lag 0 (synchronous), interval lag 1 (the paper's), bounded n = 2 with in-flight weight
updates. Bounded runs are timing dependent by design (not reproducible bit for bit).

Run: .venv/bin/python bench/async_modes.py [--budget 60] [--modes sync,interval1,bounded2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sat_cli.tracking.sink import NullSink

MODES = {
    "sync": ["lag=0"],
    "interval1": ["lag=1"],
    "bounded2": ["lag=2", "lag.mode=bounded", "lag.inflight_updates=true"],
    # variants (not in the default set): the stale KV cache kept at a switch; no in-flight
    "bounded2keep": [
        "lag=2",
        "lag.mode=bounded",
        "lag.inflight_updates=true",
        "lag.inflight_cache=keep",
    ],  # fmt: skip
    "bounded2serial": ["lag=2", "lag.mode=bounded"],
}
DEFAULT_MODES = "sync,interval1,bounded2"


class _Budget(Exception):
    pass


class _Sink(NullSink):
    def __init__(self):
        self.rows: list[dict] = []

    def log_metrics(self, m, step):
        if "rollout/batch_index" in m:
            self.rows.append(dict(m))

    def log_histogram(self, *a, **k):
        pass


def run_mode(name: str, budget_s: float) -> dict:
    import torch

    from sat_cli.build import build_engine, build_evaluator, build_task, build_trainer, model_path
    from sat_cli.config import load
    from sat_cli.engines.base import SamplingParams
    from sat_cli.engines.local import LocalEngine
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.train import ClipSchedule, LoopSettings, train_loop
    from sat_cli.models.tiny_moe import load_tokenizer

    _, obj = load([*MODES[name], "max_steps=100000", "eval.every=0", "tracking=none"])
    torch.set_num_threads(obj.trainer.num_threads)
    path = model_path(obj, log=lambda *_: None)
    tok, task = load_tokenizer(path), build_task(obj)
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        (run_dir / "logs").mkdir()
        trainer = build_trainer(obj, path, run_dir)
        engine = build_engine(obj, path, run_dir / "logs", r3=obj.r3)
        settings = LoopSettings(
            max_steps=obj.max_steps,
            prompts_per_step=obj.task.prompts_per_step,
            group_size=obj.task.samples_per_prompt,
            sampling=SamplingParams(
                temperature=obj.task.temperature,
                top_p=obj.task.top_p,
                top_k=obj.task.top_k,
                max_new_tokens=obj.task.max_new_tokens,
                stop_token_ids=(tok.eos_token_id,),
            ),
            lag=LagPolicy(obj.lag.n, obj.lag.mode),
            run_dir=run_dir,
            seed=obj.seed,
            adv_std_norm=obj.algo.adv_std_norm,
            clip=ClipSchedule(obj.algo.eps_low, obj.algo.eps_high, obj.clip.schedule, 1.0),
            histogram_every=0,
            inflight_updates=obj.lag.inflight_updates,
        )
        sink = _Sink()
        t0 = time.perf_counter()

        def stop(_state):
            if time.perf_counter() - t0 > budget_s:
                raise _Budget

        try:
            train_loop(settings, task=task, tokenizer=tok, engine=engine, trainer=trainer,
                       tracker=sink, on_state=stop)  # fmt: skip
        except _Budget:
            pass
        wall = time.perf_counter() - t0
        engine.close()
        weights = trainer.publish_weights(run_dir / "final", version=len(sink.rows))
        trainer.close()
        with LocalEngine(str(weights), seed=obj.seed) as fresh:
            score = build_evaluator(obj, fresh, tok, task)()
    per_batch = obj.task.prompts_per_step * obj.task.samples_per_prompt
    rows = sink.rows
    tokens = sum(r["rollout/response_len_mean"] * per_batch for r in rows)
    return {
        "steps": len(rows),
        "wall": wall,
        "tok_per_s": tokens / wall,
        "gen_s": statistics.mean(r["perf/gen_s"] for r in rows[1:]),
        "train_s": statistics.mean(r["perf/train_s"] for r in rows[1:]),
        "lag": statistics.mean(r["staleness/token_version_lag_mean"] for r in rows),
        "mixed": statistics.mean(r["staleness/mixed_version_frac"] for r in rows),
        "avg8": next(v for k, v in score.items() if "avg@" in k),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of training per mode")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated: {', '.join(MODES)}")
    args = ap.parse_args()
    names = args.modes.split(",")
    if "sync" not in names:
        ap.error("--modes must include sync (the baseline of the physical limit)")
    res = {}
    for name in names:
        res[name] = run_mode(name, args.budget)
        r = res[name]
        print(f"{name:>10}: {r['steps']} steps in {r['wall']:.1f}s, {r['tok_per_s']:.1f} tok/s, "
              f"gen {r['gen_s']:.3f}s train {r['train_s']:.3f}s, token lag {r['lag']:.2f}, "
              f"mixed {r['mixed']:.2f}, avg@8 {r['avg8']:.2f}", flush=True)  # fmt: skip
    base = res["sync"]
    limit = (base["gen_s"] + base["train_s"]) / max(base["gen_s"], base["train_s"])
    print(f"\nphysical limit (T_gen + T_train) / max = {limit:.3f} "
          f"(T_gen {base['gen_s']:.3f}s, T_train {base['train_s']:.3f}s)")  # fmt: skip
    print("| mode | steps | tokens/s | speed-up vs lag 0 | fraction of limit | token lag | mixed "
          "| avg@8 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        up = r["tok_per_s"] / base["tok_per_s"]
        print(f"| {name} | {r['steps']} | {r['tok_per_s']:.1f} | {up:.3f} | {up / limit:.3f} | "
              f"{r['lag']:.2f} | {r['mixed']:.2f} | {r['avg8']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
