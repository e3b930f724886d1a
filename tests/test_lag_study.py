"""Study v5's pre-registered rules (sat_cli/report/lag_study.py) on hand-made CSVs: one for each
outcome branch (waiting, underpowered, M fails, bounded null, inconclusive, SAT harms, P1
positive with P2 tested both ways), the seed-dropping rule, the recovery fraction's bootstrap
and the per-run columns the study adds (sat_cli/report/collapse.py)."""

import math
import statistics
from pathlib import Path

import pytest

from sat_cli.report import lag_study as L
from sat_cli.report.collapse import (
    StudyRow,
    early_crash,
    mean_dose,
    read_rows,
    rows_csv,
    window_mean,
)
from sat_cli.report.collapse_md import study_markdown

SEEDS = [str(s) for s in L.SEEDS]
# a fixed, irregular per-seed wobble (points), so paired differences have a spread
WOBBLE = [0.3, -0.7, 1.1, -0.2, 0.5, -1.3, 0.8, 0.0, -0.4, 0.9, -0.6, 0.2, 1.4, -1.0, 0.1, -0.3]


def _row(arm, seed, primary, *, status="FINISHED", crash="0", final=None, dose="0.05"):
    lag = "1" if arm == "B1" else "8"
    return StudyRow(
        method=arm,
        lag=lag,
        seed=seed,
        run=f"{arm.lower()}-s{seed}",
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
        design=L.DESIGN,
        best_step="280",
        late_gain="",
        can_act_early="0.9",
        started="2026-12-04T19:40:00Z",
        eval_window=f"{primary:.6g}",
        early_crash=crash,
        final_eval=f"{(primary if final is None else final):.6g}",
        dose=dose,
        dpi_mean="0.1",
    )


def _study(b1, b8, s8, c8, **kw):
    """Rows of every arm x seed; each argument: seed index -> primary value."""
    rows = []
    for i, seed in enumerate(SEEDS):  # seed-major, as the sweep runs them
        for arm, f in (("B1", b1), ("B8", b8), ("S8", s8), ("C8", c8)):
            rows.append(_row(arm, seed, f(i), **kw))
    return read_rows(rows_csv(rows))  # through the committed CSV format


def _w(scale=1.0, shift=0.0):
    return lambda i: shift + scale * WOBBLE[i]


def test_the_study_columns_hand_cases():
    ev = [(0, 20.0), (20, 9.9), (200, 30.0), (220, 32.0), (300, 31.0), (320, 99.0)]
    assert window_mean(ev) == pytest.approx((30 + 32 + 31) / 3, abs=1e-12)
    assert window_mean([(0, 1.0), (180, 2.0)]) is None
    assert early_crash(ev) == 1  # 9.9 < 10
    assert early_crash([(0, 20.0), (20, 10.0)]) == 0  # exactly half is not below it
    assert early_crash([(0, 20.0), (40, 1.0)]) is None
    # SAT's band adds step by step; a step without a band value adds 0
    assert mean_dose([(1, 0.1), (2, 0.3)], [(1, 0.05)]) == pytest.approx(0.225, abs=1e-15)
    assert mean_dose([(1, 0.1), (2, 0.3)], []) == pytest.approx(0.2, abs=1e-15)
    assert mean_dose([], [(1, 0.1)]) is None


def test_waiting_shows_no_outcome_until_every_run_ended():
    rows = _study(_w(shift=40), _w(shift=30), _w(shift=35), _w(shift=31))
    rows[5].status = "RUNNING"
    md = study_markdown(rows[:-1])
    assert md.startswith(f"{L.WAITING}: 62 of 64 planned runs have ended")
    assert "B8 − B1" not in md and "30." not in md and "Verdict" not in md
    assert L.decide(rows)["verdict"] == L.WAITING


def test_m_fails_stops_before_p1():
    rows = _study(_w(shift=30), _w(-1.0, 30.2), _w(shift=40), _w(shift=30))
    d = L.decide(rows)
    assert d["verdict"] == L.M_FAILS and "P1" not in d and "P2" not in d
    md = study_markdown(rows)
    assert f"Verdict: **{L.M_FAILS}**" in md and "**P1**, **P2** not tested" in md


