"""The collapse study's analysis (docs/results/collapse_cpu.md): per-run outcomes, the pilot's
qualification rules and the confirmatory McNemar tests.

Two steps, so that a write-up's numbers come from a committed file and nothing else:

1. ``study_rows(runs)`` turns the runs of a sweep (``RunData`` loaded by ``sat report``) into
   one row per run: its collapse outcome, time to collapse, evaluations, minimum ESS, the
   fraction of steps on which SAT can act, and its git commit. ``rows_csv`` writes them.
2. ``study_markdown(rows)`` derives every number of the write-up from those rows alone (read
   back with ``read_rows``): ``sat report <file>.csv`` prints it, and a test regenerates the
   committed write-up's tables byte for byte.

Definitions (fixed in the design before any run): with ``E_k`` the in-training evaluation at
step ``k`` and ``best_k = max_{j <= k} E_j``, a run **collapses** iff its last two evaluations
are both below ``0.5 * max_k E_k`` and its mean training reward over the last 10 steps is below
``0.5 *`` the largest 10-step moving mean of that reward; its **time to collapse** is the first
evaluation step ``k`` from which every evaluation is below ``0.5 * best_k`` (none: censored).
**SAT can act** on a step iff ``q < max(ln(1 + eps_high), -ln(1 - eps_low))``, with ``q`` the
logged ``staleness/q_shadow`` (runs without SAT) or ``sat/q`` (SAT runs); the fraction counts
the steps before the time to collapse (all steps without one).

Study v5 (docs/results/sat_lag_v5_cpu.md) adds, per run: the mean of the evaluations at steps
200-300 (its primary endpoint), the early crash ``E_20 < 0.5 * E_0``, the final evaluation, the
realised clipped fraction (the dose) and the mean d̄π; ``sat_cli.report.lag_study`` holds its
rules.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, fields

from sat_cli import metric_names as M
from sat_cli.report.regime import sat_thresholds

HALF = 0.5
REWARD_WINDOW = 10
# the ledger's two parts of d̄π (engine mismatch, staleness), when the run logged them
LEDGER_KEYS = (M.LEDGER_MISMATCH_PART, M.LEDGER_STALENESS_PART)
CAN_ACT_MIN = 0.5  # pilot rule 3: SAT can act on at least half of the pre-collapse steps


@dataclass
class StudyRow:
    method: str
    lag: str
    seed: str
    run: str
    status: str
    commit: str
    last_step: int
    evals: int
    eval_first: float
    eval_best: float
    eval_last: float
    collapsed: int  # 1 / 0
    t_collapse: str  # an evaluation step, or "" (censored)
    min_ess: str
    can_act_frac: str
    ledger_mismatch: str  # mean over the run of the ledger's two parts of d̄π ("" if absent)
    ledger_staleness: str
    # added for pilot 2 (docs/results/collapse_cpu.md); "" in pilot 1's CSV, which lacks them
    design: str = ""  # the run's tag collapse_design: which rules apply (collapse_pilot2.py)
    best_step: str = ""  # first evaluation step of the best evaluation
    late_gain: str = ""  # the run's tag collapse_late_gain ("" = the design's default)
    can_act_early: str = ""  # fraction of steps EARLY_WINDOW on which SAT can act
    started: str = ""  # the MLflow run's start time, UTC (a resumed run keeps its first)
    # added for study v5 (docs/results/sat_lag_v5_cpu.md); absent from pilot 1's and 2's CSVs
    eval_window: str = ""  # mean of the evaluations at steps PRIMARY_WINDOW (both ends included)
    early_crash: str = ""  # 1 iff E_20 < 0.5 * E_0 (EARLY_CRASH_STEP), "" without both
    final_eval: str = ""  # the final evaluation (final/<bench>/avg@k), "" if not logged
    dose: str = ""  # mean over steps of loss/clipfrac (+ sat/clipfrac_sat_band when logged)
    dpi_mean: str = ""  # mean over steps of d̄π (staleness/abs_logratio_mean or its stand-in)


COLUMNS = [f.name for f in fields(StudyRow)]
COLUMNS_PILOT1 = COLUMNS[: COLUMNS.index("design")]  # the columns of pilot 1's CSV
COLUMNS_PILOT2 = COLUMNS[: COLUMNS.index("eval_window")]  # ... and of pilot 2's
EARLY_WINDOW = (1, 32)  # pilot 2's rule 3 window: training steps 1..32, whatever happens later
PRIMARY_WINDOW = (200, 300)  # study v5's primary endpoint: the mean of E_200 .. E_300
EARLY_CRASH_STEP = 20  # study v5's early crash: E_20 below half of E_0


def _fmt(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


def time_to_collapse(evals: list[tuple[int, float]]) -> int | None:
    """The first evaluation step from which every evaluation is below half the best so far."""
    best = -math.inf
    for i, (step, value) in enumerate(evals):
        best = max(best, value)
        if all(v < HALF * best for _, v in evals[i:]):
            return step
    return None


def collapsed(evals: list[tuple[int, float]], rewards: list[tuple[int, float]]) -> bool:
    """Both parts of the definition (module doc); needs two evaluations and 10 rewards."""
    if len(evals) < 2 or len(rewards) < REWARD_WINDOW:
        raise ValueError("a collapse needs at least 2 evaluations and 10 logged rewards")
    top = max(v for _, v in evals)
    low_eval = all(v < HALF * top for _, v in evals[-2:])
    r = [v for _, v in rewards]
    means = [
        sum(r[i : i + REWARD_WINDOW]) / REWARD_WINDOW for i in range(len(r) - REWARD_WINDOW + 1)
    ]
    return low_eval and means[-1] < HALF * max(means)


def can_act_threshold(eps_low: float, eps_high: float) -> float:
    """``max(ln(1 + eps_high), -ln(1 - eps_low))``: at or above it SAT changes no gradient."""
    return max(sat_thresholds(eps_low, eps_high))


def can_act_fraction(q: list[tuple[int, float]], threshold: float, until: int | None):
    """Fraction of the logged steps (before ``until``, if given) with ``q < threshold``."""
    steps = [v for s, v in q if until is None or s < until]
    return sum(v < threshold for v in steps) / len(steps) if steps else None


def window_fraction(q: list[tuple[int, float]], threshold: float, window=EARLY_WINDOW):
    """Fraction of the logged steps ``window[0] <= step <= window[1]`` with ``q < threshold``."""
    steps = [v for s, v in q if window[0] <= s <= window[1]]
    return sum(v < threshold for v in steps) / len(steps) if steps else None


def window_mean(evals: list[tuple[int, float]], window=PRIMARY_WINDOW) -> float | None:
    """Mean of the evaluations at steps ``window[0] <= step <= window[1]`` (None if none)."""
    vals = [v for s, v in evals if window[0] <= s <= window[1]]
    return sum(vals) / len(vals) if vals else None


def early_crash(evals: list[tuple[int, float]], step: int = EARLY_CRASH_STEP) -> int | None:
    """1 iff the evaluation at ``step`` is below half the one at step 0 (None without both)."""
    at = dict(evals)
    if 0 not in at or step not in at:
        return None
    return int(at[step] < HALF * at[0])


def mean_dose(clipfrac: list[tuple[int, float]], band: list[tuple[int, float]]) -> float | None:
    """Mean over the logged steps of the clipped fraction plus, step by step, SAT's band (the
    fraction only SAT's contracted interval clips; 0 on a step without it): the dose of
    ``sat calibrate-control``, realised in a run."""
    if not clipfrac:
        return None
    extra = dict(band)
    return sum(v + extra.get(s, 0.0) for s, v in clipfrac) / len(clipfrac)


def _utc(ms: int) -> str:
    import datetime as dt

    if not ms:
        return ""
    t = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _mean(series: list[tuple[int, float]]) -> float | None:
    return sum(v for _, v in series) / len(series) if series else None


def study_row(run) -> StudyRow:
    """One run's outcomes (``run``: a ``sat_cli.report.tables.RunData``)."""
    ev, rewards = run.eval, run.values(M.REWARD_MEAN)
    ok = len(ev) >= 2 and len(rewards) >= REWARD_WINDOW
    t = time_to_collapse(ev) if ok else None
    q = run.values(M.SAT_Q_SHADOW) or run.values(M.SAT_Q)
    thr = can_act_threshold(run.eps_low, run.eps_high)
    ess = [v for _, v in run.values(M.ESS)]
    steps = [s for s, _ in rewards]
    final = run.last(run.final_key) if run.final_key else None
    return StudyRow(
        method=run.method,
        lag=run.lag,
        seed=run.seed,
        run=run.name,
        status=run.status,
        commit=run.commit,
        last_step=max(steps) if steps else 0,
        evals=len(ev),
        eval_first=ev[0][1] if ev else math.nan,
        eval_best=max(v for _, v in ev) if ev else math.nan,
        eval_last=ev[-1][1] if ev else math.nan,
        collapsed=int(collapsed(ev, rewards)) if ok else -1,
        t_collapse="" if t is None else str(t),
        min_ess=_fmt(min(ess) if ess else None),
        can_act_frac=_fmt(can_act_fraction(q, thr, t)),
        ledger_mismatch=_fmt(_mean(run.values(LEDGER_KEYS[0]))),
        ledger_staleness=_fmt(_mean(run.values(LEDGER_KEYS[1]))),
        design=run.tags.get("collapse_design", ""),
        best_step=str(next(s for s, v in ev if v == max(x for _, x in ev))) if ev else "",
        late_gain=run.tags.get("collapse_late_gain", ""),
        can_act_early=_fmt(window_fraction(q, thr)),
        started=_utc(run.start_time),
        eval_window=_fmt(window_mean(ev)),
        early_crash=_fmt(early_crash(ev)),
        final_eval=_fmt(final[0] if final else None),
        dose=_fmt(mean_dose(run.values(M.CLIPFRAC), run.values(M.SAT_BAND))),
        dpi_mean=_fmt(_mean(run.values(M.DPI))),  # the series the report stores as d̄π
    )


