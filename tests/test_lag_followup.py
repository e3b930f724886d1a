"""Study v5's follow-up F1 (sat_cli/report/lag_followup.py) on hand-made rows: the live
calibration's choice (nearest dose, a tie, the one extension on either side, an unfinished
grid), each verdict (SAT beats, loses, not distinguishable, underpowered, waiting), the dose
check, and the script's exit status on bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from sat_cli.report import lag_followup as F
from sat_cli.report.collapse import StudyRow, read_rows, rows_csv

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [str(s) for s in range(5000, 5016)]
WOBBLE = [0.3, -0.7, 1.1, -0.2, 0.5, -1.3, 0.8, 0.0, -0.4, 0.9, -0.6, 0.2, 1.4, -1.0, 0.1, -0.3]


def _row(method, seed, primary=20.0, *, dose="0.02", design=F.DESIGN, status="FINISHED", crash="0"):
    return StudyRow(
        method=method,
        lag="8",
        seed=seed,
        run=f"{method.split()[0].lower()}-s{seed}",
        status=status,
        commit="c0ffee",
        last_step=300,
        evals=16,
        eval_first=20.0,
        eval_best=primary + 2,
        eval_last=primary,
        collapsed=0,
        t_collapse="",
        min_ess="0.8",
        can_act_frac="",
        ledger_mismatch="0.01",
        ledger_staleness="0.05",
        design=design,
        best_step="280",
        late_gain="",
        can_act_early="0.9",
        started="2026-12-05T12:40:00Z",
        eval_window=f"{primary:.6g}",
        early_crash=crash,
        final_eval=f"{primary:.6g}",
        dose=dose,
        dpi_mean="0.1",
    )


def _calib(target, doses):
    rows = [_row("S8 SAT-GSPO lag 8", "4999", dose=str(target), design=F.CALIB_DESIGN)]
    rows += [
        _row(f"K{s:.2f} GSPO tight lag 8", "4999", dose=str(d), design=F.CALIB_DESIGN)
        for s, d in doses.items()
    ]
    return read_rows(rows_csv(rows))  # through the CSV format the export writes


GRID_DOSES = {0.5: 0.05, 0.6: 0.03, 0.7: 0.018, 0.8: 0.011}


def test_the_nearest_live_dose_wins():
    cal = F.choose_scale(_calib(0.02, GRID_DOSES))
    assert (cal.scale, cal.extend) == (0.7, None)  # |0.018 - 0.02| is the smallest
    assert "Chosen radius scale: **0.7** (dose 0.0180)" in F.calibration_markdown(cal)


def test_a_tie_goes_to_the_larger_scale():
    doses = {0.5: 0.75, 0.6: 0.5, 0.7: 0.375, 0.8: 0.125}  # binary fractions: an exact tie
    cal = F.choose_scale(_calib(0.25, doses))  # 0.375 and 0.125 both 0.125 away
    assert cal.scale == 0.8


@pytest.mark.parametrize(
    ("target", "ext", "ext_dose", "final"),
    [(0.2, 0.4, 0.09, 0.4), (0.002, 0.9, 0.006, 0.9), (0.2, 0.4, 0.03, 0.5)],
)
def test_the_grid_is_extended_once_on_the_targets_side(target, ext, ext_dose, final):
    cal = F.choose_scale(_calib(target, GRID_DOSES))
    assert (cal.scale, cal.extend) == (None, ext)
    assert f"run the control at {ext:g}" in F.calibration_markdown(cal)
    cal = F.choose_scale(_calib(target, {**GRID_DOSES, ext: ext_dose}))  # once: never again
    assert (cal.scale, cal.extend) == (final, None)


def test_an_unfinished_calibration_names_what_is_missing():
    rows = _calib(0.02, {0.5: 0.05, 0.7: 0.018})
    with pytest.raises(ValueError, match="K0.60, K0.80"):
        F.choose_scale(rows)
    failed = [r for r in _calib(0.02, GRID_DOSES) if not r.method.startswith("K0.80")]
    with pytest.raises(ValueError, match="K0.80"):
        F.choose_scale(failed)


def _runs(s8, b8, l8, *, l8_dose="0.02", l8_status="FINISHED", seeds=SEEDS):
    study = [_row("S8 SAT-GSPO lag 8", s, s8(i), design="sat-lag-v5") for i, s in enumerate(seeds)]
    study += [_row("B8 GSPO lag 8", s, b8(i), design="sat-lag-v5") for i, s in enumerate(seeds)]
    f1 = [
        _row("L8 GSPO tight lag 8", s, l8(i), dose=l8_dose, status=l8_status)
        for i, s in enumerate(SEEDS)
    ]
    return read_rows(rows_csv(study)), read_rows(rows_csv(f1))


def test_sat_beats_then_loses_then_is_not_distinguishable():
    study, f1 = _runs(lambda i: 20 + WOBBLE[i], lambda i: 15.0, lambda i: 17 - WOBBLE[i] / 2)
    d = F.decide(study, f1)
    assert d["verdict"] == F.BEATS and d["F"].mean == pytest.approx(3 + 1.5 * sum(WOBBLE) / 16)
    assert d["matched"] and "Verdict: **" + F.BEATS + "**." in F.f1_markdown(study, f1)
    study, f1 = _runs(lambda i: 16 + WOBBLE[i], lambda i: 15.0, lambda i: 19.0)
    assert F.decide(study, f1)["verdict"] == F.LOSES
    study, f1 = _runs(lambda i: 18 + WOBBLE[i], lambda i: 15.0, lambda i: 18 - WOBBLE[i])
    d = F.decide(study, f1)
    assert d["verdict"] == F.SAME and d["F"].p_t > 0.05


def test_a_dose_off_by_more_than_a_quarter_is_said_with_the_verdict():
    study, f1 = _runs(lambda i: 20 + WOBBLE[i], lambda i: 15.0, lambda i: 17.0, l8_dose="0.0149")
    d = F.decide(study, f1)
    assert d["verdict"] == F.BEATS and not d["matched"]  # 0.0149 / 0.02 = 0.745: 25.5 % off
    md = F.f1_markdown(study, f1)
    assert f"Verdict: **{F.BEATS}** (dose not matched)." in md and "ratio 0.74" in md
    study, f1 = _runs(lambda i: 20 + WOBBLE[i], lambda i: 15.0, lambda i: 17.0, l8_dose="0.0151")
    assert F.decide(study, f1)["matched"]  # 24.5 % off: matched
    assert f"Verdict: **{F.BEATS}**." in F.f1_markdown(study, f1)


def test_waiting_then_underpowered_when_seeds_lack_an_arm():
    study, f1 = _runs(lambda i: 20.0, lambda i: 15.0, lambda i: 17.0, l8_status="RUNNING")
    d = F.decide(study, f1)
    assert d["verdict"] == "No verdict yet" and d["ended"] == 0
    assert "no outcome" in F.f1_markdown(study, f1)
    # the study's S8/B8 of only 13 seeds: 13 < 14 complete seeds
    study, f1 = _runs(lambda i: 20 + WOBBLE[i], lambda i: 15.0, lambda i: 17.0, seeds=SEEDS[:13])
    d = F.decide(study, f1)
    assert d["verdict"] == "Underpowered" and d["would"] == F.BEATS and len(d["seeds"]) == 13


def _script(*args, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/study_v5_followup.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_the_script_prints_the_choice_and_refuses_bad_input(tmp_path):
    (tmp_path / "calib.csv").write_text(rows_csv(_calib(0.02, GRID_DOSES)))
    out = _script("calibrate", "calib.csv", cwd=tmp_path)
    assert out.returncode == 0 and "Chosen radius scale: **0.7**" in out.stdout
    (tmp_path / "bad.csv").write_text("method,lag\nx,y\n")
    for args in (
        ("calibrate", "missing.csv"),
        ("calibrate", "bad.csv"),
        ("verdict", "calib.csv", "calib.csv"),
    ):
        out = _script(*args, cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.startswith("study_v5_followup: "), out.stderr
        assert "Traceback" not in out.stderr


def _rerun(f1_s8, l8, *, s8_status="FINISHED", study_s8=lambda i: 30.0):
    """Deviation 5: F1 holds S8 again beside L8; the study's S8 (other machine) and B8 too."""
    study, _ = _runs(study_s8, lambda i: 15.0, l8)
    f1 = [_row("S8 SAT-GSPO lag 8", s, f1_s8(i), status=s8_status) for i, s in enumerate(SEEDS)]
    f1 += [_row("L8 GSPO tight lag 8", s, l8(i)) for i, s in enumerate(SEEDS)]
    return study, read_rows(rows_csv(f1))