def test_p1_not_significant_bounded_null():
    # gap 10 points; S8 - B8 = 0.1 * wobble: mean 0.005, CI well inside +-2.5
    rows = _study(_w(shift=40), _w(shift=30), _w(1.1, 30), _w(shift=29))
    d = L.decide(rows)
    assert d["verdict"] == L.BOUNDED and d["bounded"] and "P2" not in d
    diffs = [0.1 * w for w in WOBBLE]
    assert d["P1"].mean == pytest.approx(statistics.mean(diffs), abs=1e-9)
    assert d["P1"].hi < L.BOUND * 10
    # M's mean difference and t statistic, by hand in float64
    m = [(30 + w) - (40 + w) for w in WOBBLE]
    assert d["M"].mean == pytest.approx(-10.0, abs=1e-9) and d["M"].n == 16
    assert statistics.stdev(m) == pytest.approx(0.0, abs=1e-9)  # no spread: t undefined
    md = study_markdown(rows)
    assert (
        f"Verdict: **{L.BOUNDED}**. Bounded null: SAT recovers less than 25% of the lag gap" in md
    )
    assert "- **P2** not tested (P1 is not positive and significant)." in md


def test_m_without_spread_is_not_significant():
    """A difference constant over seeds has no t statistic (p = nan): not significant, so M
    fails rather than passing by accident."""
    rows = _study(lambda i: 40.0, lambda i: 30.0, lambda i: 30.0, lambda i: 30.0)
    assert L.decide(rows)["verdict"] == L.M_FAILS


def _gap(i):  # lag 1 - lag 8 per seed: about 10 points with a spread
    return 10 + 2 * WOBBLE[i]


def test_p1_not_significant_inconclusive():
    # S8 - B8 = 6 * wobble: mean 0.3, CI about +-3.5 > 0.25 * 10
    rows = _study(
        lambda i: 40.0,
        lambda i: 40 - _gap(i),
        lambda i: 40 - _gap(i) + 6 * WOBBLE[i],
        lambda i: 30.0,
    )
    d = L.decide(rows)
    assert d["M"].p_t < 0.05 and d["M"].mean < 0
    assert d["verdict"] == L.INCONCLUSIVE and not d["bounded"]
    assert d["P1"].p_t >= 0.05 and d["P1"].hi >= L.BOUND * -d["M"].mean
    assert f"Verdict: **{L.INCONCLUSIVE}**." in study_markdown(rows)


def test_p1_negative_and_significant_harms():
    rows = _study(
        lambda i: 40.0,
        lambda i: 40 - _gap(i),
        lambda i: 40 - _gap(i) - 3 + WOBBLE[i],
        lambda i: 30.0,
    )
    d = L.decide(rows)
    assert d["verdict"] == L.HARMS and d["bounded"] and "P2" not in d


def _positive(c8_shift):
    # S8 recovers half the gap, with a spread; C8 = S8 + c8_shift (+ a wobble of its own)
    return _study(
        lambda i: 40.0,
        lambda i: 40 - _gap(i),
        lambda i: 40 - _gap(i) / 2 + 0.5 * WOBBLE[i],
        lambda i: 40 - _gap(i) / 2 + 0.5 * WOBBLE[i] + c8_shift + 0.3 * WOBBLE[15 - i],
    )


def test_p1_positive_then_p2_is_tested_both_ways():
    d = L.decide(_positive(-2.0))
    assert d["verdict"] == L.BEYOND and d["P2"].mean == pytest.approx(
        2.0 - 0.3 * statistics.mean(WOBBLE), abs=1e-9
    )
    d = L.decide(_positive(0.0))
    assert d["verdict"] == L.NOT_BEYOND and d["P2"].p_t >= 0.05
    md = study_markdown(_positive(-2.0))
    assert f"Verdict: **{L.BEYOND}**." in md and "- **P2** S8 − C8: mean +" in md
    # the recovery fraction, by hand: mean(S8 - B8) / mean(B1 - B8)
    num = [_gap(i) / 2 + 0.5 * WOBBLE[i] for i in range(16)]
    den = [_gap(i) for i in range(16)]
    r, lo, hi, dropped = d["recovery"]
    assert r == pytest.approx(statistics.mean(num) / statistics.mean(den), abs=1e-12)
    assert lo < r < hi and dropped == 0


def test_recovery_bootstrap_of_an_exact_ratio_is_that_ratio():
    """S8 - B8 = 0.5 * (B1 - B8) on every seed: every resample's ratio is 0.5."""
    rows = _study(
        lambda i: 40.0, lambda i: 40 - _gap(i), lambda i: 40 - _gap(i) / 2, lambda i: 30.0
    )
    r, lo, hi, dropped = L.recovery(rows, SEEDS)
    assert (r, dropped) == (pytest.approx(0.5, abs=1e-12), 0)
    assert lo == pytest.approx(0.5, abs=1e-12) and hi == pytest.approx(0.5, abs=1e-12)


