"""`sat report`: the paper-style table and plots of a sweep (or any experiment) from MLflow.

``run_report(target)`` reads the MLflow store with ``MlflowClient`` (default
``sqlite:///runs/mlflow.db``) and finds the runs of ``target``, tried in this order:

1. a sweep id (the tag ``sat.sweep_id`` that ``sat sweep`` puts on its parent and child runs);
2. an MLflow experiment name: a sweep's name is its experiment; when the experiment holds
   several sweeps the latest parent run's sweep id is reported (a note names the others); an
   experiment of plain ``sat train`` runs is reported as is.

A run repeated under one override hash (a failed attempt, then a rerun) counts once: the
FINISHED one, else the latest. Runs are grouped by **method** (tag ``sat.method``, else derived
from the tags/params algo, clip, correction, r3: e.g. ``SAT-GSPO w/ TIS w/ R3``) and **lag**
(tag ``lag``); other axes of a sweep (e.g. ``trainer.lr``) become part of the row label. Rows
follow the sweep's method order (the parent's tag ``sat.sweep_methods``), else the paper's
Table 1 order, then first appearance; columns are the lags in increasing order.

Each cell (one row × one lag, several seeds) gives, per seed, from the metric histories:

* **best (step)** — the highest in-training ``eval/<bench>/avg@k`` and the step where it first
  occurred (step 0 is the initial model when ``eval.at_start``);
* **last** — the ``avg@k`` of the last evaluation;
* **d̄π** — ``staleness/abs_logratio_mean`` at the run's last step; for runs with the recompute
  pass (TIS, MIS, IcePop, decoupled PPO: the loss ratio is ``π_θ/π_old``, so that metric is ~0)
  ``staleness/mismatch_abs_logratio_mean`` = ``|log π_old − log μ|`` instead, the same distance
  to the behaviour policy that the other rows report;

shown as ``mean ± sample std (ddof = 1)`` over seeds (a single seed: the value alone), the
best steps of each seed in parentheses joined by ``/``. The CSV holds the same numbers unrounded
(``best_min``/``best_max`` too). A *regime* section lists per run the mean ``sat/q``, the
final ``sat/active_frac`` (fraction of steps with ``q < ln(1+ε_high)``, where SAT can change a
gradient at all; ALGORITHMS.md §4), the mean ``sat/gate_rate`` and the mean d̄π.

Outputs under ``--out`` (default ``runs/reports/<target>/``): ``report.md``, ``table.csv``,
``regime.csv`` and PNG plots (matplotlib, Agg): ``eval.png``, ``reward.png``, ``dpi.png``,
``sat_gate_rate.png`` (mean over seeds per step, min–max band; one panel per lag) and
``staleness_hist.png`` (the ``|d|`` histogram of each row × lag at its last logged step, read
from the tracker's JSON tables ``tables/staleness/abs_logratio/step_<N>.json`` of the first
seed). With a parent sweep run, the folder is also logged as its artifacts under ``report/``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sat_cli.errors import UserError

DEFAULT_URI = "sqlite:///runs/mlflow.db"
DPI_KEY = "staleness/abs_logratio_mean"
# With the recompute pass (TIS, MIS, IcePop, decoupled PPO) the loss ratio is pi_theta / pi_old,
# so DPI_KEY is ~0 there; |log pi_old - log mu| (pi_old = the weights at the step) is the d̄π
# against the behaviour policy that the other rows report.
MISMATCH_KEY = "staleness/mismatch_abs_logratio_mean"
REWARD_KEY = "rollout/reward_mean"
GATE_KEY = "sat/gate_rate"
Q_KEY = "sat/q"
ACTIVE_KEY = "sat/active_frac"
HIST_DIR = "tables/staleness/abs_logratio"
DASH = "—"

# The rows of the paper's Table 1 (ALGORITHMS.md §9): the order used when a sweep gives none.
PAPER_ORDER = (
    "GRPO",
    "GSPO",
    "GRPO w/ R3",
    "GSPO w/ R3",
    "GRPO w/ TIS",
    "GSPO w/ TIS",
    "GRPO w/ TIS w/ R3",
    "GSPO w/ TIS w/ R3",
    "DPPO (TV)",
    "SAT-GRPO",
    "SAT-GSPO",
    "SAT-GRPO w/ R3",
    "SAT-GSPO w/ R3",
)
_ALGO_NAMES = {
    "grpo": "GRPO",
    "gspo": "GSPO",
    "gspo_token": "GSPO-token",
    "dppo_tv": "DPPO (TV)",
    "ppo": "PPO",
    "decoupled_ppo": "Decoupled PPO",
    "m2po": "M2PO",
}


def derive_method(algo: str | None, clip: str | None, correction: str | None, r3: Any) -> str:
    """Method label from the config: ``SAT-GSPO w/ TIS w/ R3``, ``DPPO (TV)``, ``GRPO``."""
    name = _ALGO_NAMES.get(str(algo), str(algo or "?").upper())
    if clip == "sat":
        name = f"SAT-{name}"
    elif clip == "sat_anchored":
        name = f"SAT-{name} (anchored)"
    elif clip not in (None, "", "ppo"):
        name = f"{name} [clip={clip}]"
    if correction not in (None, "", "none"):
        name += f" w/ {str(correction).upper()}"
    if str(r3).lower() in ("true", "1"):
        name += " w/ R3"
    return name


def display_key(key: str) -> str:
    """``eval/toy/avg_at_8`` → ``eval/toy/avg@8`` (undo :func:`sat_cli.tracking.mlflow_key`)."""
    return re.sub(r"_at_(\d+)$", r"@\1", key)


# ----------------------------------------------------------------------------- data


@dataclass
class RunData:
    run_id: str
    name: str
    status: str
    start_time: int
    method: str
    lag: str
    seed: str
    row: str = ""
    eval_key: str | None = None
    eps_high: float = 0.2
    dpi_key: str = DPI_KEY  # the metric behind d̄π (MISMATCH_KEY with the recompute pass)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def values(self, key: str) -> list[tuple[int, float]]:
        return self.series.get(key, [])

    @property
    def eval(self) -> list[tuple[int, float]]:
        return self.values(self.eval_key) if self.eval_key else []

    def best(self) -> tuple[float, int] | None:
        ev = self.eval
        if not ev:
            return None
        top = max(v for _, v in ev)
        return top, next(s for s, v in ev if v == top)

    def last(self, key: str | None = None) -> tuple[float, int] | None:
        pts = self.eval if key is None else self.values(key)
        return (pts[-1][1], pts[-1][0]) if pts else None

    def mean(self, key: str) -> float | None:
        pts = self.values(key)
        return sum(v for _, v in pts) / len(pts) if pts else None

    @property
    def last_step(self) -> int | None:
        steps = [pts[-1][0] for pts in self.series.values() if pts]
        return max(steps) if steps else None


@dataclass
class Selection:
    """The runs of a report target."""

    label: str
    sweep_id: str | None
    parent: Any  # mlflow Run or None
    runs: list[Any]
    notes: list[str] = field(default_factory=list)


def _all_runs(client, experiment_ids: list[str], filter_string: str = "") -> list:
    out, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids, filter_string=filter_string, max_results=1000, page_token=token
        )
        out.extend(page)
        token = page.token
        if not token:
            return out


def _role(run) -> str:
    return run.data.tags.get("sat.sweep_role", "")


def select_runs(client, target: str) -> Selection:
    """Find the runs of a sweep id, a sweep name or an experiment (see the module docstring)."""
    if "'" in target or "\\" in target:
        raise UserError(f"report target {target!r}: quotes and backslashes are not allowed")
    exps = list(client.search_experiments())
    ids = [e.experiment_id for e in exps]
    if ids:
        tagged = _all_runs(client, ids, f"tags.`sat.sweep_id` = '{target}'")
        if tagged:
            parents = sorted(
                (r for r in tagged if _role(r) == "parent"), key=lambda r: r.info.start_time
            )
            children = [r for r in tagged if _role(r) != "parent"]
            return Selection(target, target, parents[-1] if parents else None, children)
    exp = next((e for e in exps if e.name == target), None)
    if exp is None:
        known_sweeps = sorted(
            {
                r.data.tags["sat.sweep_id"]
                for r in _all_runs(client, ids, "tags.`sat.sweep_role` = 'parent'")
            }
            if ids
            else set()
        )
        raise UserError(
            f"no sweep id or MLflow experiment named {target!r} in this store. "
            f"Experiments: {', '.join(sorted(e.name for e in exps)) or '(none)'}; "
            f"sweep ids: {', '.join(known_sweeps) or '(none)'}. "
            "Pass --tracking-uri for another store."
        )
    runs = _all_runs(client, [exp.experiment_id])
    parents = sorted((r for r in runs if _role(r) == "parent"), key=lambda r: r.info.start_time)
    if parents:
        sweep_id = parents[-1].data.tags.get("sat.sweep_id")
        others = sorted({p.data.tags.get("sat.sweep_id") for p in parents} - {sweep_id})
        children = [
            r for r in runs if _role(r) != "parent" and r.data.tags.get("sat.sweep_id") == sweep_id
        ]
        notes = []
        if others:
            notes.append(
                f"experiment {target!r} holds several sweeps; reporting the latest ({sweep_id}). "
                f"Others: {', '.join(others)} (pass one as the target)."
            )
        return Selection(target, sweep_id, parents[-1], children, notes)
    return Selection(target, None, None, [r for r in runs if _role(r) != "parent"])


def dedupe(runs: Iterable[Any]) -> list[Any]:
    """One run per override hash (runs without one are kept): FINISHED first, then the latest."""
    best: dict[str, Any] = {}
    for r in runs:
        key = r.data.tags.get("sat.override_hash") or r.info.run_id
        cur = best.get(key)
        rank = (r.info.status == "FINISHED", r.info.start_time or 0)
        if cur is None or rank > (cur.info.status == "FINISHED", cur.info.start_time or 0):
            best[key] = r
    return sorted(best.values(), key=lambda r: (r.info.start_time or 0, r.info.run_id))


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        prev = by_step.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def _eval_key(run) -> str | None:
    from sat_cli.tracking import mlflow_key

    p = run.data.params
    if p.get("eval.name") and p.get("eval.n"):
        key = mlflow_key(f"eval/{p['eval.name']}/avg@{p['eval.n']}")
        if key in run.data.metrics:
            return key
    keys = sorted(k for k in run.data.metrics if re.fullmatch(r"eval/.+/avg_at_\d+", k))
    return keys[0] if keys else None


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
    try:
        eps_high = float(params.get("algo.eps_high", 0.2))
    except ValueError:
        eps_high = 0.2
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
        eps_high=eps_high,
    )
    for key in (data.eval_key, DPI_KEY, REWARD_KEY, GATE_KEY, Q_KEY, ACTIVE_KEY):
        if key and key in run.data.metrics:
            data.series[key] = _history(client, run.info.run_id, key)
    if MISMATCH_KEY in run.data.metrics:  # d̄π against mu for runs with the recompute pass
        data.series[DPI_KEY] = _history(client, run.info.run_id, MISMATCH_KEY)
        data.dpi_key = MISMATCH_KEY
    return data


def _download_json(client, run_id: str, path: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        return json.loads(Path(local).read_text())


def _sweep_records(client, parent) -> dict[str, dict]:
    if parent is None:
        return {}
    from mlflow.exceptions import MlflowException

    try:
        rows = _download_json(client, parent.info.run_id, "sweep/runs.json")
    except (MlflowException, OSError, ValueError):  # absent or unreadable: fall back to params
        return {}
    return {r["override_hash"]: r for r in rows if isinstance(r, dict) and "override_hash" in r}


# ----------------------------------------------------------------------------- table


def _lag_sort(lag: str) -> tuple:
    try:
        return (0, float(lag), lag)
    except ValueError:
        return (1, 0.0, lag)


def row_order(runs: list[RunData], methods: list[str] | None) -> list[str]:
    """Rows in the sweep's method order (else the paper's), then by first appearance."""
    order = list(methods or PAPER_ORDER)
    seen: list[str] = []
    for r in runs:
        if r.row not in seen:
            seen.append(r.row)

    def rank(row: str) -> tuple:
        method = next(
            (
                m
                for m in sorted(order, key=len, reverse=True)
                if row == m or row.startswith(m + " · ")
            ),
            None,
        )
        return (order.index(method) if method is not None else len(order), seen.index(row))

    return sorted(seen, key=rank)


def _stats(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    std = statistics.stdev(values) if len(values) > 1 else None
    return mean, std


def fmt(values: list[float], nd: int) -> str:
    """``mean ± sample std`` with ``nd`` decimals; one value alone; none: an em dash."""
    if not values:
        return DASH
    mean, std = _stats(values)
    return f"{mean:.{nd}f}" if std is None else f"{mean:.{nd}f} ± {std:.{nd}f}"


@dataclass
class Cell:
    runs: list[RunData]

    @property
    def bests(self) -> list[tuple[float, int]]:
        return [b for b in (r.best() for r in self.runs) if b is not None]

    @property
    def lasts(self) -> list[float]:
        return [x[0] for x in (r.last() for r in self.runs) if x is not None]

    @property
    def dpis(self) -> list[float]:
        return [x[0] for x in (r.last(DPI_KEY) for r in self.runs) if x is not None]

    def best_str(self) -> str:
        b = self.bests
        if not b:
            return DASH
        return f"{fmt([v for v, _ in b], 2)} ({'/'.join(str(s) for _, s in b)})"


def build_table(
    runs: list[RunData], methods: list[str] | None
) -> tuple[list[str], list[str], dict]:
    rows = row_order(runs, methods)
    lags = sorted({r.lag for r in runs}, key=_lag_sort)
    cells: dict[tuple[str, str], Cell] = {}
    for r in sorted(runs, key=lambda r: _lag_sort(r.seed)):
        cells.setdefault((r.row, r.lag), Cell([])).runs.append(r)
    return rows, lags, cells


def markdown_table(rows: list[str], lags: list[str], cells: dict) -> str:
    head = ["method"]
    for lag in lags:
        head += [f"lag {lag} best (step)", f"lag {lag} last", f"lag {lag} d̄π"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        parts = [row]
        for lag in lags:
            c = cells.get((row, lag))
            if c is None:
                parts += [DASH, DASH, DASH]
            else:
                parts += [c.best_str(), fmt(c.lasts, 2), fmt(c.dpis, 4)]
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "" if x is None else format(x, ".10g")


def table_csv(rows: list[str], lags: list[str], cells: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "row",
            "lag",
            "n_seeds",
            "best_mean",
            "best_std",
            "best_min",
            "best_max",
            "best_steps",
            "last_mean",
            "last_std",
            "dpi_last_mean",
            "dpi_last_std",
            "eval_key",
            "runs",
        ]
    )
    for row in rows:
        for lag in lags:
            c = cells.get((row, lag))
            if c is None:
                continue
            b = [v for v, _ in c.bests]
            bm, bs = _stats(b) if b else (None, None)
            lm, ls = _stats(c.lasts) if c.lasts else (None, None)
            dm, ds = _stats(c.dpis) if c.dpis else (None, None)
            keys = sorted({display_key(r.eval_key) for r in c.runs if r.eval_key})
            w.writerow(
                [
                    row,
                    lag,
                    len(c.runs),
                    _num(bm),
                    _num(bs),
                    _num(min(b) if b else None),
                    _num(max(b) if b else None),
                    "/".join(str(s) for _, s in c.bests),
                    _num(lm),
                    _num(ls),
                    _num(dm),
                    _num(ds),
                    ";".join(keys),
                    ";".join(r.name for r in c.runs),
                ]
            )
    return buf.getvalue()


REGIME_COLS = (
    "run",
    "method",
    "lag",
    "seed",
    "status",
    "last step",
    "mean sat/q",
    "ln(1+eps_high)",
    "sat/active_frac",
    "mean sat/gate_rate",
    "mean d̄π",
)


def regime_rows(runs: list[RunData], rows: list[str]) -> list[list[str]]:
    out = []
    order = {row: i for i, row in enumerate(rows)}
    for r in sorted(runs, key=lambda r: (order.get(r.row, 0), _lag_sort(r.lag), _lag_sort(r.seed))):
        active = r.last(ACTIVE_KEY)
        out.append(
            [
                r.name,
                r.row,
                r.lag,
                r.seed,
                r.status,
                "" if r.last_step is None else str(r.last_step),
                _opt(r.mean(Q_KEY), 4),
                f"{math.log1p(r.eps_high):.4f}",
                _opt(active[0] if active else None, 2),
                _opt(r.mean(GATE_KEY), 4),
                _opt(r.mean(DPI_KEY), 4),
            ]
        )
    return out


def _opt(x: float | None, nd: int) -> str:
    return DASH if x is None else f"{x:.{nd}f}"


def regime_markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(REGIME_COLS) + " |", "|" + "---|" * len(REGIME_COLS)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def regime_csv(table: list[list[str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(REGIME_COLS)
    w.writerows([[("" if v == DASH else v) for v in row] for row in table])
    return buf.getvalue()


# ----------------------------------------------------------------------------- plots


def _series_plot(
    path: Path, runs: list[RunData], rows: list[str], lags: list[str], key_of, title: str
) -> bool:
    """One panel per lag; per row the mean over seeds at shared steps and a min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    have = [r for r in runs if r.values(key_of(r))]
    if not have:
        return False
    ncol = 4
    legend_rows = math.ceil(len({r.row for r in have}) / ncol)
    height = 4.0 + 0.22 * legend_rows
    fig, axes = plt.subplots(
        1, len(lags), figsize=(max(5.5 * len(lags), 8), height), squeeze=False, sharey=True
    )
    cmap = plt.get_cmap("tab20")
    for j, lag in enumerate(lags):
        ax = axes[0][j]
        for i, row in enumerate(rows):
            group = [r for r in have if r.row == row and r.lag == lag]
            if not group:
                continue
            series = [dict(r.values(key_of(r))) for r in group]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            if not steps:
                continue
            vals = [[s[t] for s in series] for t in steps]
            mean = [sum(v) / len(v) for v in vals]
            color = cmap((2 * i) % 20 + (i // 10) % 2)  # distinct hues first
            ax.plot(
                steps, mean, label=row, color=color, lw=1.5, marker="." if len(steps) < 30 else None
            )
            if len(group) > 1:
                ax.fill_between(
                    steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15
                )
        ax.set_title(f"lag {lag}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(title)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, l_ = ax.get_legend_handles_labels()
        for hh, ll in zip(h, l_, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.suptitle(f"{title} (mean over seeds; band: min–max)")
    fig.tight_layout(rect=(0, (0.22 * legend_rows + 0.15) / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _hist_plot(path: Path, client, runs: list[RunData], rows: list[str], lags: list[str]) -> bool:
    """Staleness |d| histograms side by side: rows = lags, columns = methods (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables: dict[tuple[str, str], dict] = {}
    for row in rows:
        for lag in lags:
            group = sorted(
                (r for r in runs if r.row == row and r.lag == lag), key=lambda r: _lag_sort(r.seed)
            )
            for r in group:
                t = _last_hist(client, r.run_id)
                if t is not None:
                    tables[(row, lag)] = {**t, "_seed": r.seed}
                    break
    if not tables:
        return False
    cols = [row for row in rows if any((row, lag) in tables for lag in lags)]
    fig, axes = plt.subplots(
        len(lags),
        len(cols),
        figsize=(2.6 * len(cols) + 1, 2.4 * len(lags) + 0.6),
        squeeze=False,
        sharex=True,
    )
    for i, lag in enumerate(lags):
        for j, row in enumerate(cols):
            ax = axes[i][j]
            t = tables.get((row, lag))
            if t is None:
                ax.set_axis_off()
                continue
            edges, counts = t.get("edges") or [], t.get("counts") or []
            if len(edges) == len(counts) + 1 and counts:
                ax.stairs(counts, edges, fill=True, alpha=0.6)
                if any(counts):
                    ax.set_yscale("log")
            for name, x in (t.get("marks") or {}).items():
                ax.axvline(x, ls="--", color="k", lw=0.8)
                ax.text(x, 1, f" {name}", transform=ax.get_xaxis_transform(), fontsize=6, va="top")
            ax.set_title(f"{row}\nlag {lag}, step {t.get('step')}, seed {t['_seed']}", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.suptitle("|log π_θ − log μ| per token at the last logged step (d̄π histograms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _last_hist(client, run_id: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        files = client.list_artifacts(run_id, HIST_DIR)
    except (MlflowException, OSError):
        return None
    steps = []
    for f in files:
        m = re.search(r"step_(\d+)\.json$", f.path)
        if m:
            steps.append((int(m.group(1)), f.path))
    if not steps:
        return None
    return _download_json(client, run_id, max(steps)[1])


# ----------------------------------------------------------------------------- main


def _check_store(uri: str) -> None:
    from sat_cli.tracking import sqlite_db_path

    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise UserError(
            f"no MLflow store at {db} (tracking URI {uri}); run `sat sweep`/`sat train` first "
            "or pass --tracking-uri"
        )


def build_report(client, target: str) -> dict[str, Any]:
    """Collect the report's pieces (no files written): selection, runs, table, regime."""
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
    rows, lags, cells = build_table(runs, methods)
    dropped = len(sel.runs) - len(children)
    if dropped:
        sel.notes.append(
            f"{dropped} earlier attempt(s) of a run (same override hash) were left out; "
            "the FINISHED (else latest) attempt is reported."
        )
    return {"selection": sel, "runs": runs, "rows": rows, "lags": lags, "cells": cells}


def render_markdown(rep: dict, uri: str, plots: list[str]) -> str:
    sel, runs = rep["selection"], rep["runs"]
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    keys = sorted({display_key(r.eval_key) for r in runs if r.eval_key})
    seeds = sorted({len(c.runs) for c in rep["cells"].values()})
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
        + f"); eval metric {', '.join(f'`{k}`' for k in keys) or '(none logged)'}.",
        "",
        "Cells: **best (step)** = highest in-training eval score and the step where it first "
        "occurred; **last** = score of the last evaluation; **d̄π** = "
        f"`{DPI_KEY}` at the last step (`{MISMATCH_KEY}` = |log π_old − log μ| for runs with "
        "the recompute pass, e.g. TIS, whose loss ratio is π_θ/π_old). Over seeds: mean ± sample std (ddof = 1); a single "
        "seed shows its value alone; the best step of each seed is listed (`a/b`). "
        f"Seeds per cell: {', '.join(map(str, seeds))}.",
    ]
    lines += [f"> {n}" for n in sel.notes]
    lines += ["", markdown_table(rep["rows"], rep["lags"], rep["cells"]), ""]
    lines += [
        "## Regime",
        "",
        "SAT can change a gradient only on tokens with q < |d| < ln(1+ε) (ALGORITHMS.md §4); "
        "`sat/active_frac` is the fraction of steps where q < ln(1+ε_high). Means are over "
        "logged steps; — = not logged (no SAT).",
        "",
        regime_markdown(regime_rows(runs, rep["rows"])),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def run_report(target: str, *, out: str | None, tracking_uri: str | None) -> None:
    """`sat report`: print the table, write report.md / table.csv / regime.csv / PNGs."""
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient

    from sat_cli.errors import os_error
    from sat_cli.loop.preflight import check_output_dir

    out_dir = (
        Path(out) if out else Path("runs") / "reports" / re.sub(r"[^A-Za-z0-9_.\-]+", "_", target)
    )
    check_output_dir(out_dir, "--out")  # a file, a read-only or too long path: exit 2 up front
    uri = tracking_uri or DEFAULT_URI
    _check_store(uri)
    client = MlflowClient(tracking_uri=uri)
    rep = build_report(client, target)
    try:
        _write_report(client, rep, uri, out_dir)
    except OSError as exc:
        raise os_error(exc, f"cannot write the report to {out_dir}") from None


def _write_report(client, rep: dict, uri: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, rows, lags = rep["runs"], rep["rows"], rep["lags"]

    plots = []
    eval_title = next((display_key(r.eval_key) for r in runs if r.eval_key), "eval avg@k")
    series = [
        ("eval.png", lambda r: r.eval_key or "", eval_title),
        ("reward.png", lambda r: REWARD_KEY, "rollout/reward_mean"),
        ("dpi.png", lambda r: DPI_KEY, "d̄π (mean |log π − log μ|)"),
        ("sat_gate_rate.png", lambda r: GATE_KEY, "sat/gate_rate"),
    ]
    for name, key_of, title in series:
        if _series_plot(out_dir / name, runs, rows, lags, key_of, title):
            plots.append(name)
    if _hist_plot(out_dir / "staleness_hist.png", client, runs, rows, lags):
        plots.append("staleness_hist.png")

    md = render_markdown(rep, uri, plots)
    (out_dir / "report.md").write_text(md)
    (out_dir / "table.csv").write_text(table_csv(rows, lags, rep["cells"]))
    (out_dir / "regime.csv").write_text(regime_csv(regime_rows(runs, rows)))
    print(md.split("## Plots")[0].rstrip())
    print(f"\nwritten: {out_dir}/ (report.md, table.csv, regime.csv, {len(plots)} plots)")
    sel = rep["selection"]
    if sel.parent is not None:
        client.log_artifacts(sel.parent.info.run_id, str(out_dir), "report")
        print(f"logged as artifacts report/ of the parent run {sel.parent.info.run_id}")
