"""One evaluation run (:func:`evaluate`) and what it returns: a :class:`ProblemResult` per problem
and the :class:`EvalResult` (see the package docstring for the semantics)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sat_cli.engines.base import RolloutEngine
from sat_cli.errors import EngineError
from sat_cli.evaluation.estimators import avg_at_k, pass_at_k_table
from sat_cli.rewards.grading import MAX_TABLE_ROWS, grade_group
from sat_cli.samples import SamplingParams
from sat_cli.tasks.prompts import render
from sat_cli.tasks.reward import extract_answer, grade

logger = logging.getLogger("sat_cli.evaluation")


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
    # the first responses with their prompts and rewards (rewards.grading.samples_table)
    samples: list[dict] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_finished(self) -> int:
        return len(self.rows)

    @property
    def reward_error_frac(self) -> float:
        """The fraction of graded samples whose reward failed (counted as wrong in avg@k)."""
        return self.meta.get("reward_errors", 0) / max(self.meta.get("graded", 0), 1)

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


def _prompt(template: str, problem: dict, tokenizer) -> str:
    """The prompt of one problem (``template=chat``: its ``system`` field, if any, first)."""
    return render(template, problem["problem"], tokenizer, problem.get("system"))


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
    table: list[dict] = []  # the first samples, for the samples table
    error: str | None = None
    meta = {
        "template": template,
        "sampling": asdict(sampling),
        "batch_size": batch_size,
        "overlong": len(overlong),
        "reward_errors": 0,  # graded samples whose reward failed (a reward plugin's error)
        "graded": 0,  # samples graded
    }
    try:
        for start in range(0, len(problems), batch_size):
            idx = range(start, min(start + batch_size, len(problems)))
            sent = [i for i in idx if i not in overlong]
            prompts = [
                list(tokenizer.encode(_prompt(template, problems[i], tokenizer))) for i in sent
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
                prompt = _prompt(template, prob, tokenizer)
                flags, rewards, parts, errors = grade_group(grader, prompt, texts, prob)
                meta["graded"] += len(errors)
                meta["reward_errors"] += sum(e is not None for e in errors)
                if "reward_error" not in meta and any(e is not None for e in errors):
                    meta["reward_error"] = next(e for e in errors if e is not None)
                for j, t in enumerate(texts[: max(0, MAX_TABLE_ROWS - len(table))]):
                    table.append(
                        {
                            "id": str(prob["id"]),
                            "prompt": prompt,
                            "response": t,
                            "reward": rewards[j],
                            "correct": flags[j],
                            "error": errors[j],
                            "components": parts[j],
                            "version": samples[j].weight_version,
                        }
                    )
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
    res.interrupted, res.samples = interrupted, table
    return res
