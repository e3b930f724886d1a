"""The collapse study's write-up tables, derived from the per-run rows only
(``sat_cli.report.collapse``): the pilot's qualification and selection, the confirmatory
McNemar tests. Rules as fixed in docs/results/collapse_cpu.md before any run."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from sat_cli.errors import UserError
from sat_cli.report.collapse import (
    CAN_ACT_MIN,
    StudyRow,
    mcnemar,
    method_order,
    read_rows,
    rows_csv,
    study_rows,
)

BASE, SAT, CONTROL = "base", "SAT", "control"


def _k(rows: list[StudyRow]) -> str:
    return f"{sum(r.collapsed == 1 for r in rows)}/{len(rows)}"


def _evals(rows: list[StudyRow]) -> str:
    return ", ".join(f"{r.eval_best:.1f}→{r.eval_last:.1f}" for r in rows)


def pilot_rules(lag1: list[StudyRow], lag8: list[StudyRow]) -> tuple[bool, bool, bool]:
    """Rules 1-3 of the design: lag 8 collapses in every run, lag 1 in none, SAT can act on at
    least half of the pre-collapse steps of every lag-8 run."""
    r1 = bool(lag8) and all(r.collapsed == 1 for r in lag8)
    r2 = bool(lag1) and all(r.collapsed == 0 for r in lag1)
    r3 = bool(lag8) and all(r.can_act_frac and float(r.can_act_frac) >= CAN_ACT_MIN for r in lag8)
    return r1, r2, r3


def _next(rules: tuple[bool, bool, bool]) -> str:
    r1, r2, r3 = rules
    if all(rules):
        return "qualifies"
    if r2 and r3 and not r1:
        return "round 2 at 1.5 × lr"
    if r1 and r3 and not r2:
        return "round 2 at 0.75 × lr"
    return "dropped"


def pilot_markdown(rows: list[StudyRow]) -> str:
    head = (
        "| candidate | lag 1 collapsed | lag 8 collapsed | lag 8 time to collapse "
        "| SAT can act, lag 8 (fraction of pre-collapse steps) | eval best→last, lag 1 "
        "| eval best→last, lag 8 | rules 1 / 2 / 3 | outcome |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines, selected, round2 = [head], None, []
    for m in method_order(rows):
        lag1 = [r for r in rows if r.method == m and r.lag == "1"]
        lag8 = [r for r in rows if r.method == m and r.lag == "8"]
        rules = pilot_rules(lag1, lag8)
        outcome = _next(rules)
        if outcome == "qualifies" and selected is None:
            selected = m
        elif outcome.startswith("round 2"):
            round2.append(f"{m} ({outcome[len('round 2 ') :]})")
        t = ", ".join(r.t_collapse or "—" for r in lag8)
        act = ", ".join(r.can_act_frac or "—" for r in lag8)
        yn = " / ".join("yes" if x else "no" for x in rules)
        lines.append(
            f"| {m} | {_k(lag1)} | {_k(lag8)} | {t} | {act} | {_evals(lag1)} | {_evals(lag8)} "
            f"| {yn} | {outcome} |"
        )
    if selected:
        verdict = (
            f"Selected: **{selected}** (the first qualifying candidate in the design's order)."
        )
    elif round2:
        verdict = "No candidate qualifies in this round. Round 2: " + "; ".join(round2) + "."
    else:
        verdict = (
            "No candidate qualifies, and none is eligible for round 2 (each failed rule 3, or "
            "rules 1 and 2 together): **the stop rule fires**."
        )
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def holm(ps: list[float]) -> list[float]:
    """Holm-adjusted p values, in the input order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adj, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return adj


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3g}" if values else "—"


def _arm_line(m: str, arm: list[StudyRow], base: list[StudyRow]) -> str:
    t = [float(r.t_collapse) for r in arm if r.t_collapse]
    last = [r.eval_last for r in arm]
    ess = [float(r.min_ess) for r in arm if r.min_ess]
    mis = [float(r.ledger_mismatch) for r in arm if r.ledger_mismatch]
    sta = [float(r.ledger_staleness) for r in arm if r.ledger_staleness]
    split = f"{statistics.mean(mis):.4f} / {statistics.mean(sta):.4f}" if mis and sta else "—"
    if m == BASE:
        test = "—"
    else:
        n, only_base, only_arm, p = mcnemar(base, arm)
        test = f"{only_base} / {only_arm} (n = {n}), p = {p:.3g}"
    return (
        f"| {m} | {_k(arm)} | {_median(t)} | {statistics.mean(last):.2f} | {_median(ess)} "
        f"| {split} | {test} |"
    )


