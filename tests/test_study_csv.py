"""Study CSVs read back (``sat report <file>.csv``): every column of every row checked, a
non-finite number, an unknown key (a field past the header), a missing field or control
characters refused naming the file, the line and the column (issue 53, class 11). The damage is
done to the committed pilot-2 files, so every other value is a real one."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest

from sat_cli.report.collapse import read_rows
from sat_cli.report.collapse_curves import read_curves

ROOT = Path(__file__).resolve().parents[1]
PILOT2 = ROOT / "docs/results/collapse_cpu/pilot2.csv"
CURVES = ROOT / "docs/results/collapse_cpu/pilot2_curves.csv"


def _damaged(path: Path, line: int, column: str, value: str, limit: int | None = None) -> str:
    """``path``'s text (its first ``limit`` lines) with ``column`` of file line ``line`` set
    to ``value``."""
    rows = list(csv.reader(io.StringIO(path.read_text())))[:limit]
    rows[line - 1][rows[0].index(column)] = value
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


ROW_CASES = [
    # columns read as numbers only where a table uses them (they were taken before)
    ("eval_best", "inf"),
    ("eval_first", "nan"),
    ("eval_last", "1e999"),  # finite text, infinite float
    ("last_step", "-3"),
    ("evals", "1_000"),
    ("collapsed", "7"),
    ("status", "BOGUS"),
    ("method", "GRPO\x1b[2J"),  # a terminal sequence would reach the printed tables
    ("run", "r\x9b31m"),  # a C1 control (CSI)
    ("seed", "x" * 300),
    ("can_act_early", "Infinity"),
    ("late_gain", " 1"),
]


@pytest.mark.parametrize(("column", "value"), ROW_CASES, ids=[c for c, _ in ROW_CASES])
def test_every_column_of_a_study_csv_is_checked(column, value):
    assert len(read_rows(PILOT2.read_text())) == 49  # the committed file reads
    with pytest.raises(ValueError, match=rf"^line 4, column {column}: "):
        read_rows(_damaged(PILOT2, 4, column, value))


def test_unknown_keys_and_missing_fields_are_refused_with_their_line():
    text = PILOT2.read_text().splitlines()
    extra = "\n".join(text[:3] + [text[3] + ",surprise"] + text[4:]) + "\n"
    with pytest.raises(ValueError, match=r"^line 4: 1 field\(s\) past the header's 22"):
        read_rows(extra)
    short = "\n".join(text[:5] + [text[5].rsplit(",", 1)[0]]) + "\n"
    with pytest.raises(ValueError, match=r"^line 6, column started: missing"):
        read_rows(short)


@pytest.mark.parametrize(
    ("column", "value"),
    [("value", "inf"), ("value", "nan"), ("step", "-1"), ("series", "loss"), ("run", "a\x07")],
)
def test_every_column_of_a_curves_csv_is_checked(column, value):
    with pytest.raises(ValueError, match=rf"^line 7, column {column}: "):
        read_curves(_damaged(CURVES, 7, column, value, limit=20))


def test_sat_report_names_the_file_line_and_column(tmp_path):
    """Through the command line: one ``sat: error:`` line naming the file, the line and the
    column, exit 2; the curves file beside the rows is checked the same way."""
    rows = tmp_path / "pilot2.csv"
    rows.write_text(_damaged(PILOT2, 5, "eval_best", "inf"))

    def report():
        return subprocess.run(
            [sys.executable, "-m", "sat_cli.cli", "report", str(rows)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )

    r = report()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("sat: error:") == 1
    assert f"{rows}: " in r.stderr and "line 5, column eval_best: 'inf'" in r.stderr
    rows.write_text(PILOT2.read_text())
    (tmp_path / "pilot2_curves.csv").write_text(_damaged(CURVES, 9, "value", "-inf", limit=40))
    r = report()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("sat: error:") == 1
    assert "pilot2_curves.csv: " in r.stderr and "line 9, column value: '-inf'" in r.stderr
