"""Rewards as plugins: one registry entry per ``reward.name``, each with ``check(settings)``
(compose-time and start-up checks that need no model) and ``build(settings, runtime)`` (the
:class:`Scorer` of a run; ``runtime`` holds the task, whose own grader ``reward=math`` is).

=========  ====================================================================================
math       the task's grader (the toy task's exact sum; math-verify for data tasks), in-process
exact      the final answer (last ``\\boxed{}``, else the ``Answer:`` line, else the response)
           equals the row's answer after stripping
regex      group 1 of the last match of ``reward.pattern`` (else the match) equals the answer
python     ``reward.fn`` (``pkg.module:function`` or ``path/to/file.py:function``) in a pool of
           ``reward.workers`` processes, ``reward.timeout_s`` per call (:mod:`.pool`)
http       a reward server at ``reward.url``, retried until ``reward.deadline_s`` (:mod:`.http`)
=========  ====================================================================================

A user's reward is ``fn(prompt, response, row) -> float | dict[str, float]`` (the row holds the
data file's columns: ``id``, ``problem``, ``answer`` and every extra one); ``reward.batched=true``
calls ``fn(prompts, responses, rows) -> list``. A dict's components are combined by
``reward.weights`` (:func:`combine`) and each is logged as ``reward/<name>``. A call that raises,
times out, or returns something that is not a finite number gives that sample
``reward.on_error`` and counts as an error (``reward/error_frac``); the loop ends the run FAILED
when a step's error fraction is above ``reward.max_error_frac`` (:class:`RewardFailed`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sat_cli.errors import RunFailed


class RewardFailed(RunFailed):
    """More rewards of a step failed than ``reward.max_error_frac`` allows."""


class BadReward(ValueError):
    """A reward returned something that is not a usable reward."""


class ReportedError(Exception):
    """A failure a reward worker or server already described (``Type: message``), shown as is."""


@dataclass
class Scores:
    """The rewards of a batch: one value per sample, its components, its error (or None)."""

    values: list[float]
    components: list[dict[str, float]]
    errors: list[str | None]

    @property
    def error_frac(self) -> float:
        return sum(e is not None for e in self.errors) / max(len(self.errors), 1)

    def first_error(self) -> str | None:
        return next((e for e in self.errors if e is not None), None)


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the trainer's reward dtype
MAX_COMPONENT_CHARS = 64


def reserved_components() -> frozenset[str]:
    """Component names whose ``reward/<name>`` is a built-in metric (``metric_names``), such as
    ``error_frac``, which the failure guard reads: a reward may not overwrite them."""
    from sat_cli import metric_names as M

    prefix = M.REWARD + "/"
    names = (v for v in vars(M).values() if isinstance(v, str) and v.startswith(prefix))
    return frozenset(v[len(prefix) :] for v in names)


def _number(what: str, value: Any) -> float:
    """``value`` as a float that float32 holds; :class:`BadReward` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReward(f"{what} {type(value).__name__}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int past float64
        raise BadReward(f"{what} an integer too large for float32 (the trainer's dtype)") from None
    if not math.isfinite(number):
        raise BadReward(f"{what} {number}")
    if abs(number) > FLOAT32_MAX:
        raise BadReward(f"{what} {number:g}, beyond float32 (the trainer's dtype)")
    return number


def _component_name(key: Any) -> str:
    name = str(key)
    if name in reserved_components():
        raise BadReward(f"component {name!r} is a built-in metric's name (reward/{name})")
    if not 1 <= len(name) <= MAX_COMPONENT_CHARS or not name.isprintable():
        raise BadReward(
            f"component name {name[:MAX_COMPONENT_CHARS]!r} is not 1-{MAX_COMPONENT_CHARS} "
            "printable characters"
        )
    return name


def combine(result: Any, weights: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` of what a reward returned; :class:`BadReward` saying why it is not
    usable (not a number or a dict of numbers, NaN/inf, beyond float32, a component named like a
    built-in metric, a weighted component missing)."""
    if isinstance(result, bool) or not isinstance(result, (int, float, dict)):
        raise BadReward(f"returned {type(result).__name__}, not a number or a dict of numbers")
    if not isinstance(result, dict):
        return _number("returned", result), {}
    parts: dict[str, float] = {}
    for key, value in result.items():
        parts[_component_name(key)] = _number(f"component {str(key)[:64]!r} is", value)
    if not weights:
        return _number("returned components summing to", sum(parts.values())), parts
    missing = sorted(set(weights) - set(parts))
    if missing:
        raise BadReward(f"components {missing} (reward.weights) are missing; got {sorted(parts)}")
    total = sum(w * parts[k] for k, w in weights.items())
    return _number("returned components weighing", total), parts


class Scorer:
    """Scores a batch: ``score(prompts, responses, rows) -> Scores``. The built-in rewards run
    ``one(prompt, response, row) -> float`` in-process; plugins override :meth:`score`."""

    def __init__(self, one: Callable[[str, str, dict], Any] | None = None, settings=None):
        self.one, self.settings = one, settings
        self.first_error: str | None = None  # of the last batch (set by the loop)

    def score(self, prompts: list[str], responses: list[str], rows: list[dict]) -> Scores:
        out = Scores([], [], [])
        for p, r, row in zip(prompts, responses, rows, strict=True):
            self.add(out, lambda p=p, r=r, row=row: self.one(p, r, row))
        return out

    def add(self, out: Scores, call: Callable[[], Any]) -> None:
        """Append one sample's result (``call()``'s) or its error to ``out``."""
        weights = dict(getattr(self.settings, "weights", None) or {})
        on_error = float(getattr(self.settings, "on_error", 0.0))
        try:
            value, parts = combine(call(), weights)
        except Exception as exc:  # noqa: BLE001 - a user's reward: any failure is counted
            out.values.append(on_error)
            out.components.append({})
            out.errors.append(error_text(exc, plugin_label(self.settings)))
            return
        out.values.append(value)
        out.components.append(parts)
        out.errors.append(None)

    def close(self) -> None:
        """Stop what the scorer started (worker processes)."""


def plugin_label(settings) -> str:
    """The reward a message names: its entry's ``label`` (``reward.fn=<spec>`` for python,
    ``reward.url=<url>`` for http, secrets masked), ``reward=<name>`` otherwise."""
    from sat_cli.rewards.registry import REWARDS

    name = getattr(settings, "name", None)
    entry = REWARDS.find(name) if isinstance(name, str) else None
    if entry is not None and (label := entry.label(settings)):
        return label
    return f"reward={name}" if name else ""


def error_text(exc: BaseException, label: str = "") -> str:
    """One line for a failed reward: ``Type: message`` (at most 300 characters); a result the
    trainer cannot take names the reward (``label``, :func:`plugin_label`)."""
    from sat_cli.tracking.remote_text import escape_controls

    lines = str(exc).strip().splitlines()
    text = escape_controls(lines[0]) if lines else ""  # a plug-in's or a server's own text
    if isinstance(exc, BadReward):
        return (f"{label} {text}" if label else f"the reward {text}")[:300]
    if isinstance(exc, ReportedError):
        return text[:300]
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:300]


def require(settings, key: str) -> None:
    """``reward.<key>`` is set, else the one-line ``ConfigError`` of a reward that needs it."""
    from sat_cli.validate import ConfigError

    if not getattr(settings, key):
        raise ConfigError(f"reward={settings.name} needs reward.{key}")


def no_label(settings) -> str:
    return ""


def no_processes(settings) -> int:
    return 0


@dataclass(frozen=True)
class RewardEntry:
    """One reward of the registry (``sat_cli.rewards.registry.REWARDS``): ``build`` its scorer;
    ``check`` its start-up checks (``UserError``); ``validate`` its rules on the ``reward``
    section at compose time (``ConfigError``); ``label`` what a message names it by (empty:
    ``reward=<name>``); ``processes`` the worker processes it starts (a cluster job's CPUs and
    memory); ``grades_itself``: the task's own grader decides what an evaluation counts
    correct (``math``), not ``reward.pass_threshold``."""

    build: Callable[[Any, dict], Scorer]  # (settings, runtime {"task": …}) -> Scorer
    check: Callable[[Any], None] = field(default=lambda settings: None)
    validate: Callable[[Any], None] = field(default=lambda settings: None)
    label: Callable[[Any], str] = no_label
    processes: Callable[[Any], int] = no_processes
    grades_itself: bool = False


def check_reward(settings) -> None:
    """Start-up checks of ``settings`` (a ``RewardConfig``); ``UserError`` when one fails."""
    from sat_cli.rewards.registry import REWARDS

    REWARDS.get(settings.name).check(settings)


def build_reward(settings, task) -> Scorer:
    """The :class:`Scorer` of ``settings`` (a ``RewardConfig``) for ``task``."""
    from sat_cli.rewards.registry import REWARDS

    return REWARDS.get(settings.name).build(settings, {"task": task})
