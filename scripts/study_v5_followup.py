"""Study v5's follow-up F1 (docs/results/sat_lag_v5_cpu.md, "Follow-up F1"), from CSVs only.

    # the live calibration: the chosen radius scale (or the one extension the rule asks for)
    python scripts/study_v5_followup.py calibrate CALIB_CSV
    # the verdict: the study's runs.csv (S8, B8) and F1's runs (L8; and S8, run again beside it
    # on another machine: deviation 5, then test F pairs F1's own S8 with L8)
    python scripts/study_v5_followup.py verdict STUDY_CSV F1_CSV

Each CSV is what ``sat report SWEEP --collapse --out DIR`` writes as ``DIR/collapse.csv`` (the
study's committed ``runs.csv`` is one). Paths are taken relative to the current folder. Run it
with the project's interpreter (``.venv/bin/python``). It prints markdown and writes nothing;
exit status 0, or 2 with a one-line message for an input it cannot use. The rules are
``sat_cli/report/lag_followup.py``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sat_cli.errors import UserError  # noqa: E402
from sat_cli.report import lag_followup as F  # noqa: E402
from sat_cli.report.collapse import StudyRow, read_rows  # noqa: E402
from sat_cli.util.readers import read_text  # noqa: E402


def _rows(path: Path) -> list[StudyRow]:
    text = read_text(path, what=str(path), error=UserError, max_bytes=16 << 20)
    try:
        rows = read_rows(text)
    except (ValueError, KeyError, TypeError, csv.Error) as exc:
        raise UserError(f"{path}: not a collapse-study CSV ({str(exc)[:200]})") from None
    if not rows:
        raise UserError(f"{path}: no runs")
    return rows


def calibrate(args) -> str:
    rows = [r for r in _rows(args.calib_csv) if r.design == F.CALIB_DESIGN]
    if not rows:
        raise UserError(f"{args.calib_csv}: no run tagged collapse_design={F.CALIB_DESIGN}")
    try:
        return F.calibration_markdown(F.choose_scale(rows))
    except ValueError as exc:
        raise UserError(f"{args.calib_csv}: {exc}") from None


def verdict(args) -> str:
    study = [r for r in _rows(args.study_csv) if r.design == "sat-lag-v5"]
    f1 = [r for r in _rows(args.f1_csv) if r.design == F.DESIGN]
    if not study or not f1:
        which = args.study_csv if not study else args.f1_csv
        raise UserError(f"{which}: none of its runs belongs to the study / to F1")
    return F.f1_markdown(study, f1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("calibrate", help="the radius scale the live calibration chooses")
    p.add_argument("calib_csv", type=Path)
    p.set_defaults(fn=calibrate)
    p = sub.add_parser("verdict", help="test F and the verdict")
    p.add_argument("study_csv", type=Path)
    p.add_argument("f1_csv", type=Path)
    p.set_defaults(fn=verdict)
    args = ap.parse_args(argv)
    try:
        print(args.fn(args), end="")
    except UserError as exc:
        print(f"study_v5_followup: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
