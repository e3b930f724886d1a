"""Overlap efficiency of the asynchronous loop: lag 0 (synchronous) vs lag 1 (interval).

Runs the same short config (the shipped warm-started tiny model, toy task, GRPO+SAT) at lag 0
and lag 1, alternating, in one process. From the lag-0 runs it takes the mean generation time
T_gen and training time T_train per step; the ideal speed-up of overlapping them is
(T_gen + T_train) / max(T_gen, T_train). The achieved speed-up is the lag-0 step time over the
lag-1 step time, and overlap efficiency = achieved / ideal (goal >= 0.9, bar 0.8).

Run: .venv/bin/python bench/async_overlap.py [--steps 12] [--rounds 3] [--prompts 32] [--group 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sat_cli.tracking.sink import NullSink


class _Sink(NullSink):
    def __init__(self):
        self.rows = []

    def log_metrics(self, m, step):
        self.rows.append(dict(m))

    def log_histogram(self, *a, **k):
        pass


def run_once(lag: int, steps: int, prompts: int, group: int, model: str) -> dict:
    import torch

    from sat_cli.engines.base import SamplingParams
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.loop.lag import LagPolicy
    from sat_cli.loop.schedule import Every
    from sat_cli.loop.train import LoopSettings, RunParts, TrainLoop
    from sat_cli.tasks.toy import ToyTask
    from sat_cli.trainers.local import LocalTrainer

    torch.set_num_threads(1)
    from sat_cli.rl.config import LossConfig

    trainer = LocalTrainer(model, lr=3e-4, seed=0, loss=LossConfig(algo="grpo", adaptive=True))
    sink = _Sink()
    with (
        tempfile.TemporaryDirectory() as d,
        LocalEngine(
            LocalEngineSettings(num_threads=1), LocalEngineRuntime(model, seed=0)
        ) as engine,
    ):
        s = LoopSettings(
            max_steps=steps,
            prompts_per_step=prompts,
            group_size=group,
            sampling=SamplingParams(
                max_new_tokens=16, stop_token_ids=(trainer.tokenizer.eos_token_id,)
            ),
            lag=LagPolicy(lag, "interval"),
            run_dir=Path(d),
            seed=0,
            histograms=Every(0),
        )
        t0 = time.perf_counter()
        TrainLoop(s, RunParts(engine, trainer, sink, ToyTask(), trainer.tokenizer)).run()
        wall = time.perf_counter() - t0
    rows = sink.rows[1:]  # the first step pays one-off warm-up costs
    return {
        "step_s": statistics.mean(r["perf/step_s"] for r in rows),
        "gen_s": statistics.mean(r["perf/gen_s"] for r in rows),
        "train_s": statistics.mean(r["perf/train_s"] for r in rows),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()
    from sat_cli.models.warmstart import SHIPPED

    res = {0: [], 1: []}
    for r in range(args.rounds):
        for lag in (0, 1):
            out = run_once(lag, args.steps, args.prompts, args.group, str(SHIPPED))
            res[lag].append(out)
            print(
                f"round {r} lag {lag}: step {out['step_s']:.3f}s  gen {out['gen_s']:.3f}s  "
                f"train {out['train_s']:.3f}s",
                flush=True,
            )
    t_gen = statistics.median(o["gen_s"] for o in res[0])
    t_train = statistics.median(o["train_s"] for o in res[0])
    step0 = statistics.median(o["step_s"] for o in res[0])
    step1 = statistics.median(o["step_s"] for o in res[1])
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    achieved = step0 / step1
    print(f"\nT_gen {t_gen:.3f}s  T_train {t_train:.3f}s  (lag 0, medians of {args.rounds} runs)")
    print(f"step time lag 0 {step0:.3f}s, lag 1 {step1:.3f}s")
    print(
        f"ideal speed-up {ideal:.3f}  achieved {achieved:.3f}  overlap efficiency "
        f"{achieved / ideal:.3f}"
    )


if __name__ == "__main__":
    main()
