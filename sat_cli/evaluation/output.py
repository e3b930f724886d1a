"""What an :class:`~sat_cli.evaluation.run.EvalResult` becomes: MLflow metrics (:func:`metrics`),
the files of ``sat eval`` (:func:`write_results`, each atomic) and the console table
(:func:`format_table`, rich)."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict
from pathlib import Path

from sat_cli import metric_names as M
from sat_cli.evaluation.run import EvalResult
from sat_cli.util.fsio import atomic_write_text


def metrics(result: EvalResult, final: bool = False) -> dict[str, float]:
    """``{eval/<name>/avg@<n>: …, eval/<name>/pass@<k>: …}`` in percent, for the tracker
    (``final/<name>/…`` for the final evaluation of a training run)."""
    name = result.name
    out = {M.avg_key(name, result.n, final): result.avg_at_k}
    out.update({M.pass_key(name, k, final): v for k, v in result.pass_at_k.items()})
    if result.meta.get("overlong"):
        out[M.overlong_key(name, final)] = float(result.meta["overlong"])
    out[M.reward_error_key(name, final)] = result.reward_error_frac
    return out


def check_reward_errors(result: EvalResult, max_frac: float) -> None:
    """:class:`~sat_cli.rewards.RewardFailed` when more of the evaluation's rewards failed than
    ``reward.max_error_frac`` allows: its avg@k would count them as wrong answers, silently."""
    frac = getattr(result, "reward_error_frac", None)  # an environment's result has no rewards
    if frac is not None and frac > max_frac:  # of a reward module to count (EnvEvalResult)
        from sat_cli.rewards import RewardFailed

        raise RewardFailed(
            f"evaluation {result.name}: {result.meta['reward_errors']} of "
            f"{result.meta['graded']} rewards failed ({frac:.1%} > reward.max_error_frac="
            f"{max_frac:g}), so its avg@{result.n} {result.avg_at_k:.1f} counts them as wrong; "
            f"the first: {result.meta.get('reward_error')}"
        )


def write_results(result: EvalResult, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``per_problem.json``, ``per_problem.csv`` and ``summary.json`` (each atomically)."""
    out = Path(out_dir)
    rows = [asdict(r) for r in result.rows]
    paths = {
        "per_problem_json": out / "per_problem.json",
        "per_problem_csv": out / "per_problem.csv",
        "summary": out / "summary.json",
    }
    atomic_write_text(
        paths["per_problem_json"], json.dumps(rows, indent=1, ensure_ascii=False) + "\n"
    )

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["id", "gold", "n", "correct", "accuracy", "answers", "mean_response_tokens"])
    for r in result.rows:
        writer.writerow(
            [
                r.id,
                r.gold,
                r.n,
                r.correct,
                f"{r.correct / r.n:.6f}",
                json.dumps(r.answers, ensure_ascii=False),
                f"{sum(r.response_tokens) / r.n:.2f}",
            ]
        )
    atomic_write_text(paths["per_problem_csv"], buf.getvalue())

    summary = result.summary()
    summary = {k: (None if isinstance(v, float) and v != v else v) for k, v in summary.items()}
    atomic_write_text(paths["summary"], json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return paths


def format_table(result: EvalResult) -> str:
    """The console summary (a rich table rendered to text)."""
    from rich.console import Console
    from rich.table import Table

    status = "complete" if result.complete else f"INCOMPLETE ({result.error})"
    table = Table(title=f"eval {result.name}: {status}")
    table.add_column("problems", justify="right")
    table.add_column("n", justify="right")
    table.add_column(f"avg@{result.n}", justify="right")
    ks = sorted(result.pass_at_k)
    shown = [k for k in ks if k == 1 or k == ks[-1] or (k & (k - 1)) == 0]  # 1, 2, 4, …, n
    for k in shown:
        table.add_column(f"pass@{k}", justify="right")
    table.add_column("wall s", justify="right")
    table.add_column("problems/s", justify="right")
    table.add_row(
        f"{result.num_finished}/{result.num_problems}",
        str(result.n),
        f"{result.avg_at_k:.2f}",
        *(f"{result.pass_at_k[k]:.2f}" for k in shown),
        f"{result.wall_s:.1f}",
        f"{result.problems_per_s:.3f}",
    )
    console = Console(file=io.StringIO(), width=120, color_system=None, force_terminal=False)
    console.print(table)
    return console.file.getvalue()
