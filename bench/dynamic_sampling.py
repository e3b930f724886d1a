"""Dynamic sampling's lag and generation cost on the toy task at lag 8 (issue 57 item 1).

Two real `sat train` runs of the embedded CPU default (tiny Qwen3-MoE, toy task, GRPO + SAT,
32 prompts x 8 samples per step) at ``lag=8`` (interval), evaluation and intermediate
checkpoints off, in one fresh folder, side by side:

1. ``run.name=plain`` — without dynamic sampling;
2. ``run.name=dynamic`` — ``algo.dynamic_sampling.enabled=true`` (std_tol 0, at most
   ``--max-gen-batches`` generation batches per step).

It reports, from each run's MLflow metrics, over every step: the realised mean lag of the
trained samples (``staleness/version_lag_mean``), and for the dynamic run the generation batches
per step (``dynamic/gen_batches``), the groups the filter dropped, the kept fraction, the short
steps (the bound hit), the extra lag (``dynamic/extra_lag``: trained samples' mean lag minus
the first generation batch's) and the mean lag of the dropped samples; the mean ``perf/step_s``
(steps 2..N) of both, as a ratio.

Run: .venv/bin/python bench/dynamic_sampling.py [--steps 30] [--max-gen-batches 3] [--keep DIR]
     [--override KEY=VALUE ...] (e.g. ``--override lag.profile=uniform:0-8``)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from replay import _history, _sat  # bench/replay.py: one sat command, one metric's history

BASE = ["lag=8", "eval.every=0", "eval.at_start=false", "run.dir=runs", "checkpoint.every=0"]


def main() -> None:
    from sat_cli import metric_names as M

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-gen-batches", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--override", action="append", default=[], help="more sat overrides")
    a = ap.parse_args()
    cwd = a.keep or Path(tempfile.mkdtemp(prefix="sat-bench-dynamic-"))
    cwd.mkdir(parents=True, exist_ok=True)
    common = [*BASE, f"max_steps={a.steps}", *a.override]
    dyn = [
        "algo.dynamic_sampling.enabled=true",
        f"algo.dynamic_sampling.max_gen_batches={a.max_gen_batches}",
    ]
    walls = {
        "plain": _sat(["train", *common, "run.name=plain"], cwd),
        "dynamic": _sat(["train", *common, *dyn, "run.name=dynamic"], cwd),
    }

    def mean(name: str, key: str, skip: int = 0) -> float:
        return statistics.fmean(_history(cwd, name, key)[skip:])

    lag = {n: mean(n, M.VERSION_LAG_MEAN) for n in walls}
    step = {n: mean(n, M.PERF_STEP_S, skip=1) for n in walls}
    gen = _history(cwd, "dynamic", M.DYN_GEN_BATCHES)
    short = _history(cwd, "dynamic", M.DYN_GROUPS_SHORT)
    print(f"folder {cwd}; {a.steps} steps each, lag 8 (interval) {' '.join(a.override)}")
    print("| run | mean lag of trained samples | gen batches / step | mean step (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for n in walls:
        g = f"{statistics.fmean(gen):.2f} (max {max(gen):.0f})" if n == "dynamic" else "1"
        print(f"| {n} | {lag[n]:.3f} | {g} | {step[n]:.2f} | {walls[n]:.0f} |")
    print(f"realised lag, dynamic - plain: {lag['dynamic'] - lag['plain']:+.3f}")
    print(f"dynamic/extra_lag (mean over steps): {mean('dynamic', M.DYN_EXTRA_LAG):+.3f}")
    print(
        f"mean lag of the dropped samples: {mean('dynamic', M.DYN_SPLIT_MEANS.format('dropped')):.3f}"
    )
    print(
        f"groups dropped per step: {mean('dynamic', M.DYN_GROUPS_DROPPED):.2f}; kept fraction "
        f"{mean('dynamic', M.DYN_KEPT_FRAC):.3f}; short steps {sum(s > 0 for s in short)} "
        f"of {len(short)} (missing groups {sum(short):.0f})"
    )
    print(f"mean step time, dynamic / plain: {step['dynamic'] / step['plain']:.2f}x")


if __name__ == "__main__":
    main()
