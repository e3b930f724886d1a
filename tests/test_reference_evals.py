"""The README's numbers and the script that compares a run with them (scripts/compare_reference.py,
docs/results/reference_evals.json): the README's tables quote the JSON exactly, the comparison
on hand cases, the default-run check on composed params, and the script's refusals."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import compare_reference as C  # noqa: E402


def _readme_table(title_word: str) -> dict[str, dict[int, str]]:
    """README's table whose header names ``title_word``: kind -> step -> cell text."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in text.split("\n\n") if b.startswith("| CPU kind") and title_word in b)
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in block.splitlines()]
    steps = [int(re.sub(r"\D", "", h)) for h in rows[0][1:]]
    return {r[0]: dict(zip(steps, r[1:], strict=True)) for r in rows[2:]}


@pytest.mark.parametrize("mode", ["portable", "default"])
def test_the_readme_quotes_the_reference_values(mode):
    ref = C.load_reference()
    table = _readme_table("portable" if mode == "portable" else "default")
    assert len(table) == len(ref[mode])
    for kind in ref[mode]:
        row = table[kind["kind"]]
        for step, cell in row.items():
            want = kind["evals"].get(step)
            assert cell == ("—" if want is None else repr(want)), (kind["kind"], step)


def test_the_reference_file_is_consistent():
    raw = json.loads(C.REFERENCE.read_text())
    for mode in ("portable", "default"):
        kinds = [k["kind"] for k in raw[mode]]
        assert len(set(kinds)) == len(kinds) and all(k.get("source") for k in raw[mode])
        for k in raw[mode]:
            assert all(int(s) % 25 == 0 and 0 <= int(s) <= 250 for s in k["evals"])
            assert all(v == round(v * 1024) / 1024 for v in k["evals"].values())  # avg@8 of 256


def test_compare_marks_equal_steps_and_names_the_first_difference():
    kinds = [
        {"kind": "A", "evals": {0: 1.0, 25: 2.0, 50: 3.0}},
        {"kind": "B", "evals": {0: 1.0, 50: 3.5}},
        {"kind": "C", "evals": {100: 9.0}},  # no step in common: neither reproduced nor differing
    ]
    lines, same, differ = C.compare({0: 1.0, 25: 2.0, 50: 3.0}, kinds)
    assert lines[2:] == [
        "| 0 | 1.0 | = | = | — |",
        "| 25 | 2.0 | = | — | — |",
        "| 50 | 3.0 | = | 3.5 | — |",
    ]
    assert same == ["A (3 steps)"]
    assert differ == ["B: first differs at step 50 (3.0 here, 3.5 there)"]


def test_only_the_default_runs_settings_are_compared():
    from omegaconf import OmegaConf

    from sat_cli.config import load
    from sat_cli.tracking.params import flatten_config

    # the params a default run records: the loaded config, with the values the schema derives
    # (engine.dtype and trainer.dtype null -> float32 on the CPU); compose's nulls once made
    # every default run "not the default"
    default = flatten_config(OmegaConf.to_container(load([])[0], resolve=True))
    assert default["engine.dtype"] == default["trainer.dtype"] == "float32"
    placed = {
        **default,
        "run.name": "mine",
        "run.dir": "elsewhere",
        "run.portable_numerics": "true",
    }
    assert C.differing_settings(placed) == []
    assert C.differing_settings({**default, "seed": "1"}) == ["seed=1 (default 0)"]
    other = flatten_config(OmegaConf.to_container(load(["algo=gspo", "lag=8"])[0], resolve=True))
    diff = C.differing_settings(other)
    assert "algo.name=gspo (default grpo)" in diff and any(d.startswith("lag.n=8") for d in diff)
    older = {k: v for k, v in default.items() if k != "algo.eps_high"}  # an option added later
    assert C.differing_settings(older) == []


def test_the_script_refuses_a_missing_store(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compare_reference.py"),
            "--tracking-uri",
            "sqlite:///nowhere/mlflow.db",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and "nowhere/mlflow.db: no such store" in r.stderr
        and "Traceback" not in r.stderr
    )
