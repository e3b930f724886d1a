"""Wall time of `sat --help` (must not import torch, mlflow or transformers).

Run: .venv/bin/python bench/cli_startup.py
Baseline side by side: `python -c pass` (the interpreter's own start-up) in the same run.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def wall(cmd: list[str], reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    sat = shutil.which("sat") or str(Path(sys.executable).parent / "sat")
    base = wall([sys.executable, "-c", "pass"])
    helpt = wall([sat, "--help"])
    print(f"python -c pass : {base * 1000:7.1f} ms (median of 15)")
    print(f"sat --help     : {helpt * 1000:7.1f} ms (median of 15)  ratio {helpt / base:.2f}x")


if __name__ == "__main__":
    main()
