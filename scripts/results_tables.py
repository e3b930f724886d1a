"""Regenerate the summary tables of docs/results/*.md from the reports' CSV files.

    python scripts/results_tables.py           # rewrite the generated blocks in place
    python scripts/results_tables.py --check   # exit 1 if a file differs (tests run this)

Every table in docs/results/README.md and docs/results/sat_power_cpu.md that quotes numbers
sits between
``<!-- generated: NAME -->`` and ``<!-- /generated -->``; this script recomputes each block from
``docs/results/<report>/{table,regime,pairs}.csv`` (written by `sat report`), so the prose around
them can be re-read against numbers that cannot drift from the reports. Block names and what
they show: see ``BLOCKS`` below. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
README = RESULTS / "README.md"
DOCS = (README, RESULTS / "sat_power_cpu.md")  # the files whose generated blocks are kept
DASH = "—"


def _rows(report: str, name: str) -> list[dict[str, str]]:
    with open(RESULTS / report / name, newline="") as f:
        return list(csv.DictReader(f))


def _f(x: str | None) -> float | None:
    return None if x in (None, "") else float(x)


def _cell(mean, half, nd: int) -> str:
    if mean is None:
        return DASH
    return f"{mean:.{nd}f}" if half is None else f"{mean:.{nd}f} ± {half:.{nd}f}"


def _table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


# ----------------------------------------------------------------------------- blocks


def regime_map() -> str:
    """regime_map_cpu (one seed per cell, the report format of before issue 18): per lr, GRPO's
    d̄π (mean over the run / at the last step), its best score, SAT-GRPO's mean q and the
    logged one-sided ``sat/active_frac`` (fraction of steps with q < ln 1.2)."""
    table = {(r["row"], r["lag"]): r for r in _rows("regime_map_cpu", "table.csv")}
    regime = {(r["method"], r["lag"]): r for r in _rows("regime_map_cpu", "regime.csv")}
    lrs = sorted({r.split("=")[1] for r, _ in table}, key=float)
    lines = []
    for lr in lrs:
        g, s = f"GRPO · trainer.lr={lr}", f"SAT-GRPO · trainer.lr={lr}"
        line = [lr]
        for lag in ("1", "8"):
            line.append(
                f"{float(regime[(g, lag)]['mean d̄π']):.4f} / {float(table[(g, lag)]['dpi_last_mean']):.4f}"
            )
        line.append(" / ".join(f"{float(table[(g, lag)]['best_mean']):.1f}" for lag in ("1", "8")))
        line.append(" / ".join(f"{float(table[(g, lag)]['last_mean']):.1f}" for lag in ("1", "8")))
        line.append(" / ".join(regime[(s, lag)]["mean sat/q"] for lag in ("1", "8")))
        line.append(" / ".join(regime[(s, lag)]["sat/active_frac"] for lag in ("1", "8")))
        lines.append(line)
    head = [
        "lr",
        "GRPO d̄π lag 1 (mean / last step)",
        "GRPO d̄π lag 8 (mean / last step)",
        "GRPO best lag 1 / 8",
        "GRPO last lag 1 / 8",
        "SAT-GRPO mean q lag 1 / 8",
        "SAT-GRPO logged active_frac lag 1 / 8 (one-sided)",
    ]
    return _table(head, lines)


def _grid_lines(report: str, nd_dpi: int = 4) -> tuple[list[str], list[list[str]]]:
    rows = _rows(report, "table.csv")
    lags = sorted({r["lag"] for r in rows}, key=float)
    by = {(r["row"], r["lag"]): r for r in rows}
    order = list(dict.fromkeys(r["row"] for r in rows))
    head = ["method"]
    for lag in lags:
        head += [
            f"lag {lag} best",
            f"lag {lag} last",
            f"lag {lag} mean last 3",
            f"lag {lag} d̄π (last 16 steps)",
        ]
    lines = []
    for row in order:
        line = [row]
        for lag in lags:
            r = by.get((row, lag))
            if r is None:
                line += [DASH] * 4
                continue
            line += [
                _cell(_f(r["best_mean"]), _f(r["best_ci95"]), 1),
                _cell(_f(r["last_mean"]), _f(r["last_ci95"]), 1),
                _cell(_f(r["lastk_mean"]), _f(r["lastk_ci95"]), 1),
                _cell(_f(r["dpi_epoch_mean"]), _f(r["dpi_epoch_ci95"]), nd_dpi),
            ]
        lines.append(line)
    n = sorted({r["n_seeds"] for r in rows})
    return head, lines + ([] if len(n) == 1 else [[f"(n per cell: {', '.join(n)})"]])


def table1() -> str:
    """paper_table1_cpu: per method and lag best / last / mean of the last 3 evals / d̄π over
    the last 16 steps, as mean ± half-width of the 95 % t-interval over the 2 seeds."""
    head, lines = _grid_lines("paper_table1_cpu")
    return _table(head, lines)


def table1_regime() -> str:
    """paper_table1_cpu, SAT rows: per cell mean q, fraction of steps SAT can act (two-sided,
    and per side), mean gate rate and SAT band (tokens whose gradient SAT removed), mean ESS."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in _rows("paper_table1_cpu", "regime.csv"):
        if r["mean sat/q"]:
            cells.setdefault((r["method"], r["lag"]), []).append(r)
    cols = [
        ("mean sat/q", 3),
        ("SAT can act (either side)", 2),
        ("can act low", 2),
        ("can act high", 2),
        ("mean sat/gate_rate", 3),
        ("mean sat/clipfrac_sat_band", 4),
        ("mean ESS", 3),
    ]
    lines = []
    for (method, lag), rs in cells.items():
        line = [method, lag]
        for c, nd in cols:
            vals = [float(r[c]) for r in rs if r[c]]
            line.append(f"{sum(vals) / len(vals):.{nd}f}" if vals else DASH)
        lines.append(line)
    head = [
        "method",
        "lag",
        "mean q",
        "SAT can act",
        "low side",
        "high side",
        "gate rate",
        "SAT band",
        "ESS mean",
    ]
    return _table(head, lines)


