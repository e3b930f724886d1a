"""What an environment's ``step()`` returns, checked before a trajectory uses it.

An environment may be a plug-in (``register_env`` from the user's own module): its ``Step`` is
the result of code `sat` does not control, like a reward function's value
(``rewards.combine``). :func:`check_step` refuses, with one line naming the environment and
the field, a reward that is not a finite number (the trajectory's reward, summed over turns, is
what the trainer's advantages are made of), a ``done`` that is not a bool, an ``info`` that is
not a mapping with string keys, and observation messages that are not ``{"role", "content"}``
strings of a chat role or that hold more than :data:`MAX_OBSERVATION_CHARS` characters in all
(each is tokenised before the trajectory's token budget can stop it). The run then stops with
exit 1 (:class:`EnvironmentResultError`, a ``RunFailed``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

from sat_cli.errors import RunFailed

MAX_OBSERVATION_CHARS = 1 << 20  # characters of one step's observation messages, all together
ROLES = ("system", "user", "assistant", "tool")


class EnvironmentResultError(RunFailed):
    """An environment's ``step()`` returned what a trajectory cannot use (exit 1)."""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_step(step, env) -> object:
    """``step`` (an environment's ``Step``) if it can be used, else :class:`EnvironmentResultError`
    naming ``env`` (the environment object) and the field (module docstring)."""
    name = type(env).__name__

    def bad(what: str) -> EnvironmentResultError:
        return EnvironmentResultError(f"environment {name}: step() returned {what}")

    try:
        observation, reward, done, info = step
    except (TypeError, ValueError):
        raise bad(f"{_short(step)}, not a Step(observation, reward, done, info)") from None
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise bad(f"reward={_short(reward)}: not a finite number")
    if not isinstance(done, bool):
        raise bad(f"done={_short(done)}: not a bool")
    if not isinstance(info, Mapping) or not all(isinstance(k, str) for k in info):
        raise bad(f"info={_short(info)}: not a mapping with string keys")
    if not isinstance(observation, list):
        raise bad(f"observation={_short(observation)}: not a list of messages")
    total = 0
    for m in observation:
        if (
            not isinstance(m, Mapping)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise bad(f"the observation message {_short(m)}: not {{'role', 'content'}} strings")
        total += len(m["content"])
        if total > MAX_OBSERVATION_CHARS:
            raise bad(f"an observation over {MAX_OBSERVATION_CHARS} characters")
    return step
