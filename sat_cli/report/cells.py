"""What makes two runs comparable in one cell of `sat report`: every run parameter but the seed
(besides method and lag, which are the cell's row and column).

* The model, task and evaluation: runs of one target that differ in any of these are never
  pooled: each run's row gets the differing labels (``GRPO · model=qwen3_0_6b``).
* Every other logged parameter (the flattened config: ``trainer.lr``,
  ``task.prompts_per_step``, ``env.name``, ...) that differs between the runs of one cell
  splits that cell's row the same way (``GRPO · trainer.lr=0.001``), so a cell never pools
  runs of different settings. Not compared: the seed (a cell's runs are its seeds), what names
  or places a run and does not change its numbers (``IGNORED``), and the recorded hardware and
  numeric settings, which are warned about, not split
  (``sat_cli.tracking.environment.compare_environments``).
* After the split a seed may appear once per cell: two runs of one seed in a cell (a run
  repeated under another name) are refused, naming the cell, the seed and the parameters in
  which they differ.

The report says which keys split it."""

from __future__ import annotations

from sat_cli.errors import UserError
from sat_cli.tracking.environment import HARDWARE_KEYS, NUMERIC_KEYS

# label -> the params (flattened config) that name it, first present wins
COMPARABLE = {
    "model": ("model.path", "model.name"),
    "task": ("task.path", "task.name"),
    "eval": ("eval.path", "eval.name"),
}


# parameters that name, place or schedule a run without changing its numbers (or are its seed)
IGNORED = ("seed", "run.name", "run.experiment", "run.dir", "resume", "ckpt", "data.dir")
IGNORED_PREFIXES = (
    "tracking.",
    "checkpoint.",
    "engine.weight_sync_port",
    "engine.weight_sync_master",
)
# the recorded environment (sat_cli.tracking.environment), not the config's env section
RECORDED_ENV = ("machine.",)  # sat_cli.tracking.environment.PREFIX


def compared(key: str) -> bool:
    """Whether the parameter ``key`` can split a cell (module doc)."""
    if key in IGNORED or key in HARDWARE_KEYS or key in NUMERIC_KEYS:
        return False
    if any(key.startswith(p) for p in (*IGNORED_PREFIXES, *RECORDED_ENV)):
        return False
    return not any(key in keys for keys in COMPARABLE.values())  # labelled as model/task/eval


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
    notes = []
    if mixed:
        values = "; ".join(f"{lb}: {', '.join(sorted({k[lb] for k in keys}))}" for lb in mixed)
        notes.append(
            f"the runs differ in {', '.join(mixed)} ({values}): they are never pooled, each "
            "cell holds runs of one " + " and one ".join(mixed)
        )
    notes += split_cells(runs, params)
    refuse_duplicate_seeds(runs, params)
    return notes


def _cells(runs: list) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(runs):
        out.setdefault((r.row, r.lag), []).append(i)
    return out


def split_cells(runs: list, params: list[dict[str, str]]) -> list[str]:
    """Append ``key=value`` to the row of every run of a row whose cells (row x lag) hold runs
    that differ in ``key`` (``compared``); the notes naming them."""
    split: dict[str, list[str]] = {}  # row -> the keys that split it
    for (row, _), idx in _cells(runs).items():
        keys = sorted({k for i in idx for k in params[i] if compared(k)})
        for k in keys:
            if len({params[i].get(k, "?") for i in idx}) > 1 and k not in split.get(row, []):
                split.setdefault(row, []).append(k)
    for run, p in zip(runs, params, strict=True):
        keys = split.get(run.row, [])
        run.row = " · ".join([run.row, *(f"{k}={p.get(k, '?')}" for k in keys)])
    return [
        f"the runs of {row} differ in {', '.join(keys)}: split into one row per value, "
        "never pooled in one cell"
        for row, keys in split.items()
    ]


def refuse_duplicate_seeds(runs: list, params: list[dict[str, str]]) -> None:
    """``UserError`` when a cell holds two runs of one seed (module doc)."""
    for (row, lag), idx in _cells(runs).items():
        by_seed: dict[str, list[int]] = {}
        for i in idx:
            by_seed.setdefault(runs[i].seed, []).append(i)
        for seed, same in by_seed.items():
            if len(same) < 2:
                continue
            a, b = (params[i] for i in same[:2])
            differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) or ["nothing"]
            names = ", ".join(runs[i].name for i in same)
            raise UserError(
                f"the cell {row!r} at lag {lag} holds {len(same)} runs of seed={seed} ({names}), "
                f"which differ in {', '.join(differ[:8])}: a seed counts once per cell; report "
                "one sweep (its sweep id) or remove the repeated run"
            )