def test_a_seed_missing_an_arm_is_dropped_from_every_arm_and_14_is_the_floor():
    rows = _positive(-2.0)
    rows[4 * 3 + 2].status = "FAILED"  # S8 of seed 5003
    d = L.decide(rows)
    assert "5003" in d["dropped"] and "5003" not in d["seeds"]
    assert d["M"].n == 15 and d["verdict"] == L.BEYOND  # B1 and B8 of 5003 unused too
    rows[4 * 7 + 0].status = "FAILED"  # B1 of 5007
    rows[4 * 9 + 3].status = "FAILED"  # C8 of 5009
    d = L.decide(rows)
    assert len(d["seeds"]) == 13 and d["verdict"] == L.UNDERPOWERED and d["would"] == L.BEYOND
    md = study_markdown(rows)
    assert "Complete seeds: 13 of 16 (dropped from every arm: 5003, 5007, 5009)." in md
    assert "- **M** (descriptive: underpowered) B8 − B1" in md
    assert f"Verdict: **{L.UNDERPOWERED}**: 13 complete seeds, fewer than 14" in md


def test_secondary_lines_crash_mcnemar_and_arm_table():
    rows = _positive(-2.0)
    for r in rows:  # B8 crashes early on every seed, S8 on seeds 0-2, C8 never
        idx = SEEDS.index(r.seed)
        r.early_crash = "1" if r.method == "B8" or (r.method == "S8" and idx < 3) else "0"
    md = study_markdown(read_rows(rows_csv(rows)))
    p = 2 * 0.5**13  # 13 discordant pairs, all one way
    assert f"S8 vs B8: only B8 crashed 13, only S8 0 (n = 16), p = {p:.3g}" in md
    assert "| B8 | 16 |" in md and "| 16/16 |" in md and "| 3/16 |" in md
    assert "| 0.0100 / 0.0500 |" in md
    assert not math.isnan(L.decide(rows)["P1"].p_w)


def _sweep(name):
    from pathlib import Path

    from sat_cli.util.safe_yaml import read_yaml

    return read_yaml(Path(__file__).resolve().parents[1] / "sweeps" / f"{name}.yaml", "a sweep")


def test_the_sweep_files_are_the_design():
    """The study's sweep: its arms in order, its 16 seeds, the D2 settings; the calibration
    sweep is the B8 arm on seed 4999, recorded; C8 is in the study's sweep iff the calibration
    is committed, at the scale it chose."""
    import json
    from pathlib import Path

    main, calib = _sweep("sat_lag_v5_cpu"), _sweep("sat_lag_v5_calib_cpu")
    assert main["seeds"] == list(L.SEEDS) and calib["seeds"] == [4999]
    assert main["clean_tree"] is True and calib["clean_tree"] is True
    arms = {m.split()[0]: ovs for m, ovs in main["methods"].items()}
    for key in (
        "max_steps=300",
        "algo=gspo",
        "algo.eps_low=0.5",
        "trainer.lr=3e-4",
        "eval.every=20",
        "eval.n=4",
        "eval.limit=128",
        "eval.final_n=8",
        "algo.ledger=true",
        f"+tracking.tags.collapse_design={L.DESIGN}",
    ):
        assert key in main["base"], key
    assert arms["B1"] == ["clip=ppo", "lag=1"] and arms["B8"] == ["clip=ppo", "lag=8"]
    assert arms["S8"] == ["clip=sat", "lag=8"]
    same = [o for o in main["base"] if "collapse_design" not in o]
    assert [o for o in calib["base"] if "collapse_design" not in o] == [*same, "replay.record=true"]
    assert list(calib["methods"].values()) == [arms["B8"]]
    path = (
        Path(__file__).resolve().parents[1] / "docs/results/sat_lag_v5_cpu/control_calibration.json"
    )
    if not path.exists():
        assert list(arms) == ["B1", "B8", "S8"]  # the design commit: C8 waits for the calibration
        return
    scale = json.loads(path.read_text())["radius_scale"]
    assert list(arms) == list(L.ARMS)
    assert arms["C8"] == ["clip=ppo_tight", f"clip.radius_scale={scale}", "lag=8"]


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("eval_window", "x"),
        ("final_eval", "inf"),
        ("dose", "nan"),
        ("dpi_mean", "1,0"),
        ("early_crash", "2"),
        ("early_crash", "0.5"),
    ],
)
def test_a_damaged_study_column_is_refused_when_read(column, value):
    rows = [_row("B1", "5000", 40.0), _row("B8", "5000", 30.0)]
    setattr(rows[1], column, value)
    with pytest.raises(ValueError, match=f"line 3, column {column}: "):
        read_rows(rows_csv(rows))
    setattr(rows[1], column, "")  # empty: a run without it (pilot 2's rows lack them all)
    assert len(read_rows(rows_csv(rows))) == 2