def confirm_markdown(rows: list[StudyRow]) -> str:
    methods = method_order(rows)
    by = {m: [r for r in rows if r.method == m] for m in methods}
    base = by.get(BASE, [])
    head = (
        "| arm | collapsed | median time to collapse (collapsed runs) | mean final eval "
        "| median min ESS | d̄π split: mismatch / staleness | McNemar vs base: only base / "
        "only arm collapsed |\n|---|---|---|---|---|---|---|"
    )
    lines = [head] + [_arm_line(m, by[m], base) for m in methods]
    out = "\n".join(lines) + "\n"
    if SAT in by and CONTROL in by:
        n, only_sat, only_ctl, p = mcnemar(by[SAT], by[CONTROL])
        out += (
            f"\nSAT vs control (uniform tightening): only SAT collapsed {only_sat}, only control "
            f"{only_ctl} (n = {n}), exact McNemar p = {p:.3g}.\n"
        )
    further = [m for m in methods if m not in (BASE, SAT, CONTROL)]
    if further:
        adj = holm([mcnemar(base, by[m])[3] for m in further])
        out += (
            "\nHolm-adjusted p (vs base): "
            + ", ".join(f"{m} {a:.3g}" for m, a in zip(further, adj, strict=True))
            + ".\n"
        )
    return out


def study_markdown(rows: list[StudyRow]) -> str:
    """Study v5's tables when its runs carry its design tag, pilot 2's when they carry pilot 2's,
    else pilot 1's when the rows span lags 1 and 8, else the confirmatory table."""
    from sat_cli.report.collapse_pilot2 import ROUND1, ROUND2, pilot2_markdown
    from sat_cli.report.lag_study import DESIGN, lag_study_markdown

    if any(r.design == DESIGN for r in rows):
        return lag_study_markdown(rows)
    if any(r.design in (ROUND1, ROUND2) for r in rows):
        return pilot2_markdown(rows)
    lags = {r.lag for r in rows}
    return pilot_markdown(rows) if {"1", "8"} <= lags else confirm_markdown(rows)


def study_from_csv(path: Path) -> str:
    """The collapse study's tables (``sat_cli.report.collapse_md``) from a committed CSV."""
    import csv

    from sat_cli.util.readers import read_text

    text = read_text(path, what=str(path), error=UserError, max_bytes=16 << 20)
    try:
        rows = read_rows(text)
    except (ValueError, KeyError, TypeError, csv.Error) as exc:
        raise UserError(f"{path}: not a collapse-study CSV ({str(exc)[:200]})") from None
    if not rows:
        raise UserError(f"{path}: no runs")
    return study_markdown(rows) + _pilot2_record(rows, path)


def _pilot2_record(rows: list[StudyRow], path: Path) -> str:
    """Pilot 2's corrected record (early crash, lag gap over both rounds) when its curves file
    (``<name>_curves.csv``) lies beside its rows; else nothing."""
    from sat_cli.report.collapse_curves import read_curves
    from sat_cli.report.collapse_pilot2 import ROUND1, ROUND2, record_markdown
    from sat_cli.util.readers import read_text

    curves = path.with_name(f"{path.stem}_curves.csv")
    if not any(r.design in (ROUND1, ROUND2) for r in rows) or not os.path.lexists(curves):
        return ""  # a FIFO, a folder or a dangling link there is refused by read_text
    import csv

    text = read_text(curves, what=str(curves), error=UserError, max_bytes=64 << 20)
    try:
        return "\n" + record_markdown(rows, read_curves(text))
    except (ValueError, KeyError, csv.Error) as exc:
        raise UserError(f"{curves}: not a collapse-curves CSV ({str(exc)[:200]})") from None


def write_study(runs, out_dir: Path) -> None:
    """collapse.csv (one row per run, the sweep's order) and collapse.md (derived from it)."""
    from sat_cli.report.collapse_curves import curves_csv

    text = rows_csv(study_rows(runs))
    (out_dir / "collapse.csv").write_text(text)
    (out_dir / "collapse_curves.csv").write_text(curves_csv(runs))
    md = study_markdown(read_rows(text))  # from the CSV's text, exactly as a reader would
    (out_dir / "collapse.md").write_text(md)
    print("\ncollapse study (collapse.csv, collapse_curves.csv, collapse.md):\n" + md)
