"""The project's sweep files ship with the package: a wheel built from the tree holds every file
of ``sat_cli/sweeps/``, and ``sat`` installed from it (not the editable checkout) lists them and
runs them by name from a folder that has no ``sweeps/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.name for p in (REPO / "sat_cli" / "sweeps").glob("*.yaml"))


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_sweeps_folder_is_the_checkout_one():
    """The package's ``sweeps/`` is the checkout's (a link, as ``sat_cli/conf`` is ``conf/``)."""
    assert (REPO / "sweeps").resolve() == (REPO / "sat_cli" / "sweeps").resolve()
    assert len(SHIPPED) >= 10 and "paper_table1.yaml" in SHIPPED


def test_an_installed_wheel_lists_and_runs_the_shipped_sweeps(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("sat_cli", "conf", "sweeps"):  # the package's links to conf/ and sweeps/ kept
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=skip)
    assert (src / "sat_cli" / "sweeps").is_symlink()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip"]
    built = _run(
        [
            *pip,
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        tmp_path,
        env,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        inside = sorted(
            n.rsplit("/", 1)[1] for n in z.namelist() if n.startswith("sat_cli/sweeps/")
        )
    assert inside == SHIPPED

    site = tmp_path / "site"
    done = _run(
        [*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)], tmp_path, env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    away = tmp_path / "elsewhere"  # no sweeps/ here, and not the checkout
    away.mkdir()
    env["PYTHONPATH"] = str(site)
    sat = [sys.executable, str(site / "bin" / "sat")]
    where = _run([sys.executable, "-c", "import sat_cli; print(sat_cli.__file__)"], away, env)
    assert where.stdout.strip() == str(site / "sat_cli" / "__init__.py"), where

    listing = _run([*sat, "sweep", "--list"], away, env)
    assert listing.returncode == 0, listing.stderr
    assert [ln.split()[0] for ln in listing.stdout.splitlines()] == [n[:-5] for n in SHIPPED]
    by_name = _run([*sat, "sweep", "smoke", "--dry-run"], away, env)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    assert f"({site}/sat_cli/sweeps/smoke.yaml)" in by_name.stdout
    assert "status: pending 4" in by_name.stdout  # GRPO, SAT-GRPO x lag {1, 8}
    # a name, and the path the docs write where there is no such file, are the shipped file
    code = "from sat_cli.sweep.spec import resolve_sweep as r; print(r('paper_table1'), " + (
        "r('sweeps/paper_table1.yaml'), r('sweeps/nope.yaml'))"
    )
    resolved = _run([sys.executable, "-c", code], away, env)
    shipped = site / "sat_cli" / "sweeps" / "paper_table1.yaml"
    assert resolved.stdout.split() == [str(shipped), str(shipped), "sweeps/nope.yaml"], resolved
    assert list(away.iterdir()) == []  # a dry run writes nothing
