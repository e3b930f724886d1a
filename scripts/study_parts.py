"""Keep a pre-registered study's finished seeds across machines (sat_cli/report/study_parts.py).

    # at a session's end: the complete seeds of an export, as a part (prints counts, no outcomes)
    python scripts/study_parts.py export REPORT_DIR PARTS_DIR LABEL
    # a sweep with other arms (study v5's F1 after deviation 5: S8 and L8)
    python scripts/study_parts.py export REPORT_DIR PARTS_DIR LABEL --arms S8,L8
    # next session: the sweep file for the seeds no part holds (only its seeds line differs)
    python scripts/study_parts.py remaining SWEEP_FILE PARTS_DIR OUT_FILE
    # once every run has ended: the parts concatenated into the study's runs.csv and curves.csv
    python scripts/study_parts.py merge PARTS_DIR OUT_DIR

REPORT_DIR is the folder that ``sat report STUDY --collapse --out REPORT_DIR`` wrote
(``collapse.csv``, ``collapse_curves.csv``); a part is ``PARTS_DIR/LABEL_runs.csv`` with
``PARTS_DIR/LABEL_curves.csv``. Paths are taken relative to the current folder. Run it with
the project's interpreter (``.venv/bin/python``). Exit status 0, or 2 with a one-line message
for an input it cannot use; it never overwrites a part or an output file.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sat_cli.report.lag_study import ARMS  # noqa: E402
from sat_cli.report.study_parts import (  # noqa: E402
    CURVES_SUFFIX,
    RUNS_SUFFIX,
    PartsError,
    check_label,
    complete_part,
    merge_parts,
    read_part_rows,
    remaining_sweep,
)
from sat_cli.util.fsio import atomic_write_text, read_regular_bytes  # noqa: E402

MAX_BYTES = 64 << 20  # a study's CSVs are a few MB; anything larger is not one


ARM_NAME = re.compile(r"[A-Z][A-Za-z0-9]{0,7}")  # an arm: its methods' first word (S8, L8)
MAX_ARMS = 16


class Refused(Exception):
    pass


def arms_list(text: str) -> tuple[str, ...]:
    """``--arms``: 1 to 16 distinct arm names (a capital letter, then up to 7 letters or digits),
    comma-separated."""
    arms = tuple(a.strip() for a in text.split(","))
    if (
        not 1 <= len(arms) <= MAX_ARMS
        or not all(ARM_NAME.fullmatch(a) for a in arms)
        or len(set(arms)) != len(arms)
    ):
        raise argparse.ArgumentTypeError(
            f"{text[:80]!r}: 1 to {MAX_ARMS} distinct arm names (a capital letter, then up to 7 "
            "letters or digits), comma-separated, e.g. S8,L8"
        )
    return arms


def _read(path: Path) -> str:
    try:
        if path.is_file() and path.stat().st_size > MAX_BYTES:
            raise Refused(f"{path}: larger than {MAX_BYTES >> 20} MiB, not a study file")
        return read_regular_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise Refused(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise Refused(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise Refused(f"{path}: cannot read it ({exc})") from None


def _new(path: Path) -> Path:
    if path.exists() or path.is_symlink():
        raise Refused(f"{path} exists: not overwritten (remove it or choose another name)")
    return path


def _parts(parts_dir: Path) -> list[tuple[str, str, str]]:
    if not parts_dir.is_dir():
        return []
    out = []
    for runs in sorted(parts_dir.glob("*" + RUNS_SUFFIX)):
        label = runs.name[: -len(RUNS_SUFFIX)]
        out.append((label, _read(runs), _read(parts_dir / (label + CURVES_SUFFIX))))
    return out


def export(args) -> None:
    label = check_label(args.label)
    rows = read_part_rows(_read(args.report_dir / "collapse.csv"), "collapse.csv")
    arms = args.arms
    part = complete_part(rows, _read(args.report_dir / "collapse_curves.csv"), arms)
    if not part.seeds:
        raise Refused(f"no seed has every arm {list(arms)} FINISHED: nothing to keep")
    merge_parts(_parts(args.parts_dir) + [(label, part.runs_csv, part.curves_csv)])  # no overlap
    runs_out = _new(args.parts_dir / (label + RUNS_SUFFIX))
    curves_out = _new(args.parts_dir / (label + CURVES_SUFFIX))
    atomic_write_text(curves_out, part.curves_csv)
    atomic_write_text(runs_out, part.runs_csv)
    left = (
        f"; left out (some arm not finished): {', '.join(part.left_out)}" if part.left_out else ""
    )
    print(
        f"part {label}: {len(part.seeds)} seeds ({', '.join(part.seeds)}), "
        f"{len(part.seeds) * len(arms)} runs{left}"
    )


def remaining(args) -> None:
    _, _, done = merge_parts(_parts(args.parts_dir))
    text, left = remaining_sweep(_read(args.sweep_file), set(done))
    out = _new(args.out_file)
    atomic_write_text(out, text)
    print(f"{out}: {len(left)} seeds left ({', '.join(map(str, left))}); {len(done)} in parts")


def merge(args) -> None:
    parts = _parts(args.parts_dir)
    if not parts:
        raise Refused(f"{args.parts_dir}: no parts (*{RUNS_SUFFIX})")
    runs, curves, seeds = merge_parts(parts)
    runs_out, curves_out = _new(args.out_dir / "runs.csv"), _new(args.out_dir / "curves.csv")
    atomic_write_text(curves_out, curves)
    atomic_write_text(runs_out, runs)
    print(f"{runs_out}: {len(parts)} parts, {len(seeds)} seeds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export", help="keep the complete seeds of an export as a part")
    p.add_argument("report_dir", type=Path)
    p.add_argument("parts_dir", type=Path)
    p.add_argument("label")
    p.add_argument(
        "--arms",
        type=arms_list,
        default=ARMS,
        help=f"the arms every kept seed must have finished (default: {','.join(ARMS)})",
    )
    p.set_defaults(fn=export)
    p = sub.add_parser("remaining", help="the sweep file for the seeds no part holds")
    p.add_argument("sweep_file", type=Path)
    p.add_argument("parts_dir", type=Path)
    p.add_argument("out_file", type=Path)
    p.set_defaults(fn=remaining)
    p = sub.add_parser("merge", help="the parts as the study's runs.csv and curves.csv")
    p.add_argument("parts_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.set_defaults(fn=merge)
    args = ap.parse_args(argv)
    try:
        args.fn(args)
    except (Refused, PartsError) as exc:
        print(f"study_parts: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output folder that cannot be made or written
        print(f"study_parts: cannot write the output: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
