"""Evaluation with a reward plugin, and the samples tables that show what the model writes.

* :class:`PassGrader` — an evaluation's grader for ``reward`` other than ``math``: a sample
  counts as correct (avg@k, pass@k) when its reward is at least ``reward.pass_threshold``; a
  failed reward counts as wrong. Its scorer is the training run's (:func:`share_scorer`) or, in
  ``sat eval``, one of its own, started on first use.
* :func:`grade_group` — one problem's ``n`` responses through either kind of grader.
* :func:`samples_table` — ``{"columns": [...], "data": [[...]]}``, the JSON layout of
  ``mlflow.log_table``, of prompts, responses, rewards (with components), errors and weight
  versions; logged as ``samples/…`` artifacts (:func:`sat_cli.metric_names.samples_artifact`).
"""

from __future__ import annotations

from typing import Any

from sat_cli import metric_names as M

MAX_TABLE_ROWS = 64  # samples per table (the first ones of the batch / evaluation)
MAX_CELL_CHARS = 4000  # a prompt or response is cut to this many characters in a table


class PassGrader:
    def __init__(self, settings, task):
        self.settings, self.task, self._own = settings, task, None
        self.shared = None  # the training run's scorer (``share_scorer``)

    @property
    def scorer(self):
        if self.shared is not None:
            return self.shared
        if self._own is None:
            from sat_cli.rewards import build_reward

            self._own = build_reward(self.settings, self.task)
        return self._own

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None


def share_scorer(grader, scorer) -> None:
    """An evaluation of a training run grades with the run's own reward scorer (a
    :class:`PassGrader`; the ``math`` grader needs none)."""
    if isinstance(grader, PassGrader):
        grader.shared = scorer


def plugin_grader(settings, task, grader):
    """``grader`` for a reward that grades with the task's grader (``reward=math``); else a
    :class:`PassGrader` of the reward plugin."""
    from sat_cli.rewards.registry import REWARDS

    return grader if REWARDS.get(settings.name).grades_itself else PassGrader(settings, task)


def grade_group(grader, prompt: str, texts: list[str], row: dict):
    """``(flags, rewards, components, errors)`` of one problem's responses."""
    if isinstance(grader, PassGrader):
        scores = grader.scorer.score([prompt] * len(texts), texts, [row] * len(texts))
        threshold = grader.settings.pass_threshold
        flags = [
            e is None and v >= threshold for v, e in zip(scores.values, scores.errors, strict=True)
        ]
        return flags, scores.values, scores.components, scores.errors
    flags = [bool(grader(t, row["answer"])) for t in texts]
    return flags, [float(f) for f in flags], [{}] * len(texts), [None] * len(texts)


def logging_samples(run, tracker, final: bool):
    """``run`` (an evaluation: ``() -> EvalResult``) that also logs its samples table as
    ``samples/eval_step_<version>.json`` (``final_step_…`` for the final evaluation), the
    version being the newest one that generated its samples (the samples carry it: the engine
    protocol has no version attribute of its own)."""

    def evaluate():
        res = run()
        if res.samples:
            version = max(int(s.get("version") or 0) for s in res.samples)
            where = M.samples_artifact("final" if final else "eval", version)
            tracker.log_dict(samples_table(res.samples), where)
        return res

    return evaluate


def cut_cell(text: Any) -> Any:
    """``text`` cut at :data:`MAX_CELL_CHARS` (a table's cell), anything else as it is."""
    if isinstance(text, str) and len(text) > MAX_CELL_CHARS:
        return text[:MAX_CELL_CHARS] + f"… [{len(text) - MAX_CELL_CHARS} more characters]"
    return text


def samples_table(samples: list[dict]) -> dict:
    """The table of ``samples`` (dicts with ``id, prompt, response, reward`` and optionally
    ``correct, error, version, components``), at most :data:`MAX_TABLE_ROWS` rows; each
    component becomes a column ``reward/<name>``."""
    samples = samples[:MAX_TABLE_ROWS]
    parts = sorted({k for s in samples for k in (s.get("components") or {})})
    base = ["id", "version", "prompt", "response", "reward", "correct", "error"]
    columns = base + [M.reward_key(k) for k in parts]
    data = [
        [cut_cell(s.get(c)) for c in base] + [(s.get("components") or {}).get(k) for k in parts]
        for s in samples
    ]
    from sat_cli.tracking.params import mask_known_in

    # a secret value quoted in a prompt, a response or a plug-in's error (one secret policy)
    return {"columns": columns, "data": mask_known_in(data)}
