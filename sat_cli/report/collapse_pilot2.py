"""Pilot 2 of the collapse study: its rules, fixed in docs/results/collapse_cpu.md (section
"Pilot 2") before any of its runs, computed from the per-run rows only
(``sat_cli.report.collapse``).

* **Phenotype** of a collapsed run: **late** iff its best evaluation came at step >=
  ``LATE_MIN_STEP`` and is at least ``late_gain`` points above its step-0 evaluation (the run
  learned, then collapsed: the paper's claim); otherwise **early** (divergence, pilot 1's kind).
  ``late_gain`` is the run's tag ``collapse_late_gain``, else ``LATE_GAIN``.
* **R1** at least ``R1_FRACTION`` of the candidate's lag-8 runs collapse *late*;
  **R2** none of its lag-1 runs collapses (late or early);
  **R3** in every lag-8 run, SAT can act (``q`` below its threshold) on at least
  ``R3_MIN`` of the steps of the fixed window 1-32 (column ``can_act_early``).
* A candidate is decided once all its runs finished (``RUNS_PER_LAG`` per lag). Outcome: all
  three rules → qualifies; R2 or R3 failing → round 2 at 0.67 × lr (a smaller step lowers both
  the lag-1 collapse risk and ``q``); only R1 failing → round 2 at 600 steps. Round-2 runs
  (tag ``collapse_design=pilot2-r2``) get no further round.
* **Selection**: the first qualifying candidate in the order D1, D2, D3, D4 (a method's first
  word names its candidate), once every candidate before it is decided; round 2 likewise over
  the candidates sent to it; with every candidate decided and none qualifying, the stop rule.
"""

from __future__ import annotations

from sat_cli.report.collapse import StudyRow, method_order

LATE_MIN_STEP = 40
LATE_GAIN = 4.0  # evaluation points (percent) above the step-0 evaluation
R1_FRACTION = 2 / 3
R3_MIN = 0.8
RUNS_PER_LAG = 3
ROUND1, ROUND2 = "pilot2", "pilot2-r2"
NONE_QUALIFIED = "none of these candidates qualified"
CANDIDATES = ("D1", "D2", "D3", "D4")  # the design's order; a method's first word names it


def phenotype(r: StudyRow) -> str:
    """``late``, ``early``, or ``""`` for a run that did not collapse (module doc)."""
    if r.collapsed != 1:
        return ""
    gain = float(r.late_gain) if r.late_gain else LATE_GAIN
    step_ok = r.best_step != "" and int(r.best_step) >= LATE_MIN_STEP
    return "late" if step_ok and r.eval_best >= r.eval_first + gain else "early"


def rules(lag1: list[StudyRow], lag8: list[StudyRow]) -> tuple[bool, bool, bool]:
    r1 = bool(lag8) and sum(phenotype(r) == "late" for r in lag8) >= R1_FRACTION * len(lag8)
    r2 = bool(lag1) and all(r.collapsed == 0 for r in lag1)
    r3 = bool(lag8) and all(r.can_act_early and float(r.can_act_early) >= R3_MIN for r in lag8)
    return r1, r2, r3


def outcome(r: tuple[bool, bool, bool], round2: bool) -> str:
    r1, r2, r3 = r
    if all(r):
        return "qualifies"
    if round2:
        return "does not qualify"
    if not (r2 and r3):
        return "round 2 at 0.67 × lr"
    return "round 2 at 600 steps"


def _done(rows: list[StudyRow]) -> bool:
    return len(rows) >= RUNS_PER_LAG and all(
        r.status == "FINISHED" and r.collapsed in (0, 1) for r in rows
    )


def _count(rows: list[StudyRow]) -> str:
    kinds = [phenotype(r) for r in rows]
    late, early = kinds.count("late"), kinds.count("early")
    return f"{late + early}/{len(rows)} ({late} late, {early} early)"


def _curve(rows: list[StudyRow]) -> str:
    return ", ".join(
        f"{r.eval_first:.1f}→{r.eval_best:.1f}@{r.best_step or '—'}→{r.eval_last:.1f}" for r in rows
    )


