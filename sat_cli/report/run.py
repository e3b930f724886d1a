"""`sat report`: the paper-style table, seed statistics, paired comparisons and plots of a sweep.

``run_report(target)`` reads the MLflow store with ``MlflowClient`` (default
``sqlite:///runs/mlflow.db``) and finds the runs of ``target``, tried in this order:

1. a sweep id (the tag ``sat.sweep_id`` that ``sat sweep`` puts on its parent and child runs);
2. an MLflow experiment name: a sweep's name is its experiment; when the experiment holds
   several sweeps the latest parent run's sweep id is reported (a note names the others); an
   experiment of plain ``sat train`` runs is reported as is.

A run repeated under one override hash (a failed attempt, then a rerun) counts once: the
FINISHED one, else the latest. Runs are grouped by **method** (tag ``sat.method``, else derived
from the tags/params algo, clip, correction, r3: e.g. ``SAT-GSPO w/ TIS w/ R3``) and **lag**
(tag ``lag``); other axes of a sweep (e.g. ``trainer.lr``) and a model, task or evaluation
that differs between the runs (``cells``: never pooled) become part of the row label. Rows
follow the sweep's method order (the parent's tag ``sat.sweep_methods``), else the paper's
Table 1 order followed by the baselines beyond it, then first appearance; columns are the lags
in increasing order.

Modules: ``select`` (which runs), ``tables`` (per-run endpoints and cells over seeds: ``mean ±
95 % t-interval`` with n, collapse counts), ``pairs`` (paired differences), ``stats``
(t-intervals, paired t and Wilcoxon tests), ``regime`` (the regime section and the markdown),
``plots`` (the figures); this module loads the runs from MLflow and writes the files. Pairs: every
``SAT-X`` row against ``X`` at the same lag, every row's higher lags against its lowest, and
any ``--pair "A@LAG:B@LAG"`` (A minus B, for each value of the other axes).

The *regime* section lists per run, and per cell, the mean ``sat/q``, the fraction of steps on
which SAT can change a gradient at all (``q < max(ln(1+eps_high), -ln(1-eps_low))``, computed
from the logged ``q`` of every step; per side too, ALGORITHMS.md §4), the mean gate rate, the
mean ``sat/clipfrac_sat_band`` (the fraction of tokens whose gradient SAT actually removed,
per side when logged), PPO's clip fraction and the ESS (mean and minimum). Runs of SAT with a
recompute denominator at one optimizer step per batch (SAT inert: ``d == 0``) are flagged.

Outputs under ``--out`` (default ``runs/reports/<target>/``): ``report.md``, ``table.csv``
(every endpoint: mean, std, CI half-width per cell), ``pairs.csv``, ``regime.csv``, with
multi-turn runs ``turns.csv`` (``sat_cli.report.turns``: staleness per turn) and PNG plots
(``sat_cli.report.plots``): ``eval.png``, ``eval_ess.png`` (eval above the ESS), ``reward.png``,
``dpi.png``, ``sat_gate_rate.png``, ``sat_band.png`` (mean over seeds, shaded 95 % t-band; one
panel per lag) and ``staleness_hist.png`` (the ``|d|`` histogram of each row × lag at its last
logged step, from the tracker's JSON tables of the first seed). With a parent sweep run, the
folder is also logged as its artifacts under ``report/``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sat_cli import metric_names as M
from sat_cli.errors import UserError
from sat_cli.report import collapse_md
from sat_cli.report.cells import check_cells
from sat_cli.report.collapse import LEDGER_KEYS
from sat_cli.report.hist import HIST_DIR, download_json, hist_tables, last_hist  # noqa: F401
from sat_cli.report.methods import derive_method, row_order
from sat_cli.report.pairs import auto_pairs, pair_rows, pairs_csv, requested_pairs
from sat_cli.report.regime import regime_csv, regime_rows, render_markdown
from sat_cli.report.select import Selection, dedupe, select_runs  # noqa: F401
from sat_cli.report.tables import (
    BAND_KEYS,
    CLIP_KEYS,
    DPI_KEY,
    DPI_MU_KEY,
    ENDPOINTS,
    ESS_KEY,
    GATE_KEY,
    MISMATCH_KEY,
    Q_KEY,
    REWARD_KEY,
    RunData,
    Settings,
    build_table,
    display_key,
    table_csv,
)

DEFAULT_URI = "sqlite:///runs/mlflow.db"
# read for the collapse study (sat_cli.report.collapse): q without SAT, the ledger's split
STUDY_KEYS = (M.SAT_Q_SHADOW, *LEDGER_KEYS)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        prev = by_step.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def _eval_key(run, prefix: str = M.EVAL) -> str | None:
    from sat_cli.tracking import mlflow_key

    p = run.data.params
    n = p.get("eval.final_n") if prefix == M.FINAL else p.get("eval.n")
    if p.get("eval.name") and n not in (None, "None"):
        key = mlflow_key(M.avg_key(p["eval.name"], n, final=prefix == M.FINAL))
        if key in run.data.metrics:
            return key
    keys = sorted(k for k in run.data.metrics if re.fullmatch(rf"{prefix}/.+/avg_at_\d+", k))
    return keys[0] if keys else None


def _float(params: dict, key: str, default: float) -> float:
    try:
        return float(params.get(key, default))
    except (TypeError, ValueError):
        return default


def _inert_recompute(tags: dict, params: dict) -> bool:
    """SAT with a recompute denominator at one optimizer step per batch (tag, else params)."""
    if "sat.inert_recompute" in tags:
        return tags["sat.inert_recompute"].lower() == "true"
    if params.get("clip.adaptive", "False").lower() != "true":
        return False
    if params.get("algo.num_minibatches", "1") != "1":
        return False
    return (
        params.get("algo.correction", "none") != "none"
        or params.get("algo.ratio_denominator") == "recompute"
        or params.get("algo.name") in ("decoupled_ppo", "m2po")
    )


def load_run(client, run, sweep_records: dict[str, dict] | None, axes: list[str]) -> RunData:
    tags, params = run.data.tags, run.data.params
    method = tags.get("sat.method") or derive_method(
        tags.get("algo", params.get("algo.name")),
        tags.get("clip", params.get("clip.name")),
        tags.get("correction", params.get("algo.correction")),
        tags.get("r3", params.get("r3")),
    )
    lag = tags.get("lag", params.get("lag.n", "?"))
    seed = tags.get("seed", params.get("seed", "?"))
    rec = (sweep_records or {}).get(tags.get("sat.override_hash", ""))
    extra = []
    for ax in axes:
        if ax == "lag":
            continue
        if rec is not None and ax in rec.get("axes", {}):
            val = rec["axes"][ax]
        else:
            val = params.get(ax, params.get(f"{ax}.name", "?"))
        extra.append(f"{ax}={val}")
    data = RunData(
        run_id=run.info.run_id,
        name=run.info.run_name or run.data.tags.get("mlflow.runName", run.info.run_id),
        status=run.info.status,
        start_time=run.info.start_time or 0,
        method=method,
        lag=str(lag),
        seed=str(seed),
        row=" · ".join([method, *extra]),
        eval_key=_eval_key(run),
        final_key=_eval_key(run, "final"),
        eps_low=_float(params, "algo.eps_low", 0.2),
        eps_high=_float(params, "algo.eps_high", 0.2),
        inert_recompute=_inert_recompute(tags, params),
        commit=tags.get("git_commit", ""),
        tags=dict(tags),
    )
    keys = (data.eval_key, data.final_key, REWARD_KEY, GATE_KEY, Q_KEY, ESS_KEY, *STUDY_KEYS)
    for key in (*keys, *BAND_KEYS, *CLIP_KEYS):
        if key and key in run.data.metrics:
            data.series[key] = _history(client, run.info.run_id, key)
    # d̄π against mu: the recompute pass's |log pi_old - log mu|, else |log pi - log mu|
    for key in (MISMATCH_KEY, DPI_MU_KEY, DPI_KEY):
        if key in run.data.metrics:
            data.series[DPI_KEY] = _history(client, run.info.run_id, key)
            data.dpi_key = key
            break
    return data


def _sweep_records(client, parent) -> dict[str, dict]:
    if parent is None:
        return {}
    from mlflow.exceptions import MlflowException

    try:
        rows = download_json(client, parent.info.run_id, M.ARTIFACT_SWEEP_RUNS)
    except (MlflowException, OSError, ValueError):  # absent or unreadable: fall back to params
        return {}
    return {r["override_hash"]: r for r in rows if isinstance(r, dict) and "override_hash" in r}


# ----------------------------------------------------------------------------- main


def _check_store(uri: str) -> None:
    from sat_cli.tracking import sqlite_db_path

    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise UserError(
            f"no MLflow store at {db} (tracking URI {uri}); run `sat sweep`/`sat train` first "
            "or pass --tracking-uri"
        )


def build_report(client, target: str, pairs: list[str] | None = None) -> dict[str, Any]:
    """Collect the report's pieces (no files written): selection, runs, cells, pairs."""
    sel = select_runs(client, target)
    children = dedupe(sel.runs)
    if not children:
        raise UserError(f"{target!r}: found no training runs to report")
    methods = axes = None
    if sel.parent is not None:
        tags = sel.parent.data.tags
        methods = json.loads(tags.get("sat.sweep_methods", "null"))
        axes = json.loads(tags.get("sat.sweep_axes", "null"))
    records = _sweep_records(client, sel.parent)
    runs = [load_run(client, r, records, list(axes or [])) for r in children]
    sel.notes += check_cells(runs, [r.data.params for r in children])  # model, task, evaluation
    rows = row_order(runs, methods)
    lags, cells = build_table(runs, rows)
    from sat_cli.tracking.environment import compare_environments

    envs = [(r.info.run_name or r.info.run_id, {**r.data.params, **r.data.tags}) for r in children]
    sel.notes += compare_environments(envs)  # different machines or numeric settings: say so
    dropped = len(sel.runs) - len(children)
    if dropped:
        sel.notes.append(
            f"{dropped} earlier attempt(s) of a run (same override hash) were left out; "
            "the FINISHED (else latest) attempt is reported."
        )
    try:
        specs = auto_pairs(rows, lags, cells) + requested_pairs(pairs or [], rows, cells)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return {
        "selection": sel,
        "runs": runs,
        "rows": rows,
        "lags": lags,
        "cells": cells,
        "pairs": specs,
    }