def _sat_base(method: str) -> str:
    return re.sub(r" \(anchored[^)]*\)", "", method[4:])


def _run_key(r: dict[str, str]) -> tuple[str, ...]:
    """A run's numbers in regime.csv (every column but its name and row): two runs with equal
    keys are copies of one run (e.g. anchored SAT at lag 1, where q never reaches a threshold
    and the anchored interval is SAT's)."""
    return tuple(v for k, v in r.items() if k not in ("run", "method"))


def dpi_pairs() -> str:
    """paper_table1_cpu: every SAT row against its base row, same seed and lag: mean d̄π over
    the run (regime.csv), and the relative change. The count in the summary is over distinct
    pairs: a pair whose SAT run is a copy of another SAT run against the same base run (same
    numbers in every regime.csv column) repeats that pair and is counted once."""
    regime = _rows("paper_table1_cpu", "regime.csv")
    by = {(r["method"], r["lag"], r["seed"]): float(r["mean d̄π"]) for r in regime}
    keys = {(r["method"], r["lag"], r["seed"]): _run_key(r) for r in regime}
    lines, changes, seen, repeats = [], [], {}, 0
    for (method, lag, seed), dpi in sorted(by.items()):
        if not method.startswith("SAT-"):
            continue
        base_row = _sat_base(method)
        base = by.get((base_row, lag, seed))
        if base is None:
            continue
        rel = (dpi - base) / base
        pair = (keys[(method, lag, seed)], keys[(base_row, lag, seed)])
        if pair in seen:
            repeats += 1
            counted = f"no: repeats the {seen[pair][0]} pair"
        else:
            seen[pair] = (method, dpi < base)
            changes.append(rel)
            counted = "yes"
        lines.append(
            [
                method,
                base_row,
                lag,
                seed,
                f"{dpi:.4f}",
                f"{base:.4f}",
                f"{100 * rel:+.0f} %",
                counted,
            ]
        )
    head = ["SAT row", "base row", "lag", "seed", "SAT d̄π", "base d̄π", "change", "counted"]
    lower, total = sum(low for _, low in seen.values()), len(seen)
    lo = min(c for c in changes if c < 0) if lower else math.nan
    hi = max(c for c in changes if c < 0) if lower else math.nan
    summary = (
        f"SAT lowers the run-mean d̄π in **{lower} of {total}** distinct paired comparisons "
        f"(by {100 * -hi:.0f}–{100 * -lo:.0f} % where it lowers it). The table has "
        f"{len(lines)} rows: {repeats} of them repeat a pair already counted (a SAT run identical "
        "in every regime.csv column to another SAT row's run of the same lag and seed, against "
        "the same base run; last column). Nor are the distinct pairs independent: a base run can "
        "serve two SAT rows (plain and anchored)."
    )
    return summary + "\n\n" + _table(head, lines)