def provenance(rows: list[StudyRow]) -> str:
    commits: dict[str, int] = {}
    for r in rows:
        commits[r.commit or "?"] = commits.get(r.commit or "?", 0) + 1
    starts = sorted(r.started for r in rows if r.started)
    span = f"; first run started {starts[0]}, last {starts[-1]}" if starts else ""
    code = ", ".join(f"{c[:12]} ({n} runs)" for c, n in commits.items())
    return f"Runs: {len(rows)}; code: {code}{span}."


def _verdict(outs: dict[tuple[str, bool], tuple[str, str]]) -> str:
    """The selection, round 2 and stop rule over the candidates in the design's order; no verdict
    while a candidate that could decide it has not finished (or not started)."""
    waiting = []
    for cid in CANDIDATES:  # round 1
        m, out = outs.get((cid, False), (cid, "not yet run"))
        if out == "qualifies" and not waiting:
            return f"Selected: **{m}** (the first qualifying candidate in the design's order)."
        if out.startswith(("pending", "not yet run")):
            waiting.append(f"{cid} ({out})")
    if waiting:
        return "No verdict yet: waiting for " + ", ".join(waiting) + "."
    to_r2 = [(cid, outs[(cid, False)][1]) for cid in CANDIDATES]
    to_r2 = [(cid, out[len("round 2 ") :]) for cid, out in to_r2 if out.startswith("round 2")]
    for cid, change in to_r2:
        m, out = outs.get((cid, True), (cid, "not yet run"))
        if out == "qualifies" and not waiting:
            return f"Selected in round 2: **{m}** (the first qualifying candidate in order)."
        if out.startswith(("pending", "not yet run")):
            waiting.append(f"{cid} {change} ({out})")
    if waiting:
        return "No candidate qualifies in round 1. Round 2: " + "; ".join(waiting) + "."
    return f"Pilot 2: **{NONE_QUALIFIED}**."


