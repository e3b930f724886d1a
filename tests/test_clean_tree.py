"""`clean_tree: true` in a sweep file (sat_cli/sweep/clean_tree.py): a pre-registered study runs
only from committed code. Real git repositories in a temporary folder."""

import subprocess
from pathlib import Path

import pytest

from sat_cli.errors import UserError
from sat_cli.sweep import clean_tree
from sat_cli.sweep.spec import load_sweep


def _git(root: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
    }
    out = subprocess.run(
        ["git", "-C", str(root), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    return out.stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "sat_cli").mkdir(parents=True)
    (root / "sat_cli" / "a.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("ignored/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "c")
    return root


def test_a_clean_tree_gives_its_commit_and_changes_are_refused(repo):
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert clean_tree.require_clean_tree("s.yaml", repo) == head
    (repo / "notes.txt").write_text("untracked outside the code: allowed\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "x.py").write_text("")
    assert clean_tree.require_clean_tree("s.yaml", repo) == head
    (repo / "sat_cli" / "a.py").write_text("x = 2\n")  # a tracked change
    with pytest.raises(UserError, match=r"s.yaml: clean_tree is set .* M sat_cli/a.py"):
        clean_tree.require_clean_tree("s.yaml", repo)
    _git(repo, "checkout", "--", "sat_cli/a.py")
    (repo / "sat_cli" / "conf.yaml").write_text("")  # an untracked file the code could pick up
    with pytest.raises(UserError, match=r"\?\? sat_cli/conf.yaml"):
        clean_tree.require_clean_tree("s.yaml", repo)
    (repo / "sat_cli" / "conf.yaml").unlink()
    _git(repo, "rm", "-q", "--cached", ".gitignore")  # a staged change
    with pytest.raises(UserError, match=r"D  .gitignore"):
        clean_tree.require_clean_tree("s.yaml", repo)


def test_not_a_git_tree_is_refused(tmp_path):
    with pytest.raises(UserError, match="not a usable git work tree"):
        clean_tree.require_clean_tree("s.yaml", tmp_path)


SWEEP = """# sat sweep x.yaml
name: cleanrun
clean_tree: {value}
axes: {{lag: "1"}}
methods: {{GRPO: [algo=grpo, clip=ppo, max_steps=1]}}
seeds: [0]
"""


def test_the_sweep_key_is_a_bool(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(SWEEP.format(value="true"))
    assert load_sweep(f).clean_tree is True
    f.write_text(SWEEP.format(value='"yes"'))
    with pytest.raises(UserError, match="clean_tree must be true or false"):
        load_sweep(f)


def test_sat_sweep_refuses_a_dirty_tree_before_any_run(tmp_path, repo, monkeypatch):
    from sat_cli.sweep.run import run_sweep

    (repo / "sat_cli" / "a.py").write_text("x = 3\n")
    monkeypatch.setattr(clean_tree, "source_root", lambda: repo)
    f = tmp_path / "s.yaml"
    f.write_text(SWEEP.format(value="true"))
    runs = tmp_path / "runs"
    with pytest.raises(UserError, match="clean_tree is set"):
        run_sweep(str(f), [f"run.dir={runs}"], jobs=1, dry_run=False)
    assert not (runs / "cleanrun").exists()  # nothing started, no state written
