"""Offline evaluation: ``avg@k`` / ``pass@k`` of a rollout engine on a benchmark (ALGORITHMS.md §8).

* ``avg@k``: each problem gets ``k`` samples scored 0/1; mean over samples, then over problems,
  as a percent.
* ``pass@k``: the unbiased estimator ``1 − C(n−c, k)/C(n, k)`` per problem (``n`` samples, ``c``
  correct), averaged over problems, as a percent; computed in product form,
  ``1 − Π_{i=n−c+1..n} (1 − k/i)``, which never forms a large binomial.

:func:`evaluate` renders each problem with a prompt template (``sat_cli.tasks.prompts``),
tokenizes it with ``tokenizer.encode``, asks the engine for ``n`` samples per prompt in batches
of ``batch_size`` prompts, decodes each response with
``tokenizer.decode(response_ids, skip_special_tokens=True)`` and grades it with ``grader``
(default :func:`sat_cli.tasks.reward.grade`). A problem counts only when all ``n`` samples came
back and none was aborted by the engine; if the engine fails (``EngineError``) or the run is
interrupted (``KeyboardInterrupt``, also SIGTERM/SIGHUP under ``orderly_stop``) the finished
problems are kept and the result says ``complete=False`` — a partial evaluation is never
reported complete. The interrupt itself is kept in ``EvalResult.interrupted`` for the caller to
raise again once the partial result is written.

:func:`write_results` writes ``per_problem.json``, ``per_problem.csv`` and ``summary.json``
atomically (temp file + ``os.replace``); :func:`metrics` gives the MLflow names
``eval/<benchmark>/avg@<n>`` and ``eval/<benchmark>/pass@<k>`` (``final/…`` for the final
evaluation; ``metric_names.avg_key`` / ``pass_key``); :func:`format_table` renders the console
summary with rich.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sat_cli import metric_names as M
from sat_cli.engines.base import RolloutEngine
from sat_cli.errors import EngineError
from sat_cli.samples import SamplingParams
from sat_cli.tasks.prompts import render
from sat_cli.tasks.reward import extract_answer, grade
from sat_cli.util.fsio import atomic_write_text

logger = logging.getLogger(__name__)

__all__ = [
    "EvalResult",
    "ProblemResult",
    "avg_at_k",
    "evaluate",
    "format_table",
    "metrics",
    "pass_at_k",
    "pass_at_k_table",
    "write_results",
]


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Percent: mean over problems of the mean over that problem's samples."""
    if not correct:
        raise ValueError("avg_at_k: no problems")
    total = 0.0
    for i, flags in enumerate(correct):
        if not flags:
            raise ValueError(f"avg_at_k: problem {i} has no samples")
        total += sum(bool(f) for f in flags) / len(flags)
    return 100.0 * total / len(correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (a probability in [0, 1]): ``1 − C(n−c,k)/C(n,k)``.

    ``C(n−c,k)/C(n,k) = Π_{i=n−c+1..n} (1 − k/i)``, so no factorial is ever formed.
    """
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_table(correct: Sequence[Sequence[bool]]) -> dict[int, float]:
    """``{k: percent}`` for ``k = 1 .. min_n``, each the mean over problems of ``pass_at_k``."""
    if not correct:
        raise ValueError("pass_at_k_table: no problems")
    min_n = min(len(flags) for flags in correct)
    if min_n == 0:
        raise ValueError("pass_at_k_table: a problem has no samples")
    counts = [(len(flags), sum(bool(f) for f in flags)) for flags in correct]
    return {
        k: 100.0 * sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        for k in range(1, min_n + 1)
    }


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class ProblemResult:
    id: str
    gold: str
    n: int
    correct: int  # number of correct samples
    flags: list[bool]  # per-sample correctness, in sample order
    answers: list[str | None]  # extracted final answer of each sample (None: no answer)
    response_tokens: list[int]  # response length of each sample, in tokens
    finish_reasons: list[str]


@dataclass
class EvalResult:
    name: str
    n: int
    avg_at_k: float  # percent, avg@n over the finished problems (nan when none finished)
    pass_at_k: dict[int, float]  # {k: percent}
    rows: list[ProblemResult]
    complete: bool  # every requested problem finished with n non-aborted samples
    num_problems: int  # problems requested
    wall_s: float
    problems_per_s: float
    error: str | None = None  # why the evaluation stopped early, when it did
    meta: dict[str, Any] = field(default_factory=dict)
    # the Ctrl-C / SIGTERM / SIGHUP that stopped it, for the caller to raise again
    interrupted: KeyboardInterrupt | None = field(default=None, repr=False, compare=False)

    @property
    def num_finished(self) -> int:
        return len(self.rows)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": self.n,
            f"avg@{self.n}": self.avg_at_k,
            "pass@k": {str(k): v for k, v in self.pass_at_k.items()},
            "complete": self.complete,
            "num_problems": self.num_problems,
            "num_finished": self.num_finished,
            "num_correct_samples": sum(r.correct for r in self.rows),
            "wall_s": self.wall_s,
            "problems_per_s": self.problems_per_s,
            "error": self.error,
            "meta": self.meta,
        }


def _summarize(
    name: str,
    n: int,
    rows: list[ProblemResult],
    num_problems: int,
    wall_s: float,
    error: str | None,
    meta: dict[str, Any],
) -> EvalResult:
    flags = [r.flags for r in rows]
    return EvalResult(
        name=name,
        n=n,
        avg_at_k=avg_at_k(flags) if flags else float("nan"),
        pass_at_k=pass_at_k_table(flags) if flags else {},
        rows=rows,
        complete=error is None and len(rows) == num_problems,
        num_problems=num_problems,
        wall_s=wall_s,
        problems_per_s=len(rows) / wall_s if wall_s > 0 else float("nan"),
        error=error,
        meta=meta,
    )


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _overlong_row(prob: dict[str, str], n: int) -> ProblemResult:
    """A problem whose prompt does not fit the context: ``n`` wrong samples, none generated."""
    return ProblemResult(
        id=str(prob["id"]),
        gold=str(prob["answer"]),
        n=n,
        correct=0,
        flags=[False] * n,
        answers=[""] * n,
        response_tokens=[0] * n,
        finish_reasons=["overlong"] * n,
    )


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    problems: Sequence[dict[str, str]],
    *,
    n: int,
    sampling: SamplingParams,
    template: str,
    grader: Callable[[str, str], bool] = grade,
    batch_size: int = 64,
    name: str = "eval",
    on_batch: Callable[[int, int], None] | None = None,
    overlong: frozenset[int] = frozenset(),
) -> EvalResult:
    """Sample ``n`` responses per problem from ``engine`` and score them.

    ``problems`` are rows ``{id, problem, answer}`` (see ``sat_cli.tasks.data``); ``tokenizer``
    needs ``encode(text) -> list[int]`` and ``decode(ids, skip_special_tokens=True) -> str``.
    ``on_batch(done, total)`` is called after each batch (progress display). ``overlong``:
    indices of problems whose prompt does not fit the model's context; they are not sent to the
    engine and are scored as ``n`` wrong samples (finish reason ``overlong``).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    started = time.perf_counter()
    rows: list[ProblemResult] = []
    error: str | None = None
    meta = {
        "template": template,
        "sampling": asdict(sampling),
        "batch_size": batch_size,
        "overlong": len(overlong),
    }
    try:
        for start in range(0, len(problems), batch_size):
            idx = range(start, min(start + batch_size, len(problems)))
            sent = [i for i in idx if i not in overlong]
            prompts = [
                list(tokenizer.encode(render(template, problems[i]["problem"]))) for i in sent
            ]
            groups = engine.generate(prompts, n, sampling) if prompts else []
            if len(groups) != len(sent):
                raise EngineError(f"engine returned {len(groups)} groups for {len(sent)} prompts")
            by_index = dict(zip(sent, groups, strict=True))
            for i in idx:
                prob = problems[i]
                if i in overlong:
                    rows.append(_overlong_row(prob, n))
                    continue
                samples = by_index[i]
                reasons = [s.finish_reason for s in samples]
                if len(samples) != n or "abort" in reasons:
                    error = error or (
                        f"problem {prob['id']!r}: {len(samples)}/{n} samples, finish reasons "
                        f"{sorted(set(reasons))}"
                    )
                    continue
                texts = [
                    tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples
                ]
                flags = [bool(grader(t, prob["answer"])) for t in texts]
                rows.append(
                    ProblemResult(
                        id=str(prob["id"]),
                        gold=str(prob["answer"]),
                        n=n,
                        correct=sum(flags),
                        flags=flags,
                        answers=[extract_answer(t) for t in texts],
                        response_tokens=[s.response_len for s in samples],
                        finish_reasons=reasons,
                    )
                )
            if on_batch is not None:
                on_batch(min(start + batch_size, len(problems)), len(problems))
    except (EngineError, KeyboardInterrupt) as err:
        error = f"{type(err).__name__}: {err}"
        interrupted = err if isinstance(err, KeyboardInterrupt) else None
        logger.warning("evaluation %s stopped early after %d problems: %s", name, len(rows), error)
    else:
        interrupted = None
    wall_s = time.perf_counter() - started
    res = _summarize(name, n, rows, len(problems), wall_s, error, meta)
    res.interrupted = interrupted
    return res


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def metrics(result: EvalResult, final: bool = False) -> dict[str, float]:
    """``{eval/<name>/avg@<n>: …, eval/<name>/pass@<k>: …}`` in percent, for the tracker
    (``final/<name>/…`` for the final evaluation of a training run)."""
    name = result.name
    out = {M.avg_key(name, result.n, final): result.avg_at_k}
    out.update({M.pass_key(name, k, final): v for k, v in result.pass_at_k.items()})
    if result.meta.get("overlong"):
        out[M.overlong_key(name, final)] = float(result.meta["overlong"])
    return out


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
