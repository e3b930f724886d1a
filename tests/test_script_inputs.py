"""Scripts outside the CLI (``scripts/``, ``bench/``) follow its input rules (issue 53, class 10):
a relative path is the caller's, not the project's (the shell wrappers ``cd`` to the project
first); an output path that cannot be written is one ``<script>: error:`` line and exit 2
before any work, not a traceback after it (``sat_cli.util.script_args``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_gpu_check_writes_a_relative_out_in_the_callers_folder(tmp_path):
    """``scripts/gpu_check.sh out --cpu-dry-run`` from another folder: ``out`` is that folder's
    (it was the project's: the wrapper changes to the project's folder before Python starts)."""
    name = f"sat-test-out-{os.getpid()}"
    try:
        r = _run(["bash", str(REPO / "scripts/gpu_check.sh"), name, "--cpu-dry-run"], tmp_path)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert json.loads((tmp_path / name / "summary.json").read_text())["status"] == "PASS"
        assert not (REPO / name).exists()
    finally:
        if (REPO / name).exists():  # the old behaviour: never leave it in the project
            import shutil

            shutil.rmtree(REPO / name)


@pytest.mark.parametrize(
    ("script", "args", "want"),
    [
        ("scripts/gpu_check.py", ["{file}/out", "--cpu-dry-run"], "is a file, not a folder"),
        ("bench/soak.py", ["--steps", "1", "--out", "{file}/r.json"], "is a file, not a folder"),
        ("bench/soak.py", ["--steps", "1", "--out", "{folder}"], "exists and is not a regular"),
        ("bench/loss_overhead.py", ["--json", "{folder}"], "exists and is not a regular file"),
        ("scripts/numerics_fingerprint.py", ["--out", "{file}/x.json"], "is a file, not a folder"),
        ("bench/envs_learn.py", ["guess", "m", "--json", "{file}/x/y.json"], "is a file, not a"),
    ],
)
def test_an_unusable_output_path_is_one_line_before_any_work(tmp_path, script, args, want):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afolder").mkdir()
    argv = [a.format(file=tmp_path / "afile", folder=tmp_path / "afolder") for a in args]
    r = _run([sys.executable, str(REPO / script), *argv], tmp_path, timeout=120)
    assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
    assert "Traceback" not in r.stderr and r.stderr.count(f"{script}: error:") == 1, r.stderr
    assert want in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "afolder"]
