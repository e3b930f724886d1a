"""The regime section and the markdown of `sat report` (see ``sat_cli.report``)."""

from __future__ import annotations

import math

from sat_cli.report.pairs import pair_rows, pairs_markdown
from sat_cli.report.tables import (
    BAND_KEYS,
    CLIP_KEYS,
    DASH,
    DPI_KEY,
    ENDPOINTS,
    ESS_KEY,
    GATE_KEY,
    Q_KEY,
    RunData,
    Settings,
    display_key,
    endpoint_table,
    paper_table,
)

REGIME_COLS = (
    "run",
    "method",
    "lag",
    "seed",
    "status",
    "last step",
    "mean sat/q",
    "ln(1+eps_high)",
    "-ln(1-eps_low)",
    "SAT can act (either side)",
    "can act low",
    "can act high",
    "mean sat/gate_rate",
    "mean sat/clipfrac_sat_band",
    "band low",
    "band high",
    "mean loss/clipfrac",
    "clip low",
    "clip high",
    "mean ESS",
    "min ESS",
    "mean d̄π",
    "flag",
)
INERT_FLAG = "SAT inert: recompute denominator, 1 step/batch"


def sat_thresholds(eps_low: float, eps_high: float) -> tuple[float, float]:
    """``(ln(1 + eps_high), -ln(1 - eps_low))``: at or above a side's value SAT cannot change a
    gradient on that side (docs/algorithms.md §4, "When SAT is inert")."""
    ell_lo = -math.log1p(-eps_low) if eps_low < 1 else math.inf
    return math.log1p(eps_high), ell_lo


def _ells(r: RunData) -> tuple[float, float]:
    return sat_thresholds(r.eps_low, r.eps_high)


def can_act_fractions(r: RunData) -> tuple[float, float, float] | None:
    """Fractions of logged steps with ``q`` below either threshold, the low, the high one."""
    qs = [v for _, v in r.values(Q_KEY)]
    if not qs:
        return None
    hi, lo = _ells(r)
    n = len(qs)
    return (
        sum(q < max(hi, lo) for q in qs) / n,
        sum(q < lo for q in qs) / n,
        sum(q < hi for q in qs) / n,
    )


def _opt(x: float | None, nd: int) -> str:
    return DASH if x is None else f"{x:.{nd}f}"


def _regime_values(r: RunData) -> list[float | None]:
    act = can_act_fractions(r) or (None, None, None)
    ess = [v for _, v in r.values(ESS_KEY) if not math.isnan(v)]
    return [
        r.mean(Q_KEY),
        *act,
        r.mean(GATE_KEY),
        *(r.mean(k) for k in BAND_KEYS),
        *(r.mean(k) for k in CLIP_KEYS),
        r.mean(ESS_KEY),
        min(ess) if ess else None,
        r.mean(DPI_KEY),
    ]


_REGIME_ND = (4, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 3, 3, 4)


def regime_rows(runs: list[RunData], rows: list[str]) -> list[list[str]]:
    out = []
    order = {row: i for i, row in enumerate(rows)}
    key = lambda r: (order.get(r.row, 0), lag_key(r.lag), lag_key(r.seed))  # noqa: E731
    for r in sorted(runs, key=key):
        hi, lo = _ells(r)
        vals = [_opt(v, nd) for v, nd in zip(_regime_values(r), _REGIME_ND, strict=True)]
        out.append(
            [
                r.name,
                r.row,
                r.lag,
                r.seed,
                r.status,
                "" if r.last_step is None else str(r.last_step),
                vals[0],
                f"{hi:.4f}",
                f"{lo:.4f}",
                *vals[1:],
                INERT_FLAG if r.inert_recompute else "",
            ]
        )
    return out


