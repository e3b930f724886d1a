"""`sat report` on a store of synthetic runs with known metric histories (real MLflow, tmp sqlite).

The runs are created directly with ``MlflowClient`` the way ``sat sweep``/``sat train`` tag them
(``sat.sweep_id``, ``sat.method``, ``lag``, ``seed``, ``sat.override_hash``, a parent run with
``sat.sweep_role=parent``), so every number in the report is known by hand: intervals and
paired tests use three seeds, where Student's t with 2 degrees of freedom has closed forms
(CDF ``1/2 + t / (2 sqrt(t^2 + 2))``, so ``t_{0.975,2} = sqrt(2 * 0.95^2 / (1 - 0.95^2))``).
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import seeded_store

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402

from sat_cli.errors import UserError  # noqa: E402
from sat_cli.report import derive_method, run_report  # noqa: E402
from sat_cli.report.tables import fmt_ci  # noqa: E402

SWEEP_ID = "toy-0123456789"
EVAL = "eval/toy/avg_at_4"  # mlflow_key("eval/toy/avg@4")
FINAL = "final/toy/avg_at_8"
T2 = math.sqrt(2 * 0.95**2 / (1 - 0.95**2))  # t_{0.975, 2} = 4.302653
# the module's store and report are built once: its tests run on one xdist worker
pytestmark = pytest.mark.xdist_group("report_store")


def _run(client, exp_id, name, *, tags, metrics, params=None, status="FINISHED", tables=None):
    run = client.create_run(exp_id, run_name=name)
    rid = run.info.run_id
    params = {
        "eval.name": "toy",
        "eval.n": "4",
        "eval.final_n": "8",
        "algo.eps_high": "0.2",
        **(params or {}),
    }
    points = [
        Metric(key, float(v), 1_000 + i, int(step))
        for key, series in metrics.items()
        for i, (step, v) in enumerate(series)
    ]
    client.log_batch(
        rid,
        metrics=points,
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, str(v)) for k, v in tags.items()],
    )
    for path, table in (tables or {}).items():
        client.log_dict(rid, table, path)
    client.set_terminated(rid, status)
    return rid


def _child(method, lag, seed, h=None):
    return {
        "sat.sweep_id": SWEEP_ID,
        "sat.method": method,
        "lag": lag,
        "seed": seed,
        "sat.override_hash": h or f"h-{method}-{lag}-{seed}",
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sweep 'toy' (GRPO, SAT-GRPO × lag 1, 8; three seeds at lag 1) plus noise, in a tmp store.

    Module-scoped: creating an MLflow sqlite store takes seconds; the tests only read it (and
    write their reports to their own folders).
    """
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{seeded_store(tmp_path / 'mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("toy", artifact_location=str(tmp_path / "art"))
    parent = _run(
        client,
        exp,
        "sweep-toy",
        tags={
            "sat.sweep_id": SWEEP_ID,
            "sat.sweep_role": "parent",
            "sat.sweep_methods": json.dumps(["SAT-GRPO", "GRPO"]),  # sweep order: SAT first
            "sat.sweep_axes": json.dumps(["lag"]),
        },
        metrics={},
    )
    hist = {
        "tables/staleness/abs_logratio/step_5.json": {
            "edges": [0.0, 0.1, 0.2],
            "counts": [1, 1],
            "marks": {"q": 0.1},
            "step": 5,
        },
        "tables/staleness/abs_logratio/step_10.json": {
            "edges": [0.0, 0.05, 0.1, 0.2],
            "counts": [5, 3, 1],
            "marks": {"q": 0.05},
            "step": 10,
        },
    }
    # GRPO lag 1, seeds 0/1/2: evals -> best 30 (5) / 35 (10) / 24 (10), last 25 / 35 / 24;
    # final 40 / 44 / 42; d̄π ends 0.01 / 0.03 / 0.02 (first point 0.5 at step 1)
    grpo1 = {0: [30, 25, 40, 0.01], 1: [20, 35, 44, 0.03], 2: [22, 24, 42, 0.02]}
    for seed, (e5, e10, fin, dpi) in grpo1.items():
        _run(
            client,
            exp,
            f"grpo-lag1-s{seed}",
            tags=_child("GRPO", 1, seed),
            metrics={
                EVAL: [(0, 10), (5, e5), (10, e10)],
                FINAL: [(10, fin)],
                "staleness/abs_logratio_mean": [(1, 0.5), (10, dpi)],
                "rollout/reward_mean": [(1, 0.1), (10, 0.3 + seed / 10)],
            },
            tables=hist if seed == 0 else None,
        )
    # GRPO lag 8: a single seed; the best (40) occurs twice: the first step (5) is reported
    _run(
        client,
        exp,
        "grpo-lag8-s0",
        tags=_child("GRPO", 8, 0),
        metrics={EVAL: [(0, 10), (5, 40), (10, 40)], "staleness/abs_logratio_mean": [(10, 0.25)]},
    )
    # SAT-GRPO lag 1 seed 0: first attempt FAILED, rerun (same override hash) FINISHED -> rerun only
    _run(
        client,
        exp,
        "sat-grpo-lag1-s0",
        tags=_child("SAT-GRPO", 1, 0),
        metrics={EVAL: [(0, 99)]},
        status="FAILED",
    )
    # SAT-GRPO lag 1: last = GRPO's + [2, 4, 6]; final = GRPO's + [1, 2, 3]
    sat1 = {0: [50, 27, 41], 1: [30, 39, 46], 2: [26, 30, 45]}
    for seed, (e5, e10, fin) in sat1.items():
        extra = {}
        if seed == 0:
            extra = {
                "sat/q": [(1, 0.1), (10, 0.2)],
                "sat/active_frac": [(1, 1.0), (10, 0.5)],
                "sat/gate_rate": [(1, 0.1), (10, 0.05)],
                "sat/clipfrac_sat_band": [(1, 0.02), (10, 0.04)],
                "sat/clipfrac_sat_band_low": [(1, 0.02), (10, 0.0)],
                "sat/clipfrac_sat_band_high": [(1, 0.0), (10, 0.04)],
                "staleness/ess": [(1, 0.9), (10, 0.5)],
            }
        _run(
            client,
            exp,
            f"sat-grpo-lag1-s{seed}",
            tags=_child("SAT-GRPO", 1, seed),
            metrics={
                EVAL: [(0, 10), (5, e5), (10, e10)],
                FINAL: [(10, fin)],
                "staleness/abs_logratio_mean": [(10, 0.02 - seed / 200)],
                **extra,
            },
            tables=hist if seed == 0 else None,
        )
    # SAT-GRPO lag 8 seed 1 only: n = 1, and it collapses (last 4 < half its step-0 score 10)
    _run(
        client,
        exp,
        "sat-grpo-lag8-s1",
        tags=_child("SAT-GRPO", 8, 1),
        metrics={EVAL: [(0, 10), (10, 4)], "staleness/abs_logratio_mean": [(10, 0.3)]},
    )
    # a run of another sweep in another experiment: must not leak into this report
    other = client.create_experiment("other", artifact_location=str(tmp_path / "art2"))
    _run(
        client,
        other,
        "x",
        tags={**_child("GRPO", 1, 2), "sat.sweep_id": "other-1"},
        metrics={EVAL: [(0, 77)]},
    )
    return {"uri": uri, "client": client, "parent": parent, "tmp": tmp_path}


def _csv(path):
    with open(path) as f:
        return {(r["row"], r["lag"]): r for r in csv.DictReader(f)}


def _pairs(path):
    with open(path) as f:
        return {
            (r["kind"], r["a"], r["lag_a"], r["b"], r["endpoint"]): r for r in csv.DictReader(f)
        }


@pytest.fixture(scope="module")
def report(store):
    """The default report of the sweep, written once (``(folder, printed text)``): the tests
    below only read it."""
    import contextlib
    import io

    out = store["tmp"] / "default-report"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"])
    return out, buf.getvalue()


def test_the_report_names_the_file_that_defines_its_endpoints(report):
    """The legend's "Endpoint definitions: `ENDPOINTS` in <file>" names a file of the package
    that defines them (it once named a module that had moved)."""
    import re

    import sat_cli

    md = (report[0] / "report.md").read_text()
    name, rel = re.search(r"Endpoint definitions: `(\w+)` in (sat_cli/[\w/]+\.py)\.", md).groups()
    src = Path(sat_cli.__file__).parent.parent / rel
    assert re.search(rf"^{name} = ", src.read_text(), re.M)


def test_table_cells_intervals_and_csv(report):
    out, printed = report
    md = (out / "report.md").read_text()
    assert (
        "| method | lag 1 best (steps) | lag 1 last | lag 1 d̄π | lag 1 n | lag 8 best (steps) "
        "| lag 8 last | lag 8 d̄π | lag 8 n |" in md
    )
    # GRPO lag 1: best 30, 35, 24 -> mean 29.667, s = sqrt(((.333)^2 + 5.333^2 + 5.667^2) / 2)
    # = 5.5076, h = T2 * s / sqrt(3) = 13.6816; last 25, 35, 24 -> 28 ± T2 * sqrt(37) / sqrt(3)
    # = 28 ± 15.1105; d̄π over the last 16 steps = the mean of both points:
    # (0.255, 0.265, 0.26) -> 0.26 ± T2 * 0.005 / sqrt(3) = 0.26 ± 0.0124
    h_best = T2 * math.sqrt(((30 - 89 / 3) ** 2 + (35 - 89 / 3) ** 2 + (24 - 89 / 3) ** 2) / 2)
    h_best /= math.sqrt(3)
    h_last = T2 * math.sqrt(37) / math.sqrt(3)
    h_dpi = T2 * 0.005 / math.sqrt(3)
    assert (
        f"| GRPO | 29.67 ± {h_best:.2f} (5/10/10) | 28.00 ± {h_last:.2f} | 0.2600 ± {h_dpi:.4f} | 3 |"
        in md
    )
    assert f"{h_last:.2f}" == "15.11" and f"{h_best:.2f}" == "13.68"
    # lag 8: one seed, best 40 first reached at step 5, d̄π 0.25
    assert "| 40.00 (5) | 40.00 | 0.2500 | 1 |" in md
    assert md.index("| SAT-GRPO |") < md.index("| GRPO |")
    assert "99.00" not in md  # the FAILED attempt (99) is left out
    assert "| GRPO | 29.67 ±" in printed

    rows = _csv(out / "table.csv")
    g1 = rows[("GRPO", "1")]
    assert g1["n_seeds"] == "3" and g1["best_steps"] == "5/10/10"
    assert float(g1["last_mean"]) == 28.0
    assert float(g1["last_std"]) == pytest.approx(math.sqrt(37), rel=1e-8)
    assert float(g1["last_ci95"]) == pytest.approx(h_last, rel=1e-8)
    assert float(g1["final_mean"]) == 42.0
    assert float(g1["final_ci95"]) == pytest.approx(T2 * 2 / math.sqrt(3), rel=1e-8)
    # mean of the last K = 3 evals: (10 + 30 + 25) / 3, (10 + 20 + 35) / 3, (10 + 22 + 24) / 3
    assert float(g1["lastk_mean"]) == pytest.approx((65 + 65 + 56) / 9)
    # training reward over the second half (steps > 5): 0.3, 0.4, 0.5
    assert float(g1["reward2_mean"]) == pytest.approx(0.4)
    # d̄π over the run: (0.5 + 0.01) / 2 ... and at the last step (the old column): 0.02
    assert float(g1["dpi_run_mean"]) == pytest.approx(0.26)
    assert float(g1["dpi_last_mean"]) == pytest.approx(0.02)
    assert (g1["collapsed"], g1["collapse_n"]) == ("0", "3")
    assert g1["runs"] == "grpo-lag1-s0;grpo-lag1-s1;grpo-lag1-s2"
    s8 = rows[("SAT-GRPO", "8")]
    assert s8["n_seeds"] == "1" and s8["best_ci95"] == "" and float(s8["best_mean"]) == 10.0
    assert (s8["collapsed"], s8["collapse_n"]) == ("1", "1")
    # the per-lag endpoint table carries the collapse count and the final evaluation
    assert "| SAT-GRPO | 1 |" in md and "| 1/1 |" in md
    assert f"| 42.00 ± {T2 * 2 / math.sqrt(3):.2f} |" in md


def test_paired_differences_against_hand_values(report):
    out = report[0]
    pairs = _pairs(out / "pairs.csv")
    # SAT-GRPO − GRPO at lag 1, final: d = [1, 2, 3] -> mean 2, s = 1, t = 2 sqrt(3) = 3.4641,
    # two-sided p (t, df 2) = 1 - t / sqrt(t^2 + 2) = 1 - 3.4641 / sqrt(14) = 0.074180;
    # CI 2 ± T2 / sqrt(3) = [-0.4841, 4.4841]; Wilcoxon: all 3 positive, W = 0, exact p = 2/8
    f = pairs[("SAT vs base", "SAT-GRPO", "1", "GRPO", "final")]
    t = 2 * math.sqrt(3)
    assert int(f["n"]) == 3 and float(f["mean_diff"]) == pytest.approx(2.0)
    assert float(f["t"]) == pytest.approx(t)
    assert float(f["p_t"]) == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-8)
    assert float(f["p_t"]) == pytest.approx(0.074180, abs=1e-6)
    assert float(f["ci95_lo"]) == pytest.approx(2 - T2 / math.sqrt(3), rel=1e-8)
    assert float(f["ci95_hi"]) == pytest.approx(2 + T2 / math.sqrt(3), rel=1e-8)
    assert float(f["wilcoxon_w"]) == 0.0 and float(f["p_wilcoxon"]) == pytest.approx(0.25)
    assert (f["a_greater"], f["b_greater"], f["seeds"]) == ("3", "0", "0/1/2")
    # last: d = [2, 4, 6] -> the same t and p, CI 4 ± 2 T2 / sqrt(3)
    last = pairs[("SAT vs base", "SAT-GRPO", "1", "GRPO", "last")]
    assert float(last["p_t"]) == pytest.approx(float(f["p_t"]), abs=1e-12)
    assert float(last["ci95_hi"]) == pytest.approx(4 + 2 * T2 / math.sqrt(3), rel=1e-8)
    # lag pair of GRPO (lag 8 − lag 1) shares only seed 0: n = 1, no interval, no test
    lag = pairs[("lag", "GRPO", "8", "GRPO", "best")]
    assert int(lag["n"]) == 1 and float(lag["mean_diff"]) == 10.0 and lag["ci95_lo"] == ""
    md = (out / "report.md").read_text()
    lo, hi = 2 - T2 / math.sqrt(3), 2 + T2 / math.sqrt(3)
    assert (
        f"| SAT-GRPO @ lag 1 − GRPO @ lag 1 | final eval | 3 | +2.00 [{lo:.2f}, {hi:.2f}] "
        "| 0.074 | 0.250 | 3/0 |" in md
    )


def test_requested_pair_and_options(store, tmp_path):
    out = tmp_path / "rep"
    run_report(
        SWEEP_ID,
        out=str(out),
        tracking_uri=store["uri"],
        pairs=["GRPO@8:SAT-GRPO@1"],
        last_k=2,
        epoch_steps=5,
        collapse_below=26.0,
    )
    pairs = _pairs(out / "pairs.csv")
    req = pairs[("requested", "GRPO", "8", "SAT-GRPO", "best")]
    assert int(req["n"]) == 1 and float(req["mean_diff"]) == 40.0 - 50.0
    rows = _csv(out / "table.csv")
    g1 = rows[("GRPO", "1")]
    # last 2 evals: (30 + 25) / 2, (20 + 35) / 2, (22 + 24) / 2; d̄π over steps > 5: the last point
    assert float(g1["lastk_mean"]) == pytest.approx((27.5 + 27.5 + 23) / 3)
    assert float(g1["dpi_epoch_mean"]) == pytest.approx(0.02)
    # absolute collapse threshold 26: last 25, 35, 24 -> 2 of 3
    assert (g1["collapsed"], g1["collapse_n"]) == ("2", "3")
    with pytest.raises(UserError, match="no cells 'GRPO' at lag 3"):
        run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"], pairs=["GRPO@3:GRPO@1"])
    with pytest.raises(UserError, match="expected 'METHOD@LAG:METHOD@LAG'"):
        run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"], pairs=["GRPO"])


def test_regime_section(report):
    out = report[0]
    with open(out / "regime.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    sat = rows["sat-grpo-lag1-s0"]
    # q = 0.1, 0.2: both < -ln(0.8) = 0.2231 (either side, low side); only 0.1 < ln(1.2) = 0.1823
    assert sat["mean sat/q"] == "0.1500" and sat["SAT can act (either side)"] == "1.00"
    assert sat["can act low"] == "1.00" and sat["can act high"] == "0.50"
    assert sat["ln(1+eps_high)"] == "0.1823" and sat["-ln(1-eps_low)"] == "0.2231"
    assert sat["mean sat/gate_rate"] == "0.0750" and sat["mean sat/clipfrac_sat_band"] == "0.0300"
    assert sat["band low"] == "0.0100" and sat["band high"] == "0.0200"
    assert sat["mean ESS"] == "0.700" and sat["min ESS"] == "0.500"
    assert sat["status"] == "FINISHED" and sat["last step"] == "10" and sat["flag"] == ""
    grpo = rows["grpo-lag1-s0"]
    # no SAT metrics: empty; mean d̄π over logged steps (0.5 + 0.01) / 2
    assert grpo["mean sat/q"] == "" and grpo["mean d̄π"] == "0.2550"
    assert len(rows) == 8  # 9 child runs, one earlier attempt (FAILED) dropped
    md = (out / "report.md").read_text()
    assert "1 earlier attempt(s) of a run (same override hash) were left out" in md
    # per-cell summary: SAT-GRPO lag 1 averages what its seeds logged (only seed 0 has SAT metrics)
    assert "| SAT-GRPO | 1 | 3 | 0.1500 | 1.00 | 1.00 | 0.50 | 0.0750 | 0.0300 |" in md


def test_plots_and_parent_artifacts(report, store):
    out = report[0]
    names = (
        "eval.png",
        "eval_ess.png",
        "reward.png",
        "dpi.png",
        "sat_gate_rate.png",
        "sat_band.png",
        "staleness_hist.png",
    )
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "![staleness_hist.png](staleness_hist.png)" in md
    assert "![eval_ess.png](eval_ess.png)" in md
    logged = {a.path for a in store["client"].list_artifacts(store["parent"], "report")}
    assert {"report/report.md", "report/table.csv", "report/pairs.csv", "report/eval.png"} <= logged


def test_seed_band_is_the_t_interval():
    from sat_cli.report.plots import seed_band

    steps, mean, lo, hi = seed_band([{0: 1.0, 5: 2.0}, {0: 3.0, 5: 4.0, 9: 1.0}, {0: 2.0, 5: 3.0}])
    assert steps == [0, 5] and mean == [2.0, 3.0]  # step 9 is not shared
    assert hi[0] - mean[0] == pytest.approx(T2 * 1.0 / math.sqrt(3))
    assert lo[1] == pytest.approx(3.0 - T2 / math.sqrt(3))
    assert seed_band([{3: 7.0}]) == ([3], [7.0], [7.0], [7.0])


def test_histogram_reads_the_last_table(store):
    from sat_cli.report.hist import last_hist

    client = store["client"]
    run = client.search_runs(
        [client.get_experiment_by_name("toy").experiment_id],
        "attributes.run_name = 'grpo-lag1-s0'",
    )[0]
    t = last_hist(client, run.info.run_id)
    assert t["step"] == 10 and t["counts"] == [5, 3, 1] and t["marks"] == {"q": 0.05}


def test_target_by_experiment_name_equals_sweep_id(store, report, tmp_path):
    b = tmp_path / "b"
    run_report("toy", out=str(b), tracking_uri=store["uri"])
    for name in ("table.csv", "pairs.csv", "regime.csv"):
        assert (report[0] / name).read_text() == (b / name).read_text(), name


def test_plain_experiment_methods_derived_in_paper_order(store, tmp_path):
    uri, client = store["uri"], store["client"]
    exp = client.create_experiment("plain", artifact_location=str(tmp_path / "art"))
    base = {"lag": 1, "seed": 0, "correction": "none", "r3": "false"}
    _run(
        client,
        exp,
        "a",
        tags={**base, "algo": "gspo", "clip": "sat", "correction": "tis", "r3": "true"},
        params={"clip.adaptive": "True", "algo.correction": "tis", "algo.num_minibatches": "1"},
        # TIS: the loss ratio is pi/pi_old (d ~ 0); d̄π against mu is the mismatch metric
        metrics={
            EVAL: [(0, 1.0)],
            "staleness/abs_logratio_mean": [(1, 0.0), (2, 0.0)],
            "staleness/mismatch_abs_logratio_mean": [(1, 0.05), (2, 0.07)],
        },
    )
    _run(
        client, exp, "b", tags={**base, "algo": "dppo_tv", "clip": "ppo"}, metrics={EVAL: [(0, 2)]}
    )
    _run(client, exp, "c", tags={**base, "algo": "grpo", "clip": "ppo"}, metrics={EVAL: [(0, 3)]})
    # A-3PO: d̄π is |log pi - log mu| (its ratio's own denominator is pi_prox)
    _run(
        client,
        exp,
        "d",
        tags={**base, "algo": "a3po", "clip": "ppo"},
        metrics={
            EVAL: [(0, 4)],
            "staleness/abs_logratio_mean": [(1, 0.01)],
            "staleness/abs_logratio_mean_mu": [(1, 0.04)],
        },
    )
    run_report("plain", out=str(tmp_path / "r"), tracking_uri=uri)
    table = _csv(tmp_path / "r" / "table.csv")
    rows = list(table)
    assert float(table[("SAT-GSPO w/ TIS w/ R3", "1")]["dpi_last_mean"]) == 0.07
    assert float(table[("A-3PO", "1")]["dpi_last_mean"]) == 0.04
    # paper Table 1 order, the baselines beyond the paper after it, then the rest
    assert rows == [
        ("GRPO", "1"),
        ("DPPO (TV)", "1"),
        ("A-3PO", "1"),
        ("SAT-GSPO w/ TIS w/ R3", "1"),
    ]
    assert not (tmp_path / "r" / "staleness_hist.png").exists()  # no tables logged: no plot
    md = (tmp_path / "r" / "report.md").read_text()
    assert "**SAT inert: recompute denominator, 1 step/batch**: SAT-GSPO w/ TIS w/ R3" in md
    with open(tmp_path / "r" / "regime.csv") as f:
        flags = {r["run"]: r["flag"] for r in csv.DictReader(f)}
    assert flags["a"].startswith("SAT inert") and flags["c"] == ""


def test_derive_method_and_fmt_ci():
    assert derive_method("grpo", "ppo", "none", "false") == "GRPO"
    assert derive_method("gspo", "sat", "tis", "true") == "SAT-GSPO w/ TIS w/ R3"
    assert derive_method("grpo", "sat_anchored", "none", False) == "SAT-GRPO (anchored)"
    assert derive_method("dppo_tv", "ppo", None, None) == "DPPO (TV)"
    assert derive_method("vcpo", "ppo", "none", None) == "VCPO"
    assert fmt_ci([], 2) == "—"
    assert fmt_ci([1.0], 2) == "1.00"
    # [1, 2, 3]: mean 2, s = 1, h = T2 / sqrt(3) = 2.484138
    assert fmt_ci([1.0, 2.0, 3.0], 2) == f"2.00 ± {T2 / math.sqrt(3):.2f}" == "2.00 ± 2.48"


def test_unknown_target_and_missing_store(store, tmp_path):
    with pytest.raises(UserError, match=r"no sweep id or MLflow experiment named 'nope'.*toy"):
        run_report("nope", out=str(tmp_path / "x"), tracking_uri=store["uri"])
    with pytest.raises(UserError, match="no MLflow store"):
        run_report("toy", out=None, tracking_uri=f"sqlite:///{tmp_path / 'absent.db'}")
    assert not (tmp_path / "absent.db").exists()


def test_cli_exit_2_on_unknown_target(store, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "report", "nope", "--tracking-uri", store["uri"]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert "no sweep id or MLflow experiment named 'nope'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("how", ["existing-file", "read-only-folder", "under-a-file", "long-name"])
def test_cli_out_that_cannot_be_written_exits_2(store, tmp_path, fsfault, how):
    """`sat report --out` onto an existing file, a read-only folder, or below a file: exit 2 with
    one line naming the path, before anything is written."""
    if how == "existing-file":
        out, want = tmp_path / "taken", "is a file, not a folder"
        out.write_text("keep me\n")
    elif how == "long-name":
        out, want = tmp_path / ("o" * 300), "has 300 bytes; this file system allows 255"
    elif how == "under-a-file":
        (tmp_path / "f").write_text("keep me\n")
        out, want = tmp_path / "f" / "report", "is a file, not a folder"
    else:
        out = tmp_path / "ro"
        kind = fsfault.read_only_dir(out)
        if kind is None:
            pytest.skip("no read-only folder possible here (root without mount rights)")
        want = "read-only file system" if kind == "tmpfs-ro" else "is not writable"
    r = subprocess.run(
        [sys.executable, "-m", "sat_cli.cli", "report", SWEEP_ID, "--tracking-uri", store["uri"]]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("sat: error:")]
    assert line.startswith("sat: error: --out ") and want in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {
            "existing-file": ["taken"],
            "under-a-file": ["f"],
            "read-only-folder": ["ro"],
            "long-name": [],
        }[how]
    )


def test_row_order_sorts_axis_values_numerically():
    from sat_cli.report.methods import row_order
    from sat_cli.report.tables import RunData

    def rd(row):
        return RunData("id", "n", "FINISHED", 0, row.split(" · ")[0], "1", "0", row=row)

    seen = [
        "B · trainer.lr=0.0007",
        "A · trainer.lr=1e-05",
        "B · trainer.lr=0.0005",
        "A · trainer.lr=0.0001",
    ]
    rows = row_order([rd(r) for r in seen], ["A", "B"])
    assert rows == [
        "A · trainer.lr=1e-05",
        "A · trainer.lr=0.0001",
        "B · trainer.lr=0.0005",
        "B · trainer.lr=0.0007",
    ]
    # methods outside the sweep's list keep their first appearance, grouped
    rows = row_order([rd(r) for r in ["Z · x=2", "Y · x=1", "Z · x=1"]], ["A"])
    assert rows == ["Z · x=1", "Z · x=2", "Y · x=1"]
