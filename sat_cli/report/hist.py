"""The ``|d|`` histograms of `sat report` (see ``sat_cli.report``): the last histogram table each
run logged (``tables/staleness/abs_logratio/step_<N>.json``), one per row × lag.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from sat_cli.report.regime import lag_key
from sat_cli.report.tables import RunData

HIST_DIR = "tables/staleness/abs_logratio"


def download_json(client, run_id: str, path: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        return json.loads(Path(local).read_text())


def last_hist(client, run_id: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        files = client.list_artifacts(run_id, HIST_DIR)
    except (MlflowException, OSError):
        return None
    steps = []
    for f in files:
        m = re.search(r"step_(\d+)\.json$", f.path)
        if m:
            steps.append((int(m.group(1)), f.path))
    if not steps:
        return None
    return download_json(client, run_id, max(steps)[1])


def hist_tables(client, runs: list[RunData], rows: list[str], lags: list[str]) -> dict:
    """``(row, lag) -> the last |d| histogram table`` of the first seed that logged one."""
    tables: dict[tuple[str, str], dict] = {}
    for row in rows:
        for lag in lags:
            group = sorted(
                (r for r in runs if r.row == row and r.lag == lag), key=lambda r: lag_key(r.seed)
            )
            for r in group:
                t = last_hist(client, r.run_id)
                if t is not None:
                    tables[(row, lag)] = {**t, "_seed": r.seed}
                    break
    return tables
