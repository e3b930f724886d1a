"""``clean_tree: true`` in a sweep file: a pre-registered study runs only from committed code.

Every run logs the commit it ran (MLflow tag ``git_commit``), but a commit says what ran only
when the tree has no changes on top of it. A sweep file with ``clean_tree: true`` (the collapse
studies, docs/results/collapse_cpu.md) is therefore refused, exit 2 and nothing started, when
the git tree of the code that would run (the folder above the ``sat_cli`` package in use):

* is not a git work tree, or ``git`` cannot be run (the commit could not be recorded);
* has a staged or unstaged change to a tracked file;
* has an untracked, not ignored file under ``sat_cli/`` or ``sweeps/`` (code, a config option
  or a sweep file that a run could pick up). Untracked files elsewhere (a ``.venv`` link, notes)
  cannot change what runs and are allowed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sat_cli.errors import UserError

CODE_DIRS = ("sat_cli", "sweeps")
GIT_TIMEOUT_S = 30


def source_root() -> Path:
    """The folder holding the ``sat_cli`` package that is running."""
    import sat_cli

    return Path(sat_cli.__file__).resolve().parent.parent


def _git(root: Path, *args: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(f"clean_tree: cannot run git in {root} ({exc})") from None
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["git failed"])[0]
        raise UserError(f"clean_tree: {root} is not a usable git work tree ({first})")
    return out.stdout


def dirty_paths(root: Path) -> list[str]:
    """The changes that make ``root`` unclean (module doc), as ``git status --porcelain`` lines."""
    tracked = _git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    untracked = _git(
        root, "status", "--porcelain", "--untracked-files=all", "--", *CODE_DIRS
    ).splitlines()
    return tracked + [line for line in untracked if line.startswith("??")]


def require_clean_tree(sweep_file: str, root: Path | None = None) -> str:
    """The commit the study runs; UserError naming the first changes when the tree is unclean."""
    root = root or source_root()
    dirty = dirty_paths(root)
    if dirty:
        shown = "; ".join(line.strip() for line in dirty[:5])
        more = f" (and {len(dirty) - 5} more)" if len(dirty) > 5 else ""
        raise UserError(
            f"{sweep_file}: clean_tree is set (a pre-registered study) but the code in {root} has "
            f"changes: {shown}{more}. Commit them first, or run from a clean checkout"
        )
    return _git(root, "rev-parse", "HEAD").strip()
