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
    head = ["lr", "GRPO d̄π lag 1 (mean / last step)", "GRPO d̄π lag 8 (mean / last step)",
            "GRPO best lag 1 / 8", "GRPO last lag 1 / 8", "SAT-GRPO mean q lag 1 / 8",
            "SAT-GRPO logged active_frac lag 1 / 8 (one-sided)"]  # fmt: skip
    return _table(head, lines)


def _grid_lines(report: str, nd_dpi: int = 4) -> tuple[list[str], list[list[str]]]:
    rows = _rows(report, "table.csv")
    lags = sorted({r["lag"] for r in rows}, key=float)
    by = {(r["row"], r["lag"]): r for r in rows}
    order = list(dict.fromkeys(r["row"] for r in rows))
    head = ["method"]
    for lag in lags:
        head += [f"lag {lag} best", f"lag {lag} last", f"lag {lag} mean last 3",
                 f"lag {lag} d̄π (last 16 steps)"]  # fmt: skip
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
    cols = [("mean sat/q", 3), ("SAT can act (either side)", 2), ("can act low", 2),
            ("can act high", 2), ("mean sat/gate_rate", 3), ("mean sat/clipfrac_sat_band", 4),
            ("mean ESS", 3)]  # fmt: skip
    lines = []
    for (method, lag), rs in cells.items():
        line = [method, lag]
        for c, nd in cols:
            vals = [float(r[c]) for r in rs if r[c]]
            line.append(f"{sum(vals) / len(vals):.{nd}f}" if vals else DASH)
        lines.append(line)
    head = ["method", "lag", "mean q", "SAT can act", "low side", "high side", "gate rate",
            "SAT band", "ESS mean"]  # fmt: skip
    return _table(head, lines)


def _sat_base(method: str) -> str:
    return re.sub(r" \(anchored[^)]*\)", "", method[4:])


def dpi_pairs() -> str:
    """paper_table1_cpu: every SAT row against its base row, same seed and lag: mean d̄π over
    the run (regime.csv), and the relative change."""
    regime = _rows("paper_table1_cpu", "regime.csv")
    by = {(r["method"], r["lag"], r["seed"]): float(r["mean d̄π"]) for r in regime}
    lines, lower, total, changes = [], 0, 0, []
    for (method, lag, seed), dpi in sorted(by.items()):
        if not method.startswith("SAT-"):
            continue
        base = by.get((_sat_base(method), lag, seed))
        if base is None:
            continue
        rel = (dpi - base) / base
        total += 1
        lower += dpi < base
        changes.append(rel)
        lines.append(
            [
                method,
                _sat_base(method),
                lag,
                seed,
                f"{dpi:.4f}",
                f"{base:.4f}",
                f"{100 * rel:+.0f} %",
            ]
        )
    head = ["SAT row", "base row", "lag", "seed", "SAT d̄π", "base d̄π", "change"]
    lo = min(c for c in changes if c < 0) if lower else math.nan
    hi = max(c for c in changes if c < 0) if lower else math.nan
    summary = (
        f"SAT lowers the run-mean d̄π in **{lower} of {total}** paired comparisons "
        f"(by {100 * -hi:.0f}–{100 * -lo:.0f} % where it lowers it)."
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
            lines.append([
                rnd.replace("round", "round "), lr, f"{l1:.2f}", f"{l8:.2f}", f"{l8 - l1:+.2f}",
                " / ".join(f"{qs[k]:.3f}" for k in sorted(qs)),
                " / ".join(f"{act[k]:.2f}" for k in sorted(act)),
                "yes" if hurt else "no", "yes" if low_q else "no",
            ])  # fmt: skip
    head = ["round", "lr", "GRPO lag 1 mean last 3", "GRPO lag 8 mean last 3", "lag 8 − lag 1",
            "SAT-GRPO mean q (seed 0 / 1)", "SAT can act, fraction of steps (seed 0 / 1)",
            "lag hurts ≥ 3", "q < 0.18"]  # fmt: skip
    return _table(head, lines)


BLOCKS = {
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
