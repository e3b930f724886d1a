"""Where the time of a `sat train` goes (issue 58, item 5): process start and imports, the run's
set-up, generation, training, evaluation, MLflow.

Run (repository root):

    .venv/bin/python bench/train_profile.py                      # the default run (250 steps)
    .venv/bin/python bench/train_profile.py max_steps=50         # any overrides

It prints, for one real `sat train` subprocess (its own run folder under a temporary folder):

* wall time, and the CPU time of the process tree (user + system, ``RUSAGE_CHILDREN``);
* when each phase's first line appeared on stdout (seconds from the start): the warm-start line,
  the ``run …`` line (MLflow run created), the step-0 evaluation, step 1, the last step, ``done``,
  and the process's exit — so start-up = time to the step-0 evaluation's start;
* the sums over steps of the run's own ``perf/*`` metrics read back from its MLflow store
  (``perf/gen_s``, ``perf/train_s``, ``perf/wait_s``, ``perf/eval_s``, ``perf/step_s``);
* the import time of torch, transformers' Qwen3-MoE model and mlflow, each in a fresh process;
* the load average before and after (the machine is shared: label the figures with it).
"""

from __future__ import annotations

import os
import re
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKS = {  # phase: the first stdout line that starts it
    "warm start line": r"^warm start",
    "MLflow run created": r"^run ",
    "eval @ step 0 done": r"^eval @ step 0:",
    "step 1 done": r"^step +1/",
    "done line": r"^done: ",
}
IMPORTS = {
    "python -c pass": "pass",
    "import torch": "import torch",
    "torch + transformers Qwen3-MoE": "import torch; from transformers import Qwen3MoeForCausalLM",
    "import mlflow (MlflowClient)": "from mlflow import MlflowClient",
}


def _wall(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t0


def _perf_sums(run_dir: Path) -> dict[str, float]:
    (db,) = run_dir.rglob("mlflow.db")
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT key, SUM(value), COUNT(*) FROM metrics WHERE key LIKE 'perf/%' GROUP BY key"
        ).fetchall()
    return {k: (s, n) for k, s, n in rows}


def main(overrides: list[str]) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "runs"
        cmd = [sys.executable, "-m", "sat_cli.cli", "train", *overrides, f"run.dir={run_dir}"]
        seen: dict[str, float] = {}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp) as p:
            last_step = None
            for line in p.stdout:
                now = time.perf_counter() - t0
                for name, pat in MARKS.items():
                    if name not in seen and re.search(pat, line):
                        seen[name] = now
                if re.search(r"^step +\d+/", line):
                    last_step = now
            rc = p.wait(timeout=3600)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if rc != 0:
            sys.exit(f"sat train exited with {rc}")
        perf = _perf_sums(run_dir)
    load1 = os.getloadavg()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"sat train {' '.join(overrides) or '(defaults)'}")
    print(f"load average before {load0[0]:.2f} {load0[1]:.2f}, after {load1[0]:.2f} {load1[1]:.2f}")
    print(f"wall {wall:.1f} s; CPU of the process tree {cpu:.1f} s")
    for name, t in sorted(seen.items(), key=lambda kv: kv[1]):
        print(f"  {t:7.1f} s  {name}")
    if last_step is not None:
        print(f"  {last_step:7.1f} s  last step line")
    print(f"  {wall:7.1f} s  process exit")
    for key in ("perf/gen_s", "perf/wait_s", "perf/train_s", "perf/eval_s", "perf/step_s"):
        if key in perf:
            total, n = perf[key]
            print(f"  sum {key:14s} {total:7.1f} s over {n} steps")
    for name, code in IMPORTS.items():
        print(f"  import wall: {name:32s} {_wall(code):5.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
