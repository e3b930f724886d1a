"""Helpers shared by test modules that run the real `sat` command line."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
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


def run_sat(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`sat <args>` as a real subprocess (this interpreter, unbuffered), output captured;
    ``env``: variables added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


_TEMPLATE: list[Path] = []


def seeded_store(db: Path) -> Path:
    """Put an empty MLflow sqlite store at the current schema at ``db`` (and return it): a copy
    of one this process created once. Creating a store runs MLflow's ~50 database migrations,
    1.5-2.5 s of CPU each time; a run folder that already holds a store (a second run there) is
    what tests whose subject is not store creation get. Store creation keeps its own tests: the
    first run in test_train_cli.py, parallel first runs in test_tracking.py, `make run`."""
    if not _TEMPLATE:
        from mlflow import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="sat-test-store-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
        _TEMPLATE.append(folder / "mlflow.db")
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_TEMPLATE[0], db)
    return db
