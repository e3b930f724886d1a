"""Shared test setup: repo paths, the shared data folder, and single-threaded torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SAT_DATA_DIR") or REPO.parent / "shared" / "data")

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "aime24.jsonl").exists():
        pytest.skip(f"shared data folder absent ({SHARED_DATA}); set SAT_DATA_DIR to run this")
    return SHARED_DATA


@pytest.fixture
def fsfault():
    """tests/fs_faults.py (a full disk, a read-only folder); its mounts are undone afterwards."""
    import fs_faults

    try:
        yield fs_faults
    finally:
        fs_faults.unmount_all()
