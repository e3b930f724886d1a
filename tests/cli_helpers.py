"""Helpers shared by test modules that run the real `sat` command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# a short `sat train` on the Megatron trainer (the slow Megatron CLI tests add their layout)
MEGATRON_SMOKE = [
    "experiment=cpu_smoke",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=2",
    "eval.every=0",
    "run.dir=runs",
    "trainer=megatron",
]


def run_sat(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`sat <args>` as a real subprocess (this interpreter, unbuffered), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