def pilot2_markdown(rows: list[StudyRow]) -> str:
    head = (
        "| candidate | lag 1 collapsed | lag 8 collapsed | lag 8 time to collapse "
        "| SAT can act, lag 8 (fraction of steps 1–32) | eval first→best@step→last, lag 1 "
        "| eval first→best@step→last, lag 8 | R1 / R2 / R3 | outcome |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines, notes, outs = [head], [], {}
    # a round-2 sweep keeps its candidate's method label (the design's rule): the round is part
    # of the key, so the two rounds of one candidate are two rows, never one pooled row
    groups = [(m, is_r2) for m in method_order(rows) for is_r2 in (False, True)]
    for m, is_r2 in groups:
        mine = [r for r in rows if r.method == m and (r.design == ROUND2) == is_r2]
        if not mine:
            continue
        lag1 = [r for r in mine if r.lag == "1"]
        lag8 = [r for r in mine if r.lag == "8"]
        if not lag8:  # the shared start of a candidate (one lag-1 run): context only
            notes.append(f"{m}: {_curve(lag1)} (lag 1, the start of a candidate).")
            continue
        if _done(lag1) and _done(lag8):
            rule = rules(lag1, lag8)
            out = outcome(rule, is_r2)
            yn = " / ".join("yes" if x else "no" for x in rule)
        else:
            n_done = sum(r.status == "FINISHED" for r in lag1 + lag8)
            out, yn = f"pending ({n_done} of {2 * RUNS_PER_LAG} runs finished)", "—"
        label = f"{m} (round 2)" if is_r2 else m
        outs[(m.split()[0], is_r2)] = (label, out)
        t = ", ".join(r.t_collapse or "—" for r in lag8)
        act = ", ".join(r.can_act_early or "—" for r in lag8)
        lines.append(
            f"| {label} | {_count(lag1)} | {_count(lag8)} | {t} | {act} | {_curve(lag1)} "
            f"| {_curve(lag8)} | {yn} | {out} |"
        )
    verdict = _verdict(outs)
    out_text = "\n".join(lines) + "\n\n" + verdict + "\n"
    if notes:
        out_text += "\n" + "\n".join(notes) + "\n"
    return out_text + "\n" + provenance(rows) + "\n"


# ----------------------------------------------------------------------------- the record
# Added after pilot 2 ended (issue 55), descriptive, no rule of the pilot changes: what its rows
# and curves show beyond the qualification rules, computed here so the write-up quotes code.


def _candidate(r: StudyRow) -> str:
    return r.method.split()[0]


def early_crashes(rows: list[StudyRow], curves: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """``(candidate, lag) -> (runs with E_20 < 0.5 * E_0, runs)`` over both rounds, from the
    evaluation curves (``read_curves``); the shared start (no lag-8 run) is left out."""
    from sat_cli.report.collapse import early_crash

    compared = {(r.method, r.design) for r in rows if r.lag == "8"}
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for r in rows:
        crash = early_crash(curves.get((r.run, "eval"), []))
        if (r.method, r.design) not in compared or crash is None:
            continue
        k, n = out.get((_candidate(r), r.lag), (0, 0))
        out[(_candidate(r), r.lag)] = (k + crash, n + 1)
    return out


def lag_pairs(rows: list[StudyRow]) -> list[tuple[str, str, float]]:
    """``(candidate and round, seed, E_last at lag 8 - E_last at lag 1)`` for every seed run
    at both lags, in the rows' order (both rounds; their last evaluation: step 300 or 600)."""
    at = {}
    for r in rows:
        group = f"{_candidate(r)} round {2 if r.design == ROUND2 else 1}"
        at[(group, r.seed, r.lag)] = r.eval_last
    return [
        (group, seed, v - at[(group, seed, "1")])
        for (group, seed, lag), v in at.items()
        if lag == "8" and (group, seed, "1") in at
    ]


def _sign_line(pairs: list[tuple[str, str, float]]) -> str:
    from scipy import stats

    from sat_cli.report.stats import t_interval

    diffs = [d for *_, d in pairs]
    rounds = [
        f"{label} {sum(d < 0 for g, _, d in pairs if g.endswith(suffix))} of "
        f"{sum(g.endswith(suffix) for g, _, _ in pairs)}"
        for label, suffix in (("round 1", "round 1"), ("round 2", "round 2"))
    ]
    below = sum(d < 0 for d in diffs)
    p_sign = stats.binomtest(below, sum(d != 0 for d in diffs), 0.5).pvalue
    mean, half, n = t_interval(diffs)
    groups = list(dict.fromkeys(g for g, _, _ in pairs))
    above = {g: sum(d > 0 for h, _, d in pairs if h == g) for g in groups}
    total = {g: sum(h == g for h, _, _ in pairs) for g in groups}
    flipped = [f"{g} ({above[g]} of {total[g]})" for g in groups if 2 * above[g] > total[g]]
    text = (
        "Lag 8 ended below lag 1 (last evaluation, same candidate, round and seed) in "
        + "; ".join(rounds)
        + f"; both rounds {below} of {len(diffs)} pairs (two-sided sign test p = {p_sign:.2g}). "
        f"Mean difference lag 8 − lag 1: {mean:+.1f} points, 95 % t-interval "
        f"{mean - half:+.1f} … {mean + half:+.1f} (n = {n})."
    )
    if flipped:
        text += " Lag 8 above lag 1 in most pairs: " + ", ".join(flipped) + "."
    return text


def record_markdown(rows: list[StudyRow], curves: dict) -> str:
    """The corrected record of pilot 2 (collapse_cpu.md): the early crash per candidate and lag
    with Fisher's exact test, and the lag gap of the last evaluation over both rounds."""
    from scipy import stats

    crashes = early_crashes(rows, curves)
    lines = [
        "| candidate | early crash (E_20 < ½ E_0), lag 8 | lag 1 | Fisher exact p |",
        "|---|---|---|---|",
    ]
    for cid in CANDIDATES:
        (k8, n8), (k1, n1) = crashes.get((cid, "8"), (0, 0)), crashes.get((cid, "1"), (0, 0))
        if n8 and n1:
            p = stats.fisher_exact([[k8, n8 - k8], [k1, n1 - k1]]).pvalue
            lines.append(f"| {cid} | {k8}/{n8} | {k1}/{n1} | {p:.3g} |")
    return "\n".join(lines) + "\n\n" + _sign_line(lag_pairs(rows)) + "\n"
