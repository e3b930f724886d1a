"""The built-in rewards, scored in-process: ``math`` (the task's own grader), ``exact`` and
``regex`` (:mod:`sat_cli.rewards`)."""

from __future__ import annotations

import re

from sat_cli.rewards import Scorer, require
from sat_cli.validate import ConfigError


def build_math(settings, runtime: dict) -> Scorer:
    """The task's grader, exactly as before plugins: ``task.reward(response, answer)``."""
    task = runtime["task"]
    return Scorer(lambda prompt, response, row: task.reward(response, row["answer"]), settings)


def final_answer(response: str) -> str:
    """The last ``\\boxed{}``, else the ``Answer:`` line, else the whole response; stripped."""
    from sat_cli.tasks.answer import extract_answer

    found = extract_answer(response)
    return (found if found is not None else response).strip()


def build_exact(settings, runtime: dict) -> Scorer:
    def one(prompt: str, response: str, row: dict) -> float:
        return 1.0 if final_answer(response) == str(row["answer"]).strip() else 0.0

    return Scorer(one, settings)


def build_regex(settings, runtime: dict) -> Scorer:
    pattern = re.compile(settings.pattern)

    def one(prompt: str, response: str, row: dict) -> float:
        matches = list(pattern.finditer(response))
        if not matches:
            return 0.0
        last = matches[-1]
        got = last.group(1) if pattern.groups else last.group(0)
        return 1.0 if (got or "").strip() == str(row["answer"]).strip() else 0.0

    return Scorer(one, settings)


def validate_regex(settings) -> None:
    """``reward.pattern`` is a regex with at most one group (the answer)."""
    require(settings, "pattern")
    try:
        compiled = re.compile(settings.pattern)
    except re.error as exc:
        raise ConfigError(f"reward.pattern={settings.pattern!r} is not a regex: {exc}") from None
    if compiled.groups > 1:
        raise ConfigError(
            f"reward.pattern={settings.pattern!r} has {compiled.groups} groups; at most one "
            "(the answer)"
        )
