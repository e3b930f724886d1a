"""What makes two runs comparable in one cell of `sat report`: the same model, task and
evaluation (besides method and lag, which are the cell's row and column). Runs of one target
that differ in any of these are never pooled: each run's row gets the differing keys
(``GRPO · model=qwen3_0_6b``), so every cell holds runs of one model, task and evaluation, and
the report says which keys split it. Hardware and numeric settings are warned about, not split
(``sat_cli.tracking.environment.compare_environments``)."""

from __future__ import annotations

from sat_cli.errors import UserError

# label -> the params (flattened config) that name it, first present wins
COMPARABLE = {
    "model": ("model.path", "model.name"),
    "task": ("task.path", "task.name"),
    "eval": ("eval.path", "eval.name"),
}


def comparable_key(params: dict[str, str]) -> dict[str, str]:
    """``{"model": …, "task": …, "eval": …}`` of a run's params (``?`` where none is logged)."""
    out = {}
    for label, keys in COMPARABLE.items():
        value = next((params[k] for k in keys if params.get(k) not in (None, "", "None")), "?")
        out[label] = str(value)
    return out


def check_cells(runs: list, params: list[dict[str, str]]) -> list[str]:
    """Append ``label=value`` to the ``row`` of each run for every label whose value differs
    between ``runs`` (``params[i]`` belongs to ``runs[i]``); return the report's notes.
    ``UserError`` when no run logged an evaluation: no outcome can be decided, and statistics
    over nothing would still print."""
    if runs and not any(r.eval_key and r.series.get(r.eval_key) for r in runs):
        raise UserError(
            f"none of the {len(runs)} run(s) logged an evaluation (eval/<benchmark>/avg@k): "
            "the report cannot decide an outcome, so it computes no statistics. Runs with "
            "eval.every > 0 log one"
        )
    keys = [comparable_key(p) for p in params]
    mixed = [label for label in COMPARABLE if len({k[label] for k in keys}) > 1]
    for run, key in zip(runs, keys, strict=True):
        run.row = " · ".join([run.row, *(f"{label}={key[label]}" for label in mixed)])
    if not mixed:
        return []
    values = "; ".join(f"{lb}: {', '.join(sorted({k[lb] for k in keys}))}" for lb in mixed)
    return [
        f"the runs differ in {', '.join(mixed)} ({values}): they are never pooled, each cell "
        "holds runs of one " + " and one ".join(mixed)
    ]
