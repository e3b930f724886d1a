"""`sat report`'s per-turn staleness section (multi-turn runs, docs/environments.md): for every
reported run that logged per-turn metrics (``staleness/turn_<k>/…``), one row per turn ``k``:

* ``steps`` — the steps that logged turn ``k``;
* ``tokens_per_step`` — the mean of ``staleness/turn_<k>/tokens`` (the model's tokens of turn
  ``k`` in a step's batch);
* ``token_version_lag`` — the version lag of turn ``k``'s model tokens over the whole run: the
  steps' ``staleness/turn_<k>/token_version_lag_mean`` weighted by their token counts;
* ``dpi_mu`` — the mean of ``staleness/turn_<k>/abs_logratio_mean_mu`` (d̄π of turn ``k``'s
  tokens against the behaviour policy; logged on histogram steps), "—" when never logged;
* ``mixed_version_frac`` — the run's mean ``staleness/mixed_version_frac`` over its steps (the
  responses whose tokens span weight versions; the same on every row of the run).
"""

from __future__ import annotations

import re

from sat_cli import metric_names as M
from sat_cli.report.replays import dict_csv

COLUMNS = (
    "run",
    "method",
    "lag",
    "turn",
    "steps",
    "tokens_per_step",
    "token_version_lag",
    "dpi_mu",
    "mixed_version_frac",
)
_TURN = re.compile(re.escape(M.TURN_TOKENS).replace(r"\{\}", r"(\d+)"))


def _by_step(client, run_id: str, key: str) -> dict[int, float]:
    """``{step: value}`` of a metric (the latest value of a step logged twice)."""
    out: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in out or m.timestamp >= out[m.step][0]:
            out[m.step] = (m.timestamp, m.value)
    return {s: v for s, (_, v) in out.items()}


def turn_rows(client, runs) -> list[dict]:
    """One row per run and turn (``runs``: the report's RunData); none for single-turn runs."""
    rows = []
    for r in runs:
        keys = client.get_run(r.run_id).data.metrics
        turns = sorted(int(m.group(1)) for k in keys if (m := _TURN.fullmatch(k)))
        if not turns:
            continue
        mixed = list(_by_step(client, r.run_id, M.MIXED_VERSION_FRAC).values())
        mixed_mean = sum(mixed) / len(mixed) if mixed else None
        for k in turns:
            tokens = _by_step(client, r.run_id, M.TURN_TOKENS.format(k))
            lag = _by_step(client, r.run_id, M.TURN_TOKEN_LAG_MEAN.format(k))
            dpi = list(_by_step(client, r.run_id, M.TURN_DPI_MU.format(k)).values())
            both = [s for s in tokens if s in lag]
            total = sum(tokens[s] for s in both)
            values = (
                r.name,
                r.method,
                r.lag,
                k,
                len(tokens),
                sum(tokens.values()) / len(tokens),
                sum(tokens[s] * lag[s] for s in both) / total if total else None,
                sum(dpi) / len(dpi) if dpi else None,
                mixed_mean,
            )
            rows.append(dict(zip(COLUMNS, values, strict=True)))
    return rows


def _fmt(x) -> str:
    if x is None:
        return "—"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def turn_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    out = [
        "## Per-turn staleness (multi-turn runs)",
        "",
        "Per turn of the trajectories: the model's tokens per step, their version lag over the "
        "run (token-weighted), their d̄π against μ (histogram steps), and the run's mean "
        "fraction of responses whose tokens span weight versions.",
        "",
        "| run | method | lag | turn | steps | tokens/step | token version lag | d̄π vs μ | "
        "mixed-version frac |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |")
    return "\n".join(out) + "\n"


def turn_csv(rows: list[dict]) -> str:
    return dict_csv(rows, COLUMNS)