def test_with_s8_run_again_test_f_pairs_f1s_own_s8_and_ignores_the_studys():
    # the study's S8 would beat L8 by 13 points; F1's own S8 equals L8 up to the wobble
    study, f1 = _rerun(lambda i: 17 + WOBBLE[i], lambda i: 17 - WOBBLE[i])
    d = F.decide(study, f1)
    assert d["s8_rerun"] and d["verdict"] == F.SAME and len(d["seeds"]) == 16
    assert d["F"].mean == pytest.approx(2 * sum(WOBBLE) / 16)
    md = F.f1_markdown(study, f1)
    assert "Seeds with S8 and L8 finished (both F1's, one machine; deviation 5): 16 of 16." in md
    # and the other way: F1's S8 beats L8 although the study's S8 is below it
    study, f1 = _rerun(lambda i: 20 + WOBBLE[i], lambda i: 17.0, study_s8=lambda i: 10.0)
    assert F.decide(study, f1)["verdict"] == F.BEATS


def test_with_s8_run_again_the_verdict_waits_for_both_arms_and_b8_is_not_required():
    study, f1 = _rerun(lambda i: 20.0, lambda i: 17.0, s8_status="RUNNING")
    d = F.decide(study, f1)
    assert d["verdict"] == "No verdict yet" and d["ended"] == 0
    # B8 of only 10 seeds in the study: F still counts the 16 seeds with F1's S8 and L8
    study, f1 = _rerun(lambda i: 20 + WOBBLE[i], lambda i: 17.0)
    study = [r for r in study if not (r.method.startswith("B8") and int(r.seed) >= 5010)]
    d = F.decide(study, f1)
    assert len(d["seeds"]) == 16 and d["verdict"] == F.BEATS
    assert "L8 − B8" in F.f1_markdown(study, f1)  # descriptive, over the 10 seeds with B8
