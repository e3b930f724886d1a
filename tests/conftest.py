"""Shared test setup: repo paths, the data folders, and single-threaded torch.

* ``benchmark_data``: the evaluation sets shipped inside the package (``sat_cli/assets/
  benchmarks``: aime24, aime25, math500, gsm8k test). Always present: no test skips for them.
* ``training_data``: the external training sets (``gsm8k_train.jsonl``,
  ``deepmath_subset.jsonl``), which are not shipped: ``$SAT_DATA_DIR``, else ``../shared/data``
  beside the repository. Only ``slow`` tests use them, and they skip, naming the folder, where the
  files are absent, so the default suite never skips for lack of data.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_helpers import run_sat

REPO = Path(__file__).resolve().parents[1]
BENCHMARK_DATA = REPO / "sat_cli" / "assets" / "benchmarks"
TRAINING_DATA = Path(os.environ.get("SAT_DATA_DIR") or REPO.parent / "shared" / "data")
TRAINING_FILES = ("gsm8k_train.jsonl", "deepmath_subset.jsonl")

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def benchmark_data() -> Path:
    return BENCHMARK_DATA


@pytest.fixture(scope="session")
def shared_data(benchmark_data) -> Path:
    """Older name of ``benchmark_data`` (the evaluation sets used to come from ../shared/data)."""
    return benchmark_data


@pytest.fixture(scope="session")
def training_data() -> Path:
    missing = [f for f in TRAINING_FILES if not (TRAINING_DATA / f).is_file()]
    if missing:
        pytest.skip(
            f"external training sets absent ({', '.join(missing)} not in {TRAINING_DATA}); "
            "they are not shipped with sat: set SAT_DATA_DIR to a folder holding them"
        )
    return TRAINING_DATA


@pytest.fixture(scope="session")
def sat_cli():
    """:func:`cli_helpers.run_sat`, for tests and fixtures of any scope."""
    return run_sat


@pytest.fixture
def fsfault():
    """tests/fs_faults.py (a full disk, a read-only folder); its mounts are undone afterwards."""
    import fs_faults

    try:
        yield fs_faults
    finally:
        fs_faults.unmount_all()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3-MoE (seed 3) with the char tokenizer, saved as an HF folder (read-only
    for the tests that use it)."""
    from sat_cli.models.tiny_moe import build_char_tokenizer, build_tiny_moe, save_hf

    path = tmp_path_factory.mktemp("tiny") / "model"
    save_hf(build_tiny_moe(seed=3), build_char_tokenizer(), path)
    return path


@pytest.fixture(scope="session")
def shared_tiny_engine(tiny_dir):
    """One local engine (seed 0) on ``tiny_dir`` for the worker: starting one takes seconds,
    most of a short loop test's time. Use it through ``tiny_engine``."""
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings

    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(str(tiny_dir), seed=0)) as engine:
        yield engine


@pytest.fixture
def tiny_engine(shared_tiny_engine, tiny_dir):
    """``shared_tiny_engine`` with ``tiny_dir`` loaded again as version 0: what a fresh
    ``LocalEngine(tiny_dir, seed=0)`` serves (tests that use it pass a seed with every request).
    Mark its tests ``xdist_group("tiny_engine")`` so that one worker starts it."""
    shared_tiny_engine.update_weights(str(tiny_dir), 0)
    return shared_tiny_engine


@pytest.fixture(scope="session")
def ray_cluster():
    """A real two-node Ray cluster on 127.0.0.1 (``tests/ray_cluster.py``), shared by the tests
    of the ``ray`` xdist group; skipped without the ``[ray]`` extra. At the end it is shut down
    and no process that carries its ``RAY_TMPDIR`` may be left."""
    import shutil
    import time

    pytest.importorskip("ray", reason="the [ray] extra is not installed (pip install -e '.[ray]')")
    from ray_cluster import RayTestCluster, new_tmp

    tmp = new_tmp()
    t0 = time.monotonic()
    cluster = RayTestCluster(tmp)
    cluster.started_s = time.monotonic() - t0
    try:
        yield cluster
    finally:
        t1 = time.monotonic()
        cluster.stop()
        deadline = time.monotonic() + 20
        while cluster.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = cluster.leftover_pids()
        print(
            f"ray test cluster: up in {cluster.started_s:.1f} s, down in {time.monotonic() - t1:.1f} s"
        )
        shutil.rmtree(tmp, ignore_errors=True)
        assert left == [], f"processes of the test Ray cluster survived it: {left}"