def _by_seed(report: str, method: str, lag: str, col: str) -> dict[str, float]:
    """Per-seed values of a regime.csv column for one row × lag."""
    out = {}
    for r in _rows(report, "regime.csv"):
        if r["method"] == method and r["lag"] == lag and r[col] != "":
            out[r["seed"]] = float(r[col])
    return out


def lr_check() -> str:
    """The short check that chose the powered test's second lr (two rounds, two seeds): per lr,
    GRPO's mean of the last 3 evals at lag 1 and lag 8 and their difference, SAT-GRPO's mean q
    per seed at lag 8, and whether the rule (difference <= -3 points, q < 0.18 in both seeds)
    holds."""
    lines = []
    for rnd in ("round1", "round2"):
        report = f"sat_power_lr_check_cpu/{rnd}"
        table = {(r["row"], r["lag"]): r for r in _rows(report, "table.csv")}
        lrs = sorted({row.split("=")[1] for row, _ in table}, key=float)
        for lr in lrs:
            l1 = float(table[(f"GRPO (lag 1) · trainer.lr={lr}", "1")]["lastk_mean"])
            l8 = float(table[(f"GRPO · trainer.lr={lr}", "8")]["lastk_mean"])
            qs = _by_seed(report, f"SAT-GRPO · trainer.lr={lr}", "8", "mean sat/q")
            act = _by_seed(report, f"SAT-GRPO · trainer.lr={lr}", "8", "SAT can act (either side)")
            hurt, low_q = l8 - l1 <= -3, all(q < 0.18 for q in qs.values())
            lines.append(
                [
                    rnd.replace("round", "round "),
                    lr,
                    f"{l1:.2f}",
                    f"{l8:.2f}",
                    f"{l8 - l1:+.2f}",
                    " / ".join(f"{qs[k]:.3f}" for k in sorted(qs)),
                    " / ".join(f"{act[k]:.2f}" for k in sorted(act)),
                    "yes" if hurt else "no",
                    "yes" if low_q else "no",
                ]
            )
    head = [
        "round",
        "lr",
        "GRPO lag 1 mean last 3",
        "GRPO lag 8 mean last 3",
        "lag 8 − lag 1",
        "SAT-GRPO mean q (seed 0 / 1)",
        "SAT can act, fraction of steps (seed 0 / 1)",
        "lag hurts ≥ 3",
        "q < 0.18",
    ]
    return _table(head, lines)


POWER = "sat_power_cpu"
LRS = ("0.0003", "0.0006")
PRIMARY_LR = "0.0006"


def _power_pair(kind: str, a: str, lag_a: str, b: str, endpoint: str) -> dict[str, str] | None:
    for r in _rows(POWER, "pairs.csv"):
        if (r["kind"], r["a"], r["lag_a"], r["b"], r["endpoint"]) == (kind, a, lag_a, b, endpoint):
            return r
    return None


def _diff(r: dict[str, str] | None, nd: int = 2) -> list[str]:
    if r is None:
        return [DASH] * 5
    lo, hi = _f(r["ci95_lo"]), _f(r["ci95_hi"])
    ci = DASH if lo is None else f"[{lo:+.{nd}f}, {hi:+.{nd}f}]"
    p_t, p_w = _f(r["p_t"]), _f(r["p_wilcoxon"])
    return [
        r["n"],
        f"{float(r['mean_diff']):+.{nd}f} {ci}",
        DASH if p_t is None else f"{p_t:.3g}",
        DASH if p_w is None else f"{p_w:.3g}",
        f"{r['a_greater']}/{r['b_greater']}",
    ]