def run_report(
    target: str,
    *,
    out: str | None,
    tracking_uri: str | None,
    pairs: list[str] | None = None,
    last_k: int = 3,
    epoch_steps: int = 16,
    collapse_below: float | None = None,
    collapse: bool = False,
) -> None:
    """`sat report`: print the tables, write report.md / table.csv / pairs.csv / regime.csv /
    PNGs; with ``collapse`` also the collapse study's collapse.csv and collapse.md. A target
    that is a ``.csv`` file written that way prints the study's tables derived from it alone."""
    if target.endswith(".csv"):
        print(collapse_md.study_from_csv(Path(target)), end="")
        return

    if last_k < 1 or epoch_steps < 1:
        raise UserError("--last-k and --epoch-steps must be >= 1")
    st = Settings(last_k=last_k, epoch_steps=epoch_steps, collapse_below=collapse_below)
    from sat_cli.errors import os_error
    from sat_cli.util.fsio import check_output_dir

    out_dir = (
        Path(out) if out else Path("runs") / "reports" / re.sub(r"[^A-Za-z0-9_.\-]+", "_", target)
    )
    check_output_dir(out_dir, "--out")  # a file, a read-only or too long path: exit 2 up front
    uri = tracking_uri or DEFAULT_URI
    _check_store(uri)
    from mlflow import MlflowClient  # after the checks: refusing costs no mlflow import (2 s)

    client = MlflowClient(tracking_uri=uri)
    rep = build_report(client, target, pairs)
    try:
        _write_report(client, rep, uri, out_dir, st)
        if collapse:
            collapse_md.write_study(rep["runs"], out_dir)
    except OSError as exc:
        raise os_error(exc, f"cannot write the report to {out_dir}") from None