def regime_cells(rows: list[str], lags: list[str], cells: dict) -> str:
    """Per cell: the regime numbers averaged over seeds (min ESS: the minimum)."""
    head = [
        "method",
        "lag",
        "n",
        "mean q",
        "SAT can act",
        "low",
        "high",
        "gate rate",
        "SAT band",
        "band low",
        "band high",
        "PPO clipfrac",
        "ESS mean",
        "ESS min",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        for lag in lags:
            c = cells.get((row, lag))
            if c is None:
                continue
            per_run = [_regime_values(r) for r in c.runs]
            vals = []
            for j, nd in enumerate(_REGIME_ND[:-1]):
                if j in (8, 9):  # PPO clip low/high: only the total here
                    continue
                xs = [v[j] for v in per_run if v[j] is not None]
                agg = (min(xs) if j == 12 else sum(xs) / len(xs)) if xs else None
                vals.append(_opt(agg, nd))
            lines.append("| " + " | ".join([row, lag, str(len(c.runs)), *vals]) + " |")
    return "\n".join(lines)


def regime_markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(REGIME_COLS) + " |", "|" + "---|" * len(REGIME_COLS)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def regime_csv(table: list[list[str]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(REGIME_COLS)
    w.writerows([[("" if v == DASH else v) for v in row] for row in table])
    return buf.getvalue()


def lag_key(x: str) -> tuple:
    try:
        return (0, float(x), x)
    except ValueError:
        return (1, 0.0, x)


def render_markdown(rep: dict, uri: str, plots: list[str], st: Settings) -> str:
    sel, runs, rows, lags, cells = (rep[k] for k in ("selection", "runs", "rows", "lags", "cells"))
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    keys = sorted({display_key(r.eval_key) for r in runs if r.eval_key})
    finals = sorted({display_key(r.final_key) for r in runs if r.final_key})
    seeds = sorted({len(c.runs) for c in cells.values()})
    lines = [f"# sat report: {sel.label}", ""]
    if sel.sweep_id:
        lines.append(
            f"Sweep `{sel.sweep_id}`"
            + (f", parent run `{sel.parent.info.run_id}`" if sel.parent else "")
            + "."
        )
    lines += [
        f"Store `{uri}`; {len(runs)} runs ("
        + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
        + f"); eval metric {', '.join(f'`{k}`' for k in keys) or '(none logged)'}"
        + (f"; final evaluation {', '.join(f'`{k}`' for k in finals)}" if finals else "")
        + ".",
        "",
        "Cells: `mean ± h` over seeds, `h` the half-width of the 95 % t-interval of the mean "
        "(Student t, n − 1 degrees of freedom); one seed shows its value alone. "
        f"Seeds per cell (n): {', '.join(map(str, seeds))}. **best (steps)** = highest in-training "
        "eval, with the step where each seed first reached it (`a/b/…`); **last** = the last "
        f"in-training eval; **d̄π** = mean d̄π over the last {st.epoch_steps} steps (the paper's "
        "last-epoch d̄π; `|log π − log μ|`, for recompute runs `|log π_old − log μ|`). Endpoint "
        "definitions: `ENDPOINTS` in sat_cli/report/tables.py.",
    ]
    lines += [f"> {n}" for n in sel.notes]
    lines += ["", paper_table(rows, lags, cells, st), ""]
    names = [k for k in ENDPOINTS if any(c.by_seed(k, st) for c in cells.values())]
    for lag in lags:
        lines += [f"### Endpoints at lag {lag}", ""]
        lines += [endpoint_table(rows, lag, cells, st, names), ""]
    thr = (
        f"{st.collapse_below:g}"
        if st.collapse_below is not None
        else "half of the run's own step-0 score"
    )
    lines += [f"**collapsed** = runs whose last eval is below {thr}.", ""]
    table = pair_rows(rep["pairs"], cells, st, [k for k in names if k != "ess"])
    if table:
        lines += [
            "## Paired differences",
            "",
            "Same seed, a − b. Mean difference with its 95 % t-interval, two-sided paired t test "
            "and Wilcoxon signed-rank test (zero differences dropped), and how many seeds have "
            "a > b / a < b. All endpoints: `pairs.csv`.",
            "",
            pairs_markdown(table, st),
            "",
        ]
    flagged = sorted({r.row for r in runs if r.inert_recompute})
    lines += [
        "## Regime",
        "",
        "SAT can change a gradient only on tokens with q < |d| < ln(1+ε) on their side "
        "(docs/algorithms.md §4): *SAT can act* = fraction of logged steps with "
        "q < max(ln(1+ε_high), −ln(1−ε_low)) (0.182 / 0.223 at ε = 0.2), *low* / *high* per "
        "side; *SAT band* = mean fraction of tokens whose gradient SAT removed (clipped by SAT, "
        "not by PPO); *gate rate* = fraction of tokens whose interval SAT contracted. Means over "
        "logged steps; — = not logged.",
        "",
    ]
    if flagged:
        lines += [
            f"> **{INERT_FLAG}**: {', '.join(flagged)}. d = 0, q = 0: these are the base method.",
            "",
        ]
    lines += [regime_cells(rows, lags, cells), "", "Per run:", ""]
    lines += [regime_markdown(regime_rows(runs, rows)), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
