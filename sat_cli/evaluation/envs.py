"""Held-out evaluation of an environment (``sat eval <env>``), torch-free: ``n`` trajectories per
held-out row through the multi-turn driver (``trajectory.run_trajectories``), summarised.

A trajectory succeeds when its last step says ``correct`` (the shipped environments; else when
its reward is positive). The summary (:func:`summarize`): ``success`` (percent: avg@n of
success, the mean over rows of each row's success rate), ``pass@k`` for ``k = 1..n`` (the
unbiased estimator, ``evaluation.estimators``), ``turns_mean`` (model turns per trajectory),
``success_within`` (percent of trajectories that succeeded within ``k`` turns, ``k = 1..
max_turns``: ``success_within[1]`` is first-turn success; the last equals ``success``), and
``finish`` (trajectories per finish reason), ``tool_calls`` and ``tool_error_frac`` (the tool calls
of all trajectories and the fraction that failed, from the last step's ``tool_calls_total`` /
``tool_errors_total``; 0 for an environment without tools).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sat_cli import metric_names as M
from sat_cli.envs.trajectory import tool_totals
from sat_cli.evaluation.estimators import avg_at_k, pass_at_k_table


def succeeded(sample) -> bool:
    info = sample.meta.get("info") or {}
    return bool(info["correct"]) if "correct" in info else float(sample.meta["reward"]) > 0


@dataclass
class EnvEvalResult:
    name: str
    n: int
    rows: list[dict[str, Any]]  # per held-out row: seed, successes, turns
    summary: dict[str, Any]
    complete: bool = True
    error: str | None = None
    interrupted: KeyboardInterrupt | None = field(default=None, repr=False, compare=False)
    samples: list[dict] = field(default_factory=list, repr=False, compare=False)


def summarize(groups: list[list[Any]], max_turns: int) -> dict[str, Any]:
    """The summary of ``groups`` (per row, its ``n`` trajectories' samples; module docstring)."""
    if not groups or any(not g for g in groups):
        raise ValueError("an environment evaluation needs at least one trajectory per row")
    flags = [[succeeded(s) for s in g] for g in groups]
    flat = [s for g in groups for s in g]
    turns = [int(s.meta["turns"]) for s in flat]
    ok_turns = [t for t, s in zip(turns, flat, strict=True) if succeeded(s)]
    finish: dict[str, int] = {}
    for s in flat:
        finish[s.finish_reason] = finish.get(s.finish_reason, 0) + 1
    calls, errors = tool_totals(flat) or (0, 0)
    return {
        "tool_calls": calls,
        "tool_error_frac": errors / calls if calls else 0.0,
        "success": avg_at_k(flags),
        "pass@k": pass_at_k_table(flags),
        "turns_mean": sum(turns) / len(turns),
        "success_within": {
            k: 100.0 * sum(t <= k for t in ok_turns) / len(flat) for k in range(1, max_turns + 1)
        },
        "finish": dict(sorted(finish.items())),
        "trajectories": len(flat),
    }


def metrics(summary: dict[str, Any], name: str) -> dict[str, float]:
    """Flat MLflow metrics ``eval/<name>/…`` of a summary."""
    within = {f"success_within_{k}": v for k, v in summary["success_within"].items()}
    flat = {
        "success": summary["success"],
        "turns_mean": summary["turns_mean"],
        "tool_error_frac": summary["tool_error_frac"],
        **{f"pass@{k}": v for k, v in summary["pass@k"].items()},
        **within,
    }
    out = {M.env_eval_key(name, what): v for what, v in flat.items()}
    return {k: float(v) for k, v in out.items() if not math.isnan(v)}


def format_summary(name: str, n: int, s: dict[str, Any]) -> str:
    within = "  ".join(f"<={k}: {v:.1f}" for k, v in s["success_within"].items())
    passes = "  ".join(f"pass@{k} {v:.1f}" for k, v in s["pass@k"].items() if k in (1, n))
    return (
        f"{name}: success (avg@{n}) {s['success']:.2f} %  {passes}  turns {s['turns_mean']:.2f}\n"
        f"  success within k turns (%): {within}\n"
        f"  {s['trajectories']} trajectories, finish: {s['finish']}"
    )


def evaluate_env(
    engine, tokenizer, name: str, settings, trajectory, rows, n: int, sampling, batch_rows: int
) -> EnvEvalResult:
    """``n`` trajectories of environment ``name`` per row, ``batch_rows`` rows per driver call."""
    from sat_cli.envs.registry import make
    from sat_cli.envs.trajectory import run_trajectories

    groups: list[list[Any]] = []
    result = EnvEvalResult(name, n, [], {})
    try:
        for at in range(0, len(rows), batch_rows):
            part = rows[at : at + batch_rows]
            flat = [r for r in part for _ in range(n)]
            envs = [make(name, settings) for _ in flat]
            samples = run_trajectories(engine, envs, tokenizer, flat, sampling, trajectory)
            for i, row in enumerate(part):
                g = samples[i * n : (i + 1) * n]
                groups.append(g)
                result.rows.append(
                    {
                        "seed": row.get("seed"),
                        "answer": row.get("answer"),
                        "success": [succeeded(s) for s in g],
                        "turns": [int(s.meta["turns"]) for s in g],
                        "finish": [s.finish_reason for s in g],
                    }
                )
                if len(result.samples) < 16:
                    text = tokenizer.decode(g[0].response_ids, skip_special_tokens=True)
                    result.samples.append({"seed": row.get("seed"), "trajectory": text})
    except KeyboardInterrupt as e:
        result.interrupted, result.complete, result.error = e, False, "interrupted"
    if groups:
        result.summary = summarize(groups, trajectory.max_turns)
    result.complete = result.complete and len(groups) == len(rows)
    if not result.complete and result.error is None:
        result.error = f"{len(groups)} of {len(rows)} rows evaluated"
    return result
