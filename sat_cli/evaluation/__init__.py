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

from sat_cli.evaluation.estimators import avg_at_k, pass_at_k, pass_at_k_table
from sat_cli.evaluation.output import format_table, metrics, write_results
from sat_cli.evaluation.run import EvalResult, ProblemResult, evaluate

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
