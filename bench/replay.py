"""The cost of recording a run's rollout stream and of replaying it (issue 33), side by side.

Three real `sat` commands on the embedded CPU default (tiny Qwen3-MoE, toy task, GRPO + SAT,
lag 1; evaluation off so that the steps are what is timed), in one fresh folder:

1. ``sat train … run.name=live<i>`` — a live run;
2. ``sat train … replay.record=true run.name=rec<i>`` — the same run, recorded;
3. ``sat replay runs/sat/rec<i> run.name=replay<i>`` — trained again on the recording (no
   engine);

repeated ``--reps`` times in a rotating order (the load of a shared machine drifts).

It reports, from each run's MLflow metrics: the mean ``perf/step_s`` (steps 2..N: the first
step pays for start-up), the whole command's wall time, and for the recording the bytes per
step (the manifest's file sizes) and the time one step's write takes (the recorded batches
encoded and written again, atomically, ``--writes`` times each: the per-step overhead without
the noise of two separate runs). The replay's losses are checked equal to the recorded run's.

Run: .venv/bin/python bench/replay.py [--steps 30] [--reps 2] [--writes 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = ["eval.every=0", "eval.at_start=false", "run.dir=runs", "checkpoint.every=0"]


def _sat(args: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *args], cwd=cwd, capture_output=True, text=True
    )
    if r.returncode != 0:
        sys.exit(f"sat {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def _history(cwd: Path, name: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    c = MlflowClient(f"sqlite:///{cwd / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("sat").experiment_id
    (run,) = c.search_runs([exp], f"attributes.run_name = '{name}'")
    hist = sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    return [m.value for m in hist]


def _write_cost(rec: Path, writes: int) -> float:
    """Seconds one step's recording takes: every recorded batch encoded and written again."""
    from sat_cli.replay.store import StreamWriter, open_recording

    recording = open_recording(rec, 0)
    batches = [recording.batch(t) for t in range(recording.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        w = StreamWriter(Path(tmp), {}, 0, 0)
        t0 = time.perf_counter()
        for _ in range(writes):
            for t, (groups, rows, rewards) in enumerate(batches):
                w.write(t, groups, rows, rewards)
        return (time.perf_counter() - t0) / (writes * len(batches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2, help="repetitions, in a rotating order")
    ap.add_argument("--writes", type=int, default=5)
    ap.add_argument("--keep", default=None, help="run here (kept) instead of a temp folder")
    a = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cwd = Path(a.keep or tempfile.mkdtemp(prefix="sat-bench-replay-"))
    cwd.mkdir(parents=True, exist_ok=True)
    steps = [f"max_steps={a.steps}", *BASE]
    kinds = ("live", "rec", "replay")
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    step_s: dict[str, list[float]] = {k: [] for k in kinds}
    gen_s, equal = [], []
    for rep in range(a.reps):
        # rec before its replay; live goes first, between or last (the neighbours' load drifts)
        order = [("live", "rec", "replay"), ("rec", "live", "replay"), ("rec", "replay", "live")]
        for k in order[rep % 3]:
            name = f"{k}{rep}"
            args = {
                "live": ["train", *steps, f"run.name={name}"],
                "rec": ["train", *steps, f"run.name={name}", "replay.record=true"],
                "replay": ["replay", f"runs/sat/rec{rep}", f"run.name={name}"],
            }[k]
            wall[k].append(_sat(args, cwd))
            step_s[k].append(statistics.mean(_history(cwd, name, "perf/step_s")[1:]))
        gen_s.append(statistics.mean(_history(cwd, f"live{rep}", "perf/gen_s")[1:]))
        equal.append(
            _history(cwd, f"rec{rep}", "loss/policy")
            == _history(cwd, f"replay{rep}", "loss/policy")
        )
    manifest = json.loads((cwd / "runs/sat/rec0/replay/manifest.json").read_text())
    sizes = [f["bytes"] for f in manifest["files"].values()]
    write_s = _write_cost(cwd / "runs/sat/rec0", a.writes)
    live = statistics.median(step_s["live"])
    print(f"{a.steps} steps of the CPU default (eval off), {a.reps} repetitions, in {cwd}")
    print("| run | wall (s) | mean step (s), steps 2..N | median vs live |")
    print("|---|---|---|---|")
    for k in kinds:
        walls = ", ".join(f"{w:.1f}" for w in wall[k])
        steps_k = ", ".join(f"{x:.3f}" for x in step_s[k])
        print(f"| {k} | {walls} | {steps_k} | {statistics.median(step_s[k]) / live:.2f} |")
    print(
        f"recording: {statistics.mean(sizes) / 1024:.1f} KiB per step "
        f"({sum(sizes) / 1024:.0f} KiB for {len(sizes)} steps); one step's write "
        f"{write_s * 1000:.1f} ms = {write_s / live * 100:.1f} % of a live step"
    )
    print(
        f"live generation per step (overlapped with training, what a replay skips): "
        f"{statistics.mean(gen_s):.3f} s; replay losses equal to the recorded run's: "
        f"{all(equal)}"
    )


if __name__ == "__main__":
    main()
