"""Study v5 (docs/results/sat_lag_v5_cpu.md): does SAT undo lag damage where lag demonstrably
hurts? Its pre-registered rules, computed from the per-run rows only
(``sat_cli.report.collapse``; runs tagged ``collapse_design=sat-lag-v5``).

* **Arms** (a method's first word): ``B1`` GSPO at lag 1, ``B8`` GSPO at lag 8, ``S8`` SAT-GSPO
  at lag 8, ``C8`` the dose-matched uniform control at lag 8; ``SEEDS`` paired seeds.
* **Stop rule**: nothing but progress is shown until every planned run (arm x seed) has ended
  (FINISHED or FAILED); a seed missing a finished arm is dropped from every arm; fewer than
  ``MIN_SEEDS`` complete seeds: **underpowered** (the tests are shown, labelled descriptive).
* **Primary endpoint**: the column ``eval_window``, the mean of ``E_200 .. E_300``.
* **Tests** (paired over the complete seeds, two-sided paired t at ``ALPHA``; Wilcoxon as a
  sensitivity analysis), hierarchical: **M** B8 - B1 < 0 (mean below 0 and p < ALPHA); only if M
  holds, **P1** S8 - B8 with the recovery fraction ``mean(S8 - B8) / mean(B1 - B8)`` and its
  seed-bootstrap 95 % CI; only if P1 is positive and significant, **P2** S8 - C8.
* **Bounded null**: P1 not positive-significant and the upper bound of its 95 % t-interval below
  ``BOUND`` x the mean gap ``mean(B1 - B8)``.
* **Secondary, descriptive**: early crash (exact McNemar vs B8), the final evaluation, the
  realised dose of S8 and C8, d̄π and the ledger's split, per arm.
"""

from __future__ import annotations

import statistics

from sat_cli.report.collapse import StudyRow
from sat_cli.report.collapse_pilot2 import provenance
from sat_cli.report.stats import Paired, paired

DESIGN = "sat-lag-v5"
ARMS = ("B1", "B8", "S8", "C8")
SEEDS = tuple(range(5000, 5016))
MIN_SEEDS = 14
ALPHA = 0.05
BOUND = 0.25  # the bounded null: recovery below a quarter of the lag gap
BOOT_N, BOOT_SEED = 10_000, 55  # the seed bootstrap of the recovery fraction (fixed: reproducible)
ENDED = ("FINISHED", "FAILED")

WAITING = "No verdict yet"
UNDERPOWERED = "Underpowered"
M_FAILS = "The manipulation failed"
BEYOND = "SAT recovers part of the lag damage, beyond a dose-matched uniform tightening"
NOT_BEYOND = "SAT recovers part of the lag damage; not more than a dose-matched uniform tightening"
HARMS = "SAT lowers the primary endpoint at lag 8"
BOUNDED = "Bounded null"
INCONCLUSIVE = "Inconclusive"


def arm_of(r: StudyRow) -> str:
    return r.method.split()[0] if r.method else ""


def complete_seeds(rows: list[StudyRow]) -> tuple[list[str], list[str]]:
    """``(complete, dropped)``: the seeds with a FINISHED run and a primary value in every arm,
    and those that lack one in some arm (dropped from all arms: the stop rule)."""
    have: dict[str, set[str]] = {}
    seeds: list[str] = []
    for r in rows:
        if r.seed not in seeds:
            seeds.append(r.seed)
        if r.status == "FINISHED" and r.eval_window:
            have.setdefault(r.seed, set()).add(arm_of(r))
    done = [s for s in seeds if have.get(s, set()) >= set(ARMS)]
    return done, [s for s in seeds if s not in done]


def values(rows: list[StudyRow], arm: str, seeds: list[str], column: str) -> dict[str, float]:
    out = {}
    for r in rows:
        v = getattr(r, column)
        if arm_of(r) == arm and r.seed in seeds and r.status == "FINISHED" and v != "":
            out[r.seed] = float(v)
    return out


def paired_test(rows, a: str, b: str, seeds: list[str], column: str = "eval_window") -> Paired:
    res = paired(values(rows, a, seeds, column), values(rows, b, seeds, column))
    if res is None:
        raise ValueError(f"no seed with both {a} and {b}")
    return res


def significant(res: Paired, sign: int) -> bool:
    """The paired t test rejects at ALPHA with a mean difference of the given sign."""
    return res.p_t < ALPHA and res.mean * sign > 0  # nan p (no variance): False


