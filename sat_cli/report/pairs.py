"""Paired comparisons of `sat report`: which cells are compared, and their tables."""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from typing import Any

from sat_cli.report.stats import paired
from sat_cli.report.tables import DASH, ENDPOINTS, PAIR_ENDPOINTS_MD, Settings, fmt_num


@dataclass
class PairSpec:
    a: str  # row (method · axes)
    lag_a: str
    b: str
    lag_b: str
    kind: str  # "SAT vs base" | "lag" | "requested"


def _split(row: str) -> tuple[str, str]:
    method, _, axes = row.partition(" · ")
    return method, axes


def sat_base(method: str) -> str | None:
    """``SAT-GSPO w/ R3`` → ``GSPO w/ R3``; ``SAT-GRPO (anchored, …)`` → ``GRPO``; else None."""
    if not method.startswith("SAT-"):
        return None
    return re.sub(r" \(anchored[^)]*\)", "", method[4:])


def auto_pairs(rows: list[str], lags: list[str], cells: dict) -> list[PairSpec]:
    """SAT-X vs X at each lag (same other axes), and each row's lag L vs its lowest lag."""
    out = []
    for row in rows:
        method, axes = _split(row)
        base = sat_base(method)
        base_row = None if base is None else (f"{base} · {axes}" if axes else base)
        for lag in lags:
            if base_row and (row, lag) in cells and (base_row, lag) in cells:
                out.append(PairSpec(row, lag, base_row, lag, "SAT vs base"))
    for row in rows:
        have = [lag for lag in lags if (row, lag) in cells]
        for lag in have[1:]:
            out.append(PairSpec(row, lag, row, have[0], "lag"))
    return out


def requested_pairs(specs: list[str], rows: list[str], cells: dict) -> list[PairSpec]:
    """``"A@8:B@1"`` = method A at lag 8 minus method B at lag 1, for every value of the other
    axes both rows have (``ValueError`` naming the spec when nothing matches)."""
    out = []
    for spec in specs:
        m = re.fullmatch(r"\s*(.+?)@([^@:]+):(.+?)@([^@:]+)\s*", spec)
        if not m:
            raise ValueError(f"--pair {spec!r}: expected 'METHOD@LAG:METHOD@LAG'")
        a, la, b, lb = (x.strip() for x in m.groups())
        found = False
        for row in rows:
            method, axes = _split(row)
            if method != a:
                continue
            row_b = f"{b} · {axes}" if axes else b
            if (row, la) in cells and (row_b, lb) in cells:
                out.append(PairSpec(row, la, row_b, lb, "requested"))
                found = True
        if not found:
            raise ValueError(f"--pair {spec!r}: no cells {a!r} at lag {la} and {b!r} at lag {lb}")
    return out


PAIR_COLS = (
    "kind",
    "a",
    "lag_a",
    "b",
    "lag_b",
    "endpoint",
    "n",
    "mean_diff",
    "ci95_lo",
    "ci95_hi",
    "t",
    "p_t",
    "wilcoxon_w",
    "p_wilcoxon",
    "a_greater",
    "b_greater",
    "seeds",
)


def pair_rows(pairs: list[PairSpec], cells: dict, st: Settings, names) -> list[list[Any]]:
    out = []
    for p in pairs:
        ca, cb = cells[(p.a, p.lag_a)], cells[(p.b, p.lag_b)]
        for k in names:
            res = paired(ca.by_seed(k, st), cb.by_seed(k, st))
            if res is None:
                continue
            out.append(
                [
                    p.kind,
                    p.a,
                    p.lag_a,
                    p.b,
                    p.lag_b,
                    k,
                    res.n,
                    res.mean,
                    res.lo,
                    res.hi,
                    res.t,
                    res.p_t,
                    res.w,
                    res.p_w,
                    res.a_wins,
                    res.b_wins,
                    "/".join(res.seeds),
                ]
            )
    return out


def pairs_csv(table: list[list[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(PAIR_COLS)
    for r in table:
        w.writerow([fmt_num(x) if isinstance(x, float) else x for x in r])
    return buf.getvalue()


def _p(x: float) -> str:
    return DASH if math.isnan(x) else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def pairs_markdown(table: list[list[Any]], st: Settings) -> str:
    head = [
        "comparison (a − b)",
        "endpoint",
        "n",
        "mean diff [95 % CI]",
        "paired t p",
        "Wilcoxon p",
        "a > b / a < b",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        kind, a, la, b, lb, k, n, mean, lo, hi, _t, p_t, _w, p_w, aw, bw, _ = r
        if k not in PAIR_ENDPOINTS_MD:
            continue
        nd = ENDPOINTS[k][1]
        ci = DASH if math.isnan(lo) else f"[{lo:.{nd}f}, {hi:.{nd}f}]"
        name = f"{a} @ lag {la} − {b} @ lag {lb}"
        title = ENDPOINTS[k][0].replace("K", str(st.last_k))
        lines.append(
            f"| {name} | {title} | {n} | {mean:+.{nd}f} {ci} | {_p(p_t)} | {_p(p_w)} | {aw}/{bw} |"
        )
    return "\n".join(lines)
