"""The numbers of `sat report`: per-run endpoints, cells over seeds, pairs, and their tables.

Endpoints of one run (``RunData`` methods; steps are trainer steps, evaluations every
``eval.every`` steps, step 0 = the initial model when ``eval.at_start``):

* ``best`` — highest in-training eval and the first step it occurred; ``last`` — the last
  in-training eval; ``lastk`` — mean of the last ``K`` in-training evals (default 3: less
  noisy than one evaluation, and not the maximum of a noisy curve); ``final`` — the separate
  final evaluation (``final/<bench>/avg@n``, ``eval.final_n``) when the run logged one;
* ``reward2`` — mean training reward (``rollout/reward_mean``) over the second half of the
  run (steps ``> last step / 2``);
* ``dpi_run`` — mean d̄π over all steps; ``dpi_epoch`` — mean d̄π over the last ``E`` steps
  (default 16). The paper reports d̄π over its last epoch; the toy task has no data epochs, so
  the last ``E`` steps stand in for it: 16 steps span two full weight-push periods at lag 8 (the
  last single step would sit at one phase of the 1..8 staleness sawtooth);
* ``collapsed`` — the last in-training eval is below the collapse threshold: an absolute score
  (``--collapse-below``), else half the run's own step-0 score (lost half its starting skill);
* ``ess`` — mean of ``staleness/ess`` (normalised Kish ESS of the sequence weights pi/mu).

d̄π per run is ``staleness/mismatch_abs_logratio_mean`` (``|log pi_old - log mu|``) for runs with
the recompute pass (TIS, MIS, IcePop, decoupled PPO, M2PO: their loss ratio is pi/pi_old),
else ``staleness/abs_logratio_mean_mu`` (``|log pi - log mu|``, logged by every loss since it
was added; identical to the next for rollout-denominator losses), else
``staleness/abs_logratio_mean``.

A cell (one row × one lag) shows ``mean ± h`` over its seeds, ``h`` the half-width of the 95 %
t-interval (``stats.t_interval``); its size ``n`` is printed. Pairs compare two cells
seed by seed (``stats.paired``).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, field

from sat_cli import metric_names as M
from sat_cli.report.stats import t_interval

DPI_KEY = M.DPI
DPI_MU_KEY = M.DPI_MU
MISMATCH_KEY = M.MISMATCH
REWARD_KEY = M.REWARD_MEAN
GATE_KEY = M.SAT_GATE_RATE
Q_KEY = M.SAT_Q
ESS_KEY = M.ESS
BAND_KEYS = (M.SAT_BAND, M.SAT_BAND_LOW, M.SAT_BAND_HIGH)
CLIP_KEYS = (M.CLIPFRAC, M.CLIPFRAC_LOW, M.CLIPFRAC_HIGH)
DASH = "—"


@dataclass
class Settings:
    last_k: int = 3
    epoch_steps: int = 16
    collapse_below: float | None = None  # None: half the run's step-0 score


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
    final_key: str | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dpi_key: str = DPI_KEY  # the metric behind d̄π
    inert_recompute: bool = False  # SAT with a recompute denominator at 1 step/batch
    commit: str = ""  # the tag git_commit: the code the run ran
    tags: dict[str, str] = field(default_factory=dict)  # the run's MLflow tags
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

    def mean(self, key: str, after: float | None = None) -> float | None:
        pts = [v for s, v in self.values(key) if after is None or s > after]
        return sum(pts) / len(pts) if pts else None

    @property
    def last_step(self) -> int | None:
        steps = [pts[-1][0] for pts in self.series.values() if pts]
        return max(steps) if steps else None

    def endpoint(self, name: str, st: Settings) -> float | None:
        """One number of this run (module docstring); ``None`` when not logged."""
        if name == "best":
            b = self.best()
            return None if b is None else b[0]
        if name == "last":
            x = self.last()
            return None if x is None else x[0]
        if name == "lastk":
            ev = self.eval[-st.last_k :]
            return sum(v for _, v in ev) / len(ev) if ev else None
        if name == "final":
            x = self.last(self.final_key) if self.final_key else None
            return None if x is None else x[0]
        if name == "reward2":
            pts = self.values(REWARD_KEY)
            return self.mean(REWARD_KEY, after=pts[-1][0] / 2) if pts else None
        if name == "dpi_run":
            return self.mean(DPI_KEY)
        if name == "dpi_epoch":
            pts = self.values(DPI_KEY)
            return self.mean(DPI_KEY, after=pts[-1][0] - st.epoch_steps) if pts else None
        if name == "ess":
            return self.mean(ESS_KEY)
        if name == "collapsed":
            x, thr = self.last(), self.collapse_threshold(st)
            return None if x is None or thr is None else float(x[0] < thr)
        raise ValueError(f"unknown endpoint {name!r}")

    def collapse_threshold(self, st: Settings) -> float | None:
        if st.collapse_below is not None:
            return st.collapse_below
        first = self.eval[0] if self.eval else None
        return first[1] / 2 if first is not None and first[0] == 0 else None


# endpoint -> (column title, decimals)
ENDPOINTS = {
    "best": ("best", 2),
    "last": ("last", 2),
    "lastk": ("mean last K evals", 2),
    "final": ("final eval", 2),
    "reward2": ("train reward, 2nd half", 3),
    "dpi_run": ("d̄π run mean", 4),
    "dpi_epoch": ("d̄π last epoch", 4),
    "ess": ("ESS mean", 3),
}
# endpoints compared in the markdown's paired table (all of them go to paired.csv)
PAIR_ENDPOINTS_MD = ("lastk", "final", "best", "dpi_run")


@dataclass
class Cell:
    runs: list[RunData]

    def by_seed(self, name: str, st: Settings) -> dict[str, float]:
        out = {}
        for r in self.runs:
            v = r.endpoint(name, st)
            if v is not None and not math.isnan(v):
                out[r.seed] = v
        return out

    @property
    def bests(self) -> list[tuple[float, int]]:
        return [b for b in (r.best() for r in self.runs) if b is not None]

    def collapses(self, st: Settings) -> tuple[int, int]:
        flags = list(self.by_seed("collapsed", st).values())
        return int(sum(flags)), len(flags)


def fmt_ci(values: list[float], nd: int) -> str:
    """``mean ± h`` (95 % t-interval half-width); one value alone; none: an em dash."""
    if not values:
        return DASH
    mean, h, _ = t_interval(values)
    return f"{mean:.{nd}f}" if h is None else f"{mean:.{nd}f} ± {h:.{nd}f}"


def _lag_sort(lag: str) -> tuple:
    try:
        return (0, float(lag), lag)
    except ValueError:
        return (1, 0.0, lag)


def build_table(runs: list[RunData], rows: list[str]) -> tuple[list[str], dict]:
    lags = sorted({r.lag for r in runs}, key=_lag_sort)
    cells: dict[tuple[str, str], Cell] = {}
    for r in sorted(runs, key=lambda r: _lag_sort(r.seed)):
        cells.setdefault((r.row, r.lag), Cell([])).runs.append(r)
    return lags, cells


def paper_table(rows: list[str], lags: list[str], cells: dict, st: Settings) -> str:
    """The paper's Table 1 shape: per lag best (steps), last, d̄π over the last epoch, n."""
    head = ["method"]
    for lag in lags:
        head += [f"lag {lag} best (steps)", f"lag {lag} last", f"lag {lag} d̄π", f"lag {lag} n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        parts = [row]
        for lag in lags:
            c = cells.get((row, lag))
            if c is None:
                parts += [DASH] * 4
                continue
            b = c.bests
            best = DASH
            if b:
                steps = "/".join(str(s) for _, s in b)
                best = f"{fmt_ci([v for v, _ in b], 2)} ({steps})"
            last = list(c.by_seed("last", st).values())
            dpi = list(c.by_seed("dpi_epoch", st).values())
            parts += [best, fmt_ci(last, 2), fmt_ci(dpi, 4), str(len(c.runs))]
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def endpoint_table(rows: list[str], lag: str, cells: dict, st: Settings, names) -> str:
    """One lag: every endpoint per row, ``mean ± h`` and n, plus the collapse count."""
    head = ["method", "n", *(ENDPOINTS[k][0].replace("K", str(st.last_k)) for k in names)]
    head.append("collapsed")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        c = cells.get((row, lag))
        if c is None:
            continue
        parts = [row, str(len(c.runs))]
        for k in names:
            parts.append(fmt_ci(list(c.by_seed(k, st).values()), ENDPOINTS[k][1]))
        k_c, n_c = c.collapses(st)
        parts.append(f"{k_c}/{n_c}" if n_c else DASH)
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def fmt_num(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, ".10g")


def _stats_cols(values: list[float]) -> list[str]:
    if not values:
        return ["", "", ""]
    mean, h, _ = t_interval(values)
    std = None
    if len(values) > 1:
        import statistics

        std = statistics.stdev(values)
    return [fmt_num(mean), fmt_num(std), fmt_num(h)]


CSV_ENDPOINTS = ("best", "last", "lastk", "final", "reward2", "dpi_run", "dpi_epoch", "ess")


def table_csv(rows: list[str], lags: list[str], cells: dict, st: Settings) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["row", "lag", "n_seeds", "best_min", "best_max", "best_steps", "dpi_last_mean"]
    for k in CSV_ENDPOINTS:
        head += [f"{k}_mean", f"{k}_std", f"{k}_ci95"]
    head += ["collapsed", "collapse_n", "eval_key", "runs"]
    w.writerow(head)
    for row in rows:
        for lag in lags:
            c = cells.get((row, lag))
            if c is None:
                continue
            b = [v for v, _ in c.bests]
            dpi_last = [x[0] for x in (r.last(DPI_KEY) for r in c.runs) if x is not None]
            line = [
                row,
                lag,
                len(c.runs),
                fmt_num(min(b) if b else None),
                fmt_num(max(b) if b else None),
                "/".join(str(s) for _, s in c.bests),
                fmt_num(sum(dpi_last) / len(dpi_last) if dpi_last else None),
            ]
            for k in CSV_ENDPOINTS:
                line += _stats_cols(list(c.by_seed(k, st).values()))
            k_c, n_c = c.collapses(st)
            keys = sorted({display_key(r.eval_key) for r in c.runs if r.eval_key})
            line += [k_c, n_c, ";".join(keys), ";".join(r.name for r in c.runs)]
            w.writerow(line)
    return buf.getvalue()


def display_key(key: str) -> str:
    """``eval/toy/avg_at_8`` → ``eval/toy/avg@8`` (undo :func:`sat_cli.tracking.mlflow_key`)."""
    return re.sub(r"_at_(\d+)$", r"@\1", key)