def _write_report(client, rep: dict, uri: str, out_dir: Path, st: Settings) -> None:
    from sat_cli.report import plots as P

    out_dir.mkdir(parents=True, exist_ok=True)
    runs, rows, lags, cells = rep["runs"], rep["rows"], rep["lags"], rep["cells"]

    plots = []
    eval_title = next((display_key(r.eval_key) for r in runs if r.eval_key), "eval avg@k")
    series = [
        ("eval.png", lambda r: r.eval_key or "", eval_title),
        ("reward.png", lambda r: REWARD_KEY, M.REWARD_MEAN),
        ("dpi.png", lambda r: DPI_KEY, "d̄π (mean |log π − log μ|)"),
        ("sat_gate_rate.png", lambda r: GATE_KEY, M.SAT_GATE_RATE),
        ("sat_band.png", lambda r: BAND_KEYS[0], M.SAT_BAND),
    ]
    for name, key_of, title in series:
        if P.series_plot(out_dir / name, runs, rows, lags, key_of, title):
            plots.append(name)
    if P.eval_ess_plot(out_dir / "eval_ess.png", runs, rows, lags, eval_title, ESS_KEY):
        plots.insert(1, "eval_ess.png")
    tables = hist_tables(client, runs, rows, lags)
    if P.hist_grid_plot(out_dir / "staleness_hist.png", tables, rows, lags):
        plots.append("staleness_hist.png")

    md = render_markdown(rep, uri, plots, st)
    from sat_cli.report.replays import replay_csv, replay_markdown, replay_rows

    replays = replay_rows(client, runs)  # `sat replay` runs next to their recorded runs
    if replays:
        md = md.rstrip("\n") + "\n\n" + replay_markdown(replays)
        (out_dir / "replays.csv").write_text(replay_csv(replays))
    from sat_cli.report.turns import turn_csv, turn_markdown, turn_rows

    turns = turn_rows(client, runs)  # multi-turn runs: staleness per turn
    if turns:
        md = md.rstrip("\n") + "\n\n" + turn_markdown(turns)
        (out_dir / "turns.csv").write_text(turn_csv(turns))
    (out_dir / "report.md").write_text(md)
    (out_dir / "table.csv").write_text(table_csv(rows, lags, cells, st))
    names = [k for k in ENDPOINTS if any(c.by_seed(k, st) for c in cells.values())]
    (out_dir / "pairs.csv").write_text(pairs_csv(pair_rows(rep["pairs"], cells, st, names)))
    (out_dir / "regime.csv").write_text(regime_csv(regime_rows(runs, rows)))
    print(md.split("## Plots")[0].split("Per run:")[0].rstrip())
    if replays:
        print("\n" + replay_markdown(replays).rstrip())
    if turns:
        print("\n" + turn_markdown(turns).rstrip())
    print(
        f"\nwritten: {out_dir}/ (report.md, table.csv, pairs.csv, regime.csv, {len(plots)} plots)"
    )
    sel = rep["selection"]
    if sel.parent is not None:
        client.log_artifacts(sel.parent.info.run_id, str(out_dir), "report")
        print(f"logged as artifacts report/ of the parent run {sel.parent.info.run_id}")
