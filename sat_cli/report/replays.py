"""`sat report`'s replay section (docs/replay.md): every reported run that is a `sat replay`
of a recorded run (MLflow tag ``replay_of_run_id``) next to that run, final metric by final
metric — the last evaluation score and the last ``loss/policy`` and ``rollout/reward_mean`` —
with the difference replay − recorded. A replay and its recorded run share their data, so the
difference is the algorithm's (and the drift it causes); with the recorded algorithm it is 0.
"""

from __future__ import annotations

import csv
import io

from sat_cli import metric_names as M
from sat_cli.replay import REPLAY_OF, REPLAY_OF_ID

COLUMNS = ("replay", "method", "replay_of", "metric", "replay_value", "recorded", "difference")


def _last(client, run_id: str, key: str) -> float | None:
    hist = client.get_metric_history(run_id, key)
    return max(hist, key=lambda m: m.step).value if hist else None


def replay_rows(client, runs) -> list[dict]:
    """One row per replay and metric (``runs``: the report's RunData)."""
    from mlflow.exceptions import MlflowException

    rows = []
    for r in runs:
        tags = client.get_run(r.run_id).data.tags
        orig_id = tags.get(REPLAY_OF_ID)
        if not orig_id:
            continue
        try:
            client.get_run(orig_id)
        except MlflowException:
            orig_id = None  # the recorded run is not in this store
        for key in (r.eval_key, M.LOSS_POLICY, M.REWARD_MEAN):
            if not key:
                continue
            mine = _last(client, r.run_id, key)
            theirs = _last(client, orig_id, key) if orig_id else None
            diff = mine - theirs if mine is not None and theirs is not None else None
            rows.append(
                dict(
                    zip(
                        COLUMNS,
                        (r.name, r.method, tags.get(REPLAY_OF, "?"), key, mine, theirs, diff),
                        strict=True,
                    )
                )
            )
    return rows


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.6g}"


def replay_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    out = [
        "## Replays: paired differences vs the recorded run",
        "",
        "Final values (last logged step); difference = replay − recorded, on identical data "
        "(docs/replay.md says what it can and cannot mean).",
        "",
        "| replay | method | replay of | metric | replay | recorded | difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['replay']} | {r['method']} | {r['replay_of']} | {r['metric']} | "
            f"{_fmt(r['replay_value'])} | {_fmt(r['recorded'])} | {_fmt(r['difference'])} |"
        )
    return "\n".join(out) + "\n"


def dict_csv(rows: list[dict], columns) -> str:
    """``rows`` (dicts keyed by ``columns``) as CSV text with a header line."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns)
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def replay_csv(rows: list[dict]) -> str:
    return dict_csv(rows, COLUMNS)