def study_rows(runs) -> list[StudyRow]:
    return [study_row(r) for r in runs]


def method_order(rows: list[StudyRow]) -> list[str]:
    """The methods of ``rows`` in order of first appearance (the sweeps' order)."""
    seen: list[str] = []
    for r in rows:
        if r.method not in seen:
            seen.append(r.method)
    return seen


def rows_csv(rows: list[StudyRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        vals = [getattr(r, c) for c in COLUMNS]
        w.writerow([_fmt(v) if isinstance(v, float) else v for v in vals])
    return buf.getvalue()


def _kinds() -> dict:
    """What each column of a collapse-study CSV may hold (``report.csv_checks``)."""
    from sat_cli.report import csv_checks as C

    kinds = dict.fromkeys(COLUMNS, C.optional_number)  # "" or a number (parsed where used)
    kinds |= dict.fromkeys(("method", "lag", "seed", "run", "commit", "design", "started"), C.text)
    kinds |= {
        "status": C.one_of(*C.STATUSES),
        "last_step": C.integer(0),
        "evals": C.integer(0),
        "collapsed": C.integer(-1, 1),  # 1 / 0, -1: too short to tell
        "t_collapse": C.optional_integer(0),
        "best_step": C.optional_integer(0),
        "early_crash": C.one_of("", "0", "1"),
    }
    return kinds


def read_rows(text: str) -> list[StudyRow]:
    """The rows of a CSV written by ``rows_csv``: every column checked
    (``report.csv_checks``); ``ValueError`` naming the line and the column for another file."""
    from sat_cli.report.csv_checks import checked_rows

    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames not in (COLUMNS, COLUMNS_PILOT1, COLUMNS_PILOT2):
        raise ValueError(f"not a collapse-study CSV: columns {reader.fieldnames}, want {COLUMNS}")
    out = []
    for _, d in checked_rows(reader, _kinds()):
        out.append(
            StudyRow(
                **{
                    **d,
                    "last_step": int(d["last_step"]),
                    "evals": int(d["evals"]),
                    "collapsed": int(d["collapsed"]),
                    **{k: float(d[k] or "nan") for k in ("eval_first", "eval_best", "eval_last")},
                }
            )
        )
    return out


def mcnemar(a: list[StudyRow], b: list[StudyRow]) -> tuple[int, int, int, float]:
    """Exact McNemar on the seeds both arms have: ``(n, only_a, only_b, p)``, two-sided
    binomial test of the discordant pairs at 1/2 (``p = 1`` without discordant pairs)."""
    from scipy import stats

    ca = {r.seed: r.collapsed for r in a if r.collapsed in (0, 1)}
    cb = {r.seed: r.collapsed for r in b if r.collapsed in (0, 1)}
    seeds = sorted(set(ca) & set(cb))
    only_a = sum(ca[s] == 1 and cb[s] == 0 for s in seeds)
    only_b = sum(ca[s] == 0 and cb[s] == 1 for s in seeds)
    n_disc = only_a + only_b
    p = float(stats.binomtest(only_a, n_disc, 0.5).pvalue) if n_disc else 1.0
    return len(seeds), only_a, only_b, p
