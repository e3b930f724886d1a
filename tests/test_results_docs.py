"""The numbers in docs/results/*.md that sit in generated blocks equal what
scripts/results_tables.py computes from the committed report CSVs (they cannot drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_result_tables_are_up_to_date():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results_tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_changed_number_is_caught(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import results_tables as R
    finally:
        sys.path.pop(0)
    doc = (ROOT / "docs" / "results" / "sat_power_cpu.md").read_text()
    assert R.render(doc) == doc
    tampered = doc.replace("| round 2 | 0.0006 |", "| round 2 | 0.0007 |", 1)
    assert tampered != doc and R.render(tampered) == doc
