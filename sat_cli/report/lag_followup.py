"""Study v5's follow-up F1 (docs/results/sat_lag_v5_cpu.md, "Follow-up F1"): does SAT-GSPO beat
a uniform tightening of equal *live* dose? Registered after the study's primary result was read,
so its single test stands alone at ``ALPHA``. Computed from the per-run rows only
(``sat_cli.report.collapse``), as the study's rules are (``sat_cli.report.lag_study``).

* **Live calibration** (runs tagged ``CALIB_DESIGN``, seed 4999): one ``S8`` run and the uniform
  control at the radius scales ``GRID``, each a method whose first word is ``K<scale>``. The
  chosen scale is the one whose realised ``dose`` is nearest S8's (a tie: the larger scale). When
  S8's dose lies outside the grid's doses, the grid is extended once on that side (``EXTEND``):
  until that run has finished, the choice is "extend", not a scale.
* **Arm L8** (runs tagged ``DESIGN``): ``clip=ppo_tight`` at the chosen scale, lag 8, the study's
  seeds. **Test F**: S8 - L8 on the primary endpoint, paired over the seeds where S8, B8 (the
  study's runs) and L8 all finished; fewer than ``MIN_SEEDS``: underpowered (descriptive).
* **The live-dose check**: L8's mean dose within ``MATCH`` (relative) of S8's, else the verdict
  carries the words "dose not matched".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from sat_cli.report.collapse import StudyRow
from sat_cli.report.collapse_pilot2 import provenance
from sat_cli.report.lag_study import (
    ALPHA,
    ENDED,
    MIN_SEEDS,
    SEEDS,
    UNDERPOWERED,
    WAITING,
    arm_of,
    crash_mcnemar,
    paired_line,
    paired_test,
    significant,
    values,
)

DESIGN = "sat-lag-v5-f1"
CALIB_DESIGN = "sat-lag-v5-f1-calibration"
CALIB_SEED = "4999"
GRID = (0.5, 0.6, 0.7, 0.8)
EXTEND = (0.4, 0.9)  # below the grid (more clipping), above it (less clipping)
MATCH = 0.25

BEATS = "SAT beats a uniform tightening of equal live dose"
LOSES = "A uniform tightening of equal live dose beats SAT"
SAME = "SAT is not distinguishable from a uniform tightening of equal live dose"


@dataclass(frozen=True)
class Calibration:
    target: float  # S8's realised dose on the calibration seed
    doses: dict[float, float]  # scale -> realised dose of the finished control runs
    scale: float | None  # the choice; None while an extension run is still needed
    extend: float | None  # the scale to run next (the rule's one extension), else None


def scale_of(method: str) -> float | None:
    """``K0.50 GSPO tight lag 8`` -> 0.5; None for a method that is not a control scale."""
    word = method.split()[0] if method.split() else ""
    if not word.startswith("K"):
        return None
    try:
        return float(word[1:])
    except ValueError:
        return None


def choose_scale(rows: list[StudyRow]) -> Calibration:
    """The registered rule on the calibration rows (module doc). Raises ValueError, naming what
    is missing, while S8 or a grid scale has not finished on the calibration seed."""
    mine = [r for r in rows if r.seed == CALIB_SEED and r.status == "FINISHED" and r.dose != ""]
    s8 = [float(r.dose) for r in mine if arm_of(r) == "S8"]
    doses = {s: float(r.dose) for r in mine if (s := scale_of(r.method)) is not None}
    missing = [f"K{s:.2f}" for s in GRID if s not in doses] + ([] if s8 else ["S8"])
    if missing:
        raise ValueError(f"calibration not finished on seed {CALIB_SEED}: {', '.join(missing)}")
    target = s8[0]
    grid = {s: d for s, d in doses.items() if s in GRID}
    low, high = EXTEND
    if target > max(grid.values()) and low not in doses:  # more clipping than the tightest
        return Calibration(target, doses, None, low)
    if target < min(grid.values()) and high not in doses:  # less clipping than the loosest
        return Calibration(target, doses, None, high)
    allowed = {s: d for s, d in doses.items() if s in GRID or s in EXTEND}
    best = min(allowed, key=lambda s: (abs(allowed[s] - target), -s))
    return Calibration(target, doses, best, None)


def calibration_markdown(cal: Calibration) -> str:
    tried = ", ".join(f"{d:.4f} at {s:g}" for s, d in sorted(cal.doses.items()))
    head = f"S8's realised dose on seed {CALIB_SEED}: {cal.target:.4f}; the control: {tried}."
    if cal.scale is None:
        return f"{head}\nThe rule extends the grid once: run the control at {cal.extend:g}.\n"
    return f"{head}\nChosen radius scale: **{cal.scale:g}** (dose {cal.doses[cal.scale]:.4f}).\n"


def _mean_dose(rows: list[StudyRow], arm: str, seeds: list[str]) -> float:
    return statistics.mean(values(rows, arm, seeds, "dose").values())


def decide(study: list[StudyRow], f1: list[StudyRow]) -> dict:
    """F1's verdict as a dict: ``verdict``, the test ``F`` (``Paired``), the doses, ``matched``,
    the seeds, and ``underpowered``; ``WAITING`` until every planned L8 run has ended."""
    # deviation 5: where F1's runs hold S8 (run again beside L8 on a machine that did not
    # reproduce the study), test F pairs F1's own S8 with L8 and the study's S8 is not used;
    # B8 (the study's) stays descriptive and is not required of a seed
    rerun = any(arm_of(r) == "S8" for r in f1)
    mine = ("S8", "L8") if rerun else ("L8",)
    planned = {str(s) for s in SEEDS}
    ended = {
        s
        for s in planned
        if all(any(arm_of(r) == a and r.seed == s and r.status in ENDED for r in f1) for a in mine)
    }
    if not planned <= ended:
        return {"verdict": WAITING, "ended": len(ended), "planned": len(planned)}
    kept = ("B8",) if rerun else ("S8", "B8")
    rows = [r for r in study if arm_of(r) in kept] + [r for r in f1 if arm_of(r) in mine]
    have: dict[str, set[str]] = {}
    for r in rows:
        if r.status == "FINISHED" and r.eval_window != "":
            have.setdefault(r.seed, set()).add(arm_of(r))
    need = {"S8", "L8"} if rerun else {"S8", "B8", "L8"}
    seeds = [str(s) for s in SEEDS if have.get(str(s), set()) >= need]
    out: dict = {"seeds": seeds, "rows": rows, "underpowered": len(seeds) < MIN_SEEDS}
    # the descriptive L8 - B8: the seeds of F that also have B8 (all of them without a rerun)
    out |= {"s8_rerun": rerun, "b8_seeds": [s for s in seeds if "B8" in have[s]]}
    if len(seeds) < 2:
        return {**out, "verdict": UNDERPOWERED, "would": None}
    out["F"] = f = paired_test(rows, "S8", "L8", seeds)
    would = BEATS if significant(f, +1) else LOSES if significant(f, -1) else SAME
    s8, l8 = _mean_dose(rows, "S8", seeds), _mean_dose(rows, "L8", seeds)
    out |= {"dose_s8": s8, "dose_l8": l8, "matched": abs(l8 / s8 - 1) <= MATCH if s8 else False}
    return {**out, "verdict": UNDERPOWERED if out["underpowered"] else would, "would": would}


def f1_markdown(study: list[StudyRow], f1: list[StudyRow]) -> str:
    d = decide(study, f1)
    if d["verdict"] == WAITING:
        return (
            f"{WAITING}: {d['ended']} of {d['planned']} planned seeds have ended all of F1's "
            "runs. The stop rule shows no outcome before all runs end.\n"
        )
    seeds = d["seeds"]
    if d["s8_rerun"]:
        out = [
            f"Seeds with S8 and L8 finished (both F1's, one machine; deviation 5): "
            f"{len(seeds)} of {len(SEEDS)}."
        ]
    else:
        out = [f"Seeds with S8, B8 and L8 finished: {len(seeds)} of {len(SEEDS)}."]
    if "F" not in d:
        return "\n".join([*out, "", f"Verdict: **{UNDERPOWERED}**."]) + "\n"
    label = " (descriptive: underpowered)" if d["underpowered"] else ""
    out.append(f"- **F**{label} " + paired_line("S8 − L8", d["F"]) + f" (α = {ALPHA}).")
    match = "matched" if d["matched"] else "**dose not matched**"
    out.append(
        f"- Live dose: S8 {d['dose_s8']:.4f}, L8 {d['dose_l8']:.4f} (ratio "
        f"{d['dose_l8'] / d['dose_s8']:.2f}): {match} (±{MATCH:.0%})."
    )
    words = "" if d["matched"] else " (dose not matched)"
    if d["verdict"] == UNDERPOWERED:
        out += ["", f"Verdict: **{UNDERPOWERED}** (the rule would read: {d['would']}{words})."]
    else:
        out += ["", f"Verdict: **{d['verdict']}**{words}."]
    rows, with_b8 = d["rows"], d["b8_seeds"]
    out += [
        "",
        "Descriptive: " + paired_line("L8 − B8", paired_test(rows, "L8", "B8", with_b8)) + "; "
        "early crash, exact McNemar: " + crash_mcnemar(rows, "L8", with_b8) + ".",
    ]
    arms = ("S8", "L8") if d["s8_rerun"] else ("L8",)
    return "\n".join(out) + "\n\n" + provenance([r for r in f1 if arm_of(r) in arms]) + "\n"