def recovery(rows, seeds: list[str]) -> tuple[float, float, float, int]:
    """``(R, lo, hi, dropped)``: ``R = mean(S8 - B8) / mean(B1 - B8)`` over the seeds, and the
    2.5 / 97.5 percentiles of ``R`` over ``BOOT_N`` seed resamples (numpy's default generator,
    seed ``BOOT_SEED``); resamples whose gap ``mean(B1 - B8)`` is not positive have no ``R`` and
    are dropped (their number is the fourth value)."""
    import numpy as np

    s8, b8, b1 = (values(rows, arm, seeds, "eval_window") for arm in ("S8", "B8", "B1"))
    num = np.array([s8[s] - b8[s] for s in seeds], dtype=np.float64)
    den = np.array([b1[s] - b8[s] for s in seeds], dtype=np.float64)
    point = float(num.mean() / den.mean()) if den.mean() > 0 else float("nan")
    idx = np.random.default_rng(BOOT_SEED).integers(0, len(seeds), size=(BOOT_N, len(seeds)))
    n_mean, d_mean = num[idx].mean(axis=1), den[idx].mean(axis=1)
    keep = d_mean > 0
    ratios = n_mean[keep] / d_mean[keep]
    if not ratios.size:
        return point, float("nan"), float("nan"), BOOT_N
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return point, float(lo), float(hi), int(BOOT_N - keep.sum())


def _p(x: float) -> str:
    return "—" if x != x else (f"{x:.3g}" if x >= 1e-4 else f"{x:.1e}")


def paired_line(name: str, res: Paired) -> str:
    return (
        f"{name}: mean {res.mean:+.2f} points [95 % CI {res.lo:+.2f}, {res.hi:+.2f}], "
        f"paired t p = {_p(res.p_t)}, Wilcoxon p = {_p(res.p_w)}; a > b in {res.a_wins}, "
        f"a < b in {res.b_wins} of {res.n} seeds"
    )


def decide(rows: list[StudyRow]) -> dict:
    """The pre-registered decision (module doc) as a dict: ``verdict`` (one of the constants
    above), the tests run (``M``, ``P1``, ``P2``: ``Paired`` or absent), ``recovery``,
    ``bounded`` and the seeds."""
    ended = {(arm_of(r), r.seed) for r in rows if r.status in ENDED}
    planned = {(a, str(s)) for a in ARMS for s in SEEDS}
    if not planned <= ended:
        return {"verdict": WAITING, "ended": len(planned & ended), "planned": len(planned)}
    seeds, dropped = complete_seeds(rows)
    out: dict = {"seeds": seeds, "dropped": dropped, "underpowered": len(seeds) < MIN_SEEDS}
    if len(seeds) < 2:
        return {**out, "verdict": UNDERPOWERED}
    out["M"] = m = paired_test(rows, "B8", "B1", seeds)
    if not significant(m, -1):
        return _final(out, M_FAILS)
    out["P1"] = p1 = paired_test(rows, "S8", "B8", seeds)
    out["recovery"] = recovery(rows, seeds)
    gap = -m.mean
    out["bounded"] = bool(p1.hi < BOUND * gap)
    if significant(p1, +1):
        out["P2"] = p2 = paired_test(rows, "S8", "C8", seeds)
        verdict = BEYOND if significant(p2, +1) else NOT_BEYOND
    elif significant(p1, -1):
        verdict = HARMS
    else:
        verdict = BOUNDED if out["bounded"] else INCONCLUSIVE
    return _final(out, verdict)


def _final(out: dict, verdict: str) -> dict:
    """The rules' verdict, replaced by UNDERPOWERED (kept as ``would``) below MIN_SEEDS."""
    return {**out, "verdict": UNDERPOWERED if out["underpowered"] else verdict, "would": verdict}


def _mean(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f}" if xs else "—"