def power_pairs() -> str:
    """The powered test: SAT-GRPO − GRPO at lag 8 and GRPO lag 8 − GRPO lag 1, per lr, paired
    by seed, on the final evaluation (primary), the mean of the last 3 evals, the best eval and
    the run-mean d̄π."""
    lines = []
    for lr in LRS:
        g8, s8, g1 = (f"{m} · trainer.lr={lr}" for m in ("GRPO", "SAT-GRPO", "GRPO (lag 1)"))
        for ep, title, nd in (
            ("final", "final eval (2,048 samples)", 2),
            ("lastk", "mean of last 3 evals", 2),
            ("best", "best eval", 2),
            ("dpi_run", "d̄π run mean", 4),
        ):
            lines.append(
                [
                    lr,
                    "SAT-GRPO − GRPO, lag 8",
                    title,
                    *_diff(_power_pair("SAT vs base", s8, "8", g8, ep), nd),
                ]
            )
        for ep, title, nd in (
            ("final", "final eval (2,048 samples)", 2),
            ("dpi_run", "d̄π run mean", 4),
        ):
            lines.append(
                [
                    lr,
                    "GRPO lag 8 − GRPO lag 1",
                    title,
                    *_diff(_power_pair("requested", g8, "8", g1, ep), nd),
                ]
            )
    head = [
        "lr",
        "comparison (a − b)",
        "endpoint",
        "n",
        "mean diff [95 % CI]",
        "paired t p",
        "Wilcoxon p",
        "seeds a > b / a < b",
    ]
    return _table(head, lines)


def power_cells() -> str:
    """The powered test per arm: mean ± 95 % t-interval over the 10 seeds."""
    table = {(r["row"], r["lag"]): r for r in _rows(POWER, "table.csv")}
    lines = []
    for lr in LRS:
        for m, lag in (("GRPO (lag 1)", "1"), ("GRPO", "8"), ("SAT-GRPO", "8")):
            r = table.get((f"{m} · trainer.lr={lr}", lag))
            if r is None:
                continue
            lines.append(
                [
                    lr,
                    m,
                    lag,
                    r["n_seeds"],
                    _cell(_f(r["final_mean"]), _f(r["final_ci95"]), 2),
                    _cell(_f(r["lastk_mean"]), _f(r["lastk_ci95"]), 2),
                    _cell(_f(r["best_mean"]), _f(r["best_ci95"]), 2),
                    _cell(_f(r["dpi_run_mean"]), _f(r["dpi_run_ci95"]), 4),
                    _cell(_f(r["ess_mean"]), _f(r["ess_ci95"]), 3),
                    f"{r['collapsed']}/{r['collapse_n']}",
                ]
            )
    head = [
        "lr",
        "arm",
        "lag",
        "n",
        "final eval",
        "mean last 3 evals",
        "best eval",
        "d̄π run mean",
        "ESS mean",
        "collapsed",
    ]
    return _table(head, lines)


def power_checks() -> str:
    """Manipulation checks of the SAT-GRPO lag-8 runs: per lr the range over seeds of the mean
    q, of the fraction of steps where SAT can act (two-sided), and of the SAT band."""
    lines = []
    for lr in LRS:
        m = f"SAT-GRPO · trainer.lr={lr}"
        cols = (
            "mean sat/q",
            "SAT can act (either side)",
            "mean sat/clipfrac_sat_band",
            "mean sat/gate_rate",
        )
        vals = {c: list(_by_seed(POWER, m, "8", c).values()) for c in cols}
        if not vals[cols[0]]:
            continue
        line = [lr, str(len(vals[cols[0]]))]
        for c, nd in zip(cols, (3, 2, 4, 3), strict=True):
            v = vals[c]
            line.append(f"{min(v):.{nd}f} – {max(v):.{nd}f} (mean {sum(v) / len(v):.{nd}f})")
        line.append("yes" if max(vals[cols[0]]) < math.log1p(0.2) else "no")
        line.append("yes" if min(vals[cols[2]]) > 0 else "no")
        lines.append(line)
    head = [
        "lr",
        "runs",
        "mean q per run",
        "SAT can act (fraction of steps)",
        "SAT band (tokens whose gradient SAT removed)",
        "gate rate",
        "mean q < 0.182 in all",
        "band > 0 in all",
    ]
    return _table(head, lines)


