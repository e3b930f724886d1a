"""A pre-registered study that spans machines: its finished seeds kept as committed parts.

A study's run folders and tracking store live on the machine that runs it. When that machine is
not kept between working sessions (a fresh machine per session), every finished run would be
lost with it. So, at a session's end, the seeds whose every arm has FINISHED are exported as a
*part*: the per-run rows (``collapse.csv``'s columns) and the curves (``collapse_curves.csv``'s)
of those runs only, written beside the write-up and committed. The next session runs the
remaining seeds with a copy of the sweep file whose only change is its ``seeds`` list
(``remaining_sweep``), and the analysis reads the concatenation of the parts (``merge_parts``).

Nothing here reads an outcome column: a part is chosen by run status and seed only, and what it
prints is counts and seeds (the stop rule: no look at outcomes before every run has ended). A
seed with some arm unfinished is left out whole and runs again in the next session; runs are
deterministic per seed, so a rerun gives the same numbers.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from sat_cli.report.collapse import StudyRow, read_rows, rows_csv
from sat_cli.report.collapse_curves import CURVE_COLUMNS

RUNS_SUFFIX = "_runs.csv"
CURVES_SUFFIX = "_curves.csv"
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SEEDS_LINE = re.compile(r"^seeds:\s*\[[^\]\n]*\]\s*$", re.MULTILINE)


class PartsError(ValueError):
    """A part, a curves file or a sweep file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Part:
    runs_csv: str
    curves_csv: str
    seeds: list[str]  # complete seeds, in the rows' order
    left_out: list[str]  # seeds with some arm not FINISHED (or missing)


def arm_of(method: str) -> str:
    return method.split()[0] if method else ""


def complete_part(rows: list[StudyRow], curves_text: str, arms: tuple[str, ...]) -> Part:
    """The rows and curves of the seeds whose every arm in ``arms`` has exactly one FINISHED run."""
    finished: dict[str, dict[str, StudyRow]] = {}
    order: list[str] = []
    for r in rows:
        if r.seed not in order:
            order.append(r.seed)
        if r.status != "FINISHED":
            continue
        arm = arm_of(r.method)
        if arm not in arms:
            raise PartsError(f"run {r.run}: arm {arm!r} is not one of the study's {list(arms)}")
        have = finished.setdefault(r.seed, {})
        if arm in have:
            raise PartsError(
                f"seed {r.seed}: two FINISHED runs of arm {arm} ({have[arm].run}, {r.run})"
            )
        have[arm] = r
    seeds = [s for s in order if set(finished.get(s, {})) == set(arms)]
    keep = [finished[s][a] for s in seeds for a in arms]
    names = {r.run for r in keep}
    return Part(
        runs_csv=rows_csv(keep),
        curves_csv=_curves_of(curves_text, names),
        seeds=seeds,
        left_out=[s for s in order if s not in seeds],
    )


def _curves_reader(text: str, where: str) -> Iterator[dict[str, str]]:
    """The lines of a curves CSV, each checked: a step and a finite value."""
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames != CURVE_COLUMNS:
        raise PartsError(
            f"{where}: not a curves CSV (columns {reader.fieldnames}, want {CURVE_COLUMNS})"
        )
    for i, d in enumerate(reader, start=2):
        step, value = d["step"] or "", d["value"] or ""
        try:
            finite = math.isfinite(float(value))
        except ValueError:
            finite = False
        if not (step.isascii() and step.isdigit()) or not finite:
            raise PartsError(
                f"{where}: line {i}: step {step!r}, value {value!r}: want a step and a finite number"
            )
        yield d


def _curves_of(text: str, names: set[str]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CURVE_COLUMNS)
    seen: set[str] = set()
    for d in _curves_reader(text, "curves"):
        if d["run"] in names:
            w.writerow([d[c] for c in CURVE_COLUMNS])
            seen.add(d["run"])
    missing = sorted(names - seen)
    if missing:
        raise PartsError(f"curves: no points for the runs {missing}")
    return out.getvalue()


def read_part_rows(text: str, where: str) -> list[StudyRow]:
    try:
        return read_rows(text)
    except ValueError as exc:
        raise PartsError(f"{where}: {exc}") from None


def merge_parts(parts: list[tuple[str, str, str]]) -> tuple[str, str, list[str]]:
    """``parts``: ``(label, runs text, curves text)``. The concatenated runs and curves CSVs and
    the seeds they hold; a seed or a run in two parts is refused (it would be counted twice)."""
    rows: list[StudyRow] = []
    curves = io.StringIO()
    w = csv.writer(curves, lineterminator="\n")
    w.writerow(CURVE_COLUMNS)
    seed_part: dict[str, str] = {}
    for label, runs_text, curves_text in parts:
        part_rows = read_part_rows(runs_text, label + RUNS_SUFFIX)
        names = {r.run for r in part_rows}
        for r in part_rows:
            if r.seed in seed_part and seed_part[r.seed] != label:
                raise PartsError(f"seed {r.seed} is in two parts: {seed_part[r.seed]} and {label}")
            seed_part[r.seed] = label
        if len(names) != len(part_rows):
            raise PartsError(f"{label}{RUNS_SUFFIX}: a run is listed twice")
        seen: set[str] = set()
        for d in _curves_reader(curves_text, label + CURVES_SUFFIX):
            if d["run"] not in names:
                raise PartsError(
                    f"{label}{CURVES_SUFFIX}: run {d['run']!r} is not in {label}{RUNS_SUFFIX}"
                )
            w.writerow([d[c] for c in CURVE_COLUMNS])
            seen.add(d["run"])
        if seen != names:
            raise PartsError(
                f"{label}{CURVES_SUFFIX}: no points for the runs {sorted(names - seen)}"
            )
        rows.extend(part_rows)
    return rows_csv(rows), curves.getvalue(), list(seed_part)


def remaining_sweep(text: str, done: set[str]) -> tuple[str, list[int]]:
    """The sweep file ``text`` with its one-line ``seeds: [...]`` list reduced to the seeds not in
    ``done`` (every other byte unchanged), and those seeds."""
    found = SEEDS_LINE.findall(text)
    if len(found) != 1:
        raise PartsError("the sweep file needs exactly one one-line 'seeds: [...]' list")
    body = found[0].split("[", 1)[1].rsplit("]", 1)[0]
    try:
        seeds = [int(x) for x in body.split(",") if x.strip()]
    except ValueError:
        raise PartsError(f"the sweep file's seeds are not integers: {found[0]!r}") from None
    unknown = sorted(done - {str(s) for s in seeds})
    if unknown:
        raise PartsError(f"the parts hold seeds that the sweep file does not list: {unknown}")
    left = [s for s in seeds if str(s) not in done]
    if not left:
        raise PartsError("every seed of the sweep file is in the parts: nothing remains to run")
    line = "seeds: [" + ", ".join(str(s) for s in left) + "]"
    return SEEDS_LINE.sub(line, text, count=1), left


def check_label(label: str) -> str:
    if not LABEL_RE.fullmatch(label):
        raise PartsError(f"part label {label!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    return label
