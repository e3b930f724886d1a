"""A study kept across machines as committed parts (sat_cli/report/study_parts.py and
scripts/study_parts.py): which seeds a part keeps, what merging refuses, and the remaining-seeds
sweep file, on hand-made rows and on the study's real sweep file."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sat_cli.report import lag_study as L
from sat_cli.report import study_parts as P
from sat_cli.report.collapse import read_rows, rows_csv
from sat_cli.report.collapse_curves import CURVE_COLUMNS
from tests.test_lag_study import _row

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "study_parts.py"
SWEEP = ROOT / "sweeps" / "sat_lag_v5_cpu.yaml"


def _curves(rows) -> str:
    lines = [",".join(CURVE_COLUMNS)]
    for r in rows:
        for step, v in ((0, 20.0), (20, 21.5)):
            lines.append(f"{r.run},{r.method},{r.lag},{r.seed},eval,{step},{v}")
    return "\n".join(lines) + "\n"


def _export(statuses: dict[tuple[str, str], str]):
    """Rows of seeds 5000-5002 in every arm, seed-major; ``statuses`` overrides a run's status
    (``"absent"``: the run is not in the export at all)."""
    rows = []
    for seed in ("5000", "5001", "5002"):
        for arm in L.ARMS:
            st = statuses.get((arm, seed), "FINISHED")
            if st != "absent":
                rows.append(_row(arm, seed, 30.0, status=st))
    return read_rows(rows_csv(rows)), _curves(rows)


def test_a_part_keeps_exactly_the_seeds_finished_in_every_arm():
    rows, curves = _export({("S8", "5001"): "RUNNING", ("C8", "5002"): "absent"})
    part = P.complete_part(rows, curves, L.ARMS)
    assert part.seeds == ["5000"]
    assert part.left_out == ["5001", "5002"]
    kept = read_rows(part.runs_csv)
    assert [(r.method, r.seed) for r in kept] == [(a, "5000") for a in L.ARMS]
    # the curves hold the kept runs' points and nothing else, byte for byte as exported
    want = [ln for ln in curves.splitlines()[1:] if ",5000,eval," in ln]
    assert part.curves_csv.splitlines() == [",".join(CURVE_COLUMNS), *want]


def test_a_failed_arm_leaves_its_seed_out_and_a_duplicate_finished_arm_is_refused():
    rows, curves = _export({("B8", "5000"): "FAILED"})
    assert P.complete_part(rows, curves, L.ARMS).seeds == ["5001", "5002"]
    rows, curves = _export({})
    dup = read_rows(rows_csv([*rows, _row("B1", "5000", 1.0)]))
    with pytest.raises(P.PartsError, match="two FINISHED runs of arm B1"):
        P.complete_part(dup, curves, L.ARMS)


def test_merge_concatenates_parts_and_refuses_a_seed_counted_twice():
    rows, curves = _export({})
    a = P.complete_part([r for r in rows if r.seed == "5000"], curves, L.ARMS)
    b = P.complete_part([r for r in rows if r.seed != "5000"], curves, L.ARMS)
    runs, merged_curves, seeds = P.merge_parts(
        [("a", a.runs_csv, a.curves_csv), ("b", b.runs_csv, b.curves_csv)]
    )
    assert seeds == ["5000", "5001", "5002"]
    assert runs == rows_csv(rows)  # the parts together are the whole export, in its order
    assert merged_curves == curves
    with pytest.raises(P.PartsError, match="seed 5000 is in two parts: a and c"):
        P.merge_parts([("a", a.runs_csv, a.curves_csv), ("c", a.runs_csv, a.curves_csv)])
    with pytest.raises(P.PartsError, match="no points for the runs"):
        P.merge_parts([("a", a.runs_csv, ",".join(CURVE_COLUMNS) + "\n")])
    bad = a.curves_csv.replace(",eval,20,21.5", ",eval,20,nan", 1)
    with pytest.raises(P.PartsError, match="line 3: step '20', value 'nan'"):
        P.merge_parts([("a", a.runs_csv, bad)])


def test_the_remaining_sweep_differs_from_the_study_file_only_in_its_seeds():
    text = SWEEP.read_text()
    out, left = P.remaining_sweep(text, {"5000", "5001", "5002"})
    assert left == list(range(5003, 5016))
    old, new = yaml.safe_load(text), yaml.safe_load(out)
    assert new.pop("seeds") == left and old.pop("seeds") == list(range(5000, 5016))
    assert new == old
    diff = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True) if a != b]
    assert len(diff) == 1 and diff[0][1].startswith("seeds: [5003, 5004")
    with pytest.raises(P.PartsError, match="does not list"):
        P.remaining_sweep(text, {"4999"})
    with pytest.raises(P.PartsError, match="nothing remains"):
        P.remaining_sweep(text, {str(s) for s in range(5000, 5016)})


def _script(*args, cwd):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_script_round_trip_and_its_refusals(tmp_path):
    rows, curves = _export({("C8", "5002"): "KILLED"})
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "collapse.csv").write_text(rows_csv(rows))
    (rep / "collapse_curves.csv").write_text(curves)
    r = _script(
        "export", "report", "parts", "day1", cwd=tmp_path
    )  # relative to the caller's folder
    assert r.returncode == 0, r.stderr
    assert (
        r.stdout.strip()
        == "part day1: 2 seeds (5000, 5001), 8 runs; left out (some arm not finished): 5002"
    )
    again = _script("export", "report", "parts", "day1", cwd=tmp_path)
    assert again.returncode == 2 and "exists: not overwritten" in again.stderr
    overlap = _script("export", "report", "parts", "day2", cwd=tmp_path)
    assert overlap.returncode == 2 and "seed 5000 is in two parts: day1 and day2" in overlap.stderr
    r = _script("remaining", SWEEP, "parts", "rest.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((tmp_path / "rest.yaml").read_text())["seeds"] == list(range(5002, 5016))
    r = _script("merge", "parts", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "runs.csv").read_text() == rows_csv(
        [x for x in rows if x.seed != "5002"]
    )
    for bad, msg in (
        (("export", "nowhere", "parts", "x"), "nowhere/collapse.csv: no such file"),
        (("export", "report", "parts", "../x"), "part label '../x'"),
        (("merge", "empty", "o"), "empty: no parts"),
    ):
        r = _script(*bad, cwd=tmp_path)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_export_keeps_the_seeds_complete_in_the_arms_given(tmp_path):
    """``--arms S8,L8`` (study v5's F1 after deviation 5): a seed is kept when both finished."""
    rows = [_row("S8", "5000", 30.0), _row("L8", "5000", 28.0), _row("S8", "5001", 30.0)]
    rows.append(_row("L8", "5001", 28.0, status="KILLED"))  # L8 of 5001 did not finish
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "collapse.csv").write_text(rows_csv(rows))
    (rep / "collapse_curves.csv").write_text(_curves(rows))
    default = _script("export", "report", "parts", "f1", cwd=tmp_path)  # the study's four arms
    assert default.returncode == 2 and "arm 'L8' is not one of the study's" in default.stderr
    r = _script("export", "report", "parts", "f1", "--arms", "S8,L8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "part f1: 1 seeds (5000), 2 runs; left out (some arm not finished): 5001"
    )
    for bad in (
        "",
        "S8,S8",
        "s8",
        "S8,,L8",
        "S8;L8",
        "K0.50",
        ",".join(f"A{i}" for i in range(17)),
    ):
        r = _script("export", "report", "parts", "x", "--arms", bad, cwd=tmp_path)
        assert r.returncode == 2 and "--arms" in r.stderr and "Traceback" not in r.stderr, bad


@pytest.mark.parametrize("seed", range(3))
def test_arms_list_accepts_exactly_the_documented_names(seed):
    """Fuzz: random strings over the characters that matter; the parser either returns the
    comma-split names, each a capital then up to 7 letters or digits, distinct, 1 to 16 of them,
    or refuses with argparse's error (exit 2), never anything else."""
    import argparse
    import importlib.util
    import random
    import re

    spec = importlib.util.spec_from_file_location("study_parts_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = random.Random(seed)
    alphabet = "SLB8K0.,; aZ\u00e9\x00-"
    name = re.compile(r"[A-Z][A-Za-z0-9]{0,7}")
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        want = tuple(a.strip() for a in text.split(","))
        ok = (
            1 <= len(want) <= 16
            and all(name.fullmatch(a) for a in want)
            and len(set(want)) == len(want)
        )
        if ok:
            assert mod.arms_list(text) == want
        else:
            with pytest.raises(argparse.ArgumentTypeError):
                mod.arms_list(text)
