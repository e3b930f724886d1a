"""Which runs `sat report` reports: a sweep id or an experiment, one attempt per override hash
(see ``sat_cli.report``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sat_cli.errors import UserError


@dataclass
class Selection:
    """The runs of a report target."""

    label: str
    sweep_id: str | None
    parent: Any  # mlflow Run or None
    runs: list[Any]
    notes: list[str] = field(default_factory=list)


def _all_runs(client, experiment_ids: list[str], filter_string: str = "") -> list:
    out, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids, filter_string=filter_string, max_results=1000, page_token=token
        )
        out.extend(page)
        token = page.token
        if not token:
            return out


def _role(run) -> str:
    return run.data.tags.get("sat.sweep_role", "")


def select_runs(client, target: str) -> Selection:
    """Find the runs of a sweep id, a sweep name or an experiment (see the module docstring)."""
    if "'" in target or "\\" in target:
        raise UserError(f"report target {target!r}: quotes and backslashes are not allowed")
    exps = list(client.search_experiments())
    ids = [e.experiment_id for e in exps]
    if ids:
        tagged = _all_runs(client, ids, f"tags.`sat.sweep_id` = '{target}'")
        if tagged:
            parents = sorted(
                (r for r in tagged if _role(r) == "parent"), key=lambda r: r.info.start_time
            )
            children = [r for r in tagged if _role(r) != "parent"]
            return Selection(target, target, parents[-1] if parents else None, children)
    exp = next((e for e in exps if e.name == target), None)
    if exp is None:
        known_sweeps = sorted(
            {
                r.data.tags["sat.sweep_id"]
                for r in _all_runs(client, ids, "tags.`sat.sweep_role` = 'parent'")
            }
            if ids
            else set()
        )
        raise UserError(
            f"no sweep id or MLflow experiment named {target!r} in this store. "
            f"Experiments: {', '.join(sorted(e.name for e in exps)) or '(none)'}; "
            f"sweep ids: {', '.join(known_sweeps) or '(none)'}. "
            "Pass --tracking-uri for another store."
        )
    runs = _all_runs(client, [exp.experiment_id])
    parents = sorted((r for r in runs if _role(r) == "parent"), key=lambda r: r.info.start_time)
    if parents:
        sweep_id = parents[-1].data.tags.get("sat.sweep_id")
        others = sorted({p.data.tags.get("sat.sweep_id") for p in parents} - {sweep_id})
        children = [
            r for r in runs if _role(r) != "parent" and r.data.tags.get("sat.sweep_id") == sweep_id
        ]
        notes = []
        if others:
            notes.append(
                f"experiment {target!r} holds several sweeps; reporting the latest ({sweep_id}). "
                f"Others: {', '.join(others)} (pass one as the target)."
            )
        return Selection(target, sweep_id, parents[-1], children, notes)
    return Selection(target, None, None, [r for r in runs if _role(r) != "parent"])


def dedupe(runs: Iterable[Any]) -> list[Any]:
    """One run per override hash (runs without one are kept): FINISHED first, then the latest."""
    best: dict[str, Any] = {}
    for r in runs:
        key = r.data.tags.get("sat.override_hash") or r.info.run_id
        cur = best.get(key)
        rank = (r.info.status == "FINISHED", r.info.start_time or 0)
        if cur is None or rank > (cur.info.status == "FINISHED", cur.info.start_time or 0):
            best[key] = r
    return sorted(best.values(), key=lambda r: (r.info.start_time or 0, r.info.run_id))
