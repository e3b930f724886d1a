"""Per-step curves of a collapse study's runs, as one long CSV (``collapse_curves.csv``).

One line per (run, series, step): the in-training evaluation (``eval``), the training reward
(``reward``), the ``q`` behind "SAT can act" (``q``: ``staleness/q_shadow`` without SAT,
``sat/q`` with it) and the ledger's two parts of d̄π (``ledger_mismatch``,
``ledger_staleness``) when logged. Values are written with 9 significant digits, so a curve
can be re-plotted and every per-run outcome of ``collapse.csv`` recomputed from it.
"""

from __future__ import annotations

import csv
import io

from sat_cli import metric_names as M

CURVE_COLUMNS = ["run", "method", "lag", "seed", "series", "step", "value"]
SERIES = ("eval", "reward", "q", "ledger_mismatch", "ledger_staleness")  # _series' names


def _series(run) -> list[tuple[str, list[tuple[int, float]]]]:
    q = run.values(M.SAT_Q_SHADOW) or run.values(M.SAT_Q)
    return [
        ("eval", run.eval),
        ("reward", run.values(M.REWARD_MEAN)),
        ("q", q),
        ("ledger_mismatch", run.values(M.LEDGER_MISMATCH_PART)),
        ("ledger_staleness", run.values(M.LEDGER_STALENESS_PART)),
    ]


def curves_csv(runs) -> str:
    """The curves of ``runs`` (``RunData``), in the runs' order, then series, then step."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CURVE_COLUMNS)
    for run in runs:
        for name, points in _series(run):
            for step, value in points:
                w.writerow([run.name, run.method, run.lag, run.seed, name, step, f"{value:.9g}"])
    return buf.getvalue()


def read_curves(text: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``(run, series) -> [(step, value)]`` from a file written by ``curves_csv``: every column
    checked (``report.csv_checks``); ``ValueError`` naming the line and the column otherwise."""
    from sat_cli.report import csv_checks as C

    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames != CURVE_COLUMNS:
        raise ValueError(f"not a collapse-curves CSV: columns {reader.fieldnames}")
    kinds = dict.fromkeys(("run", "method", "lag", "seed"), C.text)
    kinds |= {"series": C.one_of(*SERIES), "step": C.integer(0), "value": C.number}
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for _, d in C.checked_rows(reader, kinds):
        out.setdefault((d["run"], d["series"]), []).append((int(d["step"]), float(d["value"])))
    return out
