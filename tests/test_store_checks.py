"""Last round's classes that failed a fresh probe (issue 53, class 13): a run refused because its
tracking store is damaged leaves nothing behind; `sat mlflow-server` refuses sqlite stores it
cannot use in one line (it ran MLflow, which printed a traceback or retried for ever); a sweep
grid whose size no machine could run is refused with a readable size and no advice to raise
``max_runs`` to it, and ``max_runs`` itself is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_sat

from sat_cli.errors import UserError
from sat_cli.sweep.spec import SANE_MAX_RUNS, load_sweep

REPO = Path(__file__).resolve().parents[1]


def _damage(db: Path, how: str) -> str:
    if how == "garbage":
        db.write_bytes(os.urandom(5000))
        return "is not an SQLite database"
    if how == "damaged-sqlite":  # the right header, then garbage
        db.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 12)
        return "is a damaged SQLite database"
    db.mkdir()
    return "is a folder, not a database file"


@pytest.mark.parametrize(
    "how",
    ["garbage", pytest.param("damaged-sqlite", marks=pytest.mark.slow), "folder"],
)
def test_a_run_refused_for_a_damaged_store_leaves_nothing_behind(tmp_path, how):
    """It used to leave ``runs/sat/<run>/`` with ``config.yaml`` and ``logs/``, a
    ``mlflow.db.lock``, and print sqlalchemy's three-line error after 40 s."""
    (tmp_path / "runs").mkdir()
    db = tmp_path / "runs/mlflow.db"
    want = _damage(db, how)
    out = run_sat("train", "run.dir=runs", "max_steps=1", cwd=tmp_path, timeout=180)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("sat: error:") == 1 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("sat: error:")]
    assert f"the MLflow store runs/mlflow.db {want}" in line and "tracking.uri=none" in line
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mlflow.db"]


def _server(uri: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "mlflow-server", "--backend-store-uri", uri]
        + ["--artifacts-destination", str(cwd / "art"), "--port", "58731"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("a-text-file", "is not an SQLite database"),
        ("a-folder", "is a folder, not a database file"),
        ("garbage", "is not an SQLite database"),
        ("a-fifo", "is not a regular file"),
        ("in-proc", "/proc"),  # root passes os.access there; creating a file does not
    ],
)
def test_mlflow_server_refuses_a_sqlite_store_it_cannot_use(tmp_path, case, want):
    target = tmp_path / "store.db"
    if case == "a-text-file":
        target.write_text("not a database\n")
    elif case == "a-folder":
        target.mkdir()
    elif case == "garbage":
        target.write_bytes(os.urandom(3000))
    elif case == "a-fifo":
        os.mkfifo(target)
    uri = "sqlite:////proc/store.db" if case == "in-proc" else f"sqlite:///{target}"
    r = _server(uri, tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("sat: error:") == 1 and "Traceback" not in r.stderr, r.stderr
    assert want in r.stderr and "--backend-store-uri" in r.stderr, r.stderr


def _sweep(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(f"name: t\nbase: [max_steps=1]\nmethods: {{A: [clip=ppo]}}\nseeds: [0]\n{extra}\n")
    return p


def test_a_grid_no_machine_could_run_is_refused_readably(tmp_path):
    huge = "range(0, 1e300, 1e-5)"  # 1e305 values each: the product is past any float
    p = _sweep(
        tmp_path, f'axes: {{lag: "range(0,10)", trainer.lr: "{huge}", trainer.grad_clip: "{huge}"}}'
    )
    with pytest.raises(UserError) as info:
        load_sweep(p)  # it printed all 612 digits, twice, and advised max_runs: <them>
    msg = str(info.value)
    assert "the grid has more than 1e308 runs" in msg and "trainer.lr(1e+305)" in msg
    assert "set max_runs" not in msg and f"no sweep runs more than {SANE_MAX_RUNS}" in msg
    assert len(msg) < 400
    p = _sweep(tmp_path, 'axes: {lag: "range(0, 10000000000000000000000)"}')
    with pytest.raises(UserError, match=r"the grid has 1e\+22 runs \(1 methods × lag\(1e\+22\)"):
        load_sweep(p)
    p = _sweep(tmp_path, 'axes: {lag: "range(0,3000)"}')  # a real size keeps its advice
    with pytest.raises(UserError, match="set max_runs: 3000 in the sweep file"):
        load_sweep(p)


@pytest.mark.parametrize("value", [10**7, 0, "1e9", 2.5])
def test_max_runs_is_bounded(tmp_path, value):
    """``max_runs: 10**30`` let ``range(0, 10**20)`` be enumerated run by run (a hang)."""
    p = _sweep(tmp_path, f'axes: {{lag: "range(0, 100000000000000000000)"}}\nmax_runs: {value}')
    with pytest.raises(UserError, match=rf"max_runs must be an integer in \[1, {SANE_MAX_RUNS}\]"):
        load_sweep(p)
