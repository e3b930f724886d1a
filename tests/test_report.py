"""`sat report` on a store of synthetic runs with known metric histories (real MLflow, tmp sqlite).

The runs are created directly with ``MlflowClient`` the way ``sat sweep``/``sat train`` tag them
(``sat.sweep_id``, ``sat.method``, ``lag``, ``seed``, ``sat.override_hash``, a parent run with
``sat.sweep_role=parent``), so every number in the table is known by hand.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402

from sat_cli.errors import UserError  # noqa: E402
from sat_cli.report import derive_method, fmt, run_report  # noqa: E402

SWEEP_ID = "toy-0123456789"
EVAL = "eval/toy/avg_at_4"  # mlflow_key("eval/toy/avg@4")


def _run(client, exp_id, name, *, tags, metrics, params=None, status="FINISHED", tables=None):
    run = client.create_run(exp_id, run_name=name)
    rid = run.info.run_id
    params = {"eval.name": "toy", "eval.n": "4", "algo.eps_high": "0.2", **(params or {})}
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
    """A sweep 'toy' (GRPO, SAT-GRPO × lag 1, 8 × seeds 0, 1) plus noise, in a tmp sqlite store.

    Module-scoped: creating an MLflow sqlite store takes seconds; the tests only read it (and
    write their reports to their own folders).
    """
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
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
    # GRPO lag 1: seed 0 evals 10, 30, 25 -> best 30 (5), last 25; seed 1: 10, 20, 35 -> 35 (10), 35
    _run(
        client,
        exp,
        "grpo-lag1-s0",
        tags=_child("GRPO", 1, 0),
        metrics={
            EVAL: [(0, 10), (5, 30), (10, 25)],
            "staleness/abs_logratio_mean": [(1, 0.5), (10, 0.01)],
            "rollout/reward_mean": [(1, 0.1), (10, 0.3)],
        },
        tables=hist,
    )
    _run(
        client,
        exp,
        "grpo-lag1-s1",
        tags=_child("GRPO", 1, 1),
        metrics={
            EVAL: [(0, 10), (5, 20), (10, 35)],
            "staleness/abs_logratio_mean": [(1, 0.5), (10, 0.03)],
        },
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
    _run(
        client,
        exp,
        "sat-grpo-lag1-s0",
        tags=_child("SAT-GRPO", 1, 0),
        metrics={
            EVAL: [(0, 10), (5, 50), (10, 45)],
            "staleness/abs_logratio_mean": [(10, 0.02)],
            "sat/q": [(1, 0.1), (10, 0.2)],
            "sat/active_frac": [(1, 1.0), (10, 0.5)],
            "sat/gate_rate": [(1, 0.1), (10, 0.05)],
        },
        tables=hist,
    )
    # SAT-GRPO lag 8 seed 1 only (seed 0 missing): a cell with n = 1; lag 1 seed 1 missing too
    _run(
        client,
        exp,
        "sat-grpo-lag8-s1",
        tags=_child("SAT-GRPO", 8, 1),
        metrics={EVAL: [(0, 10), (10, 12)], "staleness/abs_logratio_mean": [(10, 0.3)]},
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


def test_table_cells_and_csv(store, capsys, tmp_path):
    out = tmp_path / "rep"
    run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"])
    md = (out / "report.md").read_text()
    # rows in the sweep's order (SAT-GRPO first), lags 1 then 8, three values per lag
    assert (
        "| method | lag 1 best (step) | lag 1 last | lag 1 d̄π | lag 8 best (step) | lag 8 last "
        "| lag 8 d̄π |" in md
    )
    # SAT-GRPO lag 1: only the FINISHED rerun (best 50 at 5, last 45, d̄π 0.02); lag 8: 12 (10)
    assert "| SAT-GRPO | 50.00 (5) | 45.00 | 0.0200 | 12.00 (10) | 12.00 | 0.3000 |" in md
    # GRPO lag 1: best 30, 35 -> 32.50 ± stdev = sqrt(((30-32.5)^2 + (35-32.5)^2) / 1) = 3.54;
    # last 25, 35 -> 30.00 ± 7.07; d̄π 0.01, 0.03 -> 0.0200 ± 0.0141; steps 5/10 (seed 0/seed 1)
    # lag 8: one seed, best 40 first reached at step 5
    assert (
        "| GRPO | 32.50 ± 3.54 (5/10) | 30.00 ± 7.07 | 0.0200 ± 0.0141 | 40.00 (5) | 40.00 | "
        "0.2500 |" in md
    )
    assert md.index("| SAT-GRPO |") < md.index("| GRPO |")
    assert "eval/toy/avg@4" in md and "99.00" not in md  # the FAILED attempt (99) is left out
    printed = capsys.readouterr().out
    assert "| GRPO | 32.50 ± 3.54 (5/10)" in printed

    rows = _csv(out / "table.csv")
    assert set(rows) == {("SAT-GRPO", "1"), ("SAT-GRPO", "8"), ("GRPO", "1"), ("GRPO", "8")}
    g1 = rows[("GRPO", "1")]
    assert g1["n_seeds"] == "2" and g1["best_steps"] == "5/10"
    assert float(g1["best_mean"]) == 32.5
    assert float(g1["best_std"]) == pytest.approx(math.sqrt(12.5), abs=1e-9)
    assert (float(g1["best_min"]), float(g1["best_max"])) == (30.0, 35.0)
    assert float(g1["last_mean"]) == 30.0
    assert float(g1["last_std"]) == pytest.approx(math.sqrt(50.0), abs=1e-9)
    assert float(g1["dpi_last_mean"]) == pytest.approx(0.02, abs=1e-12)
    assert g1["runs"] == "grpo-lag1-s0;grpo-lag1-s1" and g1["eval_key"] == "eval/toy/avg@4"
    s8 = rows[("SAT-GRPO", "8")]
    assert s8["n_seeds"] == "1" and s8["best_std"] == "" and float(s8["best_mean"]) == 12.0


def test_regime_section(store, tmp_path):
    out = tmp_path / "rep"
    run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"])
    with open(out / "regime.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    sat = rows["sat-grpo-lag1-s0"]
    # mean q = (0.1 + 0.2) / 2; active_frac is the last value (a running fraction); gate mean 0.075
    assert sat["mean sat/q"] == "0.1500" and sat["sat/active_frac"] == "0.50"
    assert sat["mean sat/gate_rate"] == "0.0750" and sat["ln(1+eps_high)"] == "0.1823"
    assert sat["status"] == "FINISHED" and sat["last step"] == "10"
    grpo = rows["grpo-lag1-s0"]
    # no SAT metrics: empty; mean d̄π over logged steps (0.5 + 0.01) / 2
    assert grpo["mean sat/q"] == "" and grpo["mean d̄π"] == "0.2550"
    assert len(rows) == 5  # 6 child runs, one earlier attempt (FAILED) dropped
    md = (out / "report.md").read_text()
    assert "1 earlier attempt(s) of a run (same override hash) were left out" in md


def test_plots_and_parent_artifacts(store, tmp_path):
    out = tmp_path / "rep"
    run_report(SWEEP_ID, out=str(out), tracking_uri=store["uri"])
    for name in ("eval.png", "reward.png", "dpi.png", "sat_gate_rate.png", "staleness_hist.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "![staleness_hist.png](staleness_hist.png)" in md
    logged = {a.path for a in store["client"].list_artifacts(store["parent"], "report")}
    assert {"report/report.md", "report/table.csv", "report/eval.png"} <= logged


def test_histogram_reads_the_last_table(store):
    from sat_cli.report import _last_hist

    client = store["client"]
    run = client.search_runs(
        [client.get_experiment_by_name("toy").experiment_id],
        "attributes.run_name = 'grpo-lag1-s0'",
    )[0]
    t = _last_hist(client, run.info.run_id)
    assert t["step"] == 10 and t["counts"] == [5, 3, 1] and t["marks"] == {"q": 0.05}


def test_target_by_experiment_name_equals_sweep_id(store, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_report(SWEEP_ID, out=str(a), tracking_uri=store["uri"])
    run_report("toy", out=str(b), tracking_uri=store["uri"])
    assert (a / "table.csv").read_text() == (b / "table.csv").read_text()


def test_plain_experiment_methods_derived_in_paper_order(store, tmp_path):
    uri, client = store["uri"], store["client"]
    exp = client.create_experiment("plain", artifact_location=str(tmp_path / "art"))
    base = {"lag": 1, "seed": 0, "correction": "none", "r3": "false"}
    _run(
        client,
        exp,
        "a",
        tags={**base, "algo": "gspo", "clip": "sat", "correction": "tis", "r3": "true"},
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
    run_report("plain", out=str(tmp_path / "r"), tracking_uri=uri)
    table = _csv(tmp_path / "r" / "table.csv")
    rows = list(table)
    assert float(table[("SAT-GSPO w/ TIS w/ R3", "1")]["dpi_last_mean"]) == 0.07
    # paper Table 1 order: GRPO, ..., DPPO (TV), ..., SAT-GSPO w/ TIS w/ R3 (not in the paper: last)
    assert rows == [("GRPO", "1"), ("DPPO (TV)", "1"), ("SAT-GSPO w/ TIS w/ R3", "1")]
    assert not (tmp_path / "r" / "staleness_hist.png").exists()  # no tables logged: no plot


def test_derive_method_and_fmt():
    assert derive_method("grpo", "ppo", "none", "false") == "GRPO"
    assert derive_method("gspo", "sat", "tis", "true") == "SAT-GSPO w/ TIS w/ R3"
    assert derive_method("grpo", "sat_anchored", "none", False) == "SAT-GRPO (anchored)"
    assert derive_method("dppo_tv", "ppo", None, None) == "DPPO (TV)"
    assert fmt([], 2) == "—"
    assert fmt([1.0], 2) == "1.00"
    assert fmt([1.0, 3.0], 2) == "2.00 ± 1.41"  # sample std: sqrt(((1-2)^2 + (3-2)^2) / 1)


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