def _arm_table(rows: list[StudyRow], seeds: list[str]) -> str:
    head = (
        "| arm | seeds | primary: mean E_200–E_300 | final avg@8 (2,048 samples) "
        "| early crash (E_20 < ½ E_0) | dose (clipped fraction) | d̄π "
        "| ledger: mismatch / staleness |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for arm in ARMS:
        mine = [r for r in rows if arm_of(r) == arm and r.seed in seeds and r.status == "FINISHED"]
        col = {c: [float(getattr(r, c)) for r in mine if getattr(r, c) != ""] for c in COLS}
        crash = [r.early_crash for r in mine if r.early_crash]
        mis, sta = col["ledger_mismatch"], col["ledger_staleness"]
        split = f"{statistics.mean(mis):.4f} / {statistics.mean(sta):.4f}" if mis and sta else "—"
        lines.append(
            f"| {arm} | {len(mine)} | {_mean(col['eval_window'])} | {_mean(col['final_eval'])} "
            f"| {crash.count('1')}/{len(crash)} | {_fmt4(col['dose'])} | {_fmt4(col['dpi_mean'])} "
            f"| {split} |"
        )
    return "\n".join(lines)


COLS = ("eval_window", "final_eval", "dose", "dpi_mean", "ledger_mismatch", "ledger_staleness")


def _fmt4(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4f}" if xs else "—"


def crash_mcnemar(rows, arm: str, seeds: list[str]) -> str:
    from sat_cli.report.collapse import mcnemar

    def as_collapse(a: str) -> list[StudyRow]:
        # mcnemar pairs the column ``collapsed``: here the early crash
        import dataclasses

        return [
            dataclasses.replace(r, collapsed=int(r.early_crash))
            for r in rows
            if arm_of(r) == a and r.seed in seeds and r.early_crash
        ]

    n, only_b8, only_arm, p = mcnemar(as_collapse("B8"), as_collapse(arm))
    return f"{arm} vs B8: only B8 crashed {only_b8}, only {arm} {only_arm} (n = {n}), p = {_p(p)}"


def lag_study_markdown(rows: list[StudyRow]) -> str:
    mine = [r for r in rows if r.design == DESIGN]
    d = decide(mine)
    if d["verdict"] == WAITING:
        counts = ", ".join(
            f"{a} {sum(arm_of(r) == a and r.status == 'FINISHED' for r in mine)}" for a in ARMS
        )
        return (
            f"{WAITING}: {d['ended']} of {d['planned']} planned runs have ended (finished runs "
            f"per arm: {counts}). The stop rule shows no outcome before all runs end.\n\n"
            + provenance(mine)
            + "\n"
        )
    seeds, dropped = d["seeds"], d["dropped"]
    out = [_arm_table(mine, seeds), ""]
    out.append(
        f"Complete seeds: {len(seeds)} of {len(SEEDS)}"
        + (f" (dropped from every arm: {', '.join(dropped)})" if dropped else "")
        + "."
    )
    label = " (descriptive: underpowered)" if d["underpowered"] else ""
    if "M" in d:
        holds = "holds" if significant(d["M"], -1) else "fails"
        out.append(f"- **M**{label} " + paired_line("B8 − B1", d["M"]) + f": **{holds}**.")
    if "P1" in d:
        r, lo, hi, n_drop = d["recovery"]
        extra = f"; {n_drop} resamples without a positive gap dropped" if n_drop else ""
        out.append(
            f"- **P1**{label} "
            + paired_line("S8 − B8", d["P1"])
            + f"; recovery fraction (S8 − B8)/(B1 − B8) = {r:.3f} [seed bootstrap 95 % CI "
            f"{lo:.3f}, {hi:.3f}{extra}]."
        )
        out.append(
            f"- **P2**{label} " + paired_line("S8 − C8", d["P2"]) + "."
            if "P2" in d
            else "- **P2** not tested (P1 is not positive and significant)."
        )
    elif "M" in d:
        out.append("- **P1**, **P2** not tested (M does not hold).")
    out += ["", _verdict_sentence(d), ""]
    if len(seeds) >= 1:
        out.append(
            "Secondary, descriptive: early crash, exact McNemar: "
            + "; ".join(crash_mcnemar(mine, a, seeds) for a in ("S8", "C8"))
            + "."
        )
        fin = [
            paired_line(f"final eval {a} − B8", paired_test(mine, a, "B8", seeds, "final_eval"))
            for a in ("S8", "C8")
            if len(values(mine, a, seeds, "final_eval")) >= 2
        ]
        if fin:
            out.append("Secondary, descriptive: " + "; ".join(fin) + ".")
    return "\n".join(out) + "\n\n" + provenance(mine) + "\n"


def _verdict_sentence(d: dict) -> str:
    v = d["verdict"]
    if v == UNDERPOWERED:
        would = f" (the rules would read: {d['would']})" if d.get("would") else ""
        return (
            f"Verdict: **{UNDERPOWERED}**: {len(d['seeds'])} complete seeds, fewer than "
            f"{MIN_SEEDS}; no confirmatory claim{would}."
        )
    if v == M_FAILS:
        return (
            f"Verdict: **{M_FAILS}**: lag 8 did not lower the primary endpoint significantly "
            "(M); P1 and P2 are not tested, and the study says nothing about SAT."
        )
    text = f"Verdict: **{v}**."
    if d.get("bounded"):
        gap = -d["M"].mean
        text += (
            f" Bounded null: SAT recovers less than {BOUND:.0%} of the lag gap (P1's 95 % CI "
            f"upper bound {d['P1'].hi:+.2f} < {BOUND} × gap {gap:.2f} = {BOUND * gap:.2f})."
        )
    return text