def power_verdict() -> str:
    """The decision rule of sat_power_cpu.md applied to the numbers (primary lr first)."""
    out = []
    for lr in (PRIMARY_LR, *(x for x in LRS if x != PRIMARY_LR)):
        g8, s8, g1 = (f"{m} · trainer.lr={lr}" for m in ("GRPO", "SAT-GRPO", "GRPO (lag 1)"))
        sat = _power_pair("SAT vs base", s8, "8", g8, "final")
        lag = _power_pair("requested", g8, "8", g1, "final")
        if sat is None or lag is None:
            out.append(f"- lr {lr}: not all runs have finished.")
            continue
        mean, hi, p = float(sat["mean_diff"]), float(sat["ci95_hi"]), float(sat["p_t"])
        if mean >= 2 and p < 0.05:
            verdict = "**confirms** (mean ≥ +2 points, p < 0.05)"
        elif hi < 2:
            verdict = "**refutes** a +2-point gain (the 95 % interval lies below +2)"
        else:
            verdict = "**inconclusive**"
        hurt = float(lag["mean_diff"]) < 0 and float(lag["p_t"]) < 0.05
        qs = _by_seed(POWER, s8, "8", "mean sat/q")
        bands = _by_seed(POWER, s8, "8", "mean sat/clipfrac_sat_band")
        over = sorted((seed for seed, q in qs.items() if q >= math.log1p(0.2)), key=int)
        acts = bool(qs) and not over
        changes = bool(bands) and min(bands.values()) > 0
        counts = hurt and acts and changes
        role = "primary" if lr == PRIMARY_LR else "secondary"
        out.append(
            f"- lr {lr} ({role}): SAT-GRPO − GRPO at lag 8 on the final evaluation = "
            f"{mean:+.2f} points, 95 % CI [{float(sat['ci95_lo']):+.2f}, {hi:+.2f}], paired t "
            f"p = {p:.3g} (Wilcoxon p = {float(sat['p_wilcoxon']):.3g}), n = {sat['n']}: "
            f"{verdict}. Manipulation check 1 (lag hurts GRPO): GRPO lag 8 − lag 1 = "
            f"{float(lag['mean_diff']):+.2f} points, p = {float(lag['p_t']):.3g}: "
            f"{'holds' if hurt else 'does not hold'}. Check 2 (mean q < 0.182 in every SAT run; "
            "q is measured in the SAT runs, so this checks an outcome of SAT, not a pre-treatment "
            "quantity): "
            + ("holds" if acts else f"does not hold (seeds {', '.join(over)} of {len(qs)})")
            + f". Check 3 (SAT band > 0 in every SAT run): {'holds' if changes else 'does not hold'}."
            + (
                " The verdict counts."
                if counts
                else " **The verdict does not count** (a check failed)."
            )
        )
    return "\n".join(out)


def lag_ratio() -> str:
    """paper_table1_cpu: run-mean d̄π at lag 1 and lag 8 per row (mean over seeds) and their
    ratio: how much of d̄π is policy lag rather than engine/trainer mismatch."""
    table = {(r["row"], r["lag"]): r for r in _rows("paper_table1_cpu", "table.csv")}
    lines = []
    for row in dict.fromkeys(r for r, _ in table):
        a, b = table.get((row, "1")), table.get((row, "8"))
        if a is None or b is None or not a["dpi_run_mean"] or not b["dpi_run_mean"]:
            continue
        x, y = float(a["dpi_run_mean"]), float(b["dpi_run_mean"])
        lines.append([row, f"{x:.4f}", f"{y:.4f}", f"{y / x:.1f}"])
    return _table(["row", "d̄π lag 1 (run mean)", "d̄π lag 8 (run mean)", "lag 8 / lag 1"], lines)


BLOCKS = {
    "lag_ratio": lag_ratio,
    "power_pairs": power_pairs,
    "power_cells": power_cells,
    "power_checks": power_checks,
    "power_verdict": power_verdict,
    "lr_check": lr_check,
    "regime_map": regime_map,
    "table1": table1,
    "table1_regime": table1_regime,
    "dpi_pairs": dpi_pairs,
}


def render(text: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            raise SystemExit(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"<!-- generated: {name} -->\n{BLOCKS[name]()}\n<!-- /generated -->"

    pattern = re.compile(r"<!-- generated: (\w+) -->\n.*?<!-- /generated -->", re.S)
    return pattern.sub(sub, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = render(text)
        name = doc.relative_to(RESULTS.parent.parent)
        if new != text:
            stale.append(str(name))
            if not args.check:
                doc.write_text(new)
                print(f"rewrote the generated blocks of {name}")
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}; run python scripts/results_tables.py")
            return 1
        print("generated blocks are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