def test_the_study_columns_from_a_real_mlflow_store(tmp_path):
    """`sat report <sweep> --collapse` on a real MLflow store: the study's columns come from
    the logged histories (primary window, early crash, final eval, dose with SAT's band, d̄π),
    and collapse.md is the study's waiting message (1 of 64 runs)."""
    pytest.importorskip("mlflow")
    from cli_helpers import seeded_store
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    from sat_cli.report import run_report

    uri = f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("v5")
    rid = client.create_run(exp, run_name="s8-s5000").info.run_id
    evals = [20.0, 9.0] + [25.0] * 8 + [30.0, 31.0, 32.0, 33.0, 34.0, 36.0]  # E_0 .. E_300
    pts = [Metric("eval/toy/avg_at_4", v, 1, 20 * i) for i, v in enumerate(evals)]
    pts += [Metric("final/toy/avg_at_8", 35.5, 1, 300)]
    pts += [Metric("rollout/reward_mean", 0.3, 1, s) for s in range(1, 301)]
    pts += [Metric("loss/clipfrac", 0.1 if s % 2 else 0.2, 1, s) for s in range(1, 301)]
    pts += [Metric("sat/clipfrac_sat_band", 0.05, 1, s) for s in range(1, 151)]
    pts += [Metric("staleness/abs_logratio_mean", 0.01 * (s % 3), 1, s) for s in range(1, 301)]
    # a real run logs d̄π against mu too (the same values here, as in the study's runs): the report
    # stores it as the d̄π series, and the row must read that series, not the source key
    pts += [Metric("staleness/abs_logratio_mean_mu", 0.01 * (s % 3), 1, s) for s in range(1, 301)]
    tags = {
        "sat.method": "S8 SAT-GSPO lag 8",
        "lag": "8",
        "seed": "5000",
        "git_commit": "f00",
        "collapse_design": L.DESIGN,
    }
    params = {"eval.name": "toy", "eval.n": "4", "eval.final_n": "8", "algo.eps_low": "0.5"}
    for i in range(0, len(pts), 900):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(rid, metrics=pts[i : i + 900])
    client.log_batch(
        rid,
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.set_terminated(rid, "FINISHED")
    out = tmp_path / "rep"
    run_report("v5", out=str(out), tracking_uri=uri, collapse=True)
    (row,) = read_rows((out / "collapse.csv").read_text())
    assert float(row.eval_window) == pytest.approx((30 + 31 + 32 + 33 + 34 + 36) / 6, abs=1e-4)
    assert row.early_crash == "1" and float(row.final_eval) == 35.5
    # clipfrac alternates 0.1 / 0.2 (mean 0.15), the band adds 0.05 on 150 of 300 steps
    assert float(row.dose) == pytest.approx(0.15 + 0.025, abs=1e-6)
    assert float(row.dpi_mean) == pytest.approx(0.01, abs=1e-6)  # 0.01, 0.02, 0 in turn
    md = (out / "collapse.md").read_text()
    assert md.startswith(f"{L.WAITING}: 1 of 64 planned runs have ended")


def test_the_committed_result_regenerates_from_the_committed_csv():
    """The write-up's result block is what `sat report docs/results/sat_lag_v5_cpu/runs.csv`
    prints, byte for byte, and its verdict is the one the write-up states in words."""
    root = Path(__file__).resolve().parents[1]
    doc = root / "docs/results/sat_lag_v5_cpu.md"
    md = doc.read_text()
    head = "<!-- generated: lag_study from sat_lag_v5_cpu/runs.csv -->\n"
    body = md.split(head, 1)[1].split("<!-- /generated -->", 1)[0]
    rows = read_rows((doc.parent / "sat_lag_v5_cpu/runs.csv").read_text())
    assert body == study_markdown(rows)
    d = L.decide(rows)
    assert d["verdict"] == L.BEYOND and len(d["seeds"]) == 16
    assert f"**Verdict, by the pre-registered rules: {d['verdict']}." in " ".join(md.split())
